"""Answer extraction, numeric equivalence, group advantages; model text is parsed, never executed."""
import os

import pytest
import torch

from common import extract_answer, group_advantages, math_reward, parse_number


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
    assert math_reward(code + " so \\boxed{6*7}", "42") == 0.0  # an expression is not evaluated
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
    adv, _ = group_advantages(r, 3, scale_std=False)
    assert torch.allclose(adv[6:].double(), g - g.mean(), atol=1e-6)
