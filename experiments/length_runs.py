"""The length lab (docs/lab.md, "Length"): GSPO's central claim (arXiv 2507.18071 sec. 3-4; restated by DFPO arXiv
2604.13088 sec. 2) that a token-level importance weight is a one-sample estimate whose noise accumulates with the
response length, so that GRPO's training degrades, and collapses first, as completions grow, while one sequence-level
ratio does not accumulate it.

Length is the only thing that changes: the built-in task ('x%10=', answer x) scored on the completion's first
character alone (experiments/length_reward.py), every completion held to exactly L tokens (--min-new-tokens L
--max-new-tokens L: EOS masked until L, HF's min_new_tokens), --truncated-reward-scale 1. So the reward is decided by
one token while L - 1 more carry importance weights and gradient. Each run logs (--noise-stats), after the first
update of each step: the variance over sequences of log s_i (GSPO's ratio, the mean token log-ratio) and of log
prod_t w_it (the product GRPO's token weights make), the cosine between the gradients of each minibatch's two halves
(1: no noise between halves), and the clip fractions. Per script, length and learning rate, over the seeds: reward
over the first and last 10% of steps, its peak (a 10% window), whether it collapsed (the last 10% below half the
peak, and 0.1 below it), those noise measures, and reward per 1,000 tokens generated.

    python experiments/length_runs.py                          # every script, length, rate and seed (long: see --help)
    python experiments/length_runs.py --scripts grpo.py,gspo.py --lengths 16,64,256
    python experiments/length_runs.py --table-only             # the table again from the runs there, running nothing
"""
import glob
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, fmt, mean_std, run_jobs, sci  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "length")
    """where the runs and table.md go"""
    scripts: str = "grpo.py,gspo.py,gspo_token.py,dfpo.py,cispo.py,sapo.py,gmpo.py"
    """comma-separated scripts, each with its paper's defaults"""
    lengths: str = "16,64,256"
    """comma-separated completion lengths L (each run's every completion is L tokens)"""
    learning_rates: str = "5e-4,2e-3"
    """comma-separated learning rates: the tiny model's default, where GSPO learns at L = 16, and a higher one"""
    seeds: int = 3
    """seeds per configuration (1, 2, ...)"""
    steps: int = 100
    """RL steps a run"""
    prompts_per_rank: int = 8
    """prompts a step (x G = 8 completions; 2 minibatches of 4 prompts, each in halves of 2)"""
    workers: int = 2
    """runs at once, one CPU thread each"""
    table_only: bool = False
    """run nothing: rebuild table.md from the runs already under {out}/runs"""


def run_name(script: str, length: int, lr: str) -> str:
    return f"{script[:-3]}__L{length}__lr{lr}"


def command(script: str, length: int, lr: str, args) -> list[str]:
    return [script, "--min-new-tokens", str(length), "--max-new-tokens", str(length),
            "--reward", "length_reward:first_digit", "--truncated-reward-scale", "1", "--learning-rate", lr,
            "--num-steps", str(args.steps), "--prompts-per-rank", str(args.prompts_per_rank), "--group-size", "8",
            "--num-minibatches", "2", "--micro-batch-size", str(args.prompts_per_rank * 2), "--noise-stats",
            "--eval-every", "0", "--log-samples", "0", "--save-every", "0"]


def mean(xs: list[float]) -> float:
    """The mean of the finite values (nan when none: a run whose halves never both had a gradient)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summary(rows: list[dict], length: int) -> dict:
    """One run's numbers from its metrics.jsonl rows (one a step)."""
    r = [x["charts/reward_mean"] for x in rows]
    n = max(1, len(r) // 10)
    windows = [sum(r[i:i + n]) / n for i in range(len(r) - n + 1)]
    peak, last = max(windows), windows[-1]
    return {"first": windows[0], "last": last, "peak": peak,
            "collapsed": float(last < peak / 2 and last < peak - 0.1),
            "seq_var": mean([x.get("noise/seq_log_ratio_var") for x in rows]),
            "sum_var": mean([x.get("noise/seq_log_ratio_sum_var") for x in rows]),
            "cos": mean([x.get("noise/grad_cos_later") for x in rows]),
            "clip": mean([x["losses/clipfrac"] for x in rows]),
            "clip_seq": mean([x["losses/clipfrac_seq"] for x in rows]),
            "per_1k_tokens": 1000 * sum(r) / (len(r) * length),
            "wall": rows[-1]["perf/wall_time"]}


def cell(xs: list[float], digits: int | None = 3) -> str:
    """Mean ± sample std of the finite values (digits None: scientific), '-' when none."""
    xs = [x for x in xs if math.isfinite(x)]
    return "-" if not xs else sci(xs) if digits is None else fmt(xs, digits)


def table(runs: str, scripts: list[str], lengths: list[int], rates: list[str], seeds: list[int]) -> str:
    """The table of every configuration with runs under `runs`, and each script's noise at its longest length over
    its shortest, paired by seed."""
    lines = ["| script | L | lr | reward, first 10% | last 10% | peak (10% window) | collapsed runs | "
             "Var log s_i | Var log prod_t w_it | grad cos, halves | clip frac (tokens) | clip frac (seqs) | "
             "reward / 1k tokens | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    found = {}
    for script in scripts:
        for length in lengths:
            for lr in rates:
                got = {}
                for s in seeds:
                    paths = glob.glob(os.path.join(runs, f"{run_name(script, length, lr)}__{s}__*", "metrics.jsonl"))
                    if len(paths) == 1:
                        got[s] = summary([json.loads(line) for line in open(paths[0])], length)
                if not got:
                    continue
                found[script, length, lr] = got
                col = {k: [v[k] for v in got.values()] for k in next(iter(got.values()))}
                lines.append(f"| `{script}` | {length} | {lr} | {cell(col['first'])} | {cell(col['last'])} | "
                             f"{cell(col['peak'])} | {int(sum(col['collapsed']))}/{len(got)} | "
                             f"{cell(col['seq_var'], None)} | {cell(col['sum_var'], None)} | {cell(col['cos'])} | "
                             f"{cell(col['clip'])} | {cell(col['clip_seq'])} | {cell(col['per_1k_tokens'], 2)} | "
                             f"{cell(col['wall'], 0)} |")
    if not found:
        raise SystemExit(f"no runs under {runs}")
    growth = []
    for script in scripts:
        for lr in rates:
            have = sorted(length for length in lengths if (script, length, lr) in found)
            if len(have) < 2:
                continue
            short, long = found[script, have[0], lr], found[script, have[-1], lr]
            both = [s for s in seeds if s in short and s in long]
            for key, what in (("sum_var", "Var log prod_t w_it"), ("seq_var", "Var log s_i")):
                ratios = [long[s][key] / short[s][key] for s in both if short[s][key] > 0]
                if ratios:
                    m, sd = mean_std(ratios)
                    growth.append(f"- `{script}` lr {lr}: {what} at L = {have[-1]} over L = {have[0]}, by seed: "
                                  + ", ".join(f"{r:.2f}" for r in ratios)
                                  + f" (mean {m:.2f}" + (f" ± {sd:.2f})" if len(ratios) > 1 else ")"))
    return "\n".join(lines) + ("\n\nGrowth with length, paired by seed:\n" + "\n".join(growth) if growth else "")


def main():
    args = tyro.cli(Args)
    t0 = time.time()
    scripts = args.scripts.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    rates = args.learning_rates.split(",")
    seeds = list(range(1, args.seeds + 1))
    runs = os.path.join(args.out, "runs")
    if not args.table_only:
        os.makedirs(runs, exist_ok=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
        jobs = []
        for script in scripts:
            for length in lengths:
                for lr in rates:
                    name = run_name(script, length, lr)
                    for path in glob.glob(os.path.join(runs, f"{name}__*")):
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                    jobs += [(f"{name} seed {s}", [*command(script, length, lr, args), "--seed", str(s),
                                                   "--exp-name", name, "--output-dir", runs],
                              os.path.join(runs, f"{name}__{s}.log")) for s in seeds]
        run_jobs(jobs, args.workers)
    what = ("the table rebuilt from the runs under runs/" if args.table_only
            else f"{time.time() - t0:.0f} s, {args.workers} runs at a time")
    report = (f"`python experiments/length_runs.py {' '.join(sys.argv[1:])}`: seeds {seeds}, {what}. Mean ± sample "
              f"std (ddof 1) over seeds; the noise columns are means over steps.\n\n"
              f"{table(runs, scripts, lengths, rates, seeds)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
