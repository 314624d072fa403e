"""Checkpoint save and resume on CPU, one process, against model size: what checkpoint.save_checkpoint writes
(step_N/model: the bf16 export; step_N/state: fp32 master weights, AdamW state, trainer state), how long the save
and the resume's verification and reads take, the peak host memory of the save, and what hashing every file (the
format before issue 27: a sha256 of every file at save and again at resume) would add.

    python benchmarks/checkpoint_io.py               # the tiny shape and a ~0.1B Qwen3 shape (vocabulary 151,936)
    python benchmarks/checkpoint_io.py --smoke       # the tiny shape only, seconds

Each shape runs in a fresh process (peak memory is that process's ru_maxrss; "save peak extra" is the peak during
the save less the resident set before it). The AdamW state is made by one optimizer step on random gradients.
"""
import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MB = 2**20
# ~0.1B parameters with Qwen3's vocabulary: 78M in the tied embedding, 27M in 8 layers
SHAPES = {"0.1B": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sha256_all(folder: str) -> float:
    """Seconds to hash every file under folder, as the old manifest did at save and again at resume."""
    t = time.perf_counter()
    for root, _, files in os.walk(folder):
        for name in files:
            h = hashlib.sha256()
            with open(os.path.join(root, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return time.perf_counter() - t


def folder_mb(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(folder) for n in fs) / MB


def one(shape_name: str, out: str) -> dict:
    import types

    import torch

    import checkpoint
    import common
    import shapes
    from distributed import Dist

    torch.manual_seed(0)
    d = Dist(0, 1, torch.device("cpu"))
    if shape_name == "tiny":
        tok = common.tiny_tokenizer()
        lm = common.tiny_model(tok)
    else:
        tok = shapes.word_tokenizer(shapes.QWEN3_COMMON["vocab_size"])
        lm = shapes.random_model(dict(shapes.QWEN3_COMMON, **SHAPES[shape_name]), tok, torch.float32)
    params = sum(p.numel() for p in lm.parameters())
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-6)
    for p in lm.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    args = types.SimpleNamespace(keep_checkpoints=0)
    run_dir = os.path.join(out, f"bench__{shape_name}")
    os.makedirs(run_dir)
    before = rss_mb()
    t = time.perf_counter()
    ckpt = checkpoint.save_checkpoint(run_dir, 1, types.SimpleNamespace(lm=lm), tok, optimizer, scheduler, d, args,
                                      "bench.py", reward_curve=[])
    save_s = time.perf_counter() - t
    save_peak = peak_mb() - before
    t = time.perf_counter()
    assert checkpoint.verify_checkpoint(ckpt, d) is None
    verify_s = time.perf_counter() - t
    t = time.perf_counter()
    state = checkpoint.state_dir(ckpt)
    if shape_name == "tiny":
        back = common.load_model(ckpt, tok, d, 0)[0]
    else:
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(state, dtype=torch.float32)
    fresh = torch.optim.AdamW(back.parameters(), lr=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(fresh, lambda i: 1.0)
    checkpoint.resume_state(ckpt, fresh, sched, d)
    load_s = time.perf_counter() - t
    assert all(torch.equal(a, b) for a, b in zip(lm.parameters(), back.parameters()))  # exact: the masters
    return {"shape": shape_name, "params_M": params / 1e6, "model_MB": folder_mb(os.path.join(ckpt, "model")),
            "state_MB": folder_mb(state), "save_s": save_s, "save_peak_extra_MB": save_peak,
            "verify_s": verify_s, "resume_read_s": load_s, "sha256_all_s": sha256_all(ckpt),
            "rss_before_save_MB": before}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="the tiny shape only")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one shape, JSON on stdout
    a = ap.parse_args()
    if a.one:
        with tempfile.TemporaryDirectory() as out:
            print(json.dumps(one(a.one, out)))
        return
    rows = []
    for name in ["tiny"] + ([] if a.smoke else list(SHAPES)):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name], capture_output=True, text=True,
                           cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print("| shape | params (M) | model/ (MB, bf16) | state/ (MB) | save (s) | save peak extra (MB) | verify (s) | "
          "resume reads (s) | sha256 of every file (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['params_M']:.1f} | {r['model_MB']:.0f} | {r['state_MB']:.0f} | {r['save_s']:.2f} "
              f"| {r['save_peak_extra_MB']:.0f} | {r['verify_s']:.3f} | {r['resume_read_s']:.2f} | "
              f"{r['sha256_all_s']:.2f} |")
    print(f"\n`python benchmarks/checkpoint_io.py{' --smoke' if a.smoke else ''}`")


if __name__ == "__main__":
    main()
