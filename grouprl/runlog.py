"""The run log: tensorboard and metrics.jsonl on rank 0 (Logger), a resumed run's rows, the step's
rollout numbers (rollout_log), the samples tables (--log-samples, --log-eval-samples) and the
reward curve's jitter (DFPO eq. 20). docs/logging.md lists every key.
"""

from __future__ import annotations

import json
import math
import os

import torch

from .checkpoint import writing
from .distributed import Dist, Refused, all_gather_cat, all_reduce, on_rank0
from .evaluation import EVAL_ROWS
from .generation import Rollout
from .grader import Reward

class Logger:
    """Tensorboard + metrics.jsonl on rank 0 only, one row a step, in strict JSON (a non-finite
    number is null). A resumed run (first_step > 1) continues both at first_step: rows a killed run
    logged after its checkpoint are dropped from metrics.jsonl and samples.jsonl and purged from
    tensorboard, and a torn last line (a write cut short) is dropped and said so; the kept rows are
    rewritten into a new file that replaces the old one whole."""

    def __init__(self, run_dir: str, dist_env: Dist, args, first_step: int = 1):
        self.dist_env, self.writer, self.wandb, self.run_dir = dist_env, None, None, run_dir
        # a bad metrics.jsonl stops every rank
        on_rank0(lambda: self._open(run_dir, args, first_step), dist_env)

    def _open(self, run_dir: str, args, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        path = os.path.join(run_dir, "metrics.jsonl")
        kept = read_metrics(path, keep_below=first_step) if first_step > 1 else []
        os.makedirs(run_dir, exist_ok=True)
        self.writer = SummaryWriter(run_dir, purge_step=first_step if first_step > 1 else None)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in vars(args).items()))
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1, default=str)
        rewrite_rows(path, kept)
        for name in ("samples.jsonl", EVAL_SAMPLES):  # the steps this run redoes log new samples
            samples = os.path.join(run_dir, name)
            if first_step > 1 and os.path.exists(samples):
                rewrite_rows(samples, read_metrics(samples, keep_below=first_step))
        self.metrics = open(path, "a")
        if getattr(args, "track", False):  # --track: Weights & Biases too, the same keys (CleanRL)
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity,
                                    name=os.path.basename(os.path.normpath(run_dir)),
                                    config=vars(args), dir=run_dir, resume="allow",
                                    id=os.path.basename(os.path.normpath(run_dir)))

    def log(self, step: int, scalars: dict):
        """The step's numbers; an evaluation's --log-eval-samples rows (EVAL_ROWS) go to
        eval_samples.jsonl and tensorboard instead (log_eval_samples)."""
        if not self.dist_env.main:
            return
        if scalars.get(EVAL_ROWS):
            log_eval_samples(self, step, scalars[EVAL_ROWS])
        # strict JSON: null, not NaN
        row = {k: v if math.isfinite(v) else None for k, v in scalars.items() if k != EVAL_ROWS}
        with writing(self.run_dir, self.metrics.name):  # a full disk, a deleted run folder
            for k, v in row.items():
                if v is not None:
                    self.writer.add_scalar(k, v, step)
            self.metrics.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
            self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)

    def close(self):
        if self.dist_env.main:
            self.writer.close()
            self.metrics.close()
            if self.wandb is not None:
                self.wandb.finish()


def rewrite_rows(path: str, rows: list[dict]):
    """path holds rows, one JSON object a line; replaced whole, never half written."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def read_metrics(path: str, keep_below: int | None = None) -> list[dict]:
    """The rows of a metrics.jsonl or samples.jsonl (those with step < keep_below if given). A last
    line cut short by a killed writer is dropped, and said so; any other line that is not JSON
    raises Refused with its line number."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            # files written before rows were strict JSON
            row = json.loads(line, parse_constant=lambda c: None)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a row")
        except ValueError:
            if i == len(lines):  # no newline after it: the write was cut short
                print(f"{path}: dropped a torn last line ({len(line)} characters, not a whole row)")
                continue
            raise Refused(f"{path} line {i} is not JSON: repair or remove that line, then resume")
        if keep_below is None or row["step"] < keep_below:
            rows.append(row)
    return rows


def rollout_log(roll: Rollout, zero_groups: int, reward: Reward, args, dist_env: Dist) -> dict:
    """The step's rollout over all ranks: charts/ (rewards, lengths, truncation, flat groups,
    failed reward calls), rewards/<name>/ of each --reward, and the rollout's own stats
    (perf/gen_tokens_per_s; --dynamic-sampling: charts/gen_rounds ...)."""
    rewards = all_gather_cat(roll.rewards.to(roll.input_ids.device))
    lengths = all_gather_cat(roll.mask.sum(1))
    masked_truncated = 0
    if args.mask_truncated:
        masked_truncated = all_reduce(roll.truncated.sum().float()).item()
    zero_frac = torch.tensor(zero_groups / args.prompts_per_rank)  # this rank's
    return {
        "charts/reward_mean": rewards.mean().item(),
        "charts/reward_std": rewards.std(unbiased=False).item(),
        "charts/response_length_mean": lengths.mean().item(),
        "charts/response_length_max": lengths.max().item(),
        "charts/truncated_frac": all_gather_cat(roll.truncated.float()).mean().item(),
        "charts/masked_truncated": masked_truncated,
        "charts/zero_adv_group_frac": all_reduce(zero_frac).item() / dist_env.world,  # rank mean
        "charts/reward_errors": all_reduce(torch.tensor(float(roll.reward_errors))).item(),
        **reward.metrics(),  # rewards/<name>/mean and /std, each --reward
        **roll.stats,  # perf/gen_tokens_per_s; --dynamic-sampling: charts/gen_rounds ...
    }


SAMPLE_PROMPTS = 2  # prompts a --log-samples step shows, each with all its completions


def log_samples(logger: Logger, roll: Rollout, advantages: torch.Tensor, step: int, every: int):
    """Every `every` steps (--log-samples; 0: never; main rank only): the first SAMPLE_PROMPTS
    prompts of this rank's step (roll.rows: prompt, answer, and text, the prompt as the model saw
    it through the chat template, logged as "prompt_text") with their completions, rewards and
    advantages, as a text table in tensorboard ('samples') and as one JSON object a completion in
    {run_dir}/samples.jsonl (a resumed run's Logger has dropped the rows of the steps it redoes)."""
    if not every or step % every or not logger.dist_env.main:
        return
    run_dir, texts, rewards = logger.run_dir, roll.texts, roll.rewards
    prompts, answers, prompt_texts = roll.rows["prompt"], roll.rows["answer"], roll.rows["text"]
    n = len(texts) // len(prompts)  # completions a prompt: the group size
    path = os.path.join(run_dir, "samples.jsonl")
    rows, md = [], []
    for g in range(min(SAMPLE_PROMPTS, len(prompts))):
        md.append(f"**prompt:** {prompts[g]}  \n**answer:** {answers[g]}\n\n"
                  "| reward | advantage | completion |\n|---|---|---|")
        for i in range(g * n, (g + 1) * n):
            rows.append({"step": step, "prompt": prompts[g], "prompt_text": prompt_texts[g],
                         "answer": answers[g],
                         "completion": texts[i], "reward": rewards[i].item(),
                         "advantage": advantages[i].item()})
            cell = texts[i].replace("|", "\\|").replace("\n", "<br>")
            md.append(f"| {rewards[i].item():.3f} | {advantages[i].item():+.3f} | {cell} |")
    with writing(run_dir, path):  # a full disk, a deleted run folder: one line
        logger.writer.add_text("samples", "\n".join(md), step)
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


EVAL_SAMPLES = "eval_samples.jsonl"  # --log-eval-samples, beside samples.jsonl


def log_eval_samples(logger: Logger, step: int, rows: list[dict]):
    """An evaluation's rows (evaluate's EVAL_ROWS: prompt, answer, completion, reward, extracted
    answer, truncated), one JSON object a completion with its step in {run_dir}/eval_samples.jsonl,
    and a text table in tensorboard ('eval_samples'); main rank only."""
    path = os.path.join(logger.run_dir, EVAL_SAMPLES)
    md, prompt = [], None
    for r in rows:
        if r["prompt"] != prompt:
            prompt = r["prompt"]
            md.append(f"\n**prompt:** {prompt}  \n**answer:** {r['answer']}\n\n"
                      "| reward | extracted | completion |\n|---|---|---|")
        cell = r["completion"].replace("|", "\\|").replace("\n", "<br>")
        said = str(r["extracted"]).replace("|", "\\|")
        md.append(f"| {r['reward']:.3f} | {said} | {cell} |")
    with writing(logger.run_dir, path):  # a full disk, a deleted run folder: one line
        logger.writer.add_text("eval_samples", "\n".join(md).strip(), step)
        with open(path, "a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)


def jitter2(m: list[float]) -> float:
    """Second-order difference jitter of a curve, DFPO eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t|
    (nan if T < 3)."""
    if len(m) < 3:
        return float("nan")
    return sum(abs(m[t + 2] - 2 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)
