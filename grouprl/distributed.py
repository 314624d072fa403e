"""torchrun set-up, ranks and seeds, collectives, and the one-line errors every module stops with.
The base layer: common.py, the subsystem modules and the scripts import it; it imports none of
them.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


# -------------------- distributed set-up: torchrun, ranks, seeds, collectives, errors
ON_FAIL = []  # functions fail() calls before the process stops
LINK = []  # --async-rollouts: (the link over every rank, ProcessGroupGloo; the trainers' count)


def fail(msg: str):
    """Stop with one line on stderr that says what was wrong and what to do (no traceback). Under
    torchrun every rank exits with code 1 and rank 0 alone prints the line: a check that can fail
    runs on every rank with the same answer (or on rank 0, which broadcasts it: on_rank0), so the
    line is printed once and no rank is left waiting. Once the process group exists the process
    leaves with os._exit, as cleanup() does, for the same reason."""
    main = main_process()
    for hook in ON_FAIL:  # checkpoint's: a fresh run folder that holds nothing yet is removed
        hook()
    # a progress bar on stderr's last line is ended first, so that the error starts a line of its own
    for bar in list(getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", ())):
        bar.close()
    if LINK and not dist.is_initialized():  # a rollout rank (--async-rollouts): it alone knows
        # on a line of its own: a trainer's progress bar may hold the terminal's last line
        print(f"\nerror: rollout rank {os.environ.get('RANK')}: {msg}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        if main:
            print(f"error: {msg}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    raise SystemExit(f"error: {msg}" if main else 1)


class Refused(Exception):
    """A one-line error that rank 0 alone can see (its files): on_rank0 stops every rank with it."""


def on_rank0(fn, dist_env):
    """fn() on rank 0 alone, its result given to every rank; a Refused raised there stops every rank
    with its line."""
    out = [None, None]
    if dist_env.main:
        try:
            out = [fn(), None]
        except Refused as e:
            out = [None, str(e)]
    if dist_env.world > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        fail(out[1])
    return out[0]


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device  # this process's GPU (LOCAL_RANK under torchrun), else the CPU
    # FSDP2: every run launched by torchrun, one process included (fp32 master weights)
    sharded: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def main_process() -> bool:
    """Rank 0 of a torchrun job, or a plain process; known from the environment alone, before (or
    without) the process group."""
    return int(os.environ.get("RANK", "0")) == 0


def launched() -> bool:
    """Started by torchrun (or any env:// launcher, which sets RANK): the run is sharded with FSDP2,
    one process included. setup_distributed and the argument checks both ask this, so they cannot
    disagree."""
    return "RANK" in os.environ


def setup_distributed(seed: int, rollout_ranks: int = 0) -> Dist:
    """Read torchrun's environment (plain `python x.py` is world size 1, unsharded); NCCL on CUDA,
    gloo on CPU. Under torchrun the process group exists even for one process, so that FSDP2 (fp32
    master weights, --cpu-offload, --gen-unshard) serves one GPU as it serves eight.
    rollout_ranks R > 0 (--async-rollouts): the last R ranks generate, the first world - R train;
    the process group (every collective, FSDP2) holds the trainers alone, their Dist counts them
    alone, and a second group over every rank, the link (LINK), carries rollouts and weights
    (grouprl/rollout_ranks.py). A rollout rank is in no process group: a plain process, unsharded,
    its Dist world 1 and not main."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    trainers = world - rollout_ranks
    if launched() and not dist.is_initialized() and not LINK:
        backend, dev = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None and not rollout_ranks:  # not torchrun: plain env:// rendezvous
            dist.init_process_group(backend, device_id=dev)
        else:  # torchrun keeps its TCP store across --max-restarts attempts; without a prefix per
            # attempt a restarted job reads the dead attempt's addresses and cannot connect
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                timeout=dist.constants.default_pg_timeout)
            prefix = f"attempt_{attempt or 0}"
            if rollout_ranks:  # the link first (every rank), then the trainers' own group
                LINK.append((dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/link", store), rank,
                                                   world, dist.constants.default_pg_timeout),
                             trainers))
                prefix += "/trainers"
                world = trainers
            if rank < trainers:
                dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                                        rank=rank, world_size=world, device_id=dev)
    seed_everything(seed)  # same seed on every rank while the model is built; see seed_rank()
    if LINK and rank >= LINK[0][1]:  # a rollout rank: a plain process of its own
        return Dist(rank, 1, device)
    return Dist(rank, min(world, trainers), device, sharded=dist.is_initialized())


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, dist_env: Dist):
    """Per-rank seed for sampling, after the (identical) model init on every rank."""
    seed_everything(seed + 1_000_003 * dist_env.rank)


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or op) over ranks, returned on t's device; the collective runs where the backend needs
    it (NCCL: GPU)."""
    if not dist.is_initialized():
        return t
    x = t.to(_device())
    dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x.to(t.device)


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from all ranks along dim 0, on t's device."""
    if not dist.is_initialized():
        return t
    x = t.to(_device()).contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out).to(t.device)


def _device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.is_initialized() and \
        dist.get_backend() == "nccl" else torch.device("cpu")


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -------------------- host memory, planned as a GPU's
MEMINFO = "/proc/meminfo"  # Linux; psutil is not a dependency


def available_host_memory() -> int | None:
    """Bytes of host memory available now without swapping (MEMINFO's MemAvailable); None where
    that cannot be read (then nothing is checked)."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_short(parts: dict[str, int]) -> str | None:
    """What to allocate on the CPU, {what: bytes}, checked as a GPU plan is (engine.kv_plan): None
    when it fits 90% of the available host memory (or that is unknown), else the sentence that says
    what does not fit, for a line that names the flag to lower."""
    free = available_host_memory()
    need = sum(parts.values())
    if free is None or need <= 0.9 * free:
        return None

    def size(b):
        return f"{b / 2 ** 30:.1f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"

    what = " and ".join(f"{name} ({size(b)})" for name, b in parts.items())
    return f"{what} exceed 90% of the {size(free)} of host memory available (MemAvailable)"


def check_host_memory(parts: dict[str, int]) -> None:
    """None when parts ({what: bytes}) fit the host memory available; else MemoryError, one line
    (host_memory_short), which the caller completes with the flag to lower."""
    short = host_memory_short(parts)
    if short is not None:
        raise MemoryError(short)
