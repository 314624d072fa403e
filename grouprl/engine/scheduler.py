"""Continuous batching over a fixed pool of slots: the slots' state on the device (Rows), the host's
bookkeeping of which row each slot decodes, admission and preemption (Scheduler), and the two
moves of generate's loop between decoding steps: admit (prefill and first tokens) and retire (the
host's look at which rows finished)."""

from __future__ import annotations

from collections import deque

import torch

from ..sampling import sample  # HF's penalty, temperature, top-k, top-p, min-p: on the device
from .blocks import group_blocks, prompt_blocks


def admit(plan, rows, engine, how, generator):
    """The groups the slots and the pool hold now: prefilled once each (their KV copied to their
    n slots), their first tokens sampled."""
    k = plan.admissible()
    if k == 0:
        return
    batch, at = plan.admit(k)
    sel = torch.tensor(at, device=rows.tokens.device)
    logits = engine.prefill([plan.prompts[p] for p in batch], sel, plan.n)
    if rows.min_new_tokens:  # a row's first token: 0 made < min_new_tokens, EOS masked (draw)
        logits = logits.masked_fill(engine.eos_ids, float("-inf"))
    seen = None if engine.seen is None else engine.seen[sel]  # the prompts' ids (prefill)
    new, new_logp = sample(logits.repeat_interleave(plan.n, 0), *how, seen=seen,
                           generator=generator)
    lengths = [len(plan.prompts[p]) for p in batch]
    positions = torch.tensor(lengths, device=sel.device).repeat_interleave(plan.n)
    rows.start(sel, new, new_logp, positions)
    plan.reach = max(plan.reach, max(lengths) + 1)


def retire(plan, rows, engine):
    """The host's look: which rows finished (one sync), their tokens and log-probs (one more,
    when any did), their slots and blocks freed."""
    going, plan.made[:] = torch.stack((rows.live.long(), rows.count)).tolist()  # the host sync
    done = [s for s in range(plan.slots) if plan.row_of[s] >= 0 and not going[s]]
    if done:
        for s, (tokens, logp) in zip(done, rows.finish(done, plan.made)):
            plan.done(s, tokens, logp)
            engine.give(s)
    plan.settle()


class Rows:
    """The slots' state on the device: each slot's last token, its position, the tokens it made
    (count), whether it decodes a live row, and its completion so far (out, out_logp)."""

    def __init__(self, slots: int, max_new_tokens: int, eos: list[int], device,
                 min_new_tokens: int = 0):
        self.max_new_tokens, self.eos = max_new_tokens, torch.tensor(eos, device=device)
        self.min_new_tokens = min_new_tokens
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.count = torch.zeros(slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out = torch.zeros(slots, max_new_tokens, dtype=torch.long, device=device)
        self.out_logp = torch.zeros(slots, max_new_tokens, device=device)
        self.slot_rows = torch.arange(slots, device=device)
        # each slot's most tokens (episodes: a turn's room; else max_new_tokens for every row)
        self.limit = torch.full((slots,), max_new_tokens, dtype=torch.long, device=device)

    def start(self, sel, new, new_logp, positions):
        """Slots sel begin rows: their first tokens (sampled after the prefill) at `positions`."""
        self.out[sel, 0], self.out_logp[sel, 0], self.count[sel] = new, new_logp, 1
        self.live[sel] = ~self.is_eos(new) & (self.limit[sel] > 1)
        self.tokens[sel] = new
        self.positions[sel] = positions

    def advance(self, new, new_logp):
        """A decoding step's tokens into the live rows (finished rows and free slots stay)."""
        at = self.count.clamp(max=self.max_new_tokens - 1)  # finished rows write nowhere new
        live, rows = self.live, self.slot_rows
        self.out[rows, at] = torch.where(live, new, self.out[rows, at])
        self.out_logp[rows, at] = torch.where(live, new_logp, self.out_logp[rows, at])
        self.count += live.long()
        self.tokens = torch.where(live, new, self.tokens)
        self.positions += live.long()
        self.live &= ~self.is_eos(new) & (self.count < self.limit)

    def held(self) -> torch.Tensor | None:
        """min_new_tokens: the slots whose next token is one of their first min_new_tokens (count,
        the tokens made, restarts with the row: a preempted group's rows begin again at start),
        whose EOS the step masks, so that no row stops on EOS before; None when off (no mask, no
        cost)."""
        return self.count < self.min_new_tokens if self.min_new_tokens else None

    def is_eos(self, new):
        """Whether each token is an EOS id: every pair compared ([slots, EOS ids], a few kernels).
        Not torch.isin: past ~10 elements it sorts and takes torch.unique of both sides, whose
        data-dependent sizes make the host wait for the GPU at every step (on an H200 its sort and
        unique kernels ran 1,025 and 2,052 times in a 1,024-step rollout that was 25% idle)."""
        return (new[:, None] == self.eos).any(1)

    def finish(self, done: list[int], made: list[int]):
        """Finished slots' completions -> [(token ids, log-probs)] (one copy to the host), their
        positions back to 0."""
        at = torch.tensor(done, device=self.out.device)
        # both in one copy: token ids and fp32 log-probs are exact in float64
        rows = torch.cat((self.out[at].double(), self.out_logp[at].double()), 1).tolist()
        self.positions[at] = 0
        T = self.max_new_tokens
        return [([int(t) for t in row[:made[s]]], row[T:T + made[s]]) for s, row in zip(done, rows)]

    def stop(self, s: int):
        self.positions[s] = 0
        self.live[s] = False


class Scheduler:
    """Continuous batching on the host: which row each slot decodes, which prompts wait and which
    run (oldest first), admission (whole groups, only what the slots and the KV pool hold),
    preemption (paged: the youngest group out when running rows outgrow the pool), and the
    completions as rows finish. It reads the Engine's block bookkeeping (take/give/free/owned)."""

    def __init__(self, prompts, n: int, slots: int, sync_every: int, max_len: int, engine):
        self.prompts, self.n, self.slots, self.engine = prompts, n, slots, engine
        self.sync_every, self.max_len = sync_every, max_len
        self.row_of = [-1] * slots  # the row each slot decodes (host side), -1: free
        self.made = [0] * slots  # the tokens each slot has made, as of the host's last look
        self.waiting = deque(range(len(prompts)))
        self.running = []  # prompts with rows decoding, oldest first
        self.completions = [None] * (len(prompts) * n)
        self.logps = [None] * (len(prompts) * n)
        self.reach = 0  # one more than any slot's position, an upper bound between syncs
        self.counts = {"decode_steps": 0, "prefills": 0, "prefills_while_decoding": 0,
                       "preempted": 0, "kv_blocks_peak": 0, "kv_row_blocks_peak": 0,
                       "kv_read_peak": 0, "kv_read_physical_peak": 0}

    def busy(self) -> bool:
        return any(r >= 0 for r in self.row_of)

    def blocks_ahead(self, s: int) -> int:
        """Paged: the blocks slot s needs to write its next sync_every positions."""
        return self.engine.blocks_for(min(len(self.prompts[self.row_of[s] // self.n])
                                          + self.made[s] - 1 + self.sync_every, self.max_len))

    def admissible(self) -> int:
        """How many waiting groups the free slots hold (paged: and the pool, beside what the
        running rows need next)."""
        free = sum(r < 0 for r in self.row_of)
        k = min(free // self.n, len(self.waiting))
        if self.engine.paged:
            left = len(self.engine.free) - sum(self.blocks_ahead(s) - len(self.engine.owned[s])
                                               for s in range(self.slots) if self.row_of[s] >= 0)
            for j in range(k):  # n rows' blocks, the prompt's full blocks once (Engine.share)
                length = len(self.prompts[self.waiting[j]])
                left -= group_blocks(length, min(length + self.sync_every, self.max_len),
                                     self.n, self.engine.block)
                if left < 0:
                    return j
        return k

    def admit(self, k: int):
        """k waiting groups into free slots (paged: with their blocks) -> (prompts, slots)."""
        free = [s for s in range(self.slots) if self.row_of[s] < 0]
        batch = [self.waiting.popleft() for _ in range(k)]
        self.running.extend(batch)
        self.counts["prefills"] += 1
        self.counts["prefills_while_decoding"] += self.busy()
        for j, s in enumerate(free[:k * self.n]):
            p = batch[j // self.n]
            self.row_of[s], self.made[s] = p * self.n + j % self.n, 1
            if self.engine.paged and j % self.n:  # the group's prompt blocks, its first row's
                self.engine.share(s, free[j - j % self.n],
                                  prompt_blocks(len(self.prompts[p]), self.engine.block))
            if self.engine.paged and not self.engine.take(s, self.blocks_ahead(s)):
                raise RuntimeError("admitted beyond the KV pool")  # admissible() counted them
        return batch, free[:k * self.n]

    def done(self, s: int, tokens: list[int], logp: list[float]):
        self.completions[self.row_of[s]], self.logps[self.row_of[s]] = tokens, logp
        self.row_of[s] = -1

    def settle(self):
        """After a look: the prompts still running, and the read length (one more than any
        slot's position: a row's is its prompt's length + its tokens - 1; free slots sit at 0)."""
        rows = [r for r in self.row_of if r >= 0]
        self.running[:] = [p for p in self.running if any(r // self.n == p for r in rows)]
        self.reach = 1 + max((len(self.prompts[self.row_of[s] // self.n]) + self.made[s] - 1
                              for s in range(self.slots) if self.row_of[s] >= 0), default=0)

    def preempt(self, p: int, rows: Rows):
        """Paged: prompt p's rows out of their slots, its blocks freed, p first in line again."""
        for s in range(self.slots):
            if self.row_of[s] >= 0 and self.row_of[s] // self.n == p:
                self.row_of[s] = -1
                rows.stop(s)
                self.engine.give(s)
        for row in range(p * self.n, p * self.n + self.n):  # finished rows are made anew too
            self.completions[row] = self.logps[row] = None
        self.running.remove(p)
        self.waiting.appendleft(p)
        self.counts["preempted"] += 1

    def tally(self):
        """Paged (stats): the most KV blocks taken at a look, physical (from the pool) and summed
        over the rows (each row's table: what rows without shared prompts take), and read by the
        step after it, by each live row (the blocks attention asks for) and distinct (physical)."""
        e, rows = self.engine, [s for s in range(self.slots) if self.row_of[s] >= 0]
        read = [e.owned[s][:e.blocks_for(len(self.prompts[self.row_of[s] // self.n])
                                         + self.made[s])] for s in rows]
        now = {"kv_blocks_peak": len(e.refs) - 1 - len(e.free),
               "kv_row_blocks_peak": sum(len(e.owned[s]) for s in rows),
               "kv_read_peak": sum(map(len, read)),
               "kv_read_physical_peak": len(set().union(*read))}
        for k, v in now.items():
            self.counts[k] = max(self.counts[k], v)

    def grow(self, rows: Rows):
        """Paged: every running row's blocks for its next sync_every positions, oldest first,
        preempting the youngest groups while the pool is short."""
        for p in list(self.running):
            for s in range(self.slots):
                while (p in self.running and self.row_of[s] >= 0 and self.row_of[s] // self.n == p
                       and not self.engine.take(s, self.blocks_ahead(s))):
                    self.preempt(self.running[-1], rows)
