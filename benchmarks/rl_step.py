"""Wall time of one GSPO RL step (generation + training), on CPU: this repo's gspo.py against TRL's GRPOTrainer
configured as GSPO (importance_sampling_level="sequence"), with the same tiny model, prompts and settings:

    ours   python gspo.py --model <folder> ...: P prompts x G completions (one HF generate call, KV cache), rewards,
           group advantages, old log-probs (no grad), then M optimizer steps, each over whole groups
    trl    trl.GRPOTrainer: generation_batch_size = P x G completions every steps_per_generation = M optimizer steps of
           P x G / M completions each (pip install -r benchmarks/requirements.txt)

    python benchmarks/rl_step.py                     # P=16 prompts x G=8, M=4 minibatches, 64 new tokens, 20 steps

Both sides load the same random-init `tiny` model (modeling.tiny_model, seed 1) from one saved folder, train on the
built-in task with common.math_reward, sample at temperature 1 without top-p/top-k, take AdamW steps at the same
constant learning rate with grad-norm clipping 1.0 and GSPO's clip range (3e-4, 4e-4), in fp32 without activation
checkpointing. Each side runs in a fresh process, one after the other, with the same number of torch threads.
An RL step's time is, for ours, the difference of consecutive perf/wall_time values in metrics.jsonl; for TRL, the time
between the ends of optimizer steps k*M and (k+1)*M (a TrainerCallback). The first RL step (warm-up) is skipped and
the median of the others is reported. Generation share: generation time (ours: from perf/gen_tokens_per_s; TRL: its
_generate, i.e. tokenize + generate + decode, as ours) over step time, summed over the timed steps.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_tiny(folder: str, seed: int):
    """The weights gspo.py builds for --model tiny --seed 1 (modeling.load_model seeds, then builds), saved once."""
    sys.path.insert(0, ROOT)
    from transformers.utils import logging as hf_logging

    from grouprl.modeling import tiny_model, tiny_tokenizer
    from grouprl.distributed import seed_everything

    hf_logging.disable_progress_bar()
    seed_everything(seed)
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)


PHASES = {}  # --phases: phase -> {RL step: seconds}, filled by fenced() calls in a child process
RL_STEP = [0]  # the RL step under way: each generation call starts the next one


def fenced(fn, name: str, new_step: bool = False, by_grad: bool = False):
    """fn, timed between two device synchronizations into PHASES[name] (by_grad: the name says whether autograd is
    on); new_step: a call starts the next RL step. Fencing serializes CPU and GPU at each call, so the phases add
    up to the step, at the cost of the overlap between them (the fenced step is slower than the plain one)."""
    import torch

    def wrapped(*args, **kw):
        RL_STEP[0] += new_step
        key = f"{name} ({'grad' if torch.is_grad_enabled() else 'no grad'})" if by_grad else name
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        per_step = PHASES.setdefault(key, {})
        per_step[RL_STEP[0]] = per_step.get(RL_STEP[0], 0.0) + time.perf_counter() - t
        return out
    return wrapped


def fence_training(torch):
    """The phases both trainers share, fenced where both call them: backward, grad-norm clipping, AdamW."""
    torch.Tensor.backward = fenced(torch.Tensor.backward, "backward")
    torch.nn.utils.clip_grad_norm_ = fenced(torch.nn.utils.clip_grad_norm_, "grad-norm clipping")
    torch.optim.AdamW.step = fenced(torch.optim.AdamW.step, "AdamW step")


def ours_argv(a, folder: str, out_dir: str) -> list[str]:
    return ["--model", folder, "--seed", str(a.seed), "--num-steps", str(a.steps), "--prompts-per-rank",
            str(a.prompts), "--group-size", str(a.group_size), "--num-minibatches", str(a.minibatches),
            "--max-new-tokens", str(a.max_new_tokens), "--learning-rate", str(a.lr), "--eval-every", "0",
            "--output-dir", out_dir] + (["--gen-mode", a.gen_mode] if a.gen_mode else [])


def run_ours(a, folder: str, out_dir: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "gspo.py"), *ours_argv(a, folder, out_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    if p.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return ours_result(a, out_dir)


def run_ours_fenced(a, folder: str, out_dir: str) -> dict:
    """In this (fresh) process: gspo.py's main() with its phases fenced (--phases)."""
    import runpy

    import torch

    sys.path.insert(0, ROOT)
    import common
    from grouprl import modeling

    fence_training(torch)
    common.generate = fenced(common.generate, "generate", new_step=True)
    common.score = fenced(common.score, "rewards")  # the scripts score through common.sample_groups
    modeling.Policy.forward = fenced(modeling.Policy.forward, "log-prob forward", by_grad=True)
    sys.argv = ["gspo.py", *ours_argv(a, folder, out_dir)]
    runpy.run_path(os.path.join(ROOT, "gspo.py"), run_name="__main__")
    return ours_result(a, out_dir)


def ours_result(a, out_dir: str) -> dict:
    rows = [json.loads(line) for path in [os.path.join(r, "metrics.jsonl") for r, _, f in os.walk(out_dir)
                                          if "metrics.jsonl" in f] for line in open(path)]
    rows = sorted((r for r in rows if "perf/wall_time" in r), key=lambda r: r["step"])
    wall = [0.0] + [r["perf/wall_time"] for r in rows]
    n = a.prompts * a.group_size
    gen = [r["charts/response_length_mean"] * n / r["perf/gen_tokens_per_s"] for r in rows]  # gen_time of each step
    return {"step_s": [wall[k + 1] - wall[k] for k in range(len(rows))], "gen_s": gen, "completions": [n] * len(rows),
            "length": statistics.mean(r["charts/response_length_mean"] for r in rows)}


def run_trl(a, folder: str, out_dir: str) -> dict:
    """In this (fresh) process: TRL's GRPOTrainer as GSPO, matched field by field to gspo.py's defaults (--phases:
    with its phases fenced)."""
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, ROOT)
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common import math_reward
    from grouprl.data import Task, load_task

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"  # as modeling.load_tokenizer: left-padded prompts for generation
    train, _, _ = load_task(Task("builtin", None, 64, a.seed, enable_thinking=False),
                            tok)  # the same prompts ("text") as gspo.py
    train = train.remove_columns("prompt").rename_column("text", "prompt")  # a plain string prompt is used as-is

    seen = {"calls": 0, "completions": [], "prompts": [], "lengths": []}

    def reward(completions, answer, completion_ids, prompts, **_):
        seen["calls"] += 1
        seen["completions"].append(len(completions))
        G = a.group_size  # rows i*G..(i+1)*G-1 must share one prompt: count such groups
        seen["prompts"].append(sum(len(set(prompts[i:i + G])) == 1 for i in range(0, len(prompts), G)))
        seen["lengths"] += [len(c) for c in completion_ids]  # tokens up to and including EOS, as ours
        return [math_reward(c, x) for c, x in zip(completions, answer)]

    cfg = GRPOConfig(
        output_dir=out_dir, use_cpu=not a.gpu, bf16=a.gpu,  # as gspo.py --dtype auto: fp32 on CPU, bf16 on GPU
        activation_checkpointing=False,  # as gspo.py's default (TRL's default is on)
        seed=a.seed, model_init_kwargs={"dtype": torch.bfloat16 if a.gpu else torch.float32}, disable_dropout=True,
        importance_sampling_level="sequence", loss_type="grpo",  # GSPO: one ratio per sequence, mean over sequences
        beta=0.0, epsilon=3e-4, epsilon_high=4e-4,  # gspo.py --clip-low / --clip-high defaults; no KL, no reference
        scale_rewards="group", num_generations=a.group_size, num_iterations=1,
        per_device_train_batch_size=a.prompts * a.group_size // a.minibatches,  # completions per optimizer step
        steps_per_generation=a.minibatches, gradient_accumulation_steps=1,  # M optimizer steps per P x G rollout
        max_steps=a.steps * a.minibatches, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,  # top_k 0: off, as gspo.py --top-k 0
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch",  # torch.optim.AdamW as gspo.py (not fused)
        logging_steps=a.minibatches, report_to="none", disable_tqdm=True, save_strategy="no",  # a log row per RL step
    )
    ends = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=cfg, train_dataset=train, processing_class=tok,
                          callbacks=[StepTimes()])
    gen_s, generate = [], trainer._generate

    def timed_generate(*args, **kw):  # tokenize + generate + decode: the time perf/gen_tokens_per_s divides by
        t = time.perf_counter()
        out = generate(*args, **kw)
        gen_s.append(time.perf_counter() - t)
        return out

    trainer._generate = timed_generate
    if a.phases:
        fence_training(torch)
        trainer._generate = fenced(trainer._generate, "generate", new_step=True)
        trainer._get_per_token_logps_and_entropies = fenced(trainer._get_per_token_logps_and_entropies,
                                                            "log-prob forward", by_grad=True)
    trainer.train()
    M, n = a.minibatches, a.prompts * a.group_size
    # the setup check: one reward call of P x G completions (P groups of G) per RL step, M optimizer steps each
    ok = (seen["calls"] == a.steps and set(seen["completions"]) == {n} and set(seen["prompts"]) == {a.prompts}
          and trainer.state.global_step == a.steps * M and len(ends) == a.steps * M + 1
          and not trainer.model.is_activation_checkpointing)
    if not ok:
        raise SystemExit(f"error: TRL did not run the matched setup: {seen['calls']} reward calls of "
                         f"{seen['completions']} completions in {seen['prompts']} groups, "
                         f"{trainer.state.global_step} optimizer steps (expected {a.steps} of {n} in {a.prompts}, "
                         f"{a.steps * M})")
    return {"step_s": [ends[(k + 1) * M] - ends[k * M] for k in range(a.steps)], "gen_s": gen_s,
            "completions": seen["completions"], "length": statistics.mean(seen["lengths"])}


def child(a, folder: str, run: str = "trl") -> dict:
    flags = ("run", "folder", "model_folder", "gpu", "phases")
    cmd = [sys.executable, __file__, "--run", run, "--folder", folder] + [  # unset flags stay unset (not "None")
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in flags and v is not None
    ] + (["--gpu"] if a.gpu else []) + (["--phases"] if a.phases else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    if p.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="P: prompts per RL step (gspo.py --prompts-per-rank)")
    ap.add_argument("--group-size", type=int, default=8, help="G: completions per prompt (TRL num_generations)")
    ap.add_argument("--minibatches", type=int, default=4,
                    help="M: optimizer steps per RL step (TRL steps_per_generation)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="L: completion length limit")
    ap.add_argument("--steps", type=int, default=20,
                    help="N: RL steps; the first is warm-up, the median of the rest counts")
    ap.add_argument("--lr", type=float, default=5e-4, help="learning rate (gspo.py's default for --model tiny)")
    ap.add_argument("--seed", type=int, default=1, help="model init, data order and sampling seed")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both trainers")
    ap.add_argument("--model-folder", help="a saved model and tokenizer to train (default: the tiny model, --seed)")
    ap.add_argument("--gen-mode", help="gspo.py's --gen-mode (default: gspo.py's own default)")
    ap.add_argument("--gpu", action="store_true", help="TRL on the GPU in bf16 (gspo.py: bf16 on a GPU anyway)")
    ap.add_argument("--phases", action="store_true",
                    help="also time each phase (generation, log-prob passes, backward, clipping, AdamW) of both "
                         "trainers, each call fenced by device synchronizations; a second table")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: run TRL (or ours, --phases) in this process
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        with tempfile.TemporaryDirectory() as out:
            r = (run_trl if a.run == "trl" else run_ours_fenced)(a, a.folder, out)
            print(json.dumps({**r, "phases": PHASES}))
        return
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("error: this benchmark compares against TRL: pip install -r benchmarks/requirements.txt")
    if a.prompts % a.minibatches or a.steps < 2:
        raise SystemExit("error: --prompts must be a multiple of --minibatches (whole groups), and --steps >= 2")
    import torch
    import transformers
    import trl

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.model_folder or os.path.join(tmp, "tiny")
        if not a.model_folder:
            save_tiny(folder, a.seed)
        ours = child(a, folder, "ours") if a.phases else run_ours(a, folder, os.path.join(tmp, "runs"))
        results = {"ours (gspo.py)": ours, f"TRL {trl.__version__} GRPOTrainer": child(a, folder)}  # in turn
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
          f"gspo.py --gen-mode {a.gen_mode or 'default'}; {a.threads} threads; P={a.prompts} prompts x G={a.group_size}, M={a.minibatches} optimizer steps per RL "
          f"step, L={a.max_new_tokens} new tokens, {a.steps} RL steps (first skipped)")
    print("\n| trainer | median s / RL step | completions / step | mean completion length | generation share |")
    print("|---|---|---|---|---|")
    med = {}
    for name, r in results.items():
        steps, gen = r["step_s"][1:], r["gen_s"][1:]
        med[name] = statistics.median(steps)
        print(f"| {name} | {med[name]:.2f} | {statistics.median(r['completions']):.0f} | {r['length']:.1f} | "
              f"{sum(gen) / sum(steps):.0%} |")
    ours, theirs = med.values()
    print(f"\nratio ours / TRL = {ours / theirs:.2f} (total {time.time() - t0:.0f}s)")
    if a.phases:
        print_phases(results, a.steps)
    print(" ".join(["command: python", f"benchmarks/{os.path.basename(__file__)}"] + sys.argv[1:]))


def print_phases(results: dict, steps: int):
    """Seconds per RL step in each fenced phase, the mean over RL steps 2..N, and what no fence covers."""
    names = list(dict.fromkeys(k for r in results.values() for k in r["phases"]))
    print("\nphases, s / RL step (mean of RL steps 2..N; every phase fenced by device synchronizations)\n")
    print("| phase | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    mean = {}
    for trainer, r in results.items():  # JSON made the step numbers strings
        mean[trainer] = {k: sum(v.get(str(s), 0.0) for s in range(2, steps + 1)) / (steps - 1)
                         for k, v in r["phases"].items()}
        mean[trainer]["step (fenced)"] = statistics.mean(r["step_s"][1:])
        mean[trainer]["not fenced"] = mean[trainer]["step (fenced)"] - sum(mean[trainer][k] for k in r["phases"])
    for k in names + ["not fenced", "step (fenced)"]:
        print(f"| {k} | " + " | ".join(f"{m[k]:.3f}" if k in m else "-" for m in mean.values()) + " |")


if __name__ == "__main__":
    main()
