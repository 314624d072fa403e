"""Loading the rewards of a run (load_reward: --reward, --reward-weights, --reward-timeout,
--reward-fail-steps, checked before any heavy work), where a --reward module is imported from
(module_root, worker_path), and the probe that imports it in a worker process of its own first.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading

from ..distributed import fail
from ..reward_worker import probe
from .pool import IN_WORKER_ENV, WORKER_FILE, Reward, Rewards, module_root, worker_path

# a --reward module's import, in a worker before the run (_probe_in_worker): past this it hangs
IMPORT_TIMEOUT_S = 60.0


def load_reward(spec: str | list[str] | None, timeout_s: float, weights: list[float] = (),
                fail_steps: int = 0) -> Reward | Rewards:
    """--reward, --reward-timeout, --reward-weights and --reward-fail-steps, checked before any
    heavy work. spec None (or an empty list) is the math grader (it needs math-verify); each
    'module:function' must name a function importable from the current folder or the Python path,
    of either form reward_form reads. A list gives Rewards (weights: one per reward, default 1
    each), a string or None one Reward."""
    if not timeout_s > 0:
        fail(f"--reward-timeout {timeout_s}: must be > 0 seconds")
    if isinstance(fail_steps, bool) or not isinstance(fail_steps, int) or fail_steps < 0:
        fail(f"--reward-fail-steps {fail_steps}: must be an integer >= 0 (0: never stop)")
    if not isinstance(spec, list):
        reward = _load_one(spec, timeout_s)
        reward.fail_steps = fail_steps
        return reward
    specs = spec or [None]
    weights = list(weights) or [1.0] * len(specs)
    if len(weights) != len(specs):
        fail(f"--reward-weights: {len(weights)} weight(s) for {len(specs)} reward(s) "
             f"({', '.join(s or 'the math grader' for s in specs)}); give one weight per --reward")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        fail(f"--reward-weights {bad[0]}: must be a finite number")
    rewards = [_load_one(s, timeout_s) for s in specs]
    names = [r.name for r in rewards]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"--reward: two rewards named {twice[0]!r} (their logs, rewards/<name>/mean, would "
             "mix): give each --reward once, or wrap one under another name")
    return Rewards(list(zip(rewards, weights)), fail_steps)


def _load_one(spec: str | None, timeout_s: float) -> Reward:
    import importlib.util

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
    root, other = module_root(module)
    if other:  # the same name twice: which one the trainer and its workers both use, said
        print(f"note: --reward {spec!r}: {module.split('.')[0]!r} is "
              f"{sys.modules[module.split('.')[0]].__file__} (imported by the trainer, and so by "
              f"its reward workers); your {other} is not used: rename it to use it",
              file=sys.stderr)
    # imported in a worker, under a time bound: a module that exits, hangs or leaves a thread at
    # import stops that process, not this one (one imported here already runs nothing on import)
    found = probe(spec) if module in sys.modules else _probe_in_worker(spec, module)
    if found.get("threads"):
        print(f"warning: --reward {spec!r}: importing {module!r} started a thread that is not a "
              f"daemon ({', '.join(found['threads'])}); the reward workers run it, the trainer "
              "does not import the module: start it in the function, or as a daemon",
              file=sys.stderr)
    if "missing" in found:
        fail(f"--reward {spec!r}: cannot import {found['missing']!r} (run from the folder of "
             f"{module}.py or add it to PYTHONPATH)")
    if "exited" in found:
        fail(f"--reward {spec!r}: importing {module!r} called sys.exit({found['exited']}): a reward "
             "module must not exit at import (put that under if __name__ == '__main__')")
    if "raised" in found:
        fail(f"--reward {spec!r}: importing {module!r} raised {found['raised']}")
    if "absent" in found:
        fail(f"--reward {spec!r}: module {module!r} has no {name!r}")
    if "type" in found:
        fail(f"--reward {spec!r}: {module}.{name} is a {found['type']}, not a function "
             "f(completion, answer)")
    form = found["form"]
    if form is None:
        fail(f"--reward {spec!r}: {module}.{name} fits none of f(completion, answer) -> float, "
             "TRL's f(prompts, completions, **columns) -> list[float | None] and verl's "
             "compute_score(data_source, solution_str, ground_truth, extra_info)")
    reward = Reward(spec, timeout_s, form[0])
    reward.params, reward.required, reward.more = (tuple(form[1]), tuple(form[2]), form[3])
    return reward


def _probe_in_worker(spec: str, module: str) -> dict:
    """reward_worker.probe(spec) in a worker process of its own, bounded by IMPORT_TIMEOUT_S; one
    line when the import ends that process or does not finish."""
    import subprocess

    main = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen([sys.executable, WORKER_FILE, json.dumps(worker_path(spec)),
                             spec, "probe", str(os.getpid()), "1" if main else "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            env={**os.environ, IN_WORKER_ENV: "1"})
    try:
        out = proc.communicate(timeout=IMPORT_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        fail(f"--reward {spec!r}: importing {module!r} did not finish in {IMPORT_TIMEOUT_S:g} s "
             "(it waits at import: on input, a lock, the network?): move that work into the "
             "function, or out of the module")
    for line in out.decode(errors="replace").splitlines()[::-1]:
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get("pid") == proc.pid:
            return found
    fail(f"--reward {spec!r}: importing {module!r} ended the process (exit code {proc.returncode}, "
         "os._exit or a signal) before the function could be read: a reward module must not "
         "exit at import (put that under if __name__ == '__main__')")
