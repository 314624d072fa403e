"""--log-samples: what the model writes, with its rewards and advantages, in samples.jsonl and tensorboard; the
last printed line gives the final held-out avg@k and pass@k."""
import json
import os
import types

import pytest
import torch

import common
from grouprl import evaluation, runlog
from helpers import run_script


def test_samples_and_final_eval_line(monkeypatch, tmp_path, capsys):
    rows, run = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--log-samples", "1",
                                    "--eval-every", "1", "--eval-size", "4", "--eval-k", "2"], monkeypatch, tmp_path)
    samples = [json.loads(line) for line in open(os.path.join(run, "samples.jsonl"))]
    assert [s["step"] for s in samples] == [1] * 16  # 2 prompts x 8 completions
    for step in (1,):
        for g in range(2):
            group = samples[(step - 1) * 16 + g * 8:(step - 1) * 16 + (g + 1) * 8]
            assert len({(s["prompt"], s["answer"]) for s in group}) == 1
            prompt_digit = group[0]["prompt"].split("%")[0]
            assert group[0]["answer"] == prompt_digit  # the built-in task: x%10= has answer x
            # the prompt as the model saw it: through the chat template (issue 26)
            assert {s["prompt_text"] for s in group} == {
                f"<|im_start|>user\n{group[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"}
            r = torch.tensor([float(common.math_reward(s["completion"], s["answer"])) for s in group])
            assert r.tolist() == [s["reward"] for s in group]  # graded again here: the same rewards
            adv = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)  # DFPO eq. 43
            assert torch.allclose(adv, torch.tensor([s["advantage"] for s in group]), atol=1e-5)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run, size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1]
    assert samples[0]["completion"].replace("|", "\\|") in texts[0].tensor_proto.string_val[0].decode()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    final = rows[-1]
    assert last.startswith("done in ") and (f"; held-out avg@2 {final['eval/avg@2']:.3f}, "
                                            f"pass@2 {final['eval/pass@2']:.3f}; checkpoint: ") in last


def test_samples_every_k_steps(tmp_path):
    """Rows of steps k, 2k, ...; a resumed run's rows: test_resume.py's branch test."""
    logged = []
    writer = types.SimpleNamespace(add_text=lambda tag, text, step: logged.append((tag, step)))
    logger = types.SimpleNamespace(dist_env=types.SimpleNamespace(main=True), writer=writer, run_dir=str(tmp_path))
    r, adv = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.5, -0.5, -0.5, -0.5])
    rows = {"prompt": ["a", "b"], "answer": ["1", "2"], "text": ["<a>", "<b>"]}  # 2 prompts, 2 completions each
    roll = types.SimpleNamespace(rows=rows, texts=["x", "y", "z", "w"], rewards=r)
    for step in (1, 2, 3, 4):
        runlog.log_samples(logger, roll, adv, step, 2)  # every 2 steps: 2 and 4
    steps = [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")]
    assert steps == [2, 2, 2, 2, 4, 4, 4, 4] and logged == [("samples", 2), ("samples", 4)]
    runlog.log_samples(logger, roll, adv, 6, 0)  # 0: never
    assert len(logged) == 2


@pytest.mark.parametrize("log, expected", [({"eval/avg@8": 0.25, "eval/pass@8": 0.5}, "; held-out avg@8 0.250, pass@8 0.500"),
                                           ({"charts/reward_mean": 0.3}, "")])
def test_eval_summary(log, expected):
    assert evaluation.eval_summary(log) == expected


def test_eval_samples_are_the_first_prompts_of_the_whole_evaluation():
    """--log-eval-samples 1 with --gen-batch-size 2 and k = 2 (one prompt a generate call, four calls): the rows of
    the first held-out prompt only, its 2 completions, not the first prompt of every call."""
    from datasets import Dataset

    from grouprl import data, distributed, modeling
    from grouprl.sampling import Sampling

    d = distributed.Dist(0, 1, torch.device("cpu"))
    tok = modeling.tiny_tokenizer()
    lm, _ = modeling.load_model("tiny", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 64, False).eval()
    prompts = [f"{i}%10=" for i in range(4)]
    held = Dataset.from_list([{"prompt": p, "answer": p[0], "text": t}
                              for p, t in zip(prompts, data.chat_prompts(tok, prompts, False))])
    plan = evaluation.Evaluation(Sampling(max_new_tokens=2, gen_batch_size=2), k=2, log_samples=1)
    result = evaluation.evaluate(policy, tok, held, modeling.eos_ids(lm, tok), d, plan)
    rows = result[evaluation.EVAL_ROWS]
    assert [r["prompt"] for r in rows] == ["0%10="] * 2, [r["prompt"] for r in rows]
