"""Steps a minute of `--async-rollouts` (one trainer rank and one rollout rank under torchrun, gloo) against the
synchronous one-process run of the same flags and --max-staleness (issue 63 item 4), alternated in one sitting:

    python benchmarks/async_throughput.py                          # the tiny model, 3 pairs of 12 steps
    python benchmarks/async_throughput.py --model ~/.cache/group-rl/smollm2-135m-instruct --steps 5 \\
        --extra "--max-new-tokens 48 --prompts-per-rank 2 --group-size 4"

Both sides get the machine's cores: the one process --threads of them, each of the two ranks half. Per run, from its
metrics.jsonl (the trainer's): steps a minute from the end of step 1 to the last (the first step's start-up and
compilation left out), the fraction of that time the trainer waited for a rollout (perf/rollout_wait_s) and the
rollout rank for weights (perf/weights_wait_s). The two runs of a pair sample the same rollouts (the pipeline of
depth k equals one-process --max-staleness k: tests/test_async.py), so the ratio is the overlap alone.
"""
import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv: list[str], out: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t = time.time()
    p = subprocess.run([*argv, "--output-dir", out], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{shlex.join(argv)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    (path,) = glob.glob(os.path.join(out, "*", "metrics.jsonl"))
    rows = [r for r in map(json.loads, open(path)) if "perf/wall_time" in r and r.get("step", 0) > 0]
    span = rows[-1]["perf/wall_time"] - rows[0]["perf/wall_time"]
    later = rows[1:]
    return {"steps_per_min": 60 * len(later) / span, "trainer_wait": sum(r.get("perf/rollout_wait_s", 0)
                                                                         for r in later) / span,
            "rollout_wait": sum(r.get("perf/weights_wait_s", 0) for r in later) / span, "wall": time.time() - t}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default="grpo.py")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=3, help="runs of each side, alternated (async first, then second)")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="the cores both sides get")
    ap.add_argument("--extra", default="--prompts-per-rank 4", help="more flags for both sides")
    args = ap.parse_args()
    if args.steps < 3 or args.pairs < 1 or args.threads < 2:
        sys.exit("--steps 3 or more, --pairs 1 or more, --threads 2 or more (one a rank)")
    flags = [args.script, "--model", args.model, "--num-steps", str(args.steps), "--max-staleness",
             str(args.max_staleness), "--eval-every", "0", "--log-samples", "0", "--save-every", "0",
             *shlex.split(args.extra)]
    sides = {"async, 2 ranks": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", *flags, "--async-rollouts"], args.threads // 2),
             "one process": ([sys.executable, *flags], args.threads)}
    got = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                argv, threads = sides[name]
                got[name].append(run(argv, os.path.join(tmp, f"{i}_{len(got[name])}_{name[:5]}"), threads))
                print(f"  pair {i + 1}, {name}: {got[name][-1]['steps_per_min']:.1f} steps/min", flush=True)
    print(f"\n`python benchmarks/async_throughput.py {shlex.join(sys.argv[1:])}`: {args.script}, --max-staleness "
          f"{args.max_staleness}, {args.steps} steps, steps 2-{args.steps} timed\n")
    print("| run | steps/min, each pair | trainer waits | rollout rank waits |\n|---|---|---|---|")
    for name, runs in got.items():
        waits = ", ".join(f"{r['trainer_wait']:.0%}" for r in runs) if name.startswith("async") else "-"
        rwaits = ", ".join(f"{r['rollout_wait']:.0%}" for r in runs) if name.startswith("async") else "-"
        rates = ", ".join(f"{r['steps_per_min']:.1f}" for r in runs)
        print(f"| {name} | {rates} | {waits} | {rwaits} |")
    ratios = [a["steps_per_min"] / s["steps_per_min"] for a, s in zip(*got.values())]
    print(f"\nasync over one process, pair by pair: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(mean {sum(ratios) / len(ratios):.2f})")


if __name__ == "__main__":
    main()
