"""The objectives against float64 values derived by hand from the seeds' equations: values and gradients."""
import math

import pytest
import torch

from grpo import grpo_loss
from gspo import gspo_loss



@pytest.fixture(autouse=True)
def float64():
    """Every tensor in these tests is float64; the default is restored for the other test files."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def ragged_batch(B=6, T=7, seed=0, spread=0.3):
    """Random log-probs, old log-probs a little apart, ragged completion masks (padding), +/- advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + spread * torch.randn(B, T, generator=g)).requires_grad_()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logp.data[mask == 0] = float("nan")  # padding must never leak into the loss
    adv = torch.randn(B, generator=g)
    return logp, old, adv, mask


# ------------------------------------------------------------------------------------------- GSPO
def test_blog_512_token_example():
    """seeds/gspo-blog...: 510 tokens at ratio 1, two at 1.9 and 0.4 -> s_i = exp((log 1.9 + log 0.4)/512) = 0.9995."""
    old = torch.zeros(1, 512)
    logp = old.clone()
    logp[0, 100], logp[0, 300] = math.log(1.9), math.log(0.4)
    _, stats = gspo_loss(logp, old, torch.ones(1), torch.ones(1, 512), clip_low=3e-4, clip_high=4e-4)
    s = stats["losses/ratio_mean"].item()
    assert s == pytest.approx(math.exp((math.log(1.9) + math.log(0.4)) / 512), abs=1e-15)
    assert round(s, 4) == 0.9995
    assert stats["losses/clipfrac"] == 0  # inside even GSPO's tiny band: 1 - 3e-4 < 0.99946


def gspo_reference(logp, old, adv, mask, lo, hi):
    """Loops in float64: eq. 44 for s_i, eq. 42 for J; the gradient of -J written out by hand
    (gspo-technical-analysis sec. 2.3): d(-J)/d logp_it = -(1/G) A_i s_i / |y_i| for unclipped i, 0 if clipped."""
    G, T = logp.shape
    J, grad = 0.0, torch.zeros(G, T)
    for i in range(G):
        L = int(mask[i].sum())
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(L)) / L)
        A = float(adv[i])
        J += min(s * A, min(max(s, 1 - lo), 1 + hi) * A) / G
        clipped = (A > 0 and s > 1 + hi) or (A < 0 and s < 1 - lo)
        if not clipped:
            grad[i, :L] = -A * s / L / G
    return -J, grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.05, 0.08), (10.0, 10.0)])
def test_gspo_matches_reference(seed, clip):
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    loss, _ = gspo_loss(logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1])
    loss.backward()
    ref_loss, ref_grad = gspo_reference(logp.detach(), old, adv, mask, *clip)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    g = torch.nan_to_num(logp.grad, nan=0.0)
    assert torch.allclose(g, ref_grad, atol=1e-12)
    assert torch.all(logp.grad[mask == 0] == 0)


def test_gspo_clipped_sequence_gives_zero_gradient():
    old = torch.zeros(2, 4)
    logp = torch.zeros(2, 4)
    logp[0] = 0.01  # s_0 = e^0.01 > 1 + 4e-4 with A > 0: clipped
    logp[1] = -0.01  # s_1 = e^-0.01 < 1 - 3e-4 with A < 0: clipped
    logp.requires_grad_()
    loss, stats = gspo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 4), clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert stats["losses/clipfrac"] == 1 and stats["losses/clipfrac_tokens"] == 1
    # the same ratios on the other side of the advantage are not clipped (the min keeps the unclipped branch)
    logp.grad = None
    loss, stats = gspo_loss(logp, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 4), clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    assert torch.all(logp.grad != 0) and stats["losses/clipfrac"] == 0


# ------------------------------------------------------------------------------------------- GRPO
def grpo_reference(logp, old, adv, mask, lo, hi, ref=None, beta=0.0):
    """Loops in float64: J = 1/G sum_i 1/|y_i| sum_t min(w A, clip(w) A) - beta k3; gradient by hand:
    d(-J)/d logp_it = -(1/G)(1/|y_i|) [A_i w_it (0 if clipped) + beta (exp(ref - logp) - 1)]."""
    G, T = logp.shape
    J, grad = 0.0, torch.zeros(G, T)
    for i in range(G):
        L, A = int(mask[i].sum()), float(adv[i])
        for t in range(L):
            w = math.exp(float(logp[i, t] - old[i, t]))
            term = min(w * A, min(max(w, 1 - lo), 1 + hi) * A)
            clipped = (A > 0 and w > 1 + hi) or (A < 0 and w < 1 - lo)
            dterm = 0.0 if clipped else A * w
            if beta:
                x = float(ref[i, t] - logp[i, t])
                term -= beta * (math.exp(x) - x - 1)
                dterm -= beta * (1 - math.exp(x))  # d/dlogp of -(e^x - x - 1), x = ref - logp
            J += term / L / G
            grad[i, t] = -dterm / L / G
    return -J, grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_grpo_matches_reference(seed, beta):
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.3)  # many tokens outside [0.8, 1.27]
    ref = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 99))
    loss, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.27, ref_logp=ref if beta else None,
                            kl_coef=beta)
    loss.backward()
    ref_loss, ref_grad = grpo_reference(logp.detach(), old, adv, mask, 0.2, 0.27, ref, beta)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert torch.allclose(torch.nan_to_num(logp.grad, nan=0.0), ref_grad, atol=1e-12)
    assert 0 < stats["losses/clipfrac"] < 1  # the test really crosses the clip boundaries


def test_grpo_token_clipping_is_per_token():
    """One token far outside the band with A > 0 is silenced; its neighbours still get A w / |y| / G."""
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(1.9), 0.0, math.log(0.4)]], requires_grad=True)
    loss, stats = grpo_loss(logp, old, torch.ones(1), torch.ones(1, 3), clip_low=0.2, clip_high=0.27)
    loss.backward()
    assert logp.grad[0, 0] == 0  # w = 1.9 > 1.27 with A > 0: clipped
    assert logp.grad[0, 1] == pytest.approx(-1 / 3) and logp.grad[0, 2] == pytest.approx(-0.4 / 3)
    assert stats["losses/clipfrac"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(-(1.27 + 1 + 0.4) / 3)
