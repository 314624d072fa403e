"""The decode step's sampler on CPU: sampling.sample (radix-select top-p, one exponential race)
against engine.sample (softmax + full sort for top-p + torch.multinomial), side by side in one
process, at the rollout's shape [256, 151936] in float32 and bf16 logits.

    python benchmarks/sampling.py                         # 256 x 151936, 3 repetitions
    python benchmarks/sampling.py --rows 64 --repeat 5    # quicker

For each sampling setting (temperature, top_k, top_p) and logits dtype it prints min and median
seconds a call over --repeat calls (after one untimed call) and the aten ops each call launches
(a TorchDispatchMode count: on a GPU, eagerly, each is about one kernel), and how many of them
read or write a [rows, vocab] tensor (the passes over the logits). CPU times are a proxy only:
the GPU's numbers come from benchmarks/gpu.py when a device is lent.
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine  # noqa: E402
import sampling  # noqa: E402


class CountOps(TorchDispatchMode):
    """Counts aten ops, and those touching a tensor of at least `big` elements."""

    def __init__(self, big: int):
        super().__init__()
        self.ops, self.passes, self.big = 0, 0, big

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        tensors = [a for a in list(args) + list((kwargs or {}).values())
                   if isinstance(a, torch.Tensor)]
        tensors += [o for o in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(o, torch.Tensor)]
        self.passes += any(t.numel() >= self.big for t in tensors)
        return out


def timed(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 50, 0.95), (1.0, 20, 1.0)]
    print(f"[{args.rows}, {args.vocab}] logits, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.repeat} repetitions after one untimed call")
    print(f"{'dtype':9} {'T':>4} {'top_k':>5} {'top_p':>5} | {'sampler':15} {'min s':>7} "
          f"{'median s':>8} {'aten ops':>8} {'[R,V] ops':>9}")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(args.rows, args.vocab, generator=g) * 2).to(dtype)
        for t, k, p in settings:
            calls = {"sampling.sample": lambda: sampling.sample(logits, t, k, p, generator=g),
                     # the engine as it runs today: it is given float32 logits
                     "engine.sample": lambda: engine.sample(logits.float(), t, k, p, g)}
            for name, fn in calls.items():
                best, median = timed(fn, args.repeat)
                with CountOps(args.rows * args.vocab) as count:
                    fn()
                print(f"{str(dtype)[6:]:9} {t:4} {k:5} {p:5} | {name:15} {best:7.3f} "
                      f"{median:8.3f} {count.ops:8} {count.passes:9}", flush=True)


if __name__ == "__main__":
    main()
