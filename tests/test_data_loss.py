"""Issue 38's data-loss failures, each a test that failed before its fix: --resume auto taking over another
experiment's run, a folder of mixed formats read in part, branching deleting the later logs, a checkpoint half
deleted by a kill while pruning left for good."""
import glob
import json
import os
import sys

import pytest

from grouprl import checkpoint
from helpers import fake_checkpoint


def gspo_main(monkeypatch, out, *argv):
    """gspo.main() in this process, stopped where the model would load: its exit code (or error line)."""
    import gspo

    monkeypatch.setattr(gspo, "load_model", lambda *a, **k: sys.exit("stopped at the model"))
    monkeypatch.setattr(sys, "argv", ["gspo.py", *argv, "--output-dir", str(out)])
    try:
        with pytest.raises(SystemExit) as e:
            gspo.main()
    finally:
        checkpoint.release_run_dir()
    return str(e.value.code)


# -------------------- 1. --resume auto takes only its own runs
def test_resume_auto_never_takes_another_experiments_run(tmp_path, monkeypatch, capsys):
    """x__1__1__<t> is --exp-name x__1's run (seed 1), not a run of --exp-name x with --seed 1: --resume auto for x
    starts a fresh run beside it and leaves its folder alone; it takes x__1__<t> (its own) when there is one."""
    other = tmp_path / "x__1__1__1700000000"
    fake_checkpoint(other / "step_4", step=4, world=1, script="gspo.py", args={"seed": 1, "exp_name": "x__1"})
    (other / "args.json").write_text('{"exp_name": "x__1"}')
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    assert gspo_main(monkeypatch, tmp_path, "--exp-name", "x", "--resume", "auto") == "stopped at the model"
    out = capsys.readouterr().out
    assert "resuming" not in out and "no checkpoint of x__1__<time> under" in out, out
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    assert (other / "args.json").read_text() == '{"exp_name": "x__1"}'
    fresh = [p for p in os.listdir(tmp_path) if p != other.name]
    assert len(fresh) == 1 and fresh[0].startswith("x__1__") and fresh[0].count("__") == 2

    own = tmp_path / "x__1__1600000000"  # x's own run (older): taken, and not the other experiment's newer one
    fake_checkpoint(own / "step_2", step=2, world=1, script="gspo.py", args={"seed": 1, "exp_name": "x"})
    assert gspo_main(monkeypatch, tmp_path, "--exp-name", "x", "--resume", "auto") == "stopped at the model"
    assert f"resuming {own}/step_2 (step 2)" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["x__1", "run__0", "a__b__12"])
def test_an_exp_name_ending_in_a_seed_like_number_is_refused(name, monkeypatch, tmp_path):
    """--exp-name x__1 names folders x__1__<seed>__<time>, which start as --exp-name x --seed 1's x__1__<time> do:
    refused in one line before anything is read."""
    from helpers import fails_before_any_model

    fails_before_any_model("gspo", ["--exp-name", name], f"--exp-name {name!r} ends in '__' and a number", monkeypatch,
                           tmp_path)


@pytest.mark.parametrize("name", ["x_1", "x__v1", "x__1a", "x__", "gspo"])
def test_other_exp_names_are_fine(name):
    from grouprl import cli

    cli.check_run_name("runs", name)  # no error


# -------------------- 2. a folder of several formats
def write_rows(path, n, fmt):
    rows = [{"prompt": f"{path.stem} {i}%10=", "answer": str(i % 10)} for i in range(n)]
    if fmt == "csv":
        path.write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_folder_of_mixed_formats_is_refused_in_one_line(tmp_path, monkeypatch):
    """a.jsonl and b.csv (20 rows each): `datasets` read one format's files and dropped the other's, silently (18
    train + 2 held out, "dropped: 0"); now one line names the formats found, before anything is read."""
    from helpers import fails_before_any_model

    mix = tmp_path / "mixdir"
    mix.mkdir()
    write_rows(mix / "a.jsonl", 20, "json")
    write_rows(mix / "b.csv", 20, "csv")
    fails_before_any_model("gspo", ["--dataset", f"{mix}/"], "files of several formats (csv: b.csv; json: a.jsonl)",
                           monkeypatch, tmp_path)
    from grouprl import data

    with pytest.raises(SystemExit) as e:  # the same line from read_files (load_task's callers that skip the checks)
        data.read_files("--dataset", str(mix))
    assert "files of several formats (csv: b.csv; json: a.jsonl)" in str(e.value.code)


def test_a_folder_of_one_format_reads_every_file(tmp_path):
    """.json and .jsonl are one format (`datasets`' json builder): every row of both is read."""
    from grouprl import data
    from grouprl import modeling

    one = tmp_path / "onedir"
    one.mkdir()
    write_rows(one / "a.jsonl", 20, "json")
    (one / "b.json").write_text(json.dumps([{"prompt": f"b {i}%10=", "answer": str(i)} for i in range(7)]))
    (one / "README.md").write_text("notes on the data")  # a dataset card, not data
    train, held, dropped = data.load_task(data.Task(str(one), None, 3, 0, max_prompt_tokens=100),
                                          modeling.tiny_tokenizer())
    assert len(train) + len(held) == 27 and dropped == {"no_answer": 0, "too_long": 0}


def test_a_folders_test_file_is_its_held_out_split(tmp_path):
    """train.jsonl and test.jsonl: `datasets` reads them as two splits, of which test's rows were dropped (silently,
    a tenth of train held out instead); now test.jsonl is held out, as a hub set's test split is."""
    from grouprl import data
    from grouprl import modeling

    tt = tmp_path / "ttdir"
    tt.mkdir()
    write_rows(tt / "train", 20, "json")
    os.rename(tt / "train", tt / "train.jsonl")
    (tt / "test.jsonl").write_text("".join(json.dumps({"prompt": f"t {i}%10=", "answer": str(i)}) + "\n"
                                           for i in range(5)))
    train, held, dropped = data.load_task(data.Task(str(tt), None, 8, 0, max_prompt_tokens=100),
                                          modeling.tiny_tokenizer())
    assert (len(train), len(held)) == (20, 5) and all(p.startswith("t ") for p in held["prompt"])


# -------------------- 3. branching sets the later rows aside with the later checkpoints
def rows_of(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def scalars(folder, tag="charts/reward_mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def test_branching_and_skipping_set_the_later_rows_aside(tmp_path, monkeypatch, capsys):
    """--resume auto skipping a damaged step_4, then --resume step_2 of the run that went on to step 4: the later
    checkpoints go to abandoned_<time>/ (as before) and with them, each time, the metrics.jsonl and samples.jsonl
    rows of their steps and the tensorboard event files that hold them (they were deleted: dropped from the files,
    purged from tensorboard); the run folder keeps only its own branch's rows."""
    from helpers import run_script

    base = ["--prompts-per-rank", "4", "--save-every", "1", "--log-samples", "1", "--eval-every", "0",
            "--keep-checkpoints", "0", "--num-steps", "4"]
    _, run = run_script("gspo", base, monkeypatch, tmp_path)
    first, first_samples = rows_of(f"{run}/metrics.jsonl"), rows_of(f"{run}/samples.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    model = f"{run}/step_4/state/model.safetensors"
    os.truncate(model, os.path.getsize(model) // 2)

    run_script("gspo", [*base, "--resume", "auto"], monkeypatch, tmp_path)
    assert f"--resume auto: skipping {run}/step_4" in capsys.readouterr().out
    (skipped,) = glob.glob(f"{run}/abandoned_*")
    assert rows_of(f"{skipped}/metrics.jsonl") == first[3:]
    assert rows_of(f"{skipped}/samples.jsonl") == [r for r in first_samples if r["step"] == 4]
    assert scalars(skipped)[4] == pytest.approx(first[3]["charts/reward_mean"])
    second = rows_of(f"{run}/metrics.jsonl")

    rows, _ = run_script("gspo", [*base, "--num-steps", "3", "--learning-rate", "1e-4", "--resume", f"{run}/step_2"],
                         monkeypatch, tmp_path)
    (branched,) = set(glob.glob(f"{run}/abandoned_*")) - {skipped}
    assert sorted(p for p in os.listdir(branched) if p.startswith("step_")) == ["step_3", "step_4"]
    assert rows_of(f"{branched}/metrics.jsonl") == second[2:]
    assert [r["step"] for r in rows_of(f"{branched}/samples.jsonl")] == [3] * 16 + [4] * 16
    old = scalars(branched)
    assert {s: old[s] for s in (3, 4)} == pytest.approx({r["step"]: r["charts/reward_mean"] for r in second[2:]})
    assert [r["step"] for r in rows] == [1, 2, 3] and scalars(run).keys() == {1, 2, 3}  # this branch's own
    assert [r["step"] for r in rows_of(f"{run}/samples.jsonl")] == [1] * 16 + [2] * 16 + [3] * 16


def test_a_branch_before_a_finished_runs_end_keeps_its_final_and_rows(tmp_path, monkeypatch, capsys):
    """Issue 61 1(a): a run finished with --save-final model (step_2, and final/ at step 4), then the same command at
    --num-steps 6 and another --learning-rate with --resume auto: the branch from step_2 moves the finished run's
    final/ and its rows of steps 3-4 to abandoned_<time>/ and says so (they were replaced and overwritten in place,
    no copy kept); the branch's own final/ is its step 6."""
    from helpers import run_script

    s = ["--prompts-per-rank", "4", "--group-size", "4", "--num-minibatches", "1", "--eval-every", "0",
         "--save-every", "2", "--save-final", "model"]
    _, run = run_script("gspo", [*s, "--num-steps", "4"], monkeypatch, tmp_path)
    first = rows_of(f"{run}/metrics.jsonl")
    weights = f"{run}/final/model/model.safetensors"
    old = open(weights, "rb").read()
    capsys.readouterr()
    rows, _ = run_script("gspo", [*s, "--num-steps", "6", "--learning-rate", "1e-3", "--resume", "auto"], monkeypatch,
                         tmp_path)
    out = capsys.readouterr().out
    (aside,) = glob.glob(f"{run}/abandoned_*")
    assert open(f"{aside}/final/model/model.safetensors", "rb").read() == old
    assert rows_of(f"{aside}/metrics.jsonl") == first[2:]
    assert (f"the later checkpoints of the run that went on from it (final), with the metrics.jsonl rows after step 2 "
            f"and the tensorboard event files, are moved to {aside}") in out
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[:2] == first[:2]
    assert open(weights, "rb").read() != old  # this branch's step 6


def test_a_final_folder_found_in_the_way_is_kept(tmp_path, capsys):
    """A final/ already in the run folder when --save-final model writes its own (not the run's: a branch sets that
    aside) is kept as kept_final_<time>, never deleted."""
    from grouprl.checkpoint import save

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "x").write_text("theirs")
    (run / ".tmp_final").mkdir()
    save._swap_in(str(run / ".tmp_final"), str(run / "final"))
    (kept,) = glob.glob(f"{run}/kept_final_*")
    assert open(f"{kept}/x").read() == "theirs" and f"the earlier one is kept as {kept}" in capsys.readouterr().out
    assert os.listdir(run / "final") == []


# -------------------- 4. a kill while pruning
class Killed(BaseException):
    """A kill -9 of the process at this point, in this process: nothing after it runs."""


def test_a_checkpoint_half_deleted_by_a_kill_while_pruning_is_removed_later(tmp_path, monkeypatch, capsys):
    """A kill while --keep-checkpoints 2 deletes step_2 (its manifest and weights gone, the rest not): the next run
    finishes that removal, and its own pruning leaves exactly the newest 2 checkpoints. Before, the half-deleted
    step_2 had no manifest, so it was no checkpoint to prune, and stayed for good. A step_N folder without a
    manifest that no prune started (a checkpoint written before manifests, or being copied in) is left alone."""
    import shutil

    from helpers import run_script

    real = shutil.rmtree

    def killed_while_removing_step_2(path, *a, **k):
        if str(path).endswith("step_2") and ".tmp_" not in str(path):
            os.remove(os.path.join(path, checkpoint.MANIFEST))
            real(os.path.join(path, "model"))
            raise Killed
        return real(path, *a, **k)

    base = ["--prompts-per-rank", "4", "--save-every", "1", "--log-samples", "0", "--eval-every", "0",
            "--keep-checkpoints", "2"]
    monkeypatch.setattr(shutil, "rmtree", killed_while_removing_step_2)
    with pytest.raises(Killed):
        run_script("gspo", [*base, "--num-steps", "6"], monkeypatch, tmp_path)  # killed in step 4's save
    checkpoint.release_run_dir()
    checkpoint.release_stop_signals()
    monkeypatch.setattr(shutil, "rmtree", real)
    (run,) = glob.glob(f"{tmp_path}/gspo__*")
    left = sorted(p for p in os.listdir(run) if "step_" in p)
    assert "step_3" in left and "step_4" in left and len(left) == 3, left  # step_2, or what its removal renamed
    foreign = os.path.join(run, "step_0")
    os.makedirs(os.path.join(foreign, "model"))  # no manifest: never pruned
    capsys.readouterr()

    run_script("gspo", [*base, "--num-steps", "6", "--resume", "auto"], monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert sorted(p for p in os.listdir(run) if "step_" in p) == ["step_0", "step_5", "step_6"]
    assert "step_0 has no manifest.json" in out, out


# -------------------- issue 54 (a): a run folder replaced under the run's feet
def test_a_run_folder_replaced_mid_run_stops_the_run_in_one_line(tmp_path):
    """`mv R R.old; mkdir R` while a run writes R: before, its rows went on into R.old (its open metrics.jsonl) and
    its checkpoints into the new R, which no lock held, so a --resume auto started then became a second writer.
    The lock is the folder's identity: the next row or save stops the run with one line naming where its folder is
    now, and nothing is written into the new R; a second run can lock the new R."""
    import torch

    from grouprl import runlog
    from grouprl import distributed

    run = tmp_path / "gspo__1__1700000000"
    dist_env = distributed.Dist(0, 1, torch.device("cpu"))
    checkpoint.claim_run_dir(str(run), None, dist_env)
    import argparse

    logger = runlog.Logger(str(run), dist_env, argparse.Namespace(seed=1))
    try:
        logger.log(1, {"charts/reward_mean": 0.5})
        logger.writer.flush()  # tensorboard's thread has written step 1 (in a run: long before the next step)
        os.rename(run, f"{run}.old")
        os.mkdir(run)
        line = checkpoint._attempt(lambda: os.makedirs(run / ".tmp_step_2"), str(run / ".tmp_step_2"))
        assert line.startswith(f"the run folder {run} was replaced while the run wrote it")
        with pytest.raises(SystemExit) as e:
            logger.log(2, {"charts/reward_mean": 0.5})
        assert str(e.value) == (
            f"error: the run folder {run} was replaced while the run wrote it (moved away and another made under its "
            f"name) while writing {run}/metrics.jsonl: this run stops so that no two runs mix in one folder; its rows "
            f"and checkpoints are in the folder it locked (it is now {run}.old): move it back and continue with "
            "--resume auto")
        # nothing in the new folder, and it is not removed as the run's unused fresh folder
        assert os.listdir(run) == [] and [r["step"] for r in rows_of(f"{run}.old/metrics.jsonl")] == [1]
    finally:
        logger.writer.close()
        checkpoint.release_run_dir()
    checkpoint.claim_run_dir(str(run), "x/step_0", dist_env)  # the new folder: free to lock
    checkpoint.release_run_dir()


# -------------------- issue 54 (b): a plain --resume continues the run as it was
def test_a_plain_resume_takes_the_runs_flags_and_prunes_nothing(tmp_path, monkeypatch, capsys):
    """A run of --keep-checkpoints 0 --save-every 1, resumed by a plain --resume step_3: before, the flags it did not
    restate went back to their defaults (--keep-checkpoints 2) and the resumed run deleted step_1 and step_2. Now
    every flag not restated is the run's own (--num-steps 4, --keep-checkpoints 0, ...); a restated one is this
    run's, and said."""
    from helpers import run_script

    base = ["--prompts-per-rank", "4", "--save-every", "1", "--log-samples", "0", "--eval-every", "0",
            "--keep-checkpoints", "0", "--num-steps", "4", "--learning-rate", "1e-3"]
    _, run = run_script("gspo", base, monkeypatch, tmp_path)
    capsys.readouterr()
    rows, _ = run_script("gspo", ["--resume", f"{run}/step_3"], monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert "changed on resume" not in out and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sorted(p for p in os.listdir(run) if p.startswith("step_")) == ["step_1", "step_2", "step_3", "step_4"]
    (aside,) = glob.glob(f"{run}/abandoned_*")  # the first step_4: set aside, as a branch's later checkpoints are
    assert os.listdir(aside) == ["step_4"] or sorted(os.listdir(aside))[-1] == "step_4"
    saved = checkpoint.read_trainer_state(f"{run}/step_4")["args"]
    assert (saved["keep_checkpoints"], saved["prompts_per_rank"], saved["learning_rate"]) == (0, 4, 1e-3)
    run_script("gspo", ["--resume", f"{run}/step_3", "--num-steps", "5", "--keep-checkpoints", "3"], monkeypatch,
               tmp_path)
    assert "changed on resume, in effect from step 4: --num-steps 4 -> 5, --keep-checkpoints 0 -> 3" in \
        capsys.readouterr().out
    assert sorted(p for p in os.listdir(run) if p.startswith("step_")) == ["step_3", "step_4", "step_5"]


def test_restated_flags_are_read_in_every_spelling():
    names = {"keep_checkpoints", "symmetric_clip", "learning_rate", "resume"}
    argv = ["--keep-checkpoints=3", "--no-symmetric-clip", "--learning_rate", "1e-3", "--resume", "x/step_3", "5"]
    assert checkpoint.restated(argv, names) == names


# -------------------- issue 54 (c): an edited trainer_state.json
@pytest.mark.parametrize("field, value, said", [
    ("step", -1, "step is -1, not a whole number >= 0"),
    ("step", 2, "step is 2, not 3 as its folder step_3 says"),
    ("step", "3", "step is '3', not a whole number >= 0"),
    ("step", True, "step is True, not a whole number >= 0"),
    ("world", 0, "world is 0, not a whole number >= 1"),
    ("world", [2], "world is [2], not a whole number >= 1"),
    ("script", 7, "script is 7, not a script's file name"),
    ("args", [], "args is [], not the run's flags by name"),
    ("reward_curve", ["a"], "reward_curve is ['a'], not a list of rewards"),
    ("nonfinite_run", -2, "nonfinite_run is -2, not a whole number >= 0"),
    ("wall_time", "NaN", "wall_time is 'NaN', not seconds >= 0"),
])
def test_an_edited_trainer_state_is_one_line_before_any_model(field, value, said, tmp_path, monkeypatch):
    """trainer_state.json edited (its manifest re-hashed): step -1 resumed "(step -1)" and wrote over step_1-3 in
    place; wrong types were tracebacks. Every field's type and range, and the step its folder names, are checked."""
    from helpers import fake_checkpoint

    ckpt = tmp_path / "gspo__1__1700000000" / "step_3"
    state = dict(step=3, world=1, script="gspo.py", args={}, reward_curve=[0.5, 0.5, None], nonfinite_run=0,
                 wall_time=1.5)
    fake_checkpoint(ckpt, **{**state, field: value})
    path = ckpt / "state" / "trainer_state.json"
    assert gspo_main(monkeypatch, tmp_path, "--resume", str(ckpt)) == (
        f"error: {path}: {said}: the file was edited or damaged; resume from another checkpoint")


def test_a_save_never_writes_over_a_step_it_did_not_write(tmp_path, monkeypatch, capsys):
    """A step_N already there when the run saves its own step N (a copy put there mid-run, a step_N without a manifest
    that resume leaves alone, an edited trainer_state) is kept as kept_step_N_<time>, never deleted."""
    from helpers import run_script

    write = checkpoint.write_training_state

    def copy_put_there(folder, *args):
        theirs = os.path.join(os.path.dirname(os.path.dirname(folder)), "step_2")
        if folder.endswith(".tmp_step_2/state") and not os.path.exists(theirs):
            os.makedirs(theirs)
            open(os.path.join(theirs, "x"), "w").write("theirs")
        return write(folder, *args)

    monkeypatch.setattr(checkpoint.save, "write_training_state", copy_put_there)
    _, run = run_script("gspo", ["--prompts-per-rank", "4", "--save-every", "1", "--log-samples", "0",
                                 "--eval-every", "0", "--num-steps", "2"], monkeypatch, tmp_path)
    (kept,) = glob.glob(f"{run}/kept_step_2_*")
    assert open(f"{kept}/x").read() == "theirs" and f"the earlier one is kept as {kept}" in capsys.readouterr().out
    assert checkpoint.is_checkpoint(f"{run}/step_2")


# -------------------- issue 54: contaminated evaluation
def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_repeated_prompts_are_held_out_whole(tmp_path, capsys):
    """3 distinct prompts x 20 rows: split by row, "54 train / 6 held-out" held out copies of training rows. Now a
    tenth of the distinct prompts (here 1) is held out, one row, and none of its 20 copies is trained on; said in
    the held-out line."""
    from grouprl import data
    from grouprl import modeling

    path = jsonl(tmp_path / "dup.jsonl", [{"prompt": f"{i}%10=", "answer": str(i)} for i in range(3)] * 20)
    train, held, _ = data.load_task(data.Task(path, None, 8, 0, max_prompt_tokens=100), modeling.tiny_tokenizer())
    assert (len(train), len(held)) == (40, 1) and not set(held["prompt"]) & set(train["prompt"])
    assert ("held out: 1 of the distinct prompts of --dataset " f"{path} kept apart, one row each, none of their "
            "copies trained on (its 60 rows repeat prompts;") in capsys.readouterr().out
    one = jsonl(tmp_path / "one.jsonl", [{"prompt": "1%10=", "answer": "1"}] * 5)
    with pytest.raises(SystemExit, match="its 5 rows hold 1 distinct prompt; it needs at least 2"):
        data.load_task(data.Task(one, None, 8, 0, max_prompt_tokens=100), modeling.tiny_tokenizer())


def test_distinct_prompts_split_as_before(tmp_path):
    """Without repeated prompts the split is the row split it was (the same rows, the same order)."""
    from datasets import Dataset

    from grouprl import data
    from grouprl import modeling

    rows = [{"prompt": f"q {i}%10=", "answer": str(i % 10)} for i in range(40)]
    train, held, _ = data.load_task(data.Task(jsonl(tmp_path / "d.jsonl", rows), None, 8, 3, max_prompt_tokens=100),
                                    modeling.tiny_tokenizer())
    want = Dataset.from_list(rows).train_test_split(test_size=4, seed=3)
    assert (train["prompt"], held["prompt"]) == (want["train"]["prompt"], want["test"]["prompt"])


def test_held_out_prompts_are_never_trained_on(tmp_path, capsys, monkeypatch):
    """--eval-dataset equal to --dataset gave "40 train / 40 held-out": one line, before any model. A test split
    sharing 2 prompts with train: those training rows are left out, and said."""
    from grouprl import data
    from grouprl import modeling

    from helpers import fails_before_any_model

    rows = [{"prompt": f"q {i}%10=", "answer": str(i % 10)} for i in range(40)]
    path = jsonl(tmp_path / "forty.jsonl", rows)
    fails_before_any_model("gspo", ["--dataset", path, "--eval-dataset", path], f"--dataset {path!r}: every training "
                           "prompt is also a held-out prompt of --eval-dataset (the same data twice?)", monkeypatch,
                           tmp_path)
    folder = tmp_path / "tt"
    folder.mkdir()
    jsonl(folder / "train.jsonl", rows[:20])
    jsonl(folder / "test.jsonl", rows[18:25])
    capsys.readouterr()
    train, held, _ = data.load_task(data.Task(str(folder), None, 8, 0, max_prompt_tokens=100),
                                    modeling.tiny_tokenizer())
    assert (len(train), len(held)) == (18, 7) and not set(held["prompt"]) & set(train["prompt"])
    assert (f"--dataset {folder}: 2 of its 20 training rows have a prompt its split 'test' holds out: not trained "
            "on, so that the evaluation is held out") in capsys.readouterr().out
