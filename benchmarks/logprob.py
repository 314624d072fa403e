"""Completion log-probs on CPU: peak extra memory and time of

    chunked  logprobs.chunked_logprobs: the LM head on --chunk rows at a time, each chunk recomputed in backward
    naive    log_softmax(h W^T).gather(target): the [N, V] logits and log-softmax are materialised
    trl      F.linear then TRL's selective_log_softmax (trl.trainer.utils): gather minus a per-row logsumexp
             loop; it still takes the [B, T, V] logits as input (pip install -r benchmarks/requirements.txt)

in one of the loop's two passes (--pass):

    train    forward + backward of the log-probs (the training pass; every row is computed)
    old      forward without gradient, log-probs and entropy (the old log-prob pass before the updates; chunked
             and naive); with --kept below 1 the rest of each sequence is padding after EOS, which chunked does
             not score (its keep)

    python benchmarks/logprob.py                     # the issue's size: 8 x 4096 tokens, V = 151936, hidden 64
    python benchmarks/logprob.py --pass old --kept 0.6 --methods chunked,naive

Each measurement runs in a fresh process: peak extra memory is the peak RSS during the call minus the RSS before
it (the kernel's high-water mark is reset through /proc/self/clear_refs), so it counts every transient tensor.
Where a method does not fit in this machine's memory at the full size, it is measured at the largest fraction of
the tokens that fits, and its full-size numbers are that measurement scaled by the token ratio (both grow linearly
in N for the materialising methods); the table says which rows are scaled. The script measures the common.py
beside it (run a copy of it from another checkout to measure that checkout's).
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def measure(method: str, tokens: int, vocab: int, hidden: int, chunk: int, repeat: int, pass_: str = "train",
            kept: float = 1.0) -> dict:
    """One method in this process: peak extra MB over all repeats, median seconds of the pass."""
    import inspect

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, ROOT)
    from grouprl.logprobs import chunked_logprobs

    torch.manual_seed(0)
    B = 8 if tokens % 8 == 0 else 1
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden ** 0.5).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    g = torch.randn(tokens)  # d loss / d logp: a general upstream gradient
    T = tokens // B  # each of the B sequences keeps its first kept x T positions, the rest is padding after EOS
    keep = (torch.arange(T)[None] < round(kept * T)).expand(B, T).reshape(-1)
    # a common.py from before keep existed scores every row
    keep_kw = {"keep": keep} if "keep" in inspect.signature(chunked_logprobs).parameters else {}
    if method == "trl":
        from trl.trainer.utils import selective_log_softmax

    def logprobs(entropy: bool):
        if method == "chunked":
            return chunked_logprobs(h, w, None, targets, 1.0, chunk, entropy, **keep_kw)
        logits = F.linear(h, w)
        if method == "naive":
            logsm = F.log_softmax(logits, -1)
            logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
            return (logp, -(logsm.exp() * logsm).sum(-1)) if entropy else logp
        return selective_log_softmax(logits.view(B, T, vocab), targets.view(B, -1)).view(-1)

    def run():
        if pass_ == "old":
            with torch.no_grad():
                return logprobs(True)[0]
        logp = logprobs(False)
        (logp * g).sum().backward()
        return logp.detach()

    times, before = [], kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    for _ in range(repeat):
        h.grad = w.grad = None
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return {"method": method, "tokens": tokens, "peak_extra_mb": (kb("VmHWM") - before) / 1024,
            "time_s": statistics.median(times), "pass": pass_, "kept": kept}


def child(method, tokens, a) -> dict:
    cmd = [sys.executable, __file__, "--run", method, "--tokens", str(tokens), "--vocab", str(a.vocab),
           "--hidden", str(a.hidden), "--chunk", str(a.chunk), "--repeat", str(a.repeat), "--pass", a.pass_,
           "--kept", str(a.kept)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="N = B x T completion tokens")
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen3: 151936)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (small: the LM head is what is measured)")
    ap.add_argument("--chunk", type=int, default=1024, help="chunked: rows per chunk (--logprob-chunk-tokens)")
    ap.add_argument("--repeat", type=int, default=1, help="timed forward + backward passes per measurement")
    ap.add_argument("--methods", default="chunked,naive,trl")
    ap.add_argument("--pass", dest="pass_", choices=["train", "old"], default="train",
                    help="train: forward + backward of the log-probs; old: the no-grad pass, log-probs and entropy")
    ap.add_argument("--kept", type=float, default=1.0,
                    help="fraction of each sequence's positions inside the mask (the rest: padding after EOS)")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: measure one method in this process
    a = ap.parse_args()
    if a.run:
        print(json.dumps(measure(a.run, a.tokens, a.vocab, a.hidden, a.chunk, a.repeat, a.pass_, a.kept)))
        return
    methods = a.methods.split(",")
    if a.pass_ == "old" and "trl" in methods:
        raise SystemExit("error: --pass old measures chunked and naive (--methods chunked,naive)")
    if "trl" in methods and importlib.util.find_spec("trl") is None:
        raise SystemExit("error: the trl method needs TRL: pip install -r benchmarks/requirements.txt "
                         "(or --methods chunked,naive)")
    avail = kb_meminfo("MemAvailable") * 1024
    full = a.tokens * a.vocab * 4  # one float32 [N, V] tensor
    need = {"chunked": 0, "naive": 3 * full, "trl": 2.5 * full}  # logits, log-softmax (naive), their gradient
    fit = a.tokens
    while max(need[m] for m in methods) * fit / a.tokens > 0.75 * avail and fit % 2 == 0 and fit > a.chunk:
        fit //= 2
    print(f"N = {a.tokens} tokens x V = {a.vocab}, hidden {a.hidden}, chunk {a.chunk}, pass {a.pass_}, kept {a.kept}; "
          f"one float32 [N, V] tensor is {full / 2**30:.1f} GiB; {avail / 2**30:.1f} GiB available, so the "
          f"materialising methods run at N = {fit}")
    rows = [child(m, fit, a) for m in methods]
    if fit != a.tokens and "chunked" in methods:
        rows.append(child("chunked", a.tokens, a))
    base = {r["method"]: r for r in rows if r["tokens"] == fit}
    what = "fwd+bwd" if a.pass_ == "train" else "no-grad fwd + entropy"
    print(f"\n| method | tokens | peak extra memory (MB) | time {what} (s) | memory / naive | time / naive |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        n = base.get("naive")
        ratio = (f"{r['peak_extra_mb'] / n['peak_extra_mb']:.3f} | {r['time_s'] / n['time_s']:.2f}"
                 if n and r["tokens"] == fit else "- | -")
        print(f"| {r['method']} | {r['tokens']} | {r['peak_extra_mb']:.0f} | {r['time_s']:.2f} | {ratio} |")
    if fit != a.tokens:
        k = a.tokens / fit
        for m in methods:
            if m != "chunked":
                r = base[m]
                print(f"| {m} (scaled x{k:g}) | {a.tokens} | {r['peak_extra_mb'] * k:.0f} | {r['time_s'] * k:.2f} | "
                      "- | - |")
    print(f"\ncommand: python benchmarks/{os.path.basename(__file__)} " + " ".join(sys.argv[1:]))


def kb_meminfo(field: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/meminfo")


if __name__ == "__main__":
    main()
