"""gmpo_loss (GMPO, arXiv 2507.20673) against the paper's objective and verl's geo_mean policy loss, each written here
independently of the code under test:
    paper:  J = 1/G sum_i sgn(A_i) (prod_t |min(w_it A_i, clip(w_it, e^-eps_low, e^eps_high) A_i)|)^(1/|y_i|)
    verl:   neg_kl = logp - old; clamp = clamp(neg_kl, -clip_ratio_low, clip_ratio_high);
            l = sgn(A) min(sgn(A) neg_kl, sgn(A) clamp); ratio = exp(sum(l m) / (sum m + 1e-8));
            loss = mean_i(-A_i ratio_i)   (verl/trainer/ppo/core_algos.py, compute_policy_loss_geo_mean)
The paper's form in float64 (value and gradient to 1e-10), verl's in float32 (1e-6); ratios well outside the band."""
import functools
import math

import pytest
import torch

from gmpo import Args, gmpo_loss
from helpers import batch as drawn_batch, verl_geo_mean, value_and_grad

B, T = 6, 5
batch = functools.partial(drawn_batch, 0.6)  # old log-probs 0.6 apart (in log): |log w| past 0.4 for some tokens


def paper_objective(logp, old, adv, mask, eps_low, eps_high):
    total = 0.0
    for i in range(B):
        n = int(mask[i].sum())
        a = adv[i]
        if a == 0:
            continue  # sgn(0) = 0: the sequence adds nothing
        prod = 1.0
        for t in range(n):
            w = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(w, math.exp(-eps_low), math.exp(eps_high))
            prod = prod * torch.abs(torch.min(w * a, clipped * a))
        total = total + torch.sign(a) * prod ** (1.0 / n)
    return total / B


@pytest.mark.parametrize("eps_low,eps_high", [(0.4, 0.4), (0.2, 0.28), (0.1, 1.0)])
def test_equals_the_papers_objective_in_float64(eps_low, eps_high):
    logp, old, _, mask, adv = batch()
    got, got_g = value_and_grad(lambda x: gmpo_loss(x, old, adv, mask, clip_low=eps_low, clip_high=eps_high)[0], logp)
    want, want_g = value_and_grad(lambda x: -paper_objective(x, old, adv, mask, eps_low, eps_high), logp)
    assert abs(got.item() - want.item()) <= 1e-10
    assert (got_g - want_g).abs().max().item() <= 1e-10
    log_w = (logp - old)[mask.bool()]
    assert ((log_w > eps_high) | (log_w < -eps_low)).any()  # the clip acts on this batch


def test_equals_verls_geo_mean_in_float32():
    logp, old, _, mask, adv = batch(1, torch.float32)
    got, got_g = value_and_grad(lambda x: gmpo_loss(x, old, adv, mask, clip_low=0.4, clip_high=0.4)[0], logp)
    want, want_g = value_and_grad(lambda x: verl_geo_mean(x.double(), old.double(), adv.double(), mask.double(),
                                                          0.4, 0.4), logp)
    assert abs(got.item() - want.item()) <= 1e-6
    assert (got_g.double() - want_g).abs().max().item() <= 1e-6


def test_two_tokens_by_hand():
    """A = 1, log w = (0.1, 0.9): the second is clipped to 0.4 (A > 0 caps from above), s = exp((0.1 + 0.4) / 2) =
    e^0.25; loss -e^0.25; d loss / d logp = (-e^0.25 / 2, 0): the clipped token has no gradient. With A = -1 the cap
    does not act (a negative advantage is floored, at -0.4): s = exp(0.5), loss e^0.5, gradient (e^0.5 / 2) each."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.9]], dtype=torch.float64, requires_grad=True)
    loss, terms, stats = gmpo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, clip_low=0.4,
                                   clip_high=0.4)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.25)) and terms.item() == pytest.approx(math.exp(0.25))
    assert logp.grad[0].tolist() == pytest.approx([-math.exp(0.25) / 2, 0.0])
    assert stats["losses/clipfrac"][0].item() == 1
    logp.grad = None
    loss, _, stats = gmpo_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask, clip_low=0.4,
                               clip_high=0.4)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(0.5))
    assert logp.grad[0].tolist() == pytest.approx([math.exp(0.5) / 2] * 2)
    assert stats["losses/clipfrac"][0].item() == 0


def test_defaults_are_the_papers():
    args = Args()
    assert (args.clip_low, args.clip_high) == (0.4, 0.4)


def test_keep_multiplies_the_term_by_the_fraction_of_its_tokens_kept():
    """--top-entropy-quantile: on policy (s_i = 1) the term A_i s_i is multiplied by the fraction of y_i's own tokens
    kept, 1/|y_i| sum_t keep_it, not of the padded width: y_1 has 4 tokens of T = 5, 3 kept (3/4); y_2 has 2, 1 kept
    (1/2). Loss -(2 x 3/4 - 1 x 1/2) / 2 = -0.5; the gradient of an unclipped token is A_i s_i kept_i / |y_i| / B."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, 0.0], [-0.3, -0.7, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    keep = torch.tensor([[1.0, 0, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    loss, _, _ = gmpo_loss(logp, old, adv, mask, clip_low=0.4, clip_high=0.4, keep=keep)
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 3 / 4 - 1 * 1 / 2) / 2, rel=1e-12)
    g0, g1 = -2 * (3 / 4) / 4 / 2, 1 * (1 / 2) / 2 / 2
    assert logp.grad.flatten().tolist() == pytest.approx([g0] * 4 + [0.0] + [g1] * 2 + [0.0] * 3, rel=1e-12)
