"""Run gspo.py with one of its start-up functions replaced by a stall, for the start-up signal tests:

    python tests/programs/stall.py load_model OUTPUT_DIR   prints "waiting" when gspo.py calls load_model, then
                                                           sleeps 60 s
    python tests/programs/stall.py grouprl.evaluation.generate OUTPUT_DIR --eval-every 1   the same in evaluate's
                                                           generate (the step-0 evaluation's); flags after OUTPUT_DIR
                                                           go to gspo.py"""
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import gspo  # noqa: E402


def stall(*args, **kwargs):
    print("waiting", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    patched, out, more = sys.argv[1], sys.argv[2], sys.argv[3:]
    module, _, name = patched.rpartition(".")
    setattr(importlib.import_module(module) if module else gspo, name, stall)
    sys.argv = ["gspo.py", "--output-dir", out, "--num-steps", "1", *more]
    gspo.main()
