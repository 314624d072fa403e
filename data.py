"""Tasks: prompts and reference answers (the built-in task, the hub sets, local .json/.jsonl files)
as `datasets.Dataset`s through the chat template. Called by the scripts (load_task) and cli.py.
"""

from __future__ import annotations

import glob
import json
import os
import random

from distributed import fail


# -------------------- tasks: prompts and reference answers
# name: (hub id, config, train split, held-out split, prompt column, answer column, instruction)
DATASETS = {
    "gsm8k": ("openai/gsm8k", "main", "train", "test", "question", "answer",
              "Solve the problem step by step and end with '#### <answer>'."),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", None, "problem", "answer",
                "Please reason step by step, and put your final answer within \\boxed{}."),
    "dapo17k": ("open-r1/DAPO-Math-17k-Processed", "en", "train", None, "prompt", "solution",
                # its prompts carry DAPO's own instruction ('The last line ... Answer: $Answer')
                ""),
}


def builtin_task(n: int, seed: int) -> list[dict]:
    """The built-in offline task (seeded, deterministic): 'x%10=' for a digit x, answer x. The
    answer is uniform over 0-9, so no constant answer scores above 0.1: the model has to read the
    digit, write it and stop. A random tiny model hits it about 2% of the time; RL alone takes it
    past 0.7 in a few hundred steps. With 10 distinct prompts the held-out split measures sampling
    accuracy, not generalisation."""
    rng = random.Random(seed)
    return [{"prompt": f"{x}%10=", "answer": str(x)} for x in (rng.randint(0, 9) for _ in range(n))]


def load_task(name: str, data_files: str | None, eval_size: int, seed: int, tok,
              enable_thinking: bool, max_prompt_tokens: int):
    """-> (train, held-out, dropped): `datasets.Dataset`s with columns prompt, answer and text (the
    prompt through the chat template), and the counts of rows dropped from both, {"no_answer": n,
    "too_long": m}. `name` is 'builtin', a known hub set (DATASETS), or a local .json/.jsonl file of
    {prompt, answer}. `data_files` reads local files laid out in a known hub set's own columns (an
    offline mirror). Rows without an answer, and prompts over max_prompt_tokens tokens after the
    chat template, are dropped and counted; nothing usable left is an error."""
    from datasets import Dataset, disable_progress_bars

    # the same one-line errors as check_common_args, for callers that skip it
    check_dataset(name, data_files)

    def templated(d):
        # for map/filter, after any download: the counts of what is dropped are printed
        disable_progress_bars()
        d = d.add_column("text", chat_prompts(tok, d["prompt"], enable_thinking))
        return d.filter(lambda b: [len(ids) <= max_prompt_tokens for ids in
                                   tok(b["text"], add_special_tokens=False).input_ids],
                        batched=True)

    def finish(train, held, no_answer):
        n = len(train) + len(held)
        train, held = templated(train), templated(held)
        dropped = {"no_answer": no_answer, "too_long": n - len(train) - len(held)}
        held = held.select(range(min(eval_size, len(held))))
        if len(train) == 0:
            fail(f"--dataset {name!r}: no usable rows (dropped {no_answer} without an answer, "
                 f"{dropped['too_long']} over --max-prompt-tokens {max_prompt_tokens})")
        return train, held, dropped

    if name == "builtin":
        return finish(Dataset.from_list(builtin_task(4096, seed)),
                      Dataset.from_list(builtin_task(eval_size, seed + 1)), 0)
    if name in DATASETS:
        hub, cfg, train_split, test_split, pcol, acol, instr = DATASETS[name]
        if data_files:
            hint = (f"--dataset {name} reads its own columns '{pcol}' and '{acol}' (a file of "
                    "'prompt' and 'answer' is given as --dataset path.jsonl)")
            ds = {"train": read_local("--data-files", data_files, pcol, acol, hint)}
            train_split, test_split = "train", None
        else:
            ds = load_hub(name, hub, cfg)
    else:  # a local .json/.jsonl file (check_dataset refused anything else)
        pcol, acol, instr = "prompt", "answer", ""
        ds = {"train": read_local("--dataset", name, pcol, acol,
                                  "a local file needs 'prompt' and 'answer'")}
        train_split, test_split = "train", None
    train = ds[train_split]
    missing = [c for c in (pcol, acol) if c not in train.column_names]
    if missing:
        fail(f"--dataset {name!r} has no column(s) {missing} (columns: {train.column_names}); a "
             "local file needs 'prompt' and 'answer'")

    def to_row(r):
        # chat-format prompts: last user turn
        p = r[pcol] if isinstance(r[pcol], str) else r[pcol][-1]["content"]
        a = str(r[acol]) if r[acol] is not None else ""
        a = a.split("####")[-1].strip() if "####" in a else a.strip()
        return {"prompt": f"{p}\n{instr}".strip() if instr else p, "answer": a}

    def clean(d):
        disable_progress_bars()
        d = d.map(to_row, remove_columns=d.column_names)
        return d.filter(lambda r: len(r["answer"]) > 0)

    train_c = clean(train)
    dropped = len(train) - len(train_c)
    if len(train_c) == 0:
        fail(f"--dataset {name!r}: no usable rows (dropped {dropped} without an answer)")
    if test_split is not None:
        held = clean(ds[test_split])
        dropped += len(ds[test_split]) - len(held)
    elif len(train_c) < 2:
        fail(f"--dataset {name!r}: 1 usable row (dropped {dropped} without an answer); it needs at "
             "least 2, one to train on and one held out")
    else:  # no held-out split: keep the last eval_size rows apart
        split = train_c.train_test_split(test_size=min(eval_size, len(train_c) // 10 or 1),
                                         seed=seed)
        train_c, held = split["train"], split["test"]
    return finish(train_c, held, dropped)


def read_local(flag: str, spec: str, pcol: str, acol: str, hint: str):
    """A local .json/.jsonl file (or a glob of them) as a `datasets.Dataset` of its pcol and acol
    columns, read here line by line so that a bad row fails with one line naming its file and line:
    JSON lines (one object a line) or one JSON array of objects. Prompts are text (or chat turns:
    the last one's content); answers text or numbers, kept as text (null: dropped later and
    counted)."""
    from datasets import Dataset

    paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    if not paths or not all(os.path.isfile(p) for p in paths):
        fail(f"{flag} {spec!r}: no such file")
    rows = []
    for path in paths:
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"{path}: cannot be read as UTF-8 text ({e})")
        if not text.strip():
            fail(f"{path}: empty file; write one JSON object a line, e.g. "
                 f"{{\"{pcol}\": \"2+2=\", \"{acol}\": \"4\"}}")
        if text.lstrip().startswith("["):  # one JSON array
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                fail(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})")
            numbered = [(f"{path} item {i + 1}", r) for i, r in enumerate(items)]
        else:
            numbered = []
            # not splitlines: JSON strings may hold U+2028
            for i, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    numbered.append((f"{path}:{i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    fail(f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); each line must "
                         "be one JSON object")
        rows += [checked_row(where, r, pcol, acol, hint) for where, r in numbered]
    return Dataset.from_list(rows)


def checked_row(where: str, r, pcol: str, acol: str, hint: str) -> dict:
    """One row of a local file, or one line naming what is wrong with it."""
    if not isinstance(r, dict):
        fail(f"{where}: a JSON {type(r).__name__}, not an object like {{\"{pcol}\": ..., "
             f"\"{acol}\": ...}}")
    missing = [c for c in (pcol, acol) if c not in r]
    if missing:
        fail(f"{where} has no column(s) {missing} (it has {sorted(r)}); {hint}")
    p, a = r[pcol], r[acol]
    if isinstance(p, list) and p and isinstance(p[-1], dict) and isinstance(p[-1].get("content"),
                                                                            str):
        p = p[-1]["content"]  # chat format: the last turn
    if not isinstance(p, str) or not p.strip():
        fail(f"{where}: '{pcol}' is {p!r:.40}; every row needs a text prompt")
    if isinstance(a, bool) or not isinstance(a, (str, int, float, type(None))):
        fail(f"{where}: '{acol}' is a {type(a).__name__}; give the answer as text or a number")
    return {pcol: p, acol: None if a is None else str(a)}


def load_hub(name: str, hub: str, cfg: str | None):
    """A hub set through `datasets`, failing with one line, fast, when the hub cannot be reached:
    without HF_HUB_OFFLINE, one connection to the endpoint (5 s at most) before `datasets` would
    retry for ~30 s; with it, the cached copy or a line saying there is none."""
    import socket
    import urllib.parse

    from datasets import load_dataset

    offline = any(os.environ.get(v, "0").lower() not in ("0", "", "false", "no", "off")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                                              "all_proxy"))
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not proxied:  # behind a proxy only `datasets` knows the way
        url = urllib.parse.urlparse(endpoint)
        try:
            socket.create_connection((url.hostname,
                                      url.port or (443 if url.scheme == "https" else 80)),
                                     5).close()
        except OSError as e:
            fail(f"--dataset {name}: cannot reach {endpoint} ({e.strerror or e}); without a "
                 "network, load it once "
                 f"where there is one and set HF_HUB_OFFLINE=1 to use the cached copy, or give a "
                 "local copy of "
                 f"{hub} with --data-files")
    try:
        return load_dataset(hub, cfg)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, one line says so
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "; HF_HUB_OFFLINE is set, so only a cached copy can be used" if offline else ""
        fail(f"--dataset {name}: loading {hub} failed ({type(e).__name__}: {first}){where}; or "
             "give a local copy with --data-files")


def chat_prompts(tok, prompts: list[str], enable_thinking: bool) -> list[str]:
    """Through the tokenizer's chat template where it has one."""
    if not getattr(tok, "chat_template", None):
        return prompts
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=enable_thinking)
            for p in prompts]


def check_dataset(name: str, data_files: str | None):
    """--dataset and --data-files name something that exists, before anything is read."""
    if name not in ("builtin", *DATASETS) and not name.endswith((".json", ".jsonl")):
        fail(f"--dataset {name!r}: unknown (use builtin, {', '.join(DATASETS)}, or a local .jsonl "
             "of {prompt, answer})")
    if name.endswith((".json", ".jsonl")) and not os.path.isfile(name):
        fail(f"--dataset {name!r}: no such file")
    if data_files is not None and name == "builtin":
        fail(f"--data-files {data_files!r} reads a local copy of a hub set (--dataset "
             f"{', '.join(DATASETS)}); --dataset builtin would ignore it: drop it")
    if data_files is not None and name not in DATASETS:
        fail(f"--dataset {name!r} is a local file already and --data-files {data_files!r} would be "
             "ignored: drop --data-files (it reads a local copy of a hub set in that set's own "
             "columns)")
    if data_files is not None and not glob.glob(data_files):
        fail(f"--data-files {data_files!r}: no such file")
