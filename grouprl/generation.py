"""Generation: n completions a prompt as a Rollout, through HF `generate` (repeat, shared-prefill,
static) or the engine (grouprl/engine/; docs/engine.md), and the Rollout itself, what one step's
groups are from generation to the loss (common.sample_groups adds the prompts and rewards).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import engine
from .distributed import Dist, all_reduce, fail
from .modeling import Policy
from .sampling import Sampling


@dataclass
class Rollout:
    """Completions as generate makes them, and as sample_groups hands them to the loop with their
    prompts and rewards: B = prompts x G rows, the rows of a group adjacent; P prompt positions
    (left-padded), T completion positions (right-padded)."""
    input_ids: torch.Tensor  # [B, P + T] the prompt's ids, then the completion's
    attention_mask: torch.Tensor  # [B, P + T]
    n_prompt: int  # P: input_ids[:, n_prompt:] are the completions
    mask: torch.Tensor  # [B, T] float: completion tokens up to and including the first EOS
    truncated: torch.Tensor  # [B] bool: no EOS, cut at --max-new-tokens
    texts: list[str]  # [B] the completions, decoded without their EOS
    logp: torch.Tensor | None = None  # [B, T] each token's log-prob as the engine sampled it
    rows: object = None  # the step's prompts, one a group (datasets rows: prompt, answer, text)
    rewards: torch.Tensor | None = None  # [B] each completion's reward (sample_groups)
    reward_errors: int = 0  # reward calls that failed, every generation round
    stats: dict = field(default_factory=dict)  # perf/gen_tokens_per_s; charts/gen_rounds ...
    # episodes with an --environment (episodes.close_episodes): [B] float64 get_reward (NaN: None
    # or failed), [B] its errors (None: scored), [B] get_turn_rewards (a float a model turn)
    env_rewards: torch.Tensor | None = None
    env_errors: list[str | None] | None = None
    turn_rewards: list[list[float]] | None = None
    messages: list[list[dict]] | None = None  # [B] an episode as TRL's completions (messages)

    @classmethod
    def merge(cls, parts: list[tuple[Rollout, torch.Tensor]], pad_id: int) -> Rollout:
        """Generated rollouts, rows `keep` of each (in order), as one: the prompts left-padded (pad
        id, attention 0) and the completions right-padded (pad id, attention and mask 0; log-prob
        0) to the longest. One rollout kept whole is returned as it is."""
        parts = [(roll, keep) for roll, keep in parts if len(keep)]
        if len(parts) == 1 and torch.equal(parts[0][1], torch.arange(len(parts[0][0].texts))):
            return parts[0][0]
        P = max(roll.n_prompt for roll, _ in parts)
        T = max(roll.mask.shape[1] for roll, _ in parts)

        def rows(name: str):  # a list field's rows `keep` of each part (None: the parts have none)
            if getattr(parts[0][0], name) is None:
                return None
            return [getattr(roll, name)[i] for roll, keep in parts for i in keep.tolist()]

        def cat(name: str, prompt: bool = False, value=0):  # rows `keep` of each part, padded
            if getattr(parts[0][0], name) is None:  # logp: the HF modes have none
                return None
            pieces = []
            for roll, keep in parts:
                x = getattr(roll, name)
                x = x[keep.to(x.device)]  # env_rewards stay on the CPU
                if x.dim() == 2:  # [rows, (P +) T]: the prompt padded on the left, the rest right
                    x = F.pad(x, (P - roll.n_prompt if prompt else 0, T - roll.mask.shape[1]),
                              value=value)
                pieces.append(x)
            return torch.cat(pieces)

        return cls(input_ids=cat("input_ids", prompt=True, value=pad_id),
                   attention_mask=cat("attention_mask", prompt=True), n_prompt=P,
                   mask=cat("mask"), truncated=cat("truncated"),
                   texts=rows("texts"), logp=cat("logp"), env_rewards=cat("env_rewards"),
                   env_errors=rows("env_errors"), turn_rewards=rows("turn_rewards"),
                   messages=rows("messages"))


GEN_MODES = ("repeat", "shared-prefill", "static", "engine", "engine-tp")


@torch.no_grad()
def generate(policy: Policy, tok, prompts: list[str], n: int, eos: list[int], dist_env: Dist,
             sampling: Sampling, streamer=None, episodes: bool = False) -> Rollout:
    """n completions per prompt, rows of one prompt adjacent (a group); B = len(prompts) x n.
    Returns a Rollout without rewards: input_ids and attention_mask [B, P + T] (prompts
    left-padded), n_prompt P, mask [B, T] (completion tokens up to and including the first EOS),
    truncated [B] (no EOS), texts [B], and with the engine logp [B, T], each token's log-prob as
    sampled. Every mode samples as HF's generate does (sampling: repetition_penalty, temperature,
    top_k, top_p, min_p, min_new_tokens: EOS masked until then); sampling.mode: repeat,
    shared-prefill (each prompt prefilled once, its KV cache repeated to its n rows), static,
    engine, engine-tp (grouprl/engine/). Greedy decoding (top_k=1) gives the same tokens in
    every mode. The modes, cuda_graphs, flex, compile_step and engine_dtype: docs/engine.md.
    streamer: HF's, given each decoding step's tokens (a progress bar; HF modes only).
    episodes: the first turn of episodes (grouprl/episodes.py): with the engine, one slot a row
    (not gen_batch_size's), each row's KV cache kept for its next turns (engine.turns; ended by
    engine.turns.end or the engine's next call); the HF modes keep nothing."""
    mode, gen_batch_size, max_new_tokens = (sampling.mode, sampling.gen_batch_size,
                                            sampling.max_new_tokens)
    if mode not in GEN_MODES:
        raise ValueError(f"unknown generation mode {mode!r} ({', '.join(GEN_MODES)})")
    if episodes:  # the model's last episodes end here, whichever mode makes these
        engine.turns.end(getattr(policy, "lm", None))
    enc = tok(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.to(dist_env.device), enc.attention_mask.to(dist_env.device)
    tp = dist_env.world if mode == "engine-tp" else 1  # the engine's layers split over tp ranks
    if episodes and tp > 1:  # engine-tp decodes every rank's rows together; episodes go on apart
        fail("--tools with --gen-mode engine-tp over several processes: each rank's episodes take "
             "their own turns, which engine-tp's shared decoding cannot; use --gen-mode engine")
    if mode in ("engine", "engine-tp") and engine.runs(policy.lm.config, tp, dist_env.main):
        mine = [row[m.bool()].tolist() for row, m in zip(ids, am)]  # this rank's prompts, unpadded
        everyone, generator = [mine], None
        if tp > 1:  # every rank decodes every rank's prompts, with the same random stream
            everyone = [None] * tp
            dist.all_gather_object(everyone, mine)
            seed = all_reduce(torch.randint(2 ** 62, (1,)) * dist_env.main)  # rank 0's draw
            generator = torch.Generator(dist_env.device).manual_seed(int(seed))
        dtype = ({"bf16": torch.bfloat16, "fp32": torch.float32}.get(sampling.engine_dtype)
                 or getattr(policy, "compute_dtype", None)
                 or (torch.bfloat16 if dist_env.device.type == "cuda" else torch.float32))
        setup = engine.Setup(
            slots=tp * max(n, gen_batch_size // n * n), device=dist_env.device, dtype=dtype,
            rank=dist_env.rank if tp > 1 else 0, world=tp,
            graphs=None if sampling.cuda_graphs else False, flex=sampling.flex,
            compile=sampling.compile_step,
            keep=True)  # one Engine per run: cache and graphs made once, weights refreshed
        try:
            if episodes:  # rows kept open for their next turns (engine.turns.of(lm).next)
                completions, logps = map(list, zip(*engine.turns.begin(
                    policy.lm, sum(everyone, []), n, eos, sampling, setup, generator)))
            else:
                completions, logps = engine.generate(policy.lm, sum(everyone, []), n, eos,
                                                     sampling, setup, generator)
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
        roll.logp = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps],
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
    with gathered(policy, sampling.unshard):
        for i in range(0, ids.shape[0], rows):
            outs.append(policy.generate(
                input_ids=ids[i:i + rows], attention_mask=am[i:i + rows], n=n if shared else 1,
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, min_p=sampling.min_p or None,
                repetition_penalty=sampling.repetition_penalty, max_new_tokens=max_new_tokens,
                min_new_tokens=sampling.min_new_tokens or None,
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


def rollout(ids, am, comp, tok, eos: list[int]) -> Rollout:
    """Prompts ids, am [B, P] (left-padded) and completions comp [B, T] -> generate()'s Rollout:
    each completion kept up to and including its first EOS, truncated where it has none."""
    is_eos = torch.isin(comp, torch.tensor(eos, device=comp.device))
    # positions up to and including the first EOS
    before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    comp = comp.masked_fill(~before_eos, tok.pad_token_id)
    return Rollout(input_ids=torch.cat([ids, comp], 1),
                   attention_mask=torch.cat([am, before_eos.long()], 1), n_prompt=ids.shape[1],
                   mask=before_eos.float(), truncated=~is_eos.any(1),  # no EOS: cut at the limit
                   texts=tok.batch_decode(comp.masked_fill(is_eos, tok.pad_token_id),
                                          skip_special_tokens=True))



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
