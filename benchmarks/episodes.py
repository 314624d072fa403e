"""Tokens prefilled per episode by the engine with each row's KV cache kept across turns, against re-prefilling the
history every turn (as HF generate does: --gen-mode repeat or shared-prefill in the tool loop), on the built-in tiny
model, greedy, one process on the CPU:

    python benchmarks/episodes.py                       # 4 prompts x 4 episodes, 3 rounds of tool calls, 160 tokens
    python benchmarks/episodes.py --filler 40           # longer prompts: re-prefilling costs more each turn

grouprl/episodes.py's generate_episodes runs three ways over the same prompts: --gen-mode engine (the kept cache,
grouprl/engine/turns.py), engine with engine.settings.KEEP_TURNS = False (the same Engine prefilling each turn's
whole history: the re-prefill count), and --gen-mode repeat (HF generate, the reference the episodes must equal).
The untrained tiny model writes no tool calls, so each model turn is read as one call of
tests/programs/tools_example.py's multiply(6, 7), which the real tool worker answers; EOS is the tokenizer's and three
ids greedy turns write early (so that turns end and episodes run several rounds). Per episode: its first turn's
prompt (a group's prompt prefilled once for its G rows, the same both ways), then the later turns' prefill, kept
(the last turn's EOS and the tool turn) and re-prefilled (the whole history). Also: whether the episodes (ids and
mask) equal HF's and the kept run's, the largest |log-prob difference| of the kept run against the re-prefilled one
and against the training forward (Policy.forward) at the model's tokens, and wall seconds of each run.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--filler", type=int, default=0, help="words 'filler' before each question (longer prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="the episode's budget (--max-new-tokens)")
    ap.add_argument("--max-tool-calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from grouprl import episodes, modeling
    from grouprl.data import chat_prompts
    from grouprl.distributed import Dist, seed_everything
    from grouprl.engine import settings, turns
    from grouprl.sampling import Sampling

    torch.set_num_threads(args.threads)
    tok = modeling.tiny_tokenizer()
    seed_everything(0)
    lm = modeling.tiny_model(tok).eval()
    g = torch.Generator().manual_seed(0)
    for p in lm.parameters():  # larger weights than the init's: greedy rows that differ (tests/helpers.setup)
        if p.dim() == 2:
            p.data.normal_(0, 0.3, generator=g)
    filler = " ".join(["filler"] * args.filler)
    questions = [f"{filler} {a}*{a + 3}=".strip() for a in range(1, args.prompts + 1)]
    texts = chat_prompts(tok, questions, False)
    policy, env = modeling.Policy(lm), Dist(0, 1, torch.device("cpu"))
    how = dict(temperature=1.0, top_k=1)
    first = modeling.Policy(lm).generate  # greedy first turns: the ids they write early are the EOS
    ids = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = first(input_ids=ids.input_ids, attention_mask=ids.attention_mask, do_sample=False, max_new_tokens=6,
                pad_token_id=tok.pad_token_id)[:, ids.input_ids.shape[1]:].tolist()
    eos = sorted({out[0][2], out[1 % len(out)][4], out[2 % len(out)][3], tok.eos_token_id})
    call = [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]
    episodes.parse_calls = lambda text: call  # every model turn: one call

    made = []
    close = turns.Episodes.close

    def spy(self):
        made.append(self)
        close(self)

    turns.Episodes.close = spy
    tools_file = os.path.join(ROOT, "tests", "programs", "tools_example.py") + ":multiply"
    runs = {}
    for name, mode, keep in (("kept", "engine", True), ("re-prefilled", "engine", False), ("hf", "repeat", True)):
        settings.KEEP_TURNS = keep
        tools = episodes.Tools(tools_file, args.max_tool_calls)
        t = time.time()
        try:
            roll = episodes.generate_episodes(policy, tok, texts, args.group_size, eos, env,
                                              Sampling(args.max_new_tokens, mode=mode, **how), tools)
        finally:
            tools.stop()
        runs[name] = (roll, made[-1] if mode == "engine" else None, time.time() - t)
    (kept, k, t_kept), (full, f, t_full), (hf, _, t_hf) = runs["kept"], runs["re-prefilled"], runs["hf"]
    B = len(kept.texts)
    mask = kept.mask.bool()
    forward = policy(kept.input_ids, kept.attention_mask, kept.n_prompt).detach()
    prompt = [float(x) / args.group_size for x in kept.attention_mask[:, :kept.n_prompt].sum(1)]
    later_kept = [p - q for p, q in zip(k.prefilled, prompt)]
    later_full = [p - q for p, q in zip(f.prefilled, prompt)]
    same = all(torch.equal(getattr(kept, x), getattr(r, x)) for r in (full, hf) for x in ("input_ids", "mask"))
    print("| episodes | prompt tokens | turns / episode | model tokens / ep. | tool tokens / ep. | "
          "prompt prefill / ep. | later turns' prefill / ep., kept | re-prefilled | ratio | "
          "total kept / re-prefilled | equal to HF and re-prefilled | max \\|logp - re-prefilled\\| | "
          "max \\|logp - forward\\| | s kept / re-prefilled / HF |")
    print("|" + "---|" * 14)
    tool = float(((~mask) & kept.attention_mask[:, kept.n_prompt:].bool()).sum()) / B
    print(f"| {B} | {sum(prompt) * args.group_size / B:.1f} | {kept.stats['tools/turns_per_episode']:.2f} | "
          f"{float(mask.sum()) / B:.1f} | {tool:.1f} | "
          f"{sum(prompt) / B:.1f} | {sum(later_kept) / B:.1f} | {sum(later_full) / B:.1f} | "
          f"{sum(later_full) / max(sum(later_kept), 1):.1f}x | {sum(f.prefilled) / sum(k.prefilled):.2f}x | "
          f"{'yes' if same else 'NO'} | {float((kept.logp - full.logp).abs().max()):.1e} | "
          f"{float((kept.logp - forward)[mask].abs().max()):.1e} | {t_kept:.2f} / {t_full:.2f} / {t_hf:.2f} |")
    print("command: python benchmarks/episodes.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
