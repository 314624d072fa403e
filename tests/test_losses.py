"""The objectives against float64 values derived by hand from the papers' equations (GSPO arXiv:2507.18071, GRPO
arXiv:2402.03300, DFPO arXiv:2604.13088; numbering as in docs/objectives.md): values and gradients."""
import math

import pytest
import torch

import common
from dfpo import dfpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from gspo_token import gspo_token_loss
from helpers import mean, ragged_batch


@pytest.fixture(autouse=True)
def float64():
    """Every tensor in these tests is float64; the default is restored for the other test files."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------- GSPO
def test_blog_512_token_example():
    """GSPO's length normalisation on a worked example: 510 tokens at ratio 1, two at 1.9 and 0.4 ->
    s_i = exp((log 1.9 + log 0.4)/512) = 0.9995 (eq. 44): two far-off tokens move the sequence's ratio by 5e-4."""
    old = torch.zeros(1, 512)
    logp = old.clone()
    logp[0, 100], logp[0, 300] = math.log(1.9), math.log(0.4)
    _, _, stats = gspo_loss(logp, old, torch.ones(1), torch.ones(1, 512), clip_low=3e-4, clip_high=4e-4)
    s = mean(stats["losses/ratio_mean"])
    assert s == pytest.approx(math.exp((math.log(1.9) + math.log(0.4)) / 512), abs=1e-15)
    assert round(s, 4) == 0.9995
    # below 1 - 3e-4, but with A > 0 the min of eq. 42 keeps s_i A (the lower clip binds only for A < 0)
    assert mean(stats["losses/clipfrac"]) == 0


def gspo_reference(logp, old, adv, mask, lo, hi):
    """Loops in float64: eq. 44 for s_i, eq. 42 for J; the gradient of -J written out by hand
    (eq. 66): d(-J)/d logp_it = -(1/G) A_i s_i / |y_i| for unclipped i, 0 if clipped."""
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
    loss, _, _ = gspo_loss(logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1])
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
    loss, _, stats = gspo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 4), clip_low=3e-4,
                            clip_high=4e-4)
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert mean(stats["losses/clipfrac"]) == 1 and mean(stats["losses/clipfrac_seq"]) == 1
    # the same ratios on the other side of the advantage are not clipped (the min keeps the unclipped branch)
    logp.grad = None
    loss, _, stats = gspo_loss(logp, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 4), clip_low=3e-4,
                            clip_high=4e-4)
    loss.backward()
    assert torch.all(logp.grad != 0) and mean(stats["losses/clipfrac"]) == 0


# ------------------------------------------------------------------------------------------- GRPO
def grpo_reference(logp, old, adv, mask, lo, hi, ref=None, beta=0.0, symmetric=False):
    """Loops in float64: J = 1/G sum_i 1/|y_i| sum_t min(w A, clip(w) A) - beta k3; gradient by hand:
    d(-J)/d logp_it = -(1/G)(1/|y_i|) [A_i w_it (0 if clipped) + beta (exp(ref - logp) - 1)].
    symmetric (App. H eq. 79): the token term is A clip(w, 0, 1 + eps_high), clipped iff w > 1 + eps_high."""
    G, T = logp.shape
    J, grad = 0.0, torch.zeros(G, T)
    for i in range(G):
        L, A = int(mask[i].sum()), float(adv[i])
        for t in range(L):
            w = math.exp(float(logp[i, t] - old[i, t]))
            term = min(w * A, min(max(w, 1 - lo), 1 + hi) * A)
            clipped = (A > 0 and w > 1 + hi) or (A < 0 and w < 1 - lo)
            if symmetric:
                term, clipped = min(w, 1 + hi) * A, w > 1 + hi
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
    loss, _, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.27,
                            ref_logp=ref if beta else None, kl_coef=beta)
    loss.backward()
    ref_loss, ref_grad = grpo_reference(logp.detach(), old, adv, mask, 0.2, 0.27, ref, beta)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert torch.allclose(torch.nan_to_num(logp.grad, nan=0.0), ref_grad, atol=1e-12)
    assert 0 < mean(stats["losses/clipfrac"]) < 1  # the test really crosses the clip boundaries


def test_grpo_token_clipping_is_per_token():
    """One token far outside the band with A > 0 is silenced; its neighbours still get A w / |y| / G."""
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(1.9), 0.0, math.log(0.4)]], requires_grad=True)
    loss, _, stats = grpo_loss(logp, old, torch.ones(1), torch.ones(1, 3), clip_low=0.2, clip_high=0.27)
    loss.backward()
    assert logp.grad[0, 0] == 0  # w = 1.9 > 1.27 with A > 0: clipped
    assert logp.grad[0, 1] == pytest.approx(-1 / 3) and logp.grad[0, 2] == pytest.approx(-0.4 / 3)
    assert mean(stats["losses/clipfrac"]) == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(-(1.27 + 1 + 0.4) / 3)


@pytest.mark.parametrize("seed", range(4))
def test_grpo_symmetric_clip_matches_reference(seed):
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.3)
    loss, _, stats = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.27, symmetric_clip=True)
    loss.backward()
    ref_loss, ref_grad = grpo_reference(logp.detach(), old, adv, mask, 0.2, 0.27, symmetric=True)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert torch.allclose(torch.nan_to_num(logp.grad, nan=0.0), ref_grad, atol=1e-12)
    assert 0 < mean(stats["losses/clipfrac"]) < 1
    std, _, _ = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.27)
    assert abs(std.item() - loss.item()) > 1e-6  # the two clippings really differ on this batch


@pytest.mark.parametrize("w", [1.5, 0.5])
def test_asymmetric_clip_breaks_shared_token_cancellation(w):
    """App. F/H: one token shared by two samples with A = -1 and +1 and ratio w outside [0.8, 1.27]. Standard
    clipping leaves the group coefficient A((1 + eps) - w) (eq. 75) or A(w - (1 - eps)) (eq. 76) and a non-zero
    gradient on the shared token; symmetric clipping (eq. 79) gives both samples the same weight: both cancel."""
    lo, hi, A = 0.2, 0.27, 1.0
    old = torch.zeros(2, 1)
    adv = torch.tensor([-A, A])
    coef = A * ((1 + hi) - w) if w > 1 + hi else A * (w - (1 - lo))  # eq. 75 / 76: sum_i A_i w_bar_i
    for symmetric in (False, True):
        logp = torch.full((2, 1), math.log(w), requires_grad=True)  # the same token in the same context
        loss, _, _ = grpo_loss(logp, old, adv, torch.ones(2, 1), clip_low=lo, clip_high=hi,
                            symmetric_clip=symmetric)
        loss.backward()
        shared = logp.grad.sum().item()  # both rows have the same grad log pi: this is its group coefficient
        if symmetric:
            assert loss.item() == pytest.approx(0, abs=1e-15) and shared == pytest.approx(0, abs=1e-15)
        else:
            assert coef != 0 and loss.item() == pytest.approx(-coef / 2, abs=1e-15)  # -1/G sum_i A_i w_bar_i
            assert shared == pytest.approx(A * w / 2 if w > 1 else -A * w / 2, abs=1e-15)  # the unclipped side's A w / G


# ------------------------------------------------------------------------------------------- shared identities
@pytest.mark.parametrize("seed", range(4))
def test_gspo_is_advantage_times_post_clip_weight(seed):
    """Eq. 47-49: min(s A, clip(s) A) = A min(s, c) for A >= 0 and A max(s, c) for A < 0, so J_GSPO = 1/G sum A s_bar."""
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    loss, seq_terms, stats = gspo_loss(logp, old, adv, mask, clip_low=0.02, clip_high=0.03)
    J, terms = 0.0, []
    for i in range(len(adv)):
        L = int(mask[i].sum())
        s = math.exp(float((logp.detach()[i, :L] - old[i, :L]).sum()) / L)
        c = min(max(s, 1 - 0.02), 1 + 0.03)
        s_bar = min(s, c) if adv[i] >= 0 else max(s, c)
        terms.append(float(adv[i]) * s_bar)
        J += terms[-1] / len(adv)
    assert -loss.item() == pytest.approx(J, abs=1e-14)
    assert 0 < mean(stats["losses/clipfrac_seq"]) < 1
    assert torch.allclose(seq_terms, torch.tensor(terms, dtype=torch.float64), atol=1e-14, rtol=0)  # m_i = A_i s_bar_i
    (grad,) = torch.autograd.grad(loss, logp)
    group = common.group_metrics(seq_terms, grad[:, 0], 3, 2)  # Asym (eq. 23) on m_i = w_i A_i, by hand
    m = torch.tensor(terms).view(2, 3)
    assert group["losses/asym"].item() == pytest.approx(float(((m - m.mean(1, keepdim=True)) ** 2).mean()), abs=1e-14)


def test_jitter2_by_hand():
    """Eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t|; a straight line has none, a zig-zag 0,1,0,1 has 2."""
    from grouprl.runlog import jitter2

    assert jitter2([0.0, 1.0, 0.0, 1.0]) == 2.0
    assert jitter2([0.1 * t for t in range(10)]) == pytest.approx(0.0, abs=1e-15)
    assert jitter2([0.0, 0.5, 0.25, 1.0]) == pytest.approx((abs(0.25 - 1 + 0) + abs(1 - 0.5 + 0.5)) / 2)
    assert math.isnan(jitter2([1.0, 2.0]))


def test_grpo_micro_batch_without_a_counted_token():
    """--mask-truncated can leave a micro-batch with no token in the loss (every row truncated): it adds nothing, and
    its ratio min / max are +inf / -inf, which the step's min / max skip (it raised on the empty min)."""
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _, stats = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3),
                               clip_low=0.2, clip_high=0.2, norm=8)
    loss.backward()
    assert loss.item() == 0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert stats["losses/ratio_min"] == math.inf and stats["losses/ratio_max"] == -math.inf
    reduced = common.reduce_stats([stats, {**stats, "losses/ratio_min": 0.5, "losses/ratio_max": 2.0}])
    assert reduced["losses/ratio_min"] == 0.5 and reduced["losses/ratio_max"] == 2.0


@pytest.mark.parametrize("loss_fn", [gspo_loss, dfpo_loss, gspo_token_loss, grpo_loss])
def test_sequence_stats_count_only_what_is_in_the_loss(loss_fn):
    """A row with no token in the loss (--mask-truncated) is in none of the stats: one row of 4 clipped tokens with
    s = e^0.5 and one masked row (s = 1) are 4 / 4 clipped tokens, 1 / 1 clipped sequences, ratios e^0.5 (the
    masked row added a token to clipfrac's count, and its s = 1 to the ratio stats)."""
    logp = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    kw = dict(group_size=2) if loss_fn is dfpo_loss else {}
    if loss_fn is gspo_token_loss:
        adv = adv[:, None].expand(2, 4)
    _, _, stats = loss_fn(logp, torch.zeros(2, 4), adv, mask, clip_low=0.2, clip_high=0.2, **kw)
    assert mean(stats["losses/clipfrac"]) == 1.0 and mean(stats["losses/clipfrac_seq"]) == 1.0
    s = math.exp(0.5)  # s_i, and in GRPO each token ratio w_it
    assert mean(stats["losses/ratio_mean"]) == pytest.approx(s) and stats["losses/ratio_min"].item() == pytest.approx(s)


def test_gspo_script_passes_luspo(monkeypatch, tmp_path):
    """gspo.py --luspo: every loss call of the loop is LUSPO's (luspo=True), so the run is not plain GSPO."""
    import gspo
    from helpers import run_script

    loss, calls = gspo.gspo_loss, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("luspo", False))
        return loss(*args, **kwargs)

    monkeypatch.setattr(gspo, "gspo_loss", spy)
    run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1",
                        "--eval-every", "0", "--max-new-tokens", "4", "--log-samples", "0", "--save-every", "0",
                        "--luspo"], monkeypatch, tmp_path / "o")
    assert calls and all(c is True for c in calls), calls
