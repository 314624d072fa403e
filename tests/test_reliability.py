"""Hostile input and numerical accidents: a reward that raises, a completion holding code, non-finite losses."""
import os
import signal
import sys

import pytest
import torch

import common
from grouprl import data
from grouprl import distributed
from grouprl import grader
from grouprl import checkpoint
from grouprl import modeling
from grouprl import rewards
from grouprl import runlog
from conftest import ROOT
from helpers import run_script


def test_grader_that_raises_scores_zero_and_is_counted(monkeypatch, capsys):
    real = grader.extract_answer

    def flaky(text):
        if "boom" in text:
            raise RuntimeError("grader bug")
        return real(text)

    monkeypatch.setattr(rewards, "extract_answer", flaky)
    r, errors = rewards.score(["3", "boom 3", "x = 4"], ["3", "4"], 2)  # answers 3, 3 | 4
    assert r.tolist() == [1.0, 0.0, 1.0] and errors == 1
    assert "the reward failed on 1 of 3 completions, scored 0 (first: RuntimeError: grader bug)" in \
        capsys.readouterr().err


def test_code_in_a_completion_is_only_parsed(tmp_path):
    marker = tmp_path / "pwned"
    texts = [f"__import__('os').system('touch {marker}')", f"exec (\"open('{marker}', 'w')\") 7", "\\boxed{7}"]
    r, errors = rewards.score(texts, ["7"], 3)
    assert r.tolist() == [0.0, 1.0, 1.0] and errors == 0 and not marker.exists()


def test_a_reward_that_always_raises_stops_the_run_in_one_line(monkeypatch, tmp_path):
    """Every completion of the first step failed: one line naming the first error (issue 26); with
    --reward-fail-steps 0 the run goes on, each failure scored 0 and counted."""
    monkeypatch.setattr(rewards, "extract_answer", lambda text: 1 / 0)
    argv = ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0"]
    with pytest.raises(SystemExit) as e:
        run_script("gspo", argv, monkeypatch, tmp_path / "a")
    assert str(e.value.code) == ("error: the reward math_reward failed on every completion of the first step (first "
                                 "error: ZeroDivisionError: division by zero): fix it (the run would learn from nothing)")
    rows, _ = run_script("gspo", [*argv, "--reward-fail-steps", "0"], monkeypatch, tmp_path / "b")
    assert [r["charts/reward_errors"] for r in rows] == [32, 32]  # 4 prompts x 8 completions, each step
    assert all(r["charts/reward_mean"] == 0 and r["charts/zero_adv_group_frac"] == 1 for r in rows)


def nan_on(calls, loss_fn):
    """Wrap a loss so that the listed calls (1-based) return a NaN loss (and so NaN gradients)."""
    count = [0]

    def wrapped(*a, **k):
        count[0] += 1
        loss, seq_terms, stats = loss_fn(*a, **k)
        return (loss * float("nan") if calls == "all" or count[0] in calls else loss), seq_terms, stats

    return wrapped


@pytest.mark.parametrize("script", ["gspo", "dfpo"])
def test_nonfinite_update_is_skipped_and_counted(script, monkeypatch, tmp_path):
    mod = __import__(script)
    loss_name = f"{script}_loss"
    monkeypatch.setattr(mod, loss_name, nan_on({2, 5}, getattr(mod, loss_name)))
    rows, run = run_script(script, ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0"], monkeypatch,
                           tmp_path)
    assert [r["losses/skipped_updates"] for r in rows] == [1, 1]  # 4 updates a step: calls 2 and 5
    from transformers import AutoModelForCausalLM

    assert all(torch.isfinite(p).all() for p in AutoModelForCausalLM.from_pretrained(f"{run}/step_2/model").parameters())


def test_nonfinite_updates_never_touch_the_weights(monkeypatch, tmp_path):
    import gspo
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(gspo, "gspo_loss", nan_on("all", gspo.gspo_loss))
    rows, run = run_script("gspo", ["--num-steps", "1", "--prompts-per-rank", "4", "--eval-every", "0",
                                    "--max-nonfinite", "10"], monkeypatch, tmp_path)
    assert rows[0]["losses/skipped_updates"] == 4
    trained = AutoModelForCausalLM.from_pretrained(f"{run}/step_1/state")  # fp32 masters, not the bf16 export
    tok = modeling.tiny_tokenizer()
    start, _ = modeling.load_model("tiny", tok, distributed.Dist(0, 1, torch.device("cpu")), seed=1)  # the run's init
    for (n, p), q in zip(trained.named_parameters(), start.parameters()):
        assert torch.equal(p, q), n


def test_nonfinite_updates_in_a_row_stop_the_run(monkeypatch, tmp_path):
    import gspo

    monkeypatch.setattr(gspo, "gspo_loss", nan_on("all", gspo.gspo_loss))
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0",
                                      "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value.code).startswith("error: step 1: 3 non-finite updates in a row (loss nan")
    assert not list(tmp_path.glob("*/step_*"))  # stopped before any checkpoint


def test_rows_without_answer_and_long_prompts_are_dropped_and_counted(tmp_path):
    tok = modeling.tiny_tokenizer()
    rows = ([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
            + [{"prompt": "x" * 500 + "=", "answer": "1"} for _ in range(5)]  # 500+ tokens for the tiny tokenizer
            + [{"prompt": "no answer", "answer": None}, {"prompt": "empty answer", "answer": "  "}])
    path = tmp_path / "data.jsonl"
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    train, held, dropped = data.load_task(data.Task(str(path), None, 3, 0, False, 100),
                                          tok)
    assert dropped == {"no_answer": 2, "too_long": 5} and len(train) + len(held) == 30
    assert all(len(tok(t).input_ids) <= 100 for t in list(train["text"]) + list(held["text"]))


# -------------------- the reward workers against signals, a killed trainer and a forking reward (issue 27, holes 1-3)
HOLE_REWARD = """
import os, time


def f(completion, answer):
    if completion == "slow":
        time.sleep(1.0)
    if completion == "loop":
        open(os.path.join(os.environ["MARKS"], str(os.getpid())), "w").close()
        while True:
            pass
    if completion == "fork":  # the child returns into the worker; the parent waits for it, then returns too
        pid = os.fork()
        if pid == 0:
            return 1.0
        os.waitpid(pid, 0)
        return 0.0
    return 1.0
"""


@pytest.fixture
def hole_reward(tmp_path, monkeypatch):
    (tmp_path / "hole27.py").write_text(HOLE_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def parent(mode, folder):
    import json
    import subprocess

    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "programs", "reward_parent.py"), mode,
                             json.dumps([str(folder), ROOT])], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, start_new_session=True,  # its own process group
                            env={**__import__("os").environ, "MARKS": str(folder)})


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group_does_not_reach_the_reward_workers(sig, hole_reward):
    """Ctrl-C in a terminal (SIGINT) or a scheduler's SIGTERM to the trainer's process group, while rewards are in
    flight: the trainer alone gets it; the workers answer those requests and the next (hole 1)."""
    import json

    p = parent(sig, hole_reward)
    pids = json.loads(p.stdout.readline())
    result = json.loads(p.stdout.readline())
    assert p.wait(timeout=60) == 0
    assert result["got"] == [getattr(signal, sig)]  # the trainer got it (and would stop at the end of the step)
    assert result["out"] == [[1.0, None]] * 3 and result["pids"] == pids  # no worker died or was replaced


def gone(pid: int) -> bool:
    """Exited (a zombie left for a parent that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("mode", ["main", "thread"])  # thread: no parent-death signal, the worker's own watch
def test_reward_workers_die_within_a_second_of_their_trainers_kill_9(mode, hole_reward):
    """A trainer killed with -9 while both workers loop inside the reward: the workers are gone within 1 s (hole 2)."""
    import json
    import os
    import time

    p = parent(mode, hole_reward)
    pids = json.loads(p.stdout.readline())
    t = time.monotonic()
    while not all((hole_reward / str(pid)).exists() for pid in pids):  # both are in the loop
        assert time.monotonic() - t < 60
        time.sleep(0.05)
    p.kill()
    p.wait()
    t = time.monotonic()
    while not all(gone(pid) for pid in pids) and time.monotonic() - t < 5:
        time.sleep(0.02)
    took = time.monotonic() - t
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert took < 1.0, f"the workers lived {took:.2f} s past their trainer"


def test_a_reward_that_forks_is_an_error_never_another_requests_answer(hole_reward, capsys):
    """The forked child returns 1.0 into the worker and the parent 0.0: the child's reply names its own pid, so each
    request is counted as an error (0), and the next request gets its own answer (hole 3)."""
    reward = grader.load_reward("hole27:f", 30.0)
    r, errors = rewards.score(["fork"] * 4, ["1", "2", "3", "4"], 1, reward)
    assert r.tolist() == [0.0] * 4 and errors == 4
    assert "the reward returned in a process it forked (worker restarted)" in capsys.readouterr().err
    r, errors = rewards.score(["plain", "fork", "plain"], ["1", "2", "3"], 1, reward)
    assert r.tolist() == [1.0, 0.0, 1.0] and errors == 1
    reward.stop()


PG_REWARD = """
import os, signal, time


def r(completion, answer):
    flag = os.environ.get("PG_FLAG")
    if flag:
        try:
            os.remove(flag)  # once, in whichever worker comes first
        except FileNotFoundError:
            pass
        else:  # what a scheduler sends to the job: SIGTERM to the trainer's process group, a reward in flight
            os.killpg(os.getpgid(os.getppid()), signal.SIGTERM)
            time.sleep(0.5)
    return 1.0 + len(completion) % 2  # never 0, the score of a request whose worker died
"""


def test_sigterm_to_the_process_group_with_a_reward_in_flight_then_resume_is_bitwise(tmp_path, monkeypatch):
    """The graceful stop of a whole job (SIGTERM to its process group during step 1's rewards) saves step 1 with
    every reward scored; --resume auto then ends bitwise equal to an unbroken run (hole 1)."""
    import glob
    import json
    import os
    import subprocess

    from safetensors.torch import load_file

    (tmp_path / "pg27.py").write_text(PG_REWARD)
    argv = ["--num-steps", "2", "--prompts-per-rank", "4", "--eval-every", "0", "--reward", "pg27:r"]

    def run(out, *extra, flag=None):
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        env.pop("PG_FLAG", None)
        if flag:
            open(flag, "w").close()
            env["PG_FLAG"] = flag
        p = subprocess.run([sys.executable, "gspo.py", *argv, *extra, "--output-dir", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600, start_new_session=True)  # a job of its own
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    def result(out):
        (path,) = glob.glob(f"{out}/*/metrics.jsonl")
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in open(path)]
        return load_file(os.path.join(os.path.dirname(path), "step_2", "state", "model.safetensors")), rows

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PG_FLAG", raising=False)
    run_script("gspo", argv, monkeypatch, tmp_path / "straight")  # unbroken, in this process
    p = run(tmp_path / "stopped", flag=str(tmp_path / "flag"))
    assert "SIGTERM: stopping with a checkpoint at the end of this step" in p.stderr
    assert not glob.glob(f"{tmp_path}/stopped/*/step_2") and glob.glob(f"{tmp_path}/stopped/*/step_1")
    run(tmp_path / "stopped", "--resume", "auto")
    (wa, ra), (wb, rb) = result(tmp_path / "straight"), result(tmp_path / "stopped")
    assert [r["step"] for r in rb] == [1, 2] and ra == rb and rb[0]["charts/reward_errors"] == 0
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# issue 38 item 3: a --reward module is imported in a worker under a time bound, never in the trainer
IMPORT_HOSTILE = {
    "exits": "import sys\nsys.exit(0)\n",
    "hard_exits": "import os\nos._exit(0)\n",
    "hangs": "import threading\nthreading.Event().wait()\n",
    "stray_thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(20,), name='pool').start()\n"
                    "def f(completion, answer):\n    return 1.0\n",
}


@pytest.mark.parametrize("case, needle", [
    ("exits", "importing 'imp38_exits' called sys.exit(0): a reward module must not exit at import"),
    ("hard_exits", "importing 'imp38_hard_exits' ended the process (exit code 0, os._exit or a signal)"),
    ("hangs", "importing 'imp38_hangs' did not finish in 2 s"),
])
def test_a_reward_module_that_exits_or_hangs_at_import_is_one_line(case, needle, tmp_path, monkeypatch):
    (tmp_path / f"imp38_{case}.py").write_text(IMPORT_HOSTILE[case])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(grader, "IMPORT_TIMEOUT_S", 2.0)
    with pytest.raises(SystemExit) as e:
        grader.load_reward(f"imp38_{case}:f", 1.0)
    assert needle in str(e.value) and f"imp38_{case}" not in sys.modules


def test_a_reward_module_that_starts_a_thread_at_import_is_said_and_stays_out_of_the_trainer(
        tmp_path, monkeypatch, capsys):
    import threading

    (tmp_path / "imp38_stray_thread.py").write_text(IMPORT_HOSTILE["stray_thread"])
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = grader.load_reward("imp38_stray_thread:f", 5.0)
    assert not [t for t in threading.enumerate() if t.name == "pool"]  # would keep python from exiting
    assert "importing 'imp38_stray_thread' started a thread that is not a daemon (pool)" in capsys.readouterr().err
    r, errors = rewards.score(["a"], ["1"], 1, reward, watch=False)  # the workers import it and grade
    assert r.tolist() == [1.0] and errors == 0
    reward.stop()


# issue 38 item 4: the last tracebacks are lines
@pytest.mark.parametrize("argv, needle", [
    (["--output-dir", "/proc/x"], "--output-dir /proc/x: no folder can be made in /proc"),
    (["--output-dir", "/sys/x/y"], "--output-dir /sys/x/y: no folder can be made in /sys"),
    (["--exp-name", "e" * 300], "over the 255 this file system allows in one name: give an --exp-name of at most 240"),
])
def test_run_folder_that_cannot_be_made_is_one_line(argv, needle, monkeypatch, tmp_path):
    from helpers import fails_before_any_model

    if argv[0] == "--output-dir" and not os.path.isdir(argv[1].split("/x")[0]):
        pytest.skip(f"no {argv[1].split('/x')[0]} here")
    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)
    assert os.listdir(tmp_path) == []  # the write check left nothing behind


def model_copy(src, dst, drop=(), damage=None):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    if damage == "truncated":
        os.truncate(f"{dst}/model.safetensors", os.path.getsize(f"{dst}/model.safetensors") // 2)
    elif damage == "header":  # same size, the header's length field overwritten
        with open(f"{dst}/model.safetensors", "r+b") as f:
            f.write(b"\xff" * 8)
    return str(dst)


@pytest.mark.parametrize("case, needle", [
    ("no tokenizer", "no tokenizer (spiece.model, tokenizer.json, tokenizer.model, tokenizer_config.json, vocab.json"),
    ("state", "no tokenizer (spiece.model, tokenizer.json, tokenizer.model, tokenizer_config.json, vocab.json, "
              "vocab.txt); its checkpoint's"),
    ("truncated", "model.safetensors: its tensors end at byte"),
    ("header", "model.safetensors: its safetensors header claims 18446744073709551615 bytes, the file has"),
])
def test_a_model_folder_that_cannot_load_is_one_line(case, needle, tiny_dir, tmp_path, monkeypatch):
    from helpers import fails_before_any_model

    tokenizer = ("tokenizer*", "chat_template*")
    if case == "state":  # step_N/state: the training weights without a tokenizer, beside model/ which has one
        model_copy(tiny_dir, tmp_path / "step_3" / "model")
        folder = model_copy(tiny_dir, tmp_path / "step_3" / "state", drop=tokenizer)
    else:
        folder = model_copy(tiny_dir, tmp_path / "m", drop=tokenizer if case == "no tokenizer" else (),
                            damage=case if case in ("truncated", "header") else None)
    fails_before_any_model("gspo", ["--model", folder], f"--model '{folder}': {needle}", monkeypatch, tmp_path)


@pytest.mark.parametrize("name, text, needle", [
    ("bad.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+\xff=", "answer": "4"}\n',
     "bad.jsonl:2: byte 0xff at column 15 is not UTF-8 (invalid start byte): save the file as UTF-8"),
    ("bad.csv", b"prompt,answer\n1+1=,2\n2+2=,4\n\xe9t\xe9,5\n",
     "bad.csv:4: byte 0xe9 at column 1 is not UTF-8 (invalid continuation byte): save the file as UTF-8"),
    ("folder/bad.csv", b"prompt,answer\n1+1=,2\n2+2=,4\n\xe9t\xe9,5\n", "folder/bad.csv:4: byte 0xe9 at column 1"),
])
def test_a_byte_that_is_not_utf8_in_a_data_file_names_file_and_line(name, text, needle, tmp_path, monkeypatch):
    from helpers import fails_before_any_model

    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(text)
    dataset = str(path.parent) if name.startswith("folder/") else str(path)
    fails_before_any_model("gspo", ["--dataset", dataset], needle, monkeypatch, tmp_path)


def logger_at(run_dir):
    import argparse

    return runlog.Logger(str(run_dir), distributed.Dist(0, 1, torch.device("cpu")), argparse.Namespace(seed=1))


def test_a_deleted_run_folder_or_a_full_disk_while_logging_is_the_saves_one_line(tmp_path):
    import argparse
    import shutil

    logger = logger_at(tmp_path / "run")
    logger.log(1, {"charts/reward_mean": 0.5})
    logger.writer.flush()  # tensorboard's thread has written step 1 (in a run: long before the next step)
    shutil.rmtree(tmp_path / "run")  # the open metrics.jsonl would take every later row without an error
    with pytest.raises(SystemExit) as e:
        logger.log(2, {"charts/reward_mean": 0.5})
    assert str(e.value) == (f"error: the run folder {tmp_path}/run is gone (deleted or moved while the run wrote it) "
                            f"while writing {tmp_path}/run/metrics.jsonl: nothing more can be logged or saved there; "
                            "start the run again")
    with pytest.raises(SystemExit) as e:
        rows = {"prompt": ["p"], "answer": ["a"], "text": ["p"]}
        roll = argparse.Namespace(rows=rows, texts=["c"], rewards=torch.ones(1))
        runlog.log_samples(logger, roll, torch.ones(1), 2, 1)
    assert "is gone (deleted or moved while the run wrote it) while writing" in str(e.value)
    logger = logger_at(tmp_path / "run2")
    logger.metrics = open("/dev/full", "w")  # every write: ENOSPC
    with pytest.raises(SystemExit) as e:
        logger.log(1, {"charts/reward_mean": 0.5})
    assert str(e.value).startswith("error: no space left on the disk mounted at /dev (") and str(e.value).endswith(
        "while writing /dev/full: free space there, then start the run again (it has no checkpoint to continue from)")
    # the save: its folder is not made again in a deleted run folder
    line = checkpoint._attempt(lambda: os.makedirs(tmp_path / "run" / ".tmp_step_2"), str(tmp_path / "run" / ".tmp_step_2"))
    assert line.startswith(f"the run folder {tmp_path}/run is gone")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 1-step run with its step_1 (the tiny model), copied by the tests below."""
    from helpers import SHORT

    out = tmp_path_factory.mktemp("saved38")
    mp = pytest.MonkeyPatch()
    try:
        _, run = run_script("gspo", [*SHORT, "--num-steps", "1"], mp, out)
    finally:
        mp.undo()
    return run


def damaged(path, where):
    """Same size, a damaged header (a safetensors file's first bytes) or zip central directory (its last)."""
    data = bytearray(open(path, "rb").read())
    if where == "header":
        data[:8] = (len(data) - 4).to_bytes(8, "little")  # a header longer than the file
    else:
        data[-22:-18] = b"\0\0\0\0"  # the end-of-central-directory record's signature
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("name, where, reason", [
    ("state/model.safetensors", "header", "state/model.safetensors: its safetensors header claims"),
    ("model/model.safetensors", "header", "model/model.safetensors: its safetensors header claims"),
    ("state/rank0.pt", "zip", "state/rank0.pt: its zip (torch.save's format) does not read (File is not a zip file)"),
])
def test_a_damaged_header_of_a_big_file_makes_resume_auto_take_the_previous_checkpoint(
        name, where, reason, saved_run, tmp_path, monkeypatch, capsys):
    """Big files are not hashed; a same-size damaged header or zip is still caught by reading headers alone, and
    --resume auto falls back to the checkpoint before, in one line."""
    import shutil

    from helpers import SHORT

    run = tmp_path / "runs" / os.path.basename(saved_run)
    shutil.copytree(saved_run, run)
    shutil.copytree(run / "step_1", run / "step_2")
    state = run / "step_2" / "state" / "trainer_state.json"
    state.write_text(state.read_text().replace('"step": 1', '"step": 2'))
    checkpoint.write_manifest(str(run / "step_2"))
    monkeypatch.setattr(checkpoint.manifest, "HASH_BELOW", 1000)  # the tiny model's weights count as big here
    checkpoint.write_manifest(str(run / "step_2"))
    damaged(run / "step_2" / name, where)
    assert checkpoint.verify_checkpoint(str(run / "step_2"), D).startswith(reason)
    monkeypatch.setattr(sys, "argv", ["gspo.py", *SHORT, "--num-steps", "1", "--resume", "auto", "--output-dir",
                                      str(tmp_path / "runs")])
    import gspo

    with pytest.raises(SystemExit) as e:  # step_1 is at --num-steps 1: nothing to do
        gspo.main()
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"--resume auto: skipping {run}/step_2: {reason}" in out
    assert f"resuming {run}/step_1 (step 1)" in out


@pytest.mark.parametrize("manifest, reason", [
    ({"files": {"state/trainer_state.json": 5}}, "manifest.json: the entry of 'state/trainer_state.json' is 5, not "
                                                  "[size in bytes, sha256 or null] (damaged, or not written by a save)"),
    ({"files": {"state/trainer_state.json": [5, 7]}}, "the entry of 'state/trainer_state.json' is [5, 7], not [size"),
    ({"files": {"state/trainer_state.json": ["5", None]}}, "the entry of 'state/trainer_state.json' is [\"5\", null]"),
    ({"files": {"../trainer_state.json": [5, None]}}, "manifest.json: the entry '../trainer_state.json' is not a path "
                                                      "inside the checkpoint folder"),
    ({"files": [["state/trainer_state.json", 5]]}, "manifest.json's 'files' is a list, not an object {path: [size"),
    ([1, 2], "manifest.json cannot be read (ValueError: not an object {\"files\": {path: [size in bytes, sha256 or "
             "null]}})"),
])
def test_a_malformed_manifest_names_the_entry_and_what_it_should_be(manifest, reason, tmp_path):
    import json

    ckpt = tmp_path / "step_2"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert reason in checkpoint.verify_checkpoint(str(ckpt), D)


D = distributed.Dist(0, 1, torch.device("cpu"))


def test_a_run_that_fails_after_claiming_its_folder_leaves_no_folder(monkeypatch, tmp_path):
    import gspo

    monkeypatch.setattr(gspo, "load_model", lambda *a, **k: distributed.fail("the model is broken"))
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--output-dir", str(tmp_path / "runs")])
    claimed = []
    real = gspo.claim_run_dir
    monkeypatch.setattr(gspo, "claim_run_dir", lambda *a: claimed.append(real(*a)) or claimed[-1])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value) == "error: the model is broken" and claimed and os.listdir(tmp_path / "runs") == []


@pytest.mark.parametrize("sig, patched", [("SIGTERM", "load_model"), ("SIGINT", "load_tokenizer")])
def test_a_signal_during_start_up_is_one_line_and_leaves_no_run_folder(sig, patched, tmp_path):
    """load_model: after the run folder was made; load_tokenizer: before."""
    import subprocess
    import time

    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "programs", "stall.py"), patched,
                          str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:  # start-up lines (the held-out set's), then the stall's
        if line == "waiting\n":
            break
    assert os.path.isdir(tmp_path / "runs") == (patched == "load_model")
    time.sleep(0.2)
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and err == (f"error: {sig} during start-up, before the first step: stopped, nothing "
                                         "was saved (start the run again)\n"), err
    assert not os.path.exists(tmp_path / "runs") or os.listdir(tmp_path / "runs") == []


# issue 38 item 2: host memory planned like GPU memory (MemAvailable mocked)
def fake_meminfo(monkeypatch, tmp_path, kb):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:   {kb} kB\n")
    monkeypatch.setattr(distributed, "MEMINFO", str(path))


def test_available_host_memory_is_meminfos_memavailable(monkeypatch, tmp_path):
    fake_meminfo(monkeypatch, tmp_path, 2048)
    assert distributed.available_host_memory() == 2048 * 1024
    monkeypatch.setattr(distributed, "MEMINFO", str(tmp_path / "none"))
    assert distributed.available_host_memory() is None and distributed.host_memory_short({"x": 1 << 60}) is None


def test_the_engine_plans_host_memory_before_allocating(monkeypatch, tmp_path):
    from grouprl import engine

    lm = modeling.tiny_model(modeling.tiny_tokenizer())
    kv = 2 * 2 * 8 * 2 * 100 * 32 * 4  # K and V, 2 layers, 8 slots, 2 KV heads, 100 positions, head_dim 32, fp32
    weights = 2 * 100 * 32 * 4  # the copy: cos and sin tables only (an fp32 model on the CPU is read in place)
    need_kb = (kv + weights) / 0.9 / 1024
    fake_meminfo(monkeypatch, tmp_path, int(need_kb) + 1)  # 90% of it holds both
    assert engine.kv_plan(lm, engine.Setup(8, "cpu", torch.float32), 100, 4) is None
    fake_meminfo(monkeypatch, tmp_path, int(need_kb) - 1)
    with pytest.raises(MemoryError) as e:
        engine.kv_plan(lm, engine.Setup(8, "cpu", torch.float32), 100, 4)
    free = (int(need_kb) - 1) * 1024
    assert str(e.value) == (f"the KV cache of 8 rows x 100 positions ({kv / 2 ** 20:.1f} MiB) and the weight copy "
                            f"({weights / 2 ** 20:.1f} MiB) exceed 90% of the {free / 2 ** 20:.1f} MiB of host memory "
                            "available (MemAvailable)")


def test_a_rollout_past_host_memory_and_a_huge_lora_rank_are_one_line_naming_the_flag(monkeypatch, tmp_path):
    import gspo

    fake_meminfo(monkeypatch, tmp_path, 64)  # 64 kB: past the tiny model's KV cache, weights and adapters
    monkeypatch.setattr(modeling, "check_sizes", lambda args: None)  # the set-up's plan (below): the engine's own
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--output-dir", str(tmp_path / "runs"), "--gen-mode", "engine",
                                      "--prompts-per-rank", "4", "--num-minibatches", "1", "--eval-every", "0",
                                      "--num-steps", "1"])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value).startswith("error: --gen-mode engine: the KV cache of 32 rows x ") and str(e.value).endswith(
        "of host memory available (MemAvailable); lower --gen-batch-size (now 256) or --max-new-tokens (now 2)")
    # LoRA, every linear layer: rank x (in + out) per layer, q 128+128, k and v 128+64, o 128+128, gate and up
    # 128+384, down 384+128, 2 layers
    n = 8 * 2 * (256 + 192 + 192 + 256 + 512 + 512 + 512)
    monkeypatch.setattr(sys, "argv", ["gspo.py", "--output-dir", str(tmp_path / "runs"), "--lora-rank", "8",
                                      "--num-steps", "1", "--eval-every", "0"])
    with pytest.raises(SystemExit) as e:
        gspo.main()
    assert str(e.value) == (f"error: --lora-rank 8: the LoRA adapters of rank 8 ({n:,} fp32 parameters) "
                            f"({4 * n / 2 ** 20:.1f} MiB) and their gradients and AdamW moments ({12 * n / 2 ** 20:.1f} "
                            "MiB) exceed 90% of the 0.1 MiB of host memory available (MemAvailable); lower --lora-rank")


@pytest.mark.parametrize("argv, line", [
    # issue 54: ran 161 s, then the OOM killer took 19 GB and left an empty run folder
    (["--group-size", "100000", "--prompts-per-rank", "1", "--num-minibatches", "1"],
     "--group-size 100000: the KV cache of one group (100000 rows) (2.5 GiB) and the training forward's activations "
     "(100000 rows) (66.5 GiB) and the rollout's 100000 rows (79.3 MiB) exceed 90% of the 16.0 GiB of host memory "
     "available (MemAvailable), at 24 prompt token(s) a row; lower --group-size, --prompts-per-rank (now 1) or "
     "--max-new-tokens (now 2), or set --micro-batch-size"),
    # 486M adapter parameters on a model whose layers are at most 128 wide
    (["--lora-rank", "100000"], "--lora-rank 100000: above 128, the largest rank an update of --model tiny's target "
                                "layers can have (min(in, out) of a layer): it adds parameters and no capacity; use "
                                "at most 128"),
    (["--lora-rank", "65", "--lora-target-modules", "k_proj", "v_proj"], "--lora-rank 65: above 64,"),
])
def test_a_group_or_a_lora_rank_past_what_the_model_and_memory_allow_is_one_line_before_the_model(
        argv, line, monkeypatch, tmp_path):
    """--group-size and --lora-rank bounded before the model loads (16 GiB available, mocked): the rollout's rows
    planned as the engine's KV cache is, at the least a row takes (the built-in prompt's 24 tokens and 2 new ones, 2
    layers of a 128-wide model: per token and layer 2 x (4 x 128 + 3 x 384) + 4 heads x 26 = 3432 floats kept for
    the backward: 100000 x 26 x 2 x 3432 x 4 bytes = 66.5 GiB); a rank above every target layer's min(in, out)."""
    from helpers import fails_before_any_model

    fake_meminfo(monkeypatch, tmp_path, 16 * 2 ** 20)
    assert 100000 * 26 * 2 * 3432 * 4 / 2 ** 30 == pytest.approx(66.5, abs=0.05)
    fails_before_any_model("gspo", argv, line, monkeypatch, tmp_path)


def test_the_default_runs_and_a_large_group_that_fits_pass_the_plan(monkeypatch, tmp_path):
    import gspo
    from grouprl import cli

    fake_meminfo(monkeypatch, tmp_path, 16 * 2 ** 20)
    for argv in ([], ["--group-size", "1000"], ["--lora-rank", "128"], ["--model", "tiny-moe", "--lora-rank", "8"]):
        modeling.check_sizes(cli.fill_defaults(cli.parse_args(gspo.Args, argv)))  # no error


@pytest.mark.parametrize("link, target, why", [("loop", "loop", "Too many levels of symbolic links"),
                                               ("dangling", "no/such/folder", "No such file or directory")])
@pytest.mark.parametrize("below", ["", "/runs"])
def test_an_output_dir_that_is_a_link_to_nowhere_is_one_line(link, target, why, below, monkeypatch, tmp_path):
    """Issue 54: --output-dir a symlink loop or a dangling link (or a folder under one) was a FileExistsError or
    ELOOP traceback from makedirs."""
    from helpers import fails_before_any_model

    os.symlink(target, tmp_path / link)
    fails_before_any_model("gspo", ["--output-dir", f"{tmp_path}/{link}{below}"],
                           f"--output-dir {tmp_path}/{link}{below}: {tmp_path}/{link} is a symbolic link that leads to "
                           f"no folder ({why}): point it at a folder, or give another --output-dir", monkeypatch,
                           tmp_path)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("case, needle", [
    ("system", "the model's chat template refuses the prompt (System role not supported): this template takes no "
               "system message: put the text into the prompts, or drop --system-prompt"),
    ("popen", "the model's chat template does what a template may not (access to attribute '__init__' of 'type' "
              "object is unsafe), blocked: a template formats messages only; check the chat_template of the model's "
              "tokenizer_config.json"),
    ("pickle", "pytorch_model.bin: its pickle calls posix.system, which torch.load (weights_only) refuses: such a "
               "file can run code when loaded; take weights in safetensors from a source you trust"),
])
def test_a_hostile_template_or_pickle_is_one_line(case, needle, tiny_dir, tmp_path, monkeypatch):
    """Issue 54: a chat template that raises for a system message (Gemma's) with --system-prompt, one that reaches for
    os.popen (blocked by jinja's sandbox), and a pytorch_model.bin whose pickle calls os.system (refused by
    torch.load's weights_only) were 33- and 47-line tracebacks; now one line each, before any model is built."""
    import shutil

    from transformers import AutoTokenizer

    from helpers import fails_before_any_model

    model = model_copy(tiny_dir, tmp_path / "m")
    argv = ["--model", model]
    if case == "pickle":
        os.remove(f"{model}/model.safetensors")
        torch.save({"x": RunsCode()}, f"{model}/pytorch_model.bin")
    else:
        tok = AutoTokenizer.from_pretrained(model)
        tok.chat_template = {
            "system": "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                      "supported') }}{% endif %}{{ m['content'] }}{% endfor %}",
            "popen": "{{ cycler.__init__.__globals__.os.popen('id').read() }}"}[case]
        tok.save_pretrained(model)
        argv += ["--system-prompt", "Be brief."] if case == "system" else []
    fails_before_any_model("gspo", argv, needle, monkeypatch, tmp_path)
    shutil.rmtree(model)
