"""--kl-coef in every script (issue 26): k3 = exp(ref - logp) - (ref - logp) - 1 per token, aggregated as each
script aggregates its token terms, checked against float64 loops written by hand (value and gradient); the
reference model is set up once, in modeling.reference_policy, for all four scripts."""
import math

import pytest
import torch

from grouprl import modeling
from dfpo import dfpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from gspo_token import gspo_token_loss
from helpers import ragged_batch, run_script

BETA = 0.3


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def k3_by_hand(logp, ref, mask, agg):
    """The KL part of the loss, beta * KL, and its gradient d/d logp_it, in python floats.
    agg 'seq': 1/B sum_i 1/|y_i| sum_t k3_it (GSPO, DFPO, --loss-agg seq-mean-token-mean);
    'token': 1/sum_i |y_i| sum_i sum_t k3_it (--loss-agg token-mean).
    d k3 / d logp = 1 - exp(ref - logp)."""
    B, T = mask.shape
    value, grad = 0.0, torch.zeros(B, T)
    total_tokens = float(mask.sum())
    for i in range(B):
        n_i = float(mask[i].sum())
        scale = 1 / (B * n_i) if agg == "seq" else 1 / total_tokens
        for t in range(T):
            if mask[i, t]:
                x = float(ref[i, t]) - float(logp[i, t])
                value += BETA * scale * (math.exp(x) - x - 1)
                grad[i, t] = BETA * scale * (1 - math.exp(x))
    return value, grad


def losses(name):
    """name -> f(logp, old, adv, mask, ref_logp, kl_coef) -> loss."""
    clip = dict(clip_low=0.2, clip_high=0.27)
    return {
        "gspo": lambda *a, **k: gspo_loss(*a, **clip, **k)[0],
        "dfpo": lambda *a, **k: dfpo_loss(*a, group_size=3, **clip, **k)[0],
        "gspo_token": lambda lp, old, adv, m, **k: gspo_token_loss(lp, old, adv[:, None].expand_as(m), m,
                                                                   **clip, **k)[0],
        "gspo_token_tokenmean": lambda lp, old, adv, m, **k: gspo_token_loss(
            lp, old, adv[:, None].expand_as(m), m, loss_agg="token-mean", **clip, **k)[0],
        "grpo": lambda *a, **k: grpo_loss(*a, **clip, **k)[0],
    }[name]


@pytest.mark.parametrize("name, agg", [("gspo", "seq"), ("dfpo", "seq"), ("gspo_token", "seq"),
                                       ("gspo_token_tokenmean", "token"), ("grpo", "seq")])
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_term_value_and_gradient(name, agg, seed):
    logp, old, adv, mask = ragged_batch(seed=seed)
    ref = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 7))
    f = losses(name)
    without = f(logp, old, adv, mask)
    (g0,) = torch.autograd.grad(without, logp)
    with_kl = f(logp, old, adv, mask, ref_logp=ref, kl_coef=BETA)
    (g1,) = torch.autograd.grad(with_kl, logp)
    value, grad = k3_by_hand(logp.detach(), ref, mask, agg)
    assert (with_kl - without).item() == pytest.approx(value, abs=1e-12) and value > 0
    assert torch.allclose(torch.nan_to_num(g1 - g0, nan=0.0) * mask, grad, atol=1e-12)
    # off by default: no ref, or beta 0, is the loss without KL bit for bit
    assert f(logp, old, adv, mask, ref_logp=ref, kl_coef=0.0).item() == without.item()


def test_reference_policy_is_shared_and_off_at_zero(monkeypatch):
    """kl_coef 0: no second model is loaded at all; > 0: the initial --model (not a checkpoint), frozen, in eval mode."""
    import types

    from grouprl import distributed

    d = distributed.Dist(0, 1, torch.device("cpu"))
    args = types.SimpleNamespace(kl_coef=0.0, model="tiny", seed=3, trust_remote_code=False, dtype="fp32",
                                 temperature=1.0, logprob_chunk_tokens=64, cpu_offload=False)
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("loaded a reference at --kl-coef 0"))
    assert modeling.reference_policy(args, None, d) is None
    monkeypatch.undo()
    torch.set_default_dtype(torch.float32)
    tok = modeling.tiny_tokenizer()
    ref = modeling.reference_policy(types.SimpleNamespace(**{**vars(args), "kl_coef": 0.1}), tok, d)
    lm, _ = modeling.load_model("tiny", tok, d, 3)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref.lm.state_dict().values(), lm.state_dict().values()))


@pytest.mark.parametrize("script", ["gspo", "gspo_token", "dfpo"])
def test_kl_coef_runs_in_every_script(script, monkeypatch, tmp_path):
    """One step with --kl-coef: the k3 to the reference is logged; it is 0 on the first minibatch (policy = reference,
    both the seeded tiny model) and >= 0 after."""
    torch.set_default_dtype(torch.float32)
    rows, _ = run_script(script, ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "4",
                                  "--eval-every", "0", "--kl-coef", "0.5"], monkeypatch, tmp_path)
    assert rows[-1]["losses/kl_ref"] >= 0 and math.isfinite(rows[-1]["losses/kl_ref"])
