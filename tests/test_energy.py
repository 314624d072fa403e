"""energy.py (DFPO arXiv:2604.13088, eq. 24) in float64 on the tiny model: each token's gradient norm equals a
separate autograd computation written here from HF's plain logits (to 1e-6: HF's RMSNorm computes in float32 even
in a float64 model, so a gradient's bits depend on how it is reached; a wrong coefficient, token or mask is off by
far more), the per-token terms add up to the loss's own
gradient (the chain rule the module's l_t rests on), and the buckets' shares are eq. 24 on numbers given by hand."""
import math

import torch

from grouprl import energy
from grouprl import modeling
from gspo import gspo_loss


def tiny_batch():
    """A float64 tiny model and 2 rows: prompts of 3 and 2 tokens (the second left-padded), completions of 4
    tokens, the second row's last one padding after its EOS (attention mask 0)."""
    torch.manual_seed(0)
    tok = modeling.tiny_tokenizer()
    lm = modeling.tiny_model(tok).double()
    ids = torch.randint(10, 90, (2, 7))
    ids[1, 0] = tok.pad_token_id
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 0] = 0
    am[1, 6] = 0
    mask = am[:, 3:].double()
    return lm, ids, am, mask


def plain_logp(lm, ids, am, n_prompt):
    """log pi(y_t) from HF's own logits, log_softmax and gather: not Policy.forward's chunked LM head."""
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = lm(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, n_prompt - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:, None])[..., 0]


def test_token_norm_equals_an_independent_autograd_computation():
    lm, ids, am, mask = tiny_batch()
    policy = modeling.Policy(lm)
    coef = torch.tensor([[0.5, -2.0, 1.0, 3.0], [-1.5, 0.25, 4.0, 7.0]], dtype=torch.float64)
    got = energy.token_grad_norms(policy, ids, am, 3, mask, coef)
    assert got.dtype == torch.float64 and got.shape == (2, 4)
    params = list(lm.parameters())
    for i in range(2):
        logp = plain_logp(lm, ids[i:i + 1], am[i:i + 1], 3)[0]
        for t in range(4):
            if mask[i, t] == 0:
                assert got[i, t] == 0  # the padding after EOS is no token
                continue
            grads = torch.autograd.grad(coef[i, t] * logp[t], params, retain_graph=True)  # l_t = g_t log pi(y_t)
            want = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
            assert want > 1e-3
            assert abs(got[i, t].item() - want) <= 1e-6 * want, (i, t, got[i, t].item(), want)


def test_token_terms_add_up_to_the_gradient_of_the_loss():
    """sum_t g_t grad log pi(y_t) = grad L for GSPO's loss (eq. 42), with s_i != 1 (old log-probs shifted)
    and one sequence clipped: what makes |g_t| ||grad log pi(y_t)|| the norm of token t's own term."""
    lm, ids, am, mask = tiny_batch()
    policy = modeling.Policy(lm)
    params = list(lm.parameters())
    logp = policy(ids, am, 3)
    old = logp.detach() + torch.tensor([[1e-4, -2e-4, 0.0, 1e-4], [0.3, 0.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _, stats = gspo_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask,
                               clip_low=3e-4, clip_high=4e-4)
    g = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    full = torch.autograd.grad(loss, params, retain_graph=True)
    summed = [torch.zeros_like(p) for p in params]
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                for acc, d in zip(summed, torch.autograd.grad(logp[i, t], params, retain_graph=True)):
                    acc += g[i, t] * d
    assert g[1].abs().sum() == 0  # the second sequence's ratio is clipped: no gradient, no energy
    assert g[0].abs().sum() > 0
    scale = max(float(a.abs().max()) for a in full)
    for a, b in zip(full, summed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale)  # float32 RMSNorm inside HF


def test_energy_buckets_are_eq_24_by_hand():
    # vocabulary of 6; counts give ranks: token 4 (9) -> 0, token 1 (5) -> 1, token 0 (5) -> 2 (ties by id:
    # 0 before 1, so token 0 -> 1, token 1 -> 2), token 5 (2) -> 3, tokens 2, 3 (0) -> 4, 5
    counts = torch.tensor([5, 5, 0, 0, 9, 2])
    ranks = energy.frequency_ranks(counts)
    assert ranks.tolist() == [1, 2, 4, 5, 0, 3]
    tokens = torch.tensor([[4, 0, 3], [1, 5, 4]])
    norms = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token (4, norm 32) is padding: not counted
    out = energy.energy_by_frequency(norms, tokens, mask, ranks, edges=(1, 3))
    # ranks of the kept tokens: 0 (1.0), 1 (2.0), 5 (4.0), 2 (8.0), 3 (16.0); total 31
    assert out == {"energy/top1": 1 / 31, "energy/rank1-3": 10 / 31, "energy/rest": 20 / 31}
    assert math.isnan(energy.energy_by_frequency(norms * 0, tokens, mask, ranks)["energy/top10"])


def test_a_run_logs_the_energy_of_its_own_loss(monkeypatch):
    """energy.measure as the scripts' loop calls it (the first micro-batch, after its backward, before the optimizer
    step): the rows measured are the first ones whose loss gradient is not 0 (row 0 here has none: a flat group's
    A_i = 0), the norms are |g_t| ||grad log pi(y_t)|| with g_t = logp.grad, and the buckets rank tokens by their
    count in the completions given (ties by id), all written here by hand."""
    lm, ids, am, mask = tiny_batch()
    policy = modeling.Policy(lm)
    ids = torch.cat((ids[:1], ids))  # 3 rows: row 0 a copy of row 1 with no gradient
    am, mask = torch.cat((am[:1], am)), torch.cat((mask[:1], mask))
    coef = torch.tensor([[0.0] * 4, [0.5, -2.0, 1.0, 3.0], [-1.5, 0.25, 4.0, 0.0]], dtype=torch.float64)
    counted = torch.tensor([[1, 1, 1, 20, 20, 20, 20], [1, 1, 1, 30, 30, 30, 21]])  # prompts: 3 tokens
    counted_mask = torch.ones(2, 4)
    got = energy.measure(policy, ids, am, 3, mask, coef, 1, counted, counted_mask)
    # row 1 alone (the first with a gradient); ranks: 20 (4 times) 0, 30 (3) 1, 21 (1) 2, every other id after
    norms = energy.token_grad_norms(policy, ids[1:2], am[1:2], 3, mask[1:2], coef[1:2])[0]
    rank = {20: 0, 30: 1, 21: 2}
    other = sorted(set(range(100)) - set(rank))
    rank.update({t: 3 + other.index(t) for t in other})
    by_bucket = {"energy/top5": 0.0, "energy/rank5-20": 0.0, "energy/rest": 0.0}
    for t in range(4):
        r = rank[int(ids[1, 3 + t])]
        by_bucket["energy/top5" if r < 5 else "energy/rank5-20" if r < 20 else "energy/rest"] += norms[t].item()
    total = sum(by_bucket.values())
    for k, v in by_bucket.items():
        assert math.isclose(got[k], v / total, rel_tol=1e-12), (k, got[k], v / total)
    assert got["energy/tokens"] == 4 and got["energy/seconds"] >= 0
    two = energy.measure(policy, ids, am, 3, mask, coef, 2, counted, counted_mask)
    assert two["energy/tokens"] == 7  # rows 1 and 2 (row 2's last token is padding)
    flat = energy.measure(policy, ids, am, 3, mask, torch.zeros_like(coef), 2, counted, counted_mask)
    assert flat["energy/tokens"] == 0 and all(math.isnan(flat[k]) for k in by_bucket)


def test_energy_due():
    from types import SimpleNamespace

    every = lambda n: SimpleNamespace(energy_every=n, num_steps=10, energy_minibatch="first")  # noqa: E731
    due = [s for s in range(1, 11) if energy.due(every(4), s)]
    assert due == [1, 4, 8, 10]
    assert not any(energy.due(every(0), s) for s in range(1, 11))
    # --energy-minibatch: from the first minibatch on (any update), or the last of the step's 4 updates only
    first = SimpleNamespace(energy_every=4, num_steps=10, energy_minibatch="first")
    last = SimpleNamespace(energy_every=4, num_steps=10, energy_minibatch="last")
    assert [u for u in range(4) if energy.due(first, 4, u, 4)] == [0, 1, 2, 3]
    assert [u for u in range(4) if energy.due(last, 4, u, 4)] == [3]
    assert not any(energy.due(last, 3, u, 4) for u in range(4))
