"""Tasks that learn (issue 62 item 7): the built-in episode task, grouprl/tool_task.py, with
`--model tiny-tools` (a random-init tiny model whose tokenizer holds the task's call as one token):
the answer is reachable only through the tool's reply, and a short run from scratch raises the
reward and the tool-call rate."""
import json
import os
import statistics

import pytest
from helpers import ROOT, run_script

from grouprl import tool_task
from grouprl.episodes import parse_calls
from grouprl.modeling import builtin_tokenizer, tiny_tokenizer

ENV = f"{os.path.join(ROOT, 'grouprl', 'tool_task.py')}:Secret"
DATA = os.path.join(ROOT, "experiments", "data", "secret_digit.jsonl")
TASK = ["--model", "tiny-tools", "--environment", ENV, "--dataset", DATA, "--max-tool-calls", "2",
        "--max-new-tokens", "30", "--eval-every", "0"]


def test_tokenizer_holds_the_call():
    """tiny-tools: the call is one token and parses as the call of peek; `tiny` is unchanged."""
    tok = builtin_tokenizer("tiny-tools")
    ids = tok(tool_task.CALL, add_special_tokens=False).input_ids
    assert len(ids) == 1 and tok.decode(ids) == tool_task.CALL
    assert parse_calls(tok.decode(ids)) == [{"name": "peek", "arguments": {}}]
    assert len(tok) == 3 + 12 + 1 + 1  # specials, digits space newline, unk, the call
    assert tiny_tokenizer().get_vocab() == builtin_tokenizer("tiny").get_vocab()
    assert len(builtin_tokenizer("tiny")) == 100


def test_environment_scores():
    """One peek earns CALL_CREDIT, a second loses it; turn rewards: the call turn its credit, the
    turn that says the secret 1."""
    env = tool_task.Secret()
    assert env.reset(answer=" 7", prompt="Box 3: what is its secret digit?") is None
    assert env.get_reward() == 0.0
    assert env.peek() == "7" and env.get_reward() == tool_task.CALL_CREDIT
    assert env.get_turn_rewards([tool_task.CALL, "7"]) == [tool_task.CALL_CREDIT, 1.0]
    assert env.get_turn_rewards(["3"]) == [0.0]
    env.peek()
    assert env.get_reward() == 0.0


def test_answer_only_through_the_tool():
    """The committed rows are rows(512); a prompt says nothing of its digit (the same question of a
    numbered box), and the digits are near uniform, so an unaided policy scores about 0.1."""
    rows = [json.loads(line) for line in open(DATA)]
    assert rows == tool_task.rows(512)
    assert {r["prompt"].split(":")[1] for r in rows} == {" what is its secret digit?"}
    counts = [sum(r["answer"] == str(d) for r in rows) for d in range(10)]
    assert max(counts) / len(rows) < 0.13


def call_rate_and_reward(rows):
    return [r["tools/call_frequency"] for r in rows], [r["charts/reward_mean"] for r in rows]


@pytest.mark.slow  # ~25 s, and what it shows is the call's credit only (docs/lab.md part 7)
def test_tiny_tools_learns_to_call(tmp_path, monkeypatch):
    """GRPO from a random init, seed 1: the tool-call rate and the reward rise from the first two
    steps to the last two, three (measured: calls 0.05 -> 0.42 an episode, reward 0.014 ->
    0.035)."""
    rows, _ = run_script("grpo", TASK + ["--num-steps", "5", "--prompts-per-rank", "8",
                                         "--learning-rate", "1e-3", "--seed", "1"],
                         monkeypatch, tmp_path)
    calls, rewards = call_rate_and_reward(rows)
    assert statistics.mean(calls[-2:]) > statistics.mean(calls[:2]) + 0.2, calls
    assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:2]) + 0.015, rewards


@pytest.mark.slow
def test_tiny_tools_learns_to_call_slow(tmp_path, monkeypatch):
    """The longer run (34 steps, ~2 min): the model calls the tool in most episodes and the reward
    rises well past its start (measured: calls 0.05 -> 0.9, reward 0.014 -> 0.24). Said plainly:
    at this length the answer after the call (copying the digit, rewards/math_reward) is not yet
    learned; the reward's rise is the call's credit."""
    rows, _ = run_script("grpo", TASK + ["--num-steps", "34", "--prompts-per-rank", "8",
                                         "--learning-rate", "1e-3", "--seed", "1"],
                         monkeypatch, tmp_path)
    calls, rewards = call_rate_and_reward(rows)
    assert statistics.mean(calls[-5:]) > 0.7, calls
    assert statistics.mean(rewards[-5:]) > 0.15, rewards


def test_products_rows_and_tool():
    """The real model's task: the committed rows are products(256), each answer the product of its
    prompt's two 3-digit numbers, which the multiply tool returns."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "experiments", "data",
                                                           "products.jsonl"))]
    assert rows == tool_task.products(256)
    for r in rows:
        a, b = (int(x) for x in r["prompt"].split("?")[0].split()[-3::2])
        assert 100 <= a < 1000 and 100 <= b < 1000
        assert tool_task.multiply(a, b) == int(r["answer"])
