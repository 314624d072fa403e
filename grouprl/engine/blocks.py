"""The KV cache's size and its blocks: positions a block holds (page_size), the blocks a group's
rows take with their prompt's full blocks shared (prompt_blocks, group_blocks), the bytes the
engine allocates (memory_needed) and the plan that fits them to the memory free (kv_plan: whole,
paged, or one line saying it cannot)."""

from __future__ import annotations

import torch

from ..distributed import check_host_memory
from . import settings
from .settings import Setup


def page_size(flex: bool) -> int:
    """Positions a block of a paged KV cache holds: FlexAttention's key block where decoding attends
    through it (the block mask then lists each row's physical blocks: the pool read in place), else
    PAGE (SDPA reads a copy of each row's blocks)."""
    return settings.FLEX_BLOCK if flex else settings.PAGE


def memory_needed(lm, slots: int, max_len: int, dtype, world: int = 1, device="cuda",
                  fuse: bool | None = None) -> tuple[int, int]:
    """Bytes the engine allocates on `device`: (the KV cache of `slots` rows of `max_len` positions,
    the weights take_weights copies). Copied: q/k/v and gate/up when fused (fuse None: on a GPU),
    and every weight that `full` cannot read in place (sharded, in another dtype or on another
    device, split over tensor-parallel ranks, a LoRA layer merged), and the rotary tables; the rest
    (a plain model already in `dtype` on `device`) is read where it is."""
    cfg, size = lm.config, torch.empty(0, dtype=dtype).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads // world * max_len * head_dim
    device = torch.device(device)
    if fuse is None:
        fuse = device.type != "cpu"

    def moved(p):  # full() makes a copy of p
        return (hasattr(p, "full_tensor") or p.dtype != dtype or p.device.type != device.type
                or device.index is not None and p.device.index != device.index)

    def merged(lin):  # weight() adds a LoRA layer's adapters into a copy
        return hasattr(lin, "lora_A") and not lin.disable_adapters and not lin.merged

    copied = 2 * max_len * head_dim  # cos and sin
    model = lm.get_decoder()
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin, split_rows in ((a.q_proj, 1), (a.k_proj, 1), (a.v_proj, 1), (m.gate_proj, 1),
                                (m.up_proj, 1), (a.o_proj, 0), (m.down_proj, 0)):
            # q/k/v, gate/up: fused (a copy), or split along their rows (a view); o and down:
            # split along their columns (a copy) under tensor parallelism
            w = lin.base_layer.weight if hasattr(lin, "base_layer") else lin.weight
            copy = (fuse if split_rows else world > 1) or merged(lin) or moved(w)
            copied += w.numel() // world * copy
            if lin.bias is not None:  # q/k/v's and gate/up's split with them, o's and down's whole
                b = lin.bias
                copied += (b.numel() // world * (fuse or moved(b)) if split_rows else
                           b.numel() * moved(b))
        norms = (layer.input_layernorm, layer.post_attention_layernorm,
                 getattr(a, "q_norm", None), getattr(a, "k_norm", None))
        copied += sum(n.weight.numel() * moved(n.weight) for n in norms if n is not None)
    head = lm.get_output_embeddings().weight
    rest = [model.embed_tokens.weight, model.norm.weight]
    rest += [] if head is lm.get_input_embeddings().weight else [head]
    copied += sum(p.numel() * moved(p) for p in rest)
    return kv * size, copied * size


def prompt_blocks(length: int, page: int) -> int:
    """Paged: the blocks a group's rows share, its prompt's full ones (the last, partly filled
    block is each row's own: every row writes its first token there; 0 with SHARE_PROMPTS off)."""
    return length // page if settings.SHARE_PROMPTS else 0


def group_blocks(prompt: int, positions: int, n: int, page: int) -> int:
    """Paged: the blocks n rows of `positions` positions take, the prompt's full blocks once."""
    shared = prompt_blocks(prompt, page)
    return shared + n * (-(-positions // page) - shared)


def kv_plan(lm, setup: Setup, max_len: int, n: int, page: int = settings.PAGE,
            prompt: int = 0) -> int | None:
    """The KV cache a rollout of setup.slots rows (on setup.device, setup.dtype, over setup.world
    ranks) gets on a GPU: None (whole: every slot max_len positions) when that and the weight copy
    fit 90% of the free memory (the driver's free and the allocator's cached); else the positions a
    paged pool can hold in 90% of what the weights leave; MemoryError (one line) when that is less
    than one group of n rows at max_len (in blocks of `page`, the full blocks of its prompt, at
    least `prompt` positions long, shared: group_blocks). On the CPU always whole, and a MemoryError
    (one line) when that and the weight copy exceed 90% of the host memory available
    (distributed.check_host_memory)."""
    slots, device = setup.slots, setup.device
    kv, weights = memory_needed(lm, slots, max_len, setup.dtype, setup.world, device, setup.fuse)
    if torch.device(device).type != "cuda":  # host memory: checked alike, before any allocation
        return check_host_memory({f"the KV cache of {slots} rows x {max_len} positions": kv,
                                  "the weight copy": weights})
    # free: what the driver has free and what torch's allocator holds without using it (the last
    # rollout's cache, training's activations: reserved, not allocated), which the engine's
    # allocations reuse; from the driver's number alone, the second RL step would find the first
    # step's cache taken and go paged (or fail)
    free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    if kv + weights <= 0.9 * free:  # the rest: prefill activations, logits, sampling, graphs
        return None
    pool = int((0.9 * free - weights) / (kv / (slots * max_len)))
    if pool // page >= group_blocks(prompt, max_len, n, page):
        return pool
    gib = 2 ** 30
    raise MemoryError(
        f"the KV cache of {slots} rows x {max_len} positions ({kv / gib:.1f} GiB) and the weight "
        f"copy ({weights / gib:.1f} GiB) exceed 90% of the {free / gib:.1f} GiB free on the GPU, "
        f"and a paged cache in what is left holds {max(pool, 0)} positions, less than one group "
        f"of {n} x {max_len}")
