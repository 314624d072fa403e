"""The learning-tax lab in its reduced form (--smoke): every part runs end to end from the scripts' own logs and
checkpoints, and the table it writes holds the measured numbers of each objective; the tables of the MoE and the
group-size ablations computed from hand-made metrics (fast)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_learning_tax_lab_smoke(tmp_path):
    p = subprocess.run([sys.executable, "experiments/learning_tax.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name in ("gspo", "dfpo min-replace --length-aware"):
        assert f"| {name} |" in table
        runs = summary["builtin"][name]
        assert len(runs) == 1 and len(runs[0]["curves"]["charts/reward_mean"]) == 3  # 1 seed, 3 steps, from the log
        two = summary["two_form"][name][0]
        assert two["steps"] == [0, 2, 4]  # the warm start, then the checkpoints of steps 2 and 4, measured exactly
        assert all(0 <= h <= 1 for h in two["h"]) and two["log_odds_drift"][0] == 0 == two["prefix_drift"][0]
        assert two["log_odds_drift"][-1] > 0  # the policy moved
    # the ablations' tables (issue 36 items 6 and 7): the MoE run's row, and the group size both objectives ran at
    assert "| gspo --model tiny-moe |" in table and "| 4 |" in table and "| 8 |" not in table
    moe = summary["moe"]["gspo --model tiny-moe"]
    assert moe["log_w_std_first"] == [0.0] and 0 < moe["route_flip_frac"][0] < 1  # pi = pi_old on minibatch 1
    assert len(summary["group_size"]["4"]["difference"]) == 1
    # the two forms differ in length; the length-aware transform cancels the shared first token "S" exactly (eq. 72),
    # GSPO does not
    assert max(summary["two_form"]["dfpo min-replace --length-aware"][0]["shared_coef"]) < 1e-6
    assert max(summary["two_form"]["gspo"][0]["shared_coef"]) > 1e-4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "table only, no plots" in p.stdout
    else:
        for png in ("builtin.png", "two_form.png", "ablations.png"):
            assert (tmp_path / png).stat().st_size > 10_000


def write_run(root, name: str, seed: int, rows: list[dict], jitter2: float):
    """A fake run folder as the scripts write it: metrics.jsonl, one row a step, the last with the run's Jitter2."""
    run = root / f"{name.replace(' ', '_')}__{seed}__1700000000"
    run.mkdir(parents=True)
    rows = [{"step": t + 1, "losses/entropy": 0.0, "losses/asym": 0.0, "losses/shared_coef": 0.0,
             "losses/clipfrac": 0.0, **r} for t, r in enumerate(rows)]
    rows[-1]["charts/reward_jitter2"] = jitter2
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_moe_and_group_size_tables_from_fake_runs(tmp_path):
    """The MoE table (issue 36 item 6) and the group-size table (item 7, the DFPO paper's Table 4) from hand-made
    metrics.jsonl files read as the lab reads real runs (--table-only), every cell computed by hand."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import learning_tax as lab

    root = tmp_path / "runs" / "builtin"
    # MoE: 20 steps, so the final reward is the mean of the last 2 (10%); log w variances and flips per step
    moe = {1: dict(reward=[0.2, 0.4], clip=[0.01] * 20, var_later=[0.01] * 10 + [0.03] * 10, flip=0.02, j=0.1),
           2: dict(reward=[0.5, 0.7], clip=[0.0] * 10 + [0.04] * 10, var_later=[0.0081] * 20, flip=0.04, j=0.3)}
    for seed, m in moe.items():
        write_run(root, "gspo --model tiny-moe", seed, [
            {"charts/reward_mean": r, "losses/clipfrac": c, "losses/log_ratio_var_first": 0.0,
             "losses/log_ratio_var_later": v, "moe/route_flip_frac": m["flip"], "moe/route_flip_frac_loss": 0.0}
            for r, c, v in zip([0.0] * 18 + m["reward"], m["clip"], m["var_later"])], m["j"])
    # group size: 10 steps (final reward = the last step's), 3 seeds, G = 4 and 8 (the scripts' default) only
    finals = {"gspo --group-size 4": [0.1, 0.2, 0.3], "dfpo min-replace --group-size 4": [0.4, 0.15, 0.35],
              "gspo": [0.25, 0.25, 0.25], "dfpo min-replace": [0.125, 0.5, 0.25]}
    for name, per_seed in finals.items():
        for seed, last in enumerate(per_seed, 1):
            write_run(root, name, seed, [{"charts/reward_mean": 0.0}] * 9 + [{"charts/reward_mean": last}], 0.0)

    args = lab.Args(out=str(tmp_path), table_only=True)
    r_moe = lab.part1(args, {"gspo --model tiny-moe": lab.MOE["gspo --model tiny-moe"]}, [1, 2])
    # reward: seeds 0.3, 0.6 -> 0.450 ± 0.212; Jitter2 0.1, 0.3 -> 0.200 ± 0.141; clip fraction 0.01, 0.02 ->
    # 0.0150 ± 0.0071; std log w later: sqrt of the step-mean variance, sqrt(0.02) = 0.141421 and sqrt(0.0081) = 0.09
    # -> 0.1157 ± 0.0364 (the mean of the per-step stds would give 0.1366 for seed 1); flips 0.02, 0.04 -> 0.0300 ±
    # 0.0141; the loss's flips 0
    assert lab.table_moe(r_moe).splitlines()[2] == (
        "| gspo --model tiny-moe | 0.450 ± 0.212 | 0.200 ± 0.141 | 0.0150 ± 0.0071 | 0.0e+00 ± 0.0e+00 | "
        "0.1157 ± 0.0364 | 0.0300 ± 0.0141 | 0.0000 ± 0.0000 |")

    r_g = lab.part1(args, {k: lab.PART1[k] for k in finals}, [1, 2, 3])
    lines = lab.table_group(r_g).splitlines()
    assert len(lines) == 4  # header, rule, G = 4, G = 8; no G = 16 row (not run)
    # G = 4: per-seed differences 0.30, -0.05, 0.05 -> 0.100 ± sqrt((0.2^2 + 0.15^2 + 0.05^2) / 2) = 0.180 (paired;
    # the two objectives' own stds are 0.100 and 0.132); 2 of 3 seeds ahead; the paper's +4.2
    assert lines[2] == "| 4 | 0.200 ± 0.100 | 0.300 ± 0.132 | 0.100 ± 0.180 | 2/3 | +4.2 |"
    # G = 8: differences -0.125, 0.25, 0 -> 0.042 ± sqrt((0.1667^2 + 0.2083^2 + 0.0417^2) / 2) = 0.191; 1/3 ahead
    assert lines[3] == "| 8 | 0.250 ± 0.000 | 0.292 ± 0.191 | 0.042 ± 0.191 | 1/3 | +5.6 |"
    assert lab.group_numbers(r_g)[4]["difference"] == pytest.approx([0.3, -0.05, 0.05], abs=1e-12)


def test_default_runs_pairs_each_command_with_the_base_by_seed(tmp_path):
    """experiments/default_runs.py's paired lines from hand-made metrics: 2 seeds, 10 steps (the last 10% is the last
    step), held-out avg@8 at steps 0 and 10. cispo minus grpo: seed 1 (0.6 - 0.5, 0.55 - 0.50), seed 2 (0.2 - 0.4,
    0.30 - 0.45); means 0.1 - 0.2 = -0.05 ± std(0.1, -0.2) = 0.212, and -0.05 ± std(0.05, -0.15) = 0.141."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import default_runs

    last = {("grpo.py", 1): (0.5, 0.50), ("grpo.py", 2): (0.4, 0.45), ("cispo.py", 1): (0.6, 0.55),
            ("cispo.py", 2): (0.2, 0.30)}
    for (name, seed), (reward, held) in last.items():
        run = tmp_path / f"{name}__{seed}__1"
        run.mkdir()
        rows = [{"step": 0, "eval/avg@8": 0.01}]
        rows += [{"step": t, "charts/reward_mean": 0.0 if t < 10 else reward} for t in range(1, 11)]
        rows[-1]["eval/avg@8"] = held
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (line,) = default_runs.paired_lines(str(tmp_path), ["grpo.py", "cispo.py"], [1, 2], "grpo.py")
    assert line == ("- `cispo.py` minus `grpo.py`: reward, last 10%: seed 1: +0.100, seed 2: -0.200 (mean -0.050 ± "
                    "0.212); held-out avg@8, last step: seed 1: +0.050, seed 2: -0.150 (mean -0.050 ± 0.141)")
    assert default_runs.paired_lines(str(tmp_path), ["cispo.py"], [1, 2], "grpo.py") == []


def test_default_runs_table_from_fabricated_runs(tmp_path):
    """experiments/default_runs.py --table-only's table from hand-made metrics: 2 seeds, 10 steps (the first and
    last 10% are steps 1 and 10), held-out avg@8 at steps 0 and 10, every cell by hand (below); no row for a command
    without runs; the paired line under it against grpo.py."""
    def write(name, seed, first, last, held, cut, jitter, shared, clip, wall):
        run = tmp_path / "runs" / f"{name}__{seed}__1"
        run.mkdir(parents=True)
        rows = [{"step": 0, "eval/avg@8": 0.1}]
        rows += [{"step": t, "charts/reward_mean": first if t == 1 else last if t == 10 else 0.0,
                  "charts/truncated_frac": cut if t == 10 else 1.0, "losses/shared_coef": shared if t == 10 else 0.0,
                  "losses/clipfrac": clip, "perf/wall_time": wall * t / 10} for t in range(1, 11)]
        rows[-1].update({"eval/avg@8": held, "charts/reward_jitter2": jitter})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("gspo.py", 1, 0.1, 0.5, 0.3, 0.2, 0.05, 1e-2, 0.1, 100.0)
    write("gspo.py", 2, 0.3, 0.7, 0.5, 0.0, 0.15, 3e-2, 0.3, 140.0)
    for seed in (1, 2):
        write("grpo.py", seed, 0.1, 0.4, 0.2, 0.0, 0.1, 0.0, 0.0, 50.0)
    p = subprocess.run([sys.executable, "experiments/default_runs.py", "--table-only", "--seeds", "2",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = (tmp_path / "table.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    # gspo.py: first (0.1, 0.3) 0.200 ± 0.141; last (0.5, 0.7) 0.600 ± 0.141; avg@8 step 0 0.1 both; last (0.3, 0.5)
    # 0.400 ± 0.141; truncated over the last step (0.2, 0.0) 0.100 ± 0.141; Jitter2 (0.05, 0.15) 0.100 ± 0.071;
    # shared-token coef. over 10 steps (1e-3, 3e-3) 2.0e-03 ± 1.4e-03; clip (0.1, 0.3); wall (100, 140) 120 ± 28
    assert rows == ["| `gspo.py` | 0.200 ± 0.141 | 0.600 ± 0.141 | 0.100 ± 0.000 | 0.400 ± 0.141 | 0.100 ± 0.141 "
                    "| 0.100 ± 0.071 | 2.0e-03 ± 1.4e-03 | 0.200 ± 0.141 | 120 ± 28 |",
                    "| `grpo.py` | 0.100 ± 0.000 | 0.400 ± 0.000 | 0.100 ± 0.000 | 0.200 ± 0.000 | 0.000 ± 0.000 "
                    "| 0.100 ± 0.000 | 0.0e+00 ± 0.0e+00 | 0.000 ± 0.000 | 50 ± 0 |"]
    # paired with grpo.py: reward (0.5 - 0.4, 0.7 - 0.4), held-out (0.3 - 0.2, 0.5 - 0.2): 0.200 ± 0.141 each
    assert lines[-1] == ("- `gspo.py` minus `grpo.py`: reward, last 10%: seed 1: +0.100, seed 2: +0.300 (mean 0.200 ± "
                         "0.141); held-out avg@8, last step: seed 1: +0.100, seed 2: +0.300 (mean 0.200 ± 0.141)")


def test_builtin_and_two_form_tables_by_hand(tmp_path):
    """learning_tax.py's two main tables, by hand: table1 from hand-made runs read as --table-only reads them (10
    steps, threshold 0.2, window 5), table2 from a hand-made part-2 result (its inputs come from checkpoints)."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import learning_tax as lab

    root = tmp_path / "runs" / "builtin"
    # seed 1 reaches a 5-step average of 0.2 at step 10 ((0.2 x 4 + 0.4) / 5 = 0.24; 0.16 at step 9); seed 2 never
    runs = {1: dict(reward=[0.0] * 5 + [0.2] * 4 + [0.4], asym=0.2, shared=1e-3, clip=[0.1] * 10, ent=0.5, j=0.1),
            2: dict(reward=[0.0] * 9 + [0.2], asym=0.4, shared=3e-3, clip=[0.0] * 5 + [0.2] * 5, ent=0.7, j=0.3)}
    for seed, m in runs.items():
        write_run(root, "gspo", seed, [{"charts/reward_mean": r, "losses/asym": m["asym"], "losses/clipfrac": c,
                                        "losses/shared_coef": m["shared"],
                                        "losses/entropy": m["ent"] if t == 9 else 1.0}  # the last step's: ent
                                       for t, (r, c) in enumerate(zip(m["reward"], m["clip"]))], m["j"])
    args = lab.Args(out=str(tmp_path), table_only=True)
    result = lab.part1(args, {"gspo": lab.BUILTIN["gspo"]}, [1, 2])
    # last 10% (0.4, 0.2); steps to 0.2: 10 on 1 of 2 seeds; Jitter2 (0.1, 0.3); Asym (0.2, 0.4); shared (1e-3,
    # 3e-3); clip fraction (0.1, 0.1); entropy at the last step (0.5, 0.7)
    assert lab.table1(result, args).splitlines()[2] == (
        "| gspo | 0.300 ± 0.141 | 10.0 (1/2 seeds) | 0.200 ± 0.141 | 0.3000 ± 0.1414 | 2.0e-03 ± 1.4e-03 "
        "| 0.100 ± 0.000 | 0.600 ± 0.141 |")
    two = {"gspo": [{"h": [0.9, 0.5], "log_odds_drift": [0.0, 1.0], "prefix_drift": [0.0, -0.01],
                     "shared_coef": [1e-3, 3e-3], "reward": [0.1] + [0.0] * 8 + [0.5]},
                    {"h": [0.9, 0.7], "log_odds_drift": [0.0, 2.0], "prefix_drift": [0.0, -0.03],
                     "shared_coef": [0.0, 0.0], "reward": [0.3] + [0.0] * 8 + [0.7]}]}
    # h: seed 1's start, then the ends (0.5, 0.7); drifts at the last point (1, 2) and (-0.01, -0.03); shared-token
    # coef. over steps (2e-3, 0): 1e-3 ± 1.4e-3; reward, first and last 10% (1 step): (0.1, 0.3) -> (0.5, 0.7)
    assert lab.table2(two).splitlines()[2] == (
        "| gspo | 0.900 → 0.600 ± 0.141 | 1.50 ± 0.71 | -0.0200 ± 0.0141 | 1.0e-03 ± 1.4e-03 "
        "| 0.20 ± 0.14 → 0.60 ± 0.14 |")


def same_runs_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("same_runs", os.path.join(ROOT, "tools", "same_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["out in a missing folder", "out a folder", "only unknown", "only empty",
                                  "compare missing", "compare broken", "compare a list", "compare bad entry"])
def test_same_runs_bad_arguments_are_one_line_before_any_run(case, tmp_path, monkeypatch, capsys):
    """Issue 61 item 1(j): tools/same_runs.py with a bad argument stops in one line before any run starts (it ran
    all 12 runs, then died with FileNotFoundError for --out in a missing folder; --only nosuchrun was a KeyError,
    --only with no names ran all 12, --compare of a missing, broken or list JSON a traceback)."""
    same_runs = same_runs_module()
    monkeypatch.setattr(same_runs, "fingerprint", lambda *a: pytest.fail("a run started"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"gspo-reward": {"metrics": [{"step": 1}], "files": {}}}))
    (tmp_path / "broken.json").write_text('{"gspo-reward": {"metr')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "entry.json").write_text('{"gspo-reward": [1]}')
    argv = {"out in a missing folder": ["--out", str(tmp_path / "no" / "x.json")],
            "out a folder": ["--out", str(tmp_path)],
            "only unknown": ["--out", str(tmp_path / "x.json"), "--only", "nosuchrun"],
            "only empty": ["--out", str(tmp_path / "x.json"), "--only"],
            "compare missing": ["--compare", str(good), str(tmp_path / "missing.json")],
            "compare broken": ["--compare", str(tmp_path / "broken.json"), str(good)],
            "compare a list": ["--compare", str(good), str(tmp_path / "list.json")],
            "compare bad entry": ["--compare", str(tmp_path / "entry.json"), str(good)]}[case]
    monkeypatch.setattr(sys, "argv", ["same_runs.py", *argv])
    with pytest.raises(SystemExit) as e:
        same_runs.main()
    said = str(e.value.code)
    assert e.value.code not in (0, 1, None) and said.startswith("error: ") and "\n" not in said, said
    assert not (tmp_path / "x.json").exists()


def test_same_runs_compare_reads_a_fingerprint_file_and_leaves_no_temp_folder(tmp_path, monkeypatch, capsys):
    """--compare of two equal files says bitwise equal (the format before.json was written in); a run's fingerprint
    is its metrics without timings and removes the temporary folder it ran in (each run left one behind)."""
    same_runs = same_runs_module()
    rows = [{"step": 1, "charts/reward_mean": 0.5, "perf/wall_time": 3.0, "energy/seconds": 1.0}]
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"gspo-reward": {"metrics": rows[:1], "files": {"step_1/x": "ab"}}}))
    assert same_runs.compare(str(a), str(a)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "bitwise equal"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(same_runs.tempfile, "tempdir", str(temp))

    def fake_run(cmd, **kw):  # the script's run: one run folder with its metrics and a checkpoint file
        run = os.path.join(cmd[cmd.index("--output-dir") + 1], "gspo__1__123")
        os.makedirs(os.path.join(run, "step_1"))
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(run, "step_1", "x"), "w") as f:
            f.write("x")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(same_runs.subprocess, "run", fake_run)
    got = same_runs.fingerprint("gspo-reward", ["gspo.py"])
    assert got["metrics"] == [{"step": 1, "charts/reward_mean": 0.5}] and list(got["files"]) == ["step_1/x"]
    assert os.listdir(temp) == []


def test_learning_tax_table_only_on_a_run_cut_short_is_one_line(tmp_path, monkeypatch):
    """Issue 61 item 1(k): learning_tax.py --table-only on a run cut short (no last step, so no Jitter2 row) stops
    in one line naming the run and --skip-done (it was a StopIteration traceback), table.md untouched; so does
    default_runs.py, which read the Jitter2 the same way."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import default_runs
    import learning_tax as lab

    root = tmp_path / "runs" / "builtin"
    write_run(root, "gspo", 1, [{"charts/reward_mean": 0.1}] * 3, 0.1)
    path = next(root.glob("gspo__1__*")) / "metrics.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # the last step never logged
    (tmp_path / "table.md").write_text("committed\n")
    monkeypatch.setattr(sys, "argv", ["learning_tax.py", "--table-only", "--out", str(tmp_path), "--seeds", "1",
                                      "--only", "gspo", "--no-two-form"])
    with pytest.raises(SystemExit) as e:
        lab.main()
    assert "'gspo' seed 1" in str(e.value.code) and "cut short" in str(e.value.code), e.value.code
    assert "\n" not in str(e.value.code) and (tmp_path / "table.md").read_text() == "committed\n"
    path.write_text(path.read_text().replace('"losses/entropy": 0.0, ', ""))  # a row without a column's key
    with pytest.raises(SystemExit) as e:
        lab.main()
    assert "step 1's row has no 'losses/entropy'" in str(e.value.code) and "\n" not in str(e.value.code)
    rows = [{"step": 0, "eval/avg@8": 0.1}] + [
        {"step": t, "charts/reward_mean": 0.1, "charts/truncated_frac": 0.5, "losses/shared_coef": 0.0,
         "losses/clipfrac": 0.0, "perf/wall_time": 1.0} for t in (1, 2)]
    run = tmp_path / "default" / "runs" / f"{default_runs.exp_name(next(iter(default_runs.COMMANDS)))}__1__1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["default_runs.py", "--table-only", "--out", str(tmp_path / "default"),
                                      "--seeds", "1", "--only", next(iter(default_runs.COMMANDS))])
    with pytest.raises(SystemExit) as e:
        default_runs.main()
    assert "cut short" in str(e.value.code) and "\n" not in str(e.value.code), e.value.code
