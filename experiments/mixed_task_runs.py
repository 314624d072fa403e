"""A learning curve beyond addition (issue 53 item 3): SmolLM2-135M-Instruct (tools/real_model.py) on a mixed
arithmetic task, GSPO and GRPO, 3 seeds, held-out accuracy every 10 steps.

The task: four forms of a pair a > b from 10..99, each through the model's own ChatML template,
    "What is a + b?" and "What is a - b?" (the addition's order drawn),
    "Ann has a apples and gets b more. How many apples does Ann have now?" (a + b),
    "Ann has a apples and gives b away. How many apples does Ann have left?" (a - b),
each ending "Put the final answer in \\boxed{}.". HELD_OUT pairs are kept out of training in every form; the
held-out set is one row a held-out pair, the forms in turn, so it has as many of each. The built-in math grader
scores 1 when the number a completion states equals the answer.

    python tools/real_model.py                          # the model folder, once
    python experiments/mixed_task_runs.py               # 2 commands x 3 seeds, two at a time
    python experiments/mixed_task_runs.py --table-only  # table.md and mixed.png from the logs under logs/
    python experiments/mixed_task_runs.py --task-only data   # data/train.jsonl and data/test.jsonl alone

Each run's metrics.jsonl, samples.jsonl and eval_samples.jsonl (every held-out completion at each evaluation) are
kept under {out}/logs/; its checkpoint is deleted.
"""
import os
import random
import sys
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, by_seed, exp_name, fmt, read_rows  # noqa: E402
import real_model_runs  # noqa: E402
from real_model_runs import run_and_report, write_task  # noqa: E402

HELD_OUT = 64  # pairs kept out of training in all four forms; the held-out set is one row each
ASK = " Put the final answer in \\boxed{}."
NAMES = ["Ann", "Ben", "Maria", "Tom", "Lena", "Omar", "Sara", "Jack"]
THINGS = ["apples", "marbles", "stickers", "books", "coins", "cards", "pencils", "shells"]
FORMS = ("add", "sub", "word add", "word sub")
STEPS, EVAL_EVERY = 40, 10
# the lab's real-model recipe (real_model_runs.BUDGET) for 40 steps: 80 AdamW steps, so half its learning rate
BUDGET = ["--num-steps", str(STEPS), "--prompts-per-rank", "4", "--group-size", "8", "--num-minibatches", "2",
          "--max-new-tokens", "40", "--temperature", "0.7", "--learning-rate", "1e-5",
          "--eval-every", str(EVAL_EVERY), "--eval-limit", str(HELD_OUT), "--eval-k", "1",
          "--eval-temperature", "0.001", "--log-samples", "5", "--log-eval-samples", str(HELD_OUT)]
BUDGET_WHY = (
    f"Budget: {STEPS} steps x 4 prompts x G = 8 completions of at most 40 new tokens, 2 minibatches a step "
    f"({2 * STEPS} AdamW steps), lr 1e-5 (the lab's 2e-5 was for 16 AdamW steps), sampling at temperature 0.7; "
    f"held-out accuracy greedy (temperature 0.001, one sample a prompt) on all {HELD_OUT} held-out rows every "
    f"{EVAL_EVERY} steps.")
COMMANDS = {"gspo": ["gspo.py"], "grpo": ["grpo.py"]}


@dataclass
class Args(real_model_runs.Args):  # the same flags, another folder
    out: str = os.path.join(ROOT, "experiments", "results", "mixed_task")
    """where the data, runs, logs/ and table.md go"""


def row(form: str, a: int, b: int, rng: random.Random) -> dict:
    """One prompt of the form for the pair a > b, with its answer and its form."""
    if form == "add":
        x, y = (a, b) if rng.random() < 0.5 else (b, a)
        text = f"What is {x} + {y}?"
    elif form == "sub":
        text = f"What is {a} - {b}?"
    else:
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        text = (f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
                if form == "word add" else
                f"{name} has {a} {thing} and gives {b} away. How many {thing} does {name} have left?")
    return {"prompt": text + ASK, "answer": str(a + b if form.endswith("add") else a - b), "form": form}


def mixed_task(held_out: int = HELD_OUT, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """-> (train rows, held-out rows): every pair a > b in 10..99 in all four forms for training, except the
    held_out pairs (drawn, seeded), which give one row each to the held-out set, the forms in turn."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(11, 100) for b in range(10, a)]
    kept = rng.sample(pairs, held_out)
    test = [row(FORMS[i % len(FORMS)], a, b, rng) for i, (a, b) in enumerate(kept)]
    kept = set(kept)
    train = [row(form, a, b, rng) for a, b in pairs if (a, b) not in kept for form in FORMS]
    rng.shuffle(train)
    return train, test


def load(logs: str, name: str, seed: int) -> dict | None:
    """One run's evaluations {step: accuracy}, its accuracy by form {step: {form: accuracy}} (eval_samples.jsonl's
    rows, each matched to its form by prompt), its training reward a step and the fraction of its groups with no
    reward spread (zero advantage: no gradient) a step."""
    folder = os.path.join(logs, f"{exp_name(name)}__{seed}")
    if not os.path.exists(os.path.join(folder, "metrics.jsonl")):
        return None
    rows = read_rows(os.path.join(folder, "metrics.jsonl"), ("step",))
    evals = {r["step"]: r["eval/avg@1"] for r in rows if "eval/avg@1" in r}
    form_of = {r["prompt"]: r["form"] for r in mixed_task()[1]}
    by_form = {}
    path = os.path.join(folder, "eval_samples.jsonl")
    for r in read_rows(path, ("step", "prompt", "reward")) if os.path.exists(path) else []:
        hits = by_form.setdefault(r["step"], {}).setdefault(form_of[r["prompt"]], [])
        hits.append(r["reward"])
    steps = [r for r in rows if "charts/reward_mean" in r]
    return {"evals": evals, "by_form": {s: {f: sum(h) / len(h) for f, h in d.items()} for s, d in by_form.items()},
            "reward": [r["charts/reward_mean"] for r in steps],
            "no_spread": [r["charts/zero_adv_group_frac"] for r in steps if "charts/zero_adv_group_frac" in r]}


def table(logs: str, seeds: list[int]) -> str:
    """Held-out accuracy at each evaluation, mean ± sample std over seeds; the change from step 0 paired by seed;
    the accuracy by form at step 0 and the last evaluation; the training reward over the first and last quarter of
    the steps (4 prompts a step: one step's reward swings with its prompts' forms), and the groups with no reward
    spread, mean over steps."""
    runs = {name: {s: r for s in seeds if (r := load(logs, name, s))} for name in COMMANDS}
    runs = {name: rs for name, rs in runs.items() if rs}
    if not runs:
        return "no logs"
    eval_steps = sorted(set.intersection(*(set(r["evals"]) for rs in runs.values() for r in rs.values())))
    lines = ["| objective | seeds | " + " | ".join(f"held-out, step {s}" for s in eval_steps)
             + " | change, last - step 0 | reward, first quarter of steps | reward, last quarter | groups with "
             "no reward spread |", "|---|---" + "|---" * len(eval_steps) + "|---|---|---|---|"]
    quarter = lambda xs: max(1, len(xs) // 4)  # noqa: E731
    for name, rs in runs.items():
        cells = [fmt([r["evals"][s] for r in rs.values()]) for s in eval_steps]
        change = [r["evals"][eval_steps[-1]] - r["evals"][eval_steps[0]] for r in rs.values()]
        first = [sum(r["reward"][:quarter(r["reward"])]) / quarter(r["reward"]) for r in rs.values()]
        last = [sum(r["reward"][-quarter(r["reward"]):]) / quarter(r["reward"]) for r in rs.values()]
        flat = [sum(r["no_spread"]) / len(r["no_spread"]) for r in rs.values() if r["no_spread"]]
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells)
                     + f" | {fmt(change)} | {fmt(first)} | {fmt(last)} | {fmt(flat) if flat else 'n/a'} |")
    lines += ["", "Held-out accuracy by form (16 rows each), step 0 → last evaluation, mean ± std over seeds:", "",
              "| objective | " + " | ".join(FORMS) + " |", "|---" + "|---" * len(FORMS) + "|"]
    for name, rs in runs.items():
        s0, s1 = eval_steps[0], eval_steps[-1]
        cells = [f"{fmt([r['by_form'][s0][f] for r in rs.values()], 2)} → "
                 f"{fmt([r['by_form'][s1][f] for r in rs.values()], 2)}"
                 if all(s0 in r["by_form"] and s1 in r["by_form"] for r in rs.values()) else "" for f in FORMS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, rs in runs.items():
        lines.append(f"- {name}, held-out change (last - step 0) by seed: "
                     + by_seed([(s, r["evals"][eval_steps[-1]] - r["evals"][eval_steps[0]]) for s, r in rs.items()]))
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        both = [s for s in ra if s in rb]
        lines.append(f"- {b} minus {a}, held-out at step {eval_steps[-1]}, paired by seed: "
                     + by_seed([(s, rb[s]["evals"][eval_steps[-1]] - ra[s]["evals"][eval_steps[-1]]) for s in both]))
    return "\n".join(lines)


def plot(logs: str, seeds: list[int], path: str) -> bool:
    """The learning curves: held-out accuracy at each evaluation, overall and by form, mean over seeds with a
    min-max band, an objective a colour; False (no file) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = {name: [r for s in seeds if (r := load(logs, name, s))] for name in COMMANDS}
    fig, axes = plt.subplots(1, 1 + len(FORMS), figsize=(4 * (1 + len(FORMS)), 3.4), sharey=True)
    for ax, form in zip(axes, (None, *FORMS)):
        for name, rs in runs.items():
            if not rs:
                continue
            steps = sorted(set.intersection(*(set(r["evals"] if form is None else r["by_form"]) for r in rs)))
            ys = [[r["evals"][t] if form is None else r["by_form"][t][form] for r in rs] for t in steps]
            ax.plot(steps, [sum(y) / len(y) for y in ys], marker="o", label=f"{name} ({len(rs)} seeds)")
            ax.fill_between(steps, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2)
        ax.set_title("held-out accuracy, all 64" if form is None else f"{form} (16 rows)", fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, mixed arithmetic: greedy held-out accuracy, mean over seeds, band min-max",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    args = tyro.cli(Args)
    if args.task_only:
        print(*write_task(args.task_only, mixed_task))
        return
    what = (f"SmolLM2-135M-Instruct ({os.path.basename(args.model)}) on the mixed task ({HELD_OUT} held-out pairs, "
            f"never trained on in any form). {BUDGET_WHY} Every command: `{' '.join(BUDGET)}`. Mean ± sample std "
            "(ddof 1) over seeds.")
    run_and_report(args, "mixed_task_runs.py", COMMANDS, BUDGET, what, table, task=mixed_task)
    if not plot(os.path.join(args.out, "logs"), list(range(1, args.seeds + 1)), os.path.join(args.out, "mixed.png")):
        print("matplotlib is not installed: table only, no plot")


if __name__ == "__main__":
    main()
