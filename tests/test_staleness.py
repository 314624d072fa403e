"""--max-staleness k (issue 63 items 2 and 3, one process; grouprl/staleness.py): k = 0 is today's run bitwise; k = 2
samples step s with the weights at the start of step max(1, s - 2) (one version a step, whatever its optimizer steps),
the current weights back bitwise after; the rollout's logp is the stale policy's forward; the decoupled objective
(AReaL, arXiv 2505.24298 Sec. 5.2) by hand in float64 against grpo_loss with the rollout correction's flags; the
refusals in one line."""
import math
import os

import pytest
import torch

import common
from grouprl import staleness
from helpers import StubPolicy, fails_before_any_model, run_script

ARGV = ["--num-steps", "5", "--prompts-per-rank", "4", "--num-minibatches", "2", "--eval-every", "0",
        "--learning-rate", "1e-2", "--max-new-tokens", "4", "--log-samples", "0", "--save-every", "0"]


def split_reward(monkeypatch):
    """A reward every group splits (the parity of the characters' codes): a gradient from the first step."""
    monkeypatch.setattr(common, "score", lambda texts, *a, **kw: (
        torch.tensor([float(sum(map(ord, t)) % 2) for t in texts]), 0))


def no_timings(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_zero_is_todays_run_bitwise(monkeypatch, tmp_path):
    split_reward(monkeypatch)
    argv = ARGV[:1] + ["3"] + ARGV[2:]
    base, _ = run_script("grpo", argv, monkeypatch, tmp_path / "base")
    zero, _ = run_script("grpo", argv + ["--max-staleness", "0"], monkeypatch, tmp_path / "zero")
    assert no_timings(zero) == no_timings(base)
    assert base[-1]["losses/grad_norm"] > 0 and not any("stale/" in k for k in zero[0])


# (--gen-mode, k, W): the weights step s = 1..5 samples with, as the step they were held at the start of; TRL's
# staleness (live version (s - 1) // W minus the sampler's); the steps behind (logged when W > 1)
SAMPLED = [("shared-prefill", 2, 1, [1, 1, 1, 2, 3], [0, 1, 2, 2, 2], None),
           ("engine", 2, 1, [1, 1, 1, 2, 3], [0, 1, 2, 2, 2], None),
           ("shared-prefill", 1, 2, [1, 1, 1, 1, 3], [0, 0, 1, 1, 1], [0, 1, 2, 3, 2]),
           ("engine", 0, 2, [1, 1, 3, 3, 5], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0])]


@pytest.mark.parametrize("gen_mode,k,sync,held,behind,steps_behind", SAMPLED)
def test_samples_with_the_weights_k_versions_before(gen_mode, k, sync, held, behind, steps_behind, monkeypatch,
                                                     tmp_path):
    """Each step's generate sees the trainable weights the loop held at the start of step `held` (k = 2: max(1,
    s - 2); a version every W = --weight-sync-steps steps: the start of step 1 + W max(0, (s - 1) // W - k)), bitwise;
    after the rollout the loop holds its own weights again, bitwise; roll.logp is the forward of the weights that
    sampled; stale/versions_behind is TRL's staleness and stale/kl is 0 exactly when the sampler is current.
    --num-minibatches 2: two optimizer steps a step, one step (TRL's versions are weight syncs). The engine (its
    weights refreshed from the model at each rollout) samples with the stale weights too: its log-probs are their
    forward's, to float error."""
    import grpo

    split_reward(monkeypatch)
    start, used, forward, logp = {}, {}, {}, {}
    real_sample, real_generate = grpo.sample_groups, common.generate

    def weights(policy):
        return [p.detach().clone() for p in staleness.trainable(policy)]

    def sample_groups(policy, tok, train, step, *a):
        start[step] = weights(policy)
        roll = real_sample(policy, tok, train, step, *a)
        assert all(torch.equal(p, q) for p, q in zip(weights(policy), start[step]))  # restored, bitwise
        logp[step] = roll.logp
        return roll

    def generate(policy, *a, **kw):
        roll = real_generate(policy, *a, **kw)
        step = len(start)
        used[step] = weights(policy)
        with torch.no_grad():
            forward[step] = policy(roll.input_ids, roll.attention_mask, roll.n_prompt)
        return roll

    monkeypatch.setattr(grpo, "sample_groups", sample_groups)
    monkeypatch.setattr(common, "generate", generate)
    rows, _ = run_script("grpo", ARGV + ["--max-staleness", str(k), "--weight-sync-steps", str(sync), "--gen-mode",
                                         gen_mode], monkeypatch, tmp_path)
    assert [r["stale/versions_behind"] for r in rows] == behind
    assert [r.get("stale/steps_behind") for r in rows] == (steps_behind or [None] * 5)
    for s in range(1, 6):
        assert all(torch.equal(p, q) for p, q in zip(used[s], start[held[s - 1]])), s
        if held[s - 1] < s:  # the weights moved: the rollout is not the current policy's
            assert not all(torch.equal(p, q) for p, q in zip(used[s], start[s])), s
        assert torch.allclose(logp[s], forward[s], atol=1e-6 if gen_mode != "engine" else 1e-5), s
        assert (rows[s - 1]["stale/kl"] == 0) == (held[s - 1] == s), s


@pytest.mark.parametrize("k,sync,at,behind", [(2, 1, 2, [0, 1, 2, 2]), (0, 3, 2, [0, 0, 0, 0])])
def test_resume_is_exact(k, sync, at, behind, monkeypatch, tmp_path):
    """--resume step_{at}: the steps after it as the uninterrupted run's, bitwise: the checkpoint holds the ring of
    past weights: step 3 samples with the initial weights, not the resumed ones (k = 2: version 0; k = 0, W = 3: the
    last sync's, 2 steps behind)."""
    split_reward(monkeypatch)
    argv = ARGV[:1] + ["4"] + ARGV[2:-1] + [str(at), "--keep-checkpoints", "0", "--max-staleness", str(k),
                                             "--weight-sync-steps", str(sync)]
    whole, run = run_script("grpo", argv, monkeypatch, tmp_path)
    assert os.path.exists(os.path.join(run, f"step_{at}", "state", staleness.RING_FILE))
    rows, _ = run_script("grpo", argv + ["--resume", f"{run}/step_{at}"], monkeypatch, tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert no_timings(rows)[at:] == no_timings(whole)[at:]
    assert [r["stale/versions_behind"] for r in rows] == behind and rows[at]["stale/kl"] > 0


@pytest.mark.parametrize("mode,over", [("token-mask", 0.0), ("token-truncate", 5.0)])
def test_decoupled_term_by_hand(mode, over):
    """AReaL's decoupled objective (arXiv 2505.24298 Sec. 5.2; areal/utils/functional ppo_actor_loss_fn), one token a
    row, float64: -(1/N) sum_t (pi_prox / pi_behav) min(u A, clip(u, 1 - eps_lo, 1 + eps_hi) A), u = pi_theta /
    pi_prox, the behaviour weight masked past C (AReaL's token mask) or truncated at it; against grpo_loss with pi_old
    recomputed (= pi_prox) and --rollout-is-cap C --rollout-is-mode token-mask / token-truncate (old_log_probs)."""
    theta = [-1.0, -0.5, -2.0, -1.0]
    prox = [-1.1, -1.0, -1.0, -0.1]
    behav = [-1.3, -1.2, -1.1, -3.0]  # the last: pi_prox / pi_behav = e^2.9 > C = 5
    adv = [1.0, 1.0, -1.0, 1.0]
    cap, lo, hi, n = 5.0, 0.2, 0.28, 4
    expected, grads = 0.0, []
    for t, p, b, a in zip(theta, prox, behav, adv):
        w = math.exp(p - b)
        w = w if w <= cap else over
        u = math.exp(t - p)
        clipped = min(max(u, 1 - lo), 1 + hi)
        expected -= w * min(u * a, clipped * a) / n
        grads.append(-w * u * a / n if u * a <= clipped * a else 0.0)  # the min's unclipped branch
    ids = torch.arange(n)[:, None].repeat(1, 2)  # row r's ids are all r (StubPolicy)
    mask = torch.ones(n, 1, dtype=torch.float64)
    roll = common.Rollout(ids, torch.ones(n, 2, dtype=torch.long), 1, mask, torch.zeros(n, dtype=torch.bool),
                          [""] * n, torch.tensor(behav, dtype=torch.float64)[:, None], None)
    stub = StubPolicy(torch.tensor(prox, dtype=torch.float64)[:, None], torch.zeros(n, 1, dtype=torch.float64))
    old, weight, _, _ = common.old_log_probs(stub, roll, [slice(0, n)], "recompute", cap, None, mode)
    import grpo

    logp = torch.tensor(theta, dtype=torch.float64)[:, None].requires_grad_()
    loss, _, _ = grpo.grpo_loss(logp, old, torch.tensor(adv, dtype=torch.float64), mask, clip_low=lo,
                                clip_high=hi, loss_agg="token-mean", is_weight=weight)
    loss.backward()
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert logp.grad.flatten().tolist() == pytest.approx(grads, rel=1e-12, abs=1e-15)
    # --old-logp rollout: pi_old is the behaviour policy (AReaL without the decoupled loss), no weight
    old, weight, _, _ = common.old_log_probs(stub, roll, [slice(0, n)], "rollout", None)
    assert old is roll.logp and weight is None


@pytest.mark.parametrize("argv,env,needle", [
    (["--max-staleness", "-1"], {}, "--max-staleness -1: must be >= 0"),
    (["--max-staleness", "2"], {"RANK": "0"}, "under torchrun add --async-rollouts"),
    (["--async-rollouts"], {}, "--async-rollouts splits a torchrun job into trainers and rollout ranks"),
    (["--rollout-ranks", "2"], {}, "--rollout-ranks 2 sets how many ranks generate under --async-rollouts"),
    (["--async-rollouts"], {"RANK": "0", "WORLD_SIZE": "1"}, "leaves no trainer among 1 rank(s)"),
    (["--async-rollouts", "--dynamic-sampling"], {"RANK": "0", "WORLD_SIZE": "2"},
     "--async-rollouts with --dynamic-sampling: its rounds"),
    (["--weight-sync-steps", "0"], {}, "--weight-sync-steps 0: must be >= 1"),
    (["--weight-sync-steps", "2"], {"RANK": "0"}, "--weight-sync-steps 2 keeps past weights in one process"),
])
def test_refusals_in_one_line(argv, env, needle, monkeypatch, tmp_path):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)


def test_hf_modes_run_the_decoupled_objective_on_stale_rollouts(monkeypatch, tmp_path):
    """With --max-staleness > 0 the HF modes' rollouts carry the behaviour policy's log-probs, so the rollout
    correction (AReaL's decoupled objective) and --old-logp rollout run there; without it they still stop in one line
    (HF generate returns none)."""
    split_reward(monkeypatch)
    argv = ARGV[:1] + ["3"] + ARGV[2:] + ["--max-staleness", "1"]
    rows, _ = run_script("grpo", argv + ["--rollout-is-cap", "5", "--rollout-is-mode", "token-mask"], monkeypatch,
                         tmp_path / "decoupled")
    assert [r["stale/versions_behind"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout_is/kl"] == 0 and rows[2]["rollout_is/kl"] > 0  # a real gap once the sampler is behind
    rows, _ = run_script("grpo", argv + ["--old-logp", "rollout"], monkeypatch, tmp_path / "behaviour")
    assert all(r["perf/old_logp_s"] == 0.0 for r in rows)  # pi_old is the behaviour policy's, no forward pass
    fails_before_any_model("grpo", ["--rollout-is-cap", "5"], "(HF generate) returns none", monkeypatch, tmp_path)
