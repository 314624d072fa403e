"""One gradient whatever the batching: a minibatch's parameter gradient does not depend on --micro-batch-size (here)
nor on the world size (tests/programs/fsdp_grad.py under torchrun, in test_train.py), because every loss is divided by
the minibatch's count over all ranks (`norm`) and FSDP2 sums the ranks' gradients. Normalising per micro-batch instead,
the bug this guards against, is shown to fail the same check."""
import pytest
import torch

import common
from grouprl import distributed
from grouprl import modeling
from cispo import cispo_loss
from dfpo import dfpo_loss, group_weights, sequence_weights
from gmpo import gmpo_loss
from sapo import sapo_loss
from vespo import vespo_loss
from grpo import grpo_loss
from gspo import gspo_loss
from gspo_token import gspo_token_loss
from helpers import run_script

G, B, P, T = 4, 16, 6, 7
LOSSES = {
    "gspo": (gspo_loss, dict(clip_low=0.004, clip_high=0.005)),
    "grpo": (grpo_loss, dict(clip_low=0.04, clip_high=0.05)),
    "gspo_token": (gspo_token_loss, dict(clip_low=0.004, clip_high=0.005)),
    "dfpo": (dfpo_loss, dict(group_size=G, clip_low=0.004, clip_high=0.005, transform="orth-proj-qp")),
    "grpo token-mean": (grpo_loss, dict(clip_low=0.04, clip_high=0.05, loss_agg="token-mean")),
    "gspo_token dr-grpo": (gspo_token_loss, dict(clip_low=0.004, clip_high=0.005, loss_agg="seq-mean-token-sum-norm",
                                                 max_new_tokens=T)),
    "cispo token-mean": (cispo_loss, dict(clip_low=0.04, clip_high=0.05, loss_agg="token-mean")),
    "sapo": (sapo_loss, dict(tau_pos=1.0, tau_neg=1.05)),
    "gmpo": (gmpo_loss, dict(clip_low=0.04, clip_high=0.05)),
    "vespo token-mean": (vespo_loss, dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, loss_agg="token-mean")),
}


@pytest.fixture(scope="module")
def setup():
    """The tiny model and one minibatch of 4 groups: left padding, ragged completions, pi_old a little off."""
    tok = modeling.tiny_tokenizer()
    policy = modeling.Policy(modeling.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=0)[0], 1.0, 16)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    am[::3, :2] = 0
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
    am[:, P:] = mask.long()
    ids = ids.masked_fill(am == 0, tok.pad_token_id)
    with torch.no_grad():
        old = policy(ids, am, P) + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return policy, (ids, am, mask, old, adv, (adv[:, None] + torch.randn(B, T, generator=g)) * mask)


def minibatch_grad(setup, name, micro, per_micro_mean=False, dfpo_own_groups=False, weights=None):
    """The scripts' inner loop on one minibatch: micro-batches of `micro` sequences (a micro-batch may split a group),
    the loss divided by the minibatch count; DFPO with split groups first takes s_tilde from the whole groups in a
    no-grad pass, as dfpo.py does (dfpo_own_groups: the bug of transforming each micro-batch as if it were groups)."""
    policy, (ids, am, mask, old, adv, token_adv) = setup
    loss_fn, kw = LOSSES[name]
    a = token_adv if name.startswith("gspo_token") else adv
    norm = mask.sum().item() if kw.get("loss_agg") == "token-mean" else B  # what the scripts' loop computes
    micro_batches, s_tilde = common.micro_batches(slice(0, B), micro), None
    if name == "dfpo" and micro % G and not dfpo_own_groups:
        with torch.no_grad():
            logp = torch.cat([policy(ids[mu], am[mu], P) for mu in micro_batches])
            _, _, s_bar = sequence_weights(logp, old, a, mask, clip_low=kw["clip_low"], clip_high=kw["clip_high"])
            s_tilde = group_weights(s_bar, a, mask, group_size=G, transform=kw["transform"], floor=1e-6,
                                    length_aware=False)
    policy.zero_grad(set_to_none=True)
    for mu in micro_batches:
        given = {"group_size": micro} if dfpo_own_groups else {} if s_tilde is None else {"s_tilde": s_tilde[mu]}
        if weights is not None:  # the step's token weights (--rollout-is-cap, --top-entropy-quantile), sliced
            given.update(is_weight=weights[0][mu], keep=weights[1][mu])
        loss, _, _ = loss_fn(policy(ids[mu], am[mu], P), old[mu], a[mu], mask[mu], **{**kw, **given},
                              norm=None if per_micro_mean else norm)
        loss.backward()
    return [p.grad.clone() for p in policy.parameters()]


def close(grads, ref, rtol=1e-5):
    return all(torch.allclose(g, r, rtol=rtol, atol=rtol * r.abs().max().item()) for g, r in zip(grads, ref))


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batch_size_does_not_change_the_gradient(setup, name):
    whole = minibatch_grad(setup, name, 0)
    assert all(r.abs().max() > 0 for r in whole)
    for micro in (1, 2, 3, G, 2 * G):  # single sequences, pairs, 3s (ragged, across groups), one and two groups
        assert close(minibatch_grad(setup, name, micro), whole), (name, micro)
    # the bug class: each micro-batch divided by its own count gives 4x the gradient with 4 micro-batches
    wrong = minibatch_grad(setup, name, G, per_micro_mean=True)
    assert not close(wrong, whole)
    if "token-mean" not in name:  # per-sequence counts: exactly 4x; token-mean: each micro-batch by its own tokens
        assert close(wrong, [4 * r for r in whole])
    if name == "dfpo":  # DFPO's own bug: the transform applied to each half of a group as if it were the group
        assert not close(minibatch_grad(setup, name, 2, dfpo_own_groups=True), whole)


@pytest.mark.parametrize("name", LOSSES)
def test_token_weights_keep_the_gradient_micro_batch_invariant(setup, name):
    """With rollout-correction weights and the high-entropy mask, fixed for the step as the loop computes them."""
    mask = setup[1][2]
    g = torch.Generator().manual_seed(5)
    weights = (0.5 + torch.rand(B, T, generator=g), (torch.rand(B, T, generator=g) < 0.6).float() * mask)
    whole = minibatch_grad(setup, name, 0, weights=weights)
    assert not close(whole, minibatch_grad(setup, name, 0))  # the weights act
    for micro in (1, 3, G):
        assert close(minibatch_grad(setup, name, micro, weights=weights), whole), (name, micro)


def pass_grads(setup, name, micro, mu=2, lr=0.5):
    """The scripts' loop over one rollout of 16 rows: mu passes (--num-iterations) over 2 minibatches of 2 groups, an
    SGD step after each; old log-probs fixed for the rollout. Returns every update's gradient, in order."""
    policy, (ids, am, mask, old, adv, token_adv) = setup
    loss_fn, kw = LOSSES[name]
    a = token_adv if name.startswith("gspo_token") else adv
    start = [p.detach().clone() for p in policy.parameters()]
    grads = []
    try:
        for mb in common.minibatches(B // G, G, 2) * mu:
            norm = mask[mb].sum().item() if kw.get("loss_agg") == "token-mean" else mb.stop - mb.start
            s_tilde = None
            if name == "dfpo" and micro % G:
                with torch.no_grad():
                    logp = torch.cat([policy(ids[m], am[m], P) for m in common.micro_batches(mb, micro)])
                    _, _, s_bar = sequence_weights(logp, old[mb], a[mb], mask[mb], clip_low=kw["clip_low"],
                                                   clip_high=kw["clip_high"])
                    s_tilde = torch.zeros(B)
                    s_tilde[mb] = group_weights(s_bar, a[mb], mask[mb], group_size=G, transform=kw["transform"],
                                                floor=1e-6, length_aware=False)
            policy.zero_grad(set_to_none=True)
            for m in common.micro_batches(mb, micro):
                given = {} if s_tilde is None else {"s_tilde": s_tilde[m]}
                loss, _, _ = loss_fn(policy(ids[m], am[m], P), old[m], a[m], mask[m], **kw, **given, norm=norm)
                loss.backward()
            grads.append([p.grad.clone() for p in policy.parameters()])
            with torch.no_grad():
                for p in policy.parameters():
                    p -= lr * p.grad
    finally:
        with torch.no_grad():
            for p, p0 in zip(policy.parameters(), start):
                p.copy_(p0)
        policy.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("name", ["gspo", "grpo token-mean", "dfpo"])  # sequence-level, token-count norm, s_tilde
def test_every_pass_has_the_same_gradient_whatever_the_micro_batching(setup, name):
    """--num-iterations 2: each of the 4 updates of a rollout (2 passes x 2 minibatches, pi_old fixed) gets the same
    gradient for micro-batches of the whole minibatch and of 3 sequences; and the second pass is not the first
    (pi_theta has moved away from where the first pass saw it)."""
    whole = pass_grads(setup, name, 0)
    assert len(whole) == 4
    for micro in (3,):  # ragged, across groups
        for update, (grads, ref) in enumerate(zip(pass_grads(setup, name, micro), whole)):
            assert close(grads, ref, rtol=1e-4), (name, micro, update)
    for first, second in zip(whole[:2], whole[2:]):
        assert not close(second, first, rtol=1e-3)


@pytest.mark.parametrize("script, extra", [("gspo", []), ("grpo", ["--clip-low", "1e-4", "--clip-high", "1e-4"]),
                                           ("dfpo", [])])
def test_script_num_iterations(script, extra, monkeypatch, tmp_path):
    """--num-iterations 2 with one minibatch: the second update sees pi_theta != pi_old (the ratios move off 1, the
    clip acts), the optimizer steps once an update (6 over 3 steps) and the cosine schedule counts mu x
    num_minibatches optimizer steps a rollout: after step 1 of 3, 2 of 6 updates are done, lr = 0.5 (1 + cos(pi / 3))
    = 0.75 of the peak (min-lr-ratio 0). Through the loops of gspo.py, grpo.py and dfpo.py (each its own)."""
    (tmp_path / "dense_reward15.py").write_text("def f(completion, answer):\n    return float(len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    steps, adamw_step = [], torch.optim.AdamW.step

    def counted(optimizer, *args, **kwargs):
        steps.append(1)
        return adamw_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    rows, _ = run_script(script, ["--num-steps", "3", "--prompts-per-rank", "4", "--group-size", "4",
                                  "--num-minibatches", "1", "--num-iterations", "2", "--eval-every", "0",
                                  "--reward", "dense_reward15:f", "--learning-rate", "1e-3", "--lr-schedule",
                                  "cosine", "--min-lr-ratio", "0", "--save-every", "0", *extra], monkeypatch,
                         tmp_path / "o")
    assert len(steps) == 6, len(steps)
    assert rows[0]["charts/learning_rate"] == pytest.approx(1e-3 * 0.75, rel=1e-9)
    moved = max(rows[0]["losses/ratio_max"] - 1, 1 - rows[0]["losses/ratio_min"])
    assert moved > 1e-4, moved  # with one minibatch and mu = 1 the ratios are 1 to float error
    assert rows[0]["losses/clipfrac"] > 0
    # the second pass over the one minibatch is a later update: its log-ratio spread is not the first's (which is 0)
    assert rows[0]["losses/log_ratio_var_later"] > 0 and rows[0]["losses/log_ratio_var_first"] < 1e-12


def test_micro_batches():
    assert common.micro_batches(slice(16, 32), 8) == [slice(16, 24), slice(24, 32)]
    assert common.micro_batches(slice(16, 32), 0) == [slice(16, 32)]
    assert common.micro_batches(slice(0, 12), 8) == [slice(0, 8), slice(8, 12)]
    assert common.micro_batches(slice(4, 7), 1) == [slice(4, 5), slice(5, 6), slice(6, 7)]


@pytest.mark.parametrize("script, extra", [("gspo", []), ("grpo", []), ("gspo_token", []), ("dfpo", []),
                                           ("cispo", ["--clip-low", "0.01", "--clip-high", "0.01"]),
                                           ("sapo", ["--clip-low", "0.01", "--clip-high", "0.01"]),
                                           ("gmpo", ["--clip-low", "0.01", "--clip-high", "0.01"]),
                                           ("vespo", ["--clip-low", "0.01", "--clip-high", "0.01"]),
                                           ("grpo", ["--loss-agg", "token-mean"]),
                                           # --num-iterations 2 end to end (the fast per-pass check is above)
                                           pytest.param("dfpo", ["--num-iterations", "2"], marks=pytest.mark.slow)])
def test_script_micro_batching_logs_the_same_gradient(script, extra, monkeypatch, tmp_path):
    """End to end through each script's loop: one step, 2 minibatches of 8 groups of 8, in micro-batches of the whole
    minibatch, of 1 sequence and of 3 sequences (21 x 3 + 1; DFPO: s_tilde from the whole groups first). The logged
    means too: a token-weighted one (clipfrac, approx_kl) is the minibatch's, not a mean over micro-batches."""
    (tmp_path / "dense_reward14.py").write_text("def f(completion, answer):\n    return float(len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # every group has a spread: the first minibatch moves the policy
    rows = []
    for micro in ("0", "1", "3"):
        out = tmp_path / micro
        rows.append(run_script(script, ["--num-steps", "1", "--prompts-per-rank", "16", "--num-minibatches", "2",
                                        "--eval-every", "0", "--micro-batch-size", micro, "--reward",
                                        "dense_reward14:f", "--learning-rate", "1e-3", *extra], monkeypatch,
                               out)[0][0])
    for row in rows[1:]:
        for key in ("losses/grad_norm", "losses/policy_loss", "losses/ratio_mean", "losses/asym", "losses/shared_coef",
                    "losses/clipfrac", "losses/clipfrac_seq", "losses/approx_kl", "losses/log_ratio_var_later"):
            assert row[key] == pytest.approx(rows[0][key], rel=1e-5, abs=1e-7), key
        assert row["charts/reward_mean"] == rows[0]["charts/reward_mean"]
    assert rows[0]["losses/grad_norm"] > 0 and rows[0]["losses/asym"] > 0
    assert rows[0]["losses/clipfrac"] > 0 and rows[0]["losses/approx_kl"] > 0  # the first minibatch moved the policy


@pytest.mark.parametrize("script, argv, message", [
    ("gspo", ["--micro-batch-size", "-1"], "--micro-batch-size -1: must be >= 1 sequences, or 0"),
    ("dfpo", ["--micro-batch-size", "3", "--no-stop-grad"], "--no-stop-grad differentiates through each group's"),
    ("dfpo", ["--length-aware", "--transform", "scale"], "--transform scale does not cancel"),
])
def test_micro_batch_size_errors(script, argv, message, monkeypatch, tmp_path):
    module = __import__(script)
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert message in str(e.value.code)
