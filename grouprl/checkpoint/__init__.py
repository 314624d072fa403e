"""Run folders, checkpoints and exact resume: claiming a run folder, saving and verifying step_N,
restoring a run's state, graceful stop on SIGTERM/SIGINT, and a run's end. Called by the scripts.
The layout and its guarantees: docs/checkpoints.md. Each file reads alone:

  manifest.py  a checkpoint's layout (step_N/model, state/), manifest.json, verify_checkpoint
  run_dir.py   the run folder and its lock (claim_run_dir), pruning, a branch's later checkpoints
               and rows set aside, the folder checked by identity while the run writes it
  guards.py    a failed write (full disk, file size limit, folder gone) as one line on every rank
  signals.py   SIGTERM/SIGINT in start-up and in training (stop_requested), cleanup at the end
  resume.py    run_paths (--resume auto), RESUME_FIXED, saved_flags, trainer_state.json read
  restore.py   resume_state: optimizer, lr schedule and RNGs back, resharded on a new world size
  weights.py   the bf16 export (write_model), FSDP2's gather, the per-rank fp32 master weights
  save.py      save_checkpoint (step_N whole or not at all), --save-final model's final/

Below: the names the scripts, common.py, the other modules, tests and tools use. A test that
replaces one of them patches the file that calls it (e.g. checkpoint.save.write_training_state).
"""

from .guards import _attempt, writing
from .manifest import (HASH_BELOW, MANIFEST, STEP_DIR, _manifest_files, _sha256,
                       _write_manifest_file, is_checkpoint, model_folder_problem, state_dir,
                       verify_checkpoint, write_manifest)
from .restore import reshard_rows, resume_state
from .resume import RESUME_FIXED, read_trainer_state, restated, run_paths, saved_flags
from .run_dir import (_claim_run_dir, claim_run_dir, prune_checkpoints, release_run_dir,
                      remove_pruned)
from .save import save_checkpoint, write_training_state
from .signals import (_stop, catch_startup_signals, catch_stop_signals, cleanup,
                      release_stop_signals, startup_phase, starting_up, stop_requested)
from .weights import (full_state_dict, load_masters, master_weights, masters_files, write_masters,
                      write_model)

__all__ = [
    "HASH_BELOW", "MANIFEST", "RESUME_FIXED", "STEP_DIR", "_attempt", "_claim_run_dir",
    "_manifest_files", "_sha256", "_stop", "_write_manifest_file", "catch_startup_signals",
    "catch_stop_signals", "claim_run_dir", "cleanup", "full_state_dict", "is_checkpoint",
    "load_masters", "master_weights", "masters_files", "model_folder_problem", "prune_checkpoints",
    "read_trainer_state", "release_run_dir", "release_stop_signals", "remove_pruned",
    "reshard_rows", "restated", "resume_state", "run_paths", "save_checkpoint", "saved_flags",
    "startup_phase", "starting_up", "state_dir", "stop_requested", "verify_checkpoint", "writing",
    "write_manifest", "write_masters", "write_model", "write_training_state",
]
