"""Per-GPU memory of one training job under FSDP2, as this project lays it out, by arithmetic (no GPU needed):

    python benchmarks/memory_plan.py                                    # Qwen3-32B on 8, 16 and 32 GPUs
    python benchmarks/memory_plan.py --config path/to/config.json --gpus 8 --seqs 8 --tokens 4608

What is counted (bytes; P parameters, L layers, H hidden, I intermediate, V vocabulary):
- sharded state, 16 P / n: fp32 master weights (4), fp32 gradients (4), AdamW's two fp32 moments (8). With
  --cpu-offload all of it lives in CPU memory instead.
- gathered units: FSDP2 gathers one unit at a time (plus one prefetched) in bf16, with its bf16 gradient and an
  fp32 reduce-scatter buffer (8 bytes a parameter); the root unit (embeddings, final norm, LM head) stays gathered
  for the whole forward and backward.
- activations, decoder layers checkpointed: each layer keeps its bf16 input (2 H a token); the layer being
  recomputed holds about 2 (6 H + 4 I) bytes a token (q, k, v, o, MLP gate/up/product).
- log-probs: one chunk of --logprob-chunk-tokens x V logits in bf16 and two fp32 buffers (common.chunked_logprobs).
- KV cache while generating: 2 (k, v) x L x kv_heads x head_dim x 2 bytes a token, for --gen-batch-size sequences.
- --gen-unshard: the whole model in bf16 (2 P) while generating.
Real runs add the CUDA context, allocator fragmentation and NCCL buffers (a few GB): keep ~10% headroom.
"""
import argparse
import json

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
GB = 1e9


def plan(c: dict, gpus: int, seqs: int, tokens: int, gen_seqs: int, chunk: int) -> dict:
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    attn = H * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)  # q, o and k, v projections
    layer = attn + 3 * H * I + 2 * H + 2 * hd  # + MLP, RMSNorms (layer, q, k)
    root = V * H * (1 if c.get("tie_word_embeddings") else 2) + H
    P = L * layer + root
    return {
        "parameters (B)": P / 1e9,
        "sharded state 16P/n": 16 * P / gpus / GB,
        "gathered units": (8 * root + 2 * 8 * layer) / GB,
        "activations": seqs * tokens * (2 * H * L + 2 * (6 * H + 4 * I)) / GB,
        "log-prob chunk": chunk * V * (2 + 4 + 4) / GB,
        "KV cache (generation)": gen_seqs * tokens * 2 * L * c["num_key_value_heads"] * hd * 2 / GB,
        "--gen-unshard (bf16 model)": 2 * P / GB,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a model's config.json (default: Qwen3-32B's numbers)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seqs", type=int, default=4, help="sequences per rank in one forward/backward (minibatch)")
    ap.add_argument("--tokens", type=int, default=512 + 4096, help="prompt + completion tokens a sequence")
    ap.add_argument("--gen-seqs", type=int, default=32, help="sequences per generate call (--gen-batch-size)")
    ap.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk-tokens")
    a = ap.parse_args()
    c = json.load(open(a.config)) if a.config else QWEN3_32B
    rows = {n: plan(c, n, a.seqs, a.tokens, a.gen_seqs, a.chunk) for n in a.gpus}
    print(f"{rows[a.gpus[0]]['parameters (B)']:.2f}B parameters; {a.seqs} sequences of {a.tokens} tokens per rank "
          f"per minibatch, {a.gen_seqs} per generate call; GB = 1e9 bytes, per GPU\n")
    print("| | " + " | ".join(f"{n} GPUs" for n in a.gpus) + " |")
    print("|---|" + "---|" * len(a.gpus))
    for k in list(rows[a.gpus[0]])[1:]:
        print(f"| {k} | " + " | ".join(f"{rows[n][k]:.1f}" for n in a.gpus) + " |")
    train = {n: sum(rows[n][k] for k in ("sharded state 16P/n", "gathered units", "activations", "log-prob chunk"))
             for n in a.gpus}
    gen = {n: rows[n]["sharded state 16P/n"] + rows[n]["KV cache (generation)"] for n in a.gpus}
    print("| **training peak** | " + " | ".join(f"**{train[n]:.1f}**" for n in a.gpus) + " |")
    print("| **generation peak** (sharded) | " + " | ".join(f"**{gen[n]:.1f}**" for n in a.gpus) + " |")
    print("| training peak, --cpu-offload | " + " | ".join(
        f"{train[n] - rows[n]['sharded state 16P/n']:.1f}" for n in a.gpus) + " |")
    print("\ncommand: python benchmarks/memory_plan.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(a).items() if v is not None))


if __name__ == "__main__":
    main()
