"""Completions graded per second by common.score, the reward every script uses, on numeric and on symbolic answers:

    python benchmarks/grading.py                      # 64 prompts x 16 completions, 3 repeats
    python benchmarks/grading.py --prompts 4 --group-size 4 --repeats 1

Each completion is ~1,500 characters of reasoning that ends in \\boxed{...}. A group's completions draw their final
answer from three correct spellings of the reference and three wrong answers (MATH-style groups repeat answers), and
every prompt has its own reference, so the cache helps within a group only. Numeric answers are settled in this
process (exact fractions); symbolic ones go to math-verify in the grading worker where the canonical forms differ.
One worker serves a whole run, so the first step pays for warming math-verify's LaTeX parser (ANTLR) and later
steps do not: both are timed, each step with references not seen before, and the worker's start apart.
`grader right` is the share of completions scored as their label (correct spelling or wrong answer) says.
"""
import argparse
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import grader  # noqa: E402

def symbolic_pool(i: int, k: int) -> tuple[str, list[str], list[str]]:
    """Prompt i's reference (one of ten MATH-style kinds, made distinct by k), three correct spellings and three
    wrong answers (written for this benchmark)."""
    j = k + 1
    kinds = [
        (f"\\frac{{\\sqrt{{{k}}}}}{{2}}", [f"\\dfrac{{\\sqrt{{{k}}}}}{{2}}", f"\\frac{{1}}{{2}}\\sqrt{{{k}}}",
                                          f"\\sqrt{{{k}}}/2"],
         [f"\\frac{{\\sqrt{{{j}}}}}{{2}}", f"\\sqrt{{{k}}}", f"\\frac{{{k}}}{{2}}"]),
        (f"{k}\\sqrt{{2}}", [f"\\sqrt{{{2 * k * k}}}", f"{k} \\sqrt 2", f"\\sqrt{{2}}\\cdot {k}"],
         [f"\\sqrt{{{2 * k}}}", f"{j}\\sqrt{{2}}", f"{k}\\sqrt{{3}}"]),
        (f"x^2+{k}x", [f"{k}x+x^2", f"x(x+{k})", f"x^{{2}} + {k}x"], [f"x^2+{j}x", f"{k}x", f"x^2-{k}x"]),
        (f"\\frac{{\\pi}}{{{k}}}", [f"\\pi/{k}", f"\\frac{{1}}{{{k}}}\\pi", f"\\frac{{2\\pi}}{{{2 * k}}}"],
         ["\\pi", f"\\frac{{\\pi}}{{{j}}}", f"{k}\\pi"]),
        (f"(1,{k}]", [f"(1, {k}]", f"\\left(1,{k}\\right]", f"(1,{k}.0]"], [f"(1,{k})", f"[1,{k}]", f"[1,{k})"]),
        (f"\\{{1,2,{k}\\}}", [f"\\{{{k},2,1\\}}", f"\\{{1, {k}, 2\\}}", f"\\{{2,1,{k}\\}}"],
         ["\\{1,2\\}", f"\\{{1,2,{j}\\}}", f"\\{{1,{k}\\}}"]),
        (f"\\begin{{pmatrix}}1\\\\{k}\\end{{pmatrix}}",
         [f"\\begin{{pmatrix}} 1 \\\\ {k} \\end{{pmatrix}}", f"\\begin{{pmatrix}}\\frac{{2}}{{2}}\\\\{k}\\end{{pmatrix}}",
          f"\\begin{{pmatrix}}1.0\\\\{k}\\end{{pmatrix}}"],
         [f"\\begin{{pmatrix}}{k}\\\\1\\end{{pmatrix}}", f"\\begin{{pmatrix}}1\\\\{j}\\end{{pmatrix}}",
          f"\\begin{{pmatrix}}1&{k}\\end{{pmatrix}}"]),
        (f"{k}\\pm\\sqrt{{5}}", [f"{k}+\\sqrt{{5}}, {k}-\\sqrt{{5}}", f"{k} \\pm \\sqrt 5", f"{k}-\\sqrt{{5}},{k}+\\sqrt{{5}}"],
         [f"{k}+\\sqrt{{5}}", f"{k}\\pm\\sqrt{{6}}", f"-{k}\\pm\\sqrt{{5}}"]),
        (f"y={k}x+1", [f"{k}x+1", f"y = 1 + {k}x", f"y=1+{k}x"], [f"y={k}x-1", f"{k}x", f"y={j}x+1"]),
        (f"\\frac{{{k}}}{{3}}", [f"\\frac{{{2 * k}}}{{6}}", f"{k}/3", f"\\dfrac{{{k}}}{{3}}"],
         [f"\\frac{{3}}{{{k}}}", f"\\frac{{{j}}}{{3}}", f"\\frac{{{k}}}{{4}}"]),
    ]
    return kinds[i % len(kinds)]


def numeric_pool(rng: random.Random) -> tuple[str, list[str], list[str]]:
    v = rng.randint(10, 99_999)
    return (str(v), [f"{v:,}", f"\\${v}", f"{v} dollars"],
            [str(v + 1), f"{v - 10:,}", str(v * 10)])


def completions(pools, group_size: int, rng: random.Random) -> tuple[list[str], list[str], list[float]]:
    """group_size completions a prompt, each ending in one of its six answers; and whether each is correct."""
    words = "so we add the two terms and divide by the common factor which gives".split()
    texts, answers, labels = [], [], []
    for gold, right, wrong in pools:
        answers.append(gold)
        for _ in range(group_size):
            form = rng.choice(right + wrong)
            filler = " ".join(rng.choice(words) + (f" {rng.randint(0, 99)}" if k % 9 == 0 else "")
                              for k in range(250))
            texts.append(f"{filler}.\nTherefore the answer is $\\boxed{{{form}}}$.")
            labels.append(float(form in right))
    return texts, answers, labels


def cpu_seconds(reward) -> float:
    """CPU time of this process and of the reward's live workers (Linux /proc), so that a busy machine shows."""
    ticks = os.sysconf("SC_CLK_TCK")
    workers = sum(sum(int(x) for x in open(f"/proc/{w.proc.pid}/stat").read().rsplit(")", 1)[1].split()[11:13])
                  for w in reward.workers if w.alive()) / ticks
    return time.process_time() + workers


def measure(reward, texts, answers, labels, group_size: int) -> dict:
    sent = []
    real_run = reward.run
    reward.run = lambda reqs: sent.extend(reqs) or real_run(reqs)
    t, cpu = time.perf_counter(), cpu_seconds(reward)
    r, errors = common.score(texts, answers, group_size, reward, watch=False)
    seconds, cpu = time.perf_counter() - t, cpu_seconds(reward) - cpu
    reward.run = real_run
    agree = sum(float(x) == y for x, y in zip(r.tolist(), labels)) / len(labels)
    return {"seconds": seconds, "cpu": cpu, "sent": len(sent), "errors": errors, "agree": agree}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=grader.GRADING_WORKERS, help="grading worker processes")
    p.add_argument("--timeout", type=float, default=1.0, help="seconds a request may take (--reward-timeout)")
    a = p.parse_args()
    grader.GRADING_WORKERS = a.workers
    rng = random.Random(a.seed)
    n = a.prompts * a.group_size
    ks = [k for k in range(4, 100_000) if k % 3 and math.isqrt(k) ** 2 != k]  # not squares, not multiples of 3
    print(f"| answers | step | completions | sent to math-verify | reward errors | grader right | seconds | CPU s "
          f"({a.workers} workers + this process) | completions / s |\n|---|---|---|---|---|---|---|---|---|")
    for name in ["numeric", "symbolic"]:
        reward = grader.Reward(timeout_s=a.timeout)
        t = time.perf_counter()
        reward.run([("1", "1")])  # the worker starts (imports math-verify)
        start = time.perf_counter() - t
        runs = []
        for b in range(a.repeats + 1):  # batch 0: the first step of a run; then later steps, new references each
            if name == "numeric":
                pools = [numeric_pool(rng) for _ in range(a.prompts)]
            else:
                pools = [symbolic_pool(i, k) for i, k in enumerate(ks[b * a.prompts:(b + 1) * a.prompts])]
            runs.append(measure(reward, *completions(pools, a.group_size, rng), a.group_size))
        reward.stop()
        later = sorted(runs[1:], key=lambda x: x["seconds"])[len(runs[1:]) // 2] if a.repeats else None
        for step, x in [("first", runs[0]), (f"later (median of {a.repeats})", later)]:
            if x is not None:
                print(f"| {name} | {step} | {n} | {x['sent']} | {x['errors']} | {x['agree']:.1%} | "
                      f"{x['seconds']:.3f} | {x['cpu']:.2f} | {n / x['seconds']:,.0f} |")
        print(f"| {name} | worker start | | | | | {start:.2f} | | |")
    print(f"\ncommand: python benchmarks/{os.path.basename(__file__)} " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
