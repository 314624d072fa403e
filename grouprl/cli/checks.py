"""The flags' checks: every flag before any heavy work, bad input refused in one line naming the
fix (check_common_args and the checks it calls; the rollout's are in rollout_checks.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re

import torch

from ..checkpoint import STEP_DIR, catch_startup_signals
from ..data import check_dataset
from ..distributed import fail, launched, main_process
from ..lora import ALL_LINEAR, DEFAULT_ALPHA
from ..modeling import TINY_MODELS
from .bounds import check_float, check_int
from .flags import CommonArgs
from .rollout_checks import check_rollout_args, check_staleness_args


# -------------------- argument checks: every flag before any heavy work
# Upper bounds of the integer flags past which a run would load the model and then crash (a tensor,
# a KV cache or a seed too large) instead of failing here: far above any real run's values.
MAX_SEED = 2**32 - 1  # numpy's seed range (torch's is 2**64 - 1, less the per-rank offsets)
MAX_COMPLETIONS = 2**20  # completions a rank a step, held-out completions, rows a generate call
MAX_NEW_TOKENS = 2**20  # beyond any model's context
MAX_ITERATIONS = 1024  # passes over one rollout: far past any recipe's (TRL's, verl's default: 1)
MAX_GEN_ROUNDS = 1024  # generation rounds a step (--dynamic-sampling): far past verl's example's 10
MAX_GEN_ROUNDS_DEFAULT = CommonArgs.max_gen_rounds
MAX_REWARD_TIMEOUT_S = 86400.0  # a day; past ~9e9 s select() overflows in the reward pool


MIN_TEMPERATURE = 1e-3  # logits of ~100 / 1e-3 stay far inside float32's range (3.4e38); 1e-40 does not


# Each script's own objective parameters, checked wherever its Args has the field: (low, high, low
# open, why). The clip band is checked with every flag; grpo.py's --delta, gspo_token.py's
# --post-answer-penalty and dfpo.py's --orth-floor by their scripts.
OBJECTIVE_RANGES = {
    "tau_pos": (0, math.inf, True, " (SAPO's gate temperature where A_i > 0: f = sigmoid(tau (w - 1)) "
                                   "4 / tau)"),
    "tau_neg": (0, math.inf, True, " (SAPO's gate temperature where A_i < 0)"),
    "k_pos": (0, math.inf, False, " (VESPO's phi(W) = W^k exp(lambda (1 - W)) where A_i >= 0; a "
                                  "negative k reverses the fade)"),
    "k_neg": (0, math.inf, False, " (VESPO's k where A_i < 0; a negative k reverses the fade)"),
    "lambda_pos": (1e-4, math.inf, False, " (VESPO's lambda where A_i >= 0; the loss clamps it at "
                                          "1e-4, as TRL)"),
    "lambda_neg": (1e-4, math.inf, False, " (VESPO's lambda where A_i < 0; the loss clamps it at "
                                          "1e-4, as TRL)"),
}


def check_objective_args(args):
    """The script's own objective parameters (OBJECTIVE_RANGES) in range, each in one line."""
    for name, (low, high, low_open, why) in OBJECTIVE_RANGES.items():
        if hasattr(args, name):
            check_float(name.replace("_", "-"), getattr(args, name), low, high, low_open=low_open,
                        why=why)


def check_given_eval_flags(args, argv: list[str]):
    """--log-eval-samples and --eval-max-new-tokens on the command line (argv), with --eval-every 0
    and no --eval-only: they shape evaluations the run never makes. Read from what the user typed,
    as a saved (--resume) or derived value of them is no request."""
    named = {w[2:].split("=")[0].replace("_", "-") for w in argv if w.startswith("--")}
    for flag in ("--log-eval-samples", "--eval-max-new-tokens"):
        if flag[2:] in named and args.eval_every == 0 and not args.eval_only:
            fail(f"{flag} shapes the evaluations, and --eval-every 0 runs none: give --eval-every N "
                 f"(or --eval-only), or drop {flag}")


def check_common_args(args):
    """Bad input fails with one line before any heavy work. Reads args, never writes them: main()
    has filled in the defaults already (fill_defaults)."""
    check_int("seed", args.seed, 0, MAX_SEED, " (numpy's seed range)")
    check_int("group-size", args.group_size, 2, MAX_COMPLETIONS,
              " (group-relative advantages need at least 2 completions a prompt)")
    check_int("max-new-tokens", args.max_new_tokens, 1, MAX_NEW_TOKENS)
    check_int("eval-max-new-tokens", args.eval_max_new_tokens, 1, MAX_NEW_TOKENS)
    check_float("truncated-reward-scale", args.truncated_reward_scale, 0, 1)
    check_float("clip-low", args.clip_low, 0, low_open=True)
    check_float("clip-high", args.clip_high, 0, low_open=True)
    check_objective_args(args)
    check_int("prompts-per-rank", args.prompts_per_rank, 1, MAX_COMPLETIONS)
    if args.prompts_per_rank * args.group_size > MAX_COMPLETIONS:
        fail(f"--prompts-per-rank {args.prompts_per_rank} x --group-size {args.group_size} = "
             f"{args.prompts_per_rank * args.group_size} completions a rank a step: must be at "
             f"most {MAX_COMPLETIONS}")
    if args.num_minibatches < 1 or args.prompts_per_rank % args.num_minibatches:
        fail(f"--prompts-per-rank {args.prompts_per_rank} must be a multiple of --num-minibatches "
             f"{args.num_minibatches} (each minibatch holds whole groups)")
    if args.multi_objective_aggregation == "normalize-then-sum" and (
            args.scale_rewards != "group" or args.baseline != "group-mean"):
        fail("--multi-objective-aggregation normalize-then-sum normalises each reward in its group "
             "and their sum over the batch (GDPO): give no --scale-rewards or --baseline with it")
    if args.off_policy_mask is not None:
        check_float("off-policy-mask", args.off_policy_mask, 0,
                    why=" (delta, the mean log(pi_sample / pi_theta) past which OPSM drops a sequence)")
        if not args.masks_advantages:
            fail("--off-policy-mask zeroes a sequence's advantage, and DFPO's transform (eq. 63) "
                 "weighs every sequence of the group by all their advantages: not with dfpo.py")
    check_int("num-iterations", args.num_iterations, 1, MAX_ITERATIONS,
              " (passes over each rollout's minibatches)")
    check_int("max-gen-rounds", args.max_gen_rounds, 1, MAX_GEN_ROUNDS,
              " (generation rounds a step, the first included; verl's 0, no bound, is not offered: "
              "a task whose groups are all flat would generate for ever)")
    if args.max_gen_rounds != MAX_GEN_ROUNDS_DEFAULT and not args.dynamic_sampling:
        fail(f"--max-gen-rounds {args.max_gen_rounds} bounds the rounds of --dynamic-sampling: add "
             "--dynamic-sampling, or drop it")
    check_float("temperature", args.temperature, MIN_TEMPERATURE,
                why=" (RL samples from the policy; below, logits / T overflow float32)")
    check_int("log-samples", args.log_samples, 0, why=" (0: never)")
    check_int("log-eval-samples", args.log_eval_samples, 0, why=" (0: none)")
    check_int("energy-every", args.energy_every, 0, why=" (0: never)")
    check_staleness_args(args)
    check_int("energy-rows", args.energy_rows, 1)
    if args.energy_every and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("--energy-every measures per-token gradients of the whole model, which FSDP2 shards over "
             "ranks: run it in one process (torchrun --nproc-per-node 1, or python)")
    rows = args.prompts_per_rank * args.group_size // args.num_minibatches  # a minibatch's
    if args.noise_stats and rows % 2:  # three micro-batches are not two halves
        fail(f"--noise-stats compares the gradients of each minibatch's two halves: a minibatch of "
             f"{rows} completions has none; make --prompts-per-rank x --group-size / "
             "--num-minibatches even")
    if args.noise_stats and args.micro_batch_size != rows // 2:
        fail(f"--noise-stats compares the gradients of each minibatch's two halves: give "
             f"--micro-batch-size {rows // 2} (half of a minibatch's {rows} completions)")
    if args.num_steps < 1:
        fail(f"--num-steps {args.num_steps}: must be >= 1")
    if args.micro_batch_size < 0:
        fail(f"--micro-batch-size {args.micro_batch_size}: must be >= 1 sequences, or 0 for the "
             "whole minibatch")
    if args.max_prompt_tokens < 1:
        fail(f"--max-prompt-tokens {args.max_prompt_tokens}: must be >= 1")
    if args.max_nonfinite < 1:
        fail(f"--max-nonfinite {args.max_nonfinite}: must be >= 1")
    if args.cpu_offload and not torch.cuda.is_available():
        fail("--cpu-offload moves FSDP2 shards between GPU and CPU memory: it needs a GPU (drop it "
             "on CPU)")
    if args.gen_mode in ("engine", "engine-tp") and args.gen_unshard:
        fail("--gen-unshard keeps FSDP2 units gathered for HF generate; --gen-mode engine gathers "
             "each weight once per rollout itself: drop --gen-unshard")
    if args.dtype == "bf16-pure" and launched():
        fail("--dtype bf16-pure: under torchrun FSDP2 keeps fp32 master weights; use --dtype bf16 "
             "(or auto), or plain `python` for bf16 weights")
    for flag in ("cpu_offload", "gen_unshard"):
        if getattr(args, flag) and not launched():
            fail(f"--{flag.replace('_', '-')} acts on FSDP2 shards, which plain `python` does not "
                 "make: launch with `torchrun --nproc-per-node N` (N = 1 is fine)")
    if args.eval_n is not None and args.eval_n < args.eval_k or args.eval_k < 1:
        fail(f"--eval-n {args.eval_n} / --eval-k {args.eval_k}: pass@k needs n >= k >= 1 samples a "
             "prompt")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_int("eval-size", args.eval_size, max(1, world), MAX_COMPLETIONS,
              f" (at least the world size {world}: every rank evaluates an equal share of the "
              "held-out prompts)")
    n_flag, n = ("eval-k", args.eval_k) if args.eval_n is None else ("eval-n", args.eval_n)
    if args.eval_size * n > MAX_COMPLETIONS:
        fail(f"--eval-size {args.eval_size} x --{n_flag} {n} = {args.eval_size * n} held-out "
             f"completions: must be at most {MAX_COMPLETIONS}")
    resume_dir = os.path.basename(os.path.normpath(args.resume or ""))
    if args.resume not in (None, "auto") and not (os.path.isdir(args.resume)
                                                  and STEP_DIR.match(resume_dir)):
        fail(f"--resume {args.resume}: not a checkpoint (a run's step_N folder); give one, or "
             "'auto' for the newest of this --exp-name and --seed")
    if args.keep_checkpoints < 0 or args.save_every < 0:
        fail(f"--keep-checkpoints {args.keep_checkpoints} / --save-every {args.save_every}: must "
             "be >= 0")
    check_float("warmup-frac", args.warmup_frac, 0, 1, high_open=True)
    check_float("min-lr-ratio", args.min_lr_ratio, 0, 1)
    check_float("learning-rate", args.learning_rate, 0, low_open=True)
    check_float("top-p", args.top_p, 0, 1, low_open=True, why=" (1 is off)")
    check_float("min-p", args.min_p, 0, 1, high_open=True, why=" (0 is off)")
    check_float("repetition-penalty", args.repetition_penalty, 0, low_open=True,
                why=" (1 is off; > 1 discourages repeats)")
    if args.top_k < 0:
        fail(f"--top-k {args.top_k}: must be >= 0 (0 is off)")
    check_int("gen-batch-size", args.gen_batch_size, 1, MAX_COMPLETIONS,
              " (completions a generate call)")
    if args.logprob_chunk_tokens < 1:
        fail(f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: must be >= 1")
    check_float("weight-decay", args.weight_decay, 0)
    check_float("max-grad-norm", args.max_grad_norm, 0, low_open=True)
    # grader.load_reward refuses <= 0 too; here also NaN, inf and past what select() takes
    if not (0 < args.reward_timeout <= MAX_REWARD_TIMEOUT_S):
        fail(f"--reward-timeout {args.reward_timeout}: must be > 0 seconds and at most "
             f"{MAX_REWARD_TIMEOUT_S:g} (a day)")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}: must be >= 0 (0: never)")
    check_lora_args(args)
    check_dataset(args.dataset, args.data_files)
    if args.eval_dataset is not None:
        check_dataset(args.eval_dataset, None, "--eval-dataset")
    check_int("eval-limit", args.eval_limit, 0, why=" (0: all)")
    if args.eval_temperature is not None:
        check_float("eval-temperature", args.eval_temperature, MIN_TEMPERATURE,
                    why=" (below, logits / T overflow float32)")
    if args.eval_top_p is not None:
        check_float("eval-top-p", args.eval_top_p, 0, 1, low_open=True, why=" (1 is off)")
    if args.system_prompt is not None and not args.system_prompt.strip():
        fail("--system-prompt is empty: give the text of the system message, or drop it")
    check_float("kl-coef", args.kl_coef, 0, why=" (0: no KL penalty and no reference model)")
    check_float("adv-eps", args.adv_eps, 0, why=" (added to the std of --scale-rewards)")
    if args.kl_ratio_correction and args.kl_coef == 0:
        fail("--kl-ratio-correction multiplies the KL penalty's k3 by the ratio: it needs "
             "--kl-coef > 0 (TRL's beta)")
    check_rollout_args(args)
    if args.gen_dtype != "auto" and args.gen_mode not in ("engine", "engine-tp"):
        fail(f"--gen-dtype {args.gen_dtype} sets the engine's dtype; --gen-mode {args.gen_mode} runs "
             "HF generate in the trainer's: use --gen-mode engine, or drop it")
    if args.track and importlib.util.find_spec("wandb") is None:
        fail("--track logs to Weights & Biases, which is not installed: pip install wandb "
             "(WANDB_MODE=offline logs without a network), or drop --track")
    from ..modeling import check_sizes

    check_sizes(args)  # --lora-rank and --group-size against the model and the host's memory
    from ..episodes import check_tool_args

    check_tool_args(args, launched())  # --tools, --environment, --max-tool-calls
    check_run_name(args.output_dir, args.exp_name)
    check_run_folder(args.output_dir, args.exp_name, args.seed)
    if not torch.cuda.is_available() and args.model not in TINY_MODELS and main_process():
        print(cpu_cost_line(args), flush=True)  # before the model loads
    catch_startup_signals()  # SIGINT, SIGTERM from here to the first step: one line


def cpu_cost_line(args) -> str:
    """What a run will generate at most, in one line (a real model on a CPU: said before it
    loads): training's steps x prompts x G x --max-new-tokens, and the evaluations' held-out
    prompts x samples x --eval-max-new-tokens, with their share; and where the CPU recipe is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = args.eval_n or args.eval_k
    whole = args.eval_dataset is not None or args.eval_only and args.dataset != "builtin"
    held = (args.eval_limit or None) if whole else args.eval_size  # None: a whole set, unread yet
    if args.eval_only:
        evals, train = 1, 0
    else:
        evals = (1 + args.num_steps // args.eval_every + bool(args.num_steps % args.eval_every)
                 if args.eval_every else 0)
        train = args.num_steps * args.prompts_per_rank * world * args.group_size * args.max_new_tokens
    prompts = "all the set's" if held is None else f"{held}"
    said = (f"{evals} evaluations x {prompts} held-out prompts x {n} samples x "
            f"{args.eval_max_new_tokens} tokens")
    if held is not None:
        tokens = evals * held * n * args.eval_max_new_tokens
        share = f", {tokens / (tokens + train):.0%} of all" if tokens + train else ""
        said += f" = {tokens:,}{share}"
    if not args.eval_only:
        said = (f"training {args.num_steps} steps x {args.prompts_per_rank * world} prompts x G "
                f"{args.group_size} x {args.max_new_tokens} tokens = {train:,}; evaluation {said}")
    return (f"on the CPU this run generates at most: {said} new tokens (a real model's CPU recipe: "
            "README.md, 'A real model on a CPU')")


def check_lora_args(args):
    """Bad LoRA flags (lora.py) fail in one line before any heavy work."""
    others = [f"--lora-{name.replace('_', '-')}" for name, off in
              (("alpha", args.lora_alpha == DEFAULT_ALPHA), ("dropout", args.lora_dropout == 0.0),
               ("target_modules", list(args.lora_target_modules) == [ALL_LINEAR])) if not off]
    if args.lora_rank < 0 or args.lora_rank == 0 and others:
        fail(f"--lora-rank {args.lora_rank}" + (f" with {', '.join(others)}" if others else "")
             + ": LoRA needs a rank >= 1 (0 is off, and then give no other --lora-* flag)")
    if args.lora_rank == 0:
        return
    check_float("lora-alpha", args.lora_alpha, 0, low_open=True,
                why=" (the adapters' scale is alpha / rank)")
    check_float("lora-dropout", args.lora_dropout, 0, 1, high_open=True)
    if not args.lora_target_modules:
        fail(f"--lora-target-modules: give module names (e.g. q_proj v_proj) or {ALL_LINEAR}")
    if args.dtype == "bf16-pure":
        fail("--dtype bf16-pure with --lora-rank: under LoRA the frozen base is already held in "
             "bf16 with --dtype bf16 (or auto on a GPU) and the adapters stay fp32; use those")
    if args.cpu_offload:
        fail("--cpu-offload with --lora-rank: not supported (untested with LoRA's frozen and "
             "trainable parameters in one FSDP2 unit); LoRA's state is small enough to stay on the "
             "GPU (docs/scaling.md)")


def check_run_name(output_dir: str, exp_name: str):
    """--output-dir is (or can become) a writable folder, and --exp-name one folder name inside
    it."""
    if exp_name in ("", ".", "..") or "/" in exp_name or os.sep in exp_name:
        fail(f"--exp-name {exp_name!r}: must be one folder name (no '/', not '.' or '..'), so that "
             "the run stays inside --output-dir")
    if (m := re.fullmatch(r"(.+)__(\d+)", exp_name)):  # its folders start as --exp-name m[1]'s do
        fail(f"--exp-name {exp_name!r} ends in '__' and a number, as the seed in a run folder's "
             f"name does ({{exp_name}}__{{seed}}__{{time}}): its runs would read as runs of "
             f"--exp-name {m[1]} with --seed {m[2]}; name it otherwise (e.g. {m[1]}_{m[2]})")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output-dir {output_dir}: is a file, not a folder")
    existing = os.path.abspath(output_dir)
    while not os.path.lexists(existing):  # the folder that makedirs would create the rest in
        existing = os.path.dirname(existing)
    if not os.path.exists(existing):  # a link to nowhere: dangling, or a loop of links
        try:
            os.stat(existing)
        except OSError as e:
            fail(f"--output-dir {output_dir}: {existing} is a symbolic link that leads to no folder "
                 f"({e.strerror}): point it at a folder, or give another --output-dir")
    if not os.path.isdir(existing):
        fail(f"--output-dir {output_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--output-dir {output_dir}: {existing} is not writable")


def check_run_folder(output_dir: str, exp_name: str, seed: int):
    """A run folder, {exp_name}__{seed}__{unix time}, can be made under --output-dir: its name fits
    the file system's limit on one name, and a folder can be created where --output-dir is (or
    would be) made. os.access is not enough: root passes it on /proc and /sys, where no folder can
    be made; so a folder is made and removed there."""
    import tempfile
    import time

    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # check_run_name found it a folder
        existing = os.path.dirname(existing)
    name = f"{exp_name}__{seed}__{int(time.time()) + 1}"
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    over = len(os.fsencode(name)) - limit
    if over > 0:
        fail(f"--exp-name {exp_name[:40]}...: the run folder's name ({{exp_name}}__{seed}__<time>) "
             f"would have {len(os.fsencode(name))} bytes, over the {limit} this file system allows "
             f"in one name: give an --exp-name of at most {len(os.fsencode(exp_name)) - over} "
             "bytes")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_check_", dir=existing))
    except OSError as e:
        fail(f"--output-dir {output_dir}: no folder can be made in {existing} ({e.strerror}): "
             "give a folder on a writable disk")
