"""TRL parity of --environment episodes (issue 62 item 8, TRL's environment_factory): for scripted model turns,
each episode's prompt (reset's string appended to the last user message, then templated with the tools), its
completion ids, tool mask and end, the batch's tool-call and failure counts, and get_reward's value an episode
(one more reward source of weight 1, named for the class) from our generate_episodes and env_scores equal what
the real TRL 1.16 GRPOTrainer makes with environment_factory=Ledger (tests/programs/episode_envs.py) beside
tools=[multiply] (TRL's tool dict: the standalone tools, then the instance's methods). The machinery is
test_episodes_trl.py's (the scripted generate on both sides, TRL's own _generate_and_score_completions)."""
import importlib.util
import math
import os
import types

import pytest
from helpers import ROOT
from test_episodes_trl import LIMIT, assert_same_ids_and_mask, call, our_episodes, qwen3_tiny_tokenizer, trl_episodes

from grouprl import rewards
from grouprl.episodes import env_scores
from grouprl.rewards import Rewards

ENV_FILE = os.path.join(ROOT, "tests", "programs", "episode_envs.py")
ENV = f"{ENV_FILE}:Ledger"

# each episode: the row's 'obs' (reset's string: '' gives None, 'keys' the row's keys), the model's turns
EPISODES = {
    "reset None, an answer": ("", ["42"]),
    "reset text, one call": (" Start at 0.", [call("add", n=5), "5"]),
    "state carried between calls": ("", [call("add", n=2), call("add", n=3), "5"]),
    "the same episode again: its own state": ("", [call("add", n=2), call("add", n=3), "5"]),
    "two calls in one round": (" Twice.", [call("add", n=1) + "\n" + call("add", n=10), "11"]),
    "a standalone tool beside": ("", [call("multiply", a=6, b=7) + "\n" + call("add", n=1), "42"]),
    "an exception in a method": ("", [call("fail", why="no"), call("add", n=4), "ok"]),
    "an unknown method": ("", [call("reset"), "ok"]),  # reset and get_reward are not tools (TRL)
    "the rollback past the budget": ("", [call("add", n=7) + "\n" + call("pad", n=2000), "never"]),
    "the iteration limit": (" Go.", [call("add", n=1), call("add", n=1), call("add", n=1), "never"]),
    "the row's keys": ("keys", ["ok"]),
    "reset text, a bad call": (" Hm.", ['<tool_call>\n{"name": "add", "arguments": {"n": 1,\n</tool_call>', "x"]),
}
TURNS = {name: turns for name, (_, turns) in EPISODES.items()}
COLUMNS = {"obs": [obs for obs, _ in EPISODES.values()]}


def ledger():
    spec = importlib.util.spec_from_file_location("episode_envs", ENV_FILE)  # as the worker names it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Ledger


@pytest.fixture(scope="module")
def both():
    return (trl_episodes(TURNS, environment=ledger(), columns=COLUMNS, names=["multiply"]),
            our_episodes(TURNS, environment=ENV, columns=COLUMNS, names=["multiply"]))


@pytest.mark.parametrize("name", list(EPISODES))
def test_environment_prompt_ids_equal_trl(both, name):
    """The prompt an episode generates from: reset's string appended to the user message as TRL appends it (None:
    the prompt as it is), templated with the tools (multiply, then Ledger's methods), token for token."""
    (_, _, trainer), (_, _, roll) = both
    k, P = list(EPISODES).index(name), roll.n_prompt
    ours = roll.input_ids[k, P - int(roll.attention_mask[k, :P].sum()):P].tolist()
    tok = qwen3_tiny_tokenizer()
    assert ours == trainer.seen_prompt_ids[k], (
        f"\nours: {tok.decode(ours)!r}\nTRL:  {tok.decode(trainer.seen_prompt_ids[k])!r}")


def test_environment_reset_strings(both):
    """What the prompts carry: reset's text where it gave one, the row's keys as reset is given them (every column
    of the row but our templated 'text': TRL passes the row whole), nothing where it gave None."""
    (_, _, trainer), _ = both
    tok = qwen3_tiny_tokenizer()
    texts = [tok.decode(trainer.seen_prompt_ids[k]) for k in range(len(EPISODES))]
    assert "ep1: 6*7= Start at 0.<|im_end|>" in texts[1] and "ep0: 6*7=<|im_end|>" in texts[0]
    assert "ep10: 6*7= (row: prompt)<|im_end|>" in texts[10]
    assert texts[0].startswith("<|im_start|>system\n# Tools\n") and '"name": "pad"' in texts[0]


@pytest.mark.parametrize("name", list(EPISODES))
def test_environment_episode_equals_trl(both, name):
    """The episode's completion ids, tool mask and end (truncated or not) are TRL's."""
    (theirs, _, _), (ours, _, _) = both
    k = list(EPISODES).index(name)
    assert_same_ids_and_mask(theirs[k], ours[k])
    assert ours[k][2] == theirs[k][2]


def test_environment_counts_equal_trl(both):
    """tools/call_frequency and tools/failure_frequency, as counts over the batch, are TRL's."""
    (_, trl_counts, _), (_, our_counts, _) = both
    assert our_counts == trl_counts and trl_counts[0] >= 12 and trl_counts[1] >= 2


def test_get_reward_equals_trl(both):
    """get_reward an episode, from the instance's state at the episode's end (a rolled-back call's change kept, a
    failed call's too, two episodes alike scoring alike: no state shared), equals TRL's reward column named for
    the class; None (no call made) is NaN in both. Ours go through env_scores and rewards.score (weight 1) as
    the step's do, logged as rewards/Ledger/."""
    (_, _, trainer), (_, _, roll) = both
    n = len(EPISODES)
    theirs = list(trainer._logs["rewards"]["Ledger"])[:n]
    given = env_scores(roll, types.SimpleNamespace(tools=None, environment=ENV, max_tool_calls=LIMIT,
                                                  enable_thinking=None, system_prompt=None))
    reward = Rewards([])
    r, errors = rewards.score(roll.texts, ["42"] * n, 1, reward, watch=True, given=given)
    ours = reward.values["Ledger"].tolist()
    assert errors == 0 and [p.name for p, _ in reward.parts] == ["Ledger"]
    assert [math.isnan(x) for x in ours] == [math.isnan(x) for x in theirs]
    assert [x for x in ours if not math.isnan(x)] == [x for x in theirs if not math.isnan(x)]
    named = dict(zip(EPISODES, ours))
    assert named["state carried between calls"] == named["the same episode again: its own state"] == 5.5
    assert named["the rollback past the budget"] == 7.5 and named["an exception in a method"] == 4.5
    assert math.isnan(named["reset None, an answer"]) and r.tolist() == [0 if math.isnan(x) else x for x in ours]

