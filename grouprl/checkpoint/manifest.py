"""A checkpoint's layout and its manifest: the step_N folders of a run, manifest.json (every file's
size, the small ones' sha256, written last) and verify_checkpoint, which says whether a saved
checkpoint is still whole; a --model folder's problems, read from the headers alone.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re

import torch
import torch.distributed as dist

from ..distributed import Dist, barrier


# -------------------- checkpoints and exact resume
# {run_dir}/step_N holds model/ (the bf16 export from_pretrained loads), state/ (fp32 master weights,
# rank{r}.pt: each rank's optimizer shard, lr schedule and RNG states, trainer_state.json) or, under
# LoRA, adapter/, and manifest.json (written last: every file's size, the small ones' sha256). It is
# written as .tmp_step_N and renamed when complete; resume checks the manifest, on any world size.
# The whole layout and its guarantees: docs/checkpoints.md.
STEP_DIR = re.compile(r"step_(\d+)$")
MANIFEST = "manifest.json"
MODEL, STATE = "model", "state"
FINAL = "final"  # --save-final model: {run_dir}/final/model (and adapter/), no training state
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
