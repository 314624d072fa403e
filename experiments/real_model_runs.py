"""Learning on a real model (issue 35 item 4): SmolLM2-135M-Instruct (tools/real_model.py) on 2-digit addition,
gspo.py, grpo.py, gspo_token.py and dfpo.py from the same start, several seeds each, and (issue 51 item 2) cispo.py,
sapo.py, gmpo.py, vespo.py, LUSPO and GRPO with TRL's default rollout correction, and (issue 63 item 4) GRPO and
GSPO on rollouts 2 weight versions stale, as a markdown table and a PNG:
held-out accuracy before and after, the reward curve, entropy, response length and clip fraction, the mechanism
metrics, mean ± sample std over seeds, and each command minus gspo paired by seed.

The task: "What is a + b? Put the final answer in \\boxed{}." for a, b in 10..99, the answer a + b, through the
model's own ChatML template. HELD_OUT unordered pairs {a, b} are kept out of training in both orders, so the
held-out accuracy measures arithmetic on sums the policy never trained on. The built-in math grader scores a
completion 1 only when the number it states equals the sum ('62 + 43' for 105 scores 0: issue 38 item 0).

    python tools/real_model.py                           # the model folder, once
    python experiments/real_model_runs.py                # 15 commands x 3 seeds, two at a time: ~5 min a run
    TRL="grpo --gen-mode engine --rollout-is-mode sequence-mask --rollout-is-cap 3"   # issue 51's 6 rows
    python experiments/real_model_runs.py --seeds 5 --skip-done --only "cispo,sapo,gmpo,vespo,gspo --luspo,$TRL"
    S="--max-staleness 2 --old-logp rollout"             # issue 63's stale rows, one run at a time
    python experiments/real_model_runs.py --seeds 3 --skip-done --workers 1 --only "grpo $S,gspo $S"
    python experiments/real_model_runs.py --table-only --seeds 5   # table.md, summary.json and the plot again
    python experiments/real_model_runs.py --task-only data   # data/train.jsonl and data/test.jsonl alone

Each run's metrics.jsonl and samples.jsonl are kept under {out}/logs/ (small, committed); its checkpoint (1.8 GB
with the AdamW state) is deleted once the run ends.
"""
import glob
import json
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT, by_seed, exp_name, fmt, only_commands, read_rows, run_jobs, sci, steps_to  # noqa: E402

HELD_OUT = 128  # unordered pairs kept apart (both orders) for the held-out set
PROMPT = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
# the budget (see BUDGET_WHY): shared by every command, so that they differ only in the objective
BUDGET = ["--num-steps", "8", "--prompts-per-rank", "4", "--group-size", "8", "--num-minibatches", "2",
          "--max-new-tokens", "40", "--temperature", "0.7", "--learning-rate", "2e-5",
          "--eval-every", "8", "--eval-limit", "64", "--eval-k", "1", "--eval-temperature", "0.001",
          "--log-samples", "1"]
BUDGET_WHY = (
    "Budget: 8 steps x 4 prompts x G = 8 completions of at most 40 new tokens, 2 minibatches a step (16 AdamW "
    "steps), lr 2e-5 (full fine-tuning), sampling at temperature 0.7; held-out accuracy greedy (temperature "
    "0.001, one sample a prompt, so the step-0 number is the same for every run) on 64 prompts at steps 0 and 8. "
    "Why so small: alone, one step of this size took ~60 s on one CPU thread (~70 generated, ~55 trained "
    "tokens/s), and 9 runs had to finish within ~80 min, two at a time; the issue's 20-30 min a run did not fit. "
    "On 2026-11-28 the 2 cores were shared with other jobs (load average 12-14) and a step took ~5 min: see the "
    "rows' seed counts. G = 8 because at a ~15% start most "
    "groups of 4 had no reward spread (zero advantage); lr 2e-5, 20x the scripts' real-model default, so that 16 "
    "optimizer steps can move the policy at all; greedy evaluation so that the seeds' spread is the training's, "
    "not the evaluation's sampling.")
COMMANDS = {  # script, then its own flags (after BUDGET: they override it)
    "gspo": ["gspo.py"],
    "grpo": ["grpo.py"],
    "dfpo": ["dfpo.py"],
    # GRPO-fix, the DFPO paper's GRPO baseline (arXiv 2604.13088, App. H eq. 79-80)
    "grpo --symmetric-clip --loss-agg seq-mean-token-sum-norm": ["grpo.py", "--symmetric-clip", "--loss-agg",
                                                                "seq-mean-token-sum-norm"],
    # GSPO-token: with one advantage per sequence its value and gradient are GSPO's (arXiv 2604.13088, eq. 44);
    # --post-answer-penalty gives the tokens after the stated answer their own advantage, its reason to exist
    "gspo_token": ["gspo_token.py"],
    "gspo_token --post-answer-penalty 0.1": ["gspo_token.py", "--post-answer-penalty", "0.1"],
    # LoRA beside full fine-tuning (issue 35 item 4): every linear layer of the decoder, rank 16 of the model's 576,
    # 10x full fine-tuning's learning rate (the usual LoRA ratio; on the tiny model 4x was best, docs/scaling.md)
    "gspo --lora-rank 16": ["gspo.py", "--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "2e-4"],
    # the objectives the field compares (issue 51 item 2), each with its script's defaults, its paper's (or TRL's):
    "cispo": ["cispo.py"],  # arXiv 2506.13585: the clipped weight, capped at 5 (TRL's epsilon_high for cispo)
    "sapo": ["sapo.py"],  # arXiv 2511.20347: the soft gate, tau_pos 1.0, tau_neg 1.05
    "gmpo": ["gmpo.py"],  # arXiv 2507.20673: the geometric mean, each log-ratio clipped to (-0.4, 0.4)
    "vespo": ["vespo.py"],  # arXiv 2602.10693: phi(W), (k, lambda) (2, 3) for A >= 0 and (3, 2) for A < 0
    "gspo --luspo": ["gspo.py", "--luspo"],  # arXiv 2602.05261 eq. 7: GSPO's term times |y_i|
    # GRPO as TRL runs it by default with vLLM: GRPOConfig's rollout correction, vllm_importance_sampling_mode
    # "sequence_mask", clip_max 3.0, no clip_min: a sequence whose ratio pi_old / pi_rollout (the product over its
    # tokens) exceeds 3 leaves the loss. The ratio needs the log-probs the sampler computed, so the rollout comes
    # from the engine (--gen-mode engine), not HF generate. Here the engine runs in fp32 on the CPU, as the
    # trainer does: the ratio is 1 up to float error and no sequence is masked (rollout_is/masked_frac 0), so the
    # row is GRPO as TRL runs it by default, the correction on with nothing to correct (it acts on a bf16 or vLLM
    # sampler: precision_runs.py). Paired by seed, it has gspo's prompts but not its samples (the engine's sampler
    # draws other completions from the same seed), so beside grpo it shows what a different draw moves.
    "grpo --gen-mode engine --rollout-is-mode sequence-mask --rollout-is-cap 3": [
        "grpo.py", "--gen-mode", "engine", "--rollout-is-mode", "sequence-mask", "--rollout-is-cap", "3"],
    # stale rollouts (issue 63 item 4, the staleness lab's grpo and gspo variants on the real model): step s
    # samples with the weights of step s - 2 (steps 1-3 with the initial ones), pi_old = the behaviour policy's
    # log-probs (TRL's AsyncGRPOTrainer; with HF generate a forward of the stale weights); their k = 0 partners
    # are the grpo and gspo rows, whose step 1 they equal to the last digit (the same seed)
    "grpo --max-staleness 2 --old-logp rollout": ["grpo.py", "--max-staleness", "2", "--old-logp", "rollout"],
    "gspo --max-staleness 2 --old-logp rollout": ["gspo.py", "--max-staleness", "2", "--old-logp", "rollout"],
}
NEW = ["cispo", "sapo", "gmpo", "vespo", "gspo --luspo",
       "grpo --gen-mode engine --rollout-is-mode sequence-mask --rollout-is-cap 3"]  # issue 51's rows
CURVES = {"charts/reward_mean": "reward (training, T 0.7)", "losses/entropy": "entropy (nats/token)",
          "charts/response_length_mean": "response length (tokens)", "losses/clipfrac": "clip fraction (tokens)"}
MECHANISM = ["losses/asym", "losses/shared_coef"]  # the DFPO paper's mechanism metrics each step logs
THRESHOLD, WINDOW = 0.3, 3  # eq. 19: steps until the 3-step moving average of the reward reaches 0.3


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results", "real_model")
    """where the data, runs, logs/, table.md, summary.json and real_model.png go"""
    model: str = os.path.expanduser("~/.cache/group-rl/smollm2-135m-instruct")
    """the model folder (python tools/real_model.py writes it)"""
    seeds: int = 3
    """seeds per command (1, 2, ...)"""
    skip_done: bool = False
    """run only the (command, seed) pairs whose logs/ are not there yet (an experiment continued)"""
    workers: int = 2
    """runs at once, one CPU thread each"""
    only: str | None = None
    """comma-separated command names to run (default: all); the others' logs stay in the table"""
    task_only: str | None = None
    """write the task's train.jsonl and test.jsonl (held-out sums) into this folder and stop (the README's real-model
    CPU command)"""
    table_only: bool = False
    """run nothing: rebuild the report (table.md; real_model_runs.py: summary.json and the plot too)
    from the logs under {out}/logs"""


def arithmetic_task(held_out: int = HELD_OUT, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """-> (train rows, held-out rows) of {"prompt", "answer"}: every ordered pair a, b in 10..99, the held_out
    unordered pairs drawn (seeded) kept apart in both orders, so no held-out sum is ever trained on."""
    pairs = sorted({(min(a, b), max(a, b)) for a in range(10, 100) for b in range(10, 100)})
    kept = set(random.Random(seed).sample(pairs, held_out))
    row = lambda a, b: {"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)}  # noqa: E731
    train = [row(a, b) for a in range(10, 100) for b in range(10, 100) if (min(a, b), max(a, b)) not in kept]
    test = [row(a, b) for a, b in sorted(kept)]
    random.Random(seed).shuffle(test)  # --eval-limit takes the first ones: a random subset, not the smallest a
    return train, test


def write_task(folder: str, task=arithmetic_task) -> tuple[str, str]:
    """task() -> (train rows, held-out rows), written to {folder}/train.jsonl and test.jsonl; -> their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, rows in zip(("train", "test"), task()):
        paths.append(os.path.join(folder, f"{name}.jsonl"))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths[0], paths[1]


def run_all(args, wanted: list[str], seeds: list[int], commands: dict = COMMANDS, budget: list[str] = BUDGET,
            task=arithmetic_task):
    """Seed-major, so that an interrupted experiment still has every command on the first seeds; each run's logs
    are copied to {out}/logs/{name}__{seed}/ and its run folder (checkpoint included) deleted. commands, budget:
    another experiment's (precision_runs.py, energy_runs.py, mixed_task_runs.py); a command's flags follow the
    budget's. task() -> (train rows, held-out rows): the task, written under {out}/runs/data (write_task)."""
    if not os.path.isdir(args.model):
        raise SystemExit(f"--model {args.model}: no such folder; write it with python tools/real_model.py")
    runs, logs = os.path.join(args.out, "runs"), os.path.join(args.out, "logs")
    train, test = write_task(os.path.join(runs, "data"), task)
    jobs, names = [], {}
    for seed in seeds:
        for name in wanted:
            name_s = exp_name(name)
            if getattr(args, "skip_done", False) and os.path.isdir(os.path.join(logs, f"{name_s}__{seed}")):
                continue
            for path in glob.glob(os.path.join(runs, f"{name_s}__{seed}__*")):
                shutil.rmtree(path)
            label = f"{name} seed {seed}"
            names[label] = (name_s, seed)
            script, *flags = commands[name]
            jobs.append((label, [script, "--model", args.model, "--dataset", train, "--eval-dataset", test,
                                 *budget, *flags, "--seed", str(seed), "--exp-name", name_s, "--output-dir", runs],
                         os.path.join(runs, f"{name_s}__{seed}.log")))

    run_jobs(jobs, args.workers, after=lambda label: keep_logs(runs, logs, *names[label]))


def run_and_report(args, script: str, commands: dict, budget: list[str], what: str, table,
                   task=arithmetic_task) -> str:
    """Another experiment on a task (precision_runs.py, energy_runs.py, mixed_task_runs.py): its runs (run_all,
    unless --table-only), then {out}/table.md: the command line, the seeds, `what` (the budget and statistics), and
    table(logs, seeds) from the logs under {out}/logs; printed and returned."""
    seeds = list(range(1, args.seeds + 1))
    if not args.table_only:
        run_all(args, only_commands(args.only, commands), seeds, commands, budget, task)
    logs = os.path.join(args.out, "logs")
    if not any(os.path.isfile(os.path.join(logs, f"{exp_name(name)}__{s}", "metrics.jsonl"))
               for name in commands for s in seeds):  # never a table from nothing over the one there
        raise SystemExit(f"no logs of {script}'s runs (seeds {seeds}) under {logs}: run the experiment "
                         "first; table.md is left as it was")
    report = (f"`python experiments/{script} {shlex.join(sys.argv[1:])}`: seeds {seeds}, {what}\n\n"
              f"{table(logs, seeds)}\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    print(report)
    return report


def run_kept(runs: str, logs: str, todo: list[tuple[str, int, list[str]]], workers: int):
    """Each (name, seed, argv) as `python argv --seed seed --exp-name name --output-dir runs`, `workers` at a time
    (run_jobs); a run cut short before is removed first, and each finished run's logs kept (keep_logs)."""
    jobs = []
    for name, seed, argv in todo:
        for path in glob.glob(os.path.join(runs, f"{name}__{seed}__*")):  # a run cut short
            shutil.rmtree(path)
        jobs.append((f"{name} seed {seed}", [*argv, "--seed", str(seed), "--exp-name", name, "--output-dir", runs],
                     os.path.join(runs, f"{name}__{seed}.log")))
    run_jobs(jobs, workers, after=lambda label: keep_logs(runs, logs, *label.split(" seed ")))


def keep_logs(runs: str, logs: str, name_s: str, seed) -> None:
    """A finished run's metrics.jsonl, samples.jsonl, eval_samples.jsonl and args.json to {logs}/{name_s}__{seed}/,
    and its run folder under runs (the 1.8 GB checkpoint) removed."""
    (run,) = glob.glob(os.path.join(runs, f"{name_s}__{seed}__*"))
    dest = os.path.join(logs, f"{name_s}__{seed}")
    os.makedirs(dest, exist_ok=True)
    for f in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "args.json"):
        if os.path.exists(os.path.join(run, f)):
            shutil.copy(os.path.join(run, f), dest)
    shutil.rmtree(run)


def summarize(logs: str, seeds: list[int]) -> dict:
    """{command: [one dict a seed: curves, eval before / after, the last step's samples]} from the logs there."""
    result = {}
    for name in COMMANDS:
        per_seed = []
        for s in seeds:
            path = os.path.join(logs, f"{exp_name(name)}__{s}", "metrics.jsonl")
            if not os.path.exists(path):
                continue
            rows = read_rows(path)
            steps = [r for r in rows if "charts/reward_mean" in r]
            evals = [(r["step"], r[k]) for r in rows for k in r if k.startswith("eval/avg@")]
            per_seed.append({"seed": s, "curves": {k: curve(steps, k) for k in [*CURVES, *MECHANISM]},
                             "eval_steps": [e[0] for e in evals], "eval": [e[1] for e in evals],
                             "jitter2": next((r["charts/reward_jitter2"] for r in rows
                                              if r.get("charts/reward_jitter2") is not None), None)})
        if per_seed:
            result[name] = per_seed
    return result


def curve(steps: list[dict], key: str) -> list[float] | None:
    """The key's value at each step; None when a step lacks it (a script that does not log it: the table says
    n/a)."""
    values = [r.get(key) for r in steps]
    return values if values and None not in values else None


def over_seeds(runs: list[dict], key: str, f, show=fmt) -> str:
    """show(f(curve) for each seed's curve of key), or n/a when a seed's run does not log the key."""
    curves = [r["curves"].get(key) for r in runs]
    return "n/a" if None in curves else show([f(c) for c in curves])


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def table(result: dict) -> str:
    lines = ["| objective | seeds | held-out accuracy (greedy), step 0 | held-out accuracy, last step | change (per seed: after "
             "- before) | reward, first 2 steps | reward, last 2 steps | entropy, first → last step "
             "| response length, first → last step | clip fraction, mean over steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in result.items():
        first = lambda k, n=1, d=3: over_seeds(runs, k, lambda c: mean(c[:n]), lambda x: fmt(x, d))  # noqa: E731
        last = lambda k, n=1, d=3: over_seeds(runs, k, lambda c: mean(c[-n:]), lambda x: fmt(x, d))  # noqa: E731
        before, after = [r["eval"][0] for r in runs], [r["eval"][-1] for r in runs]
        delta = [a - b for a, b in zip(after, before)]
        ent, length = "losses/entropy", "charts/response_length_mean"
        lines.append(f"| {name} | {len(runs)} | {fmt(before)} | {fmt(after)} | {fmt(delta)} "
                     f"| {first('charts/reward_mean', 2)} | {last('charts/reward_mean', 2)} "
                     f"| {first(ent)} → {last(ent)} | {first(length, d=1)} → {last(length, d=1)} "
                     f"| {over_seeds(runs, 'losses/clipfrac', mean)} |")
    return "\n".join(lines)


def paired(result: dict, base: str = "gspo") -> str:
    """Each command against gspo's run of the same seed (the same data order, prompts and step-1 samples): its
    held-out change and its reward over the last 2 steps minus gspo's, per seed, then mean ± std of the differences.
    A difference smaller than its spread says the two are not apart on this budget."""
    if base not in result:
        return ""
    seed_of = lambda runs: {r["seed"]: r for r in runs}  # noqa: E731
    ref = seed_of(result[base])
    change = lambda r: r["eval"][-1] - r["eval"][0]  # noqa: E731
    last2 = lambda r: sum(r["curves"]["charts/reward_mean"][-2:]) / 2  # noqa: E731
    lines = []
    for name, runs in result.items():
        pairs = [(s, r, ref[s]) for s, r in sorted(seed_of(runs).items()) if s in ref]
        if name == base or not pairs:
            continue
        for what, f in (("held-out change", change), ("reward over the last 2 steps", last2)):
            lines.append(f"- {name} minus {base}, {what}, paired by seed: "
                         f"{by_seed([(s, f(r) - f(b)) for s, r, b in pairs])}")
    return "\n".join(lines)


def mechanism_table(result: dict) -> str:
    """The DFPO paper's predictions (arXiv:2604.13088 sec. 6) on this task: steps to a reward threshold (eq. 19),
    Jitter2 of the reward curve (eq. 20), Asym (eq. 23) and the shared-token coefficient (eq. 72), means over steps
    per seed, then mean ± std over seeds."""
    lines = [f"| objective | steps to reward ≥ {THRESHOLD} ({WINDOW}-step average, eq. 19) | Jitter2 (eq. 20) "
             "| Asym (eq. 23) | shared-token coef. (eq. 72) |", "|---|---|---|---|---|"]
    for name, runs in result.items():
        reach = [steps_to(r["curves"]["charts/reward_mean"], THRESHOLD, WINDOW) for r in runs]
        hit = [x for x in reach if x is not None]
        reach_s = f"{fmt(hit, 1)} ({len(hit)}/{len(runs)} seeds)" if hit else f"not reached (0/{len(runs)})"
        jit = [r["jitter2"] for r in runs if r["jitter2"] is not None]
        lines.append(f"| {name} | {reach_s} | {fmt(jit) if jit else 'n/a'} "
                     f"| {over_seeds(runs, 'losses/asym', mean, lambda x: fmt(x, 4))} "
                     f"| {over_seeds(runs, 'losses/shared_coef', mean, sci)} |")
    return "\n".join(lines)


def style(k: int) -> dict:
    """The k-th command's line: colours in turn (matplotlib's 10) and line styles in turn (3), so that the
    first 30 commands each get their own pair and equal curves (gspo and gspo_token) both show."""
    return {"color": f"C{k % 10}", "linestyle": ("-", "--", ":")[k % 3]}


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.5 * len(CURVES), 4.5))
    for ax, (key, label) in zip(axes, CURVES.items()):
        for k, (name, runs) in enumerate(result.items()):
            curves = [r["curves"].get(key) for r in runs]
            if None in curves:  # a script that does not log it: no line
                continue
            n = min(len(c) for c in curves)
            avg = [sum(c[t] for c in curves) / len(curves) for t in range(n)]
            lo = [min(c[t] for c in curves) for t in range(n)]
            hi = [max(c[t] for c in curves) for t in range(n)]
            steps = list(range(1, n + 1))
            ax.plot(steps, avg, label=name, **style(k))
            ax.fill_between(steps, lo, hi, alpha=0.2, color=style(k)["color"])
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)  # below the panels
    fig.suptitle("SmolLM2-135M-Instruct, 2-digit addition: mean over seeds, band min-max", fontsize=9)
    fig.tight_layout(rect=(0, 0.05 * ((len(result) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    args = tyro.cli(Args)
    if args.task_only:
        print(*write_task(args.task_only))
        return
    t0 = time.time()
    wanted = only_commands(args.only, COMMANDS)
    seeds = list(range(1, args.seeds + 1))
    if not args.table_only:
        run_all(args, wanted, seeds)
    result = summarize(os.path.join(args.out, "logs"), seeds)
    if not result:
        raise SystemExit(f"no logs under {os.path.join(args.out, 'logs')}: run the experiment first")
    what = ("rebuilt from the logs under logs/" if args.table_only
            else f"{time.time() - t0:.0f} s, {args.workers} runs at a time")
    report = (f"# Learning on a real model: SmolLM2-135M-Instruct, 2-digit addition\n\n"
              f"`python experiments/real_model_runs.py {shlex.join(sys.argv[1:])}`: {what}. Mean ± sample std "
              f"(ddof 1) over seeds. Held-out: {HELD_OUT} sums never trained on (both orders), the first 64 "
              f"evaluated.\n\n{BUDGET_WHY}\n\nEvery command: `{' '.join(BUDGET)}`\n\n{table(result)}\n\n"
              f"{paired(result)}\n\n"
              f"Mechanism metrics (DFPO paper, sec. 6), same runs:\n\n{mechanism_table(result)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not plot(result, os.path.join(args.out, "real_model.png")):
        print("matplotlib is not installed: table only, no plots")
    print(report)


if __name__ == "__main__":
    main()
