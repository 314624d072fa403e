"""A second process that holds a run folder's lock, for the one-writer tests:

    python tests/programs/lock_holder.py claim ROOT RUN CHECKPOINT   checkpoint._claim_run_dir(RUN, CHECKPOINT), as a
                                                                      live run's rank 0 does (tests/test_checkpoint.py)
    python tests/programs/lock_holder.py flock LOCK_FILE              an exclusive flock on LOCK_FILE, which then names
                                                                      this pid and host, as a writer's writer.lock does
                                                                      (tests/test_resume.py)

Each prints "locked" once it holds the lock, then sleeps 120 s (the test kills it sooner)."""
import fcntl
import os
import socket
import sys
import time

if sys.argv[1] == "claim":
    sys.path.insert(0, sys.argv[2])
    from grouprl import checkpoint

    checkpoint._claim_run_dir(sys.argv[3], sys.argv[4])
else:
    f = open(sys.argv[2], "a+")
    fcntl.flock(f, fcntl.LOCK_EX)
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
print("locked", flush=True)
time.sleep(120)
