"""The math grader (rewards.score, the reward every script uses): its accuracy against math-verify's own parse + verify,
its speed on numeric and symbolic answers, and its time bound on a busy machine.

    python benchmarks/grading.py                      # cases, then 64 prompts x 16 completions, 3 repeats
    python benchmarks/grading.py --busy 2             # the same while 2 processes burn a core each
    python benchmarks/grading.py --prompts 4 --group-size 4 --repeats 1

Accuracy: tests/test_extraction.CASES, completions with a reference and whether they are right, written from the
public test suites of Math-Verify, lm-evaluation-harness, inspect_ai and AReaL, and from issue 38 (a policy that boxes
the question's expression: where the reference is a number, an expression a grader would compute is no answer). Each
is graded by rewards.score and by math-verify as its README uses it (parse the completion, parse the reference,
verify); the table gives each one's accuracy and false positives (a wrong completion scored 1), then every case where
the two disagree.

Speed: each completion is ~1,500 characters of reasoning that ends in \\boxed{...}. A group's completions draw their
final answer from three correct spellings of the reference and three wrong answers (MATH-style groups repeat answers),
and every prompt has its own reference, so the cache helps within a group only. Numeric answers are settled in this
process (exact fractions); symbolic ones go to math-verify in the grading worker where the canonical forms differ.
The workers serve a whole run, so a first step and later ones are timed apart, each step with references not seen
before, and the workers' start (importing math-verify) apart. The third kind is the symbolic step with --past-bound
answers that no worker finishes (9^(9^(9^9))): each costs its bound and a new worker, and its `reward errors` are
exactly --past-bound when no other answer runs late for them.
`grader right` is the share of completions scored as their label (correct spelling or wrong answer) says.

Busy machine (--busy N): N processes spin on the CPU for the whole run, so the workers wait for a core. `reward
errors` then counts the requests that ran past their bound (--timeout seconds of the worker's CPU, 1 s as
--reward-timeout's default), each of them a correct answer scored 0 or a wrong one scored 0 by luck, besides the
--past-bound answers that cannot finish; `slowest math-verify request` is the most CPU time one request of the cases
took, on a warm worker.
"""
import argparse
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from grouprl import grader  # noqa: E402
from grouprl import rewards  # noqa: E402
from test_extraction import CASES  # noqa: E402


def math_verify_verdict(completion: str, reference: str) -> int:
    """math-verify as its README uses it: parse both (a reference without $ is wrapped in $...$), verify."""
    from math_verify import parse, verify

    gold = parse(reference if "$" in reference or "\\boxed" in reference else f"${reference}$")
    return int(bool(verify(gold, parse(completion))))


def cases(timeout: float):
    """Accuracy and false positives of ours and of math-verify on CASES, every disagreement, and the slowest
    math-verify request of ours in CPU seconds (each request alone on a warm worker)."""
    import logging

    logging.disable(logging.WARNING)  # math-verify's notes on its timeouts
    reward = grader.Reward(timeout_s=timeout)
    reward.run([("1", "1")] * grader.GRADING_WORKERS)  # the workers start
    t = time.perf_counter()
    r, errors = rewards.score([c[0] for c in CASES], [c[1] for c in CASES], 1, reward, watch=False)
    seconds = time.perf_counter() - t
    ours = [int(x) for x in r.tolist()]
    theirs = [math_verify_verdict(c[0], c[1]) for c in CASES]
    print("| grader | cases | right | accuracy | false positives | reward errors | seconds |\n" + "|---" * 7 + "|")
    for name, got, err, s in [("ours (rewards.score)", ours, errors, f"{seconds:.2f}"),
                              ("math-verify parse + verify", theirs, "", "")]:
        right = sum(g == c[2] for g, c in zip(got, CASES))
        fp = sum(g == 1 and c[2] == 0 for g, c in zip(got, CASES))
        print(f"| {name} | {len(CASES)} | {right} | {right / len(CASES):.1%} | {fp} | {err} | {s} |")
    print("\n| source | completion (its end) | reference | right | ours | math-verify |\n|---|---|---|---|---|---|")
    for c, o, m in zip(CASES, ours, theirs):
        if o != m or o != c[2]:
            end = c[0][-70:].replace("|", "\\|").replace("\n", " ")
            print(f"| {c[3]} | `{end}` | `{c[1]}` | {c[2]} | {o} | {m} |")
    slowest = (0.0, None)
    reward.stop()
    one = grader.Reward(timeout_s=timeout)
    one.run([("1", "1")])
    for c in CASES:
        pred = grader.extract_answer(c[0])
        if pred is None:
            continue
        p, g = grader.canonical(pred), grader.canonical(c[1])
        if grader.decide(p, g) is None:
            before = worker_cpu(one.workers[0])
            if one.run([(p[0], g[0])])[0][1] is None and worker_cpu(one.workers[0]) - before > slowest[0]:
                slowest = (worker_cpu(one.workers[0]) - before, c[1])
    one.stop()
    print(f"\nslowest math-verify request of the cases: {slowest[0]:.2f} CPU s (reference {slowest[1]!r}); "
          f"bound {timeout:g} s")


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


def worker_cpu(w) -> float:
    """CPU seconds of a live grading worker (Linux /proc)."""
    fields = open(f"/proc/{w.proc.pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(reward) -> float:
    """CPU time of this process, of its ended child processes (workers that were stopped) and of the reward's live
    workers, so that a busy machine shows."""
    import resource

    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.process_time() + ended.ru_utime + ended.ru_stime
            + sum(worker_cpu(w) for w in reward.workers if w.alive()))


def measure(reward, texts, answers, labels, group_size: int) -> dict:
    sent = []
    real_run = reward.run
    reward.run = lambda reqs: sent.extend(reqs) or real_run(reqs)
    t, cpu = time.perf_counter(), cpu_seconds(reward)
    r, errors = rewards.score(texts, answers, group_size, reward, watch=False)
    seconds, cpu = time.perf_counter() - t, cpu_seconds(reward) - cpu
    reward.run = real_run
    agree = sum(float(x) == y for x, y in zip(r.tolist(), labels)) / len(labels)
    return {"seconds": seconds, "cpu": cpu, "sent": len(sent), "errors": errors, "agree": agree}


def speed(a):
    """The table of completions graded per second, numeric and symbolic, a first step and later ones."""
    rng = random.Random(a.seed)
    n = a.prompts * a.group_size
    ks = [k for k in range(4, 100_000) if k % 3 and math.isqrt(k) ** 2 != k]  # not squares, not multiples of 3
    print(f"| answers | step | completions | sent to math-verify | reward errors | grader right | seconds | CPU s "
          f"({a.workers} workers + this process) | completions / s |\n|---|---|---|---|---|---|---|---|---|")
    kinds = ["numeric", "symbolic"]
    if a.past_bound and a.past_bound * a.timeout <= 20:
        kinds.append(f"symbolic, {a.past_bound} past the bound")
    for name in kinds:
        reward = grader.Reward(timeout_s=a.timeout)
        t = time.perf_counter()
        reward.run([("1", "1")] * a.workers)  # the workers start (import and warm math-verify)
        start = time.perf_counter() - t
        runs = []
        for b in range(a.repeats + 1):  # batch 0: the first step of a run; then later steps, new references each
            if name == "numeric":
                pools = [numeric_pool(rng) for _ in range(a.prompts)]
            else:
                pools = [symbolic_pool(i, k) for i, k in enumerate(ks[b * a.prompts:(b + 1) * a.prompts])]
            texts, answers, labels = completions(pools, a.group_size, rng)
            if name.endswith("bound"):  # answers no worker finishes, spread over the step: each kills its worker
                for g in range(0, min(a.prompts, 10 * a.past_bound), 10):  # groups whose reference: \\frac{\\sqrt{k}}{2}
                    texts[g * a.group_size + 1] = "so it is \\boxed{9^{9^{9^{9}}}}"
                    labels[g * a.group_size + 1] = 0.0
            runs.append(measure(reward, texts, answers, labels, a.group_size))
        reward.stop()
        later = sorted(runs[1:], key=lambda x: x["seconds"])[len(runs[1:]) // 2] if a.repeats else None
        for step, x in [("first", runs[0]), (f"later (median of {a.repeats})", later)]:
            if x is not None:
                print(f"| {name} | {step} | {n} | {x['sent']} | {x['errors']} | {x['agree']:.1%} | "
                      f"{x['seconds']:.3f} | {x['cpu']:.2f} | {n / x['seconds']:,.0f} |")
        print(f"| {name} | worker start | | | | | {start:.2f} | | |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=grader.GRADING_WORKERS, help="grading worker processes")
    p.add_argument("--timeout", type=float, default=1.0, help="seconds a request may take (--reward-timeout)")
    p.add_argument("--busy", type=int, default=0, help="processes that spin on the CPU while this runs")
    p.add_argument("--past-bound", type=int, default=4,
                   help="answers of a symbolic step that no worker finishes, each costing --timeout seconds of CPU "
                        "(0, or a total over 20 s: that kind of step is left out)")
    p.add_argument("--skip-cases", action="store_true", help="the speed table only")
    a = p.parse_args()
    grader.GRADING_WORKERS = a.workers
    import subprocess

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        if not a.skip_cases:
            cases(a.timeout)
            print()
        speed(a)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"\ncommand: python benchmarks/{os.path.basename(__file__)} " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
