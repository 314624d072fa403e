"""Episodes (first slice): a completion with turns, as TRL 1.16's GRPOTrainer tool loop makes them
(`tools=`, `max_tool_calling_iterations`, `_tool_call_loop`). The model's turn is parsed for tool
calls in the Qwen3/Hermes format, the tools run in a worker process under a time bound
(tool_worker.py), their results are appended as the chat template's tool turn and the model
generates again, until a turn has no call, --max-tool-calls rounds, or the --max-new-tokens budget
over the whole episode. An episode travels as one Rollout row: prompt | turn 1 | tool turn | turn 2
..., the mask 1 on the model's tokens only (TRL's tool_mask), so every objective sees nothing the
environment wrote. Not yet: --environment, the engine, per-turn credit (docs/algorithms.md)."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time

import torch

from .distributed import fail
from .generation import Rollout, gathered, generate

TOOL_TIMEOUT_S = 10.0  # wall seconds a tool call may take; past it the call is an error result
START_TIMEOUT_S = 60.0  # seconds the tool worker may take to import the tools file
MAX_REPLY_BYTES = 1 << 21  # a reply line past this ends the worker: the call is an error
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_worker.py")

# TRL 1.16's qwen3_schema (trl/chat_template_utils.py): the whole turn, then each call's JSON
TURN = re.compile(r"^(?:<think>\n?(?:(?P<reasoning_content>.*?\S.*?)\n?|[\s]*)</think>\s*)?"
                  r"(?P<content>(?:(?!<tool_call>)[\s\S])*?)(?:\n(?=<tool_call>))?"
                  r"(?=(?:<tool_call>|<\|im_end\|>|$))"
                  r"(?P<tool_calls>(?:<tool_call>(?:(?!</tool_call>)[\s\S])+</tool_call>\s*)+)?"
                  r"\s*(?:<\|im_end\|>|$)", re.DOTALL)
CALL = re.compile(r"<tool_call>\s*(.+?)\s*</tool_call>", re.DOTALL)


# -------------------- the tools: spec, functions and schemas, checks
def split_spec(spec: str) -> tuple[str, list[str]]:
    """'FILE.py:fn,fn' -> (FILE.py, [fn, fn]); a malformed spec fails in one line."""
    path, _, names = spec.rpartition(":")
    names = [n.strip() for n in names.split(",") if n.strip()]
    if not path.endswith(".py") or not names:
        fail(f"--tools {spec!r}: give FILE.py:fn[,fn...] (a Python file and its tool functions)")
    return path, names


def load_tools(spec: str) -> tuple[dict, list[dict]]:
    """'FILE.py:fn,fn' -> ({name: function}, [JSON schema]) with the schemas as transformers'
    get_json_schema makes them from type hints and the docstring (what TRL renders into the
    prompt). The file is imported here for the schemas only: the calls run in the tool worker."""
    import importlib.util

    from transformers.utils import get_json_schema

    path, names = split_spec(spec)
    if not os.path.isfile(path):
        fail(f"--tools {spec!r}: no file {path!r}")
    module_spec = importlib.util.spec_from_file_location("grouprl_tools", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the file raised, in one line
        fail(f"--tools {spec!r}: importing {path} raised {type(e).__name__}: {e}")
    fns, schemas = {}, []
    for name in names:
        fn = getattr(module, name, None)
        if not callable(fn):
            fail(f"--tools {spec!r}: {path} has no function {name!r}")
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # noqa: BLE001 - transformers' own message says what is missing
            fail(f"--tools {spec!r}: {name} has no JSON schema ({e}): give it type hints and a "
                 "docstring with an Args: section")
        fns[name] = fn
    return fns, schemas


def check_tool_args(args, launched: bool):
    """The --tools flags' one-line checks, before any heavy work (called by check_common_args)."""
    if not args.tools:
        return
    if args.max_tool_calls < 1:
        fail(f"--max-tool-calls {args.max_tool_calls}: give at least 1 (rounds of tool calls)")
    if args.gen_mode in ("engine", "engine-tp"):
        fail(f"--tools with --gen-mode {args.gen_mode}: the engine does not run episodes yet "
             "(its KV cache across turns is not written); use --gen-mode shared-prefill")
    if args.old_logp == "rollout":
        fail("--tools with --old-logp rollout: rollout log-probs come from the engine, which does "
             "not run episodes yet; drop --old-logp rollout")
    if launched:
        fail("--tools under torchrun: episodes of different lengths would make the ranks' generate "
             "calls differ; run on one process for now")
    load_tools(args.tools)


# -------------------- a model turn's tool calls, a tool turn's tokens
def parse_calls(text: str) -> list[dict] | None:
    """A model turn's tool calls in the Qwen3/Hermes format, as TRL 1.16's parse_response reads
    them: [{"name", "arguments"}] ([] for a turn without '<tool_call>'); None for a malformed turn
    (bad JSON, no string name, arguments not an object, the turn not of the form content then
    calls): TRL then decodes the turn as plain text, so it is not a call and the episode ends."""
    if "<tool_call>" not in text:
        return []
    turn = TURN.match(text)
    if turn is None or turn.group("tool_calls") is None:
        return None
    calls = []
    for body in CALL.findall(turn.group("tool_calls")):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = {} if call.get("arguments") is None else call["arguments"]
        if not isinstance(arguments, dict):
            return None
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


def tool_suffix_ids(tok, tool_messages: list[dict]) -> list[int]:
    """The tokens after the model's turn (its EOS included) up to the next turn's header, as TRL
    1.16's _get_tool_suffix_ids makes them: a dummy conversation rendered with and without the tool
    messages (and the generation prompt), the first cut after its last EOS, the difference."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": tool_messages[0]["name"],
                                                   "arguments": {}}}]}]
    prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                     return_dict=False)
    full = tok.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    ends = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
    if ends:  # Qwen templates render '<|im_end|>\n' after a turn: cut at the EOS
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving: a tool turn cannot be "
                         "appended to an episode's tokens")
    return full[len(prefix):]


# -------------------- the tools' worker: calls out of this process, under a time bound
class Tools:
    """The --tools functions, called in a worker process (tool_worker.py) one call at a time. A
    call's reply is (content, failed): the tool's str(result), or TRL's error result
    str({'error': message}) for an exception, an unknown tool, bad arguments, a call past
    timeout_s (the worker is killed and restarted) or a worker that died (a crash). max_calls:
    the rounds of calls an episode may make (--max-tool-calls)."""

    def __init__(self, spec: str, max_calls: int = 5, timeout_s: float = TOOL_TIMEOUT_S):
        self.spec, self.max_calls, self.timeout_s = spec, max_calls, timeout_s
        self.path, self.names = split_spec(spec)
        self.fns, self.schemas = load_tools(spec)
        self.proc, self.buf, self.sent = None, b"", 0

    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, WORKER_FILE, os.path.abspath(self.path), ",".join(self.names),
             str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            start_new_session=True)  # a signal to our group leaves it be
        self.buf = b""
        msg = self.read(START_TIMEOUT_S)
        if not isinstance(msg, dict) or not msg.get("ready"):
            self.stop()
            raise RuntimeError(f"the tool worker ({self.spec}) did not start: "
                               f"{msg.get('fatal', msg) if isinstance(msg, dict) else msg}")

    def read(self, timeout_s: float):
        """The worker's next JSON line; a str saying why there is none (time, death, size)."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"the tool did not answer in {timeout_s:g} s"
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return f"the tool's process ended (exit code {self.proc.wait()})"
            self.buf += chunk
            if len(self.buf) > MAX_REPLY_BYTES:
                return f"the tool's reply passed {MAX_REPLY_BYTES} bytes"
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return f"the tool worker wrote {line[:80]!r}"

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.sent += 1
        try:
            self.proc.stdin.write((json.dumps({"id": self.sent, "name": name,
                                               "arguments": arguments}) + "\n").encode())
            msg = self.read(self.timeout_s)
        except OSError as e:  # the worker died between calls
            msg = f"the tool's process ended ({e})"
        if not isinstance(msg, dict) or msg.get("id") != self.sent:
            self.stop()  # a hang, a crash, a flood: this call's error, a fresh worker next
            return str({"error": msg if isinstance(msg, str) else "a reply out of order"}), True
        if "e" in msg:
            return str({"error": msg["e"]}), True
        return msg["r"], False

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __del__(self):
        self.stop()


# -------------------- the tool loop over generate
@torch.no_grad()
def continue_turns(policy, tok, histories: list[list[int]], room: list[int], eos: list[int],
                   dist_env, sampling) -> list[tuple[list[int], bool, str]]:
    """One more model turn after each history (ids, unpadded), at most room[i] tokens -> [(turn
    ids up to and including the first EOS, cut (no EOS), text without the EOS)]. With the engine's
    open episodes (generation.generate(episodes=True)) each row's KV cache is kept: only the
    history's tokens past it (the tool turn) are prefilled, and each token's log-prob is kept
    for turn_logps; else HF generate as generation.generate samples, one row each, prefilling
    the whole history."""
    from .engine import turns as engine_turns

    pad = tok.pad_token_id
    kept = (engine_turns.of(getattr(policy, "lm", None))
            if sampling.mode in ("engine", "engine-tp") else None)
    out = [] if kept is None else [new for new, _ in kept.next(histories, room)]
    with gathered(policy, sampling.unshard):
        for s in range(0, 0 if kept is not None else len(histories), sampling.gen_batch_size):
            part = histories[s:s + sampling.gen_batch_size]
            L = max(len(h) for h in part)
            ids = torch.tensor([[pad] * (L - len(h)) + h for h in part], device=dist_env.device)
            am = torch.tensor([[0] * (L - len(h)) + [1] * len(h) for h in part],
                              device=dist_env.device)
            gen = policy.generate(
                input_ids=ids, attention_mask=am, n=1, do_sample=True,
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
                max_new_tokens=max(room[s:s + len(part)]),
                min_new_tokens=sampling.min_new_tokens or None, eos_token_id=eos,
                pad_token_id=pad, synced_gpus=dist_env.sharded)[:, L:]
            out += gen.tolist()
    turns = []
    for new, r in zip(out, room):
        new = new[:r]  # TRL: a turn past the episode's budget is cut there
        end = next((k for k, t in enumerate(new) if t in eos), None)
        new = new if end is None else new[:end + 1]
        text = tok.decode(new if end is None else new[:-1], skip_special_tokens=True)
        turns.append((new, end is None, text))
    return turns


def turn_logps(policy, prompt: list[list[int]], comp: list[list[int]], T: int, device):
    """The episodes' log-probs [B, T] as the engine sampled the model's tokens, 0 at the tool
    turns' (mask 0), for --old-logp rollout and the rollout corrections; None where HF generate
    made the turns. Closes the engine's open episodes (their KV cache back to the pool)."""
    from .engine import turns as engine_turns

    logps = engine_turns.end(getattr(policy, "lm", None), [p + c for p, c in zip(prompt, comp)])
    if logps is None:
        return None
    rows = [lp[len(p):] for p, lp in zip(prompt, logps)]
    return torch.tensor([lp + [0.0] * (T - len(lp)) for lp in rows], device=device)


def generate_episodes(policy, tok, prompts: list[str], n: int, eos: list[int], dist_env,
                      sampling, tools: Tools, streamer=None) -> Rollout:
    """generation.generate's Rollout, each row an episode (TRL 1.16's _tool_call_loop): turn 1 by
    generate (every HF mode), then up to tools.max_calls rounds: the rows whose last turn calls tools
    get the results as a tool turn (mask 0) and generate again (mask 1). The budget
    sampling.max_new_tokens holds over the whole episode: a tool turn that would pass it is
    dropped (its calls counted) and the episode ends, truncated; a turn is cut where the budget
    ends. texts: the model's turns, joined by a newline. stats: tools/call_frequency (calls an
    episode), tools/failure_frequency (failed calls over calls), tools/malformed_turns,
    tools/rolled_back, tools/turns_per_episode (this process's episodes)."""
    first = generate(policy, tok, prompts, n, eos, dist_env, sampling, streamer=streamer,
                     episodes=True)  # the engine keeps each row's KV for its next turns
    B, P, budget = len(first.texts), first.n_prompt, sampling.max_new_tokens
    prompt = [row[m.bool()].tolist() for row, m in zip(first.input_ids[:, :P],
                                                         first.attention_mask[:, :P])]
    comp = [row[P:][m.bool()].tolist() for row, m in zip(first.input_ids, first.mask)]
    mask = [[1] * len(c) for c in comp]
    turns = [[t] for t in first.texts]
    cut = first.truncated.tolist()
    calls = failures = malformed = rolled = 0
    live = list(range(B))  # rows whose last turn is read for calls
    for _ in range(tools.max_calls):  # TRL's max_tool_calling_iterations: rounds, not calls
        nxt = []
        for i in live:
            parsed = parse_calls(turns[i][-1])
            malformed += parsed is None
            if not parsed:
                continue
            results = []
            for c in parsed:
                content, failed = tools.call(c["name"], c["arguments"])
                calls, failures = calls + 1, failures + failed
                results.append({"role": "tool", "name": c["name"], "content": content})
            suffix = tool_suffix_ids(tok, results)
            if len(comp[i]) + len(suffix) > budget:  # TRL's rollback: the result dropped
                rolled, cut[i] = rolled + 1, True
                continue
            comp[i], mask[i] = comp[i] + suffix, mask[i] + [0] * len(suffix)
            nxt.append(i)
        if not nxt:
            break
        room = [budget - len(comp[i]) for i in nxt]
        for i, (new, no_eos, text) in zip(nxt, continue_turns(
                policy, tok, [prompt[i] + comp[i] for i in nxt], room, eos, dist_env, sampling)):
            comp[i], mask[i] = comp[i] + new, mask[i] + [1] * len(new)
            turns[i].append(text)
            cut[i] = no_eos
        live = nxt
    T = max(len(c) for c in comp)
    dev = first.input_ids.device
    tail = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in comp], device=dev)
    am = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c in comp], device=dev)
    stats = {"tools/call_frequency": calls / B,
             "tools/failure_frequency": failures / calls if calls else 0.0,
             "tools/malformed_turns": float(malformed), "tools/rolled_back": float(rolled),
             "tools/turns_per_episode": sum(len(t) for t in turns) / B}
    return Rollout(input_ids=torch.cat([first.input_ids[:, :P], tail], 1),
                   attention_mask=torch.cat([first.attention_mask[:, :P], am], 1), n_prompt=P,
                   mask=torch.tensor([m + [0] * (T - len(m)) for m in mask], device=dev,
                                     dtype=torch.float),
                   truncated=torch.tensor(cut, device=dev), texts=["\n".join(t) for t in turns],
                   logp=turn_logps(policy, prompt, comp, T, dev), stats=stats)


_TOOLS = {}  # the run's Tools by --tools spec: one worker a run, started on the first call


def tools_of(args) -> Tools:
    """The run's Tools for --tools and --max-tool-calls (made once)."""
    key = (args.tools, args.max_tool_calls)
    if key not in _TOOLS:
        _TOOLS[key] = Tools(args.tools, args.max_tool_calls)
    return _TOOLS[key]
