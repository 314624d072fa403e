"""The statistics the training loop logs and reduces, apart from the loop's own map (common.py):
the step's means and variances over micro-batches and ranks (reduce_stats), the token log-ratios'
spread (log_ratio_spread) and the length lab's noise measures (noise_stats), the high-entropy
minority's mask (high_entropy_tokens), a NaN-skipping std (nanstd, GDPO's normalisations) and the
unbiased pass@k of evaluation.
"""

import math

import torch
import torch.distributed as dist

from .distributed import all_gather_cat, all_reduce


def nanstd(x: torch.Tensor, dim: int, unbiased: bool) -> torch.Tensor:
    """The std over dim of the non-NaN entries (keepdim for dim > 0): TRL's nanstd when unbiased
    (divided by n - 1), else by n."""
    keep = dim > 0
    n = (~x.isnan()).sum(dim, keepdim=keep)
    var = ((x - x.nanmean(dim, keepdim=True)) ** 2).nanmean(dim, keepdim=keep)
    return (var * n / (n - 1) if unbiased else var).sqrt()


@torch.no_grad()
def high_entropy_tokens(entropy, mask, quantile: float):
    """The high-entropy minority (Wang et al. 2025, arXiv 2506.01939; TRL's top_entropy_quantile
    rho): 1.0 on the completion tokens whose entropy is at least the (1 - rho) quantile of every
    completion token's entropy on all ranks (linear interpolation, torch.quantile's, as TRL's
    get_high_entropy_mask), 0 elsewhere; and the threshold. entropy, mask: [B, T]. The entropies
    are pi_old's over the whole step, so the mask is one for every update and does not depend on
    micro-batching or ranks; TRL's are the current forward's per micro-batch (the same tokens on
    the first update when the micro-batch is the step's batch)."""
    local = entropy[mask.bool()].float()
    counts = all_gather_cat(torch.tensor([local.numel()]))
    padded = torch.full((int(counts.max()),), -1.0, device=local.device)  # entropies >= 0: -1 pads
    padded[:local.numel()] = local
    gathered = all_gather_cat(padded)
    values = gathered[gathered != -1.0].sort().values
    if values.numel() == 0:
        return torch.zeros_like(mask), 0.0
    # torch.quantile's interpolation, without its 2^24-element limit: rank q (n - 1) in float32
    rank = torch.tensor(1 - quantile, dtype=values.dtype) * (values.numel() - 1)
    below, above = int(rank.floor()), int(rank.ceil())
    threshold = torch.lerp(values[below], values[above], rank - below)
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype), threshold.item()


def moments(x: torch.Tensor, n) -> tuple:
    """(sum, sum of squares, count) in float64: a variance as reduce_stats adds it up."""
    x = x.double()
    return (x.sum(), (x * x).sum(), torch.as_tensor(n, dtype=torch.float64))


NO_MOMENTS = (torch.zeros((), dtype=torch.float64),) * 3  # nothing counted


def log_ratio_spread(logp, old_logp, mask, first: bool) -> dict:
    """The variance of the token log-ratios log w_it = log pi - log pi_old over a micro-batch's
    completion tokens, as (sum, sum of squares, count) for reduce_stats, keyed by whether the
    minibatch is the step's first (where pi = pi_old: 0 up to float error, unless an MoE's routing
    or the rollout's numerics differ) or a later one (pi has taken optimizer steps)."""
    with torch.no_grad():
        spread = moments(torch.where(mask.bool(), logp - old_logp, 0.0), mask.sum())
    return {"losses/log_ratio_var_first": spread if first else NO_MOMENTS,
            "losses/log_ratio_var_later": NO_MOMENTS if first else spread}


def local_grads(policy) -> list[torch.Tensor]:
    """This rank's parameter gradients (an FSDP2 shard's local part)."""
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for p in policy.parameters() if p.grad is not None]


@torch.no_grad()
def noise_stats(logp, old_logp, mask, update: int, grads: list, half: list | None) -> dict:
    """--noise-stats, one micro-batch (half a minibatch): after the first update (update > 0), the
    moments over sequences of x_i = 1/|y_i| sum_t log w_it (log s_i, GSPO's ratio) and of |y_i| x_i
    (log prod_t w_it, the product GRPO's token ratios make); and at the minibatch's second half
    (half: the gradients g_1 after its first; None: this is the first), the cosine between the two
    halves' gradients, g_1 and g_2 = grads - g_1, over every parameter on all ranks (GSPO arXiv
    2507.18071 sec. 3: token-level weights add noise that grows with the length)."""
    rows = mask.sum(1) > 0
    log_sum = torch.where(mask.bool(), logp - old_logp, 0.0).double().sum(1)[rows]
    later = update > 0 and bool(rows.any())
    out = {"noise/seq_log_ratio_var": moments(log_sum / mask.sum(1)[rows], len(log_sum))
           if later else NO_MOMENTS,
           "noise/seq_log_ratio_sum_var": moments(log_sum, len(log_sum)) if later else NO_MOMENTS,
           "noise/grad_cos_first": (0.0, 0.0), "noise/grad_cos_later": (0.0, 0.0)}
    if half is None:
        return out
    dots = torch.zeros(3, dtype=torch.float64, device=grads[0].device)
    for g1, g in zip(half, grads):
        g2 = g - g1
        dots += torch.stack([(g1 * g2).sum(), (g1 * g1).sum(), (g2 * g2).sum()]).double()
    d = all_reduce(dots)
    # a half with no gradient (its groups' rewards all equal) has no direction: not counted
    if d[1] * d[2] > 0:
        key = "noise/grad_cos_first" if update == 0 else "noise/grad_cos_later"
        out[key] = ((d[0] / (d[1] * d[2]).sqrt()).item(), 1.0)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021): 1 - C(n - c, k) /
    C(n, k), the probability that k samples drawn without replacement from the n include a correct
    one."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def reduce_stats(stats: list[dict]) -> dict:
    """One value a key over a step's micro-batches and all ranks: a mean given as (sum, count) is
    the sum of the sums over the sum of the counts, whatever the rows' split; a variance given as
    (sum, sum of squares, count) likewise (absent when nothing was counted); keys ending in
    _min/_max take min/max; any other scalar (one a minibatch) the mean over entries, then ranks."""
    out = {}
    for k in stats[0]:
        if isinstance(stats[0][k], tuple) and len(stats[0][k]) == 3:  # (sum, sum of squares, n)
            total = all_reduce(torch.tensor([[float(x) for x in s[k]] for s in stats],
                                            dtype=torch.float64).sum(0))
            if total[2] > 0:  # the population variance; none counted (no such minibatch): absent
                out[k] = (total[1] / total[2] - (total[0] / total[2]) ** 2).item()
            continue
        if isinstance(stats[0][k], tuple):
            total = all_reduce(torch.tensor([[float(x) for x in s[k]] for s in stats],
                                            dtype=torch.float64).sum(0))
            out[k] = (total[0] / total[1]).item()
            continue
        v = torch.tensor([float(s[k]) for s in stats], dtype=torch.float64)
        if k.endswith("_min"):
            out[k] = all_reduce(v.min(), dist.ReduceOp.MIN).item()
        elif k.endswith("_max"):
            out[k] = all_reduce(v.max(), dist.ReduceOp.MAX).item()
        else:
            out[k] = (all_reduce(v.mean()) / (dist.get_world_size()
                                              if dist.is_initialized() else 1)).item()
    return out
