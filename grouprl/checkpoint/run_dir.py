"""The run folder and its lock: one writer per folder (claim_run_dir), what a start finds there
(partial saves, unfinished prunes, checkpoints without a manifest), pruning to --keep-checkpoints,
a branch's later checkpoints and rows set aside, the folder checked by identity while the run writes
it (gone_or_replaced), and a fresh folder removed when the run stops before it logged anything.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import json
import os
import shutil
import socket
import sys
import time

from ..distributed import ON_FAIL, Dist, Refused, on_rank0
from .manifest import FINAL, MANIFEST, STEP_DIR, is_checkpoint, step_folders


# One writer per run folder: rank 0 holds an exclusive flock on the run folder itself and on
# {run_dir}/writer.lock (which names its pid and host), from before the model loads until the
# process ends. The kernel lets go of both when the process dies, however it dies, so a dead
# writer's locks are taken over by the next run; a live writer's stop the next one with one line.
# The folder's lock is what deleting writer.lock (a stale-looking file naming a pid) cannot undo: a
# second writer that recreates the file still finds the folder locked. writer.lock's own lock is
# kept for file systems that lock files but not folders (NFS turns flock into byte-range locks,
# which a folder opened read-only cannot take).
_run_lock = []  # rank 0's open run folder and writer.lock
_held = {}  # the run folder's path -> its open descriptor: the folder as locked, by identity
_fresh = []  # a fresh run folder this process made and has not logged into yet


def claim_run_dir(run_dir: str, ckpt: str | None, dist_env: Dist) -> str:
    """Rank 0 creates a fresh run's folder (a run started in the same second with the same
    --exp-name and --seed takes the next free second's name, never the same folder) or takes a
    resumed run's, and locks it. Returns the folder, the same on every rank; a folder held by a live
    writer stops every rank with one line naming it."""
    return on_rank0(lambda: _claim_run_dir(run_dir, ckpt), dist_env)


def _lock(fd: int, run_dir: str, path: str) -> bool:
    """An exclusive flock on fd: True when taken, False where the file system refuses locks;
    a live holder is refused with one line naming it (writer.lock's text, when it is still
    there)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        os.close(fd)
        try:
            with open(path) as f:
                holder = f.read().strip() or "another process"
        except OSError:
            holder = "another process (its writer.lock, which names it, was deleted)"
        raise Refused(f"{run_dir} is being written by {holder} (it holds {path}): wait for that "
                      "run to end, or start another with a different --exp-name or --seed")
    except OSError:
        return False


def _claim_run_dir(run_dir: str, ckpt: str | None) -> str:
    if ckpt is None:
        os.makedirs(os.path.dirname(run_dir) or ".", exist_ok=True)
        head, t = run_dir.rsplit("__", 1)
        while True:
            try:
                os.mkdir(run_dir)  # atomic: of two runs that picked the same name, one gets it
                break
            except FileExistsError:
                t = str(int(t) + 1)
                print(f"{run_dir} exists (a run started in the same second): this run writes to "
                      f"{head}__{t}")
                run_dir = f"{head}__{t}"
    release_run_dir()  # an earlier run in this process (tests call main() more than once)
    if ckpt is None:  # made here: removed again if the run stops before it logs anything
        _fresh.append(run_dir)
    path = os.path.join(run_dir, "writer.lock")
    folder = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    locked = _lock(folder, run_dir, path)  # first: a refused writer leaves writer.lock as it is
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        os.close(folder)
        raise Refused(f"{run_dir}: cannot write {path} ({e.strerror}): make the folder writable "
                      "(or free space on its disk) and start again")
    try:
        locked = _lock(fd, run_dir, path) or locked
    except Refused:
        os.close(folder)
        raise
    if not locked:  # a file system without locks (e.g. NFS mounted with nolock): said, not hidden
        print(f"warning: cannot lock {run_dir} or {path}: no one-writer guarantee on this file "
              "system", file=sys.stderr)
    _run_lock.extend([folder, fd])
    _held[os.path.normpath(run_dir)] = folder
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError as e:  # a full disk: one line, not a traceback
        release_run_dir()
        raise Refused(f"{run_dir}: cannot write {path} ({e.strerror}): free space on its disk "
                      "and start again")
    remove_partial_checkpoints(run_dir)
    if ckpt is not None:
        set_aside_later_checkpoints(run_dir, int(STEP_DIR.search(ckpt)[1]))
    report_unlisted_checkpoints(run_dir)
    return run_dir


def remove_partial_checkpoints(run_dir: str):
    """A .tmp_step_N folder is a save that never completed (a kill, a full disk), a .pruned_step_N
    one a removal that never completed (a kill while pruning): never resumed, and the space they
    hold may be what the next save needs. Their writer is gone (this process holds the run's lock),
    so they are removed, and said so."""
    for p in sorted(glob.glob(os.path.join(glob.escape(run_dir), ".tmp_step_*"))):
        shutil.rmtree(p, ignore_errors=True)
        print(f"removed {p}: a checkpoint whose writing never completed")
    for p in remove_pruned(run_dir, ignore_errors=True):
        print(f"removed {p}: a checkpoint whose removal (--keep-checkpoints) never completed")


def report_unlisted_checkpoints(run_dir: str):
    """A step_N folder without a manifest is no checkpoint to resume or prune (written before
    manifests, half deleted by a version that deleted in place, or being copied in): left alone,
    and said so."""
    for _, p in step_folders(run_dir):
        if os.path.isdir(p) and not os.path.exists(os.path.join(p, MANIFEST)):
            print(f"{p} has no {MANIFEST}: no checkpoint (never resumed or pruned); delete it if "
                  "it is a partial copy or one cut short while being deleted")


PRUNED = ".pruned_"  # .pruned_step_N: a checkpoint being removed by prune_checkpoints


def prune_checkpoints(run_dir: str, keep: int):
    """All but the newest `keep` complete checkpoints removed (0: keep all). Each is renamed to
    .pruned_step_N first (one atomic step) and only then deleted: a kill in the middle leaves a
    .pruned_ folder, which the next prune (or the next run's start) finishes removing, never a
    step_N without its manifest that no prune would touch again. Only names a prune gave are
    removed: a save in progress writes .tmp_step_N, and a step_N without a manifest stays."""
    done = [(n, p) for n, p in step_folders(run_dir) if is_checkpoint(p)]
    for _, old in done[:-keep] if keep else []:
        gone = os.path.join(run_dir, PRUNED + os.path.basename(old))
        if os.path.exists(gone):  # an earlier removal of the same step, cut short
            shutil.rmtree(gone)
        os.rename(old, gone)
    remove_pruned(run_dir)


def remove_pruned(run_dir: str, ignore_errors: bool = False) -> list[str]:
    """Delete the .pruned_step_N folders of run_dir (prune_checkpoints); returns them."""
    found = sorted(glob.glob(os.path.join(glob.escape(run_dir), PRUNED + "step_*")))
    for p in found:
        shutil.rmtree(p, ignore_errors=ignore_errors)
    return found


def set_aside_later_checkpoints(run_dir: str, step: int):
    """A run resumed from step_k (an earlier one than the newest, say, or the one before a damaged
    newest that --resume auto skips) goes on from there: the checkpoints after step k belong to the
    run it branches from, and so does its final/ (--save-final model's export of its last step,
    which no step_N follows). They are moved into one new abandoned_<time> folder, so that pruning
    (--keep-checkpoints) and --resume auto never take them for this run's, nor this run's final/
    replaces that one, and with them what that run logged after step k (set_aside_logs), which
    this run's Logger then cuts from the run folder; said so, nothing deleted. The logs go first: a
    kill in between leaves the checkpoints in place, to be set aside again on the next resume (the
    logs twice, never lost)."""
    later = [(n, p) for n, p in step_folders(run_dir) if n > step]
    if os.path.isdir(os.path.join(run_dir, FINAL)):  # written at the last step: later than step_k
        later.append((None, os.path.join(run_dir, FINAL)))
    if not later:
        return
    stamp = os.path.join(run_dir, f"abandoned_{time.strftime('%Y%m%d_%H%M%S')}")
    aside, i = stamp, 1
    while True:  # a new folder: two branchings in one second keep apart
        try:
            os.mkdir(aside)
            break
        except FileExistsError:
            i += 1
            aside = f"{stamp}_{i}"
    logs = set_aside_logs(run_dir, aside, step)
    for _, p in later:
        os.rename(p, os.path.join(aside, os.path.basename(p)))
    print(f"resuming from step {step}: the later checkpoints of the run that went on from it "
          f"({', '.join(os.path.basename(p) for _, p in later)})"
          + (f", with {logs}," if logs else "")
          + f" are moved to {aside}; delete it when you no longer need them")


# the Logger's rows, one JSON object a line with "step"
LOGS = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")
EVENTS = "events.out.tfevents."  # tensorboard's event files (SummaryWriter names them so)


def set_aside_logs(run_dir: str, aside: str, step: int) -> str:
    """What a run logged after step, into aside: the rows of metrics.jsonl and samples.jsonl whose
    step is later, as they were written (lines a reader opens as the run folder's), and the run's
    tensorboard event files as they are (a new run's SummaryWriter writes a file of its own, and
    purges the later steps only from what it shows: in aside, `tensorboard --logdir` shows the
    abandoned run whole). Returns what was moved, in words ('' for nothing)."""
    moved = []
    for name in LOGS:
        try:
            with open(os.path.join(run_dir, name)) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            continue
        later = []
        for line in lines:
            try:
                row = json.loads(line, parse_constant=lambda c: None)
            except ValueError:  # a torn or damaged line: left where it is (the Logger says so)
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
                later.append(line + "\n")
        if later:
            with open(os.path.join(aside, name), "w") as f:
                f.writelines(later)
                f.flush()
                os.fsync(f.fileno())
            moved.append(name)
    events = sorted(e for e in os.listdir(run_dir) if e.startswith(EVENTS)
                    and os.path.isfile(os.path.join(run_dir, e)))
    for e in events:  # a link where the file system has them (never written again), else a copy
        src, dst = os.path.join(run_dir, e), os.path.join(aside, e)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    rows = f"the {' and '.join(moved)} rows after step {step}" if moved else ""
    return " and ".join(w for w in (rows, "the tensorboard event files" if events else "") if w)


def release_run_dir():
    """Let go of the run folder's locks (the end of a run; process exit does the same)."""
    _fresh.clear()
    _held.clear()
    while _run_lock:
        os.close(_run_lock.pop())


# what a fresh run folder holds before the run logs its first row (the rest is the run's work)
SET_UP_FILES = ("writer.lock", "args.json", "metrics.jsonl", "events.out.tfevents.")


def remove_unused_run_dir():
    """A run that stops (fail, an exception, a signal during start-up) after it made its fresh
    folder and before it logged a row or saved a checkpoint leaves no folder behind: a folder of
    nothing but its set-up files (SET_UP_FILES, metrics.jsonl empty) is removed. Called by
    distributed.fail and at exit; a resumed run's folder is never touched."""
    if not _fresh:
        return
    run_dir = _fresh.pop()
    try:
        names = os.listdir(run_dir)
        used = any(not n.startswith(SET_UP_FILES) for n in names) or (
            "metrics.jsonl" in names and os.path.getsize(os.path.join(run_dir, "metrics.jsonl")))
    except OSError:
        return
    replaced = gone_or_replaced(run_dir, run_dir) is not None  # another folder under its name now
    release_run_dir()
    if not used and not replaced:
        shutil.rmtree(run_dir, ignore_errors=True)


ON_FAIL.append(remove_unused_run_dir)
atexit.register(remove_unused_run_dir)  # an exception or SystemExit that fail() did not raise


def gone_line(run_dir: str, what: str) -> str:
    """The run folder deleted or moved while the run writes it."""
    return (f"the run folder {run_dir} is gone (deleted or moved while the run wrote it) while "
            f"writing {what}: nothing more can be logged or saved there; start the run again")


def gone_or_replaced(run_dir: str, what: str) -> str | None:
    """None while run_dir is the folder this process locked (by identity: device and inode, not by
    name); else the one line that stops the run: the folder is gone, or another was made under its
    name (`mv R R.old; mkdir R`), whose writes would mix with this run's and whose lock no one holds.
    """
    try:
        now = os.stat(run_dir)
    except OSError:
        return gone_line(run_dir, what)
    held = _held.get(os.path.normpath(run_dir))
    if held is None:
        return None
    then = os.fstat(held)
    if (now.st_dev, now.st_ino) == (then.st_dev, then.st_ino):
        return None
    try:  # where the folder this run started in is now (Linux names it)
        moved = os.readlink(f"/proc/self/fd/{held}")
        moved = f" (it is now {moved})" if not moved.endswith(" (deleted)") else ""
    except OSError:
        moved = ""
    return (f"the run folder {run_dir} was replaced while the run wrote it (moved away and another "
            f"made under its name) while writing {what}: this run stops so that no two runs mix in "
            f"one folder; its rows and checkpoints are in the folder it locked{moved}: move it "
            "back and continue with --resume auto")
