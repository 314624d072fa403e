"""Hostile input and numerical accidents: a reward that raises, a completion holding code, non-finite losses."""
import sys

import pytest
import torch

import common
import data
import distributed
import grader
from test_train import run_script


def test_grader_that_raises_scores_zero_and_is_counted(monkeypatch, capsys):
    real = grader.extract_answer

    def flaky(text):
        if "boom" in text:
            raise RuntimeError("grader bug")
        return real(text)

    monkeypatch.setattr(common, "extract_answer", flaky)
    r, errors = common.score(["3", "boom 3", "x = 4"], ["3", "4"], 2)  # answers 3, 3 | 4
    assert r.tolist() == [1.0, 0.0, 1.0] and errors == 1
    assert "the reward failed on 1 of 3 completions, scored 0 (first: RuntimeError: grader bug)" in \
        capsys.readouterr().err


def test_code_in_a_completion_is_only_parsed(tmp_path):
    marker = tmp_path / "pwned"
    texts = [f"__import__('os').system('touch {marker}')", f"exec(\"open('{marker}', 'w')\") 7", "\\boxed{7}"]
    r, errors = common.score(texts, ["7"], 3)
    assert r.tolist() == [0.0, 1.0, 1.0] and errors == 0 and not marker.exists()


def test_run_goes_on_when_the_reward_always_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "extract_answer", lambda text: 1 / 0)
    rows, _ = run_script("gspo", ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0"], monkeypatch,
                         tmp_path)
    assert [r["charts/reward_errors"] for r in rows] == [32, 32]  # 4 prompts x 8 completions, each step
    assert all(r["charts/reward_mean"] == 0 and r["charts/zero_adv_group_frac"] == 1 for r in rows)


def nan_on(calls, loss_fn):
    """Wrap a loss so that the listed calls (1-based) return a NaN loss (and so NaN gradients)."""
    count = [0]

    def wrapped(*a, **k):
        count[0] += 1
        loss, seq_terms, stats = loss_fn(*a, **k)
        return (loss * float("nan") if calls == "all" or count[0] in calls else loss), seq_terms, stats

    return wrapped


@pytest.mark.parametrize("script", ["gspo", "dfpo"])
def test_nonfinite_update_is_skipped_and_counted(script, monkeypatch, tmp_path):
    mod = __import__(script)
    loss_name = f"{script}_loss"
    monkeypatch.setattr(mod, loss_name, nan_on({2, 5}, getattr(mod, loss_name)))
    rows, run = run_script(script, ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0"], monkeypatch,
                           tmp_path)
    assert [r["losses/skipped_updates"] for r in rows] == [1, 1]  # 4 updates a step: calls 2 and 5
    from transformers import AutoModelForCausalLM

    assert all(torch.isfinite(p).all() for p in AutoModelForCausalLM.from_pretrained(f"{run}/step_2/model").parameters())


def test_nonfinite_updates_never_touch_the_weights(monkeypatch, tmp_path):
    import gspo
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(gspo, "gspo_loss", nan_on("all", gspo.gspo_loss))
    rows, run = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0",
                                    "--max-nonfinite", "10"], monkeypatch, tmp_path)
    assert rows[0]["losses/skipped_updates"] == 4
    trained = AutoModelForCausalLM.from_pretrained(f"{run}/step_1/state")  # fp32 masters, not the bf16 export
    tok = common.tiny_tokenizer()
    start, _ = common.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=1)  # the run's init
    for (n, p), q in zip(trained.named_parameters(), start.parameters()):
        assert torch.equal(p, q), n


def test_nonfinite_updates_in_a_row_stop_the_run(monkeypatch, tmp_path):
    import gspo

    monkeypatch.setattr(gspo, "gspo_loss", nan_on("all", gspo.gspo_loss))
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0",
                                      "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value.code).startswith("error: step 1: 3 non-finite updates in a row (loss nan")
    assert not list(tmp_path.glob("*/step_*"))  # stopped before any checkpoint


def test_rows_without_answer_and_long_prompts_are_dropped_and_counted(tmp_path):
    tok = common.tiny_tokenizer()
    rows = ([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
            + [{"prompt": "x" * 500 + "=", "answer": "1"} for _ in range(5)]  # 500+ tokens for the tiny tokenizer
            + [{"prompt": "no answer", "answer": None}, {"prompt": "empty answer", "answer": "  "}])
    path = tmp_path / "data.jsonl"
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    train, held, dropped = data.load_task(str(path), None, 3, 0, tok, False, max_prompt_tokens=100)
    assert dropped == {"no_answer": 2, "too_long": 5} and len(train) + len(held) == 30
    assert all(len(tok(t).input_ids) <= 100 for t in list(train["text"]) + list(held["text"]))
