"""The command line of every script. Which file holds what:
  flags.py     CommonArgs: the flags every script shares, in headed sections (each script's Args
               extends it with its objective's own)
  parsing.py   parse_args: tyro, its errors in one line, --help grouped by section, and TRL's and
               verl's names answered with ours (foreign_flag, TRL_FLAGS, VERL_KEYS)
  defaults.py  the defaults that depend on the model and the task (fill_defaults), and the flags as
               the objects generation and evaluation take (rollout_sampling, eval_plan)
  checks.py    every flag checked before any heavy work (check_common_args and the checks it calls)
  rollout_checks.py  the rollout's checks check_common_args calls (--old-logp, --rollout-is-*,
               --async-rollouts, --max-staleness), and --dynamic-sampling's prompt pool
  bounds.py    check_float, check_int: a flag in its range, the checks' one-line refusal
This file only re-exports the names used outside the package.
"""

from .bounds import check_float  # noqa: F401
from .checks import MAX_SEED, check_common_args, check_run_name  # noqa: F401
from .defaults import eval_plan, fill_defaults, rollout_sampling  # noqa: F401
from .flags import CommonArgs  # noqa: F401
from .parsing import (TRL_FLAGS, TRL_LOSS_SCRIPTS, TRL_LOSS_TYPES, VERL_KEYS,  # noqa: F401
                      foreign_flag, parse_args)
from .rollout_checks import check_prompt_pool  # noqa: F401
