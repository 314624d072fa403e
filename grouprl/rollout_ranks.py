"""--async-rollouts (issue 63 item 1): under torchrun the last --rollout-ranks R ranks generate and
the first world - R train, so that generation overlaps training.
The trainers are the process group (FSDP2 and every collective over them alone, as if the job
had world - R ranks); a rollout rank is a plain process with a full unsharded copy of the model.
They talk over a second group, the link (distributed.LINK, gloo, point to point): the weights go
from trainer 0 to the rollout ranks, each trainer's rollout comes from its rollout rank (trainer t:
rollout rank world - R + t mod R).
A deterministic pipeline of depth k = --max-staleness (TRL's bound, in weight versions; a version
every W = --weight-sync-steps steps, version j = the weights after j W steps): step s is sampled
with version max(0, (s - 1) // W - k) (staleness.sampled_with; W = 1: the weights after
max(0, s - 1 - k) steps), exactly the weights one process under the same flags samples it with
(grouprl/staleness.py), so the rollout rank samples up to k W + W - 1 steps ahead of the
trainers (k at W = 1), and each rollout carries its version (stale/version; stale/versions_behind
when stale). Nothing is older than k versions, so nothing is dropped: stale/dropped is logged, 0
(the rollout rank runs no further ahead than the bound: a bounded queue with nothing to drop).
The weights are sent once a sync (W steps: TRL's weight_sync_steps = W x a step's optimizer
steps), gathered from the FSDP2 shards (full_tensor; LoRA: the adapters only, what
staleness.trainable returns); the rollout rank takes a version just before it samples the first
step that samples with it: a generation under way finishes on the weights it began with (not
PipelineRL's cut).
Randomness: the rollout rank draws trainer t's rollout from trainer t's own random streams (torch,
CUDA, random, numpy), and each rollout brings them back as they are after it (the trainer takes
them: as if it had sampled). k = 0: t sends its streams each step (after its evaluation, if any),
so the async run draws what the synchronous run draws. k > 0: t sends them once, and the rollout
rank carries them on; without evaluations that is the one-process --max-staleness k run's draw,
while an evaluation at step s draws after rollouts s + 1 .. s + k were drawn (one process: before).
--resume: the checkpoint's ring of past weights (state/stale_ring.pt, trainer 0's) and each
trainer's rollouts' streams (state/stale_streams.rank{t}.pt, staleness.hold_streams; k = 0: the
trainers' own) regenerate the in-flight rollouts (nothing of the queue is saved: the pipeline is
a function of those).
A rollout rank that dies breaks the link: the trainers stop in one line naming the last checkpoint;
trainers that stop (the end, SIGTERM at a step boundary, an error) end the rollout ranks quietly.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import time
from dataclasses import fields, replace

import numpy as np
import torch
import torch.distributed as dist

from . import staleness
from .checkpoint.manifest import is_checkpoint, step_folders
from .checkpoint.resume import own_runs
from .checkpoint.signals import request_stop
from .cli.defaults import rollout_sampling
from .data import Task, load_task
from .distributed import LINK, Dist, fail
from .lora import lora_spec
from .modeling import eos_ids, load_model, load_tokenizer, wrap_policy

# message tags on the link (FIFO per sender and tag)
WEIGHTS, STREAMS, ROLLOUT = 1, 2, 3
_PENDING = []  # this process's sends under way (their buffers kept until they complete)
_STARTED = []  # a trainer: True once it has said hello
_STOP = []  # a rollout rank: when it got its first stop signal (time.monotonic)


def training() -> bool:
    """True on a trainer of an --async-rollouts job (its step's groups come from a rollout rank)."""
    return bool(LINK) and dist.is_initialized()


def serving(dist_env: Dist) -> bool:
    """True on a rollout rank of an --async-rollouts job."""
    return bool(LINK) and dist_env.rank >= LINK[0][1]


# -------------------- the link: objects over gloo point to point
class LinkBroken(Exception):
    """A send or receive on the link failed: the rank at the other end is gone."""


def _send(obj, dst: int, tag: int):
    """obj pickled, its size then its bytes, sent without waiting (the link's send is an isend);
    the buffers are kept until their sends complete."""
    link = LINK[0][0]
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    _PENDING[:] = [(w, b) for w, b in _PENDING if not w.is_completed()]  # done: buffers freed
    try:
        _PENDING.extend([(link.send([size], dst, tag), size), (link.send([data], dst, tag), data)])
    except RuntimeError as e:
        raise LinkBroken(str(e)) from e


def _wait_sends():
    while _PENDING:
        work, _ = _PENDING.pop(0)
        try:
            work.wait()
        except RuntimeError as e:
            raise LinkBroken(str(e)) from e


def _recv(src: int, tag: int):
    link = LINK[0][0]
    size = torch.zeros(1, dtype=torch.int64)
    try:
        link.recv([size], src, tag).wait()
        data = torch.empty(int(size), dtype=torch.uint8)
        link.recv([data], src, tag).wait()
    except RuntimeError as e:
        raise LinkBroken(str(e)) from e
    return pickle.loads(data.numpy().tobytes())


def _streams() -> dict:
    """This process's random streams (what sampling draws from)."""
    return {"torch": torch.get_rng_state(), "random": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_streams(s: dict):
    torch.set_rng_state(s["torch"])
    random.setstate(s["random"])
    np.random.set_state(s["numpy"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _moved(roll, device: torch.device):
    """roll with its tensors on device (the link carries CPU tensors: each rank its own GPU)."""
    return replace(roll, **{f.name: getattr(roll, f.name).to(device) for f in fields(roll)
                            if isinstance(getattr(roll, f.name), torch.Tensor)})


def full_weights(policy, keep: bool) -> list[torch.Tensor] | None:
    """The trainable weights, whole, on the CPU (keep; else None): each FSDP2 shard gathered
    (full_tensor, a collective over the trainers: every trainer calls it), one at a time."""
    out = []
    for p in staleness.trainable(policy):
        w = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        if keep:
            out.append(w.to("cpu", copy=True))
    return out if keep else None


# -------------------- a trainer's side
def receive(policy, step: int, reward, args):
    """This trainer's Rollout of `step`, sampled by its rollout rank with the weights of version
    staleness.sampled_with(step, k, W). First, when step - 1 is a sync point (a multiple of W),
    the weights after step - 1 steps (the policy now) go out: trainer 0 sends them to every
    rollout rank (the whole ring on the run's first step: the versions steps step .. step + k W
    sample with), to be used k syncs later. Afterwards this rank's random streams are the
    rollout's (as if it had sampled), and reward.values its scores' (the logs)."""
    link, trainers = LINK[0]
    rank, world, k, sync = dist.get_rank(), link.size(), args.max_staleness, args.weight_sync_steps
    synced = (step - 1) % sync == 0
    now = full_weights(policy, rank == 0) if synced else None  # trainer 0 alone holds them
    kept = staleness.kept(k, sync) and rank == 0
    ring = staleness.keep(policy, step, k, now, sync) if kept else [(step - 1, now)]
    first = not _STARTED
    src = trainers + rank % (world - trainers)  # this trainer's rollout rank
    try:  # no version that no step will use (the first to: step + k sync)
        if rank == 0 and (first or synced and step + k * sync <= args.num_steps):
            versions = list(ring) if first else [(step - 1, now)]
            for dst in range(trainers, world):
                _send({"step": step, "versions": versions}, dst, WEIGHTS)
        if first or not k:  # the random streams its rollout rank samples this trainer's with
            # k = 0: this rank's own each step (an evaluation's draws included, as one process);
            # k > 0: the rollout's own, carried on from the start (a resumed run: the checkpoint's)
            resumed = staleness.resumed_streams() if k else None
            _send(resumed or _streams(), src, STREAMS)
        _STARTED[:] = [True]
        start = time.time()
        version, roll, streams, values, stop = _recv(src, ROLLOUT)
        waited = time.time() - start
    except LinkBroken as e:  # a rollout rank died
        why = (str(e).splitlines() or [type(e).__name__])[0][:100]
        fail(f"step {step}: the rollout rank {src} is gone ({why}); {last_checkpoint(args)}")
    roll = _moved(roll, next(policy.parameters()).device)
    _set_streams(streams)
    if k:
        staleness.hold_streams(policy, streams)  # into the checkpoint with the ring
    if stop:  # the rollout rank got SIGTERM or SIGINT: as if this rank had (once)
        request_stop()
    if values is not None:
        reward.values = values
    roll.stats.update({"stale/version": version // sync, "stale/dropped": 0,
                       "perf/rollout_wait_s": waited})  # the trainer idle, waiting
    return roll


def last_checkpoint(args) -> str:
    """What a stopped run says of its checkpoints: the newest complete one of this exp_name and
    seed under --output-dir (what --resume auto takes)."""
    found = [(t, n, p) for t, run in own_runs(args.output_dir, args.exp_name, args.seed)
             for n, p in step_folders(run) if is_checkpoint(p)]
    if not found:
        return "no checkpoint was written: start the run again"
    return f"the last checkpoint is {max(found)[2]}: go on with --resume auto (or that folder)"


# -------------------- a rollout rank's side
def _on_stop_signal(signum, frame):
    """SIGTERM or SIGINT on a rollout rank: its next rollout tells its trainers, which stop at the
    end of that step with a checkpoint (every trainer: stop_requested); this rank goes on serving
    until they are gone. A second signal a second or more later exits at once."""
    if _STOP and time.monotonic() - _STOP[0] >= 1.0:
        os._exit(128 + signum)
    if not _STOP:
        _STOP.append(time.monotonic())
        os.write(2, f"\n{signal.Signals(signum).name} on a rollout rank: the trainers stop with a "
                    "checkpoint at the end of a step\n".encode())


def serve_rollouts(args, dist_env: Dist, reward, sample_groups):
    """On a rollout rank: the whole run (then the process ends); elsewhere nothing. The model is
    --model (its trainable weights replaced by the trainers' before any sampling); each step s,
    for each trainer t it serves: the weights staleness.sampled_with(s, k, W) in, t's random
    streams in, sample_groups as trainer t would call it (its prompts: Dist(t, trainers)),
    pi_behaviour (when stale and the engine gave none, staleness.Behind), out to t."""
    if not serving(dist_env):
        return
    link, trainers = LINK[0]
    mine = [t for t in range(trainers) if trainers + t % (link.size() - trainers) == dist_env.rank]
    k, sync = args.max_staleness, args.weight_sync_steps
    stale = staleness.kept(k, sync)
    tok = load_tokenizer(args.model, args.trust_remote_code)
    train, _, _ = load_task(Task.of(args), tok)
    lm, rank0_weights = load_model(args.model, tok, dist_env, args.seed, args.trust_remote_code,
                                   args.dtype, lora_spec(args))
    eos = eos_ids(lm, tok)
    policy = wrap_policy(lm, dist_env, args.temperature, args.logprob_chunk_tokens, False,
                         args.dtype, False, rank0_weights)
    policy.eval()
    sampling = rollout_sampling(args)
    plain = replace(args, max_staleness=0, weight_sync_steps=1)  # the weights: put in here
    params = staleness.trainable(policy)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the trainers stop at a step boundary
        signal.signal(sig, _on_stop_signal)
    try:
        hello = _recv(0, WEIGHTS)
        versions = dict(hello["versions"])
        streams = {}
        for step in range(hello["step"], args.num_steps + 1):
            v = staleness.sampled_with(step, k, sync)
            start = time.time()
            while v not in versions:  # sent by trainer 0 at the start of step v + 1
                versions.update(_recv(0, WEIGHTS)["versions"])
            for old in [u for u in versions if u < v]:
                del versions[old]
            staleness.load(params, versions[v])
            waited = time.time() - start
            for t in mine:
                if not k or t not in streams:  # k = 0: each step's, as the trainer holds them
                    streams[t] = _recv(t, STREAMS)
                _set_streams(streams[t])
                roll = sample_groups(policy, tok, train, step, eos,
                                     Dist(t, trainers, dist_env.device), reward, sampling, plain)
                roll = staleness.Behind(policy, step, v if stale else None, sync).done(roll, args)
                roll.stats["perf/weights_wait_s"] = waited  # the rollout rank idle, waiting
                streams[t] = _streams()
                values = getattr(reward, "values", None)  # the scores' logs
                _send((v, _moved(roll, torch.device("cpu")), streams[t], values, bool(_STOP)), t,
                      ROLLOUT)
        _wait_sends()
    except LinkBroken:  # the trainers are gone (stopped, or failed): they say why
        pass
    os._exit(0)
