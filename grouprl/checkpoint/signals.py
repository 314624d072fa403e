"""Stop signals and the end of a run: SIGTERM or SIGINT during start-up stops in one line; from the
first step on, it asks every rank for a checkpoint at the end of the step; cleanup ends a process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..distributed import ON_FAIL, all_reduce, fail, main_process
from .run_dir import release_run_dir


# -------------------- graceful stop (SIGTERM, SIGINT)
# SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C) on any rank: every rank finishes the step,
# saves a checkpoint and exits 0; --resume auto then continues exactly. A second signal exits at
# once (code 128 + signal), if it comes a second or more after the first: within that second it is
# the same event delivered twice (Ctrl-C or a scheduler signals every process of the job, and
# torchrun forwards what it gets to its workers on top).
_stop = {"signal": None, "at": 0.0, "handlers": {}, "phase": "start-up"}


def catch_startup_signals():
    """Until catch_stop_signals (the first step), SIGTERM or SIGINT stops the run in one line, not
    a KeyboardInterrupt traceback or a silent exit, and a run folder made meanwhile is removed
    (remove_unused_run_dir): there is nothing to save yet. Called where set-up starts
    (cli.check_common_args)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach that one
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        _stop["handlers"].setdefault(sig, signal.getsignal(sig))  # restored at the run's end
        signal.signal(sig, _on_startup_signal)


def _on_startup_signal(signum, frame):
    fail(f"{signal.Signals(signum).name} during {_stop['phase']}, before the first step: stopped, "
         "nothing was saved (start the run again)")


def starting_up() -> bool:
    """True between catch_startup_signals and catch_stop_signals: before the first step."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_startup_signal)


@contextlib.contextmanager
def startup_phase(name: str):
    """What a start-up signal's line says the run was doing ('the step-0 evaluation')."""
    before, _stop["phase"] = _stop["phase"], name
    try:
        yield
    finally:
        _stop["phase"] = before


def catch_stop_signals():
    """From here on, the first SIGTERM or SIGINT asks for a checkpoint at the end of the step
    (stop_requested)."""
    _stop["signal"] = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        _stop["handlers"].setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, _on_stop_signal)


def _on_stop_signal(signum, frame):
    if _stop["signal"] is not None and time.monotonic() - _stop["at"] >= 1.0:
        os._exit(128 + signum)
    if _stop["signal"] is not None:
        return
    _stop["signal"], _stop["at"] = signum, time.monotonic()
    # os.write: safe inside a handler, unlike print
    os.write(2, f"\n{signal.Signals(signum).name}: stopping with a checkpoint at the end of this "
                "step (a second signal exits at once)\n".encode())


def request_stop(signum: int = signal.SIGTERM):
    """A stop asked for from inside the run (--async-rollouts: a rollout rank's signal, sent with
    its rollout), as that signal would ask it here: once; a stop already asked for stays."""
    if _stop["signal"] is None:
        _on_stop_signal(signum, None)


ON_FAIL.append(lambda: release_stop_signals() if threading.current_thread() is
               threading.main_thread() else None)  # a run that fails gives its handlers back


def stop_requested() -> bool:
    """True on every rank when any rank got a stop signal: one flag, all-reduced (MAX) once a
    step."""
    flag = torch.tensor([0.0 if _stop["signal"] is None else 1.0])
    stop = bool(all_reduce(flag, dist.ReduceOp.MAX).item())
    if stop and main_process():
        print("a stop signal: every rank saves a checkpoint and exits 0 (continue with --resume "
              "auto)")
    return stop


def release_stop_signals():
    """The handlers from before catch_stop_signals (tests run main() inside one process)."""
    for sig, handler in _stop["handlers"].items():
        signal.signal(sig, handler)
    _stop["handlers"].clear()


# -------------------- the end of a run
def cleanup():
    """The end of a torchrun process: every rank done with every collective, the group destroyed,
    then the process leaves without the interpreter's exit-time destructors. Under torch 2.13 +
    gloo, process-group objects that the FSDP2 model still references are destroyed there and
    sometimes abort ("terminate called without an active exception", about 1 run in 60 on 2 busy
    cores) after all the work is done and saved. World size 1: nothing but letting go of the run
    folder's lock."""
    release_run_dir()
    release_stop_signals()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
