"""LoRA (Hu et al., 2021, arXiv:2106.09685) through `peft`: each targeted linear layer of the
decoder computes W x + (alpha / r) B A x, with W frozen and only A [r, in], B [out, r] trained (B
starts at zero, so the first step's model is the base). Its flags are checked by cli
(check_lora_args); called by common.py (load_model applies the adapters, wrap_policy shards them
with their layer), checkpoint/ (a checkpoint's adapter folder and merged model) and the KL
reference (the policy with its adapters off). The loss and the loop do not know LoRA is on.

Precision: the frozen base is held in the compute dtype (bf16 on a GPU, fp32 on CPU unless --dtype
bf16): it gets no gradient and no AdamW state, so it needs no fp32 master copy. The adapters, their
gradients and AdamW state are fp32 (peft's autocast_adapter_dtype).
A checkpoint holds step_N/adapter/ (adapter_config.json + adapter_model.safetensors: loads with
PeftModel.from_pretrained onto the base) and, as its export step_N/model/, the merged model
W + (alpha / r) B A in bf16 (computed in fp32), which loads with from_pretrained like a full
fine-tuning checkpoint's export.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch

from .distributed import fail, host_memory_short

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapter folder: step_N/adapter
ALL_LINEAR = "all-linear"  # --lora-target-modules' default: every linear layer of the decoder
DEFAULT_ALPHA = 16.0  # --lora-alpha's default (TRL's and verl's)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA flags as load_model reads them: rank r, alpha (scale alpha / r), dropout on the
    adapters' input, and the target module names (ALL_LINEAR: every linear layer of the decoder)."""
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


def lora_spec(args) -> LoraSpec | None:
    """The script's LoRA flags, or None when --lora-rank is 0 (off)."""
    if args.lora_rank == 0:
        return None
    return LoraSpec(args.lora_rank, args.lora_alpha, args.lora_dropout,
                    tuple(args.lora_target_modules))


def decoder_linears(lm) -> list[str]:
    """The names (last component) of the linear layers inside the decoder's layers, in order."""
    names = []
    for layer in lm.get_decoder().layers:
        for name, mod in layer.named_modules():
            parts = name.split(".")
            if "base_layer" in parts or any(p.startswith("lora_") for p in parts):
                continue  # inside an adapted layer (a LoRA layer counts as its linear layer)
            linear = isinstance(mod, torch.nn.Linear) or hasattr(mod, "base_layer")
            if linear and parts[-1] not in names:
                names.append(parts[-1])
    return names


def resolve_targets(skeleton, targets: tuple[str, ...]) -> list[str]:
    """--lora-target-modules as names of the decoder's linear layers (ALL_LINEAR: all of them), read
    from a model built on the meta device (no weights); a name that matches none fails in one line
    listing those there are. The LM head is not one: the log-probs read its weight directly
    (logprobs.chunked_logprobs), so an adapter on it would be skipped."""
    there = decoder_linears(skeleton)
    if list(targets) == [ALL_LINEAR]:
        return there
    missing = [t for t in targets if t not in there]
    if missing:
        fail(f"--lora-target-modules {' '.join(missing)}: no linear layer of the decoder has that "
             f"name; the linear layers are {' '.join(there)} (or {ALL_LINEAR})")
    return list(dict.fromkeys(targets))


def adapter_folder(name: str) -> str | None:
    """A LoRA checkpoint's adapter folder when `name` is one (a step_N written under LoRA), else
    None."""
    path = os.path.join(os.path.expanduser(name), ADAPTER_DIR)
    return path if os.path.isfile(os.path.join(path, "adapter_config.json")) else None


def base_of(name: str) -> str:
    """The base model a LoRA checkpoint's adapters apply to (its --model), else `name` itself."""
    folder = adapter_folder(name)
    if folder is None:
        return name
    with open(os.path.join(folder, "adapter_config.json")) as f:
        return json.load(f)["base_model_name_or_path"]


def apply_lora(lm, spec: LoraSpec, targets: list[str], base: str, adapters: str | None = None):
    """The model with LoRA adapters on `targets` (a peft PeftModelForCausalLM: the base frozen,
    A initialised by peft from the torch RNG, B zero), or with the adapters read from the adapter
    folder `adapters` (a checkpoint's: bitwise what was saved). `base` is recorded in the adapter
    config, so that a checkpoint names its base."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets, task_type="CAUSAL_LM", bias="none")
    if adapters is not None:
        with open(os.path.join(adapters, "adapter_config.json")) as f:
            saved = json.load(f)
        if (saved["r"], float(saved["lora_alpha"]), sorted(saved["target_modules"])) != (
                spec.rank, float(spec.alpha), sorted(targets)):
            fail(f"{adapters}: its adapters have rank {saved['r']}, alpha {saved['lora_alpha']} on "
                 f"{' '.join(sorted(saved['target_modules']))}; this run asks for rank "
                 f"{spec.rank}, "
                 f"alpha {spec.alpha} on {' '.join(sorted(targets))}: give the same --lora-* flags")
    check_adapter_memory(lm, spec, targets)
    # adapters in fp32 whatever the base's dtype (autocast_adapter_dtype)
    lm = get_peft_model(lm, config, autocast_adapter_dtype=True)
    lm.peft_config["default"].base_model_name_or_path = base  # peft takes the model's own name
    if adapters is not None and not next(lm.parameters()).is_meta:
        from safetensors.torch import load_file

        state = load_file(os.path.join(adapters, "adapter_model.safetensors"))
        result = set_peft_model_state_dict(lm, state)
        if result.unexpected_keys:
            fail(f"{adapters}: unexpected adapter weights {result.unexpected_keys[:3]}")
    return lm


def adapter_parameters(lm, targets: list[str], rank: int) -> int:
    """The parameters LoRA adds: rank x (in + out) for every target linear layer of the decoder
    (A: rank x in, B: out x rank)."""
    return sum(rank * (mod.in_features + mod.out_features)
               for layer in lm.get_decoder().layers for name, mod in layer.named_modules()
               if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in targets)


def check_adapter_memory(lm, spec: LoraSpec, targets: list[str]):
    """A model on the CPU: its adapters (fp32) and, where there is no GPU to train on, their
    gradients and AdamW moments (3 more fp32 copies) checked against the host memory available
    before peft allocates them; one line naming --lora-rank when they do not fit."""
    first = next(lm.parameters())
    if first.is_meta or first.device.type != "cpu":
        return
    n = adapter_parameters(lm, targets, spec.rank)
    parts = {f"the LoRA adapters of rank {spec.rank} ({n:,} fp32 parameters)": 4 * n}
    if not torch.cuda.is_available():  # trained here: gradients, AdamW's two moments
        parts["their gradients and AdamW moments"] = 12 * n
    short = host_memory_short(parts)
    if short is not None:
        fail(f"--lora-rank {spec.rank}: {short}; lower --lora-rank")


def is_lora(lm) -> bool:
    """True for a model apply_lora made."""
    return hasattr(lm, "peft_config")


def describe(lm) -> str:
    """One line: the adapters' rank, targets and trainable share of the parameters."""
    cfg = lm.peft_config["default"]
    trained = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    total = sum(p.numel() for p in lm.parameters())
    base = next(p for p in lm.parameters() if not p.requires_grad).dtype
    return (f"LoRA rank {cfg.r}, alpha {cfg.lora_alpha:g} on {' '.join(sorted(cfg.target_modules))}"
            f": {trained:,} trainable parameters (fp32) of {total:,} "
            f"({100 * trained / total:.3f}%), the frozen base in {str(base).replace('torch.', '')}")


def merged_state_dict(lm, state: dict, dtype=torch.bfloat16) -> dict:
    """The base model's state dict with each adapted weight merged, W + scale B A (in fp32, then
    `dtype`), from `state`, the PeftModel's full state dict (names as peft gives them)."""
    from peft.tuners.lora import LoraLayer

    scales = {name: mod.scaling["default"] for name, mod in lm.named_modules()
              if isinstance(mod, LoraLayer)}
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        module = key.rsplit(".", 1)[0]
        if module.endswith(".base_layer") and key.endswith(".weight"):
            module = module[: -len(".base_layer")]
            A = state[f"{module}.lora_A.default.weight"].float()
            B = state[f"{module}.lora_B.default.weight"].float()
            value = value.float() + scales[module] * (B @ A)
        name = key.replace(".base_layer.", ".").removeprefix("base_model.model.")
        out[name] = value.to(dtype)
    return out


def save_lora(lm, model: str, checkpoint: str, state: dict | None = None):
    """Rank 0: the merged model in bf16 into `model` (loads with from_pretrained), and
    `checkpoint`/adapter/ (peft's save_pretrained: the fp32 adapters, which
    PeftModel.from_pretrained loads onto the base). state: the PeftModel's full state dict (FSDP2:
    gathered by the caller); None: lm's own."""
    state = lm.state_dict() if state is None else state
    lm.save_pretrained(os.path.join(checkpoint, ADAPTER_DIR), state_dict=state)
    base = lm.get_base_model()
    base.save_pretrained(model, state_dict=merged_state_dict(lm, state))
    config = copy.deepcopy(base.config)
    config.dtype = torch.bfloat16  # what from_pretrained(dtype="auto") reads (save_pretrained wrote
    config.save_pretrained(model)  # the training model's dtype)


def adapters_disabled(policy):
    """The KL penalty's frozen reference under LoRA: the policy with its adapters switched off, the
    base itself (no second copy of the model). Called as the reference is, ref(ids, mask, n_prompt),
    without gradient."""

    def ref(input_ids, attention_mask, n_prompt: int):
        with policy.lm.disable_adapter():
            return policy(input_ids, attention_mask, n_prompt)

    return ref
