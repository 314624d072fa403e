"""Run folders, checkpoints and exact resume: claiming a run folder, saving and verifying step_N,
restoring a run's state, graceful stop on SIGTERM/SIGINT, and a run's end. Called by the scripts.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from .distributed import (ON_FAIL, Dist, Refused, all_reduce, barrier, fail, main_process,
                          on_rank0, seed_rank)
from .lora import is_lora, save_lora


# -------------------- checkpoints and exact resume
# {run_dir}/step_N holds model/ (the bf16 export from_pretrained loads), state/ (fp32 master weights,
# rank{r}.pt: each rank's optimizer shard, lr schedule and RNG states, trainer_state.json) or, under
# LoRA, adapter/, and manifest.json (written last: every file's size, the small ones' sha256). It is
# written as .tmp_step_N and renamed when complete; resume checks the manifest, on any world size.
# The whole layout and its guarantees: docs/checkpoints.md.
STEP_DIR = re.compile(r"step_(\d+)$")
MANIFEST = "manifest.json"
MODEL, STATE = "model", "state"
# a folder from_pretrained can read a tokenizer from holds one of these (model_folder_problem)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "spiece.model", "vocab.txt"}
HASH_BELOW = 16 << 20  # bytes: smaller files are hashed (trainer_state, configs, tokenizer)
MASTERS = "masters_rank{}.safetensors"  # FSDP2: rank r's rows of the fp32 master weights
BUFFER = "buffer:"  # rank 0's masters file also holds the buffers (rotary inv_freq), so prefixed


def step_folders(run_dir: str) -> list[tuple[int, str]]:
    """The run's step_N folders as (N, path), oldest first, complete or not."""
    return sorted((int(m[1]), p) for p in glob.glob(os.path.join(glob.escape(run_dir), "step_*"))
                  if (m := STEP_DIR.search(p)))


def is_checkpoint(path: str) -> bool:
    """A step_N folder with its manifest: complete when written (verify_checkpoint says whether it
    still is)."""
    return bool(STEP_DIR.match(os.path.basename(os.path.normpath(path)))) and os.path.isfile(
        os.path.join(path, MANIFEST))


def weights_file_problem(path: str) -> str | None:
    """Why a weights file cannot be loaded, from its header alone (no weight is read; the 16 bytes
    to a few MB of a header at any model size), or None: a safetensors file whose header length,
    header JSON or tensors' extent do not match its size (a truncated file, a damaged header); a
    torch.save zip (.pt, .bin) whose central directory, at its end, does not read. A same-size
    change inside the tensors is not seen (see the manifest's hashes above)."""
    import zipfile

    size = os.path.getsize(path)
    if path.endswith(".safetensors"):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"its safetensors header claims {n} bytes, the file has {size}"
            try:
                header = json.loads(f.read(n))
                end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"],
                          default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                return "its safetensors header is not the JSON safetensors writes (damaged)"
        if 8 + n + end != size:
            return f"its tensors end at byte {8 + n + end}, the file has {size} (truncated)"
    elif path.endswith((".pt", ".bin", ".pth")):
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"  # torch.save's zip (older torch: a pickle, not checked)
        if zipped:
            try:
                zipfile.ZipFile(path).close()  # reads the central directory
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                return f"its zip (torch.save's format) does not read ({e})"
            try:  # the pickle's globals, read without running it (no tensor is read)
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:  # noqa: BLE001 - torch.load says the rest, as before
                unsafe = []
            if unsafe:
                return (f"its pickle calls {', '.join(unsafe[:3])}, which torch.load (weights_only) "
                        "refuses: such a file can run code when loaded; take weights in "
                        "safetensors from a source you trust")
    return None


def model_folder_problem(folder: str) -> str | None:
    """Why a local --model folder cannot be loaded, before any weight is read (None: it can): no
    tokenizer (step_N/state holds training weights only), or a weights file whose header says it is
    truncated or damaged (weights_file_problem)."""
    names = os.listdir(folder)
    if not set(names) & TOKENIZER_FILES:
        where = (f"; its checkpoint's {os.path.join(os.path.dirname(folder), MODEL)} has one"
                 if os.path.basename(os.path.normpath(folder)) == STATE else "")
        return (f"no tokenizer ({', '.join(sorted(TOKENIZER_FILES))}){where}: give a folder "
                "with the model's tokenizer, or copy its tokenizer files in")
    for name in sorted(names):
        problem = (weights_file_problem(os.path.join(folder, name))
                   if name.endswith((".safetensors", ".bin", ".pt", ".pth")) else None)
        if problem is not None:
            fix = "" if "can run code" in problem else "; copy or download it again"
            return f"{name}: {problem}{fix}"
    return None


def state_dir(ckpt: str) -> str:
    """The folder of a checkpoint's training state: step_N/state, or step_N itself in the flat
    layout of older checkpoints. load_model reads the master weights from it on resume."""
    state = os.path.join(ckpt, STATE)
    return state if os.path.isdir(state) else ckpt


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entry(path: str) -> list:
    """[bytes, sha256 or None]: only files below HASH_BELOW are hashed."""
    size = os.path.getsize(path)
    return [size, _sha256(path) if size < HASH_BELOW else None]


def _entries(folder: str, names: list[str], dist_env: Dist) -> dict:
    """{name: [bytes, sha256 or None]} of files in folder, each rank hashing its share of the small
    ones (names: the same on every rank)."""
    mine = {}
    for name in names[dist_env.rank::dist_env.world]:
        try:
            mine[name] = _entry(os.path.join(folder, name))
        except OSError as e:
            mine[name] = [-1, f"{type(e).__name__}: {e}"]
    if dist_env.world > 1:
        parts = [None] * dist_env.world
        dist.all_gather_object(parts, mine)
        mine = {k: v for part in parts for k, v in part.items()}
    return mine


def _manifest_files(folder: str, dist_env: Dist) -> dict:
    """What manifest.json lists for folder: every file in it (rank 0 lists them), collectively."""
    barrier()
    names = [None]
    if dist_env.main:
        names = [sorted(os.path.relpath(os.path.join(root, f), folder)
                        for root, _, files in os.walk(folder)
                        for f in files if f != MANIFEST)]
    if dist_env.world > 1:
        dist.broadcast_object_list(names, src=0)
    return _entries(folder, names[0], dist_env)


def _write_manifest_file(folder: str, files: dict):
    with open(os.path.join(folder, MANIFEST + ".tmp"), "w") as f:
        json.dump({"files": files}, f, indent=1)
    os.replace(os.path.join(folder, MANIFEST + ".tmp"), os.path.join(folder, MANIFEST))


def write_manifest(folder: str, dist_env: Dist | None = None):
    """manifest.json: the size of every other file in folder and the sha256 of the small ones
    (ranks hash in parallel), written last, whole."""
    dist_env = dist_env or Dist(0, 1, torch.device("cpu"))
    files = _manifest_files(folder, dist_env)
    if dist_env.main:
        _write_manifest_file(folder, files)
    barrier()


def _check_listed(ckpt: str, files: dict) -> str | None:
    """Why the files a manifest lists are not there as written (None: they are): a listed file
    missing or of another size. A manifest that lists nothing, or not the training state, is no
    checkpoint's."""
    if not isinstance(files, dict):
        return (f"{MANIFEST}'s 'files' is a {type(files).__name__}, not an object "
                "{path: [size in bytes, sha256 or null]} (not written by a save)")
    if not files:
        return f"{MANIFEST} lists no files (not written by a complete save)"
    for name, entry in files.items():
        if not name or os.path.isabs(name) or ".." in name.split("/"):
            return (f"{MANIFEST}: the entry {name!r} is not a path inside the checkpoint folder "
                    "(damaged, or not written by a save)")
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                and entry[0] >= 0 and (entry[1] is None or isinstance(entry[1], str))):
            return (f"{MANIFEST}: the entry of {name!r} is {json.dumps(entry)[:60]}, not "
                    "[size in bytes, sha256 or null] (damaged, or not written by a save)")
    state = "trainer_state.json" if "trainer_state.json" in files else f"{STATE}/trainer_state.json"
    if state not in files:
        return f"{MANIFEST} does not list {STATE}/trainer_state.json (not a checkpoint's manifest)"
    for name, (size, _) in files.items():
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, the manifest says {size}"
    for name in files:  # a damaged header of a big file, which no hash covers: headers only
        problem = weights_file_problem(os.path.join(ckpt, name))
        if problem is not None:
            return f"{name}: {problem}"
    return None


def verify_checkpoint(ckpt: str, dist_env: Dist) -> str | None:
    """None when every file the manifest lists has its size, and the small ones their sha256; else
    why not, in a few words, the same answer on every rank (rank 0 reads the manifest and the sizes,
    then the ranks hash a share of the small files each). Big files are not reread: sizes and the
    manifest (written last, once every rank is done) are what says a save completed."""
    out = [None, []]  # (reason, files to hash)
    if dist_env.main:
        try:
            with open(os.path.join(ckpt, MANIFEST)) as f:
                manifest = json.load(f)
            if not isinstance(manifest, dict) or "files" not in manifest:
                raise ValueError("not an object {\"files\": {path: [size in bytes, sha256 or "
                                 "null]}}")
            files = manifest["files"]
            out[0] = _check_listed(ckpt, files)
            # older manifests hash every file: only the small ones are reread
            out[1] = [] if out[0] else sorted(name for name, (size, digest) in files.items()
                                              if digest is not None and size < HASH_BELOW)
        except FileNotFoundError:
            out[0] = f"no {MANIFEST} (written before manifests, or never completed)"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out[0] = f"{MANIFEST} cannot be read ({type(e).__name__}: {e})"
    if dist_env.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[0] is not None:
        return out[0]
    found = _entries(ckpt, out[1], dist_env)
    bad = [None]
    if dist_env.main:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            wanted = json.load(f)["files"]
        mismatched = [name for name in out[1] if found[name][1] != wanted[name][1]]
        bad = [f"{mismatched[0]} does not match its sha256 in the manifest" if mismatched else None]
    if dist_env.world > 1:
        dist.broadcast_object_list(bad, src=0)
    return bad[0]


def run_paths(args, dist_env: Dist, script: str) -> tuple[str, str | None]:
    """The run folder and the checkpoint to resume from (None: a fresh run). --resume auto takes the
    newest complete checkpoint of this exp_name and seed under --output-dir, or starts a fresh run
    when there is none, so the same command serves the first launch and every torchrun restart. Rank
    0 lists the checkpoints and names a fresh run folder; every rank then reads the same files and
    reaches the same verdict, so an error stops all ranks at once."""
    listed = [None, None]  # (candidate checkpoints, newest first; a fresh run's folder)
    if dist_env.main:
        candidates = [args.resume] if args.resume not in (None, "auto") else []
        if args.resume == "auto":
            runs = own_runs(args.output_dir, args.exp_name, args.seed)
            # (run's unix time, step)
            found = sorted((t, n, p) for t, run in runs for n, p in step_folders(run))
            candidates = [p for _, _, p in reversed(found)]
        fresh = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}")
        listed = [[os.path.normpath(p) for p in candidates], fresh]
    if dist_env.world > 1:
        dist.broadcast_object_list(listed, src=0)
    candidates, fresh = listed
    ckpt = None
    for path in candidates:  # the newest that verifies
        reason = verify_checkpoint(path, dist_env)
        if reason is None:
            ckpt = path
            break
        if args.resume != "auto":
            fail(f"--resume {path}: {reason}; resume from another checkpoint (or --resume auto)")
        if dist_env.main:
            print(f"--resume auto: skipping {path}: {reason}")
    if args.resume == "auto" and ckpt is None and dist_env.main:
        print(f"--resume auto: no checkpoint of {args.exp_name}__{args.seed}__<time> under "
              f"{args.output_dir}, starting a fresh run")
    step = 0
    if ckpt:
        state = read_trainer_state(ckpt)
        if state["script"] != script:
            fail(f"{ckpt} was written by {state['script']}, not {script}: resume it with that "
                 "script")
        step = state["step"]
        then, now = state.get("args", {}), vars(args)
        for name in RESUME_FIXED:
            if name in then and then[name] != now[name]:
                fail(f"--{name.replace('_', '-')} {now[name]} differs from {then[name]} in {ckpt}: "
                     "it cannot change on resume (the data order, the objective, the optimizer "
                     f"state or the weights depend on it); pass {as_flag(name, then[name])} to "
                     "resume, or start a new run without --resume")
        changed = [f"--{k.replace('_', '-')} {then[k]} -> {v}" for k, v in now.items()
                   if k in then and then[k] != v and k != "resume"]
        if dist_env.main:
            print(f"resuming {ckpt} (step {step})")
            if changed:
                print(f"changed on resume, in effect from step {step + 1}: {', '.join(changed)}")
    if step >= args.num_steps:  # e.g. a restart after the last checkpoint was written
        if dist_env.main:
            print(f"{ckpt} is at step {step} and --num-steps is {args.num_steps}: nothing to do")
        cleanup()
        raise SystemExit(0)
    return (os.path.dirname(ckpt) if ckpt else fresh), ckpt


def own_runs(output_dir: str, exp_name: str, seed: int) -> list[tuple[int, str]]:
    """The run folders of exp_name and seed under output_dir as (unix time, path): exactly
    {exp_name}__{seed}__<digits>, so that --exp-name x never takes x__1__1__<time> (--exp-name
    x__1's run at seed 1) for its own run at seed 1 (cli.check_run_name refuses an --exp-name
    ending in __<digits>, whose folders a glob of x__1__* would mix with x's)."""
    name = re.compile(re.escape(f"{exp_name}__{seed}__") + r"(\d+)")
    try:
        entries = os.listdir(output_dir)
    except OSError:  # no --output-dir yet: no runs
        return []
    return sorted((int(m[1]), os.path.join(output_dir, e)) for e in entries
                  if (m := name.fullmatch(e)) and os.path.isdir(os.path.join(output_dir, e)))


# What a resumed run may not change: the data order (seed, prompts a rank, the data), the shape of a
# step (group size), the weights and optimizer state (model), and the objective (the script's loss
# flags and what shapes the advantages). World size and script are checked on their own; a name the
# checkpoint's script lacks is skipped.
RESUME_FIXED = ("seed", "model", "dataset", "data_files", "prompt_column", "answer_column",
                # with --eval-dataset no held-out split is taken from --dataset: other train rows
                "eval_dataset", "prompts_per_rank", "group_size",
                "clip_low", "clip_high", "scale_rewards", "adv_std", "adv_eps", "baseline",
                "mask_truncated",
                "truncated_reward_scale",
                "loss_agg", "kl_ratio_correction",
                "symmetric_clip", "kl_coef", "post_answer_penalty", "transform", "length_aware",
                "clip_gated", "stop_grad", "orth_floor", "lora_rank", "lora_alpha",
                "lora_target_modules", "luspo", "delta", "tau_pos", "tau_neg", "k_pos", "lambda_pos",
                "k_neg", "lambda_neg", "top_entropy_quantile", "multi_objective_aggregation",
                "min_new_tokens")


def restated(argv: list[str], names: set[str]) -> set[str]:
    """The flags the command line gives (--flag, --flag=x, --flag_name, --no-flag), by field name."""
    said = set()
    for word in argv:
        name = word[2:].partition("=")[0].replace("-", "_") if word.startswith("--") else ""
        said.add(name[3:] if name not in names and name.startswith("no_") else name)
    return said & names


def saved_flags(args, argv: list[str]) -> dict:
    """A plain --resume step_N continues the run as it was: every flag the command line does not
    restate takes the value the run saved (trainer_state.json's args), not its default, so that
    --keep-checkpoints 0 stays 0 and no checkpoint the run was keeping is pruned. {} for a fresh
    run, --resume auto (the same command line again) or a checkpoint that cannot be read (then
    run_paths says why)."""
    if getattr(args, "resume", None) in (None, "auto"):
        return {}
    try:
        with open(os.path.join(state_dir(args.resume), "trainer_state.json")) as f:
            then = json.load(f).get("args")
    except (OSError, ValueError, AttributeError):
        return {}
    now = vars(args)
    if not isinstance(then, dict):
        return {}
    keep = restated(argv, set(now)) | {"resume", "output_dir"}  # the run folder is the checkpoint's
    return {k: tuple(v) if isinstance(now[k], tuple) and isinstance(v, list) else v
            for k, v in then.items() if k in now and k not in keep and v != now[k]}


def as_flag(name: str, value) -> str:
    """The command-line words that set flag `name` to `value` (tyro's spelling of booleans)."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def read_trainer_state(ckpt: str) -> dict:
    """A checkpoint's trainer_state.json, or one line saying why it cannot be read: a field of the
    wrong type or out of range (an edited file, its manifest re-hashed) is said, never resumed."""
    path = os.path.join(state_dir(ckpt), "trainer_state.json")
    try:
        with open(path) as f:
            state = json.load(f, parse_constant=lambda c: None)
        missing = [k for k in ("step", "world", "script") if k not in state]
    except (OSError, ValueError, TypeError) as e:
        fail(f"{path}: cannot read it ({type(e).__name__}: {e}); resume from another checkpoint")
    if missing:
        fail(f"{path} has no {missing}: resume from another checkpoint")
    bad = state_problem(state, STEP_DIR.search(os.path.normpath(ckpt)))
    if bad:
        fail(f"{path}: {bad}: the file was edited or damaged; resume from another checkpoint")
    return state


def _count(x, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def state_problem(state: dict, folder: re.Match | None) -> str | None:
    """What is wrong with a trainer_state.json's fields (type, range, the step its step_N folder
    names), in words; None when nothing is."""
    step = state["step"]
    checks = [
        ("step", _count(step, 0), "a whole number >= 0"),
        ("world", _count(state["world"], 1), "a whole number >= 1"),
        ("script", isinstance(state["script"], str) and state["script"].endswith(".py"),
         "a script's file name"),
        ("args", isinstance(state.get("args", {}), dict), "the run's flags by name"),
        ("reward_curve", isinstance(state.get("reward_curve", []), list)
         and all(r is None or _number(r) for r in state.get("reward_curve", [])),
         "a list of rewards"),
        ("nonfinite_run", _count(state.get("nonfinite_run", 0), 0), "a whole number >= 0"),
        ("wall_time", _number(state.get("wall_time", 0.0)) and state.get("wall_time", 0.0) >= 0,
         "seconds >= 0")]
    for name, ok, what in checks:
        if not ok:
            return f"{name} is {state.get(name)!r}, not {what}"
    if folder and step != int(folder[1]):
        return f"step is {step!r}, not {folder[1]} as its folder {folder[0]} says"
    return None


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
    run it branches from. They are moved into one new abandoned_<time> folder, so that pruning
    (--keep-checkpoints) and --resume auto never take them for this run's, and with them what that
    run logged after step k (set_aside_logs), which this run's Logger then cuts from the run folder;
    said so, nothing deleted. The logs go first: a kill in between leaves the checkpoints in place,
    to be set aside again on the next resume (the logs twice, never lost)."""
    later = [(n, p) for n, p in step_folders(run_dir) if n > step]
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


def _rng_state(dist_env: Dist) -> dict:
    py, npy = random.getstate(), np.random.get_state()
    return {"python": py, "numpy": (npy[0], npy[1].tolist(), *npy[2:]),
            "torch": torch.get_rng_state(),
            "cuda": (torch.cuda.get_rng_state(dist_env.device) if dist_env.device.type == "cuda"
                     else None)}


def _set_rng_state(s: dict, dist_env: Dist):
    random.setstate(s["python"])
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]))
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None:
        torch.cuda.set_rng_state(s["cuda"], dist_env.device)


def resume_state(ckpt: str | None, optimizer, scheduler, dist_env: Dist) -> dict:
    """Restore optimizer, lr schedule and this rank's RNG states from `ckpt` and return the loop's
    state (step, reward curve, non-finite run, wall time); a fresh run's state when ckpt is None.
    The data position is a pure function of the step (prompt_indices), so the step restores it.
    On the world size that wrote it, each rank reads its own rank{r}.pt (bitwise); on another, the
    optimizer state is resharded from every old rank's file (_resharded, exact) and the RNGs are
    re-seeded (the weights come whole from state/ and are sharded anew by wrap_policy)."""
    if ckpt is None:
        return {"step": 0, "reward_curve": [], "nonfinite_run": 0, "wall_time": 0.0}
    state = read_trainer_state(ckpt)
    same_world = state["world"] == dist_env.world
    if same_world:  # this rank's own file: bitwise what it held
        blob = torch.load(os.path.join(state_dir(ckpt), f"rank{dist_env.rank}.pt"),
                          map_location="cpu", weights_only=True)
    else:
        blob = _resharded(state_dir(ckpt), state["world"], optimizer, dist_env)
    # this run's
    flags = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(blob["optimizer"])
    # the moments are restored, the flags are this run's: --learning-rate, --weight-decay changed on
    # resume take effect
    for group, hyper in zip(optimizer.param_groups, flags):
        group.update(hyper)
    from torch.distributed.tensor import DTensor

    # FSDP2: this rank's shards back into DTensors laid out like the parameter
    for p, s in optimizer.state.items():
        for k, v in s.items():
            if (isinstance(p, DTensor) and not isinstance(v, DTensor)
                    and v.shape == p.to_local().shape):
                s[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                          shape=p.shape, stride=p.stride(), run_check=False)
    base_lrs = scheduler.base_lrs  # this run's --learning-rate
    # the position in the schedule; its shape is this run's flags
    scheduler.load_state_dict(blob["scheduler"])
    scheduler.base_lrs = base_lrs
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        # as LambdaLR computes it: bitwise the same when unchanged
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if same_world:
        _set_rng_state(blob["rng"], dist_env)
    else:  # no rank's RNG states carry over one-to-one: each rank's drawn from (seed, step, rank)
        seed_rank(state.get("args", {}).get("seed", 0) + state["step"], dist_env)
        if dist_env.main:
            print(f"{ckpt} was written by {state['world']} rank(s), this run has "
                  f"{dist_env.world}: the optimizer state is resharded (exact), each rank's RNG "
                  f"re-seeded from (seed, step {state['step']}, rank), and the data split over "
                  "ranks is this run's")
    return state


def _resharded(folder: str, old_world: int, optimizer, dist_env: Dist) -> dict:
    """A rank{r}.pt blob for this rank of a new world size, from the old world's files: every
    moment is the old ranks' shards concatenated along dim 0 (FSDP2's Shard(0): rank r holds rows
    [r*c, r*c + its length) of the full tensor, c = ceil(rows / world), the last ranks fewer or
    none), of which this rank takes the rows its parameter holds now. The old files are memory
    mapped, so a rank reads only the rows it takes. The lr schedule, the param groups and AdamW's
    step count are the same on every rank: rank 0's."""
    blobs = [torch.load(os.path.join(folder, f"rank{r}.pt"), map_location="cpu",
                        weights_only=True, mmap=True) for r in range(old_world)]
    blob = blobs[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, s in blob["optimizer"]["state"].items():
        p = params[i]
        start, length = _local_rows(p)
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # a moment, laid out like p
                shards = [b["optimizer"]["state"][i][k] for b in blobs]
                if (sum(t.shape[0] for t in shards) != p.shape[0]
                        or any(t.shape[1:] != p.shape[1:] for t in shards)):
                    fail(f"{folder}: the optimizer state {k} of parameter {i} has shards "
                         f"{[tuple(t.shape) for t in shards]}, which do not make its shape "
                         f"{tuple(p.shape)}: resume from another checkpoint")
                s[k] = reshard_rows(shards, start, length)
    return blob


def _local_rows(p) -> tuple[int, int]:
    """(first row, rows) of the full parameter that this rank holds: FSDP2 lays a parameter out as
    torch.chunk along dim 0 (Shard(0)); a plain tensor (one process) holds them all."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    if tuple(p.placements) != (Shard(0),):
        fail(f"resharding the optimizer state supports FSDP2's Shard(0) on one mesh dimension, "
             f"not {p.placements}: resume with the world size that wrote the checkpoint")
    rows, world = p.shape[0], p.device_mesh.size()
    chunk = -(-rows // world)
    return min(p.device_mesh.get_local_rank() * chunk, rows), p.to_local().shape[0]


def row_pieces(rows: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """Where rows [start, start + length) of shards laid end to end (rows[i] rows in shard i) lie:
    (shard, first row, end row) in each shard's own rows, in order."""
    pieces, offset = [], 0
    for i, n in enumerate(rows):
        lo, hi = max(start, offset), min(start + length, offset + n)
        if lo < hi:
            pieces.append((i, lo - offset, hi - offset))
        offset += n
    return pieces


def reshard_rows(shards: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Rows [start, start + length) of torch.cat(shards), reading only the shards' rows in that
    range (the shards may be memory mapped); a new tensor."""
    pieces = row_pieces([t.shape[0] for t in shards], start, length)
    out = [shards[i][lo:hi] for i, lo, hi in pieces]
    if not out:  # this rank holds none of the rows (FSDP2's last ranks of a short parameter)
        return shards[0].new_empty((0, *shards[0].shape[1:]))
    return torch.cat(out) if len(out) > 1 else out[0].clone()


def save_checkpoint(run_dir: str, step: int, policy, tok, optimizer, scheduler, dist_env: Dist,
                    args, script: str, **loop_state):
    """Write {run_dir}/step_{step} (see above; trainer_state.json holds the run's flags too)
    atomically, then delete all but the newest --keep-checkpoints (0: keep all).
    One process writes it all. Under FSDP2 every rank writes its rows of the master weights
    (write_masters) and its optimizer shard (write_training_state), in parallel; the export is
    gathered to rank 0 one tensor at a time, already in bf16 (full_state_dict), and written there
    (under LoRA the full fp32 state dict, which the merge needs). A write that fails on any rank (a
    full disk) stops every rank with one line, the partial .tmp_step_N removed: the previous
    checkpoints stay what --resume auto takes. The last step with --save-final model (no stop
    signal): {run_dir}/final/ with model/ (and adapter/) alone, no training state. The end's save
    says its size."""
    lora = is_lora(policy.lm)
    if dist_env.sharded:  # every parameter as its shard (a unit left gathered: written whole)
        from torch.distributed.fsdp import FSDPModule

        for m in policy.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    if dist_env.sharded and lora:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(policy.lm,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif dist_env.sharded:
        # rank 0: the export's; None elsewhere
        sd = full_state_dict(policy.lm, dist_env, torch.bfloat16)
    else:
        sd = None  # one process: the model's own tensors
    path, tmp = os.path.join(run_dir, f"step_{step}"), os.path.join(run_dir, f".tmp_step_{step}")
    last = step == getattr(args, "num_steps", None)  # (tools pass a few flags only)
    final = last or _stop["signal"] is not None
    if last and getattr(args, "save_final", "full") == "model" and _stop["signal"] is None:
        path, tmp = os.path.join(run_dir, FINAL), os.path.join(run_dir, f".tmp_{FINAL}")
        _or_stop(_attempt(lambda: _export(tmp, policy, tok, sd, lora), tmp)
                 if dist_env.main else None, tmp, dist_env)
        if dist_env.main:
            _swap_in(tmp, path)
            print(_size_line(path))
        barrier()
        return path

    def export():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
        os.makedirs(os.path.join(tmp, STATE))
        if lora:  # model/: merged, in bf16; adapter/: the fp32 adapters (lora.py)
            save_lora(policy.lm, os.path.join(tmp, MODEL), tmp, sd)
            tok.save_pretrained(os.path.join(tmp, MODEL))
        else:
            write_model(os.path.join(tmp, MODEL), policy.lm, sd, tok)
            if not dist_env.sharded:  # the master weights, as held
                _save_pretrained(policy.lm, os.path.join(tmp, STATE), None)

    def training_state():  # every rank, once rank 0 has made the folder
        if dist_env.sharded and not lora:
            write_masters(os.path.join(tmp, STATE), policy.lm, dist_env)
        write_training_state(os.path.join(tmp, STATE), optimizer, scheduler, dist_env)

    def trainer_state():
        with open(os.path.join(tmp, STATE, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "world": dist_env.world, "script": script, "args": vars(args),
                       **loop_state}, f)

    _or_stop(_attempt(export, tmp) if dist_env.main else None, tmp, dist_env)
    sd = None  # the export's full copy freed before the training state is written
    _or_stop(_attempt(training_state, tmp), tmp, dist_env)
    _or_stop(_attempt(trainer_state, tmp) if dist_env.main else None, tmp, dist_env)
    files = _manifest_files(tmp, dist_env)  # last: a folder without it is incomplete
    _or_stop(_attempt(lambda: _write_manifest_file(tmp, files), tmp) if dist_env.main else None,
             tmp, dist_env)
    if dist_env.main:
        if os.path.exists(path):  # the same step written again: swap, then delete the old copy
            os.rename(path, tmp + ".old")
        os.rename(tmp, path)
        if path in _saved:  # this run's own copy of the step; another's is kept (keep_aside)
            shutil.rmtree(tmp + ".old", ignore_errors=True)
        _saved.add(path)
        keep_aside(tmp + ".old", path)
        prune_checkpoints(run_dir, args.keep_checkpoints)
        if final:
            print(_size_line(path))
    barrier()
    return path


FINAL = "final"  # --save-final model: {run_dir}/final/model (and adapter/), no training state


def _export(tmp: str, policy, tok, sd, lora: bool):
    """--save-final model's folder: the export alone (rank 0)."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if lora:
        save_lora(policy.lm, os.path.join(tmp, MODEL), tmp, sd)
        tok.save_pretrained(os.path.join(tmp, MODEL))
    else:
        write_model(os.path.join(tmp, MODEL), policy.lm, sd, tok)


def _swap_in(tmp: str, path: str):
    if os.path.exists(path):  # written again: swap, then delete the old copy
        os.rename(path, tmp + ".old")
    os.rename(tmp, path)
    shutil.rmtree(tmp + ".old", ignore_errors=True)


def _size_line(path: str) -> str:
    """'wrote runs/x/step_8: 1.81 GB (model/ 0.27 GB, the bf16 export; state/ 1.54 GB, ...)'."""
    def size(folder: str) -> str:
        n = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
                for f in files)
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"

    parts = [f"{MODEL}/ {size(os.path.join(path, MODEL))}, the bf16 export"]
    if os.path.isdir(os.path.join(path, STATE)):
        parts.append(f"{STATE}/ {size(os.path.join(path, STATE))}, what --resume reads "
                     "(--save-final model leaves it out)")
    return f"wrote {path}: {size(path)} ({'; '.join(parts)})"


_saved = set()  # the step_N folders this process wrote


def keep_aside(old: str, path: str):
    """A step_N that was there before this run wrote its own (never this run's: resume sets the
    later ones aside, so an edited trainer_state or a copy put there is the only way) is never
    written over: it is kept as kept_step_N_<time> beside it, and said so."""
    if not os.path.exists(old):
        return
    kept = os.path.join(os.path.dirname(path), f"kept_{os.path.basename(path)}_{int(time.time())}")
    os.rename(old, kept)
    print(f"{path} was there before this run wrote its own: the earlier one is kept as {kept}")


def full_state_dict(lm, dist_env: Dist, dtype: torch.dtype) -> dict | None:
    """FSDP2: the model's full state dict in dtype on rank 0's CPU (None on the other ranks), every
    rank taking part. One tensor at a time, each cast before its all-gather: in bf16 rank 0 holds
    half of an fp32 gather and the GPUs one full tensor at a time beside their shards. Tied weights
    (embed_tokens, lm_head) stay one tensor. With --cpu-offload the shards are moved to the GPU for
    the gather (NCCL gathers GPU tensors)."""
    from torch.distributed.tensor import DTensor

    owner = {name: id(p) for name, p in lm.named_parameters(remove_duplicate=False)}
    out, seen = {}, {}
    for name, v in lm.state_dict().items():
        key = owner.get(name, name)  # the same on every rank: each rank gathers the same tensors
        if key not in seen:
            if isinstance(v, DTensor):
                cast = v.to_local().to(dist_env.device, dtype if v.is_floating_point() else v.dtype)
                full = DTensor.from_local(cast, v.device_mesh, v.placements, shape=v.shape,
                                          stride=v.stride(), run_check=False).full_tensor()
            else:
                full = v.to(dtype) if v.is_floating_point() else v
            seen[key] = full.cpu() if dist_env.main else None
            del full
        if dist_env.main:
            out[name] = seen[key]
    return out if dist_env.main else None


def write_masters(folder: str, lm, dist_env: Dist):
    """FSDP2: this rank's rows of every fp32 master weight (its local shard of FSDP2's Shard(0))
    into folder/masters_rank{r}.safetensors, keyed by parameter name (tied weights once); rank 0
    adds the buffers and the config and generation config that resume builds the model from. No
    gather: the ranks write in parallel, each 1/world of the model."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    tensors = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
               for n, p in lm.named_parameters()}
    if dist_env.main:
        tensors.update({BUFFER + n: b.detach().cpu().contiguous() for n, b in lm.named_buffers()})
        lm.config.save_pretrained(folder)
        lm.generation_config.save_pretrained(folder)
    save_file(tensors, os.path.join(folder, MASTERS.format(dist_env.rank)),
              metadata={"rank": str(dist_env.rank), "world": str(dist_env.world)})


def masters_files(folder: str) -> list[str]:
    """The masters_rank{r}.safetensors of a checkpoint's state folder, rank 0 first; [] where the
    master weights are one save_pretrained model (one process, older checkpoints)."""
    files, r = [], 0
    while os.path.isfile(os.path.join(folder, MASTERS.format(r))):
        files.append(os.path.join(folder, MASTERS.format(r)))
        r += 1
    return files


def load_masters(lm, folder: str, dist_env: Dist):
    """Every parameter of lm (FSDP2: this rank's rows, its local shard; one process: all of them)
    from the masters_rank*.safetensors in folder, written by any number of ranks: the old shards'
    rows in order make the full tensor, of which only the rows this rank holds are read (bitwise
    its own file's on the world size that wrote them). The buffers come from rank 0's file."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    paths = masters_files(folder)
    with ExitStack() as stack, torch.no_grad():
        files = [stack.enter_context(safe_open(p, framework="pt")) for p in paths]
        for name, p in lm.named_parameters():
            if name not in files[0].keys():
                fail(f"{folder}: no master weight {name} in {os.path.basename(paths[0])}: the "
                     "checkpoint holds another model; resume it with its own --model")
            slices = [f.get_slice(name) for f in files]
            shapes = [s.get_shape() for s in slices]
            if (sum(s[0] for s in shapes) != p.shape[0]
                    or any(tuple(s[1:]) != tuple(p.shape[1:]) for s in shapes)):
                fail(f"{folder}: the master weight {name} has shards {shapes}, which do not make "
                     f"its shape {list(p.shape)}: resume from another checkpoint")
            local, at = p.to_local() if isinstance(p, DTensor) else p, 0
            for i, lo, hi in row_pieces([s[0] for s in shapes], *_local_rows(p)):
                local[at:at + hi - lo].copy_(slices[i][lo:hi])
                at += hi - lo
        for name, b in lm.named_buffers():
            if BUFFER + name not in files[0].keys():
                fail(f"{folder}: no buffer {name} in {os.path.basename(paths[0])} (written by "
                     "another transformers version?): resume from another checkpoint")
            b.copy_(files[0].get_tensor(BUFFER + name))


def master_weights(ckpt: str) -> dict[str, torch.Tensor]:
    """A checkpoint's fp32 master weights, whole, on the CPU: state/model.safetensors (one
    process), or every rank's rows put together (torchrun). For tests and tools."""
    from safetensors.torch import load_file

    folder = state_dir(ckpt)
    paths = masters_files(folder)
    if not paths:
        return load_file(os.path.join(folder, "model.safetensors"))
    shards = [load_file(p) for p in paths]
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0] if not k.startswith(BUFFER)}


def _save_pretrained(lm, folder: str, sd: dict | None):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar a save would break the training bar
    try:
        lm.save_pretrained(folder, state_dict=sd)
    finally:
        hf_logging.enable_progress_bar()


def write_model(folder: str, lm, sd: dict | None, tok, dtype: torch.dtype = torch.bfloat16):
    """The model a user ships, into folder: the weights cast to dtype (bf16: half an fp32 master
    copy) as save_pretrained writes them, config.json saying so (from_pretrained then loads them in
    it), the generation config, the tokenizer and its chat template. sd: the full state dict (FSDP2,
    rank 0), None for the model's own tensors."""
    cast = {}  # one copy per tensor: tied weights (embed_tokens, lm_head) stay one tensor
    sd = {k: cast.setdefault(v.data_ptr(), v.to(dtype) if v.is_floating_point() else v)
          for k, v in (lm.state_dict() if sd is None else sd).items()}
    _save_pretrained(lm, folder, sd)
    config = os.path.join(folder, "config.json")
    with open(config) as f:
        fields = json.load(f)
    fields["dtype"] = str(dtype).removeprefix("torch.")  # save_pretrained names the model's own
    with open(config, "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
    tok.save_pretrained(folder)


def write_training_state(folder: str, optimizer, scheduler, dist_env: Dist):
    """rank{r}.pt into folder: this rank's optimizer shard (FSDP2: its local tensors), the lr
    schedule and this rank's RNG states."""
    from torch.distributed.tensor import DTensor

    optim = optimizer.state_dict()
    optim["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                      for i, s in optim["state"].items()}
    torch.save({"optimizer": optim, "scheduler": scheduler.state_dict(),
                "rng": _rng_state(dist_env)}, os.path.join(folder, f"rank{dist_env.rank}.pt"))


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
