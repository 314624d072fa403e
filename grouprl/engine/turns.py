"""Episodes on the engine (--tools with --gen-mode engine): each row's KV cache kept across its
turns. The first turn prefills each prompt once for its group (its full blocks shared, paged) and
decodes; the rows then keep their slots and their keys and values, so the next turn (the tool
turn's tokens appended by the tool loop, grouprl/episodes.py) prefills only what the cache does not
hold yet (the last turn's EOS, never fed, and the tool turn: Engine.extend) and decodes from there,
where HF generate would prefill the whole history again. settings.KEEP_TURNS = False re-prefills
the history instead (in the same Engine), the count the kept cache is measured against.

One Episodes a model at a time (rollout.OPEN): begin makes it, of finds it, end closes it (its
blocks back to the pool) and rollout.made closes it before the Engine serves anything else."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..sampling import Sampling, sample
from . import settings
from .blocks import prompt_blocks
from .rollout import OPEN, close_episodes, made, prepare
from .scheduler import Rows
from .settings import Setup


class Episodes:
    """An episode batch on one Engine, one slot a row for the whole episode (so every row of the
    call decodes at once: --gen-batch-size does not cap them, and a paged pool must hold them all
    until the episodes end): each row's tokens so far (ids: prompt, the model's turns, the tool
    turns) and the log-prob of each as the engine sampled it (0 at the prompt's and the tool
    turns' tokens), the positions its cache holds (cached: ids[:cached]; ids[cached], the last
    sampled token, is not read yet, and a slot that sits out a turn writes that token's keys and
    values at its place, which the next turn writes again), and counts (prefilled: the tokens each
    row's prefills computed, a group's prompt once for its n rows)."""

    def __init__(self, engine, setup: Setup, eos: list[int], sampling: Sampling, generator=None):
        self.engine, self.setup, self.eos, self.sampling = engine, setup, eos, sampling
        self.generator, self.slots = generator, setup.slots
        self.how = prepare(engine, sampling, eos)
        self.ids = [[] for _ in range(self.slots)]
        self.logp = [[] for _ in range(self.slots)]
        self.cached = [0] * self.slots  # positions 0 .. cached - 1 hold the row's keys and values
        self.prefilled = [0.0] * self.slots
        self.counts = {"decode_steps": 0, "prefill_tokens": 0, "turns": 0}

    @torch.no_grad()
    def first(self, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
        """Turn 1: n rows of each prompt (rows prompt * n + j in slots of the same index), each
        prompt prefilled once -> each row's (tokens, log-probs), ending at its first EOS or after
        sampling.max_new_tokens."""
        e, dev = self.engine, self.engine.table.device
        for b, p in enumerate(prompts):
            for j in range(n):
                s = b * n + j
                if e.paged and j:  # the group's full prompt blocks: its first row's (share)
                    e.share(s, b * n, prompt_blocks(len(p), e.block))
                self.grow(s, len(p) + 1)
                self.ids[s], self.logp[s] = list(p), [0.0] * len(p)
                self.cached[s], self.prefilled[s] = len(p), len(p) / n
        sel = torch.arange(len(prompts) * n, device=dev)
        logits = e.prefill(prompts, sel, n).repeat_interleave(n, 0)
        self.counts["prefill_tokens"] += sum(map(len, prompts))
        room = [self.sampling.max_new_tokens] * len(sel)
        return self.decode(sel, logits, room)

    @torch.no_grad()
    def next(self, histories: list[list[int]],
             room: list[int]) -> list[tuple[list[int], list[float]]]:
        """One more model turn after each history (a row's tokens so far and the tool turn the
        loop appended), at most room[i] tokens -> (tokens up to and including the first EOS,
        their log-probs) each. A history is matched to the row whose tokens it extends; only its
        tokens past the row's cache are prefilled (all of it with KEEP_TURNS off)."""
        taken, slots, tokens, starts, empty, s = set(), [], [], [], [], -1
        for h, r in zip(histories, room):
            s = self.find(lambda t: t not in taken and self.extends(h, t), s + 1)
            if s is None:
                raise ValueError("a history that no open episode's row begins: the engine keeps "
                                 "a row's cache only for the tokens it made or was given")
            if len(h) + (r > 0) > self.engine.max_len:
                raise ValueError(f"a history of {len(h)} tokens and room for {r} more passes the "
                                 f"{self.engine.max_len} positions a row holds (prompt + budget)")
            taken.add(s)
            start = self.cached[s] if settings.KEEP_TURNS else 0
            self.logp[s] += [0.0] * (len(h) - len(self.ids[s]))  # the tool turn: not sampled
            self.ids[s] = list(h)
            if r < 1:  # no room for a turn: the tool turn ends the row (never read)
                empty.append(len(slots) + len(empty))
                continue
            self.cached[s] = len(h)
            self.prefilled[s] += len(h) - start
            self.grow(s, len(h) + 1)
            slots.append(s)
            tokens.append(h[start:])
            starts.append(start)
        turns = []
        if slots:
            sel = torch.tensor(slots, device=self.engine.table.device)
            k = settings.EXTEND_ROWS  # rows a prefill: each gathers its history's keys and values
            logits = torch.cat([self.engine.extend(sel[i:i + k], tokens[i:i + k], starts[i:i + k])
                                for i in range(0, len(slots), k)])
            self.counts["prefill_tokens"] += sum(map(len, tokens))
            turns = self.decode(sel, logits, [r for r in room if r >= 1])
        for k in empty:  # in the histories' order
            turns.insert(k, ([], []))
        return turns

    def find(self, fits, start: int) -> int | None:
        """The first slot from `start` on (then from 0) that fits: the loop's rows come in slot
        order, so the next one is usually the first tried."""
        return next((s for s in [*range(start, self.slots), *range(start)] if fits(s)), None)

    def extends(self, history: list[int], s: int) -> bool:
        ids = self.ids[s]
        return len(ids) < len(history) and history[:len(ids)] == ids

    def grow(self, s: int, positions: int):
        """Paged: slot s's blocks for its first `positions` positions (MemoryError, one line, when
        the pool is short: an episode's rows hold their blocks until it ends)."""
        e = self.engine
        if e.paged and not e.take(s, e.blocks_for(min(positions, e.max_len))):
            raise MemoryError(f"the KV pool ({len(e.refs) - 1} blocks of {e.block} positions) "
                              f"cannot hold {self.slots} episodes' rows at once")

    def decode(self, sel: torch.Tensor, logits: torch.Tensor,
               room: list[int]) -> list[tuple[list[int], list[float]]]:
        """Rows sel decode from their prefill's logits until each meets an EOS or makes room[i]
        tokens; the other slots stay where they are (their caches untouched: each writes its own
        last token again, at its own place)."""
        e, dev, sampling = self.engine, self.engine.table.device, self.sampling
        rows = Rows(self.slots, max(room), self.eos, dev, sampling.min_new_tokens)
        # every slot sits on its last token, just past its cache (this turn's start below)
        rows.positions.copy_(torch.tensor(self.cached, device=dev))
        rows.tokens.copy_(torch.tensor([ids[-1] if ids else 0 for ids in self.ids], device=dev))
        rows.limit[sel] = torch.tensor(room, device=dev)
        if sampling.min_new_tokens:  # a row's first token: EOS masked (Engine.draw)
            logits = logits.masked_fill(e.eos_ids, float("-inf"))
        seen = None if e.seen is None else e.seen[sel]
        new, new_logp = sample(logits, *self.how, seen=seen, generator=self.generator)
        rows.start(sel, new, new_logp, torch.tensor([self.cached[s] for s in sel.tolist()],
                                                    device=dev))
        reach = max(self.cached[s] for s in sel.tolist()) + 1
        sync = self.setup.sync_every
        while True:
            live, positions = torch.stack((rows.live.long(), rows.positions)).tolist()
            if not any(live):
                break
            for s in range(self.slots):  # paged: the blocks of the next `sync` positions
                if live[s]:
                    self.grow(s, positions[s] + sync + 1)
            for _ in range(sync):  # the model's steps, no host sync
                rows.advance(*e.step(rows.tokens, rows.positions, reach, rows.live, self.how,
                                     self.generator, rows.held()))
                reach = min(reach + 1, e.max_len)
                self.counts["decode_steps"] += 1
        made_ = rows.count[sel].tolist()
        out = torch.cat((rows.out[sel].double(), rows.out_logp[sel].double()), 1).tolist()
        T, turns = rows.max_new_tokens, []
        for s, k, row in zip(sel.tolist(), made_, out):
            tokens, logp = [int(t) for t in row[:k]], row[T:T + k]
            self.ids[s] += tokens
            self.logp[s] += logp
            self.cached[s] += k - 1  # the last token is sampled, not yet read: the next turn's
            turns.append((tokens, logp))
        self.counts["turns"] += 1
        return turns

    def close(self):
        """The rows' blocks back to the pool (paged); the Episodes is done."""
        for s in range(self.slots):
            self.engine.give(s)


def begin(lm, prompts: list[list[int]], n: int, eos: list[int], sampling: Sampling,
          setup: Setup, generator=None) -> list[tuple[list[int], list[float]]]:
    """Episodes' first turn (engine.generate's arguments; one slot a row: setup.slots is set to
    the rows), its rows kept open (OPEN[lm]) for `of(lm).next` -> each row's (tokens,
    log-probs)."""
    end(lm)
    rows = len(prompts) * n
    engine, setup, _ = made(lm, prompts, n, sampling.max_new_tokens, replace(setup, slots=rows))
    episodes = Episodes(engine, setup, eos, sampling, generator)
    OPEN[lm] = episodes
    return episodes.first(prompts, n)


def of(lm) -> Episodes | None:
    """lm's open Episodes (begin), or None."""
    return OPEN.get(lm) if lm is not None else None


def end(lm, sequences: list[list[int]] | None = None) -> list[list[float]] | None:
    """Closes lm's open Episodes, if any (its blocks back to the pool). sequences: the episodes'
    tokens (prompt and completion) -> the log-probs of each's tokens as the engine sampled them
    (0 where the tool loop wrote: the prompt's and the tool turns' tokens), the row matched by
    its tokens; None without open Episodes."""
    episodes = close_episodes(lm)
    if episodes is None or sequences is None:
        return None
    taken, out, s = set(), [], -1
    for seq in sequences:
        s = episodes.find(lambda t: t not in taken and episodes.ids[t] == seq, s + 1)
        if s is None:
            raise ValueError("an episode whose tokens no engine row made")
        taken.add(s)
        out.append(episodes.logp[s])
    return out
