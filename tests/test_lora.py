"""LoRA (--lora-rank, lora.py): only the adapters get a gradient; with B = 0 the first step's log-probs and loss are
full fine-tuning's; the KL reference is the base with the adapters off; --gen-mode engine decodes the merged weights;
a stopped run resumes bitwise; a checkpoint's merged bf16 model loads with from_pretrained and generates the training
model's greedy tokens, its adapter folder loads with PeftModel.from_pretrained; torchrun 2 ranks (FSDP2) gives one
process's adapters; bad LoRA flags fail in one line."""
import glob
import importlib
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from grouprl import lora
from grouprl import modeling
from conftest import ROOT
from grouprl.distributed import Dist, seed_everything
from gspo import gspo_loss

CPU = Dist(0, 1, torch.device("cpu"))
SPEC = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=(lora.ALL_LINEAR,))
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def batch(tok, B=8, P=6, T=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    am[:, P:] = mask.long()
    return ids, am, P, mask, torch.randn(B, generator=g)


def policies(seed=0):
    tok = modeling.tiny_tokenizer()
    full = modeling.Policy(modeling.load_model("tiny", tok, CPU, seed)[0], 1.0, 16)
    adapted = modeling.Policy(modeling.load_model("tiny", tok, CPU, seed, lora=SPEC)[0], 1.0, 16)
    return tok, full, adapted


def test_adapters_on_every_decoder_linear_fp32_and_only_they_learn():
    """Every linear layer of the decoder (not the LM head) carries an fp32 adapter; two AdamW steps change every
    adapter (the first moves only B, which starts at 0: A's gradient is B^T times something) and no base weight."""
    tok, _, policy = policies()
    assert lora.decoder_linears(policy.lm) == LINEARS
    adapted = {n.split(".")[-1] for n, m in policy.lm.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(LINEARS)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids, am, P, mask, adv = batch(tok)
    for _ in range(2):
        with torch.no_grad():
            old = policy(ids, am, P)
        loss, *_ = gspo_loss(policy(ids, am, P), old, adv, mask, clip_low=0.2, clip_high=0.2)
        loss.backward()
        got_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
        assert got_grad and all("lora_" in n for n in got_grad), got_grad - {n for n in got_grad if "lora_" in n}
        opt.step()
        opt.zero_grad()
    for n, p in policy.named_parameters():
        assert p.requires_grad == ("lora_" in n), n
        if "lora_" in n:
            assert p.dtype == torch.float32 and not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n  # the frozen base: bitwise unchanged


def test_bf16_base_fp32_adapters_computed_in_bf16():
    """--dtype bf16 (a GPU's auto) in one process: the frozen base held in bf16, the adapters and their gradients
    and AdamW state in fp32, the forward under autocast (bf16 matmuls); log-probs fp32."""
    tok = modeling.tiny_tokenizer()
    lm = modeling.load_model("tiny", tok, CPU, 0, dtype="bf16", lora=SPEC)[0]
    policy = modeling.wrap_policy(lm, CPU, 1.0, 16, False, "bf16")
    assert policy.autocast == torch.bfloat16
    for n, p in policy.named_parameters():
        assert p.dtype == (torch.float32 if "lora_" in n else torch.bfloat16), n
    ids, am, P, mask, adv = batch(tok)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    for _ in range(2):
        with torch.no_grad():
            old = policy(ids, am, P)
        logp = policy(ids, am, P)
        assert logp.dtype == torch.float32
        gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0].backward()
        assert all(p.grad.dtype == torch.float32 for p in policy.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values()) and len(opt.state) == 2 * 2 * 7


def test_first_step_equals_full_fine_tuning():
    """Same seed: the base is the full model's weights, and B = 0 makes W x + s B A x = W x, so the log-probs and
    the first step's loss are bitwise full fine-tuning's."""
    tok, full, adapted = policies()
    ids, am, P, mask, adv = batch(tok)
    with torch.no_grad():
        old = full(ids, am, P)
    assert torch.equal(adapted(ids, am, P), old)
    loss_full, *_ = gspo_loss(full(ids, am, P), old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss_lora, *_ = gspo_loss(adapted(ids, am, P), old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss_full.item() == loss_lora.item() != 0


def random_adapters(lm, scale=0.3, seed=2):
    """B != 0 (a trained adapter): the adapted model differs from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale, generator=g)


def test_kl_reference_is_the_base_with_adapters_off():
    """grpo --kl-coef under LoRA: the reference is the policy with its adapters off, which is the initial model
    (bitwise), while the policy itself has moved; no second model is built."""
    tok, full, adapted = policies()
    random_adapters(adapted.lm)
    ids, am, P, *_ = batch(tok)
    ref = lora.adapters_disabled(adapted)
    with torch.no_grad():
        assert torch.equal(ref(ids, am, P), full(ids, am, P))
        assert not torch.allclose(adapted(ids, am, P), full(ids, am, P), atol=1e-3)
        assert not torch.equal(ref(ids, am, P), adapted(ids, am, P))  # the adapters are back on after the block


def test_engine_decodes_the_merged_weights():
    """--gen-mode engine reads each weight into a plain tensor: under LoRA, W + s B A (engine.weight). Its greedy
    tokens equal HF generate's on the merged model (peft's merge_and_unload)."""
    import copy

    from grouprl.data import chat_prompts
    from helpers import PROMPTS, hf_greedy, run

    tok = modeling.tiny_tokenizer()
    seed_everything(0)
    base = modeling.tiny_model(tok).eval()
    g = torch.Generator().manual_seed(0)
    for p in base.parameters():  # larger weights than the init's, as test_engine: decisive greedy tokens
        if p.dim() == 2:
            p.data.normal_(0, 0.3, generator=g)
    ids = [tok(p, add_special_tokens=False).input_ids for p in chat_prompts(tok, PROMPTS, False)]
    lm = lora.apply_lora(base, SPEC, LINEARS, "tiny").eval()
    random_adapters(lm, scale=0.5)
    eos = [tok.eos_token_id]
    comps, _ = run(lm, ids, 1, eos, 8, 4)
    ref, _ = hf_greedy(copy.deepcopy(lm).merge_and_unload(), tok, ids, 1, eos, 8)
    assert comps == ref
    with lm.disable_adapter():  # the adapters matter: the base alone writes other tokens
        plain, _ = run(lm, ids, 1, eos, 8, 4)
    assert plain != ref


# -------------------- a script's run: resume, the checkpoint's export, FSDP2
# grpo with the KL penalty (its reference: the adapters off), dropout (RNG the resume restores), checkpointing
RUN = ["--num-steps", "4", "--prompts-per-rank", "4", "--num-minibatches", "2", "--eval-every", "0",
       "--learning-rate", "5e-3", "--kl-coef", "0.05", "--activation-checkpointing",
       "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1"]


def launch(out, crash=None):
    """tests/programs/crash.py runs grpo.py as `python grpo.py` would, with CRASH injected (test_resume's recipe)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("CRASH", "CRASH_RANK")}
    if crash:
        env["CRASH"] = crash
    return subprocess.run([sys.executable, "tests/programs/crash.py", "grpo.py", *RUN, "--output-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def lora_result(out):
    """(adapters, merged weights, logged rows without timings, the folder) of the one run under `out`, at step 4."""
    from helpers import read_rows

    (run,) = glob.glob(f"{out}/*/metrics.jsonl")
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_rows(run)]
    step = os.path.join(os.path.dirname(run), "step_4")
    return (load_file(os.path.join(step, lora.ADAPTER_DIR, "adapter_model.safetensors")),
            load_file(os.path.join(step, "model", "model.safetensors")), rows, step)


_straight = {}


def straight_lora(tmp_path_factory):
    """The unbroken LoRA run, once."""
    if not _straight:
        out = tmp_path_factory.mktemp("lora_straight")
        p = launch(out)
        assert p.returncode == 0, p.stderr[-3000:]
        _straight["run"] = lora_result(out)
    return _straight["run"]


@pytest.mark.slow
def test_stopped_lora_run_resumes_bitwise(tmp_path, tmp_path_factory):
    """SIGTERM in step 3 (a checkpoint of the adapters and their AdamW state), then --resume auto: the adapters,
    the merged model and every logged number (KL to the reference included) equal the unbroken run's."""
    adapters, merged, rows, _ = straight_lora(tmp_path_factory)
    assert all(r["losses/kl_ref"] > 0 for r in rows[1:])  # the adapters moved away from the reference
    p = launch(tmp_path, crash="sigterm:3")
    assert p.returncode == 0, p.stderr[-3000:]
    RUN.extend(["--resume", "auto"])
    try:
        p = launch(tmp_path)
    finally:
        del RUN[-2:]
    assert p.returncode == 0 and "resuming" in p.stdout, p.stderr[-3000:]
    adapters2, merged2, rows2, _ = lora_result(tmp_path)
    assert adapters.keys() == adapters2.keys() and all(torch.equal(adapters[k], adapters2[k]) for k in adapters)
    assert merged.keys() == merged2.keys() and all(torch.equal(merged[k], merged2[k]) for k in merged)
    assert [r["step"] for r in rows2] == [1, 2, 3, 4] and rows == rows2


def test_export_loads_and_generates_the_training_models_tokens(tmp_path_factory):
    """A LoRA checkpoint: adapter/ loads with PeftModel.from_pretrained onto the base (--model tiny, seed 1) and
    holds the trained adapters in fp32; the merged model loads with from_pretrained in bf16, its weights are
    bf16(W + alpha / r B A), and it writes the training model's greedy tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapters, merged, _, step = straight_lora(tmp_path_factory)
    tok = modeling.tiny_tokenizer()
    base = modeling.load_model("tiny", tok, CPU, 1)[0]
    trained = PeftModel.from_pretrained(base, os.path.join(step, lora.ADAPTER_DIR)).eval()
    B = trained.get_decoder().layers[0].mlp.down_proj.lora_B["default"].weight
    assert B.dtype == torch.float32 and B.abs().sum() > 0  # trained, fp32
    assert {w.dtype for w in merged.values()} == {torch.bfloat16}
    export = AutoModelForCausalLM.from_pretrained(os.path.join(step, "model"), dtype="auto").eval()  # bf16: its config
    assert {p.dtype for p in export.parameters()} == {torch.bfloat16}
    q = trained.get_decoder().layers[1].self_attn.q_proj
    want = q.base_layer.weight + 8 / 4 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.equal(export.get_decoder().layers[1].self_attn.q_proj.weight, want.detach().to(torch.bfloat16))
    enc = tok(["3%10=", "7%10=", "12%10=", "hello"], padding=True, return_tensors="pt")
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        ours = trained.generate(**enc, **kw)
        theirs = export.generate(**enc, **kw)
    assert torch.equal(ours, theirs)


def test_torchrun_two_ranks_give_one_process_adapters():
    """FSDP2 over 2 CPU ranks with activation checkpointing: the adapters sharded with their layers, trained on half
    the groups each, equal one process's on the whole batch; the engine's merged weights and a checkpoint's adapters
    too (tests/programs/lora_fsdp.py)."""
    from helpers import torchrun

    p = torchrun("tests/programs/lora_fsdp.py")
    assert p.returncode == 0 and p.stdout.count("LoRA FSDP2 OK") == 2, p.stdout[-2000:] + p.stderr[-4000:]


def test_memory_plan_counts_the_adapters_exactly():
    """benchmarks/memory_plan.py's LoRA terms: its adapter count is peft's on the tiny model (rank 4, every linear
    layer of the decoder), the frozen base 2 bytes a parameter and the adapters 16, sharded."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_plan

    _, full, adapted = policies()
    A = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    P = sum(p.numel() for p in full.parameters())
    config = full.lm.config.to_dict()
    assert memory_plan.lora_parameters(config, 4) == A
    row = memory_plan.plan(config, gpus=2, seqs=1, tokens=10, gen_seqs=1, chunk=4, lora_rank=4)
    assert row["frozen base, bf16 sharded 2P/n"] == 2 * P / 2 / 1e9
    assert row["adapters, fp32 + grads + AdamW 16A/n"] == 16 * A / 2 / 1e9


# -------------------- bad input
@pytest.mark.parametrize("argv, needle", [
    (["--lora-alpha", "8"], "--lora-rank 0 with --lora-alpha: LoRA needs a rank >= 1"),
    (["--lora-target-modules", "q_proj"], "--lora-rank 0 with --lora-target-modules"),
    (["--lora-rank", "-2"], "--lora-rank -2: LoRA needs a rank >= 1"),
    (["--lora-rank", "4", "--lora-alpha", "nan"], "--lora-alpha nan: must be > 0"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout 1.0: must lie in [0, 1)"),
    (["--lora-rank", "4", "--dtype", "bf16-pure"], "--dtype bf16-pure with --lora-rank"),
])
def test_bad_lora_flags_fail_before_any_model(argv, needle, monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)


@pytest.mark.parametrize("targets, needle", [
    (["qproj"], "--lora-target-modules qproj: no linear layer of the decoder has that name; the linear layers are "
                "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (or all-linear)"),
    (["q_proj", "lm_head"], "--lora-target-modules lm_head: no linear layer of the decoder"),
])
def test_unknown_target_module_lists_the_linear_layers(targets, needle, monkeypatch, tmp_path):
    """Known once the model's config is read: checked on a model without weights, before any is built."""
    mod = importlib.import_module("grpo")
    monkeypatch.setattr(modeling, "apply_lora", lambda *a, **k: pytest.fail("adapters built before the check"))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--output-dir", str(tmp_path), "--lora-rank", "4",
                                      "--lora-target-modules", *targets])
    with pytest.raises(SystemExit) as e:
        mod.main()
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg
