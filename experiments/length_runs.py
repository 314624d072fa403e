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
over the first and last 10% of steps, its peak (a 10% window), whether it collapsed (it learned, its peak 0.05
above its first 10%, and lost it all: its last 10% at or below its first), those noise measures, and reward per
1,000 tokens generated; each script paired by seed with the first; length.png plots the reward curves and the noise
measures against L.

    python experiments/length_runs.py                          # every script, length, rate and seed (long: see --help)
    python experiments/length_runs.py --scripts grpo.py,gspo.py --lengths 16,64,256 --steps 400 --skip-done
    python experiments/length_runs.py --table-only             # table.md and length.png again from the logs

Each finished run's metrics.jsonl and args.json are kept under {out}/logs/{script}__L{L}__lr{lr}__n{steps}__{seed}/
(small, committed) and its run folder (checkpoint included) deleted; --skip-done runs only the configurations and
seeds whose logs are missing, and the step budget in the name keeps runs of different budgets apart.
"""
import math
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, fmt, mean_std, read_rows, sci  # noqa: E402
from real_model_runs import run_kept  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# a log folder's name: {script}__L{length}__lr{rate}__n{steps}__{seed}
LOG_NAME = re.compile(r"(?P<script>.+)__L(?P<length>\d+)__lr(?P<lr>.+)__n(?P<steps>\d+)__(?P<seed>\d+)$")


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "length")
    """where the logs (logs/), table.md and length.png go (runs/ holds the runs in progress)"""
    scripts: str = "grpo.py,gspo.py,gspo_token.py,dfpo.py,cispo.py,sapo.py,gmpo.py"
    """comma-separated scripts, each with its paper's defaults"""
    lengths: str = "16,64,256"
    """comma-separated completion lengths L (each run's every completion is L tokens)"""
    learning_rates: str = "2e-3,5e-3"
    """comma-separated learning rates: 2e-3, where GSPO learns at L = 16 in 100 steps (on 2 seeds of 3),
    and a higher one"""
    seeds: int = 3
    """seeds per configuration (1, 2, ...)"""
    steps: int = 100
    """RL steps a run (in the run's name: runs of other budgets are kept apart, and the table shows each)"""
    prompts_per_rank: int = 8
    """prompts a step (x G = 8 completions; 2 minibatches of 4 prompts, each in halves of 2)"""
    workers: int = 2
    """runs at once, one CPU thread each"""
    skip_done: bool = False
    """run only the configurations and seeds whose logs are not under {out}/logs yet (an interrupted or extended
    experiment continues)"""
    table_only: bool = False
    """run nothing: rebuild table.md and length.png from the logs already under {out}/logs"""


def grid(args) -> tuple[list[str], list[int], list[str], list[int]]:
    """The scripts, lengths, rates and seeds asked for; a clear error before anything runs."""
    scripts = args.scripts.split(",")
    if missing := [s for s in scripts if not os.path.isfile(os.path.join(ROOT, s))]:
        raise SystemExit(f"--scripts {','.join(missing)}: no such script in {ROOT}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths {args.lengths}: comma-separated whole numbers")
    if min(lengths) < 1 or args.seeds < 1 or args.steps < 1:
        raise SystemExit("--lengths, --seeds and --steps: 1 or more")
    return scripts, lengths, args.learning_rates.split(","), list(range(1, args.seeds + 1))


def run_name(script: str, length: int, lr: str, steps: int) -> str:
    return f"{script[:-3]}__L{length}__lr{lr}__n{steps}"


def command(script: str, length: int, lr: str, args) -> list[str]:
    return [script, "--min-new-tokens", str(length), "--max-new-tokens", str(length),
            "--reward", "length_reward:first_digit", "--truncated-reward-scale", "1", "--learning-rate", lr,
            "--num-steps", str(args.steps), "--prompts-per-rank", str(args.prompts_per_rank), "--group-size", "8",
            "--num-minibatches", "2", "--micro-batch-size", str(args.prompts_per_rank * 2), "--noise-stats",
            "--eval-every", "0", "--log-samples", "0", "--save-every", "0"]


def done(logs: str, name: str, seed: int) -> bool:
    """A finished run's logs are there (keep_logs copies args.json last)."""
    return all(os.path.isfile(os.path.join(logs, f"{name}__{seed}", f)) for f in ("metrics.jsonl", "args.json"))


def pending(args, logs: str) -> list[tuple[str, int, str, int]]:
    """(script, L, lr, seed) of each run to make, seed-major (an interrupted experiment has every configuration on
    its first seeds): all of them, or with --skip-done those whose logs are not under `logs`."""
    scripts, lengths, rates, seeds = grid(args)
    return [(script, length, lr, s) for s in seeds for script in scripts for length in lengths for lr in rates
            if not (args.skip_done and done(logs, run_name(script, length, lr, args.steps), s))]


def load(logs: str, scripts: list[str], lengths: list[int], rates: list[str], seeds: list[int]) -> dict:
    """{(script, L, lr, steps): {seed: metrics.jsonl rows}} of the logs under `logs` of these scripts, lengths,
    rates and seeds, every step budget found (rising), in that order."""
    found = {}
    for d in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        m = LOG_NAME.match(d)
        if m and int(m["seed"]) in seeds and os.path.isfile(path := os.path.join(logs, d, "metrics.jsonl")):
            key = (m["script"] + ".py", int(m["length"]), m["lr"], int(m["steps"]))
            found.setdefault(key, {})[int(m["seed"])] = path
    keys = [k for k in found if k[0] in scripts and k[1] in lengths and k[2] in rates]
    keys.sort(key=lambda k: (scripts.index(k[0]), lengths.index(k[1]), rates.index(k[2]), k[3]))
    return {k: {s: read_rows(found[k][s], STEP_KEYS) for s in sorted(found[k])} for k in keys}


STEP_KEYS = ("charts/reward_mean", "losses/clipfrac", "losses/clipfrac_seq", "perf/wall_time")  # summary's


def mean(xs: list[float]) -> float:
    """The mean of the finite values (nan when none: a run whose halves never both had a gradient)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


LEARNED = 0.05  # a 10% window's gain that is learning, not sampling noise: sqrt(p(1-p)/n) = 0.006 at p = 0.02, n = 640


def window(r: list[float]) -> tuple[int, list[float]]:
    """The reward's moving mean over a 10% window (n steps, at least 1): its value at steps n, n + 1, ..."""
    n = max(1, len(r) // 10)
    return n, [sum(r[i:i + n]) / n for i in range(len(r) - n + 1)]


def summary(rows: list[dict], length: int) -> dict:
    """One run's numbers from its metrics.jsonl rows (one a step)."""
    r = [x["charts/reward_mean"] for x in rows]
    windows = window(r)[1]
    peak, last = max(windows), windows[-1]
    return {"first": windows[0], "last": last, "peak": peak,
            "collapsed": float(peak >= windows[0] + LEARNED and last <= windows[0]),
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


def table(logs: str, scripts: list[str], lengths: list[int], rates: list[str], seeds: list[int]) -> str:
    """The table of every (script, L, lr, steps) with logs under `logs`; per script, rate and step budget, the noise
    at its longest length over its shortest, paired by seed; and each script's last-10% reward minus the first
    script's, paired by seed."""
    lines = ["| script | L | lr | steps | reward, first 10% | last 10% | peak (10% window) | collapsed runs | "
             "Var log s_i | Var log prod_t w_it | grad cos, halves | clip frac (tokens) | clip frac (seqs) | "
             "reward / 1k tokens | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    found = {}
    for (script, length, lr, steps), per_seed in load(logs, scripts, lengths, rates, seeds).items():
        got = found[script, length, lr, steps] = {s: summary(rows, length) for s, rows in per_seed.items()}
        col = {k: [v[k] for v in got.values()] for k in next(iter(got.values()))}
        lines.append(f"| `{script}` | {length} | {lr} | {steps} | {cell(col['first'])} | {cell(col['last'])} | "
                     f"{cell(col['peak'])} | {int(sum(col['collapsed']))}/{len(got)} | "
                     f"{cell(col['seq_var'], None)} | {cell(col['sum_var'], None)} | {cell(col['cos'])} | "
                     f"{cell(col['clip'])} | {cell(col['clip_seq'])} | {cell(col['per_1k_tokens'], 2)} | "
                     f"{cell(col['wall'], 0)} |")
    if not found:
        raise SystemExit(f"no logs under {logs}: run the experiment first")
    growth = []
    for script, lr, steps in dict.fromkeys((k[0], k[2], k[3]) for k in found):
        have = sorted(length for length in lengths if (script, length, lr, steps) in found)
        if len(have) < 2:
            continue
        short, long = found[script, have[0], lr, steps], found[script, have[-1], lr, steps]
        both = [s for s in seeds if s in short and s in long]
        for key, what in (("sum_var", "Var log prod_t w_it"), ("seq_var", "Var log s_i")):
            ratios = [long[s][key] / short[s][key] for s in both if short[s][key] > 0]
            if ratios:
                m, sd = mean_std(ratios)
                growth.append(f"- `{script}` lr {lr}, {steps} steps: {what} at L = {have[-1]} over L = {have[0]}, "
                              "by seed: " + ", ".join(f"{r:.2f}" for r in ratios)
                              + f" (mean {m:.2f}" + (f" ± {sd:.2f})" if len(ratios) > 1 else ")"))
    paired = []  # every other script against the first asked for, at the same (L, lr, steps) and seed
    for (script, length, lr, steps), got in found.items():
        base = found.get((scripts[0], length, lr, steps), {})
        if script != scripts[0] and (both := [s for s in seeds if s in got and s in base]):
            d = [got[s]["last"] - base[s]["last"] for s in both]
            paired.append(f"- `{script}` minus `{scripts[0]}`, L = {length}, lr {lr}, {steps} steps: reward over the "
                          "last 10%, by seed: " + ", ".join(f"{x:+.3f}" for x in d) + f" ({cell(d)})")
    return "\n".join(lines) + ("\n\nGrowth with length, paired by seed:\n" + "\n".join(growth) if growth else "") + (
        f"\n\nEach script paired by seed with `{scripts[0]}` (a seed's prompts and first samples are the same):\n"
        + "\n".join(paired) if paired else "")


NOISE = {"sum_var": "Var log prod_t w_it (mean over steps)", "seq_var": "Var log s_i (mean over steps)",
         "cos": "grad cos between a minibatch's halves"}


def plot(runs: dict, path: str) -> bool:
    """One reward panel per (lr, steps): each script (colour) at each L (line style), the 10%-window moving mean of
    the reward, mean over seeds, band min-max; then the noise measures against L, mean ± std over seeds, one line
    per script (colour) and (lr, steps) (marker). False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scripts = list(dict.fromkeys(k[0] for k in runs))
    lengths = sorted({k[1] for k in runs})
    budgets = list(dict.fromkeys((k[2], k[3]) for k in runs))
    colour = lambda script: f"C{scripts.index(script) % 10}"  # noqa: E731
    fig, axes = plt.subplots(1, len(budgets) + len(NOISE), figsize=(4.8 * (len(budgets) + len(NOISE)), 4.8))
    for ax, (lr, steps) in zip(axes, budgets):
        for (script, length, lr_, steps_), per_seed in runs.items():
            if (lr_, steps_) != (lr, steps):
                continue
            curves = [window([x["charts/reward_mean"] for x in rows]) for rows in per_seed.values()]
            n, t = curves[0][0], min(len(c[1]) for c in curves)
            xs, ys = range(n, n + t), [[c[1][i] for c in curves] for i in range(t)]
            style = dict(color=colour(script), linestyle=("-", "--", ":", "-.")[lengths.index(length) % 4])
            ax.plot(xs, [sum(y) / len(y) for y in ys], label=f"{script[:-3]} L={length}", **style)
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15, color=style["color"])
        ax.set(xlabel="step", title=f"reward, {n}-step moving mean; lr {lr}, {steps} steps")
        ax.legend(fontsize=7)
    for ax, (key, label) in zip(axes[len(budgets):], NOISE.items()):
        for (script, lr, steps) in dict.fromkeys((k[0], k[2], k[3]) for k in runs):
            have = [length for length in lengths if (script, length, lr, steps) in runs]
            got = [[summary(rows, length)[key] for rows in runs[script, length, lr, steps].values()]
                   for length in have]
            got = [[x for x in g if math.isfinite(x)] for g in got]
            ms = [mean_std(g) if g else (math.nan, math.nan) for g in got]
            ax.errorbar(have, [m for m, _ in ms], [0 if math.isnan(s) else s for _, s in ms], capsize=3,
                        color=colour(script), marker="os^vD"[budgets.index((lr, steps)) % 5],
                        label=f"{script[:-3]}, lr {lr}, {steps} steps")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(x) for x in lengths])
        if key != "cos":
            ax.set_yscale("log")
        ax.set(xlabel="L (completion tokens)", title=label)
        ax.legend(fontsize=7)
    fig.suptitle("The length lab: mean over seeds (band min-max; bars ± sample std)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main():
    args = tyro.cli(Args)
    t0 = time.time()
    scripts, lengths, rates, seeds = grid(args)
    runs, logs = os.path.join(args.out, "runs"), os.path.join(args.out, "logs")
    if not args.table_only:
        os.makedirs(runs, exist_ok=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
        todo = pending(args, logs)
        if args.skip_done:
            print(f"  --skip-done: {len(scripts) * len(lengths) * len(rates) * len(seeds) - len(todo)} runs there "
                  f"already, {len(todo)} to run", flush=True)
        run_kept(runs, logs, [(run_name(script, length, lr, args.steps), s, command(script, length, lr, args))
                              for script, length, lr, s in todo], args.workers)
    what = ("the table rebuilt from the logs under logs/" if args.table_only
            else f"{time.time() - t0:.0f} s, {args.workers} runs at a time")
    report = (f"`python experiments/length_runs.py {shlex.join(sys.argv[1:])}`: seeds {seeds}, {what}. Mean ± sample "
              f"std (ddof 1) over seeds; the noise columns are means over steps.\n\n"
              f"{table(logs, scripts, lengths, rates, seeds)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    if not plot(load(logs, scripts, lengths, rates, seeds), os.path.join(args.out, "length.png")):
        print("matplotlib is not installed: table only, no plot")
    print(report)


if __name__ == "__main__":
    main()
