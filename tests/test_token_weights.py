"""The per-token weights every script takes (issue 50 item 3): the high-entropy minority (--top-entropy-quantile,
arXiv 2506.01939; TRL's top_entropy_quantile) and the rollout correction (--rollout-is-cap) in the sequence-level
scripts. Against TRL 1.16.0 itself (tests/test_trl_parity.py's trl_loss: GRPOTrainer._compute_loss run as it is):
the mask against TRL's get_high_entropy_mask and by hand; each loss with the mask equal to TRL's with
top_entropy_quantile (TRL's mask from the same entropies, per_token_loss x entropy_mask before the KL); gspo.py and
dfpo.py with the rollout weights equal to TRL's sequence-level loss with importance_sampling_ratio (that ratio is
inline in TRL's _generate_and_score_completions: tests/test_rollout_logp.py transcribes it); gmpo.py against verl's
geo_mean with rollout_is_weights (verl, transcribed in tests/test_gmpo.py); GDPO against TRL's normalize_then_sum
lines (inline, transcribed) with TRL's nanstd. All in float64, and gspo's by hand."""
import math
import types

import pytest
import torch

import common
from cispo import cispo_loss
from dfpo import dfpo_loss
from gmpo import gmpo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from sapo import sapo_loss
from helpers import (G, StubPolicy, default_dtype, run_script, trl, trl_advantages, trl_batch as batch, trl_is_ratio,
                     trl_loss, value_grad, verl_geo_mean)
from vespo import vespo_loss


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL's own GRPOTrainer.get_high_entropy_mask on one process."""
    one_process = types.SimpleNamespace(pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x)
    me = types.SimpleNamespace(accelerator=one_process)
    return trl()[0].get_high_entropy_mask(me, entropies, mask, threshold)


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.8, 1 / 3, 0.999])
@pytest.mark.parametrize("ties", [False, True])
def test_high_entropy_tokens_equal_trls(rho, ties):
    g = torch.Generator().manual_seed(7)
    entropy = torch.rand(6, 9, generator=g) * 4
    if ties:  # a few distinct values: the threshold lands on a tie
        entropy = (entropy * 2).round() / 2
    mask = (torch.arange(9)[None] < torch.tensor([9, 4, 1, 7, 0, 6])[:, None]).float()
    keep, threshold = common.high_entropy_tokens(entropy, mask, rho)
    theirs = trl_high_entropy_mask(entropy, mask, 1 - rho)
    assert torch.equal(keep.bool(), theirs)
    assert threshold == torch.quantile(entropy[mask.bool()], 1 - rho).item()
    assert keep.dtype == mask.dtype and not keep[mask == 0].any()


def test_high_entropy_tokens_by_hand():
    """Entropies 1..5 on five tokens (the sixth is padding, entropy 9): rho 0.4, the 0.6 quantile at rank 0.6 x 4 =
    2.4, 3 + 0.4 (4 - 3) = 3.4: the tokens of entropy 4 and 5 stay. rho 1: every token."""
    entropy = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    keep, threshold = common.high_entropy_tokens(entropy, mask, 0.4)
    assert threshold == pytest.approx(3.4, rel=1e-6)
    assert keep.tolist() == [[0, 1, 0], [1, 0, 0]]
    assert common.high_entropy_tokens(entropy, mask, 1.0)[0].tolist() == mask.tolist()
    assert common.high_entropy_tokens(entropy, torch.zeros_like(mask), 0.4)[0].sum() == 0


def test_old_log_probs_gives_the_mask_and_its_logs():
    """The old pass's entropies (the stub's), over the whole step: the kept fraction and the threshold logged."""
    entropy = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 9.0]])
    roll = common.Rollout(torch.arange(2)[:, None].repeat(1, 5), torch.ones(2, 5, dtype=torch.long), 2,
                          torch.tensor([[1.0, 1, 1], [1, 1, 0]]), torch.zeros(2, dtype=torch.bool), ["", ""],
                          None, None)
    policy = StubPolicy(torch.zeros(2, 3), entropy)
    _, weight, keep, stats = common.old_log_probs(policy, roll, [slice(0, 1), slice(1, 2)], top_entropy=0.4)
    assert weight is None and keep.tolist() == [[0, 1, 0], [1, 0, 0]]
    assert stats["losses/entropy_kept_frac"] == pytest.approx(2 / 5)
    assert stats["losses/entropy_threshold"] == pytest.approx(3.4, rel=1e-6)
    _, _, keep, stats = common.old_log_probs(policy, roll, [slice(0, 2)])
    assert keep is None and "losses/entropy_kept_frac" not in stats


def entropies(mask, seed=4):
    return torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


LOSSES = {  # ours(logp, old, adv, mask, ref, keep); TRL's loss_type, level and its other arguments
    "grpo": (lambda x, o, a, m, r, k: grpo_loss(x, o, a, m, clip_low=0.2, clip_high=0.28, ref_logp=r, kl_coef=0.04,
                                                keep=k)[0], dict()),
    "gspo": (lambda x, o, a, m, r, k: gspo_loss(x, o, a, m, clip_low=0.2, clip_high=0.28, ref_logp=r, kl_coef=0.04,
                                                keep=k)[0], dict(level="sequence")),
    "dfpo none": (lambda x, o, a, m, r, k: dfpo_loss(x, o, a, m, group_size=G, transform="none", clip_gated=True,
                                                     clip_low=0.2, clip_high=0.28, ref_logp=r, kl_coef=0.04,
                                                     keep=k)[0], dict(level="sequence")),
    "cispo": (lambda x, o, a, m, r, k: cispo_loss(x, o, a, m, clip_low=100.0, clip_high=0.5, ref_logp=r,
                                                  kl_coef=0.04, keep=k)[0], dict(loss_type="cispo", eps_hi=1.5)),
    "sapo": (lambda x, o, a, m, r, k: sapo_loss(x, o, a, m, tau_pos=1.0, tau_neg=1.05, ref_logp=r, kl_coef=0.04,
                                                keep=k)[0], dict(loss_type="sapo")),
    "vespo": (lambda x, o, a, m, r, k: vespo_loss(x, o, a, m, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0,
                                                  ref_logp=r, kl_coef=0.04, keep=k)[0], dict(loss_type="vespo")),
}


@pytest.mark.parametrize("name", LOSSES)
def test_entropy_mask_equals_trls_in_every_loss(name):
    """Each loss with keep (ours, at rho 0.5) = TRL's with top_entropy_quantile 0.5 on the same entropies (its own
    mask, per_token_loss x entropy_mask before its KL term), value and gradient; and the mask changes the loss (it
    acts on this batch)."""
    logp, old, ref, mask, rewards = batch(1 if name in ("gspo", "dfpo none") else 0)
    if name in ("gspo", "dfpo none"):
        old = logp + 0.05 * (old - logp)  # s_i around the clip band
    adv = trl_advantages(rewards, "group")  # float64: the losses alone compared
    ent = entropies(mask)
    keep = common.high_entropy_tokens(ent, mask, 0.5)[0]
    ours_fn, trl_kw = LOSSES[name]
    ours, g_ours = value_grad(lambda x: ours_fn(x, old, adv, mask, ref, keep), logp)
    theirs, g_theirs = value_grad(lambda y: trl_loss(y, old, adv, mask, beta=0.04, ref=ref, entropies=ent,
                                                     top_entropy=0.5, **trl_kw), logp)
    assert ours == pytest.approx(theirs, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g_ours * mask, g_theirs * mask, rtol=1e-10, atol=1e-12)
    assert ours != pytest.approx(value_grad(lambda x: ours_fn(x, old, adv, mask, ref, None), logp)[0])
    # in float32, TRL's to 1e-6
    f = [t.float() for t in (logp, old, adv, mask, ref, keep)]
    ours32 = value_grad(lambda x: ours_fn(x, f[1], f[2], f[3], f[4], f[5]), f[0])[0]
    assert ours32 == pytest.approx(theirs, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("name", ["gspo", "dfpo none"])
def test_sequence_scripts_rollout_correction_equals_trls(mode, name):
    """gspo.py and dfpo.py (--transform none --clip-gated: GSPO) with the rollout weights of each mode = TRL's
    sequence-level loss_type grpo with per_token_loss x importance_sampling_ratio: a sequence's term times its
    weights' mean over its tokens (the sequence modes: its one weight)."""
    logp, old, ref, mask, rewards = batch(1)
    old = logp + 0.05 * (old - logp)
    sampling = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ratio = trl_is_ratio(old, sampling, mask, mode, 0.5, 2.0)  # TRL's: [B, T] or, sequence modes, [B, 1]
    adv = trl_advantages(rewards, "group")
    theirs, g_theirs = value_grad(lambda y: trl_loss(y, old, adv, mask, level="sequence", beta=0.04, ref=ref,
                                                     is_ratio=ratio), logp)
    ratio = ratio.expand_as(mask)
    ours_fn = {"gspo": lambda x: gspo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28, ref_logp=ref,
                                           kl_coef=0.04, is_weight=ratio)[0],
               "dfpo none": lambda x: dfpo_loss(x, old, adv, mask, group_size=G, transform="none", clip_gated=True,
                                                clip_low=0.2, clip_high=0.28, ref_logp=ref, kl_coef=0.04,
                                                is_weight=ratio)[0]}[name]
    ours, g_ours = value_grad(ours_fn, logp)
    assert ours == pytest.approx(theirs, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g_ours * mask, g_theirs * mask, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_mask"])
def test_gmpo_rollout_correction_equals_verls_geo_mean(mode):
    """gmpo.py with the rollout weights = verl's geo_mean with rollout_is_weights (their geometric mean over the
    sequence's tokens); a masked token (weight 0) weighs its sequence by 1e-10^(1/|y_i|), as verl's."""
    logp, old, ref, mask, rewards = batch(0)
    sampling = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ratio = trl_is_ratio(old, sampling, mask, mode, 0.5, 2.0).expand_as(mask)
    adv = trl_advantages(rewards, "group")
    ours, g_ours = value_grad(lambda x: gmpo_loss(x, old, adv, mask, clip_low=0.4, clip_high=0.4,
                                                  is_weight=ratio)[0], logp)
    theirs, g_theirs = value_grad(lambda y: verl_geo_mean(y, old, adv, mask, 0.4, 0.4, ratio), logp)
    assert ours == pytest.approx(theirs, rel=1e-7, abs=1e-12)
    torch.testing.assert_close(g_ours * mask, g_theirs * mask, rtol=1e-7, atol=1e-12)


def test_gspo_weights_by_hand():
    """pi = pi_old (s_i = 1, inside the clip), A = [1, -1]; token weights [2, 1, 1/2] and [1, 3] (mean 7/6 and 2):
    J = 1/2 (7/6 - 2) = -5/12, loss 5/12; d loss / d log pi_it = -A_i c_i / (|y_i| 2): -7/36 on the first
    sequence's tokens, +1/2 on the second's. Kept tokens [1, 0, 1] and [0, 1] alone: c = [2/3, 1/2]."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=torch.float64)
    w = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 7.0]], dtype=torch.float64)  # the padding's 7 is not read
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, terms, _ = gspo_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2, is_weight=w)
    loss.backward()
    assert loss.item() == pytest.approx(5 / 12) and terms.tolist() == pytest.approx([7 / 6, -2])
    assert logp.grad.view(-1).tolist() == pytest.approx([-7 / 36] * 3 + [0.5, 0.5, 0.0])
    keep = torch.tensor([[1.0, 0, 1], [0, 1, 1]], dtype=torch.float64)
    loss, _, _ = gspo_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2, keep=keep)
    assert loss.item() == pytest.approx(-(2 / 3 - 1 / 2) / 2)
    luspo, _, _ = gspo_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2, is_weight=w, luspo=True)
    assert luspo.item() == pytest.approx(-(7 / 6 * 3 - 2 * 2) / 2)  # LUSPO: times |y_i| too
    gm, _, _ = gmpo_loss(logp, logp.detach(), adv, mask, clip_low=0.4, clip_high=0.4, is_weight=w)
    assert gm.item() == pytest.approx(-(1.0 - math.sqrt(3)) / 2, rel=1e-8)  # geometric means (2 x 1 x 1/2)^(1/3), 3^(1/2)


@pytest.mark.parametrize("script", ["grpo", "gspo", "vespo"])
def test_scripts_log_the_mask_and_train(script, monkeypatch, tmp_path):
    """Through each script's own loop: --top-entropy-quantile 0.5 keeps about half of the step's tokens (ties at the
    threshold stay) and logs it; the rollout is the same as without it."""
    argv = ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0", "--max-new-tokens", "6",
            "--log-samples", "0", "--temperature", "1.5"]
    rows, _ = run_script(script, argv + ["--top-entropy-quantile", "0.5"], monkeypatch, tmp_path / "mask")
    assert 0.45 <= rows[0]["losses/entropy_kept_frac"] <= 0.75 and rows[0]["losses/entropy_threshold"] > 0
    plain, _ = run_script(script, argv, monkeypatch, tmp_path / "plain")
    assert "losses/entropy_kept_frac" not in plain[0]
    assert plain[0]["charts/reward_mean"] == rows[0]["charts/reward_mean"]  # the same rollout


# -------------------- GDPO: --multi-objective-aggregation normalize-then-sum
def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    """TRL's normalize_then_sum branch, inline in _generate_and_score_completions (trl/trainer/grpo_trainer.py:
    2758, 2790-2799, 2810, transcribed), with TRL's own nanstd (float64 throughout: see default_dtype)."""
    nanstd = trl()[1]
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    with default_dtype(torch.float64):
        std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    with default_dtype(torch.float64):
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_gdpo_equals_trls_normalize_then_sum():
    """Three rewards of different scales over 3 groups of 4, a TRL reward's None (NaN) here and there and one
    completion no reward applies to (A = 0), weights 1, 0.5, 2: Bessel std and eps 1e-4 as TRL's."""
    g = torch.Generator().manual_seed(2)
    values = torch.stack([(torch.rand(12, generator=g) > 0.5).double(), torch.rand(12, generator=g, dtype=torch.float64)
                          * 10, torch.randn(12, generator=g, dtype=torch.float64)], 1)
    values[3, 1] = values[7, 0] = math.nan
    values[9] = math.nan
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    summed = (values * weights).nansum(1).float()
    ours, _ = common.group_advantages(summed, 4, "group", "bessel", 1e-4, parts=(values, weights))
    theirs = trl_normalize_then_sum(values, weights, 4)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=1e-7)
    assert ours[9] == 0
    plain, _ = common.group_advantages(summed, 4, "group", "bessel", 1e-4)
    assert not torch.allclose(plain, ours, atol=1e-2)  # GDPO is not the advantage of the sum


def test_gdpo_by_hand():
    """Two groups of 2, rewards r1 = [1, 0 | 1, 1] and r2 = [0, 1 | 0, 0], weights 2 and 1, population std:
    the first group normalises each to [+1, -1] and [-1, +1], the second has no spread (0); sums 2 - 1 = 1, -1, 0, 0;
    over the batch mean 0, std sqrt(1/2) (eps 1e-9): A = [sqrt 2, -sqrt 2, 0, 0]. The sum first (r = [2, 1, 2, 2]) gives
    [1, -1, 0, 0]."""
    values = torch.tensor([[1.0, 0], [0, 1], [1, 0], [1, 0]], dtype=torch.float64)
    weights = torch.tensor([2.0, 1.0], dtype=torch.float64)
    summed = (values * weights).sum(1).float()
    ours, zero = common.group_advantages(summed, 2, "group", "population", 1e-9, parts=(values, weights))
    assert ours.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0, 0]) and zero == 1
    assert common.group_advantages(summed, 2, "group", "population", 1e-9)[0].tolist() == pytest.approx([1, -1, 0, 0])


def test_gdpo_through_the_loop(monkeypatch, tmp_path):
    """grpo.py with two --reward functions and normalize-then-sum: the advantages it logs (samples.jsonl) are GDPO's
    of the two rewards recomputed from the logged completions (every completion's row of the step's first groups)."""
    import json

    (tmp_path / "two_rewards53.py").write_text(
        "def odd(completion, answer):\n    return float(len(completion) % 2)\n\n"
        "def digits(completion, answer):\n    return float(sum(c.isdigit() for c in completion))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "4", "--num-minibatches", "1",
            "--eval-every", "0",
            "--max-new-tokens", "6", "--temperature", "1.5", "--log-samples", "1", "--reward", "two_rewards53:odd",
            "--reward", "two_rewards53:digits", "--reward-weights", "1", "0.5", "--adv-std", "bessel",
            "--adv-eps", "1e-4", "--truncated-reward-scale", "1", "--multi-objective-aggregation", "normalize-then-sum"]
    _, run_dir = run_script("grpo", argv, monkeypatch, tmp_path / "gdpo")
    rows = [json.loads(line) for line in open(f"{run_dir}/samples.jsonl")]
    assert len(rows) == 8  # both prompts' groups: the whole batch of this rank
    values = torch.tensor([[len(r["completion"]) % 2, sum(c.isdigit() for c in r["completion"])] for r in rows],
                          dtype=torch.float64)
    want = trl_normalize_then_sum(values, torch.tensor([1.0, 0.5], dtype=torch.float64), 4)
    assert [r["advantage"] for r in rows] == pytest.approx(want.tolist(), rel=1e-5, abs=1e-6)
    assert [r["reward"] for r in rows] == pytest.approx((values[:, 0] + 0.5 * values[:, 1]).tolist())


def test_the_step_statistics_over_two_ranks():
    """tests/programs/token_weights_ranks.py under torchrun (gloo): the entropy threshold and mask, and GDPO's batch
    normalisation, over two ranks of unequal token counts = one process holding every row."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "tests/programs/token_weights_ranks.py"], cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "rank 0 ok" in p.stdout and "rank 1 ok" in p.stdout, p.stderr[-3000:]
