"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv:2507.20673v3, Sec. 3, eq. 4).

    J_GMPO(theta) = E[ 1/G sum_i sgn(A_i) (prod_t |min(w_it A_i, clip(w_it) A_i)|)^(1/|y_i|) ]
                  = E[ 1/G sum_i A_i exp(1/|y_i| sum_t l_it) ],  clip to (e^-eps_low, e^eps_high)
    l_it          = min(log w_it, eps_high) for A_i > 0, max(log w_it, -eps_low) for A_i < 0
    A_i           = (r_i - mean_j r_j) / std_j r_j                  (DFPO arXiv:2604.13088, eq. 43)
    (--kl-coef)   - beta k3 per token, as gspo.py

The geometric mean of the token ratios in place of GRPO's arithmetic mean: one extreme token moves
s_i by a factor, not by a term, so the objective is less sensitive to outliers and a wider clip
range is stable (the paper's (e^-0.4, e^0.4)). Different from gspo.py: the clip acts on each token's
log-ratio before the mean, so a clipped token leaves the gradient and the others keep theirs (GSPO
clips the sequence's mean once); the form verl calls policy_loss geo_mean. Derivation:
docs/objectives.md.
"""

import os
import time
from dataclasses import dataclass

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
from grouprl.distributed import seed_rank, setup_distributed
from grouprl.evaluation import eval_report, eval_summary, evaluate
from grouprl.grader import load_reward
from grouprl.lora import lora_spec
from grouprl.modeling import (check_model, eos_ids, load_model, load_tokenizer, reference_policy,
                              wrap_policy)
from grouprl.rollout_ranks import serve_rollouts
from grouprl.runlog import Logger, jitter2, log_samples, rollout_log


@dataclass
class Args(CommonArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    # Algorithm-specific arguments (the flags every script shares: cli.CommonArgs)
    clip_low: float = 0.4
    """eps_low: each token's log-ratio is clipped below at -eps_low (w_it at e^-eps_low) if A_i < 0
    (GMPO paper: 0.4)"""
    clip_high: float = 0.4
    """eps_high: each token's log-ratio is clipped above at eps_high (w_it at e^eps_high) if A_i > 0
    (GMPO paper: 0.4)"""


def gmpo_loss(logp, old_logp, advantages, mask, *, clip_low: float, clip_high: float,
              ref_logp=None, kl_coef: float = 0.0, kl_ratio: bool = False,
              norm: float | None = None, is_weight=None, keep=None):
    """-J_GMPO over the minibatch. logp, old_logp, mask: [B, T] completion tokens; advantages: [B].
    Each token's log-ratio is clipped in log space by the sign of A_i (the side PPO's min guards),
    then s_i = exp(1/|y_i| sum_t l_it), the geometric mean of the clipped ratios; the objective is
    1/G sum_i A_i s_i, so an unclipped token gets the weight s_i A_i / |y_i| in the gradient and a
    clipped one none.
    ref_logp (with kl_coef = beta > 0): [B, T] log-probs of the reference model; each token adds
    beta k3_it, averaged 1/|y_i| sum_t, then 1/G sum_i (kl_ratio: each k3 times s_i, TRL's
    use_bias_correction_kl). is_weight (--rollout-is-cap): [B, T] rollout-correction weights, whose
    geometric mean over the sequence's tokens multiplies its term (verl's geo_mean); keep
    (--top-entropy-quantile): [B, T], 1 on the high-entropy tokens: the term is multiplied by
    the fraction kept. norm: the count the summed objective is divided by (None: this
    batch's); the loop passes the minibatch's count over all ranks.
    Returns (loss, seq_terms, stats): seq_terms [B] is each sequence's m_i = s_i A_i (detached),
    for the group metrics; stats are detached scalars for the logs, a mean given as (sum, count)."""
    valid = mask.bool()
    lengths = mask.sum(1).clamp(min=1)
    log_w = torch.where(valid, logp - old_logp, 0.0)  # log w_it, token log-ratios
    sign = torch.sign(advantages)[:, None]
    # min(A w, A clip(w)) in log space: A > 0 caps log w at eps_high, A < 0 floors it at -eps_low
    clipped_log_w = sign * torch.min(sign * log_w, sign * log_w.clamp(-clip_low, clip_high))
    s = torch.exp((clipped_log_w * mask).sum(1) / lengths)  # the geometric mean of clipped w_it
    objective = torch.where(mask.sum(1) > 0, advantages * s, 0.0)  # no loss token: s_i = 1, adds 0
    if is_weight is not None:  # the rollout correction: the weights' geometric mean (verl's)
        objective = objective * torch.exp((torch.log(is_weight + 1e-10) * mask).sum(1) / lengths)
    if keep is not None:  # --top-entropy-quantile: the fraction of y_i's tokens kept
        objective = objective * (keep * mask).sum(1) / lengths
    per_seq = objective
    if ref_logp is not None and kl_coef > 0:  # k3: pi_ref/pi - log(pi_ref/pi) - 1 >= 0, per token
        log_ref = torch.where(valid, ref_logp - logp, 0.0)
        k3 = log_ref.exp() - log_ref - 1
        if kl_ratio:  # k3 under pi_theta, estimated from pi_old's samples: s_i k3_it
            k3 = s[:, None] * k3
        per_seq = objective - kl_coef * (k3 * mask).sum(1) / lengths
    loss = -per_seq.sum() / (norm or per_seq.numel())  # 1/G sum_i over every group (norm)
    with torch.no_grad():  # clipped: the constant side of the min, so the token gives no gradient
        clipped = (((log_w > clip_high) & (sign > 0)) | ((log_w < -clip_low) & (sign < 0))) & valid
        in_loss = mask.sum(1) > 0  # rows with a token in the loss (--mask-truncated: maybe not)
        stats = {
            "losses/policy_loss": (-per_seq.sum(), len(s)),  # over the rows given
            "losses/clipfrac": (clipped.sum(), mask.sum()),  # tokens the clip stops
            "losses/clipfrac_seq": (clipped.any(1).sum(), in_loss.sum()),  # sequences with one
            "losses/ratio_mean": ((s * in_loss).sum(), in_loss.sum()),
            "losses/ratio_min": torch.where(in_loss, s, torch.inf).min(),  # inf: no row counts
            "losses/ratio_max": torch.where(in_loss, s, -torch.inf).max(),
            # k3 estimate of KL(old||new)
            "losses/approx_kl": (((log_w.exp() - 1 - log_w) * mask).sum(), mask.sum()),
        }
        if ref_logp is not None and kl_coef > 0:
            stats["losses/kl_ref"] = (((log_ref.exp() - log_ref - 1) * mask).sum(), mask.sum())
    return loss, objective.detach(), stats


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
            for micro in micro_batches(minibatch, args.micro_batch_size):  # gradient accumulation
                logp = policy_log_probs(policy, roll, micro, routes)  # [micro, T] log pi_theta
                adv, dropped = off_policy_mask(advantages[micro], logp, sample_logp[micro], mask[micro],
                                               args.off_policy_mask)  # --off-policy-mask: OPSM
                loss, terms, loss_stats = gmpo_loss(
                    logp, old_logp[micro], adv, mask[micro],
                    clip_low=args.clip_low, clip_high=args.clip_high,
                    ref_logp=None if ref is None else ref_logp[micro], kl_coef=args.kl_coef,
                    kl_ratio=args.kl_ratio_correction,
                    norm=norm,
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
