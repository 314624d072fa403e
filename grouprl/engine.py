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
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .distributed import check_host_memory, fail
from .sampling import sample  # HF's penalty, temperature, top-k, top-p, min-p: on the device

ARCHITECTURES = ("qwen3", "qwen2", "llama")  # config.model_type values the forward below covers
SYNC_EVERY = 8  # decoding steps between two looks from the host at which rows have finished
PAGE = 16  # positions a block of a paged KV cache holds under SDPA (as vLLM's default)
# CUDA graphs of the decoding step are captured per read length, rounded up to a multiple of this
# (the mask keeps the positions past each row's own out): at most max_len / GRAPH_REACH graphs
GRAPH_REACH = 256
# paged, a group's n rows share the physical blocks of its prompt (Engine.share); False: each row
# holds its own copy (the count that sharing is measured against)
SHARE_PROMPTS = True
# FlexAttention's blocks of keys: a decoding step reads, for each row, only the blocks of this many
# positions that hold its live ones (its length rounded up), not the whole read length; paged, the
# pool's blocks are this size too, so that the block mask's indices are the physical blocks
FLEX_BLOCK = 128
# kernel options of FlexAttention's decoding kernel (BLOCK_N, num_warps, num_stages, SPLIT_KV; torch's
# torch/_inductor/kernel/flex/flex_decoding.py). None: by the GPU, HOPPER_FLEX on Hopper (sm_90),
# inductor's defaults elsewhere (unmeasured); a dict: exactly those (benchmarks/gpu.py --flex-options)
FLEX_OPTIONS: dict | None = None
# on Hopper: inductor's default with 4 pipeline stages, not 3, which hide more of the KV reads (measured
# against the default on an H200: benchmarks/README.md, "One GPU call")
HOPPER_FLEX = {"BLOCK_N": 64, "num_stages": 4, "num_warps": 2}
# with the layer compiled: whether flex_attention is compiled apart, the layer's graph broken around it
# (True), or inside the layer's graph, its q/k norms and RoPE fused into its kernel (False). None: apart
# where paged on the CPU only (inside the layer there inductor gets it wrong); on a GPU inside (the
# variant apart: benchmarks/gpu.py's engine-flexapart, unmeasured)
FLEX_APART: bool | None = None
_flex = {}  # the flex_attention each device type runs: compiled on a GPU, eager on the CPU
HELD = weakref.WeakKeyDictionary()  # generate(keep=True): the model -> its kept Engine


def flex_attention(device):
    """torch's flex_attention for a device type: on a GPU compiled (its fused kernel skips the
    blocks a block mask leaves out; a changed read length recompiles once, then shapes are
    dynamic); on the CPU eager, the same semantics (it computes every score, then masks: for
    tests)."""
    kind = torch.device(device).type
    if kind not in _flex:
        import warnings

        from torch.nn.attention import flex_attention as fa

        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        if kind == "cuda":  # every model, group size and first/second read length is a
            raise_recompile_limit()  # compile of its own
        _flex[kind] = torch.compile(fa.flex_attention) if kind == "cuda" else fa.flex_attention
    return _flex[kind]


def flex_options(device) -> dict | None:
    """The decoding kernel's options on this device (FLEX_OPTIONS)."""
    if FLEX_OPTIONS is not None:
        return dict(FLEX_OPTIONS)
    device = torch.device(device)
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return dict(HOPPER_FLEX) if hopper else None


def release(lm):
    """Drops lm's kept Engine (HELD) and frees its memory now. An Engine is a reference cycle (its
    compiled layer holds its bound method, its graphs' closures hold it), which only the cycle
    collector frees: on an H200, 39.5 GB were still allocated after the drop, 1.3 GB after
    gc.collect(); without it the next Engine's plan finds that memory taken."""
    import gc

    if HELD.pop(lm, None) is not None:
        gc.collect()


def page_size(flex: bool) -> int:
    """Positions a block of a paged KV cache holds: FlexAttention's key block where decoding attends
    through it (the block mask then lists each row's physical blocks: the pool read in place), else
    PAGE (SDPA reads a copy of each row's blocks)."""
    return FLEX_BLOCK if flex else PAGE


def raise_recompile_limit():
    """Past dynamo's recompile limit (8) a compiled function runs eager, slowly: the engine's
    compilations are one per model shape, slot count and read length."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 64))


_FALLBACK_SAID = []  # the one line saying why HF generate runs in the engine's place, said once


def runs(config, world: int = 1, main: bool = True) -> bool:
    """Whether the engine decodes a model of this config, its layers split over `world` ranks
    (--gen-mode engine-tp; 1: engine): False for an architecture it does not cover, said in one
    line, once, from the main process (HF generate, shared-prefill, runs in its place); heads that
    do not split over the ranks fail in one line."""
    why = unsupported(config)
    if why:
        if not _FALLBACK_SAID:
            _FALLBACK_SAID.append(why)
            if main:
                print(f"--gen-mode engine does not cover {why}: generating with HF generate "
                      "(shared-prefill) instead", file=sys.stderr)
        return False
    if world > 1 and (why := tensor_parallel_fits(config, world)):
        fail(f"--gen-mode engine-tp: {why}; use --gen-mode engine, or a number of processes that "
             "divides them")
    return True


def unsupported(config) -> str | None:
    """Why the engine cannot run a model of this config (one line), or None if it can."""
    if config.model_type not in ARCHITECTURES:
        return f"model_type {config.model_type!r} (the engine covers {', '.join(ARCHITECTURES)})"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention"
                                                           for t in layer_types):
        return "sliding-window attention layers"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"rope type {rope.get('rope_type', rope.get('type'))!r}, which changes with length"
    if getattr(config, "hidden_act", "silu") not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        return f"hidden_act {config.hidden_act!r}"
    return None


# -------------------- weights: plain tensors taken from the policy once per rollout
@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[dict]  # per layer: ln1, ln2, qkv (weight, bias), o, q_norm, k_norm, gate_up, down
    norm: torch.Tensor
    head: torch.Tensor  # the LM head's weight (the embedding itself when tied)
    cos: torch.Tensor  # [max_len, head_dim] rotary tables from the model's own rotary embedding
    sin: torch.Tensor


def full(p: torch.Tensor | None, device, dtype, dim: int = 0, rank: int = 0,
         world: int = 1) -> torch.Tensor | None:
    """A parameter as one plain tensor on `device` in `dtype`: under FSDP2 its full tensor (an
    all-gather every rank runs in the same order; with --cpu-offload the shard is moved to the GPU
    first); with world > 1, this rank's part of it along `dim` (tensor parallel). Unsharded, on the
    same device and dtype and whole, the parameter itself (no copy; nothing writes to it)."""
    if p is None:
        return None
    t = p.to(device).full_tensor() if hasattr(p, "full_tensor") else p
    t = t.detach().to(device=device, dtype=dtype)
    return t.chunk(world, dim)[rank].contiguous() if world > 1 else t


def weight(lin, device, dtype, dim: int = 0, rank: int = 0, world: int = 1) -> torch.Tensor:
    """A linear layer's weight as `full` gives it; a peft LoRA layer's (--lora-rank) merged with its
    active adapters, W + scale B A, computed in fp32 from the full tensors, then cast to dtype."""
    if not hasattr(lin, "lora_A") or lin.disable_adapters or lin.merged:
        return full(lin.weight, device, dtype, dim, rank, world)
    w = full(lin.base_layer.weight, device, torch.float32)
    for name in lin.active_adapters:
        w = w + lin.scaling[name] * (full(lin.lora_B[name].weight, device, torch.float32)
                                     @ full(lin.lora_A[name].weight, device, torch.float32))
    return full(w, device, dtype, dim, rank, world)


def take_weights(lm, max_len: int, device, dtype, rank: int = 0, world: int = 1,
                 fuse: bool = True, into: Weights | None = None) -> Weights:
    """The decoder's weights, q/k/v and gate/up each fused into one matrix (one matmul each; fuse
    False, as on the CPU: kept apart, a list of (weight, bias), read in place with no copy). Tensor
    parallel over `world` ranks: this rank's heads of q/k/v and its columns of gate/up (split along
    their outputs), the matching inputs of o and down (their outputs summed over the ranks, biases
    added once after), everything else whole. into: an earlier take's Weights, whose copies take
    the model's values now in place (copy_, a layer at a time: their addresses, which the CUDA
    graphs replay, stay; weights read in place need nothing) -> into itself."""
    model = lm.get_decoder()
    tp = dict(rank=rank, world=world)
    layers = []
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv = [weight(lin, device, dtype, 0, **tp) for lin in (a.q_proj, a.k_proj, a.v_proj)]
        qkv_bias = [full(lin.bias, device, dtype, 0, **tp)
                    for lin in (a.q_proj, a.k_proj, a.v_proj)]
        gate_up = [weight(lin, device, dtype, 0, **tp) for lin in (m.gate_proj, m.up_proj)]
        gate_up_bias = [full(lin.bias, device, dtype, 0, **tp) for lin in (m.gate_proj, m.up_proj)]
        layers.append({
            "ln1": full(layer.input_layernorm.weight, device, dtype),
            "ln2": full(layer.post_attention_layernorm.weight, device, dtype),
            "qkv": fused(qkv, qkv_bias, fuse),
            "o": (weight(a.o_proj, device, dtype, 1, **tp),
                  full(a.o_proj.bias, device, dtype)),
            "q_norm": full(getattr(getattr(a, "q_norm", None), "weight", None), device, dtype),
            "k_norm": full(getattr(getattr(a, "k_norm", None), "weight", None), device, dtype),
            "gate_up": fused(gate_up, gate_up_bias, fuse),
            "down": (weight(m.down_proj, device, dtype, 1, **tp),
                     full(m.down_proj.bias, device, dtype)),
        })
        if into is not None:
            refill(into.layers[i], layers.pop())
    embed = full(model.embed_tokens.weight, device, dtype)
    head = lm.get_output_embeddings().weight
    tied = head is lm.get_input_embeddings().weight
    if into is not None:  # the rotary tables depend on the config alone
        refill([into.embed, into.norm], [embed, full(model.norm.weight, device, dtype)])
        if not tied:
            refill(into.head, full(head, device, dtype))
        return into
    # the model's own rotary embedding over every position a row can reach (rope_scaling included)
    positions = torch.arange(max_len, device=device)[None]
    cos, sin = model.rotary_emb(torch.empty(0, device=device, dtype=dtype), positions)
    return Weights(embed, layers, full(model.norm.weight, device, dtype),
                   embed if tied else full(head, device, dtype), cos[0], sin[0])


def refill(old, new):
    """old's tensors (nested in dicts, lists, tuples) take new's values in place, where they are
    copies (a tensor read in place from the model is already the model's)."""
    if isinstance(old, dict):
        old, new = list(old.values()), list(new.values())
    if isinstance(old, (list, tuple)):
        for o, n in zip(old, new):
            refill(o, n)
    elif old is not None and old.data_ptr() != new.data_ptr():
        old.copy_(new)


def fused(weights: list, biases: list, fuse: bool):
    """Linear layers that read one input: (weight, bias) stacked along the outputs (a copy, one
    matmul), or with fuse False a list of each's (weight, bias) as they are (no copy)."""
    if not fuse:
        return list(zip(weights, biases))
    return torch.cat(weights), None if biases[0] is None else torch.cat(biases)


def project(x, w, sizes: list[int]) -> list:
    """x through `fused`'s layers -> each layer's output (sizes: their widths)."""
    if isinstance(w, list):
        return [F.linear(x, *p) for p in w]
    return F.linear(x, *w).split(sizes, -1)


def tensor_parallel_fits(config, world: int) -> str | None:
    """Why the engine's layers cannot split over `world` ranks (one line), or None if they can."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world or kv_heads % world or config.intermediate_size % world:
        return (f"{heads} attention heads, {kv_heads} KV heads and an MLP of "
                f"{config.intermediate_size} do not split evenly over {world} ranks")
    return None


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
    return length // page if SHARE_PROMPTS else 0


def group_blocks(prompt: int, positions: int, n: int, page: int) -> int:
    """Paged: the blocks n rows of `positions` positions take, the prompt's full blocks once."""
    shared = prompt_blocks(prompt, page)
    return shared + n * (-(-positions // page) - shared)


def kv_plan(lm, slots: int, max_len: int, n: int, device, dtype, world: int = 1,
            page: int = PAGE, prompt: int = 0) -> int | None:
    """The KV cache a rollout gets on a GPU: None (whole: every slot max_len positions) when that
    and the weight copy fit 90% of the free memory (the driver's free and the allocator's cached);
    else the positions a paged pool can hold in 90% of what the weights leave; MemoryError (one
    line) when that is less than one group of n rows at max_len (in blocks of `page`, the full
    blocks of its prompt, at least `prompt` positions long, shared: group_blocks). On the CPU
    always whole, and a MemoryError (one line) when that and the weight copy exceed 90% of the host
    memory available (distributed.check_host_memory)."""
    kv, weights = memory_needed(lm, slots, max_len, dtype, world, device)
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


# -------------------- the forward: Qwen3 / Qwen2 / Llama decoder layers
def rms_norm(x, weight, eps: float):
    """As the models' RMSNorm: normalised in float32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    """Rotary embedding, HF's convention (two halves): x [.., heads, L, d], cos/sin [.., L, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class Engine:
    """One rollout's decoder over a KV cache of `slots` rows, each up to `max_len` tokens.

    The cache is addressed in blocks of positions through a table [slots, blocks a row]. Whole
    (pool_tokens None): every row owns one block of max_len positions for the whole rollout, so
    attention reads the cache as a view. Paged (a pool of pool_tokens positions, in blocks of
    page_size(flex)): rows take blocks from a shared pool as they grow (take/give, on the host), so
    that rows that finish early leave room for more rows: the pool holds fewer positions than slots
    x max_len. FlexAttention reads a row's blocks where they lie (its block mask lists their
    physical indices, live_blocks); SDPA reads a copy of them (one gather a layer and step)."""

    def __init__(self, lm, slots: int, max_len: int, device, dtype, rank: int = 0, world: int = 1,
                 pool_tokens: int | None = None, graphs: bool = False, flex: bool | None = None,
                 compile: bool = False, fuse: bool | None = None):
        from transformers.activations import ACT2FN

        cfg = lm.config
        self.cfg, self.slots, self.max_len, self.world = cfg, slots, max_len, world
        # this rank's heads: all of them, or 1/world of them under tensor parallelism
        self.heads = cfg.num_attention_heads // world
        self.kv_heads = cfg.num_key_value_heads // world
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.act = cfg.rms_norm_eps, ACT2FN[cfg.hidden_act]
        self.inter = cfg.intermediate_size // world  # this rank's MLP width
        # fused q/k/v and gate/up on a GPU (fewer, larger kernels); on the CPU a matmul's cost is
        # its bytes whatever the split, and the copy is not (~0.2 s a rollout at 135M parameters)
        if fuse is None:
            fuse = torch.device(device).type != "cpu"
        self.w = take_weights(lm, max_len, device, dtype, rank, world, fuse)
        self.taken = dict(max_len=max_len, device=device, dtype=dtype, rank=rank, world=world,
                          fuse=fuse)  # for refresh
        # decoding attends through FlexAttention's block mask (each row's live blocks), by default
        # on a GPU, where it is compiled; else (the CPU, where eager flex_attention computes every
        # score and is ~40x slower) SDPA with a mask over the whole read length
        if flex is None:
            flex = torch.device(device).type == "cuda"
        self.paged = pool_tokens is not None
        self.block = page_size(flex) if self.paged else max_len
        self.flex_block = self.block if self.paged else FLEX_BLOCK  # the block mask's key blocks
        pool_blocks = pool_tokens // self.block if self.paged else 0
        per_row = -(-max_len // self.block)  # blocks a row of max_len positions spans
        blocks = pool_blocks + 1 if self.paged else slots  # paged: + a block nobody owns (spare)
        # per layer [k/v, blocks, positions in a block, kv heads, head_dim]; zeros, not empty: a
        # masked position still multiplies its value by 0, and 0 x NaN is NaN
        # (a tensor a layer, each at offset 0: a compiled layer is the same code for every layer),
        # flat, [k/v x blocks x positions x heads, head_dim], written in place by index_copy_ on
        # the tensor itself (through a view, inductor's functional copy rewrote the whole cache)
        self.cache_shape = (2, blocks, self.block, self.kv_heads, self.head_dim)
        self.values_at = blocks * self.block * self.kv_heads  # the first row of the values
        self.cache = [torch.zeros(2 * self.values_at, self.head_dim, device=device, dtype=dtype)
                      for _ in self.w.layers]
        # each row's blocks; paged, unowned entries point at the spare block, where free slots and
        # rows waiting for a block write what nobody reads
        self.spare = blocks - 1
        self.table = (torch.full((slots, per_row), self.spare, device=device) if self.paged else
                      torch.arange(slots, device=device)[:, None])
        self.owned = [[] for _ in range(slots)]  # paged: each slot's blocks, on the host
        self.free = list(range(pool_blocks))
        # paged, a group's prompt stored once: its full blocks are in all n rows' tables (share),
        # each block counted by the rows that hold it (refs) and freed when the last gives it back
        self.refs = [0] * blocks
        self.borrowed = [0] * slots  # the leading blocks each slot shares with its group's first
        # paged: each physical block's place in the row that owns it, per slot (-1: not the
        # slot's), for FlexAttention's mask_mod, which sees physical positions
        self.logical = (torch.full((slots, blocks), -1, device=device) if self.paged else None)
        # graphs (step): the decoding step of each read length, over inputs at fixed addresses;
        # compiled, the step takes that path too (a read length is a compilation), without a
        # CUDA graph when graphs is off
        self.graphs = {} if graphs or compile else None
        self.flex = flex_attention(device) if flex else None
        self.flex_options = flex_options(device) if flex else None
        if flex and compile:  # inside the compiled layer: the function itself, which inductor
            from torch.nn.attention.flex_attention import flex_attention as plain  # compiles with
            self.flex = plain  # the layer (not a compiled function called from a compiled one)
            if FLEX_APART or FLEX_APART is None and self.paged and torch.device(device).type == "cpu":
                # except paged on the CPU (FLEX_APART): there inductor's lowering of flex inside the
                # layer's graph gives logits ~3 off (torch 2.13; the same graph under aot_eager agrees
                # exactly), and flex compiled on its own agrees to 1e-6. So the layer's graph breaks
                # around a call of flex compiled apart (disable() given the compiled function itself
                # would unwrap it and run flex eagerly)
                apart = torch.compile(plain, dynamic=False)
                self.flex = torch.compiler.disable(lambda *a, **k: apart(*a, **k))
        # tokens, positions, whether each slot decodes a live row (1) or not (0: free, finished),
        # and (min_new_tokens) whether its row's EOS is held back this step (1: fewer tokens made)
        self.static = torch.zeros(4, slots, dtype=torch.long, device=device)
        self.static_positions = self.static[1]
        # --repetition-penalty: [slots, vocab] bool, the ids each slot's row has read (its prompt,
        # set at its prefill; each token it reads, set in the step), made by the first call that
        # asks for a penalty (see_ids), at a fixed address for the graphs
        self.seen = None
        # min_new_tokens: [vocab] bool, the EOS ids (hold_eos), at a fixed address for the graphs
        self.eos_ids = None
        # live_blocks' mask_mod over the step's positions: one function object, so that a compiled
        # step sees the same one
        self.static_mask_mod = self.mask_mod(self.static_positions)
        # compile: each decoder layer of the decoding step compiled by inductor (torch.compile,
        # default mode, static shapes), so that the norms with their residual adds, RoPE, the KV
        # write and SiLU x up each run as one fused kernel (benchmarks/kernels.py counts them);
        # one compilation serves every layer (same shapes, the layer's weights and cache passed
        # in) and every step of a read length
        if compile:
            raise_recompile_limit()
        self.decode_layer = torch.compile(self.layer, dynamic=False) if compile else self.layer
        # the sampler compiled with the layers on a GPU (its passes over [slots, V] fused); None:
        # sampling.sample as it is (eager, the CPU's default: the same function tests run)
        self.sampler = (torch.compile(sample, dynamic=False)
                        if compile and torch.device(device).type == "cuda" else None)
        self.pool = (torch.cuda.graph_pool_handle()
                     if graphs and torch.device(device).type == "cuda" else None)

    def refresh(self, lm):
        """The model's weights now (after an optimizer step) into the engine's copies, in place:
        one Engine serves every rollout of a run, its cache, compilations and graphs made once."""
        take_weights(lm, **self.taken, into=self.w)

    def see_ids(self):
        """The repetition penalty's [slots, vocab] buffer, made once (zeros: nothing read yet)."""
        if self.seen is None:
            self.seen = torch.zeros(self.slots, self.w.head.shape[0], dtype=torch.bool,
                                    device=self.static.device)

    def hold_eos(self, eos: list[int]):
        """min_new_tokens: this rollout's EOS ids into the [vocab] buffer the step masks with (made
        once; a kept Engine's graphs read it at the same address)."""
        if self.eos_ids is None:
            self.eos_ids = torch.zeros(self.w.head.shape[0], dtype=torch.bool,
                                       device=self.static.device)
        self.eos_ids.zero_()[torch.tensor(eos, device=self.eos_ids.device)] = True

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def take(self, s: int, blocks: int) -> bool:
        """Paged: slot s holds `blocks` blocks (its first positions) after this, or False if the
        pool is short (nothing taken)."""
        need = blocks - len(self.owned[s])
        if need > len(self.free):
            return False
        if need > 0:
            new = [self.free.pop() for _ in range(need)]
            for b in new:
                self.refs[b] = 1
            self.place(s, new)
        return True

    def share(self, s: int, src: int, blocks: int):
        """Paged: slot s (holding none) takes slot src's first `blocks` blocks into its table, the
        same physical blocks (a group's full prompt blocks, which src's prefill writes once; s
        writes from its next block on, its own)."""
        shared = self.owned[src][:blocks]
        for b in shared:
            self.refs[b] += 1
        self.borrowed[s] = len(shared)
        self.place(s, shared)

    def place(self, s: int, new: list[int]):
        """Blocks `new` appended to slot s's row: its host list, block table and logical table."""
        at = len(self.owned[s])
        self.owned[s] += new
        new = torch.tensor(new, device=self.table.device, dtype=torch.long)
        self.table[s, at:at + len(new)] = new
        self.logical[s, new] = torch.arange(at, at + len(new), device=new.device)

    def give(self, s: int):
        """Paged: slot s's blocks back to the pool, each once no other row holds it."""
        if self.paged:
            for b in self.owned[s]:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.free.append(b)
            self.owned[s], self.borrowed[s] = [], 0
            self.table[s] = self.spare
            self.logical[s] = -1

    def where(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's keys (or values) viewed as [-1, head_dim] for slots [N] at positions
        [N] -> [N, kv heads], through the block table."""
        blk = self.table[slots, positions // self.block]
        heads = torch.arange(self.kv_heads, device=slots.device)
        return ((blk * self.block + positions % self.block)[:, None]) * self.kv_heads + heads

    def read(self, c: torch.Tensor, table: torch.Tensor, reach: int) -> torch.Tensor:
        """A layer's keys (or values) c [blocks, block, kv heads, d] of every slot at positions <
        reach (rounded up to a block) -> [slots, kv heads, positions, head_dim]: whole, a view;
        paged, a gather through the block table (SDPA's path; FlexAttention's reads the pool in
        place: [1, kv heads, every position of the pool, head_dim], a view)."""
        if self.paged and self.flex is not None:
            return c.flatten(0, 1)[None].transpose(1, 2)
        if self.paged:  # [slots, blocks, block, heads, d] -> [slots, positions, heads, d]
            c = c[table[:, :self.blocks_for(reach)]].flatten(1, 2)
        return c[:, :reach].transpose(1, 2)

    def layers(self, h, positions, attend):
        """The decoder layers over h [B, L, D] at positions [B, L]; attend(i, q, k, v) -> [B, H, L,
        d] writes layer i's keys and values to the cache and attends."""
        cos, sin = self.w.cos[positions][:, None], self.w.sin[positions][:, None]  # [B, 1, L, d]
        mlp_out = torch.zeros_like(h)
        for i, w in enumerate(self.w.layers):
            h, mlp_out = self.layer(h, mlp_out, w, cos, sin, attend, i)
        return h + mlp_out

    def layer(self, h, mlp_out, w: dict, cos, sin, attend, *args):
        """One decoder layer: h [B, L, D] and the previous layer's MLP output (added here, first,
        so that a compiled step fuses the residual add with this layer's norm) -> (h, this
        layer's MLP output). attend(q, k, v, *args) -> [B, H, L, d] writes the keys and values
        to the cache and attends."""
        B, L, _ = h.shape
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = h + mlp_out
        q, k, v = project(rms_norm(h, w["ln1"], self.eps), w["qkv"], [nq, nk, nk])
        q = q.view(B, L, self.heads, self.head_dim)
        k = k.view(B, L, self.kv_heads, self.head_dim)
        if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head's dimensions
            q, k = rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, *args).transpose(1, 2).reshape(B, L, nq)
        h = h + self.row_parallel(out, *w["o"])
        gate, up = project(rms_norm(h, w["ln2"], self.eps), w["gate_up"], [self.inter] * 2)
        return h, self.row_parallel(self.act(gate) * up, *w["down"])

    def row_parallel(self, x, weight, bias):
        """x @ weight.T; under tensor parallelism each rank holds some of the inputs, so the outputs
        are summed over the ranks (one all-reduce) and the bias added once, after."""
        if self.world == 1:
            return F.linear(x, weight, bias)
        y = F.linear(x, weight)
        torch.distributed.all_reduce(y)
        return y if bias is None else y + bias

    def logits(self, h):
        """[N, D] last hidden states -> [N, V] float32 logits, as HF's generate takes them."""
        return F.linear(rms_norm(h, self.w.norm, self.eps), self.w.head).float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, n: int) -> torch.Tensor:
        """Prompts (token ids) computed once each, their keys and values copied to their n slots
        each (slots [len(prompts) x n], a prompt's adjacent; a slot's blocks shared with an earlier
        one, Engine.share, are written once, by that one); -> logits at each prompt's last token,
        [len(prompts), V]."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.table.device)
        P = int(lengths.max())
        ids = torch.zeros(len(prompts), P, dtype=torch.long, device=self.table.device)
        for b, p in enumerate(prompts):  # right-padded: position t is the prompt's t-th token
            ids[b, :len(p)] = torch.tensor(p, device=ids.device)
        positions = torch.arange(P, device=ids.device).expand(len(prompts), P)

        # where the prompts' keys and values go: every slot of a prompt gets them (not the padding),
        # but for the positions a slot's shared blocks hold (written by its group's first slot)
        borrowed = torch.tensor([self.borrowed[s] * self.block if self.paged else 0
                                 for s in slots.tolist()], device=ids.device)
        valid = ((positions < lengths[:, None]).repeat_interleave(n, 0)  # [slots, P]
                 & (positions[:1] >= borrowed[:, None]))
        at = self.where(slots[:, None].expand(-1, P)[valid],
                        positions.repeat_interleave(n, 0)[valid]).flatten()

        def attend(q, k, v, i):
            for kv, x in enumerate((k, v)):  # [prompts, kv heads, P, d] -> rows of the cache
                x = x.transpose(1, 2).repeat_interleave(n, 0)[valid].flatten(0, 1)
                self.cache[i].index_copy_(0, at + kv * self.values_at, x)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                  scale=self.head_dim ** -0.5)

        h = self.layers(F.embedding(ids, self.w.embed), positions, attend)
        if self.seen is not None:  # the penalty's ids: a new row has read its prompt's, no other
            vocab = self.seen.shape[1]  # (the padding as id `vocab`, a column dropped)
            seen = torch.zeros(len(prompts), vocab + 1, dtype=torch.bool, device=ids.device)
            seen.scatter_(1, ids.masked_fill(positions >= lengths[:, None], vocab), True)
            self.seen[slots] = seen[:, :vocab].repeat_interleave(n, 0)
        return self.logits(h[torch.arange(len(prompts)), lengths - 1])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, reach: int,
               alive: torch.Tensor | None = None) -> torch.Tensor:
        """One token for every slot: tokens, positions [slots] -> logits [slots, V]."""
        return self.logits(self.hidden(tokens, positions, reach, alive))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, reach: int,
             alive: torch.Tensor | None, how: tuple, generator=None,
             held: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step as the rollout runs it, sampled: -> (tokens [slots], their log-probs
        [slots]) drawn by sampling.sample with how = (temperature, top_k, top_p, min_p,
        repetition_penalty) from `generator`
        (None: torch's global stream); held [slots] bool (min_new_tokens, None: off): the rows whose
        EOS ids are masked (draw). Eager, or (graphs) the captured step of `reach` rounded up
        to GRAPH_REACH, run on copies of tokens and positions at fixed addresses: the layers, the
        LM head and the sampler (its noise drawn inside, from the same stream) in one replay, no
        host sync."""
        if self.graphs is None:
            return self.draw(self.logits(self.hidden(tokens, positions, reach, alive)), how,
                             generator, tokens, held)
        reach = min(-(-reach // GRAPH_REACH) * GRAPH_REACH, self.max_len)
        if self.flex is not None:  # the block mask reads each row's own blocks whatever the read
            reach = self.max_len  # length: one graph, one compilation
        self.static[0].copy_(tokens)
        self.static[1].copy_(positions)
        self.static[2].fill_(1) if alive is None else self.static[2].copy_(alive)
        if held is not None:
            self.static[3].copy_(held)
        # a graph replays one sampler and one random stream, with the EOS mask or without
        key = (reach, how, generator, held is not None)
        if key not in self.graphs:
            self.graphs[key] = self.capture(reach, how, generator, held is not None)
        return self.graphs[key]()

    def draw(self, logits: torch.Tensor, how: tuple, generator=None, read=None, held=None):
        """sampling.sample over the slots' logits [slots, V] (bf16 on a GPU: the sampler reads them
        once, in float32 inside its kernels); compiled with the layers on a GPU, where its passes
        over [N, V] fuse (its Exp(1) noise drawn eagerly from `generator`, graph-safe). read
        [slots]: the tokens the step fed, marked seen first when how has a repetition penalty.
        held [slots] (min_new_tokens): HF's MinNewTokensLengthLogitsProcessor, which runs after the
        penalty and before the temperature: the EOS ids' logits -inf in those rows, so that the
        token and its log-prob are the masked distribution's (the penalty leaves -inf as it is)."""
        if held is not None:
            logits = logits.masked_fill(held[:, None].bool() & self.eos_ids, float("-inf"))
        seen = None
        if how[4] != 1:  # HF penalises the ids in input_ids: the prompt and every token read
            seen = self.seen.scatter_(1, read[:, None], True)
        if self.sampler is None:
            return sample(logits, *how, seen=seen, generator=generator)
        if how[0] == 0:  # greedy: no noise
            return self.sampler(logits, *how, seen=seen)
        noise = torch.empty(logits.shape, device=logits.device).exponential_(generator=generator)
        return self.sampler(logits, *how, seen=seen, noise=noise)

    def capture(self, reach: int, how: tuple, generator=None, hold: bool = False):
        """The decoding step at read length `reach` over self.static, sampled -> a function that
        runs it and returns (tokens [slots], log-probs [slots]). On a GPU a CUDA graph: a step's
        kernels (~9 a layer compiled, ~55 eager, the LM head and the sampler) launched as one
        replay (HF generate spends ~1.3 ms of Python and launches a layer and token). Its first
        run (which compiles, when the engine compiles) is on a side stream, as capture requires,
        and writes the same keys and values the replay then writes again (and draws noise once
        more: the stream moves on); the graphs of every read length share one memory pool (one
        runs at a time, and only their outputs outlive a run). A generator other than the global
        one is registered with the graph, so each replay draws fresh noise from it. Elsewhere
        (the CPU) the step itself, eager: the same inputs, rounding and outputs, so that tests
        cover everything but the capture. hold: the EOS mask of static[3] (min_new_tokens)."""
        def run():
            h = self.hidden(self.static[0], self.static_positions, reach, self.static[2])
            logits = F.linear(rms_norm(h, self.w.norm, self.eps), self.w.head)
            return self.draw(logits, how, generator, self.static[0],
                             self.static[3] if hold else None)

        if self.pool is None:
            return run
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()

        def replay():
            graph.replay()
            return out
        return replay

    def live_blocks(self, positions: torch.Tensor, reach: int, alive: torch.Tensor | None = None):
        """FlexAttention's block mask of a decoding step: slot s's queries (its `group` query heads
        of each KV head, hidden's grouped view) read its key blocks 0 .. positions[s] // block
        (block: self.flex_block): the blocks before the last in full, and within the last the
        positions up to its own (the mask_mod, evaluated there only). Whole, its blocks of the
        `reach` positions read; paged, the blocks its row of the table names, indices into the
        whole pool (read in place: page and key block are one size). Built from tensors alone (no
        host sync, shapes set by `reach`): a CUDA graph captures it with the step. The blocks past
        a row's length are never read: a row's cost is its own length, not the longest row's; and a
        slot that `alive` [slots] marks 0 (free, or its row finished) reads no block at all (issue
        34: ~65% of a long rollout's slot-steps)."""
        from torch.nn.attention.flex_attention import BlockMask

        block = self.flex_block
        blocks = -(-reach // block)
        last = (positions // block).clamp(max=blocks - 1)  # the block that holds the row's position
        full, partial = last, torch.ones_like(last)  # blocks 0 .. last - 1: every key visible
        if alive is not None:  # free slots and finished rows read no block at all (their output: 0)
            full, partial = full * alive, partial * alive
        if self.paged:  # the physical blocks; keys: every position of the pool (the mask spans it:
            pool = self.cache_shape[1]  # its indices padded to the pool's count, as inductor asks)
            order = F.pad(self.table[:, :blocks], (0, pool - blocks), value=self.spare)
            keys = pool * block
        else:
            order = torch.arange(blocks, device=positions.device).expand(self.slots, blocks)
            keys = reach
        # the row's last block is the one the mask_mod cuts (positions past the row's own); the
        # full blocks before it are read without evaluating it (and inductor's CPU decoding
        # template, torch 2.13, builds paged only with full blocks given)
        at_last = order.gather(1, last[:, None]).expand_as(order)
        index = lambda x: x.to(torch.int32)[:, None, None]  # noqa: E731  [slots, 1, 1, ...]
        mask_mod = (self.static_mask_mod if positions is self.static_positions else
                    self.mask_mod(positions))
        group = self.heads // self.kv_heads
        return BlockMask.from_kv_blocks(index(partial), index(at_last), index(full), index(order),
                                        BLOCK_SIZE=(block, block), mask_mod=mask_mod,
                                        seq_lengths=(group, keys), compute_q_blocks=False)

    def mask_mod(self, positions: torch.Tensor):
        """FlexAttention's mask_mod of a decoding step: slot b's query sees key kv_idx iff its
        position is at most positions[b]. Whole, kv_idx is the position; paged, a place in the
        pool, whose block holds the row's positions logical[b, block] * block onward (-1: not
        the row's, never seen)."""
        if not self.paged:
            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= positions[b]
            return mask_mod
        logical, block = self.logical, self.block

        def paged_mask_mod(b, h, q_idx, kv_idx):
            at = logical[b, kv_idx // block]
            return (at >= 0) & (at * block + kv_idx % block <= positions[b])
        return paged_mask_mod

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, reach: int,
               alive: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last hidden state [slots, D] for one token of every slot (tokens,
        positions [slots]). Slot s attends to its positions 0..positions[s] and no further, of
        the cache read up to `reach` (> every position, known on the host without a sync):
        through FlexAttention's block mask, which reads each row's live blocks only
        (live_blocks), or with flex off through SDPA and a mask over all `reach` positions;
        grouped heads, no copies. No host sync and no shape that depends on the data: a CUDA graph
        can capture it (step). Each layer runs as self.decode_layer: compiled (one compilation
        serves every layer: same shapes, weights passed in) when the engine compiles."""
        if self.flex is None:
            live = (torch.arange(reach, device=tokens.device) <= positions[:, None])[:, None, None]
        else:
            live = self.live_blocks(positions, reach, alive)
        # where each slot's new key and value go: rows of a layer's (flat) keys
        # (index_copy_ along one dimension: an index_put over slots and positions copies far more)
        at = self.where(torch.arange(self.slots, device=tokens.device), positions).flatten()
        cos, sin = self.w.cos[positions][:, None, None], self.w.sin[positions][:, None, None]
        h = F.embedding(tokens[:, None], self.w.embed)
        mlp_out = torch.zeros_like(h)
        for w, cache in zip(self.w.layers, self.cache):
            h, mlp_out = self.decode_layer(h, mlp_out, w, cos, sin, self.attend, cache, self.table,
                                           at, live, reach)
        h = (h + mlp_out)[:, 0]
        if self.flex is not None and alive is not None:  # a dead slot's state, whatever its empty
            h = torch.where(alive[:, None].bool(), h, 0)  # attention gave: 0, never NaN logits
        return h

    def attend(self, q, k, v, cache, table, at, live, reach: int):
        """A decoding step's attention in one layer: the slots' new keys and values k, v [S, kv
        heads, 1, d] written to the layer's cache (at: hidden's rows), then q [S, H, 1, d] attends
        to each slot's positions (live: FlexAttention's block mask, or SDPA's mask over `reach`)."""
        cache.index_copy_(0, torch.cat((at, at + self.values_at)), torch.cat((k, v)).flatten(0, 2))
        keys, values = (self.read(c, table, reach) for c in cache.view(self.cache_shape))
        # grouped heads as queries of their KV head: head h reads KV head h // group (HF's
        # repeat_kv), so [S, H, 1, d] -> [S, kv heads, group, d] attends with no KV copy (and
        # FlexAttention sees one query head a KV head and `group` queries: its decoding kernel
        # serves any group size, where enable_gqa's wants a power of 2)
        grouped = q.view(self.slots, self.kv_heads, -1, self.head_dim)
        if self.flex is not None:
            out = self.flex(grouped, keys, values, block_mask=live, scale=self.head_dim ** -0.5,
                            kernel_options=self.flex_options)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=live,
                                                 scale=self.head_dim ** -0.5)
        # reshape, not view: a GPU's memory-efficient kernel returns [S, kv, group, d] laid out
        # as [S, group, kv, d], whose (kv, group) do not merge into one dimension in place
        return out.reshape(q.shape)


# -------------------- the scheduler: continuous batching over a fixed pool of slots
@torch.no_grad()
def generate(lm, prompts: list[list[int]], n: int, eos: list[int], *, max_new_tokens: int,
             temperature: float, top_k: int, top_p: float, slots: int, device, dtype,
             min_p: float = 0.0, repetition_penalty: float = 1.0, sync_every: int = SYNC_EVERY,
             stats: dict | None = None, rank: int = 0, world: int = 1,
             generator=None, pool_tokens: int | None = None, graphs: bool | None = None,
             flex: bool | None = None, compile: bool | None = None,
             keep: bool = False,
             min_new_tokens: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    """n completions of each prompt (token ids, no padding): rows prompt * n + j, a group's rows
    adjacent. A completion ends at its first EOS (kept) or after max_new_tokens; min_new_tokens
    (HF's): the EOS ids' logits are -inf for a row's tokens 0 .. min_new_tokens - 1, so none ends
    before (max_new_tokens still caps), and its log-probs are the masked softmax's. `slots` rows
    decode at once; a prompt is admitted (prefilled once, its KV copied to n free slots) whenever n
    slots are free, and the host looks at which rows have finished every `sync_every` steps.
    Returns the completions' token ids and the log-prob of each under the temperature-scaled
    softmax (of the logits repetition_penalty changed, if it is not 1: sampling.sample). `stats`,
    if given, gets the counts of decoding steps, prefills, prefills made while other rows were
    decoding (continuous batching at work), groups preempted, KV blocks still taken at the end,
    graphs captured, a block's bytes (k and v, every layer) and, paged, Scheduler.tally's peaks.
    pool_tokens: the KV cache's positions, paged (Engine) in blocks of page_size(flex); None: whole
    (slots x the longest prompt + max_new_tokens), or paged where that cannot fit the GPU (kv_plan).
    Paged, a group's rows share its prompt's full blocks (Engine.share, reference-counted, freed
    with the last row that holds them; SHARE_PROMPTS), and it is admitted only when the pool also
    holds its next sync_every positions beside those the running rows need; when running rows
    outgrow the pool the youngest group is preempted: its blocks freed, its prompt first in line
    again, its completions made anew.
    world > 1: tensor parallel, every rank running this call on the same prompts with its share of
    the heads (tensor_parallel_fits) and the same `generator`, so that every rank samples the same
    tokens.
    graphs: the decoding step through Engine.step's graphs, one per read length (CUDA graphs on a
    GPU; on the CPU the same path eager, for tests); None: on a GPU with one rank (tensor
    parallel decodes eagerly: its all-reduces are not captured).
    flex: decoding attends through FlexAttention's block mask, reading each row's live blocks only
    (Engine.live_blocks); None: on a GPU (compiled), not on the CPU (SDPA over the read length).
    compile: each layer of the decoding step compiled (Engine's compile: fused kernels, inside the
    CUDA graphs); None: where the graphs are on (a GPU, one rank). Not on the CPU by default: there
    inductor's C++ compilation (~40 s on 2 cores) costs more than it saves in a rollout's steps.
    keep: one Engine per run: the Engine is kept (HELD, per model) and the next call with the same
    settings and rows no longer than its own reuses it, its weight copies refreshed from the model
    in place (Engine.refresh), its KV cache, compilations and CUDA graphs made once; its cache
    then stays allocated between rollouts (the training step runs beside it). Otherwise each call
    makes its own."""
    if slots < n:
        raise ValueError(f"{slots} slots cannot hold a group of {n}")
    # never more slots than rows: a free slot still costs its share of every step (the LM head
    # over the vocabulary, the sampler, attention over the read length), so --gen-batch-size's
    # default of 256 slots for a rollout of 12 rows decoded 21x the rows it needed
    slots = min(slots, len(prompts) * n)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    shortest = min(len(p) for p in prompts)  # the fewest prompt blocks a group's rows share
    if graphs is None:
        graphs = torch.device(device).type == "cuda" and world == 1
    if compile is None:
        compile = graphs and torch.device(device).type == "cuda"
    if compile:  # the cache's length in steps of GRAPH_REACH: rollouts whose longest prompts differ
        max_len = -(-max_len // GRAPH_REACH) * GRAPH_REACH  # reuse one compilation (static shapes)
    if flex is None:
        flex = torch.device(device).type == "cuda"
    page = page_size(flex)  # paged, the pool's blocks
    key = (slots, str(device), dtype, rank, world, graphs, flex, compile, page, FLEX_BLOCK,
           pool_tokens, str(FLEX_OPTIONS))
    engine = HELD.get(lm) if keep else None
    if (engine is not None and engine.key == key and engine.max_len >= max_len
            and not any(engine.owned)):  # (a call that raised may leave blocks taken)
        engine.refresh(lm)  # the same cache, compilations and graphs; the weights of now
        max_len = engine.max_len
    else:
        engine = None
        if keep:  # an Engine of other settings: its cache freed before the plan
            release(lm)
        if pool_tokens is None:
            pool_tokens = kv_plan(lm, slots, max_len, n, device, dtype, world, page, shortest)
            # a pool planned from 90% of the free memory is not kept: the training step's peak
            # (AdamW's moments appear at its first step) would not fit beside it
            keep = keep and pool_tokens is None
        if (pool_tokens is not None
                and pool_tokens // page < group_blocks(shortest, max_len, n, page)):
            raise ValueError(f"a KV pool of {pool_tokens} positions cannot hold one group of {n} "
                             f"rows of up to {max_len} positions")
        engine = Engine(lm, slots, max_len, device, dtype, rank, world, pool_tokens,
                        graphs=graphs, flex=flex, compile=compile)
        engine.key = key
        if keep:
            HELD[lm] = engine
    # the sampler's settings (sampling.sample: HF's semantics)
    how = (temperature, top_k, top_p, min_p, repetition_penalty)
    if repetition_penalty != 1:
        engine.see_ids()
    if min_new_tokens:
        engine.hold_eos(eos)
    rows = Rows(slots, max_new_tokens, eos, device, min_new_tokens)
    plan = Scheduler(prompts, n, slots, sync_every, max_len, engine)
    while plan.busy() or plan.waiting:
        admit(plan, rows, engine, how, generator)
        if plan.waiting and not plan.busy():  # Scheduler.admissible makes this impossible
            raise RuntimeError("the engine admitted no group into an empty batch")
        retire(plan, rows, engine)  # one-token completions finish at their prefill
        if engine.paged:
            plan.grow(rows)
            if stats is not None:
                plan.tally()
        for _ in range(sync_every if plan.busy() else 0):  # the model's steps, no host sync
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


def admit(plan, rows, engine, how, generator):
    """The groups the slots and the pool hold now: prefilled once each (their KV copied to their
    n slots), their first tokens sampled."""
    k = plan.admissible()
    if k == 0:
        return
    batch, at = plan.admit(k)
    sel = torch.tensor(at, device=rows.tokens.device)
    logits = engine.prefill([plan.prompts[p] for p in batch], sel, plan.n)
    if rows.min_new_tokens:  # a row's first token: 0 made < min_new_tokens, EOS masked (draw)
        logits = logits.masked_fill(engine.eos_ids, float("-inf"))
    seen = None if engine.seen is None else engine.seen[sel]  # the prompts' ids (prefill)
    new, new_logp = sample(logits.repeat_interleave(plan.n, 0), *how, seen=seen,
                           generator=generator)
    lengths = [len(plan.prompts[p]) for p in batch]
    positions = torch.tensor(lengths, device=sel.device).repeat_interleave(plan.n)
    rows.start(sel, new, new_logp, positions)
    plan.reach = max(plan.reach, max(lengths) + 1)


def retire(plan, rows, engine):
    """The host's look: which rows finished (one sync), their tokens and log-probs (one more,
    when any did), their slots and blocks freed."""
    going, plan.made[:] = torch.stack((rows.live.long(), rows.count)).tolist()  # the host sync
    done = [s for s in range(plan.slots) if plan.row_of[s] >= 0 and not going[s]]
    if done:
        for s, (tokens, logp) in zip(done, rows.finish(done, plan.made)):
            plan.done(s, tokens, logp)
            engine.give(s)
    plan.settle()


class Rows:
    """The slots' state on the device: each slot's last token, its position, the tokens it made
    (count), whether it decodes a live row, and its completion so far (out, out_logp)."""

    def __init__(self, slots: int, max_new_tokens: int, eos: list[int], device,
                 min_new_tokens: int = 0):
        self.max_new_tokens, self.eos = max_new_tokens, torch.tensor(eos, device=device)
        self.min_new_tokens = min_new_tokens
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.count = torch.zeros(slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out = torch.zeros(slots, max_new_tokens, dtype=torch.long, device=device)
        self.out_logp = torch.zeros(slots, max_new_tokens, device=device)
        self.slot_rows = torch.arange(slots, device=device)

    def start(self, sel, new, new_logp, positions):
        """Slots sel begin rows: their first tokens (sampled after the prefill) at `positions`."""
        self.out[sel, 0], self.out_logp[sel, 0], self.count[sel] = new, new_logp, 1
        self.live[sel] = ~self.is_eos(new) & (self.max_new_tokens > 1)
        self.tokens[sel] = new
        self.positions[sel] = positions

    def advance(self, new, new_logp):
        """A decoding step's tokens into the live rows (finished rows and free slots stay)."""
        at = self.count.clamp(max=self.max_new_tokens - 1)  # finished rows write nowhere new
        live, rows = self.live, self.slot_rows
        self.out[rows, at] = torch.where(live, new, self.out[rows, at])
        self.out_logp[rows, at] = torch.where(live, new_logp, self.out_logp[rows, at])
        self.count += live.long()
        self.tokens = torch.where(live, new, self.tokens)
        self.positions += live.long()
        self.live &= ~self.is_eos(new) & (self.count < self.max_new_tokens)

    def held(self) -> torch.Tensor | None:
        """min_new_tokens: the slots whose next token is one of their first min_new_tokens (count,
        the tokens made, restarts with the row: a preempted group's rows begin again at start),
        whose EOS the step masks, so that no row stops on EOS before; None when off (no mask, no
        cost)."""
        return self.count < self.min_new_tokens if self.min_new_tokens else None

    def is_eos(self, new):
        """Whether each token is an EOS id: every pair compared ([slots, EOS ids], a few kernels).
        Not torch.isin: past ~10 elements it sorts and takes torch.unique of both sides, whose
        data-dependent sizes make the host wait for the GPU at every step (on an H200 its sort and
        unique kernels ran 1,025 and 2,052 times in a 1,024-step rollout that was 25% idle)."""
        return (new[:, None] == self.eos).any(1)

    def finish(self, done: list[int], made: list[int]):
        """Finished slots' completions -> [(token ids, log-probs)] (one copy to the host), their
        positions back to 0."""
        at = torch.tensor(done, device=self.out.device)
        # both in one copy: token ids and fp32 log-probs are exact in float64
        rows = torch.cat((self.out[at].double(), self.out_logp[at].double()), 1).tolist()
        self.positions[at] = 0
        T = self.max_new_tokens
        return [([int(t) for t in row[:made[s]]], row[T:T + made[s]]) for s, row in zip(done, rows)]

    def stop(self, s: int):
        self.positions[s] = 0
        self.live[s] = False


class Scheduler:
    """Continuous batching on the host: which row each slot decodes, which prompts wait and which
    run (oldest first), admission (whole groups, only what the slots and the KV pool hold),
    preemption (paged: the youngest group out when running rows outgrow the pool), and the
    completions as rows finish. It reads the Engine's block bookkeeping (take/give/free/owned)."""

    def __init__(self, prompts, n: int, slots: int, sync_every: int, max_len: int, engine):
        self.prompts, self.n, self.slots, self.engine = prompts, n, slots, engine
        self.sync_every, self.max_len = sync_every, max_len
        self.row_of = [-1] * slots  # the row each slot decodes (host side), -1: free
        self.made = [0] * slots  # the tokens each slot has made, as of the host's last look
        self.waiting = deque(range(len(prompts)))
        self.running = []  # prompts with rows decoding, oldest first
        self.completions = [None] * (len(prompts) * n)
        self.logps = [None] * (len(prompts) * n)
        self.reach = 0  # one more than any slot's position, an upper bound between syncs
        self.counts = {"decode_steps": 0, "prefills": 0, "prefills_while_decoding": 0,
                       "preempted": 0, "kv_blocks_peak": 0, "kv_row_blocks_peak": 0,
                       "kv_read_peak": 0, "kv_read_physical_peak": 0}

    def busy(self) -> bool:
        return any(r >= 0 for r in self.row_of)

    def blocks_ahead(self, s: int) -> int:
        """Paged: the blocks slot s needs to write its next sync_every positions."""
        return self.engine.blocks_for(min(len(self.prompts[self.row_of[s] // self.n])
                                          + self.made[s] - 1 + self.sync_every, self.max_len))

    def admissible(self) -> int:
        """How many waiting groups the free slots hold (paged: and the pool, beside what the
        running rows need next)."""
        free = sum(r < 0 for r in self.row_of)
        k = min(free // self.n, len(self.waiting))
        if self.engine.paged:
            left = len(self.engine.free) - sum(self.blocks_ahead(s) - len(self.engine.owned[s])
                                               for s in range(self.slots) if self.row_of[s] >= 0)
            for j in range(k):  # n rows' blocks, the prompt's full blocks once (Engine.share)
                length = len(self.prompts[self.waiting[j]])
                left -= group_blocks(length, min(length + self.sync_every, self.max_len),
                                     self.n, self.engine.block)
                if left < 0:
                    return j
        return k

    def admit(self, k: int):
        """k waiting groups into free slots (paged: with their blocks) -> (prompts, slots)."""
        free = [s for s in range(self.slots) if self.row_of[s] < 0]
        batch = [self.waiting.popleft() for _ in range(k)]
        self.running.extend(batch)
        self.counts["prefills"] += 1
        self.counts["prefills_while_decoding"] += self.busy()
        for j, s in enumerate(free[:k * self.n]):
            p = batch[j // self.n]
            self.row_of[s], self.made[s] = p * self.n + j % self.n, 1
            if self.engine.paged and j % self.n:  # the group's prompt blocks, its first row's
                self.engine.share(s, free[j - j % self.n],
                                  prompt_blocks(len(self.prompts[p]), self.engine.block))
            if self.engine.paged and not self.engine.take(s, self.blocks_ahead(s)):
                raise RuntimeError("admitted beyond the KV pool")  # admissible() counted them
        return batch, free[:k * self.n]

    def done(self, s: int, tokens: list[int], logp: list[float]):
        self.completions[self.row_of[s]], self.logps[self.row_of[s]] = tokens, logp
        self.row_of[s] = -1

    def settle(self):
        """After a look: the prompts still running, and the read length (one more than any
        slot's position: a row's is its prompt's length + its tokens - 1; free slots sit at 0)."""
        rows = [r for r in self.row_of if r >= 0]
        self.running[:] = [p for p in self.running if any(r // self.n == p for r in rows)]
        self.reach = 1 + max((len(self.prompts[self.row_of[s] // self.n]) + self.made[s] - 1
                              for s in range(self.slots) if self.row_of[s] >= 0), default=0)

    def preempt(self, p: int, rows: Rows):
        """Paged: prompt p's rows out of their slots, its blocks freed, p first in line again."""
        for s in range(self.slots):
            if self.row_of[s] >= 0 and self.row_of[s] // self.n == p:
                self.row_of[s] = -1
                rows.stop(s)
                self.engine.give(s)
        for row in range(p * self.n, p * self.n + self.n):  # finished rows are made anew too
            self.completions[row] = self.logps[row] = None
        self.running.remove(p)
        self.waiting.appendleft(p)
        self.counts["preempted"] += 1

    def tally(self):
        """Paged (stats): the most KV blocks taken at a look, physical (from the pool) and summed
        over the rows (each row's table: what rows without shared prompts take), and read by the
        step after it, by each live row (the blocks attention asks for) and distinct (physical)."""
        e, rows = self.engine, [s for s in range(self.slots) if self.row_of[s] >= 0]
        read = [e.owned[s][:e.blocks_for(len(self.prompts[self.row_of[s] // self.n])
                                         + self.made[s])] for s in rows]
        now = {"kv_blocks_peak": len(e.refs) - 1 - len(e.free),
               "kv_row_blocks_peak": sum(len(e.owned[s]) for s in rows),
               "kv_read_peak": sum(map(len, read)),
               "kv_read_physical_peak": len(set().union(*read))}
        for k, v in now.items():
            self.counts[k] = max(self.counts[k], v)

    def grow(self, rows: Rows):
        """Paged: every running row's blocks for its next sync_every positions, oldest first,
        preempting the youngest groups while the pool is short."""
        for p in list(self.running):
            for s in range(self.slots):
                while (p in self.running and self.row_of[s] >= 0 and self.row_of[s] // self.n == p
                       and not self.engine.take(s, self.blocks_ahead(s))):
                    self.preempt(self.running[-1], rows)
