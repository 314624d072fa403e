"""The checks every script runs on its flags before any heavy work (one line naming the fix), and
the defaults that depend on the model and the task. Called at the top of each script's main().
"""

from __future__ import annotations

import math
import os

import torch

from checkpoint import STEP_DIR
from data import check_dataset
from distributed import fail, launched


# -------------------- argument checks: every flag before any heavy work
def default_learning_rate(model: str) -> float:
    """--learning-rate when not given: the tiny model learns fast with a large step; real models
    follow the papers' scale. Each script's main() fills it in, in view, before anything reads
    it."""
    return 5e-4 if model == "tiny" else 1e-6


def default_max_new_tokens(dataset: str) -> int:
    """--max-new-tokens when not given: the built-in task's answer is one digit, then EOS; real
    tasks reason."""
    return 2 if dataset == "builtin" else 1024


def check_common_args(args):
    """Bad input fails with one line before any heavy work. Reads args, never writes them: main()
    has filled in --learning-rate and --max-new-tokens already (default_learning_rate,
    default_max_new_tokens)."""
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: group-relative advantages need at least 2 "
             "completions a prompt")
    if args.max_new_tokens <= 0:
        fail(f"--max-new-tokens {args.max_new_tokens}: must be > 0")
    if args.clip_low <= 0 or args.clip_high <= 0:
        fail(f"--clip-low {args.clip_low} / --clip-high {args.clip_high}: clip ranges must be > 0")
    if args.prompts_per_rank < 1:
        fail(f"--prompts-per-rank {args.prompts_per_rank}: must be >= 1")
    if args.num_minibatches < 1 or args.prompts_per_rank % args.num_minibatches:
        fail(f"--prompts-per-rank {args.prompts_per_rank} must be a multiple of --num-minibatches "
             f"{args.num_minibatches} (each minibatch holds whole groups)")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        fail(f"--temperature {args.temperature}: must be > 0 (RL samples from the policy)")
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
    for flag in ("cpu_offload", "gen_unshard"):
        if getattr(args, flag) and not launched():
            fail(f"--{flag.replace('_', '-')} acts on FSDP2 shards, which plain `python` does not "
                 "make: launch with `torchrun --nproc-per-node N` (N = 1 is fine)")
    if args.eval_n is not None and args.eval_n < args.eval_k or args.eval_k < 1:
        fail(f"--eval-n {args.eval_n} / --eval-k {args.eval_k}: pass@k needs n >= k >= 1 samples a "
             "prompt")
    resume_dir = os.path.basename(os.path.normpath(args.resume or ""))
    if args.resume not in (None, "auto") and not (os.path.isdir(args.resume)
                                                  and STEP_DIR.match(resume_dir)):
        fail(f"--resume {args.resume}: not a checkpoint (a run's step_N folder); give one, or "
             "'auto' for the newest of this --exp-name and --seed")
    if args.keep_checkpoints < 0 or args.save_every < 0:
        fail(f"--keep-checkpoints {args.keep_checkpoints} / --save-every {args.save_every}: must "
             "be >= 0")
    if not 0 <= args.warmup_frac < 1 or not 0 <= args.min_lr_ratio <= 1:
        fail(f"--warmup-frac {args.warmup_frac} must lie in [0, 1) and --min-lr-ratio "
             f"{args.min_lr_ratio} in [0, 1]")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        fail(f"--learning-rate {args.learning_rate}: must be > 0")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p {args.top_p}: must lie in (0, 1] (1 is off)")
    if args.top_k < 0:
        fail(f"--top-k {args.top_k}: must be >= 0 (0 is off)")
    if args.gen_batch_size < 1:
        fail(f"--gen-batch-size {args.gen_batch_size}: must be >= 1 completions a generate call")
    if args.logprob_chunk_tokens < 1:
        fail(f"--logprob-chunk-tokens {args.logprob_chunk_tokens}: must be >= 1")
    if not args.weight_decay >= 0 or not args.max_grad_norm > 0:
        fail(f"--weight-decay {args.weight_decay} must be >= 0 and --max-grad-norm "
             f"{args.max_grad_norm} > 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.eval_size < max(1, world):
        fail(f"--eval-size {args.eval_size}: must be >= 1 and at least the world size {world} "
             "(every rank evaluates an equal share of the held-out prompts)")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every}: must be >= 0 (0: never)")
    check_dataset(args.dataset, args.data_files)
    check_run_name(args.output_dir, args.exp_name)


def check_run_name(output_dir: str, exp_name: str):
    """--output-dir is (or can become) a writable folder, and --exp-name one folder name inside
    it."""
    if exp_name in ("", ".", "..") or "/" in exp_name or os.sep in exp_name:
        fail(f"--exp-name {exp_name!r}: must be one folder name (no '/', not '.' or '..'), so that "
             "the run stays inside --output-dir")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        fail(f"--output-dir {output_dir}: is a file, not a folder")
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # the folder that makedirs would create the rest in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail(f"--output-dir {output_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--output-dir {output_dir}: {existing} is not writable")
