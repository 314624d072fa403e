"""The math grader: equivalent answers written differently score 1, different answers score 0, every call is
bounded in time, each reference is normalised once per prompt and each distinct answer graded once."""
import os
import sys
import threading
import time

import pytest

import common
from grouprl import grader
from grouprl import rewards
from common import math_reward
from grouprl.rewards import score


@pytest.fixture(autouse=True, scope="module")
def roomy_grader():
    """Correctness tests grade with a 30 s bound, so that a busy machine cannot turn a slow answer into a 0; the
    bound itself is tested below with its own Reward."""
    saved = list(rewards._MATH_GRADER)
    rewards._MATH_GRADER[:] = [grader.Reward(timeout_s=30.0)]
    yield
    rewards._MATH_GRADER[0].stop()
    rewards._MATH_GRADER[:] = saved


# (what the model boxes, the reference): the same mathematical object written two ways
SAME = [
    ("\\tfrac{6}{8}", "\\frac34"),  # fractions: another spelling, unreduced
    ("0.75", "\\frac{3}{4}"),
    ("-\\dfrac{1}{3}", "-1/3"),
    ("\\sqrt{8}", "2\\sqrt{2}"),  # radicals
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("x^2+2x+1", "(x+1)^2"),  # polynomials, expanded or in another order
    ("3 - 2a + a^2", "a^2-2a+3"),
    ("[1, 3)", "[1,3)"),  # intervals
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("(\\frac{1}{2}, 3)", "(0.5,3)"),  # tuples
    ("\\{3, 1, 2\\}", "\\{1,2,3\\}"),  # sets: order does not matter
    ("\\begin{pmatrix} \\frac{4}{2} & 0 \\\\ 0 & 2 \\end{pmatrix}", "\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}"),
    ("45^{\\circ}", "45"),  # degrees
    ("30^\\circ", "30"),
    ("12.5\\%", "12.5"),  # percent: the number as written, or as a fraction of 100
    ("20\\%", "0.2"),
    ("\\$1,250", "1250"),  # currency and thousands
    ("1{,}000", "1000"),
    ("18.90 dollars", "\\$18.90"),
    ("10 percent", "0.1"),  # words after a number: a unit, a percent, or pi
    ("2 pi", "2\\pi"),
    ("infinity", "\\infty"),  # the word
    ("-\\infty", "-Infinity"),
    ("10 \\text{ cm}^2", "10"),  # units
    ("+7", "7"),
    ("\\text{5}", "5"),
    ("\\text{Tuesday}", "tuesday"),  # text answers, without case
    ("(B)", "B"),
    ("1 \\pm \\sqrt{3}", "1+\\sqrt{3}, 1-\\sqrt{3}"),  # plus-minus: both roots
    ("x=5", "5"),  # equations
    ("5", "x = 5"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
]

DIFFERENT = [
    ("\\frac{3}{5}", "\\frac{5}{3}"),
    ("0.33", "\\frac{1}{3}"),
    ("\\sqrt{8}", "2\\sqrt{3}"),
    ("x^2-2x+1", "(x+1)^2"),
    ("(1,3)", "[1,3)"),  # open vs half-open interval
    ("[1,3]", "[1,3)"),
    ("(1, 2)", "(2, 1)"),  # tuples: order matters
    ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("\\begin{pmatrix}2&0\\\\0&3\\end{pmatrix}", "\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}"),
    ("44^\\circ", "45"),
    ("5\\%", "0.5"),
    ("\\$12", "13"),
    ("2 pi", "2"),  # pi is not a unit
    ("infinity", "-\\infty"),
    ("\\text{Monday}", "\\text{Tuesday}"),
    ("\\text{Evenly}", "\\text{Evelyn}"),  # the same letters: as products of symbols these would be equal
    ("1+\\sqrt{3}", "1 \\pm \\sqrt{3}"),  # one root of two
    ("x=6", "5"),
    ("y", "x"),
]


@pytest.mark.parametrize("pred, gold", SAME)
def test_equivalent_answers_score_1(pred, gold):
    assert math_reward(f"so the answer is \\boxed{{{pred}}}.", gold) == 1.0


@pytest.mark.parametrize("pred, gold", DIFFERENT)
def test_different_answers_score_0(pred, gold):
    assert math_reward(f"so the answer is \\boxed{{{pred}}}.", gold) == 0.0


# Issue 38: where the reference is a number, the answer must write a number out; an expression that a grader would
# compute scores 0, whatever it equals. SmolLM2-135M learned within 6 steps to box the question's own '62 + 43'.
COMPUTED = [
    ("62 + 43", "105"),  # the question echoed, as the policy of issue 38 wrote it
    ("7*15", "105"),
    ("7 \\times 15", "105"),
    ("100+5", "105"),
    ("(62+43)", "105"),  # brackets do not make a sum a number
    ("62 + 43 \\text{ apples}", "105"),  # nor does a unit
    ("x = 62 + 43", "105"),  # an equation's last side is what it states
    ("105 = 62 + 43", "105"),
    ("\\frac{210}{2}", "105"),  # a fraction equal to a whole number is a division: 210 / 2 = 105
    ("210/2", "105"),
    ("\\frac{105}{1}", "105"),
    ("\\frac{1.5}{2}", "0.75"),  # a fraction of decimals: 1.5 / 2 = 0.75
    ("\\sqrt{11025}", "105"),  # 105^2 = 11025
    ("10^3", "1000"),  # a power
    ("15 \\times 10^{2}", "1500"),  # not scientific notation: 15 is not from 1 to 10
    ("\\frac{1}{2} + \\frac{1}{4}", "\\frac{3}{4}"),
    ("1 - 0.25", "0.75"),
    ("x^2 - x^2", "0"),
    ("\\frac{0}{5}", "0"),  # 0 / 5 = 0
]

WRITTEN_OUT = [  # the same numbers written out, as models write them: 1
    ("105", "105"),
    ("105.0", "105"),
    ("105.", "105"),
    ("\\text{105}", "105"),
    ("105 apples", "105"),
    ("105\\text{ apples}", "105"),
    ("105^\\circ", "105"),
    ("\\$105", "105"),
    ("1,050", "1050"),  # thousands separators
    ("1{,}050", "1050"),
    ("1\\,050", "1050"),
    ("105\\%", "1.05"),  # 105% = 105/100
    ("x = 105", "105"),  # the last side of an equation
    ("62 + 43 = 105", "105"),  # the sum worked out: the number is written
    ("x \\approx 7.78", "7.78"),
    ("(105)", "105"),
    ("\\left(\\frac{3}{2}\\right)", "1.5"),
    ("\\frac{6}{8}", "0.75"),  # unreduced, but no whole number: 3/4 written out
    ("-\\frac{1}{3}", "-1/3"),
    ("−105", "-105"),  # the Unicode minus sign
    ("1.05 \\times 10^{2}", "105"),  # scientific notation: 1.05 * 100 = 105
    ("\\$105.00", "105"),
    ("4", "12/3"),  # a reference written as a division: the number it computes, 12 / 3 = 4
]

SYMBOLIC = [  # a reference that is not a number keeps symbolic equivalence (math-verify)
    ("\\sqrt{12}", "2\\sqrt{3}"),  # sqrt(12) = sqrt(4 * 3) = 2 sqrt(3)
    ("\\frac{4}{2}\\sqrt{3}", "2\\sqrt{3}"),
    ("x(x+1)", "x^2+x"),
    ("[1, 3)", "[1,3)"),
]


@pytest.mark.parametrize("pred, gold", COMPUTED)
def test_an_expression_never_equals_a_numeric_reference(pred, gold):
    assert math_reward(f"so the answer is \\boxed{{{pred}}}.", gold) == 0.0
    assert grader.decide(grader.canonical(pred), grader.canonical(gold)) == 0.0  # settled here: no math-verify


@pytest.mark.parametrize("pred, gold", WRITTEN_OUT)
def test_a_number_written_out_equals_a_numeric_reference(pred, gold):
    assert math_reward(f"so the answer is \\boxed{{{pred}}}.", gold) == 1.0


@pytest.mark.parametrize("pred, gold", SYMBOLIC)
def test_a_symbolic_reference_keeps_symbolic_equivalence(pred, gold):
    assert math_reward(f"so the answer is \\boxed{{{pred}}}.", gold) == 1.0


def test_echoing_the_question_does_not_pay():
    """A group of issue 38's prompt, 'What is 62 + 43?', reference 105: the completions that box the question's
    expression score 0, those that box 105 score 1, so the echo's advantage is negative."""
    texts = ["\\boxed{62 + 43}", "The answer is \\boxed{105}.", "62 + 43 = \\boxed{62 + 43}", "62 + 43 = 105"]
    r, errors = score(texts, ["105"], 4, watch=False)
    assert r.tolist() == [0.0, 1.0, 0.0, 1.0] and errors == 0
    advantages, _ = common.group_advantages(r, 4)
    assert (advantages[[0, 2]] < 0).all() and (advantages[[1, 3]] > 0).all()


@pytest.mark.parametrize("preds, golds, n", [
    (["50\\%", "50"], ["0.5"], 2),  # one reference; two answers with the same text '50', one a percent
    (["0.05", "0.05"], ["5", "5\\%"], 1),  # two references with the same text '5'
])
def test_a_batch_grades_each_completion_as_it_would_alone(preds, golds, n):
    """Each reward is the one math_reward gives that completion alone, in either order of the batch."""
    alone = [math_reward(f"\\boxed{{{p}}}", golds[i // n]) for i, p in enumerate(preds)]
    assert sorted(alone) == [0.0, 1.0]
    for order in ([0, 1], [1, 0]):
        texts = [f"\\boxed{{{preds[i]}}}" for i in order]
        answers = [golds[i // n] for i in order][::n]
        rewards, errors = score(texts, answers, n, watch=False)
        assert rewards.tolist() == [alone[i] for i in order] and errors == 0


@pytest.mark.parametrize("text, gold", [
    ("the answer is 72, in total, for both", "72"),  # a comma after a number in prose
    ("She pays $18.90.", "18.90"),
    ("#### 1,234", "1234"),
    ("\\boxed 5", "5"),  # a brace-less box
    ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last box wins
])
def test_extraction_from_prose(text, gold):
    assert math_reward(text, gold) == 1.0


LINUX_PROC = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="CPU time of a worker: Linux /proc")


@LINUX_PROC
def test_pathological_answer_scores_0_after_a_second_of_cpu_and_is_counted(capsys):
    """9^(9^(9^9)) is a number no machine can write out: the comparison with \\sqrt{2} runs until it is stopped, after
    1 s of the worker's CPU time, some more of wall time on a busy machine. (Changed with the bound, which counted
    wall seconds: this test asserted under 2 s of wall time and the old message. Changed with issue 38: against the
    numeric reference 1 it asked, the power is no number written out and scores 0 without math-verify, so the
    reference is now symbolic.)"""
    import resource

    reward = grader.Reward(timeout_s=1.0)
    reward.run([("2", "2")])  # start the worker, so that the time below is the grading alone
    used_before = reward.workers[0].cpu_seconds()
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.time()
    r, errors = score(["\\boxed{9^{9^{9^{9}}}}"], ["\\sqrt{2}"], 1, reward)
    took = time.time() - t
    now = resource.getrusage(resource.RUSAGE_CHILDREN)  # the stopped worker's CPU time, now that it has ended
    spent = now.ru_utime + now.ru_stime - ended.ru_utime - ended.ru_stime - used_before
    assert r.tolist() == [0.0] and errors == 1 and 0.95 <= spent < 1.5 and took < 10
    assert "no reward within 1 s of CPU time (worker restarted)" in capsys.readouterr().err
    r, errors = score(["\\boxed{\\sqrt{2}}", "\\boxed{\\frac{2}{\\sqrt{2}}}"], ["\\sqrt{2}"], 2, reward)  # a new worker
    assert r.tolist() == [1.0, 1.0] and errors == 0
    reward.stop()


@LINUX_PROC
def test_a_worker_waiting_for_a_core_is_not_out_of_time():
    """On a busy machine a worker waits for a core. A stopped worker (SIGSTOP) uses no CPU, as one that gets no core
    for 2 s: its answer still counts. With a bound in wall seconds it scored 0 and was restarted."""
    import signal

    reward = grader.Reward(timeout_s=1.0)
    reward.run([("2", "2")])
    pid = reward.workers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    wake = threading.Timer(2.0, os.kill, (pid, signal.SIGCONT))
    wake.start()
    t = time.time()
    try:
        r, errors = score(["\\boxed{2\\sqrt{2}}"], ["\\sqrt{8}"], 1, reward)
    finally:
        wake.join()
    assert r.tolist() == [1.0] and errors == 0 and time.time() - t >= 1.9
    reward.stop()


SLOW_START = """
import time

time.sleep(3)  # a start as slow as importing math-verify on a busy machine


def f(completion, answer):
    time.sleep(30 if completion == "hang" else 0.2)
    return 1.0
"""


def test_a_worker_out_of_time_is_replaced_without_delaying_the_other_requests(tmp_path, monkeypatch):
    """The replacement of a killed worker starts in the background: the other worker answers the next requests
    meanwhile (6 x 0.2 s). It used to start in the loop that collects the answers, which waited for it (3 s here)."""
    (tmp_path / "slow_start14.py").write_text(SLOW_START)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = grader.Reward("slow_start14:f", timeout_s=0.5)
    reward.run([("a", "1"), ("b", "1")])  # both workers start
    t = time.time()
    r, errors = score(["hang", *"abcdef"], ["1"], 7, reward)
    assert r.tolist() == [0.0] + [1.0] * 6 and errors == 1 and time.time() - t < 2.8
    r, errors = score(["g", "h"], ["1"], 2, reward)  # the run goes on
    assert r.tolist() == [1.0, 1.0] and errors == 0
    reward.stop()



FAKE_MATH_VERIFY = """
class LatexExtractionConfig:
    pass


def parse(s, **kw):
    return [s]


def verify(gold, pred, **kw):
    return True  # every answer right: a grader that imported this file would say so
"""


def test_the_grader_imports_its_libraries_from_the_installation_only(tmp_path, monkeypatch):
    """Issue 61 item 1 (c): a math_verify.py or sympy.py in the working folder is not what the math grader grades
    with, in its own workers or in a --reward worker whose function calls common.math_reward (\\sin(x) was graded
    right against \\cos(x)); the user's reward module is still found in the working folder."""
    monkeypatch.setattr(sys, "path", sys.path[:])  # load_reward appends the working folder
    (tmp_path / "math_verify.py").write_text(FAKE_MATH_VERIFY)
    (tmp_path / "sympy.py").write_text("raise ImportError('the sympy.py of the working folder')\n")
    monkeypatch.chdir(tmp_path)
    reward = grader.Reward(timeout_s=30.0)
    try:
        assert reward.run([("\\sin(x)", "\\cos(x)"), ("2\\sqrt{2}", "\\sqrt{8}")]) == [(0.0, None), (1.0, None)]
    finally:
        reward.stop()
    user = tmp_path / "user"  # no sympy.py here: torch, which the reward's `import common` loads, imports sympy
    user.mkdir()
    (user / "math_verify.py").write_text(FAKE_MATH_VERIFY)
    (user / "wraps61.py").write_text("from common import math_reward\n\n\ndef r(completion, answer):\n"
                                     "    return math_reward(completion, answer)\n")
    monkeypatch.chdir(user)
    reward = grader.load_reward("wraps61:r", 60.0)
    try:
        out = reward.run([("\\boxed{\\sin(x)}", "\\cos(x)"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")])
    finally:
        reward.stop()
    assert out == [(0.0, None), (1.0, None)], out

def test_grading_works_off_the_main_thread():
    """math-verify's own timeout uses signal.alarm, which raises ValueError outside the main thread."""
    out = []
    th = threading.Thread(target=lambda: out.append(score(["\\boxed{2\\sqrt{2}}", "\\boxed{3}"], ["\\sqrt{8}"], 2)))
    th.start()
    th.join()
    assert out[0][0].tolist() == [1.0, 0.0] and out[0][1] == 0


def test_each_reference_once_per_prompt_each_answer_once_per_group(monkeypatch):
    calls, requests = [], []
    real_canonical, real_run = grader.canonical, grader.Reward.run
    monkeypatch.setattr(rewards, "canonical", lambda s: calls.append(s) or real_canonical(s))
    monkeypatch.setattr(grader.Reward, "run", lambda self, reqs: requests.extend(reqs) or real_run(self, reqs))
    texts = ["\\boxed{2\\sqrt{2}}"] * 10 + ["\\boxed{\\sqrt{8}}"] * 5 + ["\\boxed{3}"]  # group 1: 3 distinct
    texts += ["\\boxed{x}"] * 16  # group 2: one
    r, errors = score(texts, ["\\sqrt{8}", "x"], 16)
    assert r.tolist() == [1.0] * 15 + [0.0] + [1.0] * 16 and errors == 0
    assert sorted(calls) == sorted(["\\sqrt{8}", "x", "2\\sqrt{2}", "\\sqrt{8}", "3", "x"])  # 2 references, 4 answers
    assert requests == [("2\\sqrt{2}", "\\sqrt{8}"), ("3", "\\sqrt{8}")]  # x == x: settled without sympy


USER_REWARDS = '''
import math
import os
import time


def chatty(completion, answer):
    print("debug:", completion)  # the worker's stdout carries its replies: prints must not break them
    os.system("echo from a child process")
    return 1.0


def length(completion, answer):
    return float(len(completion))


def half(completion, answer):
    return 0.5


def boom(completion, answer):
    raise KeyError("no such test")


def slow(completion, answer):
    time.sleep(30)
    return 1.0


def nan(completion, answer):
    return math.nan


not_callable = 3
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards14.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards14"


def test_user_reward_scores_each_distinct_completion_once(user_rewards, monkeypatch):
    requests = []
    real_run = grader.Reward.run
    monkeypatch.setattr(grader.Reward, "run", lambda self, reqs: requests.extend(reqs) or real_run(self, reqs))
    reward = grader.load_reward(f"{user_rewards}:length", 1.0)
    r, errors = score(["ab", "abcd", "ab", "xyz"], ["1", "2"], 2, reward)
    assert r.tolist() == [2.0, 4.0, 2.0, 3.0] and errors == 0
    assert requests == [("ab", "1"), ("abcd", "1"), ("ab", "2"), ("xyz", "2")]  # "ab" once per prompt
    reward.stop()


@pytest.mark.parametrize("name, needle", [("boom", "KeyError: 'no such test'"),
                                          ("nan", "ValueError: the reward returned nan"),
                                          ("slow", "TimeoutError: no reward within 0.3 s")])
def test_user_reward_failures_score_0_are_counted_and_bounded(user_rewards, name, needle, capsys):
    reward = grader.load_reward(f"{user_rewards}:{name}", 0.3)
    t = time.time()
    r, errors = score(["a", "b"], ["1"], 2, reward)
    assert time.time() - t < 5  # slow: 2 x 0.3 s and a worker restart in between
    assert r.tolist() == [0.0, 0.0] and errors == 2 and needle in capsys.readouterr().err
    reward.stop()


@pytest.mark.parametrize("argv, needle", [
    (["--reward", "user_rewards14"], "--reward 'user_rewards14': give module:function"),
    (["--reward", "no_such_module14:f"], "--reward 'no_such_module14:f': cannot import 'no_such_module14'"),
    (["--reward", "user_rewards14:missing"], "module 'user_rewards14' has no 'missing'"),
    (["--reward", "user_rewards14:not_callable"], "user_rewards14.not_callable is a int, not a function"),
    (["--reward-timeout", "0"], "--reward-timeout 0.0: must be > 0 seconds"),
])
def test_bad_reward_fails_before_any_model(argv, needle, user_rewards, monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)


def test_user_reward_reaches_training_and_evaluation(user_rewards, monkeypatch, tmp_path):
    from helpers import run_script

    rows, _ = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "1", "--eval-size",
                                  "2", "--eval-k", "2", "--reward", f"{user_rewards}:half",
                                  "--truncated-reward-scale", "1"], monkeypatch, tmp_path)
    assert rows[1]["charts/reward_mean"] == 0.5 and rows[1]["charts/reward_errors"] == 0
    assert rows[0]["eval/avg@2"] == rows[1]["eval/avg@2"] == 0.5  # avg@k: the mean reward of the samples


def test_user_reward_may_print(user_rewards, capfd):
    reward = grader.load_reward(f"{user_rewards}:chatty", 5.0)
    r, errors = score(["a", "b"], ["1"], 2, reward)
    assert r.tolist() == [1.0, 1.0] and errors == 0
    err = capfd.readouterr().err
    # the two workers print at once, so their lines may interleave; each print reaches stderr, none the replies
    assert err.count("debug:") == 2 and err.count("from a child process") == 2, err
    reward.stop()


# Issue 54: a number glued to letters is a name or a product ('room 4b', 'x7', '3x'), not a number stated; a unit
# glued to a number ('12cm', '5km') is still the number.
@pytest.mark.parametrize("text, gold, paid", [
    ("room 4b is free", "4", 0.0),
    ("the answer is 4b", "4", 0.0),
    ("#### 4b", "4", 0.0),
    ("it is x7", "7", 0.0),
    ("It is 3x", "3", 0.0),
    ("room 4b is free, so 5 are left", "5", 1.0),  # the number stated is read, the name is skipped
    ("It is 12cm long", "12", 1.0),
    ("#### 12cm", "12", 1.0),
    ("it took 5km", "5", 1.0),
    ("7a", "7", 1.0),  # a completion of a number and letters alone: cut off (the built-in task at 2 new tokens)
])
def test_a_number_glued_to_letters_is_not_a_number_stated(text, gold, paid):
    assert math_reward(text, gold) == paid


def test_trainer_and_workers_resolve_a_reward_module_alike(tmp_path, monkeypatch, capsys):
    """Issue 54: a common.py of the user's in the working folder and --reward common:length_penalty (a built-in):
    the trainer checked the project's common, the workers imported the user's and scored 0.75, unsaid. Now both use
    the module the trainer has imported (the project's: 0 for a short completion), and the clash is said in one
    line; a name the project does not import (the user's rewards.py) is the working folder's, in both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "common.py").write_text("def length_penalty(completion, answer):\n    return 0.75\n")
    (tmp_path / "rewards.py").write_text("def my_fn(completion, answer):\n    return 0.25\n")
    reward = grader.load_reward("common:length_penalty", 5.0)
    try:
        r, errors = score(["ab", "cd"], ["1"], 2, reward, watch=False)
        assert r.tolist() == [0.0, 0.0] and errors == 0
    finally:
        reward.stop()
    err = capsys.readouterr().err
    assert (f"note: --reward 'common:length_penalty': 'common' is {common.__file__} (imported by the trainer, and so "
            f"by its reward workers); your {tmp_path}/common.py is not used: rename it to use it") in err, err
    reward = grader.load_reward("rewards:my_fn", 5.0)
    try:
        r, errors = score(["ab", "cd"], ["1"], 2, reward, watch=False)
        assert r.tolist() == [0.25, 0.25] and errors == 0
    finally:
        reward.stop()
    assert "note:" not in capsys.readouterr().err
