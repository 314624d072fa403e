"""Run under `torchrun --nproc-per-node 2` (tests/test_stats_values.py): --scale-rewards batch divides each rank's
centred rewards by the std of every rank's rewards (TRL/verl "batch"), not of this rank's own. Rank 0 holds the group
[0, 1, 0, 1] (its own std 0.5), rank 1 [0, 4, 0, 4] (its own 2); all eight rewards have the population std
sqrt(4.25 - 1.25^2) = 1.64 (mean 1.25, mean of squares 4.25), so rank 0's advantages are +-0.5 / 1.64 = +-0.305 (by
its own std they would be +-1) and rank 1's +-2 / 1.64 = +-1.22."""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
high = [1.0, 4.0][rank]
rewards = torch.tensor([0.0, high, 0.0, high])
adv, zero = common.group_advantages(rewards, 4, "batch", "population", 1e-6)
sd = math.sqrt(4.25 - 1.25 ** 2)
want = [-high / 2 / (sd + 1e-6), high / 2 / (sd + 1e-6)] * 2
assert max(abs(a - b) for a, b in zip(adv.tolist(), want)) < 1e-6, (rank, adv.tolist(), want)
assert zero == 0
dist.destroy_process_group()
print(f"rank {rank} ok")
