"""Run under `torchrun --nproc-per-node 2`: the FSDP2 gradient of one minibatch, each rank holding half of the
groups, must equal the 1-process gradient of the same global batch (fp32, rtol 1e-4).
argv: loss name (gspo|grpo|gspo_token|dfpo), activation checkpointing (0|1)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from dfpo import dfpo_loss  # noqa: E402
from grpo import grpo_loss  # noqa: E402
from gspo import gspo_loss  # noqa: E402
from gspo_token import gspo_token_loss  # noqa: E402

loss_name, ac = sys.argv[1], sys.argv[2] == "1"
d = common.setup_distributed(0)
assert d.world == 2, "run me with torchrun --nproc-per-node 2"
tok = common.tiny_tokenizer()
policy = common.wrap_policy(common.load_model("tiny", tok, d, seed=0), d, 1.0, 16, ac)
single = common.Policy(common.load_model("tiny", tok, d, seed=0), 1.0, 16)  # same init, not sharded
policy.train(), single.train()

# One global batch, identical on both ranks: 4 groups of G = 4, left-padded prompts, ragged completions.
g = torch.Generator().manual_seed(1)
B, P, T = 16, 6, 7
ids = torch.randint(3, len(tok), (B, P + T), generator=g)
am = torch.ones(B, P + T, dtype=torch.long)
am[::3, :2] = 0  # left padding
lengths = torch.randint(1, T + 1, (B,), generator=g)
mask = (torch.arange(T)[None] < lengths[:, None]).float()
am[:, P:] = mask.long()
ids = ids.masked_fill(am == 0, tok.pad_token_id)
with torch.no_grad():
    old = single(ids, am, P) + 0.05 * torch.randn(B, T, generator=g)  # pi_old a little off the current policy
adv = torch.randn(B, generator=g)
if loss_name == "gspo_token":  # per-token advantages that change sign inside sequences
    adv = (adv[:, None] + torch.randn(B, T, generator=g)) * mask
kw = dict(group_size=4, clip_low=0.004, clip_high=0.005) if loss_name != "grpo" else dict(
    group_size=4, clip_low=0.04, clip_high=0.05)
if loss_name == "dfpo":
    kw["transform"] = "orth-proj-qp"
loss_fn = {"gspo": gspo_loss, "grpo": grpo_loss, "gspo_token": gspo_token_loss, "dfpo": dfpo_loss}[loss_name]

loss, stats = loss_fn(single(ids, am, P), old, adv, mask, **kw)
loss.backward()
half = slice(d.rank * B // 2, (d.rank + 1) * B // 2)  # whole groups on each rank
loss, _ = loss_fn(policy(ids[half], am[half], P), old[half], adv[half], mask[half], **kw)
loss.backward()
assert 0 < stats["losses/clipfrac"] < 1, stats  # some sequences/tokens clipped, some not

worst = 0.0
for (name, p), (_, q) in zip(policy.named_parameters(), single.named_parameters()):
    full = p.grad.full_tensor()
    scale = q.grad.abs().max().item()
    assert scale > 0, name
    assert torch.allclose(full, q.grad, rtol=1e-4, atol=1e-6 * scale), (name, (full - q.grad).abs().max().item(), scale)
    worst = max(worst, ((full - q.grad).abs().max() / scale).item())
if d.main:
    print(f"FSDP2 gradient OK ({loss_name}, activation checkpointing {ac}): worst relative difference {worst:.2e}")
common.cleanup()
