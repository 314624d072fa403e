"""Mutation check of the objectives and of every value they log: can the fast unit tests see each one-line bug?

    python tools/mutation.py                  # every mutation, 2 at a time (about 5 minutes on 2 cores)
    python tools/mutation.py --only dfpo -j 1 # the mutations whose file or description holds 'dfpo'
    python tools/mutation.py --list           # the list, checked against the code, nothing run
    python tools/mutation.py --tests tests/test_stats_values.py   # what one test file kills on its own

Each mutation is one edit: the file, its exact original text, the replacement, and what the edit breaks. For each,
the repository's top-level *.py, README.md, docs/ and tests/ are copied into a temporary folder (the working tree
is never touched), the edit is applied there (the original text must occur exactly once, else the tool stops before
running anything: the list has to follow the code), and the fast unit tests (FAST_TESTS; no test that runs a
script as a subprocess) run with `pytest -x -q`. A mutant is killed when they fail, and survives when they pass:
a survivor is a gap in the tests, unless the mutation is marked equivalent=<why it cannot change any value>.
Exit code 1 when a non-equivalent mutant survives (or when the unmutated copy fails its tests).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST_TESTS = ["tests/test_stats_values.py", "tests/test_losses.py", "tests/test_dfpo.py", "tests/test_gspo_token.py",
              "tests/test_shared_token.py", "tests/test_loss_agg.py", "tests/test_rewards.py",
              "tests/test_post_answer_penalty.py", "tests/test_turn_credit.py"]  # the loop tests last: -x stops
# before them when it can


@dataclass
class Mutation:
    file: str
    old: str
    new: str
    what: str
    equivalent: str | None = None  # why no value can change (not counted as a failure when it survives)


KL = "(((log_w.exp() - 1 - log_w) * mask).sum(), mask.sum())"
KL_WRONG_WAY = "(((torch.exp(-log_w) - 1 + log_w) * mask).sum(), mask.sum())"  # k3 of KL(new||old)
M = Mutation
MUTATIONS = [
    # ---- gspo.py: eq. 42-44 and its stats
    M("gspo.py", "s = torch.exp(log_w.sum(1) / lengths)", "s = torch.exp(log_w.sum(1))", "s_i without 1/|y_i|"),
    M("gspo.py", "s_clipped = s.clamp(1 - clip_low, 1 + clip_high)", "s_clipped = s.clamp(1 - clip_high, 1 + clip_low)",
      "clip bounds swapped"),
    M("gspo.py", "objective = torch.min(s * advantages, s_clipped * advantages)",
      "objective = torch.max(s * advantages, s_clipped * advantages)", "max instead of min (eq. 42)"),
    M("gspo.py", "clipped = ((s > 1 + clip_high) & (advantages > 0))",
      "clipped = ((s > 1 + clip_high) & (advantages >= 0))",
      "clipfrac counts A = 0 as clipped"),
    M("gspo.py", '"losses/clipfrac": ((clipped * lengths).sum(), mask.sum())',
      '"losses/clipfrac": (clipped.sum(), mask.sum())',
      "clipfrac numerator in sequences, denominator in tokens"),
    M("gspo.py", '"losses/clipfrac_seq": (clipped.sum(), in_loss.sum())',
      '"losses/clipfrac_seq": (clipped.sum(), len(s))',
      "clipfrac_seq counts masked rows in its denominator"),
    M("gspo.py", '"losses/ratio_mean": ((s * in_loss).sum(), in_loss.sum())',
      '"losses/ratio_mean": (s.sum(), in_loss.sum())',
      "ratio_mean sums the masked rows' s = 1"),
    M("gspo.py", "torch.where(in_loss, s, -torch.inf).max()",
      "(s * in_loss).sum() / in_loss.sum()", "ratio_max as a mean"),
    M("gspo.py", "torch.where(in_loss, s, -torch.inf).max()", "s.max()", "ratio_max over masked rows too"),
    M("gspo.py", KL, KL_WRONG_WAY, "approx_kl estimates KL(new||old)"),
    M("gspo.py", '"losses/policy_loss": (-per_seq.sum(), len(s))', '"losses/policy_loss": (per_seq.sum(), len(s))',
      "policy_loss sign"),
    M("gspo.py", "return loss, objective.detach(), stats", "return loss, (s * advantages).detach(), stats",
      "seq_terms before the clip"),
    # ---- grpo.py: eq. 67, 78-80, k3 KL, --loss-agg
    M("grpo.py", "per_token = w.clamp(max=1 + clip_high) * A", "per_token = w.clamp(1 - clip_low, 1 + clip_high) * A",
      "GRPO-fix with a lower clip (eq. 79 has none)"),
    M("grpo.py", "torch.min(w_min * A, w.clamp(1 - clip_low, 1 + clip_high) * A)",
      "torch.min(w_min * A, w.clamp(1 - clip_high, 1 + clip_low) * A)", "token clip bounds swapped"),
    M("grpo.py", "seq_terms = token_terms.sum(1) / lengths",
      "seq_terms = token_terms.sum(1)", "seq_terms without 1/|y_i|"),
    M("grpo.py", "token_terms = token_terms - kl_coef *", "token_terms = token_terms + kl_coef *", "KL penalty sign"),
    M("grpo.py", "log_ref = torch.where(valid, ref_logp - logp, 0.0)",
      "log_ref = torch.where(valid, logp - ref_logp, 0.0)",
      "k3 of KL(ref||pi) instead of KL(pi||ref)"),
    M("grpo.py", "return token_terms.sum(1), mask.sum().clamp(min=1)", "return token_terms.sum(1), mask.shape[0]",
      "token-mean divided by sequences"),
    M("grpo.py", "return token_terms.sum(1) / max_new_tokens, mask.shape[0]",
      "return token_terms.sum(1) / mask.sum(1).clamp(min=1), mask.shape[0]", "Dr. GRPO divides by |y_i|"),
    M("grpo.py", "clipped = (w > 1 + clip_high) & valid", "clipped = (w > 1 + clip_high) & (A > 0) & valid",
      "symmetric clipfrac only for A > 0"),
    M("grpo.py", "((w < 1 - clip_low) & (A < 0))) & valid", "((w < 1 - clip_low) & (A > 0))) & valid",
      "lower clip judged for A > 0"),
    M("grpo.py", "(clipped.any(1).sum(), (mask.sum(1) > 0).sum())", "(clipped.any(1).sum(), mask.shape[0])",
      "clipfrac_seq counts masked rows"),
    M("grpo.py", '"losses/ratio_mean": ((w * mask).sum(), mask.sum())', '"losses/ratio_mean": (w.sum(), mask.sum())',
      "ratio_mean sums padding's w = 1"),
    M("grpo.py", "torch.where(valid, w, -torch.inf).max()", "w.max()", "ratio_max over padding and masked rows"),
    M("grpo.py", KL, KL_WRONG_WAY, "approx_kl estimates KL(new||old)"),
    M("grpo.py", "(((log_ref.exp() - log_ref - 1) * mask).sum(), mask.sum())",
      "(((log_ref.exp() - log_ref - 1) * mask).sum(), mask.shape[0])", "kl_ref's mean over sequences"),
    M("grpo.py", '"losses/policy_loss": (-per_seq.sum(), count)',
      '"losses/policy_loss": (-per_seq.sum(), mask.shape[0])',
      "policy_loss ignores --loss-agg's count"),
    # ---- gspo_token.py: s_it, token advantages, post-answer tokens
    M("gspo_token.py", "s_it = s.detach()[:, None] *",
      "s_it = s[:, None] *", "no stop-gradient on s_i (Observation 2)"),
    M("gspo_token.py", "clipped_term = s_it.clamp(1 - clip_low, 1 + clip_high) * A",
      "clipped_term = s_it.clamp(1 - clip_high, 1 + clip_low) * A", "clip bounds swapped"),
    M("gspo_token.py", "((s_it < 1 - clip_low) & (A < 0))) & valid", "((s_it < 1 - clip_low) & (A <= 0))) & valid",
      "A_it = 0 counted clipped"),
    M("gspo_token.py", "seq_terms = per_token.sum(1) / lengths", "seq_terms = per_token.sum(1) / per_token.shape[1]",
      "seq_terms divided by the padded width"),
    M("gspo_token.py", '"losses/clipfrac_seq": (clipped.any(1).sum(), in_loss.sum())',
      '"losses/clipfrac_seq": (clipped.any(1).sum(), len(s))', "clipfrac_seq counts masked rows"),
    M("gspo_token.py", KL, KL_WRONG_WAY, "approx_kl estimates KL(new||old)"),
    M("gspo_token.py", "after[b, lo:len(ids)] = True", "after[b, :lo] = True", "penalty before the answer, not after"),
    M("gspo_token.py", "end = span[1]\n",
      "end = span[1] - (text[span[1] - 1:span[1]] == \"}\")\n",
      "\\boxed{}'s closing brace penalised"),
    M("gspo_token.py", "end = span[1]\n",
      "end = span[1] + (text[span[1]:span[1] + 1] == \"}\")\n",
      "a '}' after any answer exempted, not only \\boxed{}'s (the issue 24 finding)"),
    M("gspo_token.py", "if len(tok.decode(ids[:mid], skip_special_tokens=True)) >= end:",
      "if len(tok.decode(ids[:mid], skip_special_tokens=True)) > end:", "the answer's last token penalised"),
    M("gspo_token.py", "if not text[end:].strip():", "if not text[end:]:",
      "trailing whitespace penalised"),
    M("gspo_token.py", "ids = [i for i in completion_ids[b, :int(mask[b].sum())].tolist() if i not in eos]",
      "ids = completion_ids[b, :int(mask[b].sum())].tolist()", "the closing EOS penalised"),
    M("gspo_token.py", "(advantages[:, None] - args.post_answer_penalty * after.float())",
      "(advantages[:, None] + args.post_answer_penalty * after.float())", "post-answer penalty sign"),
    M("gspo_token.py", "args.post_answer_penalty * after.float()) * mask",
      "args.post_answer_penalty * (~after).float()) * mask",
      "penalty on the tokens up to the answer"),
    M("gspo_token.py", "(all_gather_cat(after.sum().view(1).float()).sum()",
      "(all_gather_cat(mask.sum().view(1).float()).sum()", "post_answer_frac counts every token"),
    M("gspo_token.py", "(advantages[:, None] - args.post_answer_penalty * after.float()) * mask",
      "(advantages[:, None] - args.post_answer_penalty * after.float())", "token advantages not masked",
      equivalent="gspo_token_loss reads A_it only where the mask is 1 (torch.where(valid, ...), clipped & valid)"),
    # ---- gspo_token.py --turn-credit: A_it = A_i + c D_it (docs/objectives.md, per-turn credit)
    M("gspo_token.py", "G = r.flip(1).cumsum(1).flip(1)", "G = r.cumsum(1)",
      "G_ik the return up to turn k, not from turn k on"),
    M("gspo_token.py", ".square().sum(1, keepdim=True) / n).sqrt()",
      ".square().sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()", "the group's std with Bessel's n - 1"),
    M("gspo_token.py", "k_t = (starts.cumsum(1) - 1).clamp(min=0)", "k_t = starts.cumsum(1).clamp(max=K - 1)",
      "each turn's tokens credited with the next turn's return"),
    M("gspo_token.py", "D = torch.where(on, per_token - per_token.sum(1, keepdim=True) / length, 0.0)",
      "D = torch.where(on, per_token, 0.0)", "D not centred: the turn rewards change an episode's total credit"),
    M("gspo_token.py", "token_adv = token_adv + args.turn_credit * turn_credit(roll, args) * mask",
      "token_adv = token_adv - args.turn_credit * turn_credit(roll, args) * mask", "turn credit's sign"),
    # ---- dfpo.py: eq. 44-55, 63, 68, 72, 87
    M("dfpo.py", "torch.where(advantages >= 0, torch.minimum(s, c), torch.maximum(s, c))",
      "torch.where(advantages > 0, torch.minimum(s, c), torch.maximum(s, c))", "eq. 47 read as A > 0"),
    M("dfpo.py", "torch.where(advantages >= 0, torch.minimum(s, c), torch.maximum(s, c))",
      "torch.where(advantages >= 0, torch.maximum(s, c), torch.minimum(s, c))", "eq. 47 branches swapped"),
    M("dfpo.py", "c = s.clamp(1 - clip_low, 1 + clip_high)", "c = s.clamp(1 - clip_high, 1 + clip_low)",
      "eq. 46 bounds swapped"),
    M("dfpo.py", "log_s = log_w.sum(1) / mask.sum(1).clamp(min=1)",
      "log_s = log_w.mean(1)", "s_i over the padded width"),
    M("dfpo.py", "return s_bar.min(1, keepdim=True).values.expand_as(s_bar)",
      "return s_bar.max(1, keepdim=True).values.expand_as(s_bar)", "min-replace takes the max"),
    M("dfpo.py", "alpha = neg / torch.where(pos > neg, pos, 1.0)", "alpha = pos / torch.where(pos > neg, neg, 1.0)",
      "orth-proj's alpha inverted (eq. 55)"),
    M("dfpo.py", "s_plus = s_bar.clamp(min=floor)", "s_plus = s_bar", "orth-proj without eq. 52's floor"),
    M("dfpo.py", "return 0.5 * s_bar", "return s_bar", "scale without the 0.5"),
    M("dfpo.py", "scale = L / L.mean(1, keepdim=True)",
      "scale = L.mean(1, keepdim=True) / L", "length-aware scale inverted"),
    M("dfpo.py", "objective = advantages * s_tilde * torch.exp(log_s - log_s.detach())",
      "objective = advantages * s_tilde * s_bar / s_bar.detach()", "eq. 68 replaced by the clip-gated gradient"),
    M("dfpo.py", '"losses/shrink_mean": ((s_tilde / s_bar * in_loss).sum(), in_loss.sum())',
      '"losses/shrink_mean": ((s_bar / s_tilde * in_loss).sum(), in_loss.sum())',
      "shrink_mean as s_bar / s_tilde (eq. 87)"),
    M("dfpo.py", '"losses/shrink_mean": ((s_tilde / s_bar * in_loss).sum(), in_loss.sum())',
      '"losses/shrink_mean": ((s_tilde / s_bar).sum(), len(s))',
      "shrink_mean counts --mask-truncated rows (the issue 24 finding)"),
    M("dfpo.py", '"losses/clipfrac": ((clipped * lengths).sum(), mask.sum())',
      '"losses/clipfrac": (clipped.sum(), in_loss.sum())', "clipfrac over sequences"),
    M("dfpo.py", '"losses/ratio_mean": ((s * in_loss).sum(), in_loss.sum())', '"losses/ratio_mean": (s.sum(), len(s))',
      "ratio_mean over masked rows too"),
    M("dfpo.py", KL, KL_WRONG_WAY, "approx_kl estimates KL(new||old)"),
    M("dfpo.py", "return loss, objective.detach(), stats", "return loss, (advantages * s_bar).detach(), stats",
      "seq_terms before the transform"),
    # ---- defaults: the papers' clip ranges and objective choices
    M("gspo.py", "clip_high: float = 4e-4", "clip_high: float = 3e-4", "GSPO's eps_high default"),
    M("gspo_token.py", "clip_low: float = 3e-4", "clip_low: float = 4e-4", "GSPO-token's eps_low default"),
    M("dfpo.py", "clip_low: float = 3e-4", "clip_low: float = 2e-4", "DFPO's eps_low default"),
    M("grpo.py", "clip_high: float = 0.27", "clip_high: float = 0.2", "GRPO's eps_high default"),
    M("grpo.py", 'loss_agg: LossAgg = "seq-mean-token-mean"', 'loss_agg: LossAgg = "token-mean"', "GRPO's aggregation"),
    # ---- common.py: advantages, group metrics, statistics, Jitter2
    M("common.py", 'unbiased = std == "bessel"', "unbiased = True", "sample std by default (eq. 43)"),
    M("common.py", "adv = centred / (group_std + eps)", "adv = centred / (group_std ** 2 + eps) ** 0.5",
      "eps inside the sqrt"),
    M("common.py", "int((group_std.squeeze(1) == 0).sum())", "int((group_std.squeeze(1) != 0).sum())",
      "zero-group count"),
    M("common.py", "all_gather_cat(rewards.double()).std(unbiased=unbiased)", "all_gather_cat(rewards.double()).std()",
      "batch scale with the sample std"),
    M("common.py", "m.var(1, unbiased=False).mean()", "m.var(1).mean()", "Asym with the sample variance"),
    M("common.py", "coef.abs().mean()", "coef.mean().abs()", "shared_coef: |mean| instead of mean |.|"),
    M("common.py", "coef = -groups_total * first_token_grads",
      "coef = -first_token_grads", "shared_coef without J's 1/groups"),
    M("grouprl/stats.py", "out[k] = (total[0] / total[1]).item()", "out[k] = (total[0] / len(stats)).item()",
      "(sum, count) means divided by micro-batches"),
    M("grouprl/stats.py", "out[k] = all_reduce(v.min(), dist.ReduceOp.MIN).item()",
      "out[k] = all_reduce(v.max(), dist.ReduceOp.MAX).item()", "_min keys take the max"),
    M("grouprl/runlog.py", "/ (len(m) - 2)", "/ len(m)", "Jitter2 divided by T, not T - 2"),
    M("grouprl/runlog.py", "abs(m[t + 2] - 2 * m[t + 1] + m[t])", "(m[t + 2] - 2 * m[t + 1] + m[t])",
      "Jitter2 without |.|"),
]


def copy_repo(dest: Path):
    for p in ROOT.glob("*.py"):
        shutil.copy2(p, dest / p.name)
    shutil.copytree(ROOT / "grouprl", dest / "grouprl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if (ROOT / "README.md").exists():  # the README's copy line and docs/' recipes are read by tests
        shutil.copy2(ROOT / "README.md", dest / "README.md")
    if (ROOT / "docs").exists():
        shutil.copytree(ROOT / "docs", dest / "docs")
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def check_applies(m: Mutation) -> str | None:
    """None if the original text occurs exactly once in the file, else what is wrong."""
    path = ROOT / m.file
    n = path.read_text().count(m.old) if path.exists() else -1
    return None if n == 1 else f"{m.file}: {'no such file' if n < 0 else f'found {n} times'}: {m.old!r}"


def run(m: Mutation | None, tests: list[str], timeout: float) -> tuple[str, str, float]:
    """(status, the first failing test or a note, seconds) for one mutant (None: the unmutated copy)."""
    t = time.time()
    with tempfile.TemporaryDirectory(prefix="mutant_") as tmp:
        copy_repo(Path(tmp))
        if m is not None:
            path = Path(tmp) / m.file
            path.write_text(path.read_text().replace(m.old, m.new))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        try:
            p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        except subprocess.TimeoutExpired:
            return "killed", f"timeout after {timeout:.0f} s", time.time() - t
    out = p.stdout + p.stderr
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    note = failed.group(1) if failed else (out.strip().splitlines() or [""])[-1]
    if p.returncode == 0:
        return "survived", note, time.time() - t
    return ("killed" if p.returncode == 1 else f"error rc={p.returncode}"), note, time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the mutations whose file or description contains this (case-insensitive)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutants tested at a time (default 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a mutant's tests may take (then: killed)")
    ap.add_argument("--tests", help="comma-separated test files to run instead of FAST_TESTS")
    ap.add_argument("--list", action="store_true", help="print the mutations (checked against the code) and stop")
    a = ap.parse_args()
    todo = [m for m in MUTATIONS if not a.only or a.only.lower() in f"{m.file} {m.what}".lower()]
    broken = [e for e in map(check_applies, MUTATIONS) if e]
    if broken:  # the list must follow the code: fix the list before anything runs
        sys.exit("mutations that do not apply (original text not found exactly once):\n  " + "\n  ".join(broken))
    if a.list:
        for m in todo:
            print(f"{m.file:14} {m.what}" + (f"  [equivalent: {m.equivalent}]" if m.equivalent else ""))
        return
    tests = a.tests.split(",") if a.tests else FAST_TESTS
    status, note, secs = run(None, tests, a.timeout)
    if status != "survived":  # the unmutated copy must pass, or no result means anything
        sys.exit(f"the unmutated copy fails its tests ({status}: {note})")
    print(f"unmutated copy passes {len(tests)} test files in {secs:.0f} s; {len(todo)} mutants, {a.jobs} at a time")
    results = []
    with ThreadPoolExecutor(a.jobs) as pool:
        for i, (m, (status, note, secs)) in enumerate(zip(todo, pool.map(lambda m: run(m, tests, a.timeout), todo)), 1):
            results.append((m, status, note))
            print(f"[{i:2}/{len(todo)}] {status:9} {m.file:14} {m.what}  ({secs:.0f} s; {note})", flush=True)
    survivors = [(m, n) for m, s, n in results if s == "survived"]
    bad = [m for m, _ in survivors if not m.equivalent]
    errors = [(m, s) for m, s, _ in results if s.startswith("error")]
    print(f"\n{'status':9} | {'file':14} | mutation\n{'-' * 9}-+-{'-' * 14}-+-{'-' * 50}")
    for m, s, _ in results:
        label = "equiv." if s == "survived" and m.equivalent else s
        print(f"{label:9} | {m.file:14} | {m.what}" + (f" [equivalent: {m.equivalent}]" if m.equivalent else ""))
    print(f"\ntried {len(results)}, killed {len(results) - len(survivors)} ({len(errors)} by an error, not a test), "
          f"survived {len(survivors)} ({len(survivors) - len(bad)} equivalent, {len(bad)} not)")
    for m in bad:
        print(f"SURVIVOR: {m.file}: {m.what}: {m.old!r} -> {m.new!r}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
