"""Generation time of each mode of generation.generate, side by side in one process, on a random-init Qwen3-shaped model:

    python benchmarks/generation.py          # Qwen3-0.6B shape, fp32, 4 prompts x 8 completions, 256 + 64 tokens
    python benchmarks/generation.py --model /path/to/SmolLM2-135M-Instruct --group-size 3   # a real model's folder

repeat          each prompt repeated G times, so HF `generate` prefills it G times
shared-prefill  each prompt prefilled once, its KV cache repeated to the G rows of its group (the default)
engine          engine/: plain-PyTorch decoding over a KV cache allocated once, each prompt prefilled once
engine-paged    the same with a paged KV pool of --pool-tokens positions (SDPA: blocks of engine.PAGE, gathered per
                step; --flex: blocks of engine.FLEX_BLOCK, read in place through the block mask)

Every completion runs to --new-tokens (EOS disabled: the same work for every mode and repeat). The modes take turns
(repeat, shared-prefill, repeat, ...) after one short warm-up call each, so a drift in the machine's speed hits them
alike; the table gives min / median / max seconds per mode and the per-round ratio of each mode to --baseline.
--profile records round 1's calls with torch.profiler and prints each mode's top operators by self CPU time.
--model: an HF model folder (its weights, in fp32) in place of the random model: the prompts are then its chat
template around arithmetic questions (--prompt-tokens does not apply). --gen-batch-size: as the scripts' flag (rows
a call for repeat, groups a call for shared-prefill, slots for the engine), by default the scripts' 256.
The table gives wall seconds and the CPU seconds the process used (less noisy on a shared machine).
"""
import argparse
import os
from contextlib import nullcontext
from dataclasses import replace
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6B", help="a key of shapes.QWEN3, or 'tiny' (shapes.TINY)")
    ap.add_argument("--model", default=None, help="an HF model folder instead of a random --shape model")
    ap.add_argument("--gen-batch-size", type=int, default=256, help="as the scripts' --gen-batch-size")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="timed calls of each mode, in turns")
    ap.add_argument("--modes", default="repeat,shared-prefill,engine")
    ap.add_argument("--pool-tokens", type=int, default=0,
                    help="engine-paged's KV pool (default: half of what every row at full length needs)")
    ap.add_argument("--baseline", default="shared-prefill", help="the mode the ratios are taken against")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--profile", action="store_true", help="profile round 1 (torch.profiler) and print its tables")
    ap.add_argument("--flex", nargs="?", const="all", choices=["all", "paged"],
                    help="engine modes attend through FlexAttention, each decoder layer compiled by inductor with it, "
                    "as on a GPU (paged: the pool read in place; on the CPU the layer's graph breaks around flex, "
                    "compiled on its own: engine.Engine); --flex paged: engine-paged only, beside the CPU's default "
                    "engine (SDPA, eager layers)")
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers.utils import logging as hf_logging

    from grouprl import generation
    from grouprl import distributed
    from grouprl import modeling
    from grouprl.sampling import Sampling
    import shapes

    hf_logging.set_verbosity_error()  # EOS id -1 below is on purpose (transformers warns about it)

    from grouprl import engine

    modes = a.modes.split(",")
    if a.shape != "tiny" and a.shape not in shapes.QWEN3 or not set(modes) <= {*generation.GEN_MODES, "engine-paged"}:
        raise SystemExit(f"error: --shape is one of tiny, {', '.join(shapes.QWEN3)} and --modes a comma list of "
                         f"{', '.join(generation.GEN_MODES)}, engine-paged")
    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    torch.manual_seed(0)
    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grouprl.data import chat_prompts

        tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
        lm = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        questions = [f"What is {11 + 7 * i} + {25 + 13 * i}? Put the final answer in \\boxed{{}}."
                     for i in range(a.prompts)]
        texts = chat_prompts(tok, questions)
    else:
        shape = shapes.TINY if a.shape == "tiny" else shapes.QWEN3[a.shape]
        tok = shapes.word_tokenizer(shape["vocab_size"])
        lm = shapes.random_model(shape, tok, torch.float32)
        texts = shapes.prompts(a.prompts, a.prompt_tokens, shape["vocab_size"])
        assert len(tok(texts[0]).input_ids) == a.prompt_tokens
    print(f"model built in {time.perf_counter() - t:.0f}s: {sum(p.numel() for p in lm.parameters()) / 1e9:.3f}B "
          f"parameters, fp32, {a.threads} threads, torch {torch.__version__}")
    d = distributed.Dist(0, 1, torch.device("cpu"))
    policy = modeling.Policy(lm).eval()
    P = tok(texts, padding=True, add_special_tokens=False, return_tensors="pt").input_ids.shape[1]

    pool = a.pool_tokens or a.prompts * a.group_size * (a.prompt_tokens + a.new_tokens) // 2
    whole = engine.generate

    def paged(lm, prompts, n, eos, sampling, setup, *rest):  # the engine on a pool of `pool` positions
        tokens = max(pool, a.group_size * (a.prompt_tokens + sampling.max_new_tokens))
        return whole(lm, prompts, n, eos, sampling, replace(setup, pool_tokens=tokens), *rest)

    def run(mode, prompts, new_tokens):
        flex = a.flex == "all" or a.flex == "paged" and mode == "engine-paged"
        t, cpu = time.perf_counter(), time.process_time()
        engine.generate = paged if mode == "engine-paged" else whole
        sampling = Sampling(new_tokens, gen_batch_size=a.gen_batch_size, mode=mode.replace("-paged", ""),
                            flex=flex or None, compile_step=flex or None)
        # EOS id -1: never produced, every completion has new_tokens tokens
        out = generation.generate(policy, tok, prompts, a.group_size, [-1], d, sampling)
        if len(prompts) == len(texts):
            assert out.input_ids.shape == (len(prompts) * a.group_size, P + new_tokens)
        return time.perf_counter() - t, time.process_time() - cpu

    for mode in modes:  # warm-up: one short call each
        run(mode, texts[:1], 2)
    times, cpus, profiles = {m: [] for m in modes}, {m: [] for m in modes}, {}
    for r in range(a.rounds):
        for mode in modes:
            with profile(activities=[ProfilerActivity.CPU]) if a.profile and r == 0 else nullcontext() as prof:
                wall, cpu = run(mode, texts, a.new_tokens)
            times[mode].append(wall)
            cpus[mode].append(cpu)
            print(f"round {r + 1} {mode}: {wall:.2f}s ({cpu:.2f} CPU s)", flush=True)
            if prof is not None:
                profiles[mode] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    n = a.prompts * a.group_size * a.new_tokens
    print(f"\n{a.model or a.shape}: {a.prompts} prompts x {a.group_size} completions, {P}-token prompts, "
          f"{a.new_tokens} new tokens, {a.rounds} rounds\n")
    print(f"| mode | s / call: min | median | max | CPU s (median) | new tokens / s (median) | "
          f"time / {a.baseline}, per round |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        ratios = [x / y for x, y in zip(times[m], times[a.baseline])] if a.baseline in modes else []
        print(f"| {m} | {min(times[m]):.2f} | {statistics.median(times[m]):.2f} | {max(times[m]):.2f} | "
              f"{statistics.median(cpus[m]):.2f} | {n / statistics.median(times[m]):.1f} | "
              f"{' '.join(f'{x:.2f}' for x in ratios) or '-'} |")
    for mode, table in profiles.items():
        print(f"\nprofile of round 1, {mode} (top operators by self CPU time):\n{table}")
    print(" ".join(["\ncommand: python", f"benchmarks/{os.path.basename(__file__)}"] + sys.argv[1:]))


if __name__ == "__main__":
    main()
