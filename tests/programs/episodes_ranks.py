"""Run under `torchrun --nproc-per-node 2 tests/programs/episodes_ranks.py OUT` (tests/test_episodes_dist.py):
episodes (--tools) on the tiny model under FSDP2 (gloo), the ranks' episodes of different lengths and turn counts:
rank 0's every turn is read as a multiply call, rank 1's only a turn of 1 mod 3 characters, so rank 0 takes turns that rank 1
has no row for (rank 1 generates dummy rows, greedily), and with --gen-batch-size 2 more generate calls a round.
  - repeat, shared-prefill (HF generate, synced_gpus) and engine: both ranks make the same number of generate calls
    (no hang), and each rank's episodes equal, token for token, the plain model's on one process with the same seed
    (Dist world 1: no collective); the tools/* stats are the two one-process runs' counts summed;
  - --environment whose resets differ on rank 1 only (its groups go one prompt a row): with shared-prefill every
    rank then generates one prompt a row, as many generate calls each;
  - last, gspo.py itself under torchrun with --tools and --dynamic-sampling (rank 0 logs to OUT); it exits the
    process.
Prints "OK <case>" a case from rank 0; a rank still running after 3 minutes (a hang: the ranks' collectives differ)
exits with its traceback."""
import os
import sys


class Differ:
    """An --environment for the program's own case: rows whose answer is 'differ' get resets that differ from each
    other (open_episodes then generates their group one prompt a row), the other rows none. Imported by the tool
    worker too, hence the program's body in main()."""
    made = [0]

    def reset(self, answer: str, **row):
        Differ.made[0] += 1
        return f" #{Differ.made[0]}" if answer == "differ" else None

    def noop(self) -> str:
        """Nothing."""
        return ""


def main():
    import faulthandler

    faulthandler.dump_traceback_later(180, exit=True)  # ranks whose collectives differ hang: fail instead
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [root, os.path.join(root, "tests")]  # the scripts, and tests/helpers.py
    from dataclasses import replace

    import torch
    from datasets import Dataset

    import gspo
    from grouprl import distributed, episodes, modeling
    from grouprl.data import chat_prompts
    from grouprl.episodes import Tools, generate_episodes
    from grouprl.sampling import Sampling
    from helpers import sharded_tiny_and_twin

    here = os.path.dirname(os.path.abspath(__file__))
    tools_file = os.path.join(here, "tools_example.py") + ":multiply"
    d = distributed.setup_distributed(0)
    assert d.world == 2 and d.sharded, "run me with torchrun --nproc-per-node 2"
    tok = modeling.tiny_tokenizer()
    _, policy, single, one = sharded_tiny_and_twin(d, tok)
    calls = []
    fsdp_generate = policy.generate

    def counted(*a, **k):  # the sharded policy's generate calls (each one runs FSDP2's all-gathers)
        calls.append("dummy" if k["do_sample"] is False else k["input_ids"].shape[0])
        return fsdp_generate(*a, **k)

    policy.generate = counted
    call = [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    episodes.parse_calls = lambda text: call if d.rank == 0 or len(text) % 3 == 1 else []
    eos = list(range(2, 100, 5))  # 20 of the 100 ids: turns of ~5 tokens, episodes of several turns
    prompts = chat_prompts(tok, ["1%10=", "a longer one, 2%10="] if d.rank == 0 else ["3%10=", "4"], False)
    sampling = Sampling(max_new_tokens=80, temperature=1.0, top_p=1.0, top_k=0, gen_batch_size=2)
    keys = ["tools/call_frequency", "tools/failure_frequency", "tools/malformed_turns", "tools/rolled_back",
            "tools/cut_by_budget", "tools/cut_by_limit", "tools/turns_per_episode"]

    def raw(stats, B):  # a rollout's stats as counts: episodes, calls, ..., turns
        return torch.tensor([B, stats[keys[0]] * B, stats[keys[1]] * stats[keys[0]] * B,
                             *[stats[k] for k in keys[2:6]], stats[keys[6]] * B], dtype=torch.float64)

    for mode in ["repeat", "shared-prefill", "engine"]:
        how = replace(sampling, mode=mode)
        tools = Tools(tools_file, 3)  # one worker a rank, as tools_of makes one a process
        try:
            calls.clear()
            torch.manual_seed(7 + d.rank)
            roll = generate_episodes(policy, tok, prompts, 2, eos, d, how, tools)
            torch.manual_seed(7 + d.rank)
            ref = generate_episodes(single, tok, prompts, 2, eos, one, how, tools)
        finally:
            tools.stop()
        both = [None, None]
        torch.distributed.all_gather_object(both, (len(calls), ref.stats["tools/turns_per_episode"],
                                                   calls.count("dummy")))
        assert both[0][0] == both[1][0], (mode, both)  # the same generate calls on each rank
        assert both[0][1] > both[1][1], (mode, both)  # rank 0 took more turns than rank 1
        assert (both[1][2] > 0) == (mode != "engine") and both[0][2] == 0, (mode, both)  # dummies: rank 1's
        assert torch.equal(roll.input_ids, ref.input_ids) and torch.equal(roll.mask, ref.mask), mode
        assert roll.texts == ref.texts and torch.equal(roll.truncated, ref.truncated), mode
        assert (roll.logp is None) == (mode != "engine") and (roll.logp is None or torch.equal(roll.logp, ref.logp))
        run = distributed.all_reduce(raw(ref.stats, 4))  # the two one-process runs' counts
        assert torch.equal(raw(roll.stats, 8), run), (mode, roll.stats, run)  # reduced: every rank's episodes
        if d.main:
            print(f"OK {mode}: {len(calls)} generate calls a rank ({both[1][2]} dummies on rank 1), turns per "
                  f"episode {both[0][1]} and {both[1][1]}, run {roll.stats['tools/turns_per_episode']}", flush=True)

    # --environment, resets that differ on rank 1 only: 3 prompts, gen-batch-size 3 under shared-prefill make 3
    # generate calls on rank 0 (one prompt of 2 rows a call) but 2 on rank 1 (6 rows, 3 a call) unless they agree
    rows = Dataset.from_list([{"prompt": p, "answer": "differ" if d.rank else "same", "text": t}
                              for p, t in zip(["5%10=", "6%10=", "7%10="], chat_prompts(tok, ["5%10=", "6%10=",
                                                                                               "7%10="], False))])
    tools = Tools(tools_file, 2, environment=f"{os.path.abspath(__file__)}:Differ")
    try:
        calls.clear()
        roll = generate_episodes(policy, tok, rows, 2, eos, d, replace(sampling, mode="shared-prefill",
                                                                      gen_batch_size=3), tools)
    finally:
        tools.stop()
    both = [None, None]
    torch.distributed.all_gather_object(both, len(calls))
    assert both[0] == both[1] and len(roll.texts) == 6, both
    if d.main:
        print(f"OK environment: {both[0]} generate calls a rank", flush=True)

    # gspo.py under torchrun with episodes and --dynamic-sampling (the random model's rewards are flat: 2 rounds)
    sys.argv = ["gspo.py", "--tools", tools_file, "--max-tool-calls", "2", "--num-steps", "1",
                "--prompts-per-rank", "2", "--group-size", "2", "--num-minibatches", "1", "--max-new-tokens", "48",
                "--gen-batch-size", "2", "--eval-every", "1", "--eval-size", "4", "--log-samples", "0", "--dynamic-sampling",
                "--max-gen-rounds", "2", "--output-dir", sys.argv[1]]
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(180, exit=True)
    gspo.main()  # exits the process (checkpoint.cleanup)


if __name__ == "__main__":
    main()
