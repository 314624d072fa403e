"""The Engine's KV cache (a mixin of runner.Engine): its allocation, whole or paged, the block
table through which rows address it (take, share, place, give: the paged pool's bookkeeping, on
the host), where a token's keys and values go (where) and how attention reads them (read: SDPA;
live_blocks and mask_mod: FlexAttention's block mask over each row's own blocks). It reads the
Engine's slots, kv_heads, head_dim and heads (set before init_cache), and static_positions and
static_mask_mod (live_blocks, for the graphs' step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import settings
from .blocks import page_size


class KVCache:
    """The cache is addressed in blocks of positions through a table [slots, blocks a row]. Whole
    (pool_tokens None): every row owns one block of max_len positions for the whole rollout, so
    attention reads the cache as a view. Paged (a pool of pool_tokens positions, in blocks of
    page_size(flex)): rows take blocks from a shared pool as they grow (take/give, on the host), so
    that rows that finish early leave room for more rows: the pool holds fewer positions than slots
    x max_len. FlexAttention reads a row's blocks where they lie (its block mask lists their
    physical indices, live_blocks); SDPA reads a copy of them (one gather a layer and step)."""

    def init_cache(self, slots: int, max_len: int, device, dtype, pool_tokens: int | None,
                   flex: bool, layers: int):
        """The cache of `layers` layers, its block table and the pool's bookkeeping."""
        self.paged = pool_tokens is not None
        self.block = page_size(flex) if self.paged else max_len
        # the block mask's key blocks
        self.flex_block = self.block if self.paged else settings.FLEX_BLOCK
        pool_blocks = pool_tokens // self.block if self.paged else 0
        per_row = -(-max_len // self.block)  # blocks a row of max_len positions spans
        blocks = pool_blocks + 1 if self.paged else slots  # paged: + a block nobody owns (spare)
        # per layer [k/v, blocks, positions in a block, kv heads, head_dim]; zeros, not empty: a
        # masked position still multiplies its value by 0, and 0 x NaN is NaN
        # (a tensor a layer, each at offset 0: a compiled layer is the same code for every layer),
        # flat, [k/v x blocks x positions x heads, head_dim], written in place by index_copy_ on
        # the tensor itself (through a view, inductor's functional copy rewrote the whole cache)
        self.cache_shape = (2, blocks, self.block, self.kv_heads, self.head_dim)
        self.values_at = blocks * self.block * self.kv_heads  # the first row of the values
        self.cache = [torch.zeros(2 * self.values_at, self.head_dim, device=device, dtype=dtype)
                      for _ in range(layers)]
        # each row's blocks; paged, unowned entries point at the spare block, where free slots and
        # rows waiting for a block write what nobody reads
        self.spare = blocks - 1
        self.table = (torch.full((slots, per_row), self.spare, device=device) if self.paged else
                      torch.arange(slots, device=device)[:, None])
        self.owned = [[] for _ in range(slots)]  # paged: each slot's blocks, on the host
        self.free = list(range(pool_blocks))
        # paged, a group's prompt stored once: its full blocks are in all n rows' tables (share),
        # each block counted by the rows that hold it (refs) and freed when the last gives it back
        self.refs = [0] * blocks
        self.borrowed = [0] * slots  # the leading blocks each slot shares with its group's first
        # paged: each physical block's place in the row that owns it, per slot (-1: not the
        # slot's), for FlexAttention's mask_mod, which sees physical positions
        self.logical = (torch.full((slots, blocks), -1, device=device) if self.paged else None)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def take(self, s: int, blocks: int) -> bool:
        """Paged: slot s holds `blocks` blocks (its first positions) after this, or False if the
        pool is short (nothing taken)."""
        need = blocks - len(self.owned[s])
        if need > len(self.free):
            return False
        if need > 0:
            new = [self.free.pop() for _ in range(need)]
            for b in new:
                self.refs[b] = 1
            self.place(s, new)
        return True

    def share(self, s: int, src: int, blocks: int):
        """Paged: slot s (holding none) takes slot src's first `blocks` blocks into its table, the
        same physical blocks (a group's full prompt blocks, which src's prefill writes once; s
        writes from its next block on, its own)."""
        shared = self.owned[src][:blocks]
        for b in shared:
            self.refs[b] += 1
        self.borrowed[s] = len(shared)
        self.place(s, shared)

    def place(self, s: int, new: list[int]):
        """Blocks `new` appended to slot s's row: its host list, block table and logical table."""
        at = len(self.owned[s])
        self.owned[s] += new
        new = torch.tensor(new, device=self.table.device, dtype=torch.long)
        self.table[s, at:at + len(new)] = new
        self.logical[s, new] = torch.arange(at, at + len(new), device=new.device)

    def give(self, s: int):
        """Paged: slot s's blocks back to the pool, each once no other row holds it."""
        if self.paged:
            for b in self.owned[s]:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.free.append(b)
            self.owned[s], self.borrowed[s] = [], 0
            self.table[s] = self.spare
            self.logical[s] = -1

    def where(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's keys (or values) viewed as [-1, head_dim] for slots [N] at positions
        [N] -> [N, kv heads], through the block table."""
        blk = self.table[slots, positions // self.block]
        heads = torch.arange(self.kv_heads, device=slots.device)
        return ((blk * self.block + positions % self.block)[:, None]) * self.kv_heads + heads

    def read(self, c: torch.Tensor, table: torch.Tensor, reach: int) -> torch.Tensor:
        """A layer's keys (or values) c [blocks, block, kv heads, d] of every slot at positions <
        reach (rounded up to a block) -> [slots, kv heads, positions, head_dim]: whole, a view;
        paged, a gather through the block table (SDPA's path; FlexAttention's reads the pool in
        place: [1, kv heads, every position of the pool, head_dim], a view)."""
        if self.paged and self.flex is not None:
            return c.flatten(0, 1)[None].transpose(1, 2)
        if self.paged:  # [slots, blocks, block, heads, d] -> [slots, positions, heads, d]
            c = c[table[:, :self.blocks_for(reach)]].flatten(1, 2)
        return c[:, :reach].transpose(1, 2)

    def live_blocks(self, positions: torch.Tensor, reach: int, alive: torch.Tensor | None = None):
        """FlexAttention's block mask of a decoding step: slot s's queries (its `group` query heads
        of each KV head, hidden's grouped view) read its key blocks 0 .. positions[s] // block
        (block: self.flex_block): the blocks before the last in full, and within the last the
        positions up to its own (the mask_mod, evaluated there only). Whole, its blocks of the
        `reach` positions read; paged, the blocks its row of the table names, indices into the
        whole pool (read in place: page and key block are one size). Built from tensors alone (no
        host sync, shapes set by `reach`): a CUDA graph captures it with the step. The blocks past
        a row's length are never read: a row's cost is its own length, not the longest row's; and a
        slot that `alive` [slots] marks 0 (free, or its row finished) reads no block at all (issue
        34: ~65% of a long rollout's slot-steps)."""
        from torch.nn.attention.flex_attention import BlockMask

        block = self.flex_block
        blocks = -(-reach // block)
        last = (positions // block).clamp(max=blocks - 1)  # the block that holds the row's position
        full, partial = last, torch.ones_like(last)  # blocks 0 .. last - 1: every key visible
        if alive is not None:  # free slots and finished rows read no block at all (their output: 0)
            full, partial = full * alive, partial * alive
        if self.paged:  # the physical blocks; keys: every position of the pool (the mask spans it:
            pool = self.cache_shape[1]  # its indices padded to the pool's count, as inductor asks)
            order = F.pad(self.table[:, :blocks], (0, pool - blocks), value=self.spare)
            keys = pool * block
        else:
            order = torch.arange(blocks, device=positions.device).expand(self.slots, blocks)
            keys = reach
        # the row's last block is the one the mask_mod cuts (positions past the row's own); the
        # full blocks before it are read without evaluating it (and inductor's CPU decoding
        # template, torch 2.13, builds paged only with full blocks given)
        at_last = order.gather(1, last[:, None]).expand_as(order)
        index = lambda x: x.to(torch.int32)[:, None, None]  # noqa: E731  [slots, 1, 1, ...]
        mask_mod = (self.static_mask_mod if positions is self.static_positions else
                    self.mask_mod(positions))
        group = self.heads // self.kv_heads
        return BlockMask.from_kv_blocks(index(partial), index(at_last), index(full), index(order),
                                        BLOCK_SIZE=(block, block), mask_mod=mask_mod,
                                        seq_lengths=(group, keys), compute_q_blocks=False)

    def mask_mod(self, positions: torch.Tensor):
        """FlexAttention's mask_mod of a decoding step: slot b's query sees key kv_idx iff its
        position is at most positions[b]. Whole, kv_idx is the position; paged, a place in the
        pool, whose block holds the row's positions logical[b, block] * block onward (-1: not
        the row's, never seen)."""
        if not self.paged:
            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= positions[b]
            return mask_mod
        logical, block = self.logical, self.block

        def paged_mask_mod(b, h, q_idx, kv_idx):
            at = logical[b, kv_idx // block]
            return (at >= 0) & (at * block + kv_idx % block <= positions[b])
        return paged_mask_mod
