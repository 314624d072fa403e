"""The episodes lab (docs/lab.md, Part 7): GRPO, GSPO and GSPO-token, with and without per-turn credit, on the
built-in multi-turn task (grouprl/tool_task.py: Secret, --model tiny-tools), learnt from a random init on one CPU
thread. Each run's every step logs the answer's reward (rewards/answer_reward: the last turn begins with the box's
secret, which only the tool's reply tells), the call's credit (rewards/reply_credit), their sum and the tool calls
an episode (tools/call_frequency). Seeds are paired: a seed is the same initial model and the same prompts for every
script, so the scripts differ by their objective alone.

    python experiments/episode_runs.py                      # 3 configurations x 3 seeds, one run at a time
    python experiments/episode_runs.py --steps 40 --configs grpo,gspo --skip-done
    python experiments/episode_runs.py --table-only         # table.md and episodes.png again from the logs

Each finished run's metrics.jsonl and args.json are kept under {out}/logs/{name}__n{steps}__{seed}/ (small,
committed) and its run folder deleted; --skip-done runs only those whose logs are missing.
"""
import math
import os
import sys
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, fmt, read_rows, run_jobs  # noqa: E402
from real_model_runs import keep_logs  # noqa: E402

TASK = ["--model", "tiny-tools", "--environment", "grouprl/tool_task.py:Secret",
        "--dataset", "experiments/data/secret_digit.jsonl", "--reward", "grouprl.tool_task:answer_reward",
        "--reward", "grouprl.tool_task:reply_credit", "--max-tool-calls", "1"]
CONFIGS = {  # name: the script and its own flags (each at its paper's defaults otherwise)
    "grpo": ["grpo.py"],
    "gspo": ["gspo.py"],
    "gspo_token": ["gspo_token.py"],
    "gspo_token_turn1": ["gspo_token.py", "--turn-credit", "1"],
}
CURVES = {"answer": "rewards/answer_reward/mean", "credit": "rewards/reply_credit/mean",
          "reward": "charts/reward_mean", "calls": "tools/call_frequency"}


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "episodes")
    """where the logs (logs/), table.md and episodes.png go (runs/ holds the runs in progress)"""
    configs: str = "grpo,gspo,gspo_token,gspo_token_turn1"
    """comma-separated configurations of CONFIGS"""
    seeds: int = 3
    """seeds per configuration (1, 2, ...)"""
    steps: int = 80
    """RL steps a run (in the log's name: budgets are kept apart)"""
    prompts_per_rank: int = 8
    """prompts a step (x G = 8 episodes)"""
    max_new_tokens: int = 34
    """the episode's budget: both model turns and the tool turn between them (28 tokens), so a turn of a call and
    its end leaves the answer 4 tokens"""
    learning_rate: float = 2e-3
    """AdamW's rate, the same for every script"""
    workers: int = 1
    """runs at once, one CPU thread each"""
    skip_done: bool = False
    """run only the (configuration, seed) pairs whose logs are not under {out}/logs yet"""
    table_only: bool = False
    """run nothing: rebuild table.md and episodes.png from the logs under {out}/logs"""


def run_name(name: str, steps: int) -> str:
    return f"{name}__n{steps}"


def command(name: str, args) -> list[str]:
    script, *own = CONFIGS[name]
    return [script, *TASK, *own, "--max-new-tokens", str(args.max_new_tokens),
            "--learning-rate", str(args.learning_rate), "--prompts-per-rank", str(args.prompts_per_rank),
            "--num-steps", str(args.steps), "--eval-every", "0", "--log-samples", "4", "--save-every", "0"]


def done(logs: str, name: str, seed: int) -> bool:
    return all(os.path.isfile(os.path.join(logs, f"{name}__{seed}", f)) for f in ("metrics.jsonl", "args.json"))


def configs(args) -> list[str]:
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        raise SystemExit(f"--configs {','.join(unknown)}: unknown (choose from {', '.join(CONFIGS)})")
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit("--seeds and --steps: 1 or more")
    return names


def curves(logs: str, names: list[str], seeds: list[int], steps: int) -> dict:
    """{name: {seed: {curve: [a value a step]}}} of the logs there."""
    found = {}
    for name in names:
        for s in seeds:
            path = os.path.join(logs, f"{run_name(name, steps)}__{s}", "metrics.jsonl")
            if os.path.isfile(path):
                rows = [r for r in read_rows(path) if "charts/reward_mean" in r]
                found.setdefault(name, {})[s] = {k: [r.get(key, math.nan) for r in rows]
                                                 for k, key in CURVES.items()}
    if not found:
        raise SystemExit(f"no logs under {logs} for {steps} steps: run the experiment first")
    return found


def at(curve: list[float], step: int, half: int = 2) -> float:
    """The mean over steps step - half .. step + half (1-based, clipped to the run)."""
    lo, hi = max(0, step - 1 - half), min(len(curve), step + half)
    return sum(curve[lo:hi]) / (hi - lo)


def collapse(reward: list[float]) -> int | None:
    """The first step whose 5-step reward is below 0.1 after a 5-step reward above 0.5 (None: none)."""
    high = False
    for t in range(1, len(reward) + 1):
        high = high or at(reward, t) > 0.5
        if high and at(reward, t) < 0.1:
            return t
    return None


def table(found: dict, steps: int) -> str:
    marks = sorted({1, *range(10, steps + 1, 10), steps})
    lines = [f"Mean ± std over seeds of each quantity averaged over 5 steps around the step ({steps} steps a run).",
             "", "| configuration | seeds | step | answer (`answer_reward`) | call credit (`reply_credit`) | reward "
             "| calls an episode |", "|---|---|---|---|---|---|---|"]
    for name, per_seed in found.items():
        for m in marks:
            cells = [fmt([at(c[k], m) for c in per_seed.values()]) for k in CURVES]
            lines.append(f"| {name} | {len(per_seed)} | {m} | " + " | ".join(cells) + " |")
    lines += ["", "Each run: the answer's peak (a 5-step mean) and its step, the answer and the calls over the last 10 "
              "steps, and its collapse: the first step whose 5-step reward is below 0.1 after one above 0.5 (-: none)"
              ":", "", "| configuration | seed | answer peak (step) | answer, last 10 | calls, last 10 | collapse |",
              "|---|---|---|---|---|---|"]
    for name, per_seed in found.items():
        for s, c in per_seed.items():
            steps = range(1, len(c["answer"]) + 1)
            peak = max(steps, key=lambda t: at(c["answer"], t))
            last = {k: sum(c[k][-10:]) / len(c[k][-10:]) for k in ("answer", "calls")}
            lines.append(f"| {name} | {s} | {at(c['answer'], peak):.3f} ({peak}) | {last['answer']:.3f} | "
                         f"{last['calls']:.2f} | {collapse(c['reward']) or '-'} |")
    base = next(iter(found))
    lines += ["", f"The answer's reward over the last 10 steps, each configuration minus {base}, paired by seed:", ""]
    for name, per_seed in found.items():
        if name == base:
            continue
        diffs = [(s, sum(c["answer"][-10:]) / 10 - sum(found[base][s]["answer"][-10:]) / 10)
                 for s, c in per_seed.items() if s in found[base]]
        lines.append(f"- {name}: " + ", ".join(f"seed {s}: {d:+.3f}" for s, d in diffs)
                     + f" (mean {fmt([d for _, d in diffs])})")
    return "\n".join(lines) + "\n"


def plot(found: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("answer", "answer reward (last turn begins with the secret)"),
              ("reward", "reward (answer + call credit)"), ("calls", "tool calls an episode (cut at 3)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (key, title) in zip(axes, panels):
        for k, (name, per_seed) in enumerate(found.items()):
            color = f"C{k}"
            runs = [c[key] for c in per_seed.values()]
            n = min(len(r) for r in runs)
            for r in runs:
                ax.plot(range(1, n + 1), r[:n], color=color, alpha=0.25, lw=0.8)
            ax.plot(range(1, n + 1), [sum(r[i] for r in runs) / len(runs) for i in range(n)], color=color,
                    lw=2, label=f"{name} (mean of {len(runs)})")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].axhline(0.25, color="gray", ls="--", lw=1, label="a guess after the call (1/4)")
    axes[2].set_ylim(0, 3)  # a collapse can spike to ~9 calls an episode (all rolled back)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Args):
    names, seeds = configs(args), list(range(1, args.seeds + 1))
    logs, runs = os.path.join(args.out, "logs"), os.path.join(args.out, "runs")
    if not args.table_only:
        os.makedirs(runs, exist_ok=True)
        jobs = []
        for s in seeds:  # seed-major: an interrupted experiment has every configuration on its first seeds
            for name in names:
                n = run_name(name, args.steps)
                if args.skip_done and done(logs, n, s):
                    continue
                argv = command(name, args) + ["--seed", str(s), "--exp-name", n, "--output-dir", runs]
                jobs.append((f"{n} seed {s}", argv, os.path.join(runs, f"{n}__{s}.log")))
        run_jobs(jobs, args.workers, after=lambda label: keep_logs(
            runs, logs, label.split(" seed ")[0], int(label.split(" seed ")[1])))
    found = curves(logs, names, seeds, args.steps)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table(found, args.steps))
    plot(found, os.path.join(args.out, "episodes.png"))
    print(open(os.path.join(args.out, "table.md")).read())


if __name__ == "__main__":
    main(tyro.cli(Args))
