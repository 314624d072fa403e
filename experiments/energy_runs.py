"""Energy on frequent tokens (DFPO arXiv:2604.13088, eq. 24) inside real-model runs (issue 35 item 5): GSPO and DFPO
on SmolLM2-135M-Instruct with real_model_runs.py's task and budget, each logging eq. 24 of its own loss at every
step (`--energy-every 1 --energy-rows 2`: exact per-token gradient norms, energy.py, on the first 2 completions
with a gradient of the step's first micro-batch that has any, bucketed by frequency rank in the step's completions).

DFPO's prediction (sec. 6): its in-group transform lowers the Energy on high-frequency tokens. At step 1 both
objectives see the same weights and samples and give every token the same coefficient (s_i = 1 on the first
minibatch, and DFPO's transform is the identity when sum_i A_i = 0), so where both measure on the first minibatch
their step-1 numbers must agree: the check that the measurement is the same on both sides. At step 8 they differ
through the policies they trained (and, on a later minibatch, through the clip and the transform).

    python tools/real_model.py                 # the model folder, once
    python experiments/energy_runs.py          # gspo, dfpo x 3 seeds, two at a time
    python experiments/energy_runs.py --table-only
    python experiments/energy_runs.py --minibatch last   # measured on each step's last minibatch: {out}/last

Each run's metrics.jsonl, samples.jsonl and args.json are kept under {out}/logs/ (its checkpoint is deleted).
"""
import os
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, by_seed, exp_name, fmt, read_rows  # noqa: E402
import real_model_runs  # noqa: E402
from real_model_runs import BUDGET, run_and_report  # noqa: E402

ENERGY = ["--energy-every", "1", "--energy-rows", "2"]
COMMANDS = {"gspo": ["gspo.py", *ENERGY], "dfpo": ["dfpo.py", *ENERGY]}
SHARES = {"energy/top5": "top 5 tokens", "energy/rank5-20": "ranks 5-20", "energy/rest": "the rest"}


@dataclass
class Args(real_model_runs.Args):  # the same flags, another folder
    out: str = os.path.join(ROOT, "experiments", "results", "real_model_energy")
    """where the data, runs, logs/ and table.md go ({out}/last with --minibatch last)"""
    minibatch: Literal["first", "last"] = "first"
    """--energy-minibatch: 'first' (from the step's first minibatch on, where GSPO and DFPO give every token the
    same coefficient) or 'last' (the step's last, where the ratios have moved and the clip acts)"""


def table(logs: str, seeds: list[int]) -> str:
    """One row an objective and step (1, the mean over steps 2-8 of each seed, 8): each share's mean ± sample std
    over the seeds that measured it (a step whose groups were all flat has no gradient, so no Energy: counted in the
    seeds column), with the tokens measured a step and their cost; the held-out accuracy at step 8 beside it. Then,
    paired by seed (the same data order, the same step-1 samples), DFPO's top-5 share minus GSPO's over steps 2-8."""
    lines = ["| objective | step | seeds measured | " + " | ".join(f"Energy, {v}" for v in SHARES.values()) +
             " | tokens measured a step | s a token | held-out accuracy, step 8 |",
             "|---|---|---|" + "---|" * (len(SHARES) + 3)]
    later = {}  # (objective, seed) -> each share's mean over steps 2-8 where measured
    for name in COMMANDS:
        runs = {s: read_rows(p, ("step",)) for s in seeds
                if os.path.exists(p := os.path.join(logs, f"{exp_name(name)}__{s}", "metrics.jsonl"))}
        acc = [r[k] for rows in runs.values() for r in rows if r["step"] == 8 for k in r if k.startswith("eval/avg@")]
        for label, steps in (("1", {1}), ("2-8, mean a seed", set(range(2, 9))), ("8", {8})):
            got = []  # a seed's rows (its measured steps), averaged
            for s, rows in runs.items():
                m = [r for r in rows if r["step"] in steps and r.get("energy/tokens")]
                if m:
                    got.append({k: sum(r[k] for r in m) / len(m) for k in [*SHARES, "energy/tokens"]} |
                               {"cost": sum(r["energy/seconds"] for r in m) / sum(r["energy/tokens"] for r in m)})
                    if len(steps) > 1:
                        later[name, s] = got[-1]
            cells = [fmt([r[k] for r in got]) if got else "-" for k in SHARES]
            lines.append(f"| {name} | {label} | {len(got)} of {len(runs)} | " + " | ".join(cells) +
                         f" | {fmt([r['energy/tokens'] for r in got], 0) if got else '-'} | "
                         f"{fmt([r['cost'] for r in got], 2) if got else '-'} | "
                         f"{fmt(acc) if label == '8' and acc else ''} |")
    pairs = [(s, later["dfpo", s]["energy/top5"] - later["gspo", s]["energy/top5"]) for s in seeds
             if ("dfpo", s) in later and ("gspo", s) in later]
    if pairs:
        lines.append(f"\nDFPO minus GSPO, top-5 share over steps 2-8, paired by seed: {by_seed(pairs)}")
    return "\n".join(lines)


def main():
    args = tyro.cli(Args)
    commands = COMMANDS
    if args.minibatch == "last":
        args.out = os.path.join(args.out, "last")
        commands = {name: [*flags, "--energy-minibatch", "last"] for name, flags in COMMANDS.items()}
    run_and_report(args, "energy_runs.py", commands, BUDGET,
                   f"`{' '.join(BUDGET + ENERGY)}` (--energy-minibatch {args.minibatch}) on "
                   f"{os.path.basename(args.model)}; mean ± sample std (ddof 1) over the seeds that measured it.",
                   table)


if __name__ == "__main__":
    main()
