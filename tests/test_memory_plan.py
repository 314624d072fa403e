"""The host-memory plan a CPU run makes before the model loads (modeling.check_sizes, issue 38 item 2): the training
forward's activations are planned for one micro-batch, --micro-batch-size or else a minibatch's rows, never the
whole rollout (issue 61 item 2: the plan took all 16 rows where a micro-batch holds 2 or 4)."""
import pytest

from grouprl import distributed, modeling
from grouprl.cli import fill_defaults
from gspo import Args


@pytest.mark.parametrize("micro, rows", [(0, 4), (2, 2)])
def test_the_activations_are_planned_for_one_micro_batch(micro, rows, monkeypatch):
    """4 prompts x 4 completions in 4 minibatches: a minibatch is 4 rows (--micro-batch-size 0), or 2 with
    --micro-batch-size 2; the KV cache is one group's, the rollout all 16 rows."""
    planned = []
    monkeypatch.setattr(distributed, "host_memory_short", lambda parts: planned.append(parts))
    modeling.check_sizes(fill_defaults(Args(prompts_per_rank=4, group_size=4, num_minibatches=4,
                                            micro_batch_size=micro)))
    (parts,) = planned
    assert list(parts) == ["the KV cache of one group (4 rows)", f"the training forward's activations ({rows} rows)",
                           "the rollout's 16 rows"]
    whole = fill_defaults(Args(prompts_per_rank=4, group_size=4, num_minibatches=1))
    modeling.check_sizes(whole)  # one minibatch, no micro-batches: the forward holds all 16 rows
    activations = planned[1]["the training forward's activations (16 rows)"]
    assert parts[f"the training forward's activations ({rows} rows)"] * 16 == activations * rows
