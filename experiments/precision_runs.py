"""The GSPO paper's precision claim on a real model (issue 36 item 2): the rollout engine in bf16 beside the fp32
trainer on SmolLM2-135M-Instruct (tools/real_model.py), the arithmetic task of real_model_runs.py, GSPO and GRPO
with pi_old recomputed by the trainer or taken from the engine (`--old-logp rollout`), and GRPO with truncated
importance sampling (`--rollout-is-cap 2`); GSPO with an fp32 engine is the control (the engine's kernels alone).

GSPO 2507.18071 (Sec. 5.4, "Benefit of GSPO for RL Infrastructure"): because s_i averages the token log-ratios
over the sequence, GSPO "tolerates the precision mismatch" and can use the inference engine's likelihoods. What
one step with a single minibatch measures, where pi_theta = pi_old and every ratio should be exactly 1: the
variance of the token log-ratios log w_it, the range of the ratio the clip sees (w_it for GRPO, s_i for GSPO) and
the fraction of tokens clipped, and the time a step takes with and without the recomputation pass.

    python tools/real_model.py                        # the model folder, once
    python experiments/precision_runs.py              # 6 configurations x 3 seeds, one step each
    python experiments/precision_runs.py --table-only
    python experiments/precision_runs.py --curves     # 5 configurations x 3 seeds, 8 steps each: reward curves
    python experiments/precision_runs.py --corrections   # the rollout corrections, 5 configurations x 3 seeds
    python experiments/precision_runs.py --corrections --curves   # the same, 8 steps each: reward and clip fraction

--curves: the learning runs' budget (real_model_runs.py: 8 steps, 2 minibatches a step, so later minibatches are
off-policy) without its evaluation, the bf16 engine throughout, into {out}/curves: the reward curve, its Jitter2
(DFPO eq. 20), the clip fraction over steps, and perf/old_logp_s, the seconds of the recomputation pass that
`--old-logp rollout` skips (the time a step saves).

--corrections (issue 51 item 3): GSPO with pi_old recomputed and each of TRL's rollout-correction modes at its
default C_max = 3 (token or sequence ratio pi_old / pi_rollout, truncated or masked), and GSPO with the rollout's
likelihoods as pi_old and OPSM (DeepSeek-V3.2 arXiv 2512.02556 eq. 9, TRL's suggested delta 0.5), the one-step
budget above, into {out}/corrections: the fraction of tokens each truncates or masks, the mismatch it sees (KL and
chi2 of pi_old against pi_rollout, token means), the sequences OPSM drops, the ratio range and clip fraction, beside
the two GSPO rows of the main table (read from {out}/logs).

Each run's metrics.jsonl and args.json are kept under {out}/logs/ (its checkpoint is deleted).
"""
import os
import sys
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, by_seed, exp_name, fmt, read_rows, sci  # noqa: E402
import real_model_runs  # noqa: E402
from real_model_runs import run_and_report  # noqa: E402

# one step, one minibatch: every statistic below is taken where pi_theta = pi_old (the first minibatch)
BUDGET = ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "8", "--num-minibatches", "1",
          "--max-new-tokens", "40", "--temperature", "0.7", "--learning-rate", "2e-5", "--eval-every", "0",
          "--log-samples", "0", "--gen-mode", "engine"]
BF16 = ["--gen-dtype", "bf16"]
COMMANDS = {
    "gspo, fp32 engine, rollout": ["gspo.py", "--gen-dtype", "fp32", "--old-logp", "rollout"],
    "gspo, recomputed": ["gspo.py", *BF16],
    "gspo, rollout": ["gspo.py", *BF16, "--old-logp", "rollout"],
    "grpo, recomputed": ["grpo.py", *BF16],
    "grpo, rollout": ["grpo.py", *BF16, "--old-logp", "rollout"],
    "grpo, recomputed, --rollout-is-cap 2": ["grpo.py", *BF16, "--rollout-is-cap", "2"],
}
# --curves: the learning budget of real_model_runs.py, with no evaluation (in the bf16 engine it would take ~1/3 of
# a run), and the five bf16 configurations
CURVE_BUDGET = [*real_model_runs.BUDGET[:real_model_runs.BUDGET.index("--eval-every")], "--eval-every", "0",
                "--log-samples", "0", "--gen-mode", "engine"]
CURVE_COMMANDS = {name.replace(",", ""): flags for name, flags in COMMANDS.items() if "fp32" not in name}  # --only
# --corrections: TRL's four modes at its default C_max (GRPOConfig.vllm_importance_sampling_cap = 3), and OPSM
CORRECTIONS = {f"gspo, recomputed, {mode} 3": ["gspo.py", *BF16, "--rollout-is-mode", mode, "--rollout-is-cap", "3"]
               for mode in ("token-truncate", "token-mask", "sequence-truncate", "sequence-mask")}
CORRECTIONS["gspo, rollout, OPSM 0.5"] = ["gspo.py", *BF16, "--old-logp", "rollout", "--off-policy-mask", "0.5"]
BASELINES = ["gspo, recomputed", "gspo, rollout"]  # the main table's rows, from its logs
CORRECTION_COLUMNS = {
    "rollout_is/capped_frac": "tokens truncated",
    "rollout_is/masked_frac": "tokens masked",
    "losses/opsm_frac": "sequences dropped (OPSM)",
    "rollout_is/weight_mean": "weight mean",
    "rollout_is/kl": "KL(pi_old, pi_rollout) a token",
    "rollout_is/chi2": "chi2 a token",
    "losses/ratio_min": "ratio min (s_i)",
    "losses/ratio_max": "ratio max (s_i)",
    "losses/clipfrac": "clip fraction (tokens)",
}
COLUMNS = {  # metrics.jsonl key -> column
    "losses/log_ratio_var_first": "Var log w_it",
    "losses/ratio_min": "ratio min (w_it or s_i)",
    "losses/ratio_max": "ratio max",
    "losses/clipfrac": "clip fraction (tokens)",
    "losses/clipfrac_seq": "clip fraction (sequences)",
    "rollout_is/weight_mean": "TIS weight mean",
    "rollout_is/capped_frac": "TIS capped fraction",
    "perf/wall_time": "step s",
}


@dataclass
class Args(real_model_runs.Args):  # the same flags, another folder
    out: str = os.path.join(ROOT, "experiments", "results", "precision")
    """where the data, runs, logs/ and table.md go ({out}/curves with --curves)"""
    curves: bool = False
    """the reward curves: CURVE_COMMANDS for 8 steps (CURVE_BUDGET) instead of one step"""
    corrections: bool = False
    """the rollout corrections: CORRECTIONS for one step (BUDGET), into {out}/corrections (with --curves: 8 steps,
    CURVE_BUDGET, into {out}/corrections/curves)"""


def table(logs: str, seeds: list[int], commands=COMMANDS, columns=COLUMNS, logs_of=None) -> str:
    """One row a configuration: each column's mean ± sample std over the seeds whose logs are there (a row's
    logs under logs_of(name) where given, else under logs)."""
    lines = ["| configuration | seeds | " + " | ".join(columns.values()) + " |", "|---|---" + "|---" * len(columns) + "|"]
    for name in commands:
        where = logs_of(name) if logs_of else logs
        rows = [read_rows(p)[-1] for s in seeds
                if os.path.exists(p := os.path.join(where, f"{exp_name(name)}__{s}", "metrics.jsonl"))]
        if not rows:
            continue
        cells = []
        for key in columns:
            xs = [r[key] for r in rows if r.get(key) is not None]
            digits = 0 if key == "perf/wall_time" else 4
            cells.append("" if not xs else sci(xs) if key in SCI else fmt(xs, digits))
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SCI = ("losses/log_ratio_var_first", "rollout_is/kl", "rollout_is/chi2")  # columns spanning decades


def correction_table(logs: str, seeds: list[int]) -> str:
    """The main table's two GSPO rows (from {out}/logs, beside {out}/corrections) and CORRECTIONS, with
    CORRECTION_COLUMNS; a column a configuration does not log stays empty."""
    main_logs = os.path.join(os.path.dirname(os.path.dirname(logs)), "logs")
    return table(logs, seeds, [*BASELINES, *CORRECTIONS], CORRECTION_COLUMNS,
                 lambda name: main_logs if name in BASELINES else logs)


def curve_table(logs: str, seeds: list[int], commands=None, logs_of=None, extra=None) -> str:
    """One row a configuration, mean ± sample std over seeds: the reward curve (each step's mean over seeds), its
    first and last 2 steps, Jitter2, the clip fraction and Var log w_it on first minibatches averaged over steps,
    and the seconds a step took (steps 2 on: step 1's wall time holds the model's load) and spent recomputing
    pi_old. Then, paired by seed (the same data order and step-1 samples), each configuration's reward over the last
    2 steps minus its objective's recomputed run's. commands: CURVE_COMMANDS unless given, each one's logs under
    logs_of(name) where given; extra {key: column}: more columns, means over steps (empty where a run does not log
    the key), and the clip fraction paired by seed too."""
    extra = extra or {}
    lines = ["| configuration | seeds | reward each step (mean over seeds) | reward, first 2 steps | reward, last 2 "
             "steps | Jitter2 (eq. 20) | clip fraction, mean over steps | Var log w_it, first minibatches | "
             "step s | pi_old pass s (saved by rollout) |" + "".join(f" {c} |" for c in extra.values()),
             "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    last2, clip = {}, {}  # (configuration, seed) -> reward over the last 2 steps, clip fraction over steps
    path = lambda name, s: os.path.join(logs_of(name) if logs_of else logs,  # noqa: E731
                                        f"{exp_name(name)}__{s}", "metrics.jsonl")
    for name in commands or CURVE_COMMANDS:
        found = [s for s in seeds if os.path.exists(path(name, s))]
        runs = [[r for r in read_rows(path(name, s)) if "charts/reward_mean" in r] for s in found]
        if not runs:
            continue
        curve = lambda k: [[r[k] for r in rows] for rows in runs]  # noqa: E731
        avg = lambda k: [sum(c) / len(c) for c in curve(k)]  # noqa: E731
        reward = curve("charts/reward_mean")
        n = min(map(len, reward))
        each = " ".join(f"{sum(c[t] for c in reward) / len(reward):.2f}" for t in range(n))
        wall = [(rows[-1]["perf/wall_time"] - rows[0]["perf/wall_time"]) / (len(rows) - 1) for rows in runs]
        jitter2 = [rows[-1]["charts/reward_jitter2"] for rows in runs]
        last2.update({(name, s): sum(c[-2:]) / 2 for s, c in zip(found, reward)})
        clip.update(zip([(name, s) for s in found], avg("losses/clipfrac")))
        more = "".join(f" {fmt(avg(k), 4) if all(k in r for rows in runs for r in rows) else ''} |" for k in extra)
        lines.append(f"| {name} | {len(runs)} | {each} | {fmt([sum(c[:2]) / 2 for c in reward])} | "
                     f"{fmt([sum(c[-2:]) / 2 for c in reward])} | {fmt(jitter2)} | {fmt(avg('losses/clipfrac'), 4)} | "
                     f"{sci(avg('losses/log_ratio_var_first'))} | {fmt(wall, 0)} | {fmt(avg('perf/old_logp_s'), 1)} |"
                     + more)
    for name in commands or CURVE_COMMANDS:
        base = name.split()[0] + " recomputed"
        pairs = [(s, last2[name, s] - last2[base, s]) for s in seeds if (name, s) in last2 and (base, s) in last2]
        if name != base and pairs:
            lines.append(f"\n{name} minus {base}, reward over the last 2 steps, paired by seed: {by_seed(pairs)}")
            if extra:
                lines.append(f"\n{name} minus {base}, clip fraction over steps, paired by seed: "
                             + by_seed([(s, clip[name, s] - clip[base, s]) for s, _ in pairs]))
    return "\n".join(lines)


# --corrections --curves: GSPO without a correction, recomputed and on the rollout's likelihoods, run beside the
# corrections with the same code (so that each seed's step-1 samples are the same draw), then the corrections
CORRECTION_CURVES = {"gspo recomputed": ["gspo.py", *BF16], "gspo rollout": ["gspo.py", *BF16, "--old-logp", "rollout"],
                     **{name.replace(",", ""): flags for name, flags in CORRECTIONS.items()}}
CURVE_EXTRA = {"rollout_is/capped_frac": "tokens truncated", "rollout_is/masked_frac": "tokens masked",
               "losses/opsm_frac": "sequences dropped (OPSM)"}


def correction_curve_table(logs: str, seeds: list[int]) -> str:
    """--corrections --curves: CORRECTION_CURVES, with the fractions each correction truncates, masks or drops,
    means over steps, and the reward and clip fraction paired with GSPO recomputed by seed."""
    return curve_table(logs, seeds, list(CORRECTION_CURVES), None, CURVE_EXTRA)


def main():
    args = tyro.cli(Args)
    if args.corrections and args.curves:  # {out}/corrections/curves
        args.out = os.path.join(args.out, "corrections", "curves")
        run_and_report(args, "precision_runs.py", CORRECTION_CURVES, CURVE_BUDGET,
                       f"`{' '.join(CURVE_BUDGET)}` on {os.path.basename(args.model)}, the bf16 engine; mean ± sample "
                       "std (ddof 1) over seeds.", correction_curve_table)
        return
    if args.corrections:
        args.out = os.path.join(args.out, "corrections")
        run_and_report(args, "precision_runs.py", CORRECTIONS, BUDGET,
                       f"one step of `{' '.join(BUDGET)}` on {os.path.basename(args.model)}, the bf16 engine; the "
                       "first two rows are the main table's runs; mean ± sample std (ddof 1) over seeds.",
                       correction_table)
        return
    if args.curves:
        args.out = os.path.join(args.out, "curves")
        run_and_report(args, "precision_runs.py", CURVE_COMMANDS, CURVE_BUDGET,
                       f"`{' '.join(CURVE_BUDGET)}` on {os.path.basename(args.model)}, the bf16 engine; mean ± "
                       "sample std (ddof 1) over seeds.", curve_table)
        return
    run_and_report(args, "precision_runs.py", COMMANDS, BUDGET,
                   f"one step of `{' '.join(BUDGET)}` on {os.path.basename(args.model)}; mean ± sample std (ddof 1) "
                   "over seeds.", table)


if __name__ == "__main__":
    main()
