"""Bad input fails fast with one clear line, before any model is built; --help documents every field; the
hub sets' loaders read local files laid out in the hub sets' own columns."""
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time

import pytest

from grouprl import checkpoint
import common
from grouprl import data
from grouprl import modeling
from conftest import ROOT, SCRIPTS
from helpers import bad_dataset, fails_before_any_model, help_of, write_jsonl


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv, needle", [
    (["--model", "./no/such/model"], "--model './no/such/model': no such folder"),
    (["--group-size", "1"], "--group-size 1"),
    (["--clip-low", "0"], "--clip-low 0.0: must be > 0 and finite"),
    (["--clip-high", "-0.1"], "--clip-high -0.1: must be > 0 and finite"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--prompts-per-rank", "6"], "multiple of --num-minibatches"),
    (["--dataset", "nosuchset"], "unknown"),
    (["--dataset", "BAD"], "has no column(s) ['prompt'] (columns: ['question', 'solution'])"),
    (["--warmup-frac", "1.5"], "--warmup-frac 1.5: must lie in [0, 1)"),
    (["--max-prompt-tokens", "5"], "no usable rows (dropped 0 without an answer, 4160 over --max-prompt-tokens 5)"),
    (["--max-nonfinite", "0"], "--max-nonfinite 0: must be >= 1"),
    # issue 36: flags that need the engine's sampled log-probs, or an MoE model
    (["--old-logp", "rollout"], "--old-logp rollout reads the log-probs the engine computes as it samples; "
                                "--gen-mode shared-prefill (HF generate) returns none"),
    (["--old-logp", "rollout", "--gen-mode", "engine", "--model", "tiny-moe"],
     "--model tiny-moe: HF generate runs in its place for model_type 'qwen3_moe'"),
    (["--routing-replay"], "--routing-replay forces the old pass's experts in each Mixture-of-Experts layer; "
                           "--model tiny (qwen3) is dense: drop it"),
])
def test_bad_input_fails_before_any_model(script, argv, needle, monkeypatch, tmp_path):
    fails_before_any_model(script, argv, needle, monkeypatch, tmp_path)


BAD_FLAGS = [  # every one fails in check_common_args: before the tokenizer, the data, the model and the run folder
    (["--top-k", "-5"], "--top-k -5: must be >= 0 (0 is off)"),
    (["--gen-batch-size", "0"], "--gen-batch-size 0: must lie in [1, 1048576]"),
    (["--logprob-chunk-tokens", "0"], "--logprob-chunk-tokens 0: must be >= 1"),
    (["--prompts-per-rank", "0"], "--prompts-per-rank 0: must lie in [1, 1048576]"),
    (["--learning-rate", "-1e-3"], "--learning-rate -0.001: must be > 0"),
    (["--learning-rate", "0"], "--learning-rate 0.0: must be > 0"),
    (["--eval-size", "0"], "--eval-size 0: must lie in [1, 1048576]"),
    (["--top-p", "0"], "--top-p 0.0: must lie in (0, 1]"),
    (["--top-p", "2"], "--top-p 2.0: must lie in (0, 1]"),
    (["--output-dir", "FILE"], "afile: is a file, not a folder"),
    (["--output-dir", "FILE/runs"], "afile is a file, not a folder"),
    (["--output-dir", "/proc/1/runs"], "--output-dir /proc/1/runs: /proc/1 is not writable"),
    (["--exp-name", "../../x"], "--exp-name '../../x': must be one folder name"),
    (["--gen-dtype", "bf16"], "--gen-dtype bf16 sets the engine's dtype; --gen-mode shared-prefill runs HF generate"),
    (["--dataset", "nosuchset"], "--dataset 'nosuchset': unknown"),
    (["--data-files", "x.jsonl"], "--dataset builtin would ignore it: drop it"),
    # non-finite and out-of-range floats (issue 27): each would load the model, then skip every update or crash
    (["--clip-low", "nan"], "--clip-low nan: must be > 0 and finite"),
    (["--clip-high", "nan"], "--clip-high nan: must be > 0 and finite"),
    (["--clip-high", "inf"], "--clip-high inf: must be > 0 and finite"),
    (["--temperature", "nan"], "--temperature nan: must be >= 0.001 and finite"),
    (["--temperature", "inf"], "--temperature inf: must be >= 0.001 and finite"),
    (["--temperature", "1e-40"], "--temperature 1e-40: must be >= 0.001 and finite (RL samples from the policy; "
                                 "below, logits / T overflow float32)"),
    (["--log-samples", "-1"], "--log-samples -1: must be >= 0 (0: never)"),
    (["--energy-every", "-1"], "--energy-every -1: must be >= 0 (0: never)"),
    (["--energy-every", "1", "--energy-rows", "0"], "--energy-rows 0: must be >= 1"),
    (["--truncated-reward-scale", "-0.5"], "--truncated-reward-scale -0.5: must lie in [0, 1]"),
    (["--truncated-reward-scale", "nan"], "--truncated-reward-scale nan: must lie in [0, 1]"),
    (["--num-iterations", "0"], "--num-iterations 0: must lie in [1, 1024] (passes over each rollout's minibatches)"),
    (["--adv-eps", "nan"], "--adv-eps nan: must be >= 0 and finite (added to the std of --scale-rewards)"),
    (["--kl-ratio-correction"], "--kl-ratio-correction multiplies the KL penalty's k3 by the ratio: it needs "
                                "--kl-coef > 0"),
    (["--learning-rate", "nan"], "--learning-rate nan: must be > 0 and finite"),
    (["--learning-rate", "inf"], "--learning-rate inf: must be > 0 and finite"),
    (["--top-p", "nan"], "--top-p nan: must lie in (0, 1]"),
    # issue 37 item 5: HF's ranges (min_p 1 would keep the top token alone: say it with --top-k 1)
    (["--min-p", "-0.1"], "--min-p -0.1: must lie in [0, 1) (0 is off)"),
    (["--min-p", "1"], "--min-p 1.0: must lie in [0, 1) (0 is off)"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: must be > 0 and finite (1 is off; > 1 discourages"),
    (["--repetition-penalty", "nan"], "--repetition-penalty nan: must be > 0 and finite"),
    (["--old-logp", "rollout", "--gen-mode", "engine", "--repetition-penalty", "1.2"],
     "--old-logp rollout with --repetition-penalty 1.2: the engine's log-probs are then the penalised sampler's, "
     "not the policy's, so pi_old would be wrong; use --old-logp recompute"),
    (["--old-logp", "rollout", "--gen-mode", "engine", "--min-new-tokens", "2"],
     "--old-logp rollout with --min-new-tokens 2: the engine's log-probs of a completion's first tokens are then the "
     "EOS-masked sampler's, not the policy's"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be >= 0 and finite"),
    (["--weight-decay", "inf"], "--weight-decay inf: must be >= 0 and finite"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be >= 0 and finite"),
    (["--max-grad-norm", "nan"], "--max-grad-norm nan: must be > 0 and finite"),
    (["--max-grad-norm", "inf"], "--max-grad-norm inf: must be > 0 and finite"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0.0: must be > 0 and finite"),
    (["--warmup-frac", "nan"], "--warmup-frac nan: must lie in [0, 1)"),
    (["--min-lr-ratio", "nan"], "--min-lr-ratio nan: must lie in [0, 1]"),
    (["--min-lr-ratio", "-0.5"], "--min-lr-ratio -0.5: must lie in [0, 1]"),
    (["--reward-timeout", "nan"], "--reward-timeout nan: must be > 0 seconds and at most 86400"),
    (["--reward-timeout", "inf"], "--reward-timeout inf: must be > 0 seconds and at most 86400"),
    (["--reward-timeout", "1e10"], "--reward-timeout 10000000000.0: must be > 0 seconds and at most 86400"),
    (["--reward-timeout", "0"], "--reward-timeout 0.0: must be > 0 seconds and at most 86400"),
    (["--reward-timeout", "-1"], "--reward-timeout -1.0: must be > 0 seconds and at most 86400"),
    # integers past what seeding, generation or evaluation can take (issue 27): tracebacks after the model loaded
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: must lie in [0, 4294967295]"),
    (["--seed", "-1"], "--seed -1: must lie in [0, 4294967295]"),
    (["--group-size", "1000000000000"], "--group-size 1000000000000: must lie in [2, 1048576]"),
    (["--prompts-per-rank", "1048576", "--group-size", "2"],
     "--prompts-per-rank 1048576 x --group-size 2 = 2097152 completions a rank a step: must be at most 1048576"),
    (["--max-new-tokens", "1000000000000"], "--max-new-tokens 1000000000000: must lie in [1, 1048576]"),
    (["--gen-batch-size", "1000000000000"], "--gen-batch-size 1000000000000: must lie in [1, 1048576]"),
    (["--eval-size", "1000000000000"], "--eval-size 1000000000000: must lie in [1, 1048576]"),
    (["--eval-k", "1000000000000"],
     "--eval-size 64 x --eval-k 1000000000000 = 64000000000000 held-out completions: must be at most 1048576"),
    (["--eval-size", "1024", "--eval-n", "2048"],
     "--eval-size 1024 x --eval-n 2048 = 2097152 held-out completions: must be at most 1048576"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv, needle", BAD_FLAGS)
def test_bad_flag_fails_before_tokenizer_data_and_model(script, argv, needle, monkeypatch, tmp_path):
    mod = importlib.import_module(script)
    for name in ("setup_distributed", "load_tokenizer", "load_task"):
        monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("built before the bad flag was caught"))
    (tmp_path / "afile").write_text("")
    argv = [str(tmp_path / "afile") + a[4:] if a.startswith("FILE") else a for a in argv]
    fails_before_any_model(script, argv, needle, monkeypatch, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written, inside or outside


def test_stale_hf_rollout_logp_with_min_new_tokens_passes_the_checks(monkeypatch, tmp_path):
    """--max-staleness in an HF mode: the rollout's log-probs are a forward of the stale policy, not the EOS-masked
    sampler's, so --old-logp rollout with --min-new-tokens or --repetition-penalty reaches the model (the staleness
    lab's runs)."""
    for extra in (["--min-new-tokens", "2"], ["--repetition-penalty", "1.2"]):
        with pytest.raises(AssertionError, match="the model was built"):
            fails_before_any_model("gspo", ["--max-staleness", "1", "--old-logp", "rollout", *extra], "",
                                   monkeypatch, tmp_path)


@pytest.mark.parametrize("value, shown", [("-1", "-1.0"), ("nan", "nan"), ("inf", "inf")])
def test_grpo_kl_coef(value, shown, monkeypatch, tmp_path):
    fails_before_any_model("grpo", ["--kl-coef", value], f"--kl-coef {shown}: must be >= 0 and finite", monkeypatch,
                           tmp_path)


@pytest.mark.parametrize("script, argv, needle", [
    ("dfpo", ["--orth-floor", "0"], "--orth-floor 0.0: must be > 0 and finite"),
    ("dfpo", ["--orth-floor", "nan"], "--orth-floor nan: must be > 0 and finite"),
    ("dfpo", ["--orth-floor", "inf"], "--orth-floor inf: must be > 0 and finite"),
    ("dfpo", ["--transform", "nope"], "invalid choice 'nope' for argument '--transform'"),  # tyro's own check
    ("grpo", ["--delta", "1.2"], "--delta 1.2: must be > 1.27 and finite (1 + --clip-high: the cap sits above the "
                                 "clip band)"),
    ("grpo", ["--delta", "2", "--symmetric-clip"], "--delta caps w_it inside PPO's min; --symmetric-clip caps it"),
    ("gspo_token", ["--post-answer-penalty", "-1"], "--post-answer-penalty -1.0: must be >= 0 and finite"),
    ("gspo_token", ["--post-answer-penalty", "nan"], "--post-answer-penalty nan: must be >= 0 and finite"),
    ("gspo_token", ["--post-answer-penalty", "inf"], "--post-answer-penalty inf: must be >= 0 and finite"),
    ("grpo", ["--rollout-is-cap", "0"], "--rollout-is-cap 0.0: must be > 0 and finite"),
    ("gspo_token", ["--rollout-is-cap", "-2"], "--rollout-is-cap -2.0: must be > 0 and finite"),
    ("grpo", ["--rollout-is-cap", "nan"], "--rollout-is-cap nan: must be > 0 and finite"),
    ("gspo", ["--min-new-tokens", "5", "--max-new-tokens", "4"], "--min-new-tokens 5: must lie in [0, 4] (at most --max-new-tokens and"),
    ("grpo", ["--min-new-tokens", "2", "--old-logp", "rollout", "--gen-mode", "engine"],
     "--old-logp rollout with --min-new-tokens 2: the engine's log-probs of a completion's first tokens"),
    ("gspo", ["--top-entropy-quantile", "0"], "--top-entropy-quantile 0.0: must lie in (0, 1]"),
    ("grpo", ["--top-entropy-quantile", "1.5"], "--top-entropy-quantile 1.5: must lie in (0, 1]"),
    ("cispo", ["--top-entropy-quantile", "0.2", "--old-logp", "rollout", "--gen-mode", "engine"],
     "--top-entropy-quantile 0.2 ranks tokens by pi_old's entropies, computed by the recompute pass"),
    ("grpo", ["--rollout-is-cap", "2", "--old-logp", "rollout", "--gen-mode", "engine"],
     "--rollout-is-cap 2.0 weights by pi_old / pi_rollout, and --old-logp rollout makes pi_old the rollout's own"),
    ("dfpo", ["--off-policy-mask", "0.5"], "--off-policy-mask zeroes a sequence's advantage, and DFPO's transform"),
    ("grpo", ["--off-policy-mask", "-1"], "--off-policy-mask -1.0: must be >= 0 and finite"),
    ("grpo", ["--rollout-is-min", "0.5"], "--rollout-is-min 0.5 needs --rollout-is-cap (C_max; a large one for none)"),
    ("grpo", ["--rollout-is-cap", "2", "--rollout-is-min", "2", "--gen-mode", "engine"],
     "--rollout-is-min 2.0: must lie in (0, 2) (C_min, below --rollout-is-cap)"),
    ("vespo", ["--rollout-is-cap", "2", "--rollout-is-mode", "sequence-mask", "--gen-mode", "engine"],
     "--rollout-is-mode sequence-mask: vespo.py folds the rollout's ratios into its sequence weight token by token"),
    ("grpo", ["--rollout-is-cap", "2"], "--rollout-is-cap reads the log-probs the engine computes as it samples; "
                                        "--gen-mode shared-prefill (HF generate) returns none"),
    # issue 61 item 1 (f), (g): every objective parameter range-checked before the model
    ("vespo", ["--k-pos", "nan"], "--k-pos nan: must be >= 0 and finite (VESPO's phi(W)"),
    ("vespo", ["--k-pos", "inf"], "--k-pos inf: must be >= 0 and finite"),
    ("vespo", ["--k-neg", "-3"], "--k-neg -3.0: must be >= 0 and finite (VESPO's k where A_i < 0; a negative k "
                                 "reverses the fade)"),
    ("vespo", ["--lambda-neg", "-2"], "--lambda-neg -2.0: must be >= 0.0001 and finite (VESPO's lambda where A_i < 0; "
                                      "the loss clamps it at 1e-4, as TRL)"),
    ("vespo", ["--lambda-pos", "0"], "--lambda-pos 0.0: must be >= 0.0001 and finite"),
    ("sapo", ["--tau-pos", "0"], "--tau-pos 0.0: must be > 0 and finite (SAPO's gate temperature where A_i > 0"),
    ("sapo", ["--tau-pos", "nan"], "--tau-pos nan: must be > 0 and finite"),
    ("sapo", ["--tau-neg", "-1"], "--tau-neg -1.0: must be > 0 and finite (SAPO's gate temperature where A_i < 0)"),
    # (h) every completion at the limit, so every one masked
    ("gspo", ["--min-new-tokens", "2", "--max-new-tokens", "2", "--mask-truncated"],
     "--mask-truncated with --min-new-tokens 2 = --max-new-tokens 2: no completion can stop before the limit"),
    # (l) a correction mode with no correction
    ("grpo", ["--rollout-is-mode", "sequence-mask"], "--rollout-is-mode sequence-mask needs --rollout-is-cap (C_max)"),
    ("cispo", ["--rollout-is-mode", "token-mask"], "--rollout-is-mode token-mask needs --rollout-is-cap (C_max)"),
    # (q) evaluation flags with no evaluation
    ("gspo", ["--eval-every", "0", "--log-eval-samples", "4"],
     "--log-eval-samples shapes the evaluations, and --eval-every 0 runs none: give --eval-every N (or --eval-only)"),
    ("gspo", ["--eval-every", "0", "--eval-max-new-tokens", "4"],
     "--eval-max-new-tokens shapes the evaluations, and --eval-every 0 runs none"),
    # item 2: the cli survivors
    ("gspo", ["--min-new-tokens", "3", "--max-new-tokens", "4", "--eval-max-new-tokens", "2"],
     "--min-new-tokens 3: must lie in [0, 2] (at most --max-new-tokens and --eval-max-new-tokens)"),
    ("gspo", ["--eval-max-new-tokens", "0"], "--eval-max-new-tokens 0: must lie in [1, 1048576]"),
    ("gspo", ["--multi-objective-aggregation", "normalize-then-sum", "--baseline", "leave-one-out"],
     "--multi-objective-aggregation normalize-then-sum normalises each reward in its group and their sum over the "
     "batch (GDPO): give no --scale-rewards or --baseline with it"),
])
def test_bad_algorithm_args(script, argv, needle, monkeypatch, tmp_path):
    fails_before_any_model(script, argv, needle, monkeypatch, tmp_path)



def own_float_flags():
    """(script, field) for each float field of a script's Args that CommonArgs lacks: its objective's parameters."""
    from grouprl.cli import CommonArgs

    common = {f.name for f in dataclasses.fields(CommonArgs)}
    for script in SCRIPTS:
        mod = importlib.import_module(script)
        for f in dataclasses.fields(mod.Args):
            if f.name not in common and "float" in str(f.type):
                yield script, f.name


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("script, name", list(own_float_flags()))
def test_every_objective_parameter_is_range_checked(script, name, value, monkeypatch, tmp_path):
    """Issue 61 item 1 (f, g): every objective parameter of every script (its Args' float fields beyond CommonArgs)
    refuses nan and inf in one line before the model loads."""
    flag = "--" + name.replace("_", "-")
    fails_before_any_model(script, [flag, value], f"{flag} {value}: must ", monkeypatch, tmp_path)



def test_evaluation_flags_refused_only_when_typed():
    """Issue 61 item 1 (q): --log-eval-samples and --eval-max-new-tokens typed with --eval-every 0 are refused; a value
    that only differs from --max-new-tokens (a resumed run's saved one, with --max-new-tokens restated) is not."""
    from grouprl.cli import checks, fill_defaults
    from gspo import Args

    args = fill_defaults(Args(eval_every=0, max_new_tokens=6, eval_max_new_tokens=2, log_eval_samples=3))
    checks.check_given_eval_flags(args, ["--max-new-tokens", "6", "--eval-every", "0"])  # no error
    checks.check_given_eval_flags(dataclasses.replace(args, eval_only=True), ["--log-eval-samples", "3"])
    for argv in (["--eval_max_new_tokens=2"], ["--log-eval-samples", "3"]):
        with pytest.raises(SystemExit):
            checks.check_given_eval_flags(args, argv)

@pytest.mark.parametrize("script, argv, said", [
    ("cispo", ["--epsilon-high", "5"], "--epsilon-high is TRL's name: use --clip-high 4 (TRL's CISPO epsilon_high is "
                                       "the cap on the weight itself; cispo.py's cap is 1 + --clip-high)"),
    ("cispo", ["--epsilon_high=5.5"], "--epsilon_high is TRL's name: use --clip-high 4.5 "),
    ("grpo", ["--epsilon-high", "0.28"], "--epsilon-high is TRL's name: use --clip-high"),
])
def test_trl_epsilon_high_answered_per_script(script, argv, said):
    """Issue 61 item 1 (p): TRL's CISPO epsilon_high is the cap itself, cispo.py's cap 1 + --clip-high: --epsilon-high 5
    is --clip-high 4 there; elsewhere epsilon_high is our --clip-high as it is."""
    from grouprl import cli

    with pytest.raises(SystemExit) as e:
        cli.parse_args(importlib.import_module(script).Args, argv)
    assert str(e.value).startswith(f"error: {said}"), e.value


def test_error_is_one_line_on_stderr(tmp_path):
    """Before any heavy work: the child's CPU time (not the wall clock, which a loaded machine stretches) stays
    under 5 s, about the imports; loading a model or data would add to it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "gspo.py", "--top-k", "-5", "--output-dir", str(tmp_path / "runs")], cwd=ROOT,
                       capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 5 and not (tmp_path / "runs").exists(), cpu
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: --top-k -5")


def test_error_after_a_progress_bar_starts_its_own_line(capsys):
    """A run that fails mid-training (a disk that fills, a reward that keeps failing) has the tqdm bar on stderr's
    last line: fail ends it first, so that the error line is a line of its own."""
    from tqdm import tqdm

    from grouprl.distributed import fail

    steps = iter(tqdm(range(5), desc="train"))  # held: a generator dropped closes its bar
    next(steps)
    with pytest.raises(SystemExit, match="^error: the disk is full$"):
        fail("the disk is full")
    err = capsys.readouterr().err
    assert "train" in err and err.endswith("\n"), repr(err)


def test_error_under_torchrun_is_printed_once_and_every_rank_exits(tmp_path):
    """A checkpoint written by dfpo.py, resumed by gspo.py under 2 ranks: rank 0 alone prints the line, both ranks
    exit 1 at once."""
    ckpt = tmp_path / "gspo__1__5" / "step_4"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "state" / "trainer_state.json").write_text(json.dumps({"step": 4, "world": 1, "script": "dfpo.py"}))
    checkpoint.write_manifest(str(ckpt))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "gspo.py", "--resume", str(ckpt), "--output-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert p.returncode == 1 and errors == [
        f"error: {ckpt} was written by dfpo.py, not gspo.py: resume it with that script"], out
    assert "exitcode  : 1" in out  # torchrun's own failure report (ChildFailedError) follows
    assert out.count("Traceback") == 1 and "torch/distributed/run.py" in out  # torchrun's; none from the ranks


@pytest.mark.parametrize("argv, line", [
    (["--sed", "3"], "Unrecognized options: --sed, 3 (did you mean --seed?); python gspo.py --help lists every flag"),
    (["--seed", "abc"], "Error parsing --seed: invalid literal for int() with base 10: 'abc'; python gspo.py --help "
                        "lists every flag"),
    (["--gen-mode", "foo"], "invalid choice 'foo' for argument '--gen-mode'. Expected one of ('repeat', "
                            "'shared-prefill', 'static', 'engine', 'engine-tp'); python gspo.py --help lists every flag"),
    (["--num-steps"], "Missing value for argument '--num-steps'. Expected 1 values; python gspo.py --help lists every "
                      "flag"),
])
def test_tyro_errors_are_one_line(argv, line, monkeypatch, capsys):
    """tyro's own errors (6-9 lines in a box) come out as one line: what tyro said first, the flag it suggests."""
    from grouprl import cli
    import gspo

    monkeypatch.setattr(sys, "argv", ["gspo.py", *argv])
    with pytest.raises(SystemExit) as e:
        cli.parse_args(gspo.Args, argv)
    assert e.value.code == f"error: {line}"
    assert capsys.readouterr() == ("", "")  # the box is not printed
    monkeypatch.setenv("RANK", "1")  # another rank under torchrun: silent, a failing exit code
    with pytest.raises(SystemExit) as e:
        cli.parse_args(gspo.Args, argv)
    assert e.value.code == 2 and capsys.readouterr() == ("", "")


def test_tyro_error_under_torchrun_is_printed_once(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "gspo.py", "--num-step", "3", "--output-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "╭" not in out and "Unrecognized options" not in out.replace(
        "error: Unrecognized options: --num-step, 3 (did you mean --num-steps?); python gspo.py --help lists every "
        "flag\n", "", 1), out


def test_help_in_process_is_the_scripts():
    """help_of's text is byte for byte what the script prints (the script's main reaches the same parse_args)."""
    p = subprocess.run([sys.executable, "vespo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "120"})
    assert p.returncode == 0, p.stderr
    assert p.stdout == help_of("vespo")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_arg_documented(script):
    mod = importlib.import_module(script)
    help_out = help_of(script)
    help_text = " ".join(help_out.split())
    # --help opens with the script's description: its docstring's first paragraph (issue 37 item 7)
    doc = " ".join(mod.__doc__.split("\n\n")[0].split())
    assert help_text.startswith(f"usage: {script}.py [-h] [OPTIONS] {doc}"), help_text[:300]
    for f in dataclasses.fields(mod.Args):
        assert "--" + f.name.replace("_", "-") in help_text
    # the flags most runs set come first (issue 37 item 7), in this order, before any other
    first = ["--exp-name", "--seed", "--model", "--dataset", "--reward", "--num-steps", "--prompts-per-rank",
             "--group-size", "--learning-rate", "--max-new-tokens", "--temperature", "--eval-every", "--output-dir",
             "--resume"]
    flags = re.findall(r"│ (--[a-z0-9-]+)", help_out)
    assert flags[:len(first)] == first, flags[:len(first)]
    names = set()
    for path, cls in ((f"{ROOT}/{script}.py", "class Args"), (f"{ROOT}/grouprl/cli/flags.py", "class CommonArgs")):
        src = open(path).read() + "\n\n\n"  # a class that ends its file
        body = src[src.index(cls):src.index("\n\n\n", src.index(cls))].splitlines()
        # a field: `    name: type = default` at the class body's indent (a docstring line may hold ": " and "=")
        fields = [i for i, line in enumerate(body) if re.match(r"    [a-z_][a-z0-9_]*: .+ = ", line)
                  and "ClassVar[" not in line]  # a class constant (masks_advantages), not a flag
        assert all(body[i + 1].strip().startswith('"""') for i in fields)  # a docstring under every field
        names |= {body[i].split(":")[0].strip() for i in fields}
    assert names == {f.name for f in dataclasses.fields(mod.Args)}  # every field is one of the two classes'



@pytest.mark.parametrize("script", ["gspo", "vespo"])
def test_help_is_grouped_in_sections(script):
    """--help shows CommonArgs' sections (the `# -- name: heading` comments of cli/flags.py) in order, each a box of its
    own headed by its name and heading, then the script's own flags; every flag under exactly one, the one its field
    sits under in the source; a command line still parses into the flat Args (issue 60 item 5)."""
    from grouprl.cli import flags, parsing

    mod = importlib.import_module(script)
    boxes, flags_in = [], {}
    for line in help_of(script).splitlines():  # 120 columns: one column of boxes
        row = line.strip().strip("│").strip()
        if (m := re.match(r"╭─ (\S+) options", line)):
            boxes.append([m[1], None])
        elif boxes and boxes[-1][1] is None and row:
            boxes[-1][1] = row  # the box's first line: its heading
        elif (m := re.match(r"\s*│ (--[a-z0-9-]+)", line)) and boxes:  # a flag: at the box's edge
            flags_in.setdefault(m[1], []).append(boxes[-1][0])
    source = open(flags.__file__).read()
    heads = re.findall(r"^    # -- ([a-z_]+): (.+)$", source, re.M)
    assert len(heads) >= 8
    own = [("this-script", "Parameters that control this script's own objective")]
    assert [tuple(b) for b in boxes] == [(n.replace("_", "-"), h) for n, h in heads] + own, boxes
    fields = dataclasses.fields(mod.Args)
    assert sorted(flags_in) == sorted("--" + f.name.replace("_", "-") for f in fields)
    assert all(len(where) == 1 for where in flags_in.values()), flags_in
    for name, heading, names in parsing.sections(mod.Args):
        assert all(flags_in["--" + n.replace("_", "-")] == [name.replace("_", "-")] for n in names), name
    # in the source, each CommonArgs field sits under the heading --help puts it under
    for name, _, names in parsing.sections(mod.Args)[:-1]:
        block = source[source.index(f"# -- {name}:"):]
        block = block[:block.index("# -- ", 5)] if "# -- " in block[5:] else block
        assert all(re.search(rf"^    {n}: ", block, re.M) for n in names), name
    args = parsing.parse_args(mod.Args, ["--top-p", "0.5", "--kl-coef", "0.1"])
    assert type(args) is mod.Args and args.top_p == 0.5 and args.kl_coef == 0.1

def test_hub_columns_through_local_files(tmp_path):
    tok = modeling.tiny_tokenizer()
    gsm = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": f"What is {i}+1?", "answer": f"{i}+1 = {i + 1}\n#### {i + 1:,}"} for i in range(998, 1018)
    ] + [{"question": "no answer here", "answer": None}])
    train, held, dropped = data.load_task(data.Task("gsm8k", gsm, 4, 0, enable_thinking=False), tok)
    assert dropped == {"no_answer": 1, "too_long": 0} and len(train) + len(held) == 20 and len(held) == 2
    row = train[0]
    assert set(train.column_names) == {"question", "prompt", "answer", "text"}  # the set's own columns kept
    assert row["answer"].replace(",", "").isdigit() and row["prompt"].startswith("What is")
    assert "####" in row["prompt"]  # the gsm8k instruction asks for the '#### n' ending
    assert row["text"].startswith("<|im_start|>user\n") and row["text"].endswith("<|im_start|>assistant\n")
    math = write_jsonl(tmp_path / "math.jsonl", [{"problem": f"Compute {i}/2.", "answer": f"\\frac{{{i}}}{{2}}"}
                                                  for i in range(30)])
    train, held, _ = data.load_task(data.Task("math500", math, 3, 0, enable_thinking=False), tok)
    assert len(held) == 3 and "\\boxed{}" in train[0]["prompt"]
    # two distinct prompts x 10: one held out whole, the other trained on (issue 54: one distinct prompt is an error)
    own = write_jsonl(tmp_path / "own.jsonl", [{"prompt": "2+2=", "answer": "4"},
                                               {"prompt": "3+3=", "answer": "6"}] * 10)
    train, held, _ = data.load_task(data.Task(own, None, 2, 0, enable_thinking=False), tok)
    assert (train[0]["prompt"], train[0]["answer"]) in {("2+2=", "4"), ("3+3=", "6")}
    assert len(train) == 10 and len(held) == 1 and held[0]["prompt"] != train[0]["prompt"]


def test_builtin_task_is_deterministic_and_uniform():
    a, b = data.builtin_task(2000, 3), data.builtin_task(2000, 3)
    assert a == b and a != data.builtin_task(2000, 4)
    counts = [sum(r["answer"] == str(k) for r in a) for k in range(10)]
    assert max(counts) / len(a) < 0.13  # no constant answer scores much above 0.1
    assert all(common.math_reward(str(int(r["prompt"].split("%")[0]) % 10), r["answer"]) == 1 for r in a)


@pytest.mark.parametrize("script, argv, line", [
    ("gspo", ["--num-generations", "8"], "--num-generations is TRL's name: use --group-size"),
    ("gspo", ["--num_generations=8"], "--num_generations is TRL's name: use --group-size"),
    ("grpo", ["--beta", "0.04"], "--beta is TRL's name: use --kl-coef"),
    ("gspo", ["--per-device-train-batch-size", "4"], "--per-device-train-batch-size is TRL's name: use "
                                                     "--micro-batch-size (completions a forward/backward)"),
    ("dfpo", ["--use-vllm"], "--use-vllm is TRL's name: use --gen-mode engine (the built-in engine; vLLM is not used)"),
    ("grpo", ["--loss-type", "dapo"], "--loss-type is TRL's name: use --loss-agg (grpo.py, gspo_token.py and the "
                                      "token-level scripts): dapo = token-mean, grpo = seq-mean-token-mean, dr_grpo = "
                                      "seq-mean-token-sum-norm; cispo, sapo, vespo: cispo.py, sapo.py, vespo.py; "
                                      "luspo: gspo.py --luspo"),
    ("gspo", ["--delta", "4"], "--delta is TRL's name: use grpo.py --delta (two-sided clipping)"),
    ("grpo", ["--loss-agg", "luspo"], "--loss-agg luspo is TRL's loss_type name for an objective: run gspo.py --luspo"),
    ("vespo", ["--loss-agg", "vespo"], "--loss-agg vespo is TRL's loss_type name for an objective: run vespo.py"),
    ("gspo", ["--sapo-temperature-neg", "2"], "--sapo-temperature-neg is TRL's name: use --tau-neg (sapo.py)"),
    ("grpo", ["--loss-agg", "cispo"], "--loss-agg cispo is TRL's loss_type name for an objective: run cispo.py"),
    ("grpo", ["--loss-agg", "dapo"], "--loss-agg dapo is TRL's loss_type name: use --loss-agg token-mean"),
    ("gspo_token", ["--loss-agg=dr_grpo"], "--loss-agg dr_grpo is TRL's loss_type name: use --loss-agg "
                                           "seq-mean-token-sum-norm"),
    ("gspo", ["actor_rollout_ref.rollout.n=8"], "actor_rollout_ref.rollout.n=... is verl's config key: use "
                                                "--group-size"),
    ("gspo", ["actor_rollout_ref.actor.ppo_epochs=2"], "actor_rollout_ref.actor.ppo_epochs=... is verl's config key: "
                                                       "use --num-iterations"),
    ("gspo", ["trainer.n_gpus_per_node=8"], "trainer.n_gpus_per_node=... is verl's config key: give --flags; "
                                            "docs/trl-and-verl.md maps verl's config to them"),
])
def test_trl_and_verl_names_answer_with_ours(script, argv, line, monkeypatch, capsys):
    """A TRL or verl name given as a flag: one line naming ours (issue 37 item 7), not tyro's "Unrecognized
    options"; a name both share (--learning-rate, --num-iterations) is ours and parses."""
    from grouprl import cli

    mod = importlib.import_module(script)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(mod.Args, argv)
    assert e.value.code == f"error: {line}"
    assert capsys.readouterr() == ("", "")
    args = cli.parse_args(mod.Args, ["--learning_rate", "1e-5", "--num-iterations", "2", "--temperature", "0.7"])
    assert (args.learning_rate, args.num_iterations, args.temperature) == (1e-5, 2, 0.7)


def test_trl_and_verl_hints_name_real_flags():
    from grouprl import cli

    flags = set()
    for script in SCRIPTS:
        flags |= {"--" + f.name.replace("_", "-") for f in dataclasses.fields(importlib.import_module(script).Args)}
    named = {w.strip("(),;:") for hint in [*cli.TRL_FLAGS.values(), *cli.VERL_KEYS.values()] for w in hint.split()
             if w.startswith("--")}
    assert named and named - {"--flags"} <= flags, named - flags
    assert set(cli.TRL_LOSS_TYPES.values()) <= {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    assert all(os.path.isfile(os.path.join(ROOT, run.split()[0])) for run in cli.TRL_LOSS_SCRIPTS.values())


@pytest.mark.parametrize("env, line", [
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "--model SomeOrg/not-cached-37: cannot reach http://127.0.0.1:9 "
                                            "(Connection refused); give a local model folder (one with config.json), "
                                            "or download it once where there is a network and set HF_HUB_OFFLINE=1"),
    ({"HF_HUB_OFFLINE": "1"}, "--model SomeOrg/not-cached-37: not in the Hugging Face cache, and HF_HUB_OFFLINE is "
                              "set; download it once where there is a network (huggingface-cli download "
                              "SomeOrg/not-cached-37), or give a local model folder"),
])
def test_hub_model_offline_fails_in_one_line_within_seconds(env, line, monkeypatch):
    """A hub id that can be neither downloaded nor read from the cache: one line naming the fix, at once (one
    connection to the endpoint, here a closed port on this machine), where transformers retries for ~30 s."""
    from grouprl import modeling

    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never the real hub from a test
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t = time.monotonic()
    with pytest.raises(SystemExit) as e:
        modeling.check_model("SomeOrg/not-cached-37", False)
    assert time.monotonic() - t < 20  # generous for a loaded machine; the retries it avoids take ~30 s
    assert e.value.code == f"error: {line}"


class FakeRun:
    """What wandb.init returns, recording what the Logger sends."""

    def __init__(self, **kw):
        self.init, self.rows, self.finished = kw, [], False

    def log(self, row, step):
        self.rows.append({"step": step, **row})

    def finish(self):
        self.finished = True


def test_track_logs_the_same_keys_to_wandb(monkeypatch, tmp_path):
    """--track (CleanRL's): every row of metrics.jsonl goes to wandb.log at its step, under the same keys; the run is
    named after its folder and finished at the end. A stand-in wandb module, so that this runs without wandb."""
    import types

    from helpers import run_script

    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "wandb" else real(name, *a))
    rows, run_dir = run_script("gspo", ["--num-steps", "2", "--prompts-per-rank", "4", "--group-size", "2",
                                        "--num-minibatches", "1", "--eval-every", "0", "--track",
                                        "--wandb-project", "p37"], monkeypatch, tmp_path / "o")
    (run,) = runs
    assert run.init["project"] == "p37" and run.init["name"] == os.path.basename(run_dir) and run.finished
    assert run.rows == [{k: v for k, v in row.items() if v is not None} for row in rows]


def test_track_without_wandb_is_one_line(monkeypatch, tmp_path):
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    fails_before_any_model("gspo", ["--track"], "--track logs to Weights & Biases, which is not installed: pip "
                           "install wandb (WANDB_MODE=offline logs without a network), or drop --track",
                           monkeypatch, tmp_path)


def test_track_offline_with_real_wandb(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed: --track's offline run not tried")
    from helpers import run_script

    monkeypatch.setenv("WANDB_MODE", "offline")
    _, run_dir = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "2", "--group-size", "2",
                                     "--num-minibatches", "1", "--eval-every", "0", "--track"], monkeypatch,
                            tmp_path / "o")
    assert any(name.startswith("offline-run") for name in os.listdir(os.path.join(run_dir, "wandb")))


def test_defaults_that_depend_on_the_model_and_the_task():
    """fill_defaults: the tiny models' learning rate 5e-4 (1e-6 for a real model); the built-in task 2 new tokens and
    a truncated-reward scale of 0.5 (1024 and 1.0, unchanged rewards, on other data); a value given is kept."""
    from grouprl.cli import fill_defaults
    from gspo import Args

    a = fill_defaults(Args())
    assert (a.learning_rate, a.max_new_tokens, a.truncated_reward_scale) == (5e-4, 2, 0.5)
    a = fill_defaults(Args(model="org/model", dataset="gsm8k"))
    assert (a.learning_rate, a.max_new_tokens, a.truncated_reward_scale) == (1e-6, 1024, 1.0)
    a = fill_defaults(Args(learning_rate=1e-3, max_new_tokens=5, truncated_reward_scale=0.0))
    assert (a.learning_rate, a.max_new_tokens, a.truncated_reward_scale) == (1e-3, 5, 0.0)


def test_energy_refused_over_ranks(monkeypatch, tmp_path):
    """--energy-every takes per-token gradients of the whole model, which FSDP2 shards: refused under torchrun with more
    than one rank, in one line, before any model."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    fails_before_any_model("gspo", ["--energy-every", "1"], "--energy-every measures per-token gradients of the whole "
                           "model, which FSDP2 shards over ranks", monkeypatch, tmp_path)
