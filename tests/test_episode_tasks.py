"""Tasks that learn (issue 62 item 7): the built-in episode task, grouprl/tool_task.py, with
`--model tiny-tools` (a random-init tiny model whose tokenizer holds the task's call as one token):
each episode's secret is drawn in reset and only the tool's reply tells it, and a short run from
scratch raises the reward; the longer run learns the answer (docs/lab.md part 7)."""
import json
import os
import statistics

import pytest
from helpers import ROOT, run_script

from grouprl import tool_task
from grouprl.data import chat_prompts
from grouprl.episodes import parse_calls, tool_suffix_ids
from grouprl.modeling import builtin_tokenizer, tiny_tokenizer
from grouprl.tools import tool_schemas

ENV = f"{os.path.join(ROOT, 'grouprl', 'tool_task.py')}:Secret"
DATA = os.path.join(ROOT, "experiments", "data", "secret_digit.jsonl")
TASK = ["--model", "tiny-tools", "--environment", ENV, "--dataset", DATA,
        "--reward", "grouprl.tool_task:answer_reward", "--reward", "grouprl.tool_task:reply_credit",
        "--max-tool-calls", "1", "--max-new-tokens", "34", "--learning-rate", "2e-3",
        "--prompts-per-rank", "8", "--eval-every", "0", "--save-every", "0"]
CALL, C = tool_task.CALL, tool_task.CALL_CREDIT


def test_tokenizer_holds_the_call():
    """tiny-tools: the call is one token and parses as the call of peek; the alphabet is the
    secrets' symbols (V = 9); the template renders the tools as their names; `tiny` is
    unchanged."""
    tok = builtin_tokenizer("tiny-tools")
    ids = tok(CALL, add_special_tokens=False).input_ids
    assert len(ids) == 1 and tok.decode(ids) == CALL
    assert parse_calls(tok.decode(ids)) == [{"name": "peek", "arguments": {}}]
    assert len(tok) == 3 + len(tool_task.SYMBOLS) + 1 + 1  # specials, symbols, unk, the call
    schemas = tool_schemas(None, ENV)
    prompt = chat_prompts(tok, [[{"role": "user", "content": "Box 3: what is its secret digit?"}]],
                          tools=schemas)[0]
    assert prompt.startswith("<|im_start|>system\npeek <|im_end|>\n<|im_start|>user\n")
    reply = tool_suffix_ids(tok, [{"role": "tool", "name": "peek", "content": "2" * 8}])
    assert tok.convert_ids_to_tokens(reply).count("2") == 8  # the reply's secret, 8 times
    assert tiny_tokenizer().get_vocab() == builtin_tokenizer("tiny").get_vocab()
    assert len(builtin_tokenizer("tiny")) == 100


def test_environment_and_turn_rewards():
    """reset draws each episode's secret from SYMBOLS (a group's episodes differ); peek tells it
    REPEAT times; the turn rewards: the one call, followed by a turn, its credit, the answer turn
    after it 1 when it begins with the secret."""
    secrets = set()
    for _ in range(64):
        env = tool_task.Secret()
        assert env.reset(prompt=[], answer="0123") is None
        secrets.add(env.secret)
        assert env.peek() == env.secret * tool_task.REPEAT
    assert secrets == set(tool_task.SYMBOLS)
    env.secret = "2"
    assert env.get_turn_rewards([CALL, "2 13"]) == [C, 1.0]
    assert env.get_turn_rewards([CALL, "3"]) == [C, 0.0]
    assert env.get_turn_rewards(["2"]) == [0.0]  # no call: no reply to read
    assert env.get_turn_rewards([CALL]) == [0.0]  # rolled back: no reply
    assert env.get_turn_rewards([CALL, CALL + "2"]) == [0.0, 0.0]  # a second call
    assert env.get_turn_rewards([CALL + CALL, "2"]) == [0.0, 1.0]


def episode(*parts):
    """Messages as TRL's tool loop passes them: 'C' a model turn that calls peek, a digit string
    a tool reply, any other text a model turn."""
    out = []
    for p in parts:
        if p == "C":
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "peek", "arguments": {}}}]})
        elif p.startswith("reply:"):
            out.append({"role": "tool", "name": "peek", "content": p[6:]})
        else:
            out.append({"role": "assistant", "content": p})
    return out


def test_rewards_read_the_reply():
    """answer_reward: 1 when a reply came back and the last turn, without a call, begins with the
    secret the reply told (the row's answer plays no part); reply_credit: one call, one reply."""
    eps = [episode("C", "reply:2222", " 21"), episode("C", "reply:3333", "2"),
           episode("2"), episode("C"), episode("C", "reply:2222", "C")]
    assert tool_task.answer_reward(None, eps, answer=["0123"] * 5) == [1.0, 0, 0, 0, 0]
    assert tool_task.reply_credit(None, eps) == [C, C, 0, 0, 0]


def test_rows():
    """The committed rows are rows(512): the same question of a numbered box (the number says
    nothing: the secret is drawn in reset), as a user message."""
    rows = [json.loads(line) for line in open(DATA)]
    assert rows == tool_task.rows(512)
    assert {r["prompt"][0]["content"].split(":")[1] for r in rows} == {" what is its secret digit?"}


def curve(rows, key):
    return [r[key] for r in rows if key in r]


def test_tiny_tools_learns_to_call(tmp_path, monkeypatch):
    """GRPO from a random init, seed 1, 12 steps (~15 s): the call's credit (exactly one call,
    its reply back) and the reward rise from the first three steps to the last three (measured:
    credit 0.046 at step 1, 0.24 by steps 11-15)."""
    rows, _ = run_script("grpo", TASK + ["--num-steps", "12", "--seed", "1"], monkeypatch,
                         tmp_path)
    credit = curve(rows, "rewards/reply_credit/mean")
    reward = curve(rows, "charts/reward_mean")
    assert statistics.mean(credit[-3:]) > statistics.mean(credit[:3]) + 0.05, credit
    assert statistics.mean(reward[-3:]) > statistics.mean(reward[:3]) + 0.05, reward


@pytest.mark.slow  # ~60 s
def test_tiny_tools_learns_the_answer(tmp_path, monkeypatch):
    """The lab's GRPO run, seed 1, its first 60 steps (docs/lab.md part 7): the model calls in
    every episode and the answer, the secret copied from the reply, is far above what a guess
    after the call scores (1/4; measured in the lab's 80-step run: 0.66 over steps 41-60). That
    run collapses at step 72 (calls 0, reward 0), past this test's steps."""
    rows, _ = run_script("grpo", TASK + ["--num-steps", "60", "--seed", "1"], monkeypatch,
                         tmp_path)
    answer = curve(rows, "rewards/answer_reward/mean")
    calls = curve(rows, "tools/call_frequency")
    assert statistics.mean(calls[-20:]) > 0.9, calls
    assert statistics.mean(answer[-20:]) > 0.5, answer


def test_turn_credit_runs_on_the_task(tmp_path, monkeypatch):
    """gspo_token.py --turn-credit on this task: a tool turn that fills the budget leaves the next
    turn no token; get_turn_rewards scores the turns that wrote one, the runs of the mask that
    gspo_token.turn_advantages counts (it stopped at step 1 when the empty turn was scored)."""
    rows, _ = run_script("gspo_token", TASK + ["--turn-credit", "1", "--num-steps", "2", "--seed",
                                               "1"], monkeypatch, tmp_path)
    assert len([r for r in rows if "tools/call_frequency" in r]) == 2


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
