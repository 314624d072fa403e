"""Answer extraction, numeric equivalence, group advantages; model text is parsed, never executed."""
import os

import pytest
import torch

from common import group_advantages, math_reward
from grader import extract_answer, parse_number
from test_train import run_script


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72"),  # gsm8k reference format
    ("so the total is\n#### 1,234", "1,234"),
    ("#### -3.5 dollars", "-3.5"),
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{x^{2}+1}", "x^{2}+1"),  # the last box, nested braces
    ("I think it is 12, no wait, 15.", "15"),  # last number
    ("no digits here", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("a, b", [
    ("72", "72.0"), ("1,234", "1234"), ("0.5", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{4}", "0.75"),
    ("-\\frac{2}{4}", "-0.5"), ("$18", "18"), ("50%", "50"), ("3.", "3"), ("\\frac12", "0.5"), (".25", "1/4"),
])
def test_numeric_equivalence(a, b):
    assert parse_number(a) is not None and parse_number(a) == parse_number(b)


def test_math_reward():
    assert math_reward("... so she has \\boxed{1,000} apples", "1000") == 1.0
    assert math_reward("... #### 7", "7") == 1.0
    assert math_reward("... #### 8", "7") == 0.0
    assert math_reward("the result is 3/6", "\\frac{1}{2}") == 1.0
    assert math_reward("\\boxed{x+1}", "x + 1") == 1.0  # not a number: normalised text
    assert math_reward("", "1") == 0.0
    assert parse_number("1/0") is None  # no crash on a zero denominator


def test_code_in_completion_is_not_executed(tmp_path):
    """A completion with code is scored by parsing only: the code's result (42) is not its answer, and its
    side effect never happens."""
    marker = tmp_path / "pwned"
    code = (f"```python\nimport os\nopen({str(marker)!r}, 'w').write('x')\nprint(6*7)\n```\n"
            f"__import__('os').system('touch {marker}')")
    assert math_reward(code, "42") == 0.0  # the last number in the text is 7, from 6*7
    boxed = f"\\boxed{{__import__('os').system('touch {marker}')}}"  # the code as the final answer: parsed as LaTeX
    assert math_reward(code + boxed, "42") == 0.0 and math_reward(boxed, "0") == 0.0
    assert not marker.exists() and not os.path.exists(str(marker))


def test_group_advantages_worked_example():
    """The blog's group: rewards [1,0,1,0] give A = [+1,-1,+1,-1] (mean 0.5, population std 0.5)."""
    adv, zero = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5) and zero == 0


def test_group_advantages_equal_groups_and_no_std():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.2, 0.4, 0.9])
    adv, zero = group_advantages(r, 3)
    assert zero == 2 and torch.all(adv[:6] == 0)
    g = r[6:].double()
    assert torch.allclose(adv[6:].double(), (g - g.mean()) / g.std(unbiased=False), atol=1e-5)
    adv, _ = group_advantages(r, 3, "none")
    assert torch.allclose(adv[6:].double(), g - g.mean(), atol=1e-6)


def test_scale_rewards_batch_divides_by_the_std_of_the_whole_batch():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5])
    adv, zero = group_advantages(r, 3, "batch")
    centred = r.view(3, 3) - r.view(3, 3).mean(1, keepdim=True)
    assert zero == 1 and torch.allclose(adv, (centred / r.std(unbiased=False)).view(-1), atol=1e-6)  # 0.4444 std
    with pytest.raises(ValueError, match="group, batch or none"):
        group_advantages(r, 3, "tokens")


def test_mask_truncated_takes_a_completion_out_of_the_gradient(monkeypatch, tmp_path):
    """--mask-truncated: the rows without EOS get mask 0, so their log-probs get no gradient, and they are counted."""
    from gspo import gspo_loss

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 3, generator=g, dtype=torch.float64).requires_grad_()
    mask, truncated = torch.ones(4, 3, dtype=torch.float64), torch.tensor([False, True, False, True])
    loss, _, _ = gspo_loss(logp, logp.detach() + 0.001, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
                        mask * ~truncated[:, None], clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.all(grad[truncated] == 0) and torch.all(grad[~truncated] != 0)
    rows, _ = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0",
                                  "--mask-truncated"], monkeypatch, tmp_path)
    assert rows[0]["charts/masked_truncated"] == round(rows[0]["charts/truncated_frac"] * 32) > 0


@pytest.mark.parametrize("n, c, k, expected", [  # 1 - C(n-c, k) / C(n, k), n = 4, written out
    (4, 0, 1, 0.0), (4, 0, 4, 0.0), (4, 1, 1, 1 / 4), (4, 1, 2, 1 - 3 / 6), (4, 1, 3, 1 - 1 / 4), (4, 1, 4, 1.0),
    (4, 2, 1, 2 / 4), (4, 2, 2, 1 - 1 / 6), (4, 2, 3, 1.0), (4, 2, 4, 1.0), (4, 3, 1, 3 / 4), (4, 3, 2, 1.0),
    (4, 3, 3, 1.0), (4, 3, 4, 1.0), (4, 4, 1, 1.0), (4, 4, 4, 1.0)])
def test_pass_at_k_unbiased_estimator(n, c, k, expected):
    from common import pass_at_k

    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one():
    """Against the definition: enumerate every k-subset of n samples with c correct."""
    from itertools import combinations

    from common import pass_at_k

    for c in range(5):
        samples = [1] * c + [0] * (4 - c)
        for k in range(1, 5):
            subsets = list(combinations(samples, k))
            assert pass_at_k(4, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-15)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)  # needs n >= k


def test_eval_only_on_a_saved_checkpoint_prints_the_table(tiny_dir, monkeypatch, tmp_path, capsys):
    """--eval-only with n > k: avg@k is the mean accuracy over all n samples, pass@k the mean unbiased estimate."""
    import json

    import common

    scores = []
    real = common.score

    def recording(texts, answers, n, *a, **k):
        r, e = real(texts, answers, n, *a, **k)
        scores.append(r.view(-1, n))
        return r, e

    monkeypatch.setattr(common, "score", recording)
    rows, run = run_script("gspo", ["--model", tiny_dir, "--eval-only", "--eval-size", "6", "--eval-k", "2",
                                    "--eval-n", "4", "--max-new-tokens", "2"], monkeypatch, tmp_path, jitter_row=False)
    r = torch.cat(scores)
    assert r.shape == (6, 4) and len(rows) == 1 and rows[0]["eval/samples"] == 4
    assert rows[0]["eval/avg@2"] == pytest.approx(r.mean().item(), abs=1e-12)  # avg@k of the samples: mean accuracy
    assert rows[0]["eval/pass@2"] == pytest.approx(
        sum(common.pass_at_k(4, int(c), 2) for c in (r > 0).sum(1)) / 6, abs=1e-12)
    out = capsys.readouterr().out
    assert "| dataset | prompts | samples a prompt | avg@2 | pass@2 | reward errors |" in out
    assert "| builtin (held-out) | 6 | 4 |" in out
    assert {"step": 0, **json.load(open(os.path.join(run, "eval.json")))["builtin"]} == rows[0]
    assert not [p for p in os.listdir(run) if p.startswith("step_")]  # evaluation only: nothing trained or saved
