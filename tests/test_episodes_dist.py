"""Episodes under torchrun (issue 62 item 1): two ranks whose episodes differ in length and turn count make the same
generate calls (FSDP2's all-gathers inside HF generate), each rank's episodes equal the plain model's on one process,
the tools/* stats are summed over the ranks, and gspo.py runs episodes with --dynamic-sampling. One launch of
tests/programs/episodes_ranks.py (its docstring says what each case asserts). gspo.py's numbers under torchrun are
not compared with a one-process run's: each rank samples from its own seed (seed_rank), so the episodes themselves
differ; the program's cases compare the same episodes instead, exactly (tokens, mask, tools/* counts)."""
import glob

from helpers import read_rows, torchrun


def test_episodes_under_torchrun(tmp_path):
    p = torchrun("tests/programs/episodes_ranks.py", str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    ok = [line.split(":")[0] for line in p.stdout.splitlines() if line.startswith("OK ")]
    assert ok == ["OK repeat", "OK shared-prefill", "OK engine", "OK environment"], p.stdout
    (run,) = glob.glob(f"{tmp_path}/*/metrics.jsonl")
    evals = [r for r in read_rows(run) if "eval/tools/call_frequency" in r]  # steps 0 and 1: episodes held out
    (row,) = [r for r in read_rows(run) if "charts/gen_rounds" in r]  # gspo.py --tools --dynamic-sampling, 1 step
    assert row["charts/gen_rounds"] == 2 and row["tools/call_frequency"] > 0  # the random model's rewards are flat
    assert row["tools/turns_per_episode"] > 1  # episodes went on after a tool turn
    assert len(evals) == 2
    for r in evals:  # every rank's episodes counted once (generate_episodes' counts are reduced already)
        episodes = r["eval/prompts"] * r["eval/samples"]
        assert r["eval/tools/cut_by_budget"] == r["eval/truncated_frac"] * episodes > 0, r
