"""The map of what every algorithm script's loop calls, in the loop's order; the loop itself
lives in each script. Sections:
  the model            tokenizer, weights (the built-in `tiny` model too), Policy, FSDP2
  generation           HF `generate`: repeat, shared-prefill, static
  rewards              the built-in reward functions a --reward names (scoring: rewards.py)
  group advantages     A_i and the mechanism metrics (Asym, shared-token coefficient)
  old log-probs        pi_old recomputed or from the rollout (--old-logp), TIS weights, log w spread
  data order           prompts a step, minibatches of whole groups, micro-batches
  the optimizer step   learning-rate schedule, finite checks, statistics over ranks
  evaluation, logging  held-out avg@k and pass@k, tensorboard and metrics.jsonl, samples
The subsystems a reader of an algorithm need not read live in files named for them, each
imported by the scripts or by this file, none importing a script:
  distributed.py       torchrun set-up, ranks, seeds, collectives, one-line errors (the base)
  cli.py               the flags every script shares (CommonArgs) and their checks
  data.py              tasks: prompts and reference answers (built-in, hub, local files)
  rewards.py           score: rewards per completion, and the watch over a run's rewards
  grader.py            the math grader, math-verify and --reward in worker processes
                       (reward_worker.py: the worker's program)
  checkpoint.py        run folders, checkpoints, exact resume, graceful stop, a run's end
  engine.py            the rollout engine (--gen-mode engine, engine-tp)
  logprobs.py          the LM head's log-probs and entropy in chunks (Policy.forward's last step)
  lora.py              LoRA adapters (--lora-rank): applied, checked, saved, merged
  moe.py               Mixture-of-Experts routing: recorded, flips counted, replayed (--routing-replay)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe
from checkpoint import (is_checkpoint, load_masters, masters_files, model_folder_problem,
                        state_dir, writing)
from distributed import (Dist, Refused, all_gather_cat, all_reduce, fail, main_process, on_rank0,
                         seed_everything)
from grader import Reward
from logprobs import chunked_logprobs
from lora import (LoraSpec, adapter_folder, adapters_disabled, apply_lora, base_of, describe,
                  resolve_targets)
from rewards import score


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


TINY_MODELS = ("tiny", "tiny-moe")  # --model names built here, offline, random-init


def tiny_config(tok, moe: bool = False):
    """The config of `--model tiny`: a Qwen3 sized for CPU (tied embeddings, as small Qwen3s).
    moe (`--model tiny-moe`): the same sizes as a Qwen3-MoE (Qwen3-30B-A3B's architecture): every
    decoder layer's MLP is 8 experts of width 96, each token routed to its top 2 by a softmax router
    whose top-k weights are renormalised (norm_topk_prob, as Qwen3-30B-A3B)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    sizes = dict(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    if moe:
        return Qwen3MoeConfig(**sizes, moe_intermediate_size=96, num_experts=8,
                              num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    return Qwen3Config(**sizes)


def tiny_model(tok, moe: bool = False):
    """A randomly initialised Qwen3-architecture model of tiny_config (moe: Qwen3-MoE)."""
    from transformers import GenerationConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    lm = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(tiny_config(tok, moe))
    lm.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                            pad_token_id=tok.pad_token_id)
    return lm


def check_model(name: str, trust_remote_code: bool, gen_mode: str = "shared-prefill",
                old_logp: str = "recompute", rollout_is_cap: float | None = None,
                routing_replay: bool = False):
    """Fail fast, before any weights are read: 'tiny', 'tiny-moe', a local folder with a config, or
    a hub id; for --gen-mode engine / engine-tp, what the config alone tells (check_engine); and
    the flags that need what the config tells (check_model_flags)."""
    if name in TINY_MODELS:
        config = tiny_config(tiny_tokenizer(), name == "tiny-moe")
        check_engine(config, gen_mode)
        return check_model_flags(name, config, gen_mode, old_logp, rollout_is_cap, routing_replay)
    check_not_gguf(name)
    looks_local = name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        fail(f"--model {name!r}: no such folder (give 'tiny', a local model folder, or a hub id "
             "like Qwen/Qwen3-0.6B)")
    if is_checkpoint(os.path.expanduser(name)):  # step_N holds model/ (the export) and state/
        export = os.path.join(name, "model")
        fail(f"--model {name!r}: a checkpoint folder; give its model, {export} (or continue the "
             f"run with --resume {name})")
    if not looks_local:
        check_hub_model(name)
    elif (problem := model_folder_problem(os.path.expanduser(name))) is not None:
        fail(f"--model {name!r}: {problem}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(name),
                                            trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"--model {name!r}: cannot read its config ({first})")
    check_engine(config, gen_mode)
    check_model_flags(name, config, gen_mode, old_logp, rollout_is_cap, routing_replay)


def check_model_flags(name: str, config, gen_mode: str, old_logp: str,
                      rollout_is_cap: float | None, routing_replay: bool):
    """--old-logp rollout and --rollout-is-cap read the log-probs the engine returns as it samples
    (generate's roll["logp"]): one line where the generation mode returns none (HF generate, and the
    engine's HF fallback for an architecture it does not cover). --routing-replay: one line on a
    dense model."""
    import engine

    needs = "--old-logp rollout" if old_logp == "rollout" else (
        "--rollout-is-cap" if rollout_is_cap is not None else None)
    if needs and gen_mode not in ("engine", "engine-tp"):
        fail(f"{needs} reads the log-probs the engine computes as it samples; --gen-mode {gen_mode} "
             "(HF generate) returns none: use --gen-mode engine, or drop it")
    if needs and (why := engine.unsupported(config)):
        fail(f"{needs} reads the log-probs the engine computes as it samples; --model {name}: "
             f"HF generate runs in its place for {why}, and returns none: drop {needs}")
    if routing_replay and not moe.is_moe(config):
        fail(f"--routing-replay forces the old pass's experts in each Mixture-of-Experts layer; "
             f"--model {name} ({config.model_type}) is dense: drop it")


def check_hub_model(name: str):
    """A hub id that can be neither downloaded nor read from the cache fails in one line within
    seconds (one connection to the endpoint, data.unreachable_hub), naming the fix, where
    transformers would retry for ~30 s and print a dozen lines."""
    from huggingface_hub import try_to_load_from_cache

    from data import hub_offline, unreachable_hub

    cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    if hub_offline() and not cached:
        fail(f"--model {name}: not in the Hugging Face cache, and HF_HUB_OFFLINE is set; download "
             f"it once where there is a network (huggingface-cli download {name}), or give a "
             "local model folder")
    if (why := unreachable_hub()):
        fix = ("it is in the cache: set HF_HUB_OFFLINE=1 to use the cached copy" if cached else
               "give a local model folder (one with config.json), or download it once where "
               "there is a network and set HF_HUB_OFFLINE=1")
        fail(f"--model {name}: {why}; {fix}")


def check_not_gguf(name: str):
    """A GGUF file (llama.cpp's quantized format), or a folder holding one and no config.json: one
    line naming the conversion to a model folder (tools/real_model.py), which every path here loads
    (the scripts save, shard and resume plain HF weights, not GGUF)."""
    path = os.path.expanduser(name)
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf")) if (
        os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json"))) else []
    if name.lower().endswith(".gguf") or ggufs:
        gguf = os.path.join(name, ggufs[0]) if ggufs else name
        fail(f"--model {name!r}: a GGUF file, not a model folder; convert it first with python "
             f"tools/real_model.py --gguf {gguf} --out FOLDER, then give --model FOLDER")


def check_engine(config, gen_mode: str):
    """--gen-mode engine / engine-tp, before the model is built: an architecture the engine does
    not cover is said in one line (HF generate runs instead, engine_covers); heads that do not split
    over the processes fail in one line."""
    if gen_mode not in ("engine", "engine-tp") or not engine_covers(config, main_process()):
        return
    if gen_mode == "engine-tp":
        check_tensor_parallel(config, int(os.environ.get("WORLD_SIZE", "1")))


def check_tensor_parallel(config, world: int):
    """--gen-mode engine-tp over `world` processes: one line when the heads do not split."""
    import engine

    if why := engine.tensor_parallel_fits(config, world):
        fail(f"--gen-mode engine-tp: {why}; use --gen-mode engine, or a number of processes that "
             "divides them")


def load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = tiny_tokenizer() if name in TINY_MODELS else AutoTokenizer.from_pretrained(
        os.path.expanduser(name), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"  # prompts are left-padded for generation
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def compute_dtype(dtype: str, d: Dist) -> torch.dtype:
    """--dtype's compute dtype: auto is bf16 on GPU, fp32 on CPU; bf16 and bf16-pure are bf16."""
    if dtype == "auto":
        return torch.bfloat16 if d.device.type == "cuda" else torch.float32
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def weights_dtype(dtype: str) -> torch.dtype:
    """--dtype's dtype of the weights, and so of their gradients and AdamW state: fp32 master
    weights (computed in bf16 where the compute dtype is bf16), except with bf16-pure."""
    return torch.bfloat16 if dtype == "bf16-pure" else torch.float32


def load_model(name: str, tok, d: Dist, seed: int, trust_remote_code: bool = False,
               dtype: str = "auto", lora: LoraSpec | None = None):
    """One process: the model on its device, fp32 master weights (bf16 with --dtype bf16-pure);
    wrap_policy has them computed in the compute dtype. Under torchrun: fp32 master weights (FSDP2
    casts them to the compute dtype, wrap_policy) built on the meta device on every rank, while
    rank 0 alone reads the weights into CPU memory; wrap_policy shards the model and sends each rank
    its shards. A node thus holds one full copy on CPU, not one per rank, and no GPU ever holds the
    whole fp32 model.
    lora (--lora-rank > 0, lora.py): the base frozen in the compute dtype (bf16 on a GPU) with fp32
    adapters on the target modules (checked first, on a model without weights); a LoRA checkpoint
    as `name` (resume, or --model step_N) is its base (its --model) with its adapters.
    A torchrun checkpoint's master weights are each rank's rows (checkpoint.write_masters): under
    FSDP2 every rank reads its own rows in wrap_policy, and rank 0 reads no full copy; in one
    process they are put together here.
    Returns (model, rank0_weights): under FSDP2 rank 0's (state dict, buffers) for wrap_policy to
    scatter, or the folder of a checkpoint's sharded master weights; None otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    # `tiny` is random-init: the same seed gives the same weights (policy and reference)
    seed_everything(seed)
    adapters = None
    if lora is not None:  # LoRA: the base (a checkpoint's own base) and its adapters, if any
        adapters, name = adapter_folder(name), base_of(name)
    path = os.path.expanduser(name)
    if is_checkpoint(path):  # resume: the master weights of its training state, not the export
        path = state_dir(path)
    # written under torchrun, one file a rank (a LoRA checkpoint keeps adapters instead)
    sharded_masters = bool(masters_files(path))
    if sharded_masters and lora is not None:
        fail(f"--model {name}: the training state of a torchrun checkpoint (its master weights, "
             "one file a rank) cannot be a LoRA base; give its export, step_N/model")
    frozen = None if lora is None else compute_dtype(dtype, d)  # the base's dtype under LoRA

    def skeleton(dt):
        """The model without weights (the meta device), with its generation config."""
        if name in TINY_MODELS:
            with torch.device("meta"):
                return tiny_model(tok, name == "tiny-moe").to(dt)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                dtype=dt, trust_remote_code=trust_remote_code)
        # EOS ids as from_pretrained reads them (the file, else the config)
        with contextlib.suppress(OSError):
            lm.generation_config = GenerationConfig.from_pretrained(path)
        return lm

    targets = None if lora is None else resolve_targets(skeleton(torch.float32), lora.targets)

    def adapt(lm):
        return lm if lora is None else apply_lora(lm, lora, targets, name, adapters)

    def build(dt):
        if name in TINY_MODELS:
            return tiny_model(tok, name == "tiny-moe").to(dt)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dt,
                                                    trust_remote_code=trust_remote_code)

    rank0_weights = None
    if not d.sharded and sharded_masters:  # every old rank's rows, into one model
        lm = skeleton(weights_dtype(dtype)).to_empty(device="cpu")
        lm.tie_weights()  # to_empty gives tied weights a tensor each
        load_masters(lm, path, d)
        lm = lm.to(d.device)
    elif not d.sharded:
        lm = adapt(build(frozen or weights_dtype(dtype)).to(d.device))
    elif sharded_masters:  # each rank reads its own rows in wrap_policy
        lm, rank0_weights = skeleton(torch.float32), path
    else:
        lm = skeleton(frozen or torch.float32)
        # rank 0's adapters drawn first, as one process draws them (peft's init on the meta device
        # still draws from the RNG)
        src = adapt(build(frozen or torch.float32)) if d.main else None
        lm = adapt(lm)
        # for wrap_policy
        rank0_weights = (src.state_dict(), dict(src.named_buffers())) if d.main else None
    lm.config.use_cache = True
    if lora is not None and d.main:
        print(describe(lm))
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
    head).
    autocast: None (the weights' own dtype), or the dtype fp32 weights are computed in (wrap_policy:
    plain `python` with a bf16 compute dtype). forward then runs the model under torch.autocast,
    which casts each weight to bf16 once per call (the copy is cached for the call) while the
    residual stream and the norms stay fp32; the LM head takes bf16 copies of its input and
    weight, as autocast's matmul would, and its log-probs are fp32 as always (chunked_logprobs).
    generate runs on bf16 copies of the weights instead, made once per call: the model as FSDP2's
    MixedPrecisionPolicy runs it (bf16 weights and activations, a bf16 KV cache). Under autocast
    HF's KV cache would be fp32 (the q/k norms' fp32 weights promote the keys, and the values
    follow them): twice the memory, a cast of the activations before every matmul of every decoded
    token, and a static cache (--gen-mode static) that fails on the values' dtype."""

    def __init__(self, lm, temperature: float = 1.0, chunk_tokens: int = 1024,
                 autocast: torch.dtype | None = None):
        super().__init__()
        self.lm, self.temperature, self.chunk_tokens = lm, temperature, chunk_tokens
        self.autocast = autocast

    def compute(self):
        """The context forward runs the model in: torch.autocast to self.autocast on the model's
        device, or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.lm.device.type, dtype=self.autocast)

    @contextlib.contextmanager
    def compute_weights(self):
        """The context generate runs the model in: each weight replaced by a copy in self.autocast
        for the block (one cast a call, for the prefill and every decoded token), the fp32 master
        weights put back after; nothing without autocast."""
        if self.autocast is None:
            yield
            return
        params = list(self.lm.parameters())  # each once: the tied embedding and LM head are one
        masters = [p.data for p in params]
        try:
            for p in params:
                p.data = p.data.to(self.autocast)
            yield
        finally:
            for p, master in zip(params, masters):
                p.data = master

    def generate(self, input_ids, attention_mask, n: int = 1, **kw):
        """HF `generate` for the prompts input_ids [B, P] (left-padded). n > 1: n completions of
        each prompt, rows of one prompt adjacent, with each prompt prefilled once: its KV cache over
        all its tokens but the last is computed for the B prompts and repeated n times, and
        `generate` starts from the last prompt token of each of the B x n rows, as if every prompt
        had been given n times. Under FSDP2 the root unit stays gathered for the whole call
        (register_fsdp_forward_method), the prefill included. With autocast, on bf16 copies of the
        weights (compute_weights)."""
        with self.compute_weights():
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
        the backward pass, so the extra memory is O(chunk x V), never O(B x T x V). Completion
        positions the attention mask leaves out (the padding after the first EOS) read 0 and get no
        gradient; a pass without gradient does not score them at all (chunked_logprobs' keep)."""
        # as generate() does with left padding
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        with self.compute():
            h = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, use_cache=False).last_hidden_state
        B, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
        h = h[:, n_prompt - 1:-1].reshape(B * T, -1)  # hidden state at t-1 predicts token t
        targets = input_ids[:, n_prompt:].reshape(B * T)
        keep = attention_mask[:, n_prompt:].reshape(B * T).bool()
        head = self.lm.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if self.autocast is not None:  # the LM head's product in bf16, as autocast runs a matmul
            h, weight = h.to(self.autocast), weight.to(self.autocast)
            bias = None if bias is None else bias.to(self.autocast)
        out = chunked_logprobs(h, weight, bias, targets, self.temperature, self.chunk_tokens,
                               entropy, keep)
        logp, ent = out if entropy else (out, None)
        logp = logp.view(B, T).clone()  # not a view: FSDP2 hooks the output for backward
        return (logp, ent.view(B, T)) if entropy else logp


def wrap_policy(lm, d: Dist, temperature: float, chunk_tokens: int, activation_checkpointing: bool,
                dtype: str = "auto", cpu_offload: bool = False, rank0_weights=None) -> Policy:
    """Plain `python`: the plain model, its weights (fp32, bf16 with --dtype bf16-pure, load_model)
    computed in the compute dtype under torch.autocast (Policy) where that is not theirs. Under
    torchrun (one process too): FSDP2, `fully_shard` on each decoder layer, then the root (the tied
    embedding/LM head stay together in the root unit), with fp32 shards computed in `dtype` and
    gradients reduced in fp32 (MixedPrecisionPolicy); rank 0's weights (load_model's rank0_weights)
    are then scattered to the shards, or each rank reads its rows of a checkpoint's sharded master
    weights (rank0_weights: their folder, checkpoint.load_masters)."""
    if activation_checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # generation still uses the KV cache (checkpointing acts only in training)
        lm.config.use_cache = True
    compute = compute_dtype(dtype, d)
    # the trained weights' dtype (under LoRA the adapters', fp32 beside a bf16 base)
    weights = next((p for p in lm.parameters() if p.requires_grad), next(lm.parameters())).dtype
    autocast = compute if not d.sharded and compute != weights else None
    policy = Policy(lm, temperature, chunk_tokens, autocast)
    policy.compute_dtype = compute  # what --gen-mode engine decodes in
    if not d.sharded and d.main and compute == torch.bfloat16:
        print("one process: " + ("fp32 master weights and AdamW state, computed in bf16 "
                                 "(torch.autocast)" if autocast else
                                 "bf16 weights and AdamW state (updates below bf16's resolution "
                                 "are lost)"))
    if d.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard, register_fsdp_forward_method)

        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        if d.main:
            print(f"FSDP2 over {d.world} process(es): {len(lm.get_decoder().layers)} decoder "
                  f"layers + the root, fp32 master weights computed in {compute}"
                  + (", CPU offload" if cpu_offload else ""))
        # sum the gradients over ranks: each rank's loss is already divided by the minibatch's count
        # over all ranks (the loss's `norm`)
        for m in policy.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        register_fsdp_forward_method(policy, "generate")
        # meta -> real (uninitialised) shards
        policy.to_empty(device="cpu" if cpu_offload else d.device)
        # buffers (rotary inv_freq: outside the state dict) live on the GPU even with --cpu-offload
        for mod in lm.modules():
            for n, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[n] = b.to(d.device)
        if isinstance(rank0_weights, str):  # a torchrun checkpoint: each rank reads its own rows
            load_masters(lm, rank0_weights, d)
            return policy
        state, buffers = rank0_weights or ({}, {})
        set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=True))
        for n, b in lm.named_buffers():  # from rank 0 too
            if d.main:
                b.copy_(buffers[n])
            dist.broadcast(b, src=0)
        del state, buffers
    return policy


def reference_policy(args, tok, d: Dist, policy: Policy | None = None):
    """The frozen reference of the KL penalty (--kl-coef): the initial model, --model (not the
    checkpoint a run resumes from), loaded and wrapped as the policy is, without gradients or
    activation checkpointing; under LoRA the policy itself with its adapters off (the base: no
    second copy, lora.adapters_disabled); None at --kl-coef 0, when no second model is loaded at
    all."""
    if args.kl_coef == 0:
        return None
    if getattr(args, "lora_rank", 0) > 0:
        return adapters_disabled(policy)
    ref_lm, ref_weights = load_model(args.model, tok, d, args.seed, args.trust_remote_code,
                                     args.dtype)
    return wrap_policy(ref_lm.requires_grad_(False), d, args.temperature,
                       args.logprob_chunk_tokens, False, args.dtype, args.cpu_offload,
                       ref_weights).eval()


# -------------------- generation
GEN_MODES = ("repeat", "shared-prefill", "static", "engine", "engine-tp")


@torch.no_grad()
def generate(policy: Policy, tok, prompts: list[str], n: int, eos: list[int], d: Dist, *,
             max_new_tokens: int, temperature: float, top_p: float, top_k: int, gen_batch_size: int,
             min_p: float = 0.0, repetition_penalty: float = 1.0,
             unshard: bool = False, mode: str = "shared-prefill", cuda_graphs: bool = True,
             flex: bool | None = None, compile_step: bool | None = None,
             engine_dtype: str = "auto") -> dict:
    """n completions per prompt (rows of one prompt are adjacent: a group). Returns input_ids [B,
    P+T], attention_mask, n_prompt P, completion mask [B, T] (up to and including the first EOS),
    truncated [B], texts, and with mode "engine" logp [B, T], each token's log-prob as sampled.
    Every mode samples as HF's generate does: repetition_penalty (on the prompt's and the
    completion's ids), temperature, top_k, top_p, min_p (0: off).
    mode "repeat": each prompt repeated n times, so `generate` prefills it n times, gen_batch_size
    rows a call.
    mode "shared-prefill": each prompt prefilled once and its KV cache repeated to its n rows
    (Policy.generate), whole groups a call, max(1, gen_batch_size // n) prompts. mode "static": as
    repeat, with a KV cache allocated once for the whole call and written in place (no copy of the
    cache per token); on a GPU, with the model unsharded (plain `python`), transformers compiles the
    decoding step (torch.compile; recompiled only when the cache or batch grows); under FSDP2 it
    stays eager. mode "engine": engine.py, gen_batch_size rows decoding at once (continuous
    batching), whole groups admitted. mode "engine-tp": the engine's layers split over the ranks
    (tensor parallel), every rank decoding every rank's prompts (world x gen_batch_size rows) and
    keeping its own. Same tokens under greedy decoding (top_k=1). cuda_graphs: the engine's decoding
    step replayed as CUDA graphs on a GPU (one rank; engine.Engine.step), else eager. flex: the
    engine's decoding attention (engine.generate's; None: FlexAttention on a GPU, SDPA on the CPU;
    benchmarks/gpu.py compares the two). compile_step: the engine's decoding step compiled
    (engine.generate's compile; None: with the CUDA graphs, on a GPU). engine_dtype (--gen-dtype):
    the engine's weights and KV cache in bf16 or fp32 whatever the trainer computes in (auto: the
    trainer's compute dtype), the inference/training numerics mismatch of GSPO's infrastructure
    claim made on purpose."""
    if mode not in GEN_MODES:
        raise ValueError(f"unknown generation mode {mode!r} ({', '.join(GEN_MODES)})")
    enc = tok(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.to(d.device), enc.attention_mask.to(d.device)
    if mode in ("engine", "engine-tp") and engine_covers(policy.lm.config, d.main):
        import engine

        mine = [row[m.bool()].tolist() for row, m in zip(ids, am)]  # this rank's prompts, unpadded
        tp = d.world if mode == "engine-tp" else 1
        check_tensor_parallel(policy.lm.config, tp)  # for callers that skip check_model
        everyone, generator = [mine], None
        if tp > 1:  # every rank decodes every rank's prompts, with the same random stream
            everyone = [None] * tp
            dist.all_gather_object(everyone, mine)
            seed = all_reduce(torch.randint(2 ** 62, (1,)) * d.main)  # rank 0's draw
            generator = torch.Generator(d.device).manual_seed(int(seed))
        try:
            completions, logps = engine.generate(
                policy.lm, sum(everyone, []), n, eos, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty,
                slots=tp * max(n, gen_batch_size // n * n), device=d.device,
                dtype={"bf16": torch.bfloat16, "fp32": torch.float32}.get(engine_dtype) or getattr(
                    policy, "compute_dtype", None) or (
                    torch.bfloat16 if d.device.type == "cuda" else torch.float32),
                rank=d.rank if tp > 1 else 0, world=tp, generator=generator,
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
            if not d.main:  # only this rank knows: fail() prints on rank 0 alone
                print(f"error: rank {d.rank}: {msg}", file=sys.stderr)
            fail(msg)
        first = sum(len(p) for p in everyone[:d.rank]) * n if tp > 1 else 0  # this rank's rows
        completions = completions[first:first + len(mine) * n]
        logps = logps[first:first + len(mine) * n]
        T = max(len(c) for c in completions)
        comp = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in completions],
                            device=d.device)
        roll = rollout(ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0), comp, tok, eos)
        roll["logp"] = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], device=d.device)
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
    static = (dict(cache_implementation="static", disable_compile=d.sharded) if mode == "static"
              else {})
    outs = []
    with gathered(policy, unshard):
        for i in range(0, ids.shape[0], rows):
            outs.append(policy.generate(
                input_ids=ids[i:i + rows], attention_mask=am[i:i + rows], n=n if shared else 1,
                do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=min_p or None, repetition_penalty=repetition_penalty,
                max_new_tokens=max_new_tokens, eos_token_id=eos,
                # FSDP: every rank steps until all are done
                pad_token_id=tok.pad_token_id, synced_gpus=d.sharded,
                **static,
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


_ENGINE_FALLBACK = []  # the one line saying why HF generate runs in the engine's place, said once


def engine_covers(config, main: bool) -> bool:
    """--gen-mode engine: True when engine.py covers this architecture; else one line (once, from
    the main process) that HF generate (shared-prefill) runs instead."""
    import engine

    why = engine.unsupported(config)
    if why and not _ENGINE_FALLBACK:
        _ENGINE_FALLBACK.append(why)
        if main:
            print(f"--gen-mode engine does not cover {why}: generating with HF generate "
                  "(shared-prefill) instead", file=sys.stderr)
    return why is None


def logp_drift(roll: dict, old_logp: torch.Tensor) -> dict:
    """gen/logp_drift: the mean |log-prob as sampled - old log-prob| over the completion tokens of
    every rank (the engine's decode against the training forward; it catches engine bugs). Empty
    when the rollout has no sampled log-probs (the HF modes), or when they are pi_old itself
    (--old-logp rollout: nothing to compare)."""
    if "logp" not in roll or old_logp is roll["logp"]:
        return {}
    mask = roll["mask"]
    total = all_reduce(((roll["logp"] - old_logp).abs() * mask).sum())
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
                     std: str = "population", eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std + eps) (DFPO eq. 43). std: 'population' (divide the squared
    deviations by n; the blog's worked example: rewards [1,0,1,0] give A = [+1,-1,+1,-1]) or
    'bessel' (by n - 1, as TRL's nanstd and verl's torch.std: [1,0,0,0] gives A_1 = 1.5 where
    population gives 1.732). scale: the std of the group (eq. 43), of the whole batch over all
    ranks (TRL/verl "batch"), or none (centring only, Dr. GRPO). eps: 1e-6 (verl's), TRL's 1e-4.
    Groups with equal rewards get A = 0; their count is returned."""
    if std not in ("population", "bessel"):
        raise ValueError(f"unknown std {std!r} (population or bessel)")
    unbiased = std == "bessel"
    r = rewards.view(-1, group_size).double()
    centred = r - r.mean(1, keepdim=True)
    group_std = r.std(1, unbiased=unbiased, keepdim=True)
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (all_gather_cat(rewards.double()).std(unbiased=unbiased).item() + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown scale {scale!r} (group, batch or none)")
    return adv.view(-1).float(), int((group_std.squeeze(1) == 0).sum())


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
def old_log_probs(policy, roll: dict, minibatches: list[slice], source: str = "recompute",
                  is_cap: float | None = None, routes: moe.Routes | None = None):
    """pi_old of every completion token [B, T], the TIS weights [B, T] (None without is_cap), and
    their logs.
    source "recompute": the training forward without gradient, a minibatch at a time, so that the
    ratio's numerator and denominator come from the same numerics (losses/entropy logged; on an MoE
    model each (token, layer)'s experts go to the router tape, moe.recording). "rollout"
    (--old-logp rollout): the log-prob the engine computed when it sampled each token, under the
    sampling temperature (roll["logp"]); no forward pass, the saving GSPO (arXiv 2507.18071) claims
    its sequence ratio affords, as it averages the per-token mismatch between the two numerics.
    is_cap C (--rollout-is-cap): truncated importance sampling (TIS: Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's rollout correction,
    TRL's vllm_importance_sampling_correction): the tokens were drawn from the engine's pi_rollout,
    not pi_old, so each token's loss term is weighted by min(pi_old / pi_rollout, C), a constant."""
    if source == "rollout":
        return roll["logp"], None, {}
    ids, attention_mask, n_prompt = roll["input_ids"], roll["attention_mask"], roll["n_prompt"]
    old = []
    for rows in minibatches:
        with moe.recording(routes, rows, attention_mask):
            old.append(policy(ids[rows], attention_mask[rows], n_prompt, entropy=True))
    old_logp = torch.cat([minibatch_logp for minibatch_logp, _ in old])
    entropy = torch.cat([minibatch_entropy for _, minibatch_entropy in old])
    mask = roll["mask"]
    tokens = all_reduce(mask.sum()).clamp(min=1)  # completion tokens on all ranks
    stats = {"losses/entropy": (all_reduce((entropy * mask).sum()) / tokens).item()}
    if is_cap is None:
        return old_logp, None, stats
    log_ratio = torch.where(mask.bool(), old_logp - roll["logp"], 0.0)  # log pi_old / pi_rollout
    weight = torch.exp(log_ratio.clamp(max=math.log(is_cap)))  # min(pi_old / pi_rollout, C)
    stats["rollout_is/weight_mean"] = (all_reduce((weight * mask).sum()) / tokens).item()
    capped = (log_ratio > math.log(is_cap)).float() * mask
    stats["rollout_is/capped_frac"] = (all_reduce(capped.sum()) / tokens).item()
    return old_logp, weight, stats


def log_ratio_spread(logp, old_logp, mask, first: bool) -> dict:
    """The variance of the token log-ratios log w_it = log pi - log pi_old over a micro-batch's
    completion tokens, as (sum, sum of squares, count) for reduce_stats, keyed by whether the
    minibatch is the step's first (where pi = pi_old: 0 up to float error, unless an MoE's routing
    or the rollout's numerics differ) or a later one (pi has taken optimizer steps)."""
    with torch.no_grad():
        x = torch.where(mask.bool(), logp - old_logp, 0.0).double()
        moments = (x.sum(), (x * x).sum(), mask.sum().double())
        zero = (torch.zeros((), dtype=torch.float64),) * 3
    return {"losses/log_ratio_var_first": moments if first else zero,
            "losses/log_ratio_var_later": zero if first else moments}


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


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every tensor is finite on every rank: one decision that all ranks share."""
    ok = torch.stack([torch.isfinite(t).all() for t in tensors]).all().float().view(1)
    return bool(all_reduce(ok, dist.ReduceOp.MIN).item())  # one host sync, not one a tensor


def reduce_stats(stats: list[dict]) -> dict:
    """One value a key over a step's micro-batches and all ranks: a mean given as (sum, count) is
    the sum of the sums over the sum of the counts, whatever the rows' split; a variance given as
    (sum, sum of squares, count) likewise (absent when nothing was counted); keys ending in
    _min/_max take min/max; any other scalar (one a minibatch) the mean over entries, then ranks."""
    out = {}
    for k in stats[0]:
        if isinstance(stats[0][k], tuple) and len(stats[0][k]) == 3:  # (sum, sum of squares, n)
            total = all_reduce(torch.tensor([[float(x) for x in s[k]] for s in stats],
                                            dtype=torch.float64).sum(0))
            if total[2] > 0:  # the population variance; none counted (no such minibatch): absent
                out[k] = (total[1] / total[2] - (total[0] / total[2]) ** 2).item()
            continue
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
             top_k: int, gen_batch_size: int, min_p: float = 0.0, repetition_penalty: float = 1.0,
             unshard: bool = False, mode: str = "shared-prefill", cuda_graphs: bool = True,
             engine_dtype: str = "auto") -> dict:
    """Over the held-out prompts (each rank an equal share), from n >= k samples a prompt (n
    defaults to k): avg@k, the mean accuracy of the n samples (an unbiased estimate of the mean
    accuracy of k samples, the DFPO paper's metric), and pass@k, the mean over prompts of the
    unbiased 1 - C(n - c, k) / C(n, k) (pass_at_k); the reward is the task's own, whole whether
    or not a completion stopped (truncated_frac: the fraction cut at max_new_tokens)."""
    n = n or k
    m = len(held) // d.world * d.world  # equal shares, or the FSDP all-gathers would hang
    if m == 0:
        fail(f"the held-out split has {len(held)} prompt(s), fewer than the {d.world} ranks that "
             "share it: give a larger dataset (a local file holds out a tenth, at most "
             "--eval-size) or --eval-every 0")
    rows = held.select(range(d.rank, m, d.world))
    r, errors, cut = torch.zeros(0), 0, 0
    per_call = max(1, gen_batch_size // n)  # prompts per generate call
    for i in range(0, len(rows), per_call):
        part = rows.select(range(i, min(i + per_call, len(rows))))
        out = generate(policy, tok, part["text"], n, eos, d, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       repetition_penalty=repetition_penalty,
                       gen_batch_size=gen_batch_size, unshard=unshard, mode=mode,
                       cuda_graphs=cuda_graphs, engine_dtype=engine_dtype)
        part_r, part_errors = score(out["texts"], part, n, reward, watch=False)
        r, errors = torch.cat([r, part_r]), errors + part_errors
        cut += int(out["truncated"].sum())
    r = r.view(-1, n)
    passk = sum(pass_at_k(n, int(c), k) for c in (r > 0).sum(1))
    s = all_reduce(torch.tensor([r.mean(1).sum(), passk, len(rows), errors, cut], dtype=torch.float64))
    return {f"eval/avg@{k}": (s[0] / s[2]).item(), f"eval/pass@{k}": (s[1] / s[2]).item(),
            "eval/prompts": m, "eval/samples": n, "eval/reward_errors": s[3].item(),
            "eval/truncated_frac": (s[4] / (s[2] * n)).item()}


def eval_report(result: dict, args, run_dir: str, d: Dist) -> str:
    """--eval-only: the table printed, and eval.json in the run folder (its key: the set
    evaluated, --eval-dataset or --dataset). Returns the JSON path."""
    path = os.path.join(run_dir, "eval.json")
    dataset = args.dataset if args.eval_dataset is None else args.eval_dataset
    part = "held-out" if dataset == "builtin" else "whole set"  # --eval-only: the whole file
    if args.eval_limit and dataset != "builtin":
        part = f"first {args.eval_limit}"
    if d.main:
        k = next(key for key in result if key.startswith("eval/avg@")).split("@")[1]
        print(f"\n| dataset | prompts | samples a prompt | avg@{k} | pass@{k} | reward errors |\n"
              "|---|---|---|---|---|---|\n"
              f"| {dataset} ({part}) | {result['eval/prompts']} | {result['eval/samples']} | "
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
        self.d, self.writer, self.wandb, self.run_dir = d, None, None, run_dir
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
        if getattr(args, "track", False):  # --track: Weights & Biases too, the same keys (CleanRL)
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity,
                                    name=os.path.basename(os.path.normpath(run_dir)),
                                    config=vars(args), dir=run_dir, resume="allow",
                                    id=os.path.basename(os.path.normpath(run_dir)))

    def log(self, step: int, scalars: dict):
        if not self.d.main:
            return
        # strict JSON: null, not NaN
        row = {k: v if math.isfinite(v) else None for k, v in scalars.items()}
        with writing(self.run_dir, self.metrics.name):  # a full disk, a deleted run folder
            for k, v in row.items():
                if v is not None:
                    self.writer.add_scalar(k, v, step)
            self.metrics.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
            self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)

    def close(self):
        if self.d.main:
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


SAMPLE_PROMPTS = 2  # prompts a --log-samples step shows, each with all its completions


def log_samples(logger: Logger, run_dir: str, step: int, every: int, prompts, answers,
                texts: list[str], rewards: torch.Tensor, advantages: torch.Tensor, n: int,
                prompt_texts: list[str] | None = None):
    """Every `every` steps (0: never; main rank only): the first SAMPLE_PROMPTS prompts of this
    rank's step with their n completions, rewards and advantages, as a text table in tensorboard
    ('samples') and as one JSON object a completion in {run_dir}/samples.jsonl (a resumed run's
    Logger has dropped the rows of the steps it redoes). prompt_texts: the prompts as the model saw
    them (through the chat template), logged in samples.jsonl as "prompt_text"."""
    if not every or step % every or not logger.d.main:
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
