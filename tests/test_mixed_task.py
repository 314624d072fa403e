"""experiments/mixed_task_runs.py without the model: the mixed task's rows and held-out split, and its table built
from fabricated logs (metrics.jsonl, eval_samples.jsonl) against numbers computed by hand (fast: no model)."""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import mixed_task_runs as mt  # noqa: E402


def pair_of(row: dict) -> tuple[int, int]:
    """(a, b) with a > b: the two numbers a prompt states (the addition's order is drawn)."""
    a, b = map(int, re.findall(r"\d+", row["prompt"]))
    return max(a, b), min(a, b)


def test_mixed_task_rows_and_held_out_split():
    train, test = mt.mixed_task()
    assert len(test) == 64 and [sum(r["form"] == f for r in test) for f in mt.FORMS] == [16, 16, 16, 16]
    assert [r["form"] for r in test[:4]] == list(mt.FORMS)  # the forms in turn
    pairs = 89 * 90 // 2  # a > b in 10..99
    assert len(train) == 4 * (pairs - 64)  # every other pair in all four forms
    held = {pair_of(r) for r in test}
    assert len(held) == 64 and not held & {pair_of(r) for r in train}  # no held-out pair trained on, any form
    for r in train + test:
        a, b = pair_of(r)
        assert 10 <= b < a <= 99 and r["prompt"].endswith(" Put the final answer in \\boxed{}.")
        assert r["answer"] == str(a + b if r["form"] in ("add", "word add") else a - b)
        if r["form"] == "sub":
            assert r["prompt"].startswith(f"What is {a} - {b}?")
        elif r["form"] == "word sub":
            assert f" {a} " in r["prompt"] and f"gives {b} away" in r["prompt"]
        elif r["form"] == "word add":
            assert f"gets {b} more" in r["prompt"]
    assert {r["form"] for r in train} == set(mt.FORMS)
    assert mt.mixed_task() == (train, test)  # seeded: every run sees the same split


def write(logs, name, seed, evals, rewards, samples=None, no_spread=0.5):
    """logs/{name}__{seed}/: metrics.jsonl (an eval row at each evaluation step, a reward row a step) and, where
    given, eval_samples.jsonl: {step: {form: k}}, the first k held-out rows of the form scored 1, the others 0."""
    folder = logs / f"{name}__{seed}"
    folder.mkdir(parents=True)
    rows = [{"step": s, "eval/avg@1": a, "eval/pass@1": a} for s, a in evals.items()]
    rows += [{"step": t, "charts/reward_mean": r, "charts/zero_adv_group_frac": no_spread}
             for t, r in enumerate(rewards, 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["step"])))
    if samples is not None:
        test, out = mt.mixed_task()[1], []
        for step, right in samples.items():
            for f in mt.FORMS:
                rows_f = [r for r in test if r["form"] == f]
                out += [{"step": step, "prompt": r["prompt"], "completion": "x", "reward": float(i < right.get(f, 0))}
                        for i, r in enumerate(rows_f)]
        (folder / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))


def test_mixed_task_table_from_fabricated_logs(tmp_path):
    logs = tmp_path / "logs"
    steps = [0, 10, 20, 30, 40]
    write(logs, "gspo", 1, dict(zip(steps, [0.1, 0.2, 0.3, 0.3, 0.5])), [0.0] * 2 + [0.3] * 3 + [0.5] * 5,
          {0: {"add": 8}, 40: {"add": 16, "sub": 4, "word sub": 12}}, no_spread=0.25)
    write(logs, "gspo", 2, dict(zip(steps, [0.1, 0.1, 0.2, 0.4, 0.3])), [0.2] * 5 + [0.3] * 5,
          {0: {}, 40: {"add": 8, "sub": 4, "word add": 8, "word sub": 4}})
    write(logs, "grpo", 1, dict(zip(steps, [0.1, 0.2, 0.2, 0.4, 0.6])), [0.1] * 10)
    write(logs, "grpo", 2, dict(zip(steps, [0.1, 0.1, 0.1, 0.1, 0.2])), [0.1] * 10)
    write(logs, "grpo", 3, dict(zip(steps, [0.1, 0.1, 0.1, 0.1, 0.1])), [0.1] * 10)  # no gspo seed 3: no pair
    lines = mt.table(str(logs), [1, 2, 3]).splitlines()
    assert lines[0] == ("| objective | seeds | held-out, step 0 | held-out, step 10 | held-out, step 20 "
                        "| held-out, step 30 | held-out, step 40 | change, last - step 0 | reward, first quarter of "
                        "steps | reward, last quarter | groups with no reward spread |")
    # gspo: step 20 (0.3, 0.2) 0.250 ± 0.071; step 40 (0.5, 0.3) 0.400 ± 0.141; change (0.4, 0.2) 0.300 ± 0.141;
    # reward, first quarter of 10 steps (steps 1-2: 0.0, 0.2) 0.100 ± 0.141, last (0.5, 0.3) 0.400 ± 0.141;
    # no spread (0.25, 0.5) 0.375 ± 0.177
    assert lines[2] == ("| gspo | 2 | 0.100 ± 0.000 | 0.150 ± 0.071 | 0.250 ± 0.071 | 0.350 ± 0.071 "
                        "| 0.400 ± 0.141 | 0.300 ± 0.141 | 0.100 ± 0.141 | 0.400 ± 0.141 | 0.375 ± 0.177 |")
    # grpo, 3 seeds: step 40 (0.6, 0.2, 0.1) 0.300 ± sqrt((0.09 + 0.01 + 0.04) / 2) = 0.265; change (0.5, 0.1, 0.0)
    # 0.200 ± 0.265; step 30 (0.4, 0.1, 0.1) 0.200 ± 0.173
    assert lines[3] == ("| grpo | 3 | 0.100 ± 0.000 | 0.133 ± 0.058 | 0.133 ± 0.058 | 0.200 ± 0.173 "
                        "| 0.300 ± 0.265 | 0.200 ± 0.265 | 0.100 ± 0.000 | 0.100 ± 0.000 | 0.500 ± 0.000 |")
    # by form, 16 rows each: gspo add 8/16 and 0/16 at step 0 (0.25 ± 0.35), 16/16 and 8/16 at step 40 (0.75 ±
    # 0.35); sub 0 -> (4/16, 4/16) 0.25 ± 0.00; word add 0 -> (0, 8/16) 0.25 ± 0.35; word sub 0 -> (12/16, 4/16)
    # 0.50 ± 0.35; grpo logged no eval_samples.jsonl: empty cells
    by_form = lines[lines.index("| objective | add | sub | word add | word sub |") + 2:][:2]
    assert by_form == ["| gspo | 0.25 ± 0.35 → 0.75 ± 0.35 | 0.00 ± 0.00 → 0.25 ± 0.00 "
                       "| 0.00 ± 0.00 → 0.25 ± 0.35 | 0.00 ± 0.00 → 0.50 ± 0.35 |", "| grpo |  |  |  |  |"]
    assert lines[-3:] == [
        "- gspo, held-out change (last - step 0) by seed: seed 1: +0.400, seed 2: +0.200 (mean 0.300 ± 0.141)",
        "- grpo, held-out change (last - step 0) by seed: seed 1: +0.500, seed 2: +0.100, seed 3: +0.000 "
        "(mean 0.200 ± 0.265)",
        # paired at step 40 over the seeds both have: (0.6 - 0.5, 0.2 - 0.3) = (+0.1, -0.1): 0.000 ± 0.141
        "- grpo minus gspo, held-out at step 40, paired by seed: seed 1: +0.100, seed 2: -0.100 (mean 0.000 ± 0.141)"]
    assert mt.table(str(tmp_path / "none"), [1]) == "no logs"
    if mt.plot(str(logs), [1, 2, 3], str(tmp_path / "mixed.png")):  # matplotlib there: the curves drawn
        assert (tmp_path / "mixed.png").stat().st_size > 10_000


def test_mixed_task_table_only_with_a_torn_line_is_one_line(tmp_path, monkeypatch):
    """Issue 61 item 1(k): mixed_task_runs.py --table-only where a run's metrics.jsonl or eval_samples.jsonl ends in
    a torn line (a run cut short while writing) stops in one line naming the file and line (it was a
    JSONDecodeError), table.md untouched; the torn line is not skipped (the run would read as finished)."""
    import pytest

    for name in ("metrics.jsonl", "eval_samples.jsonl"):
        out = tmp_path / name
        logs = out / "logs"
        write(logs, "gspo", 1, {0: 0.1, 40: 0.2}, [0.1] * 4, {0: {"add": 1}, 40: {"add": 2}})
        path = logs / "gspo__1" / name
        path.write_text(path.read_text() + '{"step": 4, "charts/rew')
        (out / "table.md").write_text("committed\n")
        monkeypatch.setattr(sys, "argv", ["mixed_task_runs.py", "--table-only", "--out", str(out)])
        with pytest.raises(SystemExit) as e:
            mt.main()
        said = str(e.value.code)
        assert f"{name}:{len(path.read_text().splitlines())}: not a JSON row" in said and "\n" not in said, said
        assert (out / "table.md").read_text() == "committed\n"
