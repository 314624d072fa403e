"""DFPO against the DFPO paper (arXiv:2604.13088) in float64: the in-group transforms (eq. 50-55, 63), the length-aware
form (eq. 72 at any lengths), the exact QP of eq. 51 (KKT), the loss's value and gradient (eq. 68, and the clip-gated
form) against loops written from the equations, Theorem K.1 on the gradient, the ablations, and the Appendix A.2
toy on the real tiny model."""
import itertools
import math

import pytest
import torch

import common
from grouprl import data
from grouprl import distributed
from grouprl import modeling
from dfpo import dfpo_loss, group_weights, in_group_transform, sequence_weights
from gspo import gspo_loss
from helpers import mean, ragged_batch

ORTH = ["min-replace", "orth-proj", "orth-proj-qp"]
FLOOR = 1e-6


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def groups(seed, n=64, G=8):
    """Post-clip weights s_bar in (0, ~3) with a heavy spread, and advantages from 0/1 rewards as eq. 43 makes them
    (some groups all-equal: A = 0), plus continuous rewards."""
    g = torch.Generator().manual_seed(seed)
    s_bar = torch.exp(0.6 * torch.randn(n, G, generator=g))
    r = torch.cat([torch.randint(0, 2, (n // 2, G), generator=g).double(), torch.rand(n - n // 2, G, generator=g)])
    A = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)
    return s_bar, A


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("transform", ORTH)
def test_transforms_restore_group_orthogonality(transform, G, seed):
    """Eq. 63: sum_i A_i s_tilde_i = 0 in every group; min-replace and orth-proj keep every weight positive
    (Theorem K.1 on the loss's gradient: test_theorem_k1_no_reverse_update)."""
    s_bar, A = groups(seed, G=G)
    s_t = in_group_transform(s_bar, A, transform, FLOOR)
    assert (A * s_t).sum(1).abs().max() < 1e-12 * (1 + (A.abs() * s_t).sum(1).max())
    if transform == "min-replace":  # eq. 50: one weight per group, the smallest, so phi_i = s_tilde/s_bar in (0, 1]
        assert torch.equal(s_t, s_bar.min(1, keepdim=True).values.expand_as(s_bar)) and (s_t > 0).all()
        assert (s_t <= s_bar).all()
    if transform == "orth-proj":  # eq. 52-55: s+ = max(s_bar, eps), then one side scaled by alpha or beta in (0, 1]
        s_plus = s_bar.clamp(min=FLOOR)
        ratio = s_t / s_plus
        assert (s_t > 0).all() and (ratio <= 1 + 1e-15).all()
        delta = (A * s_plus).sum(1, keepdim=True)
        unscaled = torch.where(delta > 0, A <= 0, A >= 0)  # the side that is not rescaled keeps s+ >= eps
        assert torch.equal(s_t[unscaled], s_plus[unscaled]) and (s_t[unscaled] >= FLOOR).all()
    if transform == "orth-proj-qp":
        assert (s_t >= 0).all()


def test_orth_proj_floor():
    """Eq. 52 raises a weight to eps before the rebalance: s_bar = (0, 1.2), A = (1, -1) gives (eps, eps), so every
    weight stays strictly positive (Theorem K.1); without the floor it would be (0, 0)."""
    s_t = in_group_transform(torch.tensor([[0.0, 1.2]]), torch.tensor([[1.0, -1.0]]), "orth-proj", FLOOR)
    assert torch.allclose(s_t, torch.tensor([[FLOOR, FLOOR]]), rtol=1e-12, atol=0)


def test_beta_sign_erratum():
    """Eq. 55 printed beta = -sum_P A s+ / sum_N (-A) s+, which is negative; the corrected beta lies in (0, 1]:
    A = (+1, -1), s_bar = (0.8, 1.2): delta = -0.4 < 0, beta = 0.8 / 1.2, s_tilde = (0.8, 0.8)."""
    s_t = in_group_transform(torch.tensor([[0.8, 1.2]]), torch.tensor([[1.0, -1.0]]), "orth-proj", FLOOR)
    assert torch.allclose(s_t, torch.tensor([[0.8, 0.8]]), atol=1e-15)
    s_t = in_group_transform(torch.tensor([[1.2, 0.8]]), torch.tensor([[1.0, -1.0]]), "orth-proj", FLOOR)
    assert torch.allclose(s_t, torch.tensor([[0.8, 0.8]]), atol=1e-15)  # delta > 0: alpha = 0.8 / 1.2 on P


def kkt_lambda(v, s_bar, A):
    """The multiplier lambda of eq. 51's KKT conditions, read off the active coordinates: v_i = s_bar_i - lambda A_i."""
    act = (v > 0) & (A != 0)
    return ((s_bar - v) * A * act).sum() / (A * A * act).sum()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("G", [2, 4, 8])
def test_exact_qp_satisfies_kkt_and_beats_truncate_and_rebalance(G, seed):
    """Eq. 51: min 1/2 ||v - s_bar||^2 s.t. A.v = 0, v >= 0. KKT: v = s_bar - lambda A + mu, mu >= 0, mu_i v_i = 0,
    A.v = 0. Truncate-and-rebalance is feasible, so the exact projection is never farther from s_bar."""
    s_bar, A = groups(seed, G=G)
    v = in_group_transform(s_bar, A, "orth-proj-qp", FLOOR)
    tr = in_group_transform(s_bar, A, "orth-proj", FLOOR)
    for k in range(len(s_bar)):
        x, a, vk = s_bar[k], A[k], v[k]
        if (a == 0).all():
            assert torch.equal(vk, x)  # nothing to project
            continue
        lam = kkt_lambda(vk, x, a)
        mu = vk - x + lam * a
        assert (vk >= 0).all() and abs(float(a @ vk)) < 1e-12
        assert (mu >= -1e-12).all() and (mu * vk).abs().max() < 1e-12  # dual feasibility, complementary slackness
        assert (vk - x).norm() <= (tr[k] - x).norm() + 1e-12


def test_exact_qp_hand_examples():
    # A = (1, -1), s_bar = (1.2, 0.8): lambda = 0.2, v = (1, 1); truncate-and-rebalance gives (0.8, 0.8), farther.
    v = in_group_transform(torch.tensor([[1.2, 0.8]]), torch.tensor([[1.0, -1.0]]), "orth-proj-qp", FLOOR)
    assert torch.allclose(v, torch.tensor([[1.0, 1.0]]), atol=1e-15)
    # A = (2, -1, -1), s_bar = (0.01, 0.1, 5): the root has lambda = -4.98/5 and the middle weight hits v >= 0,
    # so the QP gives that negative-advantage sample weight 0 (sign kept weakly, K.1's "no reverse update").
    v = in_group_transform(torch.tensor([[0.01, 0.1, 5.0]]), torch.tensor([[2.0, -1.0, -1.0]]), "orth-proj-qp", FLOOR)
    lam = -4.98 / 5
    assert torch.allclose(v, torch.tensor([[0.01 - 2 * lam, 0.0, 5.0 + lam]]), atol=1e-14)
    # A of one sign (eq. 43 never gives one, a caller may): A.v = 0 with v >= 0 leaves v_i = 0 wherever A_i != 0
    for sign in (1.0, -1.0):
        v = in_group_transform(torch.tensor([[0.7, 1.3, 0.9]]), sign * torch.tensor([[1.0, 0.5, 0.0]]), "orth-proj-qp",
                               FLOOR)
        assert torch.equal(v, torch.tensor([[0.0, 0.0, 0.9]]))


def reference_transform(x, a, transform):
    """s_tilde of one group from the lists s_bar = x and A = a, written from the paper without the project's code:
    eq. 50; eq. 52-55 (beta's sign corrected); eq. 51 by brute force over every active set S (v_S = x_S - lam a_S,
    0 elsewhere, lam from a.v = 0), keeping the feasible v nearest x; Table 3's scale; none."""
    G = len(x)
    if transform == "min-replace":
        return [min(x)] * G
    if transform == "orth-proj":
        sp = [max(v, FLOOR) for v in x]
        pos = sum(a[i] * sp[i] for i in range(G) if a[i] > 0)
        neg = sum(-a[i] * sp[i] for i in range(G) if a[i] < 0)
        if pos > neg:
            return [sp[i] * (neg / pos if a[i] > 0 else 1.0) for i in range(G)]
        if neg > pos:
            return [sp[i] * (pos / neg if a[i] < 0 else 1.0) for i in range(G)]
        return sp
    if transform == "orth-proj-qp":
        free = [i for i in range(G) if a[i] != 0]
        best, best_d = list(x), math.inf
        for k in range(len(free) + 1):
            for S in itertools.combinations(free, k):
                den = sum(a[i] ** 2 for i in S)
                lam = sum(a[i] * x[i] for i in S) / den if den else 0.0
                v = [x[i] if a[i] == 0 else (x[i] - lam * a[i] if i in S else 0.0) for i in range(G)]
                dist = sum((v[i] - x[i]) ** 2 for i in range(G))
                if min(v) >= -1e-15 and abs(sum(a[i] * v[i] for i in range(G))) < 1e-12 and dist < best_d:
                    best, best_d = v, dist
        return best
    if transform == "scale":
        return [0.5 * v for v in x]
    return list(x)


def dfpo_reference(logp, old, adv, mask, lo, hi, G, transform, length_aware=False, clip_gated=False):
    """Loops: s_i (eq. 44), s_bar_i (eq. 47), s_tilde = T(s_bar) per group (length_aware: T on u_i = s_bar_i L/|y_i|,
    mapped back by |y_i|/L); value -1/B sum_i A_i s_tilde_i; gradient (eq. 68, s_tilde a constant)
    d(-J)/d logp_it = -(1/B) A_i s_tilde_i / |y_i| for every sequence, or only the unclipped ones (clip_gated)."""
    B, T = logp.shape
    L = [int(mask[i].sum()) for i in range(B)]
    s_bar, clipped = [], []
    for i in range(B):
        si = math.exp(sum(float(logp[i, t] - old[i, t]) for t in range(L[i])) / L[i])
        c = min(max(si, 1 - lo), 1 + hi)
        s_bar.append(min(si, c) if adv[i] >= 0 else max(si, c))
        clipped.append((adv[i] > 0 and si > 1 + hi) or (adv[i] < 0 and si < 1 - lo))
    s_t = []
    for g in range(0, B, G):
        mean_L = sum(L[g:g + G]) / G
        scale = [L[i] / mean_L if length_aware else 1.0 for i in range(g, g + G)]
        u = reference_transform([s_bar[g + k] / scale[k] for k in range(G)], [float(v) for v in adv[g:g + G]],
                                transform)
        s_t += [u[k] * scale[k] for k in range(G)]
    J, grad = 0.0, torch.zeros(B, T)
    for i in range(B):
        J += float(adv[i]) * s_t[i] / B
        if not (clip_gated and clipped[i]):
            grad[i, :L[i]] = -float(adv[i]) * s_t[i] / L[i] / B
    return -J, grad, sum(clipped)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("form", ["eq68", "clip-gated", "length-aware"])
@pytest.mark.parametrize("transform", ORTH + ["scale", "none"])
def test_dfpo_loss_matches_reference(transform, form, seed):
    if form == "length-aware" and transform not in ORTH:
        pytest.skip("length-aware needs a cancelling transform")
    logp, old, adv, mask = ragged_batch(B=8, seed=seed, spread=0.1)
    kw = dict(length_aware=form == "length-aware", clip_gated=form == "clip-gated")
    loss, _, stats = dfpo_loss(logp, old, adv, mask, group_size=4, clip_low=0.02, clip_high=0.03, transform=transform,
                            **kw)
    loss.backward()
    ref_loss, ref_grad, n_clipped = dfpo_reference(logp.detach(), old, adv, mask, 0.02, 0.03, 4, transform, **kw)
    assert 0 < n_clipped < 8  # the comparison crosses the clip boundary
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    assert torch.allclose(torch.nan_to_num(logp.grad), ref_grad, atol=1e-12)
    assert mean(stats["losses/clipfrac_seq"]) == n_clipped / 8


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("transform", ORTH)
def test_length_aware_cancels_at_any_lengths(transform, G, seed):
    """Eq. 72: the shared-token coefficient sum_i A_i s_tilde_i / |y_i| is 0 on ragged lengths with --length-aware;
    the plain transform leaves it non-zero there (eq. 63 holds, eq. 72 does not)."""
    s_bar, A = groups(seed, G=G)
    g = torch.Generator().manual_seed(seed + 10)
    lengths = torch.randint(1, 50, s_bar.shape, generator=g)
    mask = (torch.arange(50)[None] < lengths.reshape(-1, 1)).double()
    kw = dict(group_size=G, transform=transform, floor=FLOOR)
    aware = group_weights(s_bar.flatten(), A.flatten(), mask, **kw, length_aware=True).view(-1, G)
    plain = group_weights(s_bar.flatten(), A.flatten(), mask, **kw, length_aware=False).view(-1, G)
    size = (A.abs() * aware / lengths).sum(1).max()
    assert (A * aware / lengths).sum(1).abs().max() < 1e-12 * (1 + size)
    assert (A * plain / lengths).sum(1).abs().max() > 1e-3
    assert (aware >= 0).all()
    same = lengths.min(1).values == lengths.max(1).values  # equal lengths: the plain transform exactly
    equal = mask.clone()
    equal[:] = 1.0
    assert torch.allclose(group_weights(s_bar.flatten(), A.flatten(), equal, **kw, length_aware=True),
                          plain.flatten() if same.all() else group_weights(s_bar.flatten(), A.flatten(), equal, **kw,
                                                                           length_aware=False), atol=1e-14)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("transform", ORTH)
def test_theorem_k1_no_reverse_update(transform, seed):
    """Theorem K.1 (eq. 85-89) on the loss's own gradient: every token's coefficient -dL/dlogp_it has the sign of
    A_i (min-replace and orth-proj: strictly; the exact QP may give a weight of 0: weakly), and for min-replace it is
    phi_i (in (0, 1]) times the post-clip baseline's s_bar_i A_i / |y_i| / B (eq. 86-88), clipped sequences included."""
    logp, old, adv, mask = ragged_batch(B=8, seed=seed, spread=0.1)
    loss, _, _ = dfpo_loss(logp, old, adv, mask, group_size=4, clip_low=0.02, clip_high=0.03, transform=transform)
    (grad,) = torch.autograd.grad(loss, logp)
    coef = -torch.nan_to_num(grad)
    on = mask.bool()
    A = adv[:, None].expand_as(coef)
    if transform == "orth-proj-qp":
        assert (coef * A)[on].min() >= 0
    else:
        assert torch.equal(coef[on].sign(), A[on].sign())
    if transform == "min-replace":
        L = [int(mask[j].sum()) for j in range(8)]
        s = [math.exp(float((logp.detach()[j, :L[j]] - old[j, :L[j]]).sum()) / L[j]) for j in range(8)]
        s_bar = [min(s[j], 1.03) if adv[j] >= 0 else max(s[j], 0.98) for j in range(8)]  # eq. 47, band (0.98, 1.03)
        assert any(s_bar[j] != s[j] for j in range(8))  # some sequences clipped: they keep their gradient (eq. 68)
        for i in range(8):
            phi = min(s_bar[4 * (i // 4):4 * (i // 4) + 4]) / s_bar[i]  # eq. 87
            assert 0 < phi <= 1
            expected = torch.full((L[i],), phi * s_bar[i] * float(adv[i]) / L[i] / 8)
            assert torch.allclose(coef[i, :L[i]], expected, atol=1e-14)


@pytest.mark.parametrize("seed", range(4))
def test_transform_none_is_gspo_and_scale_is_half(seed):
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    kw = dict(clip_low=0.02, clip_high=0.03)
    (g_gspo,) = torch.autograd.grad(l_gspo := gspo_loss(logp, old, adv, mask, **kw)[0], logp)
    for transform, factor in [("none", 1.0), ("scale", 0.5)]:
        for stop_grad in (True, False):
            loss = dfpo_loss(logp, old, adv, mask, group_size=3, transform=transform, stop_grad=stop_grad,
                             clip_gated=True, **kw)[0]  # GSPO's clip removes a clipped sequence's gradient
            (g,) = torch.autograd.grad(loss, logp)
            assert loss.item() == pytest.approx(factor * l_gspo.item(), abs=1e-12)
            assert torch.allclose(torch.nan_to_num(g), factor * torch.nan_to_num(g_gspo), atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_no_stop_grad_min_replace_has_zero_gradient(seed):
    """Without the stop-gradient, min-replace makes the objective s_bar_min(theta) sum_i A_i = 0: no gradient at all,
    although the stop-gradient version's gradient is as large as GSPO's."""
    logp, old, adv, mask = ragged_batch(seed=seed, spread=0.1)
    adv = adv - adv.view(-1, 3).mean(1).repeat_interleave(3)  # group-centred, as eq. 43 makes them
    kw = dict(group_size=3, clip_low=0.5, clip_high=0.5, transform="min-replace")
    (g_sg,) = torch.autograd.grad(dfpo_loss(logp, old, adv, mask, **kw)[0], logp)
    loss, _, _ = dfpo_loss(logp, old, adv, mask, stop_grad=False, **kw)
    (g_no,) = torch.autograd.grad(loss, logp)
    assert abs(loss.item()) < 1e-15 and torch.nan_to_num(g_sg).norm() > 1e-2
    assert torch.nan_to_num(g_no).abs().max() < 1e-15


@pytest.mark.parametrize("transform", ORTH)
def test_given_s_tilde_lets_micro_batches_split_groups(transform):
    """The loop's path for micro-batches smaller than a group: s_tilde from the whole groups (no grad), then each
    slice of rows on its own, divided by the whole count, adds up to the whole batch's value and gradient."""
    logp, old, adv, mask = ragged_batch(B=8, seed=5, spread=0.1)
    kw = dict(group_size=4, clip_low=0.02, clip_high=0.03, transform=transform)
    loss, _, stats = dfpo_loss(logp, old, adv, mask, **kw)
    (whole,) = torch.autograd.grad(loss, logp)
    assert 0 < mean(stats["losses/clipfrac_seq"]) < 1
    _, _, s_bar = sequence_weights(logp, old, adv, mask, clip_low=0.02, clip_high=0.03)
    s_tilde = group_weights(s_bar.detach(), adv, mask, group_size=4, transform=transform, floor=1e-6,
                            length_aware=False)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 8)):  # 3 + 1 + 1 + 3: every group split
        part, _, _ = dfpo_loss(logp[rows], old[rows], adv[rows], mask[rows], **kw, norm=8, s_tilde=s_tilde[rows])
        total = total + part
    (split,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(loss.item(), abs=1e-14)
    assert torch.allclose(torch.nan_to_num(split), torch.nan_to_num(whole), atol=1e-14, rtol=0)
    with pytest.raises(ValueError, match="stop-gradient"):
        dfpo_loss(logp[:3], old[:3], adv[:3], mask[:3], **kw, stop_grad=False, s_tilde=s_tilde[:3])


def test_groups_must_be_whole():
    logp, old, adv, mask = ragged_batch(B=6)
    with pytest.raises(ValueError, match="whole groups"):
        dfpo_loss(logp, old, adv, mask, group_size=4, clip_low=0.1, clip_high=0.1)
    assert common.minibatches(8, 4, 2) == [slice(0, 16), slice(16, 32)]  # the training loop's minibatches are whole groups


# ------------------------------------------------------------------------------------------- App. A.2 toy
def toy_gradients(loss_fn):
    """The tiny model in float64 as pi_old, a perturbed copy as pi_theta; two trajectories that share the prompt and
    the first two completion tokens and differ in the last, advantages (-1, +1). Returns the parameter gradient of
    the loss restricted to the shared-prefix tokens (sum over the group of dL/dlogp_it grad logp_it for t < 2), the
    whole gradient, the per-token log-ratios, and g* = grad of the two prefix log-probs of trajectory 1."""
    d = distributed.Dist(0, 1, torch.device("cpu"))
    tok = modeling.tiny_tokenizer()
    lm_old = modeling.load_model("tiny", tok, d, seed=0)[0].double()
    lm = modeling.load_model("tiny", tok, d, seed=0)[0].double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * p.std().nan_to_num(0.02) * torch.randn(p.shape, generator=g))
    prompt = data.chat_prompts(tok, ["What is 10+10?"], False)[0]
    ids = torch.tensor([tok(prompt + c, add_special_tokens=False).input_ids for c in ["is25", "is20"]])[:, :-1]
    P = ids.shape[1] - 3  # completions: 'i', 's', then '2' + ('5' | '0')... the last token differs
    ids = torch.cat([ids[:, :P], ids[:, P:P + 2], torch.tensor([[tok.convert_tokens_to_ids("5")],
                                                                  [tok.convert_tokens_to_ids("0")]])], 1)
    am = torch.ones_like(ids)
    old = modeling.Policy(lm_old, 1.0, 64)(ids, am, P).detach()
    policy = modeling.Policy(lm, 1.0, 64)
    logp = policy(ids, am, P)
    assert torch.equal(logp[0, :2], logp[1, :2])  # the shared prefix: the same token in the same context
    loss = loss_fn(logp, old)
    (c,) = torch.autograd.grad(loss, logp, retain_graph=True)
    params = [p for p in policy.parameters()]
    flat = lambda gs: torch.cat([x.reshape(-1) for x in gs])  # noqa: E731
    prefix = flat(torch.autograd.grad((c[:, :2] * logp[:, :2]).sum(), params, retain_graph=True))
    whole = flat(torch.autograd.grad(loss, params, retain_graph=True))
    g_star = flat(torch.autograd.grad(logp[0, :2].sum(), params))
    return prefix, whole, (logp - old).detach(), g_star


def test_appendix_a2_learning_tax_on_the_real_model():
    """Eq. 38: under sequence coupling the shared prefix keeps a non-zero group coefficient; DFPO's transforms make
    it cancel (eq. 63, 72), while the whole update stays non-zero (App. D)."""
    adv = torch.tensor([-1.0, 1.0])
    kw = dict(clip_low=0.5, clip_high=0.5)  # wide: the toy lives in the linear region, nothing clipped
    prefix, whole, log_w, g_star = toy_gradients(lambda lp, old: gspo_loss(lp, old, adv, torch.ones(2, 3), **kw)[0])
    rho, lam = log_w[0, :2].exp(), log_w[:, 2].exp()
    assert abs(lam[0] - lam[1]) > 1e-2 and torch.allclose(log_w[0, :2], log_w[1, :2])
    assert ((log_w.mean(1).exp() - 1).abs() < 0.5).all()  # nothing clipped
    # GSPO, length-normalised s_i = (rho1 rho2 lambda_i)^(1/3): the prefix coefficient is -(A/G)(s2 - s1)/|y|
    s = (rho.prod() * lam) ** (1 / 3)
    expected = -(1 / 2) * (s[1] - s[0]) / 3 * g_star
    # Qwen3's RMSNorm computes in float32 even in a float64 model, so a parameter gradient carries float32 rounding,
    # here amplified ~300x by the cancellation c_1 + c_2 << |c_i|: hence 1e-4, not 1e-12.
    assert torch.allclose(prefix, expected, rtol=0, atol=1e-4 * expected.abs().max())
    assert prefix.norm() > 1e-4 * g_star.norm()
    # eq. 38 itself, with the plain product s_i = rho1 rho2 lambda_i (eq. 31): A rho1 rho2 (lambda2 - lambda1)
    prod_loss = lambda lp, old: -(adv * ((lp - old).sum(1)).exp()).mean()  # noqa: E731
    prefix_prod, _, _, _ = toy_gradients(prod_loss)
    expected = -(1 / 2) * rho.prod() * (lam[1] - lam[0]) * g_star
    assert torch.allclose(prefix_prod, expected, rtol=0, atol=1e-4 * expected.abs().max())
    for transform in ORTH:
        p_dfpo, w_dfpo, _, _ = toy_gradients(
            lambda lp, old: dfpo_loss(lp, old, adv, torch.ones(2, 3), group_size=2, transform=transform, **kw)[0])
        assert p_dfpo.norm() < 1e-6 * prefix.norm(), transform
        assert w_dfpo.norm() > 0.1 * whole.norm(), transform  # the update on the differing tokens survives
