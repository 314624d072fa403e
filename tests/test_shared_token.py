"""losses/shared_coef is the gradient's own coefficient on a token the whole group shares (DFPO paper arXiv:2604.13088,
eq. 70-72): per group, sum_i dJ_g / d log pi(y_i1) at the first completion token, from autograd on each loss, here
against closed forms written from the equations in float64 loops (none of the project's loss code)."""
import math

import pytest
import torch

import common
from dfpo import dfpo_loss
from grpo import grpo_loss
from gspo import gspo_loss

G = 4


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def shared_first_token_batch(seed, lengths, spread=0.1, B=8):
    """B sequences in groups of G whose first completion token is shared inside each group (the same log-prob, new
    and old), the other tokens apart; centred advantages, as eq. 43 makes them. lengths: [B] completion lengths."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + spread * torch.randn(B, T, generator=g)
    for k in range(0, B, G):  # the shared first token: one value per group
        old[k:k + G, 0] = old[k, 0]
        logp[k:k + G, 0] = logp[k, 0]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    adv = torch.randn(B, generator=g)
    adv = adv - adv.view(-1, G).mean(1).repeat_interleave(G)
    return logp.requires_grad_(), old, adv, mask


def metric(loss_fn, logp, old, adv, mask, **kw):
    """What the scripts log: autograd's d loss / d logp at the first token, through common.group_metrics."""
    loss, seq_terms, _ = loss_fn(logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return common.group_metrics(seq_terms, grad[:, 0], G, len(adv) // G)["losses/shared_coef"].item()


def seq_ratios(logp, old, mask):
    """s_i = exp(1/|y_i| sum_t log w_it) (eq. 44), by loops."""
    out = []
    for i in range(len(mask)):
        L = int(mask[i].sum())
        out.append(math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(L)) / L))
    return out


def closed_form(weights, adv, mask):
    """Mean over groups of |1/G sum_{i in g} A_i w_i / |y_i||: eq. 72's coefficient, w_i the weight each sequence
    carries in the gradient (0 where it has none)."""
    per_group = []
    for k in range(0, len(adv), G):
        c = sum(float(adv[i]) * weights[i] / float(mask[i].sum()) for i in range(k, k + G)) / G
        per_group.append(abs(c))
    return sum(per_group) / len(per_group)


@pytest.mark.parametrize("seed", range(3))
def test_grpo_unclipped_equal_lengths_cancels(seed):
    """GRPO: the shared token has one ratio w in the group, so its coefficient is w/|y| sum_i A_i / G = 0."""
    logp, old, adv, mask = shared_first_token_batch(seed, [5] * 8, spread=0.05)
    assert metric(grpo_loss, logp, old, adv, mask, clip_low=0.5, clip_high=0.5) < 1e-15
    # and the old metric, |1/G sum_i m_i|, is not 0 here: it is the objective, not the gradient
    _, seq_terms, _ = grpo_loss(logp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    assert seq_terms.view(-1, G).mean(1).abs().mean() > 1e-4


@pytest.mark.parametrize("seed", range(3))
def test_gspo_with_a_clipped_sequence_gives_the_closed_form(seed):
    """GSPO: 1/G sum_i A_i s_i / |y_i| over the unclipped sequences (a clipped one has no gradient), ragged."""
    lengths = [5, 3, 7, 4, 6, 2, 5, 7]
    logp, old, adv, mask = shared_first_token_batch(seed, lengths)
    lo, hi = 0.02, 0.03
    s = seq_ratios(logp.detach(), old, mask)
    clipped = [(adv[i] > 0 and s[i] > 1 + hi) or (adv[i] < 0 and s[i] < 1 - lo) for i in range(8)]
    assert any(clipped) and not all(clipped)
    expected = closed_form([0.0 if clipped[i] else s[i] for i in range(8)], adv, mask)
    got = metric(gspo_loss, logp, old, adv, mask, clip_low=lo, clip_high=hi)
    assert got == pytest.approx(expected, rel=1e-12) and expected > 1e-4


def dfpo_s_tilde(s, adv, lo, hi, length_aware, mask):
    """min-replace (eq. 50) on the post-clip weights (eq. 47), per group; length_aware: on s_bar_i L / |y_i|."""
    s_bar = [min(s[i], 1 + hi) if adv[i] >= 0 else max(s[i], 1 - lo) for i in range(len(s))]
    out = []
    for k in range(0, len(s), G):
        L = [float(mask[i].sum()) for i in range(k, k + G)]
        scale = [x / (sum(L) / G) if length_aware else 1.0 for x in L]
        u_min = min(s_bar[k + j] / scale[j] for j in range(G))
        out += [u_min * scale[j] for j in range(G)]
    return out


@pytest.mark.parametrize("seed", range(3))
def test_dfpo_equal_lengths_cancels_with_clipped_sequences(seed):
    """DFPO's default (eq. 68): every sequence carries s_tilde_i A_i / |y|, and eq. 63 makes the sum 0 at equal
    lengths, clipped sequences included. The clip-gated form drops the clipped ones' terms: the closed form, not 0."""
    logp, old, adv, mask = shared_first_token_batch(seed, [6] * 8)
    lo, hi = 0.02, 0.03
    s = seq_ratios(logp.detach(), old, mask)
    clipped = [(adv[i] > 0 and s[i] > 1 + hi) or (adv[i] < 0 and s[i] < 1 - lo) for i in range(8)]
    assert any(clipped) and not all(clipped)
    kw = dict(group_size=G, clip_low=lo, clip_high=hi, transform="min-replace")
    assert metric(dfpo_loss, logp, old, adv, mask, **kw) < 1e-15
    s_tilde = dfpo_s_tilde(s, adv, lo, hi, False, mask)
    expected = closed_form([0.0 if clipped[i] else s_tilde[i] for i in range(8)], adv, mask)
    got = metric(dfpo_loss, logp, old, adv, mask, **kw, clip_gated=True)
    assert got == pytest.approx(expected, rel=1e-12) and expected > 1e-4


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("transform", ["min-replace", "orth-proj", "orth-proj-qp"])
def test_dfpo_length_aware_cancels_on_ragged_lengths(transform, seed):
    """--length-aware: 0 on ragged lengths (eq. 72 exact), where the plain transform leaves eq. 72's closed form."""
    lengths = [5, 3, 7, 4, 6, 2, 5, 7]
    logp, old, adv, mask = shared_first_token_batch(seed, lengths)
    kw = dict(group_size=G, clip_low=0.02, clip_high=0.03, transform=transform)
    assert metric(dfpo_loss, logp, old, adv, mask, **kw, length_aware=True) < 1e-15
    plain = metric(dfpo_loss, logp, old, adv, mask, **kw)
    assert plain > 1e-4
    if transform == "min-replace":
        s = seq_ratios(logp.detach(), old, mask)
        expected = closed_form(dfpo_s_tilde(s, adv, 0.02, 0.03, False, mask), adv, mask)
        assert plain == pytest.approx(expected, rel=1e-12)
