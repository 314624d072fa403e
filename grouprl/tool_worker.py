"""The tool worker's program (tools.py's Tools): run as a file, in a process of its own, it
imports a --tools file and an --environment class and answers one request at a time over pipes,
one JSON line each way.
argv: the tools file and its function names (comma-separated; '-' '-' for none), the trainer's
pid, the environment's file and class name ('-' '-' for none).
Its first line: {"ready": true} or {"fatal": "Type: message"}. Requests, each with its "id":
  {"name", "arguments"[, "i"]}: a tool call fn(**arguments) (arguments JSON, passed as keyword
    arguments: nothing is evaluated; a list or a string fails as Python's ** does, as TRL's), on
    instance i's methods and the tools (TRL's tool dict: a method shadows a function of its
    name) -> {"r": str(result), or a list result as it is (JSON)} or {"e": message} (an
    exception, an unknown tool, bad arguments), the result cut at MAX_RESULT_CHARS; an async
    tool's call (a coroutine) is kept -> {"later": true}, as TRL keeps it for after the round's
    other calls;
  {"op": "gather"[, "i"]}: the kept coroutines run together (asyncio.gather, as TRL's) -> {"r":
    [{"r": ...} or {"e": message}, one a kept call, in order]};
  {"op": "reset", "i", "row"}: instance i made anew (the class called with no argument, TRL's
    factory) and reset(**row) -> {"r": its str or None};
  {"op": "reward", "i"}: get_reward() (awaited where it is async, as TRL) -> {"r": float or None};
  {"op": "turn_rewards", "i", "turns"}: get_turn_rewards(), or get_turn_rewards(turns) where it
    takes an argument (the model's turns as texts), -> {"r": [float]};
  {"op": "drop", "i"}: instance i forgotten -> {"r": null}.
Instances live here only, one per episode, never shared. A hang or a crash is the trainer's to
bound (it kills this process's group: a tool's forks with it); this one leaves when the trainer
closes the pipe, and takes its group with it when the trainer dies. Its address space is bounded
(MEMORY_BYTES: a tool allocating past it gets a MemoryError, its call's error); a result is valid
UTF-8. A tools file name '-' (and names '-'): none; the tools file alone, names '-': its import
tried (tools.py's probe: a file that exits or hangs as it is imported costs the worker only).
Standard library only, so that it starts fast."""

import asyncio
import importlib.util
import inspect
import json
import os
import sys
import threading
import time

MAX_RESULT_CHARS = 100_000  # a tool's reply past this is cut (the length budget drops it anyway)
MEMORY_BYTES = 4 << 30  # the worker's address space (RLIMIT_AS), as the reward worker's math grader


NOT_TOOLS = ("reset", "get_reward", "get_turn_rewards")  # tools.py's: not the model's to call
LOOP = []  # the worker's one event loop (TRL's async loop), made at the first coroutine


def awaited(x):
    """x run to its end on the worker's event loop where it is a coroutine (an async get_reward's,
    an async tool's); else x."""
    if not inspect.iscoroutine(x):
        return x
    if not LOOP:
        LOOP.append(asyncio.new_event_loop())
    return LOOP[0].run_until_complete(x)


async def together(coroutines: list) -> list:
    """TRL 1.16's async tool calls of a round: asyncio.gather, an exception kept as its result."""
    return await asyncio.gather(*coroutines, return_exceptions=True)


def load(path: str, names: list[str]):
    """{name: attribute} of the file at path (imported as a module of its own, named as the file:
    an error naming a function, 'tools.f() argument after ** ...', reads as TRL's, whose tools
    are imported from their module)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in names}


def methods(instance) -> dict:
    """An instance's tools as TRL lists them: the class's public functions but NOT_TOOLS."""
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(
        type(instance), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")}


def answer(fns: dict, cls, instances: dict, request: dict, kept: dict) -> dict:
    """TRL 1.16's tool call fn(**arguments), or an instance's reset, scores, drop; any failure
    is the reply's 'e'. kept: per instance (None: no instance), the async calls not yet run."""
    try:
        op, i = request.get("op"), request.get("i")
        if op == "reset":
            instances[i] = cls()
            obs = instances[i].reset(**request["row"])
            if obs is not None and not isinstance(obs, str):
                raise TypeError(f"reset returned a {type(obs).__name__}, not a str or None")
            return {"r": obs}
        if op == "drop":
            instances.pop(i, None)
            for coroutine in kept.pop(i, []):
                coroutine.close()
            return {"r": None}
        if op == "gather":  # TRL: an exception (not a BaseException) is the call's error
            out = awaited(together(kept.pop(i, [])))
            return {"r": [{"e": text(x)} if isinstance(x, Exception) else {"r": result(x)}
                          for x in out]}
        if i is not None and i not in instances:
            raise ValueError(f"the environment instance {i} does not exist")
        if op == "reward":
            r = awaited(instances[i].get_reward())
            return {"r": None if r is None else float(r)}
        if op == "turn_rewards":  # get_turn_rewards() or get_turn_rewards(turns): the turns' texts
            fn = instances[i].get_turn_rewards
            r = awaited(fn(request["turns"]) if inspect.signature(fn).parameters else fn())
            return {"r": [float(x) for x in r]}
        name, arguments = request["name"], request["arguments"]
        tools = {**fns, **methods(instances[i])} if i is not None else fns
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        r = tools[name](**arguments)  # arguments that do not bind fail here, async or not (TRL)
        if inspect.iscoroutine(r):  # TRL runs it after the round's other calls: gather
            kept.setdefault(i, []).append(r)
            return {"later": True}
        return {"r": result(r)}
    except Exception as e:  # noqa: BLE001 - whatever the tool raised, sent back as its error
        return {"e": text(e)}


def result(x):
    """A tool's result as TRL passes it on: a list as it is (content blocks, rendered by the chat
    template) where it is JSON of at most MAX_RESULT_CHARS, valid UTF-8; else text(x)."""
    if isinstance(x, list):
        try:
            if len(json.dumps(x, ensure_ascii=False).encode("utf-8")) <= MAX_RESULT_CHARS:
                return x
        except (TypeError, ValueError, UnicodeEncodeError):
            pass  # not JSON (an image, an object): its str, as any other result
    return text(x)


def text(x) -> str:
    """str(x) cut at MAX_RESULT_CHARS, valid UTF-8 (a lone surrogate written as its escape: the
    tokenizer cannot encode one)."""
    return str(x)[:MAX_RESULT_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")


def main(argv: list[str]):
    import resource
    import signal

    path, names, parent = argv[0], [n for n in argv[1].split(",") if n != "-"], int(argv[2])
    env_path, env_class = (argv[3], argv[4]) if len(argv) > 4 else ("-", "-")
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a tool's print() goes to stderr, never into the replies
    sys.stdout = sys.stderr

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)  # reparented: the trainer died; this group goes (a tool's forks)

    threading.Thread(target=watch, daemon=True).start()
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES if hard < 0 else min(MEMORY_BYTES, hard), hard))
    try:
        fns = load(path, names) if path != "-" else {}
        cls = load(env_path, [env_class])[env_class] if env_path != "-" else None
    except BaseException as e:  # noqa: BLE001 - said in one line, the trainer stops
        reply(fatal=f"{type(e).__name__}: {e}")
        sys.exit(1)
    reply(ready=True)
    me, instances, kept = os.getpid(), {}, {}
    for line in sys.stdin:
        request = json.loads(line)
        msg = answer(fns, cls, instances, request, kept)
        if os.getpid() != me:  # the tool forked and its child came back here
            os._exit(0)
        reply(id=request["id"], **msg)


if __name__ == "__main__":
    main(sys.argv[1:])
