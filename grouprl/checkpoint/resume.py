"""What a resume is: the run folder and the checkpoint to go on from (run_paths, --resume auto),
the flags a resume may not change (RESUME_FIXED), the ones a plain --resume takes from the run
(saved_flags), and a checkpoint's trainer_state.json, read and checked.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import time

import torch.distributed as dist

from ..distributed import Dist, fail
from .manifest import STEP_DIR, state_dir, step_folders, verify_checkpoint
from .signals import cleanup


def run_paths(args, dist_env: Dist, script: str) -> tuple[str, str | None]:
    """The run folder and the checkpoint to resume from (None: a fresh run). --resume auto takes the
    newest complete checkpoint of this exp_name and seed under --output-dir, or starts a fresh run
    when there is none, so the same command serves the first launch and every torchrun restart. Rank
    0 lists the checkpoints and names a fresh run folder; every rank then reads the same files and
    reaches the same verdict, so an error stops all ranks at once."""
    listed = [None, None]  # (candidate checkpoints, newest first; a fresh run's folder)
    if dist_env.main:
        candidates = [args.resume] if args.resume not in (None, "auto") else []
        if args.resume == "auto":
            runs = own_runs(args.output_dir, args.exp_name, args.seed)
            # (run's unix time, step)
            found = sorted((t, n, p) for t, run in runs for n, p in step_folders(run))
            candidates = [p for _, _, p in reversed(found)]
        fresh = os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time())}")
        listed = [[os.path.normpath(p) for p in candidates], fresh]
    if dist_env.world > 1:
        dist.broadcast_object_list(listed, src=0)
    candidates, fresh = listed
    ckpt = None
    for path in candidates:  # the newest that verifies
        reason = verify_checkpoint(path, dist_env)
        if reason is None:
            ckpt = path
            break
        if args.resume != "auto":
            fail(f"--resume {path}: {reason}; resume from another checkpoint (or --resume auto)")
        if dist_env.main:
            print(f"--resume auto: skipping {path}: {reason}")
    if args.resume == "auto" and ckpt is None and dist_env.main:
        print(f"--resume auto: no checkpoint of {args.exp_name}__{args.seed}__<time> under "
              f"{args.output_dir}, starting a fresh run")
    step = 0
    if ckpt:
        state = read_trainer_state(ckpt)
        if state["script"] != script:
            fail(f"{ckpt} was written by {state['script']}, not {script}: resume it with that "
                 "script")
        step = state["step"]
        then, now = state.get("args", {}), vars(args)
        for name in RESUME_FIXED:
            if name in PATHS and same_path(then.get(name), now[name], ckpt, then.get("output_dir")):
                continue
            if name in then and then[name] != now[name]:
                fail(f"--{name.replace('_', '-')} {now[name]} differs from {then[name]} in {ckpt}: "
                     "it cannot change on resume (the data order, the objective, the optimizer "
                     f"state or the weights depend on it); pass {as_flag(name, then[name])} to "
                     "resume, or start a new run without --resume")
        changed = [f"--{k.replace('_', '-')} {then[k]} -> {v}" for k, v in now.items()
                   if k in then and then[k] != v and k != "resume" and not (
                       k in PATHS and same_path(then[k], v, ckpt, then.get("output_dir")))]
        if dist_env.main:
            print(f"resuming {ckpt} (step {step})")
            if changed:
                print(f"changed on resume, in effect from step {step + 1}: {', '.join(changed)}")
    if step >= args.num_steps:  # e.g. a restart after the last checkpoint was written
        if dist_env.main:
            print(f"{ckpt} is at step {step} and --num-steps is {args.num_steps}: nothing to do")
        cleanup()
        raise SystemExit(0)
    return (os.path.dirname(ckpt) if ckpt else fresh), ckpt


def own_runs(output_dir: str, exp_name: str, seed: int) -> list[tuple[int, str]]:
    """The run folders of exp_name and seed under output_dir as (unix time, path): exactly
    {exp_name}__{seed}__<digits>, so that --exp-name x never takes x__1__1__<time> (--exp-name
    x__1's run at seed 1) for its own run at seed 1 (cli.check_run_name refuses an --exp-name
    ending in __<digits>, whose folders a glob of x__1__* would mix with x's)."""
    name = re.compile(re.escape(f"{exp_name}__{seed}__") + r"(\d+)")
    try:
        entries = os.listdir(output_dir)
    except OSError:  # no --output-dir yet: no runs
        return []
    return sorted((int(m[1]), os.path.join(output_dir, e)) for e in entries
                  if (m := name.fullmatch(e)) and os.path.isdir(os.path.join(output_dir, e)))


# What a resumed run may not change: the data order (seed, prompts a rank, the data), the shape of a
# step (group size), the weights and optimizer state (model), and the objective (the script's loss
# flags and what shapes the advantages). World size and script are checked on their own; a name the
# checkpoint's script lacks is skipped.
RESUME_FIXED = ("seed", "model", "dataset", "data_files", "prompt_column", "answer_column",
                # with --eval-dataset no held-out split is taken from --dataset: other train rows
                "eval_dataset", "prompts_per_rank", "group_size",
                "clip_low", "clip_high", "scale_rewards", "adv_std", "adv_eps", "baseline",
                "mask_truncated",
                "truncated_reward_scale",
                "loss_agg", "kl_ratio_correction",
                "symmetric_clip", "kl_coef", "post_answer_penalty", "transform", "length_aware",
                "clip_gated", "stop_grad", "orth_floor", "lora_rank", "lora_alpha",
                "lora_target_modules", "luspo", "delta", "tau_pos", "tau_neg", "k_pos", "lambda_pos",
                "k_neg", "lambda_neg", "top_entropy_quantile", "multi_objective_aggregation",
                "min_new_tokens", "tools", "environment", "max_tool_calls", "turn_credit", "max_staleness",
                "weight_sync_steps")


def restated(argv: list[str], names: set[str]) -> set[str]:
    """The flags the command line gives (--flag, --flag=x, --flag_name, --no-flag), by field name."""
    said = set()
    for word in argv:
        name = word[2:].partition("=")[0].replace("-", "_") if word.startswith("--") else ""
        said.add(name[3:] if name not in names and name.startswith("no_") else name)
    return said & names


# fill_defaults derives these from another flag: a saved value equal to that flag's was derived, and
# is derived again from this run's (a plain --resume --max-new-tokens 6 evaluates at 6 too)
DERIVED = {"eval_max_new_tokens": "max_new_tokens"}
# flags that hold one entry per entry of another: taken only with the list they were given for
PER_ENTRY = {"reward_weights": "reward"}
# flags that name local paths, relative to the folder the run was started in
PATHS = ("dataset", "eval_dataset", "data_files")


def saved_flags(args, argv: list[str]) -> dict:
    """A plain --resume step_N continues the run as it was: every flag the command line does not
    restate takes the value the run saved (trainer_state.json's args), not its default, so that
    --keep-checkpoints 0 stays 0 and no checkpoint the run was keeping is pruned. Except: a derived
    default (DERIVED) is derived again; --reward-weights goes with the --reward list it weighed;
    --output-dir is the folder holding the checkpoint's run (where this run writes); a relative
    data path is found from the folder the run started in, or said to come from the checkpoint.
    {} for a fresh run, --resume auto (the same command line again) or a checkpoint that cannot be
    read (then run_paths says why)."""
    if getattr(args, "resume", None) in (None, "auto"):
        return {}
    try:
        with open(os.path.join(state_dir(args.resume), "trainer_state.json")) as f:
            then = json.load(f).get("args")
    except (OSError, ValueError, AttributeError):
        return {}
    now = vars(args)
    if not isinstance(then, dict):
        return {}
    said = restated(argv, set(now))
    keep = said | {"resume", "output_dir"}
    keep |= {k for k, src in DERIVED.items() if k in then and then[k] == then.get(src)}
    keep |= {k for k, src in PER_ENTRY.items() if src in said and now[src] != then.get(src)}
    taken = {k: tuple(v) if isinstance(now[k], tuple) and isinstance(v, list) else v
             for k, v in then.items() if k in now and k not in keep and v != now[k]}
    if "output_dir" not in said:  # the run folder is the checkpoint's: said as it was, if it is
        parent = os.path.dirname(os.path.dirname(os.path.abspath(args.resume)))
        same = isinstance(then.get("output_dir"), str) and _same_folder(then["output_dir"], parent)
        taken["output_dir"] = then["output_dir"] if same else parent
    for k in PATHS:
        if k in taken:
            taken[k] = _found(k, taken[k], args.resume, then.get("output_dir"))
    return taken


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def started_in(ckpt: str, output_dir) -> str | None:
    """The folder the run of ckpt was started in, where its --output-dir was relative (the run
    folder is {output_dir}/{run}/step_N); None where it cannot be told (an absolute one)."""
    if not isinstance(output_dir, str) or os.path.isabs(output_dir):
        return None
    parent = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    parts = [p for p in os.path.normpath(output_dir).split(os.sep) if p != "."]
    if ".." in parts:
        return None
    start = parent
    for _ in parts:
        start = os.path.dirname(start)
    return start if os.path.normpath(os.path.join(start, *parts)) == parent else None


def same_path(then, now, ckpt: str, output_dir) -> bool:
    """A saved relative path and this run's name the same file: from the folder the run started
    in (started_in), or, where that cannot be told, now ends with it."""
    if then == now:
        return True
    if not (isinstance(then, str) and isinstance(now, str)) or os.path.isabs(then):
        return False
    start = started_in(ckpt, output_dir)
    if start is not None:
        return os.path.abspath(now) == os.path.normpath(os.path.join(start, then))
    return os.path.abspath(now).endswith(os.sep + os.path.normpath(then))


def _found(flag: str, value, ckpt: str, output_dir) -> object:
    """A relative path taken from the checkpoint's flags, as this run reads it: as it is where it is
    found from here, else from the folder the run started in (started_in); else one line saying
    where it came from."""
    if not isinstance(value, str) or os.path.isabs(value) or glob.glob(value):
        return value
    from ..data import FORMATS

    if not (value.endswith(tuple(FORMATS)) or glob.has_magic(value) or value.startswith(".")):
        return value  # a hub id or a known set's name, not a path
    start = started_in(ckpt, output_dir)
    if start is not None and glob.glob(os.path.join(glob.escape(start), value)):
        return os.path.join(start, value)
    name = flag.replace("_", "-")
    fail(f"--{name} {value!r} comes from the checkpoint {ckpt}'s saved flags, a path relative to "
         f"the folder the run was started in, and is not found from {os.getcwd()}: resume from that "
         f"folder, or give --{name} with its path from here")


def as_flag(name: str, value) -> str:
    """The command-line words that set flag `name` to `value` (tyro's spelling of booleans)."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def read_trainer_state(ckpt: str) -> dict:
    """A checkpoint's trainer_state.json, or one line saying why it cannot be read: a field of the
    wrong type or out of range (an edited file, its manifest re-hashed) is said, never resumed."""
    path = os.path.join(state_dir(ckpt), "trainer_state.json")
    try:
        with open(path) as f:
            state = json.load(f, parse_constant=lambda c: None)
        missing = [k for k in ("step", "world", "script") if k not in state]
    except (OSError, ValueError, TypeError) as e:
        fail(f"{path}: cannot read it ({type(e).__name__}: {e}); resume from another checkpoint")
    if missing:
        fail(f"{path} has no {missing}: resume from another checkpoint")
    bad = state_problem(state, STEP_DIR.search(os.path.normpath(ckpt)))
    if bad:
        fail(f"{path}: {bad}: the file was edited or damaged; resume from another checkpoint")
    return state


def _count(x, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def state_problem(state: dict, folder: re.Match | None) -> str | None:
    """What is wrong with a trainer_state.json's fields (type, range, the step its step_N folder
    names), in words; None when nothing is."""
    step = state["step"]
    checks = [
        ("step", _count(step, 0), "a whole number >= 0"),
        ("world", _count(state["world"], 1), "a whole number >= 1"),
        ("script", isinstance(state["script"], str) and state["script"].endswith(".py"),
         "a script's file name"),
        ("args", isinstance(state.get("args", {}), dict), "the run's flags by name"),
        ("reward_curve", isinstance(state.get("reward_curve", []), list)
         and all(r is None or _number(r) for r in state.get("reward_curve", [])),
         "a list of rewards"),
        ("nonfinite_run", _count(state.get("nonfinite_run", 0), 0), "a whole number >= 0"),
        ("wall_time", _number(state.get("wall_time", 0.0)) and state.get("wall_time", 0.0) >= 0,
         "seconds >= 0")]
    for name, ok, what in checks:
        if not ok:
            return f"{name} is {state.get(name)!r}, not {what}"
    if folder and step != int(folder[1]):
        return f"step is {step!r}, not {folder[1]} as its folder {folder[0]} says"
    return None
