"""The map of what every algorithm script's loop calls, in the loop's order; the loop itself
lives in each script, after its set-up (grouprl/modeling.py: the model, the tokenizer, Policy). Sections:
  generation           HF `generate`: repeat, shared-prefill, static
  the step's groups    sample_groups: rollout -> rewards, DAPO's dynamic sampling in rounds
  rewards              the built-in reward functions a --reward names (scoring: grouprl/rewards.py)
  group advantages     A_i and the mechanism metrics (Asym, shared-token coefficient)
  old log-probs        pi_old recomputed or from the rollout (--old-logp), the token weights
  data order           prompts a step, minibatches of whole groups, micro-batches
  the optimizer step   learning-rate schedule, finite checks (statistics: grouprl/stats.py)
  evaluation, logging  held-out avg@k and pass@k, tensorboard and metrics.jsonl, samples
The subsystems a reader of an algorithm need not read live in the grouprl package, one file
each (grouprl/__init__.py lists them), imported by the scripts or by this file; none of them
imports a script or this file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grouprl import energy, engine, moe
from grouprl.checkpoint import startup_phase, starting_up, writing
from grouprl.distributed import Dist, Refused, all_gather_cat, all_reduce, fail, on_rank0
from grouprl.grader import Reward, extract_answer
from grouprl.modeling import Policy
from grouprl.rewards import score
from grouprl.progress import ROLLOUT_BAR_DELAY, GenBar
from grouprl.stats import (high_entropy_tokens, local_grads, log_ratio_spread, nanstd, noise_stats,
                           pass_at_k, reduce_stats)


# -------------------- generation
GEN_MODES = ("repeat", "shared-prefill", "static", "engine", "engine-tp")


@torch.no_grad()
def generate(policy: Policy, tok, prompts: list[str], n: int, eos: list[int], dist_env: Dist, *,
             max_new_tokens: int, temperature: float, top_p: float, top_k: int, gen_batch_size: int,
             min_p: float = 0.0, repetition_penalty: float = 1.0, min_new_tokens: int = 0,
             unshard: bool = False, mode: str = "shared-prefill", cuda_graphs: bool = True,
             flex: bool | None = None, compile_step: bool | None = None,
             engine_dtype: str = "auto", streamer=None) -> dict:
    """n completions per prompt, rows of one prompt adjacent (a group); B = len(prompts) x n.
    Returns a dict: input_ids and attention_mask [B, P + T] (prompts left-padded), n_prompt P,
    mask [B, T] (completion tokens up to and including the first EOS), truncated [B] (no EOS),
    texts [B], and with the engine logp [B, T], each token's log-prob as sampled. Every mode
    samples as HF's generate does (repetition_penalty, temperature, top_k, top_p, min_p); mode:
    repeat, shared-prefill (each prompt prefilled once, its KV cache repeated to its n rows),
    static, engine, engine-tp (grouprl/engine.py); min_new_tokens (HF's: EOS masked until then)
    in every mode. Greedy decoding (top_k=1) gives the same tokens
    in every mode. The modes, cuda_graphs, flex, compile_step and engine_dtype: docs/engine.md.
    streamer: HF's, given each decoding step's tokens (a progress bar; HF modes only)."""
    if mode not in GEN_MODES:
        raise ValueError(f"unknown generation mode {mode!r} ({', '.join(GEN_MODES)})")
    enc = tok(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.to(dist_env.device), enc.attention_mask.to(dist_env.device)
    tp = dist_env.world if mode == "engine-tp" else 1  # the engine's layers split over tp ranks
    if mode in ("engine", "engine-tp") and engine.runs(policy.lm.config, tp, dist_env.main):
        mine = [row[m.bool()].tolist() for row, m in zip(ids, am)]  # this rank's prompts, unpadded
        everyone, generator = [mine], None
        if tp > 1:  # every rank decodes every rank's prompts, with the same random stream
            everyone = [None] * tp
            dist.all_gather_object(everyone, mine)
            seed = all_reduce(torch.randint(2 ** 62, (1,)) * dist_env.main)  # rank 0's draw
            generator = torch.Generator(dist_env.device).manual_seed(int(seed))
        try:
            completions, logps = engine.generate(
                policy.lm, sum(everyone, []), n, eos, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens,
                slots=tp * max(n, gen_batch_size // n * n), device=dist_env.device,
                dtype={"bf16": torch.bfloat16, "fp32": torch.float32}.get(engine_dtype) or getattr(
                    policy, "compute_dtype", None) or (
                    torch.bfloat16 if dist_env.device.type == "cuda" else torch.float32),
                rank=dist_env.rank if tp > 1 else 0, world=tp, generator=generator,
                graphs=None if cuda_graphs else False, flex=flex, compile=compile_step,
                keep=True)  # one Engine per run: cache and graphs made once, weights refreshed
        except MemoryError as e:  # said before anything is allocated (engine.kv_plan)
            fail(f"--gen-mode {mode}: {e}; lower --gen-batch-size (now {gen_batch_size}) or "
                 f"--max-new-tokens (now {max_new_tokens})")
        except torch.OutOfMemoryError as e:  # past the plan (another process's memory, say)
            why = (str(e).strip().splitlines() or ["out of memory"])[0]
            msg = (f"--gen-mode {mode}: the GPU ran out of memory while generating ({why}); lower "
                   f"--gen-batch-size (now {gen_batch_size}) or --max-new-tokens (now "
                   f"{max_new_tokens})")
            if not dist_env.main:  # only this rank knows: fail() prints on rank 0 alone
                print(f"error: rank {dist_env.rank}: {msg}", file=sys.stderr)
            fail(msg)
        # this rank's rows
        first = sum(len(p) for p in everyone[:dist_env.rank]) * n if tp > 1 else 0
        completions = completions[first:first + len(mine) * n]
        logps = logps[first:first + len(mine) * n]
        T = max(len(c) for c in completions)
        comp = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in completions],
                            device=dist_env.device)
        roll = rollout(ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0), comp, tok, eos)
        roll["logp"] = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps],
                                    device=dist_env.device)
        return roll
    # engine, engine-tp: HF shared-prefill for a model the engine does not cover
    shared = mode in ("shared-prefill", "engine", "engine-tp")
    # one-token prompts: a pad column, so that the prefilled prefix is not empty
    if shared and ids.shape[1] < 2:
        ids, am = F.pad(ids, (1, 0), value=tok.pad_token_id), F.pad(am, (1, 0), value=0)
    # prompts (shared) or rows (repeat) a call
    rows = max(1, gen_batch_size // n) if shared else gen_batch_size
    if not shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    extra = (dict(cache_implementation="static", disable_compile=dist_env.sharded)
             if mode == "static" else {})
    if streamer is not None:
        extra["streamer"] = streamer
    outs = []
    with gathered(policy, unshard):
        for i in range(0, ids.shape[0], rows):
            outs.append(policy.generate(
                input_ids=ids[i:i + rows], attention_mask=am[i:i + rows], n=n if shared else 1,
                do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=min_p or None, repetition_penalty=repetition_penalty,
                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None,
                eos_token_id=eos,
                # FSDP: every rank steps until all are done
                pad_token_id=tok.pad_token_id, synced_gpus=dist_env.sharded,
                **extra,
            )[:, ids.shape[1]:])
    if shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    T = max(o.shape[1] for o in outs)
    comp = torch.cat([F.pad(o, (0, T - o.shape[1]), value=tok.pad_token_id) for o in outs])
    return rollout(ids, am, comp, tok, eos)


def rollout(ids, am, comp, tok, eos: list[int]) -> dict:
    """Prompts ids, am [B, P] (left-padded) and completions comp [B, T] -> generate()'s dict: each
    completion kept up to and including its first EOS, truncated where it has none."""
    is_eos = torch.isin(comp, torch.tensor(eos, device=comp.device))
    # positions up to and including the first EOS
    before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    comp = comp.masked_fill(~before_eos, tok.pad_token_id)
    return {"input_ids": torch.cat([ids, comp], 1),
            "attention_mask": torch.cat([am, before_eos.long()], 1),
            # no EOS: cut at the limit
            "n_prompt": ids.shape[1], "mask": before_eos.float(), "truncated": ~is_eos.any(1),
            "texts": tok.batch_decode(comp.masked_fill(is_eos, tok.pad_token_id),
                                      skip_special_tokens=True)}


# -------------------- the step's groups: rollout -> rewards, and DAPO's dynamic sampling
@dataclass
class Rollout:
    """This rank's groups of one step, as sample_groups hands them to the loop: B = prompts x G
    rows, the rows of a group adjacent; P prompt positions (left-padded), T completion positions
    (right-padded)."""
    rows: object  # the step's prompts, one a group (datasets rows: prompt, answer, text)
    input_ids: torch.Tensor  # [B, P + T] the prompt's ids, then the completion's
    attention_mask: torch.Tensor  # [B, P + T]
    n_prompt: int  # P: input_ids[:, n_prompt:] are the completions
    mask: torch.Tensor  # [B, T] float: completion tokens up to and including the first EOS
    truncated: torch.Tensor  # [B] bool: no EOS, cut at --max-new-tokens
    texts: list[str]  # [B] the completions, decoded without their EOS
    logp: torch.Tensor | None  # [B, T] each token's log-prob as the engine sampled it (HF: None)
    rewards: torch.Tensor  # [B] each completion's reward
    reward_errors: int = 0  # reward calls that failed, every generation round
    stats: dict = field(default_factory=dict)  # perf/gen_tokens_per_s; charts/gen_rounds ...

    @classmethod
    def of(cls, roll: dict, rows=None, rewards=None, reward_errors: int = 0,
           stats: dict | None = None) -> Rollout:
        """generate()'s dict, with its prompts and rewards."""
        return cls(rows, roll["input_ids"], roll["attention_mask"], roll["n_prompt"], roll["mask"],
                   roll["truncated"], roll["texts"], roll.get("logp"), rewards, reward_errors,
                   stats or {})


# roll's per-sequence entries by shape: [B] and [B, T] (completion positions, right-padded)
ROLL_ROW_KEYS = ("truncated",)
ROLL_COMPLETION_KEYS = ("mask", "logp")
_FILLED_SAID = []  # the line saying that --max-gen-rounds was reached, said once a run


def sample_groups(policy: Policy, tok, train, step: int, eos: list[int], dist_env: Dist, reward,
                  gen_kw: dict, *, per_rank: int, group_size: int, seed: int,
                  dynamic: bool = False, max_rounds: int = 1, truncated_scale: float = 1.0,
                  normalize_then_sum: bool = False):
    """This rank's groups of `step`: its per_rank prompts (prompt_indices), group_size completions
    each (generate) and their rewards (score; a completion cut at the token limit scores
    truncated_scale times its reward, --truncated-reward-scale), as a Rollout.
    dynamic (--dynamic-sampling): DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2: the
    constraint 0 < |{o_i correct}| < G on its objective's groups), on the reward the advantages
    use: a group whose rewards are all equal has A_i = 0 for each of its completions (DFPO eq. 43)
    and gives the policy-gradient term nothing; it is dropped, and more rounds of per_rank prompts a
    rank (extra_prompt_indices: never the step's own, a function of seed, step and round) are
    generated and scored while any rank holds fewer than per_rank groups with a spread (with
    normalize_then_sum, GDPO's: a reward whose values differ in the group, flat_groups), max_rounds
    rounds in all. Every rank runs every round (an all_reduce of the shortfall decides), so the
    ranks make the same generate calls (FSDP2's collectives) and score calls (the reward watch's).
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
    rounds = []  # per round: (indices, roll, rewards, each reward's values)

    def flat_of(round_) -> torch.Tensor:  # [groups]: A = 0 for every completion of the group
        _, roll_r, rewards_r, values_r = round_
        parts = (weighted_parts(reward, values_r, roll_r["truncated"], truncated_scale)
                 if normalize_then_sum else None)
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
        roll = generate(policy, tok, rows["text"], group_size, eos, dist_env, **gen_kw,
                        streamer=bar)
        gen_time += time.time() - t
        bar.show(len(indices))
        gen_tokens += roll["mask"].sum().item()
        rewards, errors = score(roll["texts"], rows, group_size, reward, truncated=roll["truncated"],
                                truncated_scale=truncated_scale)
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
    logs = {"perf/gen_tokens_per_s": tokens.item() / gen_time}
    if not dynamic:
        return Rollout.of(roll, rows, rewards, reward_errors, logs)
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
    roll = merge_rollouts(parts, tok.pad_token_id)
    everything = sum((indices for indices, _, _, _ in rounds), [])
    rows = train.select([everything[k] for k in kept.tolist()])
    sequences = rows_of(kept, group_size)
    rewards = torch.cat([rewards for _, _, rewards, _ in rounds])[sequences]
    if rounds[0][3]:  # the reward's logs (reward.metrics) over the kept groups
        reward.values = {name: torch.cat([values[name] for _, _, _, values in rounds])[sequences]
                         for name in rounds[0][3]}
    return Rollout.of(roll, rows, rewards, reward_errors, logs)


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


def merge_rollouts(parts: list[tuple[dict, torch.Tensor]], pad_id: int) -> dict:
    """generate()'s dicts, rows `keep` of each (in order), as one: the prompts left-padded (pad id,
    attention 0) and the completions right-padded (pad id, attention and mask 0; log-prob 0) to the
    longest. One dict kept whole is returned as it is."""
    parts = [(roll, keep) for roll, keep in parts if len(keep)]
    if len(parts) == 1 and torch.equal(parts[0][1], torch.arange(len(parts[0][0]["texts"]))):
        return parts[0][0]
    P = max(roll["n_prompt"] for roll, _ in parts)
    T = max(roll["mask"].shape[1] for roll, _ in parts)
    out = {"n_prompt": P, "texts": [roll["texts"][i] for roll, keep in parts
                                    for i in keep.tolist()]}
    for key, value in (("input_ids", pad_id), ("attention_mask", 0)):
        out[key] = torch.cat([F.pad(roll[key][keep.to(roll[key].device)], (
            P - roll["n_prompt"], T - roll["mask"].shape[1]), value=value)
            for roll, keep in parts])
    for key in ROLL_ROW_KEYS + ROLL_COMPLETION_KEYS:
        if key in parts[0][0]:
            out[key] = torch.cat([
                roll[key][keep.to(roll[key].device)] if key in ROLL_ROW_KEYS
                else F.pad(roll[key][keep.to(roll[key].device)], (0, T - roll[key].shape[1]))
                for roll, keep in parts])
    assert set(out) == set(parts[0][0]), set(parts[0][0]) ^ set(out)  # no entry left behind
    return out




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


@contextlib.contextmanager
def gathered(policy, on: bool):
    """FSDP2 with --gen-unshard: every unit keeps its full parameters from its first forward to the
    end of the block, so decoding gathers each layer once per generate call instead of once per
    token; resharded after."""
    from torch.distributed.fsdp import FSDPModule

    if not on or not isinstance(policy, FSDPModule):
        yield
        return
    policy.set_reshard_after_forward(False)
    try:
        yield
    finally:
        policy.set_reshard_after_forward(True)  # the decoder layers' default
        policy.set_reshard_after_forward(False, recurse=False)  # the root's
        for m in policy.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


# -------------------- rewards: the built-in reward functions (scoring a rollout: rewards.py)
def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (extract_answer) equals the reference, else 0.0: exact
    numbers and canonical text first (decide), math-verify on what they cannot settle (radicals,
    expressions, intervals, sets, tuples, matrices, equations), in a worker process with a time
    bound (in the calling process when that is a --reward worker). Model text is parsed, never
    executed."""
    r, errors = score([completion], [answer], 1, watch=False)
    return r.item()


# <think>, the reasoning, one </think>, then an answer: no second <think>, something after
# </think>. The opening tag may be missing where the chat template wrote it into the prompt.
_THINK_FORMAT = re.compile(r"\s*(?:<think>)?(?:(?!<think>|</think>).)*</think>(?!.*<think>)"
                           r"(?!.*</think>)\s*\S.*", re.DOTALL)


def think_format(completion: str, answer: str) -> float:
    """1.0 when the completion reasons inside <think>...</think> and then answers (TRL's
    think_format_reward, which also asks for an answer after </think>), else 0.0. A built-in
    reward: --reward common:think_format."""
    return float(_THINK_FORMAT.fullmatch(completion) is not None)


# DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), with |y| in characters (a reward
# sees text): L_max = LENGTH_MAX_CHARS, L_cache = LENGTH_CACHE_CHARS (DAPO: 20480 and 4096 tokens)
LENGTH_MAX_CHARS = 16384
LENGTH_CACHE_CHARS = 4096


def length_penalty(completion: str, answer: str) -> float:
    """0 up to L_max - L_cache characters, then ((L_max - L_cache) - |y|) / L_cache, falling
    linearly to -1 at L_max, and -1 past it (DAPO eq. 13). A built-in reward:
    --reward common:length_penalty, added to another one with its weight (--reward-weights)."""
    free = LENGTH_MAX_CHARS - LENGTH_CACHE_CHARS
    if len(completion) <= free:
        return 0.0
    if len(completion) <= LENGTH_MAX_CHARS:
        return (free - len(completion)) / LENGTH_CACHE_CHARS
    return -1.0


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
    - 1."""
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
             "perf/old_logp_s": time.time() - start}
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


def jitter2(m: list[float]) -> float:
    """Second-order difference jitter of a curve, DFPO eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t|
    (nan if T < 3)."""
    if len(m) < 3:
        return float("nan")
    return sum(abs(m[t + 2] - 2 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


# -------------------- held-out evaluation


EVAL_ROWS = "eval/completions"  # evaluate's rows of --log-eval-samples (Logger.log writes them)


@torch.no_grad()
def evaluate(policy, tok, held, eos, dist_env: Dist, *, k: int, n: int | None = None,
             reward: Reward | None = None, max_new_tokens: int, temperature: float, top_p: float,
             top_k: int, gen_batch_size: int, min_p: float = 0.0, repetition_penalty: float = 1.0,
             unshard: bool = False, mode: str = "shared-prefill", cuda_graphs: bool = True,
             engine_dtype: str = "auto", min_new_tokens: int = 0, log_samples: int = 0,
             first_name: str = "the step-0 evaluation") -> dict:
    """Over the held-out prompts (each rank an equal share), from n >= k samples a prompt (n
    defaults to k): avg@k, the mean accuracy of the n samples (an unbiased estimate of the mean
    accuracy of k samples, the DFPO paper's metric), and pass@k, the mean over prompts of the
    unbiased 1 - C(n - c, k) / C(n, k) (pass_at_k); the reward is the task's own, whole whether
    or not a completion stopped (truncated_frac: the fraction cut at max_new_tokens).
    A progress bar (GenBar) shows it; before the first step it is named first_name, in the bar
    and in a stop signal's line. log_samples (--log-eval-samples): the first N prompts of rank 0's
    share, each completion with its reward and extracted answer, as rows under EVAL_ROWS."""
    n = n or k
    world = dist_env.world
    m = len(held) // world * world  # equal shares, or the FSDP all-gathers would hang
    if m == 0:
        fail(f"the held-out split has {len(held)} prompt(s), fewer than the {world} ranks that "
             "share it: give a larger dataset (a local file holds out a tenth, at most "
             "--eval-size) or --eval-every 0")
    rows = held.select(range(dist_env.rank, m, dist_env.world))
    first = starting_up()  # before the first step: the step-0 evaluation (or --eval-only)
    name = first_name if first else "held-out evaluation"
    bar = GenBar(name.removeprefix("the "), len(rows), n, tok.pad_token_id, dist_env.main,
                 leave=first)
    r, errors, cut, logged = torch.zeros(0), 0, 0, []
    per_call = max(1, gen_batch_size // n)  # prompts per generate call
    with startup_phase(name) if first else contextlib.nullcontext():
        for i in range(0, len(rows), per_call):
            part = rows.select(range(i, min(i + per_call, len(rows))))
            out = generate(policy, tok, part["text"], n, eos, dist_env,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                           min_new_tokens=min_new_tokens, gen_batch_size=gen_batch_size,
                           unshard=unshard, mode=mode, cuda_graphs=cuda_graphs,
                           engine_dtype=engine_dtype, streamer=bar)
            part_r, part_errors = score(out["texts"], part, n, reward, watch=False)
            for g in range(max(0, min(len(part), log_samples - i))):  # --log-eval-samples
                logged += [{"prompt": part[g]["prompt"], "answer": part[g]["answer"],
                            "completion": out["texts"][j], "reward": part_r[j].item(),
                            "extracted": extract_answer(out["texts"][j]),
                            "truncated": bool(out["truncated"][j])}
                           for j in range(g * n, (g + 1) * n)]
            r, errors = torch.cat([r, part_r]), errors + part_errors
            cut += int(out["truncated"].sum())
            bar.show(len(part))
    r = r.view(-1, n)
    passk = sum(pass_at_k(n, int(c), k) for c in (r > 0).sum(1))
    s = all_reduce(torch.tensor([r.mean(1).sum(), passk, len(rows), errors, cut], dtype=torch.float64))
    result = {f"eval/avg@{k}": (s[0] / s[2]).item(), f"eval/pass@{k}": (s[1] / s[2]).item(),
              "eval/prompts": m, "eval/samples": n, "eval/reward_errors": s[3].item(),
              "eval/truncated_frac": (s[4] / (s[2] * n)).item()}
    bar.show(more=f", avg@{k} {result[f'eval/avg@{k}']:.3f}, pass@{k} "
                  f"{result[f'eval/pass@{k}']:.3f}")
    bar.bar.close()
    if log_samples and dist_env.main:
        result[EVAL_ROWS] = logged
    return result


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


# -------------------- logging: tensorboard, metrics.jsonl, samples
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


def log_samples(logger: Logger, run_dir: str, step: int, every: int, prompts, answers,
                texts: list[str], rewards: torch.Tensor, advantages: torch.Tensor, n: int,
                prompt_texts: list[str] | None = None):
    """Every `every` steps (0: never; main rank only): the first SAMPLE_PROMPTS prompts of this
    rank's step with their n completions, rewards and advantages, as a text table in tensorboard
    ('samples') and as one JSON object a completion in {run_dir}/samples.jsonl (a resumed run's
    Logger has dropped the rows of the steps it redoes). prompt_texts: the prompts as the model saw
    them (through the chat template), logged in samples.jsonl as "prompt_text"."""
    if not every or step % every or not logger.dist_env.main:
        return
    path = os.path.join(run_dir, "samples.jsonl")
    rows, md = [], []
    for g in range(min(SAMPLE_PROMPTS, len(prompts))):
        seen = {} if prompt_texts is None else {"prompt_text": prompt_texts[g]}
        md.append(f"**prompt:** {prompts[g]}  \n**answer:** {answers[g]}\n\n"
                  "| reward | advantage | completion |\n|---|---|---|")
        for i in range(g * n, (g + 1) * n):
            rows.append({"step": step, "prompt": prompts[g], **seen, "answer": answers[g],
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
