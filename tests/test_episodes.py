"""Episodes (grouprl/episodes.py, grouprl/tools.py): tool calls parsed as TRL 1.16 parses the Qwen3/Hermes
format, tools' schemas as transformers makes them and rendered into the prompt as TRL renders them, tools run in a
worker that a hang or a crash cannot take down, --environment's instances (TRL's environment_factory) one per episode
in that worker, get_reward as one more reward, a scripted episode's exact ids and mask, and the key test: GSPO's and
GRPO's loss on an episode is the loss over the model's tokens only, with no gradient at any tool token."""
import os
import time
import types

import pytest
import torch
from helpers import ROOT, fails_before_any_model, run_script, value_and_grad

import grpo
import gspo
from grouprl import data, episodes, modeling, rewards
from grouprl import tools as tools_module
from grouprl.episodes import Tools, generate_episodes, parse_calls, tool_suffix_ids
from grouprl.generation import Rollout
from grouprl.grader import Rewards
from grouprl.sampling import Sampling
from grouprl.tools import tools_text

TOOLS_FILE = os.path.join(ROOT, "tests", "programs", "tools_example.py")
ENV_FILE = os.path.join(ROOT, "tests", "programs", "counter_env.py")
ENV = f"{ENV_FILE}:Counter"
ENVS = os.path.join(ROOT, "tests", "programs", "episode_envs.py")  # the tests' own classes
BAD_TOOLS = os.path.join(ROOT, "tests", "programs", "bad_tools.py")  # tools that misbehave, each one way
BAD_IMPORT = os.path.join(ROOT, "tests", "programs", "bad_import.py")  # a file that misbehaves as it is imported
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


# ---- parsing a model turn, the schema, the tool turn's tokens


def test_parse_calls_as_trl():
    assert parse_calls("just an answer: 42") == []
    assert parse_calls(CALL) == [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    two = "let me see\n" + CALL + '\n<tool_call>{"name": "hang", "arguments": {"seconds": 1}}</tool_call>'
    assert parse_calls(two) == [{"name": "multiply", "arguments": {"a": 6, "b": 7}},
                                {"name": "hang", "arguments": {"seconds": 1}}]
    assert parse_calls("<think>\nhm\n</think>\n" + CALL) == [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    assert parse_calls('<tool_call>{"name": "f"}</tool_call>') == [{"name": "f", "arguments": {}}]  # TRL: {}
    # malformed: not a call (TRL decodes the turn as text), one bad call spoils the turn
    assert parse_calls('<tool_call>{"name": "multiply", "arguments": {"a": 6,</tool_call>') is None
    assert parse_calls('<tool_call>{"arguments": {"a": 6}}</tool_call>') is None  # no name
    assert parse_calls('<tool_call>{"name": 3, "arguments": {}}</tool_call>') is None
    assert parse_calls(CALL + '<tool_call>{"name": </tool_call>') is None
    assert parse_calls("<tool_call>unclosed") is None
    assert parse_calls(CALL[:-len("</tool_call>")] + "<|im_end|>") is None  # unclosed: the EOS in its JSON
    # TRL's: calls anywhere in the turn (the words are content), arguments of any JSON type kept (the call
    # then fails as fn(**[1]) does), a string argument typed by the tool's schema
    assert parse_calls(CALL + " and then more words") == [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    assert parse_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>') == [{"name": "f", "arguments": [1]}]
    schema = episodes.load_tools(f"{TOOLS_FILE}:multiply")[1]
    assert parse_calls(CALL.replace("6", '"6"'), schema) == [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    assert episodes.typed({"name": "multiply", "arguments": {"a": "6", "b": "x"}}, schema) == {"a": 6, "b": "x"}


def test_schema_of_a_typed_documented_function():
    fns, schemas = episodes.load_tools(f"{TOOLS_FILE}:multiply,hang")
    assert list(fns) == ["multiply", "hang"] and fns["multiply"](6, 7) == 42
    assert schemas[0] == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor"}}, "required": ["a", "b"]},
        "return": {"type": "integer"}}}


def test_tool_turn_of_the_tiny_template():
    """The tiny template renders {'role': 'tool'} as any turn: TRL's suffix is the EOS's newline, the tool turn,
    and the next assistant header."""
    tok = modeling.tiny_tokenizer()
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}])
    assert tok.decode(suffix) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_tool_checks_are_one_line(monkeypatch, tmp_path):
    ok = dict(tools=f"{TOOLS_FILE}:multiply", max_tool_calls=2, gen_mode="shared-prefill", old_logp="recompute")
    for bad, needle in [(dict(tools="tools.txt"), "FILE.py:fn"), (dict(tools="nowhere.py:f"), "no file"),
                        (dict(tools=f"{TOOLS_FILE}:nope"), "no function 'nope'"),
                        (dict(max_tool_calls=0), "at least 1")]:
        with pytest.raises(SystemExit) as e:
            episodes.check_tool_args(types.SimpleNamespace(**{**ok, **bad}), False)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg
    episodes.check_tool_args(types.SimpleNamespace(**ok), False)
    fails_before_any_model("gspo", ["--tools", "nowhere.py:f"], "no file", monkeypatch, tmp_path)


# ---- tools out of the trainer's process


def test_bad_tools_cost_a_call_never_the_run():
    tools = Tools(f"{TOOLS_FILE}:multiply,hang,boom,die,flood", timeout_s=2.0)
    try:
        assert tools.call("multiply", {"a": 6, "b": 7}) == ("42", False)
        assert tools.call("boom", {"message": "no"}) == ("{'error': 'no'}", True)
        assert tools.call("nope", {}) == ("{'error': 'Tool nope not found.'}", True)
        content, failed = tools.call("multiply", {"a": 6, "c": 7})
        assert failed and content.startswith("{'error': ") and "'c'" in content
        content, failed = tools.call("hang", {"seconds": 60})
        assert failed and "did not answer in 2 s" in content
        content, failed = tools.call("die", {"code": 3})
        assert failed and "exit code 3" in content
        content, failed = tools.call("flood", {"megabytes": 10})
        assert not failed and content == "x" * 100_000  # cut at the worker's MAX_RESULT_CHARS
        assert tools.call("multiply", {"a": 2, "b": 3}) == ("6", False)  # a fresh worker after each
    finally:
        tools.stop()


def test_the_worker_bounds_memory_kills_forks_and_sends_utf8(tmp_path, monkeypatch):
    """A tool mapping 8 GB gets ENOMEM, its call's error (the worker's address space is bounded); a child a tool forked dies
    with the worker; a lone surrogate comes back escaped (the tokenizer takes it)."""
    monkeypatch.setenv("BAD_TOOLS_DIR", str(tmp_path))
    tools = Tools(f"{BAD_TOOLS}:allocate,forker,surrogate")
    try:
        content, failed = tools.call("allocate", {})
        assert failed and "Cannot allocate memory" in content, content  # mmap past RLIMIT_AS: ENOMEM
        content, failed = tools.call("surrogate", {})
        assert not failed and content == "bad \\ud800 text", content
        modeling.tiny_tokenizer()(content)  # encodes
        content, failed = tools.call("forker", {})
        assert not failed and content.startswith("forked"), content
    finally:
        tools.stop()
    child = int((tmp_path / "children.txt").read_text())
    time.sleep(0.2)
    stat = f"/proc/{child}/stat"  # gone, or a zombie waiting for init to reap it: not running
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("mode, needle", [("exit", "raised SystemExit: 3"), ("die", "ended its process (exit code 0)"),
                                          ("hang", "took more than 1 s")])
def test_a_tools_file_that_exits_or_hangs_at_import_is_one_line(mode, needle, monkeypatch):
    """The file is imported first in a worker of its own: sys.exit, os._exit or a hang at its top level cost that
    worker, and the trainer says so in one line (before, the trainer exited 3, exited 0 silently, or hung)."""
    monkeypatch.setenv("BAD_IMPORT", mode)
    monkeypatch.setattr(tools_module, "START_TIMEOUT_S", 1.0)
    tools_module.load_tools.cache_clear()  # the file made anew: its import now behaves as BAD_IMPORT says
    with pytest.raises(SystemExit) as e:
        tools_module.load_tools(f"{BAD_IMPORT}:echo")
    msg = str(e.value.code)
    assert msg.startswith("error: --tools ") and "\n" not in msg and needle in msg, msg
    monkeypatch.setenv("BAD_IMPORT", "")
    assert list(tools_module.load_tools(f"{BAD_IMPORT}:echo")[0]) == ["echo"]



def test_a_tools_file_is_probed_once_a_process(monkeypatch):
    """The start-up's readers of --tools and --environment (the flags' check, the prompts' schemas, Tools) share
    one import of each file: one probe worker each, not one a reader."""
    probes = []
    monkeypatch.setattr(tools_module, "probe", lambda path: probes.append(path))
    tools_module.load_tools.cache_clear(), tools_module.load_environment.cache_clear()
    spec, env = f"{BAD_TOOLS}:multiply", f"{ENVS}:Where"
    episodes.check_tool_args(types.SimpleNamespace(tools=spec, environment=env, max_tool_calls=2,
                                                   gen_mode="shared-prefill"), False)
    schemas = tools_module.tool_schemas(spec, env)
    assert Tools(spec, environment=env).schemas == schemas and probes == [BAD_TOOLS, ENVS]
    tools_module.load_tools.cache_clear(), tools_module.load_environment.cache_clear()

# ---- a scripted episode: exact ids and mask


class Scripted:
    """A policy whose generate appends the next scripted turn to each row (text, then EOS)."""

    def __init__(self, tok, turns):
        self.tok, self.turns = tok, list(turns)

    def generate(self, input_ids, attention_mask, n=1, **kw):
        texts = self.turns.pop(0)
        assert len(texts) == input_ids.shape[0]
        new = [self.tok(t, add_special_tokens=False).input_ids + [self.tok.eos_token_id] for t in texts]
        T = max(map(len, new))
        tail = torch.tensor([t + [self.tok.pad_token_id] * (T - len(t)) for t in new])
        return torch.cat([input_ids, tail], 1)


PROMPT = "<|im_start|>user\n6*7=<|im_end|>\n<|im_start|>assistant\n"  # as data.chat_prompts templates it
CPU_ENV = types.SimpleNamespace(device=torch.device("cpu"), sharded=False, world=1, main=True, rank=0)


def scripted_episode(budget=200, max_calls=2):
    """Two episodes of the prompt '6*7=': the first calls multiply then answers, the second answers at once.
    -> (the Rollout, the tokenizer, the expected completion ids and model-token positions per row)."""
    tok = modeling.tiny_tokenizer()
    eos, enc = tok.eos_token_id, lambda s: tok(s, add_special_tokens=False).input_ids
    policy = Scripted(tok, [[CALL, "no tool"], ["so 42"]])
    tools = Tools(f"{TOOLS_FILE}:multiply", max_calls)
    try:
        roll = generate_episodes(policy, tok, [PROMPT], 2, [eos], CPU_ENV,
                                 Sampling(max_new_tokens=budget, mode="repeat"), tools)
    finally:
        tools.stop()
    suffix = enc("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    turn1, turn2 = enc(CALL) + [eos], enc("so 42") + [eos]
    comp = [turn1 + suffix + turn2, enc("no tool") + [eos]]
    model = [list(range(len(turn1))) + list(range(len(turn1) + len(suffix), len(comp[0]))),
             list(range(len(comp[1])))]
    return roll, tok, comp, model


def test_scripted_episode_ids_and_mask():
    roll, tok, comp, model = scripted_episode()
    P, T = roll.n_prompt, len(comp[0])
    assert roll.input_ids.shape == (2, P + T) and roll.mask.shape == (2, T)
    prompt = tok(PROMPT, add_special_tokens=False).input_ids
    for i in range(2):
        assert roll.input_ids[i, :P].tolist() == prompt
        assert roll.input_ids[i, P:P + len(comp[i])].tolist() == comp[i]
        assert roll.attention_mask[i].tolist() == [1] * (P + len(comp[i])) + [0] * (T - len(comp[i]))
        assert roll.mask[i].nonzero().flatten().tolist() == model[i]  # 1 on the model's tokens only
    tool_tokens = [t for t in range(len(comp[0])) if t not in model[0]]
    assert len(tool_tokens) > 10 and roll.mask[0, tool_tokens].sum() == 0
    assert roll.texts == [CALL + "\nso 42", "no tool"] and roll.truncated.tolist() == [False, False]
    assert roll.stats["tools/call_frequency"] == 0.5 and roll.stats["tools/failure_frequency"] == 0.0
    assert roll.stats["tools/turns_per_episode"] == 1.5


def test_budget_rolls_back_a_result():
    """TRL's rollback: a tool turn that would pass the budget is dropped (the call counted); the episode ends with
    the calling turn's EOS, not truncated (TRL's), so not cut_by_budget."""
    tok = modeling.tiny_tokenizer()
    turn1 = len(tok(CALL, add_special_tokens=False).input_ids) + 1
    roll, _, _, _ = scripted_episode(budget=turn1 + 5)
    assert roll.truncated.tolist() == [False, False] and roll.stats["tools/rolled_back"] == 1
    assert roll.stats["tools/cut_by_budget"] == 0 and roll.stats["tools/cut_by_limit"] == 0
    assert roll.stats["tools/call_frequency"] == 0.5
    assert roll.mask[0].sum() == turn1 and roll.mask.shape[1] == turn1 and roll.texts[0] == CALL


class Checked(Scripted):
    """Scripted, refusing max_new_tokens < 1 as HF generate does (GenerationConfig.validate)."""

    def generate(self, input_ids, attention_mask, n=1, **kw):
        if kw["max_new_tokens"] < 1:
            raise ValueError(f"`max_new_tokens` must be greater than 0, but is {kw['max_new_tokens']}.")
        return super().generate(input_ids, attention_mask, n, **kw)


def test_a_tool_turn_that_fills_the_budget_ends_the_episode():
    """A tool turn that ends exactly at the budget is kept (TRL rolls back only past it) and leaves no room: the next
    turn is empty and the episode cut, as the engine's (Episodes.next), with HF generate asked for at least 1 token
    (0 is refused) even where the turn's rows (--gen-batch-size 1: row 0 alone) have no room."""
    tok = modeling.tiny_tokenizer()
    turn1 = tok(CALL, add_special_tokens=False).input_ids + [tok.eos_token_id]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}])
    tools = Tools(f"{TOOLS_FILE}:multiply", 2)
    try:
        roll = generate_episodes(Checked(tok, [[CALL], ["no"], ["unused"]]), tok, [PROMPT], 2, [tok.eos_token_id],
                                 CPU_ENV, Sampling(max_new_tokens=len(turn1) + len(suffix), mode="repeat",
                                                   gen_batch_size=1), tools)
    finally:
        tools.stop()
    P = roll.n_prompt
    assert roll.input_ids[0, P:].tolist() == turn1 + suffix and roll.mask[0].sum() == len(turn1)
    assert roll.truncated.tolist() == [True, False] and roll.texts[0] == CALL + "\n"
    assert roll.stats["tools/rolled_back"] == 0 and roll.stats["tools/turns_per_episode"] == 1.5


def episode_of(turns, tools, budget=300):
    tok = modeling.tiny_tokenizer()
    return tok, generate_episodes(Scripted(tok, turns), tok, [PROMPT], len(turns[0]), [tok.eos_token_id],
                                  CPU_ENV, Sampling(max_new_tokens=budget, mode="repeat"), tools)


def test_rounds_not_calls_are_capped():
    """--max-tool-calls 1: one round (its two calls both run); the next turn's call is not run."""
    tools = Tools(f"{TOOLS_FILE}:multiply", max_calls=1)
    try:
        _, roll = episode_of([[CALL + "\n" + CALL, "no"], [CALL]], tools)
    finally:
        tools.stop()
    assert roll.stats["tools/call_frequency"] == 1.0 and roll.stats["tools/turns_per_episode"] == 1.5
    assert roll.texts[0] == CALL + "\n" + CALL + "\n" + CALL and not roll.truncated.any()
    assert roll.stats["tools/cut_by_limit"] == 1 and roll.stats["tools/cut_by_budget"] == 0  # its last turn calls


def test_malformed_call_ends_the_episode_counted():
    bad = '<tool_call>{"name": </tool_call>'
    tok, roll = episode_of([[bad, "fine"]], types.SimpleNamespace(max_calls=3))  # no call: no tool runs
    assert roll.stats["tools/malformed_turns"] == 1 and roll.stats["tools/call_frequency"] == 0
    assert roll.mask.sum(1).tolist() == [len(tok(bad, add_special_tokens=False).input_ids) + 1, 5]


# ---- THE KEY TEST: only the model's tokens in the loss


def test_loss_over_an_episode_is_the_model_tokens_only():
    """gspo_loss and grpo_loss on the scripted episode's mask equal, value and gradient in float64, the loss by hand
    over the model's token positions (counted from the script, not from the mask), and the gradient at every tool
    token is exactly 0."""
    roll, _, comp, model = scripted_episode()
    B, T = roll.mask.shape
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    A = torch.tensor([1.0, -0.7], dtype=torch.float64)
    mask = roll.mask.to(torch.float64)
    eps = 0.2

    def gspo_by_hand(lp):
        terms = []
        for i in range(B):
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in model[i]) / len(model[i]))  # eq. 44 on y_i's tokens
            terms.append(torch.min(s * A[i], s.clamp(1 - eps, 1 + eps) * A[i]))
        return -sum(terms) / B

    def grpo_by_hand(lp):
        terms = []
        for i in range(B):
            w = [torch.exp(lp[i, t] - old[i, t]) for t in model[i]]
            terms.append(sum(torch.min(x * A[i], x.clamp(1 - eps, 1 + eps) * A[i]) for x in w) / len(model[i]))
        return -sum(terms) / B

    for fn, by_hand in [(lambda lp: gspo.gspo_loss(lp, old, A, mask, clip_low=eps, clip_high=eps)[0], gspo_by_hand),
                        (lambda lp: grpo.grpo_loss(lp, old, A, mask, clip_low=eps, clip_high=eps)[0], grpo_by_hand)]:
        value, grad = value_and_grad(fn, logp)
        value_hand, grad_hand = value_and_grad(by_hand, logp)
        torch.testing.assert_close(value, value_hand, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, grad_hand, rtol=1e-12, atol=1e-15)
        for i in range(B):
            outside = [t for t in range(T) if t not in model[i]]  # tool turn, template glue, padding
            assert (grad[i, outside] == 0).all()
        assert (grad[0, model[0]] != 0).any()


# ---- end to end


def test_gspo_runs_episodes_end_to_end(monkeypatch, tmp_path):
    """gspo.py --tools on the tiny model: every turn is read as a multiply call (the random model writes none), the real worker answers, the model generates again, and the step trains on the episodes."""
    call = {"name": "multiply", "arguments": {"a": 2, "b": 3}}
    monkeypatch.setattr(episodes, "parse_calls", lambda text: [call])
    rows, _ = run_script("gspo", ["--tools", f"{TOOLS_FILE}:multiply", "--max-tool-calls", "2", "--num-steps", "2",
                                  "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1",
                                  "--max-new-tokens", "48", "--eval-every", "0", "--log-samples", "0"],
                         monkeypatch, tmp_path / "o")
    train = [r for r in rows if "tools/call_frequency" in r]
    assert len(train) == 2 and all(r["tools/call_frequency"] > 0 for r in train)
    assert all(r["tools/failure_frequency"] == 0 for r in train)
    assert all(r["tools/turns_per_episode"] > 1 for r in train)  # some episodes went on after a tool turn
    episodes._TOOLS.pop((f"{TOOLS_FILE}:multiply", None, 2)).stop()


# ---- the tools in the prompt (TRL: apply_chat_template(tools=...)), the plain fallback


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def test_tools_rendered_into_the_prompt_as_trl():
    """A template that renders tools (TRL's Qwen3 one on the tiny tokenizer) gets the schemas exactly as TRL 1.16's
    GRPOTrainer passes its tools (the callables; transformers makes their schemas), the environment's methods after
    the functions; the tiny template, which renders none, gets the plain fallback at the end of the system message."""
    from trl.chat_template_utils import qwen3_training_chat_template

    from programs.counter_env import Counter

    schemas = episodes.load_tools(f"{TOOLS_FILE}:multiply")[1] + episodes.load_environment(ENV).schemas
    qwen = modeling.tiny_tokenizer()
    qwen.chat_template = qwen3_training_chat_template  # what TRL renders with (Qwen3's own is refused with tools)
    for prompt in ["6*7=", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7="}]]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        trl_text = qwen.apply_chat_template(messages, tools=[multiply, Counter().add], tokenize=False,
                                            add_generation_prompt=True)
        assert data.chat_prompts(qwen, [prompt], tools=schemas) == [trl_text]
        assert '"name": "multiply"' in trl_text and '"name": "add"' in trl_text
    assert data.chat_prompts(qwen, ["6*7="], tools=[]) == data.chat_prompts(qwen, ["6*7="])  # TRL's `or None`

    tiny, plain = modeling.tiny_tokenizer(), tools_text(schemas)
    assert "multiply(a: integer, b: integer) -> integer: Multiply two integers." in plain
    assert "add(n: integer) -> integer" in plain and "<tool_call>" in plain
    assert data.chat_prompts(tiny, ["6*7="], tools=schemas) == [
        f"<|im_start|>system\n{plain}<|im_end|>\n<|im_start|>user\n6*7=<|im_end|>\n<|im_start|>assistant\n"]
    assert data.chat_prompts(tiny, ["6*7="], system_prompt="Be brief.", tools=schemas) == [
        f"<|im_start|>system\nBe brief.\n\n{plain}<|im_end|>\n<|im_start|>user\n6*7=<|im_end|>\n"
        "<|im_start|>assistant\n"]
    assert data.chat_prompts(tiny, ["6*7="]) == [PROMPT]  # no tools: as before
    tiny.chat_template = None
    assert data.chat_prompts(tiny, ["6*7="], tools=schemas) == [plain + "\n\n6*7="]
    train, _, _ = data.load_task(data.Task("builtin", eval_size=2, tools=f"{TOOLS_FILE}:multiply"),
                                 modeling.tiny_tokenizer())
    assert plain.split("\n")[1] in train[0]["text"]  # the run's prompts show the tools


# ---- --environment: TRL's environment_factory, its instances in the tool worker


def test_environment_checks_are_one_line(monkeypatch, tmp_path):
    ok = dict(tools=None, environment=ENV, max_tool_calls=2, gen_mode="shared-prefill", old_logp="recompute")
    for change, needle in [(dict(environment="env.txt"), "FILE.py:Class"), (dict(environment=f"{ENVS}:A,B"), "FILE.py:Class"),
                           (dict(environment="nowhere.py:C"), "no file"), (dict(environment=f"{ENVS}:Nope"), "no class 'Nope'"),
                           (dict(environment=f"{ENVS}:NoReset"), "no reset method"),
                           (dict(environment=f"{ENVS}:NoTools"), "no public method"),
                           (dict(environment=f"{ENVS}:NoSchema"), "look has no JSON schema"),
                           (dict(environment=f"{ENVS}:Multiply", tools=f"{TOOLS_FILE}:multiply"), "both name a tool"),
                           (dict(max_tool_calls=0), "at least 1")]:
        with pytest.raises(SystemExit) as e:
            episodes.check_tool_args(types.SimpleNamespace(**{**ok, **change}), False)
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: episodes run (tests/test_episodes_dist.py), not on engine-tp
    with pytest.raises(SystemExit) as e:
        episodes.check_tool_args(types.SimpleNamespace(**{**ok, "gen_mode": "engine-tp"}), True)
    assert "engine-tp over several processes" in str(e.value.code) and "\n" not in str(e.value.code)
    for mode in ["shared-prefill", "engine"]:
        episodes.check_tool_args(types.SimpleNamespace(**{**ok, "gen_mode": mode}), True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    episodes.check_tool_args(types.SimpleNamespace(**{**ok, "gen_mode": "engine-tp"}), True)
    episodes.check_tool_args(types.SimpleNamespace(**ok), False)
    episodes.check_tool_args(types.SimpleNamespace(**{**ok, "tools": f"{TOOLS_FILE}:multiply"}), False)  # as TRL
    fails_before_any_model("gspo", ["--environment", "nowhere.py:C"], "no file", monkeypatch, tmp_path)


def test_environment_instances_live_in_the_worker_one_per_episode(tmp_path):
    """Each episode its own instance, in the worker's process, never shared; TRL's tool dict (the functions and the
    instance's methods, never reset or the scores); a crash of the worker loses no instance (made again from its
    reset and calls); a dropped instance is gone."""
    tools = Tools(f"{TOOLS_FILE}:multiply", environment=f"{ENVS}:Where")
    try:
        a, obs = tools.open({"key": "a", "text": "not passed"})
        b, _ = tools.open({"key": "b"})
        assert a != b and obs is None
        assert [s["function"]["name"] for s in tools.schemas] == ["multiply", "crash", "note"]  # TRL's order
        reply, failed = tools.call("note", {"x": 1}, a)
        key, seen, pid = reply.split(":")
        assert not failed and (key, seen) == ("a", "[1]") and int(pid) not in (os.getpid(), -1)
        assert tools.call("note", {"x": 5}, b)[0].startswith("b:[5]:")  # not a's state
        assert tools.call("multiply", {"a": 2, "b": 3}, a) == ("6", False)  # the functions too
        assert tools.call("reset", {"key": "z"}, a)[1] and tools.call("get_reward", {}, a)[1]  # not tools
        assert tools.call("crash", {}, b)[1]  # the worker dies: b's call fails, nothing else is lost
        reply, failed = tools.call("note", {"x": 2}, a)
        assert not failed and reply.startswith("a:[1, 2]:") and reply.split(":")[2] != pid  # made again
        assert tools.score(a, "reward") == (3.0, None) and tools.score(b, "reward") == (5.0, None)
        tools.close(a)
        assert "is gone" in tools.call("note", {"x": 1}, a)[0]
    finally:
        tools.stop()


def test_async_calls_run_after_the_rounds_others_and_survive_a_restart():
    """An async method's call is kept and run after the round's other calls (TRL's asyncio.gather), its result after
    theirs; a worker lost between the call and the gather makes the instance again with the kept call, so it runs
    once; an async get_reward is awaited."""
    tools = Tools(None, environment=f"{ENVS}:Ledger")
    try:
        i, _ = tools.open({})
        assert tools.calls([("later", {"n": 1}), ("add", {"n": 2})], i) == [
            ("add", "total 2", False), ("later", "total 3", False)]
        assert tools.on(i, {"name": "later", "arguments": {"n": 10}}) == {"id": tools.sent, "later": True}
        tools.stop()  # the worker lost with the kept call
        assert tools.on(i, {"op": "gather"})["r"] == [{"r": "total 13"}]  # made again: its reset, its calls
        assert tools.score(i, "reward") == (13.75, None)  # 3 calls: 13 + 3/4, awaited
        tools.stop()
        tools = Tools(f"{ENVS}:shout")  # --tools: an async function, no instance
        assert tools.calls([("shout", {"text": "a"}), ("shout", {"txt": "b"})]) == [
            ("shout", "{'error': \"shout() got an unexpected keyword argument 'txt'\"}", True), ("shout", "A", False)]
        tools.request({"name": "shout", "arguments": {"text": "c"}})
        tools.stop()  # lost with the worker: its gather says so, and the next round runs
        assert tools.request({"op": "gather"})["r"] == [] and tools.call("shout", {"text": "d"}) == ("D", False)
        sent = tools.request

        def dying(body):  # the worker dies after each call, before its gather
            msg = sent(body)
            if "name" in body:
                tools.stop()
            return msg

        tools.request = dying
        assert tools.call("shout", {"text": "e"}) == ("{'error': 'the call was lost with its worker'}", True)
    finally:
        tools.stop()


def env_rows(answer="3"):
    return {"prompt": ["6*7="], "answer": [answer], "text": [PROMPT]}


ADD = '<tool_call>\n{"name": "add", "arguments": {"n": 3}}\n</tool_call>'


def test_scripted_environment_episode():
    """--environment on a scripted policy: reset's string appended to the prompt's user message (TRL), the prompt
    templated again with the tools, one Counter per episode (the first adds 3, the second answers at once),
    get_reward and get_turn_rewards collected at each episode's end, the episode as TRL's completions."""
    tok = modeling.tiny_tokenizer()
    tools = Tools(None, 2, environment=ENV)
    policy = Scripted(tok, [[ADD, "no tool"], ["so 3"]])
    try:
        roll = generate_episodes(policy, tok, env_rows(), 2, [tok.eos_token_id], CPU_ENV,
                                 Sampling(max_new_tokens=200, mode="repeat"), tools)
    finally:
        tools.stop()
    prompt, = data.chat_prompts(tok, ["6*7= A counter starts at 0."], tools=tools.schemas)
    P = roll.n_prompt
    for i in range(2):
        assert tok.decode(roll.input_ids[i, :P][roll.attention_mask[i, :P].bool()]) == prompt
    assert roll.env_rewards.tolist() == [1.0, 0.0] and roll.env_errors == [None, None]
    assert roll.turn_rewards == [[1.0, 1.0], [0.0]]  # one a model turn: Counter's rule, 'the count is said'
    assert roll.messages[0] == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                            "function": {"name": "add", "arguments": {"n": 3}}}]},
        {"role": "tool", "name": "add", "content": "3"}, {"role": "assistant", "content": "so 3"}]
    assert roll.messages[1] == [{"role": "assistant", "content": "no tool"}]
    assert roll.stats["tools/call_frequency"] == 0.5 and tools.history == {}  # every instance dropped


def test_resets_that_differ_give_one_prompt_a_row(tmp_path):
    tok = modeling.tiny_tokenizer()
    tools = Tools(None, environment=f"{ENVS}:Count")
    try:
        ids, prompts, n = episodes.open_episodes(tok, env_rows(), 2, tools)
    finally:
        tools.stop()
    assert len(set(ids)) == 2 and n == 1 and len(prompts) == 2
    assert [p.split("<|im_start|>user\n")[1][:9] for p in prompts] == ["6*7= #1<|", "6*7= #2<|"]


def test_get_reward_is_one_more_reward_logged_under_the_class():
    """score's given rewards: summed with weight 1 (TRL's nansum), logged as rewards/Counter/, a failure scores 0 and
    is counted; where none is given (a rollout without get_reward) it does not apply. Episodes' messages are what a TRL-form reward
    gets as completions."""
    reward = Rewards([])
    given = {"Counter": (torch.tensor([1.0, 0.0, float("nan")], dtype=torch.float64), [None, None, "boom"])}
    r, errors = rewards.score(["a", "b", "c"], ["1", "2", "3"], 1, reward, watch=False, given=given)
    assert r.tolist() == [1.0, 0.0, 0.0] and errors == 1
    assert [p.name for p, _ in reward.parts] == ["Counter"] and [w for _, w in reward.parts] == [1.0]
    r, errors = rewards.score(["a"], ["1"], 1, reward, watch=True)
    assert r.tolist() == [0.0] and errors == 0 and reward.values["Counter"].isnan().all()
    reward.values = {"Counter": given["Counter"][0]}
    assert reward.metrics()["rewards/Counter/mean"] == 0.5
    conversation = [{"role": "assistant", "content": "x"}, {"role": "tool", "name": "f", "content": "1"}]
    seen = []

    class Trl:
        name, kind, more, params = "trl_reward", "trl", True, ()

        def run(self, requests):
            seen.extend(q["completions"] for q in requests)
            return [([1.0] * len(q["completions"]), None) for q in requests]

    v, _ = rewards._score_groups(Trl(), ["x"], {"prompts": [[{"role": "user", "content": "q"}]]}, 1, True,
                                 [conversation])
    assert v.tolist() == [1.0] and seen == [[conversation]]


def test_merge_carries_the_episode_fields():
    """--dynamic-sampling's row selection keeps each episode's env_rewards, errors, turn rewards and messages."""
    def roll(k):
        return Rollout(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
                       n_prompt=1, mask=torch.ones(2, 2), truncated=torch.zeros(2, dtype=torch.bool),
                       texts=[f"{k}a", f"{k}b"], env_rewards=torch.tensor([k, k + 0.5], dtype=torch.float64),
                       env_errors=[None, f"e{k}"], turn_rewards=[[k], [k, k]], messages=[[{"k": k}], [{"k": k + 1}]])

    merged = Rollout.merge([(roll(1), torch.tensor([1])), (roll(2), torch.tensor([0]))], 0)
    assert merged.env_rewards.tolist() == [1.5, 2.0] and merged.env_errors == ["e1", None]
    assert merged.turn_rewards == [[1, 1], [2]] and merged.messages == [[{"k": 2}], [{"k": 2}]]


@pytest.mark.parametrize("dynamic", [False, True])
def test_gspo_runs_an_environment_end_to_end(monkeypatch, tmp_path, dynamic):
    """gspo.py --environment tests/programs/counter_env.py:Counter on the tiny model (the README's command): each
    turn is read as add(n=3) (the random model writes no call), one Counter per episode in the worker, its get_reward
    one more reward, logged under the class's name (answer 3: a counter at 3 scores 1)."""
    call = {"name": "add", "arguments": {"n": 3}}
    monkeypatch.setattr(episodes, "parse_calls", lambda text: [call])
    more = ["--dynamic-sampling", "--max-gen-rounds", "2"] if dynamic else []
    rows, _ = run_script("gspo", ["--environment", ENV, "--max-tool-calls", "2", "--num-steps", "2",
                                  "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1",
                                  "--max-new-tokens", "48", "--eval-every", "0", "--log-samples", "0", *more],
                         monkeypatch, tmp_path / "o")
    train = [r for r in rows if "tools/call_frequency" in r]
    assert len(train) == 2 and all(r["tools/call_frequency"] > 0 for r in train)
    assert all(0 <= r["rewards/Counter/mean"] <= 1 for r in train) and all("rewards/math_reward/mean" in r for r in train)
    assert all(r["tools/turns_per_episode"] > 1 and "tools/cut_by_limit" in r and "tools/cut_by_budget" in r
               for r in train)
    tools = episodes._TOOLS.pop((None, ENV, 2))
    assert tools.history == {}  # every episode's instance dropped
    tools.stop()


def test_a_broken_reset_or_turn_count_stops_in_one_line(tmp_path):
    """reset raising, or get_turn_rewards giving another count than the episode's model turns, is the class's bug:
    one line, not a silent misalignment of per-turn credit."""
    tok = modeling.tiny_tokenizer()
    for answer, needle in [("bad", "reset(**row) failed ('no such answer')"),
                           ("3", "get_turn_rewards gave 2 rewards for an episode of 1 model turns")]:
        tools = Tools(None, environment=f"{ENVS}:Broken")
        try:
            with pytest.raises(SystemExit) as e:
                generate_episodes(Scripted(tok, [["no tool"]]), tok, env_rows(answer), 1, [tok.eos_token_id],
                                  CPU_ENV, Sampling(max_new_tokens=50, mode="repeat"), tools)
        finally:
            tools.stop()
        msg = str(e.value.code)
        assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg
