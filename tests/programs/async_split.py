"""`python tests/programs/async_split.py SCRIPT ARGS...`: SCRIPT's run (plain, or a rank under torchrun) with a
reward every group splits (the parity of the characters' codes, as tests/test_staleness.py's split_reward), so that
the weights move from the first step; tests/test_async.py runs it under torchrun and alone. KILL_AT=N: the rollout rank
(the last) kills itself (SIGKILL, or KILL_WITH=SIGTERM) as it starts to sample step N."""
import os
import runpy
import signal
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import common  # noqa: E402

common.score = lambda texts, *a, **kw: (torch.tensor([float(sum(map(ord, t)) % 2) for t in texts]), 0)
if os.environ.get("KILL_AT") and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    real = common.rollout_groups

    def rollout_groups(policy, tok, train, step, *a):
        if step == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_WITH", "SIGKILL")))
        return real(policy, tok, train, step, *a)

    common.rollout_groups = rollout_groups
script = os.path.join(ROOT, sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
