"""The rollout engine (grouprl/engine/) against the HF reference: greedy tokens equal to `generate`'s, per-token
log-probs equal to Policy.forward's, logits equal to the HF forward's for the Qwen3 / Qwen2 / Llama shapes, the
sampler equal to transformers' warpers and to the softmax, and the scheduler's bookkeeping (fp32, CPU)."""
import dataclasses
import math

import pytest
import torch

import common
from grouprl import engine
from grouprl.engine import rollout, sampler, scheduler, settings
from grouprl import modeling
from grouprl.distributed import Dist, seed_everything
from grouprl.sampling import Sampling
from conftest import SCRIPTS
from helpers import CPU, hf_greedy, run, setup  # noqa: F401 (the fixture)


def ragged_eos(lm, tok, ids):
    """An EOS set that greedy decoding meets at different lengths in different rows: tokens that three rows write
    at steps 1, 3 and 5 (some rows may meet them earlier, others run to the limit)."""
    comps, _ = hf_greedy(lm, tok, ids, 1, [tok.eos_token_id], 8)
    return sorted({comps[2][1], comps[0][3], comps[1][5], tok.eos_token_id})


@pytest.mark.parametrize("n, slots", [(1, 1), (2, 2), (3, 3), (3, 7), (4, 64)])
def test_greedy_tokens_equal_hf_generate(setup, n, slots):
    """Ragged prompts, several group sizes, and pools too small for every row at once (rows wait and are
    admitted as others finish): the same completions, ends and truncation flags as HF's `generate`."""
    tok, lm, ids = setup
    eos = ragged_eos(lm, tok, ids)
    ref, truncated = hf_greedy(lm, tok, ids, n, eos, 8)
    assert len({len(c) for c in ref}) > 1  # ragged completions: the case worth testing
    comps, logps = run(lm, ids, n, eos, 8, slots, sync_every=3)
    assert comps == ref
    assert [c[-1] not in eos for c in comps] == truncated
    assert [len(lp) for lp in logps] == [len(c) for c in comps]


@pytest.mark.parametrize("n, slots, graphs", [(1, 2, False), (3, 4, True)])
def test_repetition_penalty_greedy_tokens_equal_hf_generate(setup, n, slots, graphs):
    """--repetition-penalty 1.8 under greedy decoding (top_k 1): the engine's completions equal HF generate's
    (repeat, shared-prefill and static: every --gen-mode), and differ from those without the penalty; sampled
    with --min-p 0.999, the same. Slots fewer than rows: finished
    rows' slots take new rows, whose seen ids must be their own prompt's alone; eager and through the graphs'
    step (which marks the tokens it reads in the Engine's fixed buffer)."""
    tok, lm, ids = setup
    eos = ragged_eos(lm, tok, ids)
    ref, truncated = hf_greedy(lm, tok, ids, n, eos, 12, repetition_penalty=1.8)
    for mode in ("shared-prefill", "static"):
        assert hf_greedy(lm, tok, ids, n, eos, 12, mode, repetition_penalty=1.8) == (ref, truncated), mode
    # --min-p 0.999 keeps the most likely token alone (no near-ties here): sampled, the greedy path, in every mode
    for mode in ("repeat", "shared-prefill", "static"):
        assert hf_greedy(lm, tok, ids, n, eos, 12, mode, top_k=0, min_p=0.999, repetition_penalty=1.8)[0] == ref
    assert run(lm, ids, n, eos, 12, slots, top_k=0, min_p=0.999, repetition_penalty=1.8)[0] == ref
    assert ref != hf_greedy(lm, tok, ids, n, eos, 12)[0]
    stats = {}
    comps, logps = run(lm, ids, n, eos, 12, slots, sync_every=3, graphs=graphs, repetition_penalty=1.8,
                       stats=stats)
    assert comps == ref
    assert [c[-1] not in eos for c in comps] == truncated
    assert stats["prefills"] >= 3  # 5 prompts' rows through slots for 2 of them at most: slots reused


@pytest.mark.parametrize("n, slots, pool, share", [(1, 5, 96, True), (3, 9, 320, True), (3, 9, 320, False)])
def test_paged_pool_greedy_tokens_equal_hf_generate(setup, monkeypatch, n, slots, pool, share):
    """A paged KV pool (blocks of engine.PAGE positions) far smaller than slots x the longest row (62-token prompt +
    24 new): rows wait for blocks, and when every row runs to the limit (no EOS met) the youngest groups are
    preempted and made anew (their shared prompt blocks freed with their last row, and shared again); the
    completions are still HF's, and every block is back in the pool at the end; with a group's prompt blocks
    shared (SHARE_PROMPTS) and without."""
    monkeypatch.setattr(settings, "SHARE_PROMPTS", share)
    new = 24
    tok, lm, ids = setup
    assert pool < slots * (max(map(len, ids)) + new)  # the whole cache would not fit the pool
    for eos, preempts in ((ragged_eos(lm, tok, ids), False), ([0], True)):  # token 0 (pad) is never sampled
        ref, truncated = hf_greedy(lm, tok, ids, n, eos, new)
        stats = {}
        comps, logps = run(lm, ids, n, eos, new, slots, sync_every=3, stats=stats, pool_tokens=pool)
        assert comps == ref and [c[-1] not in eos for c in comps] == truncated
        assert [len(lp) for lp in logps] == [len(c) for c in comps]
        assert stats["blocks_taken"] == 0 and (stats["preempted"] > 0) == preempts, stats


def test_shared_prompt_blocks_refcounted(setup):
    """Engine.share: a group's second row holds its first row's prompt blocks (the same physical blocks in its table
    and in the logical map flex's mask_mod reads), each counted by the rows that hold them; the first row's retiring
    frees only its own blocks, the last row's frees the shared ones too."""
    tok, lm, ids = setup
    eng = engine.Engine(lm, engine.Setup(2, CPU, torch.float32, pool_tokens=16 * 10), 64)
    assert eng.take(0, 4)
    eng.share(1, 0, 3)
    assert eng.take(1, 4)
    assert eng.owned[1][:3] == eng.owned[0][:3] and eng.owned[1][3] not in eng.owned[0]
    assert eng.table[1, :3].tolist() == eng.owned[0][:3] and eng.logical[1, eng.owned[0][:3]].tolist() == [0, 1, 2]
    assert len(eng.free) == 10 - 5
    eng.give(0)
    assert len(eng.free) == 10 - 4 and not set(eng.owned[1]) & set(eng.free)
    eng.give(1)
    assert sorted(eng.free) == list(range(10)) and not any(eng.refs)


@pytest.mark.parametrize("page", [16, 128])
def test_group_prompt_stored_once(setup, monkeypatch, page):
    """Issue 52's shape, G = 16 rows of two 2,000-token prompts, paged in blocks of 16 (SDPA's page) and 128
    (FlexAttention's): with the group's prompt blocks shared, the KV blocks taken and the distinct blocks a decoding
    step reads are the unshared counts less the 15 extra copies of each prompt's full blocks; the prompt's blocks are
    1/16 of the unshared ones at 16 (2,000 = 125 x 16), 31 of 256 a group at 128 (15 shared, and each row's own
    copy of the last, partly filled one). The tokens and log-probs are the unshared rollout's (sampled from one seed:
    a group's greedy rows would be equal, and would not show one row writing over another's)."""
    monkeypatch.setattr(settings, "PAGE", page)
    tok, lm, ids = setup
    n, P, new, groups = 16, 2000, 8, 2
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (P,), generator=g).tolist() for _ in range(groups)]
    pool = groups * n * -(-(P + new + 4) // page) * page  # every row at once, unshared: nothing waits
    out, stats = {}, {}
    for share in (True, False):
        monkeypatch.setattr(settings, "SHARE_PROMPTS", share)
        stats[share] = {}
        out[share] = run(lm, prompts, n, [0], new, groups * n, sync_every=4, pool_tokens=pool, stats=stats[share],
                         temperature=1.0, top_k=0, generator=torch.Generator().manual_seed(3))
    assert out[True][0] == out[False][0]
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-6, rtol=0)
    on, off = stats[True], stats[False]
    assert on["prefills"] == off["prefills"] == 1 and on["preempted"] == off["preempted"] == 0
    assert on["blocks_taken"] == off["blocks_taken"] == 0  # every block back, shared ones once
    copies = groups * (n - 1) * (P // page)  # the full prompt blocks the unshared rows hold again
    assert off["kv_blocks_peak"] == off["kv_row_blocks_peak"] == on["kv_row_blocks_peak"]
    assert on["kv_blocks_peak"] == off["kv_blocks_peak"] - copies
    # a decoding step: each live row asks for its own blocks either way; the distinct (physical) ones are fewer
    assert on["kv_read_peak"] == off["kv_read_peak"] == off["kv_read_physical_peak"]
    assert on["kv_read_physical_peak"] == off["kv_read_physical_peak"] - copies
    assert on["block_bytes"] == page * 2 * 2 * lm.config.num_key_value_heads * lm.config.head_dim * 4  # k, v; 2 layers
    prompt_blocks = {True: groups * (P // page + n * (P % page > 0)), False: groups * n * -(-P // page)}
    assert on["kv_blocks_peak"] - prompt_blocks[True] == off["kv_blocks_peak"] - prompt_blocks[False]
    assert prompt_blocks[True] / prompt_blocks[False] == {16: 1 / 16, 128: 31 / 256}[page]
    # admission counts the shared blocks once: a pool of exactly the blocks the shared rollout took admits both groups
    # at once (counted unshared, the second would wait for the first)
    monkeypatch.setattr(settings, "SHARE_PROMPTS", True)
    tight = {}
    assert run(lm, prompts, n, [0], new, groups * n, sync_every=4, pool_tokens=on["kv_blocks_peak"] * page,
               stats=tight, temperature=1.0, top_k=0, generator=torch.Generator().manual_seed(3))[0] == out[True][0]
    assert tight["prefills"] == 1 and tight["preempted"] == 0, tight
    print(f"page {page}: KV blocks taken {on['kv_blocks_peak']} shared, {off['kv_blocks_peak']} unshared (prompt "
          f"{prompt_blocks[True]} vs {prompt_blocks[False]}); KV bytes a step reads, physical: "
          f"{on['kv_read_physical_peak'] * on['block_bytes']} vs {off['kv_read_physical_peak'] * off['block_bytes']}")


@pytest.mark.parametrize("n, slots, pool, graphs", [(2, 3, None, False), (3, 9, 400, False), (3, 7, None, True)])
def test_flex_decoding_reads_live_blocks_and_equals_hf_generate(setup, monkeypatch, n, slots, pool, graphs):
    """Decoding through FlexAttention's block mask (the GPU's default; eager here), with blocks of 8 positions so
    that rows of 11 to 62 + 24 tokens span many: whole, paged, and through the graphs' rounded read lengths, greedy
    tokens equal HF's; sampled with one seed, SDPA's tokens and log-probs. Each row's block count is its own length
    rounded up: the blocks past it are not read (a row with one block fewer, or the read length's count, would
    differ)."""
    monkeypatch.setattr(settings, "FLEX_BLOCK", 8)
    monkeypatch.setattr(settings, "PAGE", 8)  # paged, SDPA's blocks as flex's: the same admissions and preemptions
    monkeypatch.setattr(settings, "GRAPH_REACH", 16)
    tok, lm, ids = setup
    eos = ragged_eos(lm, tok, ids)
    ref, _ = hf_greedy(lm, tok, ids, n, eos, 24)
    comps, _ = run(lm, ids, n, eos, 24, slots, sync_every=3, pool_tokens=pool, graphs=graphs, flex=True)
    assert comps == ref
    sampled = {flex: run(lm, ids, n, eos, 24, slots, sync_every=3, pool_tokens=pool, graphs=graphs, flex=flex,
                         temperature=0.8, top_k=0, generator=torch.Generator().manual_seed(5))
               for flex in (True, False)}
    assert sampled[True][0] == sampled[False][0]
    for a, b in zip(sampled[True][1], sampled[False][1]):  # two kernels: fp32 sums in another order
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    eng = engine.Engine(lm, engine.Setup(4, CPU, torch.float32, flex=True), 40)
    live = eng.live_blocks(torch.tensor([0, 7, 8, 33]), 40)  # blocks of 8: positions 0-7 one block, 8 two, 33 five
    assert live.kv_num_blocks.flatten().tolist() == [1, 1, 1, 1]  # the last block: the mask_mod cuts it
    assert live.full_kv_num_blocks.flatten().tolist() == [0, 0, 1, 4]  # the blocks before it, read in full
    assert live.kv_indices[:, 0, 0, 0].tolist() == [0, 0, 1, 4]
    assert live.kv_indices.shape[-1] == live.full_kv_indices.shape[-1] == 5  # 40 positions read: 5 blocks at most


@pytest.mark.parametrize("n, slots, pool", [(2, 3, None), (3, 9, 400)])
def test_graphed_step_equals_the_eager_one(setup, monkeypatch, n, slots, pool):
    """The decoding step as CUDA graphs run it (Engine.step with graphs: tokens and positions copied to fixed
    buffers, the read length rounded up to engine.GRAPH_REACH, here 16, so that several graphs serve one rollout; on
    the CPU each runs eagerly, the capture itself needs a GPU), whole and paged: greedy, HF's tokens; sampled with one
    seed, the eager step's tokens, and log-probs equal to 1e-5."""
    monkeypatch.setattr(settings, "GRAPH_REACH", 16)
    tok, lm, ids = setup
    eos = ragged_eos(lm, tok, ids)
    ref, _ = hf_greedy(lm, tok, ids, n, eos, 24)
    stats = {}
    comps, _ = run(lm, ids, n, eos, 24, slots, sync_every=3, graphs=True, stats=stats, pool_tokens=pool)
    assert comps == ref
    # the reads span several multiples of 16 (prompts of 11 to 62 tokens, + 24 new)
    assert stats["graphs"] >= 3, stats
    sampled = {}
    for graphs in (True, False):
        sampled[graphs] = run(lm, ids, n, eos, 24, slots, sync_every=3, graphs=graphs, pool_tokens=pool,
                              temperature=0.8, top_k=0, generator=torch.Generator().manual_seed(5))
    assert sampled[True][0] == sampled[False][0]
    for a, b in zip(sampled[True][1], sampled[False][1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_a_kept_engine_holds_eos_after_a_rollout_without(setup):
    """A kept Engine (keep=True, one per run) whose graphs' step was made without the EOS hold (min_new_tokens 0),
    then asked for min_new_tokens 4: the hold is part of the graphs' key, so the step runs a graph that masks EOS and
    no row ends before 4 tokens, as a fresh Engine's rows (issue 61: a key without it replayed the unmasked graph,
    and rows ended at their first EOS). EOS: the greedy tokens of steps 1 and 2, so that unmasked, rows end early."""
    tok, lm, ids = setup
    free, _ = run(lm, ids, 2, [tok.eos_token_id], 8, 6)
    eos = sorted({t for c in free for t in c[1:3]})
    kw = dict(sync_every=3, graphs=True)
    try:
        short, _ = run(lm, ids, 2, eos, 8, 6, keep=True, **kw)  # its graph made without the hold
        assert min(map(len, short)) < 4, short
        got = run(lm, ids, 2, eos, 8, 6, keep=True, min_new_tokens=4, **kw)
    finally:
        engine.HELD.pop(lm, None)
    assert min(map(len, got[0])) >= 4, got[0]
    assert got == run(lm, ids, 2, eos, 8, 6, min_new_tokens=4, **kw)


def test_paged_pool_too_small_for_one_group(setup, monkeypatch):
    """A pool smaller than one group at full length fails in one line: 62 + 40 positions, 7 blocks of 16 a row; the
    shortest prompt (21 tokens) has 1 full block its 2 rows share: 1 + 2 x 6 = 13 blocks (208 positions), which run
    to the end; unshared, 2 x 7 = 14 (224)."""
    tok, lm, ids = setup
    with pytest.raises(ValueError, match="a KV pool of 207 positions cannot hold one group of 2 rows of up to 102"):
        run(lm, ids, 2, [0], 40, 10, pool_tokens=207)
    stats = {}
    assert run(lm, ids, 2, [0], 40, 10, pool_tokens=208, stats=stats)[0] == run(lm, ids, 2, [0], 40, 10)[0]
    assert stats["blocks_taken"] == 0
    monkeypatch.setattr(settings, "SHARE_PROMPTS", False)
    with pytest.raises(ValueError, match="a KV pool of 223 positions cannot hold one group of 2 rows of up to 102"):
        run(lm, ids, 2, [0], 40, 10, pool_tokens=223)


def test_logprobs_equal_policy_forward(setup):
    """Sampled (temperature 0.7, no top-k/top-p): each token's log-prob equals Policy.forward's at the same
    temperature to 1e-5 (the built-in model as it is initialised)."""
    tok, _, ids = setup
    seed_everything(0)
    lm = modeling.tiny_model(tok).eval()
    torch.manual_seed(3)
    comps, logps = run(lm, ids, 3, [tok.eos_token_id], 10, 6, temperature=0.7, top_k=0)
    policy = modeling.Policy(lm, temperature=0.7, chunk_tokens=16)
    for b, (c, lp) in enumerate(zip(comps, logps)):
        x = torch.tensor([ids[b // 3] + c])
        want = policy(x, torch.ones_like(x), len(ids[b // 3]))[0]
        torch.testing.assert_close(torch.tensor(lp), want.detach(), atol=1e-5, rtol=0)


def small_config(kind: str, tied: bool, vocab: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    if kind == "qwen3":
        return Qwen3Config(head_dim=16, **kw)
    if kind == "qwen2":
        return Qwen2Config(**kw)  # q/k/v biases, no q/k-norm
    return LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **kw)  # rope_scaling kept exact


@pytest.mark.parametrize("kind, flex", [("qwen3", False), ("qwen2", False), ("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_hf_forward(kind, tied, flex):
    """Prefill and then token-by-token decoding give the HF forward's logits at every position: a tied and an
    untied head, with q/k-norm (Qwen3) and without (Qwen2 with q/k/v biases, Llama with linear rope scaling), and
    decoding through FlexAttention (the GPU's default) as well as SDPA."""
    from transformers import AutoModelForCausalLM

    seed_everything(1)
    cfg = small_config(kind, tied, 97)
    lm = AutoModelForCausalLM.from_config(cfg).eval()
    for p in lm.parameters():  # biases and norms away from their init, so that they count
        p.data.add_(0.02 * torch.randn_like(p))
    assert engine.unsupported(lm.config) is None
    x = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        want = lm(x).logits.float()
    eng = engine.Engine(lm, engine.Setup(2, CPU, torch.float32, flex=flex), 11)
    got = [eng.prefill([x[0, :5].tolist(), x[1, :5].tolist()], torch.tensor([0, 1]), 1)]
    for t in range(5, 11):
        got.append(eng.decode(x[:, t], torch.full((2,), t), t + 1))
    torch.testing.assert_close(torch.stack(got[1:], 1), want[:, 5:], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], want[:, 4], atol=2e-5, rtol=1e-5)


def test_attention_output_in_a_gpu_kernels_layout(monkeypatch):
    """A GPU's memory-efficient attention kernel returns [S, kv heads, group, d] laid out as [S, group, kv heads, d]:
    the engine's decoding step reshapes it (a view cannot merge those dimensions) and gives the HF forward's logits.
    The CPU's kernel returns a contiguous tensor, so without this the GPU path's layout is never run here."""
    from transformers import AutoModelForCausalLM

    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def gpu_layout(*args, **kw):
        calls.append(1)
        return real(*args, **kw).transpose(1, 2).contiguous().transpose(1, 2)

    seed_everything(1)
    lm = AutoModelForCausalLM.from_config(small_config("qwen3", False, 97)).eval()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = lm(x).logits.float()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    eng = engine.Engine(lm, engine.Setup(2, CPU, torch.float32), 9)
    eng.prefill([x[0, :5].tolist(), x[1, :5].tolist()], torch.tensor([0, 1]), 1)
    got = [eng.decode(x[:, t], torch.full((2,), t), t + 1) for t in range(5, 9)]
    assert calls  # the engine's attention went through it
    torch.testing.assert_close(torch.stack(got, 1), want[:, 5:], atol=2e-5, rtol=1e-5)


def test_unsupported_architectures_named():
    from transformers import GPT2Config, Qwen2Config

    assert "model_type 'gpt2'" in engine.unsupported(GPT2Config())
    assert "sliding-window" in engine.unsupported(Qwen2Config(use_sliding_window=True, max_window_layers=0))


def test_top_k_top_p_equal_transformers_warpers():
    """The engine's sampler (engine.sample is sampling.sample) keeps what transformers' warpers keep."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from grouprl import sampling

    assert engine.sample is sampling.sample
    g = torch.Generator().manual_seed(0)
    for top_k, top_p in [(0, 0.9), (5, 1.0), (5, 0.5), (1, 0.3), (50, 0.99), (0, 0.01)]:
        scores = torch.randn(16, 40, generator=g) * 3
        scores[1, :4] = scores[1].topk(5).values[-1]  # ties at the k-th value
        want = scores
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1:
            want = TopPLogitsWarper(top_p)(None, want)
        assert torch.equal(sampling.kept(scores, 1.0, top_k, top_p), ~want.isinf()), (top_k, top_p)


@pytest.mark.parametrize("graphs, pool, knobs", [(False, None, {}), (True, None, {}), (True, 400, {}),
                                                (False, None, {"min_p": 0.1, "repetition_penalty": 1.5}),
                                                (True, None, {"min_p": 0.1, "repetition_penalty": 1.5})])
def test_engine_samples_hf_multinomial_tokens_with_one_seed(setup, monkeypatch, graphs, pool, knobs):
    """The engine's rollout sampled with one seed (temperature, top-k and top-p on; then min-p and a repetition
    penalty too): the same tokens as with HF's processors + torch.multinomial in the sampler's place (given the
    same seen ids), and log-probs within float error; eager and through the graphs' step, whose captured
    function draws the tokens itself (the layers, the head and the sampler)."""
    from helpers import multinomial_sample

    tok, lm, ids = setup
    kw = dict(sync_every=3, graphs=graphs, pool_tokens=pool, temperature=0.8, top_k=20, top_p=0.9, **knobs)
    first, _ = run(lm, ids, 3, [tok.eos_token_id], 12, 7, **kw, generator=torch.Generator().manual_seed(5))
    eos = [first[0][2], first[4][5]]  # tokens sampled at steps 3 and 6: rows end at different lengths
    runs = {}
    for name, fn in (("engine", engine.sample), ("hf", multinomial_sample)):
        monkeypatch.setattr(sampler, "sample", fn)  # the decoding steps' draw
        monkeypatch.setattr(scheduler, "sample", fn)  # the first tokens, at admission
        runs[name] = run(lm, ids, 3, eos, 12, 7, **kw, generator=torch.Generator().manual_seed(5))
    assert runs["engine"][0] == runs["hf"][0]
    assert len({len(c) for c in runs["engine"][0]}) > 1  # rows ended at different steps
    for a, b in zip(runs["engine"][1], runs["hf"][1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    monkeypatch.undo()
    # the captured step returns tokens and log-probs: its sampler drew them from the generator, as the eager one does
    eng = engine.Engine(lm, engine.Setup(3, CPU, torch.float32, graphs=True), 40)
    x, at = torch.tensor([5, 9, 11]), torch.tensor([0, 0, 0])
    got = eng.step(x, at, 1, None, (0.8, 20, 0.9, 0.0, 1.0), torch.Generator().manual_seed(3))
    want = engine.sample(eng.decode(x, at, 1), 0.8, 20, 0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sampled_frequencies_follow_the_softmax():
    """Chi-square over 20,000 draws of one row at temperature 0.5: the frequencies are the temperature-scaled
    softmax's (the test fails when the temperature is left out), and the returned log-prob is that softmax's."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = torch.softmax(logits / 0.5, -1)[0]
    tokens, logp = engine.sample(logits.expand(20000, -1), 0.5, 0, 1.0)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = 20000 * p.double()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    torch.testing.assert_close(logp, p.log()[tokens])


def test_one_seed_one_run(setup):
    tok, lm, ids = setup
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(run(lm, ids, 3, [tok.eos_token_id], 6, 4, top_k=0, top_p=0.9))
    assert runs[0] == runs[1]
    torch.manual_seed(6)
    assert run(lm, ids, 3, [tok.eos_token_id], 6, 4, top_k=0, top_p=0.9)[0] != runs[0][0]


def test_every_request_once_groups_adjacent(setup, monkeypatch):
    """Rows come back in prompt order, a group's rows adjacent; each prompt is prefilled exactly once; a group
    is admitted while others still decode (4 slots, groups of 2, 5 prompts of ragged lengths)."""
    tok, lm, ids = setup
    prefilled = []
    real = engine.Engine.prefill
    monkeypatch.setattr(engine.Engine, "prefill",
                        lambda self, prompts, slots, n: prefilled.extend(map(tuple, prompts)) or real(self, prompts,
                                                                                                       slots, n))
    eos = ragged_eos(lm, tok, ids)
    stats = {}
    comps, _ = run(lm, ids, 2, eos, 8, 4, sync_every=2, stats=stats)
    assert sorted(prefilled) == sorted(map(tuple, ids)) and len(prefilled) == len(ids)
    assert stats["prefills_while_decoding"] >= 1  # a finished group's slots were refilled while others decoded
    ref, _ = hf_greedy(lm, tok, ids, 2, eos, 8)
    assert comps == ref and len(comps) == 2 * len(ids)


def test_engine_under_fsdp2_torchrun():
    """World size 2, FSDP2: the gathered weights sample the plain model's tokens and log-probs with the same seed;
    ranks that stop at different lengths meet at the next collective; the sharded policy trains on after; and
    --gen-mode engine-tp (the layers split over the ranks) gives one process's greedy tokens, with --min-new-tokens
    too (EOS masked alike on every rank)."""
    from helpers import torchrun

    p = torchrun("tests/programs/engine_fsdp.py")
    assert p.returncode == 0 and p.stdout.count("engine FSDP2 OK") == 2, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.count("engine-tp OK") == 2, p.stdout[-2000:]  # tensor parallel: one process's greedy tokens
    assert p.stdout.count("engine-tp min_new_tokens OK") == 2, p.stdout[-2000:]  # masked alike on every rank


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_train_with_the_engine(script, monkeypatch, tmp_path):
    """Every script runs its loop on the engine's episodes (issue 62: --environment, every model turn read as an
    add(1) call, one round) and logs gen/logp_drift, the sampled log-probs of the model's tokens against the training
    forward's (fp32: float rounding only); its held-out evaluation runs episodes too. (Each script on the engine's
    single completions: tests/test_rollout_logp.py.)"""
    from grouprl import episodes
    from helpers import ROOT, run_script

    monkeypatch.setattr(episodes, "parse_calls", lambda text: [{"name": "add", "arguments": {"n": 1}}])
    graphs, generate, begin = [], engine.generate, engine.turns.begin
    monkeypatch.setattr(engine, "generate", lambda *a, **k: graphs.append(a[5].graphs) or generate(*a, **k))
    monkeypatch.setattr(engine.turns, "begin", lambda *a, **k: graphs.append(a[5].graphs) or begin(*a, **k))
    eager = ["--no-gen-cuda-graphs"] if script in ("gspo_token", "dfpo") else []
    env = f"{ROOT}/tests/programs/counter_env.py:Counter"
    try:
        rows, _ = run_script(script, ["--num-steps", "2", "--prompts-per-rank", "4", "--group-size", "4",
                                      "--eval-every", "2", "--eval-size", "2", "--eval-k", "2", "--gen-mode", "engine",
                                      "--max-new-tokens", "40", "--environment", env, "--max-tool-calls", "1",
                                      *eager], monkeypatch, tmp_path)
    finally:
        if (None, env, 1) in episodes._TOOLS:
            episodes._TOOLS.pop((None, env, 1)).stop()
    drift = [r["gen/logp_drift"] for r in rows if "gen/logp_drift" in r]  # not on the eval rows
    assert len(drift) == 2 and all(0 <= x < 1e-5 for x in drift), drift
    assert any(r["tools/turns_per_episode"] > 1 for r in rows if "tools/turns_per_episode" in r)  # a second turn
    evals = [r for r in rows if "eval/avg@2" in r]  # steps 0 and 2
    assert len(evals) == 2 and all(r["eval/tools/call_frequency"] > 0 for r in evals), evals
    # rollouts and evaluations alike: the engine's choice on a GPU (None), or eager with --no-gen-cuda-graphs
    assert len(graphs) > 3 and set(graphs) == ({False} if eager else {None}), graphs


def test_an_architecture_the_engine_does_not_cover_falls_back_with_one_line(setup, monkeypatch, capsys):
    tok, lm, ids = setup
    monkeypatch.setattr(settings, "unsupported", lambda config: "model_type 'other' (the engine covers ...)")
    monkeypatch.setattr(settings, "_FALLBACK_SAID", [])
    d = Dist(0, 1, CPU)
    kw = dict(max_new_tokens=5, temperature=1.0, top_p=1.0, top_k=1, gen_batch_size=8)
    texts = [tok.decode(p) for p in ids]
    got = [common.generate(modeling.Policy(lm), tok, texts, 2, [tok.eos_token_id], d, Sampling(mode=mode, **kw))
           for mode in ("engine", "engine-tp")]
    want = common.generate(modeling.Policy(lm), tok, texts, 2, [tok.eos_token_id], d,
                           Sampling(mode="shared-prefill", **kw))
    for g in got:  # both engine modes fall back to shared-prefill, not another sampler
        assert torch.equal(g.input_ids, want.input_ids) and g.logp is None
    err = capsys.readouterr().err
    assert err.count("--gen-mode engine does not cover model_type 'other'") == 1  # said once, not every step


def test_engine_refuses_gen_unshard(monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    fails_before_any_model("gspo", ["--gen-mode", "engine", "--gen-unshard"], "drop --gen-unshard", monkeypatch,
                           tmp_path)


def test_engine_tp_heads_that_do_not_split_fail_before_any_model(monkeypatch, tmp_path):
    """The tiny model's 4 heads and 2 KV heads do not split over 3 processes: one line from the config alone, before
    any weights are built (not at the first rollout)."""
    import importlib

    from helpers import fails_before_any_model

    monkeypatch.setenv("WORLD_SIZE", "3")
    for script in ("gspo", "grpo"):
        monkeypatch.setattr(importlib.import_module(script), "setup_distributed", lambda *a: Dist(0, 1, CPU))
        fails_before_any_model(script, ["--gen-mode", "engine-tp"], "do not split evenly over 3 ranks", monkeypatch,
                               tmp_path)


def test_check_model_says_the_fallback_before_the_model_is_built(monkeypatch, capsys):
    """An architecture the engine does not cover: the one line comes at check_model (config only), once."""
    monkeypatch.setattr(settings, "unsupported", lambda config: "model_type 'other' (the engine covers ...)")
    monkeypatch.setattr(settings, "_FALLBACK_SAID", [])
    modeling.check_model("tiny", False, "engine")
    modeling.check_model("tiny", False, "engine")
    modeling.check_model("tiny", False, "shared-prefill")
    assert capsys.readouterr().err.count("--gen-mode engine does not cover model_type 'other'") == 1


def allocated_weights(eng, lm) -> int:
    """Bytes of the engine's weight tensors that are not the model's own parameters' storage (its copies)."""
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    tensors, seen, total = [eng.w.embed, eng.w.norm, eng.w.head, eng.w.cos, eng.w.sin], set(), 0
    for layer in eng.w.layers:
        for v in layer.values():
            tensors += v if isinstance(v, tuple) else [x for pair in v for x in pair] if isinstance(v, list) else [v]
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in params | seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_memory_needed_and_a_pool_the_gpu_cannot_hold(setup, monkeypatch):
    """The KV cache is layers x k/v x rows x KV heads x positions x head_dim elements. On a GPU: whole when it and the
    weights fit 90% of the free memory (the rest for prefill, logits and sampling), else paged in 90% of what the
    weights leave, and one line naming --gen-batch-size when that cannot hold one group at full length, before
    anything is allocated."""
    tok, lm, ids = setup
    kv, weights = engine.memory_needed(lm, 8, 100, torch.float32)
    assert kv == 2 * 2 * 8 * 2 * 100 * 32 * 4  # tiny: 2 layers, 2 KV heads, head_dim 32, fp32
    # the weights it copies: onto a GPU from the CPU, all of them (+ the rotary tables); on the weights' own device
    # and dtype, fused (as on a GPU), the q/k/v and gate/up; unfused (the CPU's default) none
    everything = sum(p.numel() for p in lm.parameters())
    assert weights == 4 * (everything + 2 * 100 * 32)
    linears = [(l.self_attn, ("q_proj", "k_proj", "v_proj")) for l in lm.model.layers]
    linears += [(l.mlp, ("gate_proj", "up_proj")) for l in lm.model.layers]
    fused = sum(getattr(m, n).weight.numel() for m, names in linears for n in names)
    assert fused < everything
    assert engine.memory_needed(lm, 8, 100, torch.float32, device=CPU, fuse=True) == (kv, 4 * (fused + 2 * 100 * 32))
    assert engine.memory_needed(lm, 8, 100, torch.float32, device=CPU) == (kv, 4 * 2 * 100 * 32)
    # another dtype: every weight is a copy; tensor parallel: 1/2 of the KV heads
    bf16 = 2 * (sum(p.numel() for p in lm.parameters()) + 2 * 100 * 32)
    assert engine.memory_needed(lm, 8, 100, torch.bfloat16, device=CPU) == (kv // 2, bf16)
    assert engine.memory_needed(lm, 8, 100, torch.bfloat16, world=2)[0] == kv // 4
    # what the engine allocates: the count exactly
    cache = engine.Engine(lm, engine.Setup(8, CPU, torch.float32), 100).cache
    assert sum(c.numel() * c.element_size() for c in cache) == kv
    assert engine.kv_plan(lm, engine.Setup(8, CPU, torch.float32), 100, 2) is None  # host memory: checked, ample
    per_position = kv // 800

    def free(b):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (b, 2 ** 40))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    for dtype, fuse in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        eng = engine.Engine(lm, engine.Setup(8, CPU, dtype, fuse=fuse), 100)
        assert allocated_weights(eng, lm) == engine.memory_needed(lm, 8, 100, dtype, device=CPU, fuse=fuse)[1]

    free(math.ceil((kv + weights) / 0.9))
    assert engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2) is None  # whole
    for b in (int((kv + weights) / 0.9) - 1, kv + weights):  # paged: 90% of the free memory less the weights
        free(b)
        want = int((0.9 * b - weights) / per_position)
        assert engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2) == want
    free(int((weights + 199.5 * per_position) / 0.9))  # 199 positions: less than a group of 2 x 100
    with pytest.raises(MemoryError, match="holds 199 positions, less than one group of 2 x 100"):
        engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2)  # 2 rows x 7 blocks of 16: 224
    # 199 positions are 12 blocks; prompts of 32 or more tokens: their 2 full blocks shared by the 2 rows, 2 + 2 x 5
    # = 12 blocks a group; of 31, 1 + 2 x 6 = 13
    assert engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2, prompt=32) == 199
    with pytest.raises(MemoryError, match="holds 199 positions"):
        engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2, prompt=31)

    def short(*a):
        raise MemoryError("the KV cache of ... exceed the 1.0 GiB free on the GPU")

    monkeypatch.setattr(rollout, "kv_plan", short)
    with pytest.raises(SystemExit) as e:
        common.generate(modeling.Policy(lm), tok, [tok.decode(ids[0])], 2, [tok.eos_token_id], Dist(0, 1, CPU),
                        Sampling(5, top_k=0, gen_batch_size=8, mode="engine"))
    msg = str(e.value.code)
    assert "\n" not in msg and "lower --gen-batch-size (now 8) or --max-new-tokens (now 5)" in msg, msg

    def oom(*a, **kw):  # past the plan: torch's own out-of-memory error, a traceback without this
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nSee the documentation")

    monkeypatch.setattr(engine, "generate", oom)
    with pytest.raises(SystemExit) as e:
        common.generate(modeling.Policy(lm), tok, [tok.decode(ids[0])], 2, [tok.eos_token_id], Dist(0, 1, CPU),
                        Sampling(5, top_k=0, gen_batch_size=8, mode="engine"))
    assert str(e.value.code) == ("error: --gen-mode engine: the GPU ran out of memory while generating (CUDA out of "
                                 "memory. Tried to allocate 2.00 GiB.); lower --gen-batch-size (now 8) or "
                                 "--max-new-tokens (now 5)")


def test_second_rollout_plans_as_the_first(setup, monkeypatch):
    """Issue 34: memory torch's allocator holds but does not use (the first rollout's KV cache, freed; training's
    activations) counts as available. A mocked GPU of 100 units: step 1 finds 100 free and plans a whole cache; its
    cache (70) is freed into the allocator's pool (reserved 70, allocated 0), so the driver reports 30 free; step 2
    must plan the whole cache again, not a paged pool in 30 (or a MemoryError)."""
    tok, lm, ids = setup
    kv, weights = engine.memory_needed(lm, 8, 100, torch.float32)
    total = math.ceil((kv + weights) / 0.9) + 1
    state = {"reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - state["reserved"], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    step1 = engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2)
    state["reserved"] = kv + weights  # step 1's cache and weight copy, freed but kept by the allocator
    step2 = engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2)
    assert step1 is None and step2 is None
    state["allocated"] = kv + weights  # still in use: then it is not available
    with pytest.raises(MemoryError):
        engine.kv_plan(lm, engine.Setup(8, "cuda", torch.float32), 100, 2)
