"""The length lab (issue 51): --min-new-tokens (HF's min_new_tokens) holds every completion to a length, and
--noise-stats logs the importance weights' spread over sequences and the cosine between the gradients of a
minibatch's two halves, by hand and through a script's own loop."""
import json
import math
import os
import sys

import pytest
import torch

import common
from helpers import run_script
from grouprl.sampling import Sampling


def test_noise_stats_by_hand():
    """Two sequences, token log-ratios [0.2, 0.4] and [-0.3] (the padding's 5 is not read): x = mean = [0.3, -0.3],
    sums [0.6, -0.3]; moments (0, 0.18, 2) and (0.3, 0.45, 2). Gradients: the first half [1, 0] then the total
    [2, 1]: g_2 = [1, 1], cos = 1 / sqrt 2. On the step's first update the spread is not counted."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[0.2, 0.4], [-0.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    g1 = [torch.tensor([1.0, 0.0])]
    first = common.noise_stats(logp, old, mask, 1, g1, None)
    assert [float(x) for x in first["noise/seq_log_ratio_var"]] == pytest.approx([0.0, 0.18, 2])
    assert [float(x) for x in first["noise/seq_log_ratio_sum_var"]] == pytest.approx([0.3, 0.45, 2])
    assert first["noise/grad_cos_later"] == (0.0, 0.0)  # the first half: kept, not counted
    second = common.noise_stats(logp, old, mask, 1, [torch.tensor([2.0, 1.0])], g1)
    assert second["noise/grad_cos_later"][0] == pytest.approx(1 / math.sqrt(2)) and second["noise/grad_cos_later"][1] == 1
    assert second["noise/grad_cos_first"] == (0.0, 0.0)
    assert float(common.noise_stats(logp, old, mask, 0, g1, None)["noise/seq_log_ratio_var"][2]) == 0


def test_noise_stats_through_the_loop(monkeypatch, tmp_path):
    """grpo.py, 2 minibatches of 2 groups of 4 in halves: the logged variances are those of the rows' log-ratios
    after the first update (positive once the policy moved), the cosines lie in [-1, 1]; a wrong micro-batch size
    is refused in one line."""
    (tmp_path / "spread_reward51.py").write_text(  # completions of 4 tokens whose rewards differ
        "def f(completion, answer):\n    return float(sum(map(ord, completion)) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--num-steps", "1", "--prompts-per-rank", "4", "--group-size", "4", "--num-minibatches", "2",
            "--eval-every", "0", "--reward", "spread_reward51:f", "--learning-rate", "1e-2", "--noise-stats",
            "--min-new-tokens", "4", "--max-new-tokens", "4"]
    rows, _ = run_script("grpo", argv + ["--micro-batch-size", "4"], monkeypatch, tmp_path / "ok")
    r = rows[0]
    assert r["noise/seq_log_ratio_var"] > 0 and r["noise/seq_log_ratio_sum_var"] > r["noise/seq_log_ratio_var"]
    assert -1 <= r["noise/grad_cos_first"] <= 1 and -1 <= r["noise/grad_cos_later"] <= 1
    with pytest.raises(SystemExit, match="--noise-stats compares the gradients of each minibatch's two halves: "
                                         "give --micro-batch-size 4"):
        run_script("grpo", argv + ["--micro-batch-size", "2"], monkeypatch, tmp_path / "bad")


def test_min_new_tokens_masks_eos_until_then():
    """Half the vocabulary made EOS: without the flag most completions stop at their first token; with
    min_new_tokens 4 none stops before 4 tokens, and a row may stop right after."""
    from grouprl import distributed, modeling

    tok = modeling.tiny_tokenizer()
    d = distributed.Dist(0, 1, torch.device("cpu"))
    policy = modeling.Policy(modeling.load_model("tiny", tok, d, seed=0)[0], 1.0, 16)
    eos = list(range(0, len(tok), 2))
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=64)
    torch.manual_seed(0)
    free = common.generate(policy, tok, ["1+2=", "3+4="], 8, eos, d, Sampling(**kw))
    held = common.generate(policy, tok, ["1+2=", "3+4="], 8, eos, d, Sampling(min_new_tokens=4, **kw))
    assert (free.mask.sum(1) < 4).float().mean() > 0.5
    lengths = held.mask.sum(1)
    assert (lengths >= 4).all() and (lengths < 8).any()
    first4 = held.input_ids[:, held.n_prompt:held.n_prompt + 4]
    assert not torch.isin(first4, torch.tensor(eos)).any()


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_masks_eos_until_min_new_tokens(graphs):
    """--gen-mode engine, the same half-of-the-vocabulary EOS set: with min_new_tokens 4 no completion is shorter than
    5 tokens (EOS at index 4 the earliest, as HF's), some are exactly 5 (the mask lifts at 4, not later), none has an
    EOS among its first 4; max_new_tokens 3 < 4 still caps (3 tokens, none an EOS); eager and the graphs' step."""
    from grouprl import distributed, modeling

    tok = modeling.tiny_tokenizer()
    d = distributed.Dist(0, 1, torch.device("cpu"))
    policy = modeling.Policy(modeling.load_model("tiny", tok, d, seed=0)[0], 1.0, 16)
    eos = list(range(0, len(tok), 2))
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=16, mode="engine", cuda_graphs=graphs)
    torch.manual_seed(0)
    free = common.generate(policy, tok, ["1+2=", "3+4="], 8, eos, d, Sampling(max_new_tokens=8, **kw))
    held = common.generate(policy, tok, ["1+2=", "3+4="], 8, eos, d, Sampling(max_new_tokens=8, min_new_tokens=4, **kw))
    assert (free.mask.sum(1) < 4).float().mean() > 0.5
    lengths = held.mask.sum(1)
    assert (lengths >= 5).all() and (lengths == 5).any() and (lengths < 8).any()
    P = held.n_prompt
    assert not torch.isin(held.input_ids[:, P:P + 4], torch.tensor(eos)).any()
    short = common.generate(policy, tok, ["1+2="], 8, eos, d, Sampling(max_new_tokens=3, min_new_tokens=4, **kw))
    assert (short.mask.sum(1) == 3).all() and short.truncated.all()


def hf_greedy_logps(lm, ids, eos, max_new_tokens, min_new_tokens):
    """HF generate, greedy, each prompt alone: its completion up to the first EOS and each token's log-prob under the
    softmax of the scores HF's processors leave (output_scores: EOS's logit -inf until min_new_tokens)."""
    out = []
    for p in ids:
        g = lm.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                        min_new_tokens=min_new_tokens, eos_token_id=eos, pad_token_id=0, output_scores=True,
                        return_dict_in_generate=True)
        tokens = g.sequences[0, len(p):].tolist()
        end = next((t + 1 for t, x in enumerate(tokens) if x in eos), len(tokens))
        out.append((tokens[:end], [torch.log_softmax(g.scores[t][0].float(), -1)[tokens[t]].item()
                                   for t in range(end)]))
    return out


# eos: tokens the unmasked greedy rows of 2 prompts write among their first 4 (ends at 3 and 4 tokens), met by none
# after: masked, those rows run on; pool: a paged KV pool (blocks of 16) that the masked rows outgrow (preemption)
@pytest.mark.parametrize("n, slots, graphs, pool", [(1, 2, False, None), (3, 4, True, None), (1, 5, False, 96),
                                                    (3, 9, True, 320)])
def test_engine_min_new_tokens_equals_hf(n, slots, graphs, pool):
    """min_new_tokens 4 under greedy decoding (top_k 1): the engine's completions equal HF shared-prefill's (and
    differ from those without the mask: two rows would end at 3 and 4 tokens), each token's log-prob equals the
    log-softmax of HF's processed scores (the masked distribution) to 1e-5; eager and through the graphs' step (its
    mask read from the Engine's fixed buffers), whole and paged, where groups are preempted and made anew (their
    count of tokens, and so the mask, starting again)."""
    from helpers import hf_greedy, run, setup_model

    tok, lm, ids = setup_model()
    eos = [0, 32, 93]
    ref, truncated = hf_greedy(lm, tok, ids, n, eos, 24, "shared-prefill", min_new_tokens=4)
    free, _ = hf_greedy(lm, tok, ids, n, eos, 24, "shared-prefill")
    assert sorted({len(c) for c in free})[:2] == [3, 4] and min(map(len, ref)) > 4
    stats = {}
    comps, logps = run(lm, ids, n, eos, 24, slots, sync_every=3, graphs=graphs, pool_tokens=pool, stats=stats,
                       min_new_tokens=4)
    assert comps == ref and [c[-1] not in eos for c in comps] == truncated
    assert (stats["preempted"] > 0) == (pool is not None), stats
    want = hf_greedy_logps(lm, ids, eos, 24, 4)
    for b, (c, lp) in enumerate(zip(comps, logps)):
        assert c == want[b // n][0]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(want[b // n][1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pool", [None, 320])
def test_engine_min_new_tokens_sampled_logps(pool):
    """Sampled with one seed (temperature 0.7) and min_new_tokens 4, EOS half the vocabulary, whole and paged: no EOS
    among a completion's first 4 tokens; the graphs' step draws the eager step's tokens (log-probs to 1e-5); each
    log-prob is the masked distribution's, log_softmax(logits / 0.7) of HF's forward with EOS's logits -inf at indices
    0..3 (to 1e-5 and 1e-5 relative: the enlarged weights' log-probs reach ~-5)."""
    from helpers import run, setup_model

    tok, lm, ids = setup_model()
    eos = list(range(0, len(tok), 2))
    kw = dict(sync_every=3, pool_tokens=pool, temperature=0.7, top_k=0, min_new_tokens=4)
    out = {g: run(lm, ids, 3, eos, 12, 9, graphs=g, generator=torch.Generator().manual_seed(5), **kw)
           for g in (False, True)}
    comps, logps = out[True]
    assert comps == out[False][0]
    for a, b in zip(logps, out[False][1]):  # the graphs' read length rounded up: float error apart
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert min(map(len, comps)) == 5 and not any(t in eos for c in comps for t in c[:4])
    for b, (c, lp) in enumerate(zip(comps, logps)):
        p = ids[b // 3]
        logits = lm(torch.tensor([p + c])).logits[0, len(p) - 1:-1].detach()
        logits[:4, eos] = float("-inf")
        want = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=1e-5)


def length_runs():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    import length_runs
    return length_runs


def test_length_table_from_fabricated_logs(tmp_path):
    """experiments/length_runs.py's table from made-up logs ({name}__n{steps}__{seed}/metrics.jsonl): grpo.py at
    L = 16 and 64, two seeds, 10 steps. Seed 1 at L = 64 rises to 0.8 and falls to 0.0: a window of 1 step, peak
    0.8 >= first 0.0 + 0.05 (it learned) and last 0.0 <= first (lost it all): collapsed; its other runs climb to 0.5
    and stay. Var log prod_t w_it 1 and 4 (seed 1), 2 and 2 (seed 2): growth 4.00 and 1.00, mean 2.50 ± 2.12;
    reward per 1k tokens: the mean reward over steps / L x 1000; gspo.py at L = 16 ends at 0.7 and 0.4 (seeds 1, 2),
    paired with grpo.py's 0.5: +0.200, -0.100. A 20-step run of seed 1 at L = 16 (reward 0.3 throughout) is a row
    of its own, after the 10-step one, with no growth line (one length); seed 3 (not asked for) and a folder without
    metrics.jsonl are not read."""
    lr = length_runs()

    def write(length, seed, rewards, sum_var, steps=10, script="grpo"):
        d = tmp_path / f"{script}__L{length}__lr5e-4__n{steps}__{seed}"
        d.mkdir()
        rows = [{"charts/reward_mean": r, "noise/seq_log_ratio_var": sum_var / length,
                 "noise/seq_log_ratio_sum_var": sum_var, "noise/grad_cos_later": 0.5, "losses/clipfrac": 0.1,
                 "losses/clipfrac_seq": 0.2, "perf/wall_time": 10.0 * (i + 1)} for i, r in enumerate(rewards)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    climb = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5]
    write(16, 1, climb, 1.0)
    write(16, 2, climb, 2.0)
    write(64, 1, [0.0, 0.2, 0.4, 0.6, 0.8, 0.6, 0.4, 0.3, 0.2, 0.0], 4.0)
    write(64, 2, climb, 2.0)
    write(16, 1, [0.3] * 20, 8.0, steps=20)
    write(16, 3, [9.0] * 10, 1.0)  # seed 3: not asked for
    (tmp_path / "grpo__L64__lr5e-4__n20__1").mkdir()  # no metrics.jsonl: not read
    write(16, 1, [0.7] * 10, 1.0, script="gspo")  # paired with grpo.py's seed 1: last 0.7 - 0.5
    write(16, 2, [0.4] * 10, 1.0, script="gspo")
    out = lr.table(str(tmp_path), ["grpo.py", "gspo.py"], [16, 64], ["5e-4"], [1, 2])
    row16, row16_20, row64 = [line for line in out.split("\n") if line.startswith("| `grpo.py`")]
    assert row16.split(" | ")[1:9] == ["16", "5e-4", "10", "0.000 ± 0.000", "0.500 ± 0.000", "0.500 ± 0.000",
                                       "0/2", "9.4e-02 ± 4.4e-02"]
    assert row16_20.split(" | ")[1:11] == ["16", "5e-4", "20", "0.300", "0.300", "0.300", "0/1", "5.0e-01",
                                           "8.0e+00", "0.500"]
    assert row64.split(" | ")[1:4] == ["64", "5e-4", "10"]
    assert row64.split(" | ")[7] == "1/2"
    assert row64.split(" | ")[6] == "0.650 ± 0.212"  # peaks 0.8 and 0.5
    per_1k = 1000 * sum(climb) / (10 * 16)
    assert row16.split(" | ")[13] == f"{per_1k:.2f} ± 0.00"
    assert row16_20.split(" | ")[13:] == [f"{1000 * 0.3 / 16:.2f}", "200 |"]
    growth = [line for line in out.split("\n") if line.startswith("- `grpo.py`")]
    assert growth == ["- `grpo.py` lr 5e-4, 10 steps: Var log prod_t w_it at L = 64 over L = 16, by seed: 4.00, "
                      "1.00 (mean 2.50 ± 2.12)",
                      "- `grpo.py` lr 5e-4, 10 steps: Var log s_i at L = 64 over L = 16, by seed: 1.00, 0.25 (mean "
                      "0.62 ± 0.53)"]
    paired = [line for line in out.split("\n") if line.startswith("- `gspo.py`")]
    assert paired == ["- `gspo.py` minus `grpo.py`, L = 16, lr 5e-4, 10 steps: reward over the last 10%, by seed: "
                      "+0.200, -0.100 (0.050 ± 0.212)"]
    bare = {"charts/reward_mean": 1.0, "noise/grad_cos_later": None, "losses/clipfrac": 0.0,
            "losses/clipfrac_seq": 0.0, "perf/wall_time": 1.0}
    assert math.isnan(lr.summary([bare], 4)["cos"])  # none counted
    rewards = lambda rs: [dict(bare, **{"charts/reward_mean": r}) for r in rs]  # noqa: E731
    # collapsed: it learned (peak >= first + 0.05) and lost it all (last <= first)
    assert lr.summary(rewards([0.02, 0.08, 0.02]), 4)["collapsed"] == 1.0
    assert lr.summary(rewards([0.02, 0.06, 0.0]), 4)["collapsed"] == 0.0  # a gain of 0.04: noise, not learning
    assert lr.summary(rewards([0.02, 0.08, 0.03]), 4)["collapsed"] == 0.0  # kept some of it
    pytest.importorskip("matplotlib")
    assert lr.plot(lr.load(str(tmp_path), ["grpo.py"], [16, 64], ["5e-4"], [1, 2]), str(tmp_path / "length.png"))
    assert (tmp_path / "length.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no logs under"):
        lr.table(str(tmp_path), ["dfpo.py"], [16], ["5e-4"], [1])


def test_length_skip_done_lists_only_missing_runs(tmp_path):
    """--skip-done: of grpo.py and gspo.py at L = 16, 64, lr 2e-3, seeds 1-2, 100 steps (8 runs, seed-major), the
    run whose logs hold metrics.jsonl and args.json is left out; one with metrics.jsonl alone (its copy cut short)
    and one of another budget (n200) are not done. Without the flag, all 8; nothing is run."""
    lr = length_runs()
    for name, files in (("grpo__L16__lr2e-3__n100__1", ("metrics.jsonl", "args.json")),
                        ("gspo__L64__lr2e-3__n100__2", ("metrics.jsonl",)),
                        ("grpo__L64__lr2e-3__n200__1", ("metrics.jsonl", "args.json"))):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}\n")
    args = lr.Args(scripts="grpo.py,gspo.py", lengths="16,64", learning_rates="2e-3", seeds=2, steps=100)
    every = [(script, length, "2e-3", s) for s in (1, 2) for script in ("grpo.py", "gspo.py") for length in (16, 64)]
    assert lr.pending(args, str(tmp_path)) == every
    args.skip_done = True
    assert lr.pending(args, str(tmp_path)) == every[1:]
    assert lr.run_name("gspo_token.py", 256, "2e-3", 400) == "gspo_token__L256__lr2e-3__n400"
    with pytest.raises(SystemExit, match="--lengths 16,x: comma-separated whole numbers"):
        lr.pending(lr.Args(lengths="16,x"), str(tmp_path))
    with pytest.raises(SystemExit, match="--scripts nope.py: no such script"):
        lr.pending(lr.Args(scripts="grpo.py,nope.py"), str(tmp_path))


@pytest.mark.parametrize("damage", ["torn", "empty", "key missing"])
def test_length_table_only_on_a_damaged_log_is_one_line(damage, tmp_path, monkeypatch, capsys):
    """Issue 61 item 1(k): length_runs.py --table-only with a metrics.jsonl whose last line is torn (a run cut short
    while writing it), an empty one, or one whose rows lack a column's key stops in one line naming the file and
    line (it was a JSONDecodeError, a StopIteration, a KeyError), and table.md stays as it was. A torn line is not
    skipped: the table would then show a run's first steps as a finished run."""
    lr = length_runs()
    folder = tmp_path / "logs" / "grpo__L16__lr2e-3__n100__1"
    folder.mkdir(parents=True)
    row = {"charts/reward_mean": 0.1, "losses/clipfrac": 0.0, "losses/clipfrac_seq": 0.0, "perf/wall_time": 1.0}
    text = {"torn": json.dumps(row) + "\n" + json.dumps(row)[:20], "empty": "",
            "key missing": json.dumps(row) + "\n" + json.dumps({"charts/reward_mean": 0.2}) + "\n"}[damage]
    (folder / "metrics.jsonl").write_text(text)
    (tmp_path / "table.md").write_text("committed\n")
    monkeypatch.setattr(sys, "argv", ["length_runs.py", "--table-only", "--out", str(tmp_path), "--scripts",
                                      "grpo.py", "--lengths", "16", "--learning-rates", "2e-3", "--seeds", "1"])
    with pytest.raises(SystemExit) as e:
        lr.main()
    said = str(e.value.code)
    where = {"torn": "metrics.jsonl:2: not a JSON row", "empty": "metrics.jsonl: no rows",
             "key missing": "metrics.jsonl:2: the row has no 'losses/clipfrac'"}[damage]
    assert where in said and "\n" not in said, said
    assert (tmp_path / "table.md").read_text() == "committed\n"
