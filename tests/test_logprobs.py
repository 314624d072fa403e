"""Chunked log-probs and entropy (logprobs.chunked_logprobs): equal to log_softmax + gather, value and gradient, and
their extra memory does not grow with the number of tokens times the vocabulary."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from grouprl import distributed
from grouprl import logprobs
from grouprl import modeling
from conftest import ROOT


def naive(h, w, b, t, temperature):
    logsm = (F.linear(h, w, b) / temperature).log_softmax(-1)
    return logsm.gather(-1, t[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


class PerChunk(torch.autograd.Function):
    """The head as it was before its buffers were shared (2026-11-25): one autograd node a chunk, fresh [chunk, V]
    tensors in each. The bits the training gradient had then, which the shared-buffer version keeps."""

    @staticmethod
    def logits(h, w, b, temperature):
        z = F.linear(h, w, b)
        return z.to(torch.promote_types(z.dtype, torch.float32)).div_(temperature)

    @staticmethod
    def forward(ctx, h, w, b, t, temperature, entropy):
        z = PerChunk.logits(h, w, b, temperature)
        lse = z.logsumexp(-1)
        logp = z.gather(-1, t[:, None]).squeeze(-1) - lse
        ent = None
        if entropy:
            logp_all = z.sub_(lse[:, None])
            ent = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(h, w, b, t, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, b, t, lse, ent = ctx.saved_tensors
        logp = PerChunk.logits(h, w, b, ctx.temperature).sub_(lse[:, None])
        coef = g_logp[:, None] if g_ent is None else g_logp[:, None] + g_ent[:, None] * (logp + ent[:, None])
        grad_z = logp.exp_().mul_(coef).neg_()
        grad_z.scatter_add_(-1, t[:, None], g_logp[:, None].to(grad_z.dtype))
        grad_z = grad_z.div_(ctx.temperature).to(h.dtype)
        grad_h = grad_z @ w if ctx.needs_input_grad[0] else None
        grad_w = grad_z.T @ h if ctx.needs_input_grad[1] else None
        grad_b = grad_z.sum(0) if b is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def per_chunk(h, w, b, t, temperature, chunk, entropy):
    out = [PerChunk.apply(h[i:i + chunk], w, b, t[i:i + chunk], temperature, entropy) for i in range(0, len(h), chunk)]
    return torch.cat([lp for lp, _ in out]), torch.cat([e for _, e in out]) if entropy else None


def inputs(N, H, V, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    acc = torch.promote_types(dtype, torch.float32)
    return (h, w, b, torch.randint(V, (N,), generator=g), torch.randn(N, generator=g).to(acc),
            torch.randn(N, generator=g).to(acc))


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

    lp, ent = logprobs.chunked_logprobs(h, w, b, t, temperature, chunk, entropy=True)
    grads = torch.autograd.grad((lp * g_logp).sum() + (ent * g_ent).sum(), params)
    lp_ref, ent_ref = naive(h, w, b, t, temperature)
    grads_ref = torch.autograd.grad((lp_ref * g_logp).sum() + (ent_ref * g_ent).sum(), params)
    assert lp.dtype == ent.dtype == dtype
    torch.testing.assert_close(lp, lp_ref, rtol=rtol, atol=rtol)
    torch.testing.assert_close(ent, ent_ref, rtol=rtol, atol=rtol)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=rtol, atol=rtol * r.abs().max().item())
    # log-probs alone (the training pass): the gradient of logp only
    lp = logprobs.chunked_logprobs(h, w, b, t, temperature, chunk)
    grads = torch.autograd.grad((lp * g_logp).sum(), params)
    lp_ref, _ = naive(h, w, b, t, temperature)
    grads_ref = torch.autograd.grad((lp_ref * g_logp).sum(), params)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=rtol, atol=rtol * r.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("N, H, V, chunk", [(37, 8, 50, 5), (37, 8, 50, 100), (130, 32, 1000, 1),
                                            (300, 16, 40000, 64)])  # V >= 32768: a row's sum splits over threads
@pytest.mark.parametrize("bias, temperature, entropy", [(False, 1.0, False), (True, 0.7, True), (False, 0.7, True)])
def test_shared_buffers_keep_the_bits(dtype, N, H, V, chunk, bias, temperature, entropy):
    """One autograd node for every chunk, its [chunk, V] buffers shared by the chunks, its logsumexp written out, the
    gradient for h written in place and the weight gradient summed last chunk first: values, entropies and every
    gradient are the bits of one node a chunk (PerChunk), fp32, fp64 and bf16 alike."""
    h, w, b, t, g_logp, g_ent = inputs(N, H, V, dtype, bias, seed=N + chunk)
    params = [h, w] + ([b] if bias else [])
    got = logprobs.chunked_logprobs(h, w, b, t, temperature, chunk, entropy)
    lp, ent = got if entropy else (got, None)
    lp_ref, ent_ref = per_chunk(h, w, b, t, temperature, chunk, entropy)
    assert torch.equal(lp, lp_ref) and (not entropy or torch.equal(ent, ent_ref))
    grads = torch.autograd.grad((lp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0), params)
    grads_ref = torch.autograd.grad((lp_ref * g_logp).sum() + ((ent_ref * g_ent).sum() if entropy else 0), params)
    for a, r in zip(grads, grads_ref):
        assert a.dtype == r.dtype and torch.equal(a, r)


def test_logsumexp_written_out_is_torchs():
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 100), (3, 40000), (1, 40000)]:
        z = torch.randn(*shape, generator=g) * 7
        z[0, :5] = -torch.inf
        assert torch.equal(logprobs._logsumexp_(z.clone(), torch.empty_like(z)), torch.logsumexp(z, -1))
        in_place = z.clone()  # its intermediate written over z itself (the training pass: z is not needed after)
        assert torch.equal(logprobs._logsumexp_(in_place, in_place), torch.logsumexp(z, -1))
    z = torch.full((2, 10), -torch.inf)
    z[1] = 1.0
    assert torch.equal(logprobs._logsumexp_(z.clone(), torch.empty_like(z)), torch.logsumexp(z, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, H, V, chunk", [(64, 32, 100, 1024), (97, 16, 40000, 32), (130, 8, 1000, 7), (5, 8, 50, 1)])
@pytest.mark.parametrize("dropped", [0.0, 0.05, 0.4, 0.9, 1.0])
def test_no_grad_pass_scores_only_the_kept_rows(dtype, N, H, V, chunk, dropped):
    """keep, without gradient: the kept rows' log-probs and entropies are the bits of the pass without keep (the
    logits of each chunk are computed whole, then the kept rows alone go through the softmax passes; a chunk that
    keeps 1 row, or nearly all, runs whole), the others read 0. Few, many, one and no rows dropped a chunk."""
    h, w, _, t, _, _ = inputs(N, H, V, dtype, False, seed=N)
    keep = torch.rand(N, generator=torch.Generator().manual_seed(1)) >= dropped
    with torch.no_grad():
        lp, ent = logprobs.chunked_logprobs(h, w, None, t, 0.8, chunk, True)
        lp_keep, ent_keep = logprobs.chunked_logprobs(h, w, None, t, 0.8, chunk, True, keep)
        lp_only = logprobs.chunked_logprobs(h, w, None, t, 0.8, chunk, False, keep)
    assert torch.equal(lp_keep[keep], lp[keep]) and torch.equal(ent_keep[keep], ent[keep])
    assert torch.equal(lp_only[keep], lp[keep])
    assert (lp_keep[~keep] == 0).all() and (ent_keep[~keep] == 0).all() and (lp_only[~keep] == 0).all()


@pytest.mark.parametrize("entropy", [False, True])
def test_grad_pass_with_keep_computes_every_row(entropy):
    """keep, with gradient: every row is computed (the weight gradient sums whole chunks, as before), the rows outside
    keep read 0 and get no gradient: the gradient is the bits of the pass without keep whose upstream gradient is 0
    there, as every loss's masking gives it."""
    N, chunk = 130, 32
    h, w, b, t, g_logp, g_ent = inputs(N, 16, 40000, torch.float32, True, seed=3)
    keep = torch.rand(N, generator=torch.Generator().manual_seed(2)) >= 0.4
    params = [h, w, b]
    out = logprobs.chunked_logprobs(h, w, b, t, 0.7, chunk, entropy, keep)
    ref = logprobs.chunked_logprobs(h, w, b, t, 0.7, chunk, entropy)
    lp, ent = out if entropy else (out, None)
    lp_ref, ent_ref = ref if entropy else (ref, None)
    assert torch.equal(lp[keep], lp_ref[keep]) and (lp[~keep] == 0).all()
    loss = (lp * g_logp).sum() + ((ent * g_ent).sum() if entropy else 0)
    assert 0 < keep.sum() < N
    # the pass without keep, its upstream gradient +0 off the mask as a loss's torch.where gives it
    loss_ref = (torch.where(keep, lp_ref, 0.0) * g_logp).sum() + (
        (torch.where(keep, ent_ref, 0.0) * g_ent).sum() if entropy else 0)
    for a, r in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params)):
        assert torch.equal(a, r)


def test_policy_no_grad_pass_equals_the_training_pass():
    """Policy.forward: the no-grad pass (old log-probs, entropy), which skips the padding after EOS, gives the kept
    positions the bits of the pass with gradient, so the first minibatch's ratios are exactly 1; both read 0 after
    EOS."""
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=0)
    policy = modeling.Policy(lm, temperature=0.9, chunk_tokens=16)
    g = torch.Generator().manual_seed(4)
    B, P, T = 12, 5, 9
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones_like(ids)
    am[::4, :2] = 0
    am[:, P:] = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()
    ids = ids.masked_fill(am == 0, tok.pad_token_id)
    with torch.no_grad():
        old, ent = policy(ids, am, P, entropy=True)
    logp = policy(ids, am, P)
    kept = am[:, P:].bool()
    assert logp.requires_grad and torch.equal(old, logp.detach()) and (old[~kept] == 0).all()
    assert (ent[~kept] == 0).all() and (ent[kept] > 0).all()


def test_policy_logprobs_equal_the_model_logits():
    """Policy.forward (decoder -> chunked head over the completion) against the full model's logits, fp32."""
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=0)
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 5, 6
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones_like(ids)
    am[1, :2] = 0  # left padding
    ids = ids.masked_fill(am == 0, tok.pad_token_id)
    policy = modeling.Policy(lm, temperature=0.8, chunk_tokens=7)
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
    the [N, H] and [N] tensors, while log_softmax + gather grows with N x V (one [N, V] float32 is 128 MB at N 1024)."""
    chunked = [peak_extra_mb("chunked", n) for n in (1024, 4096)]
    naive_mb = [peak_extra_mb("naive", n) for n in (1024, 4096)]
    assert naive_mb[1] > 3 * naive_mb[0] and naive_mb[1] - naive_mb[0] > 2 * 384, naive_mb  # 3 [N, V] fp32: +1152 MB
    assert chunked[1] < chunked[0] + 48, chunked  # h, its gradient, targets: 4096 x 32 floats are 0.5 MB
    assert chunked[1] < naive_mb[1] / 8, (chunked, naive_mb)
