"""Run under `torchrun --nproc-per-node N`: a checkpoint resumed on another world size (tests/test_resume.py).
argv: out_dir, then `save` (a fresh tiny model with odd dim-0 sizes, 2 AdamW steps, checkpoint out_dir/run/step_2) or
`load CKPT NEXT_STEP` (resume CKPT, check it, one more step, checkpoint out_dir/run/step_NEXT_STEP).
Each save also writes out_dir/ref_STEP.pt (rank 0): the full weights and AdamW state as DCP's
get_*_state_dict(full_state_dict=True) gathers them from the shards, and the loss on a fixed batch. A load checks
that the same gathering after resume_state gives the same tensors (bitwise: resharding copies rows) and the same
loss (float tolerance: another world size sums in another order), and that each rank's RNG was re-seeded from
(seed, step, rank)."""
import math
import os
import sys
import types

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from grouprl import checkpoint  # noqa: E402
from grouprl import distributed  # noqa: E402
from grouprl import modeling  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
d = distributed.setup_distributed(0)
tok = modeling.tiny_tokenizer()
args = types.SimpleNamespace(seed=7, keep_checkpoints=0)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

if phase == "save":
    base = os.path.join(out, "base")
    if d.main:  # odd dim-0 sizes (127, 383): FSDP2's uneven chunks on 2 ranks (64 + 63 rows)
        from transformers import Qwen3ForCausalLM

        config = modeling.tiny_config(tok)
        config.hidden_size, config.intermediate_size = 127, 383
        distributed.seed_everything(0)
        Qwen3ForCausalLM(config).save_pretrained(base)
    distributed.barrier()
    name, step = base, 0
else:
    name, step = sys.argv[3], int(sys.argv[3].rsplit("_", 1)[1])
lm, rank0_weights = modeling.load_model(name, tok, d, seed=0)
policy = modeling.wrap_policy(lm, d, 1.0, 16, False, rank0_weights=rank0_weights)
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)

# one fixed batch of 4 rows; each rank takes its share, divided by the global count (FSDP2 sums the gradients)
g = torch.Generator().manual_seed(1)
B, P, T = 4, 5, 6
ids = torch.randint(3, len(tok), (B, P + T), generator=g)
am = torch.ones(B, P + T, dtype=torch.long)
mine = slice(d.rank * B // d.world, (d.rank + 1) * B // d.world)


def loss_on_batch():
    """The fixed batch's loss, summed over ranks (a forward under FSDP2 is collective)."""
    with torch.no_grad():
        loss = -policy(ids[mine], am[mine], P).sum() / B
    return distributed.all_reduce(loss.detach().reshape(1)).item()


def train_step():
    loss = -policy(ids[mine], am[mine], P).sum() / B
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return distributed.all_reduce(loss.detach().reshape(1)).item()


def full_state():
    return get_model_state_dict(policy.lm, options=FULL), get_optimizer_state_dict(policy, optimizer, options=FULL)


def save(step):
    os.makedirs(os.path.join(out, "run"), exist_ok=True)  # a script's run folder exists before its first save
    checkpoint.save_checkpoint(os.path.join(out, "run"), step, policy, tok, optimizer, scheduler, d, args,
                               "reshard.py", reward_curve=[], nonfinite_run=0, wall_time=0.0)
    weights, optim = full_state()
    loss = loss_on_batch()
    if d.main:
        torch.save({"weights": weights, "optim": optim, "loss": loss}, os.path.join(out, f"ref_{step}.pt"))


if phase == "save":
    for _ in range(2):
        train_step()
    save(2)
else:
    state = checkpoint.resume_state(name, optimizer, scheduler, d)
    assert state["step"] == step
    # the rule for RNGs on another world size: each rank seeded from (seed, step, rank)
    distributed.seed_rank(args.seed + step, d)
    want = torch.rand(3)
    checkpoint.resume_state(name, optimizer, scheduler, d)  # again: the RNG as resume leaves it
    assert torch.equal(torch.rand(3), want)
    ref = torch.load(os.path.join(out, f"ref_{step}.pt"), weights_only=True)
    weights, optim = full_state()
    if d.main:  # rank 0 holds the gathered tensors (cpu_offload)
        assert weights.keys() == ref["weights"].keys()
        for k, v in weights.items():
            assert torch.equal(v, ref["weights"][k]), k
        assert optim["state"].keys() == ref["optim"]["state"].keys()
        moments = 0
        for k, s in optim["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(s[key], ref["optim"]["state"][k][key]), (k, key)
            moments += s["exp_avg"].numel()
        assert moments == sum(p.numel() for p in policy.parameters())  # every parameter's moments, whole
    assert optimizer.param_groups[0]["lr"] == 1e-2
    loss = loss_on_batch()
    assert abs(loss - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (loss, ref["loss"])
    after = train_step()
    assert math.isfinite(after), after
    save(int(sys.argv[4]))
    if d.main:
        print(f"resharded resume OK on {d.world} rank(s): weights and AdamW state equal, loss {loss:.6f} vs "
              f"{ref['loss']:.6f} written, next step's loss {after:.6f}")
checkpoint.cleanup()
