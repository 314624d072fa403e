"""Precision without loss: fp32 master weights computed in bf16 (--dtype bf16, and auto on a GPU) keep AdamW's small
updates, which bf16 weights (--dtype bf16-pure) round away. The GPU path's code runs here on CPU: load_model and
wrap_policy with --dtype bf16 on a CPU device take the branch a GPU run with --dtype auto takes (fp32 weights, the
forward and generate under torch.autocast to bf16); only the device differs."""
import pytest
import torch

import common
from grouprl import distributed
from grouprl import modeling
from helpers import run_script
from grouprl.sampling import Sampling

CPU = distributed.Dist(0, 1, torch.device("cpu"))
B, P, T = 16, 6, 5


def batch(tok):
    """Left-padded prompts, ragged completions (padding after them), advantages of both signs."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    am[::3, :2] = 0
    am[:, P:] = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()
    return ids.masked_fill(am == 0, tok.pad_token_id), am, torch.randn(B, generator=g)


def policy_for(dtype):
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, CPU, seed=0, dtype=dtype)
    return modeling.wrap_policy(lm, CPU, 1.0, 64, False, dtype), tok


def fraction_changed(dtype, steps=8, lr=1e-6):
    """The fraction of weight entries that differ from their initial value after `steps` AdamW steps at the
    real-model default learning rate (1e-6), on a policy-gradient loss, as the scripts step (weight decay 0)."""
    policy, tok = policy_for(dtype)
    ids, am, adv = batch(tok)
    mask = am[:, P:].float()
    init = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = -(adv[:, None] * policy(ids, am, P) * mask).sum() / B
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    changed = sum((p.detach() != q).sum().item() for p, q in zip(policy.parameters(), init))
    return changed / sum(q.numel() for q in init), policy, optimizer


@pytest.fixture(scope="module")
def changed():
    return {dtype: fraction_changed(dtype) for dtype in ("fp32", "bf16", "bf16-pure")}


def test_mixed_precision_keeps_the_small_updates(changed):
    """fp32 weights computed in bf16 change (nearly) every weight, as fp32 does; bf16 weights change a few percent
    (the updates of ~1e-6 are below half their bf16 spacing but for the weights nearest 0): the loss is real."""
    fractions = {dtype: c[0] for dtype, c in changed.items()}
    print(f"weights changed after 8 AdamW steps at lr 1e-6: {fractions}")
    assert fractions["fp32"] > 0.99 and fractions["bf16"] > 0.99, fractions
    assert fractions["bf16-pure"] < 0.05, fractions


def test_mixed_precision_state_is_fp32(changed):
    """--dtype bf16: fp32 weights, gradients' owner and AdamW moments, bf16 compute (autocast); bf16-pure: all bf16."""
    _, mixed, mixed_opt = changed["bf16"]
    _, pure, pure_opt = changed["bf16-pure"]
    assert mixed.autocast == torch.bfloat16 and pure.autocast is None and changed["fp32"][1].autocast is None
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in mixed_opt.state.values())
    assert all(p.dtype == torch.bfloat16 for p in pure.parameters())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in pure_opt.state.values())


def test_bf16_compute_in_forward_and_generate():
    """With fp32 weights and --dtype bf16 the decoder's matmuls run in bf16: in the forward under autocast (log-probs
    and entropies fp32, differing from the fp32 computation of the same weights by bf16 rounding only), in every
    `generate` call (each mode, the prefill of shared-prefill too) on bf16 copies of the weights, after which the fp32
    master weights are back, the same tensors."""
    policy, tok = policy_for("bf16")
    reference, _ = policy_for("fp32")
    for p, q in zip(policy.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # the same fp32 weights
    seen = []
    for layer in policy.lm.get_decoder().layers:
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids, am, _ = batch(tok)
    with torch.no_grad():
        logp, ent = policy(ids, am, P, entropy=True)
        ref_logp, ref_ent = reference(ids, am, P, entropy=True)
    assert set(seen) == {torch.bfloat16} and logp.dtype == ent.dtype == torch.float32
    kept = am[:, P:].bool()
    assert not torch.equal(logp[kept], ref_logp[kept])  # computed in bf16 ...
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=0.05)  # ... to bf16's precision
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0.05)
    masters = [(p.data_ptr(), p.detach().clone()) for p in policy.parameters()]
    for mode in ("shared-prefill", "repeat", "static"):
        seen.clear()
        roll = common.generate(policy.eval(), tok, ["1%10=", "7%10="], 2, [tok.eos_token_id], CPU,
                               Sampling(max_new_tokens=3, gen_batch_size=4, mode=mode))
        assert roll.input_ids.shape[0] == 4 and seen and set(seen) == {torch.bfloat16}, (mode, seen)
        for p, (ptr, value) in zip(policy.parameters(), masters):
            assert p.dtype == torch.float32 and p.data_ptr() == ptr and torch.equal(p, value)


def test_fp32_and_cpu_default_take_no_autocast():
    """--dtype fp32, and auto on CPU: fp32 weights computed in fp32, no autocast region (the numbers of before)."""
    tok = modeling.tiny_tokenizer()
    for dtype in ("fp32", "auto"):
        lm, _ = modeling.load_model("tiny", tok, CPU, seed=0, dtype=dtype)
        policy = modeling.wrap_policy(lm, CPU, 1.0, 64, False, dtype)
        assert policy.autocast is None and all(p.dtype == torch.float32 for p in policy.parameters())
        assert modeling.compute_dtype(dtype, CPU) == torch.float32
    assert modeling.compute_dtype("auto", distributed.Dist(0, 1, torch.device("cuda"))) == torch.bfloat16
    assert modeling.weights_dtype("auto") == modeling.weights_dtype("bf16") == torch.float32
    assert modeling.weights_dtype("bf16-pure") == torch.bfloat16


def test_script_trains_fp32_masters_in_bf16(monkeypatch, tmp_path):
    """gspo.py --dtype bf16 end to end (autocast on CPU): it trains, and its checkpoint holds fp32 weights and fp32
    AdamW moments."""
    from safetensors.torch import load_file

    (tmp_path / "precision_reward.py").write_text("def f(completion, answer):\n    return float(len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # every group has a spread of rewards: a gradient
    rows, run = run_script("gspo", ["--num-steps", "1", "--dtype", "bf16", "--eval-every", "0", "--prompts-per-rank",
                                    "4", "--num-minibatches", "1", "--reward", "precision_reward:f"], monkeypatch,
                           tmp_path / "runs")
    assert rows[-1]["losses/grad_norm"] > 0
    weights = load_file(f"{run}/step_1/state/model.safetensors")  # the master weights
    assert weights and all(w.dtype == torch.float32 for w in weights.values())
    state = torch.load(f"{run}/step_1/state/rank0.pt", weights_only=True)["optimizer"]["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_bf16_pure_is_refused_under_torchrun(monkeypatch, tmp_path):
    import gspo

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["gspo.py", "--dtype", "bf16-pure", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert "--dtype bf16-pure: under torchrun FSDP2 keeps fp32 master weights" in str(e.value.code)
