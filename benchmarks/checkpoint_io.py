"""Checkpoint save and resume on CPU against model size and world size: what checkpoint.save_checkpoint writes
(step_N/model: the bf16 export; step_N/state: fp32 master weights, AdamW state, trainer state), how long the save
and the resume take, the peak host memory of each on every rank, and what hashing every file (the format before
issue 27: a sha256 of every file at save and again at resume) would add.

    python benchmarks/checkpoint_io.py                 # tiny and Qwen3-0.6B shapes, 1 process and torchrun x 2
    python benchmarks/checkpoint_io.py --smoke         # the tiny shape only, seconds
    python benchmarks/checkpoint_io.py --root OTHER    # the same runs with the checkpoint code of another tree
                                                       # (a git worktree of an older commit: before and after)

Every (shape, world) runs as two fresh processes (two torchrun jobs at world 2, gloo): `save` loads the model
folder as a run does (modeling.load_model + wrap_policy: FSDP2 at world 2), makes AdamW state by one step on fixed
gradients and saves step_1; `resume` then does what a resumed run does before its first step (verify, load_model
of the checkpoint, wrap_policy, resume_state) and checks the weights equal the saved ones. A thread samples each
process's resident set every 5 ms: each phase's RSS before it (freed heap handed back first) and its peak.
Times are each phase's slowest rank.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 2**20


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class PeakRSS:
    """The resident set before the `with` (freed heap memory handed back first: malloc_trim) and the highest seen
    every 5 ms inside it (MB)."""

    def __enter__(self):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.before = self.peak = rss_mb()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.done.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mb())


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


def child(phase: str, shape_name: str, out: str) -> dict:
    """One rank of one phase (save or resume); its numbers, as a dict."""
    import types

    import torch

    from grouprl import checkpoint
    from grouprl import distributed
    from grouprl import modeling
    import shapes

    d = distributed.setup_distributed(0)
    tok = shapes.word_tokenizer(shapes_of(shape_name)["vocab_size"])
    args = types.SimpleNamespace(keep_checkpoints=0)
    run_dir, ckpt = os.path.join(out, "run"), os.path.join(out, "run", "step_1")
    from transformers import Qwen3ForCausalLM  # noqa: F401 - imported before the clock starts
    distributed.barrier()
    with PeakRSS() as mem:
        t = time.perf_counter()
        if phase == "save":
            lm, rank0 = modeling.load_model(os.path.join(out, "base"), tok, d, 0)
        else:
            assert checkpoint.verify_checkpoint(ckpt, d) is None
            lm, rank0 = modeling.load_model(ckpt, tok, d, 0)
        policy = modeling.wrap_policy(lm, d, 1.0, 64, False, rank0_weights=rank0)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
        if phase == "resume":
            checkpoint.resume_state(ckpt, optimizer, scheduler, d)
        distributed.barrier()
        load_s = time.perf_counter() - t
    row = {"rank": d.rank, "world": d.world, "load_s": load_s, "load_rss_MB": (mem.before, mem.peak),
           "params_M": sum(p.numel() for p in lm.parameters()) / 1e6}
    if phase == "save":
        for p in policy.parameters():  # AdamW state: one step on fixed gradients
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        os.makedirs(run_dir, exist_ok=True)  # a script's run folder exists before its first save
        distributed.barrier()
        with PeakRSS() as mem:
            t = time.perf_counter()
            checkpoint.save_checkpoint(run_dir, 1, policy, tok, optimizer, scheduler, d, args, "bench.py",
                                       reward_curve=[])
            save_s = time.perf_counter() - t
        row.update(save_s=save_s, save_rss_MB=(mem.before, mem.peak))
    # the weights as saved, and as the resume gives them back (measure compares the two)
    sums = [float(p.detach().to_local().double().sum()) if hasattr(p, "to_local") else
            float(p.detach().double().sum()) for p in policy.parameters()]
    row["weights_sum"] = distributed.all_reduce(torch.tensor([sum(sums)], dtype=torch.float64)).item()
    if phase == "resume" and d.main:
        row.update(model_MB=folder_mb(os.path.join(ckpt, "model")),
                   state_MB=folder_mb(checkpoint.state_dir(ckpt)), sha256_all_s=sha256_all(ckpt))
    return row


def launch(root: str, phase: str, shape_name: str, world: int, out: str) -> list[dict]:
    """Run one phase in fresh processes (torchrun at world > 1); every rank's row."""
    me = [os.path.abspath(__file__), "--phase", phase, "--shape", shape_name, "--out", out]
    cmd = [sys.executable, *me] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *me]
    env = {**os.environ, "BENCH_ROOT": root, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=3600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = []
    for r in range(world):  # each rank's row, a file each (ranks' stdout lines can interleave)
        with open(os.path.join(out, f"{phase}_rank{r}.json")) as f:
            rows.append(json.load(f))
    return rows


def measure(root: str, shape_name: str, world: int) -> dict:
    import shapes

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
        tok = shapes.word_tokenizer(shapes_of(shape_name)["vocab_size"])
        import torch

        torch.manual_seed(0)
        shapes.random_model(shapes_of(shape_name), tok, torch.float32).save_pretrained(os.path.join(out, "base"))
        saved = launch(root, "save", shape_name, world, out)
        resumed = launch(root, "resume", shape_name, world, out)
        assert saved[0]["weights_sum"] == resumed[0]["weights_sum"], (saved[0], resumed[0])  # the masters back
        by_rank = {r["rank"]: r for r in resumed}
        return {"shape": shape_name, "world": world, "params_M": saved[0]["params_M"],
                "model_MB": by_rank[0]["model_MB"], "state_MB": by_rank[0]["state_MB"],
                "save_s": max(r["save_s"] for r in saved),
                "save_rss": {r["rank"]: r["save_rss_MB"] for r in saved},
                "resume_s": max(r["load_s"] for r in resumed),
                "resume_rss": {r["rank"]: r["load_rss_MB"] for r in resumed},
                "sha256_all_s": by_rank[0]["sha256_all_s"]}


def shapes_of(name: str) -> dict:
    import shapes

    return shapes.TINY if name == "tiny" else shapes.QWEN3[name]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="the tiny shape only")
    ap.add_argument("--root", default=os.path.dirname(HERE), help="the tree whose checkpoint code runs")
    ap.add_argument("--worlds", default="1,2", help="process counts (2: torchrun, FSDP2 over gloo)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # a child: one phase of one (shape, world)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = os.path.abspath(os.environ.get("BENCH_ROOT", a.root))
    sys.path[:0] = [root, HERE]  # the tree under test first; shapes.py from this one
    if a.phase:
        row = child(a.phase, a.shape, a.out)
        with open(os.path.join(a.out, f"{a.phase}_rank{row['rank']}.json"), "w") as f:
            json.dump(row, f)
        from grouprl import checkpoint

        checkpoint.cleanup()
        return
    rows = [measure(root, name, int(w)) for name in ["tiny"] + ([] if a.smoke else ["0.6B"])
            for w in a.worlds.split(",")]
    commit = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    if commit and subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True).stdout.strip():
        commit += " and uncommitted changes"
    print(f"checkpoint code of {root} ({commit or 'not a git tree'})\n")
    print("| shape | params (M) | ranks | model/ (MB, bf16) | state/ (MB) | save (s) | save RSS before -> peak (MB), "
          "by rank | resume (s) | resume RSS before -> peak (MB), by rank | sha256 of every file (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rss = {k: " / ".join(f"{a:.0f} -> {b:.0f}" for _, (a, b) in sorted(r[k].items(), key=lambda kv: int(kv[0])))
               for k in ("save_rss", "resume_rss")}
        print(f"| {r['shape']} | {r['params_M']:.1f} | {r['world']} | {r['model_MB']:.0f} | {r['state_MB']:.0f} | "
              f"{r['save_s']:.2f} | {rss['save_rss']} | {r['resume_s']:.2f} | {rss['resume_rss']} | "
              f"{r['sha256_all_s']:.2f} |")
    print(f"\n`python benchmarks/checkpoint_io.py{' --smoke' if a.smoke else ''}`")


if __name__ == "__main__":
    main()
