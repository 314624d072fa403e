"""--max-staleness k in one process (issue 63 item 2): each step's rollout sampled by the policy as
it was k weight versions before, so staleness is studied without a second rank or model.
A weight version is TRL's (AsyncGRPOTrainer's model_version: bumped at each weight sync): a sync
every W = --weight-sync-steps steps, so version j = the weights after j W steps. Step s (1-based)
trains the weights after s - 1 steps (live version (s - 1) // W) and samples with version
max(0, (s - 1) // W - k), the weights after W max(0, (s - 1) // W - k) steps (sampled_with; W = 1:
the weights after max(0, s - 1 - k) steps): k versions behind at most (TRL's bound), k W to
k W + W - 1 steps behind. W counts steps, not optimizer steps: a step's --num-minibatches x
--num-iterations optimizer steps are one step, as TRL with weight_sync_steps = W times that product
(its default 1 at one optimizer step a step). The first k W steps sample with the initial weights.
The ring keeps CPU copies of the trainable parameters (LoRA: the adapters only) of the last k + 1
versions; the stale one is copied into the policy for the rollout and the current one copied back
after (bitwise: copy_ of the same dtype). k = 0 and W = 1 touch nothing (today's run, bitwise).
The rollout carries the behaviour policy's log-probs (Rollout.logp): the engine's as it sampled;
for the HF modes a forward of the stale weights while they are in (as old_log_probs' recompute).
The ring is part of the run's state: a checkpoint holds it (state/stale_ring.pt, save_ring) and
--resume restores it (restore_ring), so a resumed run samples as the uninterrupted one."""

from __future__ import annotations

import os
import pickle
import weakref
from collections import deque
from contextlib import contextmanager

import torch

from .distributed import all_reduce, fail

# Rollout: grouprl/generation.py's (not imported: the checkpoint reads this module)

_RINGS = weakref.WeakKeyDictionary()  # policy -> deque of (version, [CPU tensors]), oldest first
_RESUMED = []  # the ring a resumed run read from its checkpoint (restore_ring), until first used
_STREAMS = weakref.WeakKeyDictionary()  # policy -> the random streams its rollouts are drawn from
_RESUMED_STREAMS = []  # those a resumed run read from its checkpoint, until first used
RING_FILE = "stale_ring.pt"
STREAMS_FILE = "stale_streams.rank{rank}.pt"


def trainable(policy) -> list[torch.Tensor]:
    """The parameters the optimizer moves (LoRA: the adapters; the base stays as loaded)."""
    return [p for p in policy.parameters() if p.requires_grad]


@torch.no_grad()
def load(params: list[torch.Tensor], weights: list[torch.Tensor]):
    for p, w in zip(params, weights):
        p.copy_(w)


@torch.no_grad()
def behaviour_logp(policy, roll: Rollout, chunks: int) -> torch.Tensor:
    """log pi_behaviour of the completion tokens [B, T]: the policy's forward as it is now (the
    stale weights in), `chunks` row slices as the old pass takes its minibatches."""
    B = len(roll.texts)
    per = max(1, B // chunks)
    return torch.cat([policy(roll.input_ids[i:i + per], roll.attention_mask[i:i + per],
                             roll.n_prompt) for i in range(0, B, per)])


def kept(k: int, sync: int) -> bool:
    """Whether a ring of past weights is kept: --max-staleness k > 0 or --weight-sync-steps > 1
    (k = 0 with syncs every W steps samples with the weights of the last sync)."""
    return k > 0 or sync > 1


def sampled_with(step: int, k: int, sync: int) -> int:
    """The weights step samples with, as the steps trained: those of version max(0, (step - 1) //
    sync - k), the sync (every `sync` steps) k syncs before the live one."""
    return sync * max(0, (step - 1) // sync - k)


def keep(policy, step: int, k: int, now: list[torch.Tensor] | None, sync: int = 1) -> deque:
    """The ring of policy's past weights with `now` (the weights after step - 1 steps, CPU copies)
    appended when step - 1 is a sync point (a multiple of `sync`), and all but the last k + 1 syncs
    dropped: the versions steps step .. step + k sync sample with (on a resumed run's first step,
    the checkpoint's ring)."""
    if policy not in _RINGS:  # the run's first stale step: the checkpoint's ring, or a new one
        _RINGS[policy] = _RESUMED.pop() if _RESUMED else deque()
    ring = _RINGS[policy]
    if now is not None and ring and [w.shape for w in ring[0][1]] != [w.shape for w in now]:
        fail("--resume: the checkpoint's past weights (--max-staleness) do not fit this model's "
             "trainable parameters; resume with the run's own --model and LoRA flags")
    if (step - 1) % sync == 0:
        ring.append((step - 1, now))
    while len(ring) > k + 1:
        ring.popleft()
    return ring


class Behind:
    """What `behind` yields: done(roll, chunks) completes the rollout sampled inside it."""

    def __init__(self, policy, step: int, version: int | None, sync: int = 1):
        self.policy, self.step, self.version, self.sync = policy, step, version, sync

    def done(self, roll: Rollout, args) -> Rollout:
        """roll as sampled, or, when stale (version: the steps its weights had trained): its logp
        the behaviour policy's (when the engine gave none; --num-minibatches row slices) and stats
        stale/versions_behind (the live version minus the sampler's, TRL's staleness) and, when
        W > 1, stale/steps_behind (the steps trained since the sampler's weights)."""
        if self.version is None:
            return roll
        if roll.logp is None:  # HF modes: pi_behaviour by the training forward
            roll.logp = behaviour_logp(self.policy, roll, args.num_minibatches)
        live, used = (self.step - 1) // self.sync, self.version // self.sync
        roll.stats["stale/versions_behind"] = live - used
        if self.sync > 1:
            roll.stats["stale/steps_behind"] = self.step - 1 - self.version
        return roll


@contextmanager
def behind(policy, step: int, k: int, sync: int = 1):
    """Inside: the policy holds the weights step samples with (sampled_with: the ring's oldest),
    so that a rollout sampled there is step's stale one; the current weights back after, bitwise.
    k = 0 and sync = 1: nothing touched (today's run). Yields a Behind, whose done() is called
    inside."""
    if not kept(k, sync):
        yield Behind(policy, step, None)
        return
    params = trainable(policy)
    now = [p.detach().to("cpu", copy=True) for p in params]  # the weights after step - 1 steps
    version, weights = keep(policy, step, k, now, sync)[0]
    try:
        load(params, weights)  # the behaviour policy (version == step - 1: the same numbers)
        yield Behind(policy, step, version, sync)
    finally:
        load(params, now)  # the current weights back, bitwise


def gap(roll: Rollout, old_logp: torch.Tensor) -> dict:
    """stale/kl: the k3 estimate of KL(pi_behaviour || pi_old) over every rank's completion tokens,
    mean(rho - 1 - log rho), rho = pi_old / pi_behaviour (the rollout correction's rollout_is/kl,
    logged whether or not it is on); pi_old recomputed: the policy this step trains. Empty for
    a rollout that is not stale (no --max-staleness) or when pi_old is the rollout's own."""
    if "stale/versions_behind" not in roll.stats or old_logp is roll.logp:
        return {}
    mask = roll.mask
    log_ratio = torch.where(mask.bool(), old_logp - roll.logp, 0.0)
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    return {"stale/kl": (all_reduce(k3.sum()) / all_reduce(mask.sum()).clamp(min=1)).item()}


def hold_streams(policy, streams: dict):
    """--async-rollouts, k > 0: the random streams policy's next rollout is drawn from (on the
    rollout rank, ahead of this rank's own, which an evaluation also draws from); saved with the
    ring, so that a resumed run draws its in-flight rollouts as the uninterrupted one did."""
    _STREAMS[policy] = streams


def resumed_streams() -> dict | None:
    """The streams a resumed run's checkpoint held (hold_streams), once; else None."""
    return _RESUMED_STREAMS.pop() if _RESUMED_STREAMS else None


def save_ring(folder: str, policy, rank: int = 0):
    """The ring into folder/stale_ring.pt: the versions the next k syncs sample with (the rank
    that keeps it: the one process, or trainer 0 of an --async-rollouts job), and this rank's
    rollouts' random streams when held (hold_streams) into folder/stale_streams.rank{r}.pt;
    nothing when the run keeps neither (--max-staleness 0, --weight-sync-steps 1)."""
    ring = _RINGS.get(policy)
    if ring:
        blob = {"versions": [v for v, _ in ring], "weights": [w for _, w in ring]}
        torch.save(blob, os.path.join(folder, RING_FILE))
    if policy in _STREAMS:  # pickled: the random and numpy states are not tensors
        data = torch.frombuffer(bytearray(pickle.dumps(_STREAMS[policy])), dtype=torch.uint8)
        torch.save({"streams": data}, os.path.join(folder, STREAMS_FILE.format(rank=rank)))


def restore_ring(folder: str | None, rank: int = 0):
    """A checkpoint's ring (folder: its state/; read by rank 0, the rank that keeps it) and this
    rank's rollouts' streams, held for the resumed run's first stale rollout; a fresh run (None)
    or a checkpoint without them: none (the ring starts empty, the streams are the rank's own)."""
    _RESUMED.clear()
    _RESUMED_STREAMS.clear()
    if folder is None:
        return
    path = os.path.join(folder, RING_FILE)
    if rank == 0 and os.path.exists(path):
        blob = torch.load(path, map_location="cpu", weights_only=True)
        _RESUMED.append(deque(zip(blob["versions"], blob["weights"])))
    path = os.path.join(folder, STREAMS_FILE.format(rank=rank))
    if os.path.exists(path):
        blob = torch.load(path, map_location="cpu", weights_only=True)
        _RESUMED_STREAMS.append(pickle.loads(blob["streams"].numpy().tobytes()))
