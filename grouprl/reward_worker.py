"""The reward worker: one process that answers grading requests, one at a time, over pipes (JSON
lines), for grader.Reward, which starts it as `python reward_worker.py PATH SPEC KIND PARENT
DEATHSIG` and kills it past its time bound (KIND 'probe': once, before the run, to import a
--reward module and say what is there, probe). SPEC empty: the math grader (math-verify, set up by
make_math_verify); else 'module:function', a user's --reward function. Imports nothing of the
project and nothing heavy, so that a worker starts in the time math-verify takes to import.

Protocol (stdin one request a line, stdout one reply a line, every reply naming the process that
wrote it, 'pid'): first {"ready": true}, or {"fatal": "..."} when the reward cannot be set up; then
per request {"id": i, "a": [completion, answer]} ({"id": i, "kw": {...}} for a TRL-form reward,
KIND 'trl') the reply {"id": i, "r": reward} ('r' a list for 'trl') or {"id": i, "e": "error"}.

A worker lives in a session of its own, so that a Ctrl-C in the terminal or a SIGTERM to the
trainer's process group (what a scheduler sends) reaches the trainer alone, which stops at the end
of the step with every reward of it scored. It dies with its trainer, even inside a looping
reward: the kernel kills it when the thread that started it dies (PR_SET_PDEATHSIG, Linux, when
started from the main thread), and a thread of its own exits it when the requests pipe closes or
its parent changes. Replies name the request and the process that answers it: a reward that
forks and lets the child return answers in the child's name, and that is an error, never the
answer of another request.
"""

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time

# the math grader's address-space bound in its worker (math-verify on a huge expression)
MATH_MEMORY_BYTES = 4 << 30
# the grader's libraries: math-verify and what it imports to parse and compare answers
GRADER_LIBRARIES = ("math_verify", "latex2sympy2_extended", "sympy", "mpmath", "antlr4")
# parsed LaTeX kept per worker, cleared when full (a group's completions repeat answers)
PARSE_CACHE = 4096


def two_stage_parsing() -> bool:
    """ANTLR's two-stage parse in latex2sympy2_extended: the fast SLL prediction first, full LL
    only where SLL fails (~4x faster). The library has no option for it, so this wraps
    two private names, _Latex2Sympy.create_parser and _Latex2Sympy.parse; False (grading still
    right, only slower) when they are gone, and tests/test_reward_worker.py fails."""
    try:
        from antlr4.atn.PredictionMode import PredictionMode
        from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
        ll_create, ll_parse = _Latex2Sympy.create_parser, _Latex2Sympy.parse
    except (ImportError, AttributeError):
        return False
    if getattr(ll_parse, "two_stage", False):  # installed already (this process graded before)
        return True

    def create_parser(self, latex):
        parser = ll_create(self, latex)
        if getattr(self, "sll", False):
            parser._interp.predictionMode = PredictionMode.SLL
        return parser

    def two_stage(self, latex):
        try:
            self.sll = True
            return ll_parse(self, latex)
        except Exception:
            self.sll = False
            return ll_parse(self, latex)

    two_stage.two_stage = True
    _Latex2Sympy.create_parser, _Latex2Sympy.parse = create_parser, two_stage
    return True


def installed_path() -> list[str]:
    """The entries of sys.path inside the installation (the standard library, site-packages, the
    user's site) or named by PYTHONPATH, the working folder never: where the grader's libraries are
    imported from, so that a math_verify.py or sympy.py lying in the working folder is not graded
    with in their place."""
    import site
    import sysconfig

    real = os.path.realpath
    paths = sysconfig.get_paths()
    roots = {real(p) for p in (paths["stdlib"], paths["platstdlib"], paths["purelib"],
                               paths["platlib"], *site.getsitepackages()) if p}
    if site.ENABLE_USER_SITE:
        roots.add(real(site.getusersitepackages()))
    roots |= {real(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    roots.discard(real(os.getcwd()))
    return [p for p in sys.path if p and real(p) != real(os.getcwd())
            and any(real(p) == r or real(p).startswith(r + os.sep) for r in roots)]


@contextlib.contextmanager
def installed_only():
    """Imports inside come from installed_path() alone; one of the grader's libraries imported
    from elsewhere already (by a --reward module, from its folder) is an ImportError naming it."""
    path = installed_path()
    roots = [os.path.realpath(p) for p in path]
    for name in GRADER_LIBRARIES:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where and not any(os.path.realpath(where).startswith(r + os.sep) for r in roots):
            raise ImportError(f"{name} was imported from {where}, not the installed library: the "
                              "grader does not grade with it (rename that file)")
    saved = sys.path[:]
    sys.path[:] = path
    try:
        yield
    finally:
        sys.path[:] = saved


def make_math_verify():
    """math-verify set up for grading: fn(pred, gold) -> 1.0 or 0.0, both LaTeX answers parsed
    once (an ANTLR grammar into sympy, never eval), no time bound of its own (the worker's is),
    imported from the installation only (installed_only).
    Run by the math grader's workers, and inside a --reward worker whose function calls
    common.math_reward (grader.in_process_math)."""
    import logging
    logging.disable(logging.WARNING)
    with installed_only():  # never a math_verify.py or sympy.py of the working folder
        from math_verify import LatexExtractionConfig, parse, verify
        two_stage_parsing()
    config, parsed = [LatexExtractionConfig()], {}

    def parse_once(s):
        if len(parsed) > PARSE_CACHE:
            parsed.clear()
        if s not in parsed:
            parsed[s] = parse("$" + s + "$", extraction_config=config,
                              fallback_mode="no_fallback",
                              parsing_timeout=None)
        return parsed[s]

    def fn(pred, gold):
        g, p = parse_once(gold), parse_once(pred)
        return float(bool(g) and bool(p) and verify(g, p, timeout_seconds=None))

    return fn


def finite(r) -> float:
    """A reward as a float; a NaN or an infinity is an error of the reward."""
    r = float(r)
    if r != r or abs(r) == float("inf"):
        raise ValueError(f"the reward returned {r}")
    return r


def answer(fn, kind: str, request: dict) -> dict:
    """The reply to one request, less its id: {'r': ...} or {'e': 'Type: message'}."""
    try:
        if kind == "trl":  # a batch: a list of one reward or None per completion
            n = len(request["kw"]["completions"])  # counted before the call: a reward may alter it
            rs = fn(**request["kw"])
            if not isinstance(rs, (list, tuple)) or len(rs) != n:
                raise ValueError(f"the reward returned {type(rs).__name__} "
                                 f"{str(rs)[:40]}, not a list of {n} rewards")
            return {"r": [None if r is None else finite(r) for r in rs]}
        if kind == "verl":  # one completion; a dict read by its "score", as verl does
            r = fn(**request["kw"])
            if isinstance(r, dict):
                if "score" not in r:
                    raise ValueError(f"the reward returned a dict without 'score' (keys: "
                                     f"{', '.join(map(str, r))[:80]}); verl reads its 'score'")
                r = r["score"]
            return {"r": finite(r)}
        return {"r": finite(fn(*request["a"]))}
    except Exception as e:
        return {"e": f"{type(e).__name__}: {e}"[:300]}


def load(spec: str):
    """The function that grades: the user's 'module:function', or math-verify (spec empty)."""
    if spec:
        import importlib
        module, name = spec.split(":")
        fn = getattr(importlib.import_module(module), name)
        grader = sys.modules.get("grouprl.grader")
        if grader is not None:  # the reward may call common.math_reward: math-verify ready now
            try:
                grader.in_process_math()
            except ImportError:  # not installed: an error of the requests that need it
                pass
        return fn
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MATH_MEMORY_BYTES,
                                            resource.getrlimit(resource.RLIMIT_AS)[1]))
    return make_math_verify()


def reward_form(fn) -> tuple[str, tuple, tuple, bool] | None:
    """How a reward function is called, from its signature: ('pair', ...) for the project's
    f(completion, answer) -> float (two positional arguments, none named 'completions' or
    'prompts'); ('trl', params, required, more) for TRL's f(prompts, completions, **columns) ->
    list[float | None] (a parameter 'completions' or 'prompts'; params: its named parameters,
    required: those without a default, more: whether it takes **kwargs); ('verl', ...) likewise
    for verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float or
    {'score': float, ...} (parameters 'solution_str' and 'ground_truth'); None for none."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    ps = sig.parameters
    named = tuple(p.name for p in ps.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if "solution_str" in named and "ground_truth" in named:  # verl's compute_score, by keyword
        if any(p.kind == p.POSITIONAL_ONLY for p in ps.values()):
            return None
        required = tuple(p.name for p in ps.values() if p.name in named and p.default is p.empty)
        return "verl", named, required, any(p.kind == p.VAR_KEYWORD for p in ps.values())
    if "completions" not in named and "prompts" not in named:
        try:
            sig.bind("completion", "answer")
        except TypeError:
            return None
        return "pair", (), (), False
    if any(p.kind == p.POSITIONAL_ONLY for p in ps.values()):
        return None  # TRL passes every argument by name
    required = tuple(p.name for p in ps.values() if p.name in named and p.default is p.empty)
    return "trl", named, required, any(p.kind == p.VAR_KEYWORD for p in ps.values())


def probe(spec: str) -> dict:
    """What the trainer checks of a --reward 'module:function' before the run, found by importing
    the module (in a worker of kind 'probe', so that a module that exits or hangs at import stops
    that worker, not the trainer): {'missing': name} (a module that is not there), {'exited':
    code} (sys.exit at import), {'raised': 'Type: message'}, {'absent': True} (no such name),
    {'type': name} (not callable) or {'form': reward_form(fn)}; and 'threads', the names of the
    threads that are not daemons which the import started (they would keep a process alive)."""
    import importlib

    module, name = spec.split(":")
    before = set(threading.enumerate())
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        found = {"missing": e.name}
    except SystemExit as e:
        found = {"exited": str(e.code)}
    except BaseException as e:  # noqa: BLE001 - whatever the module raised, said in one line
        found = {"raised": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    else:
        found = ({"absent": True} if fn is None else {"type": type(fn).__name__}
                 if not callable(fn) else {"form": reward_form(fn)})
    found["threads"] = [t.name for t in threading.enumerate()
                        if t not in before and not t.daemon and t.is_alive()]
    return found


def main(argv: list[str]):
    spec, kind, parent, deathsig = argv[1], argv[2], int(argv[3]), argv[4] == "1"
    me = os.getpid()
    if deathsig:
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    sys.path[:0] = json.loads(argv[0])  # a --reward module's folder first (the trainer's rule)
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)
    # replies only: a print() or a child process of the reward writes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw):
        out.write(json.dumps({**kw, "pid": os.getpid()}) + "\n")
        out.flush()

    requests = queue.Queue()

    def read():
        for line in sys.stdin:
            requests.put(line)
        os._exit(0)  # the trainer closed the pipe, or died

    def watch():
        while os.getppid() == parent:
            time.sleep(0.1)
        os._exit(0)  # reparented: the trainer died

    threading.Thread(target=watch, daemon=True).start()
    if kind == "probe":  # import the module, say what is there, and leave (a stray thread too)
        reply(**probe(spec))
        os._exit(0)
    threading.Thread(target=read, daemon=True).start()
    try:
        fn = load(spec)
    except BaseException as e:
        reply(fatal=f"{type(e).__name__}: {e}")
        sys.exit(1)
    reply(ready=True)
    while True:
        request = json.loads(requests.get())
        msg = answer(fn, kind, request)
        if os.getpid() != me:  # the reward forked and its child came back here: say so, and leave
            reply(id=request["id"], e="the reward returned in a process it forked")
            os._exit(0)
        reply(id=request["id"], **msg)


if __name__ == "__main__":
    main(sys.argv[1:])
