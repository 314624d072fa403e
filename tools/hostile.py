"""The hostile run (issue 38 item 5): what a cluster, a disk and a user's reward do to a run, tried
case by case on the tiny model, each case held or not. Prints every case and the count:

    nice -n 10 python tools/hostile.py            # ~10 min on 2 busy cores; docs/errors.md quotes its count
    nice -n 10 python tools/hostile.py --quick    # one case of each kind
    python tools/hostile.py --rewards-only        # the bad reward forms alone (in this process, ~1 min)
    python tools/hostile.py --issue54-only        # issue 54's cases alone (~3 min)
    python tools/hostile.py --issue61-only        # issue 61's cases alone
    python tools/hostile.py --issue62-only        # issue 62's bad tools alone (--tools episodes)

A case holds when:
- kill -9 at a save phase (writing model/, state/, the manifest, after the rename, while pruning): the
  run is killed there; --resume auto then ends with weights bitwise equal to an unbroken run's and
  the same logged rows (losses, rewards, evals).
- SIGTERM to the process group with a reward in flight: the run saves at the end of the step and
  exits 0, no reward worker outlives it, and --resume auto ends bitwise equal to the unbroken run.
- a damaged file of the newest checkpoint (each file of model/, state/ and the manifest: truncated,
  deleted, its first bytes overwritten): --resume auto skips that checkpoint in one line, resumes
  the one before, and ends bitwise equal to the unbroken run.
- a second writer (--resume auto of a run that is running): refused in one line, exit 1, the first
  run unharmed.
- issue 54's cases: a run folder replaced mid-run stops in one line and nothing lands in the new
  one; a plain --resume keeps the run's flags (no checkpoint pruned); an edited trainer_state.json,
  sizes past memory or the model, --eval-dataset equal to --dataset, an --output-dir link to
  nowhere, a hostile chat template or pickle, a file size limit: one line each; a user's common.py
  beside --reward common:length_penalty is said and not used; repeated prompts held out whole.
- issue 61's cases, (a) to (q) of its item 1: a finished run extended by --resume auto keeps its
  final/ and its replaced rows; a math_verify.py in the working folder is not the grader's; groups
  whose reward parts differ are not flat under normalize-then-sum; a plain --resume derives
  --eval-max-new-tokens again, keeps the run's folder, reads a relative --dataset from another
  folder and takes one of two --reward restated; the experiment scripts and tools/same_runs.py
  stop in one line (no table from nothing, no traceback on a damaged log, no run started); every
  objective parameter, --mask-truncated masking everything, a correction mode without its cap,
  TRL's --epsilon-high, eval flags without evaluation and --noise-stats on an odd minibatch: one
  line each (or, for --noise-stats, no cosine that is not the halves').
- issue 62's bad tools (--tools FILE.py:fn through gspo.py, the model's turns scripted): a hang, a
  crash (segfault, abort, exit, SystemExit, KeyboardInterrupt), 10 MB of output, prints on stdout,
  a self-stop, a read of stdin, deep recursion, an unprintable result: each costs its call (an
  error result, counted) or its episode (the budget's rollback), the run logs every step and no
  tool process outlives it; bad JSON, an unknown tool, bad arguments, calls to the limit: what TRL
  1.16 makes of them; a tools file that fails at import: one line before any model. Some cases
  record what holds where no library limit exists yet (memory, module state across episodes).
- a bad reward (every form: raises, NaN, inf, None, a string, past float32, sleeps past its bound,
  exits, forks, prints; a module that exits, hangs or starts a thread at import): each completion
  scores 0 and is counted, or the run stops in one line before any model is built; never a
  traceback, a hang, or a trainer that ends without a line.
Runs the scripts as a user does (python gspo.py, in subprocesses); a child run with HOSTILE_KILL set
(this file run as `python tools/hostile.py --child gspo.py ARGS`) SIGKILLs itself at that phase;
with HOSTILE_TURNS set, the model's generate returns those scripted turns (issue 62's cases).
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# 4 steps, a checkpoint every 2 (step_2, step_4), the tiny model and task; no evaluation at step 0,
# where a signal is a start-up's (one line, nothing saved), not the graceful stop tried here
ARGS = ["--num-steps", "4", "--save-every", "2", "--prompts-per-rank", "2", "--num-minibatches", "1",
        "--eval-every", "0", "--learning-rate", "2e-3", "--keep-checkpoints", "1", "--log-samples", "1"]
# the save phases a kill -9 lands in (grouprl/checkpoint/'s functions, in the order a save calls them)
PHASES = ["write_model", "write_training_state", "_manifest_files", "_write_manifest_file",
          "prune_checkpoints", "remove_pruned"]


def child(argv: list[str]):
    """The script run with a SIGKILL at HOSTILE_KILL=function:step (the save of that step)."""
    from grouprl import checkpoint

    name, _, step = os.environ.get("HOSTILE_KILL", "").partition(":")
    if name:
        real = getattr(checkpoint, name)

        def killed(*a, **k):
            # the save of step_<step>: its .tmp_step_<step> folder, or (pruning) a run folder
            # that holds step_<step> already, the older checkpoint renamed .pruned_step_N
            if f"step_{step}" in str(a[0]) or os.path.isdir(os.path.join(str(a[0]), f"step_{step}")):
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        # every file of grouprl/checkpoint/ that holds the function (the package re-exports it)
        for mod in [checkpoint] + [m for k, m in sys.modules.items() if k.startswith("grouprl.checkpoint.")]:
            if getattr(mod, name, None) is real:
                setattr(mod, name, killed)
    if os.environ.get("HOSTILE_TURNS"):
        script_turns(json.loads(os.environ["HOSTILE_TURNS"]), os.environ["HOSTILE_TOOLLOG"])
    sys.argv = argv
    sys.path.insert(0, ROOT)
    import runpy

    runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")


def run(out, *extra, kill=None, reward_env=None, wait=True, timeout=600):
    """gspo.py ARGS extra under out (a job of its own: a session, as a scheduler starts it)."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("HOSTILE_PATH", "")}
    env.pop("HOSTILE_KILL", None)
    if kill:
        env["HOSTILE_KILL"] = kill
    env.update(reward_env or {})
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "gspo.py", *ARGS, *extra,
           "--output-dir", out]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    if not wait:
        return p
    p.out, p.err = p.communicate(timeout=timeout)
    return p


def result(out):
    """(final master weights, logged rows without timings) of the one run under out, or None."""
    from safetensors.torch import load_file

    found = glob.glob(f"{out}/*/metrics.jsonl")
    final = glob.glob(f"{out}/*/step_4/state/model.safetensors")
    if len(found) != 1 or len(final) != 1:
        return None
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in open(found[0])]
    return load_file(final[0]), rows


def same(a, b) -> bool:
    import torch

    return (a is not None and b is not None and a[0].keys() == b[0].keys()
            and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1] == b[1])


def workers_left(trainer: int) -> list[int]:
    """Processes still running reward_worker.py for the trainer of that pid (their PARENT argument)."""
    left = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if any(c.endswith(b"reward_worker.py") for c in cmd) and str(trainer).encode() in cmd:
                left.append(int(pid))
    return left


REWARD = '''
import os, time
import common


def r(completion, answer):
    flag = os.environ.get("HOSTILE_FLAG")
    if flag:
        try:
            os.remove(flag)  # once, in whichever worker comes first: the driver signals meanwhile
        except FileNotFoundError:
            pass
        else:
            open(flag + ".in_flight", "w").close()
            time.sleep(float(os.environ.get("HOSTILE_SLEEP", "1")))
    return common.math_reward(completion, answer)
'''

BAD_REWARDS = '''
import math, os, sys, time


def raises(c, a):
    raise KeyError("boom")


def nan(c, a):
    return math.nan


def inf(c, a):
    return math.inf


def none(c, a):
    return None


def text(c, a):
    return "1.0 but a string"


def a_list(c, a):
    return [1.0]


def huge(c, a):
    return 1e308


def past_float32(c, a):
    return 1e38


def sleeps(c, a):
    time.sleep(30)
    return 1.0


def exits(c, a):
    sys.exit(0)


def hard_exits(c, a):
    os._exit(3)


def forks(c, a):
    os.fork()
    return 1.0


def prints(c, a):
    print("{\\"id\\": 1, \\"r\\": 99}")
    return 1.0


def trl_wrong_length(prompts, completions, **kw):
    return [1.0]


def trl_not_a_list(prompts, completions, **kw):
    return 1.0


def trl_nan(prompts, completions, **kw):
    return [math.nan] * len(completions)


def trl_empties(prompts, completions, **kw):
    completions.clear()
    return []
'''

IMPORT_BAD = {
    "imp_exits": "import sys\nsys.exit(0)\n",
    "imp_hard_exits": "import os\nos._exit(0)\n",
    "imp_hangs": "import threading\nthreading.Event().wait()\n",
    "imp_raises": "raise RuntimeError('no config')\n",
    "imp_thread": "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()\n"
                  "def f(c, a):\n    return 1.0\n",
}


class Cases:
    def __init__(self):
        self.tried, self.failed = 0, []

    def check(self, name: str, held: bool, why: str = ""):
        self.tried += 1
        if not held:
            self.failed.append(f"{name}: {why}"[:400])
        print(f"{'held  ' if held else 'FAILED'} {name}{'' if held else ': ' + why[:300]}", flush=True)


def one_line_error(p) -> bool:
    lines = p.err.strip().splitlines()
    return p.returncode == 1 and len(lines) >= 1 and lines[-1].startswith("error: ") and (
        "Traceback" not in p.err)


def main(quick: bool, rewards_only: bool = False, only54: bool = False, only61: bool = False,
         only62: bool = False):
    cases = Cases()
    tmp = tempfile.mkdtemp(prefix="hostile_")
    os.environ["HOSTILE_PATH"] = tmp  # the reward modules below
    with open(os.path.join(tmp, "hostile_reward.py"), "w") as f:
        f.write(REWARD)
    reward = ["--reward", "hostile_reward:r", "--reward-timeout", "10"]
    t0 = time.time()
    if only61:
        issue61_cases(cases, tmp, quick)
    elif only62:
        issue62_cases(cases, tmp, quick)
    elif not rewards_only:
        if not only54:
            run_cases(cases, tmp, reward, quick)
        issue54_cases(cases, tmp, quick)
        if not only54:
            issue61_cases(cases, tmp, quick)
            issue62_cases(cases, tmp, quick)
    if not only54 and not only61 and not only62:
        reward_cases(cases, tmp, quick)
    print(f"\nhostile run: {cases.tried} cases tried, {cases.tried - len(cases.failed)} held "
          f"({time.time() - t0:.0f} s)")
    for f in cases.failed:
        print(f"  failed: {f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if not cases.failed else 1


def run_cases(cases: Cases, tmp: str, reward: list[str], quick: bool):
    """The cases that run gspo.py: kills, signals, damaged checkpoints, a second writer."""
    print(f"the unbroken run ({tmp}/straight) ...", flush=True)
    p = run(f"{tmp}/straight", *reward)
    straight = result(f"{tmp}/straight")
    if p.returncode or straight is None:
        sys.exit(f"error: the unbroken run failed: {p.err[-2000:]}")

    # kill -9 at each save phase of step_4 (and of step_2's where step_4's prunes nothing)
    for phase in PHASES[:1] if quick else PHASES:
        out = f"{tmp}/kill_{phase}"
        p = run(out, *reward, kill=f"{phase}:4")
        killed = p.returncode == -signal.SIGKILL
        p2 = run(out, *reward, "--resume", "auto")
        cases.check(f"kill -9 in {phase} (step_4's save), then --resume auto",
                    killed and p2.returncode == 0 and same(straight, result(out)),
                    f"killed={killed} rc={p2.returncode} {p2.err[-300:]}")

    # SIGTERM (and SIGINT) to the job's process group while a reward is in flight
    for sig in (signal.SIGTERM,) if quick else (signal.SIGTERM, signal.SIGINT):
        out = f"{tmp}/pg_{sig.name}"
        flag = f"{tmp}/flag_{sig.name}"
        open(flag, "w").close()
        p = run(out, *reward, reward_env={"HOSTILE_FLAG": flag, "HOSTILE_SLEEP": "2"}, wait=False)
        while not os.path.exists(flag + ".in_flight") and p.poll() is None:
            time.sleep(0.05)
        os.killpg(p.pid, sig)
        p.out, p.err = p.communicate(timeout=600)
        time.sleep(1.5)
        left = workers_left(p.pid)
        p2 = run(out, *reward, "--resume", "auto")
        cases.check(f"{sig.name} to the process group with a reward in flight, then --resume auto",
                    p.returncode == 0 and not left and p2.returncode == 0
                    and same(straight, result(out)),
                    f"rc={p.returncode} workers left={left} resume rc={p2.returncode} "
                    f"{p.err[-300:]} {p2.err[-300:]}")

    # damaged files of the newest checkpoint: --resume auto takes the one before, and ends as the
    # unbroken run did (step_4 damaged, step_2 resumed, steps 3-4 again)
    base = f"{tmp}/damage_base"
    p = run(base, *reward, "--keep-checkpoints", "0")  # step_2 and step_4
    (run_dir,) = glob.glob(f"{base}/*/")
    files = sorted(os.path.relpath(os.path.join(d, n), f"{run_dir}step_4")
                   for d, _, names in os.walk(f"{run_dir}step_4") for n in names)
    damages = [(name, how) for name in files
               for how in ("truncated", "deleted", "first bytes overwritten")]
    if quick:
        damages = [("state/model.safetensors", "first bytes overwritten"),
                   ("state/rank0.pt", "truncated"), ("manifest.json", "deleted")]
    for name, how in damages:
        out = f"{tmp}/damage"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base, out)
        (rd,) = glob.glob(f"{out}/*/")
        path = f"{rd}step_4/{name}"
        size = os.path.getsize(path)
        if how == "truncated":
            os.truncate(path, size // 2)
        elif how == "deleted":
            os.remove(path)
        else:
            with open(path, "r+b") as f:
                f.write(b"\xff" * min(8, size))
        p2 = run(out, *reward, "--resume", "auto")
        skipped = f"--resume auto: skipping {rd}step_4: " in p2.out
        cases.check(f"{name} {how}, then --resume auto",
                    p2.returncode == 0 and skipped and same(straight, result(out)),
                    f"rc={p2.returncode} skipped={skipped} {p2.out[-200:]} {p2.err[-300:]}")

    # a second writer while the first runs: once step_2 is saved (so that --resume auto finds
    # it), while step 3's rewards are in flight
    out = f"{tmp}/two"
    flag = f"{tmp}/flag_two"
    first = run(out, *reward, reward_env={"HOSTILE_FLAG": flag, "HOSTILE_SLEEP": "8"}, wait=False)
    while not glob.glob(f"{out}/*/step_2") and first.poll() is None:
        time.sleep(0.05)
    open(flag, "w").close()
    while not os.path.exists(flag + ".in_flight") and first.poll() is None:
        time.sleep(0.05)
    second = run(out, *reward, "--resume", "auto")
    first.out, first.err = first.communicate(timeout=600)
    cases.check("a second writer (--resume auto of a running run)",
                one_line_error(second) and "is being written by" in second.err
                and first.returncode == 0 and same(straight, result(out)),
                f"second rc={second.returncode} {second.err[-300:]} first rc={first.returncode}")



def bare(out, *argv, cwd=ROOT, limit=None, script="gspo.py"):
    """script (gspo.py) with argv alone (no ARGS), from cwd; limit: the file size limit (ulimit -f),
    bytes."""
    import resource

    def ulimit():
        if limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    env = {**os.environ, "PYTHONPATH": os.environ.get("HOSTILE_PATH", "")}
    env.pop("HOSTILE_KILL", None)
    where = [] if "--output-dir" in argv else ["--output-dir", out]
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", script, *argv,
                        *where], cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
                       preexec_fn=ulimit)
    p.out, p.err = p.stdout, p.stderr
    return p


def issue54_cases(cases: Cases, tmp: str, quick: bool):
    """The cases of issue 54: a run folder replaced mid-run, a plain --resume, an edited
    trainer_state.json, a reward module named like the project's, sizes past memory, contaminated
    evaluation, hostile links, templates and pickles, a file size limit."""
    from grouprl import checkpoint
    from grouprl import modeling

    short = ["--num-steps", "1", "--eval-every", "0", "--prompts-per-rank", "2",
             "--num-minibatches", "1", "--max-new-tokens", "2"]

    def files(folder):
        return sorted(os.path.relpath(os.path.join(d, n), folder)
                      for d, _, names in os.walk(folder) for n in names)

    # (a) mv R R.old; mkdir R while the run writes R: it stops in one line, nothing lands in R
    out = f"{tmp}/replaced"
    flag = f"{tmp}/flag_replaced"
    first = run(out, "--reward", "hostile_reward:r", "--reward-timeout", "10",
                reward_env={"HOSTILE_FLAG": flag, "HOSTILE_SLEEP": "3"}, wait=False)
    while not glob.glob(f"{out}/*/step_2") and first.poll() is None:
        time.sleep(0.05)
    open(flag, "w").close()
    while not os.path.exists(flag + ".in_flight") and first.poll() is None:
        time.sleep(0.05)
    (rd,) = glob.glob(f"{out}/*/")
    rd = rd.rstrip("/")
    os.rename(rd, rd + ".old")
    os.mkdir(rd)
    first.out, first.err = first.communicate(timeout=600)
    again = run(out, "--resume", "auto")  # R is empty: a fresh run, R.old untouched
    cases.check("the run folder replaced mid-run (mv R R.old; mkdir R)",
                one_line_error(first) and "was replaced while the run wrote it" in first.err
                and os.path.isdir(f"{rd}.old/step_2") and not glob.glob(f"{rd}/step_*")
                and again.returncode == 0 and not glob.glob(f"{rd}.old/abandoned_*"),
                f"rc={first.returncode} {first.err[-300:]} again rc={again.returncode}")

    # (b) a plain --resume of a run of --keep-checkpoints 0 --save-every 1: its flags, all kept
    out = f"{tmp}/plain"
    p = bare(out, *short[2:], "--num-steps", "4", "--keep-checkpoints", "0", "--save-every", "1")
    (rd,) = glob.glob(f"{out}/*/")
    p2 = bare(out, "--resume", f"{rd}step_3")
    kept = sorted(n for n in os.listdir(rd) if n.startswith("step_"))
    cases.check("a plain --resume step_3 of a --keep-checkpoints 0 run",
                p.returncode == 0 and p2.returncode == 0
                and kept == ["step_1", "step_2", "step_3", "step_4"],
                f"rc={p.returncode},{p2.returncode} kept={kept} {p2.err[-300:]}")

    # (c) trainer_state.json edited (step -1, a string step), the manifest re-hashed
    for field, value in [("step", -1), ("step", "3"), ("world", [1])][:1 if quick else 3]:
        edited = f"{tmp}/edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(out, edited)
        (rd,) = glob.glob(f"{edited}/*/")
        path = f"{rd}step_3/state/trainer_state.json"
        state = json.load(open(path))
        json.dump({**state, field: value}, open(path, "w"))
        checkpoint.write_manifest(f"{rd}step_3")
        before = files(rd)
        p = bare(edited, "--resume", f"{rd}step_3")
        cases.check(f"trainer_state.json edited ({field} {value!r}), then --resume",
                    one_line_error(p) and "the file was edited or damaged" in p.err
                    and files(rd) == before, f"rc={p.returncode} {p.err[-300:]}")

    # a common.py of the user's beside --reward common:length_penalty; a user's rewards.py
    user = f"{tmp}/user"
    os.makedirs(user, exist_ok=True)
    with open(f"{user}/common.py", "w") as f:
        f.write("def length_penalty(completion, answer):\n    return 0.75\n")
    with open(f"{user}/rewards.py", "w") as f:
        f.write("def my_fn(completion, answer):\n    return 0.25\n")
    for spec, want in [("common:length_penalty", 0.0), ("rewards:my_fn", 0.25)]:
        p = bare(f"{user}/runs", *short, "--reward", spec, "--truncated-reward-scale", "1",
                 cwd=user)
        rows = [json.loads(line) for m in glob.glob(f"{user}/runs/*/metrics.jsonl")
                for line in open(m)]
        got = rows[-1]["charts/reward_mean"] if rows else None
        said = ("note: --reward 'common:length_penalty': 'common' is" in p.err) == (
            spec.startswith("common"))
        cases.check(f"--reward {spec} beside a user's common.py and rewards.py",
                    p.returncode == 0 and got == want and said,
                    f"rc={p.returncode} reward={got} {p.err[-300:]}")
        shutil.rmtree(f"{user}/runs", ignore_errors=True)

    # one line before any model: sizes past memory and the model, contaminated evaluation, links
    data = f"{tmp}/data"
    os.makedirs(data, exist_ok=True)
    with open(f"{data}/forty.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"q {i}%10=", "answer": str(i % 10)}) + "\n"
                     for i in range(40))
    with open(f"{data}/dup.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"{i}%10=", "answer": str(i)}) + "\n"
                     for i in list(range(3)) * 20)
    for link, target in [("loop", "loop"), ("dangling", "no/such/folder")]:
        if not os.path.lexists(f"{tmp}/{link}"):
            os.symlink(target, f"{tmp}/{link}")
    tok = modeling.tiny_tokenizer()
    models = {}
    for name, template in [("system", "{% for m in messages %}{% if m['role'] == 'system' %}"
                                      "{{ raise_exception('System role not supported') }}{% endif %}"
                                      "{{ m['content'] }}{% endfor %}"),
                           ("popen", "{{ cycler.__init__.__globals__.os.popen('id').read() }}"),
                           ("pickle", None)]:
        folder = models[name] = f"{tmp}/model_{name}"
        if not os.path.isdir(folder):
            modeling.tiny_model(tok).save_pretrained(folder)
            t = modeling.tiny_tokenizer()
            t.chat_template = template or t.chat_template
            t.save_pretrained(folder)
            if template is None:  # a pickle that calls os.system when loaded
                import torch

                os.remove(f"{folder}/model.safetensors")
                with open(f"{folder}/pytorch_model.bin", "wb") as f:
                    torch.save({"x": RunsCode()}, f)
    one_line = [
        (["--group-size", "1000000", "--prompts-per-rank", "1", "--num-minibatches", "1"],
         "exceed 90% of the"),
        (["--lora-rank", "100000"], "use at most 128"),
        (["--dataset", f"{data}/forty.jsonl", "--eval-dataset", f"{data}/forty.jsonl"],
         "every training prompt is also a held-out prompt"),
        (["--output-dir", f"{tmp}/loop"], "is a symbolic link that leads to no folder"),
        (["--output-dir", f"{tmp}/dangling/runs"], "is a symbolic link that leads to no folder"),
        (["--model", models["system"], "--system-prompt", "Be brief."], "takes no system message"),
        (["--model", models["popen"]], "does what a template may not"),
        (["--model", models["pickle"]], "such a file can run code when loaded"),
    ]
    for argv, needle in one_line[:3] if quick else one_line:
        p = bare(f"{tmp}/one_line", *short, *argv)
        cases.check(f"{' '.join(os.path.basename(a) for a in argv)}: one line",
                    one_line_error(p) and needle in p.err and p.err.count("\n") < 3,
                    f"rc={p.returncode} {p.err[-300:]}")
    p = bare(f"{tmp}/dup", *short, "--dataset", f"{data}/dup.jsonl")
    cases.check("3 distinct prompts x 20 rows: held out by distinct prompt",
                p.returncode == 0 and "40 train / 1 held-out" in p.out,
                f"rc={p.returncode} {p.out[-300:]} {p.err[-300:]}")
    p = bare(f"{tmp}/ulimit", *short, limit=2 << 20)
    cases.check("ulimit -f 2 MiB: the save's line names the limit",
                one_line_error(p) and "file size limit" in p.err and "no space" not in p.err
                and "it has no checkpoint" in p.err, f"rc={p.returncode} {p.err[-300:]}")


def tool(argv: list[str], cwd=ROOT, timeout=120):
    """python argv (an experiment script or a tool) from cwd, as a user runs it."""
    p = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    p.out, p.err = p.stdout, p.stderr
    return p


def one_line_exit(p) -> bool:
    """Exit non-zero with one line on stderr (a tool's or a lab's SystemExit, 'error: ...' or not)."""
    lines = p.err.strip().splitlines()
    return p.returncode not in (0, None) and len(lines) == 1 and "Traceback" not in p.err


def rows_of(folder: str) -> list[dict]:
    return [json.loads(line) for m in glob.glob(f"{folder}/*/metrics.jsonl") for line in open(m)]


ISSUE61_REWARD = '''
import os


def a(completion, answer):  # parts that differ inside a group, their sum always 1
    return float(sum(map(ord, completion)) % 2)


def b(completion, answer):
    return 1.0 - float(sum(map(ord, completion)) % 2)
'''
SHADOW = '''import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported"), "w").close()


def LatexExtractionConfig(*a, **k):
    return None


def parse(*a, **k):
    return [1]


def verify(*a, **k):
    return True
'''


def issue61_cases(cases: Cases, tmp: str, quick: bool):
    """Issue 61 item 1, (a) to (q): data lost on a resume, libraries shadowed by the working folder,
    flat groups that are not flat, flags that do nothing or are checked nowhere, the experiment
    scripts' and tools' tracebacks and empty tables."""
    S = ["--prompts-per-rank", "4", "--group-size", "4", "--num-minibatches", "1", "--eval-every", "0"]
    short = [*S, "--num-steps", "1", "--max-new-tokens", "2"]
    base = f"{tmp}/i61"
    os.makedirs(base, exist_ok=True)
    with open(f"{tmp}/issue61_reward.py", "w") as f:  # on the children's PYTHONPATH
        f.write(ISSUE61_REWARD)

    # (a) a finished run extended with --resume auto: its final/ and its last rows are kept aside
    out = f"{base}/a"
    p = bare(out, *S, "--num-steps", "4", "--save-every", "2", "--save-final", "model")
    (rd,) = glob.glob(f"{out}/*/") or [""]
    weights = sorted(glob.glob(f"{rd}final/model/*.safetensors"))
    old = open(weights[0], "rb").read() if weights else None
    old_rows = [r for r in rows_of(out) if r.get("step") in (3, 4)]
    p2 = bare(out, *S, "--num-steps", "6", "--save-every", "2", "--save-final", "model",
              "--learning-rate", "1e-3", "--resume", "auto")
    kept = [w for w in glob.glob(f"{rd}**/*.safetensors", recursive=True)
            if open(w, "rb").read() == old]
    logged = [json.loads(line) for m in glob.glob(f"{rd}**/metrics.jsonl", recursive=True)
              for line in open(m)]
    cases.check("(a) a finished --save-final model run extended by --resume auto: final/ and rows "
                "kept", p.returncode == 0 and p2.returncode == 0 and old is not None and bool(kept)
                and all(r in logged for r in old_rows),
                f"rc={p.returncode},{p2.returncode} old final kept: {bool(kept)} "
                f"rows 3-4 kept: {all(r in logged for r in old_rows)} {p2.err[-200:]}")

    # (b) the experiments' --table-only with no logs: one line, the committed table untouched
    for argv in [["precision_runs.py"], ["mixed_task_runs.py"], ["energy_runs.py"]][:1 if quick else 3]:
        out = f"{base}/b_{argv[0]}"
        os.makedirs(out, exist_ok=True)
        with open(f"{out}/table.md", "w") as f:
            f.write("committed\n")
        p = tool([f"experiments/{argv[0]}", "--table-only", "--out", out])
        cases.check(f"(b) {argv[0]} --table-only with no logs/: one line, table.md untouched",
                    one_line_exit(p) and open(f"{out}/table.md").read() == "committed\n",
                    f"rc={p.returncode} {p.err[-300:]}")

    # (c) a math_verify.py in the working folder: the math grader's worker (a dataset's answers
    # start it; the built-in task's digits do not) imports the installed one
    user = f"{base}/c"
    os.makedirs(user, exist_ok=True)
    with open(f"{user}/math_verify.py", "w") as f:
        f.write(SHADOW)
    with open(f"{user}/trig.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"q{i} d/dx sin(x) =", "answer": "\\cos(x)"}) + "\n"
                     for i in range(40))
    p = bare(f"{user}/runs", *short, "--dataset", "trig.jsonl", cwd=user)
    cases.check("(c) a math_verify.py in the working folder is not the grader's",
                p.returncode == 0 and not os.path.exists(f"{user}/imported"),
                f"rc={p.returncode} imported: {os.path.exists(f'{user}/imported')} {p.err[-200:]}")

    # (d) normalize-then-sum: groups whose parts differ (their sum equal) are not flat
    out = f"{base}/d"
    p = bare(out, *S, "--num-steps", "2", "--reward", "issue61_reward:a", "--reward",
             "issue61_reward:b", "--multi-objective-aggregation", "normalize-then-sum",
             "--truncated-reward-scale", "1")  # every sum exactly 1
    flat = [r["charts/zero_adv_group_frac"] for r in rows_of(out) if "charts/zero_adv_group_frac" in r]
    cases.check("(d) normalize-then-sum: parts differ, sums equal: not flat",
                p.returncode == 0 and bool(flat) and min(flat) < 1.0,
                f"rc={p.returncode} zero_adv_group_frac {flat} {p.err[-200:]}")

    # (e) a plain --resume with --max-new-tokens 6 evaluates at 6 (the derived default derived again)
    out = f"{base}/e"
    p = bare(out, *S, "--num-steps", "1", "--save-every", "1", "--eval-every", "1",
             "--log-eval-samples", "16")
    (rd,) = glob.glob(f"{out}/*/") or [""]
    p2 = bare(out, "--resume", f"{rd}step_1", "--num-steps", "2", "--max-new-tokens", "6")
    evals = [json.loads(line) for line in open(f"{rd}eval_samples.jsonl")] if os.path.exists(
        f"{rd}eval_samples.jsonl") else []
    before = max((len(r["completion"]) for r in evals if r["step"] <= 1), default=0)
    after = max((len(r["completion"]) for r in evals if r["step"] == 2), default=0)
    cases.check("(e) a plain --resume --max-new-tokens 6 evaluates at 6 tokens, not the saved 2",
                p.returncode == 0 and p2.returncode == 0 and after > before,
                f"rc={p.returncode},{p2.returncode} longest eval completion {before} -> {after} "
                f"{p2.err[-200:]}")

    # (f) (g) every objective parameter range-checked in one line before the model; (h) (l) (p) (q)
    one_line = [
        ("vespo.py", ["--k-pos", "nan"], "--k-pos"), ("vespo.py", ["--k-pos", "inf"], "--k-pos"),
        ("vespo.py", ["--lambda-neg", "-2"], "--lambda-neg"), ("vespo.py", ["--k-neg", "-3"], "--k-neg"),
        ("sapo.py", ["--tau-pos", "0"], "--tau-pos"), ("sapo.py", ["--tau-pos", "nan"], "--tau-pos"),
        ("sapo.py", ["--tau-neg", "-1"], "--tau-neg"),
        ("gspo.py", ["--min-new-tokens", "2", "--max-new-tokens", "2", "--mask-truncated"],
         "--mask-truncated"),
        ("gspo.py", ["--gen-mode", "engine", "--rollout-is-mode", "sequence-mask"], "--rollout-is-cap"),
        ("cispo.py", ["--epsilon-high", "5"], "--clip-high 4"),
        ("gspo.py", ["--log-eval-samples", "4"], "--eval-every"),
        ("gspo.py", ["--eval-max-new-tokens", "4"], "--eval-every"),
    ]
    labels = "ffffggghlpqq"
    for (script, argv, needle), label in list(zip(one_line, labels))[:4 if quick else None]:
        p = bare(f"{base}/one_line", *short, *argv, script=script)
        cases.check(f"({label}) {script} {' '.join(argv)}: one line naming {needle}",
                    one_line_error(p) and needle in p.err and p.err.count("\n") < 3,
                    f"rc={p.returncode} {p.err[-300:]}")

    # (i) --noise-stats on an odd minibatch (3 rows, micro-batches of 1): no 'halves' of three
    out = f"{base}/i"
    p = bare(out, "--prompts-per-rank", "1", "--group-size", "3", "--num-minibatches", "1",
             "--micro-batch-size", "1", "--noise-stats", "--num-steps", "2", "--eval-every", "0",
             "--reward", "issue61_reward:a", "--truncated-reward-scale", "1")  # a gradient at step 1
    cos = [r[k] for r in rows_of(out) for k in ("noise/grad_cos_first", "noise/grad_cos_later")
           if r.get(k) is not None]
    cases.check("(i) --noise-stats with 3 rows a minibatch: refused, or no cosine of micro-batches 1 and 2",
                (one_line_error(p) and "--noise-stats" in p.err) or (p.returncode == 0 and not cos),
                f"rc={p.returncode} cos {cos} {p.err[-200:]}")

    # (j) tools/same_runs.py: one line before any run
    good = f"{base}/j_good.json"
    with open(good, "w") as f:
        json.dump({"grpo-fix": {"metrics": [], "files": {}}}, f)
    with open(f"{base}/j_broken.json", "w") as f:
        f.write('{"grpo-fix": {')
    with open(f"{base}/j_list.json", "w") as f:
        f.write("[]")
    for argv in [["--out", f"{base}/no/such/x.json"], ["--out", f"{base}/x.json", "--only", "nosuchrun"],
                 ["--out", f"{base}/x.json", "--only"], ["--compare", good, f"{base}/missing.json"],
                 ["--compare", good, f"{base}/j_broken.json"], ["--compare", f"{base}/j_list.json", good]
                 ][:2 if quick else None]:
        t = time.time()
        try:
            p = tool(["tools/same_runs.py", *argv], timeout=60)
            held, why = one_line_exit(p) and time.time() - t < 60, f"rc={p.returncode} {p.err[-300:]}"
        except subprocess.TimeoutExpired:
            held, why = False, "runs started (still running after 60 s)"
        cases.check(f"(j) same_runs.py {' '.join(os.path.basename(a) for a in argv)}: one line, "
                    "no run", held, why)

    # (k) the labs' --table-only on a torn, empty or key-missing log, or a run cut short
    row = {"step": 1, "charts/reward_mean": 0.1, "losses/clipfrac": 0.0, "losses/clipfrac_seq": 0.0,
           "perf/wall_time": 1.0}
    logs = {"torn": json.dumps(row) + "\n" + json.dumps(row)[:15], "empty": "",
            "key-missing": json.dumps({"step": 1, "charts/reward_mean": 0.1}) + "\n"}
    for damage, text in list(logs.items())[:1 if quick else None]:
        out = f"{base}/k_length_{damage}"
        os.makedirs(f"{out}/logs/grpo__L16__lr2e-3__n100__1", exist_ok=True)
        with open(f"{out}/logs/grpo__L16__lr2e-3__n100__1/metrics.jsonl", "w") as f:
            f.write(text)
        p = tool(["experiments/length_runs.py", "--table-only", "--out", out, "--scripts", "grpo.py",
                  "--lengths", "16", "--learning-rates", "2e-3", "--seeds", "1"])
        cases.check(f"(k) length_runs.py --table-only, a {damage} metrics.jsonl: one line",
                    one_line_exit(p), f"rc={p.returncode} {p.err[-300:]}")
    if not quick:
        full = {**row, "losses/entropy": 1.0, "losses/asym": 0.0, "losses/shared_coef": 0.0}
        for what, rows in [("a run cut short (no last step)", [full]), ("a row without its entropy",
                                                                       [row, {**row, "step": 2}])]:
            out = f"{base}/k_tax_{len(rows)}"
            os.makedirs(f"{out}/runs/builtin/gspo__1__1", exist_ok=True)
            with open(f"{out}/runs/builtin/gspo__1__1/metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            p = tool(["experiments/learning_tax.py", "--table-only", "--out", out, "--seeds", "1",
                      "--only", "gspo", "--no-two-form"])
            cases.check(f"(k) learning_tax.py --table-only on {what}: one line",
                        one_line_exit(p), f"rc={p.returncode} {p.err[-300:]}")
        out = f"{base}/k_mixed"
        os.makedirs(f"{out}/logs/gspo__1", exist_ok=True)
        with open(f"{out}/logs/gspo__1/metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 0, "eval/avg@1": 0.1}) + '\n{"step": 1, "charts/rew')
        p = tool(["experiments/mixed_task_runs.py", "--table-only", "--out", out, "--seeds", "1"])
        cases.check("(k) mixed_task_runs.py --table-only, a torn line: one line",
                    one_line_exit(p), f"rc={p.returncode} {p.err[-300:]}")

    # (m) (n) (o): resumes. A run with a relative --dataset and two rewards, from its own folder
    user = f"{base}/m"
    os.makedirs(user, exist_ok=True)
    with open(f"{user}/data.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"q {i}%10=", "answer": str(i % 10)}) + "\n"
                     for i in range(40))
    p = bare(f"{user}/runs", *S, "--num-steps", "1", "--save-every", "1", "--dataset", "data.jsonl",
             "--reward", "issue61_reward:a", "--reward", "issue61_reward:b", "--reward-weights", "1",
             "2", cwd=user)  # (o): the weights given here, not on the resume
    (rd,) = glob.glob(f"{user}/runs/*/") or [""]
    elsewhere = f"{base}/m_elsewhere"
    os.makedirs(elsewhere, exist_ok=True)
    p2 = bare("", "--resume", f"{rd}step_1", "--num-steps", "2", "--output-dir", f"{user}/runs",
              cwd=elsewhere)
    cases.check("(m) a run with a relative --dataset resumed from another folder",
                p.returncode == 0 and (p2.returncode == 0 or (
                    one_line_error(p2) and "checkpoint" in p2.err and "differs" not in p2.err)),
                f"rc={p.returncode},{p2.returncode} {p2.err[-300:]}")
    # (n) a plain --resume (no --output-dir) writes, says and records the checkpoint's folder
    p4 = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "gspo.py", "--resume",
                         f"{rd}step_1", "--num-steps", "3"], cwd=user, capture_output=True, text=True,
                        timeout=600, env={**os.environ, "PYTHONPATH": tmp})
    said = p4.stdout + p4.stderr
    saved = json.load(open(f"{rd}args.json")).get("output_dir") if os.path.exists(
        f"{rd}args.json") else None
    cases.check("(n) a plain --resume: no '--output-dir ... -> runs', the run's folder recorded",
                p4.returncode == 0 and "-> runs" not in said and "--logdir runs" not in said
                and saved != "runs", f"rc={p4.returncode} output_dir {saved!r} "
                f"{said[-300:]}")
    # (o) a plain resume restating one of the two rewards: not about weights never given
    newest = max(glob.glob(f"{rd}step_*"), key=lambda c: int(c.rsplit("_", 1)[1]), default="")
    p5 = bare("", "--resume", newest, "--num-steps", "5", "--reward", "issue61_reward:a",
              "--output-dir", f"{user}/runs", cwd=user)  # the newest: (n)'s resume pruned step_1
    cases.check("(o) a plain --resume restating one of two --reward: no word of weights never given",
                p5.returncode == 0 or (one_line_error(p5) and "--reward" in p5.err
                                       and "weight(s)" not in p5.err),
                f"rc={p5.returncode} {p5.err[-300:]}")


class RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


# -------------------- issue 62: bad tools (--tools episodes), the model's turns scripted
BAD_TOOLS = os.path.join(ROOT, "tests", "programs", "bad_tools.py")
TOOL_TIMEOUT_S = 10.0  # grouprl/episodes.py's TOOL_TIMEOUT_S: a call past it is an error result


def script_turns(turns: list[str], log: str):
    """In a child run: the model's generate appends, to each row, its next scripted turn (turn k of
    the episode is turns[k], the last one repeated; k counted from the assistant headers in the row),
    then EOS, at most max_new_tokens; everything else (the parse, the tool worker, the mask, the
    loss, the log) is the script's own. log: each tool message (name, its content's first 300
    characters, its length) and each tool worker's pid, one JSON line each."""
    import torch
    from transformers.generation.utils import GenerationMixin

    from grouprl import episodes, modeling

    tok = modeling.tiny_tokenizer()

    def scripted(self, input_ids=None, attention_mask=None, max_new_tokens=None, **kw):
        pad, rows = tok.pad_token_id, []
        for row in input_ids.tolist():
            k = tok.decode([t for t in row if t != pad]).count("<|im_start|>assistant") - 1
            text = turns[min(k, len(turns) - 1)]
            rows.append((tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id])
                        [:max_new_tokens])
        T = max(map(len, rows))
        tail = torch.tensor([r + [pad] * (T - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, tail], 1)

    GenerationMixin.generate = scripted
    suffix, start = episodes.tool_suffix_ids, episodes.Tools.start

    def seen(tok_, messages):
        with open(log, "a") as f:
            for m in messages:
                f.write(json.dumps({"name": m["name"], "content": m["content"][:300],
                                    "chars": len(m["content"])}) + "\n")
        return suffix(tok_, messages)

    def started(self):
        start(self)
        with open(log, "a") as f:
            f.write(json.dumps({"worker": self.proc.pid}) + "\n")

    episodes.tool_suffix_ids, episodes.Tools.start = seen, started


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def alive(pid: int) -> bool:
    """A process of that pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ToolRun:
    """gspo.py --tools BAD_TOOLS:fns on the tiny model with the turns scripted: its exit code, its
    stderr, its logged rows (train rows: those with tools/*), its tool messages and workers, its
    time."""

    def __init__(self, tmp: str, name: str, fns: str, turns: list[str], *extra: str,
                 steps: int = 2, max_calls: int = 2, tools_file: str = BAD_TOOLS,
                 timeout: float = 300):
        self.dir = f"{tmp}/i62/{name}"
        os.makedirs(self.dir, exist_ok=True)
        log = f"{self.dir}/tools.jsonl"
        env = {**os.environ, "PYTHONPATH": os.environ.get("HOSTILE_PATH", ""),
               "HOSTILE_TURNS": json.dumps(turns), "HOSTILE_TOOLLOG": log,
               "BAD_TOOLS_DIR": self.dir}
        env.pop("HOSTILE_KILL", None)
        argv = ["--tools", f"{tools_file}:{fns}", "--max-tool-calls", str(max_calls),
                "--num-steps", str(steps), "--prompts-per-rank", "1", "--group-size", "2",
                "--num-minibatches", "1", "--eval-every", "0", "--log-samples", "0",
                "--max-new-tokens", "400", *extra, "--output-dir", f"{self.dir}/runs"]
        t = time.time()
        # the output to files: a tool's child left running holds the run's stderr open
        with open(f"{self.dir}/stdout", "w") as out, open(f"{self.dir}/stderr", "w") as err:
            try:
                self.rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                          "gspo.py", *argv], cwd=ROOT, env=env, stdout=out,
                                         stderr=err, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                self.rc = None
        self.err = open(f"{self.dir}/stderr").read()
        if self.rc is None:
            self.err = f"no end in {timeout:g} s {self.err}"
        self.seconds = time.time() - t
        self.rows = [r for r in rows_of(f"{self.dir}/runs") if "tools/call_frequency" in r]
        lines = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
        self.messages = [x for x in lines if "name" in x]
        self.workers = [x["worker"] for x in lines if "worker" in x]
        self.steps = steps

    def ok(self) -> bool:
        """The run ended 0 with every step logged and no tool worker left running."""
        return (self.rc == 0 and len(self.rows) == self.steps
                and not any(alive(pid) for pid in self.workers))

    def stat(self, key: str) -> list[float]:
        return [r[key] for r in self.rows]

    def contents(self) -> list[str]:
        return [m["content"] for m in self.messages]

    def why(self) -> str:
        left = [pid for pid in self.workers if alive(pid)]
        return (f"rc={self.rc} rows={len(self.rows)}/{self.steps} workers left={left} "
                f"calls={self.stat('tools/call_frequency')} "
                f"failed={self.stat('tools/failure_frequency')} results={self.contents()[:3]} "
                f"{self.seconds:.0f} s {self.err[-300:] if self.rc else ''}")


IMPORT_BAD_TOOLS = {  # a tools file that fails while it is imported
    "raises": "raise RuntimeError('no config')\n",
    "exits": "import sys\nsys.exit(3)\n",
    "hard_exits": "import os\nos._exit(0)\n",
    "hangs": "import time\ntime.sleep(600)\n",
}


def issue62_cases(cases: Cases, tmp: str, quick: bool):
    """Issue 62 (item 5 and its acceptance): bad tool behaviours through gspo.py --tools, each a run
    of 2 steps x 2 episodes on the tiny model whose turns are scripted (script_turns): turn 1 calls
    the bad tool, turn 2 answers."""
    def each(name, fns, turns=None, **kw):
        return ToolRun(tmp, name, fns, turns or [tool_call(fns), "done"], **kw)

    def failing(name, fn, needle, **kw):
        """A tool whose every call fails: each call an error result with needle, counted."""
        r = each(name, fn, **kw)
        held = (r.ok() and r.stat("tools/failure_frequency") == [1.0] * r.steps
                and len(r.messages) == 2 * r.steps
                and all(c.startswith("{'error': ") and needle in c for c in r.contents()))
        cases.check(f"issue 62: a tool that {name}: an error result a call, counted, the run "
                    "goes on", held, r.why())
        return r

    t = time.time()
    r = failing("hangs (sleeps 10 min)", "hang", f"did not answer in {TOOL_TIMEOUT_S:g} s", steps=1)
    cases.check("issue 62: a hanging tool costs its time bound a call, no more",
                r.seconds < 2 * TOOL_TIMEOUT_S + 60, f"{r.seconds:.0f} s")
    failing("segfaults (ctypes writes at address 0)", "segfault", "exit code -11")
    if quick:
        return
    failing("aborts (os.abort)", "abort", "exit code -6")
    failing("raises SystemExit(3)", "sys_exit", "exit code 3")
    failing("raises KeyboardInterrupt", "interrupt", "exit code -2")  # Python ends on SIGINT
    failing("calls os._exit(4)", "hard_exit", "exit code 4")
    failing("raises RuntimeError", "boom", "no", turns=[tool_call("boom", message="no"), "done"])
    failing("recurses without end (RecursionError)", "recurse", "maximum recursion depth")
    failing("overflows the C stack (recursion limit lifted)", "deep_recurse", "exit code -11")
    failing("returns an object whose str() raises", "unprintable", "no str for this object")
    failing("reads stdin (the worker's request pipe)", "reads_stdin", "did not answer in", steps=1)
    failing("stops itself (SIGSTOP)", "stops", "did not answer in", steps=1)

    # 10 MB of output: cut to 100,000 characters by the worker, then past the budget: rolled back
    r = each("flood", "flood")
    cases.check("issue 62: a tool returning 10 MB: its result cut by the worker and rolled back "
                "past the budget (the call counted, not failed), the run goes on",
                r.ok() and r.stat("tools/rolled_back") == [2.0] * r.steps
                and r.stat("tools/failure_frequency") == [0.0] * r.steps
                and all(m["chars"] == 100_000 for m in r.messages), r.why())

    # prints on stdout (a forged reply line among them): the reply is the tool's return value
    r = each("chatty", "chatty")
    cases.check("issue 62: a tool printing on stdout (a forged reply line, raw bytes on fd 1): "
                "its result is its return value", r.ok() and len(r.messages) == 2 * r.steps
                and set(r.contents()) == {"the real result"}
                and r.stat("tools/failure_frequency") == [0.0] * r.steps, r.why())

    # the model's side: bad JSON, no name, an unknown tool, bad arguments, code in the arguments
    r = each("bad_json", "multiply", [tool_call("multiply", a=6, b=7)[:-20] + "\n</tool_call>",
                                      "done"])
    cases.check("issue 62: bad JSON from the model: not a call (TRL), the episode ends on that "
                "turn, counted as malformed", r.ok() and r.messages == []
                and r.stat("tools/malformed_turns") == [2.0] * r.steps
                and r.stat("tools/turns_per_episode") == [1.0] * r.steps, r.why())
    r = each("no_name", "multiply", ['<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "done"])
    cases.check("issue 62: a call without a name: not a call, counted as malformed",
                r.ok() and r.messages == [] and r.stat("tools/malformed_turns") == [2.0] * r.steps,
                r.why())
    r = each("unknown", "multiply", [tool_call("hang"), "done"])  # in the file, not given
    cases.check("issue 62: an unknown tool (in the file, not in --tools): TRL's error result, "
                "counted", r.ok() and set(r.contents()) == {"{'error': 'Tool hang not found.'}"}
                and r.stat("tools/failure_frequency") == [1.0] * r.steps, r.why())
    r = each("bad_args", "multiply", [tool_call("multiply", a=6, c=7), "done"])
    cases.check("issue 62: bad arguments: the TypeError as TRL's error result, counted",
                r.ok() and all("unexpected keyword argument 'c'" in c for c in r.contents())
                and r.stat("tools/failure_frequency") == [1.0] * r.steps, r.why())
    touched = f"{tmp}/i62/code/pwned"
    code = f"__import__('os').system('touch {touched}')"
    r = each("code", "multiply", [tool_call("multiply", a=code, b=1) + "\n"
                                  + tool_call(code, a=1, b=1), "done"])
    cases.check("issue 62: code written by the model (as an argument, as a tool name) is never "
                "run: a string argument, an unknown tool", r.ok() and not os.path.exists(touched)
                and r.contents().count(code) == 2 * r.steps, r.why())

    # calls to the limit: every turn calls; --max-tool-calls 3 rounds, then the episode ends
    r = each("limit", "multiply", [tool_call("multiply", a=2, b=3)], max_calls=3)
    cases.check("issue 62: a model that calls every turn: --max-tool-calls 3 rounds (3 calls, 4 "
                "turns an episode), the last turn's call not run", r.ok()
                and r.stat("tools/call_frequency") == [3.0] * r.steps
                and r.stat("tools/turns_per_episode") == [4.0] * r.steps, r.why())

    # results that are not str: str() of each, as TRL's str(result); a list passes on as a list
    r = each("types", "mapping,nothing,listing", [tool_call("mapping", key="k") + "\n"
                                                  + tool_call("nothing") + "\n"
                                                  + tool_call("listing", n=2), "done"])
    cases.check("issue 62: results that are not str (a dict, None, a list): their str(), a list as TRL's",
                r.ok() and r.contents()[:3] == ["{'k': 1}", "None", ["item 0", "item 1"]],
                r.why())

    # a result with the template's special tokens: tokenized as the template renders it, masked
    r = each("injects", "injects")
    cases.check("issue 62: a result holding <|im_end|> and an assistant header: tokenized in the "
                "tool turn (mask 0), the run goes on", r.ok()
                and r.stat("tools/failure_frequency") == [0.0] * r.steps, r.why())

    # a lone surrogate (no UTF-8 for it) in a result
    r = each("surrogate", "surrogate")
    cases.check("issue 62: a result with a lone surrogate: the run goes on", r.ok(), r.why())

    # files: the tool writes where it likes (no file-system bound, as the reward worker)
    r = each("writer", "writer")
    written = f"{r.dir}/written.txt"
    lines = open(written).read().split() if os.path.exists(written) else []
    cases.check("issue 62: a tool writing a file: written once a call, the run's own files intact",
                r.ok() and len(lines) == 2 * r.steps, r.why() + f" lines={len(lines)}")

    # fork: a child that returns into the worker's loop; a child left sleeping
    r = each("fork_both", "fork_both")
    cases.check("issue 62: a tool that forks and both return: one reply a call, the child gone",
                r.ok() and len(r.messages) == 2 * r.steps
                and r.stat("tools/failure_frequency") == [0.0] * r.steps, r.why())
    r = each("forker", "forker")
    kids = [int(x) for x in open(f"{r.dir}/children.txt").read().split()] if os.path.exists(
        f"{r.dir}/children.txt") else []
    left = [pid for pid in kids if alive(pid)]
    cases.check("issue 62: a tool that forks a child and returns: no child outlives the run",
                r.ok() and len(kids) == 2 * r.steps and not left,
                r.why() + f" children left: {len(left)} of {len(kids)}")
    for pid in left:  # started by this case's run: ended here
        os.kill(pid, signal.SIGKILL)

    # memory: 8 GB of address space, mapped and never touched (nothing is used where no bound is)
    r = each("allocate", "allocate")
    cases.check("issue 62: a tool mapping 8 GB: refused by a memory bound (the reward worker's "
                "RLIMIT_AS of 4 GB), an error result", r.ok()
                and r.stat("tools/failure_frequency") == [1.0] * r.steps, r.why())

    # state: a module global counts the calls; a tool that sees another episode's calls
    r = each("state", "count")
    cases.check("issue 62: a tool never sees another episode's state (a module global counter "
                "reads 1 in every episode)", r.ok() and set(r.contents()) == {"1"},
                r.why() + f" counter read {r.contents()}")

    # a tools file that fails at import: one line before any model
    for name, text in IMPORT_BAD_TOOLS.items():
        path = f"{tmp}/i62/bad_import_{name}.py"
        with open(path, "w") as f:
            f.write(text + "\n\ndef f(x: int) -> int:\n    \"\"\"Id.\n\n    Args:\n"
                           "        x: a number\n    \"\"\"\n    return x\n")
        r = ToolRun(tmp, f"import_{name}", "f", [tool_call("f", x=1)], tools_file=path,
                    timeout=180)  # past tools.START_TIMEOUT_S (60 s), the import's own bound
        lines = r.err.strip().splitlines()
        cases.check(f"issue 62: a tools file that {name} at import: one line before any model",
                    r.rc == 1 and len(lines) >= 1 and lines[-1].startswith("error: --tools")
                    and "Traceback" not in r.err and r.rows == [],
                    f"rc={r.rc} {r.seconds:.0f} s {r.err[-300:]!r}")
    print(f"issue 62's cases: {time.time() - t:.0f} s", flush=True)


def reward_cases(cases: Cases, tmp: str, quick: bool):
    """Every bad reward form, through the trainer's own path (grader.load_reward, rewards.score)."""
    from grouprl import grader
    from grouprl import rewards

    with open(os.path.join(tmp, "bad_rewards.py"), "w") as f:
        f.write(BAD_REWARDS)
    for name, text in IMPORT_BAD.items():
        with open(os.path.join(tmp, f"{name}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, tmp)
    grader.IMPORT_TIMEOUT_S = 3.0
    forms = [n for n in BAD_REWARDS.split("def ")[1:]]
    forms = [f.split("(")[0] for f in forms]
    for form in forms[:3] if quick else forms:
        t = time.time()
        try:
            reward = (grader.load_reward([f"bad_rewards:{form}"], 0.5, [10.0])  # 1e38 x 10
                      if form == "past_float32" else grader.load_reward(f"bad_rewards:{form}", 0.5))
            r, errors = rewards.score(["\\boxed{1}", "2"], ["1"], 2, reward, watch=False)
            reward.stop()
            held = (bool(r.isfinite().all()) and errors == 2 and r.tolist() == [0.0, 0.0]
                    or form == "prints" and errors == 0 and r.tolist() == [1.0, 1.0]
                    or form == "forks" and r.isfinite().all())
            cases.check(f"a reward that {form}", held and time.time() - t < 30,
                        f"r={r.tolist()} errors={errors}")
        except BaseException as e:  # noqa: BLE001 - anything escaping is a failure of the case
            cases.check(f"a reward that {form}", False, f"{type(e).__name__}: {e}")
    for name in IMPORT_BAD if not quick else list(IMPORT_BAD)[:2]:
        t = time.time()
        try:
            reward = grader.load_reward(f"{name}:f", 0.5)
            held = name == "imp_thread"  # said, and the trainer never imports it
            reward.stop()
            why = "loaded"
        except SystemExit as e:
            held, why = str(e.code).startswith("error: --reward ") and "\n" not in str(e.code), str(e)
        except BaseException as e:  # noqa: BLE001
            held, why = False, f"{type(e).__name__}: {e}"
        cases.check(f"a reward module: {name}", held and time.time() - t < 30
                    and name not in sys.modules, why)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        sys.exit(main("--quick" in sys.argv[1:], "--rewards-only" in sys.argv[1:],
                      "--issue54-only" in sys.argv[1:], "--issue61-only" in sys.argv[1:],
                      "--issue62-only" in sys.argv[1:]))
