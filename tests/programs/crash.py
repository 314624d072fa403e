"""Run an algorithm script, optionally with a fault injected, for the resume tests:

    CRASH=start:4      python tests/programs/crash.py gspo.py ARGS...   SIGKILL at the start of step 4
    CRASH=checkpoint:4 python tests/programs/crash.py gspo.py ARGS...   SIGKILL while step_4 is being written (the
                                                                        model is written, this rank's optimizer file
                                                                        half written)
    CRASH=sigterm:3    python tests/programs/crash.py gspo.py ARGS...   SIGTERM at the start of step 3 (a graceful stop)
    CRASH=nospace:2    python tests/programs/crash.py gspo.py ARGS...   ENOSPC when the rank writes its rank<r>.pt of
                                                                        step_2
CRASH_RANK (default 0) picks the rank that dies; under torchrun only the first attempt crashes (restarts run clean)."""
import os
import runpy
import signal
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import common  # noqa: E402


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


where, _, at = os.environ.get("CRASH", "").partition(":")
armed = (where and int(os.environ.get("RANK", 0)) == int(os.environ.get("CRASH_RANK", 0))
         and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
if armed and where in ("start", "sigterm"):
    real_indices = common.prompt_indices

    def prompt_indices(n_rows, step, *a, **k):
        if step == int(at) and where == "start":
            die()
        if step == int(at):  # a SIGTERM the run survives (preemption): it should stop after this step
            os.kill(os.getpid(), signal.SIGTERM)
        return real_indices(n_rows, step, *a, **k)

    common.prompt_indices = prompt_indices  # the script imports it from common after this
elif armed and where == "checkpoint":
    real_save = torch.save

    def save(obj, f, *a, **k):
        if f"step_{at}" in str(f):
            with open(f, "wb") as fh:
                fh.write(b"half an optimizer state")
            die()
        return real_save(obj, f, *a, **k)

    torch.save = save
elif armed and where == "nospace":
    import errno

    real_save = torch.save

    def save(obj, f, *a, **k):  # a full disk while this rank writes its part of step_{at}
        if f"step_{at}" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *a, **k)

    torch.save = save
elif where:
    assert where in ("start", "checkpoint", "sigterm", "nospace"), where
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")
