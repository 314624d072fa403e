"""Answer extraction, numeric equivalence, group advantages; model text is parsed, never executed."""
import json
import os

import pytest
import torch

from common import group_advantages, math_reward
from grouprl.grader import extract_answer, parse_number
from grouprl import evaluation
from grouprl import rewards as grouprl_rewards
from grouprl.rewards import score
from conftest import SCRIPTS
from helpers import run_script, trl


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


def test_leave_one_out_baseline_by_hand_and_as_verls_rloo():
    """RLOO (--baseline leave-one-out): rewards [1, 0, 0, 0] give A_1 = 1 - 0 = 1 and A_2 = 0 - 1/3 (the others' mean),
    unscaled; [0.2, 0.4, 0.9] give 0.2 - 0.65, 0.4 - 0.55, 0.9 - 0.3. verl's compute_rloo_outcome_advantage, written
    from its source: r_i G/(G-1) - mean G/(G-1). Scaled by the group's std like any centred reward."""
    adv, zero = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "none", baseline="leave-one-out")
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3]) and zero == 0
    r = torch.tensor([0.2, 0.4, 0.9, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv, zero = group_advantages(r, 3, "none", baseline="leave-one-out")
    assert adv[:3].tolist() == pytest.approx([0.2 - 0.65, 0.4 - 0.55, 0.9 - 0.3], abs=1e-6) and zero == 1
    g = r.view(-1, 3)
    verl = (g * 3 / 2 - g.mean(1, keepdim=True) * 3 / 2).flatten()
    assert torch.allclose(adv.double(), verl, atol=1e-6)
    scaled, _ = group_advantages(r, 3, "group", baseline="leave-one-out")
    assert torch.allclose(scaled[:3].double(), verl[:3] / (g[0].std(unbiased=False) + 1e-6), atol=1e-5)
    with pytest.raises(ValueError, match="group-mean or leave-one-out"):
        group_advantages(r, 3, baseline="others")


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


def test_a_truncated_completion_scores_its_fraction_of_the_reward():
    """--truncated-reward-scale s: a completion cut at --max-new-tokens scores s x its reward (by hand: right answers
    score 1, so a cut right one scores s, a cut wrong one 0); s = 1 and no truncation flags leave the rewards as they
    were."""
    texts, truncated = ["7", "7", "3", "7"], torch.tensor([False, True, True, False])
    for s, want in [(0.5, [1.0, 0.5, 0.0, 1.0]), (0.0, [1.0, 0.0, 0.0, 1.0]), (1.0, [1.0, 1.0, 0.0, 1.0])]:
        r, errors = score(texts, ["7"], 4, watch=False, truncated=truncated, truncated_scale=s)
        assert r.tolist() == want and errors == 0
    assert score(texts, ["7"], 4, watch=False)[0].tolist() == [1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_loop_scores_the_rollouts_truncation(script, monkeypatch, tmp_path):
    """Each script passes --truncated-reward-scale (filled in: 0.5 on the built-in task) to sample_groups, which
    scores its rollout with the rollout's truncation flags (what score does with them: the test above)."""
    import common

    seen, real_generate, real_score = {}, common.generate, common.score

    def generate(*args, **kw):
        seen["roll"] = real_generate(*args, **kw)
        return seen["roll"]

    def spy(*args, **kw):
        seen.update(kw)
        return real_score(*args, **kw)

    monkeypatch.setattr(common, "generate", generate)
    monkeypatch.setattr(common, "score", spy)
    run_script(script, ["--num-steps", "1", "--prompts-per-rank", "2", "--num-minibatches", "1", "--group-size", "4",
                        "--eval-every", "0"], monkeypatch, tmp_path)
    assert seen["truncated_scale"] == 0.5 and torch.equal(seen["truncated"], seen["roll"].truncated)


@pytest.mark.parametrize("n, c, k, expected", [  # 1 - C(n-c, k) / C(n, k), n = 4, written out
    (4, 0, 1, 0.0), (4, 0, 4, 0.0), (4, 1, 1, 1 / 4), (4, 1, 2, 1 - 3 / 6), (4, 1, 3, 1 - 1 / 4), (4, 1, 4, 1.0),
    (4, 2, 1, 2 / 4), (4, 2, 2, 1 - 1 / 6), (4, 2, 3, 1.0), (4, 2, 4, 1.0), (4, 3, 1, 3 / 4), (4, 3, 2, 1.0),
    (4, 3, 3, 1.0), (4, 3, 4, 1.0), (4, 4, 1, 1.0), (4, 4, 4, 1.0)])
def test_pass_at_k_unbiased_estimator(n, c, k, expected):
    from grouprl.stats import pass_at_k

    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one():
    """Against the definition: enumerate every k-subset of n samples with c correct."""
    from itertools import combinations

    from grouprl.stats import pass_at_k

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

    from grouprl.stats import pass_at_k

    scores = []
    real = evaluation.score

    def recording(texts, answers, n, *a, **k):
        r, e = real(texts, answers, n, *a, **k)
        scores.append(r.view(-1, n))
        return r, e

    monkeypatch.setattr(evaluation, "score", recording)  # evaluate's
    rows, run = run_script("gspo", ["--model", tiny_dir, "--eval-only", "--eval-size", "6", "--eval-k", "2",
                                    "--eval-n", "4", "--max-new-tokens", "2"], monkeypatch, tmp_path, jitter_row=False)
    r = torch.cat(scores)
    assert r.shape == (6, 4) and len(rows) == 1 and rows[0]["eval/samples"] == 4
    assert rows[0]["eval/avg@2"] == pytest.approx(r.mean().item(), abs=1e-12)  # avg@k of the samples: mean accuracy
    assert rows[0]["eval/pass@2"] == pytest.approx(
        sum(pass_at_k(4, int(c), 2) for c in (r > 0).sum(1)) / 6, abs=1e-12)
    out = capsys.readouterr().out
    assert "| dataset | prompts | samples a prompt | avg@2 | pass@2 | reward errors |" in out
    assert "| builtin (held-out) | 6 | 4 |" in out
    assert {"step": 0, **json.load(open(os.path.join(run, "eval.json")))["builtin"]} == rows[0]
    assert not [p for p in os.listdir(run) if p.startswith("step_")]  # evaluation only: nothing trained or saved


# -------------------- --reward: two signatures, several rewards, built-ins, a failing reward stops the run
TRL_REWARDS = """
import json, os


def seen(prompts, completions, solution, **kwargs):  # TRL's accuracy_reward shape: a column by name
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "solution": solution, **kwargs}) + "\\n")
    return [float(c == s) if c != "skip" else None for c, s in zip(completions, solution)]


def conv(prompts, completions, **kwargs):
    return [float(p[-1]["content"] == "q1" and c[0]["role"] == "assistant") + len(c[0]["content"])
            for p, c in zip(prompts, completions)]


def only_completions(completions):  # takes no **kwargs: gets only what it names
    return [None if c == "skip" else 1.0 for c in completions]


def wrong_length(completions, **kwargs):
    return [1.0]


def empties(completions, **kwargs):  # empties the list it was given, then answers for none
    completions.clear()
    return []


def length(completion, answer):  # the project's form
    return float(len(completion))


def huge(completion, answer):  # finite, but past float32's range once weighted (or at all: 1e39)
    return {"big": 1e38, "bigger": 1e308, "past": 1e39}.get(completion, 1.0)


def boom(completion, answer):
    raise KeyError("no such test")


def half_boom(completion, answer):
    if completion.startswith("x"):
        raise KeyError("x")
    return 1.0


def neither(a, b, c):
    return 0.0
"""


@pytest.fixture
def trl_rewards(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards26.py").write_text(TRL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    yield "trl_rewards26"


def test_reward_form_is_read_from_the_signature():
    from grouprl.grader import reward_form

    def pair(completion, answer):
        return 0.0

    def trl(completions, solution=None, **kw):  # binds two positionals too: its names say TRL
        return []

    def trl_named(prompts, completions, answer):
        return []

    assert reward_form(pair)[0] == "pair" and reward_form(math_reward)[0] == "pair"
    assert reward_form(trl) == ("trl", ("completions", "solution"), ("completions",), True)
    assert reward_form(trl_named) == ("trl", ("prompts", "completions", "answer"),
                                      ("prompts", "completions", "answer"), False)
    assert reward_form(lambda a, b, c: 0) is None and reward_form(lambda a: 0) is None


def test_trl_reward_gets_prompts_completions_and_every_column(trl_rewards, tmp_path):
    import json

    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:seen"], 5.0)
    rows = {"prompt": ["p0", "p1"], "answer": ["4", "5"], "text": ["<t>p0", "<t>p1"], "solution": ["a", "b"]}
    r, errors = score(["a", "x", "skip", "b"], rows, 2, reward)
    assert errors == 0 and r.tolist() == [1.0, 0.0, 0.0, 1.0]  # None is not applicable: 0 with no other reward
    calls = sorted((json.loads(line) for line in open(tmp_path / "seen.jsonl")), key=lambda c: c["prompts"])
    assert calls == [  # one call per group; each prompt's values repeated per completion; no "text"
        {"prompts": ["p0", "p0"], "completions": ["a", "x"], "solution": ["a", "a"], "answer": ["4", "4"]},
        {"prompts": ["p1", "p1"], "completions": ["skip", "b"], "solution": ["b", "b"], "answer": ["5", "5"]}]
    v = reward.values["seen"]
    assert v[:2].tolist() == [1.0, 0.0] and v[2].isnan() and v[3] == 1.0
    assert reward.metrics() == {"rewards/seen/mean": pytest.approx(2 / 3), "rewards/seen/std":
                                pytest.approx(torch.tensor([1.0, 0.0, 1.0]).std(unbiased=False).item())}
    reward.stop()


def test_trl_reward_gets_conversational_prompts_and_completions_as_messages(trl_rewards):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:conv", f"{trl_rewards}:only_completions"], 5.0)
    chat = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}],
            [{"role": "user", "content": "q2"}]]
    rows = {"prompt": chat, "answer": ["1", "2"], "text": ["t1", "t2"]}
    r, errors = score(["ab", "skip", "abc", "d"], rows, 2, reward)
    # conv: 1 for the first prompt's 'q1' as its last message, plus the length; only_completions: 1 (a message list
    # is not 'skip')
    assert errors == 0 and r.tolist() == [1 + 2 + 1, 1 + 4 + 1, 3 + 1, 1 + 1]
    reward.stop()


def test_a_weighted_sum_past_float32_scores_0_and_is_counted(trl_rewards, capsys):
    """1e38 x a weight of 10, 1e308 and 1e39 are finite floats whose sum is not a float32: each scores 0 and is counted
    as a failure of the reward (before: inf, and the run stopped on non-finite updates); 1e38 alone, weighted by 1,
    is a float32 and is kept."""
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:huge", f"{trl_rewards}:length"], 5.0, [10.0, 1.0])
    r, errors = score(["big", "bigger", "ok", "past"], ["1", "2"], 2, reward, watch=False)
    assert r.tolist() == [0.0, 0.0, 10.0 + 2.0, 0.0] and errors == 3
    assert "the reward huge failed on 3 of 4 completions, scored 0" in capsys.readouterr().err
    reward.stop()
    alone = grader.load_reward(f"{trl_rewards}:huge", 5.0)
    r, errors = score(["big", "bigger"], ["1"], 2, alone, watch=False)
    assert r.tolist() == [torch.tensor(1e38).item(), 0.0] and errors == 1
    alone.stop()


def test_several_rewards_are_a_weighted_sum_that_skips_none(trl_rewards):
    """r = sum_k w_k r_k over the rewards that apply (TRL's nansum), each logged under its own name."""
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:length", f"{trl_rewards}:only_completions"], 5.0, [1.0, 0.1])
    r, errors = score(["ab", "skip", "abc", "skip"], ["1", "2"], 2, reward)
    w = torch.tensor([1.0, 0.1])
    expected = [(torch.tensor([2.0, 1.0]) * w).sum(), 4.0, (torch.tensor([3.0, 1.0]) * w).sum(), 4.0]
    assert errors == 0 and r.tolist() == [float(x) for x in expected]
    m = reward.metrics()
    assert m["rewards/length/mean"] == pytest.approx(3.25) and m["rewards/only_completions/mean"] == 1.0
    assert m["rewards/only_completions/std"] == 0.0 and set(m) == {
        "rewards/length/mean", "rewards/length/std", "rewards/only_completions/mean", "rewards/only_completions/std"}
    reward.stop()


def test_a_trl_reward_of_the_wrong_length_is_an_error(trl_rewards, capsys):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:wrong_length"], 5.0)
    r, errors = score(["a", "b"], {"prompt": ["p"], "answer": ["1"], "text": ["p"]}, 2, reward, watch=False)
    assert r.tolist() == [0.0, 0.0] and errors == 2
    assert "ValueError: the reward returned list [1.0], not a list of 2 rewards" in capsys.readouterr().err
    reward.stop()


def test_a_trl_reward_that_empties_its_completions_is_counted_against_what_it_was_given(trl_rewards, capsys):
    """Issue 54: a reward that empties its `completions` argument and returns [] was reported as "not a list of 0
    rewards" (the count read after the call): the count is the completions it was given."""
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:empties"], 5.0)
    r, errors = score(["a", "b"], {"prompt": ["p"], "answer": ["1"], "text": ["p"]}, 2, reward, watch=False)
    assert r.tolist() == [0.0, 0.0] and errors == 2
    assert "ValueError: the reward returned list [], not a list of 2 rewards" in capsys.readouterr().err
    reward.stop()


def test_a_column_a_trl_reward_needs_is_named_with_those_there_are(trl_rewards):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:seen"], 5.0)
    with pytest.raises(SystemExit) as e:
        score(["a"], {"prompt": ["p"], "answer": ["1"], "text": ["p"]}, 1, reward)
    assert str(e.value.code) == (f"error: --reward {trl_rewards}:seen: needs the column 'solution', which the data "
                                 "does not have (its columns: prompt, answer, text)")


def test_a_reward_failing_on_every_completion_of_the_first_step_stops_the_run(trl_rewards):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:length", f"{trl_rewards}:boom"], 5.0, fail_steps=3)
    with pytest.raises(SystemExit) as e:
        score(["a", "b"], ["1"], 2, reward)
    assert str(e.value.code) == ("error: the reward boom failed on every completion of the first step (first "
                                 "error: KeyError: 'no such test'): fix it (the run would learn from nothing)")
    reward.stop()


def test_a_reward_failing_on_more_than_half_for_n_steps_in_a_row_stops_the_run(trl_rewards):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{trl_rewards}:half_boom"], 5.0, fail_steps=2)
    score(["a", "b", "c", "d"], ["1"], 4, reward)  # the first step: none fails
    score(["xa", "xb", "c", "d"], ["1"], 4, reward)  # half: not more than half
    score(["xa", "xb", "xc", "d"], ["1"], 4, reward)  # 1 step in a row over half
    score(["xa", "b", "c", "d"], ["1"], 4, reward)  # the run of bad steps ends
    score(["xa", "xb", "xc", "d"], ["1"], 4, reward)
    with pytest.raises(SystemExit) as e:
        score(["xa", "xb", "xc", "xd"], ["1"], 4, reward)  # 2 in a row
    assert str(e.value.code) == ("error: the reward half_boom failed on more than half of the completions in 2 "
                                 "steps in a row (first error: KeyError: 'x') (--reward-fail-steps 2): fix it")
    never = grader.load_reward([f"{trl_rewards}:half_boom"], 5.0, fail_steps=0)
    for _ in range(3):
        assert score(["xa", "xb"], ["1"], 2, never)[1] == 2  # counted, and the run goes on
    reward.stop()
    never.stop()


def test_builtin_rewards():
    """think_format: <think>, reasoning, one </think>, then an answer. length_penalty: DAPO eq. 13 in characters,
    0 up to L_max - L_cache, linear to -1 at L_max, -1 past it."""
    import common
    from common import length_penalty, think_format
    from grouprl.grader import load_reward

    assert think_format("<think>\n2+2 is 4\n</think>\nThe answer is 4.", "4") == 1.0
    assert think_format("2+2 is 4\n</think> 4", "4") == 1.0  # the template opened <think> in the prompt
    assert think_format("<think>2+2 is 4</think>  ", "4") == 0.0  # no answer after it
    assert think_format("<think>a</think> 4 <think>b</think> 5", "4") == 0.0  # a second block
    assert think_format("The answer is 4.", "4") == 0.0 and think_format("<think>never closed 4", "4") == 0.0
    lmax, cache = grouprl_rewards.LENGTH_MAX_CHARS, grouprl_rewards.LENGTH_CACHE_CHARS
    assert length_penalty("a" * (lmax - cache), "") == 0.0
    assert length_penalty("a" * (lmax - cache // 2), "") == -0.5
    assert length_penalty("a" * lmax, "") == -1.0 and length_penalty("a" * (lmax + 1), "") == -1.0
    for name in ("math_reward", "think_format", "length_penalty"):  # named without code
        assert load_reward([f"common:{name}"], 1.0).parts[0][0].kind == "pair"


@pytest.mark.parametrize("argv, needle", [
    (["--reward", "trl_rewards26:neither"], "--reward 'trl_rewards26:neither': trl_rewards26.neither fits none of "
                                            "f(completion, answer) -> float, TRL's f(prompts, completions"),
    (["--reward", "trl_rewards26:length", "--reward", "trl_rewards26:boom", "--reward-weights", "1"],
     "--reward-weights: 1 weight(s) for 2 reward(s) (trl_rewards26:length, trl_rewards26:boom)"),
    (["--reward-weights", "1", "nan"], "--reward-weights: 2 weight(s) for 1 reward(s)"),
    (["--reward", "trl_rewards26:length", "--reward-weights", "inf"], "--reward-weights inf: must be a finite"),
    (["--reward", "trl_rewards26:length", "--reward", "trl_rewards26:length"], "two rewards named 'length'"),
    (["--reward-fail-steps", "-1"], "--reward-fail-steps -1: must be an integer >= 0"),
])
def test_bad_rewards_fail_before_any_model(argv, needle, trl_rewards, monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)


def test_a_user_reward_calling_math_reward_grades_at_once_in_its_worker(tmp_path, monkeypatch):
    """common.math_reward inside a --reward worker grades there (math-verify made before the worker is ready), not in
    workers of its own that would start within the reward's 1-s bound and time out (issue 26)."""
    from grouprl import grader
    from grouprl.rewards import score

    (tmp_path / "wraps_math26.py").write_text(
        "from common import math_reward\n\n\ndef r(completion, answer):\n    return math_reward(completion, answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(grader.pool, "GRADING_WORKERS", 1)  # read by pool.Reward
    reward = grader.load_reward("wraps_math26:r", 1.0)
    r, errors = score(["\\boxed{2\\sqrt{2}}", "\\boxed{3}", "so \\boxed{\\frac{4}{\\sqrt{2}}}"], ["\\sqrt{8}"], 3,
                      reward)  # math-verify decides each (no exact form settles it)
    assert r.tolist() == [1.0, 0.0, 1.0] and errors == 0
    (worker,) = [w.proc.pid for w in reward.workers]
    children = []  # processes the worker started (graders of its own), from /proc
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                children += [pid] if int(f.read().rsplit(")", 1)[1].split()[1]) == worker else []
        except OSError:
            pass
    assert children == []
    reward.stop()


def test_trl_style_reward_through_a_script(trl_rewards, monkeypatch, tmp_path):
    """TRL's f(completions) through --reward with a project reward beside it: both logged under their names."""
    rows, _ = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "2", "--eval-every",
                                  "0", "--reward", f"{trl_rewards}:only_completions", "--reward", f"{trl_rewards}:length",
                                  "--reward-weights", "0.5", "1", "--truncated-reward-scale", "1"], monkeypatch, tmp_path)
    assert rows[0]["rewards/only_completions/mean"] == 1.0 and rows[0]["rewards/only_completions/std"] == 0.0
    assert rows[0]["charts/reward_mean"] == pytest.approx(0.5 + rows[0]["rewards/length/mean"])
    assert rows[0]["charts/reward_errors"] == 0


def test_trl_own_rewards_through_the_pool(monkeypatch):
    """trl.rewards' think_format_reward and accuracy_reward (its `solution` column) score conversational rows as in
    TRL: 1 for the right format / the right boxed answer."""
    trl()  # TRL 1.16 (tests/requirements-test.txt): fails in CI when missing, skips elsewhere
    from grouprl import grader
    from grouprl.rewards import score

    monkeypatch.setattr(grader.pool, "GRADING_WORKERS", 1)  # read by pool.Reward
    reward = grader.load_reward(["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"], 60.0)
    rows = {"prompt": [[{"role": "user", "content": "What is 1/2 + 1/3?"}]], "answer": ["5/6"], "text": ["t"],
            "solution": ["$\\frac{5}{6}$"]}
    texts = ["<think>add</think> $\\boxed{\\frac{5}{6}}$", "no think, $\\boxed{\\frac{1}{5}}$"]
    r, errors = score(texts, rows, 2, reward)
    assert errors == 0 and r.tolist() == [2.0, 0.0]
    assert reward.metrics()["rewards/accuracy_reward/mean"] == 0.5
    reward.stop()


def test_trl_reward_on_a_conversational_file_end_to_end(monkeypatch, tmp_path):
    """The data and reward paths together, as a TRL user brings them: a .jsonl of conversational prompts with a system
    message, TRL's `solution` column and one more column; the TRL-form reward sees the messages whole (system message
    first), completions as assistant messages, `solution`, `answer` and the extra column by name."""
    (tmp_path / "conv_reward26.py").write_text(
        "def acc(prompts, completions, solution, level, **kw):\n"
        "    assert prompts[0][0] == {'role': 'system', 'content': 'Answer with one digit.'}, prompts[0]\n"
        "    assert completions[0][0]['role'] == 'assistant' and kw['answer'] == solution\n"
        "    assert all(lv in (0, 1, 2) for lv in level)\n"
        "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with open(tmp_path / "conv.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": [{"role": "system", "content": "Answer with one digit."},
                                           {"role": "user", "content": f"{i}%10="}],
                                "solution": str(i % 10), "level": i % 3}) + "\n")
    rows, _ = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "2", "--eval-every",
                                  "0", "--max-new-tokens", "3", "--dataset", str(tmp_path / "conv.jsonl"),
                                  "--reward", "conv_reward26:acc"], monkeypatch, tmp_path)
    assert rows[0]["charts/reward_errors"] == 0 and rows[0]["rewards/acc/mean"] == 1.0


VERL_REWARDS = '''
import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's custom_reward_function
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}


def plain_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def accuracy_reward(completions, solution, **kwargs):  # trl.rewards' way of reading completions
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]
'''


@pytest.fixture
def verl_rewards(tmp_path, monkeypatch):
    (tmp_path / "verl_rewards37.py").write_text(VERL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    yield "verl_rewards37"


def test_verl_compute_score_on_verl_parquet(verl_rewards, tmp_path):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) is read by its signature and called
    by keyword with verl's parquet columns (reward_model.ground_truth as stored, extra_info whole), once per distinct
    completion; a dict is read by its 'score' key, a float as it is (issue 37 item 2)."""
    import json

    import pandas as pd

    from grouprl import data
    from grouprl import grader
    from grouprl import modeling
    from grouprl.rewards import score

    assert grader.reward_form(lambda data_source, solution_str, ground_truth, extra_info=None: 0)[0] == "verl"
    rows = [{"data_source": "digits", "prompt": [{"role": "user", "content": f"{i}%10="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i in range(20)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    train, _, _ = data.load_task(data.Task(str(tmp_path / "train.parquet"), None, 2, 0), modeling.tiny_tokenizer())
    batch = train.select([0, 1])
    i0, i1 = (r["extra_info"]["index"] for r in batch)
    reward = grader.load_reward([f"{verl_rewards}:compute_score"], 5.0)
    r, errors = score([str(i0), "x", "x", str(i1)], batch, 2, reward)
    assert errors == 0 and r.tolist() == [1.0, 0.0, 0.0, 1.0]
    calls = sorted(json.loads(line) for line in open(tmp_path / "seen.jsonl"))
    assert sorted(calls) == sorted([["digits", str(i0), str(i0), {"split": "train", "index": i0}],
                                    ["digits", "x", str(i0), {"split": "train", "index": i0}],
                                    ["digits", "x", str(i1), {"split": "train", "index": i1}],
                                    ["digits", str(i1), str(i1), {"split": "train", "index": i1}]])
    reward.stop()
    plain = grader.load_reward([f"{verl_rewards}:plain_score"], 5.0)
    assert score(["a", "b"], {"prompt": ["p"], "answer": ["1"], "text": ["p"]}, 2, plain)[0].tolist() == [0.5, 0.5]
    plain.stop()


def test_verl_dict_without_score_is_an_error(verl_rewards, capsys):
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{verl_rewards}:no_score"], 5.0)
    r, errors = score(["a", "b"], {"prompt": ["p"], "answer": ["1"], "text": ["p"]}, 2, reward, watch=False)
    assert r.tolist() == [0.0, 0.0] and errors == 2
    assert "the reward returned a dict without 'score' (keys: acc); verl reads its 'score'" in capsys.readouterr().err
    reward.stop()


def test_trl_rewards_function_on_plain_prompts_says_it_needs_conversational_data(verl_rewards):
    """A trl.rewards-style function reads completion[0]['content']: on plain-text prompts the completions are
    strings and it raises TypeError; the run stops saying it needs conversational data (issue 37 item 7)."""
    from grouprl import grader
    from grouprl.rewards import score

    reward = grader.load_reward([f"{verl_rewards}:accuracy_reward"], 5.0, fail_steps=3)
    with pytest.raises(SystemExit) as e:
        score(["1", "2"], {"prompt": ["1%10="], "answer": ["1"], "solution": ["1"], "text": ["p"]}, 2, reward)
    line = str(e.value.code)
    assert "\n" not in line and "TypeError: string indices must be integers" in line
    assert "needs conversational data: prompts as lists of {role, content} messages" in line
    reward.stop()
