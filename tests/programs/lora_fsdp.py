"""Run under `torchrun --nproc-per-node 2`: LoRA (rank 4, every linear layer of the decoder) on an FSDP2-sharded
policy with activation checkpointing. The adapters and the base are sharded with their layers and start as one
process's; after two AdamW steps on one global batch (each rank holding half of the groups) the adapters equal one
process's on the whole batch (fp32, to 1e-5) and the base is bitwise unchanged; the engine's merged weights
(engine.take_weights, --gen-mode engine) and a checkpoint's adapters and merged model are one process's too. In bf16
the base is sharded in bf16 beside fp32 adapters, and trains."""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from grouprl import checkpoint  # noqa: E402
from grouprl import distributed  # noqa: E402
from grouprl import engine  # noqa: E402
from grouprl import lora  # noqa: E402
from grouprl import modeling  # noqa: E402
from gspo import gspo_loss  # noqa: E402

d = distributed.setup_distributed(0)
assert d.world == 2, "run me with torchrun --nproc-per-node 2"
tok = modeling.tiny_tokenizer()
spec = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=(lora.ALL_LINEAR,))
lm, rank0_weights = modeling.load_model("tiny", tok, d, seed=0, lora=spec)
policy = modeling.wrap_policy(lm, d, 1.0, 16, True, "fp32", rank0_weights=rank0_weights)
one = distributed.Dist(d.rank, 1, d.device)
single = modeling.Policy(modeling.load_model("tiny", tok, one, seed=0, lora=spec)[0], 1.0, 16)
names = [n for n, _ in single.named_parameters()]
assert [n for n, _ in policy.named_parameters()] == names
for (name, p), (_, q) in zip(policy.named_parameters(), single.named_parameters()):
    assert p.requires_grad == q.requires_grad == ("lora_" in name), name  # only the adapters train
    assert hasattr(p, "full_tensor") and torch.equal(p.full_tensor(), q.detach()), name  # sharded, one process's init

g = torch.Generator().manual_seed(1)
B, P, T = 16, 6, 7
ids = torch.randint(3, len(tok), (B, P + T), generator=g)
am = torch.ones(B, P + T, dtype=torch.long)
lengths = torch.randint(1, T + 1, (B,), generator=g)
mask = (torch.arange(T)[None] < lengths[:, None]).float()
am[:, P:] = mask.long()
adv = torch.randn(B, generator=g)
half = slice(d.rank * B // 2, (d.rank + 1) * B // 2)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
opt1 = torch.optim.AdamW(single.parameters(), lr=1e-2)
for _ in range(2):  # the second step: B != 0, so A gets a gradient too
    policy.train(), single.train()
    with torch.no_grad():
        old = single(ids, am, P)
    loss, *_ = gspo_loss(policy(ids[half], am[half], P), old[half], adv[half], mask[half], clip_low=0.2, clip_high=0.2,
                         norm=B)
    loss.backward()
    loss1, *_ = gspo_loss(single(ids, am, P), old, adv, mask, clip_low=0.2, clip_high=0.2, norm=B)
    loss1.backward()
    opt.step(), opt1.step()
    opt.zero_grad(), opt1.zero_grad()
for (name, p), (_, q) in zip(policy.named_parameters(), single.named_parameters()):
    full = p.full_tensor()
    if "lora_" in name:
        # AdamW steps of 1e-2 each: equal to 1e-5 (its normalised update amplifies fp32 sum-order noise)
        assert torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-5), (name, (full - q).abs().max())
    else:
        assert torch.equal(full, q.detach()), name  # the frozen base: bitwise unchanged on both
assert single.lm.get_decoder().layers[0].self_attn.q_proj.lora_B["default"].weight.abs().sum() > 0  # they moved

# the engine's weights: each adapted weight merged, gathered from the shards, as one process's
policy.eval(), single.eval()
ws = engine.take_weights(policy.lm, 32, d.device, torch.float32)
w1 = engine.take_weights(single.lm, 32, d.device, torch.float32)
for layer, layer1 in zip(ws.layers, w1.layers):
    for k in ("qkv", "o", "gate_up", "down"):
        assert torch.allclose(layer[k][0], layer1[k][0], rtol=1e-5, atol=1e-6), k

# a checkpoint's model part, as checkpoint.save_checkpoint writes it under FSDP2: the gathered full state dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

sd = get_model_state_dict(policy.lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
folder = [tempfile.mkdtemp() if d.main else None]
torch.distributed.broadcast_object_list(folder)
if d.main:
    lora.save_lora(policy.lm, folder[0], folder[0], sd)
distributed.barrier()
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

loaded = PeftModel.from_pretrained(modeling.load_model("tiny", tok, one, 0)[0], os.path.join(folder[0], lora.ADAPTER_DIR))
for (name, p), (_, q) in zip(loaded.named_parameters(), single.lm.named_parameters()):
    assert "lora_" not in name or torch.allclose(p, q, rtol=1e-5, atol=1e-5), name
merged = load_file(os.path.join(folder[0], "model.safetensors"))
assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16

# bf16 (a GPU's auto): the frozen base sharded in bf16, the adapters fp32 (FSDP2 gathers both in bf16, reduces the
# adapters' gradients in fp32); one step trains them
lm, rank0_weights = modeling.load_model("tiny", tok, d, seed=0, dtype="bf16", lora=spec)
policy = modeling.wrap_policy(lm, d, 1.0, 16, True, "bf16", rank0_weights=rank0_weights)
for name, p in policy.named_parameters():
    assert p.to_local().dtype == (torch.float32 if "lora_" in name else torch.bfloat16), name
opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
for _ in range(2):
    with torch.no_grad():
        old = policy(ids[half], am[half], P)
    loss, *_ = gspo_loss(policy(ids[half], am[half], P), old, adv[half], mask[half], clip_low=0.2, clip_high=0.2,
                         norm=B)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in policy.parameters() if p.grad is not None)
    opt.step()
    opt.zero_grad()
assert len(opt.state) == 2 * 2 * 7  # A and B of 7 linear layers in 2 decoder layers
print(f"LoRA FSDP2 OK rank {d.rank}")
checkpoint.cleanup()
