"""A user's first real run (issue 53): the evaluation in view (its progress bar, the step-0 evaluation named in the
bar and in a stop signal's line, --log-eval-samples), what a run will generate said before a real model loads on a
CPU, the evaluation's own --eval-max-new-tokens, and checkpoints proportionate to the run (--save-final, the size
written)."""
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import common
from conftest import ROOT
from grouprl import checkpoint, data, distributed, evaluation, grader, modeling, runlog
from helpers import help_of, run_script
from grouprl.sampling import Sampling


def test_eval_samples_bar_and_length_through_the_loop(monkeypatch, tmp_path, capsys):
    """--log-eval-samples 2: at steps 0, 1 and 2, the first 2 held-out prompts' completions (eval-k 2 each), each
    with the reward the grader gives it again and the answer it extracts, in eval_samples.jsonl and in tensorboard
    ('eval_samples'); metrics.jsonl keeps its numbers only. --eval-max-new-tokens 1 bounds the evaluation's
    completions, not training's (2). The bar names the step-0 evaluation and shows samples and tokens a second."""
    rows, run = run_script("gspo", ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "1",
                                    "--eval-size", "4", "--eval-k", "2", "--log-eval-samples", "2",
                                    "--eval-max-new-tokens", "1"], monkeypatch, tmp_path)
    err = capsys.readouterr().err
    samples = [json.loads(line) for line in open(os.path.join(run, "eval_samples.jsonl"))]
    assert [s["step"] for s in samples] == [0] * 4 + [1] * 4 + [2] * 4  # 2 prompts x 2 samples, 3 evaluations
    assert len({s["prompt"] for s in samples[:4]}) == 2 and samples[0]["prompt"] == samples[1]["prompt"]
    tok = modeling.load_tokenizer("tiny", False)
    for s in samples:
        assert s["reward"] == common.math_reward(s["completion"], s["answer"])  # graded again: the same reward
        assert s["extracted"] == grader.extract_answer(s["completion"])
        assert len(tok(s["completion"], add_special_tokens=False).input_ids) <= 1  # --eval-max-new-tokens 1
    assert all("eval/completions" not in r for r in rows) and "eval/avg@2" in rows[0]
    args = json.load(open(os.path.join(run, "args.json")))
    assert (args["max_new_tokens"], args["eval_max_new_tokens"]) == (2, 1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run, size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("eval_samples/text_summary")
    assert [t.step for t in texts] == [0, 1, 2]
    shown = texts[0].tensor_proto.string_val[0].decode()
    assert f"**prompt:** {samples[0]['prompt']}" in shown and "| reward | extracted | completion |" in shown
    assert "step-0 evaluation: 100%" in err and "4/4" in err and "8/8 samples" in err and "tok/s" in err
    assert "held-out evaluation" in err


def test_eval_max_new_tokens_defaults_to_training_length():
    from grouprl.cli import fill_defaults
    from gspo import Args

    assert fill_defaults(Args()).eval_max_new_tokens == 2
    assert fill_defaults(Args(max_new_tokens=40)).eval_max_new_tokens == 40
    assert fill_defaults(Args(max_new_tokens=40, eval_max_new_tokens=8)).eval_max_new_tokens == 8


def test_the_bar_moves_inside_one_generate_call():
    """HF's streamer hands the bar each decoding step's tokens: within one generate call of 3 prompts x 4 samples
    the bar has counted every generated token (the pad of finished rows not), before the call returns."""
    d = distributed.Dist(0, 1, torch.device("cpu"))
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 64, False).eval()
    prompts = data.chat_prompts(tok, ["1%10=", "a longer prompt, 23%10=", "7%10="], False)
    seen = []
    bar = common.GenBar("eval", 3, 4, tok.pad_token_id, main=True, leave=False)
    real_put = bar.put
    bar.put = lambda value: seen.append(value.shape) or real_put(value)
    out = common.generate(policy, tok, prompts, 4, modeling.eos_ids(lm, tok), d,
                          Sampling(max_new_tokens=6, gen_batch_size=64), streamer=bar)
    assert len(seen) >= 2 and all(len(s) == 1 and s[0] == 12 for s in seen[1:])  # [B x n] a decoding step
    assert bar.tokens == int(out.mask.sum()) > 0 and bar.bar.n == 0  # prompts move once a call is scored
    # a row counts as a sample done once it stops (the pad after its EOS: a row stopping at the last step does not)
    stopped = ~out.truncated & (out.mask.sum(1) < out.mask.shape[1])
    assert torch.equal(bar.stopped, stopped) and stopped.any()
    bar.show(3)
    assert (bar.samples, bar.stopped, bar.bar.n) == (12, None, 3)


def test_a_slow_steps_rollout_is_in_view(monkeypatch, tmp_path, capsys):
    """A step's generation shows its own bar once it has run ROLLOUT_BAR_DELAY seconds (here 0), cleared when done."""
    monkeypatch.setattr(common, "ROLLOUT_BAR_DELAY", 0.0)
    steps, put = [], common.GenBar.put
    monkeypatch.setattr(common.GenBar, "put", lambda self, value: steps.append(value.dim()) or put(self, value))
    run_script("gspo", ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0"], monkeypatch, tmp_path)
    err = capsys.readouterr().err
    assert "step 1 rollout:   0%|          | 0/4" in err and "step 2 rollout" in err
    assert steps.count(2) == 2 and steps.count(1) >= 2  # each step's call: its prompts, then its decoding steps


def test_a_stop_signal_during_the_step0_evaluation_is_named(tmp_path):
    """SIGTERM while the step-0 evaluation generates: one line naming it, nothing saved."""
    p = subprocess.Popen([sys.executable, "tests/programs/stall.py", "grouprl.evaluation.generate",
                          str(tmp_path / "runs"), "--eval-every", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line == "waiting\n":
            break
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and err.endswith(
        "error: SIGTERM during the step-0 evaluation, before the first step: stopped, nothing was saved (start the "
        "run again)\n"), err
    assert "step-0 evaluation:   0%" in err


def test_a_resumed_logger_drops_the_eval_samples_it_redoes(tmp_path):
    (tmp_path / "eval_samples.jsonl").write_text("".join(json.dumps({"step": s, "completion": "x"}) + "\n"
                                                         for s in (0, 2, 4)))
    args = types.SimpleNamespace(track=False)
    logger = runlog.Logger(str(tmp_path), distributed.Dist(0, 1, torch.device("cpu")), args, first_step=3)
    logger.log(4, {"eval/avg@1": 0.5, evaluation.EVAL_ROWS: [{"prompt": "p", "answer": "1", "completion": "1",
                                                          "reward": 1.0, "extracted": "1", "truncated": False}]})
    logger.close()
    steps = [json.loads(line)["step"] for line in open(tmp_path / "eval_samples.jsonl")]
    assert steps == [0, 2, 4]
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == [{"step": 4, "eval/avg@1": 0.5}]


def cost_line(argv, monkeypatch, capsys, model):
    import gspo

    monkeypatch.setattr(gspo, "setup_distributed", lambda *a: pytest.fail("set up before the cost line"))
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--model", model, *argv])
    with pytest.raises(pytest.fail.Exception):
        gspo.main()
    return capsys.readouterr().out


def test_the_cost_line_before_a_real_model_loads_on_a_cpu(tiny_dir, monkeypatch, capsys, tmp_path):
    """3 steps x 4 prompts x G 8 x 5 tokens = 480 for training; 3 evaluations (step 0, 2, 3) x 4 prompts x 2 samples
    x 10 tokens = 240, a third of 720; nothing for the built-in tiny model."""
    argv = ["--num-steps", "3", "--prompts-per-rank", "4", "--max-new-tokens", "5", "--eval-every", "2",
            "--eval-size", "4", "--eval-k", "2", "--eval-max-new-tokens", "10", "--output-dir", str(tmp_path)]
    assert cost_line(argv, monkeypatch, capsys, str(tiny_dir)) == (
        "on the CPU this run generates at most: training 3 steps x 4 prompts x G 8 x 5 tokens = 480; evaluation 3 "
        "evaluations x 4 held-out prompts x 2 samples x 10 tokens = 240, 33% of all new tokens (a real model's CPU "
        "recipe: README.md, 'A real model on a CPU')\n")
    no_eval = [a for a in argv if a not in ("--eval-max-new-tokens", "10")] + ["--eval-every", "0"]  # 1(q): refused
    assert "evaluation 0 evaluations" in cost_line(no_eval, monkeypatch, capsys, str(tiny_dir))
    assert cost_line(argv, monkeypatch, capsys, "tiny") == ""
    data = tmp_path / "set.jsonl"  # --eval-only evaluates the whole file: its size is not known yet
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    assert cost_line(argv + ["--eval-only", "--dataset", str(data)], monkeypatch, capsys, str(tiny_dir)).startswith(
        "on the CPU this run generates at most: 1 evaluations x all the set's held-out prompts x 2 samples x 10 "
        "tokens new tokens")


def size_of(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.mark.parametrize("final", ["full", "model"])
def test_save_final(final, monkeypatch, tmp_path, capsys):
    """--save-final model ends with {run}/final/model alone (from_pretrained loads it), no state/; full: step_1 as
    ever. Either way the end's save says the size it wrote."""
    from transformers import AutoModelForCausalLM

    rows, run = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0",
                                    "--save-final", final], monkeypatch, tmp_path)
    out = capsys.readouterr().out
    folder = os.path.join(run, "final" if final == "model" else "step_1")
    assert sorted(os.listdir(folder)) == (["model"] if final == "model" else ["manifest.json", "model", "state"])
    assert not os.path.exists(os.path.join(run, "step_1")) or final == "full"
    model_mb = f"{size_of(os.path.join(folder, 'model')) / 1e6:.1f} MB"
    said = f"wrote {folder}: {size_of(folder) / 1e6:.1f} MB (model/ {model_mb}, the bf16 export"
    assert said in out and ("state/" in out) == (final == "full")
    assert out.strip().splitlines()[-1].endswith(f"checkpoint: {folder}")
    AutoModelForCausalLM.from_pretrained(os.path.join(folder, "model"))


def test_save_final_model_after_a_stop_signal_stays_full(monkeypatch, tmp_path):
    """A stop signal's save at the last step is a full checkpoint: the run was stopped, and may be continued."""
    import gspo

    def stopped():
        checkpoint._stop["signal"] = signal.SIGTERM
        return True

    monkeypatch.setattr(gspo, "stop_requested", stopped)
    try:
        rows, run = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0",
                                        "--save-final", "model"], monkeypatch, tmp_path)
    finally:
        checkpoint._stop["signal"] = None
    assert os.path.isdir(os.path.join(run, "step_1", "state")) and not os.path.exists(os.path.join(run, "final"))


def test_help_says_what_a_checkpoint_holds():
    text = " ".join(help_of("gspo").replace("│", " ").split())
    assert "(0: only at the end). A checkpoint, step_N/, holds model/ (the bf16 export" in text
    assert "--save-final" in text and "what --resume needs" in text


def readme_cpu_command() -> list[str]:
    """The README's real-model CPU command, as words."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text[text.index("### A real model on a CPU"):]
    block = block[block.index("```bash"):block.index("```\n", block.index("```bash") + 7)]
    lines = block.replace("\\\n", " ").splitlines()
    return [line for line in lines if line.startswith("OMP_NUM_THREADS=1 python ")][0].split()[2:]


def test_the_readmes_cpu_command_runs(tiny_dir, monkeypatch, tmp_path, capsys):
    """The README's real-model CPU command, on the task `real_model_runs.py --task-only` writes, runs through every
    flag it gives (the tiny model in the real one's place, one step): the held-out set is the 64 sums never trained
    on, the evaluation greedy and 40 tokens long, and the run ends with the export alone."""
    p = subprocess.run([sys.executable, "experiments/real_model_runs.py", "--task-only", str(tmp_path / "data")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    train = [json.loads(line) for line in open(tmp_path / "data" / "train.jsonl")]
    test = [json.loads(line) for line in open(tmp_path / "data" / "test.jsonl")]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test} and len(test) == 128
    script, *argv = readme_cpu_command()
    assert script == "grpo.py" and argv[argv.index("--learning-rate") + 1] == "2e-5"
    argv = [w.replace("~/.cache/group-rl/smollm2-135m-instruct", tiny_dir).replace("data/", f"{tmp_path}/data/")
            for w in argv]
    rows, run = run_script("grpo", argv + ["--num-steps", "1"], monkeypatch, tmp_path / "runs")
    assert (rows[0]["eval/prompts"], rows[0]["eval/samples"]) == (64, 1) and rows[-1]["step"] == 1
    assert os.listdir(os.path.join(run, "final")) == ["model"] and "eval_samples.jsonl" in os.listdir(run)
    args = json.load(open(os.path.join(run, "args.json")))
    assert (args["eval_max_new_tokens"], args["eval_temperature"], args["symmetric_clip"]) == (40, 0.001, True)
    assert capsys.readouterr().out.startswith("on the CPU this run generates at most: training 1 steps")


def test_eval_only_logs_its_samples_and_names_its_bar(monkeypatch, tmp_path, capsys):
    """--eval-only with --log-eval-samples 1: the first prompt's samples at step 0 in eval_samples.jsonl, none in
    eval.json (its numbers only); the bar is named for --eval-only, not for a step 0 of training."""
    rows, run = run_script("gspo", ["--eval-only", "--eval-size", "4", "--eval-k", "2", "--log-eval-samples", "1"],
                           monkeypatch, tmp_path, jitter_row=False)
    samples = [json.loads(line) for line in open(os.path.join(run, "eval_samples.jsonl"))]
    assert [s["step"] for s in samples] == [0, 0] and len({s["prompt"] for s in samples}) == 1
    result = json.load(open(os.path.join(run, "eval.json")))["builtin"]
    assert "eval/completions" not in result and result["eval/samples"] == 2
    err = capsys.readouterr().err
    assert "--eval-only evaluation: 100%" in err and "step-0 evaluation" not in err
