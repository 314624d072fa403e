"""The Engine: one rollout's decoder over a KV cache, its settings made once (weights, cache,
FlexAttention, compilation, CUDA graphs) and its decoding step as the rollout runs it, eager or
replayed as a CUDA graph (step, capture). Its parts: the cache and its block table
(kvcache.KVCache), the layers (forward.Forward), the sampler (sampler.Sampler)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import settings
from .forward import Forward, rms_norm
from .kvcache import KVCache
from .sampler import Sampler, compiled
from .settings import Setup
from .weights import take_weights

_flex = {}  # the flex_attention each device type runs: compiled on a GPU, eager on the CPU


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
    if settings.FLEX_OPTIONS is not None:
        return dict(settings.FLEX_OPTIONS)
    device = torch.device(device)
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return dict(settings.HOPPER_FLEX) if hopper else None


def raise_recompile_limit():
    """Past dynamo's recompile limit (8) a compiled function runs eager, slowly: the engine's
    compilations are one per model shape, slot count and read length."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 64))


class Engine(KVCache, Forward, Sampler):
    """One rollout's decoder over a KV cache of setup.slots rows, each up to `max_len` tokens, made
    as `setup` says (settings.Setup: where, in which precision, which paths; None there is auto as
    generate decides it, so that an Engine made here is the one generate makes): the cache, whole or
    paged, and its block table (KVCache), the layers (Forward) and the sampler (Sampler), made here
    once with the weights, FlexAttention, compilation and CUDA graphs; and the decoding step as the
    rollout runs it (step, capture)."""

    def __init__(self, lm, setup: Setup, max_len: int):
        from transformers.activations import ACT2FN

        setup = setup.resolve()  # graphs, flex, compile, fuse: None decided (Setup.resolve)
        slots, device, dtype, world = setup.slots, setup.device, setup.dtype, setup.world
        graphs, flex, compile = setup.graphs, setup.flex, setup.compile
        cfg = lm.config
        self.cfg, self.slots, self.max_len, self.world = cfg, slots, max_len, world
        self.setup = setup
        # this rank's heads: all of them, or 1/world of them under tensor parallelism
        self.heads = cfg.num_attention_heads // world
        self.kv_heads = cfg.num_key_value_heads // world
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.act = cfg.rms_norm_eps, ACT2FN[cfg.hidden_act]
        self.inter = cfg.intermediate_size // world  # this rank's MLP width
        # fused q/k/v and gate/up on a GPU (fewer, larger kernels); on the CPU a matmul's cost is
        # its bytes whatever the split, and the copy is not (~0.2 s a rollout at 135M parameters):
        # setup.fuse None
        self.taken = dict(max_len=max_len, device=device, dtype=dtype, rank=setup.rank,
                          world=world, fuse=setup.fuse)  # for refresh
        self.w = take_weights(lm, **self.taken)
        # decoding attends through FlexAttention's block mask (each row's live blocks), by default
        # on a GPU, where it is compiled; else (the CPU, where eager flex_attention computes every
        # score and is ~40x slower) SDPA with a mask over the whole read length: setup.flex None
        self.init_cache(slots, max_len, device, dtype, setup.pool_tokens, flex,
                        len(self.w.layers))
        # graphs (step): the decoding step of each read length, over inputs at fixed addresses;
        # compiled, the step takes that path too (a read length is a compilation), without a
        # CUDA graph when graphs is off
        self.graphs = {} if graphs or compile else None
        self.flex = flex_attention(device) if flex else None
        self.flex_options = flex_options(device) if flex else None
        if flex and compile:  # inside the compiled layer: the function itself, which inductor
            from torch.nn.attention.flex_attention import flex_attention as plain  # compiles with
            self.flex = plain  # the layer (not a compiled function called from a compiled one)
            if (settings.FLEX_APART or settings.FLEX_APART is None and self.paged
                    and torch.device(device).type == "cpu"):
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
        self.sampler = compiled(compile, device)
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
        reach = min(-(-reach // settings.GRAPH_REACH) * settings.GRAPH_REACH, self.max_len)
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
