"""An episode's tools (episodes.py runs the loop): --tools functions and an --environment class
(TRL 1.16's environment_factory: its public methods are the tools, reset(**row) -> str | None, an
optional get_reward() -> float, and here get_turn_rewards() -> list[float]), their JSON schemas as
transformers' get_json_schema makes them (what the prompt renders), and Tools, the client of the
worker process (tool_worker.py) that runs every call and holds every environment instance, one
per episode, out of the trainer's process."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass

from .distributed import fail

TOOL_TIMEOUT_S = 10.0  # wall seconds a tool call may take; past it the call is an error result
START_TIMEOUT_S = 60.0  # seconds the tool worker may take to import the tools file
MAX_REPLY_BYTES = 1 << 21  # a reply line past this ends the worker: the call is an error
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tool_worker.py")
# an environment's methods that are not tools: TRL's two, and the per-turn rewards (ours)
NOT_TOOLS = ("reset", "get_reward", "get_turn_rewards")


# -------------------- the specs, the functions and classes, their schemas
def split_spec(spec: str, flag: str = "--tools") -> tuple[str, list[str]]:
    """'FILE.py:fn,fn' -> (FILE.py, [fn, fn]); a malformed spec fails in one line."""
    path, _, names = spec.rpartition(":")
    names = [n.strip() for n in names.split(",") if n.strip()]
    what = "FILE.py:fn[,fn...] (a Python file and its tool functions)" if flag == "--tools" else (
        "FILE.py:Class (a Python file and its environment class)")
    if not path.endswith(".py") or not names or (flag != "--tools" and len(names) > 1):
        fail(f"{flag} {spec!r}: give {what}")
    return path, names


def import_file(flag: str, spec: str, path: str):
    """The Python file at path as a module of its own (its top level runs; nothing is called),
    imported first in a tool worker (probe): a file that exits, hangs or dies as it is imported
    fails in one line there, not in the trainer."""
    if not os.path.isfile(path):
        fail(f"{flag} {spec!r}: no file {path!r}")
    said = probe(path)
    if said:
        fail(f"{flag} {spec!r}: importing {path} {said}")
    module_spec = importlib.util.spec_from_file_location("grouprl_tools", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the file raised, in one line
        fail(f"{flag} {spec!r}: importing {path} raised {type(e).__name__}: {e}")
    return module


def probe(path: str) -> str | None:
    """The file imported in a tool worker of its own, which then ends: None when it is ready;
    else what happened ('raised Type: message', 'ended its process (exit code N)', 'took more
    than START_TIMEOUT_S s')."""
    proc = subprocess.Popen([sys.executable, WORKER_FILE, os.path.abspath(path), "-",
                             str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=START_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return f"took more than {START_TIMEOUT_S:g} s"
    kill_group(proc)  # a fork the import left behind
    line = out.split(b"\n", 1)[0]
    try:
        msg = json.loads(line)
    except ValueError:
        return f"ended its process (exit code {proc.returncode})"
    return None if msg.get("ready") else f"raised {msg.get('fatal')}"


def kill_group(proc: subprocess.Popen):
    """A worker (the leader of its own session) and every process in its group: a tool's forks."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def schema_of(flag: str, spec: str, fn) -> dict:
    """fn's JSON schema as transformers' get_json_schema makes it (what TRL renders)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' own message says what is missing
        fail(f"{flag} {spec!r}: {fn.__name__} has no JSON schema ({e}): give it type hints and a "
             "docstring with an Args: section")


@functools.cache  # the flags' check, Tools, the prompts' schemas: the file probed once a process
def load_tools(spec: str) -> tuple[dict, list[dict]]:
    """'FILE.py:fn,fn' -> ({name: function}, [JSON schema]). The file is imported here for the
    schemas only: the calls run in the tool worker. Made once a spec in a process (a spec that
    fails is not kept: it fails again, in the same line); callers change neither."""
    path, names = split_spec(spec)
    module = import_file("--tools", spec, path)
    fns, schemas = {}, []
    for name in names:
        fn = getattr(module, name, None)
        if not callable(fn):
            fail(f"--tools {spec!r}: {path} has no function {name!r}")
        schemas.append(schema_of("--tools", spec, fn))
        fns[name] = fn
    return fns, schemas


@dataclass
class Environment:
    """An --environment class as TRL 1.16 reads environment_factory: its tools (the public
    functions of the class but reset and get_reward, by name as inspect.getmembers lists them;
    get_turn_rewards is not one here either), their schemas, and which scores it gives."""
    spec: str
    path: str
    name: str  # the class's name: its get_reward is logged as rewards/<name>/
    methods: list[str]
    schemas: list[dict]
    reward: bool  # defines get_reward() -> float (one more reward source, weight 1)
    turn_rewards: bool  # defines get_turn_rewards() -> list[float] (one a model turn)


@functools.cache  # as load_tools: the file probed once a process
def load_environment(spec: str) -> Environment:
    """'FILE.py:Class' -> Environment, checked in one line each (no file, no class, no reset, no
    public method, a method without a schema). The class is read, never instantiated, here: its
    instances live in the tool worker. Made once a spec in a process, as load_tools."""
    path, (name,) = split_spec(spec, "--environment")
    cls = getattr(import_file("--environment", spec, path), name, None)
    if not inspect.isclass(cls):
        fail(f"--environment {spec!r}: {path} has no class {name!r}")
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    if "reset" not in members:
        fail(f"--environment {spec!r}: {name} has no reset method (TRL's contract: "
             "reset(self, **row) -> str | None, called before each episode)")
    methods = [m for m in members if m not in NOT_TOOLS and not m.startswith("_")]
    if not methods:
        fail(f"--environment {spec!r}: {name} has no public method for the model to call (its "
             "public methods but reset and get_reward are the tools)")
    # the schema of what TRL calls, getattr(instance, m): a bound method's signature has no self
    # (the placeholder is never called); a static method's is the function's own
    schemas = [schema_of("--environment", spec, members[m] if isinstance(
        inspect.getattr_static(cls, m), staticmethod) else types.MethodType(members[m], object()))
        for m in methods]
    return Environment(spec, path, name, methods, schemas, "get_reward" in members,
                       "get_turn_rewards" in members)


# -------------------- the tools in the prompt
# where the chat template renders no tools (tools_text): a system message's lines, each tool's
# signature from its schema, and the <tool_call> form the episode loop parses
TOOLS_HEAD = ('You may call these tools, as <tool_call>{"name": NAME, "arguments": {ARG: VALUE}}'
              '</tool_call>; a result comes back as the next turn:')
_RENDERS_TOOLS = {}  # chat template -> whether it renders a tools= list
_CHECKED = set()  # chat templates found prefix-preserving


def tools_text(schemas: list[dict]) -> str:
    """The plain fallback of the tools in the prompt (docs/algorithms.md, Episodes and tools):
    TOOLS_HEAD, then a line a tool, 'name(arg: type, opt?: type) -> type: description (arg: its
    description; ...)', shorter than the schemas' JSON (a small model's context is short)."""
    lines = [TOOLS_HEAD]
    for schema in schemas:
        f = schema["function"]
        props = f.get("parameters", {}).get("properties", {})
        required = f.get("parameters", {}).get("required", [])
        args = ", ".join(f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}"
                         for k, v in props.items())
        ret = f.get("return", {}).get("type")
        said = "; ".join(f"{k}: {v['description']}" for k, v in props.items()
                         if v.get("description"))
        lines.append(f"{f['name']}({args})" + (f" -> {ret}" if ret else "")
                     + (f": {f['description']}" if f.get("description") else "")
                     + (f" ({said})" if said else ""))
    return "\n".join(lines)


def renders_tools(tok) -> bool:
    """Whether the tokenizer's chat template renders the tools= it is given (Qwen3's, Llama 3.1's
    do; one that ignores them, as the tiny model's, does not)."""
    template = tok.chat_template
    if template not in _RENDERS_TOOLS:
        probe = {"type": "function", "function": {"name": "probe_tool_9f2c", "description": "d",
                                                  "parameters": {"type": "object",
                                                                 "properties": {}}}}
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[probe],
                                           tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools renders none
            text = ""
        _RENDERS_TOOLS[template] = "probe_tool_9f2c" in text
    return _RENDERS_TOOLS[template]


def check_prefix_preserving(tok):
    """An episode's tool turns are appended to its tokens (episodes.tool_suffix_ids), so the chat
    template must render a conversation's turns the same whatever follows them: TRL 1.16's
    is_chat_template_prefix_preserving, on its dummy conversation. TRL swaps in a training template
    of its own (trl.chat_template_utils.get_training_chat_template, one shipped a model family) for
    one that is not, as Qwen3's own (it drops the earlier turns' <think> blocks); we ship none, so
    the run stops here in one line, at the prompts' templating (data.load_task), before the model."""
    template = tok.chat_template
    if template in _CHECKED:
        return
    ids = None
    for arguments in ({}, "{}"):  # TRL: a template that refuses a dict gets the JSON text
        call = [{"type": "function", "function": {"name": "dummy", "arguments": arguments}}]
        two = [{"role": "user", "content": "dummy"},
               {"role": "assistant", "content": "", "tool_calls": call}]
        three = two + [{"role": "tool", "name": "dummy", "content": "dummy"}]
        try:
            ids = (tok.apply_chat_template(two, tokenize=True, return_dict=False),
                   tok.apply_chat_template(three, tokenize=True, return_dict=False,
                                           add_generation_prompt=True))
            break
        except TypeError:
            continue
    if ids is None or ids[1][:len(ids[0])] != ids[0]:
        fail("--tools/--environment: the model's chat template is not prefix-preserving (a tool "
             "turn renders the turns before it anew, as Qwen3's own drops their <think>), so tool "
             "turns cannot be appended to an episode's tokens; TRL swaps in a training template "
             "of its own (trl.chat_template_utils.get_training_chat_template) that we do not "
             "ship: set that template as the model's chat_template (tokenizer_config.json)")
    _CHECKED.add(template)


def tools_in_prompt(tok, prompt, tools: list[dict] | None):
    """(prompt, tools) for apply_chat_template: the tools as TRL 1.16's GRPOTrainer passes them
    (tools=schemas, None for none) where the template renders them; else the plain fallback,
    tools_text, after the system message's text (a system message of its own first when there is
    none) and tools None; a text prompt (no chat template) gets it before it. prompt: messages,
    or a text."""
    if not tools:
        return prompt, None  # TRL: `or None`, a template may render boilerplate for []
    if getattr(tok, "chat_template", None):
        check_prefix_preserving(tok)  # the first point the run sees the template, with tools
    if getattr(tok, "chat_template", None) and renders_tools(tok):
        return prompt, tools
    plain = tools_text(tools)
    if isinstance(prompt, str):
        return plain + "\n\n" + prompt, None
    first = prompt[0] if prompt else {}
    if first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": first["content"] + "\n\n" + plain}, *prompt[1:]], None
    return [{"role": "system", "content": plain}, *prompt], None


def tool_schemas(tools: str | None, environment: str | None) -> list[dict]:
    """The schemas an episode's prompt shows: --tools's, then --environment's methods' (TRL)."""
    return ((load_tools(tools)[1] if tools else [])
            + (load_environment(environment).schemas if environment else []))


# -------------------- the tools' worker: calls and instances out of this process
def reply(msg: dict | str) -> tuple:
    """A call's worker reply as (content, failed): its result, or TRL's error result
    str({'error': message}) for an 'e' or for no reply (a str saying why)."""
    if isinstance(msg, str):
        return str({"error": msg}), True
    if "e" in msg:
        return str({"error": msg["e"]}), True
    return msg["r"], False


class Tools:
    """The --tools functions and the --environment's instances, in a worker process
    (tool_worker.py), one request at a time. A call's reply is (content, failed): the tool's
    str(result) (a list result as a list, TRL's content blocks, where it is JSON), or TRL's error
    result str({'error': message}) for an exception, an unknown tool, bad arguments, a call past
    timeout_s (the worker is killed and restarted) or a worker that died (a crash). The instances
    a restart loses come back at their next request, made anew and given their reset and calls
    again (the one that killed the worker left out). max_calls: the rounds of calls an episode
    may make (--max-tool-calls). template: the chat template's settings (enable_thinking,
    system_prompt) a reset's prompt is rendered with."""

    def __init__(self, spec: str | None, max_calls: int = 5, timeout_s: float = TOOL_TIMEOUT_S,
                 environment: str | None = None, template: dict | None = None):
        self.spec, self.max_calls, self.timeout_s = spec, max_calls, timeout_s
        self.path, self.names = split_spec(spec) if spec else ("-", [])
        self.fns, self.schemas = load_tools(spec) if spec else ({}, [])
        self.env = load_environment(environment) if environment else None
        if self.env is not None:  # TRL: the standalone tools, then the environment's methods
            self.schemas = self.schemas + self.env.schemas
        self.template = template or {}
        self.proc, self.buf, self.sent, self.starts = None, b"", 0, 0
        self.opened = 0  # instance ids handed out: each episode its own, never reused
        self.history, self.born = {}, {}  # per instance: its requests; the worker it lives in

    def start(self):
        env = [os.path.abspath(self.env.path), self.env.name] if self.env else ["-", "-"]
        path = os.path.abspath(self.path) if self.spec else "-"
        self.proc = subprocess.Popen(
            [sys.executable, WORKER_FILE, path, ",".join(self.names) or "-", str(os.getpid()),
             *env], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            start_new_session=True)  # a signal to our group leaves it be
        self.buf, self.starts = b"", self.starts + 1
        if self.starts == 1:
            atexit.register(self.stop)  # at the run's end, even where __del__ never runs
        msg = self.read(START_TIMEOUT_S)
        if not isinstance(msg, dict) or not msg.get("ready"):
            self.stop()
            raise RuntimeError(f"the tool worker ({self.spec or self.env.spec}) did not start: "
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

    def request(self, body: dict) -> dict | str:
        """The worker's reply to one request ({'r': ...} or {'e': message}), or a str saying why
        there is none (the worker is then stopped: a fresh one next)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.sent += 1
        try:
            self.proc.stdin.write((json.dumps({"id": self.sent, **body}, default=str)
                                   + "\n").encode())
            msg = self.read(self.timeout_s)
        except OSError as e:  # the worker died between calls
            msg = f"the tool's process ended ({e})"
        if not isinstance(msg, dict) or msg.get("id") != self.sent:
            self.stop()  # a hang, a crash, a flood: this request's error, a fresh worker next
            return msg if isinstance(msg, str) else "a reply out of order"
        return msg

    def on(self, i: int, body: dict) -> dict | str:
        """A request to instance i, which is first made again in a fresh worker if a restart lost
        it (its reset and calls sent again, their replies unread)."""
        if self.born.get(i) is None:
            return f"the environment instance {i} is gone"
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        if self.born[i] != self.starts:
            self.born[i] = self.starts
            for past in self.history[i]:
                if isinstance(self.request(past), str):
                    self.born[i] = None  # it cannot be made again: its episode's calls fail
                    return f"the environment instance {i} was lost with its worker"
        msg = self.request({**body, "i": i})
        if isinstance(msg, dict) and body.get("op") in (None, "reset", "gather"):
            self.history[i].append({**body, "i": i})  # what makes it again after a restart
        return msg

    def calls(self, calls: list[tuple[str, dict]], i: int | None = None) -> list[tuple]:
        """A round's tool calls (name, arguments) on instance i's methods and the --tools
        functions (TRL's tool dict), as TRL 1.16 makes them: each in order, an async tool's kept
        (its arguments bound: a call that does not bind fails in order); then the kept ones run
        together (asyncio.gather) and their results come after the others' -> [(name, content,
        failed)] in that order."""
        out, later = [], []
        for name, arguments in calls:
            body = {"name": name, "arguments": arguments}
            msg = self.request(body) if i is None else self.on(i, body)
            if isinstance(msg, dict) and msg.get("later"):
                later.append(name)
            else:
                out.append((name, *reply(msg)))
        if later:
            msg = self.request({"op": "gather"}) if i is None else self.on(i, {"op": "gather"})
            got = msg.get("r") if isinstance(msg, dict) else None
            if not isinstance(got, list) or len(got) != len(later):  # the worker died meanwhile
                got = [msg if isinstance(msg, str) else "the call was lost with its worker"] * len(
                    later)
            out += [(name, *reply(m)) for name, m in zip(later, got)]
        return out

    def call(self, name: str, arguments: dict, i: int | None = None) -> tuple[str, bool]:
        """One tool call (calls): (content, failed)."""
        return self.calls([(name, arguments)], i)[0][1:]

    def open(self, row: dict) -> tuple[int, str | None]:
        """A new instance for one episode, reset(**row): its id and the reset's string (None: the
        prompt as it is). A reset that raises stops the run in one line."""
        i, self.opened = self.opened, self.opened + 1
        self.history[i], self.born[i] = [], -1
        msg = self.on(i, {"op": "reset", "row": {k: v for k, v in row.items() if k != "text"}})
        if isinstance(msg, str) or "e" in msg:
            fail(f"--environment {self.env.spec!r}: reset(**row) failed "
                 f"({msg if isinstance(msg, str) else msg['e']}): fix the class's reset")
        return i, msg["r"]

    def score(self, i: int, what: str, turns: list[str] | None = None):
        """Instance i's get_reward() (what 'reward') or get_turn_rewards() ('turn_rewards'; given
        the model's turns where it takes an argument): (its value, None) or (None, the error)."""
        msg = self.on(i, {"op": what, "turns": turns} if turns is not None else {"op": what})
        if isinstance(msg, str):
            return None, msg
        return msg.get("r"), msg.get("e")

    def close(self, i: int):
        """Instance i dropped at its episode's end (in the worker, if it still lives there)."""
        if self.born.get(i) == self.starts and self.proc is not None and self.proc.poll() is None:
            self.request({"op": "drop", "i": i})
        self.history.pop(i, None)
        self.born.pop(i, None)

    def stop(self):
        if self.proc is not None:
            kill_group(self.proc)  # the worker and any process a tool forked
            self.proc = None

    def __del__(self):
        self.stop()
