"""The defaults that depend on the model and the task (fill_defaults), and the flags as the
objects generation and evaluation take (rollout_sampling: a Sampling; eval_plan: an Evaluation).
"""

from __future__ import annotations

import dataclasses

from ..episodes import tools_of
from ..evaluation import Evaluation
from ..modeling import TINY_MODELS
from ..sampling import Sampling


def fill_defaults(args):
    """args with the defaults that depend on the model and the task filled in (each None until
    here); every script's main() calls it first, so the run is logged, checkpointed and compared on
    resume with these values, and nothing changes args after it:
    --learning-rate   5e-4 for the tiny models (random init learns fast with a large step), 1e-6
                      otherwise (the papers' scale)
    --max-new-tokens  2 for the built-in task (one digit, then EOS), 1024 otherwise (real tasks
                      reason)
    --truncated-reward-scale  0.5 for the built-in task, whose reward asks for the digit and a
                      stop (a right digit cut at the limit scores half), 1.0 otherwise
    --eval-max-new-tokens     --max-new-tokens"""
    builtin, tiny = args.dataset == "builtin", args.model in TINY_MODELS
    max_new_tokens = (2 if builtin else 1024) if args.max_new_tokens is None else args.max_new_tokens
    return dataclasses.replace(
        args,
        learning_rate=(5e-4 if tiny else 1e-6) if args.learning_rate is None else args.learning_rate,
        max_new_tokens=max_new_tokens,
        eval_max_new_tokens=max_new_tokens if args.eval_max_new_tokens is None
        else args.eval_max_new_tokens,
        truncated_reward_scale=(0.5 if builtin else 1.0) if args.truncated_reward_scale is None
        else args.truncated_reward_scale)


def rollout_sampling(args) -> Sampling:
    """The rollout's Sampling: how a step's completions are drawn (sampling, lengths, --gen-mode
    and its settings), passed whole to generation.generate and the engine."""
    return Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty,
                    min_new_tokens=args.min_new_tokens, mode=args.gen_mode,
                    gen_batch_size=args.gen_batch_size, unshard=args.gen_unshard,
                    cuda_graphs=args.gen_cuda_graphs, engine_dtype=args.gen_dtype)


def eval_plan(args, sampling: Sampling, reward) -> Evaluation:
    """The held-out evaluation's Evaluation: the rollout's sampling with the evaluation's own
    temperature, top_p and max_new_tokens (--eval-temperature, --eval-top-p,
    --eval-max-new-tokens: by default the training ones), --eval-k and --eval-n, the task's
    reward, --log-eval-samples, the name of an evaluation before the first step (the step-0
    one, or --eval-only's), and with --tools or --environment the run's Tools (episodes.tools_of,
    the rollout's own): the evaluation then runs episodes as the rollout does."""
    own = dataclasses.replace(
        sampling, max_new_tokens=args.eval_max_new_tokens,
        temperature=args.temperature if args.eval_temperature is None else args.eval_temperature,
        top_p=args.top_p if args.eval_top_p is None else args.eval_top_p)
    return Evaluation(sampling=own, k=args.eval_k, n=args.eval_n, reward=reward,
                      log_samples=args.log_eval_samples,
                      first_name="the --eval-only evaluation" if args.eval_only
                      else "the step-0 evaluation",
                      tools=tools_of(args) if args.tools or args.environment else None)
