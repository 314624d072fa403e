"""The checkpoint folder at real size and its failure modes (issue 27): a shippable bf16 export beside the training
state, integrity from sizes and small files' hashes (no rereading of big files), files a user adds, a full disk, and
one writer per run folder whatever happens to writer.lock."""
import errno
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from grouprl import checkpoint
from grouprl import distributed
from conftest import ROOT, SCRIPTS
from helpers import run_script, SHORT

D = distributed.Dist(0, 1, torch.device("cpu"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 1-step run's checkpoint (the tiny model), shared by the read-only tests below."""
    out = tmp_path_factory.mktemp("saved")
    mp = pytest.MonkeyPatch()
    try:
        _, run = run_script("gspo", [*SHORT, "--num-steps", "1"], mp, out)
    finally:
        mp.undo()
    return os.path.join(run, "step_1")


def test_export_is_bf16_and_loads_with_from_pretrained_and_pipeline(saved):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    assert sorted(os.listdir(saved)) == ["manifest.json", "model", "state"]
    assert sorted(os.listdir(f"{saved}/state")) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "rank0.pt", "trainer_state.json"]
    master = load_file(f"{saved}/state/model.safetensors")
    export = load_file(f"{saved}/model/model.safetensors")
    assert export.keys() == master.keys() and "lm_head.weight" not in export  # tied: saved once, as HF does
    assert all(master[k].dtype == torch.float32 and torch.equal(export[k], master[k].to(torch.bfloat16))
               for k in master)  # the master weights rounded to bf16, nothing else
    lm = AutoModelForCausalLM.from_pretrained(f"{saved}/model")
    assert lm.dtype == torch.bfloat16  # config.json says so: the export loads in its own dtype
    tok = AutoTokenizer.from_pretrained(f"{saved}/model")
    assert tok.chat_template and tok.eos_token_id in [lm.generation_config.eos_token_id]
    out = pipeline("text-generation", model=f"{saved}/model")([{"role": "user", "content": "3%10="}],
                                                               max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"][-1]["role"] == "assistant"


def test_big_files_are_checked_by_size_only(saved, tmp_path, monkeypatch):
    """Files of HASH_BELOW bytes or more get no sha256 at save, and are not reread at resume: truncation is caught,
    a same-size change inside is not (the README says so). Small files keep their hash."""
    import shutil

    ckpt = tmp_path / "step_1"
    shutil.copytree(saved, ckpt)
    monkeypatch.setattr(checkpoint.manifest, "HASH_BELOW", 100_000)  # the tiny model's weights count as big here
    read = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint.manifest, "_sha256", lambda p: read.append(os.path.relpath(p, ckpt)) or real(p))
    checkpoint.write_manifest(str(ckpt))
    files = json.load(open(ckpt / "manifest.json"))["files"]
    big = sorted(n for n, (size, _) in files.items() if size >= 100_000)
    assert big == ["model/model.safetensors", "state/model.safetensors", "state/rank0.pt"]
    assert all(files[n][1] is None for n in big) and all(files[n][1] for n in files if n not in big)
    assert sorted(read) == sorted(n for n in files if n not in big)  # the big files were never read
    read.clear()
    assert checkpoint.verify_checkpoint(str(ckpt), D) is None
    assert sorted(read) == sorted(n for n in files if n not in big)
    weights = ckpt / "state" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # a same-size bit flip in a big file: not caught (no rereading)
    assert checkpoint.verify_checkpoint(str(ckpt), D) is None
    os.truncate(weights, len(data) - 1)
    assert checkpoint.verify_checkpoint(str(ckpt), D) == (
        f"state/model.safetensors has {len(data) - 1} bytes, the manifest says {len(data)}")
    (ckpt / "state" / "trainer_state.json").write_text((ckpt / "state" / "trainer_state.json").read_text()
                                                       .replace('"step": 1', '"step": 7'))
    os.truncate(weights, len(data))
    assert checkpoint.verify_checkpoint(str(ckpt), D) == ("state/trainer_state.json does not match its sha256 in the "
                                                          "manifest")


def test_a_manifest_that_lists_no_files_fails(tmp_path):
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    checkpoint.write_manifest(str(ckpt))
    assert json.load(open(ckpt / "manifest.json")) == {"files": {}}
    assert checkpoint.verify_checkpoint(str(ckpt), D) == "manifest.json lists no files (not written by a complete save)"
    (ckpt / "notes.txt").write_text("mine")
    checkpoint.write_manifest(str(ckpt))
    assert checkpoint.verify_checkpoint(str(ckpt), D) == ("manifest.json does not list state/trainer_state.json (not "
                                                          "a checkpoint's manifest)")


def test_a_full_disk_is_one_line_and_resume_auto_goes_on(tmp_path, monkeypatch, capsys):
    """ENOSPC while step_2 is written: one line naming the disk, .tmp_step_2 removed, step_1 intact; then files a
    user added to step_1 (a README, notes) do not stop --resume auto from continuing at step 1."""
    real = torch.save

    def full(obj, f, *a, **k):
        if ".tmp_step_2" in str(f):
            with open(f, "wb") as fh:
                fh.write(b"the first bytes")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit) as e:
        run_script("gspo", [*SHORT, "--num-steps", "2", "--save-every", "1"], monkeypatch, tmp_path)
    (run,) = glob.glob(f"{tmp_path}/gspo__*")
    mount = os.path.abspath(run)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    line = str(e.value.code)
    assert line.startswith(f"error: no space left on the disk mounted at {mount} (") and "\n" not in line
    assert line.endswith(f"GiB free) while writing {run}/.tmp_step_2 (removed): free space there, then continue with "
                         "--resume auto from the previous checkpoint")
    assert sorted(p for p in os.listdir(run) if "step" in p) == ["step_1"]
    checkpoint.release_run_dir()
    monkeypatch.setattr(torch, "save", real)
    (tmp_path / run / "step_1" / "README.md").write_text("# my notes on this checkpoint\n")
    (tmp_path / run / "step_1" / "model" / "notes.txt").write_text("uploaded to the hub\n")
    capsys.readouterr()
    rows, _ = run_script("gspo", [*SHORT, "--num-steps", "2", "--save-every", "1", "--resume", "auto"], monkeypatch,
                         tmp_path)
    assert f"resuming {run}/step_1 (step 1)" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [1, 2] and checkpoint.is_checkpoint(f"{run}/step_2")


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2432 vs "
                                                "2326"), OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_short_writes_in_other_words_are_a_full_disk(error, tmp_path):
    """torch.save's zip writer reports a short write as 'unexpected pos'; a quota as EDQUOT: both say no space."""
    def write():
        raise error

    assert checkpoint._attempt(write, str(tmp_path)).startswith("no space left on the disk mounted at ")
    assert checkpoint._attempt(lambda: None, str(tmp_path)) is None


def test_deleting_writer_lock_does_not_admit_a_second_writer(tmp_path, monkeypatch):
    """A live run's writer.lock deleted (it looks stale, it names a pid): a second --resume auto of the run is still
    refused before it touches anything, with one line."""
    import gspo

    run = tmp_path / "gspo__1__5"
    ckpt = run / "step_4"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "state" / "trainer_state.json").write_text(json.dumps({"step": 4, "world": 1, "script": "gspo.py"}))
    checkpoint.write_manifest(str(ckpt))
    holder = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "programs", "lock_holder.py"), "claim", ROOT,
                               str(run), str(ckpt)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        (run / "writer.lock").unlink()
        monkeypatch.setattr(gspo, "load_model", lambda *a, **k: pytest.fail("a second writer reached the model"))
        monkeypatch.setattr(sys, "argv", ["gspo.py", "--resume", "auto", "--output-dir", str(tmp_path)])
        with pytest.raises(SystemExit) as e:
            gspo.main()
        assert e.value.code == (f"error: {run} is being written by another process (its writer.lock, which names it, "
                                f"was deleted) (it holds {run}/writer.lock): wait for that run to end, or start "
                                "another with a different --exp-name or --seed")
        assert not (run / "writer.lock").exists()  # the refused writer wrote nothing
    finally:
        holder.kill()
        holder.wait()
    assert checkpoint.claim_run_dir(str(run), str(ckpt), D) == str(run)  # the dead writer's locks, taken over
    checkpoint.release_run_dir()


def test_a_checkpoint_in_the_flat_layout_before_model_and_state_still_resumes(tmp_path):
    """step_N/ holding trainer_state.json and rank0.pt beside the weights, every file hashed in its manifest: the
    training state is read from step_N itself, and only its small files are rehashed."""
    import hashlib

    ckpt = tmp_path / "step_2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "world": 1, "script": "gspo.py"}))
    (ckpt / "rank0.pt").write_bytes(b"x" * 64)
    files = {n: [os.path.getsize(ckpt / n), hashlib.sha256((ckpt / n).read_bytes()).hexdigest()]
             for n in ("trainer_state.json", "rank0.pt")}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files}))
    assert checkpoint.state_dir(str(ckpt)) == str(ckpt) and checkpoint.verify_checkpoint(str(ckpt), D) is None
    assert checkpoint.read_trainer_state(str(ckpt))["step"] == 2
    (ckpt / "rank0.pt").write_bytes(b"y" * 64)
    assert checkpoint.verify_checkpoint(str(ckpt), D) == "rank0.pt does not match its sha256 in the manifest"


def test_a_checkpoint_given_as_model_names_its_export(saved):
    from grouprl import modeling

    with pytest.raises(SystemExit) as e:
        modeling.check_model(saved, False)
    assert e.value.code == (f"error: --model {saved!r}: a checkpoint folder; give its model, {saved}/model (or "
                            f"continue the run with --resume {saved})")
    modeling.check_model(f"{saved}/model", False)  # the export is a model folder


def test_every_objective_flag_is_fixed_on_resume():
    """Each script's own flags (its Args beyond CommonArgs, the objective's) cannot change on resume: a run resumed
    under another loss would not be the run it was. A new script's flags missing from checkpoint.RESUME_FIXED fail
    here."""
    import dataclasses
    import importlib

    from grouprl.checkpoint import RESUME_FIXED
    from grouprl.cli import CommonArgs

    common_fields = {f.name for f in dataclasses.fields(CommonArgs)}
    for script in SCRIPTS:
        own = {f.name for f in dataclasses.fields(importlib.import_module(script).Args)} - common_fields - {"exp_name"}
        assert own <= set(RESUME_FIXED), (script, own - set(RESUME_FIXED))


def test_a_save_past_the_file_size_limit_is_not_a_full_disk(tmp_path, monkeypatch):
    """Issue 54: under `ulimit -f` a save failed with torch's short-write words and was reported as "no space left ...
    (62.7 GiB free) ... continue from the previous checkpoint", when the disk had room and there was no previous
    checkpoint. Now the limit is named, and what to do next depends on whether the run has a checkpoint."""
    import resource

    run = tmp_path / "run"
    run.mkdir()
    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 2432 vs 2326")

    def write():
        raise short

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        line = checkpoint._attempt(write, str(run / ".tmp_step_1"))
        efbig = checkpoint._attempt(lambda: (_ for _ in ()).throw(OSError(errno.EFBIG, "File too large")),
                                    str(run / ".tmp_step_1"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert line == efbig == (f"writing {run}/.tmp_step_1 (removed) went past the file size limit (ulimit -f: 1,048,576 "
                             "bytes): raise it (ulimit -f unlimited), then start the run again (it has no checkpoint "
                             "to continue from)")
    from helpers import fake_checkpoint

    fake_checkpoint(run / "step_1", step=1, world=1, script="gspo.py")
    assert checkpoint._attempt(write, str(run / ".tmp_step_2")).endswith(  # no limit: the disk, as before
        "free space there, then continue with --resume auto from the previous checkpoint")


# -------------------- issue 61 item 2: slips a test must catch
def test_save_final_model_under_lora_writes_the_merged_model_and_its_adapter(tmp_path, monkeypatch):
    """--lora-rank 4 --save-final model: final/model is the merged model from_pretrained loads (no LoRA tensors) and
    final/adapter the adapters (the export's LoRA flag lost: it fails to write)."""
    from transformers import AutoModelForCausalLM

    from helpers import run_script

    _, run = run_script("gspo", [*SHORT, "--num-steps", "1", "--lora-rank", "4", "--save-final", "model"],
                        monkeypatch, tmp_path)
    assert sorted(os.listdir(f"{run}/final")) == ["adapter", "model"]
    merged = AutoModelForCausalLM.from_pretrained(f"{run}/final/model")
    assert not any("lora" in k for k in merged.state_dict())


def test_the_run_lock_is_held_under_the_normalised_path(tmp_path, monkeypatch):
    """--output-dir ./runs: the run folder is ./runs/<run>; a folder put in its place (mv R R.old; mkdir R) is seen
    however the path is spelled (the lock kept under the path as given: never found, the replacement unnoticed)."""
    from grouprl.checkpoint import run_dir

    monkeypatch.chdir(tmp_path)
    os.mkdir("runs")
    path = checkpoint.claim_run_dir("./runs/x__1__5", None, D)
    assert run_dir.gone_or_replaced(path, "metrics.jsonl") is None
    os.rename("runs/x__1__5", "runs/old")
    os.mkdir("runs/x__1__5")
    for spelled in (path, "runs/x__1__5", os.path.abspath("runs/x__1__5")[len(os.getcwd()) + 1:]):
        assert "was replaced while the run wrote it" in run_dir.gone_or_replaced(spelled, "metrics.jsonl")
    checkpoint.release_run_dir()


@pytest.mark.parametrize("flag, then, now", [("baseline", "group-mean", "leave-one-out"),
                                              ("scale_rewards", "group", "batch"),
                                              ("top_entropy_quantile", 1.0, "0.5"),
                                              ("multi_objective_aggregation", "sum-then-normalize",
                                               "normalize-then-sum"),
                                              ("min_new_tokens", 0, "1")])
def test_every_common_objective_flag_is_fixed_on_resume(flag, then, now, tmp_path):
    """The objective flags every script shares (CommonArgs) cannot change on resume either: --resume with another
    value stops in one line (one left out of RESUME_FIXED: the run goes on under another objective)."""
    import dataclasses

    import gspo
    from grouprl.cli import fill_defaults, parse_args
    from helpers import fake_checkpoint

    ckpt = tmp_path / "gspo__1__5" / "step_1"
    fake_checkpoint(ckpt, step=1, world=1, script="gspo.py", args={flag: then})
    args = fill_defaults(parse_args(gspo.Args, ["--resume", str(ckpt), f"--{flag.replace('_', '-')}", now]))
    with pytest.raises(SystemExit) as e:
        checkpoint.run_paths(dataclasses.replace(args, num_steps=3), D, "gspo.py")
    assert f"differs from {then} in {ckpt}: it cannot change on resume" in str(e.value.code)
