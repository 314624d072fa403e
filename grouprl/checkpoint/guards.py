"""Write guards: a save's or a log's write that fails (a full disk, the file size limit, the run
folder deleted or replaced) stops every rank with one line saying what to do, never a traceback
or a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import traceback

import torch.distributed as dist

from ..distributed import Dist, fail
from .manifest import is_checkpoint, step_folders
from .run_dir import gone_or_replaced


# What a short write looks like where the error is not an OSError: torch.save's zip writer, and
# safetensors' Rust writer.
_NO_SPACE = ("unexpected pos", "No space left", "os error 28", "StorageFull", "Disk quota")


def _attempt(write, folder: str) -> str | None:
    """write(), or the one line that says why it failed: a full disk (ENOSPC, EDQUOT, or a short
    write that torch or safetensors report in their own words) names the disk; a run folder
    deleted mid-run is said (and not made again by the save's makedirs)."""
    if (gone := gone_or_replaced(os.path.dirname(folder), folder)) is not None:
        return gone
    try:
        write()
        return None
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others would wait
        if (gone := gone_or_replaced(os.path.dirname(folder), folder)) is not None:
            return gone  # the run folder deleted or replaced mid-run
        short = any(s in str(e) for s in _NO_SPACE)  # a short write, in torch's or Rust's words
        if isinstance(e, OSError) and e.errno == errno.EFBIG or short and file_size_limit():
            return file_size_line(folder)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or short:
            return no_space_line(folder)
        if not isinstance(e, OSError):
            traceback.print_exc()
        return f"cannot write the checkpoint {folder} (removed): {type(e).__name__}: {e}"


def file_size_limit() -> int | None:
    """The largest file this process may write (ulimit -f, RLIMIT_FSIZE) in bytes; None: no limit."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def then_what(run_dir: str) -> str:
    """How to go on once the cause is fixed: from the run's last checkpoint, when it has one."""
    if any(is_checkpoint(p) for _, p in step_folders(run_dir)):
        return "continue with --resume auto from the previous checkpoint"
    return "start the run again (it has no checkpoint to continue from)"


def file_size_line(folder: str, removed: bool = True) -> str:
    """A write past the file size limit (ulimit -f): not a full disk."""
    limit = file_size_limit()
    said = f"the file size limit (ulimit -f: {limit:,} bytes)" if limit else "the file size limit"
    return (f"writing {folder}{' (removed)' if removed else ''} went past {said}: raise it "
            f"(ulimit -f unlimited), then {then_what(os.path.dirname(folder))}")


def no_space_line(folder: str, removed: bool = True) -> str:
    """No space left on the disk holding folder: which disk, how much is free, what to do."""
    mount = os.path.abspath(folder)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        free = f"{shutil.disk_usage(mount).free / 2**30:.1f} GiB free"
    except OSError:
        free = "free space unknown"
    return (f"no space left on the disk mounted at {mount} ({free}) while writing {folder}"
            f"{' (removed)' if removed else ''}: free space there, then "
            f"{then_what(os.path.dirname(folder))}")


@contextlib.contextmanager
def writing(run_dir: str, path: str):
    """Around a write of the logs (metrics.jsonl, samples.jsonl) into run_dir: a run folder that is
    gone, or a write that fails (a full disk), stops the run with the save's one line, not a
    traceback (a deleted folder's open metrics.jsonl would take every later row without an
    error)."""
    if (gone := gone_or_replaced(run_dir, path)) is not None:
        fail(gone)
    try:
        yield
    except OSError as e:
        if (gone := gone_or_replaced(run_dir, path)) is not None:
            fail(gone)
        if e.errno == errno.EFBIG:
            fail(file_size_line(path, removed=False))
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fail(no_space_line(path, removed=False))
        fail(f"cannot write {path} ({e.strerror or e}): the run stops here; continue with "
             "--resume auto from its last checkpoint once it can be written")


def _or_stop(err: str | None, tmp: str, dist_env: Dist):
    """Every rank learns of any rank's failed write (the first one's line); then the partial folder
    is removed and every rank stops with that line."""
    errs = [err]
    if dist_env.world > 1:
        errs = [None] * dist_env.world
        dist.all_gather_object(errs, err)
    err = next((e for e in errs if e is not None), None)
    if err is None:
        return
    if dist_env.main:
        shutil.rmtree(tmp, ignore_errors=True)
    fail(err)
