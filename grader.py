"""The math grader (answer extraction, normalisation, exact decisions, math-verify) and the worker
processes that run it and users' --reward functions under a time bound. Called by common.score.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from fractions import Fraction

from distributed import fail


# -------------------- the math grader: answers read, normalised and decided exactly
# Numbers as answers write them: -12, 3.5, .5, 3/4, and thousands in groups of three (1,234). A
# comma that three digits do not follow ends the number, so "the answer is 72, in total" gives 72.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")


def answer_span(text: str) -> tuple[int, int] | None:
    """Where the final answer lies in text, as (start, end) character offsets: the contents of the
    last \\boxed{...} (or the token after a brace-less `\\boxed 5`), else the number (or the first
    non-empty line) after the last '####', else the last number."""
    box = None
    for box in _BOX.finditer(text):
        pass
    if box is not None and box.group(1) is None:
        m = re.compile(r"\s*([^\s$]+)").match(text, box.end())
        return m.span(1) if m else None
    if box is not None:
        depth = 1
        for k in range(box.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return box.end(), k
        return None  # unbalanced \boxed{
    i = text.rfind("####")
    if i >= 0:
        m = (re.compile(r"\s*(" + _NUM + ")").match(text, i + 4)
             or re.compile(r"\s*(\S[^\n]*)").match(text, i + 4))
        return m.span(1) if m else None
    last = None
    for last in re.finditer(_NUM, text):
        pass
    return last.span() if last else None


def extract_answer(text: str) -> str | None:
    """The final answer: the last \\boxed{...}, else what follows the last '####', else the last
    number."""
    span = answer_span(text)
    return text[span[0]:span[1]].strip() if span else None


_TEXT_CMD = r"\\(?:text|textbf|textrm|textit|mbox|mathrm|mathbf|operatorname)\s*"
_UNIT = re.compile(r"(?<=\S)\s*" + _TEXT_CMD
                   + r"\{\s*[A-Za-z][A-Za-z\s.]*\}(?:\s*\^\s*\{?[23]\}?)?$")
_WORDS_AFTER_NUMBER = re.compile(r"([-+]?[\d.,/]*\d)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]+)*)\.?")
_WORD = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")
# a longer extracted answer is not graded: it scores 0 and counts as a reward error
MAX_ANSWER_CHARS = 1000


def normalize_answer(s: str) -> tuple[str, bool]:
    """An answer in one canonical spelling, and whether it carried a percent sign: \\dfrac and
    \\tfrac become \\frac, \\sqrt3 and \\frac12 get their braces; \\left/\\right, spacing commands,
    $ and \\$, degrees (^\\circ), %, a trailing unit (\\text{ cm}, or words after a number: '18.90
    dollars', but 'percent' is a % and 'pi' is \\pi), a \\text{...} around the whole answer, a
    leading + and a final period go; 1{,}000 is 1,000; spaces go except between two letters. Pure
    text."""
    s = s.strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle", "", s)
    s = s.replace("{,}", ",").replace("\\$", "").replace("$", "")
    s = re.sub(r"(?<!\\)\\[,!;: ]|~|\\q?quad(?![a-zA-Z])", " ", s)  # not the \\ of a new row
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree", "", s)
    percent = "%" in s
    s = re.sub(r"\\?%", "", s).strip()
    s = _UNIT.sub("", s).strip()
    whole = re.fullmatch(_TEXT_CMD + r"\{([^{}]*)\}", s)
    if whole:
        s = whole.group(1).strip()
    after = _WORDS_AFTER_NUMBER.fullmatch(s)
    if after and after.group(2).lower() == "pi":  # '2 pi' is a number times pi, not a unit
        s = after.group(1) + "\\pi"
    elif after:
        percent = percent or after.group(2).lower() in ("percent", "per cent")
        s = after.group(1)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", " ", s).rstrip(".").strip()
    # the word: compared as text, 'infinity' never equals \\infty
    s = re.sub(r"^([-+]?)(?:infinity|inf|∞)$", r"\1\\infty", s, flags=re.I)
    s = re.sub(r"^\+(?=[\d.\\])", "", s)
    # "x + 1" -> "x+1"; "\pi r" keeps its space
    s = re.sub(r"(?<=[^A-Za-z]) | (?=[^A-Za-z])", "", s)
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)  # multiple choice: (C) is C
    return (choice.group(1) if choice else s), percent


def parse_number(s: str) -> Fraction | None:
    """The exact value of a number as answers write it (after normalize_answer): integers, decimals,
    thousands separators, a/b, \\frac{a}{b}, a sign; None when s is not one number."""
    s = normalize_answer(s)[0]
    if len(s) > 100:  # past Python's digit limits, and no answer worth an exact comparison
        return None
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}", s)
    try:
        if m:
            v = Fraction(m.group(2).replace(",", "")) / Fraction(m.group(3).replace(",", ""))
            return -v if m.group(1) else v
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
            s = s.replace(",", "")
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+)?", s):
            num, _, den = s.partition("/")
            return Fraction(num) / (Fraction(den) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def canonical(answer: str) -> tuple[str, frozenset]:
    """(normalised text, the exact values it may mean): one value for a number, two for a percentage
    (5% is 5, as answers are often written, and 0.05), none for anything else. Computed once per
    distinct answer."""
    text, percent = normalize_answer(answer)
    v = parse_number(text)
    if v is None:
        return text, frozenset()
    return text, frozenset({v, v / 100}) if percent else frozenset({v})


def decide(pred: tuple[str, frozenset], gold: tuple[str, frozenset]) -> float | None:
    """The fast path: 1.0 or 0.0 where canonical forms settle it (equal text, two numbers, or plain
    words, compared without case), None where a symbolic comparison must decide (math-verify, in the
    grading worker)."""
    if pred[0] == gold[0] and pred[0]:
        return 1.0
    if pred[1] and gold[1]:
        return float(bool(pred[1] & gold[1]))
    # text answers; math-verify would read a word as a product of symbols, so 'Evenly' would equal
    # 'Evelyn'
    if _WORD.fullmatch(pred[0]) or _WORD.fullmatch(gold[0]):
        return float(pred[0].lower() == gold[0].lower())
    if not pred[0] or not gold[0]:
        return 0.0
    return None


# Grading runs math-verify (LaTeX parsed by an ANTLR grammar into sympy, never eval) and users'
# reward functions in worker processes (GRADING_WORKERS), each answering one request at a time, with
# a hard time bound: a request not answered within the bound kills its worker (restarted on its next
# request) and scores 0, counted as a reward error. Not math-verify's own timeout: it uses
# signal.alarm, which raises ValueError off the main thread, has a resolution of whole seconds,
# replaces the process's SIGALRM handler, and cannot interrupt a long call into C (a huge integer
# power); a separate process can always be killed, and bounds memory too (RLIMIT_AS for the math
# grader).
_WORKER_SRC = r'''
import json
import os
import sys
sys.path[:0] = json.loads(sys.argv[1])
spec = sys.argv[2]
# replies only: a print() or a child process of the reward writes to stderr
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
def reply(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()
try:
    if spec:
        import importlib
        module, name = spec.split(":")
        fn = getattr(importlib.import_module(module), name)
    else:
        import logging
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        logging.disable(logging.WARNING)
        from math_verify import LatexExtractionConfig, parse, verify
        # ANTLR's two-stage parse: the fast SLL prediction first, full LL only where SLL fails
        # (~4x faster)
        try:
            from antlr4.atn.PredictionMode import PredictionMode
            from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy
            ll_create, ll_parse = _Latex2Sympy.create_parser, _Latex2Sympy.parse
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
            _Latex2Sympy.create_parser, _Latex2Sympy.parse = create_parser, two_stage
        except (ImportError, AttributeError):
            pass
        config, parsed = [LatexExtractionConfig()], {}
        def parse_once(s):
            if len(parsed) > 4096:
                parsed.clear()
            if s not in parsed:
                parsed[s] = parse("$" + s + "$", extraction_config=config,
                                  fallback_mode="no_fallback",
                                  parsing_timeout=None)
            return parsed[s]
        def fn(pred, gold):
            g, p = parse_once(gold), parse_once(pred)
            return float(bool(g) and bool(p) and verify(g, p, timeout_seconds=None))
except BaseException as e:
    reply(fatal=f"{type(e).__name__}: {e}")
    sys.exit(1)
reply(ready=True)
for line in sys.stdin:
    a, b = json.loads(line)
    try:
        r = float(fn(a, b))
        if r != r or abs(r) == float("inf"):
            raise ValueError(f"the reward returned {r}")
        reply(r=r)
    except Exception as e:
        reply(e=f"{type(e).__name__}: {e}"[:300])
'''


# worker processes per Reward (per rank): math-verify's parser is pure Python, one core each
GRADING_WORKERS = 2


class _Worker:
    """One grading process, answering one request at a time over pipes (JSON lines)."""

    def __init__(self, spec: str | None):
        self.spec, self.proc, self.buf = spec, None, b""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self):
        import subprocess

        path = json.dumps([os.getcwd(), *sys.path])
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_SRC, path, self.spec or ""],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     # a user's prints show
                                     stderr=None if self.spec else subprocess.DEVNULL)
        self.buf = b""

    def wait_ready(self):
        import select

        deadline = time.monotonic() + 120.0  # importing math-verify or the user's module
        while self.line() is None and time.monotonic() < deadline:
            if (select.select([self.proc.stdout], [], [], deadline - time.monotonic())[0]
                    and not self.pull()):
                break
        msg = self.take()
        if msg is None or "fatal" in msg:
            self.stop()
            why = msg["fatal"] if msg else "no answer in 120 s"
            raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) did not start: "
                               f"{why}")

    def pull(self) -> bool:
        """Read what the worker wrote; False when it has died."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> bytes | None:
        return self.buf.split(b"\n", 1)[0] if b"\n" in self.buf else None

    def take(self) -> dict | None:
        line = self.line()
        if line is None:
            return None
        self.buf = self.buf[len(line) + 1:]
        try:
            return json.loads(line)
        except ValueError:
            return {"e": f"RuntimeError: the reward worker wrote {line[:80]!r}"}

    def send(self, request):
        for attempt in range(2):
            if not self.alive():
                self.launch()
                self.wait_ready()
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                return
            except OSError:  # it died after alive() looked: once more with a new one
                self.stop()
        raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) dies as it starts")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Reward:
    """The reward of a completion given its prompt's answer: the math grader (spec None) or a user's
    function f(completion, answer) -> float named 'module:function'. What score() cannot settle in
    this process (decide) runs in GRADING_WORKERS worker processes, each request bounded by
    timeout_s (see above)."""

    def __init__(self, spec: str | None = None, timeout_s: float = 1.0):
        self.spec, self.timeout_s = spec, timeout_s
        self.workers, self.lock = [_Worker(spec) for _ in range(GRADING_WORKERS)], threading.Lock()
        # training steps in a row, from the first, in which every group's rewards were equal
        self.flat_steps = 0

    def stop(self):
        for w in self.workers:
            w.stop()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.stop()

    def run(self, requests: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
        """(reward, error) per request, each within timeout_s of being sent: a request that raises,
        returns a non-finite value, kills its worker or runs out of time gives (0.0, the error); the
        worker is restarted."""
        import select

        out, todo = [None] * len(requests), list(range(len(requests)))[::-1]
        busy = {}  # worker -> (request index, deadline)
        with self.lock:
            idle = [w for w in self.workers[:len(requests)] if not w.alive()]
            for w in idle:  # start them side by side
                w.launch()
            for w in idle:
                w.wait_ready()
            while todo or busy:
                for w in self.workers:
                    if w not in busy and todo:
                        i = todo.pop()
                        w.send(requests[i])
                        busy[w] = (i, time.monotonic() + self.timeout_s)
                wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
                ready = select.select([w.proc.stdout for w in busy], [], [], wait)[0]
                for w, (i, deadline) in list(busy.items()):
                    died = w.proc.stdout in ready and not w.pull()
                    msg = w.take()
                    if msg is not None:
                        out[i] = (msg.get("r", 0.0), msg.get("e"))
                    elif died:
                        out[i] = (0.0, "RuntimeError: the reward worker died (restarted)")
                    elif time.monotonic() >= deadline:
                        out[i] = (0.0, f"TimeoutError: no reward within {self.timeout_s:g} s "
                                       "(worker restarted)")
                    else:
                        continue
                    if msg is None:
                        w.stop()
                    del busy[w]
        return out


def load_reward(spec: str | None, timeout_s: float) -> Reward:
    """--reward and --reward-timeout, checked before any heavy work: None is the math grader (it
    needs math-verify); 'module:function' must name a callable f(completion, answer) -> float
    importable from the current folder or the Python path."""
    import importlib
    import importlib.util

    if not timeout_s > 0:
        fail(f"--reward-timeout {timeout_s}: must be > 0 seconds")
    if spec is None:
        if importlib.util.find_spec("math_verify") is None:
            fail("the math grader needs math-verify: pip install -r requirements.txt")
        return Reward(None, timeout_s)
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        fail(f"--reward {spec!r}: give module:function, e.g. my_rewards:format_reward for a "
             "function f(completion, answer) -> float in my_rewards.py")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        fail(f"--reward {spec!r}: cannot import {e.name!r} (run from the folder of {module}.py or "
             "add it to PYTHONPATH)")
    except Exception as e:  # noqa: BLE001 - the user's module raised while it was imported
        fail(f"--reward {spec!r}: importing {module!r} raised {type(e).__name__}: "
             f"{e}".splitlines()[0])
    if fn is None:
        fail(f"--reward {spec!r}: module {module!r} has no {name!r}")
    if not callable(fn):
        fail(f"--reward {spec!r}: {module}.{name} is a {type(fn).__name__}, not a function "
             "f(completion, answer)")
    return Reward(spec, timeout_s)
