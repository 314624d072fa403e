"""--loss-agg for the token-level objectives (GRPO, GSPO-token): each mode against its equation written out token by
token in float64 on ragged masks, value and gradient."""
import pytest
import torch

from grpo import grpo_loss
from gspo_token import gspo_token_loss

B, T, L_MAX = 6, 5, 9


def batch(seed, lengths=(5, 1, 3, 4, 2, 5)):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    token_adv = adv[:, None] + torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, adv, token_adv, mask


def by_hand(logp, old, A, mask, mode, eps=0.2, seq_ratio=False):
    """The loss written as the equations say, one scalar at a time. A: [B, T]."""
    terms, lengths = [], []
    for i in range(B):
        n = int(mask[i].sum())
        s_i = torch.exp(sum(logp[i, t] - old[i, t] for t in range(n)) / n) if seq_ratio else None
        row = []
        for t in range(n):
            if seq_ratio:  # GSPO-token: value s_i, gradient sg[s_i] grad log pi_t
                w = s_i.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            else:
                w = torch.exp(logp[i, t] - old[i, t])
            row.append(torch.minimum(w * A[i, t], w.clamp(1 - eps, 1 + eps) * A[i, t]))
        terms.append(row)
        lengths.append(n)
    if mode == "seq-mean-token-mean":  # 1/B sum_i 1/|y_i| sum_t
        return -sum(sum(r) / n for r, n in zip(terms, lengths)) / B
    if mode == "token-mean":  # 1/sum_i |y_i| sum_i sum_t
        return -sum(sum(r) for r in terms) / sum(lengths)
    return -sum(sum(r) / L_MAX for r in terms) / B  # seq-mean-token-sum-norm (Dr. GRPO)


MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("script", ["grpo", "gspo_token"])
def test_loss_agg_matches_its_equation(mode, script):
    logp, old, adv, token_adv, mask = batch(1)
    kw = dict(clip_low=0.2, clip_high=0.2, loss_agg=mode, max_new_tokens=L_MAX)
    if script == "grpo":
        loss, _, _ = grpo_loss(logp, old, adv, mask, **kw)
        ref = by_hand(logp, old, adv[:, None].expand(B, T), mask, mode)
    else:
        loss, _, _ = gspo_token_loss(logp, old, token_adv, mask, **kw)
        ref = by_hand(logp, old, token_adv, mask, mode, seq_ratio=True)
    (grad,) = torch.autograd.grad(loss, logp)
    (grad_ref,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-14)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-14)
    assert grad.abs().max() > 0


def test_token_mean_and_seq_mean_differ_on_ragged_lengths_and_agree_on_equal_ones():
    kw = dict(clip_low=0.2, clip_high=0.2, max_new_tokens=L_MAX)
    for lengths, same in [((5, 1, 3, 4, 2, 5), False), ((3,) * B, True)]:
        logp, old, adv, _, mask = batch(2, lengths)
        a = grpo_loss(logp, old, adv, mask, loss_agg="token-mean", **kw)[0]
        b = grpo_loss(logp, old, adv, mask, loss_agg="seq-mean-token-mean", **kw)[0]
        assert (abs(a.item() - b.item()) < 1e-14) == same, (lengths, a.item(), b.item())


def test_norm_replaces_the_count_the_sum_is_divided_by():
    logp, old, adv, _, mask = batch(3)
    kw = dict(clip_low=0.2, clip_high=0.2, max_new_tokens=L_MAX)
    for mode, count in [("seq-mean-token-mean", B), ("token-mean", mask.sum().item()), ("seq-mean-token-sum-norm", B)]:
        mean = grpo_loss(logp, old, adv, mask, loss_agg=mode, **kw)[0]
        summed = grpo_loss(logp, old, adv, mask, loss_agg=mode, norm=1.0, **kw)[0]
        assert summed.item() == pytest.approx(mean.item() * count, rel=1e-12)
    with pytest.raises(ValueError, match="max_new_tokens"):
        grpo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-sum-norm")


@pytest.mark.parametrize("script, agg", [("grpo", "token-mean"), ("gspo_token", "token-mean"), ("gspo", None),
                                         ("dfpo", None)])
def test_minibatch_without_a_counted_token_adds_nothing(script, agg, monkeypatch, tmp_path):
    """--mask-truncated: a minibatch whose completions are all truncated has 0 tokens in the loss and adds 0 (no
    gradient). With token-mean it was 0/0, a NaN loss, a skipped update, and three in a row stopped the run."""
    from helpers import run_script

    agg_flags = ["--loss-agg", agg] if agg else []
    reward = "def f(completion, answer):\n    return float(sum(map(ord, completion)) % 2)\n"
    (tmp_path / "parity_reward14.py").write_text(reward)
    monkeypatch.syspath_prepend(str(tmp_path))  # groups with a spread: unmasked, they would give a gradient
    rows, _ = run_script(script, ["--num-steps", "3", "--mask-truncated", *agg_flags, "--max-new-tokens", "1",
                                  "--prompts-per-rank", "4", "--num-minibatches", "4", "--eval-every", "0",
                                  "--reward", "parity_reward14:f"], monkeypatch, tmp_path / "out")
    assert any(r["charts/masked_truncated"] == 32 for r in rows)  # a step whose 4 minibatches had no token
    assert all(r["losses/skipped_updates"] == 0 and abs(r["losses/policy_loss"]) < 1e-6 and r["losses/grad_norm"] == 0
               for r in rows if r["charts/masked_truncated"] == 32)  # the mask took them out (GSPO's value: -mean A)
    if agg is None:
        return
    logp = torch.zeros(2, 3, requires_grad=True)
    loss_fn = grpo_loss if script == "grpo" else gspo_token_loss
    adv = torch.ones(2) if script == "grpo" else torch.ones(2, 3)
    loss, _, _ = loss_fn(logp, torch.zeros(2, 3), adv, torch.zeros(2, 3), clip_low=0.2, clip_high=0.2,
                         loss_agg="token-mean")  # no norm given: its own count, none
    assert loss.item() == 0
