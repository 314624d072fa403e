"""What Energy on frequent tokens (DFPO arXiv:2604.13088, eq. 24; energy.py) costs on a real model, and what it reads
there: G completions of one held-out prompt of experiments/real_model_runs.py's task sampled from --model, the
exact per-token norms ||grad_theta log pi(y_t)|| (one backward a token, timed), and eq. 24's shares for frequency-
rank buckets, ranks counted over the tokens of the same completions. The coefficient g_t = dL/dlogp_t is left at 1:
on the first minibatch of a step (s_i = 1) GSPO's and DFPO's g_t are the same (A_i / (G |y_i|) up to the sign:
DFPO's transform is the identity when sum_i A_i s_bar_i = sum_i A_i = 0), so Energy separates the objectives only
through the policies they train, which needs the measurement inside the runs.

    python experiments/energy_cost.py --model ~/.cache/group-rl/smollm2-135m-instruct   # ~1-2 min on 1 thread
"""
import os
import sys
import time
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from learning_tax import ROOT  # noqa: E402
from real_model_runs import arithmetic_task  # noqa: E402

sys.path.insert(0, ROOT)
import common  # noqa: E402
from grouprl import energy  # noqa: E402
from grouprl import modeling  # noqa: E402
from grouprl.data import chat_prompts  # noqa: E402
from grouprl.distributed import Dist  # noqa: E402
from grouprl.sampling import Sampling  # noqa: E402


@dataclass
class Args:
    model: str = os.path.expanduser("~/.cache/group-rl/smollm2-135m-instruct")
    """the model folder (tools/real_model.py), or a run's step_N checkpoint"""
    group_size: int = 4
    """completions measured"""
    max_new_tokens: int = 24
    """their length limit"""
    seed: int = 1
    """sampling seed"""
    out: str = os.path.join(ROOT, "experiments", "results", "real_model", "energy.md")
    """where the report goes"""


def main():
    args = tyro.cli(Args)
    torch.manual_seed(args.seed)
    tok = modeling.load_tokenizer(args.model, False)
    lm, _ = modeling.load_model(args.model, tok, Dist(0, 1, torch.device("cpu")), args.seed)
    policy = modeling.Policy(lm, temperature=0.7)
    eos = modeling.eos_ids(lm, tok)
    _, test = arithmetic_task()
    prompt = chat_prompts(tok, [test[0]["prompt"]])
    policy.eval()
    with torch.no_grad():
        sampling = Sampling(args.max_new_tokens, temperature=0.7, gen_batch_size=args.group_size)
        roll = common.generate(policy, tok, prompt, args.group_size, eos, Dist(0, 1, torch.device("cpu")),
                               sampling)
    ids, am, n_prompt, mask = roll.input_ids, roll.attention_mask, roll.n_prompt, roll.mask
    t, cpu = time.time(), time.process_time()
    norms = energy.token_grad_norms(policy, ids, am, n_prompt, mask)
    seconds, cpu = time.time() - t, time.process_time() - cpu
    tokens = int(mask.sum())
    counts = torch.bincount(ids[:, n_prompt:][mask.bool()], minlength=len(tok))
    shares = energy.energy_by_frequency(norms, ids[:, n_prompt:], mask, energy.frequency_ranks(counts),
                                        edges=(5, 20))
    top = [tok.decode([int(i)]) for i in torch.argsort(-counts.double(), stable=True)[:5]]
    report = (f"# Energy (eq. 24) on {os.path.basename(os.path.normpath(args.model))}: cost and one reading\n\n"
              f"`python experiments/energy_cost.py {' '.join(sys.argv[1:])}`, {torch.get_num_threads()} thread(s)."
              f"\n\n{args.group_size} completions of \"{test[0]['prompt']}\" (temperature 0.7, at most "
              f"{args.max_new_tokens} tokens): {tokens} tokens measured exactly in {seconds:.1f} s wall, "
              f"{cpu:.1f} s CPU: {cpu / tokens:.2f} CPU s a token (one forward a row, one backward a token; the wall "
              f"time measures the machine's load as much).\n\n"
              f"Shares of sum_t ||grad log pi(y_t)|| (g_t = 1) by frequency rank in these completions (the 5 most "
              f"frequent: {top}): " + ", ".join(f"{k} {v:.3f}" for k, v in shares.items()) + "\n")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
