"""experiments/real_model_runs.py without the model: the arithmetic task's rows and held-out split, graded by the
math grader, and --table-only on a fabricated folder of run logs (fast: no model is loaded)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from real_model_runs import arithmetic_task  # noqa: E402


def test_arithmetic_task_rows_and_held_out_split():
    train, test = arithmetic_task()
    # 90 x 90 ordered pairs; 128 unordered pairs held out: 127 of them a != b (2 orders each) and however many
    # a == b among them, so 8100 - len(train) is 2 x 128 minus the diagonal ones
    pairs = lambda rows: [tuple(int(x) for x in r["prompt"][8:].split("?")[0].split(" + ")) for r in rows]  # noqa
    held = pairs(test)
    diagonal = sum(a == b for a, b in held)
    assert len(test) == 128 and len(train) == 8100 - (2 * 128 - diagonal)
    assert test[0]["prompt"] == f"What is {held[0][0]} + {held[0][1]}? Put the final answer in \\boxed{{}}."
    for rows in (train, test):
        for (a, b), r in zip(pairs(rows), rows):
            assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a + b)
    # no held-out sum is trained on, in either order
    unordered = lambda ps: {(min(a, b), max(a, b)) for a, b in ps}  # noqa: E731
    assert not unordered(held) & unordered(pairs(train))
    assert arithmetic_task() == (train, test)  # seeded: every run and every seed of a run sees the same split
    # the held-out order is shuffled: --eval-limit 48 takes a spread of pairs, not the smallest a
    assert sorted(held) != held


def test_arithmetic_answers_are_graded_right_and_echoing_the_question_is_not():
    _, test = arithmetic_task()
    r = test[0]
    a, b = r["prompt"][8:].split("?")[0].split(" + ")
    n = int(r["answer"])
    assert common.math_reward(f"{a} + {b} = {n}. The answer is \\boxed{{{n}}}.", r["answer"]) == 1.0
    assert common.math_reward(f"The sum is {n}.", r["answer"]) == 1.0
    assert common.math_reward(f"\\boxed{{{n + 1}}}", r["answer"]) == 0.0
    assert common.math_reward(f"\\boxed{{{a} + {b}}}", r["answer"]) == 0.0  # issue 38 item 0
    assert common.math_reward("\\boxed{}", r["answer"]) == 0.0


def fake_run(folder, rewards, evals, clip=0.1):
    """A metrics.jsonl as the scripts write it: one row a step (eval at the first and last), Jitter2 on the last."""
    os.makedirs(folder)
    rows = [{"step": 0, "eval/avg@4": evals[0], "eval/pass@4": 0.5}]
    for t, r in enumerate(rewards, 1):
        rows.append({"step": t, "charts/reward_mean": r, "losses/entropy": 1.0 - 0.1 * t,
                     "charts/response_length_mean": 30.0 - t, "losses/clipfrac": clip, "losses/asym": 0.2,
                     "losses/shared_coef": 1e-3})
    rows[-1].update({"eval/avg@4": evals[1], "eval/pass@4": 0.6, "charts/reward_jitter2": 0.05})
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_table_only_on_fabricated_logs(tmp_path):
    logs = tmp_path / "logs"
    fake_run(logs / "gspo__1", [0.1, 0.2, 0.3, 0.5], (0.10, 0.30))
    fake_run(logs / "gspo__2", [0.1, 0.1, 0.3, 0.3], (0.20, 0.30))
    fake_run(logs / "dfpo__1", [0.2, 0.1, 0.2, 0.3], (0.25, 0.25), clip=0.3)
    p = subprocess.run([sys.executable, "experiments/real_model_runs.py", "--table-only", "--seeds", "2",
                        "--out", str(tmp_path), "--only", "gspo,gspo --lora-rank 16"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    # the command line as a shell takes it back: a name with spaces quoted
    assert (f"`python experiments/real_model_runs.py --table-only --seeds 2 --out {tmp_path} "
            "--only 'gspo,gspo --lora-rank 16'`: rebuilt") in table
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.split("Mechanism")[0].splitlines()
            if line.startswith("| g")
            or line.startswith("| d")}
    assert set(rows) == {"gspo", "dfpo"}  # grpo has no logs: no row
    g = rows["gspo"]
    # held-out before: mean 0.15, sample std of (0.1, 0.2) = 0.0707; after 0.30 ± 0; change (0.2, 0.1): 0.15 ± 0.0707
    assert g[1] == "2" and g[2] == "0.150 ± 0.071" and g[3] == "0.300 ± 0.000" and g[4] == "0.150 ± 0.071"
    # reward, first 2 steps: seed 1 0.15, seed 2 0.10 -> 0.125 ± 0.035; last 2: 0.4, 0.3 -> 0.350 ± 0.071
    assert g[5] == "0.125 ± 0.035" and g[6] == "0.350 ± 0.071"
    assert g[7] == "0.900 ± 0.000 → 0.600 ± 0.000" and g[8] == "29.0 ± 0.0 → 26.0 ± 0.0"
    assert g[9].startswith("0.100 ± 0.000")
    d = rows["dfpo"]
    assert d[1] == "1" and d[2] == "0.250" and d[4] == "0.000" and d[9].startswith("0.300")
    # mechanism table: steps to a 3-step average >= 0.3 (eq. 19): seed 1 (0.1, 0.2, 0.3, 0.5) reaches it at step 4
    # ((0.2 + 0.3 + 0.5) / 3 = 0.333), seed 2 (0.1, 0.1, 0.3, 0.3) never (0.233 at most): 4.0 on 1 of 2 seeds
    mech = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.split("Mechanism")[1].splitlines()
            if line.startswith("| g") or line.startswith("| d")}
    assert mech["gspo"][1] == "4.0 (1/2 seeds)" and mech["dfpo"][1] == "not reached (0/1)"
    assert mech["gspo"][2] == "0.050 ± 0.000" and mech["gspo"][3] == "0.2000 ± 0.0000"
    assert mech["gspo"][4].startswith("1.0e-03 ± 0.0e+00")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gspo"][0]["eval"] == [0.10, 0.30] and summary["gspo"][1]["eval_steps"] == [0, 4]
    # paired with gspo by seed: dfpo has seed 1 alone; its held-out change 0.25 - 0.25 = 0 against gspo seed 1's
    # 0.30 - 0.10 = 0.20, so -0.200; its last-2 reward (0.2 + 0.3) / 2 = 0.25 against (0.3 + 0.5) / 2 = 0.4: -0.150
    assert [line for line in table.splitlines() if "paired by seed" in line] == [
        "- dfpo minus gspo, held-out change, paired by seed: seed 1: -0.200 (mean -0.200)",
        "- dfpo minus gspo, reward over the last 2 steps, paired by seed: seed 1: -0.150 (mean -0.150)"]


def test_precision_table_from_fabricated_logs(tmp_path):
    """experiments/precision_runs.py's table: each configuration's last metrics row, mean ± sample std over the seeds
    whose logs are there (by hand: Var 1e-3 and 3e-3 -> 2.0e-03 ± 1.4e-03; clip 0.1 and 0.2 -> 0.1500 ± 0.0707;
    step s 100 and 140 -> 120 ± 28), an empty cell for a metric the run does not log, no row without logs."""
    from precision_runs import table

    for seed, (var, clip, wall) in enumerate([(1e-3, 0.1, 100.0), (3e-3, 0.2, 140.0)], 1):
        folder = tmp_path / f"gspo,_rollout__{seed}"
        folder.mkdir()
        row = {"losses/log_ratio_var_first": var, "losses/ratio_min": 0.9, "losses/ratio_max": 1.1,
               "losses/clipfrac": clip, "losses/clipfrac_seq": 0.5, "perf/wall_time": wall}
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/avg@1": 0.1}) + "\n" + json.dumps(row) + "\n")
    lines = table(str(tmp_path), [1, 2, 3]).splitlines()
    assert len(lines) == 3  # header, rule, the one configuration with logs
    assert lines[2] == ("| gspo, rollout | 2 | 2.0e-03 ± 1.4e-03 | 0.9000 ± 0.0000 | 1.1000 ± 0.0000 | 0.1500 ± 0.0707 "
                        "| 0.5000 ± 0.0000 |  |  | 120 ± 28 |")


def test_energy_table_from_fabricated_logs(tmp_path):
    """experiments/energy_runs.py's table, by hand: per objective, step 1, steps 2-8 (each seed's mean over its
    measured steps, then mean ± sample std over seeds) and step 8, a seed whose steps had no gradient (energy/tokens 0
    or no energy) left out and counted; the cost per token (30 s / 20 tokens = 1.50); the held-out accuracy at step
    8; then DFPO minus GSPO's top-5 share over steps 2-8, paired by seed."""
    from energy_runs import table

    def share(top):
        return {"energy/top5": top, "energy/rank5-20": 0.5, "energy/rest": 0.5 - top, "energy/tokens": 20,
                "energy/seconds": 30.0}

    runs = {"gspo": {1: {1: 0.2, 2: 0.1, 3: 0.3}, 2: {1: 0.4, 2: 0.5}, 3: {}},  # objective: seed: step: top-5 share
            "dfpo": {1: {2: 0.1}, 2: {3: 0.2}}}
    for name, seeds in runs.items():
        for seed, steps in seeds.items():
            folder = tmp_path / f"{name}__{seed}"
            folder.mkdir()
            rows = [{"step": 0, "eval/avg@1": 0.1}, *({"step": t, **(share(steps[t]) if t in steps else
                                                                      {"energy/tokens": 0})} for t in range(1, 8)),
                    {"step": 8, "eval/avg@1": 0.3 + 0.1 * seed}]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = table(str(tmp_path), [1, 2, 3]).splitlines()
    assert lines[2] == "| gspo | 1 | 2 of 3 | 0.300 ± 0.141 | 0.500 ± 0.000 | 0.200 ± 0.141 | 20 ± 0 | 1.50 ± 0.00 |  |"
    # seed 1: (0.1 + 0.3) / 2 = 0.2, its rest (0.4 + 0.2) / 2 = 0.3; seed 2: 0.5, rest 0.0
    assert lines[3] == ("| gspo | 2-8, mean a seed | 2 of 3 | 0.350 ± 0.212 | 0.500 ± 0.000 | 0.150 ± 0.212 "
                        "| 20 ± 0 | 1.50 ± 0.00 |  |")
    assert lines[4] == "| gspo | 8 | 0 of 3 | - | - | - | - | - | 0.500 ± 0.100 |"
    assert lines[5].startswith("| dfpo | 1 | 0 of 2 |")
    assert lines[6] == ("| dfpo | 2-8, mean a seed | 2 of 2 | 0.150 ± 0.071 | 0.500 ± 0.000 | 0.350 ± 0.071 "
                        "| 20 ± 0 | 1.50 ± 0.00 |  |")
    assert lines[-1] == ("DFPO minus GSPO, top-5 share over steps 2-8, paired by seed: seed 1: -0.100, seed 2: -0.300 "
                         "(mean -0.200 ± 0.141)")


def test_precision_curve_table_from_fabricated_logs(tmp_path):
    """experiments/precision_runs.py --curves' table, by hand: the reward each step (mean over seeds), the first and
    last 2 steps, Jitter2 from the last row, the clip fraction and Var log w_it averaged over steps, a step's seconds
    from step 2 on (step 1 holds the model's load) and the pi_old pass's; no row without logs; the reward over the
    last 2 steps paired by seed with the objective's recomputed run, over the seeds both have."""
    from precision_runs import curve_table

    for seed, rewards in enumerate([[0.0, 0.2, 0.4, 0.6], [0.2, 0.2, 0.6, 1.0]], 1):
        folder = tmp_path / f"gspo_rollout__{seed}"
        folder.mkdir()
        rows = [{"step": 0, "eval/avg@1": 0.1}]
        for t, r in enumerate(rewards, 1):
            rows.append({"step": t, "charts/reward_mean": r, "losses/clipfrac": 0.1 * seed,
                         "losses/log_ratio_var_first": 1e-3 * seed, "perf/wall_time": 100.0 + 50 * seed * t,
                         "perf/old_logp_s": 0.0, "charts/reward_jitter2": 0.05 * seed if t == 4 else None})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(curve_table(str(tmp_path), [1, 2, 3]).splitlines()) == 3  # header, rule, the one with logs
    folder = tmp_path / "gspo_recomputed__2"  # its objective's recomputed run, seed 2 only: one pair
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": t, "charts/reward_mean": r, "losses/clipfrac": 0.0, "losses/log_ratio_var_first": 0.0,
         "perf/wall_time": 10.0 * t, "perf/old_logp_s": 2.0, "charts/reward_jitter2": 0.0}) + "\n"
        for t, r in enumerate([0.0, 0.0, 0.3, 0.5], 1)))
    lines = curve_table(str(tmp_path), [1, 2, 3]).splitlines()
    assert len(lines) == 6 and lines[2].startswith("| gspo recomputed | 1 | 0.00 0.00 0.30 0.50 | ")
    # first 2: 0.1, 0.2; last 2: 0.5, 0.8; step s: 50 and 100
    assert lines[3] == ("| gspo rollout | 2 | 0.10 0.20 0.50 0.80 | 0.150 ± 0.071 | 0.650 ± 0.212 | 0.075 ± 0.035 "
                        "| 0.1500 ± 0.0707 | 1.5e-03 ± 7.1e-04 | 75 ± 35 | 0.0 ± 0.0 |")
    # seed 2's last 2 steps: 0.8 against 0.4
    assert lines[5] == ("gspo rollout minus gspo recomputed, reward over the last 2 steps, paired by seed: seed 2: "
                        "+0.400 (mean 0.400)")


def test_new_objectives_rows_pair_with_gspo_and_say_n_a_for_what_a_script_does_not_log(tmp_path):
    """Issue 51 item 2's rows beside gspo's from fabricated logs, every cell by hand: cispo on seeds 1-3 (gspo has
    1-2, so seed 3 has no pair), and TRL's GRPO on seed 1 logging neither losses/entropy nor losses/shared_coef (n/a
    in their cells, no crash); the 15 commands' plot lines all differ; issue 63's two stale commands."""
    import real_model_runs as rm

    trl = "grpo --gen-mode engine --rollout-is-mode sequence-mask --rollout-is-cap 3"
    assert set(rm.NEW) <= set(rm.COMMANDS) and rm.COMMANDS[trl] == [
        "grpo.py", "--gen-mode", "engine", "--rollout-is-mode", "sequence-mask", "--rollout-is-cap", "3"]
    assert rm.COMMANDS["gspo --luspo"] == ["gspo.py", "--luspo"] and rm.COMMANDS["vespo"] == ["vespo.py"]
    assert rm.only_commands(f"cispo,sapo,gmpo,vespo,gspo --luspo,{trl}", rm.COMMANDS) == rm.NEW  # the doc's --only
    logs = tmp_path / "logs"
    fake_run(logs / "gspo__1", [0.1, 0.2, 0.3, 0.5], (0.10, 0.30))
    fake_run(logs / "gspo__2", [0.1, 0.1, 0.3, 0.3], (0.20, 0.30))
    fake_run(logs / "cispo__1", [0.2, 0.4, 0.4, 0.6], (0.10, 0.50), clip=0.1)
    fake_run(logs / "cispo__2", [0.0, 0.2, 0.2, 0.4], (0.20, 0.20), clip=0.2)
    fake_run(logs / "cispo__3", [0.0, 0.0, 0.0, 0.0], (0.10, 0.40), clip=0.3)
    fake_run(logs / rm.exp_name(f"{trl}__1"), [0.5, 0.5, 0.5, 0.5], (0.25, 0.50), clip=0.0)
    path = logs / rm.exp_name(f"{trl}__1") / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r.pop("losses/entropy", None)
        r.pop("losses/shared_coef", None)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = rm.summarize(str(logs), [1, 2, 3])
    assert list(result) == ["gspo", "cispo", trl]  # COMMANDS' order, the rows with logs
    cells = {line.split(" | ")[0][2:]: line.split(" | ") for line in rm.table(result).splitlines()[2:]}
    c = cells["cispo"]
    # before (0.1, 0.2, 0.1): 0.1333 ± sqrt((0.0333^2 + 0.0667^2 + 0.0333^2) / 2) = 0.0577; after (0.5, 0.2, 0.4):
    # 0.3667 ± 0.1528; change (0.4, 0.0, 0.3): 0.2333 ± 0.2082; reward, first 2 (0.3, 0.1, 0.0): 0.1333 ± 0.1528;
    # last 2 (0.5, 0.3, 0.0): 0.2667 ± 0.2517; clip fraction (0.1, 0.2, 0.3): 0.200 ± 0.100
    assert c[1:7] == ["3", "0.133 ± 0.058", "0.367 ± 0.153", "0.233 ± 0.208", "0.133 ± 0.153", "0.267 ± 0.252"]
    assert c[9].startswith("0.200 ± 0.100")
    t = cells[trl]
    assert t[1:5] == ["1", "0.250", "0.500", "0.250"] and t[7] == "n/a → n/a" and t[8] == "29.0 → 26.0"
    assert t[9].startswith("0.000 |")
    # paired with gspo by seed, seeds 1 and 2: held-out change (0.4 - 0.2, 0.0 - 0.1) = (+0.2, -0.1): 0.05 ± 0.212;
    # reward over the last 2 steps (0.5 - 0.4, 0.3 - 0.3) = (+0.1, 0.0): 0.05 ± 0.071; TRL's GRPO seed 1: held-out
    # 0.25 - 0.20 = +0.05, reward 0.5 - 0.4 = +0.1
    assert rm.paired(result).splitlines() == [
        "- cispo minus gspo, held-out change, paired by seed: seed 1: +0.200, seed 2: -0.100 (mean 0.050 ± 0.212)",
        "- cispo minus gspo, reward over the last 2 steps, paired by seed: seed 1: +0.100, seed 2: +0.000 "
        "(mean 0.050 ± 0.071)",
        f"- {trl} minus gspo, held-out change, paired by seed: seed 1: +0.050 (mean 0.050)",
        f"- {trl} minus gspo, reward over the last 2 steps, paired by seed: seed 1: +0.100 (mean 0.100)"]
    mech = {line.split(" | ")[0][2:]: line.split(" | ") for line in rm.mechanism_table(result).splitlines()[2:]}
    # cispo's 3-step average reaches 0.3 at step 3 on seed 1 ((0.2 + 0.4 + 0.4) / 3 = 0.333), never on 2 or 3
    assert mech["cispo"][1:4] == ["3.0 (1/3 seeds)", "0.050 ± 0.000", "0.2000 ± 0.0000"]
    assert mech["cispo"][4] == "1.0e-03 ± 0.0e+00 |"
    assert mech[trl][1:] == ["3.0 (1/1 seeds)", "0.050", "0.2000", "n/a |"]
    # the plot: each of the 15 commands its own (colour, line style)
    styles = {tuple(rm.style(k).values()) for k in range(len(rm.COMMANDS))}
    assert len(rm.COMMANDS) == 15 and len(styles) == 15
    # issue 63's stale rows: k = 2 with pi_old the behaviour policy's, the script's flags alone beside the budget
    for name in ("grpo", "gspo"):
        assert rm.COMMANDS[f"{name} --max-staleness 2 --old-logp rollout"] == [
            f"{name}.py", "--max-staleness", "2", "--old-logp", "rollout"]
    if rm.plot(result, str(tmp_path / "p.png")):  # a missing curve leaves its line out (False: no matplotlib)
        assert (tmp_path / "p.png").stat().st_size > 10_000


def test_committed_tables_rebuild_from_committed_logs():
    """Issue 51 item 4: each committed real-model table is what --table-only computes from the committed logs beside
    it (real_model_runs, precision_runs and its --curves, --corrections and --corrections --curves, energy_runs and
    its --minibatch last, mixed_task_runs; length_runs and staleness_runs with their table.md's command line,
    episode_runs): a table edited by hand, or
    logs committed without their table, fail here."""
    import shlex

    import energy_runs
    import length_runs
    import mixed_task_runs
    import precision_runs
    import real_model_runs as rm
    import tyro

    results = os.path.join(ROOT, "experiments", "results")
    read = lambda out: open(os.path.join(results, out, "table.md")).read()  # noqa: E731
    found = rm.summarize(os.path.join(results, "real_model", "logs"), [1, 2, 3, 4, 5])
    assert len(found) >= 7
    for part in (rm.table(found), rm.paired(found), rm.mechanism_table(found)):
        assert part in read("real_model")
    tables = [(precision_runs.table, "precision"), (precision_runs.curve_table, "precision/curves"),
              (precision_runs.correction_table, "precision/corrections"),
              (precision_runs.correction_curve_table, "precision/corrections/curves"),
              (energy_runs.table, "real_model_energy"), (energy_runs.table, "real_model_energy/last"),
              (mixed_task_runs.table, "mixed_task")]
    for table, out in tables:  # a table without its logs would rebuild as its bare header
        assert os.path.isdir(os.path.join(results, out, "logs")), f"{out}: its logs are not committed"
        assert table(os.path.join(results, out, "logs"), [1, 2, 3]) in read(out), out
    # the length lab: its table from the logs, with the scripts, lengths and rates of table.md's command line
    argv = shlex.split(read("length").split("`")[1])[2:]
    found = length_runs.table(os.path.join(results, "length", "logs"),
                              *length_runs.grid(tyro.cli(length_runs.Args, args=argv)))
    assert found.count("\n| `") >= 6 and found in read("length")
    # the staleness lab (its table.md's command line) and the episodes lab (every configuration, 80 steps)
    import episode_runs
    import staleness_runs

    argv = shlex.split(read("staleness").split("`")[1])[2:]
    variants, ks, lengths, seeds = staleness_runs.grid(tyro.cli(staleness_runs.Args, args=argv))
    found = staleness_runs.table(staleness_runs.load(os.path.join(results, "staleness", "logs"), variants, ks,
                                                     lengths, seeds), seeds)
    assert found.count("\n| `") >= 16 and found in read("staleness")
    found = episode_runs.curves(os.path.join(results, "episodes", "logs"), list(episode_runs.CONFIGS), [1, 2, 3], 80)
    assert len(found) == len(episode_runs.CONFIGS) and episode_runs.table(found, 80) in read("episodes")


def test_table_only_without_logs_never_writes_a_table(tmp_path, monkeypatch, capsys):
    """Issue 61 item 1(b): --table-only of every experiment script with no logs/ under --out stops in one line, exit
    non-zero, and leaves the table.md there as it was (precision_runs.py, mixed_task_runs.py and energy_runs.py wrote
    an empty table over it and exited 0); so does a folder holding another configuration's logs alone."""
    import default_runs
    import energy_runs
    import learning_tax
    import length_runs
    import mixed_task_runs
    import precision_runs
    import real_model_runs as rm

    cases = [(precision_runs, [], ""), (precision_runs, ["--curves"], "curves"),
             (precision_runs, ["--corrections"], "corrections"),
             (precision_runs, ["--corrections", "--curves"], "corrections/curves"),
             (mixed_task_runs, [], ""), (energy_runs, [], ""), (energy_runs, ["--minibatch", "last"], "last"),
             (rm, [], ""), (length_runs, [], ""), (learning_tax, [], ""), (default_runs, [], "")]
    for k, (module, flags, sub) in enumerate(cases):
        out = tmp_path / str(k)
        (out / sub).mkdir(parents=True)
        (out / sub / "table.md").write_text("committed\n")
        (out / sub / "logs" / "other__1").mkdir(parents=True)  # not one of the experiment's configurations
        (out / sub / "logs" / "other__1" / "metrics.jsonl").write_text('{"step": 1}\n')
        monkeypatch.setattr(sys, "argv", [module.__name__, "--table-only", "--out", str(out), *flags])
        with pytest.raises(SystemExit) as e:
            module.main()
        said = str(e.value.code)
        assert e.value.code not in (0, None) and "\n" not in said and "no " in said, (module.__name__, flags, said)
        assert (out / sub / "table.md").read_text() == "committed\n", (module.__name__, flags)
        assert "Traceback" not in capsys.readouterr().err
