"""sapo_loss (SAPO, arXiv 2511.20347) against the paper's objective, written here independently of the code under
test, and against TRL 1.16's own loss:
    paper:  J = 1/G sum_i 1/|y_i| sum_t f_it(w_it) A_i,  f_it(x) = sigmoid(tau_i (x - 1)) 4 / tau_i,
            tau_i = tau_pos if A_i > 0 else tau_neg   (float64)
    TRL:    GRPOTrainer._compute_loss itself, loss_type "sapo" (helpers.trl_loss): temperatures = where(A > 0,
            sapo_temperature_pos, sapo_temperature_neg); per_token_loss = -sigmoid(temperatures (coef_1 - 1)) 4 /
            temperatures A (+ beta kl); loss = mean_i (sum_t per_token_loss m / |y_i|)
Value and gradient with respect to logp, ratios well off 1."""
import dataclasses
import functools
import math

import pytest
import torch

from sapo import Args, sapo_loss
from helpers import batch as drawn_batch, trl, trl_loss, value_and_grad, value_grad

B, T = 6, 5
batch = functools.partial(drawn_batch, 0.8)  # old log-probs 0.8 apart (in log): ratios well off 1


def paper_objective(logp, old, adv, mask, tau_pos, tau_neg):
    """J_SAPO sequence by sequence, token by token."""
    total = 0.0
    for i in range(B):
        tau = tau_pos if adv[i] > 0 else tau_neg
        n = int(mask[i].sum())
        seq = 0.0
        for t in range(n):
            w = torch.exp(logp[i, t] - old[i, t])
            seq = seq + 1 / (1 + torch.exp(-tau * (w - 1))) * 4 / tau * adv[i]
        total = total + seq / n
    return total / B


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0), (3.0, 3.0)])
def test_equals_the_papers_objective_in_float64(tau_pos, tau_neg):
    logp, old, _, mask, adv = batch()
    got, got_g = value_and_grad(lambda x: sapo_loss(x, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)[0], logp)
    want, want_g = value_and_grad(lambda x: -paper_objective(x, old, adv, mask, tau_pos, tau_neg), logp)
    assert abs(got.item() - want.item()) <= 1e-10
    assert (got_g - want_g).abs().max().item() <= 1e-10


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, False), (0.05, False), (0.05, True)])
def test_equals_trls_loss(tau_pos, tau_neg, beta, bias_kl):
    """TRL 1.16's _compute_loss, loss_type "sapo", sapo_temperature_pos/neg = --tau-pos/--tau-neg: value and gradient
    equal in float64 to 1e-10 (TRL run with float64 as the default dtype: its temperatures, where() of two Python
    floats, come out in it), ours in float32 within 1e-6 of TRL's float64."""
    logp, old, ref, mask, adv = batch(1)
    theirs, g_theirs = value_grad(lambda x: trl_loss(x, old, adv, mask, loss_type="sapo", sapo=(tau_pos, tau_neg),
                                                     beta=beta, ref=ref, bias_kl=bias_kl), logp)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-6)):
        o, r, m, a = (t.to(dtype) for t in (old, ref, mask, adv))
        got, g = value_grad(lambda x: sapo_loss(x, o, a, m, tau_pos=tau_pos, tau_neg=tau_neg, ref_logp=r,
                                                kl_coef=beta, kl_ratio=bias_kl)[0], logp.to(dtype))
        assert abs(got - theirs) <= tol
        assert (g.double() - g_theirs).abs().max().item() <= tol


def test_the_gate_by_hand():
    """On policy (w = 1) the gate is sigmoid(0) 4 / tau = 2 / tau and its slope d f / d log pi = 4 sigma (1 - sigma) w =
    1 whatever tau: the plain policy gradient. One token, A = 1, tau_pos = 1: loss -2, gradient -1. At w = e (log w =
    1) with A = -1, tau_neg = 2: f = sigmoid(2 (e - 1)) 4 / 2, loss -(-f) = f; gradient -(-1) 4 s (1 - s) e, s =
    sigmoid(2 (e - 1))."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    one = torch.ones(1, 1, dtype=torch.float64)
    loss, terms, stats = sapo_loss(logp, torch.tensor([[-1.0]], dtype=torch.float64),
                                   torch.tensor([1.0], dtype=torch.float64), one, tau_pos=1.0, tau_neg=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and logp.grad.item() == pytest.approx(-1.0)
    assert terms.item() == pytest.approx(1.0) and stats["losses/gate_mean"][0].item() == pytest.approx(1.0)
    logp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    loss, _, stats = sapo_loss(logp, torch.tensor([[-1.0]], dtype=torch.float64),
                               torch.tensor([-1.0], dtype=torch.float64), one, tau_pos=1.0, tau_neg=2.0)
    loss.backward()
    s = 1 / (1 + math.exp(-2 * (math.e - 1)))
    assert loss.item() == pytest.approx(s * 2) and logp.grad.item() == pytest.approx(4 * s * (1 - s) * math.e)
    assert stats["losses/clipfrac"][0].item() == 1  # w = e is outside GRPO's band (0.8, 1.27)


def test_far_tokens_fade_but_none_is_cut():
    """The gradient's weight 4 s (1 - s) w decays as w leaves 1 and never reaches 0 (no hard edge, unlike GRPO's
    clip), faster for tau_neg > tau_pos."""
    w = torch.tensor([1.0, 1.5, 3.0, 10.0], dtype=torch.float64)
    logp = w.log()[None].clone().requires_grad_(True)
    for a, tau in ((1.0, 1.0), (-1.0, 1.05)):
        logp.grad = None
        sapo_loss(logp, torch.zeros(1, 4, dtype=torch.float64), torch.tensor([a], dtype=torch.float64),
                  torch.ones(1, 4, dtype=torch.float64), tau_pos=1.0, tau_neg=1.05)[0].backward()
        weight = (logp.grad.abs() * 4).flatten()  # 1/|y| = 1/4 undone
        s = torch.sigmoid(tau * (w - 1))
        assert torch.allclose(weight, 4 * s * (1 - s) * w)
        assert (weight > 0).all() and weight[2] < weight[1] and weight[3] < weight[2]


def test_defaults_are_the_papers_and_trls():
    """The paper's (1.0, 1.05), and TRL 1.16's GRPOConfig defaults read from its dataclass."""
    args = Args()
    assert (args.tau_pos, args.tau_neg, args.loss_agg) == (1.0, 1.05, "seq-mean-token-mean")
    trl()
    from trl.trainer.grpo_config import GRPOConfig

    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert (args.tau_pos, args.tau_neg) == (config["sapo_temperature_pos"], config["sapo_temperature_neg"])


def test_is_weight_multiplies_each_token_term():
    """--rollout-is-cap: on policy (w = 1) each token's term is v_it f(1) A_i = v_it (2 / tau) A_i with the gradient
    v_it A_i (f'(1) = 1), then 1/B sum_i 1/|y_i| sum_t (seq-mean-token-mean): v the TIS weights."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 2.0, 1.5], [0.25, 3.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    loss, _, _ = sapo_loss(logp, old, adv, mask, tau_pos=1.0, tau_neg=2.0, is_weight=v)
    loss.backward()
    seq0 = (0.5 + 2.0 + 1.5) * (2 / 1.0) * 1.0 / 3
    seq1 = (0.25 + 3.0) * (2 / 2.0) * -2.0 / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, rel=1e-12)
    grad = [[-0.5 / 6, -2.0 / 6, -1.5 / 6], [0.25 * 2 / 4, 3.0 * 2 / 4, 0.0]]
    assert logp.grad.flatten().tolist() == pytest.approx(sum(grad, []), rel=1e-12)


def test_script_passes_the_rollout_correction_to_the_loss(monkeypatch, tmp_path):
    """sapo.py --rollout-is-cap 2 with the engine's log-probs raised by 0.5 a token: the loss gets is_weight =
    min(pi_old / pi_rollout, 2) = e^-0.5 (to the engine's float error) on every completion token, in every call."""
    import sapo
    from helpers import run_script

    sample_groups, loss, weights = sapo.sample_groups, sapo.sapo_loss, []

    def raised(*args, **kwargs):
        roll = sample_groups(*args, **kwargs)
        return dataclasses.replace(roll, logp=roll.logp + 0.5 * roll.mask)

    def spy(logp, old_logp, advantages, mask, **kwargs):
        weights.append((kwargs.get("is_weight"), mask))
        return loss(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(sapo, "sample_groups", raised)
    monkeypatch.setattr(sapo, "sapo_loss", spy)
    run_script("sapo", ["--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1",
                        "--eval-every", "0", "--max-new-tokens", "4", "--log-samples", "0", "--save-every", "0",
                        "--gen-mode", "engine", "--rollout-is-cap", "2"], monkeypatch, tmp_path / "o")
    assert weights and all(v is not None for v, _ in weights)
    for v, mask in weights:
        assert torch.allclose(v[mask.bool()].double(), torch.full_like(v[mask.bool()].double(), math.exp(-0.5)),
                              atol=1e-5)
