"""What every algorithm script shares: torchrun/FSDP2 set-up, model and tokenizer loading (with the
built-in `tiny` model), tasks and the math reward, HF generation, memory-bounded log-probs, group
advantages, logging, evaluation and checkpoints. The training loop itself lives in each script.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


def fail(msg: str):
    """Stop with one line that says what was wrong and what to do (no traceback)."""
    raise SystemExit(f"error: {msg}")


# ----------------------------------------------------------------------------- distributed set-up
@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(seed: int) -> Dist:
    """Read torchrun's environment (plain `python x.py` is world size 1); NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend, dev = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:  # launched by something other than torchrun: plain env:// rendezvous
            dist.init_process_group(backend, device_id=dev)
        else:  # torchrun keeps its TCP store across --max-restarts attempts; without a prefix per attempt a restarted
            # job reads the dead attempt's addresses and cannot connect
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                                  timeout=dist.constants.default_pg_timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                                    world_size=world, device_id=dev)
    seed_everything(seed)  # same seed on every rank while the model is built; see seed_rank()
    return Dist(rank, world, local_rank, device)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, d: Dist):
    """Per-rank seed for sampling, after the (identical) model init on every rank."""
    seed_everything(seed + 1_000_003 * d.rank)


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or op) over ranks, returned on t's device; the collective runs where the backend needs it (NCCL: GPU)."""
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


# ----------------------------------------------------------------------------- the built-in tiny model
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (= EOS)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A real HF fast tokenizer over characters (printable ASCII and newline), Qwen-style specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars + ["<|unk|>"])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))  # no merges: one token a char
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(TINY_SPECIALS + ["<|unk|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|unk|>",
        chat_template=TINY_CHAT_TEMPLATE, padding_side="left",
    )


def tiny_model(tok):
    """A randomly initialised Qwen3-architecture model sized for CPU (tied embeddings, as small Qwen3s)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    lm = Qwen3ForCausalLM(cfg)
    lm.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return lm


# ----------------------------------------------------------------------------- model loading
def check_model(name: str, trust_remote_code: bool):
    """Fail fast, before any weights are read: 'tiny', a local folder with a config, or a hub id."""
    if name == "tiny":
        return
    looks_local = name.startswith((".", "/", "~")) or os.path.exists(name) or name.count("/") != 1
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        fail(f"--model {name!r}: no such folder (give 'tiny', a local model folder, or a hub id like Qwen/Qwen3-0.6B)")
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


def load_model(name: str, tok, d: Dist, seed: int, trust_remote_code: bool = False, dtype: str = "auto"):
    """One process: the model on its device in the compute dtype. Under torchrun: fp32 master weights (FSDP2 casts
    them to the compute dtype, wrap_policy) built on the meta device on every rank, while rank 0 alone reads the
    weights into CPU memory; wrap_policy shards the model and sends each rank its shards. A node thus holds one full
    copy on CPU, not one per rank, and no GPU ever holds the whole fp32 model."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    seed_everything(seed)  # `tiny` is random-init: the same seed gives the same weights (policy and reference)
    path = os.path.expanduser(name)

    def build(dt):
        if name == "tiny":
            return tiny_model(tok).to(dt)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code)

    if d.world == 1:
        lm = build(compute_dtype(dtype, d)).to(d.device)
    else:
        with torch.device("meta"):
            lm = tiny_model(tok) if name == "tiny" else AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), dtype=torch.float32,
                trust_remote_code=trust_remote_code)
        if name != "tiny":
            with contextlib.suppress(OSError):  # EOS ids as from_pretrained reads them (the file, else the config)
                lm.generation_config = GenerationConfig.from_pretrained(path)
        src = build(torch.float32) if d.main else None
        lm.rank0_state = (src.state_dict(), dict(src.named_buffers())) if d.main else None  # taken by wrap_policy
    lm.config.use_cache = True
    return lm


def eos_ids(lm, tok) -> list[int]:
    """Every EOS id the generation config lists (Qwen3 instruct models end a turn with <|im_end|>)."""
    ids = lm.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


class Policy(torch.nn.Module):
    """The causal LM plus memory-bounded completion log-probs. Under FSDP2 this is the root unit, so its
    forward (and `generate`, registered below) gathers the root parameters (embeddings, norm, LM head)."""

    def __init__(self, lm, temperature: float = 1.0, chunk_tokens: int = 1024):
        super().__init__()
        self.lm, self.temperature, self.chunk_tokens = lm, temperature, chunk_tokens

    def generate(self, input_ids, attention_mask, n: int = 1, **kw):
        """HF `generate` for the prompts input_ids [B, P] (left-padded). n > 1: n completions of each prompt, rows of
        one prompt adjacent, with each prompt prefilled once: its KV cache over all its tokens but the last is
        computed for the B prompts and repeated n times, and `generate` starts from the last prompt token of each of
        the B x n rows, as if every prompt had been given n times. Under FSDP2 the root unit stays gathered for the
        whole call (register_fsdp_forward_method), the prefill included."""
        if n == 1:
            return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kw)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.config)
        prefix_mask = attention_mask[:, :-1]
        position_ids = (prefix_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() does with left padding
        self.lm.get_decoder()(input_ids=input_ids[:, :-1], attention_mask=prefix_mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(n)  # [B, heads, P-1, d] -> [B n, heads, P-1, d]
        return self.lm.generate(input_ids=input_ids.repeat_interleave(n, 0),
                                attention_mask=attention_mask.repeat_interleave(n, 0), past_key_values=cache, **kw)

    def forward(self, input_ids, attention_mask, n_prompt: int, entropy: bool = False):
        """log pi(y_t | x, y_<t) for the completion tokens input_ids[:, n_prompt:] -> [B, T] float32
        (and per-token entropy if asked). The LM head runs on chunks of tokens, each recomputed in the
        backward pass, so the extra memory is O(chunk x V), never O(B x T x V)."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() does with left padding
        h = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        B, T = input_ids.shape[0], input_ids.shape[1] - n_prompt
        h = h[:, n_prompt - 1:-1].reshape(B * T, -1)  # hidden state at t-1 predicts token t
        targets = input_ids[:, n_prompt:].reshape(B * T)
        head = self.lm.get_output_embeddings()
        out = chunked_logprobs(h, head.weight, head.bias, targets, self.temperature, self.chunk_tokens, entropy)
        logp, ent = out if entropy else (out, None)
        logp = logp.view(B, T).clone()  # not a view: FSDP2 hooks the output for backward
        return (logp, ent.view(B, T)) if entropy else logp


def chunked_logprobs(h, weight, bias, targets, temperature: float = 1.0, chunk_tokens: int = 1024,
                     entropy: bool = False):
    """log softmax(z)[target] with z = (h W^T + b) / temperature (and the entropy of that softmax if asked) for N
    rows of hidden states h [N, H] -> [N] in float32 (float64 for a float64 model). The LM head runs on
    `chunk_tokens` rows at a time and each chunk's backward recomputes its logits, so the extra memory is
    O(chunk x V) instead of the O(N x V) of log_softmax(logits).gather(...), in training and no-grad passes alike."""
    logps, ents = [], []
    for i in range(0, h.shape[0], chunk_tokens):
        lp, ent = _ChunkLogprobs.apply(h[i:i + chunk_tokens], weight, bias, targets[i:i + chunk_tokens], temperature,
                                       entropy)
        logps.append(lp)
        ents.append(ent)
    return (torch.cat(logps), torch.cat(ents)) if entropy else torch.cat(logps)


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk. Forward keeps only logsumexp (and the entropy) per row; backward recomputes the logits and applies
    d logp_t / dz = onehot(target) - p and d H / dz = -p (log p + H), with p = softmax(z), in place on one buffer."""

    @staticmethod
    def _logits(h, weight, bias, temperature):
        z = F.linear(h, weight, bias)
        return z.to(torch.promote_types(z.dtype, torch.float32)).div_(temperature)  # bf16 -> fp32; fp64 stays

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
        coef = g_logp[:, None] if g_ent is None else g_logp[:, None] + g_ent[:, None] * (logp + ent[:, None])
        grad_z = logp.exp_().mul_(coef).neg_()  # -p * (g_logp + g_ent (log p + H))
        grad_z.scatter_add_(-1, targets[:, None], g_logp[:, None].to(grad_z.dtype))  # + onehot(target) * g_logp
        grad_z = grad_z.div_(ctx.temperature).to(h.dtype)
        grad_h = grad_z @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_z.T @ h if ctx.needs_input_grad[1] else None
        grad_b = grad_z.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def wrap_policy(lm, d: Dist, temperature: float, chunk_tokens: int, activation_checkpointing: bool,
                dtype: str = "auto", cpu_offload: bool = False) -> Policy:
    """World size 1: the plain model. World size > 1: FSDP2, `fully_shard` on each decoder layer, then the root (the
    tied embedding/LM head stay together in the root unit), with fp32 shards computed in `dtype` and gradients
    reduced in fp32 (MixedPrecisionPolicy); rank 0's weights (load_model) are then scattered to the shards."""
    if activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.config.use_cache = True  # generation still uses the KV cache (checkpointing acts only in training)
    policy = Policy(lm, temperature, chunk_tokens)
    if d.world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                            register_fsdp_forward_method)

        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype(dtype, d), reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        for m in policy.modules():  # sum the gradients over ranks: each rank's loss is already divided by the
            if hasattr(m, "set_gradient_divide_factor"):  # minibatch's count over all ranks (the loss's `norm`)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        register_fsdp_forward_method(policy, "generate")
        state, buffers = lm.__dict__.pop("rank0_state") or ({}, {})
        policy.to_empty(device="cpu" if cpu_offload else d.device)  # meta -> real (uninitialised) shards
        set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for mod in lm.modules():  # buffers (rotary inv_freq: outside the state dict) live on the GPU even with
            for n, b in mod._buffers.items():  # --cpu-offload, and come from rank 0 too
                if b is not None:
                    mod._buffers[n] = b.to(d.device)
        for n, b in lm.named_buffers():
            if d.main:
                b.copy_(buffers[n])
            dist.broadcast(b, src=0)
        del state, buffers
    return policy


# ----------------------------------------------------------------------------- tasks and rewards
DATASETS = {  # name: (hub id, config, train split, held-out split, prompt column, answer column, instruction)
    "gsm8k": ("openai/gsm8k", "main", "train", "test", "question", "answer",
              "Solve the problem step by step and end with '#### <answer>'."),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", None, "problem", "answer",
                "Please reason step by step, and put your final answer within \\boxed{}."),
    "dapo17k": ("open-r1/DAPO-Math-17k-Processed", "en", "train", None, "prompt", "solution",
                ""),  # its prompts carry DAPO's own instruction ('The last line ... Answer: $Answer')
}


def builtin_task(n: int, seed: int) -> list[dict]:
    """The built-in offline task (seeded, deterministic): 'x%10=' for a digit x, answer x. The answer is
    uniform over 0-9, so no constant answer scores above 0.1: the model has to read the digit, write it and stop.
    A random tiny model hits it about 2% of the time; RL alone takes it past 0.7 in a few hundred steps.
    With 10 distinct prompts the held-out split measures sampling accuracy, not generalisation."""
    rng = random.Random(seed)
    return [{"prompt": f"{x}%10=", "answer": str(x)} for x in (rng.randint(0, 9) for _ in range(n))]


def load_task(name: str, data_files: str | None, eval_size: int, seed: int, tok, enable_thinking: bool,
              max_prompt_tokens: int):
    """-> (train, held-out, dropped): `datasets.Dataset`s with columns prompt, answer and text (the prompt
    through the chat template), and the counts of rows dropped from both, {"no_answer": n, "too_long": m}.
    `name` is 'builtin', a known hub set (DATASETS), or a local .json/.jsonl file of {prompt, answer}.
    `data_files` reads local files laid out in a known hub set's own columns (an offline mirror). Rows
    without an answer, and prompts over max_prompt_tokens tokens after the chat template, are dropped and
    counted; nothing usable left is an error."""
    from datasets import Dataset, disable_progress_bars, load_dataset

    def templated(d):
        disable_progress_bars()  # for map/filter, after any download: the counts of what is dropped are printed
        d = d.add_column("text", chat_prompts(tok, d["prompt"], enable_thinking))
        return d.filter(lambda b: [len(ids) <= max_prompt_tokens for ids in
                                   tok(b["text"], add_special_tokens=False).input_ids], batched=True)

    def finish(train, held, no_answer):
        n = len(train) + len(held)
        train, held = templated(train), templated(held)
        dropped = {"no_answer": no_answer, "too_long": n - len(train) - len(held)}
        held = held.select(range(min(eval_size, len(held))))
        if len(train) == 0:
            fail(f"--dataset {name!r}: no usable rows (dropped {no_answer} without an answer, {dropped['too_long']} "
                 f"over --max-prompt-tokens {max_prompt_tokens})")
        return train, held, dropped

    if name == "builtin":
        return finish(Dataset.from_list(builtin_task(4096, seed)), Dataset.from_list(builtin_task(eval_size, seed + 1)), 0)
    if name in DATASETS:
        hub, cfg, train_split, test_split, pcol, acol, instr = DATASETS[name]
        if data_files:
            ds = {"train": load_dataset("json", data_files=data_files, split="train")}
            train_split, test_split = "train", None
        else:
            ds = load_dataset(hub, cfg)
    elif name.endswith((".json", ".jsonl")):
        if not os.path.isfile(name):
            fail(f"--dataset {name!r}: no such file")
        ds, train_split, test_split, pcol, acol, instr = {"train": load_dataset("json", data_files=name, split="train")}, "train", None, "prompt", "answer", ""
    else:
        fail(f"--dataset {name!r}: unknown (use builtin, {', '.join(DATASETS)}, or a local .jsonl of {{prompt, answer}})")
    train = ds[train_split]
    missing = [c for c in (pcol, acol) if c not in train.column_names]
    if missing:
        fail(f"--dataset {name!r} has no column(s) {missing} (columns: {train.column_names}); a local file needs 'prompt' and 'answer'")

    def to_row(r):
        p = r[pcol] if isinstance(r[pcol], str) else r[pcol][-1]["content"]  # chat-format prompts: last user turn
        a = str(r[acol]) if r[acol] is not None else ""
        a = a.split("####")[-1].strip() if "####" in a else a.strip()
        return {"prompt": f"{p}\n{instr}".strip() if instr else p, "answer": a}

    def clean(d):
        disable_progress_bars()
        d = d.map(to_row, remove_columns=d.column_names)
        return d.filter(lambda r: len(r["answer"]) > 0)

    train_c = clean(train)
    dropped = len(train) - len(train_c)
    if test_split is not None:
        held = clean(ds[test_split])
        dropped += len(ds[test_split]) - len(held)
    else:  # no held-out split: keep the last eval_size rows apart
        split = train_c.train_test_split(test_size=min(eval_size, len(train_c) // 10 or 1), seed=seed)
        train_c, held = split["train"], split["test"]
    if len(train_c) == 0:
        fail(f"--dataset {name!r}: no usable rows (dropped {dropped} without an answer)")
    return finish(train_c, held, dropped)


def chat_prompts(tok, prompts: list[str], enable_thinking: bool) -> list[str]:
    """Through the tokenizer's chat template where it has one."""
    if not getattr(tok, "chat_template", None):
        return prompts
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                    enable_thinking=enable_thinking) for p in prompts]


_NUM = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def answer_span(text: str) -> tuple[int, int] | None:
    """Where the final answer lies in text, as (start, end) character offsets: the contents of the last
    \\boxed{...}, else the number (or the first non-empty line) after the last '####', else the last number."""
    i = text.rfind("\\boxed")
    if i >= 0:
        j = text.find("{", i)
        depth, k = 0, j
        while 0 <= k < len(text):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return j + 1, k
            k += 1
        return None  # unbalanced \boxed{
    i = text.rfind("####")
    if i >= 0:
        m = re.compile(r"\s*(" + _NUM + ")").match(text, i + 4) or re.compile(r"\s*(\S[^\n]*)").match(text, i + 4)
        return m.span(1) if m else None
    last = None
    for last in re.finditer(_NUM, text):
        pass
    return last.span() if last else None


def extract_answer(text: str) -> str | None:
    """The final answer: the last \\boxed{...}, else what follows the last '####', else the last number."""
    span = answer_span(text)
    return text[span[0]:span[1]].strip() if span else None


def parse_number(s: str) -> Fraction | None:
    """Integers, decimals, thousands separators, a/b, \\frac{a}{b}, a leading sign, $ and % dropped."""
    s = s.strip().replace("$", "").replace("\\!", "").replace("\\,", "").replace(" ", "").rstrip(".").replace("%", "")
    s = re.sub(r"\\text\{[^}]*\}$", "", s)
    m = re.fullmatch(r"(-?)\\d?frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}", s) or re.fullmatch(r"(-?)\\d?frac(\d)(\d)", s)
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


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the extracted final answer equals the reference numerically (or as normalised text when
    either side is not a number), else 0.0. Model text is only parsed, never evaluated."""
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    a, b = parse_number(pred), parse_number(answer)
    if a is not None and b is not None:
        return float(a == b)
    norm = lambda x: re.sub(r"\s+|\\left|\\right|\$", "", x)  # noqa: E731
    return float(norm(pred) == norm(answer))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std + eps), population std (DFPO eq. 43; the blog's worked example: rewards [1,0,1,0]
    give A = [+1,-1,+1,-1]). scale: the std of the group (eq. 43), of the whole batch over all ranks (TRL/verl
    "batch"), or none (centring only, Dr. GRPO). Groups with equal rewards get A = 0; their count is returned."""
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


def group_metrics(m: torch.Tensor, d_first: torch.Tensor, group_size: int, groups_total: int) -> dict:
    """Mechanism metrics of one minibatch, over its whole groups (rows in group order).
    m [B]: each sequence's term m_i = w_i A_i in the objective (w_i: the weight the objective applies after clipping
    and any in-group transform). losses/asym: mean over groups of Var_i(m_i) (DFPO eq. 23).
    d_first [B]: d loss / d log pi(y_i1), the gradient of the minibatch's loss with respect to the log-prob of each
    sequence's first completion token (autograd; every sequence has one, after the same prompt). groups_total: the
    minibatch's groups on all ranks, so that J = -loss = 1/groups_total sum_g J_g. losses/shared_coef: mean over
    groups of |sum_{i in g} dJ_g / d log pi(y_i1)|, the coefficient that a token shared by the whole group gets in
    the gradient (DFPO eq. 70-72): 0 when the group's updates on a shared token cancel."""
    m = m.detach().double().view(-1, group_size)
    coef = -groups_total * d_first.detach().double().view(-1, group_size).sum(1)
    return {"losses/asym": m.var(1, unbiased=False).mean(), "losses/shared_coef": coef.abs().mean()}


# ----------------------------------------------------------------------------- generation
GEN_MODES = ("repeat", "shared-prefill")


@torch.no_grad()
def generate(policy: Policy, tok, prompts: list[str], n: int, eos: list[int], d: Dist, *, max_new_tokens: int,
             temperature: float, top_p: float, top_k: int, gen_batch_size: int, unshard: bool = False,
             mode: str = "shared-prefill") -> dict:
    """n completions per prompt (rows of one prompt are adjacent: a group). Returns input_ids [B, P+T],
    attention_mask, n_prompt P, completion mask [B, T] (up to and including the first EOS), truncated [B].
    mode "repeat": each prompt repeated n times, so `generate` prefills it n times, gen_batch_size rows a call.
    mode "shared-prefill": each prompt prefilled once and its KV cache repeated to its n rows (Policy.generate),
    whole groups a call, max(1, gen_batch_size // n) prompts. Same tokens under greedy decoding (top_k=1)."""
    if mode not in GEN_MODES:
        raise ValueError(f"unknown generation mode {mode!r} ({', '.join(GEN_MODES)})")
    enc = tok(list(prompts), padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.to(d.device), enc.attention_mask.to(d.device)
    shared = mode == "shared-prefill"
    if shared and ids.shape[1] < 2:  # one-token prompts: a pad column, so that the prefilled prefix is not empty
        ids, am = F.pad(ids, (1, 0), value=tok.pad_token_id), F.pad(am, (1, 0), value=0)
    rows = max(1, gen_batch_size // n) if shared else gen_batch_size  # prompts (shared) or rows (repeat) a call
    if not shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    outs = []
    with gathered(policy, unshard):
        for i in range(0, ids.shape[0], rows):
            outs.append(policy.generate(
                input_ids=ids[i:i + rows], attention_mask=am[i:i + rows], n=n if shared else 1, do_sample=True,
                temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, eos_token_id=eos,
                pad_token_id=tok.pad_token_id, synced_gpus=d.world > 1,  # FSDP: every rank steps until all are done
            )[:, ids.shape[1]:])
    if shared:
        ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
    T = max(o.shape[1] for o in outs)
    comp = torch.cat([F.pad(o, (0, T - o.shape[1]), value=tok.pad_token_id) for o in outs])
    is_eos = torch.isin(comp, torch.tensor(eos, device=comp.device))
    before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0  # positions up to and including the first EOS
    comp = comp.masked_fill(~before_eos, tok.pad_token_id)
    return {"input_ids": torch.cat([ids, comp], 1), "attention_mask": torch.cat([am, before_eos.long()], 1),
            "n_prompt": ids.shape[1], "mask": before_eos.float(), "truncated": ~is_eos.any(1),  # no EOS: cut at the limit
            "texts": tok.batch_decode(comp.masked_fill(is_eos, tok.pad_token_id), skip_special_tokens=True)}


@contextlib.contextmanager
def gathered(policy, on: bool):
    """FSDP2 with --gen-unshard: every unit keeps its full parameters from its first forward to the end of the block,
    so decoding gathers each layer once per generate call instead of once per token; resharded after."""
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


def score(texts: list[str], answers: list[str], n: int) -> tuple[torch.Tensor, int]:
    """Reward per completion, and how many completions the reward raised on: those score 0 and the first error is
    printed, so one broken completion or reward function never stops a run. Answers are given once per prompt,
    completions n per prompt."""
    answers, rewards, errors = list(answers), [], []
    for i, t in enumerate(texts):
        try:
            rewards.append(float(math_reward(t, answers[i // n])))
        except Exception as e:  # noqa: BLE001 (any error of the reward, whatever the completion holds)
            rewards.append(0.0)
            errors.append(e)
    if errors:
        print(f"warning: the reward raised on {len(errors)} of {len(texts)} completions, scored 0 "
              f"(first: {type(errors[0]).__name__}: {errors[0]})", file=sys.stderr)
    return torch.tensor(rewards, dtype=torch.float32), len(errors)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021): 1 - C(n - c, k) / C(n, k), the
    probability that k samples drawn without replacement from the n include a correct one."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(policy, tok, held, eos, d: Dist, *, k: int, n: int | None = None, max_new_tokens: int,
             temperature: float, top_p: float, top_k: int, gen_batch_size: int, unshard: bool = False,
             mode: str = "shared-prefill") -> dict:
    """Over the held-out prompts (each rank an equal share), from n >= k samples a prompt (n defaults to k):
    avg@k, the mean accuracy of the n samples (an unbiased estimate of the mean accuracy of k samples, the DFPO
    paper's metric), and pass@k, the mean over prompts of the unbiased 1 - C(n - c, k) / C(n, k) (pass_at_k)."""
    n = n or k
    m = len(held) // d.world * d.world  # equal shares, or the FSDP all-gathers would hang
    rows = held.select(range(d.rank, m, d.world))
    r, errors = torch.zeros(0), 0
    per_call = max(1, gen_batch_size // n)  # prompts per generate call
    for i in range(0, len(rows), per_call):
        part = rows.select(range(i, min(i + per_call, len(rows))))
        out = generate(policy, tok, part["text"], n, eos, d, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, gen_batch_size=gen_batch_size, unshard=unshard, mode=mode)
        part_r, part_errors = score(out["texts"], part["answer"], n)
        r, errors = torch.cat([r, part_r]), errors + part_errors
    r = r.view(-1, n)
    passk = sum(pass_at_k(n, int(c), k) for c in (r > 0).sum(1))
    s = all_reduce(torch.tensor([r.mean(1).sum(), passk, len(rows), errors], dtype=torch.float64))
    return {f"eval/avg@{k}": (s[0] / s[2]).item(), f"eval/pass@{k}": (s[1] / s[2]).item(), "eval/prompts": m,
            "eval/samples": n, "eval/reward_errors": s[3].item()}


def eval_report(result: dict, dataset: str, run_dir: str, d: Dist) -> str:
    """--eval-only: the table printed, and eval.json in the run folder. Returns the JSON path."""
    path = os.path.join(run_dir, "eval.json")
    if d.main:
        k = next(key for key in result if key.startswith("eval/avg@")).split("@")[1]
        print(f"\n| dataset | prompts | samples a prompt | avg@{k} | pass@{k} | reward errors |\n"
              "|---|---|---|---|---|---|\n"
              f"| {dataset} (held-out) | {result['eval/prompts']} | {result['eval/samples']} | "
              f"{result[f'eval/avg@{k}']:.4f} | {result[f'eval/pass@{k}']:.4f} | {result['eval/reward_errors']:.0f} |")
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({dataset: result}, f, indent=1)
        print(f"written: {path}")
    return path


# ----------------------------------------------------------------------------- data order
def prompt_indices(n_rows: int, step: int, per_rank: int, d: Dist, seed: int) -> list[int]:
    """This rank's prompts for `step` (1-based): a fresh seeded permutation each epoch, global batch
    split across ranks, so the data position is a pure function of the step."""
    first = (step - 1) * per_rank * d.world + d.rank * per_rank
    perms = {}  # one permutation per epoch this batch touches (at most two), not one per prompt
    out = []
    for j in range(first, first + per_rank):
        epoch, pos = divmod(j, n_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
        out.append(int(perms[epoch][pos]))
    return out


def minibatches(n_groups: int, group_size: int, num_minibatches: int) -> list[slice]:
    """Row slices of whole groups: a group never straddles two minibatches."""
    per = n_groups // num_minibatches * group_size
    return [slice(i * per, (i + 1) * per) for i in range(num_minibatches)]


def micro_batches(mb: slice, size: int) -> list[slice]:
    """Consecutive slices of `size` rows inside a minibatch (the last may be shorter; a slice may split a group);
    size 0 is the whole minibatch."""
    size = size or mb.stop - mb.start
    return [slice(i, min(i + size, mb.stop)) for i in range(mb.start, mb.stop, size)]


# ----------------------------------------------------------------------------- logging and checkpoints
def reduce_stats(stats: list[dict]) -> dict:
    """Mean over minibatches then ranks; keys ending in _min/_max take min/max."""
    out = {}
    for k in stats[0]:
        v = torch.tensor([float(s[k]) for s in stats], dtype=torch.float64)
        if k.endswith("_min"):
            out[k] = all_reduce(v.min(), dist.ReduceOp.MIN).item()
        elif k.endswith("_max"):
            out[k] = all_reduce(v.max(), dist.ReduceOp.MAX).item()
        else:
            out[k] = (all_reduce(v.mean()) / (dist.get_world_size() if dist.is_initialized() else 1)).item()
    return out


def all_finite(*tensors: torch.Tensor) -> bool:
    """True when every tensor is finite on every rank: one decision that all ranks share."""
    ok = torch.tensor([float(all(torch.isfinite(t).all() for t in tensors))], device=tensors[0].device)
    return bool(all_reduce(ok, dist.ReduceOp.MIN).item())


def jitter2(m: list[float]) -> float:
    """Second-order difference jitter of a curve, DFPO eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t| (nan if T < 3)."""
    if len(m) < 3:
        return float("nan")
    return sum(abs(m[t + 2] - 2 * m[t + 1] + m[t]) for t in range(len(m) - 2)) / (len(m) - 2)


def lr_scheduler(optimizer, args):
    """Per optimizer step: linear warm-up over --warmup-frac of the steps, then constant or cosine decay to
    --min-lr-ratio x the peak (the DFPO paper's App. I: cosine, 3% warm-up, 0.2)."""
    total = args.num_steps * args.num_minibatches
    warmup = round(args.warmup_frac * total)

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if args.lr_schedule == "constant":
            return 1.0
        progress = (i - warmup) / max(1, total - warmup)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Logger:
    """Tensorboard + metrics.jsonl on rank 0 only. A resumed run (first_step > 1) continues both at first_step:
    rows a killed run logged after its checkpoint are dropped from metrics.jsonl and purged from tensorboard."""

    def __init__(self, run_dir: str, d: Dist, args, first_step: int = 1):
        self.d, self.writer = d, None
        if d.main:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(run_dir, exist_ok=True)
            self.writer = SummaryWriter(run_dir, purge_step=first_step if first_step > 1 else None)
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
                f"|{k}|{v}|" for k, v in vars(args).items()))
            with open(os.path.join(run_dir, "args.json"), "w") as f:
                json.dump(vars(args), f, indent=1, default=str)
            path = os.path.join(run_dir, "metrics.jsonl")
            kept = [line for line in open(path) if json.loads(line)["step"] < first_step] if first_step > 1 else []
            self.metrics = open(path, "w")
            self.metrics.writelines(kept)

    def log(self, step: int, scalars: dict):
        if not self.d.main:
            return
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.metrics.write(json.dumps({"step": step, **scalars}) + "\n")
        self.metrics.flush()

    def close(self):
        if self.d.main:
            self.writer.close()
            self.metrics.close()


# ----------------------------------------------------------------------------- checkpoints and exact resume
# A checkpoint is a folder {run_dir}/step_N: the model and tokenizer as `save_pretrained` writes them (safetensors,
# loads with from_pretrained), trainer_state.json (step, world size, script, reward curve) and rank{r}.pt per rank
# (this rank's optimizer shard, the lr schedule, the RNG states; plain tensors, read with weights_only=True). It is
# written into .tmp_step_N and renamed into place when complete, so a crash mid-write leaves the previous ones intact.
STEP_DIR = re.compile(r"step_(\d+)$")


def is_checkpoint(path: str) -> bool:
    return bool(STEP_DIR.search(os.path.basename(os.path.normpath(path)))) and os.path.isfile(
        os.path.join(path, "trainer_state.json"))


def run_paths(args, d: Dist, script: str) -> tuple[str, str | None]:
    """The run folder and the checkpoint to resume from (None: a fresh run). --resume auto takes the newest complete
    checkpoint of this exp_name and seed under --output-dir, or starts a fresh run when there is none, so the same
    command serves the first launch and every torchrun restart. Rank 0 decides for all ranks."""
    out = [None, None, 0]
    if d.main:
        ckpt = args.resume
        if ckpt == "auto":
            runs = glob.glob(os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__*", "step_*"))
            key = re.compile(r"__(\d+)" + re.escape(os.sep) + r"step_(\d+)$")  # (run's unix time, step)
            found = sorted((int(m[1]), int(m[2]), p) for p in runs if (m := key.search(p)) and is_checkpoint(p))
            ckpt = found[-1][2] if found else None
            if ckpt is None:
                print(f"--resume auto: no checkpoint of {args.exp_name}__{args.seed}__* under {args.output_dir}, "
                      "starting a fresh run")
        if ckpt:
            ckpt = os.path.normpath(ckpt)
            state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
            if state["world"] != d.world:
                fail(f"{ckpt} was written by {state['world']} ranks and this run has {d.world}: resume it with "
                     f"--nproc-per-node {state['world']} (optimizer shards and RNG states are per rank)")
            if state["script"] != script:
                fail(f"{ckpt} was written by {state['script']}, not {script}: resume it with that script")
            print(f"resuming {ckpt} (step {state['step']})")
        out = [os.path.dirname(ckpt) if ckpt else os.path.join(
            args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}"), ckpt, state["step"] if ckpt else 0]
    if d.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[2] >= args.num_steps:  # e.g. a restart after the last checkpoint was written
        if d.main:
            print(f"{out[1]} is at step {out[2]} and --num-steps is {args.num_steps}: nothing to do")
        cleanup()
        raise SystemExit(0)
    return out[0], out[1]


def _rng_state(d: Dist) -> dict:
    py, npy = random.getstate(), np.random.get_state()
    return {"python": py, "numpy": (npy[0], npy[1].tolist(), *npy[2:]), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None}


def _set_rng_state(s: dict, d: Dist):
    random.setstate(s["python"])
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]))
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None:
        torch.cuda.set_rng_state(s["cuda"], d.device)


def resume_state(ckpt: str | None, optimizer, scheduler, d: Dist) -> dict:
    """Restore optimizer, lr schedule and this rank's RNG states from `ckpt` and return the loop's state (step,
    reward curve, non-finite run, wall time); a fresh run's state when ckpt is None. The data position is a pure
    function of the step (prompt_indices), so the step restores it."""
    if ckpt is None:
        return {"step": 0, "reward_curve": [], "nonfinite_run": 0, "wall_time": 0.0}
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    blob = torch.load(os.path.join(ckpt, f"rank{d.rank}.pt"), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    from torch.distributed.tensor import DTensor

    for p, s in optimizer.state.items():  # FSDP2: this rank's shards back into DTensors laid out like the parameter
        for k, v in s.items():
            if isinstance(p, DTensor) and not isinstance(v, DTensor) and v.shape == p.to_local().shape:
                s[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                          run_check=False)
    scheduler.load_state_dict(blob["scheduler"])
    _set_rng_state(blob["rng"], d)
    return state


def save_checkpoint(run_dir: str, step: int, policy: Policy, tok, optimizer, scheduler, d: Dist, keep: int,
                    script: str, **loop_state):
    """Write {run_dir}/step_{step} (see above) atomically, then delete all but the newest `keep` (0: keep all).
    The model is gathered from FSDP2 shards into one full state dict; the optimizer stays sharded, one file a rank."""
    from torch.distributed.tensor import DTensor

    if d.world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(policy.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:  # last: a folder without it is incomplete
            json.dump({"step": step, "world": d.world, "script": script, **loop_state}, f)
        if os.path.exists(path):  # the same step written again: swap, then delete the old copy
            os.rename(path, tmp + ".old")
        os.rename(tmp, path)
        shutil.rmtree(tmp + ".old", ignore_errors=True)
        done = sorted((int(STEP_DIR.search(p)[1]), p) for p in glob.glob(os.path.join(run_dir, "step_*"))
                      if is_checkpoint(p))
        for _, old in done[:-keep] if keep else []:
            shutil.rmtree(old)
    barrier()
    return path


def barrier():
    if dist.is_initialized():
        dist.barrier()


def cleanup():
    """The end of a torchrun process: every rank done with every collective, the group destroyed, then the process
    leaves without the interpreter's exit-time destructors. Under torch 2.13 + gloo, process-group objects that the
    FSDP2 model still references are destroyed there and sometimes abort ("terminate called without an active
    exception", about 1 run in 60 on 2 busy cores) after all the work is done and saved. World size 1: nothing."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def resolve_defaults(args):
    """Defaults that depend on the model and task: the tiny model learns fast with a large step and short
    answers; real models follow the papers' scale."""
    if args.learning_rate is None:
        args.learning_rate = 5e-4 if args.model == "tiny" else 1e-6
    if args.max_new_tokens is None:
        args.max_new_tokens = 2 if args.dataset == "builtin" else 1024  # builtin: the digit, then EOS
    return args


def check_common_args(args):
    """Bad input fails with one line before any heavy work."""
    resolve_defaults(args)
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: group-relative advantages need at least 2 completions a prompt")
    if args.max_new_tokens <= 0:
        fail(f"--max-new-tokens {args.max_new_tokens}: must be > 0")
    if args.clip_low <= 0 or args.clip_high <= 0:
        fail(f"--clip-low {args.clip_low} / --clip-high {args.clip_high}: clip ranges must be > 0")
    if args.num_minibatches < 1 or args.prompts_per_rank % args.num_minibatches:
        fail(f"--prompts-per-rank {args.prompts_per_rank} must be a multiple of --num-minibatches {args.num_minibatches} "
             "(each minibatch holds whole groups)")
    if args.temperature <= 0:
        fail(f"--temperature {args.temperature}: must be > 0 (RL samples from the policy)")
    if args.num_steps < 1:
        fail(f"--num-steps {args.num_steps}: must be >= 1")
    if args.micro_batch_size < 0:
        fail(f"--micro-batch-size {args.micro_batch_size}: must be >= 1 sequences, or 0 for the whole minibatch")
    if args.max_prompt_tokens < 1:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: must be >= 1")
    if args.max_nonfinite < 1:
        fail(f"--max-nonfinite {args.max_nonfinite}: must be >= 1")
    if args.cpu_offload and not torch.cuda.is_available():
        fail("--cpu-offload moves FSDP2 shards between GPU and CPU memory: it needs a GPU (drop it on CPU)")
    if args.eval_n is not None and args.eval_n < args.eval_k or args.eval_k < 1:
        fail(f"--eval-n {args.eval_n} / --eval-k {args.eval_k}: pass@k needs n >= k >= 1 samples a prompt")
    if args.resume not in (None, "auto") and not is_checkpoint(args.resume):
        fail(f"--resume {args.resume}: not a checkpoint (a run's step_N folder holding trainer_state.json); "
             "give one, or 'auto' for the newest of this --exp-name and --seed")
    if args.keep_checkpoints < 0 or args.save_every < 0:
        fail(f"--keep-checkpoints {args.keep_checkpoints} / --save-every {args.save_every}: must be >= 0")
    if not 0 <= args.warmup_frac < 1 or not 0 <= args.min_lr_ratio <= 1:
        fail(f"--warmup-frac {args.warmup_frac} must lie in [0, 1) and --min-lr-ratio {args.min_lr_ratio} in [0, 1]")
