"""Each script with its defaults on the built-in task (200 steps, evaluation every 50), on several seeds, as the
README's "Measured on the built-in task" table: mean ± sample std over the seeds, read from each run's
metrics.jsonl.

One seed is bitwise repeatable on one machine, not across CPUs (float rounding differs and RL amplifies it), so
the table gives the spread over seeds, and only differences larger than it mean anything.

    python experiments/default_runs.py                 # 5 commands x 3 seeds, two at a time: ~30 min on 2 cores
    python experiments/default_runs.py --table-only    # the table again from the runs already there, running nothing
"""
import glob
import os
import shutil
import sys
import time
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import (ROOT, by_seed, exp_name, fmt, jitter2, metrics, only_commands, run_jobs, sci,  # noqa: E402
                          step_rows)

COMMANDS = {  # gspo_token.py with its default A_it = A_i is gspo.py to the last digit (tests/test_gspo_token.py)
    "gspo.py": ["gspo.py"],
    "grpo.py": ["grpo.py"],
    "dfpo.py": ["dfpo.py"],
    "dfpo.py --clip-gated": ["dfpo.py", "--clip-gated"],
    "dfpo.py --length-aware": ["dfpo.py", "--length-aware"],
    "cispo.py": ["cispo.py"],
    "sapo.py": ["sapo.py"],
    "gmpo.py": ["gmpo.py"],
    "vespo.py": ["vespo.py"],
    # the objectives issue's flags with TRL's suggested values (docs/objectives.md, docs/algorithms.md)
    "gspo.py --luspo": ["gspo.py", "--luspo"],
    "grpo.py --delta 4": ["grpo.py", "--delta", "4"],
    "grpo.py --baseline leave-one-out --scale-rewards none": [
        "grpo.py", "--baseline", "leave-one-out", "--scale-rewards", "none"],
    "grpo.py --off-policy-mask 0.5": ["grpo.py", "--off-policy-mask", "0.5"],
    "grpo.py --gen-mode engine": ["grpo.py", "--gen-mode", "engine"],
    "grpo.py --gen-mode engine --rollout-is-cap 2": ["grpo.py", "--gen-mode", "engine", "--rollout-is-cap", "2"],
    "grpo.py --gen-mode engine --rollout-is-mode token-mask --rollout-is-min 0.5 --rollout-is-cap 2": [
        "grpo.py", "--gen-mode", "engine", "--rollout-is-mode", "token-mask", "--rollout-is-min", "0.5",
        "--rollout-is-cap", "2"],
    "grpo.py --gen-mode engine --rollout-is-mode sequence-truncate --rollout-is-cap 3": [
        "grpo.py", "--gen-mode", "engine", "--rollout-is-mode", "sequence-truncate", "--rollout-is-cap", "3"],
    "grpo.py --gen-mode engine --rollout-is-mode sequence-mask --rollout-is-cap 3": [
        "grpo.py", "--gen-mode", "engine", "--rollout-is-mode", "sequence-mask", "--rollout-is-cap", "3"],
    "grpo.py --top-entropy-quantile 0.2": ["grpo.py", "--top-entropy-quantile", "0.2"],
    "gspo.py --top-entropy-quantile 0.2": ["gspo.py", "--top-entropy-quantile", "0.2"],
    "grpo.py --reward common:math_reward --reward common:length_penalty": [
        "grpo.py", "--reward", "common:math_reward", "--reward", "common:length_penalty"],
    "grpo.py --reward common:math_reward --reward common:length_penalty --multi-objective-aggregation "
    "normalize-then-sum": ["grpo.py", "--reward", "common:math_reward", "--reward", "common:length_penalty",
                           "--multi-objective-aggregation", "normalize-then-sum"],
    "gspo.py --gen-mode engine --rollout-is-cap 3 --rollout-is-mode sequence-mask": [
        "gspo.py", "--gen-mode", "engine", "--rollout-is-cap", "3", "--rollout-is-mode", "sequence-mask"],
    "gmpo.py --gen-mode engine --rollout-is-cap 2": ["gmpo.py", "--gen-mode", "engine", "--rollout-is-cap", "2"],
    # LoRA (README, Scaling): every linear layer of the decoder, rank 16 of the tiny model's 128, a 4x learning rate,
    # at temperature 0.3 (at 1 the tiny model's frozen random LM head caps a token's probability near 11%), next to
    # full fine-tuning at the same temperature
    "gspo.py --temperature 0.3": ["gspo.py", "--temperature", "0.3"],
    "gspo.py --temperature 0.3 --lora-rank 16 --lora-alpha 32 --learning-rate 2e-3": [
        "gspo.py", "--temperature", "0.3", "--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "2e-3"],
    "gspo.py --temperature 0.5": ["gspo.py", "--temperature", "0.5"],
    "gspo.py --temperature 0.5 --lora-rank 16 --lora-alpha 32 --learning-rate 5e-3": [
        "gspo.py", "--temperature", "0.5", "--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "5e-3"],
    "gspo.py --temperature 0.5 --lora-rank 16 --lora-alpha 32 --learning-rate 2e-3": [
        "gspo.py", "--temperature", "0.5", "--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "2e-3"],
}

STEP_KEYS = ("charts/truncated_frac", "losses/shared_coef", "losses/clipfrac", "perf/wall_time")  # the table's

@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "default_runs")
    """where the runs and table.md go (the runs of the commands run are replaced; the table has every command
    whose runs are there)"""
    seeds: int = 3
    """seeds per command (1, 2, ...)"""
    workers: int = 2
    """runs at once, one CPU thread each"""
    only: str | None = None
    """comma-separated command names to run (default: all); the others' earlier runs stay in the table"""
    table_only: bool = False
    """run nothing: rebuild table.md from the runs already under {out}/runs"""
    pair_with: str = "grpo.py"
    """under the table, every other command minus this one, paired by seed (they share each seed's data order and
    first rollout): the reward over the last 10% of steps and the held-out avg@8 at the last step"""


def last_reward(rows: list[dict]) -> float:
    """The mean reward over the last 10% of a run's steps (at least one)."""
    r = [x["charts/reward_mean"] for x in rows if "charts/reward_mean" in x]
    n = max(1, len(r) // 10)
    return sum(r[-n:]) / n


def paired_lines(runs: str, present: list[str], seeds: list[int], base: str) -> list[str]:
    """Each command of `present` other than `base` minus `base`, seed by seed (by_seed): the last-10% reward and
    the last held-out avg@8. None when `base` has no runs."""
    if base not in present:
        return []
    lines = []
    base_rows = {s: metrics(runs, base, s) for s in seeds}
    for name in present:
        if name == base:
            continue
        pairs = [(s, metrics(runs, name, s), base_rows[s]) for s in seeds]
        reward = by_seed([(s, last_reward(a) - last_reward(b)) for s, a, b in pairs])
        held = by_seed([(s, [x["eval/avg@8"] for x in a if "eval/avg@8" in x][-1]
                         - [x["eval/avg@8"] for x in b if "eval/avg@8" in x][-1]) for s, a, b in pairs])
        lines.append(f"- `{name}` minus `{base}`: reward, last 10%: {reward}; held-out avg@8, last step: {held}")
    return lines


def main():
    args = tyro.cli(Args)
    t0 = time.time()
    wanted = only_commands(args.only, COMMANDS)
    runs = os.path.join(args.out, "runs")
    seeds = list(range(1, args.seeds + 1))
    if not args.table_only:
        for name in wanted:
            for path in glob.glob(os.path.join(runs, f"{exp_name(name)}__*")):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.makedirs(runs, exist_ok=True)
        jobs = [(f"{name} seed {s}", [*COMMANDS[name], "--seed", str(s), "--exp-name", exp_name(name),
                                      "--output-dir", runs], os.path.join(runs, f"{exp_name(name)}__{s}.log"))
                for name in wanted for s in seeds]
        run_jobs(jobs, args.workers)
    lines = ["| command | reward, first 10% of steps | reward, last 10% | held-out avg@8, step 0 | avg@8, last step "
             "| truncated fraction, last 10% | Jitter2 (eq. 20) | shared-token coef. (eq. 72), mean over steps "
             "| clip fraction (tokens) | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    present = [n for n in COMMANDS if glob.glob(os.path.join(runs, f"{exp_name(n)}__*", "metrics.jsonl"))]
    if not present:
        raise SystemExit(f"no runs under {runs}")
    for name in present:
        cols = {k: [] for k in ("first", "last", "eval0", "eval1", "cut", "jitter", "shared", "clip", "wall")}
        for s in seeds:
            rows = metrics(runs, name, s)
            steps = step_rows(rows, STEP_KEYS, f"{name!r} seed {s} under {runs}")
            evals = [r["eval/avg@8"] for r in rows if "eval/avg@8" in r]
            n = max(1, len(steps) // 10)
            r = [x["charts/reward_mean"] for x in steps]
            cols["first"].append(sum(r[:n]) / n)
            cols["last"].append(sum(r[-n:]) / n)
            cols["eval0"].append(evals[0])
            cols["eval1"].append(evals[-1])
            cols["cut"].append(sum(x["charts/truncated_frac"] for x in steps[-n:]) / n)
            cols["jitter"].append(jitter2(rows, f"{name!r} seed {s} under {runs}"))
            cols["shared"].append(sum(x["losses/shared_coef"] for x in steps) / len(steps))
            cols["clip"].append(sum(x["losses/clipfrac"] for x in steps) / len(steps))
            cols["wall"].append(steps[-1]["perf/wall_time"])
        lines.append(f"| `{name}` | {fmt(cols['first'])} | {fmt(cols['last'])} | {fmt(cols['eval0'])} | "
                     f"{fmt(cols['eval1'])} | {fmt(cols['cut'])} | {fmt(cols['jitter'])} | {sci(cols['shared'])} | {fmt(cols['clip'])} | "
                     f"{fmt(cols['wall'], 0)} |")
    paired = paired_lines(runs, present, seeds, args.pair_with)
    table = "\n".join(lines) + ("\n\nPaired by seed:\n" + "\n".join(paired) if paired else "")
    what = ("the table rebuilt from the runs under runs/" if args.table_only
            else f"{time.time() - t0:.0f} s, {args.workers} runs at a time")
    report = (f"`python experiments/default_runs.py {' '.join(sys.argv[1:])}`: seeds {seeds}, {what}. "
              f"Mean ± sample std (ddof 1) over seeds.\n\n{table}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
