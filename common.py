"""What every algorithm script shares, in the order a script's loop uses it; the training loop
itself lives in each script. Sections:
  distributed set-up   torchrun, ranks, seeds, collectives, one-line errors
  the model            tokenizer, weights (the built-in `tiny` model too), Policy, chunked
                       log-probs, FSDP2
  generation           HF `generate`: repeat, shared-prefill, static
  tasks                prompts and reference answers (built-in, hub sets, local .jsonl)
  rewards              the math grader (math-verify in worker processes), --reward, scoring a
                       rollout
  group advantages     A_i and the mechanism metrics (Asym, shared-token coefficient)
  data order           prompts a step, minibatches of whole groups, micro-batches
  the optimizer step   learning-rate schedule, finite checks, statistics over ranks
then the plumbing: held-out evaluation, logging, checkpoints and exact resume, graceful stop,
argument checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


# -------------------- distributed set-up: torchrun, ranks, seeds, collectives, errors
def fail(msg: str):
    """Stop with one line on stderr that says what was wrong and what to do (no traceback). Under
    torchrun every rank exits with code 1 and rank 0 alone prints the line: a check that can fail
    runs on every rank with the same answer (or on rank 0, which broadcasts it: on_rank0), so the
    line is printed once and no rank is left waiting. Once the process group exists the process
    leaves with os._exit, as cleanup() does, for the same reason."""
    main = int(os.environ.get("RANK", "0")) == 0
    if dist.is_initialized():
        if main:
            print(f"error: {msg}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    raise SystemExit(f"error: {msg}" if main else 1)


class Refused(Exception):
    """A one-line error that rank 0 alone can see (its files): on_rank0 stops every rank with it."""


def on_rank0(fn, d):
    """fn() on rank 0 alone, its result given to every rank; a Refused raised there stops every rank
    with its line."""
    out = [None, None]
    if d.main:
        try:
            out = [fn(), None]
        except Refused as e:
            out = [None, str(e)]
    if d.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        fail(out[1])
    return out[0]


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device  # this process's GPU (LOCAL_RANK under torchrun), else the CPU
    # FSDP2: every run launched by torchrun, one process included (fp32 master weights)
    sharded: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """Started by torchrun (or any env:// launcher, which sets RANK): the run is sharded with FSDP2,
    one process included. setup_distributed and the argument checks both ask this, so they cannot
    disagree."""
    return "RANK" in os.environ


def setup_distributed(seed: int) -> Dist:
    """Read torchrun's environment (plain `python x.py` is world size 1, unsharded); NCCL on CUDA,
    gloo on CPU. Under torchrun the process group exists even for one process, so that FSDP2 (fp32
    master weights, --cpu-offload, --gen-unshard) serves one GPU as it serves eight."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched() and not dist.is_initialized():
        backend, dev = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:  # launched by something other than torchrun: plain env:// rendezvous
            dist.init_process_group(backend, device_id=dev)
        else:  # torchrun keeps its TCP store across --max-restarts attempts; without a prefix per
            # attempt a restarted job reads the dead attempt's addresses and cannot connect
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                timeout=dist.constants.default_pg_timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                                    rank=rank, world_size=world, device_id=dev)
    seed_everything(seed)  # same seed on every rank while the model is built; see seed_rank()
    return Dist(rank, world, device, sharded=dist.is_initialized())


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, d: Dist):
    """Per-rank seed for sampling, after the (identical) model init on every rank."""
    seed_everything(seed + 1_000_003 * d.rank)


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or op) over ranks, returned on t's device; the collective runs where the backend needs
    it (NCCL: GPU)."""
    if not dist.is_initialized():
        return t
    x = t.to(_device())
    dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x.to(t.device)


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from all ranks along dim 0, on t's device."""
    if not dist.is_initialized():
        return t
    x = t.to(_device()).contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out).to(t.device)


def _device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.is_initialized() and \
        dist.get_backend() == "nccl" else torch.device("cpu")


def barrier():
    if dist.is_initialized():
        dist.barrier()


def cleanup():
    """The end of a torchrun process: every rank done with every collective, the group destroyed,
    then the process leaves without the interpreter's exit-time destructors. Under torch 2.13 +
    gloo, process-group objects that the FSDP2 model still references are destroyed there and
    sometimes abort ("terminate called without an active exception", about 1 run in 60 on 2 busy
    cores) after all the work is done and saved. World size 1: nothing but letting go of the run
    folder's lock."""
    release_run_dir()
    release_stop_signals()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# -------------------- the model: tokenizer, weights, Policy, chunked log-probs, FSDP2
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (= EOS)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A real HF fast tokenizer over characters (printable ASCII and newline), Qwen-style
    specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars + ["<|unk|>"])}
    # no merges: one token a char
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(TINY_SPECIALS + ["<|unk|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|unk|>",
        chat_template=TINY_CHAT_TEMPLATE, padding_side="left",
    )


def tiny_model(tok):
    """A randomly initialised Qwen3-architecture model sized for CPU (tied embeddings, as small
    Qwen3s)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    lm = Qwen3ForCausalLM(cfg)
    lm.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                            pad_token_id=tok.pad_token_id)
    return lm


def check_model(name: str, trust_remote_code: bool):
    """Fail fast, before any weights are read: 'tiny', a local folder with a config, or a hub id."""
    if name == "tiny":
        return
    looks_local = name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        fail(f"--model {name!r}: no such folder (give 'tiny', a local model folder, or a hub id "
             "like Qwen/Qwen3-0.6B)")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(os.path.expanduser(name), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"--model {name!r}: cannot read its config ({first})")


def load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = tiny_tokenizer() if name == "tiny" else AutoTokenizer.from_pretrained(
        os.path.expanduser(name), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"  # prompts are left-padded for generation
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def compute_dtype(dtype: str, d: Dist) -> torch.dtype:
    """--dtype: auto is bf16 on GPU, fp32 on CPU."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        dtype, torch.bfloat16 if d.device.type == "cuda" else torch.float32)


def load_model(name: str, tok, d: Dist, seed: int, trust_remote_code: bool = False,
               dtype: str = "auto"):
    """One process: the model on its device in the compute dtype. Under torchrun: fp32 master
    weights (FSDP2 casts them to the compute dtype, wrap_policy) built on the meta device on every
    rank, while rank 0 alone reads the weights into CPU memory; wrap_policy shards the model and
    sends each rank its shards. A node thus holds one full copy on CPU, not one per rank, and no GPU
    ever holds the whole fp32 model.
    Returns (model, rank0_weights): rank0_weights is rank 0's (state dict, buffers) for wrap_policy
    to scatter under FSDP2, None otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    # `tiny` is random-init: the same seed gives the same weights (policy and reference)
    seed_everything(seed)
    path = os.path.expanduser(name)

    def build(dt):
        if name == "tiny":
            return tiny_model(tok).to(dt)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dt,
                                                    trust_remote_code=trust_remote_code)

    rank0_weights = None
    if not d.sharded:
        lm = build(compute_dtype(dtype, d)).to(d.device)
    else:
        with torch.device("meta"):
            lm = tiny_model(tok) if name == "tiny" else AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                dtype=torch.float32, trust_remote_code=trust_remote_code)
        if name != "tiny":
            # EOS ids as from_pretrained reads them (the file, else the config)
            with contextlib.suppress(OSError):
                lm.generation_config = GenerationConfig.from_pretrained(path)
        src = build(torch.float32) if d.main else None
        # for wrap_policy
        rank0_weights = (src.state_dict(), dict(src.named_buffers())) if d.main else None
    lm.config.use_cache = True
    return lm, rank0_weights


def eos_ids(lm, tok) -> list[int]:
    """Every EOS id the generation config lists (Qwen3 instruct models end a turn with
    <|im_end|>)."""
    ids = lm.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


class Policy(torch.nn.Module):
    """The causal LM plus memory-bounded completion log-probs. Under FSDP2 this is the root unit, so
    its forward (and `generate`, registered below) gathers the root parameters (embeddings, norm, LM
    head)."""

    def __init__(self, lm, temperature: float = 1.0, chunk_tokens: int = 1024):
        super().__init__()
        self.lm, self.temperature, self.chunk_tokens = lm, temperature, chunk_tokens

    def generate(self, input_ids, attention_mask, n: int = 1, **kw):
        """HF `generate` for the prompts input_ids [B, P] (left-padded). n > 1: n completions of
        each prompt, rows of one prompt adjacent, with each prompt prefilled once: its KV cache over
        all its tokens but the last is computed for the B prompts and repeated n times, and
        `generate` starts from the last prompt token of each of the B x n rows, as if every prompt
        had been given n times. Under FSDP2 the root unit stays gathered for the whole call
        (register_fsdp_forward_method), the prefill included."""
        if n == 1:
            return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kw)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.config)
        prefix_mask = attention_mask[:, :-1]
        # as generate() does with left padding
        position_ids = (prefix_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.lm.get_decoder()(input_ids=input_ids[:, :-1], attention_mask=prefix_mask,
                              position_ids=position_ids, past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(n)  # [B, heads, P-1, d] -> [B n, heads, P-1, d]
        return self.lm.generate(input_ids=input_ids.repeat_interleave(n, 0),
                                attention_mask=attention_mask.repeat_interleave(n, 0),
                                past_key_values=cache, **kw)

    def forward(self, input_ids, attention_mask, n_prompt: int, entropy: bool = False):
        """log pi(y_t | x, y_<t) for the completion tokens input_ids[:, n_prompt:] -> [B, T] float32
        (and per-token entropy if asked). The LM head runs on chunks of tokens, each recomputed in
        the backward pass, so the extra memory is O(chunk x V), never O(B x T x V)."""
        # as generate() does with left padding
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        h = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, use_cache=False).last_hidden_state
        B, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
        h = h[:, n_prompt - 1:-1].reshape(B * T, -1)  # hidden state at t-1 predicts token t
        targets = input_ids[:, n_prompt:].reshape(B * T)
        head = self.lm.get_output_embeddings()
        out = chunked_logprobs(h, head.weight, head.bias, targets, self.temperature,
                               self.chunk_tokens, entropy)
        logp, ent = out if entropy else (out, None)
        logp = logp.view(B, T).clone()  # not a view: FSDP2 hooks the output for backward
        return (logp, ent.view(B, T)) if entropy else logp


def chunked_logprobs(h, weight, bias, targets, temperature: float = 1.0, chunk_tokens: int = 1024,
                     entropy: bool = False):
    """log softmax(z)[target] with z = (h W^T + b) / temperature (and the entropy of that softmax if
    asked) for N rows of hidden states h [N, H] -> [N] in float32 (float64 for a float64 model). The
    LM head runs on `chunk_tokens` rows at a time and each chunk's backward recomputes its logits,
    so the extra memory is O(chunk x V) instead of the O(N x V) of log_softmax(logits).gather(...),
    in training and no-grad passes alike."""
    logps, ents = [], []
    for i in range(0, h.shape[0], chunk_tokens):
        lp, ent = _ChunkLogprobs.apply(h[i:i + chunk_tokens], weight, bias,
                                       targets[i:i + chunk_tokens], temperature, entropy)
        logps.append(lp)
        ents.append(ent)
    return (torch.cat(logps), torch.cat(ents)) if entropy else torch.cat(logps)


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk. Forward keeps only logsumexp (and the entropy) per row; backward recomputes the
    logits and applies d logp_t / dz = onehot(target) - p and d H / dz = -p (log p + H), with p =
    softmax(z), in place on one buffer."""

    @staticmethod
    def _logits(h, weight, bias, temperature):
        z = F.linear(h, weight, bias)
        # bf16 -> fp32; fp64 stays
        return z.to(torch.promote_types(z.dtype, torch.float32)).div_(temperature)

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature: float, entropy: bool):
        z = _ChunkLogprobs._logits(h, weight, bias, temperature)
        lse = z.logsumexp(-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = None
        if entropy:  # H = -sum_v p log p, with log p = z - lse (z is not needed any more)
            logp_all = z.sub_(lse[:, None])
            ent = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(h, weight, bias, targets, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, targets, lse, ent = ctx.saved_tensors
        logp = _ChunkLogprobs._logits(h, weight, bias, ctx.temperature).sub_(lse[:, None])  # log p
        coef = (g_logp[:, None] if g_ent is None
                else g_logp[:, None] + g_ent[:, None] * (logp + ent[:, None]))
        grad_z = logp.exp_().mul_(coef).neg_()  # -p * (g_logp + g_ent (log p + H))
        # + onehot(target) * g_logp
        grad_z.scatter_add_(-1, targets[:, None], g_logp[:, None].to(grad_z.dtype))
        grad_z = grad_z.div_(ctx.temperature).to(h.dtype)
        grad_h = grad_z @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_z.T @ h if ctx.needs_input_grad[1] else None
        grad_b = grad_z.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def wrap_policy(lm, d: Dist, temperature: float, chunk_tokens: int, activation_checkpointing: bool,
                dtype: str = "auto", cpu_offload: bool = False, rank0_weights=None) -> Policy:
    """Plain `python`: the plain model. Under torchrun (one process too): FSDP2, `fully_shard` on
    each decoder layer, then the root (the tied embedding/LM head stay together in the root unit),
    with fp32 shards computed in `dtype` and gradients reduced in fp32 (MixedPrecisionPolicy); rank
    0's weights (load_model's rank0_weights) are then scattered to the shards."""
    if activation_checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # generation still uses the KV cache (checkpointing acts only in training)
        lm.config.use_cache = True
    policy = Policy(lm, temperature, chunk_tokens)
    if d.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard, register_fsdp_forward_method)

        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype(dtype, d),
                                                 reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        if d.main:
            print(f"FSDP2 over {d.world} process(es): {len(lm.get_decoder().layers)} decoder "
                  f"layers + the root, fp32 master weights computed in {compute_dtype(dtype, d)}"
                  + (", CPU offload" if cpu_offload else ""))
        # sum the gradients over ranks: each rank's loss is already divided by the minibatch's count
        # over all ranks (the loss's `norm`)
        for m in policy.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        register_fsdp_forward_method(policy, "generate")
        state, buffers = rank0_weights or ({}, {})
        # meta -> real (uninitialised) shards
        policy.to_empty(device="cpu" if cpu_offload else d.device)
        set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=True))
        # buffers (rotary inv_freq: outside the state dict) live on the GPU even with --cpu-offload,
        # and come from rank 0 too
        for mod in lm.modules():
            for n, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[n] = b.to(d.device)
        for n, b in lm.named_buffers():
            if d.main:
                b.copy_(buffers[n])
            dist.broadcast(b, src=0)
        del state, buffers
    return policy


# -------------------- generation
GEN_MODES = ("repeat", "shared-prefill", "static")


@torch.no_grad()
def generate(policy: Policy, tok, prompts: list[str], n: int, eos: list[int], d: Dist, *,
             max_new_tokens: int, temperature: float, top_p: float, top_k: int, gen_batch_size: int,
             unshard: bool = False, mode: str = "shared-prefill") -> dict:
    """n completions per prompt (rows of one prompt are adjacent: a group). Returns input_ids [B,
    P+T], attention_mask, n_prompt P, completion mask [B, T] (up to and including the first EOS),
    truncated [B].
    mode "repeat": each prompt repeated n times, so `generate` prefills it n times, gen_batch_size
    rows a call.
    mode "shared-prefill": each prompt prefilled once and its KV cache repeated to its n rows
    (Policy.generate), whole groups a call, max(1, gen_batch_size // n) prompts. mode "static": as
    repeat, with a KV cache allocated once for the whole call and written in place (no copy of the
    cache per token); on a GPU, with the model unsharded (plain `python`), transformers compiles the
    decoding step (torch.compile; recompiled only when the cache or batch grows); under FSDP2 it
    stays eager. Same tokens under greedy decoding (top_k=1)."""
    if mode not in GEN_MODES:
        raise ValueError(f"unknown generation mode {mode!r} ({', '.join(GEN_MODES)})")
    enc = tok(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.to(d.device), enc.attention_mask.to(d.device)
    shared = mode == "shared-prefill"
    # one-token prompts: a pad column, so that the prefilled prefix is not empty
    if shared and ids.shape[1] < 2:
        ids, am = F.pad(ids, (1, 0), value=tok.pad_token_id), F.pad(am, (1, 0), value=0)
    # prompts (shared) or rows (repeat) a call
    rows = max(1, gen_batch_size // n) if shared else gen_batch_size
    if not shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    static = (dict(cache_implementation="static", disable_compile=d.sharded) if mode == "static"
              else {})
    outs = []
    with gathered(policy, unshard):
        for i in range(0, ids.shape[0], rows):
            outs.append(policy.generate(
                input_ids=ids[i:i + rows], attention_mask=am[i:i + rows], n=n if shared else 1,
                do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                max_new_tokens=max_new_tokens, eos_token_id=eos,
                # FSDP: every rank steps until all are done
                pad_token_id=tok.pad_token_id, synced_gpus=d.sharded,
                **static,
            )[:, ids.shape[1]:])
    if shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    T = max(o.shape[1] for o in outs)
    comp = torch.cat([F.pad(o, (0, T - o.shape[1]), value=tok.pad_token_id) for o in outs])
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


# -------------------- tasks: prompts and reference answers
# name: (hub id, config, train split, held-out split, prompt column, answer column, instruction)
DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "train", "test", "question", "answer",
              "Solve the problem step by step and end with '#### <answer>'."),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", None, "problem", "answer",
                "Please reason step by step, and put your final answer within \\boxed{}."),
    "dapo17k": ("open-r1/DAPO-Math-17k-Processed", "en", "train", None, "prompt", "solution",
                # its prompts carry DAPO's own instruction ('The last line ... Answer: $Answer')
                ""),
}


def builtin_task(n: int, seed: int) -> list[dict]:
    """The built-in offline task (seeded, deterministic): 'x%10=' for a digit x, answer x. The
    answer is uniform over 0-9, so no constant answer scores above 0.1: the model has to read the
    digit, write it and stop. A random tiny model hits it about 2% of the time; RL alone takes it
    past 0.7 in a few hundred steps. With 10 distinct prompts the held-out split measures sampling
    accuracy, not generalisation."""
    rng = random.Random(seed)
    return [{"prompt": f"{x}%10=", "answer": str(x)} for x in (rng.randint(0, 9) for _ in range(n))]


def load_task(name: str, data_files: str | None, eval_size: int, seed: int, tok,
              enable_thinking: bool, max_prompt_tokens: int):
    """-> (train, held-out, dropped): `datasets.Dataset`s with columns prompt, answer and text (the
    prompt through the chat template), and the counts of rows dropped from both, {"no_answer": n,
    "too_long": m}. `name` is 'builtin', a known hub set (DATASETS), or a local .json/.jsonl file of
    {prompt, answer}. `data_files` reads local files laid out in a known hub set's own columns (an
    offline mirror). Rows without an answer, and prompts over max_prompt_tokens tokens after the
    chat template, are dropped and counted; nothing usable left is an error."""
    from datasets import Dataset, disable_progress_bars

    # the same one-line errors as check_common_args, for callers that skip it
    check_dataset(name, data_files)

    def templated(d):
        # for map/filter, after any download: the counts of what is dropped are printed
        disable_progress_bars()
        d = d.add_column("text", chat_prompts(tok, d["prompt"], enable_thinking))
        return d.filter(lambda b: [len(ids) <= max_prompt_tokens for ids in
                                   tok(b["text"], add_special_tokens=False).input_ids],
                        batched=True)

    def finish(train, held, no_answer):
        n = len(train) + len(held)
        train, held = templated(train), templated(held)
        dropped = {"no_answer": no_answer, "too_long": n - len(train) - len(held)}
        held = held.select(range(min(eval_size, len(held))))
        if len(train) == 0:
            fail(f"--dataset {name!r}: no usable rows (dropped {no_answer} without an answer, "
                 f"{dropped['too_long']} over --max-prompt-tokens {max_prompt_tokens})")
        return train, held, dropped

    if name == "builtin":
        return finish(Dataset.from_list(builtin_task(4096, seed)),
                      Dataset.from_list(builtin_task(eval_size, seed + 1)), 0)
    if name in DATASETS:
        hub, cfg, train_split, test_split, pcol, acol, instr = DATASETS[name]
        if data_files:
            hint = (f"--dataset {name} reads its own columns '{pcol}' and '{acol}' (a file of "
                    "'prompt' and 'answer' is given as --dataset path.jsonl)")
            ds = {"train": read_local("--data-files", data_files, pcol, acol, hint)}
            train_split, test_split = "train", None
        else:
            ds = load_hub(name, hub, cfg)
    else:  # a local .json/.jsonl file (check_dataset refused anything else)
        pcol, acol, instr = "prompt", "answer", ""
        ds = {"train": read_local("--dataset", name, pcol, acol,
                                  "a local file needs 'prompt' and 'answer'")}
        train_split, test_split = "train", None
    train = ds[train_split]
    missing = [c for c in (pcol, acol) if c not in train.column_names]
    if missing:
        fail(f"--dataset {name!r} has no column(s) {missing} (columns: {train.column_names}); a "
             "local file needs 'prompt' and 'answer'")

    def to_row(r):
        # chat-format prompts: last user turn
        p = r[pcol] if isinstance(r[pcol], str) else r[pcol][-1]["content"]
        a = str(r[acol]) if r[acol] is not None else ""
        a = a.split("####")[-1].strip() if "####" in a else a.strip()
        return {"prompt": f"{p}\n{instr}".strip() if instr else p, "answer": a}

    def clean(d):
        disable_progress_bars()
        d = d.map(to_row, remove_columns=d.column_names)
        return d.filter(lambda r: len(r["answer"]) > 0)

    train_c = clean(train)
    dropped = len(train) - len(train_c)
    if len(train_c) == 0:
        fail(f"--dataset {name!r}: no usable rows (dropped {dropped} without an answer)")
    if test_split is not None:
        held = clean(ds[test_split])
        dropped += len(ds[test_split]) - len(held)
    elif len(train_c) < 2:
        fail(f"--dataset {name!r}: 1 usable row (dropped {dropped} without an answer); it needs at "
             "least 2, one to train on and one held out")
    else:  # no held-out split: keep the last eval_size rows apart
        split = train_c.train_test_split(test_size=min(eval_size, len(train_c) // 10 or 1),
                                         seed=seed)
        train_c, held = split["train"], split["test"]
    return finish(train_c, held, dropped)


def read_local(flag: str, spec: str, pcol: str, acol: str, hint: str):
    """A local .json/.jsonl file (or a glob of them) as a `datasets.Dataset` of its pcol and acol
    columns, read here line by line so that a bad row fails with one line naming its file and line:
    JSON lines (one object a line) or one JSON array of objects. Prompts are text (or chat turns:
    the last one's content); answers text or numbers, kept as text (null: dropped later and
    counted)."""
    from datasets import Dataset

    paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    if not paths or not all(os.path.isfile(p) for p in paths):
        fail(f"{flag} {spec!r}: no such file")
    rows = []
    for path in paths:
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"{path}: cannot be read as UTF-8 text ({e})")
        if not text.strip():
            fail(f"{path}: empty file; write one JSON object a line, e.g. "
                 f"{{\"{pcol}\": \"2+2=\", \"{acol}\": \"4\"}}")
        if text.lstrip().startswith("["):  # one JSON array
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                fail(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})")
            numbered = [(f"{path} item {i + 1}", r) for i, r in enumerate(items)]
        else:
            numbered = []
            # not splitlines: JSON strings may hold U+2028
            for i, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    numbered.append((f"{path}:{i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    fail(f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); each line must "
                         "be one JSON object")
        rows += [checked_row(where, r, pcol, acol, hint) for where, r in numbered]
    return Dataset.from_list(rows)


def checked_row(where: str, r, pcol: str, acol: str, hint: str) -> dict:
    """One row of a local file, or one line naming what is wrong with it."""
    if not isinstance(r, dict):
        fail(f"{where}: a JSON {type(r).__name__}, not an object like {{\"{pcol}\": ..., "
             f"\"{acol}\": ...}}")
    missing = [c for c in (pcol, acol) if c not in r]
    if missing:
        fail(f"{where} has no column(s) {missing} (it has {sorted(r)}); {hint}")
    p, a = r[pcol], r[acol]
    if isinstance(p, list) and p and isinstance(p[-1], dict) and isinstance(p[-1].get("content"),
                                                                            str):
        p = p[-1]["content"]  # chat format: the last turn
    if not isinstance(p, str) or not p.strip():
        fail(f"{where}: '{pcol}' is {p!r:.40}; every row needs a text prompt")
    if isinstance(a, bool) or not isinstance(a, (str, int, float, type(None))):
        fail(f"{where}: '{acol}' is a {type(a).__name__}; give the answer as text or a number")
    return {pcol: p, acol: None if a is None else str(a)}


def load_hub(name: str, hub: str, cfg: str | None):
    """A hub set through `datasets`, failing with one line, fast, when the hub cannot be reached:
    without HF_HUB_OFFLINE, one connection to the endpoint (5 s at most) before `datasets` would
    retry for ~30 s; with it, the cached copy or a line saying there is none."""
    import socket
    import urllib.parse

    from datasets import load_dataset

    offline = any(os.environ.get(v, "0").lower() not in ("0", "", "false", "no", "off")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                                              "all_proxy"))
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not proxied:  # behind a proxy only `datasets` knows the way
        url = urllib.parse.urlparse(endpoint)
        try:
            socket.create_connection((url.hostname,
                                      url.port or (443 if url.scheme == "https" else 80)),
                                     5).close()
        except OSError as e:
            fail(f"--dataset {name}: cannot reach {endpoint} ({e.strerror or e}); without a "
                 "network, load it once "
                 f"where there is one and set HF_HUB_OFFLINE=1 to use the cached copy, or give a "
                 "local copy of "
                 f"{hub} with --data-files")
    try:
        return load_dataset(hub, cfg)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, one line says so
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "; HF_HUB_OFFLINE is set, so only a cached copy can be used" if offline else ""
        fail(f"--dataset {name}: loading {hub} failed ({type(e).__name__}: {first}){where}; or "
             "give a local copy with --data-files")


def chat_prompts(tok, prompts: list[str], enable_thinking: bool) -> list[str]:
    """Through the tokenizer's chat template where it has one."""
    if not getattr(tok, "chat_template", None):
        return prompts
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=enable_thinking)
            for p in prompts]


# -------------------- rewards: the math grader, --reward, scoring a rollout
# Numbers as answers write them: -12, 3.5, .5, 3/4, and thousands in groups of three (1,234). A
# comma that three digits do not follow ends the number, so "the answer is 72, in total" gives 72.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")


def answer_span(text: str) -> tuple[int, int] | None:
    """Where the final answer lies in text, as (start, end) character offsets: the contents of the
    last \\boxed{...} (or the token after a brace-less `\\boxed 5`), else the number (or the first
    non-empty line) after the last '####', else the last number."""
    box = None
    for box in _BOX.finditer(text):
        pass
    if box is not None and box.group(1) is None:
        m = re.compile(r"\s*([^\s$]+)").match(text, box.end())
        return m.span(1) if m else None
    if box is not None:
        depth = 1
        for k in range(box.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return box.end(), k
        return None  # unbalanced \boxed{
    i = text.rfind("####")
    if i >= 0:
        m = (re.compile(r"\s*(" + _NUM + ")").match(text, i + 4)
             or re.compile(r"\s*(\S[^\n]*)").match(text, i + 4))
        return m.span(1) if m else None
    last = None
    for last in re.finditer(_NUM, text):
        pass
    return last.span() if last else None


def extract_answer(text: str) -> str | None:
    """The final answer: the last \\boxed{...}, else what follows the last '####', else the last
    number."""
    span = answer_span(text)
    return text[span[0]:span[1]].strip() if span else None


_TEXT_CMD = r"\\(?:text|textbf|textrm|textit|mbox|mathrm|mathbf|operatorname)\s*"
_UNIT = re.compile(r"(?<=\S)\s*" + _TEXT_CMD
                   + r"\{\s*[A-Za-z][A-Za-z\s.]*\}(?:\s*\^\s*\{?[23]\}?)?$")
_WORDS_AFTER_NUMBER = re.compile(r"([-+]?[\d.,/]*\d)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]+)*)\.?")
_WORD = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")
# a longer extracted answer is not graded: it scores 0 and counts as a reward error
_MAX_ANSWER_CHARS = 1000


def normalize_answer(s: str) -> tuple[str, bool]:
    """An answer in one canonical spelling, and whether it carried a percent sign: \\dfrac and
    \\tfrac become \\frac, \\sqrt3 and \\frac12 get their braces; \\left/\\right, spacing commands,
    $ and \\$, degrees (^\\circ), %, a trailing unit (\\text{ cm}, or words after a number: '18.90
    dollars', but 'percent' is a % and 'pi' is \\pi), a \\text{...} around the whole answer, a
    leading + and a final period go; 1{,}000 is 1,000; spaces go except between two letters. Pure
    text."""
    s = s.strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle", "", s)
    s = s.replace("{,}", ",").replace("\\$", "").replace("$", "")
    s = re.sub(r"(?<!\\)\\[,!;: ]|~|\\q?quad(?![a-zA-Z])", " ", s)  # not the \\ of a new row
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree", "", s)
    percent = "%" in s
    s = re.sub(r"\\?%", "", s).strip()
    s = _UNIT.sub("", s).strip()
    whole = re.fullmatch(_TEXT_CMD + r"\{([^{}]*)\}", s)
    if whole:
        s = whole.group(1).strip()
    after = _WORDS_AFTER_NUMBER.fullmatch(s)
    if after and after.group(2).lower() == "pi":  # '2 pi' is a number times pi, not a unit
        s = after.group(1) + "\\pi"
    elif after:
        percent = percent or after.group(2).lower() in ("percent", "per cent")
        s = after.group(1)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", " ", s).rstrip(".").strip()
    # the word: compared as text, 'infinity' never equals \\infty
    s = re.sub(r"^([-+]?)(?:infinity|inf|∞)$", r"\1\\infty", s, flags=re.I)
    s = re.sub(r"^\+(?=[\d.\\])", "", s)
    # "x + 1" -> "x+1"; "\pi r" keeps its space
    s = re.sub(r"(?<=[^A-Za-z]) | (?=[^A-Za-z])", "", s)
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)  # multiple choice: (C) is C
    return (choice.group(1) if choice else s), percent


def parse_number(s: str) -> Fraction | None:
    """The exact value of a number as answers write it (after normalize_answer): integers, decimals,
    thousands separators, a/b, \\frac{a}{b}, a sign; None when s is not one number."""
    s = normalize_answer(s)[0]
    if len(s) > 100:  # past Python's digit limits, and no answer worth an exact comparison
        return None
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}", s)
    try:
        if m:
            v = Fraction(m.group(2).replace(",", "")) / Fraction(m.group(3).replace(",", ""))
            return -v if m.group(1) else v
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
            s = s.replace(",", "")
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+)?", s):
            num, _, den = s.partition("/")
            return Fraction(num) / (Fraction(den) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def canonical(answer: str) -> tuple[str, frozenset]:
    """(normalised text, the exact values it may mean): one value for a number, two for a percentage
    (5% is 5, as answers are often written, and 0.05), none for anything else. Computed once per
    distinct answer."""
    text, percent = normalize_answer(answer)
    v = parse_number(text)
    if v is None:
        return text, frozenset()
    return text, frozenset({v, v / 100}) if percent else frozenset({v})


def decide(pred: tuple[str, frozenset], gold: tuple[str, frozenset]) -> float | None:
    """The fast path: 1.0 or 0.0 where canonical forms settle it (equal text, two numbers, or plain
    words, compared without case), None where a symbolic comparison must decide (math-verify, in the
    grading worker)."""
    if pred[0] == gold[0] and pred[0]:
        return 1.0
    if pred[1] and gold[1]:
        return float(bool(pred[1] & gold[1]))
    # text answers; math-verify would read a word as a product of symbols, so 'Evenly' would equal
    # 'Evelyn'
    if _WORD.fullmatch(pred[0]) or _WORD.fullmatch(gold[0]):
        return float(pred[0].lower() == gold[0].lower())
    if not pred[0] or not gold[0]:
        return 0.0
    return None


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (extract_answer) equals the reference, else 0.0: exact
    numbers and canonical text first (decide), math-verify on what they cannot settle (radicals,
    expressions, intervals, sets, tuples, matrices, equations), in a worker process with a time
    bound. Model text is parsed, never executed."""
    r, errors = score([completion], [answer], 1, watch=False)
    return r.item()


# Grading runs math-verify (LaTeX parsed by an ANTLR grammar into sympy, never eval) and users'
# reward functions in worker processes (GRADING_WORKERS), each answering one request at a time, with
# a hard time bound: a request not answered within the bound kills its worker (restarted on its next
# request) and scores 0, counted as a reward error. Not math-verify's own timeout: it uses
# signal.alarm, which raises ValueError off the main thread, has a resolution of whole seconds,
# replaces the process's SIGALRM handler, and cannot interrupt a long call into C (a huge integer
# power); a separate process can always be killed, and bounds memory too (RLIMIT_AS for the math
# grader).
_WORKER_SRC = r'''
import json
import os
import sys
sys.path[:0] = json.loads(sys.argv[1])
spec = sys.argv[2]
# replies only: a print() or a child process of the reward writes to stderr
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
def reply(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()
try:
    if spec:
        import importlib
        module, name = spec.split(":")
        fn = getattr(importlib.import_module(module), name)
    else:
        import logging
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        logging.disable(logging.WARNING)
        from math_verify import LatexExtractionConfig, parse, verify
        # ANTLR's two-stage parse: the fast SLL prediction first, full LL only where SLL fails
        # (~4x faster)
        try:
            from antlr4.atn.PredictionMode import PredictionMode
            from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
            ll_create, ll_parse = _Latex2Sympy.create_parser, _Latex2Sympy.parse
            def create_parser(self, latex):
                parser = ll_create(self, latex)
                if getattr(self, "sll", False):
                    parser._interp.predictionMode = PredictionMode.SLL
                return parser
            def two_stage(self, latex):
                try:
                    self.sll = True
                    return ll_parse(self, latex)
                except Exception:
                    self.sll = False
                    return ll_parse(self, latex)
            _Latex2Sympy.create_parser, _Latex2Sympy.parse = create_parser, two_stage
        except (ImportError, AttributeError):
            pass
        config, parsed = [LatexExtractionConfig()], {}
        def parse_once(s):
            if len(parsed) > 4096:
                parsed.clear()
            if s not in parsed:
                parsed[s] = parse("$" + s + "$", extraction_config=config,
                                  fallback_mode="no_fallback",
                                  parsing_timeout=None)
            return parsed[s]
        def fn(pred, gold):
            g, p = parse_once(gold), parse_once(pred)
            return float(bool(g) and bool(p) and verify(g, p, timeout_seconds=None))
except BaseException as e:
    reply(fatal=f"{type(e).__name__}: {e}")
    sys.exit(1)
reply(ready=True)
for line in sys.stdin:
    a, b = json.loads(line)
    try:
        r = float(fn(a, b))
        if r != r or abs(r) == float("inf"):
            raise ValueError(f"the reward returned {r}")
        reply(r=r)
    except Exception as e:
        reply(e=f"{type(e).__name__}: {e}"[:300])
'''


# worker processes per Reward (per rank): math-verify's parser is pure Python, one core each
GRADING_WORKERS = 2


class _Worker:
    """One grading process, answering one request at a time over pipes (JSON lines)."""

    def __init__(self, spec: str | None):
        self.spec, self.proc, self.buf = spec, None, b""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self):
        import subprocess

        path = json.dumps([os.getcwd(), *sys.path])
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_SRC, path, self.spec or ""],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     # a user's prints show
                                     stderr=None if self.spec else subprocess.DEVNULL)
        self.buf = b""

    def wait_ready(self):
        import select

        deadline = time.monotonic() + 120.0  # importing math-verify or the user's module
        while self.line() is None and time.monotonic() < deadline:
            if (select.select([self.proc.stdout], [], [], deadline - time.monotonic())[0]
                    and not self.pull()):
                break
        msg = self.take()
        if msg is None or "fatal" in msg:
            self.stop()
            why = msg["fatal"] if msg else "no answer in 120 s"
            raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) did not start: "
                               f"{why}")

    def pull(self) -> bool:
        """Read what the worker wrote; False when it has died."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> bytes | None:
        return self.buf.split(b"\n", 1)[0] if b"\n" in self.buf else None

    def take(self) -> dict | None:
        line = self.line()
        if line is None:
            return None
        self.buf = self.buf[len(line) + 1:]
        try:
            return json.loads(line)
        except ValueError:
            return {"e": f"RuntimeError: the reward worker wrote {line[:80]!r}"}

    def send(self, request):
        for attempt in range(2):
            if not self.alive():
                self.launch()
                self.wait_ready()
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                return
            except OSError:  # it died after alive() looked: once more with a new one
                self.stop()
        raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) dies as it starts")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Reward:
    """The reward of a completion given its prompt's answer: the math grader (spec None) or a user's
    function f(completion, answer) -> float named 'module:function'. What score() cannot settle in
    this process (decide) runs in GRADING_WORKERS worker processes, each request bounded by
    timeout_s (see above)."""

    def __init__(self, spec: str | None = None, timeout_s: float = 1.0):
        self.spec, self.timeout_s = spec, timeout_s
        self.workers, self.lock = [_Worker(spec) for _ in range(GRADING_WORKERS)], threading.Lock()
        # training steps in a row, from the first, in which every group's rewards were equal
        self.flat_steps = 0

    def stop(self):
        for w in self.workers:
            w.stop()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.stop()

    def run(self, requests: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
        """(reward, error) per request, each within timeout_s of being sent: a request that raises,
        returns a non-finite value, kills its worker or runs out of time gives (0.0, the error); the
        worker is restarted."""
        import select

        out, todo = [None] * len(requests), list(range(len(requests)))[::-1]
        busy = {}  # worker -> (request index, deadline)
        with self.lock:
            idle = [w for w in self.workers[:len(requests)] if not w.alive()]
            for w in idle:  # start them side by side
                w.launch()
            for w in idle:
                w.wait_ready()
            while todo or busy:
                for w in self.workers:
                    if w not in busy and todo:
                        i = todo.pop()
                        w.send(requests[i])
                        busy[w] = (i, time.monotonic() + self.timeout_s)
                wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
                ready = select.select([w.proc.stdout for w in busy], [], [], wait)[0]
                for w, (i, deadline) in list(busy.items()):
                    died = w.proc.stdout in ready and not w.pull()
                    msg = w.take()
                    if msg is not None:
                        out[i] = (msg.get("r", 0.0), msg.get("e"))
                    elif died:
                        out[i] = (0.0, "RuntimeError: the reward worker died (restarted)")
                    elif time.monotonic() >= deadline:
                        out[i] = (0.0, f"TimeoutError: no reward within {self.timeout_s:g} s "
                                       "(worker restarted)")
                    else:
                        continue
                    if msg is None:
                        w.stop()
                    del busy[w]
        return out


_MATH_GRADER = []  # the default Reward, made on first use


def load_reward(spec: str | None, timeout_s: float) -> Reward:
    """--reward and --reward-timeout, checked before any heavy work: None is the math grader (it
    needs math-verify); 'module:function' must name a callable f(completion, answer) -> float
    importable from the current folder or the Python path."""
    import importlib
    import importlib.util

    if not timeout_s > 0:
        fail(f"--reward-timeout {timeout_s}: must be > 0 seconds")
    if spec is None:
        if importlib.util.find_spec("math_verify") is None:
            fail("the math grader needs math-verify: pip install -r requirements.txt")
        return Reward(None, timeout_s)
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        fail(f"--reward {spec!r}: give module:function, e.g. my_rewards:format_reward for a "
             "function f(completion, answer) -> float in my_rewards.py")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        fail(f"--reward {spec!r}: cannot import {e.name!r} (run from the folder of {module}.py or "
             "add it to PYTHONPATH)")
    except Exception as e:  # noqa: BLE001 - the user's module raised while it was imported
        fail(f"--reward {spec!r}: importing {module!r} raised {type(e).__name__}: "
             f"{e}".splitlines()[0])
    if fn is None:
        fail(f"--reward {spec!r}: module {module!r} has no {name!r}")
    if not callable(fn):
        fail(f"--reward {spec!r}: {module}.{name} is a {type(fn).__name__}, not a function "
             "f(completion, answer)")
    return Reward(spec, timeout_s)


def score(texts: list[str], answers: list, n: int, reward: Reward | None = None,
          watch: bool = True) -> tuple[torch.Tensor, int]:
    """Reward per completion (reward: a Reward, default the math grader), and on how many
    completions it failed (raised, returned a non-finite value, ran past its time bound, or an
    answer too long to grade): those score 0 and the first error is printed, so one broken
    completion or reward function never stops a run. Answers are given once per prompt, completions
    n per prompt. Each answer is normalised once per prompt, and each distinct request (extracted
    answer and reference; for a user's reward, completion and answer) is graded once.
    watch: a training step; when every group of each of the first steps has equal rewards, say so
    once."""
    if reward is None:
        if not _MATH_GRADER:
            _MATH_GRADER.append(Reward())
        reward = _MATH_GRADER[0]
    answers = [str(a) for a in answers]
    keys, results, requests = [], {}, []  # per completion: its request (None: no answer, scores 0)
    if reward.spec is None:
        golds = [canonical(a) for a in answers]  # once per prompt
        preds = {}  # extracted answer -> canonical form, once per distinct answer
        for i, text in enumerate(texts):
            try:
                pred, gold = extract_answer(text), golds[i // n]
                if pred is None:
                    keys.append(None)
                    continue
                if len(pred) > _MAX_ANSWER_CHARS:
                    raise ValueError(f"an answer of {len(pred)} characters (over "
                                     f"{_MAX_ANSWER_CHARS}) is not graded")
                p = preds[pred] if pred in preds else preds.setdefault(pred, canonical(pred))
                key = (p, gold)  # the values too: '50%' and '50' share the text '50'
                if key not in results:
                    results[key] = (decide(p, gold), None)
                    if results[key][0] is None:
                        requests.append(key)
            except Exception as e:  # noqa: BLE001 - whatever the completion holds, it scores 0
                # and is counted
                key = ("failed", i)
                results[key] = (0.0, f"{type(e).__name__}: {e}")
            keys.append(key)
    else:
        keys = [(text, answers[i // n]) for i, text in enumerate(texts)]
        requests = list(dict.fromkeys(keys))
    if reward.spec is None:  # math-verify compares the texts
        results.update(zip(requests, reward.run([(p[0], gold[0]) for p, gold in requests])))
    else:
        results.update(zip(requests, reward.run(requests)))
    rewards = [results[k][0] if k is not None else 0.0 for k in keys]
    errors = [results[k][1] for k in keys if k is not None and results[k][1] is not None]
    if errors:
        print(f"warning: the reward failed on {len(errors)} of {len(texts)} completions, scored 0 "
              f"(first: {errors[0]})", file=sys.stderr)
    r = torch.tensor(rewards, dtype=torch.float32)
    if watch:
        watch_flat_groups(reward, r, n)
    return r, len(errors)


# the first training steps that, all flat, make a run say that its answers may not be gradable
FLAT_STEPS = 5


def watch_flat_groups(reward: Reward, r: torch.Tensor, n: int):
    """Say once (main rank) when every group of each of the first FLAT_STEPS training steps had
    equal rewards: every advantage was 0, nothing was learned, and the likely cause is answers the
    grader cannot match."""
    # a step with a spread was seen, or the warning was given
    if reward.flat_steps < 0 or r.numel() % n:
        return
    g = r.view(-1, n)
    reward.flat_steps = reward.flat_steps + 1 if bool((g == g[:, :1]).all()) else -1
    if reward.flat_steps == FLAT_STEPS:
        reward.flat_steps = -1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"warning: in each of the first {FLAT_STEPS} steps every group's completions got "
                  f"the same reward (now {r.mean().item():.3f}), so every advantage is 0 and "
                  "nothing is learned; if this goes on, the answers may not be gradable: compare "
                  "them with what the model writes (samples.jsonl)",
                  file=sys.stderr)


# -------------------- group advantages and the mechanism metrics
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std + eps), population std (DFPO eq. 43; the blog's worked example:
    rewards [1,0,1,0] give A = [+1,-1,+1,-1]). scale: the std of the group (eq. 43), of the whole
    batch over all ranks (TRL/verl "batch"), or none (centring only, Dr. GRPO). Groups with equal
    rewards get A = 0; their count is returned."""
    r = rewards.view(-1, group_size).double()
    centred = r - r.mean(1, keepdim=True)
    std = r.std(1, unbiased=False, keepdim=True)
    if scale == "group":
        adv = centred / (std + eps)
    elif scale == "batch":
        adv = centred / (all_gather_cat(rewards.double()).std(unbiased=False).item() + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown scale {scale!r} (group, batch or none)")
    return adv.view(-1).float(), int((std.squeeze(1) == 0).sum())


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


# -------------------- data order: prompts a step, minibatches, micro-batches
def prompt_indices(n_rows: int, step: int, per_rank: int, d: Dist, seed: int) -> list[int]:
    """This rank's prompts for `step` (1-based): a fresh seeded permutation each epoch, global batch
    split across ranks, so the data position is a pure function of the step."""
    first = (step - 1) * per_rank * d.world + d.rank * per_rank
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
    """Per optimizer step: linear warm-up over --warmup-frac of the steps, then constant or cosine
    decay to --min-lr-ratio x the peak (the DFPO paper's App. I: cosine, 3% warm-up, 0.2)."""
    total = args.num_steps * args.num_minibatches
    warmup = round(args.warmup_frac * total)

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if args.lr_schedule == "constant":
            return 1.0
        progress = (i - warmup) / max(1, total - warmup)
        return (args.min_lr_ratio
                + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every tensor is finite on every rank: one decision that all ranks share."""
    ok = torch.tensor([float(all(torch.isfinite(t).all() for t in tensors))],
                      device=tensors[0].device)
    return bool(all_reduce(ok, dist.ReduceOp.MIN).item())


def reduce_stats(stats: list[dict]) -> dict:
    """One value a key over a step's micro-batches and all ranks: a mean given as (sum, count) is
    the sum of the sums over the sum of the counts, whatever the rows' split; keys ending in
    _min/_max take min/max; any other scalar (one a minibatch) the mean over entries, then ranks."""
    out = {}
    for k in stats[0]:
        if isinstance(stats[0][k], tuple):
            total = all_reduce(torch.tensor([[float(x) for x in s[k]] for s in stats],
                                            dtype=torch.float64).sum(0))
            out[k] = (total[0] / total[1]).item()
            continue
        v = torch.tensor([float(s[k]) for s in stats], dtype=torch.float64)
        if k.endswith("_min"):
            out[k] = all_reduce(v.min(), dist.ReduceOp.MIN).item()
        elif k.endswith("_max"):
            out[k] = all_reduce(v.max(), dist.ReduceOp.MAX).item()
        else:
            out[k] = (all_reduce(v.mean()) / (dist.get_world_size()
                                              if dist.is_initialized() else 1)).item()
    return out


def jitter2(m: list[float]) -> float:
    """Second-order difference jitter of a curve, DFPO eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t|
    (nan if T < 3)."""
    if len(m) < 3:
        return float("nan")
    return sum(abs(m[t + 2] - 2 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


# -------------------- held-out evaluation
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021): 1 - C(n - c, k) /
    C(n, k), the probability that k samples drawn without replacement from the n include a correct
    one."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(policy, tok, held, eos, d: Dist, *, k: int, n: int | None = None,
             reward: Reward | None = None, max_new_tokens: int, temperature: float, top_p: float,
             top_k: int, gen_batch_size: int, unshard: bool = False,
             mode: str = "shared-prefill") -> dict:
    """Over the held-out prompts (each rank an equal share), from n >= k samples a prompt (n
    defaults to k): avg@k, the mean accuracy of the n samples (an unbiased estimate of the mean
    accuracy of k samples, the DFPO paper's metric), and pass@k, the mean over prompts of the
    unbiased 1 - C(n - c, k) / C(n, k) (pass_at_k)."""
    n = n or k
    m = len(held) // d.world * d.world  # equal shares, or the FSDP all-gathers would hang
    if m == 0:
        fail(f"the held-out split has {len(held)} prompt(s), fewer than the {d.world} ranks that "
             "share it: give a larger dataset (a local file holds out a tenth, at most "
             "--eval-size) or --eval-every 0")
    rows = held.select(range(d.rank, m, d.world))
    r, errors = torch.zeros(0), 0
    per_call = max(1, gen_batch_size // n)  # prompts per generate call
    for i in range(0, len(rows), per_call):
        part = rows.select(range(i, min(i + per_call, len(rows))))
        out = generate(policy, tok, part["text"], n, eos, d, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k,
                       gen_batch_size=gen_batch_size, unshard=unshard, mode=mode)
        part_r, part_errors = score(out["texts"], part["answer"], n, reward, watch=False)
        r, errors = torch.cat([r, part_r]), errors + part_errors
    r = r.view(-1, n)
    passk = sum(pass_at_k(n, int(c), k) for c in (r > 0).sum(1))
    s = all_reduce(torch.tensor([r.mean(1).sum(), passk, len(rows), errors], dtype=torch.float64))
    return {f"eval/avg@{k}": (s[0] / s[2]).item(), f"eval/pass@{k}": (s[1] / s[2]).item(),
            "eval/prompts": m, "eval/samples": n, "eval/reward_errors": s[3].item()}


def eval_report(result: dict, dataset: str, run_dir: str, d: Dist) -> str:
    """--eval-only: the table printed, and eval.json in the run folder. Returns the JSON path."""
    path = os.path.join(run_dir, "eval.json")
    if d.main:
        k = next(key for key in result if key.startswith("eval/avg@")).split("@")[1]
        print(f"\n| dataset | prompts | samples a prompt | avg@{k} | pass@{k} | reward errors |\n"
              "|---|---|---|---|---|---|\n"
              f"| {dataset} (held-out) | {result['eval/prompts']} | {result['eval/samples']} | "
              f"{result[f'eval/avg@{k}']:.4f} | {result[f'eval/pass@{k}']:.4f} | "
              f"{result['eval/reward_errors']:.0f} |")
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({dataset: result}, f, indent=1)
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

    def __init__(self, run_dir: str, d: Dist, args, first_step: int = 1):
        self.d, self.writer = d, None
        # a bad metrics.jsonl stops every rank
        on_rank0(lambda: self._open(run_dir, args, first_step), d)

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
        samples = os.path.join(run_dir, "samples.jsonl")
        if first_step > 1 and os.path.exists(samples):  # the steps this run redoes log new samples
            rewrite_rows(samples, read_metrics(samples, keep_below=first_step))
        self.metrics = open(path, "a")

    def log(self, step: int, scalars: dict):
        if not self.d.main:
            return
        # strict JSON: null, not NaN
        row = {k: v if math.isfinite(v) else None for k, v in scalars.items()}
        for k, v in row.items():
            if v is not None:
                self.writer.add_scalar(k, v, step)
        self.metrics.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        self.metrics.flush()

    def close(self):
        if self.d.main:
            self.writer.close()
            self.metrics.close()


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


SAMPLE_PROMPTS = 2  # prompts a --log-samples step shows, each with all its completions


def log_samples(logger: Logger, run_dir: str, step: int, every: int, prompts, answers,
                texts: list[str], rewards: torch.Tensor, advantages: torch.Tensor, n: int):
    """Every `every` steps (0: never; main rank only): the first SAMPLE_PROMPTS prompts of this
    rank's step with their n completions, rewards and advantages, as a text table in tensorboard
    ('samples') and as one JSON object a completion in {run_dir}/samples.jsonl (a resumed run's
    Logger has dropped the rows of the steps it redoes)."""
    if not every or step % every or not logger.d.main:
        return
    path = os.path.join(run_dir, "samples.jsonl")
    rows, md = [], []
    for g in range(min(SAMPLE_PROMPTS, len(prompts))):
        md.append(f"**prompt:** {prompts[g]}  \n**answer:** {answers[g]}\n\n"
                  "| reward | advantage | completion |\n|---|---|---|")
        for i in range(g * n, (g + 1) * n):
            rows.append({"step": step, "prompt": prompts[g], "answer": answers[g],
                         "completion": texts[i], "reward": rewards[i].item(),
                         "advantage": advantages[i].item()})
            cell = texts[i].replace("|", "\\|").replace("\n", "<br>")
            md.append(f"| {rewards[i].item():.3f} | {advantages[i].item():+.3f} | {cell} |")
    logger.writer.add_text("samples", "\n".join(md), step)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


# -------------------- checkpoints and exact resume
# A checkpoint is a folder {run_dir}/step_N: the model and tokenizer as `save_pretrained` writes
# them (safetensors, loads with from_pretrained), trainer_state.json (step, world size, script,
# reward curve) and rank{r}.pt per rank (this rank's optimizer shard, the lr schedule, the RNG
# states; plain tensors, read with weights_only=True), and, written last, manifest.json: the size
# and sha256 of every other file. It is written into .tmp_step_N and renamed into place when
# complete, so a crash mid-write leaves the previous ones intact; a file damaged later (a full disk,
# a bad copy) fails the manifest, and resume says so instead of loading it.
STEP_DIR = re.compile(r"step_(\d+)$")
MANIFEST = "manifest.json"


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """The run's step_N folders as (N, path), oldest first, complete or not."""
    return sorted((int(m[1]), p) for p in glob.glob(os.path.join(glob.escape(run_dir), "step_*"))
                  if (m := STEP_DIR.search(p)))


def is_checkpoint(path: str) -> bool:
    """A step_N folder with its manifest: complete when written (verify_checkpoint says whether it
    still is)."""
    return bool(STEP_DIR.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(
        os.path.join(path, MANIFEST))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _digests(folder: str, names: list[str], d: Dist) -> dict:
    """{name: [bytes, sha256]} of files in folder, each rank hashing its share (names: the same on
    every rank)."""
    mine = {}
    for name in names[d.rank::d.world]:
        path = os.path.join(folder, name)
        try:
            mine[name] = [os.path.getsize(path), _sha256(path)]
        except OSError as e:
            mine[name] = [-1, f"{type(e).__name__}: {e}"]
    if d.world > 1:
        parts = [None] * d.world
        dist.all_gather_object(parts, mine)
        mine = {k: v for part in parts for k, v in part.items()}
    return mine


def write_manifest(folder: str, d: Dist | None = None):
    """manifest.json: size and sha256 of every other file in folder (ranks hash in parallel),
    written last, whole."""
    d = d or Dist(0, 1, torch.device("cpu"))
    barrier()
    names = [None]
    if d.main:
        names = [sorted(os.path.relpath(os.path.join(root, f), folder)
                        for root, _, files in os.walk(folder)
                        for f in files if f != MANIFEST)]
    if d.world > 1:
        dist.broadcast_object_list(names, src=0)
    files = _digests(folder, names[0], d)
    if d.main:
        with open(os.path.join(folder, MANIFEST + ".tmp"), "w") as f:
            json.dump({"files": files}, f, indent=1)
        os.replace(os.path.join(folder, MANIFEST + ".tmp"), os.path.join(folder, MANIFEST))
    barrier()


def verify_checkpoint(ckpt: str, d: Dist) -> str | None:
    """None when every file the manifest lists has its size and sha256; else why not, in a few
    words, the same answer on every rank (rank 0 reads the manifest and the sizes, then the ranks
    hash a share each)."""
    out = [None, []]  # (reason, files to hash)
    if d.main:
        try:
            with open(os.path.join(ckpt, MANIFEST)) as f:
                files = json.load(f)["files"]
            for name, (size, _) in files.items():
                path = os.path.join(ckpt, name)
                if not os.path.isfile(path):
                    out[0] = out[0] or f"{name} is missing"
                elif os.path.getsize(path) != size:
                    out[0] = out[0] or (f"{name} has {os.path.getsize(path)} bytes, the manifest "
                                        f"says {size}")
            out[1] = sorted(files)
        except FileNotFoundError:
            out[0] = f"no {MANIFEST} (written before manifests, or never completed)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            out[0] = f"{MANIFEST} cannot be read ({type(e).__name__}: {e})"
    if d.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[0] is not None:
        return out[0]
    found = _digests(ckpt, out[1], d)
    wanted = {}
    if d.main:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            wanted = json.load(f)["files"]
    bad = [None]
    if d.main:
        mismatched = [name for name in out[1] if found[name] != wanted[name]]
        bad = [f"{mismatched[0]} does not match its sha256 in the manifest" if mismatched else None]
    if d.world > 1:
        dist.broadcast_object_list(bad, src=0)
    return bad[0]


def run_paths(args, d: Dist, script: str) -> tuple[str, str | None]:
    """The run folder and the checkpoint to resume from (None: a fresh run). --resume auto takes the
    newest complete checkpoint of this exp_name and seed under --output-dir, or starts a fresh run
    when there is none, so the same command serves the first launch and every torchrun restart. Rank
    0 lists the checkpoints and names a fresh run folder; every rank then reads the same files and
    reaches the same verdict, so an error stops all ranks at once."""
    listed = [None, None]  # (candidate checkpoints, newest first; a fresh run's folder)
    if d.main:
        candidates = [args.resume] if args.resume not in (None, "auto") else []
        if args.resume == "auto":
            pattern = os.path.join(glob.escape(args.output_dir),
                                   f"{glob.escape(args.exp_name)}__{args.seed}__*", "step_*")
            # (run's unix time, step)
            key = re.compile(r"__(\d+)" + re.escape(os.sep) + r"step_(\d+)$")
            found = sorted((int(m[1]), int(m[2]), p) for p in glob.glob(pattern)
                           if (m := key.search(p)))
            candidates = [p for _, _, p in reversed(found)]
        fresh = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}")
        listed = [[os.path.normpath(p) for p in candidates], fresh]
    if d.world > 1:
        dist.broadcast_object_list(listed, src=0)
    candidates, fresh = listed
    ckpt = None
    for path in candidates:  # the newest that verifies
        reason = verify_checkpoint(path, d)
        if reason is None:
            ckpt = path
            break
        if args.resume != "auto":
            fail(f"--resume {path}: {reason}; resume from another checkpoint (or --resume auto)")
        if d.main:
            print(f"--resume auto: skipping {path}: {reason}")
    if args.resume == "auto" and ckpt is None and d.main:
        print(f"--resume auto: no checkpoint of {args.exp_name}__{args.seed}__* under "
              f"{args.output_dir}, starting a fresh run")
    step = 0
    if ckpt:
        state = read_trainer_state(ckpt)
        if state["world"] != d.world:
            fail(f"{ckpt} was written by {state['world']} ranks and this run has {d.world}: resume "
                 f"it with --nproc-per-node {state['world']} (optimizer shards and RNG states are "
                 "per rank)")
        if state["script"] != script:
            fail(f"{ckpt} was written by {state['script']}, not {script}: resume it with that "
                 "script")
        step = state["step"]
        then, now = state.get("args", {}), vars(args)
        for name in RESUME_FIXED:
            if name in then and then[name] != now[name]:
                fail(f"--{name.replace('_', '-')} {now[name]} differs from {then[name]} in {ckpt}: "
                     "it cannot change on resume (the data order, the objective, the optimizer "
                     "state or the weights depend on it); start a new run")
        changed = [f"--{k.replace('_', '-')} {then[k]} -> {v}" for k, v in now.items()
                   if k in then and then[k] != v and k != "resume"]
        if d.main:
            print(f"resuming {ckpt} (step {step})")
            if changed:
                print(f"changed on resume, in effect from step {step + 1}: {', '.join(changed)}")
    if step >= args.num_steps:  # e.g. a restart after the last checkpoint was written
        if d.main:
            print(f"{ckpt} is at step {step} and --num-steps is {args.num_steps}: nothing to do")
        cleanup()
        raise SystemExit(0)
    return (os.path.dirname(ckpt) if ckpt else fresh), ckpt


# What a resumed run may not change: the data order (seed, prompts a rank, the data), the shape of a
# step (group size), the weights and optimizer state (model), and the objective (the script's loss
# flags and what shapes the advantages). World size and script are checked on their own; a name the
# checkpoint's script lacks is skipped.
RESUME_FIXED = ("seed", "model", "dataset", "data_files", "prompts_per_rank", "group_size",
                "clip_low", "clip_high", "scale_rewards", "mask_truncated", "loss_agg",
                "symmetric_clip", "kl_coef", "post_answer_penalty", "transform", "length_aware",
                "clip_gated", "stop_grad", "orth_floor")


def read_trainer_state(ckpt: str) -> dict:
    """A checkpoint's trainer_state.json, or one line saying why it cannot be read."""
    try:
        with open(os.path.join(ckpt, "trainer_state.json")) as f:
            state = json.load(f)
        missing = [k for k in ("step", "world", "script") if k not in state]
    except (OSError, ValueError, TypeError) as e:
        fail(f"{ckpt}/trainer_state.json: cannot read it ({type(e).__name__}: {e}); resume from "
             "another checkpoint")
    if missing:
        fail(f"{ckpt}/trainer_state.json has no {missing}: resume from another checkpoint")
    return state


# One writer per run folder: rank 0 holds an exclusive flock on {run_dir}/writer.lock (which names
# its pid and host) from before the model loads until the process ends. The kernel lets go of it
# when the process dies, however it dies, so a dead writer's lock is taken over by the next run; a
# live writer's stops the next one with one line.
_run_lock = None  # rank 0's open writer.lock


def claim_run_dir(run_dir: str, ckpt: str | None, d: Dist) -> str:
    """Rank 0 creates a fresh run's folder (a run started in the same second with the same
    --exp-name and --seed takes the next free second's name, never the same folder) or takes a
    resumed run's, and locks it. Returns the folder, the same on every rank; a folder held by a live
    writer stops every rank with one line naming it."""
    return on_rank0(lambda: _claim_run_dir(run_dir, ckpt), d)


def _claim_run_dir(run_dir: str, ckpt: str | None) -> str:
    global _run_lock
    if ckpt is None:
        os.makedirs(os.path.dirname(run_dir) or ".", exist_ok=True)
        head, t = run_dir.rsplit("__", 1)
        while True:
            try:
                os.mkdir(run_dir)  # atomic: of two runs that picked the same name, one gets it
                break
            except FileExistsError:
                t = str(int(t) + 1)
                print(f"{run_dir} exists (a run started in the same second): this run writes to "
                      f"{head}__{t}")
                run_dir = f"{head}__{t}"
    release_run_dir()  # an earlier run in this process (tests call main() more than once)
    path = os.path.join(run_dir, "writer.lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise Refused(f"{run_dir} is being written by {holder} (it holds {path}): wait for that "
                      "run to end, or start another with a different --exp-name or --seed")
    # a file system without locks (e.g. NFS mounted with nolock refuses some): said, not hidden
    except OSError as e:
        print(f"warning: cannot lock {path} ({e}): no one-writer guarantee on this file system",
              file=sys.stderr)
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _run_lock = f
    if ckpt is not None:
        set_aside_later_checkpoints(run_dir, int(STEP_DIR.search(ckpt)[1]))
    return run_dir


def set_aside_later_checkpoints(run_dir: str, step: int):
    """A run resumed from step_k (an earlier one than the newest, say) goes on from there: the
    checkpoints after step k belong to the run it branches from. They are moved into one
    abandoned_* folder, so that pruning (--keep-checkpoints) and --resume auto never take them for
    this run's, and said so; nothing is deleted."""
    later = [(n, p) for n, p in step_folders(run_dir) if n > step]
    if not later:
        return
    aside = os.path.join(run_dir, f"abandoned_{time.strftime('%Y%m%d_%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for _, p in later:
        os.rename(p, os.path.join(aside, os.path.basename(p)))
    print(f"resuming from step {step}: the later checkpoints of the run that went on from it "
          f"({', '.join(os.path.basename(p) for _, p in later)}) are moved to {aside}; delete it "
          "when you no longer need them")


def release_run_dir():
    """Let go of writer.lock (the end of a run; process exit does the same)."""
    global _run_lock
    if _run_lock is not None:
        _run_lock.close()
        _run_lock = None


def _rng_state(d: Dist) -> dict:
    py, npy = random.getstate(), np.random.get_state()
    return {"python": py, "numpy": (npy[0], npy[1].tolist(), *npy[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None}


def _set_rng_state(s: dict, d: Dist):
    random.setstate(s["python"])
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]))
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None:
        torch.cuda.set_rng_state(s["cuda"], d.device)


def resume_state(ckpt: str | None, optimizer, scheduler, d: Dist) -> dict:
    """Restore optimizer, lr schedule and this rank's RNG states from `ckpt` and return the loop's
    state (step, reward curve, non-finite run, wall time); a fresh run's state when ckpt is None.
    The data position is a pure function of the step (prompt_indices), so the step restores it."""
    if ckpt is None:
        return {"step": 0, "reward_curve": [], "nonfinite_run": 0, "wall_time": 0.0}
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    blob = torch.load(os.path.join(ckpt, f"rank{d.rank}.pt"), map_location="cpu", weights_only=True)
    # this run's
    flags = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(blob["optimizer"])
    # the moments are restored, the flags are this run's: --learning-rate, --weight-decay changed on
    # resume take effect
    for group, hyper in zip(optimizer.param_groups, flags):
        group.update(hyper)
    from torch.distributed.tensor import DTensor

    # FSDP2: this rank's shards back into DTensors laid out like the parameter
    for p, s in optimizer.state.items():
        for k, v in s.items():
            if (isinstance(p, DTensor) and not isinstance(v, DTensor)
                    and v.shape == p.to_local().shape):
                s[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                          shape=p.shape, stride=p.stride(), run_check=False)
    base_lrs = scheduler.base_lrs  # this run's --learning-rate
    # the position in the schedule; its shape is this run's flags
    scheduler.load_state_dict(blob["scheduler"])
    scheduler.base_lrs = base_lrs
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        # as LambdaLR computes it: bitwise the same when unchanged
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    _set_rng_state(blob["rng"], d)
    return state


def save_checkpoint(run_dir: str, step: int, policy: Policy, tok, optimizer, scheduler, d: Dist,
                    args, script: str, **loop_state):
    """Write {run_dir}/step_{step} (see above; trainer_state.json holds the run's flags too)
    atomically, then delete all but the newest --keep-checkpoints (0: keep all).
    The model is gathered from FSDP2 shards into one full state dict; the optimizer stays sharded,
    one file a rank."""
    from torch.distributed.tensor import DTensor

    if d.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(policy.lm,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = None
    path, tmp = os.path.join(run_dir, f"step_{step}"), os.path.join(run_dir, f".tmp_step_{step}")
    if d.main:
        from transformers.utils import logging as hf_logging

        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
        hf_logging.disable_progress_bar()  # one bar a save would break the training bar
        policy.lm.save_pretrained(tmp, state_dict=sd)
        hf_logging.enable_progress_bar()
        tok.save_pretrained(tmp)
    barrier()
    optim = optimizer.state_dict()
    optim["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                      for i, s in optim["state"].items()}
    torch.save({"optimizer": optim, "scheduler": scheduler.state_dict(), "rng": _rng_state(d)},
               os.path.join(tmp, f"rank{d.rank}.pt"))
    barrier()
    if d.main:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "world": d.world, "script": script, "args": vars(args),
                       **loop_state}, f)
    write_manifest(tmp, d)  # last: a folder without it is incomplete
    if d.main:
        if os.path.exists(path):  # the same step written again: swap, then delete the old copy
            os.rename(path, tmp + ".old")
        os.rename(tmp, path)
        shutil.rmtree(tmp + ".old", ignore_errors=True)
        done = [(n, p) for n, p in step_folders(run_dir) if is_checkpoint(p)]
        for _, old in done[:-args.keep_checkpoints] if args.keep_checkpoints else []:
            shutil.rmtree(old)
    barrier()
    return path


# -------------------- graceful stop (SIGTERM, SIGINT)
# SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C) on any rank: every rank finishes the step,
# saves a checkpoint and exits 0; --resume auto then continues exactly. A second signal exits at
# once (code 128 + signal), if it comes a second or more after the first: within that second it is
# the same event delivered twice (Ctrl-C or a scheduler signals every process of the job, and
# torchrun forwards what it gets to its workers on top).
_stop = {"signal": None, "at": 0.0, "handlers": {}}


def catch_stop_signals():
    """From here on, the first SIGTERM or SIGINT asks for a checkpoint at the end of the step
    (stop_requested)."""
    _stop["signal"] = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        _stop["handlers"].setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, _on_stop_signal)


def _on_stop_signal(signum, frame):
    if _stop["signal"] is not None and time.monotonic() - _stop["at"] >= 1.0:
        os._exit(128 + signum)
    if _stop["signal"] is not None:
        return
    _stop["signal"], _stop["at"] = signum, time.monotonic()
    # os.write: safe inside a handler, unlike print
    os.write(2, f"\n{signal.Signals(signum).name}: stopping with a checkpoint at the end of this "
                "step (a second signal exits at once)\n".encode())


def stop_requested() -> bool:
    """True on every rank when any rank got a stop signal: one flag, all-reduced (MAX) once a
    step."""
    flag = torch.tensor([0.0 if _stop["signal"] is None else 1.0])
    stop = bool(all_reduce(flag, dist.ReduceOp.MAX).item())
    if stop and int(os.environ.get("RANK", "0")) == 0:
        print("a stop signal: every rank saves a checkpoint and exits 0 (continue with --resume "
              "auto)")
    return stop


def release_stop_signals():
    """The handlers from before catch_stop_signals (tests run main() inside one process)."""
    for sig, handler in _stop["handlers"].items():
        signal.signal(sig, handler)
    _stop["handlers"].clear()


# -------------------- argument checks: every flag before any heavy work
def default_learning_rate(model: str) -> float:
    """--learning-rate when not given: the tiny model learns fast with a large step; real models
    follow the papers' scale. Each script's main() fills it in, in view, before anything reads
    it."""
    return 5e-4 if model == "tiny" else 1e-6


def default_max_new_tokens(dataset: str) -> int:
    """--max-new-tokens when not given: the built-in task's answer is one digit, then EOS; real
    tasks reason."""
    return 2 if dataset == "builtin" else 1024


def check_common_args(args):
    """Bad input fails with one line before any heavy work. Reads args, never writes them: main()
    has filled in --learning-rate and --max-new-tokens already (default_learning_rate,
    default_max_new_tokens)."""
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: group-relative advantages need at least 2 "
             "completions a prompt")
    if args.max_new_tokens <= 0:
        fail(f"--max-new-tokens {args.max_new_tokens}: must be > 0")
    if args.clip_low <= 0 or args.clip_high <= 0:
        fail(f"--clip-low {args.clip_low} / --clip-high {args.clip_high}: clip ranges must be > 0")
    if args.prompts_per_rank < 1:
        fail(f"--prompts-per-rank {args.prompts_per_rank}: must be >= 1")
    if args.num_minibatches < 1 or args.prompts_per_rank % args.num_minibatches:
        fail(f"--prompts-per-rank {args.prompts_per_rank} must be a multiple of --num-minibatches "
             f"{args.num_minibatches} (each minibatch holds whole groups)")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        fail(f"--temperature {args.temperature}: must be > 0 (RL samples from the policy)")
    if args.num_steps < 1:
        fail(f"--num-steps {args.num_steps}: must be >= 1")
    if args.micro_batch_size < 0:
        fail(f"--micro-batch-size {args.micro_batch_size}: must be >= 1 sequences, or 0 for the "
             "whole minibatch")
    if args.max_prompt_tokens < 1:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: must be >= 1")
    if args.max_nonfinite < 1:
        fail(f"--max-nonfinite {args.max_nonfinite}: must be >= 1")
    if args.cpu_offload and not torch.cuda.is_available():
        fail("--cpu-offload moves FSDP2 shards between GPU and CPU memory: it needs a GPU (drop it "
             "on CPU)")
    for flag in ("cpu_offload", "gen_unshard"):
        if getattr(args, flag) and not launched():
            fail(f"--{flag.replace('_', '-')} acts on FSDP2 shards, which plain `python` does not "
                 "make: launch with `torchrun --nproc-per-node N` (N = 1 is fine)")
    if args.eval_n is not None and args.eval_n < args.eval_k or args.eval_k < 1:
        fail(f"--eval-n {args.eval_n} / --eval-k {args.eval_k}: pass@k needs n >= k >= 1 samples a "
             "prompt")
    resume_dir = os.path.basename(os.path.normpath(args.resume or ""))
    if args.resume not in (None, "auto") and not (os.path.isdir(args.resume)
                                                  and STEP_DIR.match(resume_dir)):
        fail(f"--resume {args.resume}: not a checkpoint (a run's step_N folder); give one, or "
             "'auto' for the newest of this --exp-name and --seed")
    if args.keep_checkpoints < 0 or args.save_every < 0:
        fail(f"--keep-checkpoints {args.keep_checkpoints} / --save-every {args.save_every}: must "
             "be >= 0")
    if not 0 <= args.warmup_frac < 1 or not 0 <= args.min_lr_ratio <= 1:
        fail(f"--warmup-frac {args.warmup_frac} must lie in [0, 1) and --min-lr-ratio "
             f"{args.min_lr_ratio} in [0, 1]")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        fail(f"--learning-rate {args.learning_rate}: must be > 0")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p {args.top_p}: must lie in (0, 1] (1 is off)")
    if args.top_k < 0:
        fail(f"--top-k {args.top_k}: must be >= 0 (0 is off)")
    if args.gen_batch_size < 1:
        fail(f"--gen-batch-size {args.gen_batch_size}: must be >= 1 completions a generate call")
    if args.logprob_chunk_tokens < 1:
        fail(f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: must be >= 1")
    if not args.weight_decay >= 0 or not args.max_grad_norm > 0:
        fail(f"--weight-decay {args.weight_decay} must be >= 0 and --max-grad-norm "
             f"{args.max_grad_norm} > 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.eval_size < max(1, world):
        fail(f"--eval-size {args.eval_size}: must be >= 1 and at least the world size {world} "
             "(every rank evaluates an equal share of the held-out prompts)")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}: must be >= 0 (0: never)")
    check_dataset(args.dataset, args.data_files)
    check_run_name(args.output_dir, args.exp_name)


def check_dataset(name: str, data_files: str | None):
    """--dataset and --data-files name something that exists, before anything is read."""
    if name not in ("builtin", *DATASETS) and not name.endswith((".json", ".jsonl")):
        fail(f"--dataset {name!r}: unknown (use builtin, {', '.join(DATASETS)}, or a local .jsonl "
             "of {prompt, answer})")
    if name.endswith((".json", ".jsonl")) and not os.path.isfile(name):
        fail(f"--dataset {name!r}: no such file")
    if data_files is not None and name == "builtin":
        fail(f"--data-files {data_files!r} reads a local copy of a hub set (--dataset "
             f"{', '.join(DATASETS)}); --dataset builtin would ignore it: drop it")
    if data_files is not None and name not in DATASETS:
        fail(f"--dataset {name!r} is a local file already and --data-files {data_files!r} would be "
             "ignored: drop --data-files (it reads a local copy of a hub set in that set's own "
             "columns)")
    if data_files is not None and not glob.glob(data_files):
        fail(f"--data-files {data_files!r}: no such file")


def check_run_name(output_dir: str, exp_name: str):
    """--output-dir is (or can become) a writable folder, and --exp-name one folder name inside
    it."""
    if exp_name in ("", ".", "..") or "/" in exp_name or os.sep in exp_name:
        fail(f"--exp-name {exp_name!r}: must be one folder name (no '/', not '.' or '..'), so that "
             "the run stays inside --output-dir")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output-dir {output_dir}: is a file, not a folder")
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # the folder that makedirs would create the rest in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail(f"--output-dir {output_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--output-dir {output_dir}: {existing} is not writable")
