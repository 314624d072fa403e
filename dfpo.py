"""DFPO: Drift Fixing Policy Optimization, GSPO with an in-group transform of the post-clip sequence
weights ("Design Conditions for Intra-Group Learning of Sequence-Level Rewards: Token Gradient
Cancellation", arXiv:2604.13088, Sec. 4 and App. B, D).

    s_i           = exp(1/|y_i| sum_t log w_it)                                          (eq. 44)
    c_i           = clip(s_i, 1 - eps_low, 1 + eps_high)                                 (eq. 46)
    s_bar_i       = min(s_i, c_i) if A_i >= 0 else max(s_i, c_i)                         (eq. 47)
    J_GSPO        = 1/G sum_i A_i s_bar_i                                                (eq. 49)
    A_i           = (r_i - mean_j r_j) / std_j r_j                                       (eq. 43)
    s_tilde       = T(s_bar, A) inside each group, with sum_i A_i s_tilde_i = 0          (eq. 63)
    grad J        = 1/G sum_i s_tilde_i A_i grad log s_i, every sequence, s_tilde constant (eq. 68)
    T (--transform): min-replace (eq. 50), orth-proj (eq. 52-55), orth-proj-qp (eq. 51), scale, none
    (--kl-coef)   - beta 1/G sum_i 1/|y_i| sum_t [pi_ref/pi_theta - log(pi_ref/pi_theta) - 1]   (k3)
                  (off by default, as in the GSPO and DFPO recipes)

Equation numbers are the DFPO paper's (arXiv:2604.13088); derivations: docs/objectives.md.
Different from gspo.py: the sequences of a group get weights whose advantage-weighted sum is zero
(eq. 63), so a token the whole group shares gets no gradient at equal lengths (eq. 72-73; at any
lengths with --length-aware). Eq. 68 keeps every sequence's gradient, so it has no trust region
beyond the bound on s_tilde; --clip-gated is GSPO's gating, kept for comparison.
"""

import os
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from tqdm import tqdm

from common import (Updates, clip_grad_norm, group_advantages, logp_drift, lr_scheduler,
                    micro_batches, minibatches, old_log_probs, policy_log_probs, ref_log_probs,
                    reward_parts, sample_groups)
from grouprl import moe
from grouprl.checkpoint import (catch_stop_signals, claim_run_dir, cleanup, resume_state,
                                run_paths, save_checkpoint, stop_requested)
from grouprl.cli import (CommonArgs, check_common_args, check_float, check_prompt_pool, eval_plan,
                         fill_defaults, parse_args, rollout_sampling)
from grouprl.data import Task, load_task
from grouprl.distributed import fail, seed_rank, setup_distributed
from grouprl.evaluation import eval_report, eval_summary, evaluate
from grouprl.grader import load_reward
from grouprl.lora import lora_spec
from grouprl.modeling import (check_model, eos_ids, load_model, load_tokenizer, reference_policy,
                              wrap_policy)
from grouprl.rollout_ranks import serve_rollouts
from grouprl.runlog import Logger, jitter2, log_samples, rollout_log


@dataclass
class Args(CommonArgs):
    masks_advantages: ClassVar[bool] = False  # eq. 63 weighs a group by all its advantages: no OPSM
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    micro_batch_size: int = 0
    """sequences per forward/backward inside a minibatch (0: the whole minibatch); gradients
    accumulate and the loss is divided by the minibatch's count over all ranks, so this changes
    memory, never the gradient; a size that splits groups costs one more no-grad forward pass per
    minibatch (eq. 63 needs whole groups)"""
    # Algorithm-specific arguments (the flags every script shares: cli.CommonArgs)
    clip_low: float = 3e-4
    """eps_low: s_i is clipped below at 1 - eps_low (GSPO paper: 3e-4)"""
    clip_high: float = 4e-4
    """eps_high: s_i is clipped above at 1 + eps_high (GSPO paper: 4e-4)"""
    transform: Literal["min-replace", "orth-proj", "orth-proj-qp", "scale", "none"] = "min-replace"
    """T of eq. 63: min-replace eq. 50, orth-proj 52-55, orth-proj-qp 51; scale (Table 3), none"""
    length_aware: bool = False
    """T acts on s_bar_i / |y_i|: a shared token cancels at any lengths (eq. 72), not only equal"""
    clip_gated: bool = False
    """a clipped sequence gets no gradient, as in GSPO (off: eq. 68); with --transform none: GSPO"""
    stop_grad: bool = True
    """s_tilde is a constant (App. D); --no-stop-grad differentiates through T (Table 3)"""
    orth_floor: float = 1e-6
    """eps of eq. 52: orth-proj first raises every weight to at least this"""


def orth_proj_qp(s_bar, A):
    """Eq. 51 exactly, per group: argmin_v 1/2 ||v - s_bar||^2 s.t. A.v = 0, v >= 0; s_bar >= 0
    and A: [groups, G]. KKT: v = max(s_bar - lam A, 0), with the lam that makes A.v = 0."""
    G = s_bar.shape[1]
    with torch.no_grad():
        # A.v = 0 is (-A).v = 0: with a = +-A such that a.s_bar >= 0 the root lam is >= 0, so only
        # the v_i with a_i > 0 fall as lam grows, each to 0 at its breakpoint s_bar_i / a_i
        a = torch.where((A * s_bar).sum(1, keepdim=True) < 0, -A, A).double()
        x = s_bar.double()
        breakpoints, order = torch.where(a > 0, x / a, float("inf")).sort(1)
        # column j: lam_j, the root of a.v = 0 when the first j in breakpoint order are 0 (sums over
        # the rest), and whether the j-th v stays > 0 there (den = 0 gives nan: False)
        num = (a * x).gather(1, order).flip(1).cumsum(1).flip(1)
        den = (a * a).gather(1, order).flip(1).cumsum(1).flip(1)
        stays = num / den < breakpoints
        # the first j that stays is the root's; none (a of one sign): every v_i with A_i != 0 is 0
        n_zero = torch.where(stays.any(1), stays.double().argmax(1), G)
        kept = torch.arange(G, device=n_zero.device) >= n_zero[:, None]  # in breakpoint order
        S = torch.zeros_like(kept).scatter(1, order, kept) & (a != 0)
    den = (S * A ** 2).sum(1, keepdim=True)
    lam = (S * A * s_bar).sum(1, keepdim=True) / torch.where(den > 0, den, 1.0)  # S empty: 0
    return torch.where(S | (A == 0), s_bar - lam * A, 0.0).clamp(min=0)


def in_group_transform(s_bar, A, transform: str, floor: float):
    """s_tilde from the post-clip weights s_bar and advantages A, both [groups, G] (App. B.4)."""
    if transform == "min-replace":  # eq. 50
        return s_bar.min(1, keepdim=True).values.expand_as(s_bar)
    if transform == "orth-proj":  # truncate-and-rebalance, eq. 52-55
        s_plus = s_bar.clamp(min=floor)  # eq. 52
        pos = torch.where(A > 0, A * s_plus, 0.0).sum(1, keepdim=True)  # sum_P A_i s+_i
        neg = torch.where(A < 0, -A * s_plus, 0.0).sum(1, keepdim=True)  # sum_N (-A_i) s+_i
        alpha = neg / torch.where(pos > neg, pos, 1.0)  # eq. 55, when delta = pos - neg > 0
        beta = pos / torch.where(neg > pos, neg, 1.0)  # eq. 55 (sign corrected), when delta < 0
        scaled_pos = torch.where((pos > neg) & (A > 0), alpha * s_plus, s_plus)
        return torch.where((neg > pos) & (A < 0), beta * s_plus, scaled_pos)
    if transform == "orth-proj-qp":
        return orth_proj_qp(s_bar, A)
    if transform == "scale":  # Table 3: "DFPO (scale by 0.5)"
        return 0.5 * s_bar
    if transform == "none":
        return s_bar
    raise ValueError(f"unknown transform {transform!r}")


def sequence_weights(logp, old_logp, advantages, mask, *, clip_low: float, clip_high: float):
    """-> log w_it [B, T] (0 off the mask), log s_i [B] (eq. 44) and the post-clip weights
    s_bar_i [B] (eq. 46-47)."""
    log_w = torch.where(mask.bool(), logp - old_logp, 0.0)  # log w_it, token log-ratios
    log_s = log_w.sum(1) / mask.sum(1).clamp(min=1)  # eq. 44: log s_i = 1/|y_i| sum_t log w_it
    s = log_s.exp()
    c = s.clamp(1 - clip_low, 1 + clip_high)  # eq. 46
    s_bar = torch.where(advantages >= 0, torch.minimum(s, c), torch.maximum(s, c))  # eq. 47
    return log_w, log_s, s_bar


def group_weights(s_bar, advantages, mask, *, group_size: int, transform: str, floor: float,
                  length_aware: bool):
    """s_tilde = T(s_bar) [B], sum_i A_i s_tilde_i = 0 in each group (eq. 63); whole groups in rows.
    length_aware: T acts on u_i = s_bar_i L / |y_i| (L: the group's mean length), mapped back."""
    A = advantages.view(-1, group_size)
    if not length_aware:
        return in_group_transform(s_bar.view(-1, group_size), A, transform, floor).flatten()
    L = mask.sum(1).clamp(min=1).view(-1, group_size).to(s_bar.dtype)
    scale = L / L.mean(1, keepdim=True)  # |y_i| / L
    u_tilde = in_group_transform(s_bar.view(-1, group_size) / scale, A, transform, floor)
    return (u_tilde * scale).flatten()


def dfpo_loss(logp, old_logp, advantages, mask, *, group_size: int, clip_low: float,
              clip_high: float, transform: str = "min-replace", floor: float = 1e-6,
              length_aware: bool = False, clip_gated: bool = False, stop_grad: bool = True,
              ref_logp=None, kl_coef: float = 0.0, kl_ratio: bool = False,
              norm: float | None = None, s_tilde=None, is_weight=None, keep=None):
    """-J_DFPO over the minibatch. logp, old_logp, mask: [B, T] completion tokens; advantages: [B];
    rows are whole groups of group_size, unless s_tilde [B] (from their whole groups) is given.
    ref_logp (with kl_coef = beta > 0): [B, T] log-probs of the reference model; each token adds
    beta k3_it = beta (pi_ref/pi - log(pi_ref/pi) - 1) to the loss, averaged 1/|y_i| sum_t as s_i
    averages its token log-ratios, then 1/G sum_i as the objective (the GSPO and DFPO recipes use
    no KL: beta = 0).
    is_weight (--rollout-is-cap) and keep (--top-entropy-quantile): [B, T] token weights (the
    rollout correction's, 1 on the high-entropy tokens); the sequence's term (after the transform) is multiplied by
    their product's mean over its tokens, as TRL's sequence-level loss averages its per-token
    loss x weights (loss_type grpo).
    norm: the count the summed objective is divided by (None: this batch's); the loop passes the
    minibatch's count over all ranks, so that micro-batches and ranks add up to one gradient.
    Returns (loss, seq_terms, stats): seq_terms [B] is each sequence's term m_i = w_i A_i
    (detached), from which the loop computes the group metrics over whole groups; stats are
    detached scalars for the logs, a mean given as (sum, count) so that micro-batches and ranks
    add up to the minibatch's mean.
    Here w_i = s_tilde_i."""
    if s_tilde is None and logp.shape[0] % group_size:
        raise ValueError(f"{logp.shape[0]} rows do not split into whole groups of {group_size}")
    if s_tilde is not None and not stop_grad:
        raise ValueError("a given s_tilde is a constant: without the stop-gradient the transform "
                         "needs whole groups")
    lengths = mask.sum(1).clamp(min=1)
    log_w, log_s, s_bar = sequence_weights(logp, old_logp, advantages, mask, clip_low=clip_low,
                                           clip_high=clip_high)
    if s_tilde is None:  # eq. 63 (or 72) inside each group of the rows given
        s_tilde = group_weights(s_bar.detach() if stop_grad else s_bar, advantages, mask,
                                group_size=group_size, transform=transform, floor=floor,
                                length_aware=length_aware)
    if not stop_grad:  # the literal -1/G sum_i A_i s_tilde_i(theta), differentiated through T
        objective = advantages * s_tilde
    elif clip_gated:  # value A s_tilde; gradient s_tilde A grad log s_i where s_bar_i = s_i, else 0
        objective = advantages * s_tilde * s_bar / s_bar.detach()
    else:  # eq. 68: value A s_tilde; gradient s_tilde A grad log s_i for every sequence
        objective = advantages * s_tilde * torch.exp(log_s - log_s.detach())
    if is_weight is not None or keep is not None:  # per-token weights: their mean over y_i (TRL)
        weight = (1.0 if is_weight is None else is_weight) * (1.0 if keep is None else keep)
        objective = objective * (weight * mask).sum(1) / lengths
    per_seq = objective
    if ref_logp is not None and kl_coef > 0:  # k3: pi_ref/pi - log(pi_ref/pi) - 1 >= 0, per token
        log_ref = torch.where(mask.bool(), ref_logp - logp, 0.0)
        k3 = log_ref.exp() - log_ref - 1
        if kl_ratio:  # k3 under pi_theta, estimated from pi_old's samples: s_i k3_it
            k3 = log_s.exp()[:, None] * k3
        per_seq = objective - kl_coef * (k3 * mask).sum(1) / lengths
    loss = -per_seq.sum() / (norm or per_seq.numel())  # 1/G sum_i over every group (norm)
    with torch.no_grad():
        s = log_s.exp()
        # clipped: s_bar_i = c_i
        clipped = ((s > 1 + clip_high) & (advantages > 0)) | ((s < 1 - clip_low) & (advantages < 0))
        in_loss = mask.sum(1) > 0  # rows with a token in the loss (--mask-truncated: maybe not)
        stats = {
            "losses/policy_loss": (-per_seq.sum(), len(s)),  # over the rows given
            "losses/clipfrac": ((clipped * lengths).sum(), mask.sum()),  # tokens the clip bounds
            "losses/clipfrac_seq": (clipped.sum(), in_loss.sum()),  # sequences
            "losses/ratio_mean": ((s * in_loss).sum(), in_loss.sum()),
            "losses/ratio_min": torch.where(in_loss, s, torch.inf).min(),  # inf: no row counts
            "losses/ratio_max": torch.where(in_loss, s, -torch.inf).max(),
            # k3 estimate of KL(old||new)
            "losses/approx_kl": (((log_w.exp() - 1 - log_w) * mask).sum(), mask.sum()),
            # phi_i = s_tilde_i / s_bar_i (eq. 87), over the rows in the loss
            "losses/shrink_mean": ((s_tilde / s_bar * in_loss).sum(), in_loss.sum()),
        }
        if ref_logp is not None and kl_coef > 0:
            stats["losses/kl_ref"] = (((log_ref.exp() - log_ref - 1) * mask).sum(), mask.sum())
    return loss, objective.detach(), stats


def check_dfpo_args(args):
    """DFPO's own flags, before any heavy work: one line each."""
    check_float("orth-floor", args.orth_floor, 0, low_open=True,
                why=" (eq. 52 keeps every weight positive)")
    if args.length_aware and args.transform in ("scale", "none"):
        fail(f"--length-aware makes a cancelling transform exact at any lengths: --transform "
             f"{args.transform} does not cancel; use min-replace, orth-proj or orth-proj-qp")
    if not args.stop_grad and args.micro_batch_size % args.group_size:
        fail(f"--no-stop-grad differentiates through each group's transform: --micro-batch-size "
             f"{args.micro_batch_size} must be a multiple of --group-size {args.group_size} (or 0)")


@torch.no_grad()
def split_group_weights(policy, roll, minibatch: slice, old_logp, advantages, mask, routes, args):
    """s_tilde [rollout rows], set on the rows of `minibatch`: eq. 63 transforms whole groups, so
    when micro-batches split them every row's weight is computed first (one more forward)."""
    logp = torch.cat([policy_log_probs(policy, roll, micro, routes)  # MoE: routed as the loss's
                      for micro in micro_batches(minibatch, args.micro_batch_size)])
    _, _, s_bar = sequence_weights(logp, old_logp[minibatch], advantages[minibatch],
                                   mask[minibatch], clip_low=args.clip_low,
                                   clip_high=args.clip_high)
    s_tilde = s_bar.new_zeros(advantages.shape)  # [rollout rows]: set on these
    s_tilde[minibatch] = group_weights(
        s_bar, advantages[minibatch], mask[minibatch], group_size=args.group_size,
        transform=args.transform, floor=args.orth_floor, length_aware=args.length_aware)
    return s_tilde


def main():
    # tyro (its errors in one line, once), then the defaults that depend on the model and the task:
    # the run is logged, checkpointed and compared on resume with these values; nothing changes args after this
    args = fill_defaults(parse_args(Args))

    # TRY NOT TO MODIFY: set-up (bad input fails here, before any model is built)
    check_common_args(args)
    reward = load_reward(args.reward, args.reward_timeout, args.reward_weights,
                         args.reward_fail_steps)  # a bad --reward fails here too
    check_dfpo_args(args)
    dist_env = setup_distributed(args.seed, args.rollout_ranks if args.async_rollouts else 0)
    serve_rollouts(args, dist_env, reward, sample_groups)  # --async-rollouts: a rollout rank's run
    check_model(args.model, args.trust_remote_code, args.gen_mode, args.old_logp,
                args.rollout_is_cap, args.routing_replay, args.max_staleness)
    script = os.path.basename(__file__)
    run_dir, ckpt = run_paths(args, dist_env, script)  # a fresh run, or the checkpoint to resume
    tok = load_tokenizer(args.model, args.trust_remote_code)
    train, held, dropped = load_task(Task.of(args), tok)  # --dataset and its flags
    check_prompt_pool(args, len(train), dist_env.world)  # --dynamic-sampling's extra prompts
    run_dir = claim_run_dir(run_dir, ckpt, dist_env)  # one writer per run folder (writer.lock)
    lm, rank0_weights = load_model(ckpt or args.model, tok, dist_env, args.seed,
                                   args.trust_remote_code, args.dtype, lora_spec(args))
    eos = eos_ids(lm, tok)
    policy = wrap_policy(lm, dist_env, args.temperature, args.logprob_chunk_tokens,
                         args.activation_checkpointing, args.dtype, args.cpu_offload, rank0_weights)
    ref = reference_policy(args, tok, dist_env, policy)  # the KL's initial model (or none)
    routes = moe.track(lm, args.routing_replay)  # MoE: the router tape (None: a dense model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate,
                                  weight_decay=args.weight_decay)
    scheduler = lr_scheduler(optimizer, args)
    seed_rank(args.seed, dist_env)
    # resumed: optimizer, lr schedule, RNG of each rank, step
    state = resume_state(ckpt, optimizer, scheduler, dist_env)
    logger = Logger(run_dir, dist_env, args, first_step=state["step"] + 1)
    if dist_env.main:
        print(f"{len(train)} train / {len(held)} held-out prompts (dropped: {dropped['no_answer']} "
              f"without an answer, {dropped['too_long']} over --max-prompt-tokens); "
              f"world size {dist_env.world}; logs: tensorboard --logdir {args.output_dir}")
    sampling = rollout_sampling(args)  # how completions are drawn: one Sampling, passed whole
    plan = eval_plan(args, sampling, reward)  # the held-out evaluation's Evaluation

    def eval_now(step: int) -> bool:
        return args.eval_every > 0 and (step % args.eval_every == 0 or step == args.num_steps)

    if args.eval_only:  # the table a paper reports, for --model as it is
        policy.eval()
        result = evaluate(policy, tok, held, eos, dist_env, plan)
        logger.log(0, result)
        eval_report(result, args, run_dir, dist_env)
        logger.close()
        return cleanup()
    if eval_now(0) and state["step"] == 0:
        policy.eval()
        logger.log(0, evaluate(policy, tok, held, eos, dist_env, plan))
    start = time.time() - state["wall_time"]
    reward_curve = state["reward_curve"]
    nonfinite_run = state["nonfinite_run"]
    bar = tqdm(range(state["step"] + 1, args.num_steps + 1), initial=state["step"],
               total=args.num_steps, disable=not dist_env.main, desc=args.exp_name)
    catch_stop_signals()  # SIGTERM or SIGINT: every rank saves at the end of the step and stops
    for step in bar:
        # TRY NOT TO MODIFY: rollout -> rewards -> group advantages
        policy.eval()
        # the step's prompts, G completions each, their rewards; --dynamic-sampling (DAPO): groups
        # with equal rewards (A = 0) replaced by more prompts' groups, in rounds
        roll = sample_groups(policy, tok, train, step, eos, dist_env, reward, sampling, args)
        advantages, zero_groups = group_advantages(
            roll.rewards, args.group_size, scale=args.scale_rewards, std=args.adv_std,
            eps=args.adv_eps, baseline=args.baseline, parts=reward_parts(reward, roll, args))
        log_samples(logger, roll, advantages, step, args.log_samples)  # --log-samples
        mask = roll.mask  # the loss's tokens: the completions up to their first EOS
        if args.mask_truncated:  # and only the rows that stopped (the logs keep roll.mask)
            mask = mask * ~roll.truncated[:, None]
        advantages = advantages.to(mask.device)
        minibatch_slices = minibatches(args.prompts_per_rank, args.group_size, args.num_minibatches)

        # pi_old, recomputed (no grad) or as the engine sampled it (--old-logp); token weights: the
        # rollout correction's (--rollout-is-cap), the high-entropy tokens' (--top-entropy-quantile)
        updates = Updates(policy, roll, mask, args, step, nonfinite_run, dist_env)  # logs, Energy
        with torch.no_grad():
            old_logp, is_weight, keep, old_stats = old_log_probs(
                policy, roll, minibatch_slices, routes=routes, source=args.old_logp,
                is_cap=args.rollout_is_cap, is_mode=args.rollout_is_mode,
                is_min=args.rollout_is_min, top_entropy=args.top_entropy_quantile)
            ref_logp = ref_log_probs(ref, roll, minibatch_slices)  # --kl-coef: the KL's pi_ref

        # ALGO LOGIC: num_iterations (mu, GRPO arXiv 2402.03300 Alg. 1) passes of num_minibatches
        # optimizer steps, each over whole groups; old_logp stays pi_old's, so ratios move off 1
        policy.train()
        for update, minibatch in enumerate(minibatch_slices * args.num_iterations):  # mu passes
            seqs = (minibatch.stop - minibatch.start) * dist_env.world  # its sequences on all ranks
            norm = seqs  # 1/G sum_i over every group: the loss is divided by the minibatch's count
            s_tilde = None  # None: each micro-batch holds whole groups and transforms them itself
            if args.micro_batch_size % args.group_size:  # micro-batches split groups: eq. 63
                s_tilde = split_group_weights(policy, roll, minibatch, old_logp, advantages, mask,
                                              routes, args)  # needs whole ones, one more forward
            for micro in micro_batches(minibatch, args.micro_batch_size):  # gradient accumulation
                logp = policy_log_probs(policy, roll, micro, routes)  # [micro, T] log pi_theta
                loss, terms, loss_stats = dfpo_loss(
                    logp, old_logp[micro], advantages[micro], mask[micro],
                    clip_low=args.clip_low, clip_high=args.clip_high, group_size=args.group_size,
                    transform=args.transform, floor=args.orth_floor, length_aware=args.length_aware,
                    clip_gated=args.clip_gated, stop_grad=args.stop_grad,
                    ref_logp=None if ref is None else ref_logp[micro], kl_coef=args.kl_coef,
                    kl_ratio=args.kl_ratio_correction,
                    norm=norm, s_tilde=None if s_tilde is None else s_tilde[micro],
                    is_weight=None if is_weight is None else is_weight[micro],
                    keep=None if keep is None else keep[micro])
                loss.backward()
                updates.after_backward(update, micro, logp, loss, terms, loss_stats, old_logp[micro])
            grad_norm = clip_grad_norm(policy, args.max_grad_norm)
            if updates.finite(grad_norm):  # else skipped on every rank together, and counted
                optimizer.step()
                scheduler.step()
            # free the gradients now, not before the next backward: generation and the checkpoint
            # save in between get their 4 P / n bytes (the Qwen3-32B recipe: 16 GB a GPU)
            optimizer.zero_grad(set_to_none=True)
            updates.minibatch_done(grad_norm, seqs // args.group_size)
        nonfinite_run = updates.nonfinite_run

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        log = {
            **rollout_log(roll, zero_groups, reward, args, dist_env),  # charts/, rewards/
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            **updates.log(),  # losses/ over micro-batches and ranks; --energy-every: energy/
            **old_stats,  # losses/entropy (recomputed pi_old), rollout_is/ (--rollout-is-cap)
            **moe.stats(routes),  # moe/route_flip_frac (MoE models)
            **logp_drift(roll, old_logp),  # --gen-mode engine: decode vs training forward
            "perf/wall_time": time.time() - start,
        }
        if eval_now(step):
            policy.eval()
            log.update(evaluate(policy, tok, held, eos, dist_env, plan))
        reward_curve.append(log["charts/reward_mean"])
        if step == args.num_steps:  # Jitter2 of the reward curve (DFPO eq. 20), last row
            log["charts/reward_jitter2"] = jitter2(reward_curve)
        logger.log(step, log)
        bar.set_postfix(reward=f"{log['charts/reward_mean']:.3f}",
                        clip=f"{log['losses/clipfrac']:.3f}", asym=f"{log['losses/asym']:.3f}")
        stop = stop_requested()  # SIGTERM or SIGINT on any rank: all save this step, stop
        if stop or step == args.num_steps or args.save_every and step % args.save_every == 0:
            ckpt = save_checkpoint(run_dir, step, policy, tok, optimizer, scheduler, dist_env, args,
                                   script, reward_curve=reward_curve, nonfinite_run=nonfinite_run,
                                   wall_time=time.time() - start)
        if stop:
            break
    n = max(1, len(reward_curve) // 10)
    first = sum(reward_curve[:n]) / n
    last = sum(reward_curve[-n:]) / n
    if dist_env.main:
        print(f"done in {time.time() - start:.0f}s: reward {first:.3f} (first 10% of steps) -> "
              f"{last:.3f} (last 10%), Jitter2 (DFPO eq. 20) {jitter2(reward_curve):.4f}"
              f"{eval_summary(log)}; checkpoint: {ckpt}")
    logger.close()
    cleanup()

if __name__ == "__main__":
    main()
