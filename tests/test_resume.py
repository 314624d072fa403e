"""Exact resume and crash-safe checkpoints: a run stopped after step 3 and resumed, a run SIGKILLed while it writes a
checkpoint, and a torchrun job whose rank 1 is SIGKILLed under --max-restarts all end with weights bitwise equal to
an unbroken run's, and log the same numbers at every step (fp32, tiny model, world size 1 and 2)."""
import dataclasses
import glob
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from grouprl import checkpoint
import common
from grouprl import distributed
from grouprl import modeling
from grouprl import runlog
from conftest import ROOT
from helpers import fake_checkpoint, read_rows

# 6 steps, eval at 0/3/6 (it draws samples too), warm-up then cosine: every piece of state a resume must restore
ARGS = ["--num-steps", "6", "--prompts-per-rank", "8", "--eval-every", "3", "--eval-size", "8", "--eval-k", "2",
        "--lr-schedule", "cosine", "--warmup-frac", "0.25", "--learning-rate", "2e-3"]


def launch(out, *extra, world=1, crash=None, crash_rank=0, restarts=0, script="gspo.py"):
    """tests/programs/crash.py runs the script as `python gspo.py` would (or under torchrun), with CRASH injected."""
    env = {k: v for k, v in os.environ.items() if k not in ("CRASH", "CRASH_RANK")}
    if crash:
        env.update(CRASH=crash, CRASH_RANK=str(crash_rank))
    cmd = [sys.executable, "tests/programs/crash.py"] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        "--max-restarts", str(restarts), "tests/programs/crash.py"]
    return subprocess.run([*cmd, script, *ARGS, *extra, "--output-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def result(out):
    """(final weights, logged rows without timings) of the one run under `out`."""
    (run,) = glob.glob(f"{out}/*/metrics.jsonl")
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_rows(run)]
    return checkpoint.master_weights(os.path.join(os.path.dirname(run), "step_6")), rows  # fp32 masters (any layout)


def assert_same(a, b):
    (wa, ra), (wb, rb) = a, b
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert [r["step"] for r in rb] == [0, 1, 2, 3, 4, 5, 6]  # eval at 0, steps 1-6 (6 with Jitter2); no repeats
    assert ra == rb  # rewards, losses, clip fractions, learning rates, evals: every logged number of every step


_straight = {}


def straight(world, tmp_path_factory):
    """The unbroken 6-step run, once per world size."""
    if world not in _straight:
        out = tmp_path_factory.mktemp(f"straight{world}")
        p = launch(out, world=world)
        assert p.returncode == 0, p.stderr[-3000:]
        _straight[world] = result(out)
        weights, rows = _straight[world]
        tok = modeling.tiny_tokenizer()
        init = modeling.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), 1)[0].state_dict()
        assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])
        assert sum(r.get("charts/reward_mean", 0) for r in rows) > 0  # some groups had signal: the runs learn
    return _straight[world]


def tensorboard_steps(out, tag="charts/reward_mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = glob.glob(f"{out}/*/metrics.jsonl")
    acc = EventAccumulator(os.path.dirname(run))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_damaged_newest_checkpoint_is_skipped(tmp_path, tmp_path_factory, monkeypatch):
    """A truncated model.safetensors in the newest checkpoint: --resume of it is one line; --resume auto says why it
    skips it and continues exactly from the one before."""
    p = launch(tmp_path, "--save-every", "2", crash="start:5")
    assert p.returncode == -9  # SIGKILL at the start of step 5, after step_4 was written
    (run,) = glob.glob(f"{tmp_path}/*/")
    assert sorted(n for n in os.listdir(run) if "step" in n) == ["step_2", "step_4"]
    model = f"{run}step_4/state/model.safetensors"  # big files: checked by size
    size = os.path.getsize(model)
    os.truncate(model, size // 2)
    damage = f"state/model.safetensors has {size // 2} bytes, the manifest says {size}"
    assert main_exits(monkeypatch, tmp_path, "--resume", f"{run}step_4") == (
        f"error: --resume {run}step_4: {damage}; resume from another checkpoint (or --resume auto)")

    p = launch(tmp_path, "--save-every", "2", "--resume", "auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"--resume auto: skipping {run}step_4: {damage}\nresuming {run}step_2 (step 2)" in p.stdout, p.stdout
    assert_same(straight(1, tmp_path_factory), result(tmp_path))

    # flags on resume: those that must not change are refused, a new learning rate and more steps take effect
    for flag, new, old in [("--group-size", "4", "8"), ("--clip-low", "0.1", "0.0003"),  # the objective too
                           ("--adv-std", "bessel", "population")]:
        assert main_exits(monkeypatch, tmp_path, "--resume", f"{run}step_6", flag, new) == (
            f"error: {flag} {new} differs from {old} in {run}step_6: it cannot change on resume (the data order, the "
            f"objective, the optimizer state or the weights depend on it); pass {flag} {old} to resume, or start a new "
            "run without --resume")
    p = launch(tmp_path, "--save-every", "2", "--resume", f"{run}step_6", "--num-steps", "8",
               "--learning-rate", "4e-3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "changed on resume, in effect from step 7: --num-steps 6 -> 8, --learning-rate 0.002 -> 0.004" in p.stdout
    rows = [json.loads(line) for line in open(f"{run}metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    factor = lambda i: 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * (i - 8) / (32 - 8)))  # noqa: E731 - 8 x 4 updates
    assert [r["charts/learning_rate"] for r in rows[7:]] == pytest.approx([4e-3 * factor(28), 4e-3 * factor(32)])


def main_exits(monkeypatch, out, *argv):
    """gspo.main() in this process, which must stop before the model loads: its exit code (the error line)."""
    import gspo

    monkeypatch.setattr(gspo, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "argv", ["gspo.py", *ARGS, *argv, "--output-dir", str(out)])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    return e.value.code


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_on_every_rank_and_resume_is_exact(tmp_path, tmp_path_factory):
    """Preemption: SIGTERM to rank 1 alone during step 3; both ranks finish step 3, save it, exit 0."""
    p = launch(tmp_path, world=2, crash="sigterm:3", crash_rank=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SIGTERM: stopping with a checkpoint at the end of this step" in p.stderr
    assert "a stop signal: every rank saves a checkpoint and exits 0 (continue with --resume auto)" in p.stdout
    (run,) = glob.glob(f"{tmp_path}/*/")
    assert sorted(n for n in os.listdir(run) if "step" in n) == ["step_3"]
    assert [json.loads(line)["step"] for line in open(f"{run}metrics.jsonl")] == [0, 1, 2, 3]
    p = launch(tmp_path, "--resume", "auto", world=2)
    assert p.returncode == 0 and f"resuming {run}step_3 (step 3)" in p.stdout, p.stderr[-3000:]
    assert_same(straight(2, tmp_path_factory), result(tmp_path))
    assert tensorboard_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_second_stop_signal_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    checkpoint.release_stop_signals()  # a main() run earlier in this process may have left its handlers
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN in a background job
    checkpoint.catch_stop_signals()
    try:
        assert not checkpoint.stop_requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert checkpoint.stop_requested() and exits == []
        os.kill(os.getpid(), signal.SIGTERM)  # within a second: the same event (torchrun forwards what it gets)
        assert exits == []
        checkpoint._stop["at"] -= 1.0  # a second later
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]
    finally:
        checkpoint.release_stop_signals()
    assert signal.getsignal(signal.SIGINT) is before  # released: the handler from before is back


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, tmp_path_factory):
    p = launch(tmp_path, "--save-every", "2", crash="checkpoint:4")
    assert p.returncode == -9
    (run,) = glob.glob(f"{tmp_path}/*/")
    assert sorted(n for n in os.listdir(run) if "step" in n) == [".tmp_step_4", "step_2"]
    assert open(f"{run}/.tmp_step_4/state/rank0.pt", "rb").read() == b"half an optimizer state"
    assert not checkpoint.is_checkpoint(f"{run}/.tmp_step_4") and checkpoint.is_checkpoint(f"{run}/step_2")
    assert [json.loads(line)["step"] for line in open(f"{run}/metrics.jsonl")][-1] == 4  # logged past the checkpoint
    with open(f"{run}/metrics.jsonl", "a") as f:
        f.write('{"step": 5, "charts/reward_me')  # and a row torn by the kill

    p = launch(tmp_path, "--save-every", "2", "--resume", "auto")
    assert p.returncode == 0 and f"resuming {run}step_2 (step 2)" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"{run}metrics.jsonl: dropped a torn last line (29 characters, not a whole row)" in p.stdout
    assert_same(straight(1, tmp_path_factory), result(tmp_path))  # steps 3-4 were logged twice, kept once
    assert tensorboard_steps(tmp_path) == [1, 2, 3, 4, 5, 6]  # purged at step 3 by the resumed writer
    assert sorted(d for d in os.listdir(run) if "step" in d) == ["step_4", "step_6"]  # --keep-checkpoints 2


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_rank(tmp_path, tmp_path_factory):
    p = launch(tmp_path, "--save-every", "3", "--resume", "auto", world=2, crash="start:4", crash_rank=1, restarts=1)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "starting a fresh run" in p.stdout and "(step 3)" in p.stdout  # the first attempt, then the restart
    assert_same(straight(2, tmp_path_factory), result(tmp_path))


def test_metrics_rows_read_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": NaN}\n{"step": 2, "a": 1}\n{"step": 3, "a"')
    assert runlog.read_metrics(str(path)) == [{"step": 1, "a": None}, {"step": 2, "a": 1}]  # older files: NaN read
    assert runlog.read_metrics(str(path), keep_below=2) == [{"step": 1, "a": None}]
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(distributed.Refused, match="metrics.jsonl line 2 is not JSON: repair or remove that line"):
        runlog.read_metrics(str(path))


def test_one_writer_per_run_folder(tmp_path, monkeypatch):
    """A live writer's lock stops a second one (here two --resume auto of one run) before the model loads, with one
    line naming it; a dead writer's lock is taken over; two fresh runs started in the same second get two folders."""
    import socket

    import gspo

    run = tmp_path / "gspo__1__5"
    ckpt = run / "step_4"
    ckpt.mkdir(parents=True)
    fake_checkpoint(ckpt, step=4, world=1, script="gspo.py")
    holder = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "programs", "lock_holder.py"), "flock",
                               str(run / "writer.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setattr(gspo, "load_model", lambda *a, **k: pytest.fail("a second writer reached the model"))
        monkeypatch.setattr(sys, "argv", ["gspo.py", "--resume", "auto", "--output-dir", str(tmp_path)])
        with pytest.raises(SystemExit) as e:
            gspo.main()
        assert e.value.code == (f"error: {run} is being written by pid {holder.pid} on {socket.gethostname()} (it "
                                f"holds {run}/writer.lock): wait for that run to end, or start another with a "
                                "different --exp-name or --seed")
    finally:
        holder.kill()
        holder.wait()
    d = distributed.Dist(0, 1, torch.device("cpu"))
    assert checkpoint.claim_run_dir(str(run), str(ckpt), d) == str(run)  # the dead writer's lock, taken over
    assert (run / "writer.lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    fresh = str(tmp_path / "gspo__1__1795365514")
    assert checkpoint.claim_run_dir(fresh, None, d) == fresh
    assert checkpoint.claim_run_dir(fresh, None, d) == fresh[:-1] + "5"  # the same name: the next second's folder
    checkpoint.release_run_dir()


def test_resume_errors_before_any_heavy_work(tmp_path, monkeypatch, capsys):
    import gspo

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["gspo.py", *argv, "--output-dir", str(tmp_path)])
        with pytest.raises(SystemExit) as e:
            gspo.main()
        return str(e.value.code)

    assert "not a checkpoint" in main("--resume", str(tmp_path))
    ckpt = tmp_path / "gspo__1__5" / "step_4"
    fake_checkpoint(ckpt, step=4, world=2, script="gspo.py")  # another world size: no refusal (it reshards)
    assert main("--resume", "auto", "--num-steps", "4") == "0"
    fake_checkpoint(ckpt, step=4, world=1, script="dfpo.py")
    assert "written by dfpo.py, not gspo.py" in main("--resume", str(ckpt))
    fake_checkpoint(ckpt, step=4, world=1, script="gspo.py")
    assert main("--resume", str(ckpt), "--num-steps", "4") == "0"
    assert "is at step 4 and --num-steps is 4: nothing to do" in capsys.readouterr().out

    (ckpt / "state" / "rank0.pt").write_bytes(b"0123")
    checkpoint.write_manifest(str(ckpt))
    (ckpt / "state" / "rank0.pt").write_bytes(b"0124")  # damaged in place: same size (a small file: hashed)
    assert main("--resume", str(ckpt)) == (f"error: --resume {ckpt}: state/rank0.pt does not match its sha256 in "
                                           "the manifest; resume from another checkpoint (or --resume auto)")
    (ckpt / "state" / "rank0.pt").unlink()
    assert main("--resume", str(ckpt)).endswith(f"{ckpt}: state/rank0.pt is missing; resume from another "
                                                "checkpoint (or --resume auto)")
    (ckpt / "state" / "trainer_state.json").write_text("{")  # damaged before the manifest was written: one line
    checkpoint.write_manifest(str(ckpt))
    assert main("--resume", str(ckpt)).startswith(f"error: {ckpt}/state/trainer_state.json: cannot read it "
                                                  "(JSONDecodeError")
    (ckpt / "manifest.json").unlink()
    assert main("--resume", str(ckpt)).endswith(f"{ckpt}: no manifest.json (written before manifests, or never "
                                                "completed); resume from another checkpoint (or --resume auto)")
    monkeypatch.setattr(gspo, "load_model", lambda *a, **k: sys.exit("stopped at the model"))
    assert main("--resume", "auto") == "stopped at the model"
    out = capsys.readouterr().out
    assert f"--resume auto: skipping {ckpt}: no manifest.json" in out and "starting a fresh run" in out
    checkpoint.release_run_dir()


def test_resume_from_an_earlier_checkpoint_branches_the_run(tmp_path, monkeypatch, capsys):
    """--resume step_2 of a run that went on to step 4: the new branch's checkpoints, metrics and samples are its own.
    Steps 3 and 4 of the old branch are set aside (not pruned in place of the new ones, never resumed by --resume auto),
    its rows after step 2 are moved from metrics.jsonl and samples.jsonl to the same folder (test_data_loss), a torn
    last samples line dropped."""
    from helpers import run_script

    base = ["--prompts-per-rank", "4", "--save-every", "1", "--log-samples", "1", "--eval-every", "0"]
    _, run = run_script("gspo", [*base, "--num-steps", "4", "--keep-checkpoints", "0"], monkeypatch, tmp_path)
    with open(os.path.join(run, "samples.jsonl"), "a") as f:
        f.write('{"step": 4, "prom')  # a write cut short
    branch = [*base, "--keep-checkpoints", "2", "--learning-rate", "1e-4"]
    rows, _ = run_script("gspo", [*branch, "--num-steps", "3", "--resume", f"{run}/step_2"], monkeypatch, tmp_path)
    (aside,) = glob.glob(f"{run}/abandoned_*")
    assert sorted(p for p in os.listdir(aside) if p.startswith("step_")) == ["step_3", "step_4"]
    assert sorted(p for p in os.listdir(run) if p.startswith("step_")) == ["step_2", "step_3"]  # the newest 2 of its own
    assert checkpoint.read_trainer_state(f"{run}/step_3")["args"]["learning_rate"] == 1e-4
    assert [r["step"] for r in rows] == [1, 2, 3]
    samples = [json.loads(line)["step"] for line in open(os.path.join(run, "samples.jsonl"))]
    assert samples == [1] * 16 + [2] * 16 + [3] * 16
    capsys.readouterr()
    import gspo

    monkeypatch.setattr(sys, "argv", ["gspo.py", *branch, "--num-steps", "4", "--resume", "auto", "--output-dir",
                                      str(tmp_path)])
    gspo.main()
    assert f"resuming {run}/step_3 (step 3)" in capsys.readouterr().out
    assert [r["step"] for r in runlog.read_metrics(f"{run}/metrics.jsonl")] == [1, 2, 3, 4]


def test_full_disk_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1 alone gets ENOSPC writing its part of step_2: every rank stops, rank 0 prints the one line, the partial
    folder is gone and step_1 is intact (the single-process test in test_checkpoint.py resumes after it)."""
    p = launch(tmp_path, "--num-steps", "2", "--save-every", "1", "--eval-every", "0", world=2, crash="nospace:2",
               crash_rank=1)
    (run,) = glob.glob(f"{tmp_path}/*/")
    errors = [line[line.index("error: "):] for line in p.stderr.splitlines() if "error: " in line]  # after tqdm's bar
    mount = os.path.abspath(run)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    assert p.returncode == 1 and len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith(f"error: no space left on the disk mounted at {mount} (") and errors[0].endswith(
        f"GiB free) while writing {run}.tmp_step_2 (removed): free space there, then continue with --resume auto from "
        "the previous checkpoint")
    assert sorted(n for n in os.listdir(run) if "step" in n) == ["step_1"] and checkpoint.is_checkpoint(f"{run}step_1")


def test_reshard_rows_takes_fsdp2_chunks():
    """The rows a rank of a new world size holds, from the old ranks' shards (torch.chunk along dim 0, as FSDP2's
    Shard(0) lays them out, the last old rank empty when the rows run out), equal those rows of the full tensor."""
    full = torch.randn(5, 3)
    for old in (1, 2, 4):  # 4 ranks of 5 rows: chunks 2, 2, 1 and an empty one
        shards = list(torch.chunk(full, old))
        shards += [full[:0]] * (old - len(shards))
        for new in (1, 2, 3, 4, 8):
            c = -(-5 // new)
            for r in range(new):
                start = min(r * c, 5)
                length = min(c, 5 - start)
                got = checkpoint.reshard_rows(shards, start, length)
                assert torch.equal(got, full[start:start + length]), (old, new, r)
                assert got.data_ptr() != full.data_ptr()  # a copy, not a view of the (memory-mapped) shards


def test_one_process_resumes_two_ranks_optimizer_shards(tmp_path, capsys):
    """rank0.pt and rank1.pt of a 2-rank checkpoint (uneven shards: 5 rows as 3 + 2), resumed by one process: AdamW's
    moments are the shards concatenated, the step count and the lr are restored, and the RNG is re-seeded from
    (seed, step, rank), said in one line."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 5)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    lin(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    sched.step()
    ckpt = tmp_path / "run" / "step_6"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "state" / "trainer_state.json").write_text(json.dumps({"step": 6, "world": 2, "script": "gspo.py",
                                                                   "args": {"seed": 11}}))
    full = opt.state_dict()
    for r in range(2):
        part = {i: {k: v if v.dim() == 0 else torch.chunk(v, 2)[r].clone() for k, v in s.items()}
                for i, s in full["state"].items()}
        torch.save({"optimizer": {**full, "state": part}, "scheduler": sched.state_dict(), "rng": None},
                   ckpt / "state" / f"rank{r}.pt")
    lin2 = torch.nn.Linear(3, 5)
    opt2 = torch.optim.AdamW(lin2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda i: 0.5 ** i)
    d = distributed.Dist(0, 1, torch.device("cpu"))
    assert checkpoint.resume_state(str(ckpt), opt2, sched2, d)["step"] == 6
    draw = torch.rand(4)
    distributed.seed_rank(11 + 6, d)
    assert torch.equal(draw, torch.rand(4))
    out = capsys.readouterr().out
    assert f"{ckpt} was written by 2 rank(s), this run has 1: the optimizer state is resharded" in out
    for p, q in zip(lin.parameters(), lin2.parameters()):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k]), k
    assert opt2.param_groups[0]["lr"] == 1e-2 * 0.5


def test_resume_on_another_world_size_under_torchrun(tmp_path):
    """2 ranks -> 1 -> 2 under torchrun (FSDP2, gloo), with odd dim-0 sizes (FSDP2's uneven chunks): after each
    resume the gathered weights and AdamW moments equal those the writer gathered, bitwise, and the fixed batch's
    loss the writer computed, to float tolerance; one more step trains with a finite loss
    (tests/programs/reshard.py)."""
    def run(world, *argv):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(world), "tests/programs/reshard.py", str(tmp_path), *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        return p.stdout

    run(2, "save")
    # the master weights: each rank wrote its own rows (FSDP2's chunks: 64 + 63 of the 127-wide norms), nothing whole
    state = tmp_path / "run" / "step_2" / "state"
    assert not (state / "model.safetensors").exists()
    with safe_open(state / "masters_rank0.safetensors", "pt") as r0, safe_open(state / "masters_rank1.safetensors",
                                                                                  "pt") as r1:
        assert r0.get_slice("model.norm.weight").get_shape() == [64]
        assert r1.get_slice("model.norm.weight").get_shape() == [63]
    # plain python (no torchrun, no FSDP2) puts the ranks' rows together: the weights the writer gathered, bitwise
    ref = torch.load(tmp_path / "ref_2.pt", weights_only=True)["weights"]
    lm, _ = modeling.load_model(str(tmp_path / "run" / "step_2"), modeling.tiny_tokenizer(),
                              distributed.Dist(0, 1, torch.device("cpu")), seed=0)
    got = lm.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert [n for n, _ in lm.named_buffers()] and all(b.isfinite().all() for b in lm.buffers())
    # the state folder as a LoRA base: one line (its export is the base to give), not a from_pretrained traceback
    from grouprl import lora

    with pytest.raises(SystemExit, match=r"cannot be a LoRA base; give its export, step_N/model$"):
        modeling.load_model(str(state), modeling.tiny_tokenizer(), distributed.Dist(0, 1, torch.device("cpu")), seed=0,
                          lora=lora.LoraSpec(4, 8.0, 0.0, (lora.ALL_LINEAR,)))
    assert "resharded resume OK on 1 rank(s)" in run(1, "load", f"{tmp_path}/run/step_2", "3")
    assert "resharded resume OK on 2 rank(s)" in run(2, "load", f"{tmp_path}/run/step_3", "4")


# -------------------- issue 61: what a plain --resume takes from the checkpoint
def resumed(ckpt, *argv):
    """gspo's flags for `gspo.py --resume ckpt argv`, the defaults filled in, as its main() sees them."""
    import gspo
    from grouprl.cli import fill_defaults, parse_args

    return fill_defaults(parse_args(gspo.Args, ["--resume", str(ckpt), *argv]))


def test_a_plain_resume_derives_a_derived_default_again(tmp_path):
    """Issue 61 1(e): --eval-max-new-tokens left out was filled in from --max-new-tokens (2) and saved; a plain
    --resume --max-new-tokens 6 evaluated at 2 (as --resume auto does not). Derived again, unless the run gave it."""
    ckpt = tmp_path / "gspo__1__5" / "step_1"
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"max_new_tokens": 2, "eval_max_new_tokens": 2})
    assert resumed(ckpt, "--max-new-tokens", "6").eval_max_new_tokens == 6
    assert resumed(ckpt).eval_max_new_tokens == 2 and resumed(ckpt).max_new_tokens == 2
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"max_new_tokens": 2, "eval_max_new_tokens": 3})
    assert resumed(ckpt, "--max-new-tokens", "6").eval_max_new_tokens == 3  # given: kept


def test_a_plain_resume_restating_one_reward_drops_the_others_weights(tmp_path):
    """Issue 61 1(o): a run of two --reward with --reward-weights 1 0.5, resumed restating one --reward, failed with
    "2 weight(s) for 1 reward(s)" (the saved weights taken for the new list). Weights go with their list."""
    ckpt = tmp_path / "gspo__1__5" / "step_1"
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py",
                    args={"reward": ["rw:a", "rw:b"], "reward_weights": [1.0, 0.5]})
    one = resumed(ckpt, "--reward", "rw:a")
    assert list(one.reward) == ["rw:a"] and list(one.reward_weights) == []
    assert list(resumed(ckpt).reward_weights) == [1.0, 0.5]
    assert list(resumed(ckpt, "--reward", "rw:a", "--reward", "rw:b").reward_weights) == [1.0, 0.5]


def test_a_plain_resume_writes_where_it_says(tmp_path, monkeypatch, capsys):
    """Issue 61 1(n): a plain --resume without --output-dir reported `--output-dir <original> -> runs` as a change,
    printed `tensorboard --logdir runs` and saved `runs` while it wrote to the checkpoint's folder. --output-dir is
    the folder that holds the checkpoint's run: as the run said it when that is the same folder."""
    import gspo

    runs = tmp_path / "runs"
    ckpt = runs / "gspo__1__5" / "step_1"
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"output_dir": str(runs)})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resumed(ckpt).output_dir == str(runs)
    monkeypatch.setattr(gspo, "load_model", lambda *a, **k: sys.exit("stopped at the model"))
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--resume", str(ckpt), "--num-steps", "3"])
    with pytest.raises(SystemExit, match="stopped at the model"):
        gspo.main()
    checkpoint.release_run_dir()
    assert "--output-dir" not in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)  # relative, from the folder the run started in: as it was
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"output_dir": "runs"})
    assert resumed("runs/gspo__1__5/step_1").output_dir == "runs"
    os.rename(runs, tmp_path / "moved")  # the run moved: where it is now
    assert resumed(tmp_path / "moved" / "gspo__1__5" / "step_1").output_dir == str(tmp_path / "moved")


def test_a_relative_dataset_resumed_from_another_folder(tmp_path, monkeypatch):
    """Issue 61 1(m): a run started with a relative --dataset could not be resumed from another folder, and the
    message did not say the path came from the checkpoint; given as an absolute path, it "differed". The path is found
    from the folder the run started in; where it cannot be, the line says it came from the checkpoint."""
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    ckpt = tmp_path / "runs" / "gspo__1__5" / "step_1"
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"dataset": "data.jsonl", "output_dir": "runs"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resumed(ckpt).dataset == str(tmp_path / "data.jsonl")
    d = distributed.Dist(0, 1, torch.device("cpu"))
    for given in (resumed(ckpt), resumed(ckpt, "--dataset", str(tmp_path / "data.jsonl"))):
        run_dir, _ = checkpoint.run_paths(dataclasses.replace(given, num_steps=3), d, "gspo.py")
        assert run_dir == str(ckpt.parent)
    with pytest.raises(SystemExit, match="differs from data.jsonl"):
        checkpoint.run_paths(resumed(ckpt, "--dataset", str(tmp_path / "elsewhere" / "x.jsonl"), "--num-steps", "3"),
                             d, "gspo.py")
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={"dataset": "data.jsonl", "output_dir": "/abs"})
    with pytest.raises(SystemExit) as e:
        resumed(ckpt)
    assert e.value.code == (f"error: --dataset 'data.jsonl' comes from the checkpoint {ckpt}'s saved flags, a path "
                            "relative to the folder the run was started in, and is not found from "
                            f"{tmp_path / 'elsewhere'}: resume from that folder, or give --dataset with its path from "
                            "here")
