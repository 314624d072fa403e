"""The tiny Mixture-of-Experts model and its routing (issue 36 items 3-5): every script trains --model tiny-moe (the
engine's one fallback line said), the flip fraction counted by hand on a router whose outputs are set, and Routing
Replay: the first minibatch's ratios are 1, the loss sees no flipped expert, and the forced experts are weighted by
the current router (softmax over all experts at the forced ones, renormalised), by hand."""
import glob
import math
import os

import pytest
import torch

import common
from grouprl import data
from grouprl import distributed
from grouprl import modeling
from grouprl import moe
from conftest import SCRIPTS
from helpers import read_rows, run_script, torchrun
from grouprl.sampling import Sampling


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_trains_tiny_moe(script, monkeypatch, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    rows, run = run_script(script, ["--model", "tiny-moe", "--num-steps", "1", "--prompts-per-rank", "4",
                                    "--num-minibatches", "2", "--eval-every", "0", "--gen-mode", "engine",
                                    "--log-samples", "0"], monkeypatch, tmp_path)
    err = capsys.readouterr().err
    assert err.count("--gen-mode engine does not cover model_type 'qwen3_moe'") <= 1  # said once a process
    assert "gen/logp_drift" not in rows[0]  # HF generate ran in the engine's place: no sampled log-probs
    for row in rows:
        assert 0 <= row["moe/route_flip_frac"] <= 1 and 0 <= row["moe/route_flip_frac_loss"] <= 1
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    trained = AutoModelForCausalLM.from_pretrained(f"{run}/step_1/model")
    assert trained.config.model_type == "qwen3_moe" and trained.config.num_experts == 8


class Gate(torch.nn.Module):
    """A router whose output (logits [N, E], top-k weights, top-k index [N, k]) is set by the test."""

    def __init__(self):
        super().__init__()
        self.norm_topk_prob = True
        self.out = None

    def forward(self, x):
        return self.out


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.gate = Gate()
        self.mlp.experts = torch.nn.Module()


class FakeLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer()])

    def get_decoder(self):
        return self


def route(lm, logits, index):
    gate = lm.layers[0].mlp.gate
    gate.out = (torch.tensor(logits), torch.full((len(index), 2), 0.5), torch.tensor(index))
    return gate(None)


@pytest.mark.parametrize("replay", [False, True])
def test_flip_fraction_and_forced_weights_by_hand(replay):
    """2 rows of 2 positions (row 1's first is left padding), top 2 of 4 experts, minibatches of one row.
    Old pass: row 0 {0,1} {2,3}; row 1 {0,1} {1,2}. After the step: row 0 {1,0} {2,3} (no flip: order is not
    routing), row 1 {3,2} (padding: not counted) {1,3}: 1 of its 2 selections flipped. route_flip_frac (minibatch 2)
    = 1 / 2; route_flip_frac_loss = 1 / 6 over every counted selection, 0 when the old experts are forced. Forced
    {1, 2} under logits log(1, 2, 3, 4): softmax 0.1 .. 0.4, renormalised over {1, 2}: 0.2 / 0.5, 0.3 / 0.5."""
    lm = FakeLM()
    routes = moe.Routes(lm, replay)
    am = torch.tensor([[1, 1], [0, 1]])
    logits = [[0.0, math.log(2), math.log(3), math.log(4)]] * 2
    with moe.recording(routes, slice(0, 1), am):
        route(lm, logits, [[0, 1], [2, 3]])
    with moe.recording(routes, slice(1, 2), am):
        route(lm, logits, [[0, 1], [1, 2]])
    assert routes.tape[0].dtype == torch.uint8 and routes.tape[0].shape == (2, 2, 2)  # 1 byte a selection
    with moe.replaying(routes, slice(0, 1)):
        route(lm, logits, [[1, 0], [2, 3]])
    with moe.replaying(routes, slice(1, 2)):
        _, weights, index = route(lm, logits, [[3, 2], [1, 3]])
    stats = moe.stats(routes)
    assert stats["moe/route_flip_frac"] == pytest.approx(1 / 2)
    assert stats["moe/route_flip_frac_loss"] == pytest.approx(0 if replay else 1 / 6)
    if replay:
        assert index.tolist() == [[0, 1], [1, 2]]
        assert weights.double().tolist() == [pytest.approx([0.1 / 0.3, 0.2 / 0.3]), pytest.approx([0.4, 0.6])]
    else:
        assert index.tolist() == [[3, 2], [1, 3]]
    assert route(lm, logits, [[3, 2], [1, 3]])[2].tolist() == [[3, 2], [1, 3]]  # outside the contexts: untouched


def tiny_moe_rollout():
    d = distributed.Dist(0, 1, torch.device("cpu"))
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny-moe", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 64, False)
    prompts = data.chat_prompts(tok, [r["prompt"] for r in data.builtin_task(8, 0)], False)
    roll = common.generate(policy.eval(), tok, prompts, 4, modeling.eos_ids(lm, tok), d,
                           Sampling(max_new_tokens=8, gen_batch_size=64))
    return lm, policy, roll


@pytest.mark.parametrize("replay", [False, True])
def test_routing_replay_on_tiny_moe(replay):
    """The old pass tapes the experts; minibatch 1 (before any step) has ratios of 1 and no flips; after one AdamW
    step the router itself picks other experts for some of minibatch 2's (token, layer)s, and the loss sees them
    unless they are replayed; replayed experts are weighted by the current router by hand."""
    torch.manual_seed(0)
    lm, policy, roll = tiny_moe_rollout()
    routes = moe.track(lm, replay)
    captured = []
    for gate in routes.gates:  # after moe's hook: what the experts receive
        gate.register_forward_hook(lambda m, i, out: captured.append(out) if routes.mode == "train" else None)
    ids, am, P, mask = roll.input_ids, roll.attention_mask, roll.n_prompt, roll.mask
    slices = common.minibatches(8, 4, 2)
    old_logp, _, _, _ = common.old_log_probs(policy, roll, slices, "recompute", None, routes)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    policy.train()
    with moe.replaying(routes, slices[0]):
        logp = policy(ids[slices[0]], am[slices[0]], P)
    log_w = (logp - old_logp[slices[0]]) * mask[slices[0]]
    assert log_w.abs().max().item() < 1e-6  # w_it = 1 on the first minibatch (the old pass is a batch of 2x)
    first = moe.stats(routes)
    assert first["moe/route_flip_frac_loss"] == 0
    (-(logp * mask[slices[0]] * torch.randn(16, 1)).sum()).backward()
    optimizer.step()
    captured.clear()
    with moe.replaying(routes, slices[1]):
        policy(ids[slices[1]], am[slices[1]], P)
    stats = moe.stats(routes)
    assert stats["moe/route_flip_frac"] > 0.01  # the router moved
    assert (stats["moe/route_flip_frac_loss"] == 0) == replay
    for layer, (logits, weights, index) in enumerate(captured):
        tape = routes.tape[layer][slices[1]].reshape(-1, 2).long()
        if replay:
            assert torch.equal(index, tape)
            probs = torch.softmax(logits.double(), -1).gather(1, tape)
            assert torch.allclose(weights.double(), probs / probs.sum(-1, keepdim=True), atol=1e-6)
    assert len(captured) == len(routes.gates) == 2


def test_log_ratio_variance_by_hand():
    """Var(log w_it) over the completion tokens, kept apart for the first minibatch and the later ones, summed over
    micro-batches as one population: later micro-batches log w = (0.1, -0.2 | 0.3, masked 5.0): mean 0.2 / 3,
    E[x^2] = 0.14 / 3, Var = 0.14 / 3 - (0.2 / 3)^2; the first minibatch's log w = 0 exactly: Var 0; no later
    minibatch at all: the key is absent, not 0."""
    first = common.log_ratio_spread(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), first=True)
    a = common.log_ratio_spread(torch.tensor([[0.1, -0.2]]), torch.zeros(1, 2), torch.ones(1, 2), first=False)
    b = common.log_ratio_spread(torch.tensor([[0.8, 6.0]]), torch.tensor([[0.5, 1.0]]), torch.tensor([[1.0, 0.0]]),
                                first=False)
    out = common.reduce_stats([first, a, b])
    assert out["losses/log_ratio_var_later"] == pytest.approx(0.14 / 3 - (0.2 / 3) ** 2, rel=1e-6)
    assert out["losses/log_ratio_var_first"] == 0
    assert "losses/log_ratio_var_later" not in common.reduce_stats([first])


@pytest.mark.slow
def test_tiny_moe_under_torchrun_two_ranks(tmp_path):
    """FSDP2 over the MoE decoder layers, 2 ranks with gloo: GRPO with Routing Replay trains, the flip fractions
    are the same number on both ranks' logs (all-reduced), and the checkpoint gathers to a Qwen3-MoE."""
    from transformers import AutoModelForCausalLM

    p = torchrun("grpo.py", "--model", "tiny-moe", "--routing-replay", "--num-steps", "2", "--prompts-per-rank", "4",
                 "--num-minibatches", "2", "--eval-every", "0", "--output-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    (run,) = glob.glob(f"{tmp_path}/*/metrics.jsonl")
    rows = read_rows(run)
    assert all(r["moe/route_flip_frac_loss"] == 0 and 0 <= r["moe/route_flip_frac"] <= 1 for r in rows)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(run), "step_2", "model"))
    assert model.config.model_type == "qwen3_moe"


def test_routing_replay_holds_through_activation_checkpointing(monkeypatch, tmp_path):
    """Activation checkpointing runs each layer's forward again in the backward pass, after the training forward's
    block: the replayed experts stay in force until the step's stats, so the gradient is the one without it."""
    argv = ["--model", "tiny-moe", "--routing-replay", "--num-steps", "1", "--prompts-per-rank", "4",
            "--num-minibatches", "2", "--eval-every", "0", "--log-samples", "0", "--learning-rate", "1e-2"]
    plain, _ = run_script("grpo", argv, monkeypatch, tmp_path / "plain")
    ac, _ = run_script("grpo", argv + ["--activation-checkpointing"], monkeypatch, tmp_path / "ac")
    assert plain[0]["moe/route_flip_frac"] > 0 and ac[0]["moe/route_flip_frac_loss"] == 0
    for key in ("losses/grad_norm", "losses/policy_loss", "losses/approx_kl"):
        assert ac[0][key] == pytest.approx(plain[0][key], rel=1e-5, abs=1e-8), key


def test_routing_replay_holds_over_episodes(monkeypatch, tmp_path):
    """Issue 62 item 2: an episode's rows (model turns, tool turns between them) are taped by the old pass and replayed
    in the loss like any completion: after the first minibatch's update the router picks other experts, and the loss
    sees none of them."""
    from grouprl import episodes
    from helpers import ROOT

    monkeypatch.setattr(episodes, "parse_calls", lambda text: [{"name": "add", "arguments": {"n": 1}}])
    (tmp_path / "spread_reward62.py").write_text(  # rewards that differ in every group: a gradient
        "def f(completion, answer):\n    return float(sum(map(ord, completion)) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = f"{ROOT}/tests/programs/counter_env.py:Counter"
    argv = ["--model", "tiny-moe", "--routing-replay", "--num-steps", "1", "--prompts-per-rank", "4",
            "--num-minibatches", "2", "--eval-every", "0", "--log-samples", "0", "--learning-rate", "1e-2",
            "--max-new-tokens", "24", "--environment", env, "--max-tool-calls", "1", "--reward", "spread_reward62:f"]
    try:
        (row,), _ = run_script("grpo", argv, monkeypatch, tmp_path)
    finally:
        if (None, env, 1) in episodes._TOOLS:
            episodes._TOOLS.pop((None, env, 1)).stop()
    assert row["tools/turns_per_episode"] > 1  # episodes, tool turns inside the rows
    assert row["moe/route_flip_frac"] > 0 and row["moe/route_flip_frac_loss"] == 0
