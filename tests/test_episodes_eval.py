"""Issue 62 items 1 and 3 in the held-out evaluation: with --tools or --environment, evaluate runs episodes as the
rollout does (episodes.generate_episodes with the run's Tools, reset(**row) on the held-out rows), get_reward is one
more reward of weight 1 in avg@k and pass@k, and the episodes' tools/* are logged as eval/tools/*. Turns are scripted
by monkeypatching episodes.parse_calls (the random tiny model writes no call), so the counts follow by hand."""
import json
import os

import pytest
import torch
from helpers import ROOT, run_script

import gspo
from grouprl import episodes

TOOLS_FILE = os.path.join(ROOT, "tests", "programs", "tools_example.py")
ENV = os.path.join(ROOT, "tests", "programs", "counter_env.py") + ":Counter"
ANSWERS = ["3", "5", "3", "7", "1"]  # the held-out rows (--eval-dataset): add(3) leaves a Counter at 3
ZERO_REWARD = "def zero(completion, answer):\n    return 0.0\n"  # the task's reward: only get_reward counts
RUN = ["--num-steps", "2", "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1",
       "--max-new-tokens", "24", "--max-tool-calls", "1", "--log-samples", "0"]
EVAL = ["--eval-k", "2", "--eval-n", "3", "--eval-max-new-tokens", "64"]  # some episodes reach turn 2


def held_out(tmp_path, monkeypatch) -> list[str]:
    """The held-out set (ANSWERS, each prompt its answer's digit) and the zero reward, as flags."""
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}%10=", "answer": a}) + "\n" for a in ANSWERS))
    (tmp_path / "zero_reward62.py").write_text(ZERO_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["--eval-dataset", str(data), "--reward", "zero_reward62:zero"]


def scripted(monkeypatch, calls):
    """Every model turn calls `calls` (each episode: turn 1, the tool turn, turn 2, then --max-tool-calls 1 is
    spent)."""
    monkeypatch.setattr(episodes, "parse_calls", lambda text: [dict(c) for c in calls])


def stop_tools(key):
    tools = episodes._TOOLS.pop(key)
    assert tools.history == {}  # every episode's instance (training's and the evaluation's) dropped
    tools.stop()


def check_episode_counts(row, episodes_, calls_a_round, failed_a_round):
    """--max-tool-calls 1, every turn calling: each episode makes exactly one round of calls (counted even where
    its result is rolled back), then ends rolled back (cut by the budget) or after turn 2 (cut by the budget when
    it has no EOS, else by the limit: it still calls). So turns = 2 E - rolled back and cut_by_budget +
    cut_by_limit = E, by hand."""
    assert row["eval/tools/call_frequency"] == calls_a_round
    assert row["eval/tools/failure_frequency"] == pytest.approx(failed_a_round / calls_a_round)
    assert row["eval/tools/malformed_turns"] == 0
    rolled = row["eval/tools/rolled_back"]
    assert row["eval/tools/turns_per_episode"] == pytest.approx((2 * episodes_ - rolled) / episodes_)
    # a rolled-back episode ends with its calling turn, truncated only where that turn was cut (TRL's)
    assert row["eval/tools/cut_by_limit"] + rolled <= episodes_
    assert episodes_ <= row["eval/tools/cut_by_budget"] + row["eval/tools/cut_by_limit"] + rolled


@pytest.mark.parametrize("gen_mode", ["shared-prefill", "engine"])
def test_eval_runs_environment_episodes(monkeypatch, tmp_path, gen_mode):
    """gspo.py --environment Counter --eval-every 1: each evaluation (steps 0, 1, 2) runs 5 held-out prompts x 3
    episodes, each Counter reset with its row and given add(3) once: get_reward is 1 exactly where the answer is 3
    (2 of 5 prompts), the task's reward 0; so avg@2 = 2/5, pass@2 = 2/5, eval/rewards/Counter/mean = 2/5, and the
    episode counts are the scripted ones. With HF generate and the engine (its episodes' KV cache)."""
    scripted(monkeypatch, [{"name": "add", "arguments": {"n": 3}}])
    rows, _ = run_script("gspo", [*RUN, *EVAL, *held_out(tmp_path, monkeypatch), "--environment", ENV,
                                  "--eval-every", "1", "--gen-mode", gen_mode], monkeypatch, tmp_path / "o")
    evals = [r for r in rows if "eval/avg@2" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["eval/prompts"] == 5 and r["eval/samples"] == 3 and r["eval/reward_errors"] == 0
        assert r["eval/avg@2"] == pytest.approx(2 / 5) and r["eval/pass@2"] == pytest.approx(2 / 5)
        assert r["eval/rewards/Counter/mean"] == pytest.approx(2 / 5)
        check_episode_counts(r, 5 * 3, 1, 0)
    train = [r for r in rows if "tools/call_frequency" in r]
    assert len(train) == 2 and all(r["tools/call_frequency"] == 1 for r in train)  # the rollout's, not the eval's
    stop_tools((None, ENV, 1))


def test_eval_runs_tool_episodes(monkeypatch, tmp_path):
    """gspo.py --tools multiply --eval-every 2 (evaluations at steps 0 and 2): every turn calls multiply and a tool
    the run does not have, so each episode makes 2 calls a round, 1 failed: eval/tools/call_frequency 2,
    failure_frequency 1/2; no environment, so the reward is the task's alone (0) and no eval/rewards/."""
    scripted(monkeypatch, [{"name": "multiply", "arguments": {"a": 2, "b": 3}}, {"name": "nope", "arguments": {}}])
    rows, _ = run_script("gspo", [*RUN, *EVAL, *held_out(tmp_path, monkeypatch), "--tools", f"{TOOLS_FILE}:multiply",
                                  "--eval-every", "2"], monkeypatch, tmp_path / "o")
    evals = [r for r in rows if "eval/avg@2" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/avg@2"] == 0 and r["eval/pass@2"] == 0
        assert not any(k.startswith("eval/rewards/") for k in r)
        check_episode_counts(r, 5 * 3, 2, 1)
    stop_tools((f"{TOOLS_FILE}:multiply", None, 1))


def test_eval_only_with_an_environment(monkeypatch, tmp_path):
    """--eval-only --environment: the held-out file evaluated as episodes, its table and eval.json carry the
    environment's reward (avg@2 = pass@2 = 2/5) and the episode counts."""
    scripted(monkeypatch, [{"name": "add", "arguments": {"n": 3}}])
    rows, run = run_script("gspo", [*RUN, *EVAL, *held_out(tmp_path, monkeypatch), "--environment", ENV,
                                    "--eval-only"], monkeypatch, tmp_path / "o", jitter_row=False)
    (row,) = rows
    saved = json.load(open(os.path.join(run, "eval.json")))
    (result,) = saved.values()
    for r in (row, result):
        assert r["eval/avg@2"] == pytest.approx(2 / 5) and r["eval/pass@2"] == pytest.approx(2 / 5)
        assert r["eval/rewards/Counter/mean"] == pytest.approx(2 / 5)
        check_episode_counts(r, 5 * 3, 1, 0)
    assert row["eval/tools/rolled_back"] < 15  # some episodes reach turn 2 (the turn counts are not all 1)
    stop_tools((None, ENV, 1))


TOOL_SEEN = ("def tool_seen(prompts, completions, **kwargs):\n"
             "    return [float(any(m['role'] == 'tool' for m in c)) for c in completions]\n")


def test_eval_gives_trl_rewards_the_episode(monkeypatch, tmp_path):
    """Message prompts and a TRL-form reward: as in training, the reward gets each episode as TRL's completions
    (model and tool messages), so a reward that scores 1 for an episode whose tool turn was kept gives, by hand,
    avg@2 = the episodes not rolled back over all of them."""
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}%10="}], "answer": a}) + "\n"
                            for a in ANSWERS))
    (tmp_path / "tool_seen62.py").write_text(TOOL_SEEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    scripted(monkeypatch, [{"name": "multiply", "arguments": {"a": 2, "b": 3}}])
    rows, _ = run_script("gspo", [*RUN, *EVAL, "--eval-dataset", str(data), "--reward", "tool_seen62:tool_seen",
                                  "--tools", f"{TOOLS_FILE}:multiply", "--eval-only"], monkeypatch, tmp_path / "o",
                         jitter_row=False)
    (row,) = rows
    assert row["eval/reward_errors"] == 0 and 0 < row["eval/tools/rolled_back"] < 15
    assert row["eval/avg@2"] == pytest.approx(1 - row["eval/tools/rolled_back"] / 15)
    stop_tools((f"{TOOLS_FILE}:multiply", None, 1))


def own_rng(evaluate):
    """evaluate with the training's RNG left as it was: the evaluation's draws, not its episodes, are then the
    only thing that could move the training's numbers."""
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return evaluate(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("flags", [[], ["--tools", f"{TOOLS_FILE}:multiply"], ["--environment", ENV]],
                         ids=["plain", "tools", "environment"])
def test_eval_episodes_leave_training_as_it_was(monkeypatch, tmp_path, flags):
    """The training's rows (rewards, losses, tools/*, rewards/Counter/) with evaluations at every step equal those
    with --eval-every 0 once the evaluation's random draws are its own (own_rng): the evaluation's episodes (their
    instances, the worker, the rewards they join) leave the training's as they were. Plain runs: the same holds."""
    call = {"name": "add", "arguments": {"n": 3}} if "--environment" in flags else {
        "name": "multiply", "arguments": {"a": 2, "b": 3}}
    scripted(monkeypatch, [call])
    monkeypatch.setattr(gspo, "evaluate", own_rng(gspo.evaluate))
    common = [*RUN, *held_out(tmp_path, monkeypatch), *flags]
    with_eval, _ = run_script("gspo", [*common, *EVAL, "--eval-every", "1"], monkeypatch, tmp_path / "a")
    without, _ = run_script("gspo", [*common, "--eval-every", "0"], monkeypatch, tmp_path / "b")

    def training(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("eval/", "perf/"))} for r in rows if r["step"] > 0]
    assert training(with_eval) == training(without)
    assert [r["step"] for r in with_eval] == [0, 1, 2] and "eval/avg@2" in with_eval[-1]
    if flags:
        assert all("tools/call_frequency" in r for r in training(without))
        stop_tools((flags[1] if flags[0] == "--tools" else None, ENV if flags[0] == "--environment" else None, 1))
