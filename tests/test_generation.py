"""Generation modes (common.generate): each prompt prefilled once and its KV cache repeated to its group gives the
same completions as today's path, where every prompt is repeated n times and prefilled n times."""
import pytest
import torch

import common
from grouprl import data
from grouprl import distributed
from grouprl import modeling
from grouprl.sampling import Sampling


@pytest.fixture(scope="module")
def setup():
    d = distributed.Dist(0, 1, torch.device("cpu"))
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 64, False).eval()
    prompts = data.chat_prompts(tok, ["1%10=", "a longer prompt, 23%10=", "7%10="], False)  # ragged: left padding
    return d, tok, policy, prompts, modeling.eos_ids(lm, tok)


def rollout(setup, mode, gen_batch_size, top_k, prompts=None, seed=0):
    d, tok, policy, default_prompts, eos = setup
    torch.manual_seed(seed)
    return common.generate(policy, tok, prompts or default_prompts, 4, eos, d,
                           Sampling(max_new_tokens=12, top_k=top_k, gen_batch_size=gen_batch_size, mode=mode))


@pytest.fixture(scope="module")
def reference(setup):
    """Today's path in one call: greedy (top_k=1) and sampled (seed 0)."""
    return {top_k: rollout(setup, "repeat", 64, top_k) for top_k in (1, 0)}


@pytest.mark.parametrize("gen_batch_size", [64, 5])  # one call of 3 groups; or 3 calls of one group each
def test_shared_prefill_gives_the_same_tokens(setup, reference, gen_batch_size):
    """Greedy (top_k=1): the same tokens, masks and truncation as today's path. Sampled with the same seed in one
    call: the same tokens too, since each decoding step draws from the same B x n distributions in one order."""
    for top_k in (1, 0) if gen_batch_size == 64 else (1,):
        ref, out = reference[top_k], rollout(setup, "shared-prefill", gen_batch_size, top_k)
        for key in ("input_ids", "attention_mask", "mask", "truncated"):
            assert torch.equal(getattr(ref, key), getattr(out, key)), (top_k, key)
        assert ref.texts == out.texts and ref.n_prompt == out.n_prompt
        assert top_k == 1 or len(set(out.texts)) > 3  # sampled completions differ inside a group


def test_one_token_prompts(setup):
    """Prompts of one token (no chat template) leave no prefix to prefill: shared-prefill pads one column."""
    ref, out = (rollout(setup, mode, 64, 1, prompts=["7", "3"]) for mode in ("repeat", "shared-prefill"))
    assert ref.n_prompt == 1 and out.n_prompt == 2
    assert torch.equal(ref.input_ids[:, 1:], out.input_ids[:, 2:]) and torch.equal(ref.mask, out.mask)


def test_generation_logprobs_equal_the_training_forward(setup):
    """The log-probs each mode's decoding steps see (from its KV cache) equal Policy.forward's on the finished
    sequences, and each other, to float32 tolerance."""
    d, tok, policy, prompts, eos = setup
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    n, P = 4, enc.input_ids.shape[1]
    kw = dict(do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=tok.pad_token_id,
              return_dict_in_generate=True, output_logits=True)
    seen = []
    with torch.no_grad():
        for mode_n, ids, am in [(1, enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)),
                                (n, enc.input_ids, enc.attention_mask)]:
            out = policy.generate(input_ids=ids, attention_mask=am, n=mode_n, **kw)
            comp = out.sequences[:, P:]
            logits = torch.stack(out.logits, 1)  # [B n, T, V]
            seen.append(logits.log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1))
        full_am = torch.cat([enc.attention_mask.repeat_interleave(n, 0), torch.ones_like(comp)], 1)
        forward = policy(out.sequences, full_am, P)
    assert seen[0].shape == (3 * n, 8)
    torch.testing.assert_close(seen[1], seen[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(seen[1], forward, rtol=0, atol=1e-5)


def test_unknown_mode_fails(setup):
    with pytest.raises(ValueError, match="unknown generation mode"):
        rollout(setup, "beam", 64, 1)


def test_static_cache_gives_the_same_tokens_and_logprobs(setup, reference, monkeypatch):
    """--gen-mode static (KV cache allocated once, written in place): the same tokens as today's path under greedy
    decoding, in one call and in calls of 5 rows (a smaller last call), and the same log-probs to float32 tolerance
    as Policy.forward computes on the finished sequences."""
    from transformers import cache_utils

    d, tok, policy, prompts, eos = setup
    made = []
    init = cache_utils.StaticCache.__init__
    monkeypatch.setattr(cache_utils.StaticCache, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    for gen_batch_size in (64, 5):
        out = rollout(setup, "static", gen_batch_size, 1)
        assert len(made) == (1 if gen_batch_size == 64 else 4)  # one cache a generate call: the mode is in effect
        for key in ("input_ids", "attention_mask", "mask", "truncated"):
            assert torch.equal(getattr(reference[1], key), getattr(out, key)), (gen_batch_size, key)
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    ids, am = enc.input_ids.repeat_interleave(2, 0), enc.attention_mask.repeat_interleave(2, 0)
    with torch.no_grad():
        out = policy.generate(input_ids=ids, attention_mask=am, do_sample=False, max_new_tokens=8, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True,
                              cache_implementation="static")
        comp = out.sequences[:, ids.shape[1]:]
        seen = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, comp[..., None]).squeeze(-1)
        forward = policy(out.sequences, torch.cat([am, torch.ones_like(comp)], 1), ids.shape[1])
    torch.testing.assert_close(seen, forward, rtol=0, atol=1e-5)


def held_out(tok, n=4):
    from datasets import Dataset

    prompts = [f"{i}%10=" for i in range(n)]
    texts = data.chat_prompts(tok, prompts, False)
    return Dataset.from_list([{"prompt": p, "answer": p[0], "text": t} for p, t in zip(prompts, texts)])


def test_evaluate_holds_eos_until_min_new_tokens(setup, monkeypatch):
    """The held-out evaluation samples as training does (--min-new-tokens 4): half the vocabulary made EOS, every
    generate call evaluate makes masks EOS for the first 4 tokens, so no completion is shorter than 4 tokens (HF's
    min_new_tokens; without it most stop at their first)."""
    from grouprl import evaluation
    from grouprl.sampling import Sampling

    d, tok, policy, _, _ = setup
    real, lengths = evaluation.generate, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        lengths.append(out.mask.sum(1))
        return out

    monkeypatch.setattr(evaluation, "generate", spy)
    eos = list(range(0, len(tok), 2))
    torch.manual_seed(0)
    held = evaluation.Evaluation(Sampling(max_new_tokens=8, gen_batch_size=64, min_new_tokens=4), k=2)
    evaluation.evaluate(policy, tok, held_out(tok), eos, d, held)
    assert lengths and (torch.cat(lengths) >= 4).all(), lengths
    lengths.clear()
    free = evaluation.Evaluation(Sampling(max_new_tokens=8, gen_batch_size=64), k=2)
    evaluation.evaluate(policy, tok, held_out(tok), eos, d, free)
    assert (torch.cat(lengths) < 4).float().mean() > 0.5  # the flag is what holds them
