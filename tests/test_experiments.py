"""The learning-tax lab in its reduced form (--smoke): every part runs end to end from the scripts' own logs and
checkpoints, and the table it writes holds the measured numbers of each objective."""
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
    # the two forms differ in length; the length-aware transform cancels the shared first token "S" exactly (eq. 72),
    # GSPO does not
    assert max(summary["two_form"]["dfpo min-replace --length-aware"][0]["shared_coef"]) < 1e-6
    assert max(summary["two_form"]["gspo"][0]["shared_coef"]) > 1e-4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "table only, no plots" in p.stdout
    else:
        assert (tmp_path / "builtin.png").stat().st_size > 10_000 and (tmp_path / "two_form.png").stat().st_size > 10_000
