"""The Engine's forward (a mixin of runner.Engine): the Qwen3 / Qwen2 / Llama decoder layers over
the Engine's weights (self.w), a prompt's prefill and a decoding step's hidden state, each layer
writing its keys and values to the KV cache (kvcache.KVCache: where, read, live_blocks) and
attending to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import project


def rms_norm(x, weight, eps: float):
    """As the models' RMSNorm: normalised in float32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    """Rotary embedding, HF's convention (two halves): x [.., heads, L, d], cos/sin [.., L, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class Forward:
    """The layers (layers, layer, row_parallel), the LM head (logits), a prompt's prefill, and a
    decoding step (decode, hidden, attend). It reads the Engine's weights w, heads, kv_heads,
    head_dim, inter, eps, act, world, slots, and its cache, its flex and decode_layer."""

    def layers(self, h, positions, attend):
        """The decoder layers over h [B, L, D] at positions [B, L]; attend(i, q, k, v) -> [B, H, L,
        d] writes layer i's keys and values to the cache and attends."""
        cos, sin = self.w.cos[positions][:, None], self.w.sin[positions][:, None]  # [B, 1, L, d]
        mlp_out = torch.zeros_like(h)
        for i, w in enumerate(self.w.layers):
            h, mlp_out = self.layer(h, mlp_out, w, cos, sin, attend, i)
        return h + mlp_out

    def layer(self, h, mlp_out, w: dict, cos, sin, attend, *args):
        """One decoder layer: h [B, L, D] and the previous layer's MLP output (added here, first,
        so that a compiled step fuses the residual add with this layer's norm) -> (h, this
        layer's MLP output). attend(q, k, v, *args) -> [B, H, L, d] writes the keys and values
        to the cache and attends."""
        B, L, _ = h.shape
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = h + mlp_out
        q, k, v = project(rms_norm(h, w["ln1"], self.eps), w["qkv"], [nq, nk, nk])
        q = q.view(B, L, self.heads, self.head_dim)
        k = k.view(B, L, self.kv_heads, self.head_dim)
        if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head's dimensions
            q, k = rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, *args).transpose(1, 2).reshape(B, L, nq)
        h = h + self.row_parallel(out, *w["o"])
        gate, up = project(rms_norm(h, w["ln2"], self.eps), w["gate_up"], [self.inter] * 2)
        return h, self.row_parallel(self.act(gate) * up, *w["down"])

    def row_parallel(self, x, weight, bias):
        """x @ weight.T; under tensor parallelism each rank holds some of the inputs, so the outputs
        are summed over the ranks (one all-reduce) and the bias added once, after."""
        if self.world == 1:
            return F.linear(x, weight, bias)
        y = F.linear(x, weight)
        torch.distributed.all_reduce(y)
        return y if bias is None else y + bias

    def logits(self, h):
        """[N, D] last hidden states -> [N, V] float32 logits, as HF's generate takes them."""
        return F.linear(rms_norm(h, self.w.norm, self.eps), self.w.head).float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, n: int) -> torch.Tensor:
        """Prompts (token ids) computed once each, their keys and values copied to their n slots
        each (slots [len(prompts) x n], a prompt's adjacent; a slot's blocks shared with an earlier
        one, Engine.share, are written once, by that one); -> logits at each prompt's last token,
        [len(prompts), V]."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.table.device)
        P = int(lengths.max())
        ids = torch.zeros(len(prompts), P, dtype=torch.long, device=self.table.device)
        for b, p in enumerate(prompts):  # right-padded: position t is the prompt's t-th token
            ids[b, :len(p)] = torch.tensor(p, device=ids.device)
        positions = torch.arange(P, device=ids.device).expand(len(prompts), P)

        # where the prompts' keys and values go: every slot of a prompt gets them (not the padding),
        # but for the positions a slot's shared blocks hold (written by its group's first slot)
        borrowed = torch.tensor([self.borrowed[s] * self.block if self.paged else 0
                                 for s in slots.tolist()], device=ids.device)
        valid = ((positions < lengths[:, None]).repeat_interleave(n, 0)  # [slots, P]
                 & (positions[:1] >= borrowed[:, None]))
        at = self.where(slots[:, None].expand(-1, P)[valid],
                        positions.repeat_interleave(n, 0)[valid]).flatten()

        def attend(q, k, v, i):
            for kv, x in enumerate((k, v)):  # [prompts, kv heads, P, d] -> rows of the cache
                x = x.transpose(1, 2).repeat_interleave(n, 0)[valid].flatten(0, 1)
                self.cache[i].index_copy_(0, at + kv * self.values_at, x)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                  scale=self.head_dim ** -0.5)

        h = self.layers(F.embedding(ids, self.w.embed), positions, attend)
        if self.seen is not None:  # the penalty's ids: a new row has read its prompt's, no other
            vocab = self.seen.shape[1]  # (the padding as id `vocab`, a column dropped)
            seen = torch.zeros(len(prompts), vocab + 1, dtype=torch.bool, device=ids.device)
            seen.scatter_(1, ids.masked_fill(positions >= lengths[:, None], vocab), True)
            self.seen[slots] = seen[:, :vocab].repeat_interleave(n, 0)
        return self.logits(h[torch.arange(len(prompts)), lengths - 1])

    @torch.no_grad()
    def extend(self, slots: torch.Tensor, tokens: list[list[int]],
               starts: list[int]) -> torch.Tensor:
        """Rows continued (an episode's next turn): slot slots[b]'s new tokens[b] at its positions
        starts[b] onward, computed in one batch, their keys and values written to the slot's
        cache, each attending to the slot's positions before it (kept in the cache) and causally
        to the new ones; a slot's shared prompt blocks (Engine.share) are read, never written.
        -> logits at each slot's last new token, [len(slots), V]. The tokens a step reads are the
        new ones alone: the history's keys and values are not computed again."""
        dev = self.table.device
        lengths = torch.tensor([len(t) for t in tokens], device=dev)
        M, start = int(lengths.max()), torch.tensor(starts, device=dev)
        ids = torch.zeros(len(tokens), M, dtype=torch.long, device=dev)
        for b, t in enumerate(tokens):  # right-padded: column j is position starts[b] + j
            ids[b, :len(t)] = torch.tensor(t, device=dev)
        valid = torch.arange(M, device=dev) < lengths[:, None]  # [S, M]
        positions = (start[:, None] + torch.arange(M, device=dev)).clamp(max=self.max_len - 1)
        reach = int((start + lengths).max())
        borrowed = torch.tensor([self.borrowed[s] * self.block if self.paged else 0
                                 for s in slots.tolist()], device=dev)
        write = valid & (positions >= borrowed[:, None])  # a shared block: its first row's
        at = self.where(slots[:, None].expand(-1, M)[write], positions[write]).flatten()
        table = self.table[slots, :self.blocks_for(reach)]
        # query j of slot b sees the slot's positions up to its own: [S, 1, M, reach]
        visible = (torch.arange(reach, device=dev) <= positions[:, :, None])[:, None]

        def attend(q, k, v, i):
            for kv, x in enumerate((k, v)):  # [S, kv heads, M, d] -> rows of the cache
                x = x.transpose(1, 2)[write].flatten(0, 1)
                self.cache[i].index_copy_(0, at + kv * self.values_at, x)
            keys, values = (c[table].flatten(1, 2)[:, :reach].transpose(1, 2)
                            for c in self.cache[i].view(self.cache_shape))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                  enable_gqa=True, scale=self.head_dim ** -0.5)

        h = self.layers(F.embedding(ids, self.w.embed), positions, attend)
        if self.seen is not None:  # the penalty's ids: the new ones join what the row has read
            vocab = self.seen.shape[1]  # (the padding as id `vocab`, a column dropped)
            seen = torch.zeros(len(tokens), vocab + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, ids.masked_fill(~valid, vocab), True)
            self.seen[slots] |= seen[:, :vocab]
        return self.logits(h[torch.arange(len(tokens), device=dev), lengths - 1])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, reach: int,
               alive: torch.Tensor | None = None) -> torch.Tensor:
        """One token for every slot: tokens, positions [slots] -> logits [slots, V]."""
        return self.logits(self.hidden(tokens, positions, reach, alive))

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, reach: int,
               alive: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last hidden state [slots, D] for one token of every slot (tokens,
        positions [slots]). Slot s attends to its positions 0..positions[s] and no further, of
        the cache read up to `reach` (> every position, known on the host without a sync):
        through FlexAttention's block mask, which reads each row's live blocks only
        (live_blocks), or with flex off through SDPA and a mask over all `reach` positions;
        grouped heads, no copies. No host sync and no shape that depends on the data: a CUDA graph
        can capture it (step). Each layer runs as self.decode_layer: compiled (one compilation
        serves every layer: same shapes, weights passed in) when the engine compiles."""
        if self.flex is None:
            live = (torch.arange(reach, device=tokens.device) <= positions[:, None])[:, None, None]
        else:
            live = self.live_blocks(positions, reach, alive)
        # where each slot's new key and value go: rows of a layer's (flat) keys
        # (index_copy_ along one dimension: an index_put over slots and positions copies far more)
        at = self.where(torch.arange(self.slots, device=tokens.device), positions).flatten()
        cos, sin = self.w.cos[positions][:, None, None], self.w.sin[positions][:, None, None]
        h = F.embedding(tokens[:, None], self.w.embed)
        mlp_out = torch.zeros_like(h)
        for w, cache in zip(self.w.layers, self.cache):
            h, mlp_out = self.decode_layer(h, mlp_out, w, cos, sin, self.attend, cache, self.table,
                                           at, live, reach)
        h = (h + mlp_out)[:, 0]
        if self.flex is not None and alive is not None:  # a dead slot's state, whatever its empty
            h = torch.where(alive[:, None].bool(), h, 0)  # attention gave: 0, never NaN logits
        return h

    def attend(self, q, k, v, cache, table, at, live, reach: int):
        """A decoding step's attention in one layer: the slots' new keys and values k, v [S, kv
        heads, 1, d] written to the layer's cache (at: hidden's rows), then q [S, H, 1, d] attends
        to each slot's positions (live: FlexAttention's block mask, or SDPA's mask over `reach`)."""
        cache.index_copy_(0, torch.cat((at, at + self.values_at)), torch.cat((k, v)).flatten(0, 2))
        keys, values = (self.read(c, table, reach) for c in cache.view(self.cache_shape))
        # grouped heads as queries of their KV head: head h reads KV head h // group (HF's
        # repeat_kv), so [S, H, 1, d] -> [S, kv heads, group, d] attends with no KV copy (and
        # FlexAttention sees one query head a KV head and `group` queries: its decoding kernel
        # serves any group size, where enable_gqa's wants a power of 2)
        grouped = q.view(self.slots, self.kv_heads, -1, self.head_dim)
        if self.flex is not None:
            out = self.flex(grouped, keys, values, block_mask=live, scale=self.head_dim ** -0.5,
                            kernel_options=self.flex_options)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=live,
                                                 scale=self.head_dim ** -0.5)
        # reshape, not view: a GPU's memory-efficient kernel returns [S, kv, group, d] laid out
        # as [S, group, kv, d], whose (kv, group) do not merge into one dimension in place
        return out.reshape(q.shape)
