"""TRL parity of episodes (issue 62 item 8; --environment's at the end): for scripted model turns, each episode's completion
token ids, tool mask and end (truncated or not), and the batch's tool-call and failure counts, from our
grouprl/episodes.generate_episodes equal what the real TRL 1.16 GRPOTrainer makes with the same tools and the same
tokenizer. TRL's own code runs, not a transcription: a GRPOTrainer is built on the CPU (the tiny model, the tiny
tokenizer carrying TRL's Qwen3 chat template, tools=[...], max_tool_calling_iterations, mask_truncated_completions)
and its _generate_and_score_completions runs whole: _tokenize_prompts, _generate_single_turn (its HF generate
path, the EOS cut), parse_response, _tool_call_loop (the tool calls, _get_tool_suffix_ids, the rollback past the
budget, the iteration limit, the cut of a post-tool turn) and the truncation that mask_truncated_completions reads.
The one stand-in, on both sides, is the model's generate: it appends each row's next scripted turn (its text, then
EOS unless the turn is meant to be cut), as HF generate returns ids, at most max_new_tokens. Our side runs its real
tool worker (grouprl/tool_worker.py) on the same file TRL imports the functions from."""
import importlib.util
import json
import math
import os
import re
import tempfile
import types

import pytest
import torch
from helpers import ROOT, trl

from grouprl import modeling, rewards
from grouprl.data import chat_prompts
from grouprl.episodes import Tools, env_scores, generate_episodes
from grouprl.rewards import Rewards
from grouprl.sampling import Sampling

TOOLS_FILE = os.path.join(ROOT, "tests", "programs", "bad_tools.py")
NAMES = ["multiply", "repeat", "listing", "mapping", "nothing", "empty", "boom"]
BUDGET, LIMIT = 700, 2  # max_completion_length = --max-new-tokens; max_tool_calling_iterations = --max-tool-calls
CUT = "\x00"  # a scripted turn that ends with it has no EOS: generate runs into the budget


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def raw(body):
    return "<tool_call>\n" + body + "\n</tool_call>"


# each episode's model turns, in order (a turn past the list is an EOS alone)
EPISODES = {
    "answer": ["42"],
    "one call": [call("multiply", a=6, b=7), "so 42"],
    "two calls, one round": [call("multiply", a=2, b=3) + "\n" + call("multiply", a=4, b=5), "6 and 20"],
    "content, then a call": ["let me see\n" + call("multiply", a=6, b=7), "42"],
    "thinking, then a call": ["<think>\nhm\n</think>\n\n" + call("multiply", a=6, b=7), "42"],
    "the iteration limit": [call("multiply", a=1, b=1), call("multiply", a=2, b=2), call("multiply", a=3, b=3),
                            "never"],
    "two calls a round, to the limit": [call("multiply", a=1, b=2) + "\n" + call("multiply", a=3, b=4)] * 3
    + ["never"],
    "an exception": [call("boom", message="no"), "ok"],
    "an unknown tool": [call("nope"), "ok"],
    "an unknown argument": [call("multiply", a=6, c=7), "ok"],
    "a missing argument": [call("multiply", a=6), "ok"],
    "results of each type": [call("mapping", key="k") + "\n" + call("nothing") + "\n" + call("empty"), "ok"],
    "no arguments key": [raw('{"name": "nothing"}'), "ok"],
    "bad JSON": [raw('{"name": "multiply", "arguments": {"a": 6,'), "never"],
    "no name": [raw('{"arguments": {"a": 6}}'), "never"],
    "a name not a string": [raw('{"name": 3, "arguments": {}}'), "never"],
    "not an object": [raw('[1, 2]'), "never"],
    "arguments null": [raw('{"name": "nothing", "arguments": null}'), "ok"],
    "an unclosed call": ['<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}', "never"],
    "a result past the budget": [call("repeat", text="x", times=2000), "never"],
    "a post-tool turn cut": [call("multiply", a=6, b=7), "y" * 900 + CUT],
    "a first turn cut": ["z" * 900 + CUT],
    "a call cut by the budget": ['<tool_call>\n{"name": "multiply", "arguments": {"a": "' + "9" * 900 + CUT],
    "arguments a list": [raw('{"name": "multiply", "arguments": [6, 7]}'), "ok"],
    "arguments a JSON string": [raw('{"name": "multiply", "arguments": "{\\"a\\": 6, \\"b\\": 7}"}'), "ok"],
    "words after the call": [call("multiply", a=6, b=7) + " and more words", "ok"],
    "text between two calls": [call("multiply", a=2, b=3) + " then " + call("multiply", a=4, b=5), "ok"],
    "a number given as a string": [call("multiply", a="6", b=7), "ok"],  # typed by the schema: 6
    "a list result": [call("listing", n=2), "ok"],  # content blocks, as TRL passes a list on
}


class ScriptedLM:
    """The model's generate on both sides: each row's next scripted turn. The row's episode is read from its
    prompt ('ep<k>: ...'), its turn from the assistant headers in it (the prompt's one, then one a tool turn)."""

    def __init__(self, tok, episodes, max_position_embeddings=1 << 16):
        self.tok, self.episodes = tok, list(episodes.values())
        self.config = types.SimpleNamespace(max_position_embeddings=max_position_embeddings)

    def turn_ids(self, row: list[int]) -> list[int]:
        text = self.tok.decode(row)
        turns = self.episodes[int(re.search(r"ep(\d+):", text).group(1))]
        k = text.count("<|im_start|>assistant") - 1
        turn = turns[k] if k < len(turns) else ""
        ids = self.tok(turn.rstrip(CUT), add_special_tokens=False).input_ids
        return ids if turn.endswith(CUT) else ids + [self.tok.eos_token_id]

    def generate(self, input_ids, attention_mask=None, generation_config=None, max_new_tokens=None, **kw):
        most = max_new_tokens or generation_config.max_new_tokens
        pad = self.tok.pad_token_id
        new = [self.turn_ids([t for t in row if t != pad])[:most] for row in input_ids.tolist()]
        T = max(map(len, new))
        return torch.cat([input_ids, torch.tensor([t + [pad] * (T - len(t)) for t in new])], 1)


def qwen3_tiny_tokenizer(training=True):
    """The built-in tiny tokenizer (one token a character, Qwen's specials) carrying Qwen3's format: TRL parses tool
    calls only for templates it ships, and the tiny template renders no tool_calls. training: TRL's
    prefix-preserving Qwen3 template (what GRPOTrainer renders with when given Qwen3's own, which is not
    prefix-preserving) and the response template add_response_schema sets for Qwen3; else Qwen3's own template."""
    from trl.chat_template_utils import qwen3_chat_template, qwen3_template, qwen3_training_chat_template

    tok = modeling.tiny_tokenizer()
    tok.chat_template = qwen3_training_chat_template if training else qwen3_chat_template
    if training:
        tok.response_template = qwen3_template
    return tok


def tool_functions():
    spec = importlib.util.spec_from_file_location("bad_tools", TOOLS_FILE)  # as the worker names it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [getattr(module, name) for name in NAMES]


def trl_episodes(episodes, budget=BUDGET, limit=LIMIT, max_position_embeddings=1 << 16, tokenizer=None,
                 thinking=None, environment=None, columns=None, names=NAMES):
    """TRL 1.16's GRPOTrainer on the episodes' prompts -> (per episode: completion ids, tool mask, truncated),
    (tool calls, failed calls), the trainer. The model is the tiny Qwen3 (its context raised past every episode
    here unless max_position_embeddings says otherwise: TRL also drops a tool result at the model's context).
    environment: a class, TRL's environment_factory; columns: {name: a value an episode}, the rows' other
    columns (reset(**row) gets them); names: bad_tools.py's functions given as tools=."""
    GRPOTrainer = trl()[0]  # skips (fails in CI) without TRL 1.16
    from datasets import Dataset
    from transformers import Qwen3ForCausalLM
    from trl import GRPOConfig

    tok = tokenizer or qwen3_tiny_tokenizer()
    config = modeling.tiny_config(tok)
    config.max_position_embeddings = max_position_embeddings

    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(config)
    B = len(episodes) + len(episodes) % 2  # a multiple of num_generations (a row more: episode 0 again)
    assert B == len(episodes) or not any("<tool_call>" in turn for turn in list(episodes.values())[0])
    prompts = [[{"role": "user", "content": f"ep{k % len(episodes)}: 6*7="}] for k in range(B)]
    rows = [{"prompt": p, **{c: v[k % len(episodes)] for c, v in (columns or {}).items()}}
            for k, p in enumerate(prompts)]
    out_dir = tempfile.TemporaryDirectory(prefix="trl_episodes_")  # TRL makes its output_dir
    args = GRPOConfig(output_dir=out_dir.name, use_cpu=True, per_device_train_batch_size=B,
                      num_generations=2, max_completion_length=budget, max_tool_calling_iterations=limit,
                      mask_truncated_completions=True, report_to=[], save_strategy="no", bf16=False,
                      chat_template_kwargs=None if thinking is None else {"enable_thinking": thinking})
    trainer = GRPOTrainer(model=lm, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          tools=[f for f in tool_functions() if f.__name__ in names],
                          environment_factory=environment)
    lm.generate = ScriptedLM(tok, episodes).generate
    seen = {}
    real = trainer._generate

    def spy(prompts):  # TRL's own _generate, its lists kept for the comparison
        seen["out"] = real(prompts)
        return seen["out"]

    trainer._generate = spy
    out = trainer._generate_and_score_completions(rows)
    out_dir.cleanup()
    trainer.seen_prompt_ids, completion_ids, tool_mask, *_ = seen["out"]
    truncated = (out["completion_mask"].sum(1) == 0).tolist()  # mask_truncated_completions: no EOS at the end
    metrics = trainer._metrics["train"]
    calls = round(metrics["tools/call_frequency"][-1] * B)
    failed = round(metrics["tools/failure_frequency"][-1] * calls)
    n = len(episodes)
    return [(completion_ids[k], tool_mask[k], truncated[k]) for k in range(n)], (calls, failed), trainer


CPU_ENV = types.SimpleNamespace(device=torch.device("cpu"), sharded=False, world=1, main=True, rank=0)


def our_episodes(episodes, budget=BUDGET, limit=LIMIT, max_position_embeddings=1 << 16, tokenizer=None,
                 thinking=None, environment=None, columns=None, names=NAMES):
    """grouprl/episodes.generate_episodes on the same prompts, templated as data.chat_prompts templates them ->
    the same lists, (calls, failed), the Rollout. environment: 'FILE.py:Class' (--environment); then the prompts
    are the batch's rows, as the rollout gives them: prompt (messages), columns, text (templated)."""
    tok = tokenizer or qwen3_tiny_tokenizer()
    tools = Tools(f"{TOOLS_FILE}:{','.join(names)}" if names else None, limit, environment=environment,
                  template={"enable_thinking": thinking})
    prompts = chat_prompts(tok, [f"ep{k}: 6*7=" for k in range(len(episodes))], thinking,
                           tools=tools.schemas)  # as data.load_task renders --tools' prompts
    if environment:
        prompts = {"prompt": [[{"role": "user", "content": f"ep{k}: 6*7="}] for k in range(len(episodes))],
                   **(columns or {}), "text": prompts}
    try:
        roll = generate_episodes(ScriptedLM(tok, episodes, max_position_embeddings), tok, prompts, 1,
                                 [tok.eos_token_id], CPU_ENV, Sampling(max_new_tokens=budget, mode="repeat"), tools)
    finally:
        tools.stop()
    P, out = roll.n_prompt, []
    for k in range(len(episodes)):
        length = int(roll.attention_mask[k, P:].sum())
        out.append((roll.input_ids[k, P:P + length].tolist(), roll.mask[k, :length].long().tolist(),
                     bool(roll.truncated[k])))
    calls = round(roll.stats["tools/call_frequency"] * len(episodes))
    return out, (calls, round(roll.stats["tools/failure_frequency"] * calls)), roll


@pytest.fixture(scope="module")
def both():
    return trl_episodes(EPISODES), our_episodes(EPISODES)


def test_the_tiny_tokenizer_carries_qwen3_for_trl(both):
    """TRL parses the tiny tokenizer's turns as Qwen3's and renders with the template as given (prefix-preserving:
    no template swapped in); the batch's tool calls and failed calls are TRL's (tools/call_frequency and
    tools/failure_frequency, as counts)."""
    from trl.chat_template_utils import qwen3_template

    (_, trl_counts, trainer), (_, our_counts, _) = both
    assert trainer._tokenizer.response_template == qwen3_template and trainer.chat_template is None
    assert our_counts == trl_counts and trl_counts[0] > 10 and trl_counts[1] >= 4


def test_a_list_result_goes_on_as_a_list():
    """The worker passes a tool's list result on as a list (TRL's content blocks) where it is JSON within
    MAX_RESULT_CHARS and valid UTF-8; else its str, as any other result."""
    from grouprl import tool_worker

    assert tool_worker.result(["a", {"type": "text", "text": "b"}]) == ["a", {"type": "text", "text": "b"}]
    assert tool_worker.result([object]) == str([object]) and tool_worker.result(("a",)) == "('a',)"
    assert tool_worker.result(["\ud800"]) == "['\\ud800']"  # a lone surrogate: its escape, as text does
    assert tool_worker.result(["x" * tool_worker.MAX_RESULT_CHARS]) == str(["x" * tool_worker.MAX_RESULT_CHARS])[
        :tool_worker.MAX_RESULT_CHARS]


def assert_same_ids_and_mask(theirs, ours):
    (trl_ids, trl_mask, _), (our_ids, our_mask, _) = theirs, ours
    tok = qwen3_tiny_tokenizer()
    assert our_ids == trl_ids, f"\nours: {tok.decode(our_ids)!r}\nTRL:  {tok.decode(trl_ids)!r}"
    assert our_mask == trl_mask


@pytest.mark.parametrize("name", list(EPISODES))
def test_episode_ids_and_mask_equal_trl(both, name):
    """The episode's completion ids (every model turn's EOS, the tool segment's exact tokens, a turn cut at the
    budget) and its tool mask (1 on the model's tokens, 0 on the tool segment) are TRL's."""
    (theirs, _, _), (ours, _, _) = both
    k = list(EPISODES).index(name)
    assert_same_ids_and_mask(theirs[k], ours[k])


@pytest.mark.parametrize("name", list(EPISODES))
def test_episode_end_equals_trl(both, name):
    """Truncated (no EOS at the end: TRL's mask_truncated_completions masks the episode) or not, as TRL says: a
    rolled-back episode ends with the calling turn's EOS, not truncated."""
    (theirs, _, _), (ours, _, _) = both
    k = list(EPISODES).index(name)
    assert ours[k][2] == theirs[k][2]


def test_qwen3_own_template_stops_at_the_prompts():
    """Qwen3's own template is not prefix-preserving: TRL renders episodes with its training template
    (get_training_chat_template, swapped in by GRPOTrainer); we ship none, so templating the prompts with the tools
    (data.load_task, before the model) stops in one line saying what to do."""
    from grouprl import tools as tools_mod

    two = {name: EPISODES[name] for name in ("answer", "one call")}
    trainer = trl_episodes(two, tokenizer=qwen3_tiny_tokenizer(training=False))[2]
    assert trainer.chat_template is not None  # TRL swapped its template in
    schemas = tools_mod.load_tools(f"{TOOLS_FILE}:multiply")[1]
    with pytest.raises(SystemExit, match="not prefix-preserving.*get_training_chat_template.*chat_template"):
        chat_prompts(qwen3_tiny_tokenizer(training=False), ["ep0: 6*7="], tools=schemas)
    assert chat_prompts(qwen3_tiny_tokenizer(), ["ep0: 6*7="], tools=schemas)  # TRL's training template passes


def test_enable_thinking_false_in_the_tool_turn():
    """--enable-thinking false: Qwen3's generation prompt pre-writes an empty <think> block, in the prompt and in
    each tool turn's tail (TRL passes chat_template_kwargs to _get_tool_suffix_ids), so both have it."""
    two = {name: EPISODES[name] for name in ("answer", "one call")}
    theirs = trl_episodes(two, thinking=False)[0]
    ours = our_episodes(two, thinking=False)[0]
    assert "<think>\n\n</think>" in qwen3_tiny_tokenizer().decode(theirs[1][0])
    assert_same_ids_and_mask(theirs[1], ours[1])


def test_a_turn_parsed_after_what_the_template_prewrote():
    """A template whose generation prompt opens '<think>\n' (as Qwen3's thinking models' do): TRL parses the turn
    with the history as prefix=, so a call written inside the open think block is reasoning, not a call; a call
    after '</think>' runs. Ours parses the turn after the history's tail past the last assistant header."""
    from trl.chat_template_utils import qwen3_template, qwen3_training_chat_template

    head = "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking"
    assert head in qwen3_training_chat_template

    def opening():
        tok = modeling.tiny_tokenizer()
        tok.chat_template = qwen3_training_chat_template.replace(
            head, "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking")
        tok.response_template = qwen3_template
        return tok

    episodes = {"answer": ["42"],
                "a call inside the think block": ["hm " + call("multiply", a=6, b=7) + "\n</think>\n\nok", "never"],
                "a call after it": ["hm\n</think>\n\n" + call("multiply", a=6, b=7),  # then one inside again
                                    "hm " + call("multiply", a=1, b=1) + "\n</think>\n\n42"],
                "the answer": ["hm\n</think>\n\n42"]}
    theirs, trl_counts, _ = trl_episodes(episodes, tokenizer=opening())
    ours, our_counts, _ = our_episodes(episodes, tokenizer=opening())
    assert trl_counts == our_counts == (1, 0)
    for k in range(len(episodes)):
        assert_same_ids_and_mask(theirs[k], ours[k])


def test_the_model_context_drops_a_result():
    """TRL also drops a tool result when prompt + completion + tool turn reach the model's max_position_embeddings
    (not only past the budget): so does generate_episodes (context_of)."""
    two = {name: EPISODES[name] for name in ("answer", "one call")}
    theirs = trl_episodes(two, max_position_embeddings=64)[0]
    ours = our_episodes(two, max_position_embeddings=64)[0]
    assert theirs[1][0][-1] == 2  # TRL: the turn that called, its EOS, nothing more
    assert_same_ids_and_mask(theirs[1], ours[1])


def test_prompt_ids_equal_trl(both):
    """The prompt TRL generates from, the tools' schemas rendered into Qwen3's system message, token for token."""
    (_, _, trainer), (_, _, roll) = both
    P, tok = roll.n_prompt, qwen3_tiny_tokenizer()
    ours = roll.input_ids[0, P - int(roll.attention_mask[0, :P].sum()):P].tolist()
    theirs = tok.decode(trainer.seen_prompt_ids[0])
    assert theirs.startswith("<|im_start|>system\n# Tools\n") and theirs.endswith(tok.decode(ours))  # the difference
    assert ours == trainer.seen_prompt_ids[0]


# ---- --environment FILE.py:Class: TRL's environment_factory (issue 62 item 8, its environment part)
# For scripted model turns, each episode's prompt (reset's string appended to the last user message, then templated
# with the tools), its completion ids, tool mask and end, the batch's tool-call and failure counts, and get_reward's
# value an episode (one more reward source of weight 1, named for the class) from our generate_episodes and
# env_scores equal what TRL 1.16's GRPOTrainer makes with environment_factory=Ledger (tests/programs/episode_envs.py)
# beside tools=[multiply] (TRL's tool dict: the standalone tools, then the instance's methods). Three differences
# this found, fixed: a static method's schema (ours dropped its first argument as if it were self), an async method
# (ours answered its coroutine's str; TRL awaits it after the round's other calls, the async ones together) and an
# async get_reward (ours failed on float(coroutine); TRL awaits it).
ENV_FILE = os.path.join(ROOT, "tests", "programs", "episode_envs.py")
ENV = f"{ENV_FILE}:Ledger"

# each episode: the row's 'obs' (reset's string: '' gives None, 'keys' the row's keys), the model's turns
ENV_EPISODES = {
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
    "a static method": ("", [call("double", n=21), "42"]),  # its schema has every argument (no self)
    "an async method": ("", [call("later", n=3), "3"]),
    "async, then sync, in one round": ("", [call("later", n=1) + "\n" + call("add", n=2), "3"]),  # add's first
    "an async method raises": ("", [call("later", n=-1) + "\n" + call("later", m=1) + "\n" + call("add", n=1),
                                    "ok"]),
    "reset text, a bad call": (" Hm.", ['<tool_call>\n{"name": "add", "arguments": {"n": 1,\n</tool_call>', "x"]),
}
ENV_TURNS = {name: turns for name, (_, turns) in ENV_EPISODES.items()}
ENV_COLUMNS = {"obs": [obs for obs, _ in ENV_EPISODES.values()]}


def ledger():
    spec = importlib.util.spec_from_file_location("episode_envs", ENV_FILE)  # as the worker names it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Ledger


@pytest.fixture(scope="module")
def env_both():
    return (trl_episodes(ENV_TURNS, environment=ledger(), columns=ENV_COLUMNS, names=["multiply"]),
            our_episodes(ENV_TURNS, environment=ENV, columns=ENV_COLUMNS, names=["multiply"]))


@pytest.mark.parametrize("name", list(ENV_EPISODES))
def test_environment_prompt_ids_equal_trl(env_both, name):
    """The prompt an episode generates from: reset's string appended to the user message as TRL appends it (None:
    the prompt as it is), templated with the tools (multiply, then Ledger's methods), token for token."""
    (_, _, trainer), (_, _, roll) = env_both
    k, P = list(ENV_EPISODES).index(name), roll.n_prompt
    ours = roll.input_ids[k, P - int(roll.attention_mask[k, :P].sum()):P].tolist()
    tok = qwen3_tiny_tokenizer()
    assert ours == trainer.seen_prompt_ids[k], (
        f"\nours: {tok.decode(ours)!r}\nTRL:  {tok.decode(trainer.seen_prompt_ids[k])!r}")


def test_environment_reset_strings(env_both):
    """What the prompts carry: reset's text where it gave one, the row's keys as reset is given them (every column
    of the row but our templated 'text': TRL passes the row whole), nothing where it gave None."""
    (_, _, trainer), _ = env_both
    tok = qwen3_tiny_tokenizer()
    texts = [tok.decode(trainer.seen_prompt_ids[k]) for k in range(len(ENV_EPISODES))]
    assert "ep1: 6*7= Start at 0.<|im_end|>" in texts[1] and "ep0: 6*7=<|im_end|>" in texts[0]
    assert "ep10: 6*7= (row: prompt)<|im_end|>" in texts[10]
    assert texts[0].startswith("<|im_start|>system\n# Tools\n") and '"name": "pad"' in texts[0]


@pytest.mark.parametrize("name", list(ENV_EPISODES))
def test_environment_episode_equals_trl(env_both, name):
    """The episode's completion ids, tool mask and end (truncated or not) are TRL's."""
    (theirs, _, _), (ours, _, _) = env_both
    k = list(ENV_EPISODES).index(name)
    assert_same_ids_and_mask(theirs[k], ours[k])
    assert ours[k][2] == theirs[k][2]


def test_environment_counts_equal_trl(env_both):
    """tools/call_frequency and tools/failure_frequency, as counts over the batch, are TRL's."""
    (_, trl_counts, _), (_, our_counts, _) = env_both
    assert our_counts == trl_counts and trl_counts[0] >= 12 and trl_counts[1] >= 2


def test_get_reward_equals_trl(env_both):
    """get_reward an episode, from the instance's state at the episode's end (a rolled-back call's change kept, a
    failed call's too, two episodes alike scoring alike: no state shared; get_reward async, awaited as TRL awaits
    it), equals TRL's reward column named for the class; None (no call made) is NaN in both. Ours go through env_scores and rewards.score (weight 1) as
    the step's do, logged as rewards/Ledger/."""
    (_, _, trainer), (_, _, roll) = env_both
    n = len(ENV_EPISODES)
    theirs = list(trainer._logs["rewards"]["Ledger"])[:n]
    given = env_scores(roll, Tools(None, LIMIT, environment=ENV))  # as evaluate's; the step's: tools_of(args)
    reward = Rewards([])
    r, errors = rewards.score(roll.texts, ["42"] * n, 1, reward, watch=True, given=given)
    ours = reward.values["Ledger"].tolist()
    assert errors == 0 and [p.name for p, _ in reward.parts] == ["Ledger"]
    assert [math.isnan(x) for x in ours] == [math.isnan(x) for x in theirs]
    assert [x for x in ours if not math.isnan(x)] == [x for x in theirs if not math.isnan(x)]
    named = dict(zip(ENV_EPISODES, ours))
    assert named["state carried between calls"] == named["the same episode again: its own state"] == 5.5
    assert named["the rollback past the budget"] == 7.5 and named["an exception in a method"] == 4.5
    assert named["async, then sync, in one round"] == 3.5 and named["an async method"] == 3.25
    assert math.isnan(named["reset None, an answer"]) and r.tolist() == [0 if math.isnan(x) else x for x in ours]



def test_environment_with_enable_thinking_false():
    """--enable-thinking false with an environment: the prompt reset's string is appended to is templated again with
    it (TRL's chat_template_kwargs), as is each tool turn's tail."""
    two = {name: ENV_EPISODES[name] for name in ("reset None, an answer", "reset text, one call")}
    turns, columns = {k: t for k, (_, t) in two.items()}, {"obs": [obs for obs, _ in two.values()]}
    theirs, _, trainer = trl_episodes(turns, environment=ledger(), columns=columns, names=["multiply"], thinking=False)
    ours, _, roll = our_episodes(turns, environment=ENV, columns=columns, names=["multiply"], thinking=False)
    P, tok = roll.n_prompt, qwen3_tiny_tokenizer()
    prompt = roll.input_ids[1, P - int(roll.attention_mask[1, :P].sum()):P].tolist()
    assert prompt == trainer.seen_prompt_ids[1] and tok.decode(prompt).endswith(
        " Start at 0.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert_same_ids_and_mask(theirs[1], ours[1])
