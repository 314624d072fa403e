"""The step, in the loop's order: what every algorithm script's loop calls between its set-up and
its logging (the loop itself lives in each script). Sections:
  the step's groups    sample_groups: rollout -> rewards, DAPO's dynamic sampling in rounds
  group advantages     A_i and the mechanism metrics (Asym, shared-token coefficient)
  old log-probs        pi_old recomputed or from the rollout (--old-logp), the token weights
  data order           prompts a step, minibatches of whole groups, micro-batches
  the optimizer step   learning-rate schedule, finite checks, what one step's updates log
What `logp` is everywhere: log pi_theta(y_it | x, y_<t) of each completion token, [B, T] in
float32, 0 past a completion's end (mask 0), computed by Policy.forward (grouprl/modeling.py)
through a chunked log-softmax that never builds a float32 [B, T, V] (grouprl/logprobs.py).
The rest lives in the grouprl package, a file or a folder a subsystem (grouprl/__init__.py lists
them): generation (generate, the Rollout), episodes (--tools, --environment), evaluation, runlog
(Logger, samples), rewards (scoring and the built-in reward functions a --reward names), stats (how
each loss's stats add up over ranks).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from grouprl import energy, moe, rollout_ranks, staleness
from grouprl.distributed import Dist, all_gather_cat, all_reduce, fail
from grouprl.episodes import env_scores, generate_episodes, tools_of
from grouprl.generation import Rollout, generate
from grouprl.modeling import Policy
from grouprl.progress import ROLLOUT_BAR_DELAY, GenBar
from grouprl.rewards import length_penalty, math_reward, score, think_format  # noqa: F401
from grouprl.sampling import Sampling
from grouprl.stats import (high_entropy_tokens, local_grads, log_ratio_spread, nanstd, noise_stats,
                           reduce_stats)

# length_penalty, math_reward, think_format: the built-in rewards, named by --reward as
# common:math_reward (users' command lines and saved checkpoints); they live in grouprl/rewards.py


# -------------------- the step's groups: rollout -> rewards, and DAPO's dynamic sampling
_FILLED_SAID = []  # the line saying that --max-gen-rounds was reached, said once a run


def sample_groups(policy: Policy, tok, train, step: int, eos: list[int], dist_env: Dist, reward,
                  sampling: Sampling, args) -> Rollout:
    """This rank's groups of `step` (rollout_groups), sampled by the weights of --max-staleness k
    versions before, a version every --weight-sync-steps W steps (staleness.behind; k = 0, W = 1:
    the policy as it is), or under --async-rollouts received from a rollout rank, which sampled
    them so (grouprl/rollout_ranks.py)."""
    k, sync = getattr(args, "max_staleness", 0), getattr(args, "weight_sync_steps", 1)
    if rollout_ranks.training():  # --async-rollouts: a rollout rank sampled this step's groups
        return rollout_ranks.receive(policy, step, reward, args)
    with staleness.behind(policy, step, k, sync) as stale:
        return stale.done(rollout_groups(policy, tok, train, step, eos, dist_env, reward,
                                         sampling, args), args)


def rollout_groups(policy: Policy, tok, train, step: int, eos: list[int], dist_env: Dist, reward,
                   sampling: Sampling, args) -> Rollout:
    """This rank's groups of `step`: its per_rank (--prompts-per-rank) prompts (prompt_indices),
    group_size (--group-size) completions each (generate, drawn as `sampling` says) and their
    rewards (score; a completion cut at the token limit scores truncated_scale times its reward,
    --truncated-reward-scale), as a Rollout.
    dynamic (--dynamic-sampling): DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2: the
    constraint 0 < |{o_i correct}| < G on its objective's groups), on the reward the advantages
    use: a group whose rewards are all equal has A_i = 0 for each of its completions (DFPO eq. 43)
    and gives the policy-gradient term nothing; it is dropped, and more rounds of per_rank prompts a
    rank (extra_prompt_indices: never the step's own, a function of seed, step and round) are
    generated and scored while any rank holds fewer than per_rank groups with a spread (with
    --multi-objective-aggregation normalize-then-sum, GDPO's: a reward whose values differ in the
    group, flat_groups), max_rounds rounds in all. Every rank runs every round (an all_reduce of
    the shortfall decides), so the ranks make the same generate calls (FSDP2's collectives) and
    score calls (the reward watch's).
    Each rank keeps its first per_rank groups with a spread; past max_rounds, the earliest flat
    groups fill the batch (A = 0; counted), so the step goes on. The kept groups stay in generation
    order: a step whose first round has no flat group is the step without dynamic.
    The Rollout's rows, tensors, texts, rewards and reward.values (rewards/<name>/...) hold the kept
    groups only; reward_errors counts the failures in every round. Its stats: perf/gen_tokens_per_s
    (every completion generated, all ranks, over this rank's generate time), and with dynamic, over
    all ranks: charts/gen_rounds; charts/dropped_groups (flat groups dropped); charts/surplus_groups
    (groups with a spread past per_rank on their rank, unused); charts/filled_groups (flat groups
    kept at the bound). Generated groups = gen_rounds x per_rank x world = the batch + dropped +
    surplus."""
    per_rank, group_size, seed = args.prompts_per_rank, args.group_size, args.seed
    dynamic, max_rounds = args.dynamic_sampling, args.max_gen_rounds
    rounds = []  # per round: (indices, roll, rewards, each reward's values)

    def flat_of(round_) -> torch.Tensor:  # [groups]: A = 0 for every completion of the group
        _, roll_r, rewards_r, values_r = round_
        parts = (weighted_parts(reward, values_r, roll_r.truncated, args.truncated_reward_scale)
                 if args.multi_objective_aggregation == "normalize-then-sum" else None)
        return flat_groups(rewards_r, group_size, parts)

    gen_time, gen_tokens, reward_errors, spread = 0.0, 0.0, 0, 0
    bar = GenBar(f"step {step} rollout", per_rank, group_size, tok.pad_token_id, dist_env.main,
                 leave=False, delay=ROLLOUT_BAR_DELAY)  # a slow step's generation in view
    while True:
        r = len(rounds)
        indices = (prompt_indices(len(train), step, per_rank, dist_env, seed) if r == 0
                   else extra_prompt_indices(len(train), step, r, per_rank, dist_env, seed))
        rows = train.select(indices)
        bar.bar.total += len(indices) if r else 0  # --dynamic-sampling's further rounds
        t = time.time()
        if args.tools or args.environment:  # episodes: tool calls, results, turns (an instance each)
            roll = generate_episodes(policy, tok, rows, group_size, eos, dist_env, sampling,
                                     streamer=bar, tools=tools_of(args))
        else:
            roll = generate(policy, tok, rows["text"], group_size, eos, dist_env, sampling,
                            streamer=bar)
        gen_time += time.time() - t
        bar.show(len(indices))
        gen_tokens += roll.mask.sum().item()
        rewards, errors = score(roll.texts, rows, group_size, reward, truncated=roll.truncated,
                                truncated_scale=args.truncated_reward_scale,
                                given=env_scores(roll, args),  # get_reward, weight 1
                                messages=roll.messages)  # TRL-form rewards: the episode
        reward_errors += errors
        rounds.append((indices, roll, rewards, dict(getattr(reward, "values", {}))))
        if not dynamic or r + 1 == max_rounds:
            break
        spread += int((~flat_of(rounds[-1])).sum())  # groups with a spread stay
        short = torch.tensor(float(max(0, per_rank - spread)), device=dist_env.device)
        if all_reduce(short).item() == 0:  # every rank full (the same answer on each)
            break
    bar.bar.close()
    tokens = all_reduce(torch.tensor(gen_tokens, dtype=torch.float64, device=dist_env.device))
    logs = {"perf/gen_tokens_per_s": tokens.item() / gen_time, **roll.stats}  # tools/* (last round)
    if not dynamic:
        return replace(roll, rows=rows, rewards=rewards, reward_errors=reward_errors, stats=logs)
    # the batch: the first per_rank groups with a spread, then (at the bound) the earliest flat ones
    flat = torch.cat([flat_of(round_) for round_ in rounds])
    order = torch.cat([(~flat).nonzero().flatten(), flat.nonzero().flatten()])  # stable
    kept = order[:per_rank].sort().values  # in generation order
    counts = torch.tensor([float(flat.sum() - flat[kept].sum()),  # dropped
                           float((~flat).sum() - (~flat)[kept].sum()),  # surplus
                           float(flat[kept].sum())], device=dist_env.device)  # filled
    dropped, surplus, filled = all_reduce(counts).tolist()
    logs.update({"charts/gen_rounds": len(rounds), "charts/dropped_groups": dropped,
                 "charts/surplus_groups": surplus, "charts/filled_groups": filled})
    if filled and dist_env.main and not _FILLED_SAID:
        _FILLED_SAID.append(step)
        print(f"step {step}: --max-gen-rounds {max_rounds} spent; {filled:.0f} flat groups (A = 0) "
              "fill the batch, counted in charts/filled_groups (said once)", file=sys.stderr)
    # group k of the concatenated rounds: round k // per_rank, its group k % per_rank
    parts = [(rollout_r, rows_of(kept[kept // per_rank == r] % per_rank, group_size))
             for r, (_, rollout_r, _, _) in enumerate(rounds)]
    roll = Rollout.merge(parts, tok.pad_token_id)
    everything = sum((indices for indices, _, _, _ in rounds), [])
    rows = train.select([everything[k] for k in kept.tolist()])
    sequences = rows_of(kept, group_size)
    rewards = torch.cat([rewards for _, _, rewards, _ in rounds])[sequences]
    if rounds[0][3]:  # the reward's logs (reward.metrics) over the kept groups
        reward.values = {name: torch.cat([values[name] for _, _, _, values in rounds])[sequences]
                         for name in rounds[0][3]}
    return replace(roll, rows=rows, rewards=rewards, reward_errors=reward_errors, stats=logs)


def flat_groups(rewards: torch.Tensor, group_size: int,
                parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[groups]: True where every advantage of the group is 0: its rewards all equal (std 0, DFPO
    eq. 43); with parts (reward_parts: GDPO), each weighted reward's values equal over the rows it
    applies to (every z-score 0), whatever the summed rewards."""
    if parts is None:
        g = rewards.view(-1, group_size)
        return (g == g[:, :1]).all(1)
    values, weights = parts
    k = values.view(-1, group_size, values.shape[1])
    lo = k.nan_to_num(math.inf).amin(1)  # NaN: the reward does not apply to that row
    hi = k.nan_to_num(-math.inf).amax(1)
    return ((lo >= hi) | (weights == 0)).all(1)


def rows_of(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """The completion rows of groups `groups` (rows of one group adjacent, groups in order)."""
    return (groups[:, None] * group_size + torch.arange(group_size)).flatten()


def extra_prompt_indices(n_rows: int, step: int, round_: int, per_rank: int, dist_env: Dist,
                         seed: int) -> list[int]:
    """This rank's prompts for generation round `round_` >= 1 of `step` (--dynamic-sampling):
    rows outside the step's own batch (every rank's prompt_indices), in an order drawn from (seed,
    step); round r takes slice (r - 1) x world + rank of per_rank of it, and wraps around once the
    pool is spent. A pure function of (seed, step, round, rank), so a resumed run draws the same.
    The pool is never empty when n_rows > per_rank x world (cli.check_prompt_pool)."""
    own = set(prompt_indices(n_rows, step, per_rank * dist_env.world,
                             Dist(0, 1, dist_env.device), seed))
    pool = torch.tensor([i for i in range(n_rows) if i not in own])
    gen = torch.Generator().manual_seed(seed * 2**32 + step)  # seed < 2**32 (cli.MAX_SEED)
    pool = pool[torch.randperm(len(pool), generator=gen)]
    first = ((round_ - 1) * dist_env.world + dist_env.rank) * per_rank
    return [int(pool[j % len(pool)]) for j in range(first, first + per_rank)]




def logp_drift(roll: Rollout, old_logp: torch.Tensor) -> dict:
    """gen/logp_drift: the mean |log-prob as sampled - old log-prob| over the completion tokens of
    every rank (the engine's decode against the training forward; it catches engine bugs). Empty
    when the rollout has no sampled log-probs (the HF modes), or when they are pi_old itself
    (--old-logp rollout: nothing to compare)."""
    if roll.logp is None or old_logp is roll.logp:
        return {}
    mask = roll.mask
    total = all_reduce(((roll.logp - old_logp).abs() * mask).sum())
    return {"gen/logp_drift": (total / all_reduce(mask.sum()).clamp(min=1)).item()}


# -------------------- group advantages and the mechanism metrics
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     std: str = "population", eps: float = 1e-6, baseline: str = "group-mean",
                     parts: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A_i = (r_i - mean_g r) / (std + eps) (DFPO eq. 43). std: 'population' (divide the squared
    deviations by n; the blog's worked example: rewards [1,0,1,0] give A = [+1,-1,+1,-1]) or
    'bessel' (by n - 1, as TRL's nanstd and verl's torch.std: [1,0,0,0] gives A_1 = 1.5 where
    population gives 1.732). scale: the std of the group (eq. 43), of the whole batch over all
    ranks (TRL/verl "batch"), or none (centring only, Dr. GRPO). eps: 1e-6 (verl's), TRL's 1e-4.
    baseline: 'group-mean' (eq. 43) or 'leave-one-out' (RLOO: r_i - 1/(G-1) sum_{j != i} r_j,
    which is G/(G-1) (r_i - mean)), before the scaling.
    parts (reward_parts, --multi-objective-aggregation normalize-then-sum): each reward's values
    [B, K] (NaN where it does not apply) and weights [K]; GDPO (arXiv 2601.05242; TRL's
    normalize_then_sum): each reward normalised in its group, (r_k - mean_g r_k) / (std_g r_k +
    eps), their weighted sum (NaN-skipping), then that normalised over the batch of all ranks;
    a completion no reward applies to gets A = 0. scale and baseline are the defaults then.
    Returns the advantages [B] and the count of flat groups, whose advantages are all 0
    (flat_groups: equal rewards; with parts, each reward's values equal in the group)."""
    if std not in ("population", "bessel"):
        raise ValueError(f"unknown std {std!r} (population or bessel)")
    unbiased = std == "bessel"
    r = rewards.view(-1, group_size).double()
    centred = r - r.mean(1, keepdim=True)
    if baseline == "leave-one-out":  # RLOO: the other G - 1 completions' mean as the baseline
        centred = centred * group_size / (group_size - 1)
    elif baseline != "group-mean":
        raise ValueError(f"unknown baseline {baseline!r} (group-mean or leave-one-out)")
    group_std = r.std(1, unbiased=unbiased, keepdim=True)
    zero = int((group_std.squeeze(1) == 0).sum())
    if parts is not None:  # GDPO: normalise each reward in its group, sum, normalise the batch
        zero = int(flat_groups(rewards, group_size, parts).sum())  # not the summed rewards' std
        values, weights = parts
        k = values.view(-1, group_size, values.shape[1])
        z = ((k - k.nanmean(1, keepdim=True)) / (nanstd(k, 1, unbiased) + eps)).view_as(values)
        summed = (z * weights).nansum(1).masked_fill(values.isnan().all(1), math.nan)
        batch = all_gather_cat(summed)
        adv = (summed - batch.nanmean()) / (nanstd(batch, 0, unbiased) + eps)
        return adv.nan_to_num(0.0).float(), zero
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (all_gather_cat(rewards.double()).std(unbiased=unbiased).item() + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown scale {scale!r} (group, batch or none)")
    return adv.view(-1).float(), zero


def reward_parts(reward, roll: Rollout, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """--multi-objective-aggregation normalize-then-sum: each --reward's values on this rank's
    rows [B, K] (NaN: it does not apply; a completion cut at --max-new-tokens: times
    --truncated-reward-scale, as its summed reward) and their weights [K]; else None."""
    if args.multi_objective_aggregation != "normalize-then-sum":
        return None
    return weighted_parts(reward, reward.values, roll.truncated, args.truncated_reward_scale)


def weighted_parts(reward, values: dict, truncated: torch.Tensor, truncated_scale: float):
    """reward_parts of the values {name: [B]} that reward's score set; truncated [B]: rows cut."""
    parts = torch.stack([values[part.name] for part, _ in reward.parts], 1).double()
    cut = truncated.cpu()[:, None]
    parts = torch.where(cut, truncated_scale * parts, parts)
    return parts, torch.tensor([w for _, w in reward.parts], dtype=torch.float64)


def group_metrics(seq_terms: torch.Tensor, first_token_grads: torch.Tensor, group_size: int,
                  groups_total: int) -> dict:
    """Mechanism metrics of one minibatch, over its whole groups (rows in group order).
    seq_terms [B]: each sequence's term m_i = w_i A_i in the objective (w_i: the weight the
    objective applies after clipping and any in-group transform). losses/asym: mean over groups of
    Var_i(m_i) (DFPO eq. 23).
    first_token_grads [B]: d loss / d log pi(y_i1), the gradient of the minibatch's loss with
    respect to the log-prob of each sequence's first completion token (autograd; every sequence has
    one, after the same prompt).
    groups_total: the minibatch's groups on all ranks, so that J = -loss = 1/groups_total sum_g J_g.
    losses/shared_coef: mean over groups of |sum_{i in g} dJ_g / d log pi(y_i1)|, the coefficient
    that a token shared by the whole group gets in the gradient (DFPO eq. 70-72): 0 when the group's
    updates on a shared token cancel."""
    m = seq_terms.detach().double().view(-1, group_size)
    coef = -groups_total * first_token_grads.detach().double().view(-1, group_size).sum(1)
    return {"losses/asym": m.var(1, unbiased=False).mean(), "losses/shared_coef": coef.abs().mean()}


# -------------------- old log-probs: pi_old, and the rollout's own likelihoods
@torch.no_grad()
def old_log_probs(policy, roll: Rollout, minibatches: list[slice], source: str = "recompute",
                  is_cap: float | None = None, routes: moe.Routes | None = None,
                  is_mode: str = "token-truncate", is_min: float | None = None,
                  top_entropy: float = 1.0):
    """pi_old of every completion token [B, T], the rollout correction's weights [B, T] (None
    without is_cap), the high-entropy tokens [B, T] (high_entropy_tokens; None at top_entropy 1),
    and their logs (with perf/old_logp_s, the pass's time).
    source "recompute": the training forward without gradient, a minibatch at a time, so that the
    ratio's numerator and denominator come from the same numerics (losses/entropy logged; on an MoE
    model each (token, layer)'s experts go to the router tape, moe.recording). "rollout"
    (--old-logp rollout): the log-prob the engine computed when it sampled each token, under the
    sampling temperature (roll.logp); no forward pass, the saving GSPO (arXiv 2507.18071) claims
    its sequence ratio affords, as it averages the per-token mismatch between the two numerics.
    is_cap C_max (--rollout-is-cap), is_min C_min, is_mode: the rollout correction (TIS: Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's rollout
    correction, TRL's vllm_importance_sampling_mode): the tokens were drawn from the engine's
    pi_rollout, not pi_old, so each token's loss term is weighted by rho = pi_old / pi_rollout, a
    constant: the token's own (token-*) or its sequence's, the product over its tokens
    (sequence-*), truncated to [C_min, C_max] (*-truncate) or set to 0 outside it (*-mask). Logged:
    the weight's mean, the fraction truncated or masked, and the mismatch itself over tokens, the
    k3 estimate of KL(pi_rollout || pi_old), mean(rho - 1 - log rho), and chi-square, mean(rho^2)
    - 1. With --max-staleness: stale/kl (staleness.gap), the gap between the behaviour policy and
    the recomputed pi_old."""
    if source == "rollout":  # what --old-logp rollout saves: perf/old_logp_s 0
        return roll.logp, None, None, {"perf/old_logp_s": 0.0}
    start = time.time()
    ids, attention_mask, n_prompt = roll.input_ids, roll.attention_mask, roll.n_prompt
    old = []
    for rows in minibatches:
        with moe.recording(routes, rows, attention_mask):
            old.append(policy(ids[rows], attention_mask[rows], n_prompt, entropy=True))
    old_logp = torch.cat([minibatch_logp for minibatch_logp, _ in old])
    entropy = torch.cat([minibatch_entropy for _, minibatch_entropy in old])
    mask = roll.mask
    tokens = all_reduce(mask.sum()).clamp(min=1)  # completion tokens on all ranks
    stats = {"losses/entropy": (all_reduce((entropy * mask).sum()) / tokens).item(),
             "perf/old_logp_s": time.time() - start, **staleness.gap(roll, old_logp)}
    keep = None
    if top_entropy < 1:  # --top-entropy-quantile: pi_old's entropies, the whole step's tokens
        keep, threshold = high_entropy_tokens(entropy, mask, top_entropy)
        stats["losses/entropy_threshold"] = threshold
        stats["losses/entropy_kept_frac"] = (all_reduce(keep.sum()) / tokens).item()
    if is_cap is None:
        return old_logp, None, keep, stats
    log_ratio = torch.where(mask.bool(), old_logp - roll.logp, 0.0)  # log pi_old / pi_rollout
    log_rho = log_ratio  # token-*: each token's own ratio
    if is_mode.startswith("sequence"):  # sequence-*: the product over the sequence, on each token
        log_rho = torch.where(mask.bool(), log_ratio.sum(1, keepdim=True), 0.0)
    high = math.log(is_cap)
    low = -math.inf if is_min is None else math.log(is_min)
    outside = ((log_rho > high) | (log_rho < low)).float() * mask
    if is_mode.endswith("truncate"):  # TIS: clip(rho, C_min, C_max)
        weight = torch.exp(log_rho.clamp(low, high))
    else:  # masked: rho inside [C_min, C_max], else 0 (IcePop: token-mask with both bounds)
        weight = torch.where(outside.bool(), 0.0, torch.exp(log_rho))
    stats["rollout_is/weight_mean"] = (all_reduce((weight * mask).sum()) / tokens).item()
    key = "rollout_is/capped_frac" if is_mode.endswith("truncate") else "rollout_is/masked_frac"
    stats[key] = (all_reduce(outside.sum()) / tokens).item()
    rho = torch.exp(log_ratio)  # the mismatch, token by token
    stats["rollout_is/kl"] = (all_reduce(((rho - 1 - log_ratio) * mask).sum()) / tokens).item()
    stats["rollout_is/chi2"] = (all_reduce((rho * rho * mask).sum()) / tokens).item() - 1
    return old_logp, weight, keep, stats


def policy_log_probs(policy, roll: Rollout, rows: slice, routes: moe.Routes | None) -> torch.Tensor:
    """log pi_theta of the completion tokens of rows `rows` [rows, T] (Policy.forward), routed as
    the old pass was on an MoE model (moe.replaying: flips counted; --routing-replay). With grad,
    its own gradient is kept: d loss / d logp, read by the shared-token coefficient and Energy."""
    with moe.replaying(routes, rows):
        logp = policy(roll.input_ids[rows], roll.attention_mask[rows], roll.n_prompt)
    if logp.requires_grad:
        logp.retain_grad()
    return logp


@torch.no_grad()
def off_policy_mask(advantages, logp, sample_logp, mask, delta: float | None):
    """OPSM (DeepSeek-V3.2, arXiv 2512.02556 eq. 9; TRL's get_off_policy_mask): the advantages
    [B] (or [B, T]) with the rows dropped set to 0, and the rows dropped as (count, rows) for the
    logs (None when off). A row is dropped when its advantage is negative (a [B, T] row: its sum) and its mean
    log(pi_sample / pi_theta) over its tokens exceeds delta; logp: pi_theta now (the micro-batch's
    forward), sample_logp: what sampled the tokens. delta None: the advantages as they are."""
    if delta is None:
        return advantages, None
    seq_adv = advantages.sum(1) if advantages.dim() == 2 else advantages
    kl = ((sample_logp - logp) * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean log pi_s / pi
    drop = (seq_adv < 0) & (kl > delta)
    keep = (~drop).to(advantages.dtype)
    dropped = (drop.sum().float(), torch.tensor(float(len(mask))))
    return advantages * (keep[:, None] if advantages.dim() == 2 else keep), dropped


@torch.no_grad()
def ref_log_probs(ref, roll: Rollout, minibatches: list[slice]) -> torch.Tensor | None:
    """log pi_ref of every completion token [B, T], a minibatch at a time (None: no KL term)."""
    if ref is None:
        return None
    return torch.cat([ref(roll.input_ids[rows], roll.attention_mask[rows], roll.n_prompt)
                      for rows in minibatches])


# -------------------- data order: prompts a step, minibatches, micro-batches
def prompt_indices(n_rows: int, step: int, per_rank: int, dist_env: Dist, seed: int) -> list[int]:
    """This rank's prompts for `step` (1-based): a fresh seeded permutation each epoch, global batch
    split across ranks, so the data position is a pure function of the step."""
    first = (step - 1) * per_rank * dist_env.world + dist_env.rank * per_rank
    perms = {}  # one permutation per epoch this batch touches (at most two), not one per prompt
    out = []
    for j in range(first, first + per_rank):
        epoch, pos = divmod(j, n_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_rows,
                                          generator=torch.Generator().manual_seed(seed + epoch))
        out.append(int(perms[epoch][pos]))
    return out


def minibatches(n_groups: int, group_size: int, num_minibatches: int) -> list[slice]:
    """Row slices of whole groups: a group never straddles two minibatches."""
    per = n_groups // num_minibatches * group_size
    return [slice(i * per, (i + 1) * per) for i in range(num_minibatches)]


def micro_batches(mb: slice, size: int) -> list[slice]:
    """Consecutive slices of `size` rows inside a minibatch (the last may be shorter; a slice may
    split a group); size 0 is the whole minibatch."""
    size = size or mb.stop - mb.start
    return [slice(i, min(i + size, mb.stop)) for i in range(mb.start, mb.stop, size)]


# -------------------- the optimizer step: learning rate, finite checks, statistics
def lr_scheduler(optimizer, args):
    """Per optimizer step: linear warm-up over --warmup-frac of the steps, then constant, cosine or
    linear decay to --min-lr-ratio x the peak (the DFPO paper's App. I: cosine, 3% warm-up, 0.2;
    transformers' linear, TRL's default: linear to 0). A step makes --num-iterations x
    --num-minibatches optimizer steps."""
    total = args.num_steps * args.num_iterations * args.num_minibatches
    warmup = round(args.warmup_frac * total)

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if args.lr_schedule == "constant":
            return 1.0
        progress = (i - warmup) / max(1, total - warmup)
        if args.lr_schedule == "linear":  # transformers' (total - i) / (total - warmup) at ratio 0
            return args.min_lr_ratio + (1 - args.min_lr_ratio) * (1 - progress)
        return (args.min_lr_ratio
                + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm(policy, max_norm: float) -> torch.Tensor:
    """The gradient's total norm before clipping to max_norm, one value on every rank (FSDP2's
    DTensor made whole)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


class Updates:
    """One step's optimizer updates as the loop makes them, and what they log: each micro-batch's
    loss stats and the spread of its token log-ratios; each minibatch's loss, gradient norm and
    group metrics (Asym, DFPO eq. 23; the shared-token coefficient, eq. 70-72, from d loss / d logp
    at each sequence's first completion token); Energy once in a due step (--energy-every, eq. 24);
    the finite check of each update (a non-finite one is skipped on every rank together and
    counted; --max-nonfinite in a row stop the run). Its clock starts when it is made, before the
    old log-probs: perf/train_tokens_per_s is the step's tokens over the old pass and updates."""

    def __init__(self, policy, roll: Rollout, mask: torch.Tensor, args, step: int,
                 nonfinite_run: int, dist_env: Dist):
        self.policy, self.roll, self.mask, self.args, self.step, self.dist_env = (
            policy, roll, mask, args, step, dist_env)
        self.count = args.num_minibatches * args.num_iterations  # optimizer steps this step
        self.nonfinite_run, self.skipped = nonfinite_run, 0
        self.stats, self.energy = [], {}
        self.start = time.time()
        self._new_minibatch()

    def _new_minibatch(self):
        self.loss, self.micro_stats, self.seq_terms, self.first_token_grads = 0.0, [], [], []

    def after_backward(self, update: int, micro: slice, logp, loss, seq_terms, loss_stats: dict,
                       old_logp, dropped=None):
        """After a micro-batch's loss.backward(): logp [micro, T] its log-probs (their .grad kept by
        policy_log_probs), seq_terms [micro] each sequence's m_i = w_i A_i, old_logp [micro, T];
        dropped: OPSM's (rows dropped, rows), logged as losses/opsm_frac (None: OPSM off)."""
        self.seq_terms.append(seq_terms)
        self.first_token_grads.append(logp.grad[:, 0])
        if not self.energy.get("energy/tokens") and energy.due(  # eq. 24
                self.args, self.step, update, self.count):
            roll = self.roll
            self.energy = energy.measure(self.policy, roll.input_ids[micro],
                                         roll.attention_mask[micro], roll.n_prompt,
                                         self.mask[micro], logp.grad, self.args.energy_rows,
                                         roll.input_ids, self.mask)
        self.loss = self.loss + loss.detach()
        self.micro_stats.append({**loss_stats, **log_ratio_spread(
            logp, old_logp, self.mask[micro], first=update == 0)})
        if self.args.noise_stats:  # --noise-stats: the weights' spread, the halves' gradients
            grads, second = local_grads(self.policy), len(self.micro_stats) == 2
            self.micro_stats[-1].update(noise_stats(logp, old_logp, self.mask[micro], update, grads,
                                                    self.half if second else None))
            if not second:  # the minibatch's first half: its gradient kept for the second
                self.half = [g.detach().clone() for g in grads]
        if dropped is not None:
            self.micro_stats[-1]["losses/opsm_frac"] = dropped

    def finite(self, grad_norm: torch.Tensor) -> bool:
        """Whether this minibatch's loss and gradient are finite on every rank; if not, the update
        is skipped (by the caller) and counted, and max_nonfinite in a row stop the run."""
        if all_finite(self.loss, grad_norm):
            self.nonfinite_run = 0
            return True
        self.skipped += 1
        self.nonfinite_run += 1
        if self.nonfinite_run >= self.args.max_nonfinite:
            fail(f"step {self.step}: {self.nonfinite_run} non-finite updates in a row (loss "
                 f"{self.loss.item()}, grad norm {grad_norm.item()}); lower the "
                 "learning rate or look at this step's data")
        return False

    def minibatch_done(self, grad_norm: torch.Tensor, groups_total: int):
        """After a minibatch's optimizer step; groups_total: its groups on all ranks."""
        groups = group_metrics(torch.cat(self.seq_terms), torch.cat(self.first_token_grads),
                               self.args.group_size, groups_total)
        minibatch_stats = {
            # the minibatch's loss: the mean over ranks of world x their share
            "losses/policy_loss": self.loss * self.dist_env.world,
            "losses/grad_norm": grad_norm,
            **groups,
        }
        self.stats += [{**loss_stats, **minibatch_stats} for loss_stats in self.micro_stats]
        self._new_minibatch()

    def log(self) -> dict:
        """losses/ over the step's micro-batches and all ranks (reduce_stats), the skipped
        updates, perf/train_tokens_per_s, and energy/ when it was measured."""
        tokens = all_gather_cat(self.roll.attention_mask.sum().view(1).float()).sum()
        return {"losses/skipped_updates": self.skipped,
                "perf/train_tokens_per_s": tokens.item() / (time.time() - self.start),
                **reduce_stats(self.stats), **self.energy}


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every tensor is finite on every rank: one decision that all ranks share."""
    ok = torch.stack([torch.isfinite(t).all() for t in tensors]).all().float().view(1)
    return bool(all_reduce(ok, dist.ReduceOp.MIN).item())  # one host sync, not one a tensor
