"""The engine's weights: plain tensors taken from the policy once per rollout (Weights,
take_weights), under FSDP2 each parameter's full tensor gathered in turn, a LoRA layer merged
(weight), under tensor parallelism this rank's part (full), q/k/v and gate/up fused on a GPU
(fused, project), and refreshed in place after an optimizer step (take_weights into=, refill)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
