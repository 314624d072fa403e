"""generate, the engine's entry point (common.generate calls it): the Engine made or kept (HELD,
release), the KV plan, and the loop of admissions, decoding steps and looks (scheduler)."""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..sampling import Sampling
from . import settings
from .blocks import group_blocks, kv_plan, page_size
from .runner import Engine
from .scheduler import Rows, Scheduler, admit, retire
from .settings import Setup

HELD = weakref.WeakKeyDictionary()  # generate(keep=True): the model -> its kept Engine
OPEN = weakref.WeakKeyDictionary()  # the model -> its open episodes (turns.Episodes)


def close_episodes(lm):
    """lm's open episodes (turns.begin) closed, their rows' blocks back to the pool -> them, or
    None: an Engine serves one thing at a time."""
    episodes = OPEN.pop(lm, None) if lm is not None else None
    if episodes is not None:
        episodes.close()
    return episodes


def release(lm):
    """Drops lm's kept Engine (HELD) and frees its memory now. An Engine is a reference cycle (its
    compiled layer holds its bound method, its graphs' closures hold it), which only the cycle
    collector frees: on an H200, 39.5 GB were still allocated after the drop, 1.3 GB after
    gc.collect(); without it the next Engine's plan finds that memory taken."""
    import gc

    if HELD.pop(lm, None) is not None:
        gc.collect()


def made(lm, prompts: list[list[int]], n: int, max_new_tokens: int,
         setup: Setup) -> tuple[Engine, Setup, int]:
    """The Engine for n rows of each prompt, up to max_new_tokens each, made as `setup` says or
    kept from the last call (setup.keep: HELD; generate's docstring) -> (the Engine, the setup
    resolved with its slots, the cache's positions a row). Episodes still open on lm (turns.py)
    are closed first: their rows' blocks back to the pool."""
    close_episodes(lm)
    slots, keep = setup.slots, setup.keep
    if slots < n:
        raise ValueError(f"{slots} slots cannot hold a group of {n}")
    # never more slots than rows: a free slot still costs its share of every step (the LM head
    # over the vocabulary, the sampler, attention over the read length), so --gen-batch-size's
    # default of 256 slots for a rollout of 12 rows decoded 21x the rows it needed
    slots = min(slots, len(prompts) * n)
    setup = replace(setup, slots=slots).resolve()
    max_len = max(len(p) for p in prompts) + max_new_tokens
    shortest = min(len(p) for p in prompts)  # the fewest prompt blocks a group's rows share
    if setup.compile:  # the cache's length in steps of GRAPH_REACH: rollouts whose longest
        # prompts differ reuse one compilation (static shapes)
        max_len = -(-max_len // settings.GRAPH_REACH) * settings.GRAPH_REACH
    page = page_size(setup.flex)  # paged, the pool's blocks
    key = (slots, str(setup.device), setup.dtype, setup.rank, setup.world, setup.graphs,
           setup.flex, setup.compile, setup.fuse, page, settings.FLEX_BLOCK, setup.pool_tokens,
           str(settings.FLEX_OPTIONS))
    engine = HELD.get(lm) if keep else None
    if (engine is not None and engine.key == key and engine.max_len >= max_len
            and not any(engine.owned)):  # (a call that raised may leave blocks taken)
        engine.refresh(lm)  # the same cache, compilations and graphs; the weights of now
        max_len = engine.max_len
    else:
        engine = None
        if keep:  # an Engine of other settings: its cache freed before the plan
            release(lm)
        pool_tokens = setup.pool_tokens
        if pool_tokens is None:
            pool_tokens = kv_plan(lm, setup, max_len, n, page, shortest)
            # a pool planned from 90% of the free memory is not kept: the training step's peak
            # (AdamW's moments appear at its first step) would not fit beside it
            keep = keep and pool_tokens is None
        if (pool_tokens is not None
                and pool_tokens // page < group_blocks(shortest, max_len, n, page)):
            raise ValueError(f"a KV pool of {pool_tokens} positions cannot hold one group of {n} "
                             f"rows of up to {max_len} positions")
        engine = Engine(lm, replace(setup, pool_tokens=pool_tokens), max_len)
        engine.key = key
        if keep:
            HELD[lm] = engine
    return engine, setup, max_len


def prepare(engine: Engine, sampling: Sampling, eos: list[int]) -> tuple:
    """The sampler's settings (sampling.sample: HF's semantics) as the step takes them, `how`, and
    the Engine's buffers they need (the penalty's seen ids, min_new_tokens' EOS mask)."""
    if sampling.repetition_penalty != 1:
        engine.see_ids()
    if sampling.min_new_tokens:
        engine.hold_eos(eos)
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
            sampling.repetition_penalty)


@torch.no_grad()
def generate(lm, prompts: list[list[int]], n: int, eos: list[int], sampling: Sampling,
             setup: Setup, generator=None,
             stats: dict | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """n completions of each prompt (token ids, no padding): rows prompt * n + j, a group's rows
    adjacent, drawn as `sampling` says (its max_new_tokens, temperature, top_k, top_p, min_p,
    repetition_penalty and min_new_tokens; the rest of it is generation.generate's) by an Engine
    made as `setup` says (settings.Setup). A completion ends at its first EOS (kept) or after
    max_new_tokens; min_new_tokens (HF's): the EOS ids' logits are -inf for a row's tokens 0 ..
    min_new_tokens - 1, so none ends before (max_new_tokens still caps), and its log-probs are the
    masked softmax's. `setup.slots` rows decode at once; a prompt is admitted (prefilled once, its
    KV copied to n free slots) whenever n slots are free, and the host looks at which rows have
    finished every `setup.sync_every` steps.
    Returns the completions' token ids and the log-prob of each under the temperature-scaled
    softmax (of the logits repetition_penalty changed, if it is not 1: sampling.sample). `stats`,
    if given, gets the counts of decoding steps, prefills, prefills made while other rows were
    decoding (continuous batching at work), groups preempted, KV blocks still taken at the end,
    graphs captured, a block's bytes (k and v, every layer) and, paged, Scheduler.tally's peaks.
    setup.pool_tokens: the KV cache's positions, paged (Engine) in blocks of page_size(flex);
    None: whole (slots x the longest prompt + max_new_tokens), or paged where that cannot fit the
    GPU (kv_plan). Paged, a group's rows share its prompt's full blocks (Engine.share,
    reference-counted, freed with the last row that holds them; SHARE_PROMPTS), and it is admitted
    only when the pool also holds its next sync_every positions beside those the running rows
    need; when running rows outgrow the pool the youngest group is preempted: its blocks freed, its
    prompt first in line again, its completions made anew.
    setup.world > 1: tensor parallel, every rank running this call on the same prompts with its
    share of the heads (tensor_parallel_fits) and the same `generator` (None: torch's global
    stream), so that every rank samples the same tokens.
    setup.graphs: the decoding step through Engine.step's graphs, one per read length (CUDA graphs
    on a GPU; on the CPU the same path eager, for tests); None: on a GPU with one rank (tensor
    parallel decodes eagerly: its all-reduces are not captured).
    setup.flex: decoding attends through FlexAttention's block mask, reading each row's live
    blocks only (Engine.live_blocks); None: on a GPU (compiled), not on the CPU (SDPA over the
    read length).
    setup.compile: each layer of the decoding step compiled (Engine's compile: fused kernels,
    inside the CUDA graphs); None: where the graphs are on (a GPU, one rank). Not on the CPU by
    default: there inductor's C++ compilation (~40 s on 2 cores) costs more than it saves in a
    rollout's steps.
    setup.keep: one Engine per run: the Engine is kept (HELD, per model) and the next call with
    the same setup and rows no longer than its own reuses it, its weight copies refreshed from the
    model in place (Engine.refresh), its KV cache, compilations and CUDA graphs made once; its
    cache then stays allocated between rollouts (the training step runs beside it). Otherwise
    each call makes its own."""
    max_new_tokens = sampling.max_new_tokens
    engine, setup, max_len = made(lm, prompts, n, max_new_tokens, setup)
    slots = setup.slots
    how = prepare(engine, sampling, eos)
    rows = Rows(slots, max_new_tokens, eos, setup.device, sampling.min_new_tokens)
    plan = Scheduler(prompts, n, slots, setup.sync_every, max_len, engine)
    while plan.busy() or plan.waiting:
        admit(plan, rows, engine, how, generator)
        if plan.waiting and not plan.busy():  # Scheduler.admissible makes this impossible
            raise RuntimeError("the engine admitted no group into an empty batch")
        retire(plan, rows, engine)  # one-token completions finish at their prefill
        if engine.paged:
            plan.grow(rows)
            if stats is not None:
                plan.tally()
        for _ in range(setup.sync_every if plan.busy() else 0):  # the model's steps, no host sync
            rows.advance(*engine.step(rows.tokens, rows.positions, plan.reach, rows.live, how,
                                      generator, rows.held()))
            plan.reach = min(plan.reach + 1, max_len)
            plan.counts["decode_steps"] += 1
        retire(plan, rows, engine)
    assert all(c is not None for c in plan.completions), "a request never finished"
    if stats is not None:
        kv = engine.cache[0]  # a block's bytes: k and v of every layer
        stats.update(plan.counts, blocks_taken=(len(engine.refs) - 1 - len(engine.free)
                                                if engine.paged else 0),
                     block_bytes=kv.element_size() * kv.numel() // engine.cache_shape[1]
                     * len(engine.cache), graphs=len(engine.graphs or {}), engine=id(engine))
    return plan.completions, plan.logps
