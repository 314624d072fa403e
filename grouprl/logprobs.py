"""The LM head's log-probs and entropy in chunks of tokens (Policy.forward's last step): log
softmax(z)[target] of z = (h W^T + b) / temperature without ever holding the [N, V] logits, the
backward recomputing each chunk. A function of tensors only, imported by common.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def chunked_logprobs(h, weight, bias, targets, temperature: float = 1.0, chunk_tokens: int = 1024,
                     entropy: bool = False, keep=None):
    """log softmax(z)[target] with z = (h W^T + b) / temperature (and the entropy of that softmax if
    asked) for N rows of hidden states h [N, H] -> [N] in float32 (float64 for a float64 model). The
    LM head runs on `chunk_tokens` rows at a time and the backward recomputes each chunk's logits,
    so the extra memory is O(chunk x V) instead of the O(N x V) of log_softmax(logits).gather(...),
    in training and no-grad passes alike.
    keep [N] bool (None: all rows): the rows outside it read 0 (log-prob and entropy) and get no
    gradient. A pass without gradient skips them: each chunk's logits are computed for all its rows
    as without keep (a matmul's bits can depend on its number of rows), then the softmax passes run
    on the kept rows only, so a kept row gets the bits it gets without keep. A pass with gradient
    computes every row: the backward multiplies each whole chunk's logit gradient into the weight
    gradient, whose sums dropped rows would group differently."""
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    logp, ent = _ChunkedLogprobs.apply(h, weight, bias, targets, temperature, chunk_tokens,
                                       entropy, keep, keep is not None and not grad)
    return (logp, ent) if entropy else logp


def _logsumexp_(z, tmp):
    """torch.logsumexp(z, -1), the same operations in the same order (so the same bits), with its
    [rows, V] intermediate written into tmp (which may be z itself, when z is not needed after)."""
    m = z.amax(-1, keepdim=True)
    m.masked_fill_(m.abs() == math.inf, 0)
    s = torch.sub(z, m, out=tmp).exp_().sum(-1)
    return s.log_().add_(m.squeeze(-1))


def _logits(h, weight, bias, temperature: float, out, low):
    """z = (h W^T + b) / temperature written into out [rows, V] (float32; float64 for a float64
    model), the bits of F.linear(h, weight, bias).to(out.dtype) / temperature: the product in the
    weights' dtype, into `low` (a [rows, V] buffer of that dtype) when that is not out's."""
    prod = out if low is None else low
    if bias is None:
        torch.mm(h, weight.t(), out=prod)
    else:
        torch.addmm(bias, h, weight.t(), out=prod)
    if low is not None:
        out.copy_(low)  # bf16 -> fp32
    if temperature != 1:  # dividing by 1 changes nothing
        out.div_(temperature)
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """Every chunk in one autograd node. Forward keeps only logsumexp (and the entropy) per row;
    backward recomputes each chunk's logits and applies d logp_t / dz = onehot(target) - p and
    d H / dz = -p (log p + H), with p = softmax(z), in place. One set of [chunk, V] buffers serves
    every chunk (the logits in fp32, a second fp32 buffer for the softmax passes or the entropy's
    coefficient, and for a bf16 model the bf16 product), each chunk's gradient for h is written into
    its rows of one [N, H] tensor, and the chunks' weight gradients are summed into one [V, H]
    tensor, last chunk first: the order autograd summed them in when each chunk was its own node,
    so the gradient has the same bits."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature: float, chunk_tokens: int,
                entropy: bool, keep, compact: bool):
        N, V, C = h.shape[0], weight.shape[0], chunk_tokens
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 -> fp32; fp64 stays
        rows_max = min(C, N)
        z_buf = h.new_empty(rows_max, V, dtype=acc)
        low = h.new_empty(rows_max, V, dtype=weight.dtype) if weight.dtype != acc else None
        tmp = h.new_empty(rows_max, V, dtype=acc) if entropy or compact else None
        logp, lse = h.new_zeros(N, dtype=acc), h.new_zeros(N, dtype=acc)
        ent = h.new_zeros(N, dtype=acc) if entropy else None
        kept = keep.cpu() if compact else None  # which rows to score, read once
        for i in range(0, N, C):
            c = min(C, N - i)
            rows, idx = slice(i, i + c), None
            if compact:
                k = int(kept[rows].sum())
                if k == 0:
                    continue
                # gathered when it pays (1/8 of the chunk dropped or more), and not for 1 row:
                # torch sums a single row over V >= 32768 on both threads, in another order
                if 2 <= k <= c - max(1, c // 8):
                    idx = kept[rows].nonzero().squeeze(1)
                    # the runs of kept rows [start, end): each sequence's positions up to its EOS
                    edges = F.pad(kept[rows].to(torch.int8), (1, 1)).diff().nonzero().squeeze(1)
                    runs = edges.view(-1, 2).tolist()
                    idx = idx.to(h.device)
            z = _logits(h[rows], weight, bias, temperature, z_buf[:c],
                        None if low is None else low[:c])
            t = targets[rows]
            if idx is not None:  # the kept rows, gathered after the product of the whole chunk
                k, start = len(idx), 0
                for a, b in runs:  # a copy a run (index_select of rows is many times slower on CPU)
                    tmp[start:start + b - a].copy_(z[a:b])
                    start += b - a
                z, t, spare = tmp[:k], t[idx], z_buf[:k]
            else:
                spare = tmp[:c] if tmp is not None else z  # z is not needed after, without entropy
            target_z = z.gather(-1, t[:, None]).squeeze(-1)
            lse_c = _logsumexp_(z, spare)
            logp_c = target_z - lse_c
            ent_c = None
            if entropy:  # H = -sum_v p log p, with log p = z - lse (z is not needed any more)
                logp_all = z.sub_(lse_c[:, None])
                ent_c = torch.exp(logp_all, out=spare).mul_(logp_all).sum(-1).neg_()
            if idx is None:
                logp[rows], lse[rows] = logp_c, lse_c
                if entropy:
                    ent[rows] = ent_c
            else:
                logp.index_copy_(0, idx + i, logp_c)
                if entropy:
                    ent.index_copy_(0, idx + i, ent_c)
        ent_out = ent
        if keep is not None:  # rows outside keep computed with their whole chunk read 0 too
            logp.masked_fill_(~keep, 0)
            ent_out = None if ent is None else ent.masked_fill(~keep, 0)
        ctx.save_for_backward(h, weight, bias, targets, lse, ent, keep)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logp, ent_out

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, targets, lse, ent, keep = ctx.saved_tensors
        N, V, C, T = h.shape[0], weight.shape[0], ctx.chunk_tokens, ctx.temperature
        if keep is not None:  # the rows outside keep read 0: no gradient
            g_logp = g_logp.masked_fill(~keep, 0)
            g_ent = None if g_ent is None else g_ent.masked_fill(~keep, 0)
        rows_max = min(C, N)
        z_buf = h.new_empty(rows_max, V, dtype=lse.dtype)
        low = h.new_empty(rows_max, V, dtype=weight.dtype) if weight.dtype != lse.dtype else None
        coef_buf = h.new_empty(rows_max, V, dtype=lse.dtype) if g_ent is not None else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = grad_w_chunk = grad_b = None
        for i in reversed(range(0, N, C)):  # last chunk first (the class docstring says why)
            c = min(C, N - i)
            rows = slice(i, i + c)
            hc = h[rows]
            logp = _logits(hc, weight, bias, T, z_buf[:c], None if low is None else low[:c])
            logp = logp.sub_(lse[rows, None])  # log p
            g = g_logp[rows, None]
            coef = g if g_ent is None else (torch.add(logp, ent[rows, None], out=coef_buf[:c])
                                            .mul_(g_ent[rows, None]).add_(g))
            grad_z = logp.exp_().mul_(coef).neg_()  # -p * (g_logp + g_ent (log p + H))
            grad_z.scatter_add_(-1, targets[rows, None], g.to(grad_z.dtype))  # + onehot * g_logp
            if T != 1:
                grad_z.div_(T)
            if low is not None:
                grad_z = low[:c].copy_(grad_z)  # fp32 -> the model's dtype
            if need_h:
                torch.mm(grad_z, weight, out=grad_h[rows])
            if need_w:
                if grad_w is None:
                    grad_w = torch.mm(grad_z.t(), hc)
                else:
                    if grad_w_chunk is None:
                        grad_w_chunk = torch.empty_like(grad_w)
                    grad_w.add_(torch.mm(grad_z.t(), hc, out=grad_w_chunk))
            if bias is not None and need_b:
                grad_b = grad_z.sum(0) if grad_b is None else grad_b.add_(grad_z.sum(0))
        return grad_h, grad_w, grad_b, None, None, None, None, None, None
