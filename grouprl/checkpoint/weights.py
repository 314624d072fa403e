"""The model's weights on disk: the bf16 export from_pretrained loads (write_model), FSDP2's full
state dict gathered one tensor at a time, and the fp32 master weights each rank writes and reads
as its own rows (write_masters, load_masters).
"""

from __future__ import annotations

import json
import os

import torch

from ..distributed import Dist, fail
from .manifest import BUFFER, MASTERS, state_dir
from .restore import _local_rows, row_pieces


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
