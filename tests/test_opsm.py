"""OPSM, --off-policy-mask delta (DeepSeek-V3.2 arXiv 2512.02556 eq. 9; TRL's get_off_policy_mask): a sequence with a
negative advantage whose mean log(pi_sample / pi_theta) over its tokens exceeds delta is dropped. The rule by hand in
float64 (common.off_policy_mask), then through two scripts' loops, that each measures against the policy it trains
(pi_theta, not pi_old) and the policy that sampled (the engine's pi_rollout when there is one). Issue 61 item 2."""
import dataclasses

import pytest
import torch

import common
from helpers import run_script

MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)


def test_the_rule_by_hand():
    """Mean log(pi_sample / pi_theta) of the rows: 0.3, 0.3, 0.3, -0.2 (padding not counted); A = (-1, 1, -2, -1). At
    delta 0.25 rows 1 and 3 go (negative A, over delta); row 2 stays (A > 0), row 4 stays (under delta)."""
    logp = torch.zeros(4, 3, dtype=torch.float64)
    sample = torch.tensor([[0.1, 0.3, 0.5], [0.4, 0.2, 9.0], [0.3, 9.0, 9.0], [-0.2, -0.2, -0.2]], dtype=torch.float64)
    adv = torch.tensor([-1.0, 1.0, -2.0, -1.0], dtype=torch.float64)
    out, (dropped, rows) = common.off_policy_mask(adv, logp, sample, MASK, 0.25)
    assert out.tolist() == [0.0, 1.0, 0.0, -1.0] and (dropped.item(), rows.item()) == (2, 4)
    # delta None: off, nothing measured
    assert common.off_policy_mask(adv, logp, sample, MASK, None) == (adv, None)


def test_on_policy_at_delta_zero_nothing_is_dropped():
    """pi_sample = pi_theta: every mean log-ratio is 0, which does not exceed delta = 0 (eq. 9's strict >): no row is
    dropped, whatever the advantages' signs."""
    logp = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = torch.tensor([-1.0, -0.5, -2.0, 1.0], dtype=torch.float64)
    out, (dropped, _) = common.off_policy_mask(adv, logp, logp.clone(), MASK, 0.0)
    assert dropped.item() == 0 and torch.equal(out, adv)


def test_a_token_advantage_row_is_judged_by_its_sum():
    """[B, T] advantages (GSPO-token): a row's sign is its sum's. Row 1 starts negative and sums to +1 (kept); row 2
    starts positive and sums to -1 (dropped, every token); row 3 sums to -1 but is on policy (kept)."""
    adv = torch.tensor([[-1.0, 2.0, 0.0], [2.0, -3.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    logp = torch.zeros(3, 3, dtype=torch.float64)
    sample = torch.tensor([[1.0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
    out, (dropped, rows) = common.off_policy_mask(adv, logp, sample, mask, 0.5)
    assert out.tolist() == [[-1.0, 2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]
    assert (dropped.item(), rows.item()) == (1, 3)


ARGV = ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "4", "--eval-every", "0",
        "--max-new-tokens", "4", "--log-samples", "0", "--save-every", "0", "--reward", "parity_reward61:f"]


@pytest.fixture
def parity(monkeypatch, tmp_path):
    """A reward most groups split (the completion's length, odd or even): negative advantages from the first step."""
    (tmp_path / "parity_reward61.py").write_text("def f(completion, answer):\n    return float(len(completion) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_grpo_measures_against_the_policy_it_trains(parity, monkeypatch, tmp_path):
    """HF generation: pi_sample is pi_old. On the second pass (--num-iterations 2) the first has lowered the
    log-probs of the negative-advantage rows, so their mean log(pi_old / pi_theta) is > 0: past delta 1e-4, some are
    dropped (measured against pi_old itself the log-ratio is 0 and nothing ever is)."""
    rows, _ = run_script("grpo", ARGV + ["--num-minibatches", "1", "--num-iterations", "2", "--learning-rate", "1e-2",
                                         "--off-policy-mask", "1e-4"], monkeypatch, tmp_path / "o")
    assert rows[0]["losses/opsm_frac"] > 0, rows[0]["losses/opsm_frac"]


def test_gspo_takes_pi_sample_from_the_engine(parity, monkeypatch, tmp_path):
    """--gen-mode engine: pi_sample is the engine's pi_rollout (roll.logp), not the recomputed pi_old. The rollout's
    log-probs are raised by 1 a token here, so every row's mean log(pi_sample / pi_theta) is ~1 > delta 0.5 on the
    first (on-policy) update: every negative-advantage row is dropped, and only those."""
    import gspo

    sample_groups = gspo.sample_groups
    negative = []

    def raised(*args, **kwargs):
        roll = sample_groups(*args, **kwargs)
        return dataclasses.replace(roll, logp=roll.logp + roll.mask)

    def advantages(*args, **kwargs):
        adv, zero = common.group_advantages(*args, **kwargs)
        negative.append((adv < 0).double().mean().item())
        return adv, zero

    monkeypatch.setattr(gspo, "sample_groups", raised)
    monkeypatch.setattr(gspo, "group_advantages", advantages)
    rows, _ = run_script("gspo", ARGV + ["--num-minibatches", "1", "--gen-mode", "engine", "--off-policy-mask", "0.5"],
                         monkeypatch, tmp_path / "o")
    assert negative[0] > 0 and rows[0]["losses/opsm_frac"] == pytest.approx(negative[0])
