"""The same advantages and loss as TRL's GRPOTrainer where docs/trl-and-verl.md says so (issue 37 item 1), against
TRL 1.16.0 itself (tests/requirements-test.txt; issue 60 item 7), not a transcription of it:
    the loss    GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py:3020-3292) run as it is, bound to an object
                carrying the GRPOConfig fields it reads, the model's forward replaced by the test's log-probs (and
                entropies); its get_off_policy_mask, get_gamma_weights and get_high_entropy_mask are TRL's too
    advantages  TRL's nanstd (trl/trainer/utils.py:1021); the lines around it are inline in
                _generate_and_score_completions (grpo_trainer.py:2765-2787), so they are transcribed here
In float64 (TRL's code run with float64 as the default dtype: see default_dtype), value and gradient to 1e-10;
in float32, ours to TRL's float64 to 1e-6. Where TRL has no such loss, the reference is verl's or the paper's,
transcribed, and says so (GSPO-token here; GMPO outside its band in tests/test_gmpo.py). In CI (.ci/run sets CI) a
missing or other trl fails these tests; a plain local run without it skips them in one line."""
import contextlib
import functools
import math
import os
import types
from collections import defaultdict

import pytest
import torch

from common import group_advantages
from conftest import SCRIPTS
from dfpo import dfpo_loss
from gmpo import gmpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from helpers import (B, G, LENGTHS, T, TRL_VERSION, assert_equal_trl, default_dtype, trl, trl_advantages,
                     trl_batch as batch, trl_loss, value_grad)

def test_bessel_advantages_by_hand():
    """Rewards [1, 0, 0, 0]: mean 1/4, squared deviations 9/16 + 3/16 = 3/4; Bessel std sqrt(3/4 / 3) = 1/2, TRL's
    A_1 = (3/4) / (1/2 + 1e-4) = 1.49970006; population std sqrt(3/16) = 0.4330127, A_1 = 1.7320468 (eps 1e-6)."""
    r = torch.tensor([1.0, 0, 0, 0])
    bessel, _ = group_advantages(r, 4, "group", "bessel", 1e-4)
    assert bessel[0].item() == pytest.approx(0.75 / 0.5001, rel=1e-6)
    assert bessel[1].item() == pytest.approx(-0.25 / 0.5001, rel=1e-6)
    population, _ = group_advantages(r, 4, "group", "population", 1e-6)
    assert population[0].item() == pytest.approx(0.75 / (math.sqrt(3 / 16) + 1e-6), rel=1e-6)
    with pytest.raises(ValueError, match="unknown std"):
        group_advantages(r, 4, "group", "sample")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    """--adv-std bessel --adv-eps 1e-4 = TRL's advantages with its own nanstd; [1, 0, 0, 0] by hand is 1.4997."""
    rewards = batch()[-1]
    ours, zero = group_advantages(rewards, G, scale, "bessel", 1e-4)
    theirs = trl_advantages(rewards, scale)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-7)
    assert zero == 0
    if scale == "group":
        assert theirs[0].item() == pytest.approx(0.75 / 0.5001, rel=1e-12)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("loss_type, loss_agg", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean"),
                                                 ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("bias_kl", [False, True])
def test_grpo_loss_equals_trl_token_level(loss_type, loss_agg, bias_kl, lengths):
    """grpo.py's loss and its gradient = TRL's with importance_sampling_level='token', the loss_type the table maps to
    --loss-agg, beta = --kl-coef, use_bias_correction_kl = --kl-ratio-correction, on TRL's advantages; with and
    without rows of no loss token. TRL's clip_ratio/region_mean is our losses/clipfrac."""
    logp, old, ref, mask, rewards = batch(lengths=lengths)
    adv = trl_advantages(rewards, "group")
    stats, metrics = {}, {}

    def ours(x):
        loss, _, got = grpo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_coef=0.04,
                                 kl_ratio=bias_kl, loss_agg=loss_agg, max_new_tokens=T)
        stats.update(got)
        return loss

    assert_equal_trl(ours, lambda y: trl_loss(y, old, adv, mask, loss_type=loss_type, beta=0.04, ref=ref,
                                              bias_kl=bias_kl, metrics=metrics), logp, mask)
    clipped, tokens = stats["losses/clipfrac"]
    assert (clipped / tokens).item() == pytest.approx(metrics["clip_ratio/region_mean"], rel=1e-12)
    assert 0 < metrics["clip_ratio/region_mean"] < 1  # the clip acts on this batch
    kl, _ = stats["losses/kl_ref"]  # TRL logs its KL times coef_1 under use_bias_correction_kl, ours plain
    assert (kl / tokens).item() == pytest.approx(metrics["kl"], rel=1e-10) or bias_kl


# dfpo.py keeps an empty row's term A_i s_tilde_i (s_i = exp(0) = 1): the row takes part in the group's transform
# (eq. 63's sum over the group), and zeroing its term alone would break the cancellation; TRL (no DFPO) adds 0
DFPO_EMPTY = pytest.mark.xfail(strict=True, reason="dfpo.py keeps an empty row's term in its group (eq. 63)")


@pytest.mark.parametrize("loss_fn, lengths", [("gspo", "full"), ("gspo", "empty"), ("dfpo none", "full"),
                                              pytest.param("dfpo none", "empty", marks=DFPO_EMPTY)])
@pytest.mark.parametrize("bias_kl", [False, True])
def test_gspo_loss_equals_trl_sequence_level(loss_fn, bias_kl, lengths):
    """gspo.py (and dfpo.py --transform none --clip-gated, which is GSPO) = TRL's importance_sampling_level='sequence'
    with loss_type='grpo' (a sequence's per-token term is constant, so its token mean is the sequence's term); a row
    with no loss token adds nothing (issue 60: gspo.py added -A_i / B; dfpo.py still does, strict xfail)."""
    logp, old, ref, mask, rewards = batch(1, lengths)
    old = logp + 0.002 * (old - logp)  # s_i near the GSPO band, some inside, some clipped
    adv = trl_advantages(rewards, "group")
    kw = dict(clip_low=3e-4, clip_high=4e-4, ref_logp=ref, kl_coef=0.04, kl_ratio=bias_kl)

    def ours(x):
        if loss_fn == "gspo":
            return gspo_loss(x, old, adv, mask, **kw)[0]
        return dfpo_loss(x, old, adv, mask, group_size=G, transform="none", clip_gated=True, **kw)[0]

    assert_equal_trl(ours, lambda y: trl_loss(y, old, adv, mask, level="sequence", eps_lo=3e-4, eps_hi=4e-4,
                                              beta=0.04, ref=ref, bias_kl=bias_kl), logp, mask)


@pytest.mark.parametrize("loss_type, loss_agg", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean")])
def test_grpo_delta_equals_trls_two_sided_clip(loss_type, loss_agg):
    """grpo.py --delta = TRL's delta: coef_1 capped at delta before the min; ratios up to ~e^1 here, so the cap acts on
    tokens of A < 0 (for A > 0 the clip's 1 + eps_high < delta already decides)."""
    logp, old, ref, mask, rewards = batch(2)
    adv = trl_advantages(rewards, "group")
    ours = assert_equal_trl(
        lambda x: grpo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, delta=1.38, loss_agg=loss_agg)[0],
        lambda y: trl_loss(y, old, adv, mask, loss_type=loss_type, delta=1.38), logp, mask)
    w = torch.exp(logp - old)
    assert ((w > 1.38) & (adv[:, None] < 0) & mask.bool()).any()  # the cap acts on this batch
    plain, _, _ = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg=loss_agg)
    assert plain.item() != pytest.approx(ours)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("beta, bias_kl", [(0.0, False), (0.04, False), (0.04, True)])
def test_luspo_equals_trls(beta, bias_kl, lengths):
    """gspo.py --luspo = TRL 1.16's loss_type='luspo' at importance_sampling_level='sequence', its KL included:
    TRL masks the broadcast [B, T] per-token loss and sums it per sequence (grpo_trainer.py:3175-3183), so a
    sequence adds |y_i| min(s_i A_i, clip(s_i) A_i) - beta sum_t k3_it: the whole GSPO term, KL too, times |y_i|."""
    logp, old, ref, mask, rewards = batch(1, lengths)
    old = logp + 0.002 * (old - logp)  # s_i near the GSPO band, some inside, some clipped
    adv = trl_advantages(rewards, "group")

    def ours(x):
        return gspo_loss(x, old, adv, mask, clip_low=3e-4, clip_high=4e-4, ref_logp=ref, kl_coef=beta,
                         kl_ratio=bias_kl, luspo=True)[0]

    assert_equal_trl(ours, lambda y: trl_loss(y, old, adv, mask, level="sequence", loss_type="luspo", eps_lo=3e-4,
                                              eps_hi=4e-4, beta=beta, ref=ref, bias_kl=bias_kl), logp, mask)


def test_luspo_and_delta_by_hand():
    """LUSPO, one sequence of 3 tokens on policy (s = 1), A = 1: GSPO gives each token -A/|y| = -1/3 in d loss / d
    logp, LUSPO -A = -1, and the loss -1 x 3 = -3; with beta 0.5 and k3 = e^-1 - (-1) - 1 = 1/e on every token
    (log pi_ref - log pi = -1), the KL adds 0.5 x 3/e (summed, as TRL's), not GSPO's 0.5 x 1/e. Delta 1.5, one token
    of A = -1 at w = e: min(min(e, 1.5) (-1), clip(e) (-1)) = -1.5, a constant: loss 1.5, no gradient (without
    delta: loss e, gradient e)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    one = torch.tensor([1.0], dtype=torch.float64)
    ones = torch.ones(1, 3, dtype=torch.float64)
    loss, terms, _ = gspo_loss(logp, logp.detach(), one, ones, clip_low=3e-4, clip_high=4e-4, luspo=True)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0) and logp.grad[0].tolist() == pytest.approx([-1.0] * 3)
    assert terms.item() == pytest.approx(3.0)
    kw = dict(clip_low=3e-4, clip_high=4e-4, ref_logp=logp.detach() - 1, kl_coef=0.5)
    luspo, _, _ = gspo_loss(logp.detach(), logp.detach(), one, ones, luspo=True, **kw)
    assert luspo.item() == pytest.approx(-3.0 + 0.5 * 3 / math.e, rel=1e-12)
    gspo, _, _ = gspo_loss(logp.detach(), logp.detach(), one, ones, **kw)
    assert gspo.item() == pytest.approx(-1.0 + 0.5 / math.e, rel=1e-12)
    w = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)  # log pi - log pi_old = 1: w = e
    minus = torch.tensor([-1.0], dtype=torch.float64)
    loss, _, stats = grpo_loss(w, torch.zeros(1, 1, dtype=torch.float64), minus, torch.ones(1, 1, dtype=torch.float64),
                               clip_low=0.2, clip_high=0.28, delta=1.5)
    loss.backward()
    assert loss.item() == pytest.approx(1.5) and w.grad.item() == 0 and stats["losses/clipfrac"][0].item() == 1
    w.grad = None
    loss, _, stats = grpo_loss(w, torch.zeros(1, 1, dtype=torch.float64), minus, torch.ones(1, 1, dtype=torch.float64),
                               clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(math.e) and w.grad.item() == pytest.approx(math.e)
    assert stats["losses/clipfrac"][0].item() == 0


def test_vespo_seq_terms_of_a_row_with_no_loss_token_are_0():
    """VESPO's loss never counted an empty row (its log pi terms are masked); its seq_terms (Asym's m_i) held
    phi(1) A_i = A_i for it; 0 now, as every other script's."""
    from vespo import vespo_loss

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    _, terms, _ = vespo_loss(logp, logp, torch.tensor([1.0, -2.0], dtype=torch.float64), mask, k_pos=2.0,
                             lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    assert terms.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("script", ["gspo", "gmpo"])
def test_a_row_with_no_loss_token_adds_nothing(script):
    """--mask-truncated can leave a row with no loss token. Two rows, A = [1, -2], the second empty, pi = pi_old
    (s_1 = 1): GSPO's loss is -(1 x 1 + 0) / 2 = -1/2 and its seq_terms [1, 0], as grpo.py's and TRL's (the row's
    s_i = exp(0) = 1 added -A_2 / 2 = +1 before, and seq_terms[1] = -2); the same for GMPO, whose s_i is a geometric
    mean over no tokens. Against TRL 1.16 (sequence level, GMPO inside its band: no clip on either side)."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss_fn = {"gspo": gspo_loss, "gmpo": gmpo_loss}[script]
    kw = dict(clip_low=0.4, clip_high=0.4)
    loss, terms, stats = loss_fn(logp, logp, adv, mask, **kw)
    assert loss.item() == -0.5 and terms.tolist() == [1.0, 0.0]
    assert stats["losses/policy_loss"][0].item() == -1.0  # summed over rows, divided by 2 rows in the logs
    alone, _, _ = grpo_loss(logp, logp, adv, mask, **kw)
    assert alone.item() == -0.5
    old = logp + 0.1 * torch.tensor([[1.0, -1.0], [2.0, 0.5]], dtype=torch.float64)
    assert_equal_trl(lambda x: loss_fn(x, old, adv, mask, **kw)[0],
                     lambda y: trl_loss(y, old, adv, mask, level="sequence", eps_lo=0.9, eps_hi=9.0), logp, mask)


@pytest.mark.parametrize("delta", [0.0, 0.1, 0.5])
def test_opsm_equals_trls_in_grpo(delta):
    """--off-policy-mask: the rows TRL's mask drops get A = 0 here, so grpo.py's loss and gradient equal TRL's
    (off_policy_mask_threshold = delta, the KL term kept in both); the logged count is TRL's drops."""
    from common import off_policy_mask

    logp, old, ref, mask, rewards = batch(3)
    sampling = logp + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    adv = trl_advantages(rewards, "group")
    dropped = []

    def ours(x):
        masked, counts = off_policy_mask(adv, x, sampling, mask, delta)
        dropped.append(counts)
        return grpo_loss(x, old, masked, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_coef=0.04)[0]

    assert_equal_trl(ours, lambda y: trl_loss(y, old, adv, mask, beta=0.04, ref=ref, opsm=delta, sampling=sampling),
                     logp, mask)
    opsm = trl()[0].get_off_policy_mask(adv[:, None], logp, sampling, mask, delta)
    assert dropped[0][0].item() == (1 - opsm).sum().item() and dropped[0][1].item() == B
    assert 0 < dropped[0][0].item() < B or delta == 0.5  # the mask acts on this batch (0.5: it may drop none)


def test_opsm_by_hand():
    """Three rows, log pi_sample - log pi_theta = 0.6, 0.4, 1.0 on every token; A = -1, -1, +1; delta 0.5: only the
    first is dropped (negative and past delta); the third is past delta but positive. A [B, T] advantage row is
    judged by its sum."""
    from common import off_policy_mask

    logp = torch.zeros(3, 2, dtype=torch.float64)
    sampling = torch.tensor([[0.6, 0.6], [0.4, 0.4], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.float64)
    adv, dropped = off_policy_mask(torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64), logp, sampling, mask, 0.5)
    assert adv.tolist() == [0.0, -1.0, 1.0] and dropped[0].item() == 1 and dropped[1].item() == 3
    token_adv = torch.tensor([[-1.0, 0.5], [-1.0, -1.0], [2.0, -1.0]], dtype=torch.float64)
    adv, _ = off_policy_mask(token_adv, logp, sampling, mask, 0.5)
    assert adv.tolist() == [[0.0, 0.0], [-1.0, -1.0], [2.0, -1.0]]
    same, none = off_policy_mask(token_adv, logp, sampling, mask, None)
    assert same is token_adv and none is None


def new_losses():
    from cispo import cispo_loss
    from sapo import sapo_loss
    from vespo import vespo_loss

    return {  # ours(x, old, adv, mask, **kw), TRL's loss_type and its arguments
        "cispo": (lambda *a, **kw: cispo_loss(*a, clip_low=1.0, clip_high=0.5, **kw), dict(loss_type="cispo",
                                                                                        eps_hi=1.5)),
        "sapo": (lambda *a, **kw: sapo_loss(*a, tau_pos=1.0, tau_neg=1.05, **kw), dict(loss_type="sapo")),
        "vespo": (lambda *a, **kw: vespo_loss(*a, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, **kw),
                  dict(loss_type="vespo")),
    }


@pytest.mark.parametrize("rollout", [False, True])
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("beta, bias_kl", [(0.0, False), (0.04, False), (0.04, True)])
@pytest.mark.parametrize("name", ["cispo", "sapo", "vespo"])
def test_cispo_sapo_vespo_equal_trls(name, beta, bias_kl, lengths, rollout):
    """cispo.py (cap 1 + --clip-high = TRL's epsilon_high 1.5, no floor), sapo.py (TRL's temperatures 1.0, 1.05) and
    vespo.py (TRL's k and lambda 2, 3, 3, 2) = TRL's loss_type of that name, its KL and bias correction, rows with
    no loss token, and the rollout correction (--rollout-is-cap's token weights = TRL's importance_sampling_ratio:
    a factor of cispo's and sapo's per-token loss, folded into vespo's W_i); in float32 ours within 1e-6 of TRL."""
    ours_fn, trl_kw = new_losses()[name]
    logp, old, ref, mask, rewards = batch(4, lengths)
    adv = trl_advantages(rewards, "group")
    sampling = old + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    # TIS: TRL's token_truncate at C = 2 (grpo_trainer.py:2662-2684; 1 on padding, which vespo's W_i sums over)
    ratio = torch.exp((old - sampling) * mask).clamp(max=2.0) if rollout else None

    def ours(x, old=old, adv=adv, mask=mask, ref=ref, ratio=ratio):
        return ours_fn(x, old, adv, mask, ref_logp=ref, kl_coef=beta, kl_ratio=bias_kl, is_weight=ratio)[0]

    theirs = assert_equal_trl(ours, lambda y: trl_loss(y, old, adv, mask, beta=beta, ref=ref, bias_kl=bias_kl,
                                                       is_ratio=ratio, **trl_kw), logp, mask)
    f32 = [None if t is None else t.float() for t in (logp, old, adv, mask, ref, ratio)]
    assert ours(f32[0], *f32[1:]).item() == pytest.approx(theirs, rel=1e-6, abs=1e-7)


def kl_losses():
    from cispo import cispo_loss
    from gspo_token import gspo_token_loss
    from sapo import sapo_loss
    from vespo import vespo_loss

    return {  # (loss, its other arguments, TRL's importance level, TRL's loss_type)
        "grpo": (grpo_loss, dict(clip_low=0.2, clip_high=0.28), "token", "grpo"),
        "gspo": (gspo_loss, dict(clip_low=3e-4, clip_high=4e-4), "sequence", "grpo"),
        "gspo_token": (gspo_token_loss, dict(clip_low=3e-4, clip_high=4e-4), "sequence_token", "grpo"),
        "dfpo": (dfpo_loss, dict(group_size=G, clip_low=3e-4, clip_high=4e-4), "sequence", "grpo"),
        "cispo": (cispo_loss, dict(clip_low=1.0, clip_high=4.0), "token", "cispo"),
        "sapo": (sapo_loss, dict(tau_pos=1.0, tau_neg=1.05), "token", "sapo"),
        # inside GMPO's log-space band (0.4, ratios within e^+-0.3 here) its s_i is TRL's sequence ratio
        "gmpo": (gmpo_loss, dict(clip_low=0.4, clip_high=0.4), "sequence", "grpo"),
        "vespo": (vespo_loss, dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0), "token", "vespo"),
    }


@pytest.mark.parametrize("name", SCRIPTS)
def test_bias_corrected_kl_equals_trls_in_every_loss(name):
    """--kl-ratio-correction (TRL's use_bias_correction_kl) in every loss that takes it: what the KL adds to the loss,
    loss(beta, kl_ratio) - loss(beta = 0), and its gradient equal TRL's, TRL's loss at beta 0.04 minus at 0, in
    float64: beta agg(coef_1 k3), k3 = exp(ref - logp) - (ref - logp) - 1, coef_1 TRL's importance weight, w_it
    (token) or s_i = exp(1/|y_i| sum_t log w_it) (sequence; GMPO's s_i inside its band). GSPO-token's s_it =
    sg[s_i] pi / sg[pi] (value s_i, gradient s_i grad log pi) is in no TRL 1.16 (no importance level
    'sequence_token'): its reference is the GSPO paper's, transcribed here. Without the correction the KL adds
    beta agg(k3), which differs on this batch."""
    loss_fn, kw, level, loss_type = kl_losses()[name]
    logp, old, ref, mask, rewards = batch(3)
    old = logp + (0.3 if level == "token" else 0.2) * (old - logp)  # ratios off 1, GMPO's inside its band
    adv = group_advantages(rewards, G, "group", "population", 1e-6)[0].double()
    a = adv[:, None] * mask if name == "gspo_token" else adv
    trl_kw = dict(loss_type=loss_type, level=level, eps_hi=5.0 if loss_type == "cispo" else 0.28)

    def added(x, kl_ratio):
        return loss_fn(x, old, a, mask, **kw, ref_logp=ref, kl_coef=0.04, kl_ratio=kl_ratio)[0] - \
            loss_fn(x, old, a, mask, **kw)[0]

    def gspo_token_paper(x, bias_kl):  # the GSPO paper's GSPO-token ratio, TRL's KL aggregation 'grpo'
        log_w = x - x.detach() + (((x - old) * mask).sum(-1) / mask.sum(-1)).detach().unsqueeze(-1)
        kl = torch.exp(ref - x) - (ref - x) - 1
        kl = kl * torch.exp(log_w) if bias_kl else kl
        return 0.04 * ((kl * mask).sum(-1) / mask.sum(-1)).mean()

    def reference(x, bias_kl):
        if level == "sequence_token":
            return gspo_token_paper(x, bias_kl)
        return trl_loss(x, old, adv, mask, beta=0.04, ref=ref, bias_kl=bias_kl, **trl_kw) - \
            trl_loss(x, old, adv, mask, **trl_kw)

    for bias_kl in (True, False):
        assert_equal_trl(lambda x: added(x, bias_kl), lambda y: reference(y, bias_kl), logp, mask, rel=1e-9)
    corrected, plain = reference(logp, True).item(), reference(logp, False).item()
    assert abs(corrected - plain) > 1e-3 * abs(plain), (corrected, plain)  # the correction acts on this batch


def test_linear_lr_schedule_is_transformers_linear_after_warmup():
    """--lr-schedule linear --min-lr-ratio 0 (TRL's default lr_scheduler_type): after the warm-up, transformers'
    get_linear_schedule_with_warmup, (total - i) / (total - warmup); by hand, 10 optimizer steps (5 steps x 2
    minibatches), 2 of warm-up: 0.5, 1, 1, 7/8, ..., 1/8, 0. With --min-lr-ratio 0.2: 0.2 + 0.8 x that."""
    from types import SimpleNamespace

    from transformers import get_linear_schedule_with_warmup

    from common import lr_scheduler

    def factors(ratio, make=None):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        args = SimpleNamespace(num_steps=5, num_iterations=1, num_minibatches=2, warmup_frac=0.2,
                               lr_schedule="linear", min_lr_ratio=ratio)
        sched = make(opt) if make else lr_scheduler(opt, args)
        out = []
        for _ in range(11):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert factors(0.0) == pytest.approx([0.5, 1, 1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8, 0], abs=1e-12)
    hf = factors(0.0, lambda opt: get_linear_schedule_with_warmup(opt, 2, 10))
    assert factors(0.0)[2:] == pytest.approx(hf[2:], abs=1e-12)
    assert factors(0.2)[2:] == pytest.approx([0.2 + 0.8 * f for f in hf[2:]], abs=1e-12)


@pytest.mark.parametrize("script", SCRIPTS)
def test_advantage_defaults(script):
    """The command line's defaults, as each script parses them: the group's population std (DFPO eq. 43) and verl's
    eps 1e-6 (TRL's Bessel std and 1e-4 are --adv-std bessel --adv-eps 1e-4). Rewards [1, 0, 0, 0]: A_1 =
    (3/4) / (sqrt(3/16) + 1e-6) = 1.7320468, where Bessel would give 1.5 and eps 1e-4 1.7316."""
    import importlib

    from grouprl import cli

    args = cli.parse_args(importlib.import_module(script).Args, [])
    assert (args.scale_rewards, args.adv_std, args.adv_eps, args.baseline) == ("group", "population", 1e-6,
                                                                               "group-mean")
    adv, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, args.scale_rewards, args.adv_std, args.adv_eps,
                              args.baseline)
    assert adv[0].item() == pytest.approx(0.75 / (math.sqrt(3 / 16) + 1e-6), rel=5e-7)
