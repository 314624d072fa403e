"""GSPO-token: GSPO with token-level advantages (Zheng et al., 2025, arXiv:2507.18071).

    J(theta)      = E[ 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it, 1-eps_lo, 1+eps_hi) A_it) ]
    s_it          = sg[s_i] pi_theta(y_it) / sg[pi_theta(y_it)], of value s_i           (eq. 44)
    grad s_it     = sg[s_i] grad log pi_theta(y_it)                                 (Observation 3)
                    with pi_theta(y_it) = pi_theta(y_it | x, y_i,<t)
    A_i           = (r_i - mean_j r_j) / std_j r_j                                       (eq. 43)
    A_it          = A_i, or A_i - lambda after the final answer, or on all of a completion that
                    states none (--post-answer-penalty lambda), or A_i + c D_it with D_it each model
                    turn's share of the episode's turn rewards (--turn-credit c: turn_advantages)
    (--kl-coef)   - beta k3_it in each token's term, k3 = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1
                  (off, as in the GSPO recipe)

Equation numbers are the DFPO paper's (arXiv:2604.13088); the objective and s_it are the GSPO
paper's eq. 13-14; derivations: docs/objectives.md.
Different from gspo.py: the advantage may change from token to token. s_it has the value of s_i, so
clipping is decided as in GSPO, but its gradient flows only through the token's own log-likelihood,
scaled by the frozen s_i. With A_it = A_i it is GSPO exactly; Observations 1-3 (why both
stop-gradients: docs/objectives.md) are checked in tests/test_gspo_token.py.
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
from grouprl.cli import (CommonArgs, check_common_args, check_float, check_prompt_pool, eval_plan,
                         fill_defaults, parse_args, rollout_sampling)
from grouprl.data import Task, load_task
from grouprl.distributed import (all_gather_cat, all_reduce, fail, seed_rank,
                                  setup_distributed)
from grouprl.evaluation import eval_report, eval_summary, evaluate
from grouprl.grader import answer_span, extract_answer, load_reward
from grouprl.lora import lora_spec
from grouprl.modeling import (check_model, eos_ids, load_model, load_tokenizer, reference_policy,
                              wrap_policy)
from grouprl.rollout_ranks import serve_rollouts
from grouprl.runlog import Logger, jitter2, log_samples, rollout_log
from grouprl.tools import load_environment

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]  # --loss-agg


@dataclass
class Args(CommonArgs):
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the run: logs and checkpoints go to {output_dir}/{exp_name}__{seed}__{unix time}"""
    # Algorithm-specific arguments (the flags every script shares: cli.CommonArgs)
    loss_agg: LossAgg = "seq-mean-token-mean"
    """how token terms become the loss: 1/B sum_i 1/|y_i| sum_t (GRPO paper), token-mean (DAPO:
    over all tokens of the minibatch), seq-mean-token-sum-norm (Dr. GRPO: sum_t / --max-new-tokens,
    then over sequences)"""
    clip_low: float = 3e-4
    """eps_low: s_i is clipped below at 1 - eps_low (GSPO paper: 3e-4)"""
    clip_high: float = 4e-4
    """eps_high: s_i is clipped above at 1 + eps_high (GSPO paper: 4e-4)"""
    post_answer_penalty: float = 0.0
    """per-token advantages: tokens after the final answer, and every token of a completion that states
    none (EOS excluded), get A_i - this; 0: A_it = A_i (= GSPO)"""
    turn_credit: float = 0.0
    """c, per-turn credit over episodes: each model turn's tokens get A_i + c D_it, D_it the turn's
    return (its turn rewards from it on) normalised over the group's turns and centred over the
    episode's tokens (turn_advantages); needs --environment whose class defines get_turn_rewards()
    (one float a model turn); 0: off"""


def gspo_token_loss(logp, old_logp, advantages, mask, *, clip_low: float, clip_high: float,
                    loss_agg: str = "seq-mean-token-mean", max_new_tokens: int | None = None,
                    ref_logp=None, kl_coef: float = 0.0, kl_ratio: bool = False,
                    norm: float | None = None, is_weight=None,
                    keep=None):
    """-J_GSPO-token over the minibatch. logp, old_logp, mask and advantages: [B, T] completion
    tokens. loss_agg: how token terms are summed and divided (see aggregate).
    is_weight (--rollout-is-cap): [B, T] constant TIS weights min(pi_old / pi_rollout, C), each
    multiplying its token's term (common.old_log_probs).
    keep (--top-entropy-quantile): [B, T], 1 on the high-entropy tokens, whose terms alone stay
    (the KL's all stay, as TRL's).
    ref_logp (with kl_coef = beta > 0): [B, T] log-probs of the reference model; each token's term
    gets - beta k3_it = - beta (pi_ref/pi - log(pi_ref/pi) - 1), summed by loss_agg as the
    objective's token terms are (the GSPO recipe uses no KL: beta = 0).
    norm: the count the summed objective is divided by (None: this batch's); the loop passes the
    minibatch's count over all ranks, so that micro-batches and ranks add up to one gradient.
    Returns (loss, seq_terms, stats): seq_terms [B] is each sequence's term m_i = w_i A_i
    (detached), from which the loop computes the group metrics over whole groups; stats are
    detached scalars for the logs, a mean given as (sum, count) so that micro-batches and ranks
    add up to the minibatch's mean.
    Here m_i = 1/|y_i| sum_t s_bar_it A_it."""
    valid = mask.bool()
    lengths = mask.sum(1).clamp(min=1)
    log_w = torch.where(valid, logp - old_logp, 0.0)  # log w_it, token log-ratios
    s = torch.exp(log_w.sum(1) / lengths)  # eq. 44: s_i = exp(1/|y_i| sum_t log w_it)
    # s_it = sg[s_i] pi / sg[pi]: value s_i, gradient sg[s_i] grad log pi_t (Observation 3)
    s_it = s.detach()[:, None] * torch.exp(torch.where(valid, logp - logp.detach(), 0.0))
    A = advantages  # A_it
    clipped_term = s_it.clamp(1 - clip_low, 1 + clip_high) * A
    per_token = torch.where(valid, torch.min(s_it * A, clipped_term), 0.0)  # the J(theta) term
    if is_weight is not None:  # TIS: the token was drawn from pi_rollout, not pi_old
        per_token = per_token * is_weight
    if keep is not None:  # --top-entropy-quantile: only the high-entropy tokens' terms
        per_token = per_token * keep
    seq_terms = per_token.sum(1) / lengths  # 1/|y_i| sum_t, for the group metrics
    token_terms = per_token
    if ref_logp is not None and kl_coef > 0:  # k3: pi_ref/pi - log(pi_ref/pi) - 1 >= 0
        log_ref = torch.where(valid, ref_logp - logp, 0.0)
        k3 = log_ref.exp() - log_ref - 1
        if kl_ratio:  # k3 under pi_theta, estimated from pi_old's samples: s_it k3_it
            k3 = s_it * k3
        token_terms = per_token - kl_coef * k3 * mask
    per_seq, count = aggregate(token_terms, mask, loss_agg, max_new_tokens)
    loss = -per_seq.sum() / (norm or count)  # divided by the minibatch's count on all ranks (norm)
    with torch.no_grad():  # clipped: the min takes the constant branch, so no gradient
        clipped = (((s_it > 1 + clip_high) & (A > 0)) | ((s_it < 1 - clip_low) & (A < 0))) & valid
        in_loss = mask.sum(1) > 0  # rows with a token in the loss (--mask-truncated: maybe not)
        stats = {
            "losses/policy_loss": (-per_seq.sum(), count),  # over the rows given
            "losses/clipfrac": (clipped.sum(), mask.sum()),  # tokens
            "losses/clipfrac_seq": (clipped.any(1).sum(), in_loss.sum()),  # a token clipped
            "losses/ratio_mean": ((s * in_loss).sum(), in_loss.sum()),
            "losses/ratio_min": torch.where(in_loss, s, torch.inf).min(),  # inf: no row counts
            "losses/ratio_max": torch.where(in_loss, s, -torch.inf).max(),
            # k3 estimate of KL(old||new)
            "losses/approx_kl": (((log_w.exp() - 1 - log_w) * mask).sum(), mask.sum()),
        }
        if ref_logp is not None and kl_coef > 0:
            stats["losses/kl_ref"] = (((log_ref.exp() - log_ref - 1) * mask).sum(), mask.sum())
    return loss, seq_terms.detach(), stats


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


def post_answer_tokens(tok, completion_ids, mask, texts: list[str], eos: list[int]) -> torch.Tensor:
    """[B, T] bool: completion tokens that carry no answer, EOS tokens excluded: those written after
    the end of the final answer (grader.answer_span on the decoded text), and every token of a
    completion that states none, or only an empty \\boxed{} (else, in a group of equal rewards, where
    A_i = 0, the penalty alone would make not answering the cheapest text). The answer's last token
    is found by bisection on the decoded prefix length."""
    after = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    for b, text in enumerate(texts):
        span = answer_span(text)
        ids = [i for i in completion_ids[b, :int(mask[b].sum())].tolist() if i not in eos]
        if span is None or not extract_answer(text):  # no answer, or only empty boxes: \boxed{}
            after[b, :len(ids)] = True  # none of it is the answer's
            continue
        # the span ends after a box's closing brace or a math span's closing $: both belong to the
        # answer; a "}" after any other answer is text after it
        end = span[1]
        if not text[end:].strip():
            continue  # nothing but whitespace after the answer
        lo = 0  # bisection: the fewest tokens whose text reaches the answer's end
        hi = len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[:mid], skip_special_tokens=True)) >= end:
                hi = mid
            else:
                lo = mid + 1
        after[b, lo:len(ids)] = True  # the mask ends at the first EOS: an EOS can only follow these
    return after


def turn_advantages(turn_rewards: list[list[float]], mask, group_size: int,
                    eps: float = 1e-6) -> torch.Tensor:
    """Per-turn credit (--turn-credit c): D [B, T], each token's share in A_it = A_i + c D_it.
    turn_rewards: [B] lists, one reward per model turn of the row (an environment's
    get_turn_rewards()); mask [B, T]: the model's tokens, turn k of a row being its k-th run of
    1s (tool turns between them are 0); rows of a group adjacent, group_size of them.
        G_ik  = sum_{k' >= k} r_ik'                     the return from turn k on
        Gh_ik = (G_ik - mean_g G) / (std_g G + eps)     over every turn of the group's episodes
        D_it  = Gh_ik(t) - 1/|y_i| sum_t' Gh_ik(t')     centred over the episode's model tokens
    sum_t D_it = 0, so an episode's advantage summed over its tokens stays |y_i| A_i: the turn
    rewards move credit between its turns, the outcome alone says how much it gets, whatever its
    number of turns. Gh constant over an episode's turns (one turn, say) gives D_i = 0: GSPO.
    (mean_g cancels in D; std_g: population.) A count that differs from the row's runs of 1s, or a
    reward that is not a finite number, raises ValueError."""
    on = mask > 0
    before = torch.zeros_like(on)
    before[:, 1:] = on[:, :-1]
    starts = on & ~before  # the first token of each model turn
    counts = starts.sum(1).tolist()
    if len(turn_rewards) != len(counts):
        raise ValueError(f"{len(turn_rewards)} rows of turn rewards for {len(counts)} episodes")
    K = max(counts + [1])
    r = torch.zeros(len(counts), K, dtype=torch.float64)
    for i, (row, k) in enumerate(zip(turn_rewards, counts)):
        if len(row) != k:
            raise ValueError(f"episode {i} has {k} model turns but {len(row)} turn rewards")
        try:
            r[i, :k] = torch.tensor([float(x) for x in row], dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(f"episode {i}'s turn rewards {row} are not all numbers") from None
        if not r[i].isfinite().all():
            raise ValueError(f"episode {i}'s turn rewards {row} are not all finite")
    r = r.to(mask.device)
    turns = torch.arange(K, device=mask.device) < torch.tensor(counts, device=mask.device)[:, None]
    G = r.flip(1).cumsum(1).flip(1)  # G_ik (the zeros after the last turn add nothing)
    in_group = turns.view(-1, group_size * K)  # [groups, G K]: the turns of each group
    grouped = G.view(-1, group_size * K)
    n = in_group.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(in_group, grouped, 0.0).sum(1, keepdim=True) / n
    std = (torch.where(in_group, grouped - mean, 0.0).square().sum(1, keepdim=True) / n).sqrt()
    Gh = ((grouped - mean) / (std + eps)).view_as(G)
    k_t = (starts.cumsum(1) - 1).clamp(min=0)  # each token's turn, 0-based (meaningful on the mask)
    per_token = torch.where(on, Gh.gather(1, k_t), 0.0)
    length = on.sum(1, keepdim=True).clamp(min=1)
    D = torch.where(on, per_token - per_token.sum(1, keepdim=True) / length, 0.0)
    return D.to(mask.dtype if mask.dtype.is_floating_point else torch.float32)


def turn_credit(roll, args) -> torch.Tensor:
    """--turn-credit: turn_advantages of this step's episodes, or one line and exit where the
    rollout carries no turn rewards or they do not fit its model turns."""
    if roll.turn_rewards is None:
        fail("--turn-credit: this step's episodes carry no turn rewards; give --environment "
             "FILE.py:Class whose class defines get_turn_rewards() -> list[float]")
    try:
        return turn_advantages(roll.turn_rewards, roll.mask, args.group_size, args.adv_eps)
    except ValueError as e:
        fail(f"--turn-credit: {e}; get_turn_rewards() gives one finite float a model turn")


def check_token_advantages(args):
    """--post-answer-penalty and --turn-credit, before any model: each >= 0, and the penalty only
    on single completions: it finds the answer in a completion's decoded text and counts positions
    from its start, which over an episode (tool turns between the model's) fall in the wrong turn."""
    check_float("post-answer-penalty", args.post_answer_penalty, 0,
                why=" (a negative one rewards text after the answer)")
    check_float("turn-credit", args.turn_credit, 0, why=" (a negative one reverses each turn's)")
    if args.post_answer_penalty and (args.turn_credit or args.tools or args.environment):
        fail("--post-answer-penalty finds the answer in a single completion's text, and an "
             "episode's (--tools, --environment, --turn-credit) has tool turns in it: drop one")
    if args.turn_credit and not (args.environment and
                                 load_environment(args.environment).turn_rewards):
        fail("--turn-credit needs turn rewards: give --environment FILE.py:Class whose class "
             "defines get_turn_rewards() -> list[float] (one a model turn)")


def main():
    # tyro (its errors in one line, once), then the defaults that depend on the model and the task:
    # the run is logged, checkpointed and compared on resume with these values; nothing changes args after this
    args = fill_defaults(parse_args(Args))

    # TRY NOT TO MODIFY: set-up (bad input fails here, before any model is built)
    check_common_args(args)
    reward = load_reward(args.reward, args.reward_timeout, args.reward_weights,
                         args.reward_fail_steps)  # a bad --reward fails here too
    check_token_advantages(args)  # --post-answer-penalty, --turn-credit
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
        # A_it = A_i - lambda on the tokens after the final answer (all of them when it states none)
        after = post_answer_tokens(tok, roll.input_ids[:, roll.n_prompt:], roll.mask, roll.texts,
                                   eos)
        token_adv = (advantages[:, None] - args.post_answer_penalty * after.float()) * mask
        if args.turn_credit:  # A_it = A_i + c D_it: each model turn its share of the turn rewards
            token_adv = token_adv + args.turn_credit * turn_credit(roll, args) * mask

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
                adv, dropped = off_policy_mask(token_adv[micro], logp, sample_logp[micro], mask[micro],
                                               args.off_policy_mask)  # --off-policy-mask: OPSM
                loss, terms, loss_stats = gspo_token_loss(
                    logp, old_logp[micro], adv, mask[micro],
                    clip_low=args.clip_low, clip_high=args.clip_high, loss_agg=args.loss_agg,
                    max_new_tokens=args.max_new_tokens,
                    ref_logp=None if ref is None else ref_logp[micro], kl_coef=args.kl_coef,
                    kl_ratio=args.kl_ratio_correction, norm=norm,
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
            "charts/post_answer_frac": (all_gather_cat(after.sum().view(1).float()).sum()
                                        / all_gather_cat(roll.mask.sum(1)).sum()).item(),
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
