"""The learning-tax lab: what the DFPO paper (arXiv:2604.13088) claims about each objective, measured on the tiny
model on 2 CPU cores, several seeds each, as a markdown table and PNG plots.

Part 1, the built-in task ('x%10=' -> the digit): grpo.py, grpo.py --symmetric-clip, gspo.py and dfpo.py with each
transform and gradient form, on the same seeds (gspo_token.py with A_it = A_i is GSPO to the last digit, as its
tests show, so it is not run again). Per step, from each run's metrics.jsonl: reward, entropy, Asym (eq. 23), clip
fraction and the shared-token coefficient, the gradient's own coefficient on a token the whole group shares
(eq. 70-72, at the first completion token). Per run: Jitter2 of the reward curve (eq. 20, as the script logs it)
and the steps until the reward, averaged over a window of --window steps, first reaches --threshold (eq. 19).

Part 2, Appendix A made real: "What is a+b?" answered "So, the answer is N." or "So, a+b=N.", equally correct (the
reward reads N only, eq. 28). Every completion, of either form, right or wrong, opens with the same "So, ": a prefix
the whole group shares, which is what eq. 63 and 72 constrain. A short supervised warm start teaches the tiny model
both forms, with some wrong sums; then RL with checkpoints every --save-every steps, and on fixed probe prompts,
exactly (no sampling), per checkpoint:
  h(p), p = pi(A) / (pi(A) + pi(B)), A and B the two correct completions: the binary entropy between the equally
      correct forms, whose log-odds drift is eq. 41 (Corollary 3.2: h -> 0 is the collapse)
  log pi("So, " | x): the prefix every completion shares, so its reward is nothing; any drift of it is learning tax
      (App. A.2, eq. 38). The two forms differ in length, so eq. 63 cancels it only approximately (eq. 72-73);
      dfpo.py --length-aware cancels it exactly.
Part 1 also holds two ablations on the same task and seeds, each with its own table:
  Mixture-of-Experts (GSPO arXiv:2507.18071, Sec. 5.3: GRPO needs Routing Replay on an MoE, GSPO does not):
      grpo.py, grpo.py --routing-replay and gspo.py on --model tiny-moe; reward, Jitter2, clip fraction, the spread of
      log w_it on each step's first minibatch (pi = pi_old) and on the later ones, and the expert selections that flip
      after one optimizer step (moe/route_flip_frac) or that the loss sees (moe/route_flip_frac_loss).
  Group size (the DFPO paper's Table 4): dfpo.py --transform min-replace minus gspo.py at G = 4, 8, 16 (the same
      prompts a step, so G completions each), as per-seed paired differences of the final reward: the same seed is
      the same initial model and the same prompts for both objectives.
Energy on frequent tokens (eq. 24) needs a backward pass per token: energy.py computes it exactly
(experiments/energy_cost.py states its cost); this lab does not log it yet.

    pip install -r experiments/requirements.txt     # matplotlib for the plots (the table needs nothing more)
    python experiments/learning_tax.py              # ~32 min a run at a time on 2 CPU cores; experiments/results/
    python experiments/learning_tax.py --smoke      # a reduced form, under a minute
    python experiments/learning_tax.py --table-only # the table, summary.json and plots again from the runs there
"""
import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from grouprl import cli  # noqa: E402
from grouprl import data  # noqa: E402
from grouprl import modeling  # noqa: E402

# name -> the script and its flags; everything else is the script's default (the papers' settings)
BUILTIN = {
    "grpo": ["grpo.py"],
    "grpo --symmetric-clip": ["grpo.py", "--symmetric-clip"],
    "gspo": ["gspo.py"],
    "dfpo min-replace": ["dfpo.py", "--transform", "min-replace"],
    "dfpo min-replace --clip-gated": ["dfpo.py", "--transform", "min-replace", "--clip-gated"],
    "dfpo min-replace --length-aware": ["dfpo.py", "--transform", "min-replace", "--length-aware"],
    "dfpo orth-proj": ["dfpo.py", "--transform", "orth-proj"],
    "dfpo orth-proj-qp": ["dfpo.py", "--transform", "orth-proj-qp"],
    "dfpo scale": ["dfpo.py", "--transform", "scale"],
}
# the GSPO paper's MoE claim (arXiv:2507.18071, Sec. 5.3), on transformers' Qwen3-MoE built like tiny
MOE = {
    "grpo --model tiny-moe": ["grpo.py", "--model", "tiny-moe"],
    "grpo --model tiny-moe --routing-replay": ["grpo.py", "--model", "tiny-moe", "--routing-replay"],
    "gspo --model tiny-moe": ["gspo.py", "--model", "tiny-moe"],
}
# the DFPO paper's Table 4 (arXiv:2604.13088): min-replace minus GSPO as the group size G grows
GROUP_SIZES = [4, 8, 16]
GROUP_PAIR = ("gspo", "dfpo min-replace")  # (the baseline, the objective); their difference is the row
PAPER_TABLE4 = {2: 3.1, 4: 4.2, 8: 5.6, 16: 5.7}  # its Delta: AIME25 avg@32 points, Qwen3-32B


def group_name(name: str, g: int) -> str:
    """The configuration of `name` at group size g: the part-1 run itself at the scripts' default G."""
    return name if g == cli.CommonArgs.group_size else f"{name} --group-size {g}"


GROUP = {group_name(n, g): [*BUILTIN[n], "--group-size", str(g)] for g in GROUP_SIZES for n in GROUP_PAIR
         if g != cli.CommonArgs.group_size}
PART1 = {**BUILTIN, **GROUP, **MOE}  # every configuration run on the built-in task
TWO_FORM = {k: BUILTIN[k] for k in ["grpo", "gspo", "dfpo min-replace", "dfpo min-replace --clip-gated",
                                    "dfpo min-replace --length-aware"]}
CURVES = {"charts/reward_mean": "reward", "losses/entropy": "entropy (nats/token)", "losses/asym": "Asym (eq. 23)",
          "losses/clipfrac": "clip fraction (tokens)", "losses/shared_coef": "shared-token coefficient (eq. 72)"}
# kept as well where every step logged them (the MoE runs; the log w variances in every run)
EXTRA_CURVES = ["losses/log_ratio_var_first", "losses/log_ratio_var_later", "moe/route_flip_frac",
                "moe/route_flip_frac_loss"]
FORM_A, FORM_B, PREFIX = "So, the answer is {n}.", "So, {a}+{b}={n}.", "So, "


@dataclass
class Args:
    out: str = os.path.join(ROOT, "experiments", "results")
    """where the table, plots and summary.json go (the runs themselves under {out}/runs, replaced each time)"""
    seeds: int = 3
    """seeds per configuration (1, 2, ...)"""
    steps: int = 60
    """RL steps of each part-1 run (the built-in task)"""
    threshold: float = 0.2
    """kappa of eq. 19: the reward the steps-to-threshold column waits for (the default runs start near 0.03)"""
    window: int = 5
    """steps in the moving average that steps-to-threshold reads"""
    two_form_steps: int = 40
    """RL steps of each part-2 run (Appendix A's task)"""
    save_every: int = 5
    """part 2: a checkpoint every N steps, each measured exactly on the probes"""
    sft_steps: int = 300
    """part 2: supervised warm-start steps (both forms, 25% wrong sums)"""
    probes: int = 32
    """part 2: prompts on which h(p) and the prefix log-probability are computed exactly"""
    workers: int = 2
    """runs at once, one CPU thread each"""
    only: str | None = None
    """comma-separated configuration names to run (default: all)"""
    two_form: bool = True
    """run part 2 (Appendix A's task) for the configurations it holds; --no-two-form: part 1 and its tables only"""
    skip_done: bool = False
    """keep the runs already under {out}/runs and run only the (configuration, seed) pairs without a finished
    metrics.jsonl (an experiment continued, or grown with --only); the tables cover --only as always"""
    smoke: bool = False
    """a reduced form for the test suite: 1 seed, 3 + 4 steps; gspo and dfpo min-replace --length-aware, gspo on
    tiny-moe, gspo and dfpo min-replace at G = 4"""
    table_only: bool = False
    """run nothing: rebuild table.md, summary.json and the plots from the runs already under {out}/runs (their
    metrics.jsonl and checkpoints), with the same --seeds, --steps, --only ... as the run that wrote them"""


def run_jobs(jobs: list[tuple[str, list[str], str]], workers: int, after=None):
    """Each job (label, argv, log file) as its own process, `workers` at a time with one thread each; a failed run
    stops the experiment with the end of its log; after(label), where given, runs once a job has succeeded (before
    its time is printed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def one(job):
        label, argv, log = job
        t = time.time()
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        if rc:
            raise SystemExit(f"{label} failed (exit {rc}); the end of {log}:\n" + open(log).read()[-3000:])
        if after is not None:
            after(label)
        print(f"  {label}: {time.time() - t:.0f}s", flush=True)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, jobs))


def only_commands(only: str | None, commands: dict) -> list[str]:
    """--only's comma-separated names, checked against `commands` (default: all of them, in order)."""
    wanted = only.split(",") if only else list(commands)
    if unknown := set(wanted) - set(commands):
        raise SystemExit(f"--only {sorted(unknown)}: unknown (choose from {', '.join(commands)})")
    return wanted


def exp_name(name: str) -> str:
    return name.replace(" ", "_")


def run_dir(root: str, name: str, seed: int) -> str:
    """The one run folder of this configuration and seed ({exp_name}__{seed}__{time}, as the scripts name it)."""
    paths = glob.glob(os.path.join(root, f"{exp_name(name)}__{seed}__*"))
    if not paths:
        raise SystemExit(f"no run of {name!r} seed {seed} under {root}: run the lab first (--table-only reads "
                         "the runs there, with the --seeds and --only of the run that wrote them)")
    if len(paths) != 1:
        raise SystemExit(f"{len(paths)} run folders of {name!r} seed {seed} under {root} (expected one)")
    return paths[0]


def metrics(root: str, name: str, seed: int) -> list[dict]:
    """The rows of one run's metrics.jsonl, one a step (the last also holds the run's Jitter2)."""
    return read_rows(os.path.join(run_dir(root, name, seed), "metrics.jsonl"))


def read_rows(path: str, keys: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a run's metrics.jsonl (or samples file), each a JSON object holding `keys`. A torn line (a run
    cut short while writing it), a row without a key a table needs or a file with no row stops the table in one
    line naming the file and line: a table built around it would be silently wrong."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise SystemExit(f"{path}:{n}: not a JSON row (a line torn when the run was cut short?): run it "
                                 "again, or delete the line and the rows after it") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: a JSON {type(row).__name__}, not a row of a run's log")
            if missing := [k for k in keys if k not in row]:
                raise SystemExit(f"{path}:{n}: the row has no {missing[0]!r} (a log of another script or "
                                 "version?): run it again with this one")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows (the run stopped before its first step): run it again, or remove "
                         "its folder")
    return rows


def step_rows(rows: list[dict], keys, where: str) -> list[dict]:
    """The rows of a run's steps (those with charts/reward_mean), each holding `keys`; else one line."""
    steps = [r for r in rows if "charts/reward_mean" in r]
    for r in steps:
        if missing := [k for k in keys if k not in r]:
            raise SystemExit(f"{where}: step {r.get('step')}'s row has no {missing[0]!r} (a log of another "
                             "script or version?): run it again with this one")
    return steps


def jitter2(rows: list[dict], where: str) -> float:
    """The run's Jitter2 (eq. 20), logged with its last step; a run cut short has none: one line."""
    for r in rows:
        if "charts/reward_jitter2" in r:
            return r["charts/reward_jitter2"]
    raise SystemExit(f"{where}: no charts/reward_jitter2 (logged with the last step): the run was cut short; "
                     "run it again (learning_tax.py --skip-done runs the pairs that did not finish)")


def steps_to(curve: list[float], threshold: float, window: int) -> int | None:
    """Eq. 19: the first step at which the mean reward of the last `window` steps is >= threshold (None: never)."""
    for t in range(window, len(curve) + 1):
        if sum(curve[t - window:t]) / window >= threshold:
            return t
    return None


def mean_std(xs: list[float]) -> tuple[float, float]:
    """The mean and the sample std (ddof 1, the usual for mean ± std over seeds; nan for one value)."""
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan


def fmt(xs: list[float], digits=3) -> str:
    """Mean ± sample std; one value alone."""
    m, s = mean_std(xs)
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if len(xs) > 1 else "")


def by_seed(diffs: list[tuple[int, float]]) -> str:
    """Paired differences, each seed's then their mean ± sample std: 'seed 1: +0.100, seed 2: -0.050 (mean
    0.025 ± 0.106)'."""
    return ", ".join(f"seed {s}: {d:+.3f}" for s, d in diffs) + f" (mean {fmt([d for _, d in diffs])})"


def sci(xs: list[float]) -> str:
    """Mean ± sample std in scientific notation: the shared-token coefficient spans 1e-10 (float32 zero) to
    1e-2."""
    m, s = mean_std(xs)
    return f"{m:.1e}" + (f" ± {s:.1e}" if len(xs) > 1 else "")


# ----------------------------------------------------------------------------- part 1: the built-in task
def finished(root: str, name: str, seed: int) -> bool:
    """--skip-done: one run folder whose metrics.jsonl ends with the run's Jitter2 (its last step); any other
    folders of the pair (a run cut short) are removed, so that the pair runs again."""
    paths = glob.glob(os.path.join(root, f"{exp_name(name)}__{seed}__*"))
    log = os.path.join(paths[0], "metrics.jsonl") if len(paths) == 1 else ""
    if os.path.isfile(log) and "charts/reward_jitter2" in (open(log).read().strip().splitlines() or [""])[-1]:
        return True
    for path in paths:
        shutil.rmtree(path)
    return False


def pending(args, jobs: list, root: str) -> list:
    """The jobs to run: all, or with --skip-done those whose (configuration, seed) has no finished run."""
    if not args.skip_done:
        return [job for job, _ in jobs]
    todo = [job for job, (name, s) in jobs if not finished(root, name, s)]
    print(f"  --skip-done: {len(jobs) - len(todo)} of {len(jobs)} runs there already", flush=True)
    return todo


def part1(args, configs: dict, seeds: list[int]) -> dict:
    root = os.path.join(args.out, "runs", "builtin")
    jobs = [((f"{name} seed {s}", [*argv, "--seed", str(s), "--num-steps", str(args.steps), "--eval-every", "0",
                                   "--exp-name", exp_name(name), "--output-dir", root],
              os.path.join(root, f"{exp_name(name)}__{s}.log")), (name, s)) for name, argv in configs.items()
            for s in seeds]
    if not args.table_only:
        os.makedirs(root, exist_ok=True)
        run_jobs(pending(args, jobs, root), args.workers)
    result = {}
    for name in configs:
        per_seed = []
        for s in seeds:
            rows = metrics(root, name, s)
            steps = step_rows(rows, CURVES, f"{name!r} seed {s} under {root}")
            keys = list(CURVES) + [k for k in EXTRA_CURVES if all(k in r for r in steps)]
            per_seed.append({"curves": {k: [r[k] for r in steps] for k in keys},
                             "jitter2": jitter2(rows, f"{name!r} seed {s} under {root}")})
        result[name] = per_seed
    return result


def final_reward(run: dict) -> float:
    """The mean reward of a run's last 10% of steps (at least one)."""
    curve = run["curves"]["charts/reward_mean"]
    n = max(1, len(curve) // 10)
    return sum(curve[-n:]) / n


def step_mean(run: dict, key: str) -> float:
    """A per-step curve's mean over the run's steps."""
    return sum(run["curves"][key]) / len(run["curves"][key])


def table1(result: dict, args) -> str:
    lines = [f"| objective | reward, last 10% of steps | steps to reward ≥ {args.threshold} (eq. 19) | Jitter2 (eq. 20) "
             "| Asym (eq. 23) | shared-token coef. (eq. 72) | clip fraction | entropy, last step |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in result.items():
        last = [final_reward(r) for r in runs]
        reach = [steps_to(r["curves"]["charts/reward_mean"], args.threshold, args.window) for r in runs]
        hit = [x for x in reach if x is not None]
        reach_s = (f"{fmt(hit, 1)} ({len(hit)}/{len(runs)} seeds)" if hit else f"not reached (0/{len(runs)})")
        avg = lambda k: [sum(r["curves"][k]) / len(r["curves"][k]) for r in runs]  # noqa: E731
        lines.append(f"| {name} | {fmt(last)} | {reach_s} | {fmt([r['jitter2'] for r in runs])} | "
                     f"{fmt(avg('losses/asym'), 4)} | {sci(avg('losses/shared_coef'))} | "
                     f"{fmt(avg('losses/clipfrac'))} | {fmt([r['curves']['losses/entropy'][-1] for r in runs])} |")
    return "\n".join(lines)


def moe_numbers(runs: list[dict]) -> dict:
    """Per seed: the final reward, Jitter2, and the means over steps of the clip fraction and the flip fractions;
    the spread of log w_it as a std, the square root of the mean over steps of each step's variance over the
    completion tokens of its first minibatch (pi = pi_old) and of its later minibatches."""
    return {"reward": [final_reward(r) for r in runs], "jitter2": [r["jitter2"] for r in runs],
            "clipfrac": [step_mean(r, "losses/clipfrac") for r in runs],
            "log_w_std_first": [math.sqrt(step_mean(r, "losses/log_ratio_var_first")) for r in runs],
            "log_w_std_later": [math.sqrt(step_mean(r, "losses/log_ratio_var_later")) for r in runs],
            "route_flip_frac": [step_mean(r, "moe/route_flip_frac") for r in runs],
            "route_flip_frac_loss": [step_mean(r, "moe/route_flip_frac_loss") for r in runs]}


def table_moe(result: dict) -> str:
    lines = ["| objective on tiny-moe | reward, last 10% of steps | Jitter2 (eq. 20) | clip fraction (tokens) | "
             "std log w_it, first minibatch | std log w_it, later minibatches | route flips after one step | "
             "route flips the loss sees |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in result.items():
        m = moe_numbers(runs)
        lines.append(f"| {name} | {fmt(m['reward'])} | {fmt(m['jitter2'])} | {fmt(m['clipfrac'], 4)} | "
                     f"{sci(m['log_w_std_first'])} | {fmt(m['log_w_std_later'], 4)} | {fmt(m['route_flip_frac'], 4)} | "
                     f"{fmt(m['route_flip_frac_loss'], 4)} |")
    return "\n".join(lines)


def group_numbers(result: dict) -> dict:
    """Per group size whose two configurations ran: each one's final reward per seed and their per-seed
    differences (objective - baseline; the same seed is the same initial model and the same prompts)."""
    out = {}
    for g in GROUP_SIZES:
        base, obj = (group_name(n, g) for n in GROUP_PAIR)
        if base in result and obj in result:
            b, o = [final_reward(r) for r in result[base]], [final_reward(r) for r in result[obj]]
            out[g] = {"baseline": b, "objective": o, "difference": [y - x for x, y in zip(b, o)]}
    return out


def table_group(result: dict) -> str:
    base, obj = GROUP_PAIR
    lines = [f"| G | {base}: reward, last 10% of steps | {obj} | {obj} - {base}, per-seed paired difference | "
             f"seeds with {obj} ahead | the paper's Delta (Table 4: AIME25 avg@32, Qwen3-32B) |",
             "|---|---|---|---|---|---|"]
    for g, m in group_numbers(result).items():
        ahead = sum(d > 0 for d in m["difference"])
        lines.append(f"| {g} | {fmt(m['baseline'])} | {fmt(m['objective'])} | {fmt(m['difference'])} | "
                     f"{ahead}/{len(m['difference'])} | +{PAPER_TABLE4[g]} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- part 2: Appendix A's task
TWO_FORM_PAIRS = [(a, b) for a in range(10) for b in range(10)]


def two_form_data(out: str) -> str:
    """All 'What is a+b?' for a, b in 0..9 as a {prompt, answer} .jsonl the scripts read; returns its path."""
    path = os.path.join(out, "two_form.jsonl")
    with open(path, "w") as f:
        for a, b in TWO_FORM_PAIRS:
            f.write(json.dumps({"prompt": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n")
    return path


def probe_pairs(probes: int, seed: int) -> list[tuple[int, int]]:
    """The (a, b) of the fixed probe prompts."""
    return random.Random(seed).sample(TWO_FORM_PAIRS, probes)


def warm_start(out: str, steps: int, seed: int) -> str:
    """Supervised warm start of the tiny model on both surface forms (half each) with 25% wrong sums, so that RL
    starts from a policy that writes both and is sometimes wrong (groups with reward variance). Returns its folder."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = modeling.tiny_tokenizer()
    lm = modeling.tiny_model(tok)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    for step in range(steps):
        prompts, completions = [], []
        for _ in range(64):
            a, b = rng.randrange(10), rng.randrange(10)
            n = a + b if rng.random() < 0.75 else a + b + rng.choice([-2, -1, 1, 2])
            prompts.append(f"What is {a}+{b}?")
            completions.append((FORM_A if rng.random() < 0.5 else FORM_B).format(a=a, b=b, n=n))
        ids, labels = encode(tok, prompts, completions)
        loss = torch.nn.functional.cross_entropy(lm(input_ids=ids).logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = os.path.join(out, "warm_start")
    from transformers.utils import logging

    logging.disable_progress_bar()
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    print(f"  warm start: {steps} steps, last loss {loss.item():.3f}", flush=True)
    return path


def encode(tok, prompts: list[str], completions: list[str]):
    """Chat-templated prompt + completion + EOS, right-padded; labels -100 outside the completion."""
    texts = data.chat_prompts(tok, prompts, False)
    seqs = [(tok(p, add_special_tokens=False).input_ids, tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id])
            for p, c in zip(texts, completions)]
    L = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    labels = torch.full((len(seqs), L), -100)
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    return ids, labels


@torch.no_grad()
def seq_logprob(lm, tok, prompts: list[str], completions: list[str], eos: bool = True) -> torch.Tensor:
    """log pi(completion | chat-templated prompt), summed over its tokens (and EOS), one value per row."""
    ids, labels = encode(tok, prompts, completions)
    if not eos:  # drop the EOS label: the probability of the text as a prefix
        labels[torch.arange(len(labels)), (labels != -100).long().cumsum(1).argmax(1)] = -100
    logp = torch.log_softmax(lm(input_ids=ids).logits[:, :-1].double(), -1)
    target = labels[:, 1:]
    lp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return (lp * (target != -100)).sum(1)


def measure(ckpt: str, probes: list[tuple[int, int]]) -> dict:
    """Exact h(p) and prefix log-probability of one checkpoint, per probe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tok_dir, weights_dir = ckpt, ckpt
    if os.path.isdir(os.path.join(ckpt, "state")):  # a run's step_N: its fp32 master weights, its export's tokenizer
        tok_dir, weights_dir = os.path.join(ckpt, "model"), os.path.join(ckpt, "state")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    lm = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
    prompts = [f"What is {a}+{b}?" for a, b in probes]
    la = seq_logprob(lm, tok, prompts, [FORM_A.format(a=a, b=b, n=a + b) for a, b in probes])
    lb = seq_logprob(lm, tok, prompts, [FORM_B.format(a=a, b=b, n=a + b) for a, b in probes])
    prefix = seq_logprob(lm, tok, prompts, [PREFIX] * len(prompts), eos=False)  # log pi("So, " | x), group-wide
    p = torch.sigmoid(la - lb)
    h = -(p * p.clamp(min=1e-300).log2() + (1 - p) * (1 - p).clamp(min=1e-300).log2())
    return {"h": h.mean().item(), "log_odds": (la - lb).tolist(), "prefix": prefix.tolist(),
            "p_correct": (la.exp() + lb.exp()).mean().item()}


def part2(args, configs: dict, seeds: list[int]) -> dict:
    root = os.path.join(args.out, "runs", "two_form")
    probes = probe_pairs(args.probes, 0)
    model = os.path.join(root, "warm_start")
    if not args.table_only:
        os.makedirs(root, exist_ok=True)
        data = two_form_data(root)
        if not (args.skip_done and os.path.isdir(model)):  # the warm start is the same every time (seed 0)
            model = warm_start(root, args.sft_steps, 0)
        common_flags = ["--model", model, "--dataset", data, "--learning-rate", "5e-4", "--max-new-tokens", "24",
                        "--eval-every", "0", "--eval-size", "4", "--num-steps", str(args.two_form_steps),
                        "--save-every", str(args.save_every), "--keep-checkpoints", "0", "--output-dir", root]
        jobs = [((f"{name} seed {s} (two forms)", [*argv, *common_flags, "--seed", str(s), "--exp-name",
                                                   exp_name(name)],
                  os.path.join(root, f"{exp_name(name)}__{s}.log")), (name, s)) for name, argv in configs.items()
                for s in seeds]
        run_jobs(pending(args, jobs, root), args.workers)
    start = measure(model, probes)
    result = {}
    for name in configs:
        per_seed = []
        for s in seeds:
            ckpts = sorted(glob.glob(os.path.join(run_dir(root, name, s), "step_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
            points = [(0, start)] + [(int(c.rsplit("_", 1)[1]), measure(c, probes)) for c in ckpts]
            rows = [r for r in metrics(root, name, s) if "charts/reward_mean" in r]
            per_seed.append({
                "steps": [t for t, _ in points], "h": [m["h"] for _, m in points],
                "log_odds_drift": [median([abs(a - b) for a, b in zip(m["log_odds"], start["log_odds"])])
                                   for _, m in points],
                "prefix_drift": [median([a - b for a, b in zip(m["prefix"], start["prefix"])]) for _, m in points],
                "p_correct": [m["p_correct"] for _, m in points],
                "reward": [r["charts/reward_mean"] for r in rows],
                "shared_coef": [r["losses/shared_coef"] for r in rows]})
        result[name] = per_seed
    return result


def median(xs: list[float]) -> float:
    """Over the probes: a probe whose form A or B is no longer sampled has a log-odds heading to -inf or +inf, and
    would dominate a mean."""
    return float(torch.tensor(xs, dtype=torch.float64).median())


def table2(result: dict) -> str:
    lines = ["| objective | h(p) start → end (bits) | abs. log-odds drift A vs B (eq. 41), median over probes | "
             "log pi(\"So, \") drift (App. A.2), median over probes | shared-token coef. (eq. 72), mean over steps | "
             "reward first → last 10% |",
             "|---|---|---|---|---|---|"]
    for name, runs in result.items():
        n = max(1, len(runs[0]["reward"]) // 10)
        lines.append(
            f"| {name} | {runs[0]['h'][0]:.3f} → {fmt([r['h'][-1] for r in runs])} | "
            f"{fmt([r['log_odds_drift'][-1] for r in runs], 2)} | {fmt([r['prefix_drift'][-1] for r in runs], 4)} | "
            f"{sci([sum(r['shared_coef']) / len(r['shared_coef']) for r in runs])} | "
            f"{fmt([sum(r['reward'][:n]) / n for r in runs], 2)} → {fmt([sum(r['reward'][-n:]) / n for r in runs], 2)} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots
def plot(out: str, part1_result: dict, part2_result: dict, window: int) -> list[str]:
    """Mean over seeds as a line, min..max over seeds as a band; per-step curves averaged over `window` steps first.
    Needs matplotlib; without it, no plots."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r experiments/requirements.txt): table only, no plots")
        return []

    def band(ax, xs, ys_per_seed, label, smooth=1):
        n = min(len(y) for y in ys_per_seed)
        ys = torch.tensor([y[:n] for y in ys_per_seed], dtype=torch.float64)
        if smooth > 1:  # trailing moving average, shorter at the start
            c = torch.nn.functional.pad(ys.cumsum(1), (1, 0))
            k = torch.arange(1, n + 1).clamp(max=smooth)
            ys = (c[:, 1:] - c[:, torch.arange(n) + 1 - k]) / k
        line, = ax.plot(xs[:n], ys.mean(0), label=label, lw=1.3, ls="--" if "token" in label else "-")
        ax.fill_between(xs[:n], ys.min(0).values, ys.max(0).values, color=line.get_color(), alpha=0.12, lw=0)

    paths = []
    builtin = {k: v for k, v in part1_result.items() if k in BUILTIN}
    if builtin:
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for ax, (key, title) in zip(axes.flat, CURVES.items()):
            for name, runs in builtin.items():
                ys = [r["curves"][key] for r in runs]
                band(ax, list(range(1, len(ys[0]) + 1)), ys, name, window)
            ax.set_title(title)
            ax.set_xlabel("RL step")
        axes.flat[-1].axis("off")
        axes.flat[-1].legend(*axes.flat[0].get_legend_handles_labels(), loc="center")
        fig.suptitle(f"built-in task: mean over seeds of the {window}-step moving average, band = min..max over seeds")
        fig.tight_layout()
        paths.append(os.path.join(out, "builtin.png"))
        fig.savefig(paths[-1], dpi=90)
    if part2_result:
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        panels = [("h", "h(p) between the two correct forms (bits)"),
                  ("log_odds_drift", "|log-odds drift| A vs B (eq. 41), median"),
                  ("prefix_drift", "drift of log pi(shared prefix) (App. A.2), median"), ("reward", "reward")]
        for ax, (key, title) in zip(axes, panels):
            for name, runs in part2_result.items():
                xs = runs[0]["steps"] if key != "reward" else list(range(1, len(runs[0]["reward"]) + 1))
                band(ax, xs, [r[key] for r in runs], name, window if key == "reward" else 1)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step")
        axes[0].legend(fontsize=8)
        fig.suptitle("Appendix A's task, two equally correct surface forms: mean over seeds, band = min..max "
                     f"(reward: {window}-step moving average)")
        fig.tight_layout()
        paths.append(os.path.join(out, "two_form.png"))
        fig.savefig(paths[-1], dpi=90)
    moe = {k: v for k, v in part1_result.items() if k in MOE}
    groups = group_numbers(part1_result)
    if moe or groups:
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        panels = [("charts/reward_mean", "tiny-moe: reward"), ("losses/log_ratio_var_later",
                                                              "tiny-moe: std log w_it, later minibatches"),
                  ("moe/route_flip_frac", "tiny-moe: route flips after one step")]
        for ax, (key, title) in zip(axes, panels):
            for name, runs in moe.items():
                ys = [[math.sqrt(v) for v in r["curves"][key]] if "var" in key else r["curves"][key] for r in runs]
                band(ax, list(range(1, len(ys[0]) + 1)), ys, name, window)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("RL step")
        if moe:
            axes[0].legend(fontsize=8)
        ax = axes[3]
        for g, m in groups.items():
            ax.scatter([g] * len(m["difference"]), m["difference"], color="C0", s=12)
        if groups:
            ax.plot(list(groups), [mean_std(m["difference"])[0] for m in groups.values()], "o-", color="C0",
                    label=f"{GROUP_PAIR[1]} - {GROUP_PAIR[0]}: seeds, mean")
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(GROUP_SIZES, [str(g) for g in GROUP_SIZES])
            ax.set_xlabel("group size G")
            ax.set_ylabel("final reward difference")
            paper = ax.twinx()
            paper.plot(GROUP_SIZES, [PAPER_TABLE4[g] for g in GROUP_SIZES], "s--", color="C3",
                       label="the paper (AIME25)")
            paper.set_ylabel("the paper's Delta, AIME25 avg@32 points", color="C3")
            ax.legend(*[a + b for a, b in zip(ax.get_legend_handles_labels(), paper.get_legend_handles_labels())],
                      fontsize=8)
        ax.set_title("DFPO Table 4: min-replace minus GSPO by G", fontsize=10)
        fig.suptitle(f"built-in task ablations: mean over seeds of the {window}-step moving average, band = min..max")
        fig.tight_layout()
        paths.append(os.path.join(out, "ablations.png"))
        fig.savefig(paths[-1], dpi=90)
    return paths


def main():
    args = tyro.cli(Args)
    if args.smoke:
        args.seeds, args.steps, args.two_form_steps, args.save_every, args.sft_steps = 1, 3, 4, 2, 20
        args.only = args.only or ("gspo,dfpo min-replace --length-aware,gspo --model tiny-moe,"
                                  "gspo --group-size 4,dfpo min-replace --group-size 4")
    wanted = set(only_commands(args.only, PART1))
    if args.seeds < 1 or args.steps < 3 or args.two_form_steps < args.save_every or args.save_every < 1:
        raise SystemExit("--seeds >= 1, --steps >= 3 (Jitter2 needs 3 points), --two-form-steps >= --save-every >= 1")
    if not 1 <= args.probes <= 100:
        raise SystemExit(f"--probes {args.probes}: between 1 and the task's 100 prompts")
    t0 = time.time()
    if not args.table_only and not args.skip_done:
        shutil.rmtree(os.path.join(args.out, "runs"), ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    seeds = list(range(1, args.seeds + 1))
    print(f"part 1: the built-in task, {len(wanted)} configurations x {len(seeds)} seeds x {args.steps} steps",
          flush=True)
    r1 = part1(args, {k: v for k, v in PART1.items() if k in wanted}, seeds)
    two = {k: v for k, v in TWO_FORM.items() if k in wanted and args.two_form}
    print(f"part 2: two surface forms, {len(two)} objectives x {len(seeds)} seeds x {args.two_form_steps} steps",
          flush=True)
    r2 = part2(args, two, seeds) if two else {}
    builtin = {k: v for k, v in r1.items() if k in BUILTIN}
    moe = {k: v for k, v in r1.items() if k in MOE}
    groups = group_numbers(r1)
    sections = [(f"Built-in task, {args.steps} steps", table1(builtin, args) if builtin else ""),
                (f"Mixture-of-Experts (tiny-moe), built-in task, {args.steps} steps", table_moe(moe) if moe else ""),
                (f"Group size (the DFPO paper's Table 4), built-in task, {args.steps} steps",
                 table_group(r1) if groups else ""),
                (f"Two surface forms (Appendix A), {args.two_form_steps} steps", table2(r2) if r2 else "")]
    what = "the tables rebuilt from the runs under runs/" if args.table_only else "runs and tables"
    report = (f"# Learning-tax lab\n\n`python experiments/learning_tax.py {' '.join(sys.argv[1:])}`: {len(seeds)} "
              f"seeds, {what} in {time.time() - t0:.0f} s. Mean ± sample std (ddof 1) over seeds.\n"
              + "".join(f"\n## {title}\n\n{table}\n" for title, table in sections if table))
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"args": vars(args), "builtin": r1, "moe": {k: moe_numbers(v) for k, v in moe.items()},
                   "group_size": groups, "two_form": r2}, f)
    plots = plot(args.out, r1, r2, args.window)
    print(report)
    print(f"written: {os.path.join(args.out, 'table.md')}, summary.json" + "".join(f", {p}" for p in plots)
          + f" ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
