"""The grading worker pool: Reward (one reward function, the math grader or a user's, run in worker
processes under a time bound), Rewards (several, summed with weights), _Worker, one process
running reward_worker.py and talking to it over pipes (its protocol is in that file), and where a
worker imports a --reward module from (module_root, worker_path).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from ..reward_worker import make_math_verify


# Grading runs math-verify (LaTeX parsed by an ANTLR grammar into sympy, never eval) and users'
# reward functions in worker processes (GRADING_WORKERS), each answering one request at a time, with
# a hard time bound: a request not answered within the bound kills its worker and scores 0,
# counted as a reward error. Not math-verify's own timeout: it uses signal.alarm, which raises
# ValueError off the main thread, has a resolution of whole seconds, replaces the process's SIGALRM
# handler, and cannot interrupt a long call into C (a huge integer power); a separate process can
# always be killed, and bounds memory too (RLIMIT_AS for the math grader).
# The math grader's bound counts the worker's CPU seconds (Linux /proc), not the wall clock: on a
# busy machine a request waits for a core without using its bound, so a correct answer is never
# scored 0 because other processes ran (benchmarks/grading.py --busy). A killed worker is replaced
# at once, in the background: the next requests go to the workers that are ready, never to one
# still importing math-verify.
# Each worker is a process of its own, running reward_worker.py (its protocol, its life and death
# with the trainer); inside a --reward worker whose function calls common.math_reward,
# math-verify grades in that process (in_process_math) instead of starting workers of its own
# within the reward's time bound.

# worker processes per Reward (per rank): math-verify's parser is pure Python, one core each
GRADING_WORKERS = 2
# seconds a worker may take to start (importing math-verify or the user's module)
START_TIMEOUT_S = 120.0
# the math grader's bound is in CPU seconds; a request past this many times it in wall seconds
# (a worker that makes no progress) is stopped too
WALL_FACTOR = 30.0
# set in a --reward worker's environment: the math grader grades in that process (in_process_math)
IN_WORKER_ENV = "GRADER_IN_REWARD_WORKER"
_IN_PROCESS = []  # math-verify of this process, made once (in_process_math)
# the worker's program, in the package folder above this one: run as a file, it finds the project
# wherever the trainer runs from, and its own imports (standard library only) keep its start-up fast
WORKER_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "reward_worker.py")


def in_process_math():
    """math-verify's comparison in this process (a --reward worker): made once, on first use or
    before the worker says it is ready."""
    if not _IN_PROCESS:
        _IN_PROCESS.append(make_math_verify())
    return _IN_PROCESS[0]


class _Worker:
    """One grading process, answering one request at a time over pipes (JSON lines). It starts in
    the background (launch) and takes requests once it has said it is ready."""

    def __init__(self, spec: str | None, kind: str = "pair"):
        self.spec, self.kind, self.proc, self.buf, self.ready, self.started = (spec, kind, None,
                                                                               b"", False, 0.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self):
        import subprocess

        path = json.dumps(worker_path(self.spec))
        main = threading.current_thread() is threading.main_thread()  # lives as long as we do
        env = {**os.environ, IN_WORKER_ENV: "1"} if self.spec else None
        self.proc = subprocess.Popen([sys.executable, WORKER_FILE, path, self.spec or "",
                                      self.kind, str(os.getpid()), "1" if main else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     # a user's prints show
                                     stderr=None if self.spec else subprocess.DEVNULL,
                                     env=env, start_new_session=True)  # signals to our group
        self.buf, self.ready, self.started = b"", False, time.monotonic()

    def relaunch(self):
        self.stop()
        self.launch()

    def check_start(self, died: bool):
        """Note the ready line of a starting worker; one that failed to start stops the run."""
        msg = self.take()
        if msg is not None and "ready" in msg:
            self.ready = True
            return
        if msg is None and not died and time.monotonic() - self.started < START_TIMEOUT_S:
            return
        self.stop()
        why = (msg.get("fatal", msg) if msg else "it exited" if died
               else f"no answer in {START_TIMEOUT_S:g} s")
        raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) did not start: {why}")

    def cpu_seconds(self) -> float | None:
        """The worker's CPU seconds so far (user + system, Linux /proc); None where unreadable."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

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
            msg = json.loads(line)
            if isinstance(msg, dict):
                return msg
        except ValueError:
            pass
        return {"e": f"RuntimeError: the reward worker wrote {line[:80]!r}"}

    def send(self, request) -> bool:
        """False when the worker has died (it is then restarted in the background)."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            return True
        except OSError:
            self.relaunch()
            return False

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc, self.ready = None, False


class _Watched:
    """What score() keeps of a run's training steps, on the reward it was given: whether every
    group's rewards were equal from the first step on (flat_steps, watch_flat_groups), the steps in
    a row each reward failed on more than half of the completions (bad_steps; the run stops after
    fail_steps of them, 0: never, or when one fails on every completion of the first step), and
    each reward's values in the last step (values; NaN where a TRL reward returned None)."""

    def __init__(self, fail_steps: int = 0):
        # training steps in a row, from the first, in which every group's rewards were equal
        self.flat_steps = 0
        self.fail_steps, self.steps, self.bad_steps = fail_steps, 0, {}
        self.values = {}

    def metrics(self) -> dict:
        """rewards/<name>/mean and rewards/<name>/std of each reward (TRL's names) over the last
        training step's completions on all ranks, those it applied to (not None); population std,
        as charts/reward_std."""
        from ..distributed import all_gather_cat

        out = {}
        for name, v in self.values.items():
            v = all_gather_cat(v)
            v = v[~v.isnan()]
            out[f"rewards/{name}/mean"] = v.mean().item() if len(v) else float("nan")
            out[f"rewards/{name}/std"] = v.std(unbiased=False).item() if len(v) else float("nan")
        return out


class Reward(_Watched):
    """One reward function: the math grader (spec None) or a user's function named
    'module:function', of one of two forms (kind): 'pair', f(completion, answer) -> float, one
    request per distinct (completion, answer); or 'trl', TRL's f(prompts, completions, **columns)
    -> list[float | None], one request per group of completions. What score() cannot settle in
    this process (decide) runs in GRADING_WORKERS worker processes, each request bounded by
    timeout_s (a 'trl' request: timeout_s per completion): CPU seconds of its worker for the math
    grader (wall seconds where /proc is missing, and at most WALL_FACTOR x timeout_s of wall time),
    wall seconds for a user's function, which may wait on a sandbox of its own (see above).
    name: its name in the logs (rewards/<name>/mean); params, required: a 'trl' function's named
    parameters and those without a default; more: whether it takes **kwargs."""

    def __init__(self, spec: str | None = None, timeout_s: float = 1.0, kind: str = "pair"):
        self.spec, self.timeout_s, self.kind = spec, timeout_s, kind
        self.name = spec.partition(":")[2] if spec else "math_reward"
        self.params, self.required, self.more = (), (), True
        self.workers = [_Worker(spec, kind) for _ in range(GRADING_WORKERS)]
        self.lock, self.next_id = threading.Lock(), 0
        super().__init__()

    @property
    def parts(self) -> list[tuple[Reward, float]]:
        """The rewards a completion's reward sums, with their weights: this one."""
        return [(self, 1.0)]

    def stop(self):
        for w in self.workers:
            w.stop()

    def __del__(self):
        try:  # at interpreter exit the modules it uses may be gone already
            self.stop()
        except Exception:  # noqa: BLE001
            pass

    def bound(self, request) -> float:
        """The request's time bound: timeout_s, per completion for a group ('trl')."""
        return self.timeout_s * (len(request["completions"]) if self.kind == "trl" else 1)

    def time_left(self, w: _Worker, sent: float, cpu: float | None, bound: float) -> float:
        """Seconds left of the bound of the request sent to w at wall time sent, when w had used cpu
        CPU seconds (<= 0: out of time)."""
        wall = time.monotonic() - sent
        if self.spec is not None or cpu is None:
            return bound - wall
        now = w.cpu_seconds()
        if now is None:
            return bound - wall
        return min(bound - (now - cpu), WALL_FACTOR * bound - wall)

    def run(self, requests: list) -> list[tuple]:
        """(reward, error) per request, each within its bound (timeout_s) of being sent: a request
        that raises, returns a non-finite value, kills its worker or runs out of time gives (0.0,
        the error), and its worker is replaced in the background. A request: (completion, answer)
        ('pair'; (extracted answer, reference) for the math grader), or a dict of keyword
        arguments ('trl', whose reward is a list). A reply that does not name the request or the
        worker is an error too, and its worker is replaced."""
        import select

        if self.spec is None and os.environ.get(IN_WORKER_ENV):  # inside a --reward worker
            fn = in_process_math()
            return [(fn(*r), None) for r in requests]
        out, todo = [None] * len(requests), list(range(len(requests)))[::-1]
        busy = {}  # worker -> (request index, wall time sent, its CPU time then, request id)
        with self.lock:
            for w in self.workers[:len(requests)]:  # start them side by side
                if not w.alive():
                    w.launch()
            while todo or busy:
                for w in self.workers:
                    if w.ready and w not in busy and not w.alive():
                        w.relaunch()  # died while idle
                    if todo and w.ready and w not in busy:
                        i = todo.pop()
                        self.next_id += 1
                        key = "kw" if self.kind in ("trl", "verl") else "a"
                        if w.send({"id": self.next_id, key: requests[i]}):
                            busy[w] = (i, time.monotonic(), w.cpu_seconds(), self.next_id)
                        else:
                            todo.append(i)
                starting = [w for w in self.workers if w.proc is not None and not w.ready]
                wait = min([self.time_left(w, t, c, self.bound(requests[i]))
                            for w, (i, t, c, _) in busy.items()],
                           default=START_TIMEOUT_S)  # a starting worker says when it is ready
                ready = select.select([w.proc.stdout for w in [*busy, *starting]], [], [],
                                      max(0.01, wait))[0]
                for w in starting:
                    w.check_start(w.proc.stdout in ready and not w.pull())
                for w, (i, sent, cpu, rid) in list(busy.items()):
                    died = w.proc.stdout in ready and not w.pull()
                    msg = w.take()
                    if msg is not None and (msg.get("id"), msg.get("pid")) != (rid, w.proc.pid):
                        out[i] = (0.0, f"RuntimeError: a reply from process {msg.get('pid')} for "
                                       f"request {msg.get('id')} came to request {rid} of worker "
                                       f"{w.proc.pid}: {msg.get('e', 'a reward that forks?')} "
                                       "(worker restarted)")
                        msg = None
                    elif msg is not None:
                        out[i] = (msg.get("r", 0.0), msg.get("e"))
                    elif died:
                        out[i] = (0.0, "RuntimeError: the reward worker died (restarted)")
                    elif self.time_left(w, sent, cpu, self.bound(requests[i])) <= 0:
                        b = self.bound(requests[i])
                        bound = (f"{b:g} s" if self.spec is not None or cpu is None
                                 else f"{b:g} s of CPU time")
                        out[i] = (0.0, f"TimeoutError: no reward within {bound} (worker "
                                       "restarted)")
                    else:
                        continue
                    if msg is None:
                        w.relaunch()
                    del busy[w]
        return out


class Rewards(_Watched):
    """Several rewards (--reward repeated), a completion's reward the weighted sum of those that
    apply to it: sum_k w_k r_k over the rewards that did not return None, as TRL's nansum (0 when
    none applies)."""

    def __init__(self, parts: list[tuple[Reward, float]], fail_steps: int = 0):
        super().__init__(fail_steps)
        self.parts = parts

    def stop(self):
        for reward, _ in self.parts:
            reward.stop()


def module_root(module: str) -> tuple[str | None, str | None]:
    """Where a --reward module's top package is found, the one rule the trainer and its workers
    share (worker_path puts this folder first): a name already imported here (the project's
    common, the standard library) from where it was imported, else the working folder first, then
    sys.path. Returns (that folder, another file of the name in the working folder that loses to
    it, or None)."""
    import importlib.machinery

    top = module.split(".")[0]
    imported = sys.modules.get(top)
    origin = getattr(imported, "__file__", None) if imported else None
    if imported is None:
        found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
        origin = found.origin if found and found.has_location else None
    if not origin:
        return None, None
    root = os.path.dirname(origin)
    if os.path.basename(origin) == "__init__.py":
        root = os.path.dirname(root)
    mine = [p for p in (os.path.join(os.getcwd(), top + ".py"), os.path.join(os.getcwd(), top))
            if os.path.exists(p)]
    other = mine[0] if mine and os.path.realpath(root) != os.path.realpath(os.getcwd()) else None
    return root, other


def worker_path(spec: str | None) -> list[str]:
    """What a reward worker puts first on its import path: for a --reward module, the trainer's
    module_root first, so that a worker imports the very file the trainer checked (not a
    same-named one in the working folder), then the working folder and the trainer's path; for the
    math grader, nothing: it imports its libraries from the installation only."""
    if not spec:
        return []
    root = module_root(spec.partition(":")[0])[0]
    return [p for p in (root, os.getcwd()) if p] + sys.path
