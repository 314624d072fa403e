"""A trainer-like parent for the reward-worker tests (tests/test_reliability.py, issue 27's holes 1-2):

    python tests/programs/reward_parent.py MODE PATH_JSON

PATH_JSON: folders put first on sys.path (the reward module's and the repository). The parent's reward workers,
started from the main thread (or from another one: MODE thread), answer two requests, and it prints their pids.
MODE SIGINT / SIGTERM: the signal is sent to the parent's process group while requests are in flight; the parent
catches it (the trainer's graceful stop) and prints the answers, what it caught and its workers' pids. Any other
MODE: the workers are left inside a looping reward, for the test to kill the parent."""
import json
import os
import signal
import sys
import threading

sys.path[:0] = json.loads(sys.argv[2])
from grouprl import grader  # noqa: E402

mode = sys.argv[1]
reward = grader.load_reward("hole27:f", 30.0)


def start():
    reward.run([("warm", "1"), ("warm", "1")])


if mode == "thread":
    th = threading.Thread(target=start)
    th.start()
    th.join()
else:
    start()
print(json.dumps([w.proc.pid for w in reward.workers]), flush=True)
if mode in ("SIGINT", "SIGTERM"):
    sig, got = getattr(signal, mode), []
    signal.signal(sig, lambda s, frame: got.append(s))  # the trainer's graceful stop
    threading.Timer(0.3, lambda: os.killpg(os.getpgid(0), sig)).start()
    out = reward.run([("slow", "1"), ("slow", "1")]) + reward.run([("warm", "1")])
    print(json.dumps({"out": out, "got": got, "pids": [w.proc.pid for w in reward.workers]}), flush=True)
else:
    reward.run([("loop", "1"), ("loop", "1")])
