"""Held-out evaluation: avg@k and pass@k over the held-out prompts (over episodes with --tools or
--environment, as the rollout makes them), the --eval-only report, and the one-line summary a step
prints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass

import torch

from .checkpoint import startup_phase, starting_up
from .distributed import Dist, all_reduce, fail
from .episodes import env_scores, generate_episodes
from .generation import generate
from .grader import Reward, extract_answer
from .progress import GenBar
from .rewards import score
from .sampling import Sampling
from .stats import pass_at_k
from .tools import Tools

EVAL_ROWS = "eval/completions"  # evaluate's rows of --log-eval-samples (Logger.log writes them)


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation's settings, made from the flags by cli.eval_plan."""
    sampling: Sampling  # the rollout's, with --eval-temperature, --eval-top-p, --eval-max-new-tokens
    k: int  # --eval-k
    n: int | None = None  # --eval-n: samples a prompt (None: k)
    reward: Reward | None = None  # the task's reward (None: the math grader)
    log_samples: int = 0  # --log-eval-samples: prompts whose completions are logged
    first_name: str = "the step-0 evaluation"  # its name before the first step (or --eval-only)
    tools: Tools | None = None  # --tools/--environment: the run's (episodes.tools_of); None: plain


@torch.no_grad()
def evaluate(policy, tok, held, eos, dist_env: Dist, plan: Evaluation) -> dict:
    """Over the held-out prompts (each rank an equal share), from n >= k samples a prompt (plan.n,
    defaults to k): avg@k, the mean accuracy of the n samples (an unbiased estimate of the mean
    accuracy of k samples, the DFPO paper's metric), and pass@k, the mean over prompts of the
    unbiased 1 - C(n - c, k) / C(n, k) (pass_at_k); the reward is the task's own, whole whether
    or not a completion stopped (truncated_frac: the fraction cut at max_new_tokens).
    A progress bar (GenBar) shows it; before the first step it is named first_name, in the bar
    and in a stop signal's line. log_samples (--log-eval-samples): the first N prompts of rank 0's
    share, each completion with its reward and extracted answer, as rows under EVAL_ROWS.
    plan.tools (--tools, --environment): each sample is an episode as the rollout's
    (episodes.generate_episodes, the run's Tools: reset(**row) on the held-out rows, tool turns),
    its get_reward one more reward of weight 1 as in training; logged besides: the rollout's
    tools/* over the evaluation's episodes as eval/tools/*, and eval/rewards/<Class>/mean."""
    k, n, log_samples = plan.k, plan.n or plan.k, plan.log_samples
    world = dist_env.world
    m = len(held) // world * world  # equal shares, or the FSDP all-gathers would hang
    if m == 0:
        fail(f"the held-out split has {len(held)} prompt(s), fewer than the {world} ranks that "
             "share it: give a larger dataset (a local file holds out a tenth, at most "
             "--eval-size) or --eval-every 0")
    rows = held.select(range(dist_env.rank, m, dist_env.world))
    first = starting_up()  # before the first step: the step-0 evaluation (or --eval-only)
    name = plan.first_name if first else "held-out evaluation"
    bar = GenBar(name.removeprefix("the "), len(rows), n, tok.pad_token_id, dist_env.main,
                 leave=first)
    r, errors, cut, logged = torch.zeros(0), 0, 0, []
    tally = torch.zeros(len(TALLY), dtype=torch.float64)  # episodes: their counts, summed
    per_call = max(1, plan.sampling.gen_batch_size // n)  # prompts per generate call
    with startup_phase(name) if first else contextlib.nullcontext():
        for i in range(0, len(rows), per_call):
            part = rows.select(range(i, min(i + per_call, len(rows))))
            if plan.tools is None:
                out = generate(policy, tok, part["text"], n, eos, dist_env, plan.sampling,
                               streamer=bar)
            else:  # the rollout's episodes (sample_groups): reset(**row), tool turns
                out = generate_episodes(policy, tok, part, n, eos, dist_env, plan.sampling,
                                        plan.tools, streamer=bar)
                tally += episode_tally(out)
            given = env_scores(out, plan.tools)  # get_reward: weight 1, as in training
            part_r, part_errors = score(out.texts, part, n, plan.reward, watch=False,
                                        given=given, messages=out.messages)
            for g in range(max(0, min(len(part), log_samples - i))):  # --log-eval-samples
                logged += [{"prompt": part[g]["prompt"], "answer": part[g]["answer"],
                            "completion": out.texts[j], "reward": part_r[j].item(),
                            "extracted": extract_answer(out.texts[j]),
                            "truncated": bool(out.truncated[j])}
                           for j in range(g * n, (g + 1) * n)]
            r, errors = torch.cat([r, part_r]), errors + part_errors
            cut += int(out.truncated.sum())
            bar.show(len(part))
    r = r.view(-1, n)
    passk = sum(pass_at_k(n, int(c), k) for c in (r > 0).sum(1))
    s = all_reduce(torch.tensor([r.mean(1).sum(), passk, len(rows), errors, cut], dtype=torch.float64))
    result = {f"eval/avg@{k}": (s[0] / s[2]).item(), f"eval/pass@{k}": (s[1] / s[2]).item(),
              "eval/prompts": m, "eval/samples": n, "eval/reward_errors": s[3].item(),
              "eval/truncated_frac": (s[4] / (s[2] * n)).item()}
    if plan.tools is not None:
        tally[-2:] = all_reduce(tally[-2:])  # get_reward's, this rank's; the rest: every rank's
        result.update(episode_log(tally, s[2].item() * n, plan.tools))
    bar.show(more=f", avg@{k} {result[f'eval/avg@{k}']:.3f}, pass@{k} "
                  f"{result[f'eval/pass@{k}']:.3f}")
    bar.bar.close()
    if log_samples and dist_env.main:
        result[EVAL_ROWS] = logged
    return result


# an evaluation's episodes, counted over its generate calls (generate_episodes' stats are rates and
# counts of one call's episodes, every rank's); then get_reward's sum and count (this rank's)
TALLY = ("calls", "failures", "malformed_turns", "rolled_back", "cut_by_budget", "cut_by_limit",
         "turns", "env_reward_sum", "env_reward_count")


def episode_tally(roll) -> torch.Tensor:
    """One generate_episodes call's episodes as TALLY's counts (float64), to sum: the tools'
    over every rank's episodes (as generate_episodes counts them), get_reward's over this rank's."""
    s, B = roll.stats, roll.stats["tools/episodes"]
    calls = round(s["tools/call_frequency"] * B)
    env = (torch.zeros(0, dtype=torch.float64) if roll.env_rewards is None
           else roll.env_rewards.cpu())
    return torch.tensor([calls, round(s["tools/failure_frequency"] * calls),
                         s["tools/malformed_turns"], s["tools/rolled_back"],
                         s["tools/cut_by_budget"], s["tools/cut_by_limit"],
                         round(s["tools/turns_per_episode"] * B), env.nansum().item(),
                         (~env.isnan()).sum().item()], dtype=torch.float64)


def episode_log(t: torch.Tensor, episodes: float, tools: Tools) -> dict:
    """The training's tools/* (generate_episodes' stats) over the evaluation's episodes, named
    eval/tools/*: calls an episode, failed calls over calls, model turns an episode, and the
    counts; eval/rewards/<Class>/mean: get_reward's mean where it applied (an --environment's;
    NaN, logged null, where it never did)."""
    c = dict(zip(TALLY, t.tolist()))
    log = {"eval/tools/call_frequency": c["calls"] / episodes,
           "eval/tools/failure_frequency": c["failures"] / c["calls"] if c["calls"] else 0.0,
           **{f"eval/tools/{key}": c[key] for key in TALLY[2:6]},
           "eval/tools/turns_per_episode": c["turns"] / episodes}
    if tools.env is not None and tools.env.reward:
        log[f"eval/rewards/{tools.env.name}/mean"] = (
            c["env_reward_sum"] / c["env_reward_count"] if c["env_reward_count"] else math.nan)
    return log


def eval_report(result: dict, args, run_dir: str, dist_env: Dist) -> str:
    """--eval-only: the table printed, and eval.json in the run folder (its key: the set
    evaluated, --eval-dataset or --dataset). Returns the JSON path."""
    path = os.path.join(run_dir, "eval.json")
    dataset = args.dataset if args.eval_dataset is None else args.eval_dataset
    part = "held-out" if dataset == "builtin" else "whole set"  # --eval-only: the whole file
    if args.eval_limit and dataset != "builtin":
        part = f"first {args.eval_limit}"
    if dist_env.main:
        k = next(key for key in result if key.startswith("eval/avg@")).split("@")[1]
        print(f"\n| dataset | prompts | samples a prompt | avg@{k} | pass@{k} | reward errors |\n"
              "|---|---|---|---|---|---|\n"
              f"| {dataset} ({part}) | {result['eval/prompts']} | {result['eval/samples']} | "
              f"{result[f'eval/avg@{k}']:.4f} | {result[f'eval/pass@{k}']:.4f} | "
              f"{result['eval/reward_errors']:.0f} |")
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({dataset: {k: v for k, v in result.items() if k != EVAL_ROWS}}, f, indent=1)
        print(f"written: {path}")
    return path


def eval_summary(log: dict) -> str:
    """'; held-out avg@k a, pass@k p' when `log` (a step's logged values) holds an evaluation, else
    ''."""
    k = next((key.split("@")[1] for key in log if key.startswith("eval/avg@")), None)
    if k is None:
        return ""
    return f"; held-out avg@{k} {log[f'eval/avg@{k}']:.3f}, pass@{k} {log[f'eval/pass@{k}']:.3f}"
