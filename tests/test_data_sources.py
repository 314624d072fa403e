"""Data as TRL and verl users bring it (issue 26): any file `datasets.load_dataset` reads or a hub id, renamed
columns, TRL's `solution` and verl's nested `reward_model.ground_truth`, conversational prompts whole through the
chat template (system messages kept), --system-prompt, every other column kept, --eval-dataset in full,
--eval-only on the whole file, the chat template's own thinking default. Files are written here; the hub is
reached only through its error path or a monkeypatched `datasets.load_dataset`."""
import json

import pandas as pd
import pytest

from grouprl import cli
import common
from grouprl import data
from grouprl import modeling
from grouprl import rewards
from conftest import SCRIPTS
from helpers import fails_before_any_model

TOK = modeling.tiny_tokenizer()
SYSTEM = [{"role": "system", "content": "Answer with one digit."}]


def load(path, eval_size=3, **kw):
    return data.load_task(data.Task(str(path), None, eval_size, 0, **kw), TOK)


def test_parquet_in_verl_layout_conversational_with_system_message(tmp_path):
    """verl's parquet: prompt a message list (system + user), the answer in reward_model.ground_truth, extra
    columns kept; the whole conversation reaches the model (only the last turn did before)."""
    rows = [{"data_source": "digits", "prompt": SYSTEM + [{"role": "user", "content": f"{i}%10="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"index": i}} for i in range(20)]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    train, held, dropped = load(path)
    assert dropped == {"no_answer": 0, "too_long": 0} and len(train) == 18 and len(held) == 2
    assert {"data_source", "ability", "reward_model", "extra_info", "prompt", "answer", "text"} <= set(
        train.column_names)
    for r in list(train) + list(held):
        i = r["extra_info"]["index"]
        assert r["answer"] == str(i) and r["prompt"] == rows[i]["prompt"]  # the message list as given
        assert r["text"] == ("<|im_start|>system\nAnswer with one digit.<|im_end|>\n"
                             f"<|im_start|>user\n{i}%10=<|im_end|>\n<|im_start|>assistant\n")


def test_renamed_columns_csv_and_trl_solution(tmp_path):
    """--prompt-column / --answer-column on a csv file; TRL's 'solution' read when 'answer' is absent; numbers
    as answers are text; other columns kept under their own names."""
    path = tmp_path / "q.csv"
    pd.DataFrame({"question": [f"{i}+1=" for i in range(30)], "gold": [i + 1 for i in range(30)],
                  "level": ["easy"] * 30}).to_csv(path, index=False)
    train, held, _ = load(path, prompt_column="question", answer_column="gold")
    r = train[0]
    assert r["prompt"] == r["question"] and r["answer"] == str(int(r["question"].split("+")[0]) + 1)
    assert r["level"] == "easy" and len(held) == 3  # a tenth of 30, at most --eval-size 3
    trl = tmp_path / "trl.jsonl"
    trl.write_text("".join(json.dumps({"prompt": f"{i}%10=", "solution": str(i)}) + "\n" for i in range(10)))
    train, _, _ = load(trl)
    assert all(r["answer"] == r["prompt"].split("%")[0] for r in train)


def test_system_prompt_reaches_the_model(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}%10=", "answer": str(i)}) + "\n" for i in range(10)))
    train, held, _ = load(path, system_prompt="Think, then answer.")
    for r in list(train) + list(held):
        assert r["text"] == (f"<|im_start|>system\nThink, then answer.<|im_end|>\n<|im_start|>user\n{r['prompt']}"
                             "<|im_end|>\n<|im_start|>assistant\n")
        assert r["prompt"] == f"{r['answer']}%10="  # the prompt as given; the system message is in the text


def test_a_column_that_does_not_exist_names_the_columns_there_are(tmp_path, capsys):
    path = tmp_path / "q.parquet"
    pd.DataFrame({"question": ["1+1="] * 4, "gold": ["2"] * 4}).to_parquet(path)
    with pytest.raises(SystemExit) as e:
        load(path, answer_column="answr")
    assert str(e.value.code) == (f"error: --dataset '{path}' has no column(s) ['prompt', 'answr'] (columns: "
                                 "['question', 'gold']); name them with --prompt-column and --answer-column")


def test_eval_dataset_in_full_and_eval_only_on_the_whole_file(tmp_path):
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "aime.parquet"
    train_file.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(30)))
    pd.DataFrame({"problem": [f"{i}*1=" for i in range(25)], "answer": [str(i) for i in range(25)]}).to_parquet(
        eval_file)
    with pytest.raises(SystemExit, match=r"--eval-dataset '.*aime.parquet' has no column\(s\) \['prompt'\]"):
        load(train_file, eval_size=4, eval_dataset=str(eval_file))  # the same --prompt-column for both sets
    train, held, _ = data.load_task(data.Task(str(train_file), None, 4, 0, eval_dataset="builtin"), TOK)
    assert len(train) == 30 and len(held) == 4  # builtin as the eval set: --eval-size prompts
    eval_rows = tmp_path / "eval.jsonl"
    eval_rows.write_text("".join(json.dumps({"prompt": f"{i}*1=", "answer": str(i)}) + "\n" for i in range(25)))
    train, held, _ = load(train_file, eval_size=4, eval_dataset=str(eval_rows))
    assert len(train) == 30 and len(held) == 25  # no held-out split taken from training, the eval set whole
    assert held["prompt"] == [f"{i}*1=" for i in range(25)]
    _, held, dropped = load(train_file, eval_size=4, eval_dataset=str(eval_rows), eval_limit=7)
    assert len(held) == 7 and dropped == {"no_answer": 0, "too_long": 0}  # the 18 left out were not too long
    train, held, _ = load(train_file, eval_size=4, eval_only=True)
    assert len(train) == 0 and len(held) == 30  # --eval-only: the whole file, not a tenth of it


def test_eval_set_without_answers_fails_before_any_model(monkeypatch, tmp_path):
    path = tmp_path / "noanswer.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}%10="}) + "\n" for i in range(5)))
    fails_before_any_model("gspo", ["--eval-dataset", str(path)],
                           f"--eval-dataset '{path}' has no column(s) ['answer'] (columns: ['prompt'])",
                           monkeypatch, tmp_path)


@pytest.mark.parametrize("argv, needle", [
    (["--eval-dataset", "nosuchset"], "--eval-dataset 'nosuchset': unknown"),
    (["--eval-dataset", "missing.parquet"], "--eval-dataset 'missing.parquet': no such file"),
    (["--eval-temperature", "0"], "--eval-temperature 0.0: must be >= 0.001 and finite"),
    (["--eval-top-p", "1.5"], "--eval-top-p 1.5: must lie in (0, 1]"),
    (["--eval-limit", "-1"], "--eval-limit -1: must be >= 0"),
    (["--kl-coef", "-1"], "--kl-coef -1.0: must be >= 0 and finite"),
])
def test_bad_eval_and_kl_flags(argv, needle, monkeypatch, tmp_path):
    fails_before_any_model("dfpo", argv, needle, monkeypatch, tmp_path)


def test_hub_id_through_load_dataset(monkeypatch):
    """A hub id goes to `datasets.load_dataset` (here monkeypatched: tests are offline): its train split trains,
    its test split is held out."""
    import datasets

    calls = []

    def fake(name, config=None, **kw):
        calls.append((name, config))
        return datasets.DatasetDict({
            "train": datasets.Dataset.from_list([{"problem": f"{i}-0=", "solution": str(i)} for i in range(12)]),
            "test": datasets.Dataset.from_list([{"problem": f"{i}-1=", "solution": str(i - 1)} for i in range(5)])})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train, held, _ = data.load_task(data.Task("trl-lib/DeepMath-103K", None, 64, 0, prompt_column="problem"), TOK)
    assert calls == [("trl-lib/DeepMath-103K", None)] and len(train) == 12 and len(held) == 5
    assert held[0]["answer"] == "-1" and train[0]["prompt"] == train[0]["problem"]


def test_hub_id_unreachable_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    fails_before_any_model("gspo", ["--dataset", "trl-lib/DeepMath-103K"],
                           "--dataset trl-lib/DeepMath-103K: cannot reach http://127.0.0.1:9", monkeypatch, tmp_path)


# ----------------------------------------------------------------------------------------------- thinking
QWEN3_END = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
             "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
             "{%- endif %}{%- endif %}")  # the end of Qwen3's own chat template


def test_thinking_defaults_to_the_templates_own():
    """--enable-thinking unset passes nothing: a Qwen3 template thinks (no empty <think></think> closing the
    prompt); False still turns it off; the tiny model's template ignores it (default runs are unchanged)."""
    assert cli.CommonArgs().enable_thinking is None
    qwen = modeling.tiny_tokenizer()
    qwen.chat_template = QWEN3_END
    default, = data.chat_prompts(qwen, ["2+2="], None)
    assert default == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert data.chat_prompts(qwen, ["2+2="], True) == [default]
    assert data.chat_prompts(qwen, ["2+2="], False) == [default + "<think>\n\n</think>\n\n"]
    assert data.chat_prompts(TOK, ["2+2="], None) == data.chat_prompts(TOK, ["2+2="], False) == \
        data.chat_prompts(TOK, ["2+2="], True)


def test_docs_think_format_scores_on_the_builtin_task(tmp_path, monkeypatch):
    """docs/rewards.md's think_format reward, as written there, through --reward's loader and the scoring of a step,
    on built-in rows: a completion that thinks and boxes its answer scores 1, a bare answer 0."""
    from grouprl import grader

    page = open(f"{common.__file__.rsplit('/', 1)[0]}/docs/rewards.md").read()
    block = page.split("def think_format", 1)[1].split("```", 1)[0]
    (tmp_path / "my_rewards.py").write_text("import re\n\n\ndef think_format" + block)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = grader.load_reward("my_rewards:think_format", 5.0)
    rows = data.builtin_task(2, 0)
    texts = [f"<think>{r['prompt']} is {r['answer']}</think> \\boxed{{{r['answer']}}}" for r in rows] + \
            [r["answer"] for r in rows]
    r, errors = rewards.score(texts, [r["answer"] for r in rows] * 2, 1, reward, watch=False)
    assert r.tolist() == [1.0, 1.0, 0.0, 0.0] and errors == 0


def test_docs_trl_and_verl_tables_name_real_flags():
    """Every flag docs/trl-and-verl.md's TRL and verl tables map to is a flag of one of the scripts (--reward-weights comes with
    issue 26's rewards, merged from another branch)."""
    import dataclasses
    import importlib
    import re

    tables = open(f"{common.__file__.rsplit('/', 1)[0]}/docs/trl-and-verl.md").read()
    named = set(re.findall(r"`--([a-z-]+)", tables))
    flags = {f.name.replace("_", "-") for s in SCRIPTS
             for f in dataclasses.fields(importlib.import_module(s).Args)}
    assert len(named) > 25 and named - flags <= {"reward-weights"}, named - flags
    for name in ("num_generations", "max_completion_length", "beta", "epsilon_high", "steps_per_generation",
                     "per_device_train_batch_size", "reward_weights", "mask_truncated_completions", "loss_type",
                     "scale_rewards", "importance_sampling_level", "data.train_batch_size",
                     "actor_rollout_ref.rollout.n", "clip_ratio_low", "loss_agg_mode", "kl_ctrl", "use_kl_loss",
                     "kl_loss_coef", "data.max_response_length", "ppo_mini_batch_size"):
        assert name in tables, name


@pytest.mark.parametrize("argv, expected", [([], {"temperature": 0.9, "top_p": 0.8}),
                                            (["--eval-temperature", "0.6", "--eval-top-p", "0.95"],
                                             {"temperature": 0.6, "top_p": 0.95})])
def test_evaluation_samples_at_its_own_temperature_and_top_p(argv, expected, monkeypatch, tmp_path):
    """--eval-temperature / --eval-top-p reach evaluate(); unset, the training ones do (as before)."""
    import sys

    import gspo

    seen = []

    def fake_evaluate(policy, tok, held, eos, d, plan):
        seen.append({k: getattr(plan.sampling, k) for k in expected})
        return {"eval/avg@2": 0.0, "eval/pass@2": 0.0, "eval/prompts": len(held), "eval/samples": 2,
                "eval/reward_errors": 0.0}

    monkeypatch.setattr(gspo, "evaluate", fake_evaluate)
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--eval-only", "--eval-k", "2", "--temperature", "0.9", "--top-p",
                                      "0.8", *argv, "--output-dir", str(tmp_path)])
    gspo.main()
    assert seen == [expected]


def write_split(path, n, tag):
    path.write_text("".join(json.dumps({"prompt": f"{tag} {i}%10=", "answer": str(i % 10)}) + "\n" for i in range(n)))


def test_folders_and_globs_keep_their_splits(tmp_path, capsys):
    """Local folders and globs keep their splits (issue 37 item 3): a validation file is the held-out set when there
    is no test file; a glob of train/test files keeps them apart (it read them as one train split, a tenth held
    out); --eval-dataset of a folder evaluates its test split, whole; the start-up line names the held-out rows."""
    val = tmp_path / "valdir"
    val.mkdir()
    write_split(val / "train.jsonl", 20, "r")
    write_split(val / "validation.jsonl", 4, "v")
    train, held, _ = load(val, eval_size=8)
    assert (len(train), len(held)) == (20, 4) and all(p.startswith("v ") for p in held["prompt"])
    assert f"held out: split 'validation' of --dataset {val} (at most --eval-size 8 rows)" in capsys.readouterr().out

    shards = tmp_path / "shards"
    shards.mkdir()
    write_split(shards / "gsm_train.jsonl", 20, "r")
    write_split(shards / "gsm_test.jsonl", 5, "t")
    train, held, _ = load(f"{shards}/*.jsonl", eval_size=8)
    assert (len(train), len(held)) == (20, 5) and all(p.startswith("t ") for p in held["prompt"])
    assert f"held out: split 'test' of --dataset {shards}/*.jsonl" in capsys.readouterr().out
    (shards / "gsm_test.jsonl").unlink()  # no test file in the glob: one split, a tenth kept apart
    write_split(shards / "more.jsonl", 10, "m")
    train, held, _ = load(f"{shards}/*.jsonl", eval_size=8)
    assert (len(train), len(held)) == (27, 3)
    assert "held out: 3 rows of --dataset" in capsys.readouterr().out

    write_split(val / "test.jsonl", 6, "t")  # a test file beside validation: test is the held-out set
    train, held, _ = load(val, eval_size=8)
    assert len(held) == 6 and all(p.startswith("t ") for p in held["prompt"])
    capsys.readouterr()
    write_split(tmp_path / "one.jsonl", 30, "o")
    train, held, _ = load(tmp_path / "one.jsonl", eval_size=8, eval_dataset=str(val))
    assert (len(train), len(held)) == (30, 6) and all(p.startswith("t ") for p in held["prompt"])
    assert f"held out: --eval-dataset {val}: split 'test'" in capsys.readouterr().out
