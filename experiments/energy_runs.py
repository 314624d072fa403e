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

Each run's metrics.jsonl, samples.jsonl and args.json are kept under {out}/logs/ (its checkpoint is deleted).
"""
import json
import os
import sys
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, exp_name, fmt  # noqa: E402
import real_model_runs  # noqa: E402
from real_model_runs import BUDGET, run_and_report  # noqa: E402

ENERGY = ["--energy-every", "1", "--energy-rows", "2"]
COMMANDS = {"gspo": ["gspo.py", *ENERGY], "dfpo": ["dfpo.py", *ENERGY]}
SHARES = {"energy/top5": "top 5 tokens", "energy/rank5-20": "ranks 5-20", "energy/rest": "the rest"}


@dataclass
class Args(real_model_runs.Args):  # the same flags, another folder
    out: str = os.path.join(ROOT, "experiments", "results", "real_model_energy")
    """where the data, runs, logs/ and table.md go"""


def table(logs: str, seeds: list[int]) -> str:
    """One row an objective and step: each share's mean ± sample std over the seeds that measured it (a step whose
    groups were all flat has no gradient, so no Energy: counted in the seeds column), with the tokens measured and
    their cost; the held-out accuracy at step 8 beside it."""
    lines = ["| objective | step | seeds measured | " + " | ".join(f"Energy, {v}" for v in SHARES.values()) +
             " | tokens measured | s a token | held-out accuracy, step 8 |",
             "|---|---|---|" + "---|" * (len(SHARES) + 3)]
    for name in COMMANDS:
        runs = [[json.loads(line) for line in open(p)] for s in seeds
                if os.path.exists(p := os.path.join(logs, f"{exp_name(name)}__{s}", "metrics.jsonl"))]
        acc = [r[k] for rows in runs for r in rows if r["step"] == 8 for k in r if k.startswith("eval/avg@")]
        for step in (1, 8):
            got = [r for rows in runs for r in rows if r["step"] == step and r.get("energy/tokens")]
            cells = [fmt([r[k] for r in got]) if got else "-" for k in SHARES]
            tokens = [r["energy/tokens"] for r in got]
            cost = [r["energy/seconds"] / r["energy/tokens"] for r in got]
            lines.append(f"| {name} | {step} | {len(got)} of {len(runs)} | " + " | ".join(cells) +
                         f" | {fmt(tokens, 0) if got else '-'} | {fmt(cost, 2) if got else '-'} | "
                         f"{fmt(acc) if step == 8 and acc else ''} |")
    return "\n".join(lines)


def main():
    args = tyro.cli(Args)
    run_and_report(args, "energy_runs.py", COMMANDS, BUDGET,
                   f"`{' '.join(BUDGET + ENERGY)}` on {os.path.basename(args.model)}; mean ± sample std (ddof 1) "
                   "over the seeds that measured it.", table)


if __name__ == "__main__":
    main()
