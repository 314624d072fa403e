"""The command line read into a script's Args: tyro, its errors in one line printed once, and TRL's
and verl's names for our flags answered with ours (foreign_flag).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

from ..checkpoint import saved_flags
from ..distributed import main_process
from .checks import check_given_eval_flags


# -------------------- TRL's and verl's names for our flags (docs/trl-and-verl.md's tables)
# TRL's GRPOConfig (and the TrainingArguments it extends), by field name: what to give here instead.
# A name that is ours too (learning_rate, temperature, seed, num_iterations ...) is not listed.
TRL_FLAGS = {
    "num_generations": "use --group-size",
    "num_generations_eval": "use --eval-n",
    "max_completion_length": "use --max-new-tokens",
    "max_prompt_length": "use --max-prompt-tokens (longer prompts are dropped and counted)",
    "beta": "use --kl-coef",
    "epsilon": "use --clip-low (and --clip-high)",
    "epsilon_high": "use --clip-high",
    "loss_type": "use --loss-agg (grpo.py, gspo_token.py and the token-level scripts): dapo = "
                 "token-mean, grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm; cispo, "
                 "sapo, vespo: cispo.py, sapo.py, vespo.py; luspo: gspo.py --luspo",
    "sapo_temperature_pos": "use --tau-pos (sapo.py)",
    "sapo_temperature_neg": "use --tau-neg (sapo.py)",
    "delta": "use grpo.py --delta (two-sided clipping)",
    "vespo_k_pos": "use --k-pos (vespo.py)",
    "vespo_lambda_pos": "use --lambda-pos (vespo.py)",
    "vespo_k_neg": "use --k-neg (vespo.py)",
    "vespo_lambda_neg": "use --lambda-neg (vespo.py)",
    "importance_sampling_level": "use the script: token is grpo.py, sequence is gspo.py",
    "use_vllm": "use --gen-mode engine (the built-in engine; vLLM is not used)",
    "vllm_mode": "use --gen-mode engine (the built-in engine; vLLM is not used)",
    "per_device_train_batch_size": "use --micro-batch-size (completions a forward/backward)",
    "gradient_accumulation_steps": "use --micro-batch-size (gradients accumulate over a "
                                   "minibatch's micro-batches)",
    "generation_batch_size": "use --prompts-per-rank x --group-size (completions a step; "
                             "--gen-batch-size is completions a generate call)",
    "steps_per_generation": "use --num-minibatches (optimizer steps a rollout)",
    "reward_funcs": "use --reward module:function",
    "mask_truncated_completions": "use --mask-truncated",
    "use_bias_correction_kl": "use --kl-ratio-correction",
    "vllm_importance_sampling_correction": "use --rollout-is-cap C_max (the correction is on when "
                                           "a cap is given; --gen-mode engine)",
    "vllm_importance_sampling_mode": "use --rollout-is-mode (token-truncate, token-mask, "
                                     "sequence-truncate, sequence-mask)",
    "vllm_importance_sampling_clip_max": "use --rollout-is-cap",
    "vllm_importance_sampling_cap": "use --rollout-is-cap",
    "vllm_importance_sampling_clip_min": "use --rollout-is-min",
    "off_policy_mask_threshold": "use --off-policy-mask",
    "max_steps": "use --num-steps",
    "num_train_epochs": "use --num-steps (RL steps, one rollout batch each)",
    "lr_scheduler_type": "use --lr-schedule",
    "warmup_ratio": "use --warmup-frac",
    "warmup_steps": "use --warmup-frac (a fraction of the optimizer steps)",
    "gradient_checkpointing": "use --activation-checkpointing",
    "log_completions": "use --log-samples",
    "eval_steps": "use --eval-every",
    "save_steps": "use --save-every",
    "save_total_limit": "use --keep-checkpoints",
    "resume_from_checkpoint": "use --resume",
    "model_name_or_path": "use --model",
    "dataset_name": "use --dataset",
    "bf16": "use --dtype bf16",
    "report_to": "use --track for Weights & Biases (tensorboard and metrics.jsonl are always "
                 "written)",
    "logging_steps": "every step is logged",
}
# verl's trainer config keys (hydra overrides key=value): what to give here instead.
VERL_KEYS = {
    "data.train_files": "--dataset",
    "data.val_files": "--eval-dataset",
    "data.prompt_key": "--prompt-column",
    "data.train_batch_size": "--prompts-per-rank (x ranks)",
    "data.max_prompt_length": "--max-prompt-tokens",
    "data.max_response_length": "--max-new-tokens",
    "actor_rollout_ref.model.path": "--model",
    "actor_rollout_ref.rollout.n": "--group-size",
    "actor_rollout_ref.rollout.name": "--gen-mode",
    "actor_rollout_ref.rollout.temperature": "--temperature",
    "actor_rollout_ref.rollout.top_p": "--top-p",
    "actor_rollout_ref.rollout.top_k": "--top-k",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "--num-minibatches (prompts an optimizer step "
                                                   "= --prompts-per-rank x ranks / it)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "--micro-batch-size",
    "actor_rollout_ref.actor.ppo_epochs": "--num-iterations",
    "actor_rollout_ref.actor.clip_ratio_low": "--clip-low",
    "actor_rollout_ref.actor.clip_ratio_high": "--clip-high",
    "actor_rollout_ref.actor.loss_agg_mode": "--loss-agg",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "the script (gspo: gspo.py, geo_mean: gmpo.py, "
                                                     "cispo: cispo.py)",
    "actor_rollout_ref.actor.use_kl_loss": "--kl-coef",
    "actor_rollout_ref.actor.kl_loss_coef": "--kl-coef",
    "actor_rollout_ref.actor.optim.lr": "--learning-rate",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "--warmup-frac",
    "actor_rollout_ref.actor.optim.warmup_style": "--lr-schedule",
    "actor_rollout_ref.actor.grad_clip": "--max-grad-norm",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "--activation-checkpointing",
    "algorithm.adv_estimator": "the script (grpo: grpo.py); rloo: --baseline leave-one-out "
                               "--scale-rewards none; reinforce_plus_plus_baseline: --scale-rewards "
                               "batch",
    "algorithm.norm_adv_by_std_in_grpo": "--scale-rewards group / none (and --adv-std bessel)",
    "algorithm.filter_groups.enable": "--dynamic-sampling",
    "algorithm.filter_groups.max_num_gen_batches": "--max-gen-rounds (with --dynamic-sampling)",
    "algorithm.filter_groups.metric": "--dynamic-sampling (flat: equal rewards, the --reward the "
                                      "advantages use)",
    "custom_reward_function.path": "--reward module:function",
    "custom_reward_function.name": "--reward module:function",
    "trainer.total_training_steps": "--num-steps",
    "trainer.total_epochs": "--num-steps",
    "trainer.test_freq": "--eval-every",
    "trainer.save_freq": "--save-every",
    "trainer.default_local_dir": "--output-dir",
}
# TRL's loss_type -> --loss-agg (grpo.py, gspo_token.py); verl's loss_agg_mode names are ours
TRL_LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean",
                  "dr_grpo": "seq-mean-token-sum-norm", "bnpo": "token-mean"}
TRL_LOSS_SCRIPTS = {"cispo": "cispo.py", "sapo": "sapo.py",  # TRL loss_types that are a script here
                    "vespo": "vespo.py", "luspo": "gspo.py --luspo"}
VERL_OVERRIDE = re.compile(r"\+?([a-z_]+(?:\.[a-z_]+)+)=")


def foreign_flag(argv: list[str], ours: set[str], script: str = "") -> str | None:
    """The first of argv's flags that is TRL's or verl's name and not ours, as one line naming
    ours ("--num-generations is TRL's name: use --group-size"); None when there is none. ours:
    the field names of the script's Args; script: its file name (cispo.py's cap differs)."""
    for i, word in enumerate(argv):
        if (m := VERL_OVERRIDE.match(word)):
            key = m[1]
            hint = f"use {VERL_KEYS[key]}" if key in VERL_KEYS else (
                "give --flags; docs/trl-and-verl.md maps verl's config to them")
            return f"{key}=... is verl's config key: {hint}"
        if not word.startswith("--"):
            continue
        flag, eq, value = word[2:].partition("=")
        name = flag.replace("-", "_")
        if name == "loss_agg" and "loss_agg" in ours:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value in TRL_LOSS_TYPES:
                return (f"--loss-agg {value} is TRL's loss_type name: use --loss-agg "
                        f"{TRL_LOSS_TYPES[value]}")
            if value in TRL_LOSS_SCRIPTS:
                return (f"--loss-agg {value} is TRL's loss_type name for an objective: run "
                        f"{TRL_LOSS_SCRIPTS[value]}")
        if name == "epsilon_high" and script == "cispo.py" and name not in ours:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                mine = f"--clip-high {float(value) - 1:g}"
            except ValueError:
                mine = "--clip-high, its value less 1"
            return (f"--{flag} is TRL's name: use {mine} (TRL's CISPO epsilon_high is the cap on the "
                    "weight itself; cispo.py's cap is 1 + --clip-high)")
        if name in TRL_FLAGS and name not in ours:
            return f"--{flag} is TRL's name: {TRL_FLAGS[name]}"
    return None


# -------------------- parsing: tyro, its errors in one line, printed once
def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), whose own errors (an unknown flag, a value of the wrong type) stop with one
    line, printed by rank 0 alone under torchrun, instead of a box of 6-9 lines from every rank:
    tyro's first sentence, the flag it suggests if any, and where the flags are listed. --help is
    tyro's, printed once, one box per section of CommonArgs (help_view)."""
    import contextlib
    import io

    import tyro

    main = main_process()
    said = foreign_flag(sys.argv[1:] if argv is None else argv,
                        {f.name for f in dataclasses.fields(cls)}, script_file(cls))
    if said:  # a TRL or verl name: ours in one line, before tyro's "Unrecognized options"
        raise SystemExit(f"error: {said}" if main else 2)
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            args = tyro.cli(help_view(cls) if asks_help(argv) else cls, args=argv,
                            console_outputs=main, description=script_description(cls))
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        raise SystemExit(f"error: {tyro_error_line(box.getvalue())}" if main else 2) from None
    sys.stderr.write(box.getvalue())  # anything else tyro said (warnings) is not lost
    # a plain --resume step_N: the flags not restated are the run's saved ones, not the defaults
    words = sys.argv[1:] if argv is None else argv
    args = dataclasses.replace(args, **saved_flags(args, words))
    check_given_eval_flags(args, words)  # what the user typed, not a saved or derived value
    return args


def script_file(cls) -> str:
    """The file name of the script whose Args cls is ('' where unknown)."""
    import inspect

    try:
        return os.path.basename(inspect.getfile(cls))
    except (TypeError, OSError):
        return ""


def script_description(cls) -> str:
    """--help's first lines: the first paragraph of the script's docstring (what it optimises and
    where it comes from), then where TRL's and verl's names are mapped."""
    import inspect

    doc = (inspect.getmodule(cls).__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    return (f"{first}\nThe flags most runs set come first (--exp-name to --resume), then the rest "
            "every script shares by what they control, then this script's objective's own; TRL's and "
            "verl's names for them: docs/trl-and-verl.md.")


# -------------------- --help in sections: one box per `# -- name: heading` of CommonArgs' body
SECTION = re.compile(r"\s*# -- ([a-z_]+): (.+)")


def asks_help(argv: list[str] | None) -> bool:
    """Whether the command line asks for --help (before a bare --, as tyro reads it)."""
    words = sys.argv[1:] if argv is None else argv
    words = words[:words.index("--")] if "--" in words else words
    return "-h" in words or "--help" in words


def class_fields(cls) -> tuple[dict[str, int], dict[str, str], list[tuple[int, str, str]]]:
    """From cls's own source: its fields' lines, their docstrings, and the section headings
    (line, name, heading) of its body."""
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    lines, docs = {}, {}
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines[node.target.id] = node.lineno
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    heads = [(i + 1, m[1], m[2]) for i, line in enumerate(source.splitlines())
             if (m := SECTION.fullmatch(line))]
    return lines, docs, heads


def sections(cls) -> list[tuple[str, str, list[str]]]:
    """cls's flags by section, in --help's order, as (name, heading, fields): CommonArgs' sections
    (each `# -- name: heading` comment in its body over the fields below it), then the script's
    own flags (its Args' fields that CommonArgs lacks), if any."""
    from .flags import CommonArgs

    lines, _, heads = class_fields(CommonArgs)
    out = [(name, heading, []) for _, name, heading in heads]
    for f in dataclasses.fields(cls):
        if f.name in lines:
            k = max(i for i, (at, _, _) in enumerate(heads) if at < lines[f.name])
            out[k][2].append(f.name)
    own = [f.name for f in dataclasses.fields(cls) if f.name not in lines]
    if own:
        out.append(("this_script", "Parameters that control this script's own objective", own))
    return out


def help_view(cls):
    """A class whose --help is cls's in sections: one nested dataclass per section, its prefix
    omitted (tyro.conf.OmitArgPrefixes), so that tyro prints each section in a box of its own,
    headed by its name and heading, with every flag named, typed, documented and defaulted as in
    cls. Only --help reads it; a command line is always parsed into cls, whose fields stay flat."""
    import typing

    import tyro

    hints = typing.get_type_hints(cls, include_extras=True)
    docs = {}
    for klass in cls.__mro__[::-1]:  # a field's docstring: the nearest class's that gives one
        if dataclasses.is_dataclass(klass):
            docs.update(class_fields(klass)[1])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    groups = []
    for name, heading, names in sections(cls):
        parts = []
        for n in names:
            f = fields[n]
            default = (dataclasses.field(default_factory=f.default_factory)
                       if f.default is dataclasses.MISSING else dataclasses.field(default=f.default))
            parts.append((n, typing.Annotated[hints[n], tyro.conf.arg(help=docs.get(n, ""))],
                          default))
        group = dataclasses.make_dataclass(name, parts)
        group.__doc__ = heading
        groups.append((name, tyro.conf.OmitArgPrefixes[group],
                       dataclasses.field(default_factory=group)))
    return dataclasses.make_dataclass(cls.__name__, groups)


def tyro_error_line(box: str) -> str:
    """One line from tyro's error box: its first paragraph, the flags under 'Perhaps you meant',
    and the script's --help."""
    # rich draws a box, or plain rules where it guesses the terminal cannot show one; either way the
    # first row is the title and the first paragraph after it says what was wrong
    rows = [row for line in box.splitlines() if (row := line.strip().strip("│|╭╰╮╯").strip())][1:]
    rules = [i for i, row in enumerate(rows) if set(row) <= set("─-━=")] + [len(rows)]
    start = 1 if rules[0] == 0 else 0
    first = rows[start:min(i for i in rules if i >= start)]
    meant = next((i for i, row in enumerate(rows) if row.startswith("Perhaps you meant")), None)
    suggested = [] if meant is None else [
        row.split()[0] for row in rows[meant + 1:min(i for i in rules if i > meant)]
        if row.startswith("--")]
    said = " ".join(first).rstrip(".") or "cannot parse the flags"
    hint = f" (did you mean {' or '.join(dict.fromkeys(suggested))}?)" if suggested else ""
    return f"{said}{hint}; python {os.path.basename(sys.argv[0])} --help lists every flag"
