"""The model: the tokenizer, the weights (the built-in `tiny` and `tiny-moe` too, built offline), the
checks a --model passes before anything heavy, Policy (the temperature-scaled log-probs the objectives
read, in chunks), and its wrapping for training (FSDP2 over decoder layers, activation checkpointing,
LoRA) and for the KL reference. The scripts call it at set-up, before their loop (common.py).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from . import engine, moe
from .checkpoint import is_checkpoint, load_masters, masters_files, model_folder_problem, state_dir
from .distributed import Dist, fail, main_process, seed_everything
from .logprobs import chunked_logprobs
from .lora import (LoraSpec, adapter_folder, adapters_disabled, apply_lora, base_of, describe,
                   resolve_targets)

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (= EOS)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# tiny-tools: the tools as one system line of their names, where the plain fallback (tools.py,
# tools_text) would write ~150 characters the tiny alphabet holds as <|unk|>: a prompt 4x shorter
TINY_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|>\n{% endif %}" + TINY_CHAT_TEMPLATE
)


def tiny_tokenizer(tools: bool = False):
    """A real HF fast tokenizer over characters (printable ASCII and newline), Qwen-style
    specials. tools (`--model tiny-tools`, for the built-in episode task, grouprl/tool_task.py):
    the task's alphabet only, its secrets' symbols (any other character is <|unk|>), a chat
    template that renders the tools as their names (TINY_TOOLS_TEMPLATE), and tool_task.CALL, the
    task's whole tool call, as one token (a real tokenizer holds `<tool_call>` as one token; this
    one the call): V = 9, so a random-init policy writes a call then its turn's end with
    probability ~1/V^2 = 1/81 a position, where the call's 56 characters it would never write."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    if tools:
        from .tool_task import CALL, SYMBOLS

        chars = list(SYMBOLS)
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars + ["<|unk|>"])}
    # no merges: one token a char
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(TINY_SPECIALS + ["<|unk|>"])
    if tools:
        tk.add_tokens([AddedToken(CALL, special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|unk|>",
        chat_template=TINY_TOOLS_TEMPLATE if tools else TINY_CHAT_TEMPLATE, padding_side="left",
    )


TINY_MODELS = ("tiny", "tiny-moe", "tiny-tools")  # --model names built here, offline, random-init


def builtin_tokenizer(name: str):
    """The tokenizer of a TINY_MODELS name (tiny-tools: with the task's call token)."""
    return tiny_tokenizer(tools=name == "tiny-tools")


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


def model_config(name: str, trust_remote_code: bool):
    """--model's config where it can be read at once (tiny, a local folder, the hub cache), else
    None (check_model then says why it cannot)."""
    if name in TINY_MODELS:
        return tiny_config(builtin_tokenizer(name), name == "tiny-moe")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.path.expanduser(name), local_files_only=True,
                                          trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - check_model reads it again, and says what is wrong
        return None


def check_sizes(args):
    """--lora-rank and --group-size bounded by what the model and the host allow, before the model
    loads: a rank past every target layer's min(in, out) adds parameters and no capacity (the
    update of a d_in x d_out weight has rank <= min(d_in, d_out)); on a CPU run, the rollout's rows
    are planned as the engine's KV cache is (distributed.host_memory_short), at the least each can
    take: all of --max-new-tokens and one prompt token (the built-in task's own on a tiny model)."""
    config = model_config(args.model, args.trust_remote_code)
    if config is None or getattr(config, "hidden_size", None) is None:
        return
    if args.lora_rank > 0:
        from transformers import AutoModelForCausalLM

        from .lora import ALL_LINEAR

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        wanted = set(args.lora_target_modules)
        dims = [min(m.in_features, m.out_features) for layer in skeleton.get_decoder().layers
                for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)
                and (ALL_LINEAR in wanted or n.split(".")[-1] in wanted)]
        if dims and args.lora_rank > max(dims):
            fail(f"--lora-rank {args.lora_rank}: above {max(dims)}, the largest rank an update of "
                 f"--model {args.model}'s target layers can have (min(in, out) of a layer): it "
                 f"adds parameters and no capacity; use at most {max(dims)}")
    if torch.cuda.is_available():  # the rows then live on the GPU (the engine plans its KV there)
        return
    from .distributed import host_memory_short

    rows = args.prompts_per_rank * args.group_size
    prompt = 1  # tokens; the built-in task's prompts on a tiny model are known exactly
    if args.dataset == "builtin" and args.model in TINY_MODELS:
        from .data import builtin_task, chat_prompts

        tok = tiny_tokenizer()
        text = chat_prompts(tok, [builtin_task(1, 0)[0]["prompt"]], args.enable_thinking,
                            args.system_prompt)[0]
        prompt = len(tok(text, add_special_tokens=False).input_ids)
    positions = prompt + args.max_new_tokens
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    micro = args.micro_batch_size or rows // args.num_minibatches
    # what autograd keeps a token a layer: ~2 x (4 hidden + 3 MLP widths), the attention weights
    width = 2 * (4 * config.hidden_size + 3 * (getattr(config, "intermediate_size", None)
                                               or config.hidden_size))
    width += config.num_attention_heads * positions
    parts = {  # fp32 on the CPU
        f"the KV cache of one group ({args.group_size} rows)":
            args.group_size * positions * layers * 2 * heads * head_dim * 4,
        f"the training forward's activations ({micro} rows)": micro * positions * layers * width * 4,
        f"the rollout's {rows} rows": rows * positions * (8 + 8 + 4 * 4),
    }
    if (short := host_memory_short(parts)) is not None:
        fail(f"--group-size {args.group_size}: {short}, at {prompt} prompt token(s) a row; lower "
             f"--group-size, --prompts-per-rank (now {args.prompts_per_rank}) or "
             f"--max-new-tokens (now {args.max_new_tokens}), or set --micro-batch-size")


def check_model(name: str, trust_remote_code: bool, gen_mode: str = "shared-prefill",
                old_logp: str = "recompute", rollout_is_cap: float | None = None,
                routing_replay: bool = False, max_staleness: int = 0):
    """Fail fast, before any weights are read: 'tiny', 'tiny-moe', a local folder with a config, or
    a hub id; for --gen-mode engine / engine-tp, what the config alone tells (check_engine); and
    the flags that need what the config tells (check_model_flags)."""
    flags = (gen_mode, old_logp, rollout_is_cap, routing_replay, max_staleness)
    if name in TINY_MODELS:
        config = tiny_config(builtin_tokenizer(name), name == "tiny-moe")
        check_engine(config, gen_mode)
        return check_model_flags(name, config, *flags)
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
    check_model_flags(name, config, *flags)


def check_model_flags(name: str, config, gen_mode: str, old_logp: str,
                      rollout_is_cap: float | None, routing_replay: bool, max_staleness: int = 0):
    """--old-logp rollout and --rollout-is-cap read the log-probs the engine returns as it samples
    (generate's Rollout.logp): one line where the generation mode returns none (HF generate, and the
    engine's HF fallback for an architecture it does not cover), unless --max-staleness > 0, whose
    rollouts carry the behaviour policy's log-probs in every mode (staleness.py). --routing-replay:
    one line on a dense model."""
    needs = None if max_staleness > 0 else "--old-logp rollout" if old_logp == "rollout" else (
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

    from .data import hub_offline, unreachable_hub

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
    not cover is said in one line (HF generate runs instead); heads that do not split over the
    processes fail in one line (engine.runs)."""
    if gen_mode in ("engine", "engine-tp"):
        world = int(os.environ.get("WORLD_SIZE", "1")) if gen_mode == "engine-tp" else 1
        engine.runs(config, world, main_process())


def load_tokenizer(name: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = builtin_tokenizer(name) if name in TINY_MODELS else AutoTokenizer.from_pretrained(
        os.path.expanduser(name), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"  # prompts are left-padded for generation
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def compute_dtype(dtype: str, dist_env: Dist) -> torch.dtype:
    """--dtype's compute dtype: auto is bf16 on GPU, fp32 on CPU; bf16 and bf16-pure are bf16."""
    if dtype == "auto":
        return torch.bfloat16 if dist_env.device.type == "cuda" else torch.float32
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def weights_dtype(dtype: str) -> torch.dtype:
    """--dtype's dtype of the weights, and so of their gradients and AdamW state: fp32 master
    weights (computed in bf16 where the compute dtype is bf16), except with bf16-pure."""
    return torch.bfloat16 if dtype == "bf16-pure" else torch.float32


def load_model(name: str, tok, dist_env: Dist, seed: int, trust_remote_code: bool = False,
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
    frozen = None if lora is None else compute_dtype(dtype, dist_env)  # the base's dtype under LoRA

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
    if not dist_env.sharded and sharded_masters:  # every old rank's rows, into one model
        lm = skeleton(weights_dtype(dtype)).to_empty(device="cpu")
        lm.tie_weights()  # to_empty gives tied weights a tensor each
        load_masters(lm, path, dist_env)
        lm = lm.to(dist_env.device)
    elif not dist_env.sharded:
        lm = adapt(build(frozen or weights_dtype(dtype)).to(dist_env.device))
    elif sharded_masters:  # each rank reads its own rows in wrap_policy
        lm, rank0_weights = skeleton(torch.float32), path
    else:
        lm = skeleton(frozen or torch.float32)
        # rank 0's adapters drawn first, as one process draws them (peft's init on the meta device
        # still draws from the RNG)
        src = adapt(build(frozen or torch.float32)) if dist_env.main else None
        lm = adapt(lm)
        # for wrap_policy
        rank0_weights = (src.state_dict(), dict(src.named_buffers())) if dist_env.main else None
    lm.config.use_cache = True
    if lora is not None and dist_env.main:
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


def wrap_policy(lm, dist_env: Dist, temperature: float, chunk_tokens: int,
                activation_checkpointing: bool, dtype: str = "auto", cpu_offload: bool = False,
                rank0_weights=None) -> Policy:
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
    compute = compute_dtype(dtype, dist_env)
    # the trained weights' dtype (under LoRA the adapters', fp32 beside a bf16 base)
    weights = next((p for p in lm.parameters() if p.requires_grad), next(lm.parameters())).dtype
    autocast = compute if not dist_env.sharded and compute != weights else None
    policy = Policy(lm, temperature, chunk_tokens, autocast)
    policy.compute_dtype = compute  # what --gen-mode engine decodes in
    if not dist_env.sharded and dist_env.main and compute == torch.bfloat16:
        print("one process: " + ("fp32 master weights and AdamW state, computed in bf16 "
                                 "(torch.autocast)" if autocast else
                                 "bf16 weights and AdamW state (updates below bf16's resolution "
                                 "are lost)"))
    if dist_env.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard, register_fsdp_forward_method)

        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        if dist_env.main:
            print(f"FSDP2 over {dist_env.world} process(es): "
                  f"{len(lm.get_decoder().layers)} decoder layers + the root, fp32 master weights "
                  f"computed in {compute}"
                  + (", CPU offload" if cpu_offload else ""))
        # sum the gradients over ranks: each rank's loss is already divided by the minibatch's count
        # over all ranks (the loss's `norm`)
        for m in policy.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
        register_fsdp_forward_method(policy, "generate")
        # meta -> real (uninitialised) shards
        policy.to_empty(device="cpu" if cpu_offload else dist_env.device)
        # buffers (rotary inv_freq: outside the state dict) live on the GPU even with --cpu-offload
        for mod in lm.modules():
            for n, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[n] = b.to(dist_env.device)
        if isinstance(rank0_weights, str):  # a torchrun checkpoint: each rank reads its own rows
            load_masters(lm, rank0_weights, dist_env)
            return policy
        state, buffers = rank0_weights or ({}, {})
        set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=True))
        for n, b in lm.named_buffers():  # from rank 0 too
            if dist_env.main:
                b.copy_(buffers[n])
            dist.broadcast(b, src=0)
        del state, buffers
    return policy


def reference_policy(args, tok, dist_env: Dist, policy: Policy | None = None):
    """The frozen reference of the KL penalty (--kl-coef): the initial model, --model (not the
    checkpoint a run resumes from), loaded and wrapped as the policy is, without gradients or
    activation checkpointing; under LoRA the policy itself with its adapters off (the base: no
    second copy, lora.adapters_disabled); None at --kl-coef 0, when no second model is loaded at
    all."""
    if args.kl_coef == 0:
        return None
    if getattr(args, "lora_rank", 0) > 0:
        return adapters_disabled(policy)
    ref_lm, ref_weights = load_model(args.model, tok, dist_env, args.seed, args.trust_remote_code,
                                     args.dtype)
    return wrap_policy(ref_lm.requires_grad_(False), dist_env, args.temperature,
                       args.logprob_chunk_tokens, False, args.dtype, args.cpu_offload,
                       ref_weights).eval()

