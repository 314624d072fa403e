"""--old-logp rollout and --rollout-is-cap (issue 36 item 1): the TIS weight and its logs against their hand
computation in float64, the weighted GRPO and GSPO-token losses and gradients by hand, and, with the engine decoding
in the trainer's dtype (fp32 on the CPU), both options equal to the recomputed run to float tolerance."""
import glob
import math

import pytest
import torch

import common
from conftest import SCRIPTS
from helpers import run_script, StubPolicy, trl_is_ratio

# two completions of 3 tokens, the second with 2 (its third position is padding)
OLD = [[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]]  # pi_old as the training forward computes it
ROLL = [[-1.5, -1.0, -0.5 - math.log(3)], [-0.3, -0.7 - math.log(2.5), 5.0]]  # pi_rollout as the engine sampled
MASK = [[1, 1, 1], [1, 1, 0]]
CAP = 2.0
# min(pi_old / pi_rollout, C), token by token: e^0.5, e^-1, 3 -> 2; 1, 2.5 -> 2 (the padding: not counted)
WEIGHTS = [math.exp(0.5), math.exp(-1.0), 2.0, 1.0, 2.0]


def rollout():
    ids = torch.arange(2)[:, None].repeat(1, 5)  # 2 prompt + 3 completion positions
    return common.Rollout(ids, torch.ones(2, 5, dtype=torch.long), 2, torch.tensor(MASK, dtype=torch.float32),
                          torch.zeros(2, dtype=torch.bool), ["", ""], torch.tensor(ROLL), None)


def test_tis_weight_and_its_logs_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    policy = StubPolicy(torch.tensor(OLD), entropy)
    roll = rollout()
    old_logp, weight, keep, stats = common.old_log_probs(policy, roll, [slice(0, 1), slice(1, 2)], "recompute", CAP)
    assert torch.equal(old_logp, torch.tensor(OLD))
    got = weight.double()[torch.tensor(MASK).bool()].tolist()
    assert got == pytest.approx(WEIGHTS, rel=1e-6)
    assert stats["rollout_is/weight_mean"] == pytest.approx(sum(WEIGHTS) / 5, rel=1e-6)
    assert stats["rollout_is/capped_frac"] == pytest.approx(2 / 5)  # 3 and 2.5 are over C = 2
    assert stats["losses/entropy"] == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)
    # no cap: no weight, the same pi_old; rollout: the engine's log-probs, no forward at all
    assert common.old_log_probs(policy, roll, [slice(0, 2)], "recompute", None)[1] is None
    none = StubPolicy(None, None)
    logp, weight, keep, stats = common.old_log_probs(none, roll, [slice(0, 2)], "rollout", None)
    assert logp is roll.logp and weight is None and stats == {"perf/old_logp_s": 0.0}


@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-truncate", "sequence-mask"])
@pytest.mark.parametrize("clip_min", [None, 0.5])
def test_rollout_correction_modes_equal_trls(mode, clip_min):
    """Every --rollout-is-mode, with and without C_min, gives TRL's ratio on every completion token (TRL's (B, 1)
    sequence ratio broadcast over the tokens, as its per_token_loss * ratio does); the logged fraction outside
    [C_min, C_max] and the mismatch (k3 KL and chi-square over tokens) by hand."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    sampling = old + 0.6 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([6, 4, 2, 5])[:, None]).double()
    roll = common.Rollout(torch.arange(4)[:, None].repeat(1, 8), torch.ones(4, 8, dtype=torch.long), 2, mask,
                          torch.zeros(4, dtype=torch.bool), [""] * 4, sampling, None)
    _, weight, _, stats = common.old_log_probs(StubPolicy(old, torch.zeros(4, 6)), roll, [slice(0, 4)], "recompute", 3.0,
                                            None, mode, clip_min)
    theirs = trl_is_ratio(old, sampling, mask, mode.replace("-", "_"), clip_min, 3.0)
    torch.testing.assert_close(weight * mask, (theirs * mask).to(weight.dtype), rtol=1e-12, atol=0)
    rho = torch.exp(old - sampling)[mask.bool()]
    level = torch.exp(((old - sampling) * mask).sum(1, keepdim=True)).expand_as(mask)[mask.bool()] \
        if mode.startswith("sequence") else rho
    out = ((level > 3.0) | (level < (clip_min or 0.0))).double().mean().item()
    key = "rollout_is/capped_frac" if mode.endswith("truncate") else "rollout_is/masked_frac"
    assert stats[key] == pytest.approx(out) and 0 < out < 1
    assert stats["rollout_is/kl"] == pytest.approx((rho - 1 - rho.log()).mean().item())
    assert stats["rollout_is/chi2"] == pytest.approx((rho ** 2).mean().item() - 1)
    assert stats["rollout_is/weight_mean"] == pytest.approx(weight[mask.bool()].mean().item())


def test_sequence_mask_by_hand():
    """sequence-mask, C_max = 2: the first completion's ratio is e^0.5 e^-1 3 = 1.82 (kept, on each of its tokens),
    the second's 1 x 2.5 = 2.5 (masked: 0)."""
    roll = rollout()
    _, weight, _, stats = common.old_log_probs(StubPolicy(torch.tensor(OLD), torch.zeros(2, 3)), roll,
                                            [slice(0, 2)], "recompute", CAP, None, "sequence-mask")
    first = math.exp(0.5) * math.exp(-1.0) * 3
    assert weight[0].tolist() == pytest.approx([first] * 3) and weight[1, :2].tolist() == [0.0, 0.0]
    assert stats["rollout_is/masked_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("script", ["grpo", "gspo_token"])
def test_tis_weight_multiplies_each_token_term(script):
    """At pi = pi_old every ratio is 1 (inside the clip), so the objective is 1/B sum_i 1/|y_i| sum_t A_i v_it and
    d loss / d log pi_it = -A_i v_it / (|y_i| B), v the TIS weights."""
    import importlib

    mod = importlib.import_module(script)
    loss_fn = mod.grpo_loss if script == "grpo" else mod.gspo_token_loss
    mask = torch.tensor(MASK, dtype=torch.float32)
    v = torch.ones(2, 3)
    v[mask.bool()] = torch.tensor(WEIGHTS, dtype=torch.float32)
    A = torch.tensor([1.0, -1.0])
    adv = A if script == "grpo" else A[:, None] * mask  # GSPO-token takes A_it
    logp = torch.tensor(OLD, requires_grad=True)
    loss, _, _ = loss_fn(logp, torch.tensor(OLD), adv, mask, clip_low=0.2, clip_high=0.27, is_weight=v)
    loss.backward()
    w = WEIGHTS
    seq0, seq1 = (w[0] + w[1] + w[2]) / 3, -(w[3] + w[4]) / 2
    assert loss.item() == pytest.approx(-(seq0 + seq1) / 2, rel=1e-6)
    grad = [[-w[0] / 6, -w[1] / 6, -w[2] / 6], [w[3] / 4, w[4] / 4, 0.0]]
    assert torch.allclose(logp.grad.double(), torch.tensor(grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)


KEYS = ["charts/reward_mean", "losses/policy_loss", "losses/clipfrac", "losses/ratio_mean", "losses/approx_kl",
        "losses/grad_norm", "losses/asym"]


class LoopSpy:
    """What a script's own loop hands its loss, call by call (log pi_theta, log pi_old), and how many optimizer steps
    it takes: --num-iterations 2 over 2 minibatches is 4 updates, the minibatches' order twice."""

    def __init__(self, module, name, monkeypatch):
        self.calls, self.steps, loss = [], 0, getattr(module, name)
        step = torch.optim.AdamW.step

        def spy_loss(logp, old_logp, *args, **kwargs):
            self.calls.append((logp.detach().clone(), old_logp.detach().clone()))
            return loss(logp, old_logp, *args, **kwargs)

        def spy_step(optimizer, *args, **kwargs):
            self.steps += 1
            return step(optimizer, *args, **kwargs)

        monkeypatch.setattr(module, name, spy_loss)
        monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)

    def check(self, minibatches=2, passes=2):
        """pi_old is fixed across the passes (the same tensor, not recomputed); pi_theta of the first minibatch is
        pi_old (up to float error); every update is applied: the second pass sees each minibatch at a moved policy,
        and the optimizer stepped once an update."""
        assert len(self.calls) == minibatches * passes and self.steps == minibatches * passes, (len(self.calls),
                                                                                               self.steps)
        first, *_ = self.calls
        assert torch.allclose(first[0], first[1], atol=1e-5)
        for k in range(minibatches):
            (logp1, old1), (logp2, old2) = self.calls[k], self.calls[k + minibatches]
            assert torch.equal(old1, old2), k
            assert (logp2 - logp1).abs().max() > 1e-5, k


@pytest.mark.parametrize("script, extra", [*[(s, ["--old-logp", "rollout"]) for s in SCRIPTS],
                                           ("grpo", ["--rollout-is-cap", "2"]),
                                           ("gmpo", ["--rollout-is-cap", "2", "--rollout-is-mode", "sequence-mask"])])
def test_engine_logprobs_in_the_trainers_dtype_equal_the_recomputed_run(script, extra, monkeypatch, tmp_path):
    """The engine decodes in fp32 on the CPU, as the trainer computes: pi_rollout = pi_old up to float error, so
    taking pi_old from the rollout, or weighting by min(pi_old / pi_rollout, 2) ~ 1, changes no number beyond it;
    end to end through every script's loop, with --num-iterations 2 (LoopSpy: pi_old fixed, every update applied)."""
    from transformers import AutoModelForCausalLM

    import importlib

    # a reward every group splits (the parity of the characters' codes): a gradient from the first step
    monkeypatch.setattr(common, "score", lambda texts, *a, **kw: (  # common.sample_groups scores
        torch.tensor([float(sum(map(ord, t)) % 2) for t in texts]), 0))
    argv = ["--num-steps", "1", "--prompts-per-rank", "4", "--num-minibatches", "2", "--eval-every", "0",
            "--gen-mode", "engine", "--learning-rate", "1e-2", "--max-new-tokens", "4", "--log-samples", "0",
            "--num-iterations", "2"]
    if script in ("cispo", "sapo", "gmpo", "vespo"):  # ratios off 1 but inside these objectives' bands
        argv += ["--clip-low", "0.01", "--clip-high", "0.01"] if script != "sapo" else []
    spies = []
    runs = []
    for out, more in (("recompute", []), ("option", extra)):
        spies.append(LoopSpy(importlib.import_module(script), f"{script}_loss", monkeypatch))
        runs.append(run_script(script, argv + more, monkeypatch, tmp_path / out))
        spies[-1].check()
    (base, base_dir), (rows, run_dir) = runs
    assert all(r["losses/grad_norm"] > 0 and r["losses/approx_kl"] > 1e-7 for r in base)  # the ratios moved
    for a, b in zip(base, rows):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
    if "--rollout-is-cap" in extra:
        assert all(r["rollout_is/weight_mean"] == pytest.approx(1, abs=1e-5) for r in rows)
        key = "rollout_is/masked_frac" if "sequence-mask" in extra else "rollout_is/capped_frac"
        assert all(r[key] == 0 for r in rows)
    else:
        assert "losses/entropy" in base[0] and "losses/entropy" not in rows[0]  # no old pass: no entropy
        assert "gen/logp_drift" in base[0] and "gen/logp_drift" not in rows[0]  # pi_old is pi_rollout
        # perf/old_logp_s, the pass the option saves: a forward of the rollout against returning it
        assert all(r["perf/old_logp_s"] < a["perf/old_logp_s"] for a, r in zip(base, rows))
        for (_, old_a), (_, old_b) in zip(spies[0].calls, spies[1].calls):  # the engine's pi_old, to float error
            assert torch.allclose(old_a, old_b, atol=1e-5)
    (a,) = glob.glob(f"{base_dir}/step_1/model")
    (b,) = glob.glob(f"{run_dir}/step_1/model")
    pa = dict(AutoModelForCausalLM.from_pretrained(a).named_parameters())
    pb = dict(AutoModelForCausalLM.from_pretrained(b).named_parameters())
    # AdamW moves a weight by ~lr whatever its gradient's size: where a gradient is at float noise (~1e-9) the two
    # runs' noise differs and so may those updates; the weights agree far inside one step (2 steps of 1e-2)
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) < 1e-3
