"""GSPO-token (arXiv:2507.18071, GSPO-token) against hand-derived float64 values: equal to GSPO when A_it = A_i (value,
clip decisions, gradient), its own hand-derived gradient with per-token advantages, why the two stop-gradients are
needed (Observation 2), and the post-answer source of per-token advantages."""
import math

import pytest
import torch

from grouprl import modeling
from gspo import gspo_loss
from gspo_token import gspo_token_loss, post_answer_tokens
from helpers import mean, ragged_batch

CLIPS = [(3e-4, 4e-4), (0.02, 0.03), (10.0, 10.0)]


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", CLIPS)
def test_equals_gspo_when_token_advantages_are_the_sequence_advantage(seed, clip):
    """The blog's claim: with A_it = A_i, GSPO-token is GSPO in objective, clipping condition and gradient."""
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    kw = dict(clip_low=clip[0], clip_high=clip[1])
    loss, seq_terms, stats = gspo_loss(logp, old, adv, mask, **kw)
    (g_seq,) = torch.autograd.grad(loss, logp)
    loss_t, seq_terms_t, stats_t = gspo_token_loss(logp, old, adv[:, None].expand_as(mask), mask, **kw)
    (g_tok,) = torch.autograd.grad(loss_t, logp)
    assert loss_t.item() == pytest.approx(loss.item(), abs=1e-10)
    for k in ["losses/clipfrac", "losses/clipfrac_seq", "losses/ratio_mean"]:
        assert mean(stats_t[k]) == pytest.approx(mean(stats[k]), abs=1e-10), k
    assert torch.allclose(seq_terms_t, seq_terms, atol=1e-10, rtol=0)  # m_i = w_i A_i, so the group metrics agree
    assert torch.allclose(torch.nan_to_num(g_tok), torch.nan_to_num(g_seq), atol=1e-10, rtol=0)
    if clip == (0.02, 0.03):
        assert 0 < mean(stats["losses/clipfrac_seq"]) < 1  # the comparison crosses the clip boundary


def token_reference(logp, old, adv, mask, lo, hi):
    """Loops: J = 1/G sum_i 1/|y_i| sum_t min(s_i A_it, clip(s_i) A_it); by Observation 3,
    d(-J)/d logp_it = -(1/G) A_it s_i / |y_i| unless that token is clipped (then 0)."""
    G, T = logp.shape
    J, grad = 0.0, torch.zeros(G, T)
    for i in range(G):
        L = int(mask[i].sum())
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(L)) / L)
        for t in range(L):
            A = float(adv[i, t])
            J += min(s * A, min(max(s, 1 - lo), 1 + hi) * A) / L / G
            if not ((A > 0 and s > 1 + hi) or (A < 0 and s < 1 - lo)):
                grad[i, t] = -A * s / L / G
    return -J, grad


def token_advantages(adv, mask, seed):
    """Per-token advantages that change sign inside some sequences."""
    g = torch.Generator().manual_seed(seed + 7)
    return (adv[:, None] + torch.randn(mask.shape, generator=g)) * mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", CLIPS)
def test_token_advantages_match_reference(seed, clip):
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    A = token_advantages(adv, mask, seed)
    loss, _, stats = gspo_token_loss(logp, old, A, mask, clip_low=clip[0], clip_high=clip[1])
    loss.backward()
    ref_loss, ref_grad = token_reference(logp.detach(), old, A, mask, *clip)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert torch.allclose(torch.nan_to_num(logp.grad), ref_grad, atol=1e-12)
    assert torch.all(logp.grad[mask == 0] == 0)


def without_stop_gradients(logp, old, A, mask, clip_low, clip_high):
    """GSPO-token with both sg[.] dropped (Observation 2): s_it = s_i(theta) pi / pi = s_i(theta), in gspo_token_loss's
    default aggregation, 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it) A_it)."""
    valid = mask.bool()
    lengths = mask.sum(1).clamp(min=1)
    s = torch.exp(torch.where(valid, logp - old, 0.0).sum(1) / lengths)[:, None]  # s_i(theta), on every token
    per_token = torch.where(valid, torch.min(s * A, s.clamp(1 - clip_low, 1 + clip_high) * A), 0.0)
    return -(per_token.sum(1) / lengths).sum() / len(A)


@pytest.mark.parametrize("seed", range(4))
def test_without_stop_gradients_token_credit_is_lost(seed):
    """Observation 2: without sg, s_it = s_i(theta), so d s_it = d s_i = s_i / |y_i| sum_t' d logp_it' and each token is
    pushed by the mean advantage of its sequence. The gradient then differs from the sg one by
    sum_t A_it / |y_i| (grad s_i - s_i grad log pi_t), i.e. -(1/G) s_i / |y_i| (mean_t A_it - A_it') on token t';
    with A_it = A_i that difference is zero, which is why the bug is invisible without token advantages."""
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    kw = dict(clip_low=10.0, clip_high=10.0)  # no clipping: the linear region of the derivation
    lengths = mask.sum(1, keepdim=True)
    s = torch.exp(((logp.detach() - old).nan_to_num() * mask).sum(1, keepdim=True) / lengths)
    G = len(adv)
    for A, same in [(token_advantages(adv, mask, seed), False), (adv[:, None].expand_as(mask) * mask, True)]:
        (g_sg,) = torch.autograd.grad(gspo_token_loss(logp, old, A, mask, **kw)[0], logp)
        (g_no,) = torch.autograd.grad(without_stop_gradients(logp, old, A, mask, **kw), logp)
        g_sg, g_no = torch.nan_to_num(g_sg), torch.nan_to_num(g_no)
        mean_A = (A * mask).sum(1, keepdim=True) / lengths
        assert torch.allclose(g_no, -(mean_A * s / lengths / G) * mask, atol=1e-12)  # every token: the mean advantage
        assert torch.allclose(g_no - g_sg, -(s / lengths / G) * (mean_A - A) * mask, atol=1e-12)
        assert (g_no - g_sg).abs().max() < 1e-12 if same else (g_no - g_sg).abs().max() > 1e-3


def test_post_answer_tokens():
    """Tokens after the final answer (the closing EOS excluded) are the ones the penalty hits; the tiny tokenizer
    is one token per character."""
    tok = modeling.tiny_tokenizer()
    eos = [tok.eos_token_id]
    cases = [("7<|im_end|>", ""), ("7ab<|im_end|>", "ab"), ("x \\boxed{12}. ok<|im_end|>", ". ok"),
             ("no answer<|im_end|>", "no answer"), ("5xy", "xy"), ("#### 42 done<|im_end|>", " done")]
    rows = [tok(text, add_special_tokens=False).input_ids for text, _ in cases]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in rows])
    texts = tok.batch_decode(ids.masked_fill(torch.isin(ids, torch.tensor(eos)), tok.pad_token_id),
                             skip_special_tokens=True)
    after = post_answer_tokens(tok, ids, mask, texts, eos)
    for (text, expected), row, a in zip(cases, ids, after):
        assert tok.decode(row[a]) == expected, text
    assert not (after & (mask == 0)).any()


def test_keep_drops_the_low_entropy_tokens_terms():
    """--top-entropy-quantile: on policy (s_it = 1, inside the clip) each kept token's term is A_it, the others' 0;
    1/B sum_i 1/|y_i| sum_t keep_it A_it (seq-mean-token-mean), gradient keep_it A_it / (|y_i| B) (s_it's gradient is
    sg[s_i] grad log pi_t); keep = 1 everywhere is the plain loss."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    keep = torch.tensor([[1.0, 0, 1], [0, 1, 0]])
    A = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -4.0, 0.0]])
    logp = old.clone().requires_grad_(True)
    loss, _, _ = gspo_token_loss(logp, old, A, mask, clip_low=0.2, clip_high=0.27, keep=keep)
    loss.backward()
    assert loss.item() == pytest.approx(-((1 + 3) / 3 + -4 / 2) / 2, rel=1e-12)
    want = [[-1 / 6, 0.0, -3 / 6], [0.0, 4 / 4, 0.0]]
    assert logp.grad.flatten().tolist() == pytest.approx(sum(want, []), rel=1e-12)
    plain = gspo_token_loss(old, old, A, mask, clip_low=0.2, clip_high=0.27, keep=torch.ones_like(keep))[0]
    assert plain.item() == pytest.approx(-((1 + 2 + 3) / 3 + (-1 - 4) / 2) / 2, rel=1e-12)
