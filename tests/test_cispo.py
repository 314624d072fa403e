"""cispo_loss (CISPO, arXiv 2506.13585 Sec. 3.1) against the paper's objective, written here independently of the
code under test, and against TRL 1.16's own loss:
    paper:  J = 1/sum_i |y_i| sum_i sum_t sg(clip(w_it, 1 - eps_low, 1 + eps_high)) A_i log pi(y_it)   (float64)
    TRL:    GRPOTrainer._compute_loss itself, loss_type "cispo" (helpers.trl_loss): per_token_loss =
            -clamp(coef_1, max=epsilon_high).detach() * A * logp (+ beta kl, x coef_1 with use_bias_correction_kl);
            loss = (per_token_loss * mask).sum() / num_items_in_batch; TRL's epsilon_high is the cap itself, ours
            is 1 + --clip-high, and TRL has no floor (its case of ours: --clip-low 1; the floor is the paper's test)
Value and gradient with respect to logp, ratios well outside the band (some weights capped)."""
import functools
import math

import pytest
import torch

from cispo import Args, cispo_loss
from helpers import batch as drawn_batch, trl_loss, value_and_grad, value_grad

B, T = 6, 5
batch = functools.partial(drawn_batch, 1.2)  # old log-probs 1.2 apart (in log): w from ~0.03 to ~30


def paper_objective(logp, old, adv, mask, eps_low, eps_high):
    """J_CISPO token by token: the weight clip(w, 1 - eps_low, 1 + eps_high) as a number (sg), times A_i log pi."""
    total, tokens = 0.0, 0.0
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                w = math.exp(float(logp[i, t].detach() - old[i, t]))
                r_hat = min(max(w, 1 - eps_low), 1 + eps_high)
                total = total + r_hat * float(adv[i]) * logp[i, t]  # a tensor in logp: its gradient is r_hat A_i
                tokens += 1
    return total / tokens


@pytest.mark.parametrize("eps_low,eps_high", [(1.0, 4.0), (0.2, 0.28), (0.5, 1.0)])
def test_equals_the_papers_objective_in_float64(eps_low, eps_high):
    logp, old, _, mask, adv = batch()
    got, got_g = value_and_grad(lambda x: cispo_loss(x, old, adv, mask, clip_low=eps_low, clip_high=eps_high)[0],
                                logp)
    want, want_g = value_and_grad(lambda x: -paper_objective(x, old, adv, mask, eps_low, eps_high), logp)
    assert abs(got.item() - want.item()) <= 1e-10
    assert (got_g - want_g).abs().max().item() <= 1e-10
    w = torch.exp(logp - old)[mask.bool()]
    assert ((w > 1 + eps_high) | (w < 1 - eps_low)).any()  # the clip acts on this batch


@pytest.mark.parametrize("clip_high", [4.0, 0.28])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, False), (0.05, False), (0.05, True)])
def test_equals_trls_loss(clip_high, beta, bias_kl):
    """TRL 1.16's _compute_loss, loss_type "cispo", epsilon_high = 1 + --clip-high, no floor (--clip-low 1): value
    and gradient equal in float64 to 1e-10 (TRL run with float64 as the default dtype), ours in float32 within
    1e-6 of TRL's float64."""
    logp, old, ref, mask, adv = batch(1)
    theirs, g_theirs = value_grad(lambda x: trl_loss(x, old, adv, mask, loss_type="cispo", eps_hi=1 + clip_high,
                                                     beta=beta, ref=ref, bias_kl=bias_kl), logp)
    assert (torch.exp(logp - old)[mask.bool()] > 1 + clip_high).any()  # the cap acts on this batch
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-6)):
        o, r, m, a = (t.to(dtype) for t in (old, ref, mask, adv))
        got, g = value_grad(lambda x: cispo_loss(x, o, a, m, clip_low=1.0, clip_high=clip_high, ref_logp=r,
                                                 kl_coef=beta, kl_ratio=bias_kl)[0], logp.to(dtype))
        assert abs(got - theirs) <= tol
        assert (g.double() - g_theirs).abs().max().item() <= tol


def test_one_token_by_hand():
    """log pi = -1, log pi_old = -3: w = e^2 = 7.39, capped at 5; A = 1. Loss -5 x 1 x (-1) / 1 = 5, d loss / d log pi
    = -5 (the token keeps its gradient, scaled by the cap); clipfrac 1. Below the floor (w = e^-2 = 0.135, floor 0.8)
    with A = -1: loss 0.8 x (-1) x (-1) x -1 = -0.8, gradient 0.8."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    loss, terms, stats = cispo_loss(logp, torch.tensor([[-3.0]], dtype=torch.float64),
                                    torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                                    clip_low=1.0, clip_high=4.0)
    loss.backward()
    assert loss.item() == pytest.approx(5.0) and logp.grad.item() == pytest.approx(-5.0)
    assert terms.item() == pytest.approx(5.0)  # m_i = w_i A_i with w_i the capped weight
    assert stats["losses/clipfrac"][0].item() == 1 and stats["losses/ratio_max"].item() == pytest.approx(math.e ** 2)
    logp = torch.tensor([[-3.0]], dtype=torch.float64, requires_grad=True)
    loss, _, _ = cispo_loss(logp, torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                            torch.ones(1, 1, dtype=torch.float64), clip_low=0.2, clip_high=4.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.8 * -3.0) and logp.grad.item() == pytest.approx(0.8)


def test_no_token_leaves_the_gradient():
    """Unlike PPO's min (grpo.py), every unmasked token with A_i != 0 has a gradient, clipped weight or not; masked
    tokens and A_i = 0 have none."""
    logp, old, _, mask, adv = batch(2)
    _, g = value_and_grad(lambda x: cispo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28)[0], logp)
    live = mask.bool() & (adv != 0)[:, None]
    assert (g[live] != 0).all() and (g[~live] == 0).all()


def test_defaults_are_the_papers_and_trls():
    args = Args()
    assert (args.clip_low, args.clip_high, args.loss_agg) == (1.0, 4.0, "token-mean")


def test_is_weight_multiplies_each_token_term():
    """--rollout-is-cap: on policy (w = 1, r_hat = 1) each token's term is v_it A_i log pi, v the TIS weights, summed
    over the 5 tokens and divided by them (token-mean): loss -sum v_it A_i log pi_it / 5, d loss / d log pi_it =
    -v_it A_i / 5; no weight (v = 1) is the plain CISPO loss."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 2.0, 1.5], [0.25, 3.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    loss, _, _ = cispo_loss(logp, old, adv, mask, clip_low=1.0, clip_high=4.0, is_weight=v)
    loss.backward()
    want = -(0.5 * -1.0 + 2.0 * -2.0 + 1.5 * -0.5 - 2.0 * (0.25 * -0.3 + 3.0 * -0.7)) / 5
    assert loss.item() == pytest.approx(want, rel=1e-12)
    grad = [[-0.5 / 5, -2.0 / 5, -1.5 / 5], [0.25 * 2 / 5, 3.0 * 2 / 5, 0.0]]
    assert logp.grad.flatten().tolist() == pytest.approx(sum(grad, []), rel=1e-12)
    plain = cispo_loss(old, old, adv, mask, clip_low=1.0, clip_high=4.0)[0]
    assert plain.item() == pytest.approx(-(-1.0 - 2.0 - 0.5 - 2.0 * (-0.3 - 0.7)) / 5, rel=1e-12)


def test_script_passes_the_rollout_correction_mode(monkeypatch, tmp_path):
    """cispo.py --rollout-is-mode sequence-mask: the loop's correction is the masked one (rollout_is/masked_frac
    logged), not the default token-truncate's (rollout_is/capped_frac); the engine decodes in fp32 on the CPU, so
    nothing is masked."""
    from helpers import run_script

    rows, _ = run_script("cispo", ["--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "2",
                                   "--num-minibatches", "1", "--eval-every", "0", "--max-new-tokens", "4",
                                   "--log-samples", "0", "--save-every", "0", "--gen-mode", "engine",
                                   "--rollout-is-cap", "2", "--rollout-is-mode", "sequence-mask"],
                         monkeypatch, tmp_path / "o")
    assert rows[0]["rollout_is/masked_frac"] == 0 and "rollout_is/capped_frac" not in rows[0]
