"""Run under `torchrun --nproc-per-node 2`: the FSDP2 gradient of one minibatch, each rank holding half of the
groups, must equal the 1-process gradient of the same global batch (fp32, rtol 1e-4).
argv: one or more cases, each loss:ac:dtype:micro[:per-rank-mean]: the loss (gspo|grpo|gspo_token|dfpo|cispo|sapo|gmpo|vespo|
grpo_token_mean), activation checkpointing (0|1), compute dtype (fp32|bf16), the micro-batch size on each rank (0: all
its rows), and per-rank-mean for the normalisation bug, which must fail.
fp32 compares to rtol 1e-4; bf16 (FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 shards and reduction) against the
same model run in bf16 in one process, to 5% of the largest gradient entry.
The cases share one launch (a torchrun start costs ~5 s on 2 cores): rank 0 prints a line a case, `OK <case>: ...` or
`FAIL <case>: <the assertion>`. Every assertion is decided on values equal on both ranks (full gradients, the
1-process reference), so both ranks take the same branch and the next case's collectives stay paired."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the scripts, and tests/helpers.py
from grouprl import checkpoint  # noqa: E402
import common  # noqa: E402
from grouprl import distributed  # noqa: E402
from grouprl import modeling  # noqa: E402
from cispo import cispo_loss  # noqa: E402
from dfpo import dfpo_loss, group_weights, sequence_weights  # noqa: E402
from gmpo import gmpo_loss  # noqa: E402
from sapo import sapo_loss  # noqa: E402
from vespo import vespo_loss  # noqa: E402
from grpo import grpo_loss  # noqa: E402
from gspo import gspo_loss  # noqa: E402
from gspo_token import gspo_token_loss  # noqa: E402
from helpers import mean  # noqa: E402

d = distributed.setup_distributed(0)
assert d.world == 2, "run me with torchrun --nproc-per-node 2"
tok = modeling.tiny_tokenizer()


def check(loss_name: str, ac: bool, dtype: str, micro: int, per_rank_mean: bool) -> float:
    """One case; -> the worst difference relative to the largest entry of a parameter's gradient."""
    # FSDP2: built on the meta device, rank 0's weights scattered to fp32 shards, computed in `dtype`, reduced in fp32
    lm, rank0_weights = modeling.load_model("tiny", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 16, ac, dtype, rank0_weights=rank0_weights)
    one = distributed.Dist(d.rank, 1, d.device)
    single = modeling.Policy(modeling.load_model("tiny", tok, one, seed=0, dtype=dtype)[0], 1.0, 16)  # same, 1 process
    policy.train(), single.train()
    for (name, p), (_, q) in zip(policy.named_parameters(), single.named_parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.full_tensor().to(q.dtype), q.detach()), name  # fp32 masters
    for (name, b), (_, c) in zip(policy.named_buffers(), single.named_buffers()):
        assert torch.equal(b.to(c.dtype), c), name  # buffers outside the state dict (rotary inv_freq) from rank 0

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
    kw = (dict(clip_low=0.04, clip_high=0.05) if loss_name.startswith(("grpo", "cispo", "gmpo"))
          else dict(clip_low=0.004, clip_high=0.005))
    if dtype == "bf16":  # bf16 rounding moves ratios by ~1e-2: keep them off the clip edges so no clip decision flips
        kw.update(clip_low=0.5, clip_high=0.5)
    if loss_name == "dfpo":
        kw.update(group_size=4, transform="orth-proj-qp")
    norm = B  # the global count the scripts divide by: sequences, or tokens for token-mean (all-reduced there)
    if loss_name == "grpo_token_mean":  # DAPO's token-mean: the ranks hold different token counts
        loss_name, kw["loss_agg"], norm = "grpo", "token-mean", mask.sum().item()
    if loss_name == "cispo":  # CISPO's default: token-mean too
        kw["loss_agg"], norm = "token-mean", mask.sum().item()
    if loss_name == "sapo":  # the soft gate: clip_low/high only set the logged band
        kw.update(tau_pos=1.0, tau_neg=1.05)
    if loss_name == "vespo":  # the Gamma weight, token-mean as TRL's
        kw.update(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, loss_agg="token-mean")
        norm = mask.sum().item()
    loss_fn = {"gspo": gspo_loss, "grpo": grpo_loss, "gspo_token": gspo_token_loss, "dfpo": dfpo_loss,
               "cispo": cispo_loss, "sapo": sapo_loss, "gmpo": gmpo_loss, "vespo": vespo_loss}[loss_name]

    loss, _, stats = loss_fn(single(ids, am, P), old, adv, mask, **kw)  # the mean over the B rows
    loss.backward()
    half = slice(d.rank * B // 2, (d.rank + 1) * B // 2)  # whole groups on each rank
    s_tilde = {}  # DFPO with micro-batches that split groups: s_tilde of the rank's rows first, from whole groups
    if loss_name == "dfpo" and micro % 4:
        clip = dict(clip_low=kw["clip_low"], clip_high=kw["clip_high"])
        with torch.no_grad():
            logp = torch.cat([policy(ids[mu], am[mu], P) for mu in common.micro_batches(half, micro)])
            _, _, s_bar = sequence_weights(logp, old[half], adv[half], mask[half], **clip)
            s_tilde = dict(s_tilde=group_weights(s_bar, adv[half], mask[half], group_size=4, transform="orth-proj-qp",
                                                 floor=1e-6, length_aware=False))
    for mu in common.micro_batches(half, micro):  # as the scripts: divided by the global count B
        given = {k: v[mu.start - half.start:mu.stop - half.start] for k, v in s_tilde.items()}
        loss, _, _ = loss_fn(policy(ids[mu], am[mu], P), old[mu], adv[mu], mask[mu], **kw, **given,
                          norm=(half.stop - half.start) if per_rank_mean else norm)
        loss.backward()
    assert 0 < mean(stats["losses/clipfrac"]) < 1 or dtype == "bf16", stats  # some sequences/tokens clipped, some not

    # fp32: the same sums in another order. bf16: both sides round each op to 8 bits of mantissa, in other orders
    rtol, atol = (1e-4, 1e-6) if dtype == "fp32" else (5e-2, 5e-2)
    worst = 0.0
    for (name, p), (_, q) in zip(policy.named_parameters(), single.named_parameters()):
        assert p.grad.dtype == torch.float32, name  # reduced and kept in fp32
        full, ref = p.grad.full_tensor(), q.grad.float()
        scale = ref.abs().max().item()
        assert scale > 0, name
        assert torch.allclose(full, ref, rtol=rtol, atol=atol * scale), (name, (full - ref).abs().max().item(), scale)
        worst = max(worst, ((full - ref).abs().max() / scale).item())
    return worst


for case in sys.argv[1:]:
    loss, ac, dtype, micro, *bug = case.split(":")
    try:  # per-rank-mean: the bug, divide by this rank's count only
        worst = check(loss, ac == "1", dtype, int(micro), bug == ["per-rank-mean"])
        line = f"OK {case}: worst relative difference {worst:.2e}"
    except AssertionError as e:
        line = f"FAIL {case}: {e!r}"
    if d.main:
        print(line, flush=True)
checkpoint.cleanup()
