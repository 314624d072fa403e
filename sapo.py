"""SAPO: Soft Adaptive Policy Optimization (Gao et al., 2025, arXiv:2511.20347).

    J_SAPO(theta) = E[ 1/G sum_i 1/|y_i| sum_t f_it(w_it) A_i ]
    f_it(x)       = sigmoid(tau_i (x - 1)) 4 / tau_i,   tau_i = tau_pos if A_i > 0 else tau_neg
    w_it          = pi_theta(y_it | x, y_i,<t) / pi_old(y_it | x, y_i,<t)
    A_i           = (r_i - mean_j r_j) / std_j r_j                  (DFPO arXiv:2604.13088, eq. 43)
    (--kl-coef)   - beta k3 per token, as grpo.py

The hard clip replaced by a soft gate: each token's gradient is f'(w_it) w_it A_i grad log pi(y_it)
with f'(x) = 4 sigmoid(tau (x - 1)) (1 - sigmoid(tau (x - 1))), which is 1 at w = 1 (the plain
policy gradient on policy) and decays smoothly as w moves off 1, faster for negative advantages
(tau_neg > tau_pos). Different from grpo.py: no token's gradient is cut at a band's edge; far-off
tokens fade instead. Defaults: the paper's and TRL's, tau_pos 1.0, tau_neg 1.05. Derivation:
docs/objectives.md.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from common import (Updates, clip_grad_norm, group_advantages, logp_drift, lr_scheduler,
                    micro_batches, minibatches, off_policy_mask, old_log_probs, policy_log_probs,
                    ref_log_probs, reward_parts, sample_groups)
from grouprl import moe
from grouprl.checkpoint import (catch_stop_signals, claim_run_dir, cleanup, resume_state,
                                run_paths, save_checkpoint, stop_requested)
from grouprl.cli import (CommonArgs, check_common_args, check_prompt_pool, eval_plan,
                         fill_defaults, parse_args, rollout_sampling)
from grouprl.data import Task, load_task
from grouprl.distributed import all_reduce, seed_rank, setup_distributed
from grouprl.evaluation import eval_report, eval_summary, evaluate
from grouprl.grader import load_reward
from grouprl.lora import lora_spec
from grouprl.modeling import (check_model, eos_ids, load_model, load_tokenizer, reference_policy,
                              wrap_policy)
from grouprl.rollout_ranks import serve_rollouts
from grouprl.runlog import Logger, jitter2, log_samples, rollout_log

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]  # --loss-agg


@dataclass
class Args(CommonArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    # Algorithm-specific arguments (the flags every script shares: cli.CommonArgs)
    loss_agg: LossAgg = "seq-mean-token-mean"
    """how token terms become the loss: 1/B sum_i 1/|y_i| sum_t (the SAPO paper's; TRL's sapo),
    token-mean (over all tokens of the minibatch), seq-mean-token-sum-norm (Dr. GRPO)"""
    tau_pos: float = 1.0
    """the gate's temperature for tokens of A_i > 0 (SAPO paper and TRL's sapo_temperature_pos: 1.0)"""
    tau_neg: float = 1.05
    """the gate's temperature for tokens of A_i <= 0: larger decays faster off w = 1 (SAPO paper and
    TRL's sapo_temperature_neg: 1.05)"""
    clip_low: float = 0.2
    """not used by the objective (no clip): the band of the logged losses/clipfrac, tokens whose w
    leaves [1 - clip_low, 1 + clip_high] (GRPO's, for comparison)"""
    clip_high: float = 0.27
    """not used by the objective: the upper edge of the logged band (GRPO's 0.27)"""


def sapo_loss(logp, old_logp, advantages, mask, *, tau_pos: float, tau_neg: float,
              clip_low: float = 0.2, clip_high: float = 0.27, ref_logp=None, kl_coef: float = 0.0,
              kl_ratio: bool = False, loss_agg: str = "seq-mean-token-mean",
              max_new_tokens: int | None = None, norm: float | None = None, is_weight=None,
              keep=None):
    """-J_SAPO over the minibatch. logp, old_logp, mask (and ref_logp): [B, T] completion tokens;
    advantages: [B]. Each token's term is f(w_it) A_i with f(x) = sigmoid(tau (x - 1)) 4 / tau,
    tau = tau_pos where A_i > 0, else tau_neg. loss_agg: how token terms are summed and divided
    (see aggregate); kl_ratio: each token's k3 is multiplied by w_it (TRL's use_bias_correction_kl);
    is_weight (--rollout-is-cap): [B, T] constant TIS weights, each multiplying its token's term.
    keep (--top-entropy-quantile): [B, T], 1 on the high-entropy tokens, whose terms alone stay
    (the KL's all stay, as TRL's).
    norm: the count the summed objective is divided by (None: this batch's); the loop passes the
    minibatch's count over all ranks, so that micro-batches and ranks add up to one gradient.
    Returns (loss, seq_terms, stats): seq_terms [B] is each sequence's m_i = w_i A_i with w_i =
    1/|y_i| sum_t f'(w_it) w_it, the mean weight of its tokens' gradients (detached), for the group
    metrics; stats are detached scalars for the logs, a mean given as (sum, count).
    clip_low, clip_high: only the band whose leavers losses/clipfrac counts (the gate has none)."""
    valid = mask.bool()
    lengths = mask.sum(1).clamp(min=1)
    log_w = torch.where(valid, logp - old_logp, 0.0)  # log w_it, token log-ratios
    w = torch.exp(log_w)
    A = advantages[:, None]  # the same A_i for every token of y_i
    tau = torch.where(A > 0, A.new_tensor(tau_pos), A.new_tensor(tau_neg))  # [B, 1]: by A_i's sign
    gate = torch.sigmoid(tau * (w - 1))
    per_token = gate * 4 / tau * A  # f(w_it) A_i: the soft gate in place of PPO's clip
    if is_weight is not None:  # TIS: the token was drawn from pi_rollout, not pi_old
        per_token = per_token * is_weight
    if keep is not None:  # --top-entropy-quantile: only the high-entropy tokens' terms
        per_token = per_token * keep
    token_terms = per_token * mask
    with torch.no_grad():  # d f(w) / d log pi = f'(w) w: each token's weight in the gradient
        grad_weight = 4 * gate * (1 - gate) * w
        seq_terms = (grad_weight * mask).sum(1) / lengths * advantages
    if ref_logp is not None and kl_coef > 0:  # k3: pi_ref/pi - log(pi_ref/pi) - 1 >= 0
        log_ref = torch.where(valid, ref_logp - logp, 0.0)
        k3 = log_ref.exp() - log_ref - 1
        if kl_ratio:  # k3 under pi_theta, estimated from pi_old's samples: w_it k3_it
            k3 = w * k3
        token_terms = token_terms - kl_coef * k3 * mask
    per_seq, count = aggregate(token_terms, mask, loss_agg, max_new_tokens)
    loss = -per_seq.sum() / (norm or count)  # divided by the minibatch's count on all ranks (norm)
    with torch.no_grad():  # outside GRPO's band: where the gate has faded (the token still learns)
        outside = ((w > 1 + clip_high) | (w < 1 - clip_low)) & valid
        stats = {
            "losses/policy_loss": (-per_seq.sum(), count),  # over the rows given
            "losses/clipfrac": (outside.sum(), mask.sum()),  # tokens outside the band
            "losses/clipfrac_seq": (outside.any(1).sum(), (mask.sum(1) > 0).sum()),
            "losses/gate_mean": ((grad_weight * mask).sum(), mask.sum()),  # f'(w) w: 1 on policy
            "losses/ratio_mean": ((w * mask).sum(), mask.sum()),
            "losses/ratio_min": torch.where(valid, w, torch.inf).min(),  # inf: no token counts
            "losses/ratio_max": torch.where(valid, w, -torch.inf).max(),
            # k3 estimate of KL(old||new)
            "losses/approx_kl": (((log_w.exp() - 1 - log_w) * mask).sum(), mask.sum()),
        }
        if ref_logp is not None and kl_coef > 0:
            stats["losses/kl_ref"] = (((log_ref.exp() - log_ref - 1) * mask).sum(), mask.sum())
    return loss, seq_terms, stats


def aggregate(token_terms, mask, loss_agg: str, max_new_tokens: int | None):
    """--loss-agg: per-sequence sums of the masked [B, T] token terms, and the count their sum is
    divided by (in brackets: TRL's loss_type / verl's loss_agg_mode):
        seq-mean-token-mean      1/B sum_i 1/|y_i| sum_t    GRPO paper (grpo / seq-mean-token-mean)
        token-mean               1/sum_i |y_i| sum_i sum_t  DAPO (dapo / token-mean)
        seq-mean-token-sum-norm  1/B sum_i 1/L_max sum_t    Dr. GRPO, L_max = --max-new-tokens
                                                            (dr_grpo / seq-mean-token-sum-norm)
    The loop replaces the count by the minibatch's over all ranks (sequences, or tokens for
    token-mean)."""
    if loss_agg == "seq-mean-token-mean":
        return token_terms.sum(1) / mask.sum(1).clamp(min=1), mask.shape[0]
    if loss_agg == "token-mean":
        return token_terms.sum(1), mask.sum().clamp(min=1)
    if loss_agg == "seq-mean-token-sum-norm":
        if not max_new_tokens:
            raise ValueError("seq-mean-token-sum-norm divides by max_new_tokens: pass it")
        return token_terms.sum(1) / max_new_tokens, mask.shape[0]
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def main():
    # tyro (its errors in one line, once), then the defaults that depend on the model and the task:
    # the run is logged, checkpointed and compared on resume with these values; nothing changes args after this
    args = fill_defaults(parse_args(Args))

    # TRY NOT TO MODIFY: set-up (bad input fails here, before any model is built)
    check_common_args(args)
    reward = load_reward(args.reward, args.reward_timeout, args.reward_weights,
                         args.reward_fail_steps)  # a bad --reward fails here too
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
        sample_logp = old_logp if roll.logp is None else roll.logp  # OPSM's pi_sample

        # ALGO LOGIC: num_iterations (mu, GRPO arXiv 2402.03300 Alg. 1) passes of num_minibatches
        # optimizer steps, each over whole groups; old_logp stays pi_old's, so ratios move off 1
        policy.train()
        for update, minibatch in enumerate(minibatch_slices * args.num_iterations):  # mu passes
            seqs = (minibatch.stop - minibatch.start) * dist_env.world  # its sequences on all ranks
            norm = seqs  # 1/G sum_i over every group: the loss is divided by the minibatch's count
            if args.loss_agg == "token-mean":  # 1 / its completion tokens on all ranks
                norm = max(1.0, all_reduce(mask[minibatch].sum()).item())  # none: it adds 0
            for micro in micro_batches(minibatch, args.micro_batch_size):  # gradient accumulation
                logp = policy_log_probs(policy, roll, micro, routes)  # [micro, T] log pi_theta
                adv, dropped = off_policy_mask(advantages[micro], logp, sample_logp[micro], mask[micro],
                                               args.off_policy_mask)  # --off-policy-mask: OPSM
                loss, terms, loss_stats = sapo_loss(
                    logp, old_logp[micro], adv, mask[micro],
                    tau_pos=args.tau_pos, tau_neg=args.tau_neg,
                    clip_low=args.clip_low, clip_high=args.clip_high,
                    ref_logp=None if ref is None else ref_logp[micro], kl_coef=args.kl_coef,
                    kl_ratio=args.kl_ratio_correction,
                    loss_agg=args.loss_agg, max_new_tokens=args.max_new_tokens, norm=norm,
                    is_weight=None if is_weight is None else is_weight[micro],
                    keep=None if keep is None else keep[micro])
                loss.backward()
                updates.after_backward(update, micro, logp, loss, terms, loss_stats, old_logp[micro],
                                       dropped)
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
