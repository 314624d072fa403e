"""Data files a user would write fail through the real command line with one line on stderr, a non-zero exit,
no run folder and no model, fast; numbers as answers are text; a run whose rewards never differ says so once."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import common
from grouprl import data
from grouprl import distributed
from grouprl import evaluation
from grouprl.sampling import Sampling
from grouprl import grader
from grouprl import modeling
from grouprl import rewards
from conftest import ROOT

ROWS = [{"prompt": f"{i}%10=", "answer": str(i % 10)} for i in range(20)]
LINES = [json.dumps(r) for r in ROWS]
FILES = {  # name: lines
    "broken.jsonl": LINES[:7] + ['{"prompt": "7%10=", "answer": "7"'] + LINES[8:],  # line 8 lacks its brace
    "empty.jsonl": [],
    "one.jsonl": LINES[:1],
    "null_prompt.jsonl": LINES[:3] + [json.dumps({"prompt": None, "answer": "3"})] + LINES[4:],
    "int_prompt.jsonl": LINES[:4] + [json.dumps({"prompt": 4, "answer": "4"})] + LINES[5:],
    "own_columns.jsonl": LINES,
    "no_answers.jsonl": [json.dumps({"prompt": r["prompt"], "answer": None}) for r in ROWS],
    "corrupt.parquet": ["this is not parquet"],
    "notes.txt": LINES,
}
CASES = {  # id: (argv, extra environment, what the line must say)
    "broken line": (["--dataset", "{d}/broken.jsonl"], {}, "broken.jsonl:8: not valid JSON (Expecting ',' delimiter"),
    "empty file": (["--dataset", "{d}/empty.jsonl"], {}, "empty.jsonl: empty file; write one JSON object a line"),
    "one row": (["--dataset", "{d}/one.jsonl"], {}, "1 usable row (dropped 0 without an answer); it needs at least 2"),
    "null prompt": (["--dataset", "{d}/null_prompt.jsonl"], {}, "null_prompt.jsonl row 4: 'prompt' is None"),
    "integer prompt": (["--dataset", "{d}/int_prompt.jsonl"], {}, "int_prompt.jsonl row 5: 'prompt' is 4"),
    "gsm8k columns": (["--dataset", "gsm8k", "--data-files", "{d}/own_columns.jsonl"], {},
                      "own_columns.jsonl' has no column(s) ['question'] (columns: ['prompt', 'answer']); --dataset "
                      "gsm8k reads its own columns 'question' and 'answer'"),
    "data-files with builtin": (["--data-files", "{d}/own_columns.jsonl"], {}, "--dataset builtin would ignore it"),
    "data-files with a local file": (["--dataset", "{d}/one.jsonl", "--data-files", "{d}/own_columns.jsonl"], {},
                                     "is a local file already and --data-files"),
    "hub unreachable": (["--dataset", "math500"], {"HF_ENDPOINT": "http://127.0.0.1:9"},
                        "--dataset math500: cannot reach http://127.0.0.1:9 (Connection refused)"),
    "hub offline, not cached": (["--dataset", "gsm8k"], {"HF_HUB_OFFLINE": "1"},
                                "HF_HUB_OFFLINE is set, so only a cached copy can be used"),
    "no answers": (["--dataset", "{d}/no_answers.jsonl"], {}, "no_answers.jsonl': no usable rows (dropped 20 without an "
                   "answer)"),
    "corrupt parquet": (["--dataset", "{d}/corrupt.parquet"], {}, "corrupt.parquet': `datasets` cannot read it ("),
    "unknown format": (["--dataset", "{d}/notes.txt"], {}, "notes.txt': not a file `datasets` reads here"),
    "renamed column missing": (["--dataset", "{d}/own_columns.jsonl", "--prompt-column", "question"], {},
                               "has no column(s) ['question'] (columns: ['prompt', 'answer'])"),
    "reward module missing": (["--reward", "no_such_module14:f"], {}, "cannot import 'no_such_module14'"),
}


CLI = ["broken line", "gsm8k columns", "hub offline, not cached"]  # through the real command line, side by side


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    for name, lines in FILES.items():
        (d / name).write_text("".join(line + "\n" for line in lines))
    return d


@pytest.fixture(scope="module")
def cli_results(data_dir):
    """The CLI cases at once, each in its own process (HF_HUB_OFFLINE is read when `datasets` is imported)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "TRANSFORMERS"))}
    env["HF_HOME"] = str(data_dir / "hf_home")  # an empty cache
    procs = {}
    for case in CLI:
        argv, extra, _ = CASES[case]
        out = data_dir / case.replace(" ", "_").replace(",", "")
        cmd = [sys.executable, "gspo.py", *[a.format(d=data_dir) for a in argv], "--output-dir", str(out)]
        procs[case] = (subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True), out, time.time())
    done = {}
    for case, (p, out, t) in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        done[case] = (p.returncode, stdout, stderr, out.exists(), time.time() - t)
    return done


@pytest.mark.parametrize("case", CLI)
def test_bad_data_fails_on_the_command_line_with_one_line(case, cli_results):
    rc, stdout, stderr, run_folder, seconds = cli_results[case]
    assert rc == 1 and stderr.count("\n") == 1 and stderr.startswith("error: "), stderr[-3000:]
    assert CASES[case][2] in stderr, stderr
    assert not run_folder and seconds < 60  # three at once on 2 cores; each alone takes ~3 s
    assert "train /" not in stdout  # the data never got as far as being counted


@pytest.mark.parametrize("case", [c for c in CASES if c not in CLI])
def test_bad_data_fails_before_any_model(case, data_dir, monkeypatch, tmp_path):
    """The same check in this process (test_cli.fails_before_any_model: one line, no model, no run folder)."""
    from helpers import fails_before_any_model

    argv, extra, needle = CASES[case]
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    t = time.time()
    fails_before_any_model("gspo", [a.format(d=data_dir) for a in argv], needle, monkeypatch, tmp_path)
    assert time.time() - t < 10


def test_numbers_as_answers_and_chat_prompts_are_text(tmp_path):
    rows = [{"prompt": "3%10=", "answer": 3}, {"prompt": "2.5*2=", "answer": 5.0}, {"prompt": "1+1=", "answer": "2"},
            {"prompt": [{"role": "user", "content": "4%10="}], "answer": 4}, {"prompt": "none", "answer": None}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    train, held, dropped = data.load_task(data.Task(str(path), None, 2, 0, enable_thinking=False),
                                          modeling.tiny_tokenizer())
    # 4 distinct prompts x 4: one held out (one row), its 3 copies trained on by neither split (issue 54)
    assert dropped == {"no_answer": 4, "too_long": 0} and (len(train), len(held)) == (12, 1)
    assert sorted(set(train["answer"]) | set(held["answer"])) == ["2", "3", "4", "5.0"]
    prompts = list(train["prompt"]) + list(held["prompt"])  # a column of text and message lists (datasets' Json)
    assert [{"role": "user", "content": "4%10="}] in prompts and "3%10=" in prompts  # each as given
    texts = list(train["text"]) + list(held["text"])
    assert "<|im_start|>user\n4%10=<|im_end|>\n<|im_start|>assistant\n" in texts


def test_the_flat_warning_judges_each_reward_not_their_sum(capsys):
    """Issue 61 1(d): two rewards whose weighted sums are equal in the group but whose values tell the completions
    apart (GDPO's normalize-then-sum gives them A = -+1) are not 'every group flat': no warning; with each reward
    constant in the group, the warning after FLAT_STEPS steps."""
    from types import SimpleNamespace

    summed = torch.tensor([2.0, 2.0, 2.0, 2.0])  # 1 x a + 2 x b
    apart = {"a": torch.tensor([2.0, 0.0, 2.0, 0.0]), "b": torch.tensor([0.0, 1.0, 0.0, 1.0])}
    constant = {"a": torch.tensor([2.0, 2.0, 2.0, 2.0]), "b": torch.tensor([0.0, 0.0, 0.0, math.nan])}
    for values, warned in ((apart, False), (constant, True)):
        reward = SimpleNamespace(flat_steps=0)
        for _ in range(rewards.FLAT_STEPS):
            rewards.watch_flat_groups(reward, summed, 4, values)
        assert ("the answers may not be gradable" in capsys.readouterr().err) == warned and reward.flat_steps < 0


def test_flat_rewards_in_the_first_steps_are_reported_once(capsys):
    reward = grader.Reward()
    flat, spread = ["\\boxed{1}"] * 4, ["\\boxed{1}", "\\boxed{2}"] * 2
    for step in range(rewards.FLAT_STEPS + 2):
        rewards.score(flat, ["7", "8"], 2, reward)
        rewards.score(spread, ["1"], 4, reward, watch=False)  # an evaluation between steps does not count
        err = capsys.readouterr().err
        assert ("the answers may not be gradable" in err) == (step == rewards.FLAT_STEPS - 1), (step, err)
    fresh = grader.Reward()
    rewards.score(spread, ["1"], 4, fresh)  # a first step with a spread: never reported
    for _ in range(rewards.FLAT_STEPS):
        rewards.score(flat, ["7", "8"], 2, fresh)
    assert "gradable" not in capsys.readouterr().err and fresh.flat_steps < 0
    assert torch.equal(rewards.score(flat, ["1", "1"], 2, fresh)[0], torch.ones(4))


def test_fewer_held_out_prompts_than_ranks_fail_before_any_generation():
    """Each rank evaluates an equal share: with 1 held-out prompt and 2 ranks no rank has one (it logged NaN)."""
    from datasets import Dataset

    held = Dataset.from_list([{"prompt": "1+1", "answer": "2", "text": "1+1"}])
    with pytest.raises(SystemExit) as e:  # no model: it stops before any generation
        plan = evaluation.Evaluation(Sampling(max_new_tokens=4, gen_batch_size=8), k=2)
        evaluation.evaluate(None, None, held, None, distributed.Dist(0, 2, torch.device("cpu")), plan)
    assert str(e.value.code).startswith("error: the held-out split has 1 prompt(s), fewer than the 2 ranks")
