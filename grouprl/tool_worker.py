"""The tool worker's program (episodes.py's Tools): run as a file, in a process of its own, it
imports a --tools file and answers one call at a time over pipes, one JSON line each way.
argv: the tools file, its function names (comma-separated), the trainer's pid.
Its first line: {"ready": true} or {"fatal": "Type: message"}. A request {"id", "name",
"arguments"} (arguments a JSON object, passed as keyword arguments: nothing is evaluated) gets
{"id", "r": str(result)} or {"id", "e": "Type: message"} (an exception, an unknown tool, bad
arguments), the result cut at MAX_RESULT_CHARS. A hang or a crash is the trainer's to bound (it
kills this process); this one leaves when the trainer closes the pipe or dies.
Standard library only, so that it starts fast."""

import importlib.util
import json
import os
import sys
import threading
import time

MAX_RESULT_CHARS = 100_000  # a tool's reply past this is cut (the length budget drops it anyway)


def load(path: str, names: list[str]) -> dict:
    """{name: function} of the file at path (imported as a module of its own)."""
    spec = importlib.util.spec_from_file_location("grouprl_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: getattr(module, name) for name in names}


def answer(fns: dict, request: dict) -> dict:
    """TRL 1.16's tool call: fn(**arguments); any failure is the reply's 'e'."""
    try:
        name, arguments = request["name"], request["arguments"]
        if name not in fns:
            raise ValueError(f"Tool {name} not found.")
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a JSON object, not {type(arguments).__name__}")
        return {"r": str(fns[name](**arguments))[:MAX_RESULT_CHARS]}
    except Exception as e:  # noqa: BLE001 - whatever the tool raised, sent back as its error
        return {"e": str(e)[:MAX_RESULT_CHARS]}


def main(argv: list[str]):
    path, names, parent = argv[0], argv[1].split(","), int(argv[2])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a tool's print() goes to stderr, never into the replies
    sys.stdout = sys.stderr

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)  # reparented: the trainer died

    threading.Thread(target=watch, daemon=True).start()
    try:
        fns = load(path, names)
    except BaseException as e:  # noqa: BLE001 - said in one line, the trainer stops
        reply(fatal=f"{type(e).__name__}: {e}")
        sys.exit(1)
    reply(ready=True)
    me = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        msg = answer(fns, request)
        if os.getpid() != me:  # the tool forked and its child came back here
            os._exit(0)
        reply(id=request["id"], **msg)


if __name__ == "__main__":
    main(sys.argv[1:])
