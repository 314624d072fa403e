"""A run's state put back on resume: the optimizer's moments, the lr schedule's position and every
RNG, on the world size that wrote them (each rank its own file, bitwise) or on another (the
optimizer state resharded row by row, exact).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from ..distributed import Dist, fail, seed_rank
from .manifest import state_dir
from .resume import read_trainer_state


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
    from ..staleness import restore_ring

    restore_ring(None if ckpt is None else state_dir(ckpt), dist_env.rank)  # --max-staleness
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
