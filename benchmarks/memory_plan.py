"""Per-GPU memory of one training job under FSDP2, as this project lays it out, by arithmetic (no GPU needed):

    python benchmarks/memory_plan.py                                    # Qwen3-32B on 8, 16 and 32 GPUs
    python benchmarks/memory_plan.py --config path/to/config.json --gpus 8 --seqs 8 --tokens 4608
    python benchmarks/memory_plan.py --config path/to/config.json --gpus 1 2 --cpu 0.5   # RAM a process on CPU
    python benchmarks/memory_plan.py --config qwen3-8b --gpus 1 --lora-rank 64          # LoRA (README, Scaling)

What is counted (bytes; P parameters, L layers, H hidden, I intermediate, V vocabulary):
- sharded state, 16 P / n: fp32 master weights (4), fp32 gradients (4), AdamW's two fp32 moments (8). With
  --cpu-offload all of it lives in CPU memory instead. The scripts free the gradients after each optimizer step,
  so generation and checkpoint saves hold 12 P / n of it.
- gathered units: FSDP2 gathers one unit at a time (plus one prefetched) in bf16, with its bf16 gradient and an
  fp32 reduce-scatter buffer (8 bytes a parameter); the root unit (embeddings, final norm, LM head) stays gathered
  for the whole forward and backward.
- activations, decoder layers checkpointed: each layer keeps its bf16 input (2 H a token); the layer being
  recomputed holds about 2 (6 H + 4 I) bytes a token (q, k, v, o, MLP gate/up/product).
- log-probs: one chunk of --logprob-chunk-tokens x V logits in bf16 and two fp32 buffers (logprobs.chunked_logprobs).
- KV cache while generating: 2 (k, v) x L x kv_heads x head_dim x 2 bytes a token, for --gen-batch-size sequences.
- --gen-unshard: the whole model in bf16 (2 P) while generating.
- --gen-mode engine: its own copy of the whole model in the compute dtype (2 P: each weight's full tensor, q/k/v
  and gate/up fused) and its KV pool, allocated once: --gen-batch-size rows of --tokens positions (the KV cache term).
  Paged (where that whole cache does not fit), a group's --group-size rows share its prompt's full blocks of 128
  positions (engine.group_blocks): a group of G rows at full length takes --prompt-tokens // 128 blocks once and
  ceil(--tokens / 128) - that each, every row its own copy of the prompt's last, partly filled block (the "KV
  cache, engine paged" term, the fewest positions the rollout decodes in without a row waiting).
- --lora-rank R (lora.py): adapters B A on every linear layer of the decoder, A = R x sum over them of (inputs +
  outputs) parameters. The frozen base is held in bf16 and sharded (2 P / n, no gradient, no AdamW state); the
  adapters are fp32 with gradients and AdamW (16 A / n); a gathered unit is its bf16 weights only (no gradient or
  reduce buffer for frozen weights) plus its adapters' (2 b + 4 bytes each). Activations, the log-prob chunk and the
  KV cache are unchanged (the adapters' rank-R intermediates are small next to a layer's); --gen-mode engine holds
  the merged weights (2 P).
Real runs add the CUDA context, allocator fragmentation and NCCL buffers (a few GB): keep ~10% headroom.
--dtype fp32 counts 4 bytes where bf16 counts 2 (gathered units then 12 bytes a parameter). --cpu: the RAM of each
process of a CPU job (fp32; plain `python` and torchrun's ranks), by cpu_process below, checked against
measurements by benchmarks/cpu_0p6b.py (benchmarks/README.md).
"""
import argparse
import json

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
PRESETS = {"qwen3-32b": QWEN3_32B, "qwen3-8b": QWEN3_8B}  # --config by name
GB = 1e9
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def lora_parameters(c: dict, rank: int) -> int:
    """Adapter parameters of LoRA rank `rank` on every linear layer of the decoder: R (inputs + outputs) each."""
    H, I, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    # q, k, v, o, then gate, up, down
    return L * rank * ((H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H))


def shared_positions(gen_seqs: int, tokens: int, prompt_tokens: int, group_size: int, page: int = 128) -> int:
    """KV positions the engine's paged pool takes for gen_seqs rows of `tokens` positions in groups of group_size
    rows that share their prompt's full blocks of `page` (engine.group_blocks, FlexAttention's block)."""
    groups, shared = -(-gen_seqs // group_size), prompt_tokens // page
    return page * (groups * shared + gen_seqs * (-(-tokens // page) - shared))


def plan(c: dict, gpus: int, seqs: int, tokens: int, gen_seqs: int, chunk: int, dtype: str = "bf16",
         lora_rank: int = 0, prompt_tokens: int = 0, group_size: int = 1) -> dict:
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    b = DTYPE_BYTES[dtype]  # the compute dtype: gathered weights, activations, logits, KV cache
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    attn = H * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)  # q, o and k, v projections
    layer = attn + 3 * H * I + 2 * H + 2 * hd  # + MLP, RMSNorms (layer, q, k)
    root = V * H * (1 if c.get("tie_word_embeddings") else 2) + H
    P = L * layer + root
    if lora_rank:  # the frozen base in bf16, fp32 adapters with gradients and AdamW (module docstring)
        A = lora_parameters(c, lora_rank)
        state = {"LoRA adapters (B)": A / 1e9, "frozen base, bf16 sharded 2P/n": 2 * P / gpus / GB,
                 "adapters, fp32 + grads + AdamW 16A/n": 16 * A / gpus / GB,
                 "gathered units": (b * root + 2 * b * layer + 2 * (2 * b + 4) * A / L) / GB}
    else:
        state = {"sharded state 16P/n": 16 * P / gpus / GB,
                 "gathered units": ((2 * b + 4) * root + 2 * (2 * b + 4) * layer) / GB}
    return {
        "parameters (B)": P / 1e9,
        **state,
        "activations": seqs * tokens * (b * H * L + b * (6 * H + 4 * I)) / GB,
        "log-prob chunk": chunk * V * (b + 4 + 4) / GB,
        "KV cache (generation)": gen_seqs * tokens * 2 * L * c["num_key_value_heads"] * hd * b / GB,
        "KV cache, engine paged (a group's prompt once)":
            shared_positions(gen_seqs, tokens, prompt_tokens, group_size) * 2 * L * c["num_key_value_heads"] * hd
            * b / GB,
        f"--gen-unshard ({dtype} model)": b * P / GB,
    }


def cpu_process(c: dict, procs: int, seqs: int, tokens: int, gen_seqs: int, chunk: int, baseline: float,
                fsdp: bool = True, rank0: bool = False) -> dict:
    """One training process's peak resident memory on CPU (GB), by phase. On CPU the compute dtype is fp32 and all
    state lives in RAM. Plain `python` (fsdp False): the fp32 model, its gradients and AdamW's moments, 16 P, not
    sharded. Under torchrun: plan()'s FSDP2 terms in fp32 (gathered units 12 bytes a parameter). Both add
    - baseline: the process's own (python, torch, transformers, the project; measure it: ~0.5 GB);
    - AdamW's temporaries: on CPU torch runs AdamW one tensor at a time (no foreach kernels), and its update of the
      largest tensor, the V x H embedding (its 1/n shard under FSDP2), holds two temporaries of that size
      (sqrt of the second moment, then its division); they come after the backward, when the gathered units are
      freed, so training's peak is the larger of the two, not their sum.
    Rank 0 under FSDP2 (rank0 True) also holds the whole fp32 model (4 P) while it reads the weights, freed once they
    are scattered (modeling.load_model), and while it saves a checkpoint the export's bf16 copy of the whole model (2 P,
    gathered a tensor at a time: checkpoint.full_state_dict) next to its shards and AdamW state (the gradients were
    freed after the optimizer step), plus one gathered copy of the largest tensor in bf16; the fp32 master weights
    are written from each rank's own shard, with no gather (checkpoint.write_masters). Measured on the 0.6B shape, 2
    ranks (benchmarks/checkpoint_io.py): rank 0 rose by 1.27 GB while saving, this term 1.50 GB."""
    n = procs if fsdp else 1
    r = plan(c, n, seqs, tokens, gen_seqs, chunk, dtype="fp32")
    P = r["parameters (B)"] * 1e9 / GB  # GB a byte a parameter
    adam_tmp = 2 * 4 * c["vocab_size"] * c["hidden_size"] / n / GB
    work = r["activations"] + r["log-prob chunk"] + (r["gathered units"] if fsdp else 0)
    out = {"training": baseline + 16 * P / n + max(work, adam_tmp)}
    if rank0 and fsdp:
        out.update(loading=baseline + 4 * P + 4 * P / n, saving=baseline + 12 * P / n + 2 * P + adam_tmp * n / 4)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a model's config.json, or qwen3-32b / qwen3-8b (default: Qwen3-32B's numbers)")
    ap.add_argument("--lora-rank", type=int, help="LoRA rank on every linear layer of the decoder (default: off)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seqs", type=int, default=4, help="sequences per rank in one forward/backward (minibatch)")
    ap.add_argument("--tokens", type=int, default=512 + 4096, help="prompt + completion tokens a sequence")
    ap.add_argument("--gen-seqs", type=int, default=32, help="sequences per generate call (--gen-batch-size)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="of --tokens, the prompt's")
    ap.add_argument("--group-size", type=int, default=16, help="rows a prompt (the engine shares its prompt blocks)")
    ap.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk-tokens")
    ap.add_argument("--dtype", choices=list(DTYPE_BYTES), help="compute dtype (default bf16, as on GPU)")
    ap.add_argument("--cpu", type=float, metavar="BASELINE_GB",
                    help="CPU instead (fp32): each process's RAM by cpu_process, with this baseline a process "
                         "(~0.5 GB; benchmarks/cpu_0p6b.py measures it); --gpus then counts processes")
    a = ap.parse_args()
    c = PRESETS[a.config] if a.config in PRESETS else json.load(open(a.config)) if a.config else QWEN3_32B
    if a.cpu is not None:
        return print_cpu(c, a)
    rows = {n: plan(c, n, a.seqs, a.tokens, a.gen_seqs, a.chunk, a.dtype or "bf16", a.lora_rank or 0,
                    a.prompt_tokens, a.group_size) for n in a.gpus}
    lora = f", LoRA rank {a.lora_rank}: {rows[a.gpus[0]]['LoRA adapters (B)']:.3f}B adapters" if a.lora_rank else ""
    print(f"{rows[a.gpus[0]]['parameters (B)']:.2f}B parameters{lora}; {a.seqs} sequences of {a.tokens} tokens per "
          f"rank per minibatch, {a.gen_seqs} per generate call; GB = 1e9 bytes, per GPU\n")
    print("| | " + " | ".join(f"{n} GPUs" for n in a.gpus) + " |")
    print("|---|" + "---|" * len(a.gpus))
    for k in [k for k in rows[a.gpus[0]] if not k.endswith("(B)")]:
        print(f"| {k} | " + " | ".join(f"{rows[n][k]:.1f}" for n in a.gpus) + " |")
    # the sharded state (GB), and the part of it that the freed gradients leave while generating (12 of 16 bytes)
    if a.lora_rank:
        state = {n: rows[n]["frozen base, bf16 sharded 2P/n"] + rows[n]["adapters, fp32 + grads + AdamW 16A/n"]
                 for n in a.gpus}
        held = {n: state[n] - rows[n]["adapters, fp32 + grads + AdamW 16A/n"] / 4 for n in a.gpus}
    else:
        state = {n: rows[n]["sharded state 16P/n"] for n in a.gpus}
        held = {n: state[n] * 12 / 16 for n in a.gpus}
    train = {n: state[n] + sum(rows[n][k] for k in ("gathered units", "activations", "log-prob chunk"))
             for n in a.gpus}
    gen = {n: held[n] + rows[n]["KV cache (generation)"] for n in a.gpus}
    engine = {n: gen[n] + rows[n][f"--gen-unshard ({a.dtype or 'bf16'} model)"] for n in a.gpus}
    print("| **training peak** | " + " | ".join(f"**{train[n]:.1f}**" for n in a.gpus) + " |")
    print("| **generation peak** (sharded) | " + " | ".join(f"**{gen[n]:.1f}**" for n in a.gpus) + " |")
    print("| generation peak, --gen-mode engine | " + " | ".join(f"{engine[n]:.1f}" for n in a.gpus) + " |")
    paged = {n: engine[n] - rows[n]["KV cache (generation)"] + rows[n]["KV cache, engine paged (a group's prompt once)"]
             for n in a.gpus}
    print("| generation peak, --gen-mode engine, paged (a group's prompt once) | " +
          " | ".join(f"{paged[n]:.1f}" for n in a.gpus) + " |")
    # the scripts keep the Engine (its whole KV cache and weight copy) across steps, so the training step runs beside
    # it (a paged pool sized to the free memory is not kept: engine.generate); on an H200 the checkpointed 0.6B step
    # peaked at 44.3 GB with the Engine held against 6.2 GB without (benchmarks/README.md, 2026-11-28)
    kept = {n: train[n] + engine[n] - held[n] for n in a.gpus}
    print("| training peak, --gen-mode engine (the Engine kept across steps) | " +
          " | ".join(f"{kept[n]:.1f}" for n in a.gpus) + " |")
    if not a.lora_rank:  # LoRA refuses --cpu-offload
        print("| training peak, --cpu-offload | " + " | ".join(
            f"{train[n] - rows[n]['sharded state 16P/n']:.1f}" for n in a.gpus) + " |")
    print(command(a))


def print_cpu(c: dict, a):
    job = dict(seqs=a.seqs, tokens=a.tokens, gen_seqs=a.gen_seqs, chunk=a.chunk, baseline=a.cpu)
    cols = {"python, 1 process": cpu_process(c, 1, fsdp=False, **job)}
    for n in a.gpus:
        cols[f"torchrun, {n}: rank 0"] = cpu_process(c, n, rank0=True, **job)
        if n > 1:
            cols[f"torchrun, {n}: rank > 0"] = cpu_process(c, n, **job)
    print(f"CPU, fp32; {a.seqs} sequences of {a.tokens} tokens per rank per minibatch; RAM of each process, GB = 1e9 "
          f"bytes, with a baseline of {a.cpu} GB a process\n")
    print("| phase | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for phase in ("training", "loading", "saving"):
        print(f"| {phase} | " + " | ".join(f"{v[phase]:.2f}" if phase in v else "-" for v in cols.values()) + " |")
    print("| **peak** | " + " | ".join(f"**{max(v.values()):.2f}**" for v in cols.values()) + " |")
    print(command(a))


def command(a) -> str:
    return "\ncommand: python benchmarks/memory_plan.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(a).items() if v is not None)


if __name__ == "__main__":
    main()
