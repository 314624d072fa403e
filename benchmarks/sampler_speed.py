"""The decode step's sampler on CPU: sampling.sample (radix-select top-p, one exponential race)
(the engine's since 2026-11-28) against hf_sample below (softmax + full sort for top-p +
torch.multinomial: transformers' way, and the engine's sampler before), side by side in one
process, at the rollout's shape [256, 151936] in float32 and bf16 logits.

    python benchmarks/sampler_speed.py                         # 256 x 151936, 3 repetitions
    python benchmarks/sampler_speed.py --rows 64 --repeat 5    # quicker
    python benchmarks/sampler_speed.py --inductor              # + kernels under torch.compile

--inductor also compiles sampling.sample with torch.compile(fullgraph=True, dynamic=False) per
setting (the noise passed in as a tensor: Dynamo does not trace a torch.Generator argument) at
[8, 4096] (the count does not depend on the shape) and prints the generated code's kernels:
fused loops (each one read of its inputs) and the extern calls inductor left to aten (topk).
Compiling takes about a minute a setting on CPU.

For each sampling setting (temperature, top_k, top_p, min_p, repetition_penalty; the penalty on
the ids of 64 random tokens a row) and logits dtype it prints min and median
seconds a call over --repeat calls (after one untimed call) and the aten ops each call launches
(a TorchDispatchMode count, on 8 rows: on a GPU, eagerly, each is about one kernel), and how
many of them read or write a [rows, vocab] tensor (eager passes over the logits). CPU times are a proxy only:
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

from grouprl import sampling  # noqa: E402


def hf_sample(logits, temperature, top_k, top_p, min_p=0.0, penalty=1.0, ids=None, generator=None):
    """transformers' order on float32 scores: repetition penalty (gather, where, scatter over the
    ids), temperature, top-k (topk), top-p (a full sort, cumsum, scatter), min-p (softmax, max,
    compare), then torch.multinomial; the token's log-prob under the tempered softmax."""
    if penalty != 1.0:
        score = logits.gather(1, ids)
        logits = logits.scatter(1, ids, torch.where(score < 0, score * penalty, score / penalty))
    scores = logits / temperature
    logp = torch.log_softmax(scores, -1)
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[..., -1:] = False  # the most likely token stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -float("inf"))
    if min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -float("inf"))
    tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)
    return tokens[:, 0], logp.gather(1, tokens)[:, 0]


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
    parser.add_argument("--inductor", action="store_true", help="also count compiled kernels")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [(1.0, 0, 1.0, 0.0, 1.0), (0.7, 0, 0.9, 0.0, 1.0), (1.0, 50, 0.95, 0.0, 1.0),
                (1.0, 20, 1.0, 0.0, 1.0), (1.0, 0, 1.0, 0.05, 1.0), (1.0, 0, 1.0, 0.0, 1.3),
                (0.7, 0, 0.9, 0.05, 1.3)]
    print(f"[{args.rows}, {args.vocab}] logits, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.repeat} repetitions after one untimed call")
    print(f"{'dtype':9} {'T':>4} {'top_k':>5} {'top_p':>5} {'min_p':>5} {'pen':>4} | "
          f"{'sampler':15} {'min s':>7} {'median s':>8} {'aten ops':>8} {'[R,V] ops':>9}")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(args.rows, args.vocab, generator=g) * 2).to(dtype)
        ids = torch.randint(0, args.vocab, (args.rows, 64), generator=g)
        seen = torch.zeros(args.rows, args.vocab, dtype=torch.bool).scatter_(1, ids, True)
        for t, k, p, m, r in settings:
            calls = {"sampling.sample": lambda: sampling.sample(logits, t, k, p, m, r, seen=seen,
                                                                generator=g),
                     # transformers' way, on float32 logits (as generate gives them)
                     "hf_sample": lambda: hf_sample(logits.float(), t, k, p, m, r, ids, g)}
            for name, fn in calls.items():
                best, median = timed(fn, args.repeat)
                small = logits[:8]  # the counts do not depend on the rows: counted on 8
                with CountOps(small.numel()) as count:
                    if name == "sampling.sample":
                        sampling.sample(small, t, k, p, m, r, seen=seen[:8], generator=g)
                    else:
                        hf_sample(small.float(), t, k, p, m, r, ids[:8], g)
                print(f"{str(dtype)[6:]:9} {t:4} {k:5} {p:5} {m:5} {r:4} | {name:15} {best:7.3f} "
                      f"{median:8.3f} {count.ops:8} {count.passes:9}", flush=True)
    if args.inductor:
        inductor_kernels(settings)


def inductor_kernels(settings):
    """Kernels of the compiled sampler, read from the code inductor generates."""
    import re

    from torch._inductor.utils import run_and_get_code

    x = torch.randn(8, 4096).to(torch.bfloat16)
    noise = torch.empty(8, 4096).exponential_()
    seen = torch.rand(8, 4096) < 0.02
    print("torch.compile(fullgraph=True, dynamic=False), bf16 logits, noise passed in:")
    for t, k, p, m, r in settings:
        torch._dynamo.reset()
        fn = torch.compile(lambda x, e, seen: sampling.sample(x, t, k, p, m, r, seen=seen, noise=e),
                           fullgraph=True, dynamic=False)
        _, code = run_and_get_code(fn, x, noise, seen)
        src = "\n".join(code)
        fused = sorted(set(re.findall(r"\b(cpp_fused_\w+|triton_\w+_fused_\w+)\s*=", src)))
        extern = re.findall(r"(?:extern_kernels\.|torch\.ops\.aten\.)(\w+)[.\w]*\(", src)
        print(f"  T {t} top_k {k} top_p {p} min_p {m} penalty {r}: {len(fused)} fused kernels, "
              f"extern calls: {', '.join(extern) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
