"""The rollout's checks, called by check_common_args (checks.py) in its order: how completions are
sampled and whose log-probs pi_old is (check_rollout_args: --old-logp, --rollout-is-*,
--min-new-tokens, --top-entropy-quantile), where and how stale they are generated
(check_staleness_args: --async-rollouts, --rollout-ranks, --max-staleness), and once the data is
loaded, --dynamic-sampling's pool of extra prompts (check_prompt_pool).
"""

from __future__ import annotations

import os

from ..distributed import fail, launched
from .bounds import check_float, check_int
from .flags import CommonArgs


def check_prompt_pool(args, n_train: int, world: int):
    """--dynamic-sampling draws its extra prompts from the train rows outside the step's own batch
    (common.extra_prompt_indices): there must be some. Called once the data is loaded, before the
    model."""
    if args.dynamic_sampling and not args.eval_only and n_train <= args.prompts_per_rank * world:
        fail(f"--dynamic-sampling replaces flat groups with prompts from outside the step's own "
             f"batch, and the {n_train} train rows fit in one step (--prompts-per-rank "
             f"{args.prompts_per_rank} x {world} ranks): use more data or a smaller "
             "--prompts-per-rank, or drop --dynamic-sampling")


def check_rollout_args(args):
    """--rollout-is-cap: a finite C > 0, on a script whose loss is a sum of token terms, with pi_old
    recomputed (the weight is pi_old / pi_rollout). --old-logp rollout: no repetition penalty (the
    engine's log-probs are then the penalised sampler's, not the policy's). What needs the model's
    config (a generation mode that returns log-probs, --routing-replay on an MoE model) is checked
    by modeling.check_model."""
    check_float("top-entropy-quantile", args.top_entropy_quantile, 0, 1, low_open=True,
                why=" (rho, the fraction of tokens kept by entropy; 1: all)")
    if args.top_entropy_quantile < 1 and args.old_logp == "rollout":
        fail(f"--top-entropy-quantile {args.top_entropy_quantile} ranks tokens by pi_old's "
             "entropies, computed by the recompute pass: use --old-logp recompute (the default)")
    check_int("min-new-tokens", args.min_new_tokens, 0,
              min(args.max_new_tokens, args.eval_max_new_tokens),
              " (at most --max-new-tokens and --eval-max-new-tokens)")
    if args.mask_truncated and args.min_new_tokens >= args.max_new_tokens:
        fail(f"--mask-truncated with --min-new-tokens {args.min_new_tokens} = --max-new-tokens "
             f"{args.max_new_tokens}: no completion can stop before the limit, so every one would be "
             "masked and nothing learned; lower --min-new-tokens, or drop --mask-truncated")
    sampler_logp = args.old_logp == "rollout" and args.gen_mode.startswith("engine")
    if sampler_logp and args.min_new_tokens:
        fail(f"--old-logp rollout with --min-new-tokens {args.min_new_tokens}: the engine's "
             "log-probs of a completion's first tokens are then the EOS-masked sampler's, not the "
             "policy's, so pi_old would be wrong; use --old-logp recompute (the default)")
    if sampler_logp and args.repetition_penalty != 1:
        fail(f"--old-logp rollout with --repetition-penalty {args.repetition_penalty}: the "
             "engine's log-probs are then the penalised sampler's, not the policy's, so pi_old would "
             "be wrong; use --old-logp recompute (the default), or drop --repetition-penalty")
    cap = args.rollout_is_cap
    if cap is None:
        if args.rollout_is_mode != CommonArgs.rollout_is_mode:
            fail(f"--rollout-is-mode {args.rollout_is_mode} needs --rollout-is-cap (C_max): the "
                 "rollout correction is on when a cap is given, and corrects nothing without one")
        if args.rollout_is_min is not None:
            fail(f"--rollout-is-min {args.rollout_is_min} needs --rollout-is-cap (C_max; a large one "
                 "for none): the rollout correction is on when a cap is given")
        return
    check_float("rollout-is-cap", cap, 0, low_open=True,
                why=" (TIS weights each token by min(pi_old / pi_rollout, C))")
    if args.rollout_is_min is not None:
        check_float("rollout-is-min", args.rollout_is_min, 0, cap, low_open=True, high_open=True,
                    why=" (C_min, below --rollout-is-cap)")
    if args.rollout_is_mode.startswith("sequence") and not args.sequence_is_weights:
        fail(f"--rollout-is-mode {args.rollout_is_mode}: vespo.py folds the rollout's ratios into "
             "its sequence weight token by token; use token-truncate or token-mask (as TRL)")
    if args.old_logp == "rollout":
        fail(f"--rollout-is-cap {cap} weights by pi_old / pi_rollout, and --old-logp rollout makes "
             "pi_old the rollout's own: use --old-logp recompute, or drop --rollout-is-cap")


def check_staleness_args(args):
    """--max-staleness k >= 0 and --weight-sync-steps W >= 1: past weights kept (k > 0 or W > 1)
    in one process (--resume is exact: the checkpoint holds the ring of past weights,
    grouprl/staleness.py), or under torchrun with --async-rollouts (rollout_ranks): more ranks than
    --rollout-ranks, and what the rollout ranks cannot sample refused."""
    k, ranks, sync = args.max_staleness, args.rollout_ranks, args.weight_sync_steps
    check_int("max-staleness", k, 0, why=" (weight versions behind; 0: today's run)")
    check_int("weight-sync-steps", sync, 1, why=" (steps a weight version; 1: every step)")
    if ranks != 1 and not args.async_rollouts:
        fail(f"--rollout-ranks {ranks} sets how many ranks generate under --async-rollouts: add "
             "--async-rollouts, or drop it")
    if not args.async_rollouts:
        if (k or sync > 1) and launched():
            flag = f"--max-staleness {k}" if k else f"--weight-sync-steps {sync}"
            fail(f"{flag} keeps past weights in one process; under torchrun add "
                 "--async-rollouts (ranks that generate beside the trainers), or run it with "
                 "plain `python`")
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if not launched():
        fail("--async-rollouts splits a torchrun job into trainers and rollout ranks: launch with "
             "`torchrun --nproc-per-node N`, N > --rollout-ranks")
    check_int("rollout-ranks", ranks, 1, why=" (ranks that generate)")
    if world <= ranks:
        fail(f"--async-rollouts with --rollout-ranks {ranks} leaves no trainer among {world} "
             f"rank(s): launch more ranks (--nproc-per-node > {ranks}) or lower --rollout-ranks")
    others = [flag for flag, on in (("--dynamic-sampling", args.dynamic_sampling),
                                    ("--tools", args.tools), ("--environment", args.environment),
                                    ("--gen-mode engine-tp", args.gen_mode == "engine-tp")) if on]
    if others:
        fail(f"--async-rollouts with {others[0]}: its rounds or turns span every rank's "
             "generation at once, which a rollout rank's does not; drop one of the two")
