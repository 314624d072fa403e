"""The staleness lab (docs/lab.md Part 8; issue 63 item 4): the GSPO paper's argument (arXiv 2507.18071 sec. 5.4)
that one sequence-level ratio tolerates the gap between the engine that sampled and the one that trains, where token
ratios carry its noise token by token (there the gap is precision; here it is the staleness an asynchronous system
makes), measured on stale rollouts.

Each run samples step s with the weights of k steps before (`--max-staleness k`, grouprl/staleness.py; an async
run's pipeline of depth k samples the same), on the length lab's task (experiments/length_runs.py: the built-in
task, every completion held to L tokens, the reward on its first character) at its settings (lr 2e-3, 8 prompts x
G 8, 2 minibatches). Variants, each a paper's or a peer's way of training on stale samples:
    grpo, gspo, cispo        pi_old = pi_behav (`--old-logp rollout`: TRL's AsyncGRPOTrainer takes the
                             sampler's log-probs as pi_old), so each ratio carries the whole gap
    grpo-decoupled           AReaL's decoupled objective (arXiv 2505.24298 eq. 5): pi_old = pi_prox recomputed
                             (the default), the behaviour corrected by rho = pi_prox / pi_behav, masked past 5
                             (`--rollout-is-cap 5 --rollout-is-mode token-mask`, AReaL's old default cap)
At k = 0 pi_behav = pi_prox = pi_old and every variant's run is the default run of its script (grpo-decoupled's is
grpo's: rho = 1 exactly), so k = 0 runs once a script. gspo_token.py with A_it = A_i is gspo.py to the last digit
(tests/test_gspo_token.py): not run again.

Per run, from its metrics.jsonl: the reward's first and last 10% and peak (10%-step windows), collapses, the stale
gap (`stale/kl`, KL(pi_behav || pi_prox) by k3; the decoupled objective's alone, the one that recomputes pi_prox), the
variance of the token log-ratios on each step's first minibatch (`losses/log_ratio_var_first`: pi_theta = pi_prox
there, so against pi_behav it is the stale gap as token ratios see it), the spread over sequences of log s_i and of
log prod_t w_it (the ratios against pi_old after the first update, --noise-stats), the clip fractions, the masked
fraction; per variant and k > 0, the last-10% reward minus the same seed's k = 0 run (its drop), and that drop minus
GRPO's on the same seed (the paper's claim: GSPO's is the smaller).

    python experiments/staleness_runs.py            # 4 variants, k = 0, 1, 2, 4, L = 16, 3 seeds, a run at a time
    python experiments/staleness_runs.py --lengths 64 --staleness 0,4 --variants grpo,gspo --skip-done
    python experiments/staleness_runs.py --table-only                # table.md and staleness.png from the logs

Each finished run's metrics.jsonl and args.json are kept under {out}/logs/{variant}__L{L}__k{k}__n{steps}__{seed}/
(small, committed) and its run folder deleted.
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
from learning_tax import ROOT, mean_std, read_rows  # noqa: E402
from length_runs import cell, command, mean, summary, window  # noqa: E402
from real_model_runs import run_kept  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"grpo": ["grpo.py"], "gspo": ["gspo.py"], "cispo": ["cispo.py"],
            "grpo-decoupled": ["grpo.py", "--rollout-is-cap", "5", "--rollout-is-mode", "token-mask"]}
K0 = {"grpo-decoupled": "grpo"}  # a variant whose k = 0 run is another's (rho = 1: the same run)
REF = "grpo"  # each variant's drop is paired against this one's (GSPO's claim: it loses less than the token ratio)
LOG_NAME = re.compile(r"(?P<variant>.+)__L(?P<length>\d+)__k(?P<k>\d+)__n(?P<steps>\d+)__(?P<seed>\d+)$")
KEYS = ("charts/reward_mean", "losses/clipfrac", "losses/clipfrac_seq", "perf/wall_time")


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "staleness")
    """where the logs (logs/), table.md and staleness.png go (runs/ holds the runs in progress)"""
    variants: str = ",".join(VARIANTS)
    """comma-separated variants (see the module's help)"""
    staleness: str = "0,1,2,4"
    """comma-separated k of --max-staleness (weight versions behind)"""
    lengths: str = "16"
    """comma-separated completion lengths L"""
    learning_rate: str = "2e-3"
    """the length lab's rate"""
    seeds: int = 3
    """seeds per configuration (1, 2, ...)"""
    steps: int = 100
    """RL steps a run"""
    prompts_per_rank: int = 8
    """prompts a step (x G = 8 completions; 2 minibatches of 4 prompts, each in halves of 2)"""
    workers: int = 1
    """runs at once, one CPU thread each"""
    skip_done: bool = False
    """run only the configurations and seeds whose logs are not under {out}/logs yet"""
    table_only: bool = False
    """run nothing: rebuild table.md and staleness.png from the logs under {out}/logs"""


def grid(args) -> tuple[list[str], list[int], list[int], list[int]]:
    """The variants, k, L and seeds asked for; a clear error before anything runs."""
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants {','.join(unknown)}: unknown (choose from {', '.join(VARIANTS)})")
    try:
        ks, lengths = [int(x) for x in args.staleness.split(",")], [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit("--staleness and --lengths: comma-separated whole numbers")
    if min(ks) < 0 or min(lengths) < 1 or args.seeds < 1 or args.steps < 1:
        raise SystemExit("--staleness: 0 or more; --lengths, --seeds and --steps: 1 or more")
    return variants, ks, lengths, list(range(1, args.seeds + 1))


def run_name(variant: str, length: int, k: int, steps: int) -> str:
    return f"{K0.get(variant, variant) if k == 0 else variant}__L{length}__k{k}__n{steps}"


def argv(variant: str, length: int, k: int, args) -> list[str]:
    script, *extra = VARIANTS[K0.get(variant, variant) if k == 0 else variant]
    stale = [] if k == 0 else ["--max-staleness", str(k)] + (["--old-logp", "rollout"] if not extra else [])
    return [*command(script, length, args.learning_rate, args), *extra, *stale]


def pending(args, logs: str) -> list[tuple[str, int, int, int]]:
    """(variant, L, k, seed) of each run to make, seed-major, then variant-major: a variant's k = 0 and stale runs
    of a seed one after the other, so a cut sitting leaves whole pairs; k = 0 once a script (K0); with --skip-done
    only those whose logs are missing."""
    variants, ks, lengths, seeds = grid(args)
    todo, seen = [], set()
    for s in seeds:
        for length in lengths:
            for v in variants:
                for k in ks:
                    name = run_name(v, length, k, args.steps)
                    done = os.path.isfile(os.path.join(logs, f"{name}__{s}", "args.json"))
                    if (name, s) not in seen and not (args.skip_done and done):
                        todo.append((v, length, k, s))
                    seen.add((name, s))
    return todo


def load(logs: str, variants: list[str], ks: list[int], lengths: list[int], seeds: list[int]) -> dict:
    """{(variant, L, k, steps): {seed: rows}}, k = 0 of a K0 variant read from its script's runs."""
    found = {}
    for d in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        m = LOG_NAME.match(d)
        if m and int(m["seed"]) in seeds and os.path.isfile(path := os.path.join(logs, d, "metrics.jsonl")):
            found.setdefault((m["variant"], int(m["length"]), int(m["k"]), int(m["steps"])), {})[
                int(m["seed"])] = path
    out = {}
    for v in variants:
        for length in lengths:
            for k in ks:
                for key in sorted(x for x in found if x[0] == (K0.get(v, v) if k == 0 else v)
                                  and x[1:3] == (length, k)):
                    out[(v, length, k, key[3])] = {s: read_rows(p, KEYS) for s, p in sorted(found[key].items())}
    stale = {(v, length) for v, length, k, _ in out if k}  # a K0 variant's borrowed k = 0 row: beside its own runs
    return {key: rows for key, rows in out.items() if key[0] not in K0 or key[:2] in stale}


def extra(rows: list[dict]) -> dict:
    return {"kl": mean([x.get("stale/kl", 0.0 if "stale/versions_behind" not in x else None) for x in rows]),
            "gap_var": mean([x.get("losses/log_ratio_var_first") for x in rows]),
            "masked": mean([x.get("rollout_is/masked_frac") for x in rows])}


def table(runs: dict, seeds: list[int]) -> str:
    lines = ["| variant | L | k | steps | reward, first 10% | last 10% | peak (10% window) | collapsed | stale KL | "
             "Var log w_it, 1st minibatch | Var log s_i | Var log prod_t w_it | clip frac (tokens) | "
             "clip frac (seqs) | masked frac | wall s |", "|---" * 16 + "|"]
    got = {}
    for (v, length, k, steps), per_seed in runs.items():
        one = got[v, length, k, steps] = {s: {**summary(r, length), **extra(r)} for s, r in per_seed.items()}
        col = {key: [x[key] for x in one.values()] for key in next(iter(one.values()))}
        lines.append(f"| `{v}` | {length} | {k} | {steps} | {cell(col['first'])} | {cell(col['last'])} | "
                     f"{cell(col['peak'])} | {int(sum(col['collapsed']))}/{len(one)} | {cell(col['kl'], None)} | "
                     f"{cell(col['gap_var'], None)} | "
                     f"{cell(col['seq_var'], None)} | {cell(col['sum_var'], None)} | {cell(col['clip'])} | "
                     f"{cell(col['clip_seq'])} | {cell(col['masked'])} | {cell(col['wall'], 0)} |")
    if not got:
        raise SystemExit("no logs found: run the experiment first")
    paired, versus = [], []
    for v, length, k, steps in got:
        if k and (d := drops(got, v, length, k, steps, seeds)):
            paired.append(f"- `{v}` L = {length}, k = {k} minus k = 0, reward over the last 10%, by seed: "
                          + ", ".join(f"{x:+.3f}" for x in d.values()) + f" ({cell(list(d.values()))})")
            ref = drops(got, REF, length, k, steps, seeds)
            if v != REF and (both := [s for s in d if s in ref]):
                x = [d[s] - ref[s] for s in both]
                versus.append(f"- `{v}` L = {length}, k = {k}: its drop minus `{REF}`'s, by seed "
                              f"{', '.join(map(str, both))}: " + ", ".join(f"{y:+.3f}" for y in x) + f" ({cell(x)})")
    return "\n".join(lines) + ("\n\nEach stale run paired by seed with its k = 0 run:\n" + "\n".join(paired)
                               if paired else "") + (
        f"\n\nEach variant's drop (k minus k = 0) minus `{REF}`'s, paired by seed (< 0: it loses more):\n"
        + "\n".join(versus) if versus else "")


def drops(got: dict, v: str, length: int, k: int, steps: int, seeds: list[int]) -> dict:
    """{seed: the last 10%'s reward at k minus the same seed's at k = 0}, the seeds with both runs."""
    one, base = got.get((v, length, k, steps), {}), got.get((v, length, 0, steps), {})
    return {s: one[s]["last"] - base[s]["last"] for s in seeds if s in one and s in base}


def plot(runs: dict, path: str) -> bool:
    """One panel per (L, k): the reward's 10%-step moving mean, mean over seeds (band min-max), a line a variant;
    then the last 10%'s reward against k, mean ± std over seeds. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    variants = list(dict.fromkeys(key[0] for key in runs))
    panels = list(dict.fromkeys(key[1:3] for key in runs))
    lengths = list(dict.fromkeys(key[1] for key in runs))
    fig, axes = plt.subplots(1, len(panels) + len(lengths), figsize=(4.2 * (len(panels) + len(lengths)), 4.2),
                             squeeze=False)
    for ax, (length, k) in zip(axes[0], panels):
        for (v, length_, k_, steps), per_seed in runs.items():
            if (length_, k_) != (length, k):
                continue
            curves = [window([x["charts/reward_mean"] for x in rows]) for rows in per_seed.values()]
            n, t = curves[0][0], min(len(c[1]) for c in curves)
            ys = [[c[1][i] for c in curves] for i in range(t)]
            colour = f"C{variants.index(v) % 10}"
            ax.plot(range(n, n + t), [sum(y) / len(y) for y in ys], color=colour, label=v)
            ax.fill_between(range(n, n + t), [min(y) for y in ys], [max(y) for y in ys], alpha=0.15, color=colour)
        ax.set(xlabel="step", title=f"reward, L = {length}, k = {k}")
        ax.legend(fontsize=7)
    for ax, length in zip(axes[0][len(panels):], lengths):
        for v in variants:
            ks = sorted(k for (v_, l_, k, _) in runs if v_ == v and l_ == length)
            ms = [mean_std([summary(r, length)["last"] for (v_, l_, k_, _), p in runs.items()
                            if (v_, l_, k_) == (v, length, k) for r in p.values()]) for k in ks]
            ax.errorbar(ks, [m for m, _ in ms], [0 if math.isnan(s) else s for _, s in ms], capsize=3, marker="o",
                        color=f"C{variants.index(v) % 10}", label=v)
        ax.set(xlabel="k (versions behind)", title=f"reward, last 10%, L = {length}")
        ax.legend(fontsize=7)
    fig.suptitle("The staleness lab: mean over seeds (band min-max; bars ± sample std)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main():
    args = tyro.cli(Args)
    t0 = time.time()
    variants, ks, lengths, seeds = grid(args)
    runs, logs = os.path.join(args.out, "runs"), os.path.join(args.out, "logs")
    if not args.table_only:
        os.makedirs(runs, exist_ok=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
        todo = [(run_name(v, length, k, args.steps), s, argv(v, length, k, args))
                for v, length, k, s in pending(args, logs)]
        print(f"  {len(todo)} runs, {args.workers} at a time", flush=True)
        run_kept(runs, logs, todo, args.workers)
    found = load(logs, variants, ks, lengths, seeds)
    what = ("the table rebuilt from the logs under logs/" if args.table_only
            else f"{time.time() - t0:.0f} s, {args.workers} runs at a time")
    report = (f"`python experiments/staleness_runs.py {shlex.join(sys.argv[1:])}`: seeds {seeds}, {what}. Mean ± "
              f"sample std (ddof 1) over seeds; stale KL, the spreads and fractions are means over steps.\n\n"
              f"{table(found, seeds)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    if not plot(found, os.path.join(args.out, "staleness.png")):
        print("matplotlib is not installed: table only, no plot")
    print(report)


if __name__ == "__main__":
    main()
