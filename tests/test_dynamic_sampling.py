"""--dynamic-sampling (DAPO, arXiv 2503.14476, Sec. 3.2; verl's algorithm.filter_groups): groups whose rewards are
all equal are dropped and replaced by groups of prompts from outside the step's batch, in rounds, until each rank
holds --prompts-per-rank groups with a spread, at most --max-gen-rounds rounds (then flat groups fill the batch).
common.sample_groups is tested on a scripted rollout and scripted rewards (the kept groups, their order, the padding
of rounds of different lengths and the counts, all written out by hand), then in the scripts: the logged counts
against hand counts, two ranks under torchrun (every rank makes the same generate calls), and exact resume."""
import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

import common
from conftest import ROOT
from grouprl.distributed import Dist
from helpers import fails_before_any_model, run_script
from grouprl.generation import Rollout
from grouprl.sampling import Sampling

CPU = torch.device("cpu")
PAD = 0
F, S = "flat", "spread"


def scripted(monkeypatch, flags, group_size=2):
    """common.generate and common.score replaced: round r's rollout has prompts of 2 + r tokens and completions of
    4 - r (so that rounds must be padded to be put together), every token 1000 (r + 1) + 10 row + column; group g of
    round r scores [10 r + g, 10 r + g + 0.5] (flags[r][g] == S) or [10 r + g] x G (F). Returns the prompts each
    generate call got, and the reward object whose values score sets (twice the rewards, for reward.metrics)."""
    calls = []

    def generate(policy, tok, prompts, n, eos, d, *a, **kw):
        r = len(calls)
        calls.append(list(prompts))
        B, P, T = len(prompts) * n, 2 + r, 4 - r
        ids = 1000 * (r + 1) + 10 * torch.arange(B)[:, None] + torch.arange(P + T)[None]
        return Rollout(input_ids=ids, attention_mask=torch.ones(B, P + T, dtype=torch.long), n_prompt=P,
                       mask=torch.ones(B, T), truncated=torch.arange(B) % 2 == 0,
                       texts=[f"round {r} row {i}" for i in range(B)],
                       logp=-(r + 1) - torch.arange(B)[:, None] / 100 - torch.arange(T)[None] / 1000)

    reward = SimpleNamespace(values={})

    def score(texts, rows, n, reward_, truncated=None, truncated_scale=1.0, given=None, messages=None):
        r = int(texts[0].split()[1])
        values = []
        for g, flag in enumerate(flags[r]):
            values += [10 * r + g, 10 * r + g + (0.5 if flag == S else 0.0)] + [10 * r + g] * (n - 2)
        rewards = torch.tensor(values)
        reward_.values = {"r": 2 * rewards}
        return rewards, r  # round r's reward errors: r

    monkeypatch.setattr(common, "generate", generate)
    monkeypatch.setattr(common, "score", score)
    monkeypatch.setattr(common, "_FILLED_SAID", [])
    return calls, reward


def train_rows(n=40):
    return Dataset.from_list([{"prompt": f"p{i}", "answer": str(i), "text": f"<t>p{i}"} for i in range(n)])


def sample(reward, dynamic=True, max_rounds=10, per_rank=4, group_size=2, step=3):
    """common.sample_groups' Rollout as (rows, generate()'s entries, rewards, reward errors, stats)."""
    args = SimpleNamespace(prompts_per_rank=per_rank, group_size=group_size, seed=5, dynamic_sampling=dynamic,
                           max_gen_rounds=max_rounds, truncated_reward_scale=1.0,
                           multi_objective_aggregation="sum-then-normalize", tools=None,
                           environment=None)
    r = common.sample_groups(None, SimpleNamespace(pad_token_id=PAD), train_rows(), step, [1], Dist(0, 1, CPU),
                             reward, Sampling(max_new_tokens=4), args)
    roll = {"input_ids": r.input_ids, "attention_mask": r.attention_mask, "n_prompt": r.n_prompt, "mask": r.mask,
            "truncated": r.truncated, "texts": r.texts, "logp": r.logp}
    return r.rows, roll, r.rewards, r.reward_errors, r.stats


def expected_roll(kept, P, T, group_size=2):
    """The rollout of the kept (round, group) pairs, built row by row from the scripted one: prompts left-padded to
    P tokens, completions right-padded to T."""
    ids, am, mask, logp, texts, truncated = [], [], [], [], [], []
    for r, g in kept:
        p, t = 2 + r, 4 - r
        for i in range(g * group_size, (g + 1) * group_size):
            row = [1000 * (r + 1) + 10 * i + j for j in range(p + t)]
            ids.append([PAD] * (P - p) + row[:p] + row[p:] + [PAD] * (T - t))
            am.append([0] * (P - p) + [1] * (p + t) + [0] * (T - t))
            mask.append([1.0] * t + [0.0] * (T - t))
            logp.append([-(r + 1) - i / 100 - j / 1000 for j in range(t)] + [0.0] * (T - t))
            texts.append(f"round {r} row {i}")
            truncated.append(i % 2 == 0)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(am), "n_prompt": P,
            "mask": torch.tensor(mask), "truncated": torch.tensor(truncated), "texts": texts,
            "logp": torch.tensor(logp)}


def group_rewards(kept, flags):
    return torch.tensor([v for r, g in kept for v in (10 * r + g, 10 * r + g + (0.5 if flags[r][g] == S else 0.0))])


def assert_roll(roll, want):
    assert roll.keys() == want.keys()
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert roll[k].dtype == want[k].dtype or k == "logp", k
            assert torch.allclose(roll[k].double(), want[k].double(), atol=1e-6) and roll[k].shape == want[k].shape, k
        else:
            assert roll[k] == want[k], k


def test_flat_groups_are_replaced_until_the_batch_is_full(monkeypatch):
    """4 groups a round: 2, then 1, then 3 with a spread. Round 3 fills the batch: the first 4 groups with a spread in
    generation order, (0,1) (0,3) (1,2) (2,0); dropped: the 6 flat ones; surplus: (2,1) (2,3); 3 x 4 = 4 + 6 + 2."""
    flags = [[F, S, F, S], [F, F, S, F], [S, S, F, S], [S, S, S, S]]
    calls, reward = scripted(monkeypatch, flags)
    rows, roll, rewards, errors, logs = sample(reward)
    kept = [(0, 1), (0, 3), (1, 2), (2, 0)]
    assert len(calls) == 3
    assert {k: v for k, v in logs.items() if k != "perf/gen_tokens_per_s"} == {
        "charts/gen_rounds": 3, "charts/dropped_groups": 6.0, "charts/surplus_groups": 2.0,
        "charts/filled_groups": 0.0}
    assert logs["perf/gen_tokens_per_s"] > 0
    assert errors == 0 + 1 + 2  # every round's failures count
    assert rows["text"] == [calls[r][g] for r, g in kept]  # the prompts of the kept groups, in order
    assert rows["prompt"] == [t[len("<t>"):] for t in rows["text"]]
    assert torch.equal(rewards, group_rewards(kept, flags))
    assert torch.equal(reward.values["r"], 2 * group_rewards(kept, flags))  # rewards/<name>/...: kept groups only
    assert_roll(roll, expected_roll(kept, P=4, T=4))  # rounds 0-2: prompts of 2-4 tokens, completions of 4-2


def test_at_the_bound_the_earliest_flat_groups_fill_the_batch(monkeypatch, capsys):
    """--max-gen-rounds 2 with the rounds above: 3 groups with a spread, so the earliest flat group, (0,0), fills the
    4th place; the batch keeps generation order."""
    flags = [[F, S, F, S], [F, F, S, F]]
    calls, reward = scripted(monkeypatch, flags)
    rows, roll, rewards, errors, logs = sample(reward, max_rounds=2)
    kept = [(0, 0), (0, 1), (0, 3), (1, 2)]
    assert len(calls) == 2
    assert {k: v for k, v in logs.items() if k != "perf/gen_tokens_per_s"} == {
        "charts/gen_rounds": 2, "charts/dropped_groups": 4.0, "charts/surplus_groups": 0.0,
        "charts/filled_groups": 1.0}
    assert torch.equal(rewards, group_rewards(kept, flags))
    assert_roll(roll, expected_roll(kept, P=3, T=4))
    assert rows["text"] == [calls[r][g] for r, g in kept]
    err = capsys.readouterr().err
    assert "step 3: --max-gen-rounds 2 spent; 1 flat groups (A = 0) fill the batch, counted in charts/filled_groups" \
        in err
    calls.clear()  # the scripted rounds again
    sample(reward, max_rounds=2)  # said once a run
    assert "spent" not in capsys.readouterr().err


def test_without_flat_groups_or_without_the_flag_the_rollout_is_the_plain_one(monkeypatch):
    """Off: one round, the rollout as generate returned it (the same object) and no dynamic logs, flat groups kept.
    On, with no flat group in the first round: the same batch (the step without --dynamic-sampling)."""
    flags = [[F, S, F, S], [S] * 4]
    calls, reward = scripted(monkeypatch, flags)
    rows, roll, rewards, errors, logs = sample(reward, dynamic=False)
    assert len(calls) == 1 and list(logs) == ["perf/gen_tokens_per_s"]
    assert rows["text"] == calls[0] and torch.equal(rewards, group_rewards([(0, g) for g in range(4)], flags))
    assert_roll(roll, expected_roll([(0, g) for g in range(4)], P=2, T=4))
    calls, reward = scripted(monkeypatch, [[S] * 4])
    rows, roll, rewards, errors, logs = sample(reward)
    assert len(calls) == 1 and rows["text"] == calls[0]
    assert logs["charts/gen_rounds"] == 1 and logs["charts/dropped_groups"] == 0
    assert_roll(roll, expected_roll([(0, g) for g in range(4)], P=2, T=4))


def test_extra_prompts_come_from_outside_the_step_and_from_seed_step_round():
    """Rounds 1-3 on 2 ranks, 4 prompts a rank: 24 distinct rows, none of the step's 8 (either rank's), the same on
    every call; another step or seed draws others; a pool of 6 rows (10 - 4) is taken whole, then wraps."""
    n, per_rank, world, step, seed = 40, 4, 2, 3, 5
    own = {i for rank in range(world) for i in common.prompt_indices(n, step, per_rank, Dist(rank, world, CPU), seed)}
    assert len(own) == 8
    drawn = [common.extra_prompt_indices(n, step, r, per_rank, Dist(rank, world, CPU), seed)
             for r in (1, 2, 3) for rank in range(world)]
    flat = sum(drawn, [])
    assert len(flat) == 24 and len(set(flat)) == 24 and not set(flat) & own
    assert drawn == [common.extra_prompt_indices(n, step, r, per_rank, Dist(rank, world, CPU), seed)
                     for r in (1, 2, 3) for rank in range(world)]  # a pure function: a resumed run draws the same
    assert common.extra_prompt_indices(n, step + 1, 1, per_rank, Dist(0, world, CPU), seed) != drawn[0]
    assert common.extra_prompt_indices(n, step, 1, per_rank, Dist(0, world, CPU), seed + 1) != drawn[0]
    own = set(common.prompt_indices(10, 1, 4, Dist(0, 1, CPU), 0))
    r1, r2 = (common.extra_prompt_indices(10, 1, r, 4, Dist(0, 1, CPU), 0) for r in (1, 2))
    assert set(r1 + r2[:2]) == set(range(10)) - own and r2[2:] == r1[:2]  # the pool of 6, in its order, then again


@pytest.mark.parametrize("argv, needle", [
    (["--dynamic-sampling", "--max-gen-rounds", "0"], "--max-gen-rounds 0: must lie in [1, 1024] (generation rounds "
                                                      "a step, the first included; verl's 0, no bound, is not offered"),
    (["--max-gen-rounds", "3"], "--max-gen-rounds 3 bounds the rounds of --dynamic-sampling: add --dynamic-sampling, "
                                "or drop it"),
    (["--dynamic-sampling", "--dataset", "SMALL", "--prompts-per-rank", "20"],
     "--dynamic-sampling replaces flat groups with prompts from outside the step's own batch, and the 18 train rows "
     "fit in one step (--prompts-per-rank 20 x 1 ranks)"),
])
def test_bad_values_fail_in_one_line_before_the_model(argv, needle, monkeypatch, tmp_path):
    small = tmp_path / "small.jsonl"  # 20 rows: 2 held out, 18 to train on
    small.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(20)))
    fails_before_any_model("gspo", [str(small) if a == "SMALL" else a for a in argv], needle, monkeypatch, tmp_path)


def test_verl_names_answer_with_ours():
    from grouprl import cli

    ours = {"dynamic_sampling", "max_gen_rounds"}
    assert cli.foreign_flag(["algorithm.filter_groups.enable=True"], ours) == (
        "algorithm.filter_groups.enable=... is verl's config key: use --dynamic-sampling")
    assert cli.foreign_flag(["algorithm.filter_groups.max_num_gen_batches=10"], ours) == (
        "algorithm.filter_groups.max_num_gen_batches=... is verl's config key: use --max-gen-rounds (with "
        "--dynamic-sampling)")


PARITY_REWARD = """
def parity(prompts, completions, answer, **kwargs):  # a group with an odd answer splits 0/1, an even one is flat
    return [float(int(answer[0]) % 2 and i % 2) for i in range(len(completions))]
"""


def test_the_script_logs_the_hand_counts_and_trains_on_the_kept_groups(monkeypatch, tmp_path):
    """gspo.py, 2 steps of 4 prompts x 4 completions, a reward that splits groups of odd answers only: the rounds
    each step takes and the groups dropped and left over, counted by hand from the prompts each generate call got,
    are the logged ones; the samples, rewards and reward metrics are those of kept (odd) groups: mean 0.5."""
    (tmp_path / "parity_reward37.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []  # per generate call: the answer of each prompt, and the completions

    def generate(policy, tok, prompts, n, *a, **k):
        roll = real(policy, tok, prompts, n, *a, **k)
        calls.append(([int(re.search(r"(\d)%10=", p)[1]) for p in prompts], roll.texts))
        return roll

    real = common.generate
    monkeypatch.setattr(common, "generate", generate)
    rows, run = run_script("gspo", ["--num-steps", "2", "--prompts-per-rank", "4", "--group-size", "4",
                                    "--eval-every", "0", "--log-samples", "1", "--dynamic-sampling",
                                    "--reward", "parity_reward37:parity", "--truncated-reward-scale", "1"],
                           monkeypatch, tmp_path / "runs")
    samples = [json.loads(line) for line in open(os.path.join(run, "samples.jsonl"))]
    assert len(samples) == 2 * 2 * 4 and all(int(s["answer"]) % 2 for s in samples)
    assert all(s["reward"] == (i % 2) for i, s in enumerate(samples))
    for row in rows:  # by hand: rounds of 4 prompts until 4 odd answers, the first 4 kept
        seen, rounds, groups = [], 0, set()
        while sum(x % 2 for x in seen) < 4:
            answers, texts = calls.pop(0)
            seen += answers
            groups |= {(str(x), tuple(texts[4 * g:4 * g + 4])) for g, x in enumerate(answers)}
            rounds += 1
        logged = [s for s in samples if s["step"] == row["step"]]  # a kept group's own completions
        assert all((s["answer"], tuple(c["completion"] for c in logged[i - i % 4:i - i % 4 + 4])) in groups
                   for i, s in enumerate(logged))
        odd = sum(x % 2 for x in seen)
        assert (row["charts/gen_rounds"], row["charts/dropped_groups"], row["charts/surplus_groups"],
                row["charts/filled_groups"]) == (rounds, len(seen) - odd, odd - 4, 0), row
        assert row["charts/reward_mean"] == 0.5 and row["charts/zero_adv_group_frac"] == 0
        assert row["rewards/parity/mean"] == 0.5 and row["rewards/parity/std"] == 0.5
    assert not calls and any(r["charts/gen_rounds"] > 1 for r in rows)  # every call counted; a round was added


def test_merged_rounds_give_the_engines_own_log_probs(monkeypatch, tmp_path):
    """Prompts of 2-31 characters, so that each round is padded to its own length, and the parity reward, so that
    a step keeps groups of several rounds: the rounds put together (prompts left-padded, completions right-padded to
    the longest) give the training forward the log-probs the engine sampled with, to float error (gen/logp_drift,
    fp32 on the CPU)."""
    (tmp_path / "parity_reward37.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "varied.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q" * (i * 7 % 30) + str(i), "answer": str(i % 10)}) + "\n"
                            for i in range(60)))
    rows, _ = run_script("gspo", ["--dataset", str(data), "--num-steps", "2", "--prompts-per-rank", "4",
                                  "--group-size", "4", "--num-minibatches", "2", "--eval-every", "0", "--log-samples",
                                  "0", "--max-new-tokens", "6", "--gen-mode", "engine", "--dynamic-sampling",
                                  "--reward", "parity_reward37:parity"], monkeypatch, tmp_path / "runs")
    assert all(r["charts/gen_rounds"] > 1 and r["charts/reward_mean"] == 0.5 for r in rows), rows
    assert all(r["gen/logp_drift"] < 1e-5 for r in rows), rows


def test_resume_is_exact_with_dynamic_sampling(monkeypatch, tmp_path):
    """A run of 3 steps that added rounds and hit the bound, resumed from its step_2 checkpoint: step 3 again gives
    the same weights, bitwise, and the same logged numbers (the rounds and counts too): the extra prompts come from
    (seed, step, round) and the sampling from the RNG state the checkpoint holds."""
    from grouprl import checkpoint

    argv = ["--num-steps", "3", "--prompts-per-rank", "4", "--group-size", "4", "--eval-every", "0",
            "--save-every", "1", "--log-samples", "0", "--learning-rate", "2e-3", "--dynamic-sampling",
            "--max-gen-rounds", "3"]
    rows, run = run_script("gspo", argv, monkeypatch, tmp_path)
    assert any(r["charts/gen_rounds"] > 1 for r in rows) and any(r["charts/filled_groups"] > 0 for r in rows)
    weights = checkpoint.master_weights(os.path.join(run, "step_3"))
    again, _ = run_script("gspo", argv + ["--resume", os.path.join(run, "step_2")], monkeypatch, tmp_path)
    redone = checkpoint.master_weights(os.path.join(run, "step_3"))
    assert weights.keys() == redone.keys() and all(torch.equal(weights[k], redone[k]) for k in weights)
    assert [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in again] == [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.slow  # ~12 s on 2 loaded cores: torchrun and two processes' start
def test_two_ranks_make_the_same_generate_calls(tmp_path):
    """torchrun, 2 ranks (FSDP2, gloo), real generate: rank 0's groups all have a spread, rank 1's are flat in its
    first two rounds; both ranks run 3 rounds (an all_reduce of the shortfall), or 2 at --max-gen-rounds 2
    (tests/programs/dynsample_ranks.py asserts the counts)."""
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "tests/programs/dynsample_ranks.py"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a rank waits in a collective the other never joins: end them all
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("the ranks hung: they made different generate (FSDP2 all-gather) or all_reduce calls")
    assert p.returncode == 0 and "dynamic sampling on 2 ranks OK" in out, out[-2000:] + err[-4000:]
