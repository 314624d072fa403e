"""The rollout engine (--gen-mode engine): sampling G completions per prompt in plain PyTorch, with
a KV cache allocated once, each prompt prefilled once for its group, and finished rows replaced by
waiting ones while decoding (continuous batching). Called by common.generate; HF `generate` (the
other --gen-mode values) stays the reference it is tested against.

The model is read, not wrapped: its weights are taken once per rollout into plain tensors (under
FSDP2 each parameter's full tensor, gathered in turn), so decoding runs no collective and ranks that
finish early wait at the next collective the loop already has. The forward covers the Qwen3 / Qwen2
/ Llama family (RMSNorm, q/k-norm when present, the model's own rotary embedding so that
rope_scaling stays exact, SwiGLU, grouped KV heads read without copies, tied or untied head). On
a GPU the decoding step is replayed as CUDA graphs (Engine.step), one per rounded read length, each
layer compiled by inductor into ~9 kernels (benchmarks/kernels.py), and attends through
FlexAttention, each live row reading only its own blocks of the KV cache and dead slots none
(Engine.live_blocks).

The files, each read alone, in the order a rollout meets them:
    settings.py   the engine's settings (PAGE, FLEX_BLOCK, GRAPH_REACH, SHARE_PROMPTS, ...), the
                  models it covers (runs, unsupported, tensor_parallel_fits), and Setup: where
                  and how one rollout's engine runs (slots, device, dtype, ranks, paths)
    rollout.py    generate(lm, prompts, n, eos, sampling, setup), the entry point: the Engine
                  made or kept (HELD, release), the loop
    blocks.py     the KV cache's size in blocks and bytes, and its plan (page_size, group_blocks,
                  memory_needed, kv_plan)
    weights.py    the policy's weights as plain tensors (Weights, take_weights, weight, full)
    runner.py     the Engine: its set-up, and the decoding step eager or as CUDA graphs (step,
                  capture); FlexAttention's compiled function and kernel options
    kvcache.py    the Engine's KV cache and block table (KVCache: take, share, give, where, read,
                  live_blocks, mask_mod)
    forward.py    the Engine's layers (Forward: layer, prefill, decode, hidden, attend)
    sampler.py    the Engine's sampler (Sampler.draw over sampling.sample)
    scheduler.py  continuous batching: the slots' state (Rows), admission and preemption
                  (Scheduler), admit and retire
    turns.py      episodes (--tools): each row's KV cache kept across its turns, the next turn
                  prefilling only the tool turn's tokens (Episodes; begin, of, end)
The names below are re-exported for `engine.<name>`. A setting is read from engine.settings at
call time: set it there (`settings.PAGE = 8`); assigning engine.PAGE reaches nothing.
"""

from . import turns
from .blocks import group_blocks, kv_plan, memory_needed, page_size, prompt_blocks
from .rollout import HELD, generate
from .runner import Engine, flex_options
from .sampler import sample
from .scheduler import Rows
from .settings import (FLEX_APART, FLEX_BLOCK, FLEX_OPTIONS, GRAPH_REACH, HOPPER_FLEX,
                       KEEP_TURNS, PAGE, SHARE_PROMPTS, SYNC_EVERY, Setup, runs, unsupported)
from .weights import take_weights, weight

__all__ = ["FLEX_APART", "FLEX_BLOCK", "FLEX_OPTIONS", "GRAPH_REACH", "HELD", "HOPPER_FLEX",
           "KEEP_TURNS", "PAGE", "SHARE_PROMPTS", "SYNC_EVERY", "Engine", "Rows", "Setup",
           "flex_options", "generate", "group_blocks", "kv_plan", "memory_needed", "page_size",
           "prompt_blocks", "runs", "sample", "take_weights", "turns", "unsupported", "weight"]
