"""Run under `torchrun --nproc-per-node 2` (tests/test_token_weights.py): the step-wide statistics the token weights
and GDPO take over all ranks, with the ranks holding different numbers of completion tokens (so the entropies'
gather pads), equal to one process holding both ranks' rows: the high-entropy threshold and mask, and GDPO's
advantages (each rank's groups normalised where they are, their weighted sums normalised over the whole batch)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(11)
entropy = torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
mask = (torch.arange(5)[None] < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]).double()
values = torch.rand(8, 2, generator=g, dtype=torch.float64).round()
values[3, 1] = float("nan")
weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
rows = slice(0, 2) if rank == 0 else slice(2, 6)  # rank 0: 7 tokens, rank 1: 13
keep, threshold = common.high_entropy_tokens(entropy[rows], mask[rows], 0.3)
assert threshold == torch.quantile(entropy[mask.bool()].float(), 0.7).item(), (threshold, rank)  # TRL's, float32
groups = slice(0, 4) if rank == 0 else slice(4, 8)  # a group of 4 on each rank
summed = (values * weights).nansum(1).float()
adv, _ = common.group_advantages(summed[groups], 4, "group", "bessel", 1e-4, parts=(values[groups], weights))
dist.destroy_process_group()
whole, _ = common.group_advantages(summed, 4, "group", "bessel", 1e-4, parts=(values, weights))  # one process
whole_keep, whole_threshold = common.high_entropy_tokens(entropy, mask, 0.3)
assert torch.equal(keep, whole_keep[rows]) and threshold == whole_threshold, rank
torch.testing.assert_close(adv, whole[groups])
print(f"rank {rank} ok")
