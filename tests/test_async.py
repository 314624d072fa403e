"""--async-rollouts (issue 63 item 1; grouprl/rollout_ranks.py): under torchrun (gloo, CPU) one trainer and one
rollout rank sample exactly what one process under --max-staleness k --weight-sync-steps W samples (every metric
bitwise but the async run's own keys), each step with the weights staleness.sampled_with gives (stale/version, read
from each row); SIGKILL of the rollout rank stops the job with its last checkpoint intact (in one line when the
trainer waits on the link, at the step boundary when torchrun's SIGTERM reaches it first), and --resume auto goes on
exactly; two trainers: k = 0 is the synchronous 2-rank run, k = 2 stops on SIGTERM and resumes exactly; an async
run learns the built-in task."""
import glob
import os
import subprocess
import sys

from helpers import ROOT, read_rows

from grouprl.checkpoint.manifest import is_checkpoint, step_folders

PROGRAM = os.path.join(ROOT, "tests", "programs", "async_split.py")
K = 1
ARGV = ["--num-steps", "5", "--prompts-per-rank", "4", "--num-minibatches", "2", "--eval-every", "0",
        "--learning-rate", "1e-2", "--max-new-tokens", "4", "--log-samples", "0", "--save-every", "1",
        "--max-staleness", str(K)]
ASYNC_KEYS = ("stale/version", "stale/dropped")
SYNC2 = ("--weight-sync-steps", "2")


def launch(out, *extra, script="grpo.py", torchrun=True, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else [
        sys.executable]
    return subprocess.run([*cmd, PROGRAM, script, *ARGV, *extra, "--output-dir", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def rows_of(out, jitter_row=True):
    (run,) = glob.glob(f"{out}/*/metrics.jsonl")
    return read_rows(run, jitter_row), os.path.dirname(run)


def without(rows, keys=ASYNC_KEYS):
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k not in keys} for r in rows]


def test_async_run_is_the_one_process_run_survives_a_killed_rollout_rank_and_resumes_exactly(tmp_path):
    """k = 1, a version every W = 2 steps (--weight-sync-steps): step s samples with the weights after
    2 max(0, (s - 1) // 2 - 1) steps, as one process does; the resumed step 3 or 4 reads them from the checkpoint."""
    p = launch(tmp_path / "one", *SYNC2, torchrun=False)
    assert p.returncode == 0, p.stderr[-3000:]
    one, _ = rows_of(tmp_path / "one")
    # the rollout rank kills itself as it starts to sample step 5 (with the weights after step 2, sent as step 3
    # starts; steps 1-4 sample with the initial ones): the trainer has trained step 2, 3 or 4
    p = launch(tmp_path / "async", "--async-rollouts", *SYNC2, env={"KILL_AT": "5"})
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    stopped = "SIGTERM: stopping with a checkpoint at the end of this step" in p.stderr
    assert len(errors) == 1 or not errors and stopped, p.stderr[-3000:]
    rows, run = rows_of(tmp_path / "async", jitter_row=False)
    last = max(n for n, path in step_folders(run) if is_checkpoint(path))
    assert last in (2, 3, 4) and [r["step"] for r in rows] == list(range(1, last + 1))
    if errors:  # the trainer waited on the link: one line, naming the last checkpoint
        assert errors[0].startswith(f"error: step {last + 1}: the rollout rank 1 is gone (") and errors[0].endswith(
            f"the last checkpoint is {run}/step_{last}: go on with --resume auto (or that folder)"), errors[0]
    p = launch(tmp_path / "async", "--async-rollouts", *SYNC2, "--resume", "auto")
    assert p.returncode == 0, p.stderr[-3000:]
    rows, _ = rows_of(tmp_path / "async")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert without(rows) == without(one)  # bitwise: the same samples, the same updates
    assert [r["stale/version"] for r in rows] == [0, 0, 0, 0, 1]  # TRL's model version: syncs
    assert [r["stale/steps_behind"] for r in rows] == [0, 1, 2, 3, 2]
    assert all(0 <= r["stale/versions_behind"] <= K and r["stale/dropped"] == 0 for r in rows)
    assert rows[-1]["losses/grad_norm"] > 0 and not any(k in one[0] for k in ASYNC_KEYS)


def test_two_trainers_and_a_rollout_rank_are_the_synchronous_two_rank_run(tmp_path):
    """3 ranks, --async-rollouts k = 0: FSDP2 and every collective over the two trainers alone, the rollout rank
    drawing each trainer's prompts from that trainer's random streams as they are at the step's start (an evaluation's
    draws included): the 2-rank synchronous run, bitwise, evaluations included."""
    short = ["--num-steps", "2", "--max-staleness", "0", "--save-every", "0", "--eval-every", "1", "--eval-size", "4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    for n, out, extra in (("3", "async", ["--async-rollouts"]), ("2", "sync", [])):
        p = subprocess.run([*cmd, n, PROGRAM, "grpo.py", *ARGV, *short, *extra, "--output-dir", str(tmp_path / out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    rows, _ = rows_of(tmp_path / "async")
    sync, _ = rows_of(tmp_path / "sync")
    assert without(rows) == without(sync) and [r.get("stale/version") for r in rows] == [None, 0, 1]


def test_two_trainers_k2_lora_stop_on_sigterm_and_resume_exactly(tmp_path):
    """3 ranks, --async-rollouts k = 2, LoRA (the adapters are what is sent): trainer 0 keeps the ring of past weights
    (state/stale_ring.pt) and each trainer the random streams its rollouts are drawn from
    (state/stale_streams.rank{t}.pt). SIGTERM on the rollout rank as it starts to sample step 3: that rollout tells
    the trainers, which finish step 3, save it and exit 0, and so does the rollout rank (a stop, not a failure);
    --resume auto then logs the uninterrupted run's steps 4 and 5 bitwise, though the evaluation at step 3 drew from
    the trainers' streams after rollouts 4 and 5 were drawn from the rollouts' own (so a k > 0 async run with
    evaluations samples otherwise than one process from the first evaluation on: docs/objectives.md)."""
    flags = ["--max-staleness", "2", "--save-every", "0", "--async-rollouts", "--eval-every", "3", "--eval-size", "4",
             "--lora-rank", "4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", PROGRAM, "gspo.py"]
    for out, extra, env in (("whole", [], {}), ("cut", [], {"KILL_AT": "3", "KILL_WITH": "SIGTERM"}),
                            ("cut", ["--resume", "auto"], {})):
        p = subprocess.run([*cmd, *ARGV, *flags, *extra, "--output-dir", str(tmp_path / out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        assert p.returncode == 0, p.stderr[-3000:]
        if env:
            assert "SIGTERM on a rollout rank: the trainers stop with a checkpoint at the end of a step" in p.stderr
            rows, run = rows_of(tmp_path / out, jitter_row=False)
            assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/prompts" in rows[3]
            assert {"stale_ring.pt", "stale_streams.rank0.pt", "stale_streams.rank1.pt"} <= set(
                os.listdir(f"{run}/step_3/state"))
    rows, _ = rows_of(tmp_path / "cut")
    whole, _ = rows_of(tmp_path / "whole")
    assert without(rows, ()) == without(whole, ()) and [r["stale/version"] for r in rows[1:]] == [0, 0, 0, 1, 2]


def test_an_async_run_learns_the_built_in_task(tmp_path):
    """gspo.py under torchrun, one trainer and one rollout rank, each step sampled with the weights one step old (k = 1,
    2026-12-08: reward 0.007 over steps 1-10, 0.261 over 71-80, 0.455 over 91-100 at 100 steps; tests/test_train.py's
    synchronous run: 0.167 over 91-100): the
    reward rises as test_reward_rises asks of the one-process run, and every rollout the trainer used was sampled
    with the weights after max(0, s - 2) steps (stale/version, logged by the trainer as it receives each)."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "gspo.py", "--num-steps", "80", "--eval-every", "0", "--async-rollouts", "--max-staleness", "1",
                        "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows, _ = rows_of(tmp_path)
    assert [r["stale/version"] for r in rows] == [max(0, s - 2) for s in range(1, 81)]
    assert all(r["stale/versions_behind"] == min(1, r["step"] - 1) and r["stale/dropped"] == 0 for r in rows)
    r = [row["charts/reward_mean"] for row in rows]
    first, last = sum(r[:10]) / 10, sum(r[-10:]) / 10
    assert last > 10 * first and last > 0.12, (first, last)  # 0.1: the best a constant answer can do
