"""gspo.py on a Qwen3-0.6B-shaped model on CPU, one process and torchrun with FSDP2, with each process's peak memory
against memory_plan.py's prediction for the same job:

    python benchmarks/cpu_0p6b.py             # ~15 minutes on 2 cores; prints a markdown table and the commands
    python benchmarks/cpu_0p6b.py --smoke     # tiny shapes, seconds (the test suite)

The model folder: random weights in shapes.QWEN3["0.6B"] (28 layers, hidden 1024, vocabulary 151,936, tied
embeddings) saved with save_pretrained, and the built-in task's character tokenizer (modeling.tiny_tokenizer, 100
ids: the built-in task's prompts and its chat template need it; the model's other ids are only ever sampled). Then
`python gspo.py --model <folder>` and `torchrun --nproc-per-node 2 gspo.py --model <folder>` (FSDP2 over gloo: a
meta-device build on every rank, rank 0 reads the weights and scatters the shards), each with the same small job.
Peak memory is each process's VmHWM (peak resident set, /proc/<pid>/status), read every 0.2 s while it lives; the
plan is memory_plan.cpu_process for the same job, with the baseline measured here: the same job on --model tiny
(everything but the model's own memory; a process that only imports gspo.py and transformers is given too).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def status(pid: int) -> dict:
    """VmRSS and VmHWM (bytes) of a live process, {} once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError, KeyError):
        return {}


def descendants(pid: int) -> tuple[list[int], set[int]]:
    """pid and every process below it, and pid's children."""
    children = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except (OSError, IndexError):
            pass
    out, todo = [pid], list(children.get(pid, []))
    while todo:
        out.append(todo.pop(0))
        todo += children.get(out[-1], [])
    return out, set(children.get(pid, []))


def rank_of(pid: int) -> str:
    try:
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    except OSError:
        return "?"
    return f"rank {env['RANK']}" if "RANK" in env else "launcher"


def measure(cmd: list[str], log: str) -> dict:
    """Run cmd; every 0.2 s, each of its processes' VmHWM and VmRSS. Returns per process (by rank; the largest of
    any other children) the peak RSS, the largest RSS seen and when, an RSS timeline (a point every ~5 s), and the
    wall time."""
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        procs = {}
        while p.poll() is None:
            tree, launched = descendants(p.pid)  # torchrun's workers are its children
            for pid in tree:
                s = status(pid)
                if not s:
                    continue
                name = ("launcher" if "torch.distributed.run" in cmd else "process") if pid == p.pid else \
                    rank_of(pid) if pid in launched else "other child processes (each)"
                r = procs.setdefault(pid, {"name": name, "peak": 0, "timeline": [], "rss_max": 0, "t_rss_max": 0})
                r["name"] = name  # the latest: a worker seen between fork and exec has the launcher's environment
                t = round(time.time() - t0, 1)
                r["peak"] = max(r["peak"], s["VmHWM"])
                if s["VmRSS"] > r["rss_max"]:
                    r["rss_max"], r["t_rss_max"] = s["VmRSS"], t
                if not r["timeline"] or t - r["timeline"][-1][0] >= 5:
                    r["timeline"].append((t, round(s["VmRSS"] / GB, 2)))
            time.sleep(0.2)
    wall = time.time() - t0
    if p.returncode:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"error: {' '.join(cmd)} exited {p.returncode}; its output ({log}) ends:\n{tail}")
    by_name = {}
    for r in sorted(procs.values(), key=lambda r: r["peak"]):
        by_name[r.pop("name")] = r  # the largest last
    return {"wall_s": wall, "procs": by_name}


def build(folder: str, shape: dict):
    """The model folder: random weights in `shape` (fp32) and the built-in task's tokenizer."""
    import torch

    from grouprl import modeling
    import shapes

    tok = modeling.tiny_tokenizer()
    torch.manual_seed(0)
    lm = shapes.random_model(shape, tok, torch.float32)
    lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in lm.parameters())


def table(results: dict) -> str:
    """The markdown table of a run's results: each process's peak RSS against memory_plan.cpu_process."""
    import memory_plan

    GBs = {k: results[k] / GB for k in ("imports", "baseline")}
    lines = [f"baseline: {GBs['imports']:.2f} GB with gspo.py and transformers imported, {GBs['baseline']:.2f} GB for "
             f"the same job on --model tiny (the plan's baseline)", "",
             "| run | process | peak RSS (GB) | plan (GB), its peak phase | peak / plan | wall (s) |",
             "|---|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        for proc, m in sorted(r["procs"].items()):
            if proc in ("launcher", "other child processes (each)"):
                phase, plan = "imports", GBs["imports"]
            else:
                phases = memory_plan.cpu_process(results["shape"], results["nproc"], **results["job"],
                                                 baseline=GBs["baseline"], fsdp=name == "torchrun",
                                                 rank0=proc == "rank 0")
                phase, plan = max(phases.items(), key=lambda kv: kv[1])
            lines.append(f"| {name} | {proc} | {m['peak'] / GB:.2f} | {plan:.2f}, {phase} | "
                         f"{m['peak'] / GB / plan:.2f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for the model, runs and cpu_0p6b.json (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts-per-rank", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=2, help="torchrun --nproc-per-node")
    ap.add_argument("--runs", default="python,torchrun", help="which of the two runs")
    ap.add_argument("--keep", action="store_true", help="keep the model folder and the runs' checkpoints (~17 GB)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one step: every code path in seconds")
    ap.add_argument("--table", metavar="JSON", help="only print the table of an earlier run's cpu_0p6b.json")
    a = ap.parse_args()
    if a.table:
        return print(table(json.load(open(a.table))))
    if a.smoke:
        ap.set_defaults(steps=1, max_new_tokens=4)
        a = ap.parse_args()
    import shapes

    out = a.out or tempfile.mkdtemp(prefix="cpu_0p6b_")
    folder = os.path.join(out, "model")
    shape = shapes.TINY if a.smoke else shapes.QWEN3["0.6B"]
    t = time.time()
    P = build(folder, shape)
    print(f"model folder {folder}: {P / 1e9:.3f}B parameters, built in {time.time() - t:.0f}s", flush=True)

    flags = ["--num-steps", str(a.steps), "--prompts-per-rank", str(a.prompts_per_rank),
             "--group-size", str(a.group_size), "--num-minibatches", "1", "--max-new-tokens", str(a.max_new_tokens),
             "--eval-every", "0", "--log-samples", "0", "--activation-checkpointing", "--output-dir",
             os.path.join(out, "runs")]
    commands = {"python": [sys.executable, "gspo.py"],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(a.nproc), "gspo.py"]}
    # baselines: a process that imports gspo.py and transformers; the same job on the built-in tiny model (0.5M
    # parameters: everything but the model's own memory)
    imports = measure([sys.executable, "-c", "import gspo, transformers"], os.path.join(out, "imports.log"))
    tiny = measure(commands["python"] + ["--model", "tiny"] + flags, os.path.join(out, "tiny.log"))
    imports, baseline = imports["procs"]["process"]["peak"], tiny["procs"]["process"]["peak"]
    results = {"shape": shape, "nproc": a.nproc, "parameters": P, "imports": imports, "baseline": baseline, "runs": {}}
    # the job's sizes per rank: one minibatch of prompts x group sequences, each the prompt (24 tokens with the
    # chat template) and the completion; a generate call of as many sequences; one log-prob chunk of their completions
    seqs, tokens = a.prompts_per_rank * a.group_size, 24 + a.max_new_tokens
    results["job"] = dict(seqs=seqs, tokens=tokens, gen_seqs=seqs, chunk=seqs * a.max_new_tokens)
    for name in a.runs.split(","):
        cmd = commands[name] + ["--model", folder] + flags
        print(f"running: {' '.join(cmd)}", flush=True)
        results["runs"][name] = {"command": cmd, **measure(cmd, os.path.join(out, f"{name}.log"))}
        with open(os.path.join(out, "cpu_0p6b.json"), "w") as f:  # after each run: a stopped run keeps the first
            json.dump(results, f, indent=1)

    if not a.keep:  # the logs and cpu_0p6b.json stay
        shutil.rmtree(folder)
        shutil.rmtree(os.path.join(out, "runs"), ignore_errors=True)
    print(table(results))
    for name, r in results["runs"].items():
        print(f"{name}: " + " ".join(r["command"]).replace(sys.executable, "python"))
    print(f"written: {out}/cpu_0p6b.json\ncommand: " + " ".join(["python", "benchmarks/cpu_0p6b.py"] + sys.argv[1:]))


if __name__ == "__main__":
    main()
