"""The staleness lab's driver (experiments/staleness_runs.py, issue 63 item 4): each variant's command, the runs
it makes (k = 0 once a script), and its table from made-up logs."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import staleness_runs as sr  # noqa: E402


def test_each_variant_samples_stale_and_takes_its_pi_old():
    """k > 0: --max-staleness k, and pi_old the behaviour's (--old-logp rollout) except for the decoupled objective,
    which recomputes pi_prox and weighs by rho masked past 5; k = 0: the script's default run (the decoupled
    variant's k = 0 is grpo's own run: rho = 1)."""
    args = sr.Args()
    tail = lambda v, k: sr.argv(v, 16, k, args)[-6:]  # noqa: E731
    assert sr.argv("gspo", 16, 2, args)[0] == "gspo.py" and tail("gspo", 2)[-4:] == [
        "--max-staleness", "2", "--old-logp", "rollout"]
    assert tail("grpo-decoupled", 4) == ["--rollout-is-cap", "5", "--rollout-is-mode", "token-mask",
                                         "--max-staleness", "4"]
    assert sr.argv("grpo-decoupled", 16, 0, args) == sr.argv("grpo", 16, 0, args)
    assert "--max-staleness" not in sr.argv("cispo", 16, 0, args)
    assert sr.run_name("grpo-decoupled", 16, 0, 100) == "grpo__L16__k0__n100"


def test_pending_runs_k0_once_a_script_and_skips_done(tmp_path):
    args = sr.Args(variants="grpo,grpo-decoupled", staleness="0,1", seeds=2)
    every = [("grpo", 16, 0, 1), ("grpo", 16, 1, 1), ("grpo-decoupled", 16, 1, 1),
             ("grpo", 16, 0, 2), ("grpo", 16, 1, 2), ("grpo-decoupled", 16, 1, 2)]
    assert sr.pending(args, str(tmp_path)) == every
    (tmp_path / "grpo__L16__k0__n100__1").mkdir()
    (tmp_path / "grpo__L16__k0__n100__1" / "args.json").write_text("{}")
    args.skip_done = True
    assert sr.pending(args, str(tmp_path)) == every[1:]
    pairs = sr.Args(variants="grpo,gspo", staleness="0,4", lengths="256", seeds=2)
    assert sr.pending(pairs, str(tmp_path))[:4] == [  # seed 1's (k = 0, k = 4) pairs first, a variant at a time
        ("grpo", 256, 0, 1), ("grpo", 256, 4, 1), ("gspo", 256, 0, 1), ("gspo", 256, 4, 1)]
    with pytest.raises(SystemExit, match="--variants nope: unknown"):
        sr.pending(sr.Args(variants="grpo,nope"), str(tmp_path))
    with pytest.raises(SystemExit, match="--staleness and --lengths: comma-separated whole numbers"):
        sr.pending(sr.Args(staleness="0,x"), str(tmp_path))


def test_table_from_fabricated_logs(tmp_path):
    """grpo at k = 0 climbs to 0.5 (window 1 step: last 0.5) on seeds 1 and 2; at k = 2 ends at 0.3 and 0.6 with
    stale KL 0.01 and 0.03 (peaks 0.5 and 0.6), the first minibatch's spread 0.5 on seed 1: paired -0.200, +0.100.
    The decoupled variant's k = 0 row is grpo's runs; its k = 2 run (seed 1 only) ends at 0.4 with masked fraction
    0.25: paired -0.100, and its drop minus grpo's on seed 1 +0.100 (grpo's own row is not paired against itself)."""
    def write(name, seed, rewards, **extra):
        d = tmp_path / f"{name}__{seed}"
        d.mkdir()
        rows = [{"charts/reward_mean": r, "losses/clipfrac": 0.1, "losses/clipfrac_seq": 0.2,
                 "perf/wall_time": 10.0 * (i + 1), **extra} for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    climb = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]
    write("grpo__L16__k0__n10", 1, climb)
    write("grpo__L16__k0__n10", 2, climb)
    write("grpo__L16__k2__n10", 1, climb[:-1] + [0.3], **{"stale/versions_behind": 2, "stale/kl": 0.01,
                                                         "losses/log_ratio_var_first": 0.5})
    write("grpo__L16__k2__n10", 2, climb[:-1] + [0.6], **{"stale/versions_behind": 2, "stale/kl": 0.03})
    write("grpo-decoupled__L16__k2__n10", 1, climb[:-1] + [0.4],
          **{"stale/versions_behind": 2, "stale/kl": 0.02, "rollout_is/masked_frac": 0.25})
    write("grpo__L64__k0__n10", 1, climb)  # no decoupled run at L = 64: no borrowed row there
    runs = sr.load(str(tmp_path), ["grpo", "grpo-decoupled"], [0, 2], [16, 64], [1, 2])
    assert list(runs) == [("grpo", 16, 0, 10), ("grpo", 16, 2, 10), ("grpo", 64, 0, 10),
                          ("grpo-decoupled", 16, 0, 10), ("grpo-decoupled", 16, 2, 10)]
    out = sr.table(runs, [1, 2])
    rows = [line.split(" | ") for line in out.split("\n") if line.startswith("| `")]
    assert rows[0][1:9] == ["16", "0", "10", "0.000 ± 0.000", "0.500 ± 0.000", "0.500 ± 0.000", "0/2",
                            "0.0e+00 ± 0.0e+00"]
    assert rows[1][5:9] == ["0.450 ± 0.212", "0.550 ± 0.071", "0/2", "2.0e-02 ± 1.4e-02"]
    assert rows[1][9] == "5.0e-01"  # seed 1's alone: seed 2 logged none
    assert rows[4][5] == "0.400" and rows[4][14] == "0.250"
    paired = [line for line in out.split("\n") if line.startswith("- ") and "its drop minus" not in line]
    assert paired == ["- `grpo` L = 16, k = 2 minus k = 0, reward over the last 10%, by seed: -0.200, +0.100 "
                      "(-0.050 ± 0.212)",
                      "- `grpo-decoupled` L = 16, k = 2 minus k = 0, reward over the last 10%, by seed: -0.100 "
                      "(-0.100)"]
    versus = out.split("minus `grpo`'s, paired by seed (< 0: it loses more):\n")[1].split("\n")
    assert versus == ["- `grpo-decoupled` L = 16, k = 2: its drop minus `grpo`'s, by seed 1: +0.100 (0.100)"]
    pytest.importorskip("matplotlib")
    assert sr.plot(runs, str(tmp_path / "staleness.png")) and (tmp_path / "staleness.png").stat().st_size > 0
