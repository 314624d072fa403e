"""The same advantages and loss as TRL's GRPOTrainer where docs/trl-and-verl.md says so (issue 37 item 1).

The reference here is an independent float64 transcription of TRL's formulas (trl/trainer/grpo_trainer.py,
_generate_and_score_completions and _compute_loss; trl/trainer/utils.py nanstd), written from its source, not from
this project's code:
    A      = (r - mean_group r) / (nanstd + 1e-4)        nanstd: Bessel-corrected (n - 1)
    coef_1 = exp(logp - old)  (token)  or  exp(sum_t (logp - old) m / |y|)  (sequence);  delta: coef_1 capped at delta
    kl     = exp(ref - logp) - (ref - logp) - 1,  x coef_1 with use_bias_correction_kl
    loss   = agg(-min(coef_1 A, clip(coef_1, 1 - eps_lo, 1 + eps_hi) A) + beta kl)
    agg    = grpo: mean_i (sum_t / |y_i|);  dapo: sum / sum |y|;  dr_grpo: sum / (B max_completion_length);
             luspo (sequence level): mean_i (term_i |y_i|)
Where trl is importable, TRL's own nanstd is compared too; elsewhere that test skips in one line."""
import math

import pytest
import torch

from common import group_advantages
from dfpo import dfpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from conftest import SCRIPTS
from helpers import B, G, T, trl_advantages, trl_batch, trl_loss, trl_nanstd


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
    rewards = trl_batch()[-1]
    ours, zero = group_advantages(rewards, G, scale, "bessel", 1e-4)
    torch.testing.assert_close(ours.double(), trl_advantages(rewards, scale), rtol=1e-6, atol=1e-7)
    assert zero == 0


@pytest.mark.parametrize("loss_type, loss_agg", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean"),
                                                 ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("bias_kl", [False, True])
def test_grpo_loss_equals_trl_token_level(loss_type, loss_agg, bias_kl):
    """grpo.py's loss and its gradient = TRL's with importance_sampling_level='token', the loss_type the table maps to
    --loss-agg, beta = --kl-coef, use_bias_correction_kl = --kl-ratio-correction, on TRL's advantages."""
    logp, old, ref, mask, rewards = trl_batch()
    adv = group_advantages(rewards, G, "group", "bessel", 1e-4)[0].double()
    x = logp.clone().requires_grad_()
    ours, _, _ = grpo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_coef=0.04,
                           kl_ratio=bias_kl, loss_agg=loss_agg, max_new_tokens=T)
    ours.backward()
    y = logp.clone().requires_grad_()
    theirs = trl_loss(y, old, ref, trl_advantages(rewards, "group"), mask, level="token", loss_type=loss_type,
                      eps_lo=0.2, eps_hi=0.28, beta=0.04, bias_kl=bias_kl)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("bias_kl", [False, True])
@pytest.mark.parametrize("loss_fn", ["gspo", "dfpo none"])
def test_gspo_loss_equals_trl_sequence_level(loss_fn, bias_kl):
    """gspo.py (and dfpo.py --transform none --clip-gated, which is GSPO) = TRL's importance_sampling_level='sequence'
    with loss_type='grpo' (a sequence's per-token term is constant, so its token mean is the sequence's term)."""
    logp, old, ref, mask, rewards = trl_batch(1)
    old = logp + 0.002 * (old - logp)  # s_i near the GSPO band, some inside, some clipped
    adv = group_advantages(rewards, G, "group", "bessel", 1e-4)[0].double()
    x = logp.clone().requires_grad_()
    kw = dict(clip_low=3e-4, clip_high=4e-4, ref_logp=ref, kl_coef=0.04, kl_ratio=bias_kl)
    if loss_fn == "gspo":
        ours, _, _ = gspo_loss(x, old, adv, mask, **kw)
    else:
        ours, _, _ = dfpo_loss(x, old, adv, mask, group_size=G, transform="none", clip_gated=True, **kw)
    ours.backward()
    y = logp.clone().requires_grad_()
    theirs = trl_loss(y, old, ref, trl_advantages(rewards, "group"), mask, level="sequence", loss_type="grpo",
                      eps_lo=3e-4, eps_hi=4e-4, beta=0.04, bias_kl=bias_kl)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("loss_type, loss_agg", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean")])
def test_grpo_delta_equals_trls_two_sided_clip(loss_type, loss_agg):
    """grpo.py --delta = TRL's delta: coef_1 capped at delta before the min; ratios up to ~e^1 here, so the cap acts on
    tokens of A < 0 (for A > 0 the clip's 1 + eps_high < delta already decides)."""
    logp, old, ref, mask, rewards = trl_batch(2)
    adv = group_advantages(rewards, G, "group", "bessel", 1e-4)[0].double()
    x = logp.clone().requires_grad_()
    ours, _, stats = grpo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, delta=1.1 + 0.28, loss_agg=loss_agg)
    ours.backward()
    y = logp.clone().requires_grad_()
    theirs = trl_loss(y, old, ref, trl_advantages(rewards, "group"), mask, level="token", loss_type=loss_type,
                      eps_lo=0.2, eps_hi=0.28, beta=0.0, bias_kl=False, delta=1.38)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-6, atol=1e-9)
    w = torch.exp(logp - old)
    assert ((w > 1.38) & (adv[:, None] < 0) & mask.bool()).any()  # the cap acts on this batch
    plain, _, _ = grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, loss_agg=loss_agg)
    assert plain.item() != pytest.approx(ours.item())


def test_luspo_equals_trls():
    """gspo.py --luspo = TRL's loss_type='luspo' at importance_sampling_level='sequence' (beta 0: TRL broadcasts its
    KL over the padded [B, T] there, and ours keeps GSPO's KL)."""
    logp, old, ref, mask, rewards = trl_batch(1)
    old = logp + 0.002 * (old - logp)  # s_i near the GSPO band, some inside, some clipped
    adv = group_advantages(rewards, G, "group", "bessel", 1e-4)[0].double()
    x = logp.clone().requires_grad_()
    ours, _, _ = gspo_loss(x, old, adv, mask, clip_low=3e-4, clip_high=4e-4, luspo=True)
    ours.backward()
    y = logp.clone().requires_grad_()
    theirs = trl_loss(y, old, ref, trl_advantages(rewards, "group"), mask, level="sequence", loss_type="luspo",
                      eps_lo=3e-4, eps_hi=4e-4, beta=0.0, bias_kl=False)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-6, atol=1e-9)


def test_luspo_and_delta_by_hand():
    """LUSPO, one sequence of 3 tokens on policy (s = 1), A = 1: GSPO gives each token -A/|y| = -1/3 in d loss / d
    logp, LUSPO -A = -1, and the loss -1 x 3 = -3. Delta 1.5, one token of A = -1 at w = e: min(min(e, 1.5) (-1),
    clip(e) (-1)) = -1.5, a constant: loss 1.5, no gradient (without delta: loss e, gradient e)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    one = torch.tensor([1.0], dtype=torch.float64)
    loss, terms, _ = gspo_loss(logp, logp.detach(), one, torch.ones(1, 3, dtype=torch.float64), clip_low=3e-4,
                               clip_high=4e-4, luspo=True)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0) and logp.grad[0].tolist() == pytest.approx([-1.0] * 3)
    assert terms.item() == pytest.approx(3.0)
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


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """TRL's get_off_policy_mask, written from its source: (B, 1), 1 keep, 0 drop."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg_seq_kl <= off_policy_threshold)).to(dtype=mask.dtype)


@pytest.mark.parametrize("delta", [0.0, 0.1, 0.5])
def test_opsm_equals_trls_in_grpo(delta):
    """--off-policy-mask: the rows TRL's mask drops get A = 0 here, so grpo.py's loss and gradient equal TRL's
    per_token_loss x off_policy_mask (the KL term kept in both); the logged count is TRL's drops."""
    from common import off_policy_mask

    logp, old, ref, mask, rewards = trl_batch(3)
    sampling = logp + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    adv = group_advantages(rewards, G, "group", "bessel", 1e-4)[0].double()
    x = logp.clone().requires_grad_()
    masked, (dropped, rows) = off_policy_mask(adv, x, sampling, mask, delta)
    ours, _, _ = grpo_loss(x, old, masked, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_coef=0.04)
    ours.backward()
    y = logp.clone().requires_grad_()
    opsm = trl_off_policy_mask(trl_advantages(rewards, "group").unsqueeze(1), y, sampling, mask, delta)
    coef_1 = torch.exp(y - old)
    a = trl_advantages(rewards, "group").unsqueeze(1)
    per_token = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.28) * a) * opsm
    per_token = per_token + 0.04 * (torch.exp(ref - y) - (ref - y) - 1)
    theirs = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-6, atol=1e-9)
    assert dropped.item() == (1 - opsm).sum().item() and rows.item() == B
    assert 0 < dropped.item() < B or delta == 0.5  # the mask acts on this batch (0.5: it may drop none)


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


def test_trl_own_nanstd():
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed: TRL's own nanstd not compared")
    rewards = trl_batch()[-1].double()
    torch.testing.assert_close(trl_utils.nanstd(rewards.view(-1, G), dim=1), trl_nanstd(rewards.view(-1, G), dim=1))
    ours, _ = group_advantages(rewards, G, "group", "bessel", 1e-4)
    mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
    theirs = (rewards - mean) / (trl_utils.nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) + 1e-4)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-7)


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


def kl_losses():
    from cispo import cispo_loss
    from gmpo import gmpo_loss
    from gspo_token import gspo_token_loss
    from sapo import sapo_loss
    from vespo import vespo_loss

    return {  # (loss, its other arguments, TRL's importance level, the loss's aggregation)
        "grpo": (grpo_loss, dict(clip_low=0.2, clip_high=0.28), "token", "grpo"),
        "gspo": (gspo_loss, dict(clip_low=3e-4, clip_high=4e-4), "sequence", "grpo"),
        "gspo_token": (gspo_token_loss, dict(clip_low=3e-4, clip_high=4e-4), "sequence_token", "grpo"),
        "dfpo": (dfpo_loss, dict(group_size=G, clip_low=3e-4, clip_high=4e-4), "sequence", "grpo"),
        "cispo": (cispo_loss, dict(clip_low=1.0, clip_high=4.0), "token", "dapo"),
        "sapo": (sapo_loss, dict(tau_pos=1.0, tau_neg=1.05), "token", "grpo"),
        # inside GMPO's log-space band (0.4, ratios within e^+-0.3 here) its s_i is TRL's sequence ratio
        "gmpo": (gmpo_loss, dict(clip_low=0.4, clip_high=0.4), "sequence", "grpo"),
        "vespo": (vespo_loss, dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0), "token", "dapo"),
    }


@pytest.mark.parametrize("name", SCRIPTS)
def test_bias_corrected_kl_equals_trls_in_every_loss(name):
    """--kl-ratio-correction (TRL's use_bias_correction_kl) in every loss that takes it: what the KL adds to the loss,
    loss(beta, kl_ratio) - loss(beta = 0), and its gradient equal TRL's beta agg(coef_1 k3) in float64, with
    k3 = exp(ref - logp) - (ref - logp) - 1 and coef_1 TRL's importance weight: w_it (token), s_i =
    exp(1/|y_i| sum_t log w_it) (sequence), or GSPO-token's s_it = sg[s_i] pi / sg[pi] (value s_i, gradient
    s_i grad log pi). Without the correction the KL adds beta agg(k3), which differs on this batch."""
    loss_fn, kw, level, agg = kl_losses()[name]
    logp, old, ref, mask, rewards = trl_batch(3)
    old = logp + (0.3 if level == "token" else 0.2) * (old - logp)  # ratios off 1, GMPO's inside its band
    adv = group_advantages(rewards, G, "group", "population", 1e-6)[0].double()
    a = adv[:, None] * mask if name == "gspo_token" else adv

    def added(x, kl_ratio):
        return loss_fn(x, old, a, mask, **kw, ref_logp=ref, kl_coef=0.04, kl_ratio=kl_ratio)[0] - \
            loss_fn(x, old, a, mask, **kw)[0]

    def trl(x, bias_kl):
        log_w = x - old
        if level == "sequence":
            log_w = ((log_w * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1)
        elif level == "sequence_token":
            log_w = x - x.detach() + ((log_w * mask).sum(-1) / mask.sum(-1)).detach().unsqueeze(-1)
        kl = torch.exp(ref - x) - (ref - x) - 1
        if bias_kl:
            kl = kl * torch.exp(log_w)
        if agg == "grpo":
            return 0.04 * ((kl * mask).sum(-1) / mask.sum(-1)).mean()
        return 0.04 * (kl * mask).sum() / mask.sum()

    for bias_kl in (True, False):
        x = logp.clone().requires_grad_()
        ours = added(x, bias_kl)
        ours.backward()
        y = logp.clone().requires_grad_()
        theirs = trl(y, bias_kl)
        theirs.backward()
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-9, abs=1e-12), (name, bias_kl)
        torch.testing.assert_close(x.grad * mask, y.grad * mask, rtol=1e-9, atol=1e-12)
    corrected, plain = trl(logp, True).item(), trl(logp, False).item()
    assert abs(corrected - plain) > 1e-3 * abs(plain), (corrected, plain)  # the correction acts on this batch


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
