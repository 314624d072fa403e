"""Run under `torchrun --nproc-per-node 2` (tests/test_dynamic_sampling.py): common.sample_groups with
--dynamic-sampling on the tiny model under FSDP2 (gloo), real generate, scripted rewards: every group of rank 0 has
a spread, rank 1's groups are flat in its first two rounds. Both ranks must make the same generate calls (FSDP2's
all-gathers inside generate would hang otherwise), and the counts are summed over the ranks:
  --max-gen-rounds 10: 3 rounds; rank 0 keeps round 0's 2 groups (4 surplus), rank 1 round 2's (4 flat dropped)
  --max-gen-rounds 2:  2 rounds; rank 0: 2 surplus; rank 1: 4 flat, 2 of them fill its batch (2 dropped)"""
import inspect
import os
import sys
from types import SimpleNamespace

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from grouprl import checkpoint  # noqa: E402
import common  # noqa: E402
from grouprl import distributed  # noqa: E402
from grouprl import modeling  # noqa: E402
from grouprl.sampling import Sampling  # noqa: E402

d = distributed.setup_distributed(0)
assert d.world == 2 and d.sharded, "run me with torchrun --nproc-per-node 2"
tok = modeling.tiny_tokenizer()
lm, rank0_weights = modeling.load_model("tiny", tok, d, seed=0)
policy = modeling.wrap_policy(lm, d, 1.0, 16, False, "fp32", rank0_weights=rank0_weights)
policy.eval()
train = Dataset.from_list([{"prompt": f"{i}%10=", "answer": str(i % 10), "text": f"{i}%10="} for i in range(40)])
sampling = Sampling(max_new_tokens=3, gen_batch_size=256)
calls = []
real_generate = common.generate


def generate(*a, **k):
    calls.append(1)
    return real_generate(*a, **k)


def score(texts, answers, n, reward=None, watch=True, truncated=None, truncated_scale=1.0, given=None,
          messages=None):
    """rewards.score's signature (the loop passes truncated=): 0 on rank 1's first two rounds, else 0, 1, 0, ..."""
    flat = d.rank == 1 and len(calls) <= 2  # rank 1: its first two rounds
    return torch.tensor([0.0 if flat else float(i % 2) for i in range(len(texts))]), 0


# the stub takes what the real score takes: a new argument of the loop's call fails here, named
assert list(inspect.signature(score).parameters) == list(inspect.signature(common.score).parameters), (
    inspect.signature(common.score))
common.generate, common.score = generate, score
for max_rounds, want in [(10, (3, 4.0, 4.0, 0.0)), (2, (2, 2.0, 2.0, 2.0))]:
    calls.clear()
    args = SimpleNamespace(prompts_per_rank=2, group_size=2, seed=0, dynamic_sampling=True,
                           max_gen_rounds=max_rounds, truncated_reward_scale=1.0,
                           multi_objective_aggregation="sum-then-normalize", tools=None,
                           environment=None)
    roll = common.sample_groups(policy, tok, train, 1, modeling.eos_ids(lm, tok), d, SimpleNamespace(values={}),
                                sampling, args)
    rows, rewards, logs = roll.rows, roll.rewards, roll.stats
    got = (logs["charts/gen_rounds"], logs["charts/dropped_groups"], logs["charts/surplus_groups"],
           logs["charts/filled_groups"])
    assert len(calls) == want[0] and got == want, (d.rank, len(calls), got, want)
    assert len(rows) == 2 and roll.input_ids.shape[0] == 4 == len(rewards) == len(roll.texts)
    flat_kept = 2 if d.rank == 1 and max_rounds == 2 else 0
    assert rewards.tolist() == [0.0] * 2 * flat_kept + [0.0, 1.0] * (2 - flat_kept), (d.rank, rewards)
if d.main:
    print("dynamic sampling on 2 ranks OK")
checkpoint.cleanup()
