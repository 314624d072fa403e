"""What more than one test file uses, in one place: running a script in-process or under torchrun and reading its
metrics, the bad-input check, the loss tensors and value-and-gradient, the engine's test model and its HF reference,
transformers' sampling, TRL 1.16 run as the peer and verl's loss written out. Test files import from here and from
conftest, never from each other; the programs in tests/programs/ may import from here too."""
import contextlib
import dataclasses
import functools
import glob
import importlib
import io
import json
import math
import os
import subprocess
import sys
import types
from collections import defaultdict

import pytest
import torch
from transformers.generation import logits_process as lp

import common
from grouprl import checkpoint
from grouprl import engine
from grouprl import modeling
from grouprl.data import chat_prompts
from grouprl.distributed import Dist, seed_everything
from grouprl.sampling import Sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest's; here too for the programs


# ---- a script's run: in this process (run_script) or under torchrun, its metrics.jsonl, bad input


def run_script(script, argv, monkeypatch, out, jitter_row=True):
    """`python {script}.py {argv} --output-dir {out}` in this process: (its metrics rows, the run folder)."""
    mod = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv, "--output-dir", str(out)])
    mod.main()
    (run,) = glob.glob(f"{out}/*/metrics.jsonl")
    rows = read_rows(run, jitter_row)
    return rows, os.path.dirname(run)


def not_json(constant):
    raise ValueError(f"{constant} is not JSON")


def read_rows(path, jitter_row=True):
    """metrics.jsonl, read as strict JSON (NaN or Infinity fail), one row a step; the last (training) step's row also
    holds the run's Jitter2 (checked here)."""
    rows = [json.loads(line, parse_constant=not_json) for line in open(path)]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), steps
    with_jitter = [i for i, r in enumerate(rows) if "charts/reward_jitter2" in r]
    assert with_jitter == ([len(rows) - 1] if jitter_row else [])
    return rows


def torchrun(*args):
    """`torchrun --standalone --nproc-per-node 2 {args}` from the repository root, its output captured."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


# a short run: 4 prompts a rank, no evaluation, no sample tables (test_checkpoint, test_reliability)
SHORT = ["--prompts-per-rank", "4", "--eval-every", "0", "--log-samples", "0"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def bad_dataset(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1?", "solution": "2"}])


def fails_before_any_model(script, argv, needle, monkeypatch, tmp_path):
    """`script` with argv (BAD: a dataset without the answer column) exits with one line holding needle (None:
    argparse's exit 2) before any model is built, and writes nothing."""
    mod = importlib.import_module(script)

    def no_model(*a, **k):
        raise AssertionError("the model was built before the bad input was caught")

    monkeypatch.setattr(mod, "load_model", no_model)
    argv = [bad_dataset(tmp_path) if a == "BAD" else a for a in argv]
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--output-dir", str(tmp_path / "runs"), *argv])
    with pytest.raises(SystemExit) as e:
        mod.main()
    if needle is None:
        assert e.value.code == 2
        return
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg
    assert not (tmp_path / "runs").exists()  # nothing written either


def fake_checkpoint(ckpt, **state):
    """A checkpoint folder holding only state/trainer_state.json and its manifest."""
    (ckpt / "state").mkdir(parents=True, exist_ok=True)
    (ckpt / "state" / "trainer_state.json").write_text(json.dumps(state))
    checkpoint.write_manifest(str(ckpt))


# ---- losses' stats and tensors


def mean(stat) -> float:
    """A logged mean from a loss's stats, given as (sum, count)."""
    total, count = stat
    return float(total / count)


def ragged_batch(B=6, T=7, seed=0, spread=0.3):
    """Random log-probs, old log-probs a little apart, ragged completion masks (padding), +/- advantages."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + spread * torch.randn(B, T, generator=g)).requires_grad_()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logp.data[mask == 0] = float("nan")  # padding must never leak into the loss
    adv = torch.randn(B, generator=g)
    return logp, old, adv, mask


def batch(spread, seed=0, dtype=torch.float64):
    """Six completions of 5, 3, 1, 4, 5, 2 tokens (of 5), drawn in float64, then cast: logp, old log-probs `spread`
    apart (normal, in log: how far the ratios reach), ref 0.5 apart, the mask, advantages of both signs and a 0."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    old = logp + spread * torch.randn(6, 5, generator=g, dtype=torch.float64)
    ref = logp + 0.5 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).double()
    adv = torch.tensor([1.2, -0.4, 0.0, -1.5, 0.7, 2.0], dtype=torch.float64)
    return [x.to(dtype) for x in (logp, old, ref, mask, adv)]


def value_and_grad(fn, logp):
    """fn(logp) and its gradient with respect to logp (a copy that requires it)."""
    x = logp.clone().requires_grad_(True)
    out = fn(x)
    (g,) = torch.autograd.grad(out, x)
    return out.detach(), g


# ---- the engine's test model and HF generate as its reference (test_engine and the files beside it)


CPU = torch.device("cpu")
PROMPTS = ["1%10=", "a longer prompt, 23%10=", "7%10=", "xy", "a much longer prompt than the others, 5%10="]


@pytest.fixture(scope="module")
def setup():
    return setup_model()


def setup_model():
    tok = modeling.tiny_tokenizer()
    seed_everything(0)
    lm = modeling.tiny_model(tok).eval()
    g = torch.Generator().manual_seed(0)
    for p in lm.parameters():  # larger weights than the init's: greedy rows that differ token by token
        if p.dim() == 2:
            p.data.normal_(0, 0.3, generator=g)
    ids = [tok(p, add_special_tokens=False).input_ids for p in chat_prompts(tok, PROMPTS, False)]
    return tok, lm, ids


def sharded_tiny_and_twin(d, tok):
    """For a program under torchrun (d: its Dist): the tiny model (seed 0) FSDP2-sharded over the ranks (fp32, no
    activation checkpointing) and its one-process twin with the same seed, both in eval mode -> (the sharded
    model's lm, the sharded Policy, the twin Policy, the twin's Dist: this rank alone, world 1)."""
    lm, rank0_weights = modeling.load_model("tiny", tok, d, seed=0)
    policy = modeling.wrap_policy(lm, d, 1.0, 16, False, "fp32", rank0_weights=rank0_weights)
    one = Dist(d.rank, 1, d.device)
    single = modeling.Policy(modeling.load_model("tiny", tok, one, seed=0)[0], 1.0, 16)
    policy.eval(), single.eval()
    return lm, policy, single, one


def hf_greedy(lm, tok, ids, n, eos, max_new_tokens, mode="repeat", **kw):
    """HF generate, each prompt repeated n times (--gen-mode repeat), greedy: completions up to the first EOS."""
    d = Dist(0, 1, CPU)
    texts = [tok.decode(p) for p in ids]
    kw = {"temperature": 1.0, "top_p": 1.0, "top_k": 1, **kw}
    roll = common.generate(modeling.Policy(lm), tok, texts, n, eos, d,
                           Sampling(max_new_tokens=max_new_tokens, gen_batch_size=64, mode=mode, **kw))
    P = roll.n_prompt
    comps = [row[P:][m.bool()].tolist() for row, m in zip(roll.input_ids, roll.mask)]
    return comps, roll.truncated.tolist()


DRAWN = {f.name for f in dataclasses.fields(Sampling)}  # the rest of run's keywords: the Setup's


def run(lm, ids, n, eos, max_new_tokens, slots, generator=None, stats=None, **kw):
    """engine.generate on the CPU in fp32, greedy unless kw says otherwise: kw's Sampling fields to the Sampling,
    the rest to the Setup."""
    how = {"temperature": 1.0, "top_k": 1, "top_p": 1.0, **{k: v for k, v in kw.items() if k in DRAWN}}
    where = {k: v for k, v in kw.items() if k not in DRAWN}
    return engine.generate(lm, ids, n, eos, Sampling(max_new_tokens, **how),
                           engine.Setup(slots, CPU, torch.float32, **where), generator, stats)


# ---- transformers' sampling, written from its processors (test_sampling; test_engine's reference)


def hf_warped(scores, temperature, top_k, top_p, min_p=0.0):
    scores = lp.TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0:
        scores = lp.MinPLogitsWarper(min_p)(None, scores)
    return scores


def ids_of(seen):
    """seen [R, V] bool -> input_ids [R, max count] as HF's RepetitionPenaltyLogitsProcessor reads them, padded
    with V (an id past the logits, which it drops)."""
    rows = [row.nonzero()[:, 0].tolist() for row in seen]
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [seen.shape[1]] * (width - len(r)) for r in rows])


def hf_penalised(x, penalty, seen):
    """RepetitionPenaltyLogitsProcessor on float32 logits (generate's first processor here)."""
    if penalty == 1.0:
        return x.float()
    return lp.RepetitionPenaltyLogitsProcessor(float(penalty))(ids_of(seen), x.float())


def multinomial_sample(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, *,
                       seen=None, generator=None):
    """HF's sampling as transformers writes it (the engine's sampler before sampling.py): its processors in
    float32 in generate's order (repetition penalty, temperature, top-k, top-p, min-p), then torch.multinomial;
    the log-prob under the tempered softmax of the penalised logits."""
    scores = hf_penalised(logits, repetition_penalty, seen)
    logp = torch.log_softmax(scores / temperature, -1)
    scores = hf_warped(scores, temperature, top_k, top_p, min_p)
    tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)
    return tokens[:, 0], logp.gather(1, tokens)[:, 0]


# ---- TRL 1.16.0 itself, run as the parity tests' reference (test_trl_parity, test_token_weights, test_cispo,
# test_sapo, test_vespo); what cannot be run, transcribed from its source: trl_is_ratio (inline in TRL) and
# verl's geo_mean (verl is not installed); StubPolicy, the old pass's stand-in

G, B, T = 4, 8, 5
REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements-test.txt")
TRL_VERSION = next(line.split("==")[1].strip() for line in open(REQUIREMENTS) if line.startswith("trl=="))
LENGTHS = {"full": [5, 3, 1, 4, 5, 2, 5, 4], "empty": [5, 3, 0, 4, 5, 0, 5, 4]}  # empty: --mask-truncated rows


@functools.cache
def _trl():
    try:
        import trl
        from trl.trainer import grpo_trainer, utils
    except ImportError as e:
        return f"trl is not installed ({e}): pip install -r tests/requirements-test.txt"
    if trl.__version__ != TRL_VERSION:
        return f"trl {trl.__version__} is installed; the parity tests read {TRL_VERSION} (tests/requirements-test.txt)"
    return grpo_trainer.GRPOTrainer, utils.nanstd


def trl():
    """(GRPOTrainer, nanstd) of TRL 1.16.0. Missing or another version: fails in CI, skips elsewhere."""
    got = _trl()
    if isinstance(got, str):
        if os.environ.get("CI"):
            pytest.fail(got, pytrace=False)
        pytest.skip(got)
    return got


@contextlib.contextmanager
def default_dtype(dtype):
    """TRL's code run with dtype as the default: its count / (count - 1) of integer tensors (nanstd's Bessel factor)
    and torch.where of two Python floats (SAPO's temperatures) come out in the default dtype, float32 otherwise."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def trl_advantages(rewards, scale):
    """TRL's sum_then_normalize advantages (grpo_trainer.py:2765-2787) with TRL's own nanstd, in float64."""
    nanstd = trl()[1]
    r = rewards.double()
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    with default_dtype(torch.float64):
        std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G) if scale == "group" else nanstd(r).expand_as(r)
    adv = r - mean
    return adv if scale == "none" else adv / (std + 1e-4)


def trl_loss(logp, old, adv, mask, *, level="token", loss_type="grpo", eps_lo=0.2, eps_hi=0.28, beta=0.0, ref=None,
             bias_kl=False, delta=None, max_len=T, entropies=None, top_entropy=1.0, opsm=None, sampling=None,
             is_ratio=None, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0), metrics=None):
    """TRL 1.16's GRPOTrainer._compute_loss on one process, one micro-batch (no accumulation, training mode): the
    per-token log-probs logp (and entropies) stand in for the model's forward; old, ref, sampling and is_ratio are
    the inputs dict's old_per_token_logps, ref_per_token_logps, sampling_per_token_logps and
    importance_sampling_ratio (vLLM's correction on). Fills metrics (a dict) with TRL's logged values."""
    trainer = trl()[0]
    args = types.SimpleNamespace(use_bias_correction_kl=bias_kl, delta=delta, sapo_temperature_pos=sapo[0],
                                 sapo_temperature_neg=sapo[1], vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1],
                                 vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3], steps_per_generation=1)
    one_process = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction: x,
                                        pad_across_processes=lambda x, dim, pad_index: x)
    ent = torch.zeros_like(logp) if entropies is None else entropies
    me = types.SimpleNamespace(
        args=args, accelerator=one_process, loss_type=loss_type, importance_sampling_level=level,
        epsilon_low=eps_lo, epsilon_high=eps_hi, beta=beta, top_entropy_quantile=top_entropy,
        off_policy_mask_threshold=opsm, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_len, _metrics={"train": defaultdict(list)},
        get_off_policy_mask=trainer.get_off_policy_mask, get_gamma_weights=trainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None))
    me.get_high_entropy_mask = types.MethodType(trainer.get_high_entropy_mask, me)
    ids = torch.zeros(mask.shape, dtype=torch.long)
    inputs = dict(prompt_ids=ids[:, :0], prompt_mask=ids[:, :0], completion_ids=ids, completion_mask=mask,
                  advantages=adv, old_per_token_logps=old, num_items_in_batch=mask.sum())
    for key, value in (("ref_per_token_logps", ref), ("sampling_per_token_logps", sampling),
                       ("importance_sampling_ratio", is_ratio)):
        if value is not None:
            inputs[key] = value
    with default_dtype(logp.dtype):
        loss = trainer._compute_loss(me, None, inputs)
    if metrics is not None:
        metrics.update({k: v[0] for k, v in me._metrics["train"].items()})
    return loss


def trl_batch(seed=0, lengths="full"):
    """Two groups of 4 completions (LENGTHS' tokens of 5) in float64, and their rewards."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside the clip band
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS[lengths])[:, None]).double()
    rewards = torch.tensor([1.0, 0, 0, 0, 0.5, 1, 0, 2])
    return logp, old, ref, mask, rewards


def value_grad(fn, logp):
    x = logp.clone().requires_grad_()
    out = fn(x)
    out.backward()
    return out.item(), x.grad


def assert_equal_trl(ours_fn, trl_fn, logp, mask, rel=1e-10):
    """Value and gradient (on the loss tokens) of ours and TRL's, float64; returns TRL's value."""
    ours, g_ours = value_grad(ours_fn, logp)
    theirs, g_theirs = value_grad(trl_fn, logp)
    assert ours == pytest.approx(theirs, rel=rel, abs=1e-12)
    torch.testing.assert_close(g_ours * mask, g_theirs * mask, rtol=rel, atol=1e-12)
    return theirs


class StubPolicy:
    """The old pass's forward: rows of fixed log-probs and entropies (row r's ids are all r)."""

    def __init__(self, logp, entropy):
        self.logp, self.entropy = logp, entropy

    def __call__(self, ids, attention_mask, n_prompt, entropy=False):
        rows = ids[:, 0]
        return self.logp[rows], self.entropy[rows]


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vllm_importance_sampling_ratio, transcribed: TRL computes it inline in
    _generate_and_score_completions (trl/trainer/grpo_trainer.py:2660-2703), no function of its own to call.
    (B, T) for token_* modes, (B, 1) for sequence_* modes; a NaN sampling log-prob gives a ratio of 1, as in TRL."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    logps_diff = diff.sum(dim=-1, keepdim=True) if mode in ("sequence_mask", "sequence_truncate") else diff
    ratio = torch.exp(logps_diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


def verl_geo_mean(logp, old, adv, mask, clip_low, clip_high, rollout_is_weights=None):
    advantages = adv[:, None] * mask  # verl's token-level advantages, the sequence's on every token
    negative_approx_kl = logp - old
    sgn = torch.sign(advantages)
    clamp = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    kl_min = sgn * torch.min(sgn * negative_approx_kl, sgn * clamp)
    n = mask.sum(dim=-1)
    ratio = torch.exp((kl_min * mask).sum(dim=-1) / (n + 1e-8))
    advantage = (advantages * mask).sum(dim=-1) / (n + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:  # the token weights' geometric mean, the sequence's weight
        pg_losses = pg_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / (n + 1e-8))
    return torch.mean(pg_losses)


@functools.cache
def help_of(script: str) -> str:
    """What `python {script}.py --help` prints at 120 columns, made in this process by the script's own call,
    parse_args(Args) with sys.argv as the shell gives it (a subprocess a script costs ~3 s of imports;
    test_cli.py::test_help_in_process_is_the_scripts checks that the two are the same bytes)."""
    from grouprl.cli import parsing

    mod = importlib.import_module(script)
    argv, columns = sys.argv, os.environ.get("COLUMNS")
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # utf-8: tyro's boxes, as on a terminal
    sys.argv, os.environ["COLUMNS"] = [f"{script}.py", "--help"], "120"
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            parsing.parse_args(mod.Args)
    finally:
        sys.argv = argv
        os.environ.pop("COLUMNS") if columns is None else os.environ.update(COLUMNS=columns)
    assert e.value.code in (0, None)
    out.flush()
    return out.buffer.getvalue().decode()
