"""experiments/precision_runs.py --corrections without the model (issue 51 item 3): its commands are TRL's four
rollout-correction modes at C_max = 3 and OPSM at delta 0.5 on the bf16 engine, and its table, rebuilt from
fabricated logs, puts the main table's two GSPO rows beside them, numbers by hand."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import precision_runs  # noqa: E402


def test_correction_commands_are_trls_modes_and_opsm():
    flags = {name: " ".join(argv) for name, argv in precision_runs.CORRECTIONS.items()}
    for mode in ("token-truncate", "token-mask", "sequence-truncate", "sequence-mask"):
        assert flags[f"gspo, recomputed, {mode} 3"] == (
            f"gspo.py --gen-dtype bf16 --rollout-is-mode {mode} --rollout-is-cap 3")
    assert flags["gspo, rollout, OPSM 0.5"] == "gspo.py --gen-dtype bf16 --old-logp rollout --off-policy-mask 0.5"
    assert "--gen-mode engine" in " ".join(precision_runs.BUDGET)  # the rollout's likelihoods are the engine's


def write(folder, row):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0}) + "\n" + json.dumps(row) + "\n")  # the table reads the last row


def test_correction_table_from_fabricated_logs(tmp_path):
    """By hand: tokens truncated 0.01 and 0.03 -> 0.0200 ± 0.0141; KL 1e-3 and 3e-3 -> 2.0e-03 ± 1.4e-03; the
    baseline's clip fraction 0.1 and 0.3 -> 0.2000 ± 0.1414 read from the main table's logs; a column a run does not
    log stays empty; a configuration without logs has no row."""
    main_logs, logs = tmp_path / "logs", tmp_path / "corrections" / "logs"
    for seed, (clip, capped, kl) in enumerate([(0.1, 0.01, 1e-3), (0.3, 0.03, 3e-3)], 1):
        write(main_logs / f"gspo,_rollout__{seed}", {"losses/ratio_min": 0.97, "losses/ratio_max": 1.03,
                                                      "losses/clipfrac": clip})
        write(logs / f"gspo,_recomputed,_token-truncate_3__{seed}",
              {"rollout_is/capped_frac": capped, "rollout_is/weight_mean": 1.0, "rollout_is/kl": kl,
               "rollout_is/chi2": 2 * kl, "losses/ratio_min": 1.0, "losses/ratio_max": 1.0, "losses/clipfrac": 0.0})
    write(logs / "gspo,_rollout,_OPSM_0.5__1", {"losses/opsm_frac": 0.25, "losses/clipfrac": 0.1})
    lines = precision_runs.correction_table(str(logs), [1, 2, 3]).splitlines()
    assert lines[0] == ("| configuration | seeds | tokens truncated | tokens masked | sequences dropped (OPSM) | "
                        "weight mean | KL(pi_old, pi_rollout) a token | chi2 a token | ratio min (s_i) | "
                        "ratio max (s_i) | clip fraction (tokens) |")
    assert len(lines) == 5  # header, rule, three configurations with logs
    assert lines[2] == "| gspo, rollout | 2 |  |  |  |  |  |  | 0.9700 ± 0.0000 | 1.0300 ± 0.0000 | 0.2000 ± 0.1414 |"
    assert lines[3] == ("| gspo, recomputed, token-truncate 3 | 2 | 0.0200 ± 0.0141 |  |  | 1.0000 ± 0.0000 "
                        "| 2.0e-03 ± 1.4e-03 | 4.0e-03 ± 2.8e-03 | 1.0000 ± 0.0000 | 1.0000 ± 0.0000 | 0.0000 ± 0.0000 |")
    assert lines[4] == "| gspo, rollout, OPSM 0.5 | 1 |  |  | 0.2500 |  |  |  |  |  | 0.1000 |"


def write_curve(folder, rewards, clips, extra=None):
    """Two steps of a --curves run's metrics.jsonl: wall times 10 and 30 (a step 20 s), Jitter2 0.5."""
    os.makedirs(folder)
    rows = [{"step": t + 1, "charts/reward_mean": r, "losses/clipfrac": c, "losses/log_ratio_var_first": 0.0,
             "perf/wall_time": 10.0 + 20 * t, "perf/old_logp_s": 2.0, "charts/reward_jitter2": 0.5,
             **{k: v[t] for k, v in (extra or {}).items()}} for t, (r, c) in enumerate(zip(rewards, clips))]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_correction_curve_table_from_fabricated_logs(tmp_path):
    """--corrections --curves, by hand: token-mask's rewards (0.1, 0.5) and (0.2, 0.3) -> each step's mean over seeds
    0.15 0.40, its last 2 steps (0.3, 0.25) 0.275 ± 0.035; clip (0.3, 0.1) 0.2000 ± 0.1414; tokens masked 0.02 and
    0.02 -> 0.0200 ± 0.0000, the other correction columns empty; paired with GSPO recomputed (last 2 steps 0.2,
    0.3; clip 0.1, 0.2): reward +0.100, -0.050 (0.025 ± 0.106), clip +0.200, -0.100 (0.050 ± 0.212). GSPO on the
    rollout's likelihoods has no logs here: no row."""
    logs = tmp_path / "logs"
    write_curve(logs / "gspo_recomputed__1", [0.1, 0.3], [0.1, 0.1])
    write_curve(logs / "gspo_recomputed__2", [0.2, 0.4], [0.2, 0.2])
    write_curve(logs / "gspo_recomputed_token-mask_3__1", [0.1, 0.5], [0.3, 0.3], {"rollout_is/masked_frac": [0.01, 0.03]})
    write_curve(logs / "gspo_recomputed_token-mask_3__2", [0.2, 0.3], [0.1, 0.1], {"rollout_is/masked_frac": [0.02, 0.02]})
    lines = precision_runs.correction_curve_table(str(logs), [1, 2, 3]).splitlines()
    assert lines[0].endswith("| tokens truncated | tokens masked | sequences dropped (OPSM) |")
    assert lines[2].startswith("| gspo recomputed | 2 | 0.15 0.35 | 0.250 ± 0.071 | 0.250 ± 0.071 |")
    assert lines[3] == ("| gspo recomputed token-mask 3 | 2 | 0.15 0.40 | 0.275 ± 0.035 | 0.275 ± 0.035 | 0.500 ± 0.000 "
                        "| 0.2000 ± 0.1414 | 0.0e+00 ± 0.0e+00 | 20 ± 0 | 2.0 ± 0.0 |  | 0.0200 ± 0.0000 |  |")
    assert ("gspo recomputed token-mask 3 minus gspo recomputed, reward over the last 2 steps, paired by seed: seed 1: "
            "+0.100, seed 2: -0.050 (mean 0.025 ± 0.106)") in lines
    assert ("gspo recomputed token-mask 3 minus gspo recomputed, clip fraction over steps, paired by seed: seed 1: "
            "+0.200, seed 2: -0.100 (mean 0.050 ± 0.212)") in lines
