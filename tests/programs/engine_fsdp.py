"""Run under `torchrun --nproc-per-node 2`: --gen-mode engine on an FSDP2-sharded policy takes each weight's full
tensor and samples exactly what the engine samples from the plain model with the same seed; the ranks generate
different prompts and stop at different lengths, and meet at the next collective without hanging (fp32)."""
import os
import sys
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the scripts, and tests/helpers.py
import common  # noqa: E402
from helpers import sharded_tiny_and_twin  # noqa: E402
from grouprl import distributed  # noqa: E402
from grouprl import modeling  # noqa: E402
from grouprl.data import chat_prompts  # noqa: E402
from grouprl.sampling import Sampling  # noqa: E402

d = distributed.setup_distributed(0)
assert d.world == 2, "run me with torchrun --nproc-per-node 2"
tok = modeling.tiny_tokenizer()
lm, policy, single, one = sharded_tiny_and_twin(d, tok)
eos = modeling.eos_ids(lm, tok)
# rank 0: two short prompts and up to 3 tokens; rank 1: three prompts and up to 12 (it decodes 4x longer)
prompts = chat_prompts(tok, ["1%10=", "2%10="] if d.rank == 0 else ["3%10=", "a longer one, 4%10=", "5"], False)
sampling = Sampling(max_new_tokens=3 if d.rank == 0 else 12, temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=4,
              mode="engine")
torch.manual_seed(7 + d.rank)
sharded = common.generate(policy, tok, prompts, 2, eos, d, sampling)
total = distributed.all_reduce(sharded.mask.sum())  # the next collective: rank 0 waits here for rank 1
torch.manual_seed(7 + d.rank)
plain = common.generate(single, tok, prompts, 2, eos, one, sampling)
assert torch.equal(sharded.input_ids, plain.input_ids), (sharded.input_ids, plain.input_ids)
assert torch.equal(sharded.logp, plain.logp) and torch.equal(sharded.mask, plain.mask)
assert sharded.input_ids.shape[1] - sharded.n_prompt == (3 if d.rank == 0 else 12)
# the sharded policy trains on after the rollout: its forward gives the plain model's log-probs
logp = policy(sharded.input_ids, sharded.attention_mask, sharded.n_prompt)
torch.testing.assert_close(logp, single(plain.input_ids, plain.attention_mask, plain.n_prompt))
print(f"rank {d.rank}: engine FSDP2 OK ({int(total)} completion tokens over both ranks)")
distributed.barrier()

# --gen-mode engine-tp: the layers split over the 2 ranks (each holds 2 of the 4 heads, 1 of the 2 KV heads, half the
# MLP), every rank decoding both ranks' prompts with one random stream: under greedy decoding each rank gets the
# tokens one process gets for its own prompts. Weights made larger than the init's (the same elementwise function
# on both sides), so that greedy rows differ token by token.
for m in (policy, single):
    for p in m.parameters():
        q = p.full_tensor() if hasattr(p, "full_tensor") else p
        if q.dim() == 2:
            p.data.copy_(torch.sin(p.data * 1000) * 0.3)
greedy = replace(sampling, top_k=1, max_new_tokens=8)
tp = common.generate(policy, tok, prompts, 2, eos, d, replace(greedy, mode="engine-tp"))
ref = common.generate(single, tok, prompts, 2, eos, one, replace(greedy, mode="engine"))
assert torch.equal(tp.input_ids, ref.input_ids), (tp.input_ids, ref.input_ids)
torch.testing.assert_close(tp.logp, ref.logp, atol=1e-5, rtol=0)
assert len(set(tp.input_ids[0, tp.n_prompt:].tolist())) > 1  # not one token repeated
print(f"rank {d.rank}: engine-tp OK")
distributed.barrier()

# --min-new-tokens under engine-tp: every rank masks EOS alike (the same counts, the whole LM head on each), so that
# with an EOS that rank 0's first row writes as its second token (masked: it runs on), each rank gets one process's
# masked tokens and log-probs
early = eos + [int(distributed.all_reduce(ref.input_ids[0, ref.n_prompt + 1] * (d.rank == 0)))]
held = replace(greedy, min_new_tokens=4)
tp = common.generate(policy, tok, prompts, 2, early, d, replace(held, mode="engine-tp"))
ref = common.generate(single, tok, prompts, 2, early, one, replace(held, mode="engine"))
assert torch.equal(tp.input_ids, ref.input_ids), (tp.input_ids, ref.input_ids)
torch.testing.assert_close(tp.logp, ref.logp, atol=1e-5, rtol=0)
assert (tp.mask.sum(1) >= 5).all(), tp.mask.sum(1)
free = common.generate(single, tok, prompts, 2, early, one, replace(greedy, mode="engine"))
assert d.rank or free.mask[0].sum() <= 2  # unmasked, rank 0's first row ends by its second token
print(f"rank {d.rank}: engine-tp min_new_tokens OK")
distributed.barrier()
