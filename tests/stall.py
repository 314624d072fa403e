"""Run gspo.py with one of its start-up functions replaced by a stall, for the start-up signal tests:

    python tests/stall.py load_model OUTPUT_DIR   prints "waiting" when gspo.py calls load_model, then sleeps 60 s"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gspo  # noqa: E402


def stall(*args, **kwargs):
    print("waiting", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    patched, out = sys.argv[1], sys.argv[2]
    setattr(gspo, patched, stall)
    sys.argv = ["gspo.py", "--output-dir", out, "--num-steps", "1"]
    gspo.main()
