"""vespo_loss (VESPO, arXiv 2602.10693, as TRL computes it) against the Gamma weight written from its definition,
independently of the code under test, and against TRL 1.16's own loss:
    definition: phi(W) = W^k exp(lambda (1 - W)), W_i = prod_t w_it, (k, lambda) by A_i >= 0 or < 0;
                J = 1/sum_i |y_i| sum_i sum_t phi(W_i) A_i log pi(y_it), phi a constant   (float64)
    TRL:        GRPOTrainer._compute_loss itself, loss_type "vespo" (helpers.trl_loss), with its get_gamma_weights
                (log w_it clamped to [-20, 20], summed, clamped to [log 1e-8, 20]; log phi = lambda + k log W -
                lambda W); per_token_loss = -phi A logp (+ beta kl); loss = (per_token_loss m).sum() /
                num_items_in_batch
Value and gradient with respect to logp."""
import dataclasses
import functools
import math

import pytest
import torch

from vespo import Args, vespo_loss
from helpers import batch as drawn_batch, trl, trl_loss, value_and_grad, value_grad

B, T = 6, 5
batch = functools.partial(drawn_batch, 0.3)  # old log-probs 0.3 apart (in log): W_i from ~0.5 to ~2
DEFAULTS = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
OTHERS = dict(k_pos=1.0, lambda_pos=1.0, k_neg=5.0, lambda_neg=0.5)


def by_definition(logp, old, adv, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    total, tokens = 0.0, 0
    for i in range(B):
        n = int(mask[i].sum())
        W = 1.0
        for t in range(n):
            W *= math.exp(float(logp[i, t].detach() - old[i, t]))
        k, lam = (k_pos, lambda_pos) if adv[i] >= 0 else (k_neg, lambda_neg)
        phi = W ** k * math.exp(lam * (1 - W))
        for t in range(n):
            total = total + phi * float(adv[i]) * logp[i, t]
            tokens += 1
    return total / tokens


@pytest.mark.parametrize("params", [DEFAULTS, OTHERS])
def test_equals_the_gamma_weight_by_definition_in_float64(params):
    logp, old, _, mask, adv = batch()
    got, got_g = value_and_grad(lambda x: vespo_loss(x, old, adv, mask, **params)[0], logp)
    want, want_g = value_and_grad(lambda x: -by_definition(x, old, adv, mask, **params), logp)
    assert abs(got.item() - want.item()) <= 1e-10
    assert (got_g - want_g).abs().max().item() <= 1e-10


@pytest.mark.parametrize("params", [DEFAULTS, OTHERS])
@pytest.mark.parametrize("beta,bias_kl", [(0.0, False), (0.05, False), (0.05, True)])
def test_equals_trls_loss(params, beta, bias_kl):
    """TRL 1.16's _compute_loss, loss_type "vespo", vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg =
    --k-pos, --lambda-pos, --k-neg, --lambda-neg: value and gradient equal in float64 to 1e-10 (TRL run with float64
    as the default dtype), ours in float32 within 1e-6 of TRL's float64."""
    logp, old, ref, mask, adv = batch(1)
    trl_params = tuple(params[k] for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"))
    theirs, g_theirs = value_grad(lambda x: trl_loss(x, old, adv, mask, loss_type="vespo", vespo=trl_params,
                                                     beta=beta, ref=ref, bias_kl=bias_kl), logp)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-6)):
        o, r, m, a = (t.to(dtype) for t in (old, ref, mask, adv))
        got, g = value_grad(lambda x: vespo_loss(x, o, a, m, **params, ref_logp=r, kl_coef=beta,
                                                 kl_ratio=bias_kl)[0], logp.to(dtype))
        assert abs(got - theirs) <= tol
        assert (g.double() - g_theirs).abs().max().item() <= tol


def test_one_sequence_by_hand():
    """Two tokens, log w = (0.1, 0.2): W = e^0.3; A = 1 takes (k, lambda) = (2, 3): phi = e^0.6 e^(3 (1 - e^0.3)).
    Loss -phi (logp_1 + logp_2) / 2, gradient -phi / 2 on each token; on policy (W = 1) phi = 1."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.2]], dtype=torch.float64)
    loss, terms, stats = vespo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64),
                                    torch.ones(1, 2, dtype=torch.float64), **DEFAULTS)
    loss.backward()
    phi = math.exp(0.6) * math.exp(3 * (1 - math.exp(0.3)))
    assert loss.item() == pytest.approx(-phi * (-3.0) / 2) and terms.item() == pytest.approx(phi)
    assert logp.grad[0].tolist() == pytest.approx([-phi / 2] * 2)
    assert stats["losses/phi_mean"][0].item() == pytest.approx(phi)
    on = vespo_loss(logp.detach(), logp.detach(), torch.tensor([-1.0], dtype=torch.float64),
                    torch.ones(1, 2, dtype=torch.float64), **DEFAULTS)[1]
    assert on.item() == pytest.approx(-1.0)  # phi(1) = 1 whatever (k, lambda)


def test_defaults_are_trls():
    """TRL 1.16's GRPOConfig defaults, read from its dataclass."""
    args = Args()
    assert (args.k_pos, args.lambda_pos, args.k_neg, args.lambda_neg, args.loss_agg) == (2.0, 3.0, 3.0, 2.0,
                                                                                         "token-mean")
    trl()
    from trl.trainer.grpo_config import GRPOConfig

    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert [getattr(args, k) for k in DEFAULTS] == [config["vespo_" + k] for k in DEFAULTS]


def test_is_weight_folds_into_the_sequence_ratio():
    """--rollout-is-cap: the TIS weights v_it = pi_old / pi_rollout fold into W_i (TRL multiplies its
    importance_sampling_ratio into the sequence weight): on policy (w = 1) with log v = (0.3, -0.1), W = e^0.2 and
    A = 1 takes (k, lambda) = (2, 3): phi = e^0.4 e^(3 (1 - e^0.2)) = 0.77; the terms are not multiplied by v. Loss
    -phi (logp_1 + logp_2) / 2, gradient -phi / 2 each. Folded the wrong way (W = e^-0.2) phi would be 1.15."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[math.exp(0.3), math.exp(-0.1)]], dtype=torch.float64)
    loss, terms, stats = vespo_loss(logp, logp.detach(), torch.tensor([1.0], dtype=torch.float64),
                                    torch.ones(1, 2, dtype=torch.float64), **DEFAULTS, is_weight=v)
    loss.backward()
    phi = math.exp(0.4) * math.exp(3 * (1 - math.exp(0.2)))
    assert loss.item() == pytest.approx(-phi * (-3.0) / 2, rel=1e-12) and terms.item() == pytest.approx(phi)
    assert logp.grad[0].tolist() == pytest.approx([-phi / 2] * 2, rel=1e-12)
    assert stats["losses/phi_mean"][0].item() == pytest.approx(phi)
    # A < 0 takes (3, 2): phi = e^0.6 e^(2 (1 - e^0.2)), with a padded third position that must not count
    logp = torch.tensor([[-1.0, -2.0, -5.0]], dtype=torch.float64)
    v3 = torch.cat([v, torch.tensor([[100.0]], dtype=torch.float64)], 1)
    _, terms, _ = vespo_loss(logp, logp, torch.tensor([-1.0], dtype=torch.float64),
                             torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), **DEFAULTS, is_weight=v3)
    assert terms.item() == pytest.approx(-math.exp(0.6) * math.exp(2 * (1 - math.exp(0.2))), rel=1e-12)
