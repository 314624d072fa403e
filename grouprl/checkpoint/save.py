"""Saving: step_N written whole or not at all (save_checkpoint), --save-final model's final/, a
step_N found in the way kept aside, and each rank's training state (optimizer, schedule, RNG).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch

from ..distributed import Dist, barrier
from ..lora import is_lora, save_lora
from .guards import _attempt, _or_stop
from .manifest import FINAL, MODEL, STATE, _manifest_files, _write_manifest_file
from .restore import _rng_state
from .run_dir import prune_checkpoints
from .signals import _stop
from .weights import _save_pretrained, full_state_dict, write_masters, write_model


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
        from ..staleness import save_ring  # --max-staleness: past weights, rollouts' streams

        save_ring(os.path.join(tmp, STATE), policy, dist_env.rank)

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
    """final/ in place of .tmp_final; a final/ already there (never this run's: it writes one, and a
    branch sets the run's earlier one aside) is kept beside it (keep_aside), never deleted."""
    if os.path.exists(path):
        os.rename(path, tmp + ".old")
    os.rename(tmp, path)
    keep_aside(tmp + ".old", path)


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


def write_training_state(folder: str, optimizer, scheduler, dist_env: Dist):
    """rank{r}.pt into folder: this rank's optimizer shard (FSDP2: its local tensors), the lr
    schedule and this rank's RNG states."""
    from torch.distributed.tensor import DTensor

    optim = optimizer.state_dict()
    optim["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                      for i, s in optim["state"].items()}
    torch.save({"optimizer": optim, "scheduler": scheduler.state_dict(),
                "rng": _rng_state(dist_env)}, os.path.join(folder, f"rank{dist_env.rank}.pt"))
