"""Chunked log-probs and entropy (common.chunked_logprobs): equal to log_softmax + gather, value and gradient, and
their extra memory does not grow with the number of tokens times the vocabulary."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import common
import distributed
from conftest import ROOT


def naive(h, w, b, t, temperature):
    logsm = (F.linear(h, w, b) / temperature).log_softmax(-1)
    return logsm.gather(-1, t[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("bias, temperature", [(False, 1.0), (True, 0.7)])
def test_chunked_equals_naive_value_and_gradient(dtype, rtol, chunk, bias, temperature):
    g = torch.Generator().manual_seed(chunk)
    N, H, V = 37, 8, 50
    h = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g, dtype=dtype), torch.randn(N, generator=g, dtype=dtype)
    params = [h, w] + ([b] if bias else [])

    lp, ent = common.chunked_logprobs(h, w, b, t, temperature, chunk, entropy=True)
    grads = torch.autograd.grad((lp * g_logp).sum() + (ent * g_ent).sum(), params)
    lp_ref, ent_ref = naive(h, w, b, t, temperature)
    grads_ref = torch.autograd.grad((lp_ref * g_logp).sum() + (ent_ref * g_ent).sum(), params)
    assert lp.dtype == ent.dtype == dtype
    torch.testing.assert_close(lp, lp_ref, rtol=rtol, atol=rtol)
    torch.testing.assert_close(ent, ent_ref, rtol=rtol, atol=rtol)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=rtol, atol=rtol * r.abs().max().item())
    # log-probs alone (the training pass): the gradient of logp only
    lp = common.chunked_logprobs(h, w, b, t, temperature, chunk)
    grads = torch.autograd.grad((lp * g_logp).sum(), params)
    lp_ref, _ = naive(h, w, b, t, temperature)
    grads_ref = torch.autograd.grad((lp_ref * g_logp).sum(), params)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=rtol, atol=rtol * r.abs().max().item())


def test_policy_logprobs_equal_the_model_logits():
    """Policy.forward (decoder -> chunked head over the completion) against the full model's logits, fp32."""
    tok = common.tiny_tokenizer()
    lm, _ = common.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=0)
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 5, 6
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = 0  # left padding
    ids = ids.masked_fill(am == 0, tok.pad_token_id)
    policy = common.Policy(lm, temperature=0.8, chunk_tokens=7)
    logp, ent = policy(ids, am, P, entropy=True)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = lm(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1:-1] / 0.8
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(logp, ref.gather(-1, ids[:, P:, None]).squeeze(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)


def peak_extra_mb(method, tokens):
    p = subprocess.run([sys.executable, "benchmarks/logprob.py", "--run", method, "--tokens", str(tokens), "--vocab",
                        "32768", "--hidden", "32", "--chunk", "512"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["peak_extra_mb"]


def test_chunked_memory_does_not_grow_with_tokens_x_vocab():
    """Peak RSS during forward + backward, in a fresh process each: 4x the tokens costs the chunked version only
    the [N, H] and [N] tensors, while log_softmax + gather grows with N x V (one [N, V] float32 is 256 MB at N 2048)."""
    chunked = [peak_extra_mb("chunked", n) for n in (2048, 8192)]
    naive_mb = [peak_extra_mb("naive", n) for n in (2048, 8192)]
    assert naive_mb[1] > 3 * naive_mb[0] and naive_mb[1] - naive_mb[0] > 2 * 768, naive_mb  # 3 [N, V] fp32: +2304 MB
    assert chunked[1] < chunked[0] + 48, chunked  # h, its gradient, targets: 8192 x 32 floats are 1 MB
    assert chunked[1] < naive_mb[1] / 8, (chunked, naive_mb)
