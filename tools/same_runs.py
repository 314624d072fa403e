"""Proof that a change moves code and no number: a fixed set of short runs, fingerprinted.

    python tools/same_runs.py --out before.json            # on the commit before the change
    python tools/same_runs.py --out after.json             # on the commit after it
    python tools/same_runs.py --compare before.json after.json

Each run's fingerprint is its metrics.jsonl without the timings (perf/*, */seconds) and the sha256
of every file of its checkpoints, with what differs between two runs of one commit by design taken
out: JSON files (trainer_state, manifest, args) lose their wall time and run folder, and the
manifest its hashes of those; a safetensors file's header is hashed with its keys sorted. Runs use
PYTHONHASHSEED=0 (set orders in saved JSON).
The runs cover every subsystem a script calls: the engine, KL, evaluation, LoRA, the MoE tape and
Routing Replay, dynamic sampling, the rollout's log-probs and TIS, Energy, --reward's worker, FSDP2
under torchrun (gloo, 2 ranks), stale rollouts (--max-staleness, its ring in a checkpoint).
"""
import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--num-steps", "3", "--prompts-per-rank", "4", "--eval-every", "0"]
RUNS = {
    "gspo-engine-kl-eval-saves": ["gspo.py", "--gen-mode", "engine", "--kl-coef", "0.05", "--num-steps", "4",
                                  "--prompts-per-rank", "4", "--eval-every", "2", "--save-every", "2"],
    "dfpo-lora": ["dfpo.py", "--lora-rank", "4", *SHORT],
    "grpo-moe-replay": ["grpo.py", "--model", "tiny-moe", "--routing-replay", *SHORT],
    "gspo_token-dynamic": ["gspo_token.py", "--dynamic-sampling", *SHORT],
    "gspo_token-penalty-energy": ["gspo_token.py", "--post-answer-penalty", "0.1", "--energy-every", "1",
                                  *SHORT],
    "grpo-rollout-logp": ["grpo.py", "--gen-mode", "engine", "--old-logp", "rollout", *SHORT],
    "grpo-tis": ["grpo.py", "--gen-mode", "engine", "--rollout-is-cap", "2", *SHORT],
    "gspo-reward": ["gspo.py", "--reward", "common:math_reward", *SHORT],
    "grpo-fix": ["grpo.py", "--symmetric-clip", "--loss-agg", "seq-mean-token-sum-norm", *SHORT],
    "gspo-torchrun": ["--torchrun", "gspo.py", *SHORT],
    "dfpo-split-groups": ["dfpo.py", "--micro-batch-size", "4", "--num-iterations", "2", *SHORT],
    "grpo-token-mean-kl": ["grpo.py", "--loss-agg", "token-mean", "--kl-coef", "0.1", "--micro-batch-size", "8",
                           *SHORT],
    "grpo-stale-decoupled": ["grpo.py", "--max-staleness", "2", "--rollout-is-cap", "2", "--rollout-is-mode",
                             "token-mask", "--save-every", "2", *SHORT],
    "gspo-stale-behaviour": ["gspo.py", "--max-staleness", "1", "--old-logp", "rollout", *SHORT],
}
NORMALISED = {"trainer_state.json", "manifest.json", "args.json"}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def safetensors_hash(path: str) -> str:
    """The hash of a safetensors file with its header's keys sorted: the Rust writer orders the
    metadata of masters_rank{r}.safetensors at random; the tensors' bytes are hashed as they are."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def normalised(path: str, run_dir: str, out_dir: str) -> str:
    """The hash of a JSON file with its wall time and paths taken out."""
    data = json.load(open(path))

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()
                    if k not in ("wall_time", "output_dir") and not k.endswith(("trainer_state.json", ".safetensors"))}
        if isinstance(x, list):
            return [clean(v) for v in x]
        if isinstance(x, str):
            return x.replace(run_dir, "RUN").replace(out_dir, "OUT")
        return x

    return hashlib.sha256(json.dumps(clean(data), sort_keys=True).encode()).hexdigest()


def fingerprint(name: str, argv: list[str]) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"same_runs_{name}_")
    try:
        return run_and_hash(name, argv, out_dir)
    finally:  # the run and its checkpoints: hashed, no longer needed
        shutil.rmtree(out_dir, ignore_errors=True)


def run_and_hash(name: str, argv: list[str], out_dir: str) -> dict:
    """One run under out_dir, then its fingerprint (the module docstring)."""
    if argv[0] == "--torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *argv[1:]]
    else:
        cmd = [sys.executable, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")  # set orders in saved JSON and metadata
    done = subprocess.run(cmd + ["--output-dir", out_dir], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    (run_dir,) = glob.glob(os.path.join(out_dir, "*__*__*"))
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/") and not k.endswith("/seconds")}
               for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    files = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "**", "*"), recursive=True)):
        rel = os.path.relpath(path, run_dir)
        if not os.path.isfile(path) or rel.startswith("events.") or rel in ("metrics.jsonl", "writer.lock"):
            continue
        base = os.path.basename(path)
        if base in NORMALISED:
            files[rel] = normalised(path, run_dir, out_dir)
        elif base.endswith(".safetensors"):
            files[rel] = safetensors_hash(path)
        else:
            files[rel] = sha256(path)
    return {"metrics": metrics, "files": files}


def load(path: str) -> dict:
    """A fingerprint file as --out writes it ({run: {"metrics": [rows], "files": {file: hash}}}), or one line."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        sys.exit(f"error: --compare {path}: no such file (write it with --out)")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        sys.exit(f"error: --compare {path}: not a JSON file ({e}); write it again with --out")
    if not isinstance(data, dict):
        sys.exit(f"error: --compare {path}: a JSON {type(data).__name__}, not same_runs.py's "
                 "{run: fingerprint} object (written by --out)")
    for name, run in data.items():
        if not (isinstance(run, dict) and isinstance(run.get("metrics"), list)
                and isinstance(run.get("files"), dict)):
            sys.exit(f"error: --compare {path}: run {name!r} is not a fingerprint "
                     "({\"metrics\": [...], \"files\": {...}}); write the file again with --out")
    return data


def compare(a_path: str, b_path: str, only_common: bool = False) -> int:
    a, b = load(a_path), load(b_path)
    bad = 0
    for name in sorted(set(a) | set(b)):
        if (name not in a or name not in b) and only_common:
            continue
        if name not in a or name not in b:
            print(f"{name}: only in {a_path if name in a else b_path}")
            bad += 1
            continue
        same_metrics = a[name]["metrics"] == b[name]["metrics"]  # every row: the same keys and values
        same_order = [list(r) for r in a[name]["metrics"]] == [list(r) for r in b[name]["metrics"]]
        diff_files = sorted(f for f in set(a[name]["files"]) | set(b[name]["files"])
                            if a[name]["files"].get(f) != b[name]["files"].get(f))
        print(f"{name}: metrics.jsonl {'equal' if same_metrics else 'DIFFER'}"
              f"{'' if same_order or not same_metrics else ' (its keys in another order)'} "
              f"({len(a[name]['metrics'])} rows), checkpoint files "
              f"{len(a[name]['files'])} {'equal' if not diff_files else 'DIFFER: ' + ', '.join(diff_files)}")
        bad += (not same_metrics) + bool(diff_files)
    print("bitwise equal" if not bad else f"{bad} differences")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the runs' fingerprints to this JSON file")
    p.add_argument("--only", nargs="*", help="run only these (names of RUNS)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    p.add_argument("--common", action="store_true", help="with --compare: only the runs both files hold")
    args = p.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare, only_common=args.common))
    if not args.out:
        p.error("give --out FILE or --compare A B")
    # every check before the first run (12 runs take minutes)
    if args.only is not None and not args.only:
        sys.exit(f"error: --only with no names: give one or more of {', '.join(RUNS)} (or leave out --only)")
    if unknown := [n for n in args.only or [] if n not in RUNS]:
        sys.exit(f"error: --only {' '.join(unknown)}: no such run (choose from {', '.join(RUNS)})")
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out):
        sys.exit(f"error: --out {args.out} is a folder: give a file name in it, e.g. {args.out}/before.json")
    if not os.path.isdir(folder):
        sys.exit(f"error: --out {args.out}: no folder {folder}; make it first (mkdir -p {folder})")
    if not os.access(folder, os.W_OK):
        sys.exit(f"error: --out {args.out}: the folder {folder} is not writable")
    names = args.only or list(RUNS)
    with ThreadPoolExecutor(2) as pool:  # two runs at a time, one thread each
        prints = dict(zip(names, pool.map(lambda n: fingerprint(n, RUNS[n]), names)))
    json.dump(prints, open(args.out, "w"), indent=1)
    print(f"{len(prints)} runs -> {args.out}")


if __name__ == "__main__":
    main()
