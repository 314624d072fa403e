"""Episodes on the engine (grouprl/engine/turns.py, issue 62 item 6): each row's KV cache kept across its turns,
the next turn prefilling only the tokens past it. Against HF generate re-prefilling the history (the tool loop's
--gen-mode repeat): the same greedy episodes; each model token's log-prob equal to the training forward's, 0 at
the tool tokens; the prefill counted both ways; paged, a group's prompt blocks still shared across turns (fp32,
CPU, the tiny model). The untrained model writes no tool calls of its own, so its turns are read as calls of
tests/programs/tools_example.py's multiply (every turn, or those of an odd length), whose results the real tool
worker returns."""
import os

import pytest
import torch

from grouprl import engine, episodes, modeling
from grouprl.distributed import Dist, seed_everything
from grouprl.engine import settings, turns
from grouprl.episodes import Tools, generate_episodes, tool_suffix_ids
from grouprl.sampling import Sampling
from helpers import CPU, ROOT, hf_greedy, setup  # noqa: F401 (the fixture)

TOOLS = os.path.join(ROOT, "tests", "programs", "tools_example.py") + ":multiply"
CALL = [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]


def scripted_calls(monkeypatch, every=True):
    """Each model turn read as one call of multiply(6, 7) (every turn, or those of an odd length in characters)."""
    monkeypatch.setattr(episodes, "parse_calls", lambda text: CALL if every or len(text) % 2 else [])


def early_eos(lm, tok, ids):
    """EOS ids that greedy turns meet after a few tokens (the tiny model's EOS alone: turns run to the budget)."""
    comps, _ = hf_greedy(lm, tok, ids, 1, [tok.eos_token_id], 8)
    return sorted({comps[0][2], comps[1][4], comps[2][3], tok.eos_token_id})


def run_episodes(lm, tok, ids, n, eos, mode, budget, calls, **how):
    """generate_episodes over the prompts ids (greedy unless how says otherwise) -> the Rollout, and the engine's
    Episodes when it made them (the counts)."""
    made = []
    close = turns.Episodes.close

    def spy(self):
        made.append(self)
        close(self)

    how = {"temperature": 1.0, "top_k": 1, **how}
    tools = Tools(TOOLS, calls)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(turns.Episodes, "close", spy)
            roll = generate_episodes(modeling.Policy(lm), tok, [tok.decode(p) for p in ids], n, eos,
                                     Dist(0, 1, CPU), Sampling(budget, mode=mode, **how), tools)
    finally:
        tools.stop()
    return roll, (made[-1] if made else None)


def segments(mask_row):
    """A completion's runs of tool tokens (mask 0 between model tokens) -> [(start, end)]."""
    m, out, k = mask_row.tolist(), [], 0
    last = max(i for i, x in enumerate(m) if x) if any(m) else -1
    while k <= last:
        if m[k] == 0:
            j = k
            while m[j] == 0:
                j += 1
            out.append((k, j))
            k = j
        k += 1
    return out


@pytest.mark.parametrize("n, budget, calls, every, mode, how", [
    (2, 60, 3, True, "engine", {}), (1, 200, 2, False, "engine", {}), (3, 50, 4, True, "engine", {}),
    (2, 60, 3, True, "engine-tp", {}), (2, 60, 3, True, "engine", {"repetition_penalty": 1.3, "min_new_tokens": 2})])
def test_greedy_episodes_equal_hf_reprefilling_the_history(setup, monkeypatch, n, budget, calls, every, mode, how):
    """The engine with the kept cache gives HF's greedy episodes (--gen-mode repeat, whose every turn re-prefills
    the history): the same ids, mask, ends and texts; turns ended by EOS, by the budget (a tool result rolled
    back), by the rounds' limit, and (every=False) turns without a call, in groups of 1-3 rows; engine-tp on one
    process; with HF's repetition penalty over the whole history and min_new_tokens in every turn. A later turn
    prefills 3 rows at a time (settings.EXTEND_ROWS)."""
    tok, lm, ids = setup
    monkeypatch.setattr(settings, "EXTEND_ROWS", 3)
    scripted_calls(monkeypatch, every)
    eos = early_eos(lm, tok, ids)
    want, _ = run_episodes(lm, tok, ids, n, eos, "repeat", budget, calls, **how)
    got, kept = run_episodes(lm, tok, ids, n, eos, mode, budget, calls, **how)
    assert want.logp is None and kept is not None and kept.counts["turns"] > 1  # episodes of several turns
    assert any(len(segments(m)) > 1 for m in got.mask)  # some episode made two tool turns or more
    for name in ("input_ids", "attention_mask", "mask", "truncated"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.texts == want.texts and got.stats == want.stats


@pytest.mark.parametrize("how", [{}, {"temperature": 0.7, "top_k": 0}])
def test_episode_logp_is_the_training_forwards_at_the_models_tokens(setup, monkeypatch, how):
    """Rollout.logp of an episode (greedy, and sampled at temperature 0.7): at every mask-1 position the
    training forward's log-prob (Policy.forward at the sampling temperature) to 1e-5, as the engine's own test;
    exactly 0 at the tool turns' tokens and the padding, so --old-logp rollout and the rollout corrections read
    the model's tokens alone."""
    tok, lm, ids = setup
    scripted_calls(monkeypatch)
    torch.manual_seed(5)
    roll, _ = run_episodes(lm, tok, ids, 2, early_eos(lm, tok, ids), "engine", 60, 3, **how)
    mask = roll.mask.bool()
    assert (~mask & roll.attention_mask[:, roll.n_prompt:].bool()).any()  # tool tokens inside the episodes
    policy = modeling.Policy(lm, temperature=how.get("temperature", 1.0), chunk_tokens=16)
    want = policy(roll.input_ids, roll.attention_mask, roll.n_prompt).detach()
    torch.testing.assert_close(roll.logp[mask], want[mask], atol=1e-5, rtol=1e-5)  # fp32: a few ulp of |logp|
    assert torch.equal(roll.logp[~mask], torch.zeros(int((~mask).sum())))


def test_kept_cache_prefills_the_tool_turn_alone(setup, monkeypatch):
    """Counted: with the kept cache each later turn prefills the last turn's EOS and the tool turn (1 + its
    tokens), re-prefilling the history (settings.KEEP_TURNS False, as HF generate does) every token before;
    both give the same greedy episodes and log-probs (1e-5), and the first turn's prompt is prefilled once a
    group either way."""
    tok, lm, ids = setup
    scripted_calls(monkeypatch)
    eos = early_eos(lm, tok, ids)
    kept_roll, kept = run_episodes(lm, tok, ids, 2, eos, "engine", 60, 3)
    monkeypatch.setattr(settings, "KEEP_TURNS", False)
    full_roll, full = run_episodes(lm, tok, ids, 2, eos, "engine", 60, 3)
    assert torch.equal(kept_roll.input_ids, full_roll.input_ids) and torch.equal(kept_roll.mask, full_roll.mask)
    torch.testing.assert_close(kept_roll.logp, full_roll.logp, atol=1e-5, rtol=0)
    P = kept_roll.n_prompt
    prompts = kept_roll.attention_mask[:, :P].sum(1).tolist()
    want_kept, want_full = [], []
    for b, m in enumerate(kept_roll.mask):
        first = prompts[b] / 2  # the group's prompt, prefilled once for its 2 rows
        tool_turns = segments(m)
        want_kept.append(first + sum(j - i + 1 for i, j in tool_turns))
        want_full.append(first + sum(prompts[b] + j for _, j in tool_turns))
    assert kept.prefilled == want_kept and full.prefilled == want_full
    assert sum(want_kept) < sum(want_full) / 2
    assert kept.counts["prefill_tokens"] == sum(want_kept)


def test_paged_group_prompt_blocks_shared_across_turns(setup, monkeypatch):
    """Paged (blocks of 8 positions): a group's rows hold its prompt's full blocks once (the same physical blocks,
    counted by every row) through every turn, the next turn's tokens go to each row's own blocks, and every block
    is back in the pool when the episodes end. The tokens and log-probs (1e-5) are those of the whole cache, kept
    and re-prefilled (KEEP_TURNS off), with the host looking after every step (sync_every 1: no step runs after a
    turn's last row ends, so its EOS, never fed, is in no cache until the next turn prefills it)."""
    monkeypatch.setattr(settings, "PAGE", 8)
    tok, lm, ids = setup
    eos, n, budget = early_eos(lm, tok, ids), 3, 64
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}])
    runs = []
    for pool, keep in ((None, False), (None, True), (2048, True)):
        monkeypatch.setattr(settings, "KEEP_TURNS", keep)
        sampling = Sampling(budget, temperature=1.0, top_k=1)
        setup_ = engine.Setup(64, CPU, torch.float32, pool_tokens=pool, sync_every=1)
        first = turns.begin(lm, ids, n, eos, sampling, setup_)
        kept = turns.of(lm)
        e, out = kept.engine, [first]
        for _ in range(2):  # two tool turns after the last turn of every row with room for them
            fits = [s for s, x in enumerate(kept.ids) if len(x) + len(suffix) < len(ids[s // n]) + budget]
            histories = [kept.ids[s] + suffix for s in fits]
            room = [len(ids[s // n]) + budget - len(h) for s, h in zip(fits, histories)]
            out.append(kept.next(histories, room))
            if pool:
                for b, p in enumerate(ids):
                    shared = len(p) // 8
                    rows = [e.owned[b * n + j] for j in range(n)]
                    assert shared and all(r[:shared] == rows[0][:shared] for r in rows)
                    assert all(e.refs[blk] == n for blk in rows[0][:shared])
                    assert len({blk for r in rows for blk in r[shared:]}) == sum(len(r) - shared for r in rows)
        sequences = [list(x) for x in kept.ids]
        assert turns.end(lm, sequences) == kept.logp and turns.of(lm) is None
        if pool:
            assert len(e.free) == pool // 8 and not any(e.owned)
        assert len(out[1]) > 0 and len(out[2]) > 0  # rows made a second and a third turn
        runs.append(([[t for t, _ in o] for o in out], sequences, kept.logp))
    (tokens, seqs, logps), *others = runs
    for tokens_, seqs_, logps_ in others:
        assert tokens_ == tokens and seqs_ == seqs
        for a, b in zip(logps_, logps):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_the_penalty_reads_the_whole_history(setup):
    """--repetition-penalty, as HF's generate over the history: after a later turn each row's seen ids (the
    Engine's [slots, vocab] buffer) are its whole history's, the tool turn's new ids included (not only the prompt's
    and the tokens the steps read), and none other."""
    tok, lm, ids = setup
    n, eos = 2, early_eos(lm, tok, ids)
    turns.begin(lm, ids, n, eos, Sampling(30, top_k=1, repetition_penalty=1.3), engine.Setup(64, CPU, torch.float32))
    kept = turns.of(lm)
    rows = [s for s, x in enumerate(kept.ids) if len(x) + 5 < len(ids[s // n]) + 30]
    fresh = [[t for t in range(3, 100) if t not in kept.ids[s]][:4] for s in rows]  # ids the row never read
    histories = [kept.ids[s] + f for s, f in zip(rows, fresh)]
    kept.next(histories, [len(ids[s // n]) + 30 - len(h) for s, h in zip(rows, histories)])
    seen = kept.engine.seen
    for s, f in zip(rows, fresh):
        have = set(seen[s].nonzero().flatten().tolist())
        assert set(f) <= have and set(kept.ids[s][:-1]) <= have <= set(kept.ids[s]), s
    turns.end(lm)


def test_a_history_no_row_began_is_refused(setup):
    """A history that extends no open row, and engine-tp's episodes over several processes: one line each."""
    tok, lm, ids = setup
    from grouprl import generation

    with pytest.raises(SystemExit, match="engine-tp over several processes"):
        generation.generate(modeling.Policy(lm), tok, ["x"], 1, [tok.eos_token_id], Dist(0, 2, CPU),
                            Sampling(4, mode="engine-tp"), episodes=True)
    seed_everything(0)
    turns.begin(lm, ids[:1], 1, [tok.eos_token_id], Sampling(4, top_k=1), engine.Setup(4, CPU, torch.float32))
    with pytest.raises(ValueError, match="no open episode's row begins"):
        turns.of(lm).next([[1, 2, 3]], [4])
    turns.end(lm)


def test_gspo_trains_on_engine_episodes_with_rollout_logps(monkeypatch, tmp_path):
    """gspo.py --tools --gen-mode engine end to end, every turn read as a call: with the training forward's pi_old
    the engine's episode log-probs agree with it at the model's tokens (gen/logp_drift < 1e-5, fp32), and
    --old-logp rollout trains on them."""
    from helpers import run_script

    scripted_calls(monkeypatch)
    common = ["--tools", TOOLS, "--max-tool-calls", "2", "--num-steps", "2", "--prompts-per-rank", "2",
              "--group-size", "2", "--num-minibatches", "1", "--max-new-tokens", "48", "--eval-every", "0",
              "--log-samples", "0", "--gen-mode", "engine"]
    try:
        rows, _ = run_script("gspo", common, monkeypatch, tmp_path / "recompute")
        train = [r for r in rows if "tools/call_frequency" in r]
        assert len(train) == 2 and all(r["tools/turns_per_episode"] > 1 for r in train)
        assert all(0 <= r["gen/logp_drift"] < 1e-5 for r in train), [r["gen/logp_drift"] for r in train]
        rows, _ = run_script("gspo", common + ["--old-logp", "rollout"], monkeypatch, tmp_path / "rollout")
        train = [r for r in rows if "tools/call_frequency" in r]
        assert len(train) == 2 and all("gen/logp_drift" not in r for r in train)  # pi_old is pi_rollout
        assert all(r["perf/old_logp_s"] == 0.0 for r in train)
    finally:
        episodes._TOOLS.pop((TOOLS, None, 2)).stop()
