"""sampling.py against transformers' processors and hand computations: the kept set equals
TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper's (ties included), the
penalised logits RepetitionPenaltyLogitsProcessor's bit for bit, sampled frequencies follow the warped softmax
(chi-square), one seed gives one run, the log-prob is the float64 one, Dynamo traces the sampler whole (no host
sync), and bf16 logits work (CPU)."""
import functools
import math

import pytest
import torch
from transformers.generation import logits_process as lp

from grouprl import sampling
from helpers import hf_penalised, hf_warped, multinomial_sample


def hf_kept(x, temperature, top_k, top_p, min_p=0.0):
    """transformers' own warpers on float32 scores (as generate casts them), in generate's order
    (_get_logits_processor: temperature, top-k, top-p, min-p): True where finite."""
    return ~hf_warped(x.float(), temperature, top_k, top_p, min_p).isinf()


def stable_sort(monkeypatch):
    """torch.sort as transformers calls it (stable=False) leaves the order of equal scores unspecified
    (on the CPU it is not stable past ~32 columns), so a top-p boundary inside a tie group keeps an
    arbitrary subset; with a stable sort HF keeps the members of highest index."""
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: sort(*a, **{**kw, "stable": True}))


CONFIGS = [(t, k, p) for t in (0.6, 1.7) for k in (0, 1, 5, 1000)
           for p in (1.0, 0.9, 0.5, 0.0, 1e-6, 0.99, 0.999)]


def test_kept_set_equals_transformers_warpers(monkeypatch):
    """Continuous logits: HF's own warpers, unpatched, on every row but the first, whose six equal
    top scores make ties at the k-th value (HF keeps them all) and at the top-p boundary (there HF's
    kept count, and its set under a stable sort: see stable_sort)."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for i, (t, k, p) in enumerate(CONFIGS):
        vocab = (64, 500)[i % 2]
        x = torch.randn(8, vocab, generator=g) * (1 + 3 * torch.rand(8, 1, generator=g))
        x[0, :6] = x[0].topk(4).values[-1]
        cases.append((x, t, k, p))
        got, want = sampling.kept(x, t, k, p), hf_kept(x, t, k, p)
        assert torch.equal(got[1:], want[1:]), (t, k, p, vocab)
        assert torch.equal(got.sum(-1), want.sum(-1)), (t, k, p, vocab)
    stable_sort(monkeypatch)
    for x, t, k, p in cases:
        assert torch.equal(sampling.kept(x, t, k, p), hf_kept(x, t, k, p)), (t, k, p)


def test_ties_cut_as_a_stable_sort_cuts_them(monkeypatch):
    """Integer logits (large tie groups at every boundary), random top_p: the kept count equals
    HF's as it is; the kept set equals HF's with a stable sort."""
    g = torch.Generator().manual_seed(1)
    cases = []
    for i in range(36):
        vocab = (40, 300, 7)[i % 3]
        x = torch.randint(0, 5, (6, vocab), generator=g).float()
        t = (0.7, 1.0, 1.6)[i % 3]
        k = (0, 3, 20, 0)[i % 4]
        p = (float(torch.rand(1, generator=g)), 0.0, 1e-4)[i % 3]
        cases.append((x, t, k, p))
        want = hf_kept(x, t, k, p)
        got = sampling.kept(x, t, k, p)
        assert torch.equal(got.sum(-1), want.sum(-1)), (t, k, p, vocab)
    stable_sort(monkeypatch)
    for x, t, k, p in cases:
        assert torch.equal(sampling.kept(x, t, k, p), hf_kept(x, t, k, p)), (t, k, p)
    # exact in float32 on both sides: four equal scores, the boundary at 0.5 exactly
    x = torch.zeros(1, 4)
    assert sampling.kept(x, 1.0, 0, 0.5).tolist() == [[False, False, True, True]]
    assert sampling.kept(x, 1.0, 0, 0.0).tolist() == [[False, False, False, True]]
    assert torch.equal(sampling.kept(x, 1.0, 0, 0.5), hf_kept(x, 1.0, 0, 0.5))


def seen_ids(rows, vocab, generator):
    """Each row's prompt and completion so far as HF's input_ids hold them (ids repeat) -> (input_ids, seen
    [rows, vocab] bool)."""
    ids = torch.randint(0, vocab, (rows, vocab // 3), generator=generator)
    return ids, torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, ids, True)


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    """The penalised logits are RepetitionPenaltyLogitsProcessor's on the same input_ids (repeated ids
    penalised once), bit for bit in float32, positive and negative logits alike; float64 by hand agrees."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(8, 300, generator=g) * 3
    ids, seen = seen_ids(8, 300, g)
    got = sampling.penalise(x, penalty, seen)
    want = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, x.clone())
    assert torch.equal(got, want)
    hand = x.double().clone()
    for r in range(8):
        for j in set(ids[r].tolist()):
            hand[r, j] = hand[r, j] / penalty if hand[r, j] > 0 else hand[r, j] * penalty
    torch.testing.assert_close(got.double(), hand, rtol=1e-7, atol=0)
    assert not torch.equal(got, x) and torch.equal(got[~seen], x[~seen])
    assert sampling.penalise(x, 1.0, None) is x
    with pytest.raises(ValueError, match="needs `seen`"):
        sampling.penalise(x, penalty, None)


@pytest.mark.parametrize("bf16", [False, True])
def test_min_p_kept_set_equals_transformers_warpers(bf16):
    """min-p alone and after top-k and top-p, at two temperatures, with and without a penalty: the kept set is
    that of HF's processors in generate's order (penalty, temperature, top-k, top-p, min-p) on the same logits,
    exactly. min-p before the temperature keeps other sets (checked: the test sees the order)."""
    g = torch.Generator().manual_seed(11)
    differs = 0
    for t in (0.6, 1.7):
        for k, p in ((0, 1.0), (20, 1.0), (0, 0.9), (20, 0.95)):
            for min_p in (0.05, 0.3, 0.9, 1e-6):
                for penalty in (1.0, 1.5):
                    x = torch.randn(16, 400, generator=g) * (1 + 3 * torch.rand(16, 1, generator=g))
                    x = x.to(torch.bfloat16).float() if bf16 else x
                    _, seen = seen_ids(16, 400, g)
                    pen = hf_penalised(x, penalty, seen)
                    got = sampling.kept(sampling.penalise(x, penalty, seen), t, k, p, min_p)
                    want = ~hf_warped(pen, t, k, p, min_p).isinf()
                    assert torch.equal(got.sum(-1), want.sum(-1)), (t, k, p, min_p, penalty)
                    if not bf16 or p == 1.0:  # bf16 ties cut by top-p: HF's unstable sort's subset
                        assert torch.equal(got, want), (t, k, p, min_p, penalty)
                    before = ~hf_warped(lp.MinPLogitsWarper(min_p)(None, pen.clone()), t, k, p).isinf()
                    differs += not torch.equal(before, want)
    assert differs > 10, differs


def warped_probs(logits, temperature, top_k, top_p, min_p=0.0, penalty=1.0, seen=()):
    """By hand in float64 (no ties): the ids in `seen` penalised (logit / penalty if > 0, else x penalty),
    softmax at the temperature, the top_k largest, then the shortest descending prefix whose mass reaches
    top_p, then those at least min_p x the largest probability, renormalised."""
    x = logits.double().clone()
    for j in seen:
        x[j] = x[j] / penalty if x[j] > 0 else x[j] * penalty
    p = torch.softmax(x / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, j in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[j] = True
        mass += p[j].item()
    keep &= p >= min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


def chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a removed token was drawn"
    expected = tokens.numel() * probs[kept]
    return ((counts[kept] - expected) ** 2 / expected).sum().item(), int(kept.sum()) - 1


# chi-square quantiles at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_frequencies_follow_the_warped_softmax(dtype):
    """10,000 draws of one row (every row its own noise) at temperature 0.7 with top-k 7 and top-p
    0.93: the frequencies are the hand-warped softmax's. The top-p set at temperature 0.7 (5
    tokens) is not the one at temperature 1 (6), so warping before the temperature fails."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -1.0, -2.0, -4.0]]).to(dtype)
    probs = warped_probs(logits.float()[0], 0.7, 7, 0.93)
    assert int((probs > 0).sum()) != int((warped_probs(logits.float()[0], 1.0, 7, 0.93) > 0).sum())
    g = torch.Generator().manual_seed(0)
    tokens, _ = sampling.sample(logits.expand(10000, -1), 0.7, 7, 0.93, generator=g)
    chi2, dof = chi_square(tokens, probs)
    assert chi2 < CHI2_999[dof], (chi2, dof)
    # repetition penalty 1.5 on ids 0 and 5 and min-p 0.1 at temperature 0.7: 5 tokens kept (id 0's 2.0 -> 1.33,
    # the max now id 1's 1.5; kept iff (x - 1.5) / 0.7 >= log 0.1). Without the penalty 4 would be kept, with
    # min-p before the temperature 6: either break draws a removed token or fails the chi-square
    seen = torch.zeros(10000, 9, dtype=torch.bool)
    seen[:, [0, 5]] = True
    probs = warped_probs(logits.float()[0], 0.7, 0, 1.0, 0.1, 1.5, [0, 5])
    assert int((probs > 0).sum()) == 5
    assert int((warped_probs(logits.float()[0], 0.7, 0, 1.0, 0.1) > 0).sum()) == 4
    assert int((warped_probs(logits.float()[0], 1.0, 0, 1.0, 0.1, 1.5, [0, 5]) > 0).sum()) == 6
    tokens, _ = sampling.sample(logits.expand(10000, -1), 0.7, 0, 1.0, 0.1, 1.5, seen=seen, generator=g)
    chi2, dof = chi_square(tokens, probs)
    assert chi2 < CHI2_999[dof], (chi2, dof)
    # no top-k/top-p, temperature 1.6: the plain tempered softmax
    tokens, _ = sampling.sample(logits.expand(10000, -1)[:, :7], 1.6, 0, 1.0, generator=g)
    chi2, dof = chi_square(tokens, warped_probs(logits.float()[0, :7], 1.6, 0, 1.0))
    assert chi2 < CHI2_999[dof], (chi2, dof)


def test_one_seed_one_run():
    """The same generator state gives the same tokens; the stream advances from call to call; a
    pre-drawn noise tensor from that state gives the same tokens as the generator."""
    x = torch.randn(256, 300, generator=torch.Generator().manual_seed(2))

    def two_calls(seed):
        g = torch.Generator().manual_seed(seed)
        return [sampling.sample(x, 1.0, 0, 0.95, generator=g)[0] for _ in range(2)]

    a, b = two_calls(3), two_calls(3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[0] != a[1]).float().mean() > 0.5  # fresh noise each call
    assert (a[0] != two_calls(4)[0]).float().mean() > 0.5
    noise = torch.empty(256, 300).exponential_(generator=torch.Generator().manual_seed(3))
    assert torch.equal(sampling.sample(x, 1.0, 0, 0.95, noise=noise)[0], a[0])


def test_log_prob_is_the_tempered_softmax_in_float64():
    """The returned log-prob is log softmax(logits / T) of the drawn token over the whole
    vocabulary (before top-k/top-p), as the engine's drift metric compares it with
    Policy.forward; temperature 0 is greedy with the softmax at temperature 1."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 500, generator=g) * 4
    for t, k, p in [(0.6, 0, 0.9), (1.0, 20, 1.0), (1.7, 50, 0.8), (1.0, 0, 1.0), (0.6, 1, 1.0)]:
        tokens, logp = sampling.sample(x, t, k, p, generator=g)
        assert logp.dtype == torch.float32
        want = torch.log_softmax(x.double() / t, -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logp.double(), want, rtol=0, atol=1e-5)
        assert hf_kept(x, t, k, p).gather(1, tokens[:, None]).all()
    tokens, logp = sampling.sample(x, 0.0, 0, 1.0)
    assert torch.equal(tokens, x.argmax(-1))
    want = torch.log_softmax(x.double(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), want, rtol=0, atol=1e-5)
    # with a repetition penalty: the tempered softmax of the penalised logits (the sampler's own, not the
    # policy's: --old-logp rollout refuses it), min-p changing nothing; greedy, the penalised argmax
    _, seen = seen_ids(64, 500, g)
    hand = x.double().clone()
    hand[seen] = torch.where(hand[seen] > 0, hand[seen] / 1.4, hand[seen] * 1.4)
    for t in (0.7, 0.0):
        tokens, logp = sampling.sample(x, t, 0, 0.95, 0.02, 1.4, seen=seen, generator=g)
        want = torch.log_softmax(hand / (t or 1.0), -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logp.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(tokens, hand.argmax(-1)) and not torch.equal(tokens, x.argmax(-1))


@pytest.mark.parametrize("top_k,top_p,min_p,penalty", [(0, 1.0, 0, 1), (5, 1.0, 0, 1), (0, 0.9, 0, 1),
                                                       (5, 0.9, 0, 1), (0, 0.9, 0.05, 1.3)])
def test_traced_whole_with_no_host_sync(top_k, top_p, min_p, penalty):
    """torch.compile(fullgraph=True, dynamic=False) traces the sampler with no graph break: no
    .item(), no data-dependent shape, no branch on a tensor's value (what a CUDA graph capture
    needs). backend="eager" keeps it quick; the tokens and log-probs equal the eager call's."""
    torch._dynamo.reset()
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    noise = torch.empty(8, 300).exponential_(generator=torch.Generator().manual_seed(7))
    seen = torch.rand(8, 300, generator=torch.Generator().manual_seed(8)) < 0.2
    step = functools.partial(sampling.sample, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=penalty, seen=seen)
    compiled = torch.compile(lambda x, e: step(x, noise=e), fullgraph=True, dynamic=False,
                             backend="eager")
    got, want = compiled(x, noise), step(x, noise=noise)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_logits(monkeypatch):
    """bf16 logits (as a GPU's head gives them): the kept set is HF's on their float32 values, the
    log-prob float32 and the float64 one of those values."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(32, 1000, generator=g) * 3).to(torch.bfloat16)  # bf16 rounding makes ties
    for t, k, p in [(0.7, 0, 0.9), (1.3, 40, 0.95), (1.0, 1, 1.0)]:
        want = hf_kept(x.float(), t, k, p)
        got = sampling.kept(x, t, k, p)
        assert torch.equal(got.sum(-1), want.sum(-1)), (t, k, p)
        with monkeypatch.context() as m:
            stable_sort(m)
            want = hf_kept(x.float(), t, k, p)
        assert torch.equal(got, want), (t, k, p)
        tokens, logp = sampling.sample(x, t, k, p, generator=g)
        assert want.gather(1, tokens[:, None]).all()
        ref = torch.log_softmax(x.double() / t, -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-5)
    assert math.isfinite(float(logp.sum()))


def test_same_tokens_as_hf_multinomial_with_one_seed():
    """The race is torch.multinomial's own draw for one sample (argmax p / E over the same Exp(1)
    stream), so the engine's runs keep HF's tokens for a given seed (test_engine checks it through
    engine.generate); with min-p and a repetition penalty too (HF's processors in the draw's place)."""
    x = torch.randn(128, 700, generator=torch.Generator().manual_seed(9))
    _, seen = seen_ids(128, 700, torch.Generator().manual_seed(12))
    for t, k, p, m, r in [(0.7, 0, 1.0, 0, 1), (1.0, 0, 0.9, 0, 1), (1.3, 40, 0.95, 0, 1),
                          (0.7, 0, 1.0, 0.1, 1), (1.0, 0, 0.9, 0.05, 1.3), (1.3, 40, 0.95, 0.2, 0.8)]:
        got = sampling.sample(x, t, k, p, m, r, seen=seen, generator=torch.Generator().manual_seed(1))
        want = multinomial_sample(x, t, k, p, m, r, seen=seen, generator=torch.Generator().manual_seed(1))
        assert torch.equal(got[0], want[0]), (t, k, p, m, r)
        torch.testing.assert_close(got[1], want[1])
