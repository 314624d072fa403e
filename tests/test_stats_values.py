"""Every value the losses return or log, pinned against float64 loops written here from the papers' equations (none
of the project's loss code is called for an expected value): each entry of each loss's stats (a mean as (sum, count),
both checked), the per-sequence terms m_i, the group metrics (Asym, the shared-token coefficient), Jitter2, the group
advantages, reduce_stats, the post-answer tokens of GSPO-token and each script's clip defaults.
Equations: GSPO arXiv:2507.18071; GRPO arXiv:2402.03300; the numbering is the DFPO paper's, arXiv:2604.13088.

One hand-made batch serves every loss: two groups of 4 with partial-credit rewards (0, 0.5, 1), so the first group
has two sequences with A_i = 0 although its rewards differ; ragged lengths 1-6; sequences and tokens on both sides
of the clip range, some clipped and some not; and (masked=True) one row with no token in the loss, as
--mask-truncated leaves a truncated completion."""
import dataclasses
import importlib
import math
import os
import re

import pytest
import torch

from common import group_advantages, group_metrics, reduce_stats
from grouprl.runlog import jitter2
from dfpo import dfpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from gspo_token import gspo_token_loss, post_answer_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G, T = 4, 6
REWARDS = [1.0, 0.5, 0.0, 0.5, 0.0, 0.5, 1.0, 1.0]
LOG_W = [  # log w_it = log pi(y_it) - log pi_old(y_it) of each row; the row's length is |y_i|
    [0.30, -0.10, 0.25, 0.05, 0.10, 0.12],  # A > 0, s = e^0.12 > 1 + eps_high: clipped; tokens 1.35, 1.28 > 1.27
    [-0.30, 0.05, -0.20],  # A = 0, s = e^-0.15 < 1 - eps_low: the group's smallest s_bar by eq. 47 (A >= 0: min)
    [0.10, -0.05, 0.0, 0.05, 0.0],  # A < 0, s = e^0.02 inside the range
    [0.15, 0.05],  # A = 0, s = e^0.10 > 1 + eps_high
    [-0.25, 0.05, -0.10, -0.02],  # A < 0, s = e^-0.08 < 1 - eps_low: clipped; token 0.78 < 0.8
    [0.30, 0.0, 0.10, 0.05, 0.05, 0.04],  # A < 0, s = e^0.09 > 1 + eps_high: the upper bound binds only A > 0
    [0.03],  # A > 0, one token
    [0.50, 0.50, 0.50],  # A > 0; masked=True: truncated, no token in the loss (s = e^0.5 if it were counted)
]
MASKED = 7
LO, HI = 0.05, 0.08  # sequence-level clip range of these tests (the scripts' defaults are pinned below)
TOKEN_LO, TOKEN_HI = 0.2, 0.27  # GRPO's token-level range
AFTER = {0: [4, 5], 1: [1, 2], 3: [1], 4: [3], 5: [5]}  # GSPO-token: tokens after the final answer, per row
PENALTY = 0.5
MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
L_MAX = 9  # --max-new-tokens for seq-mean-token-sum-norm


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------- the references
def ref_advantages(rewards, eps=1e-6):
    """Eq. 43: A_i = (r_i - mean_g r) / (std_g r + eps), population std, per group of G."""
    out = []
    for k in range(0, len(rewards), G):
        g = rewards[k:k + G]
        m = sum(g) / G
        sd = math.sqrt(sum((x - m) ** 2 for x in g) / G)
        out += [(x - m) / (sd + eps) for x in g]
    return out


ADV = ref_advantages(REWARDS)


def lengths(masked):
    """|y_i| in the loss: 0 for the masked row."""
    return [0 if masked and i == MASKED else len(row) for i, row in enumerate(LOG_W)]


def seq_ratio(i, masked):
    """Eq. 44: s_i = exp(1/|y_i| sum_t log w_it); a row with no token in the loss has s_i = 1 (an empty sum)."""
    L = lengths(masked)[i]
    return math.exp(sum(LOG_W[i][:L]) / L) if L else 1.0


def k3(x):
    """k3 estimate of KL(p||q) from a sample of p with x = log q/p: e^x - 1 - x >= 0."""
    return math.exp(x) - 1 - x


def clip(x, lo, hi):
    return min(max(x, 1 - lo), 1 + hi)


def batch(masked, token_adv=False):
    """The tensors: logp, old [B, T] (padding NaN, so that it cannot leak), advantages, loss mask."""
    B = len(LOG_W)
    old = torch.full((B, T), float("nan"))
    logp = old.clone()
    mask = torch.zeros(B, T)
    for i, row in enumerate(LOG_W):
        for t, x in enumerate(row):
            old[i, t] = -0.4 - 0.15 * t - 0.05 * i
            logp[i, t] = old[i, t] + x
            mask[i, t] = 0.0 if masked and i == MASKED else 1.0
    adv = torch.tensor(ADV)
    if token_adv:
        adv = torch.tensor([[ADV[i] - PENALTY * (t in AFTER.get(i, [])) for t in range(T)] for i in range(B)]) * mask
    return logp.requires_grad_(), old, adv, mask


def ref_logp_offsets(i, t):
    """log pi_ref - log pi_old of token (i, t), for GRPO's KL term."""
    return 0.1 * ((i * 7 + t * 3) % 5 - 2)


def sequence_stats(terms, clipped, masked, policy_count):
    """The stats of the sequence-level losses (GSPO, DFPO); clipped: per row."""
    L = lengths(masked)
    rows = [i for i in range(len(L)) if L[i]]
    s = [seq_ratio(i, masked) for i in range(len(L))]
    return {
        "losses/policy_loss": (-sum(terms), policy_count),
        "losses/clipfrac": (sum(L[i] for i in rows if clipped[i]), sum(L)),
        "losses/clipfrac_seq": (sum(clipped[i] for i in rows), len(rows)),
        "losses/ratio_mean": (sum(s[i] for i in rows), len(rows)),
        "losses/ratio_min": min(s[i] for i in rows),
        "losses/ratio_max": max(s[i] for i in rows),
        "losses/approx_kl": (sum(k3(x) for i in rows for x in LOG_W[i][:L[i]]), sum(L)),
    }


def sequence_clipped(masked, lo=LO, hi=HI):
    """GSPO's clip takes its constant branch: s_i > 1 + eps_high with A_i > 0, or s_i < 1 - eps_low with A_i < 0."""
    return [(ADV[i] > 0 and seq_ratio(i, masked) > 1 + hi) or (ADV[i] < 0 and seq_ratio(i, masked) < 1 - lo)
            for i in range(len(LOG_W))]


def aggregate(token_terms, L, mode):
    """--loss-agg on per-row lists of token terms: (per-row sums, count)."""
    if mode == "seq-mean-token-mean":
        return [sum(r) / max(n, 1) for r, n in zip(token_terms, L)], len(L)
    if mode == "token-mean":
        return [sum(r) for r in token_terms], max(sum(L), 1)
    return [sum(r) / L_MAX for r in token_terms], len(L)


def check(stats, expected):
    """Every key the loss logs is pinned, each (sum, count) on both parts."""
    assert set(stats) == set(expected)
    for k, v in expected.items():
        if isinstance(v, tuple):
            assert isinstance(stats[k], tuple), k
            assert float(stats[k][0]) == pytest.approx(v[0], abs=1e-12), k
            assert float(stats[k][1]) == v[1], k
        else:
            assert float(stats[k]) == pytest.approx(v, abs=1e-12), k


# ------------------------------------------------------------------------------------------- GSPO
@pytest.mark.parametrize("masked", [True, False])
def test_gspo_values(masked):
    """Eq. 42-44: m_i = min(s_i A_i, clip(s_i) A_i), loss -1/G sum_i m_i, and each stat."""
    logp, old, adv, mask = batch(masked)
    loss, seq_terms, stats = gspo_loss(logp, old, adv, mask, clip_low=LO, clip_high=HI)
    s = [seq_ratio(i, masked) for i in range(len(LOG_W))]
    # a row with no loss token adds 0 (TRL 1.16, verl, grpo.py), not its s_i = exp(0) times A_i
    terms = [min(s[i] * ADV[i], clip(s[i], LO, HI) * ADV[i]) if lengths(masked)[i] else 0.0 for i in range(len(s))]
    clipped = sequence_clipped(masked)
    assert 0 < sum(clipped) < len(clipped) - 1  # both sides of the clip
    assert seq_terms.tolist() == pytest.approx(terms, abs=1e-12)
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), abs=1e-12)
    check(stats, sequence_stats(terms, clipped, masked, len(terms)))


# ------------------------------------------------------------------------------------------- GRPO
def grpo_reference(masked, symmetric, mode, beta):
    """Per token: min(w A, clip(w) A) (eq. 78), or A clip(w, 0, 1 + eps_high) (GRPO-fix, eq. 79), minus beta k3 of
    KL(pi||pi_ref); m_i = 1/|y_i| sum_t of the clipped term (no KL)."""
    L = lengths(masked)
    token_terms, seq_terms, clipped, w_all, kl_ref = [], [], [], [], []
    for i, row in enumerate(LOG_W):
        A, terms, c_row = ADV[i], [], []
        for t, x in enumerate(row[:L[i]]):
            w = math.exp(x)
            w_all.append(w)
            if symmetric:
                term, c = min(w, 1 + TOKEN_HI) * A, w > 1 + TOKEN_HI
            else:
                term = min(w * A, clip(w, TOKEN_LO, TOKEN_HI) * A)
                c = (A > 0 and w > 1 + TOKEN_HI) or (A < 0 and w < 1 - TOKEN_LO)
            terms.append(term)
            c_row.append(c)
        seq_terms.append(sum(terms) / max(L[i], 1))
        kl = [k3(ref_logp_offsets(i, t) - x) for t, x in enumerate(row[:L[i]])]  # x: ref - logp
        kl_ref += kl
        token_terms.append([a - beta * b for a, b in zip(terms, kl)])
        clipped.append(c_row)
    per_seq, count = aggregate(token_terms, L, mode)
    rows = [i for i in range(len(L)) if L[i]]
    stats = {
        "losses/policy_loss": (-sum(per_seq), count),
        "losses/clipfrac": (sum(map(sum, clipped)), sum(L)),
        "losses/clipfrac_seq": (sum(any(c) for c in clipped), len(rows)),
        "losses/ratio_mean": (sum(w_all), sum(L)),
        "losses/ratio_min": min(w_all),
        "losses/ratio_max": max(w_all),
        "losses/approx_kl": (sum(k3(x) for i in rows for x in LOG_W[i][:L[i]]), sum(L)),
    }
    if beta:
        stats["losses/kl_ref"] = (sum(kl_ref), sum(L))
    return -sum(per_seq) / count, seq_terms, stats


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_values(masked, mode, symmetric, beta):
    logp, old, adv, mask = batch(masked)
    ref = old + torch.tensor([[ref_logp_offsets(i, t) for t in range(T)] for i in range(len(LOG_W))])
    loss, seq_terms, stats = grpo_loss(logp, old, adv, mask, clip_low=TOKEN_LO, clip_high=TOKEN_HI,
                                       symmetric_clip=symmetric, ref_logp=ref if beta else None, kl_coef=beta,
                                       loss_agg=mode, max_new_tokens=L_MAX)
    ref_loss, ref_terms, ref_stats = grpo_reference(masked, symmetric, mode, beta)
    assert 0 < ref_stats["losses/clipfrac"][0] < ref_stats["losses/clipfrac"][1]
    assert seq_terms.tolist() == pytest.approx(ref_terms, abs=1e-12)  # 1/|y_i| sum_t, whatever --loss-agg
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    check(stats, ref_stats)


def test_grpo_clip_decisions_differ_between_the_two_clippings():
    """Row 5 (A < 0) has a token at 1.35 > 1 + eps_high: clipped by the symmetric clip only; row 4's token at 0.78
    (A < 0) only by the standard one. The batch really tells the two apart."""
    std = grpo_reference(True, False, MODES[0], 0.0)[2]["losses/clipfrac"][0]
    sym = grpo_reference(True, True, MODES[0], 0.0)[2]["losses/clipfrac"][0]
    assert (std, sym) == (3, 3)  # std: row 0's 1.35 and 1.28, row 4's 0.78; sym: 1.35, 1.28 and row 5's 1.35


# ------------------------------------------------------------------------------------------- GSPO-token
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_gspo_token_values(masked, mode):
    """Token advantages A_it = A_i - lambda after the answer: per token min(s_i A_it, clip(s_i) A_it), clipped per
    token with the sign of A_it; m_i = 1/|y_i| sum_t of the token terms."""
    logp, old, adv, mask = batch(masked, token_adv=True)
    loss, seq_terms, stats = gspo_token_loss(logp, old, adv, mask, clip_low=LO, clip_high=HI, loss_agg=mode,
                                             max_new_tokens=L_MAX)
    L = lengths(masked)
    token_terms, clipped = [], []
    for i in range(len(LOG_W)):
        s = seq_ratio(i, masked)
        A = [ADV[i] - PENALTY * (t in AFTER.get(i, [])) for t in range(L[i])]
        token_terms.append([min(s * a, clip(s, LO, HI) * a) for a in A])
        clipped.append([(a > 0 and s > 1 + HI) or (a < 0 and s < 1 - LO) for a in A])
    per_seq, count = aggregate(token_terms, L, mode)
    rows = [i for i in range(len(L)) if L[i]]
    s = [seq_ratio(i, masked) for i in range(len(L))]
    expected = {
        "losses/policy_loss": (-sum(per_seq), count),
        "losses/clipfrac": (sum(map(sum, clipped)), sum(L)),
        "losses/clipfrac_seq": (sum(any(c) for c in clipped), len(rows)),
        "losses/ratio_mean": (sum(s[i] for i in rows), len(rows)),
        "losses/ratio_min": min(s[i] for i in rows),
        "losses/ratio_max": max(s[i] for i in rows),
        "losses/approx_kl": (sum(k3(x) for i in rows for x in LOG_W[i][:L[i]]), sum(L)),
    }
    # row 1 (A = 0, s < 1 - eps_low) is clipped exactly on its post-answer tokens, where A_it = -lambda < 0
    assert clipped[1] == [False, True, True] and 0 < expected["losses/clipfrac"][0] < sum(L)
    assert seq_terms.tolist() == pytest.approx([sum(r) / max(n, 1) for r, n in zip(token_terms, L)], abs=1e-12)
    assert loss.item() == pytest.approx(-sum(per_seq) / count, abs=1e-12)
    check(stats, expected)


# ------------------------------------------------------------------------------------------- DFPO
def s_bar_of(i, masked, zero_takes_min=True):
    """Eq. 47: min(s_i, c_i) for A_i >= 0, max(s_i, c_i) for A_i < 0 (zero_takes_min=False: the A > 0 misreading)."""
    s = seq_ratio(i, masked)
    c = clip(s, LO, HI)
    takes_min = ADV[i] >= 0 if zero_takes_min else ADV[i] > 0
    return min(s, c) if takes_min else max(s, c)


def transform_ref(sb, A, transform, floor=1e-6):
    """s_tilde of one group: eq. 50 (min-replace), eq. 52-55 (orth-proj, beta's sign corrected), Table 3 (scale)."""
    if transform == "min-replace":
        return [min(sb)] * len(sb)
    if transform == "orth-proj":
        sp = [max(x, floor) for x in sb]
        pos = sum(a * x for a, x in zip(A, sp) if a > 0)
        neg = sum(-a * x for a, x in zip(A, sp) if a < 0)
        if pos > neg:
            return [x * neg / pos if a > 0 else x for a, x in zip(A, sp)]
        if neg > pos:
            return [x * pos / neg if a < 0 else x for a, x in zip(A, sp)]
        return sp
    if transform == "scale":
        return [0.5 * x for x in sb]
    return list(sb)


def dfpo_reference(masked, transform, length_aware=False, zero_takes_min=True):
    B = len(LOG_W)
    sb = [s_bar_of(i, masked, zero_takes_min) for i in range(B)]
    L = [max(n, 1) for n in lengths(masked)]
    st = []
    for k in range(0, B, G):
        scale = [L[k + j] / (sum(L[k:k + G]) / G) if length_aware else 1.0 for j in range(G)]
        u = transform_ref([sb[k + j] / scale[j] for j in range(G)], ADV[k:k + G], transform)
        st += [u[j] * scale[j] for j in range(G)]
    return sb, st


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("transform, length_aware", [("min-replace", False), ("min-replace", True),
                                                     ("orth-proj", False), ("scale", False), ("none", False)])
def test_dfpo_values(masked, transform, length_aware):
    """m_i = A_i s_tilde_i (value of eq. 68's objective), the stats, and shrink_mean = mean s_tilde_i / s_bar_i
    (eq. 87); with a masked row shrink_mean is left to test_issue24_shrink_mean_skips_masked_rows."""
    logp, old, adv, mask = batch(masked)
    loss, seq_terms, stats = dfpo_loss(logp, old, adv, mask, group_size=G, clip_low=LO, clip_high=HI,
                                       transform=transform, length_aware=length_aware)
    sb, st = dfpo_reference(masked, transform, length_aware)
    terms = [a * x for a, x in zip(ADV, st)]
    expected = sequence_stats(terms, sequence_clipped(masked), masked, len(terms))
    expected["losses/shrink_mean"] = (sum(x / y for x, y in zip(st, sb)), len(sb))
    assert seq_terms.tolist() == pytest.approx(terms, abs=1e-12)
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), abs=1e-12)
    if masked:
        stats = {k: v for k, v in stats.items() if k != "losses/shrink_mean"}
        del expected["losses/shrink_mean"]
    else:
        assert transform in ("none", "orth-proj") or abs(expected["losses/shrink_mean"][0] / 8 - 1) > 1e-2
    check(stats, expected)


def test_dfpo_zero_advantage_takes_the_min_branch_of_eq_47():
    """Eq. 47 puts A_i = 0 on the min(s_i, c_i) side (A_i >= 0) and eq. 50 takes the minimum over all j of the group,
    A = 0 included. Row 1 has A = 0 in a group whose rewards differ (partial credit) and s = e^-0.15 < 1 - eps_low:
    s_bar_1 = s_1 = 0.861 is the group's minimum, where the A > 0 reading would give max(s_1, c_1) = 0.95."""
    logp, old, adv, mask = batch(False)
    assert ADV[1] == 0 and ADV[3] == 0 and ADV[0] > 0 > ADV[2]
    right, wrong = dfpo_reference(False, "min-replace")[1], dfpo_reference(False, "min-replace",
                                                                          zero_takes_min=False)[1]
    assert right[0] == pytest.approx(math.exp(-0.15)) and wrong[0] == pytest.approx(1 - LO)
    loss, seq_terms, stats = dfpo_loss(logp, old, adv, mask, group_size=G, clip_low=LO, clip_high=HI)
    assert seq_terms[0].item() == pytest.approx(ADV[0] * math.exp(-0.15), abs=1e-12)  # m_0 = A_0 s_tilde_0
    assert seq_terms[0].item() != pytest.approx(ADV[0] * (1 - LO), abs=1e-3)
    (grad,) = torch.autograd.grad(loss, logp)  # eq. 68: d(-J)/d logp_0t = -A_0 s_tilde_0 / |y_0| / B
    assert grad[0].tolist() == pytest.approx([-ADV[0] * math.exp(-0.15) / 6 / 8] * 6, abs=1e-12)


def test_issue24_shrink_mean_skips_masked_rows():
    """Every sequence statistic skips a row with no token in the loss; shrink_mean = mean of s_tilde_i / s_bar_i
    (eq. 87) over the rows in the loss too (the masked row has s = 1 by construction, phi = 0.95 here)."""
    logp, old, adv, mask = batch(True)
    _, _, stats = dfpo_loss(logp, old, adv, mask, group_size=G, clip_low=LO, clip_high=HI)
    sb, st = dfpo_reference(True, "min-replace")
    rows = [i for i in range(len(sb)) if i != MASKED]
    total, count = stats["losses/shrink_mean"]
    assert float(count) == len(rows)
    assert float(total) == pytest.approx(sum(st[i] / sb[i] for i in rows), abs=1e-12)


@pytest.mark.parametrize("loss_fn", [gspo_loss, grpo_loss, gspo_token_loss, dfpo_loss])
def test_masked_row_is_in_no_ratio_stat(loss_fn):
    """Every ratio below 1 (s = w = e^-0.1) and a masked row (s = 1 by construction): ratio_max is e^-0.1, not 1,
    and ratio_mean e^-0.1 over the 3 counted tokens or the 1 counted sequence."""
    logp = torch.tensor([[-0.1, -0.1, -0.1], [0.2, 0.2, 0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    kw = dict(group_size=2) if loss_fn is dfpo_loss else {}
    if loss_fn is gspo_token_loss:
        adv = adv[:, None] * mask
    _, _, stats = loss_fn(logp, torch.zeros(2, 3), adv, mask, clip_low=0.2, clip_high=0.2, **kw)
    count = 3 if loss_fn is grpo_loss else 1
    assert float(stats["losses/ratio_max"]) == pytest.approx(math.exp(-0.1), abs=1e-15)
    assert float(stats["losses/ratio_min"]) == pytest.approx(math.exp(-0.1), abs=1e-15)
    assert float(stats["losses/ratio_mean"][0]) == pytest.approx(count * math.exp(-0.1), abs=1e-15)
    assert float(stats["losses/ratio_mean"][1]) == count


# ------------------------------------------------------------------------------------------- group metrics
def test_group_metrics_by_hand():
    """Asym: mean over groups of the population Var_i(m_i) (eq. 23). shared_coef: mean over groups of
    |sum_{i in g} dJ_g / d log pi(y_i1)|, with J = -loss = 1/groups_total sum_g J_g, so dJ_g = -groups_total d loss
    (eq. 70-72). groups_total (5) is not the 2 groups given: the minibatch spans ranks."""
    m = [0.3, -0.1, 0.0, 0.5, 1.0, -2.0, 0.25, 0.75]
    grads = [0.01, -0.03, 0.02, 0.005, -0.1, 0.02, 0.03, 0.01]
    out = group_metrics(torch.tensor(m), torch.tensor(grads), G, 5)
    var = []
    for k in (0, 4):
        mean = sum(m[k:k + G]) / G
        var.append(sum((x - mean) ** 2 for x in m[k:k + G]) / G)
    assert set(out) == {"losses/asym", "losses/shared_coef"}
    assert out["losses/asym"].item() == pytest.approx(sum(var) / 2, abs=1e-14)
    coef = [abs(-5 * sum(grads[k:k + G])) for k in (0, 4)]  # 0.025 and 0.2
    assert out["losses/shared_coef"].item() == pytest.approx(sum(coef) / 2, abs=1e-14)


# ------------------------------------------------------------------------------------ advantages, reduce, Jitter2
def test_group_advantages_partial_credit():
    """Eq. 43 with population std and eps = 1e-6 added to the std; a group of equal rewards gets A = 0 and is
    counted; 'none' centres only; 'batch' divides by the std of all rewards."""
    r = REWARDS + [0.5] * G
    adv, zero = group_advantages(torch.tensor(r), G)
    assert zero == 1 and adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(ref_advantages(r), abs=5e-7)
    assert adv[1].item() == 0 and adv[3].item() == 0 and adv[-G:].abs().sum() == 0
    adv, zero = group_advantages(torch.tensor(r), G, "none")
    means = [sum(r[k:k + G]) / G for k in range(0, len(r), G)]
    assert zero == 1 and adv.tolist() == pytest.approx([x - means[i // G] for i, x in enumerate(r)], abs=1e-7)
    mu = sum(r) / len(r)
    sd = math.sqrt(sum((x - mu) ** 2 for x in r) / len(r))
    adv, _ = group_advantages(torch.tensor(r), G, "batch")
    assert adv.tolist() == pytest.approx([(x - means[i // G]) / (sd + 1e-6) for i, x in enumerate(r)], abs=5e-7)


def test_reduce_stats_by_hand():
    """A (sum, count) mean is the sum of sums over the sum of counts (0.25 here, not the mean of means 0.5); _min and
    _max keys take min and max (inf / -inf of a micro-batch with no token skipped); other scalars the mean."""
    stats = [{"losses/clipfrac": (torch.tensor(1.0), torch.tensor(1)), "losses/ratio_min": torch.tensor(0.9),
              "losses/ratio_max": torch.tensor(1.1), "losses/grad_norm": torch.tensor(2.0)},
             {"losses/clipfrac": (torch.tensor(0.0), torch.tensor(3)), "losses/ratio_min": torch.tensor(math.inf),
              "losses/ratio_max": torch.tensor(-math.inf), "losses/grad_norm": torch.tensor(4.0)},
             {"losses/clipfrac": (torch.tensor(0.0), torch.tensor(0)), "losses/ratio_min": torch.tensor(0.95),
              "losses/ratio_max": torch.tensor(1.3), "losses/grad_norm": torch.tensor(6.0)}]
    out = reduce_stats(stats)
    assert out == {"losses/clipfrac": 0.25, "losses/ratio_min": 0.9, "losses/ratio_max": 1.3,
                   "losses/grad_norm": 4.0}


def test_jitter2_irregular_curve():
    """Eq. 20: 1/(T-2) sum_t |m_t+2 - 2 m_t+1 + m_t|, on a curve whose second differences change sign."""
    m = [0.1, 0.4, 0.2, 0.5, 0.45]
    assert jitter2(m) == pytest.approx((abs(0.2 - 0.8 + 0.1) + abs(0.5 - 0.4 + 0.4) + abs(0.45 - 1.0 + 0.2)) / 3,
                                       abs=1e-15)  # 0.45
    assert jitter2([0.0, 1.0, 0.5]) == pytest.approx(1.5, abs=1e-15)
    assert math.isnan(jitter2([0.3, 0.1]))


# ------------------------------------------------------------------------------------------- defaults
@pytest.mark.parametrize("script, defaults", [
    ("gspo", dict(clip_low=3e-4, clip_high=4e-4)),  # GSPO paper (arXiv:2507.18071)
    ("gspo_token", dict(clip_low=3e-4, clip_high=4e-4, post_answer_penalty=0.0)),  # GSPO's range; A_it = A_i
    ("dfpo", dict(clip_low=3e-4, clip_high=4e-4, transform="min-replace", length_aware=False, clip_gated=False,
                  stop_grad=True, orth_floor=1e-6)),  # DFPO gives no range: GSPO's; eq. 50, 68, App. D
    ("grpo", dict(clip_low=0.2, clip_high=0.27, symmetric_clip=False, kl_coef=0.0,
                  loss_agg="seq-mean-token-mean")),  # the GSPO paper's GRPO baseline; GRPO's 1/|y_i|
])
def test_objective_defaults(script, defaults):
    fields = {f.name: f.default for f in dataclasses.fields(importlib.import_module(script).Args)}
    assert {k: fields[k] for k in defaults} == defaults
    assert fields["scale_rewards"] == "group" and fields["mask_truncated"] is False  # eq. 43


# ------------------------------------------------------------------------------------------- post-answer tokens
class CharTok:
    """One token a character (id = its code point); id 0 is EOS, a special token decode skips."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def penalised(texts_eos):
    """post_answer_tokens on (text, ends with EOS) rows: the text of the tokens it marks, per row."""
    rows = [[ord(c) for c in text] + ([0] if eos else []) for text, eos in texts_eos]
    width = max(map(len, rows)) + 2  # padding after the mask
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    after = post_answer_tokens(CharTok(), ids, mask, [text for text, _ in texts_eos], [0])
    assert not (after & (mask == 0)).any() and not (after & (ids == 0)).any()  # never padding, never EOS
    return ["".join(chr(i) for i in row[a].tolist()) for row, a in zip(ids, after)]


@pytest.mark.parametrize("text, eos, expected", [
    ("7ab", True, "ab"),  # the last number
    ("x \\boxed{12}. ok", True, ". ok"),  # the closing brace of \boxed{} is part of the answer
    ("so \\boxed{a{b}c} then", True, " then"),  # nested braces
    ("\\boxed{7}}z", True, "}z"),  # a second brace is written after the answer
    ("\\boxed{3}", True, ""),
    ("#### 42 done", True, " done"),
    ("no answer here", True, "no answer here"),  # no answer: every token, else not answering is the cheapest
    ("so \\boxed{} ok", True, "so \\boxed{} ok"),  # an empty box states no answer
    ("\\boxed{ }", False, "\\boxed{ }"),
    ("", True, ""),  # the EOS alone: nothing to mark
    ("5xy", False, "xy"),  # truncated: no EOS
    ("the answer is 9 \n ", True, ""),  # only whitespace after it
    ("12 and then 3 more", True, " more"),  # the last number is the answer
])
def test_post_answer_tokens(text, eos, expected):
    assert penalised([(text, eos)]) == [expected]


@pytest.mark.parametrize("text, expected", [("x 7}ab", "}ab"), ("#### 42} done", "} done")])
def test_issue24_brace_after_a_plain_answer_is_penalised(text, expected):
    assert penalised([(text, True)]) == [expected]


# ------------------------------------------------------------------------------------------- GRPO-fix, eq. 80-82
def shared_token_group():
    """One group with a token shared by all four sequences (the first: the same log-prob, new and old, ratio
    e^0.1 inside the range, so it has a gradient), ragged lengths 6, 3, 5, 2, partial-credit advantages (sum 0), and
    other tokens on both sides of the clip range."""
    logp, old, adv, mask = batch(False)
    logp, old, adv, mask = logp.detach()[:G].clone(), old[:G].clone(), adv[:G], mask[:G]
    old[:, 0] = -1.0
    logp[:, 0] = -0.9
    return logp.requires_grad_(), old, adv, mask


def shared_coef(logp, old, adv, mask, **kw):
    """What the script logs: group_metrics on autograd's d loss / d logp at the shared first token."""
    loss, seq_terms, _ = grpo_loss(logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return group_metrics(seq_terms, grad[:, 0], G, 1)["losses/shared_coef"].item()


@pytest.mark.parametrize("mode", MODES)
def test_grpo_fix_shared_token_at_ragged_lengths(mode):
    """Eq. 82: with one clipping operator for every sign, the shared token's group coefficient is
    phi(r*) sum_i A_i = 0 when every token weighs the same (eq. 80 sums over tokens, 1/G outside). With GRPO's
    1/|y_i| it is phi(r*)/G sum_i A_i / |y_i| instead, not 0 at ragged lengths."""
    logp, old, adv, mask = shared_token_group()
    got = shared_coef(logp, old, adv, mask, clip_low=TOKEN_LO, clip_high=TOKEN_HI, symmetric_clip=True,
                      loss_agg=mode, max_new_tokens=L_MAX)
    if mode == "seq-mean-token-mean":
        expected = abs(math.exp(0.1) / G * sum(ADV[i] / len(LOG_W[i]) for i in range(G)))
        assert got == pytest.approx(expected, rel=1e-12) and expected > 1e-2
    else:
        assert got < 1e-15


def docs_grpo_fix_args():
    """docs/algorithms.md's Table 1 recipe for GRPO-fix, $COMMON expanded, parsed as grpo.py would."""
    import tyro

    import grpo

    text = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    common_argv = re.search(r'COMMON="(.*?)"', text, re.S).group(1).replace("\\\n", " ").split()
    row = next(line for line in text.splitlines() if line.startswith("| Table 1: GRPO-fix |"))
    command = re.search(r"`grpo\.py \$COMMON([^`]*)`", row).group(1).split()
    return tyro.cli(grpo.Args, args=common_argv + command)


def test_issue24_docs_grpo_fix_recipe_cancels_shared_tokens():
    args = docs_grpo_fix_args()
    assert args.symmetric_clip
    logp, old, adv, mask = shared_token_group()
    got = shared_coef(logp, old, adv, mask, clip_low=args.clip_low, clip_high=args.clip_high, symmetric_clip=True,
                      loss_agg=args.loss_agg, max_new_tokens=args.max_new_tokens)
    assert got < 1e-15


def test_batch_scale_takes_every_ranks_rewards():
    """tests/programs/advantages_ranks.py under torchrun (gloo, 2 ranks): --scale-rewards batch divides by the std of all
    ranks' rewards (1.25 there; rank 0's own would be 0.5), each rank's advantages by hand."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "tests/programs/advantages_ranks.py"], cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "rank 0 ok" in p.stdout and "rank 1 ok" in p.stdout, p.stderr[-3000:]


def test_reward_parts_scale_the_cut_completions():
    """--multi-objective-aggregation normalize-then-sum: each reward's values as GDPO normalises them, those of a
    completion cut at --max-new-tokens times --truncated-reward-scale (0.25 here), as its summed reward is; NaN (the
    reward does not apply) stays NaN; the weights as given. Other aggregations: None."""
    import types

    import common

    part = types.SimpleNamespace
    reward = types.SimpleNamespace(parts=[(part(name="a"), 1.0), (part(name="b"), 0.5)],
                                   values={"a": torch.tensor([1.0, 0.0, 1.0, 1.0]),
                                           "b": torch.tensor([2.0, math.nan, 4.0, -1.0])})
    roll = types.SimpleNamespace(truncated=torch.tensor([False, True, True, False]))
    args = types.SimpleNamespace(multi_objective_aggregation="normalize-then-sum", truncated_reward_scale=0.25)
    values, weights = common.reward_parts(reward, roll, args)
    want = torch.tensor([[1.0, 2.0], [0.0, math.nan], [0.25, 1.0], [1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(values, want, equal_nan=True)
    assert values.dtype == torch.float64 and weights.tolist() == [1.0, 0.5]
    args.multi_objective_aggregation = "sum-then-normalize"
    assert common.reward_parts(reward, roll, args) is None


# issue 61 item 1(d): under normalize-then-sum (GDPO) a group is flat when every advantage is 0, not when its summed
# rewards are equal. Weights (1, 2): group 1's parts (2, 0) and (0, 1) sum to 2 on every row, yet each part's z-score
# is +-1 and the weighted sum of those is -+1; group 2's parts are each constant where they apply (NaN: b does not
# apply to row 3), so every z-score is 0, though the summed rewards (3, 3, 1, 3) differ; group 3's a differs.
GDPO_VALUES = torch.tensor([[2.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 1.0],
                            [1.0, 1.0], [1.0, 1.0], [1.0, math.nan], [1.0, 1.0],
                            [0.0, 1.0], [2.0, 1.0], [0.0, 1.0], [0.0, 1.0],
                            [0.0, 1.0], [2.0, 0.0], [2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
GDPO_WEIGHTS = torch.tensor([1.0, 2.0], dtype=torch.float64)


def test_gdpo_flat_groups_are_those_whose_advantages_are_all_zero():
    """Groups 1 and 4 (equal sums, parts apart) have A = -+1 and are not flat; group 2 (each part constant) has
    A = 0 and is: one zero-advantage group, not the two whose summed rewards are equal."""
    import common

    summed = (GDPO_VALUES * GDPO_WEIGHTS).nansum(1).float()
    parts = (GDPO_VALUES, GDPO_WEIGHTS)
    adv, zero = common.group_advantages(summed, 4, parts=parts)
    groups = adv.view(-1, 4).abs().amax(1)
    assert groups[1] < 1e-6 and (groups[[0, 2, 3]] > 0.5).all(), groups
    assert zero == 1
    assert common.flat_groups(summed, 4, parts).tolist() == [False, True, False, False]
    assert common.flat_groups(summed, 4).tolist() == [True, False, False, True]  # the summed rewards' rule


def test_dynamic_sampling_keeps_gdpo_groups_with_advantages(monkeypatch):
    """--dynamic-sampling with normalize-then-sum judges a group flat by its parts: of round 1's groups (1 and 2
    above) group 1 is kept (A = -+1) and group 2 dropped; round 2 (groups 3 and 4) fills the batch."""
    from types import SimpleNamespace

    from datasets import Dataset

    import common
    from grouprl.distributed import Dist
    from grouprl.generation import Rollout
    from grouprl.sampling import Sampling

    calls = []

    def generate(policy, tok, prompts, n, eos, d, *args, **kw):
        B, P, T = len(prompts) * n, 2, 3
        calls.append(len(calls))
        return Rollout(torch.ones(B, P + T, dtype=torch.long), torch.ones(B, P + T, dtype=torch.long), P,
                       torch.ones(B, T), torch.zeros(B, dtype=bool), [f"{len(calls) - 1}"] * B)

    def score(texts, rows, n, reward_, truncated=None, truncated_scale=1.0, given=None, messages=None):
        r = int(texts[0])
        values = GDPO_VALUES[8 * r: 8 * r + 8]
        reward_.values = {"a": values[:, 0], "b": values[:, 1]}
        return (values * GDPO_WEIGHTS).nansum(1).float(), 0

    monkeypatch.setattr(common, "generate", generate)
    monkeypatch.setattr(common, "score", score)
    part = SimpleNamespace
    reward = SimpleNamespace(values={}, parts=[(part(name="a"), 1.0), (part(name="b"), 2.0)])
    train = Dataset.from_list([{"prompt": f"p{i}", "answer": "1", "text": f"p{i}"} for i in range(40)])
    args = SimpleNamespace(prompts_per_rank=2, group_size=4, seed=0, dynamic_sampling=True, max_gen_rounds=3,
                           truncated_reward_scale=1.0, multi_objective_aggregation="normalize-then-sum", tools=None,
                           environment=None)
    roll = common.sample_groups(None, SimpleNamespace(pad_token_id=0), train, 1, [1], Dist(0, 1, torch.device("cpu")),
                                reward, Sampling(max_new_tokens=3), args)
    assert len(calls) == 2 and roll.stats["charts/dropped_groups"] == 1
    torch.testing.assert_close(torch.stack([reward.values["a"], reward.values["b"]], 1),
                               GDPO_VALUES[list(range(4)) + list(range(8, 12))], equal_nan=True)
