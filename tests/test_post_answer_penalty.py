"""GSPO-token's per-token advantages as the training loop builds them (gspo_token.py main(), one line):
A_it = (A_i - lambda [t after the final answer]) * mask, checked where the loop hands them to gspo_token_loss, and
the logged charts/post_answer_frac. One step of the built-in tiny model, 4 completions (about a second): the line
lives in main(), so no unit test reaches it. Rewards and the post-answer tokens are fixed by hand (the random
model's own are all 0 and rarely hold an answer)."""
import glob
import json
import sys

import pytest
import torch

import gspo_token

REWARDS = [1.0, 0.5, 0.0, 0.5]  # partial credit: A = (+1.41, 0, -1.41, 0)
PENALTY = 0.25


def test_loop_gives_penalised_token_advantages(monkeypatch, tmp_path):
    seen = {}
    real_advantages, real_loss = gspo_token.group_advantages, gspo_token.gspo_token_loss

    def advantages(rewards, *args, **kw):
        out = real_advantages(torch.tensor(REWARDS, dtype=rewards.dtype), *args, **kw)
        seen["adv"] = out[0].clone()
        return out

    def after(tok, completion_ids, mask, texts, eos):
        """Every token of rows 0, 2 and 3 but their first: 'after the answer'; none in row 1."""
        marked = mask.bool().clone()
        marked[:, 0] = False
        marked[1] = False
        seen["after"], seen["roll_mask"] = marked, mask.clone()
        return marked

    def loss(logp, old_logp, token_adv, mask, **kw):
        seen["token_adv"], seen["mask"] = token_adv.detach().clone(), mask.clone()
        return real_loss(logp, old_logp, token_adv, mask, **kw)

    monkeypatch.setattr(gspo_token, "group_advantages", advantages)
    monkeypatch.setattr(gspo_token, "post_answer_tokens", after)
    monkeypatch.setattr(gspo_token, "gspo_token_loss", loss)
    monkeypatch.setattr(sys, "argv", ["gspo_token.py", "--num-steps", "1", "--prompts-per-rank", "1", "--group-size",
                                      "4", "--num-minibatches", "1", "--max-new-tokens", "3", "--eval-every", "0",
                                      "--log-samples", "0", "--post-answer-penalty", str(PENALTY),
                                      "--output-dir", str(tmp_path)])
    gspo_token.main()
    adv, marked, mask = seen["adv"].double(), seen["after"], seen["mask"].double()
    assert torch.equal(seen["mask"], seen["roll_mask"])  # no --mask-truncated: the loss mask is the rollout's
    assert adv[0] > 0 and adv[1] == 0 and adv[2] < 0 and marked.any() and mask.sum() > marked.sum()
    expected = [[(adv[i].item() - PENALTY * marked[i, t].item()) * mask[i, t].item() for t in range(mask.shape[1])]
                for i in range(4)]
    assert seen["token_adv"].double().tolist() == [pytest.approx(row, abs=1e-7) for row in expected]
    (metrics,) = glob.glob(f"{tmp_path}/*/metrics.jsonl")
    row = json.loads(open(metrics).readlines()[-1])
    assert row["charts/post_answer_frac"] == pytest.approx(marked.sum().item() / seen["roll_mask"].sum().item())
