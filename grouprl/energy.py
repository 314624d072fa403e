"""Energy on frequent tokens (DFPO arXiv:2604.13088, eq. 24): the share of the per-token gradient norms
||grad_theta l_t||_2 that falls on a bucket B of tokens grouped by frequency,

    Energy(B) = sum_{t in B} ||grad_theta l_t||_2 / sum_t ||grad_theta l_t||_2.

l_t is token t's term in the loss. The loss L is a function of the completion log-probs, so by the chain rule
grad_theta L = sum_t g_t grad_theta log pi(y_t | x, y_<t) with g_t = dL / d log pi(y_t) (what `logp.grad` holds
after `loss.backward()` with `logp.retain_grad()`), and token t's term is g_t grad_theta log pi(y_t): its norm is
|g_t| ||grad_theta log pi(y_t)||_2. The objectives differ in g_t (clipping, sequence weights, DFPO's in-group
transform); the policy sets ||grad_theta log pi(y_t)||.

Exact, not estimated: one backward pass per completion token (autograd.grad of one log-prob, the forward graph
kept), so its cost is one forward and T backward passes per sequence measured. On SmolLM2-135M on one CPU thread
that is about 0.3-0.5 s a token: callers measure a small subsample of sequences per logged step. Used by the lab
(experiments/); a function of a Policy and tensors, so a script can call it in a line.
"""

from __future__ import annotations

import time

import torch

# the frequency-rank buckets a run logs (--energy-every): the 5 most frequent tokens of the step's
# completions, the next 15, the rest (a short-answer task writes a few dozen distinct tokens)
EDGES = (5, 20)


def token_grad_norms(policy, input_ids, attention_mask, n_prompt: int, mask, coef=None) -> torch.Tensor:
    """||grad_theta l_t||_2 = |coef[i, t]| ||grad_theta log pi(y_it | x_i, y_i,<t)||_2 for every completion token
    of the rows given (mask [B, T] 1 where a token counts; 0 elsewhere) -> [B, T] float64, 0 outside the mask.
    coef [B, T]: g_t = dL / d log pi(y_t) of the loss measured (None: 1, the norms of grad log pi themselves).
    The gradient is over the parameters that require grad (LoRA: the adapters only). One forward a row, one
    backward a token: exact and slow (module docstring)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    norms = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(input_ids.shape[0]):
        logp = policy(input_ids[i:i + 1], attention_mask[i:i + 1], n_prompt)[0]
        tokens = mask[i].nonzero().flatten().tolist()
        for k, t in enumerate(tokens):
            grads = torch.autograd.grad(logp[t], params, retain_graph=k < len(tokens) - 1, allow_unused=True)
            sq = sum(g.detach().double().pow(2).sum() for g in grads if g is not None)
            norms[i, t] = torch.as_tensor(sq, dtype=torch.float64).sqrt()
    if coef is not None:
        norms = norms * coef.detach().double().abs().cpu()
    return norms * mask.double().cpu()


def frequency_ranks(counts: torch.Tensor) -> torch.Tensor:
    """[V] token counts in a reference text -> [V] each token's rank by count (0: the most frequent; ties in
    token-id order)."""
    order = torch.sort(-counts.double(), stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order))
    return ranks


def energy_by_frequency(norms, token_ids, mask, ranks, edges=(10, 100)) -> dict:
    """Eq. 24 for buckets of frequency rank [0, e0), [e0, e1), ..., [e_last, V): {"energy/top{e0}": ...,
    "energy/rank{e0}-{e1}": ..., "energy/rest": ...}, each the bucket's share of the summed norms (they sum to 1;
    nan when every norm is 0). norms, token_ids, mask [B, T]; ranks [V] (frequency_ranks)."""
    keep = mask.bool().cpu()
    n = norms.double().cpu()[keep]
    r = ranks.cpu()[token_ids.cpu()[keep]]
    total = n.sum()
    bounds = [0, *edges, None]
    out = {}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        name = f"energy/top{hi}" if lo == 0 else ("energy/rest" if hi is None else f"energy/rank{lo}-{hi}")
        inside = (r >= lo) & (r < hi) if hi is not None else r >= lo
        out[name] = (n[inside].sum() / total).item() if total > 0 else float("nan")
    return out


def due(args, step: int, update: int = 0, updates: int = 1) -> bool:
    """--energy-every N: Energy at step 1, every N steps and the last; within a step, from the first minibatch
    (update 0 of `updates`) on, or (--energy-minibatch last) on the step's last minibatch only, whose ratios the
    step's earlier updates have moved off 1: there the clip acts, and with it what sets the objectives apart (on a
    first minibatch GSPO and DFPO give every token the same coefficient)."""
    n = args.energy_every
    return (n > 0 and (step == 1 or step % n == 0 or step == args.num_steps)
            and (args.energy_minibatch == "first" or update == updates - 1))


def measure(policy, ids, attention_mask, n_prompt: int, mask, coef, rows: int, counted_ids, counted_mask) -> dict:
    """A run's Energy (eq. 24) on the first `rows` rows of a micro-batch whose loss gradient is not 0 (a flat group's
    rows have none: A_i = 0): ids, attention_mask [B, P + T], mask [B, T], coef [B, T] = logp.grad after the loss's
    backward (g_t = dL / d log pi(y_t)), so the norms are the step's loss's own ||grad l_t|| before that
    micro-batch's optimizer step. The scripts call it on each micro-batch of a due step until one has rows with a
    gradient (on the first minibatch pi_theta = pi_old; a later one has had the step's earlier updates, where GSPO
    and DFPO differ). Frequency ranks are counted over the completion tokens of counted_ids where
    counted_mask (the step's completions in this process). -> energy/top5, energy/rank5-20, energy/rest (shares
    summing to 1; nan when no row has a gradient), energy/tokens measured, energy/seconds it took."""
    t = time.time()
    vocab = int(max(ids.max(), counted_ids.max())) + 1
    counts = torch.bincount(counted_ids[:, n_prompt:][counted_mask.bool()].cpu(), minlength=vocab)
    r = ((coef.detach() * mask) != 0).any(1).nonzero().flatten()[:rows].cpu()
    norms = token_grad_norms(policy, ids[r], attention_mask[r], n_prompt, mask[r], coef[r])
    shares = energy_by_frequency(norms, ids[r, n_prompt:], mask[r], frequency_ranks(counts), EDGES)
    return {**{k: float(v) for k, v in shares.items()}, "energy/tokens": int(mask[r].sum()),
            "energy/seconds": time.time() - t}
