"""The project on one GPU, in the real shapes of Qwen3-0.6B, 1.7B, 4B and 8B with random bf16 weights (random
weights run at the speed of trained ones; no download):

    python benchmarks/gpu.py --models 0.6B,1.7B --minutes 6 --no-trl   # one 10-minute call; gpu.md, gpu.json in --out
    python benchmarks/gpu.py --models 8B --gen-modes shared-prefill  # 8B alone: every mode outlasts 10 minutes
    python benchmarks/gpu.py --smoke          # every code path on CPU with tiny shapes, in seconds (the test suite)

Per model, as far as each fits:
- generation: a GSPO rollout through generation.generate, --prompts x --group-size completions of --prompt-tokens-token
  prompts, up to --new-tokens new tokens, in each mode of --gen-modes (default: all of generation.GEN_MODES, and
  engine-eager: the engine without CUDA graphs, --no-gen-cuda-graphs, to show what the graphs gain; engine-sdpa: the
  engine attending through SDPA over the whole read length, to show what FlexAttention's live blocks gain;
  engine-nocompile: the graphs replaying the eager layers, to show what inductor's fusion gains; engine-flexapart:
  FlexAttention compiled apart from the layer, its kernel without the q/k norms and RoPE fused in, engine.FLEX_APART).
  Random
  weights never say EOS, so realistic early stops are made by declaring V / --mean-length token ids EOS: a completion
  stops at each step with probability about 1 / --mean-length (roughly geometric lengths; the table gives the measured
  mean). static and the engine modes are timed after one untimed call (which compiles). tokens/s = completion tokens
  (up to and including EOS) / wall time of the call. share of bound: the memory-bandwidth bound of the same rollout
  over the measured time. The bound reads, at every decoding step, the weights once and each live row's KV cache over
  its length (prompt + tokens so far), from the config and the lengths actually generated, at the bandwidth a
  device-to-device copy reaches in the same run (read + write bytes / time); prefill is left out, so the bound is a
  little optimistic.
- training: forward + backward of Policy.forward (chunked log-probs) and gspo_loss, then an AdamW step, on
  --train-seqs sequences of --train-tokens tokens, with and without activation checkpointing. tokens/s over the
  timed steps; MFU = model FLOPs / (time x the GPU's dense bf16 peak), model FLOPs a token = 6 N + 12 L h T (N the
  matmul parameters, LM head included, input embedding not; L layers, h = heads x head_dim, T the sequence length;
  recomputation is not counted as useful work).
- memory: peak allocated GPU memory of the training step against memory_plan.py's prediction for the same job with
  checkpointed layers. One process trains the plain bf16 model (modeling.wrap_policy without FSDP): weights, gradients
  and AdamW's two moments in bf16 are 8 bytes a parameter, in place of the plan's sharded fp32 16 P / n and gathered
  units; activations and the log-prob chunk are the plan's own terms.
- engine memory: each engine mode's peak GPU memory above what the call started with, against engine.memory_needed
  (the KV cache and the weights the engine copies: here, bf16 weights on the GPU, the fused q/k/v and gate/up and
  the rotary tables; the other weights are read in place).
- paged check (--paged-check): greedy completions through the engine with the whole KV cache and with a paged pool,
  token for token and log-prob for log-prob (paging through the compiled layer has never run on a GPU).
- shared check (--shared-check): a group's prompt stored once against each row's own copy (engine.SHARE_PROMPTS),
  paged, 4 prompts of 2,000 tokens x --group-size rows, 128 sampled tokens: the KV blocks taken, the KV bytes a step
  reads by row and distinct (the physical bytes; whether the GPU reads a shared block once is what the times say),
  tok/s, and the two sides' rows token for token.
- episodes check (--episodes-check): episodes of 4 turns on the engine (grouprl/engine/turns.py) with a scripted
  tool turn between turns, each row's KV cache kept across its turns against re-prefilling the history each turn
  (engine.settings.KEEP_TURNS = False, the same Engine), 4 prompts of 1,000 tokens x --group-size rows, greedy: the
  tokens each side's prefills computed, tok/s, and the two sides' episodes token for token.
- training beside the Engine (--train-beside-engine): right after the generation modes, with the last mode's Engine
  still kept (the scripts keep it across steps), the checkpointed training step's peak against the plan's training
  peak plus engine.memory_needed for the rollout's rows (memory_plan.py's "Engine kept across steps" row). Needs
  gspo.py, hence tyro: on the GPU image, with the wheels of ../shared/tools/gpu-wheels.sh installed.
- TRL: if `trl` imports, benchmarks/rl_step.py on the 0.6B shape (gspo.py --gen-mode engine against TRL's
  GRPOTrainer as GSPO, no vLLM, one RL step's median wall time).
One call cannot come back empty: each mode's row and each training row is written to --out (default $OUT, the
folder a device call brings back) the moment it is measured; a mode or training row that fails (out of memory or any
other error) is a row holding its one-line error, and the call goes on; once --minutes have passed, every remaining
model, mode and training row is written as skipped. Generation imports nothing of the training path: on an image
without tyro (gspo.py imports cli) the training rows say so. The command for a ~10-minute lease is in
benchmarks/README.md ("One GPU call").
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.05}  # dense


def peak_tflops(name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (first match in PEAK_BF16_TFLOPS's order), None if unknown."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_token(c: dict, seq_len: int) -> float:
    """Training FLOPs a token: 6 N + 12 L h T (PaLM's formula; N matmul parameters, LM head included)."""
    H, L, h = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"] * c["head_dim"]
    attn = H * c["head_dim"] * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    N = L * (attn + 3 * H * c["intermediate_size"]) + c["vocab_size"] * H
    return 6 * N + 12 * L * h * seq_len


def sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def bandwidth(device) -> float:
    """Bytes/s a device-to-device copy of 1 GiB (64 MiB on CPU) reaches: read + write bytes over the best of 5."""
    import torch

    x = torch.empty((1 << 30) if device.type == "cuda" else (64 << 20), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() / best


def bound_seconds(lengths: list[int], prompt_tokens: int, weight_bytes: int, kv_bytes_per_token: int,
                  bytes_per_s: float) -> float:
    """Decoding time at the memory-bandwidth limit: every step reads the weights and each live row's KV cache."""
    total = 0
    for t in range(1, max(lengths) + 1):  # decoding step t makes each live row's t-th token
        live = [n for n in lengths if n >= t]
        total += weight_bytes + kv_bytes_per_token * len(live) * (prompt_tokens + t - 1)
    return total / bytes_per_s


def bench_generation(policy, tok, shape, a, d, out=None, flush=lambda: None) -> dict:
    import torch

    from grouprl import generation
    from grouprl.sampling import Sampling
    import shapes

    V = shape["vocab_size"]
    g = torch.Generator().manual_seed(0)
    eos = torch.randperm(V - 3, generator=g)[:max(1, V // a.mean_length)].add(3).tolist()  # ids >= 3: no special
    texts = shapes.prompts(a.prompts, a.prompt_tokens, V)
    # untimed: CUDA/cuBLAS start-up is not the first mode's cost
    generation.generate(policy, tok, texts[:1], 2, eos, d, Sampling(2, gen_batch_size=2))
    out = {} if out is None else out
    bytes_per_s = bandwidth(d.device)
    elem = next(policy.parameters()).element_size()
    # read every step: every weight but an untied input embedding (a lookup of one row a token)
    untied_embedding = 0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"]
    weight_bytes = (sum(p.numel() for p in policy.parameters()) - untied_embedding) * elem
    kv_bytes_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * elem
    for mode in a.gen_modes:
        if time.time() > a.deadline:
            out[mode] = {"error": f"skipped: over --minutes {a.minutes}"}
            continue
        try:
            out[mode] = _one_mode(policy, tok, shape, a, d, mode, texts, eos, bytes_per_s, weight_bytes,
                                  kv_bytes_per_token)
        except torch.OutOfMemoryError:
            out[mode] = {"error": "OOM"}
        except (Exception, SystemExit) as e:  # one failing mode is a row, not the end of the call (generation.generate
            # turns an OOM into SystemExit with its one-line error)
            out[mode] = error_row(e)
        flush()  # each mode's row on disk the moment it is measured
        if a.profile and mode == "engine" and time.time() < a.deadline:  # the engine's rollout, profiled
            try:
                out["profile"] = profile(policy, tok, texts, eos, a, d, a.model_name)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                out["profile"] = error_row(e)
            flush()
    return out


def error_row(e: BaseException) -> dict:
    """A failed measurement as its row: the error's type and first line (its traceback printed)."""
    import traceback

    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def rollout(policy, tok, texts, eos, a, d, mode: str) -> dict:
    """One GSPO rollout through generation.generate in a row of --gen-modes, or of --flex-options
    ('engine{...}': the engine with exactly those FlexAttention decoding kernel options, engine.settings.FLEX_OPTIONS;
    'engine{}': inductor's defaults)."""
    from grouprl import generation
    from grouprl.sampling import Sampling

    engine_mode = mode.startswith("engine-") and mode != "engine-tp"
    options = json.loads(mode[len("engine"):]) if mode.startswith("engine{") else None
    from grouprl.engine import settings

    if options is not None:
        settings.FLEX_OPTIONS = options
    settings.FLEX_APART = True if mode == "engine-flexapart" else None
    try:
        sampling = Sampling(
            a.new_tokens, gen_batch_size=a.prompts * a.group_size,
            mode="engine" if options is not None else mode.split("-")[0] if engine_mode else mode,
            cuda_graphs=mode != "engine-eager", flex=False if mode == "engine-sdpa" else None,
            compile_step=False if mode == "engine-nocompile" else None)
        return generation.generate(policy, tok, texts, a.group_size, eos, d, sampling)
    finally:
        settings.FLEX_OPTIONS, settings.FLEX_APART = None, None


def profile(policy, tok, texts, eos, a, d, name: str) -> dict:
    """The engine's rollout under torch.profiler (GPU kernels only, those its CUDA graphs replay included):
    where the decoding time goes, kernel by kernel. Its table is written to --out as profile_<model>.txt;
    returns the totals: wall seconds, seconds of kernels, kernels launched."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if "grouprl.engine" in sys.modules:  # a fresh Engine, as the engine row had
        sys.modules["grouprl.engine"].HELD.clear()
    rollout(policy, tok, texts, eos, a, d, "engine")  # untimed: compiles, makes the Engine the next call keeps
    sync(d.device)
    with torch_profile(activities=[ProfilerActivity.CUDA] if d.device.type == "cuda" else [ProfilerActivity.CPU]) \
            as prof:
        t = time.perf_counter()
        roll = rollout(policy, tok, texts, eos, a, d, "engine")
        sync(d.device)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    own = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or (  # noqa
        e.self_cpu_time_total if d.device.type != "cuda" else 0)
    rows = sorted(events, key=own, reverse=True)
    busy = sum(own(e) for e in rows) / 1e6
    count = sum(e.count for e in rows)
    tokens = roll.mask.sum().item()
    lines = [f"{name}: the engine's rollout under torch.profiler: {wall:.2f} s wall, {busy:.2f} s of kernels "
             f"({busy / wall:.0%} busy), {count} kernels, {tokens} tokens, {int(roll.mask.sum(1).max())} steps",
             "", "| kernel | calls | ms | share of kernel time |", "|---|---|---|---|"]
    lines += [f"| {e.key[:120]} | {e.count} | {own(e) / 1e3:.1f} | {own(e) / 1e6 / busy:.1%} |" for e in rows[:40]]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"profile_{name}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:20]), flush=True)
    return {"wall_s": wall, "kernel_s": busy, "kernels": count, "tokens": tokens}


def paged_check(lm, shape, d) -> dict:
    """Paging against the whole cache, where the engine runs by default (on a GPU: FlexAttention compiled inside the
    layer, reading the pool in place; on the CPU the layer compiled by inductor gives wrong logits paged,
    tests/test_engine_step.py): 4 prompts of 37-300 tokens x 2, 64 greedy tokens, no EOS, a pool that holds every
    row (nothing preempted). The rows equal token for token, and the largest log-prob difference over the tokens
    before each row's first difference (bf16: a near-tie may flip a token; a broken read is off by whole nats)."""
    import torch

    from grouprl import engine
    from grouprl.sampling import Sampling

    engine.HELD.clear()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() for n in (37, 300, 130, 200)]
    new, n = 64, 2
    block = engine.page_size(d.device.type == "cuda")
    pool = n * sum(-(-(len(p) + new + engine.SYNC_EVERY) // block) * block for p in prompts)
    greedy = Sampling(new, top_k=1)
    (whole, whole_lp), (paged, paged_lp) = (
        engine.generate(lm, prompts, n, [-1], greedy,
                        engine.Setup(len(prompts) * n, d.device, next(lm.parameters()).dtype, pool_tokens=pt))
        for pt in (None, pool))
    diff = 0.0
    for a, b, la, lb in zip(whole, paged, whole_lp, paged_lp):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        diff = max([diff] + [abs(x - y) for x, y in zip(la[:same], lb[:same])])
    return {"rows": len(whole), "rows_equal": sum(a == b for a, b in zip(whole, paged)), "max_logp_diff": diff}


def shared_check(lm, shape, a, d) -> dict:
    """A group's prompt stored once (engine.SHARE_PROMPTS) against each row's own copy, paged: 4 prompts of 2,000
    tokens (--smoke: 40) x --group-size rows, 128 tokens sampled from one seed (--smoke: 4; sampled, so that a
    group's rows differ, which greedy ones would not), no EOS, a pool that holds every row
    unshared (nothing waits). Per side: its time after one untimed call (compilation), the KV blocks taken and read by
    a decoding step (each row's, and distinct: physical) and a block's bytes (engine.generate's stats); and whether
    the two sides' rows are equal token for token, with their largest log-prob difference."""
    import torch

    from grouprl import engine
    from grouprl.engine import settings
    from grouprl.sampling import Sampling

    engine.HELD.clear()
    P, new, n = (40, 4, a.group_size) if a.smoke else (2000, 128, a.group_size)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, shape["vocab_size"], (P,), generator=g).tolist() for _ in range(4)]
    block = engine.page_size(d.device.type == "cuda")
    sampling = Sampling(new)
    setup = engine.Setup(len(prompts) * n, d.device, next(lm.parameters()).dtype,
                         pool_tokens=len(prompts) * n * block * -(-(P + new + 8) // block))
    out = {}
    try:
        for share in (True, False):
            settings.SHARE_PROMPTS = share
            engine.generate(lm, prompts, n, [-1], sampling, setup)  # untimed: compiles
            stats, seed = {}, torch.Generator(d.device).manual_seed(3)
            sync(d.device)
            t = time.perf_counter()
            rows, logps = engine.generate(lm, prompts, n, [-1], sampling, setup, seed, stats)
            sync(d.device)
            out[share] = dict(s=time.perf_counter() - t, rows=rows, logps=logps, **{
                k: stats[k] for k in ("kv_blocks_peak", "kv_read_peak", "kv_read_physical_peak", "block_bytes")})
    finally:
        settings.SHARE_PROMPTS = True
    diff = max(abs(x - y) for la, lb in zip(out[True]["logps"], out[False]["logps"]) for x, y in zip(la, lb))
    equal = sum(x == y for x, y in zip(out[True].pop("rows"), out[False].pop("rows")))
    for side in out.values():
        side.pop("logps")
        side["tokens_per_s"] = len(prompts) * n * new / side["s"]
    return {"shape": f"{len(prompts)} x {n} rows, {P}-token prompts, {new} new tokens", "rows_equal": equal,
            "rows": len(prompts) * n, "max_logp_diff": diff, "shared": out[True], "unshared": out[False]}


def episodes_check(lm, shape, a, d) -> dict:
    """Episodes on the engine (grouprl/engine/turns.py, as --tools with --gen-mode engine runs them) with each row's
    KV cache kept across its turns, against re-prefilling each turn's whole history (settings.KEEP_TURNS = False,
    the same kept Engine: what HF generate does in the tool loop): 4 prompts of 1,000 tokens (--smoke: 24) x
    --group-size rows, 4 model turns of 128 greedy tokens each (--smoke: 4), no EOS, and after each of the first 3
    a scripted tool turn of 64 tokens (--smoke: 5; the same random ids for every row: no tools file, no tokenizer).
    Per side, after one untimed kept run (compilation): wall seconds of the episodes, model tokens/s, the tokens
    its prefills computed (a group's prompt once) and the later turns' prefill per episode; and whether the two
    sides' episodes are equal token for token, with the largest log-prob difference before a row's first
    difference (bf16: a near-tie may flip a greedy token; a wrong read is off by whole nats)."""
    import torch

    from grouprl import engine
    from grouprl.engine import rollout as engine_rollout
    from grouprl.engine import settings, turns
    from grouprl.sampling import Sampling

    engine_rollout.release(lm)  # a kept Engine freed (a reference cycle: gc) before this one plans its cache
    P, T, tool_len, k = (24, 4, 5, 4) if a.smoke else (1000, 128, 64, 4)
    n, g = a.group_size, torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, shape["vocab_size"], (P,), generator=g).tolist() for _ in range(4)]
    tools = [torch.randint(3, shape["vocab_size"], (tool_len,), generator=g).tolist() for _ in range(k - 1)]
    rows = len(prompts) * n
    setup = engine.Setup(rows, d.device, next(lm.parameters()).dtype, keep=True)  # one Engine for every run

    def run(keep: bool) -> dict:
        settings.KEEP_TURNS = keep
        e, resolved, _ = engine_rollout.made(lm, prompts, n, k * T + (k - 1) * tool_len, setup)
        episodes = turns.Episodes(e, resolved, [-1], Sampling(T, top_k=1))  # a turn: T tokens
        sync(d.device)
        t = time.perf_counter()
        try:
            said = episodes.first(prompts, n)
            for tool in tools:  # each row's history and the tool turn; the next turn's room
                said += episodes.next([ids + tool for ids in episodes.ids], [T] * rows)
        finally:
            episodes.close()
        sync(d.device)
        s = time.perf_counter() - t
        tokens = sum(len(m[0]) for m in said)
        later = (episodes.counts["prefill_tokens"] - sum(map(len, prompts))) / rows
        return {"s": s, "tokens_per_s": tokens / s, "model_tokens": tokens,
                "prefill_tokens": episodes.counts["prefill_tokens"], "later_prefill_per_episode": later,
                "ids": episodes.ids, "logp": episodes.logp}

    try:
        run(True)  # untimed: compiles and captures
        out = {"kept": run(True), "re-prefilled": run(False)}
    finally:
        settings.KEEP_TURNS = True
        engine_rollout.release(lm)
    (ka, kl), (fa, fl) = ((out[x].pop("ids"), out[x].pop("logp")) for x in ("kept", "re-prefilled"))
    diff = 0.0
    for x, y, lx, ly in zip(ka, fa, kl, fl):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        diff = max([diff] + [abs(u - v) for u, v in zip(lx[:same], ly[:same])])
    return {"shape": f"{len(prompts)} x {n} rows, {P}-token prompts, {k} turns of {T} greedy tokens, "
                     f"{tool_len}-token tool turns", "rows": rows, "rows_equal": sum(x == y for x, y in zip(ka, fa)),
            "max_logp_diff": diff, **out}


def episodes_line(c: dict) -> str:
    """--episodes-check's result in one line: per side its prefill, time and tok/s; the rows compared."""
    def side(x):
        return (f"{x['prefill_tokens']} tokens prefilled ({x['later_prefill_per_episode']:.0f} an episode after its "
                f"prompt), {x['s']:.2f} s, {x['tokens_per_s']:.0f} tok/s")
    kept, full = c["kept"], c["re-prefilled"]
    return (f"{c['shape']}: KV kept {side(kept)}; re-prefilled {side(full)}; later turns' prefill "
            f"{full['later_prefill_per_episode'] / max(kept['later_prefill_per_episode'], 1):.1f}x fewer kept, "
            f"tok/s {kept['tokens_per_s'] / full['tokens_per_s']:.2f}x; {c['rows_equal']} of {c['rows']} episodes "
            f"equal, log-probs within {c['max_logp_diff']:.2g}")


def held(device) -> dict:
    """GB the allocator holds after the generation modes: with engine.HELD cleared, after gc, after
    torch._dynamo.reset() (which of them frees the Engine says what kept it)."""
    import gc

    import torch

    if "grouprl.engine" in sys.modules:
        sys.modules["grouprl.engine"].HELD.clear()
    out = {"HELD cleared": torch.cuda.memory_allocated(device) / 1e9}
    gc.collect()
    out["gc.collect"] = torch.cuda.memory_allocated(device) / 1e9
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    out["torch._dynamo.reset"] = torch.cuda.memory_allocated(device) / 1e9
    return out


def _one_mode(policy, tok, shape, a, d, mode, texts, eos, bytes_per_s, weight_bytes, kv_bytes_per_token) -> dict:
    import torch

    cuda = d.device.type == "cuda"
    # the previous mode's kept Engine (generation.generate keeps one per run) freed, as far as each step frees it
    freed = held(d.device) if cuda else None
    # static and the engine modes: the first call compiles (HF's step; FlexAttention, first and dynamic read
    # lengths) and is not timed, so no mode's time holds a compilation; the engine's first call also makes the
    # Engine the timed call reuses (its cache, graphs and weight copies): its memory is the first call's peak
    peak = None
    for timed in (False, True) if mode == "static" or mode.startswith("engine") else (True,):
        torch.manual_seed(0)
        sync(d.device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d.device)
        base = torch.cuda.memory_allocated(d.device) if cuda else 0
        t = time.perf_counter()
        roll = rollout(policy, tok, texts, eos, a, d, mode)
        sync(d.device)
        s = time.perf_counter() - t
        if cuda and peak is None:  # the call's peak GPU memory above what it started with
            peak = (torch.cuda.max_memory_allocated(d.device) - base) / 1e9
    tokens = roll.mask.sum().item()
    bound = bound_seconds(roll.mask.sum(1).long().tolist(), a.prompt_tokens, weight_bytes, kv_bytes_per_token,
                          bytes_per_s)
    res = {"s": s, "tokens_per_s": tokens / s, "mean_length": tokens / roll.mask.shape[0],
           "bound_share": bound / s, "bandwidth_GBps": bytes_per_s / 1e9,
           "peak_gb": peak, "allocated_before_gb": freed}
    if mode.startswith("engine") and cuda:  # against the engine's plan (memory_plan.py's engine row)
        from grouprl import engine

        kv, weights = engine.memory_needed(policy.lm, a.prompts * a.group_size,
                                           a.prompt_tokens + a.new_tokens, next(policy.parameters()).dtype,
                                           device=d.device)  # the weights it copies (fused q/k/v, gate/up)
        res["plan_gb"] = (kv + weights) / 1e9
    return res


def training_row(lm, policy, shape, a, d, checkpointing: bool, beside: bool = False):
    """bench_training's row, or why there is none: skipped (--no-train, past --minutes), OOM, the error."""
    import torch

    if (a.no_train and not beside) or time.time() > a.deadline:
        return "skipped: " + ("--no-train" if a.no_train and not beside else f"over --minutes {a.minutes}")
    try:
        return bench_training(lm, policy, shape, a, d, checkpointing, beside)
    except torch.OutOfMemoryError:
        return "OOM"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:200]


def bench_training(lm, policy, shape, a, d, checkpointing: bool, beside: bool = False) -> dict:
    import torch

    import memory_plan

    try:  # the training path (gspo.py imports cli, hence tyro) is optional: generation never needs it
        from gspo import gspo_loss
    except ImportError as e:
        return f"skipped: gspo.py does not import ({e})"

    if checkpointing:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.activation_checkpointing_disable()
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    B, T, P = a.train_seqs, a.train_tokens, a.prompt_tokens
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, shape["vocab_size"], (B, T), generator=g).to(d.device)
    am = torch.ones_like(ids)
    mask = torch.ones(B, T - P, device=d.device)
    adv = torch.randn(B, generator=g).to(d.device)
    cuda = d.device.type == "cuda"

    def step():
        opt.zero_grad(set_to_none=True)
        logp = policy(ids, am, P)
        loss, _, _ = gspo_loss(logp, logp.detach(), adv, mask, clip_low=3e-4, clip_high=4e-4)
        loss.backward()
        opt.step()

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d.device)
    step()  # warm-up (and the AdamW state)
    sync(d.device)
    t = time.perf_counter()
    for _ in range(a.train_steps):
        step()
    sync(d.device)
    s = (time.perf_counter() - t) / a.train_steps
    peak = torch.cuda.max_memory_allocated(d.device) / 1e9 if cuda else None
    opt = None  # its AdamW state freed
    policy.eval()
    lm.activation_checkpointing_disable()
    plan = memory_plan.plan(shape, gpus=1, seqs=B, tokens=T, gen_seqs=1, chunk=policy.chunk_tokens)
    predicted = 8 * plan["parameters (B)"] + plan["activations"] + plan["log-prob chunk"]  # GB; see the docstring
    name = torch.cuda.get_device_name(d.device) if cuda else ""
    peak_flops = (a.peak_tflops or peak_tflops(name) or 0) * 1e12
    tps = B * T / s
    out = {"s_per_step": s, "tokens_per_s": tps,
           "mfu": tps * flops_per_token(shape, T) / peak_flops if peak_flops else None,
           "peak_gb": peak, "plan_gb": predicted if checkpointing else None}
    if beside:  # the kept Engine's KV cache and weight copy, as _one_mode plans them (memory_plan.py's kept row)
        from grouprl import engine

        kv, weights = engine.memory_needed(lm, a.prompts * a.group_size, a.prompt_tokens + a.new_tokens,
                                           next(lm.parameters()).dtype, device=d.device)
        out.update(engine_kept=lm in engine.HELD, train_plan_gb=predicted, engine_plan_gb=(kv + weights) / 1e9,
                   plan_gb=predicted + (kv + weights) / 1e9)
    return out


def trl_step(a, out_dir: str) -> dict:
    """benchmarks/rl_step.py on the 0.6B shape (the tiny shape under --smoke), its table as printed."""
    import torch

    from grouprl import modeling
    import shapes

    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl does not import (pip install -r benchmarks/requirements.txt)"}
    folder = os.path.join(out_dir, "rl_step_model")
    tok = modeling.tiny_tokenizer()  # the built-in task's characters; the model's larger vocabulary is unused
    torch.manual_seed(0)
    shape = dict(shapes.TINY, vocab_size=len(tok)) if a.smoke else shapes.QWEN3["0.6B"]
    lm = shapes.random_model(shape, tok, torch.float32)
    lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    del lm
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "rl_step.py"), "--model-folder", folder,
           "--steps", "2" if a.smoke else "4", "--prompts", "4" if a.smoke else "16",
           "--max-new-tokens", "8" if a.smoke else "256", "--gen-mode", "engine"] + ([] if a.smoke else ["--gpu"]) + (
        ["--phases"] if a.trl_phases else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
    lines = [line for line in p.stdout.splitlines() if line.startswith(("|", "ratio", "phases"))]
    return {"table": [f"\n{line}\n" if line.startswith("phases") else line for line in lines]}


def main():
    from grouprl import generation
    from grouprl import distributed
    from grouprl import modeling

    # engine-eager: --gen-mode engine --no-gen-cuda-graphs; engine-sdpa: the engine decoding through SDPA over the
    # whole read length instead of FlexAttention's live blocks (the GPU's default)
    # engine-nocompile: the graphs replay the eager layers (each layer not compiled by inductor); engine-flexapart:
    # FlexAttention compiled apart from the layer (engine.FLEX_APART)
    MODES = (*generation.GEN_MODES, "engine-eager", "engine-sdpa", "engine-nocompile", "engine-flexapart")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.6B,1.7B,4B,8B",
                    help="keys of shapes.QWEN3, smallest first ('': none, the TRL comparison alone)")
    ap.add_argument("--gen-modes", type=lambda s: s.split(","), default=list(MODES),
                    help=f"generation modes to time, comma-separated ({', '.join(MODES)})")
    ap.add_argument("--flex-options", type=lambda s: [json.loads(o) for o in s.split(";") if o], default=[],
                    help="more engine rows, one a ';'-separated JSON dict of FlexAttention decoding kernel options "
                         "(engine.FLEX_OPTIONS), e.g. '{\"num_warps\": 4};{\"BLOCK_N\": 128}'")
    ap.add_argument("--profile", action="store_true",
                    help="after the engine's row, its rollout again under torch.profiler: profile_<model>.txt")
    ap.add_argument("--paged-check", action="store_true",
                    help="after the generation modes, greedy completions with the whole KV cache and a paged pool, "
                         "token for token (paging's correctness through the compiled layer, never run on a GPU)")
    ap.add_argument("--shared-check", action="store_true",
                    help="after the generation modes, a G = --group-size rollout of 2,000-token prompts paged with "
                         "each group's prompt blocks shared and not: KV blocks taken and read a step, time, rows")
    ap.add_argument("--episodes-check", action="store_true",
                    help="after the generation modes, episodes of 4 turns with a scripted tool turn on the engine, "
                         "the KV cache kept across turns and re-prefilled: tokens prefilled, tok/s, rows equal")
    ap.add_argument("--train-beside-engine", action="store_true",
                    help="right after the generation modes, the checkpointed training step with the last mode's "
                         "Engine still kept (as the scripts keep it across steps): its peak against the plan's "
                         "training peak plus engine.memory_needed")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--mean-length", type=int, default=384, help="mean completion length the EOS ids aim at")
    ap.add_argument("--train-seqs", type=int, default=8, help="sequences per training step")
    ap.add_argument("--train-tokens", type=int, default=1280, help="tokens per training sequence (prompt included)")
    ap.add_argument("--train-steps", type=int, default=3, help="timed training steps after one warm-up")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by its name)")
    ap.add_argument("--minutes", type=float, default=8.0,
                    help="start no new model, mode or training row after this many minutes (each one is a row)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"),
                    help="folder for gpu.md/json (default: $OUT where set, the folder a device call brings back; "
                         "else benchmarks/results)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every code path in seconds")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL comparison (benchmarks/rl_step.py)")
    ap.add_argument("--no-train", action="store_true", help="generation alone (no training step, no gspo import)")
    ap.add_argument("--trl-phases", action="store_true",
                    help="the TRL comparison with rl_step.py --phases: each trainer's time by phase, fenced")
    a = ap.parse_args()
    if a.smoke:  # tiny everything, the same code paths (flags given explicitly still win)
        ap.set_defaults(prompts=2, group_size=3, prompt_tokens=8, new_tokens=6, mean_length=3, train_seqs=2,
                        train_tokens=16, train_steps=1)
        a = ap.parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    import shapes

    models = ["tiny"] if a.smoke else [m for m in a.models.split(",") if m]  # --models "": TRL only
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("error: no GPU here: run with --smoke on CPU (tiny shapes), or on a machine with a GPU")
    if not set(models) <= set(shapes.QWEN3) | {"tiny"}:
        raise SystemExit(f"error: --models takes {', '.join(shapes.QWEN3)}")
    if not set(a.gen_modes) <= set(MODES):
        raise SystemExit(f"error: --gen-modes takes {', '.join(MODES)}")
    a.gen_modes = a.gen_modes + ["engine" + json.dumps(o, sort_keys=True) for o in a.flex_options]
    hf_logging.set_verbosity_error()
    d = distributed.Dist(0, 1, torch.device("cuda", 0) if torch.cuda.is_available() and not a.smoke else
                    torch.device("cpu"))
    dtype = torch.bfloat16 if d.device.type == "cuda" else torch.float32
    device_name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "CPU (--smoke)"
    t0 = time.time()
    a.deadline = t0 + 60 * a.minutes
    results = {}
    for name in models:
        if time.time() > a.deadline:
            results[name] = {"skipped": f"over --minutes {a.minutes}"}
            continue
        a.model_name = name
        shape = shapes.TINY if name == "tiny" else shapes.QWEN3[name]
        tok = shapes.word_tokenizer(shape["vocab_size"])
        torch.manual_seed(0)
        lm = shapes.random_model(shape, tok, dtype, d.device)
        policy = modeling.Policy(lm).eval()
        row = {"parameters_B": sum(p.numel() for p in lm.parameters()) / 1e9}
        results[name] = row
        row["generation"] = {}
        flush = lambda: write(results, a, device_name, time.time() - t0)  # noqa: E731
        try:
            bench_generation(policy, tok, shape, a, d, row["generation"], flush)
        except Exception as e:  # noqa: BLE001 (set-up of the modes: the bandwidth copy, the warm-up call)
            row["generation"]["error"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        if a.train_beside_engine:  # before the kept Engine is freed (held, below; the checks clear it)
            row["training_beside_engine"] = training_row(lm, policy, shape, a, d, True, beside=True)
            flush()
            if "grouprl.engine" in sys.modules:  # the Engine freed now (gc: a reference cycle), not at the next plan
                sys.modules["grouprl.engine"].rollout.release(lm)
        if a.episodes_check and time.time() < a.deadline:  # issue 64's item 4 before item 2
            try:
                row["generation"]["episodes_check"] = episodes_check(lm, shape, a, d)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                row["generation"]["episodes_check"] = error_row(e)
            flush()
        if a.paged_check and time.time() < a.deadline:
            try:
                row["generation"]["paged_check"] = paged_check(lm, shape, d)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                row["generation"]["paged_check"] = error_row(e)
            flush()
        if a.shared_check and time.time() < a.deadline:
            try:
                row["generation"]["shared_check"] = shared_check(lm, shape, a, d)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                row["generation"]["shared_check"] = error_row(e)
            flush()
        if d.device.type == "cuda":  # the last mode's kept Engine (its cache, and through it this model) freed
            row["allocated_after_generation_gb"] = held(d.device)  # before training and the next model
            flush()
        elif "grouprl.engine" in sys.modules:
            sys.modules["grouprl.engine"].HELD.clear()
        for ac in (False, True):
            row[f"training_ac{int(ac)}"] = training_row(lm, policy, shape, a, d, ac)
            flush()
        results[name] = row
        print(f"{name}: done at {time.time() - t0:.0f}s", flush=True)
        write(results, a, device_name, time.time() - t0)  # after each model: a killed run keeps what it measured
        del lm, policy
        if d.device.type == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    results["trl"] = {"skipped": "--no-trl"} if a.no_trl else trl_step(a, tempfile.mkdtemp(dir=a.out))
    print(write(results, a, device_name, time.time() - t0))
    print(f"written: {a.out}/gpu.md, {a.out}/gpu.json\ncommand: {command_line()}")


def command_line() -> str:
    return " ".join(["python", "benchmarks/gpu.py"] + sys.argv[1:])


def write(results: dict, a, device_name: str, seconds: float) -> str:
    """gpu.md and gpu.json under --out, with what has been measured so far; returns the markdown."""
    import torch

    os.makedirs(a.out, exist_ok=True)
    md = table(results, a, device_name, command_line(), seconds)
    with open(os.path.join(a.out, "gpu.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "gpu.json"), "w") as f:
        json.dump({"device": device_name, "command": command_line(), "args": vars(a), "torch": torch.__version__,
                   "results": results}, f, indent=1)
    return md


def table(results: dict, a, device: str, command: str, seconds: float) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    modes = a.gen_modes
    bw = [g[m]["bandwidth_GBps"] for r in results.values() if isinstance(g := r.get("generation"), dict) for m in g
          if "bandwidth_GBps" in g[m]]
    device = device + (f" (copy bandwidth {bw[0]:.0f} GB/s)" if bw else "")
    lines = [f"{device}; {a.prompts} prompts x {a.group_size} completions, {a.prompt_tokens}-token prompts, up to "
             f"{a.new_tokens} new tokens (mean aimed at {a.mean_length}); training {a.train_seqs} x "
             f"{a.train_tokens} tokens; {seconds:.0f}s in all", "",
             "| model | params (B) | " + " | ".join(f"gen tok/s {m} (share of bound)" for m in modes) +
             " | mean length | train tok/s | MFU | train tok/s, AC | MFU, AC | peak GB, AC | plan GB, AC |",
             "|---|---|" + "---|" * len(modes) + "---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if name == "trl":
            continue
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |")
            continue
        gen = r.get("generation", {})

        def cell(m):
            g = gen.get(m)
            if g is None:
                return "not run"
            return g["error"] if "error" in g else f"{g['tokens_per_s']:.0f} ({g['bound_share']:.1%})"
        cells = [f"{name}", f"{r['parameters_B']:.3f}"] + [cell(m) for m in modes]
        lengths = [g["mean_length"] for g in gen.values() if "mean_length" in g]
        cells.append(f"{lengths[0]:.0f}" if lengths else "-")
        for ac in (0, 1):
            t = r.get(f"training_ac{ac}", "not run")
            cells += [t, "-"] if not isinstance(t, dict) else [f"{t['tokens_per_s']:.0f}", f(t["mfu"], ".1%")]
        t = r.get("training_ac1")
        cells += ["-", "-"] if not isinstance(t, dict) else [f(t["peak_gb"], ".1f"), f(t["plan_gb"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    peaks = [f"{name} {m}: {g[m]['peak_gb']:.2f} GB measured, {g[m]['plan_gb']:.2f} GB planned "
             f"({g[m]['peak_gb'] / g[m]['plan_gb'] - 1:+.0%})"
             for name, r in results.items() if isinstance(g := r.get("generation"), dict)
             for m in modes if g.get(m, {}).get("plan_gb")]
    if peaks:  # the engine's KV cache and weight copy (engine.memory_needed, memory_plan.py) against its peak
        lines += ["", "Engine peak GPU memory above the model's (engine.memory_needed: KV cache + weight copy):",
                  *[f"- {p}" for p in peaks]]
    for name, r in results.items():
        if isinstance(r, dict) and "allocated_after_generation_gb" in r:
            lines.append(f"- {name}: GB allocated after the generation modes: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["allocated_after_generation_gb"].items()))
        for m in modes:
            g = r.get("generation", {}).get(m, {}) if isinstance(r, dict) else {}
            if g.get("allocated_before_gb"):
                lines.append(f"- {name} {m}: GB allocated before it: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in g["allocated_before_gb"].items()))
        c = r.get("generation", {}).get("paged_check") if isinstance(r, dict) else None
        if c:
            lines.append(f"- {name}: paged against whole, greedy: " + (c["error"] if "error" in c else
                         f"{c['rows_equal']} of {c['rows']} rows equal, log-probs within {c['max_logp_diff']:.2g} "
                         "before a row's first difference"))
        c = r.get("generation", {}).get("shared_check") if isinstance(r, dict) else None
        if c:
            lines.append(f"- {name}: a group's prompt stored once against each row's copy: " + (c["error"] if "error"
                         in c else shared_line(c)))
        c = r.get("generation", {}).get("episodes_check") if isinstance(r, dict) else None
        if c:
            lines.append(f"- {name}: episodes, the KV cache kept across turns against re-prefilled: " + (
                c["error"] if "error" in c else episodes_line(c)))
        t = r.get("training_beside_engine") if isinstance(r, dict) else None
        if t:
            lines.append(f"- {name}: the checkpointed training step beside the kept Engine: " + (
                t if isinstance(t, str) else f"peak {f(t['peak_gb'], '.2f')} GB, planned {t['plan_gb']:.2f} "
                f"(training {t['train_plan_gb']:.2f} + Engine {t['engine_plan_gb']:.2f}; "
                f"Engine {'kept' if t['engine_kept'] else 'NOT kept'}), {t['tokens_per_s']:.0f} tok/s"))
        p = r.get("generation", {}).get("profile") if isinstance(r, dict) else None
        if p:
            lines.append(f"- {name}: profiled engine rollout: " + (p["error"] if "error" in p else
                         f"{p['wall_s']:.2f} s wall, {p['kernel_s']:.2f} s of kernels, {p['kernels']} kernels "
                         f"(profile_{name}.txt)"))
    trl = results.get("trl", {"skipped": "not run yet"})
    lines += ["", "TRL (benchmarks/rl_step.py, 0.6B shape): " + (
        "\n" + "\n".join(trl["table"]) if "table" in trl else trl.get("skipped") or trl.get("error")),
        "", f"command: {command}", ""]
    return "\n".join(lines)


def shared_line(c: dict) -> str:
    """--shared-check's result in one line: blocks taken, KV MB a step reads (each row's; distinct), tok/s, rows."""
    def side(x):
        mb = x["block_bytes"] / 1e6
        return (f"{x['kv_blocks_peak']} KV blocks taken, a step reads {x['kv_read_peak'] * mb:.1f} MB by row, "
                f"{x['kv_read_physical_peak'] * mb:.1f} MB distinct, {x['tokens_per_s']:.0f} tok/s")
    return (f"{c['shape']}: shared {side(c['shared'])}; unshared {side(c['unshared'])}; {c['rows_equal']} of "
            f"{c['rows']} rows equal, log-probs within {c['max_logp_diff']:.2g}")


if __name__ == "__main__":
    main()
