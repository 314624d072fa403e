"""Mixture-of-Experts routing across an RL step: which experts each (token, layer) is sent to in the
old-log-prob pass, how many of those change once the policy has taken an optimizer step
(moe/route_flip_frac), and Routing Replay (--routing-replay): the old pass's experts forced in the
training forward, so that the ratio's numerator and denominator route alike (GSPO, arXiv
2507.18071, its section on MoE training: ~10% of the experts activated for the same input change
after each gradient update of Qwen3-30B-A3B; GRPO needed Routing Replay to converge, GSPO did not).

Covers routers that return (router_logits, top_k_weights, top_k_index) from the `gate` of an MLP
that has `experts` (transformers' Qwen3-MoE, Qwen2-MoE, OLMoE style): a forward hook on each gate
reads, and under replay replaces, its output. The scripts call track() once, recording() around
each old-pass forward, replaying() around each training forward and stats() when they log (which
ends the step's replay, before any evaluation or the next rollout).

Memory of the recorded routing: layers x rows x positions x top_k indices, one byte each (two
with more than 256 experts), for the whole rollout batch of a rank: Qwen3-30B-A3B (48 layers,
top 8 of 128) at 128 rows of 4096 positions is 48 x 128 x 4096 x 8 B = 192 MiB; tiny-moe (2
layers, top 2 of 8) at 128 rows of ~15 positions, 8 KiB.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .distributed import all_reduce


def is_moe(config) -> bool:
    """A config with routed experts (Qwen3-MoE and its kind: num_experts and top-k)."""
    return (getattr(config, "num_experts", 0) or 0) > 0 and (
        getattr(config, "num_experts_per_tok", 0) or 0) > 0


class Routes:
    """The router tape of one policy: the experts each (row, position, layer) was sent to in the
    old-log-prob pass, and the flips counted in the training forwards of this step."""

    def __init__(self, lm, replay: bool):
        self.replay = replay
        self.gates = [layer.mlp.gate for layer in lm.get_decoder().layers
                      if hasattr(layer.mlp, "experts")]
        self.mode = None  # None (hooks pass through: generation, evaluation), "record", "train"
        self.rows = None  # the rows of the rollout batch the current forward runs on
        self.tape = [None] * len(self.gates)  # per layer [rows, positions, top_k] expert indices
        self.attention_mask = None  # [rows, positions] of the rollout batch: tokens that count
        self.minibatches = []  # the old pass's row slices, in order (minibatch k: k optimizer steps)
        self.flips = {}  # (minibatch, first row, layer) -> (router's own flips, loss's flips, total)
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(self.hook(layer))

    def hook(self, layer: int):
        def read(module, inputs, output):
            if self.mode is None:
                return None
            logits, weights, index = output
            top_k = index.shape[-1]
            rows = self.attention_mask[self.rows]
            if self.mode == "record":
                if self.tape[layer] is None:
                    dtype = torch.uint8 if logits.shape[-1] <= 256 else torch.int16
                    self.tape[layer] = torch.zeros(*self.attention_mask.shape, top_k, dtype=dtype,
                                                   device=index.device)
                self.tape[layer][self.rows] = index.view(*rows.shape, top_k).to(
                    self.tape[layer].dtype)
                return None
            old = self.tape[layer][self.rows].reshape(-1, top_k).long()
            valid = rows.reshape(-1).bool()
            used = old if self.replay else index
            # an expert of the new top-k that is not in the old one is a flipped selection
            own = (~(index[:, :, None] == old[:, None, :]).any(-1))[valid].sum()
            seen = (~(used[:, :, None] == old[:, None, :]).any(-1))[valid].sum()
            k = next(i for i, mb in enumerate(self.minibatches)
                     if mb.start <= self.rows.start < mb.stop)
            # keyed, not added: activation checkpointing runs the forward (and this hook) again
            self.flips[(k, self.rows.start, layer)] = (own, seen, valid.sum() * top_k)
            if not self.replay:
                return None
            # the old experts, weighted by the current router: its softmax over all experts at the
            # forced ones (renormalised over them where the router renormalises its top-k)
            probs = F.softmax(logits, dim=-1, dtype=torch.float)
            forced = probs.gather(1, old)
            if getattr(module, "norm_topk_prob", False):
                forced = forced / forced.sum(-1, keepdim=True)
            return logits, forced.to(weights.dtype), old.to(index.dtype)

        return read


def track(lm, replay: bool) -> Routes | None:
    """The router tape of an MoE model (None for a dense one: every call below is then a no-op)."""
    if not is_moe(lm.config):
        return None
    return Routes(lm, replay)


@contextlib.contextmanager
def recording(routes: Routes | None, rows: slice, attention_mask: torch.Tensor):
    """Around an old-log-prob forward of rows `rows` of the rollout batch (attention_mask: the
    whole batch's): each layer's top-k experts written to the tape. The first minibatch of a step
    starts the step's tape and flip counts afresh."""
    if routes is None:
        yield
        return
    if rows.start == 0:
        routes.minibatches, routes.flips = [], {}
        routes.tape = [None] * len(routes.gates)
        routes.attention_mask = attention_mask
    routes.minibatches.append(rows)
    routes.mode, routes.rows = "record", rows
    try:
        yield
    finally:
        routes.mode = None


@contextlib.contextmanager
def replaying(routes: Routes | None, rows: slice):
    """Around a training forward of rows `rows`: the flips of each layer's top-k against the tape
    counted, and with --routing-replay the tape's experts forced. The tape stays in force after the
    block, until the next block or stats(): under activation checkpointing the backward pass runs
    each layer's forward again, and it must route as the forward did."""
    if routes is None:
        yield
        return
    routes.mode, routes.rows = "train", rows
    yield


def stats(routes: Routes | None) -> dict:
    """The step's routing logs, over all ranks (every rank runs the same minibatches):
    moe/route_flip_frac: the fraction of the (token, layer) top-k expert selections the router
    itself makes on minibatch 2, after one optimizer step, that are not among those it made for the
    same tokens in the old pass (absent with --num-minibatches 1); moe/route_flip_frac_loss: the
    same over every minibatch for the experts the training forward used (0 with --routing-replay).
    Tokens: every position the attention mask keeps, prompts included."""
    if routes is None:
        return {}
    routes.mode = None  # the step's training is over: generation and evaluation route freely
    if not routes.flips:
        return {}
    device = routes.attention_mask.device
    one_step = torch.zeros(2, dtype=torch.float64, device=device)
    loss = torch.zeros(2, dtype=torch.float64, device=device)
    for (k, _, _), (own, seen, total) in routes.flips.items():
        loss += torch.stack([seen, total]).double()
        if k == 1:
            one_step += torch.stack([own, total]).double()
    out = {}
    if len(routes.minibatches) > 1:
        one_step = all_reduce(one_step)
        out["moe/route_flip_frac"] = (one_step[0] / one_step[1].clamp(min=1)).item()
    loss = all_reduce(loss)
    out["moe/route_flip_frac_loss"] = (loss[0] / loss[1].clamp(min=1)).item()
    return out
