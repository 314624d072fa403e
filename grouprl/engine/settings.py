"""The engine's settings and the models it covers. The settings are this module's constants, read
at call time as settings.NAME by every file of the package, so that a test or a benchmark sets
one here (`settings.PAGE = 8`) and the whole engine sees it. What the engine covers: runs (for
common.generate and modeling.check_engine), unsupported, tensor_parallel_fits. Where and how one
rollout's engine runs (its slots, device, precision, ranks, paths): Setup, passed whole."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from ..distributed import fail

ARCHITECTURES = ("qwen3", "qwen2", "llama")  # config.model_type values forward.py covers
SYNC_EVERY = 8  # decoding steps between two looks from the host at which rows have finished
PAGE = 16  # positions a block of a paged KV cache holds under SDPA (as vLLM's default)
# CUDA graphs of the decoding step are captured per read length, rounded up to a multiple of this
# (the mask keeps the positions past each row's own out): at most max_len / GRAPH_REACH graphs
GRAPH_REACH = 256
# paged, a group's n rows share the physical blocks of its prompt (Engine.share); False: each row
# holds its own copy (the count that sharing is measured against)
SHARE_PROMPTS = True
# episodes (turns.py): a row's next turn prefills only the tokens its kept KV cache lacks; False:
# the whole history again (as HF generate does each turn), the count the kept cache is measured
# against
KEEP_TURNS = True
# episodes: rows a later turn's prefill computes at once (each gathers its row's cached keys and
# values for attention, a copy of up to max_len positions a layer)
EXTEND_ROWS = 16
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
_FALLBACK_SAID = []  # the one line saying why HF generate runs in the engine's place, said once


@dataclass(frozen=True)
class Setup:
    """Where and how the engine runs (nano-vllm's Config); what it draws is the Sampling.
    graphs, flex, compile and fuse: None is auto (resolve)."""
    slots: int  # rows decoded at once (never more than a rollout's rows: generate)
    device: object  # torch.device or its name
    dtype: torch.dtype  # the weights' copies and the KV cache
    rank: int = 0  # this rank among `world` (tensor parallel: its share of the heads)
    world: int = 1  # ranks the layers split over (1: no tensor parallelism)
    pool_tokens: int | None = None  # a paged KV cache's positions; None: kv_plan decides
    graphs: bool | None = None  # decoding step through Engine.step's graphs; None: GPU, 1 rank
    flex: bool | None = None  # attention through FlexAttention's block mask; None: on a GPU
    compile: bool | None = None  # each decoding layer compiled; None: where graphs are on a GPU
    fuse: bool | None = None  # q/k/v and gate/up fused into one copy each; None: off the CPU
    sync_every: int = SYNC_EVERY  # decoding steps between two looks from the host at the rows
    keep: bool = False  # the Engine kept for the next call (HELD): one Engine per run

    def resolve(self) -> Setup:
        """graphs, compile, flex and fuse decided where None (the rules in generate's docstring)."""
        cuda = torch.device(self.device).type == "cuda"
        graphs = cuda and self.world == 1 if self.graphs is None else self.graphs
        compile = graphs and cuda if self.compile is None else self.compile
        flex = cuda if self.flex is None else self.flex
        fuse = torch.device(self.device).type != "cpu" if self.fuse is None else self.fuse
        return replace(self, graphs=graphs, compile=compile, flex=flex, fuse=fuse)


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


def tensor_parallel_fits(config, world: int) -> str | None:
    """Why the engine's layers cannot split over `world` ranks (one line), or None if they can."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world or kv_heads % world or config.intermediate_size % world:
        return (f"{heads} attention heads, {kv_heads} KV heads and an MLP of "
                f"{config.intermediate_size} do not split evenly over {world} ranks")
    return None
