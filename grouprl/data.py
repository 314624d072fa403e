"""Tasks: prompts and reference answers as `datasets.Dataset`s through the chat template: the
built-in task, three hub sets by short name, and any hub id or local file (json, jsonl, parquet,
csv, arrow) that `datasets.load_dataset` reads. Called by the scripts (load_task) and cli (its checks).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from .distributed import fail, main_process
from .tools import tool_schemas, tools_in_prompt


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
# a local file's ending -> the `datasets` builder that reads it
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
           ".arrow": "arrow"}
# read when --answer-column 'answer' is not there: TRL's column, verl's nested one
ANSWER_FALLBACKS = ("solution", "reward_model.ground_truth")
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


def builtin_task(n: int, seed: int) -> list[dict]:
    """The built-in offline task (seeded, deterministic): 'x%10=' for a digit x, answer x. The
    answer is uniform over 0-9, so no constant answer scores above 0.1: the model has to read the
    digit, write it and stop (a right digit cut at --max-new-tokens scores half:
    --truncated-reward-scale). A random tiny model writes the right digit about 2% of the time; RL
    alone takes the reward past 0.7 in a few hundred steps. With 10 distinct prompts the held-out
    split measures sampling accuracy, not generalisation."""
    rng = random.Random(seed)
    return [{"prompt": f"{x}%10=", "answer": str(x)} for x in (rng.randint(0, 9) for _ in range(n))]


@dataclass(frozen=True)
class Task:
    """The data a run trains and evaluates on, and how its prompts are made (the data flags)."""
    name: str  # --dataset: 'builtin', a known hub set (DATASETS), a local file or a hub id
    data_files: str | None = None  # --data-files: local files in a known hub set's columns
    eval_size: int = 64  # --eval-size: held-out rows at most (a tenth of the data kept apart)
    seed: int = 1  # --seed: the built-in task's rows and the held-out split's draw
    enable_thinking: bool | None = None  # --enable-thinking: Qwen3's chat template's switch
    max_prompt_tokens: int = 2048  # --max-prompt-tokens: longer prompts dropped and counted
    prompt_column: str = "prompt"  # --prompt-column
    answer_column: str = "answer"  # --answer-column
    system_prompt: str | None = None  # --system-prompt
    eval_dataset: str | None = None  # --eval-dataset: held out whole
    eval_limit: int = 0  # --eval-limit: the first N held-out rows (0: all)
    eval_only: bool = False  # --eval-only: every row held out
    tools: str | None = None  # --tools: their schemas rendered into the prompts
    environment: str | None = None  # --environment: its methods' schemas too

    @classmethod
    def of(cls, args) -> Task:  # the run's flags (--dataset is `name`)
        return cls(**{f.name: getattr(args, "dataset" if f.name == "name" else f.name)
                      for f in fields(cls)})


def load_task(task: Task, tok):
    """-> (train, held-out, dropped): `datasets.Dataset`s with columns prompt (text, or a list of
    {role, content} messages, as given), answer (text), text (the prompt through the chat template)
    and every other column of the data under its own name, and the counts of rows dropped from
    both, {"no_answer": n, "too_long": m}. task.name and task.data_files: as Task says (a known hub
    set comes with its own columns and instruction). The held-out rows: the whole of eval_dataset if given (test split, else its only one); with
    eval_only the whole of the data (its test split if it has one); else the data's test split, or
    a tenth of its rows kept apart, at most eval_size of them. eval_limit > 0 caps the first two.
    Rows without an answer, and prompts over max_prompt_tokens tokens after the chat template, are
    dropped and counted; nothing usable left is an error."""
    from datasets import Dataset, disable_progress_bars

    name, data_files, eval_size, seed = task.name, task.data_files, task.eval_size, task.seed
    eval_dataset, eval_limit, eval_only = task.eval_dataset, task.eval_limit, task.eval_only

    # the same one-line errors as check_common_args, for callers that skip it
    check_dataset(name, data_files)
    if eval_dataset is not None:
        check_dataset(eval_dataset, None, "--eval-dataset")
    cols = (task.prompt_column, task.answer_column)

    def templated(d):
        # for map/filter, after any download: the counts of what is dropped are printed
        disable_progress_bars()
        if "text" in d.column_names:  # the templated prompt goes there; the data's 'text' is lost
            print("the data's column 'text' is replaced by the templated prompt")
            d = d.remove_columns("text")
        schemas = tool_schemas(task.tools, task.environment)  # --tools', --environment's
        d = d.add_column("text", chat_prompts(tok, d["prompt"], task.enable_thinking,
                                              task.system_prompt, schemas))
        return d.filter(lambda b: [len(ids) <= task.max_prompt_tokens for ids in
                                   tok(b["text"], add_special_tokens=False).input_ids],
                        batched=True)

    def whole(flag, spec, files):  # every usable row of a set (its test split if it has one)
        if spec == "builtin":
            say(f"{flag} builtin: {eval_size} prompts of the built-in task")
            return Dataset.from_list(builtin_task(eval_size, seed + 1)), 0
        splits, train_split, test_split, pcol, acol, instr = read_source(flag, spec, files, *cols)
        say(f"{flag} {spec}: split '{test_split or train_split}'")
        return task_rows(flag, spec, splits[test_split or train_split], pcol, acol, instr)

    def say(where):  # the start-up line that names the held-out rows
        if main_process():
            print(f"{'evaluated' if eval_only else 'held out'}: {where}")

    if eval_dataset is not None or eval_only:
        if eval_dataset is not None:
            held, no_answer = whole("--eval-dataset", eval_dataset, None)
        else:
            held, no_answer = whole("--dataset", name, data_files)
        train = held.select([])  # --eval-only: no training rows
        if not eval_only:
            if name == "builtin":
                train, n = Dataset.from_list(builtin_task(4096, seed)), 0
            else:
                splits, train_split, _, pcol, acol, instr = read_source("--dataset", name,
                                                                        data_files, *cols)
                train, n = task_rows("--dataset", name, splits[train_split], pcol, acol, instr)
                train = not_held(train, held, name, "--eval-dataset")
            no_answer += n
        n = len(train) + len(held)
        train, held = templated(train), templated(held)
        dropped = {"no_answer": no_answer, "too_long": n - len(train) - len(held)}
        if eval_limit > 0 and len(held) > eval_limit:  # kept out by choice, not dropped
            held = held.select(range(eval_limit))
        why = (f"no usable rows (dropped {no_answer} without an answer, {dropped['too_long']} over "
               f"--max-prompt-tokens {task.max_prompt_tokens})")
        if len(held) == 0:
            fail(f"--eval-dataset {eval_dataset!r}: {why}" if eval_dataset is not None
                 else f"--dataset {name!r}: {why}")
        if not eval_only and len(train) == 0:
            fail(f"--dataset {name!r}: {why}")
        return train, held, dropped

    def finish(train, held, no_answer):
        n = len(train) + len(held)
        train, held = templated(train), templated(held)
        dropped = {"no_answer": no_answer, "too_long": n - len(train) - len(held)}
        held = held.select(range(min(eval_size, len(held))))
        if len(train) == 0:
            fail(f"--dataset {name!r}: no usable rows (dropped {no_answer} without an answer, "
                 f"{dropped['too_long']} over --max-prompt-tokens {task.max_prompt_tokens})")
        return train, held, dropped

    if name == "builtin":
        say(f"{eval_size} prompts of the built-in task")
        return finish(Dataset.from_list(builtin_task(4096, seed)),
                      Dataset.from_list(builtin_task(eval_size, seed + 1)), 0)
    splits, train_split, test_split, pcol, acol, instr = read_source("--dataset", name,
                                                                     data_files, *cols)
    train, dropped = task_rows("--dataset", name, splits[train_split], pcol, acol, instr)
    if len(train) == 0:
        fail(f"--dataset {name!r}: no usable rows (dropped {dropped} without an answer)")
    if test_split is not None:
        say(f"split '{test_split}' of --dataset {name} (at most --eval-size {eval_size} rows)")
        held, n = task_rows("--dataset", name, splits[test_split], pcol, acol, instr)
        dropped += n
        train = not_held(train, held, name, f"its split '{test_split}'")
    elif len(set(map(prompt_key, train["prompt"]))) < len(train):  # copies: held out whole
        n = len(train)
        train, held = apart_by_prompt(train, eval_size, seed, name)
        say(f"{len(held)} of the distinct prompts of --dataset {name} kept apart, one row each, "
            f"none of their copies trained on (its {n} rows repeat prompts; a tenth of the "
            "distinct ones at most, at most --eval-size; it has no test or validation split)")
    elif len(train) < 2:
        fail(f"--dataset {name!r}: 1 usable row (dropped {dropped} without an answer); it needs at "
             "least 2, one to train on and one held out (or give --eval-dataset)")
    else:  # no held-out split: keep a tenth of the rows apart, at most eval_size
        split = train.train_test_split(test_size=min(eval_size, len(train) // 10 or 1), seed=seed)
        train, held = split["train"], split["test"]
        say(f"{len(held)} rows of --dataset {name} kept apart (a tenth at most, at most "
            "--eval-size; it has no test or validation split)")
    return finish(train, held, dropped)


def prompt_key(prompt) -> str:
    """A prompt as one string (a list of messages as its JSON), to compare prompts by."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def not_held(train, held, name: str, source: str):
    """The training rows whose prompt is not a held-out one: a held-out prompt trained on makes the
    evaluation measure recall, not generalisation. Said in one line; nothing left is an error."""
    out = set(map(prompt_key, held["prompt"]))
    keep = [i for i, p in enumerate(train["prompt"]) if prompt_key(p) not in out]
    if len(keep) == len(train):
        return train
    if not keep:
        fail(f"--dataset {name!r}: every training prompt is also a held-out prompt of {source} (the "
             "same data twice?): give held-out prompts the training data does not hold, or drop "
             "--eval-dataset (a tenth of --dataset is then held out)")
    if main_process():
        print(f"--dataset {name}: {len(train) - len(keep)} of its {len(train)} training rows have a "
              f"prompt {source} holds out: not trained on, so that the evaluation is held out")
    return train.select(keep)


def apart_by_prompt(train, eval_size: int, seed: int, name: str):
    """A tenth of the distinct prompts (at most eval_size) held out, one row each, and every copy
    of them kept out of training: data with repeated prompts split by row would hold out copies of
    training rows."""
    keys = list(dict.fromkeys(map(prompt_key, train["prompt"])))
    if len(keys) < 2:
        fail(f"--dataset {name!r}: its {len(train)} rows hold 1 distinct prompt; it needs at least "
             "2, one to train on and one held out (or give --eval-dataset)")
    chosen = set(random.Random(seed).sample(keys, min(eval_size, len(keys) // 10 or 1)))
    first, train_rows = {}, []
    for i, p in enumerate(map(prompt_key, train["prompt"])):
        if p in chosen:
            first.setdefault(p, i)
        else:
            train_rows.append(i)
    return train.select(train_rows), train.select(sorted(first.values()))


# the splits held out from training, in the order taken: a folder's or glob's test.jsonl, else its
# validation.jsonl (datasets' names: test/eval..., validation/valid/dev/val)
HELD_OUT_SPLITS = ("test", "validation")


def file_split(path: str) -> str:
    """The split a file's name says, as `datasets` reads a folder: a word of its name among
    datasets' split keywords (train, training; validation, valid, dev, val; test, testing, eval,
    evaluation), else train."""
    from datasets.data_files import SPLIT_KEYWORDS

    words = set(re.split(r"[^a-z0-9]+", os.path.basename(path).lower()))
    return next((str(split) for split, keys in SPLIT_KEYWORDS.items() if words & set(keys)),
                "train")


def read_source(flag: str, name: str, data_files: str | None, prompt_column: str,
                answer_column: str):
    """-> (splits, train split, test split or None, prompt column, answer column, instruction) of
    a known hub set (its own columns, unless --prompt-column / --answer-column name others), a
    local file or a hub id (the columns given, the answer column found among ANSWER_FALLBACKS when
    the given one is absent). A column that is not there fails in one line naming those there
    are."""
    if name in DATASETS:
        hub, cfg, train_split, test_split, pcol, acol, instr = DATASETS[name]
        pcol = prompt_column if prompt_column != "prompt" else pcol
        acol = answer_column if answer_column != "answer" else acol
        if data_files:
            splits = {"train": read_files("--data-files", data_files)}
            train_split, test_split = "train", None
            hint = (f"{flag} {name} reads its own columns '{pcol}' and '{acol}' (a file of "
                    f"'prompt' and 'answer' is given as {flag} path.jsonl)")
            flag, name = "--data-files", data_files
        else:
            splits = load_hub(flag, name, hub, cfg)
            hint = "name them with --prompt-column and --answer-column"
    else:
        splits = read_files(flag, name, splits=True) if is_local(name) else load_hub(flag, name,
                                                                                     name, None)
        train_split = "train" if "train" in splits else next(iter(splits))
        test_split = next((s for s in HELD_OUT_SPLITS if s in splits and s != train_split), None)
        pcol, acol, instr = prompt_column, answer_column, ""
        hint = "name them with --prompt-column and --answer-column"
    for split in {train_split, test_split} - {None}:
        d = splits[split]
        if not has_column(d, acol) and acol == "answer":
            acol = next((c for c in ANSWER_FALLBACKS if has_column(d, c)), acol)
        missing = [c for c in (pcol, acol) if not has_column(d, c)]
        if missing:
            fail(f"{flag} {name!r} has no column(s) {missing} (columns: {d.column_names}); "
                 f"{hint}")
    return splits, train_split, test_split, pcol, acol, instr


def has_column(d, path: str) -> bool:
    """d has the column `path`, or for 'a.b' a column a of records holding b (verl's
    reward_model.ground_truth)."""
    top, *rest = path.split(".")
    if top not in d.column_names:
        return False
    feature = d.features[top]
    for key in rest:  # a struct column is a dict of its fields
        if not isinstance(feature, dict) or key not in feature:
            return False
        feature = feature[key]
    return True


def column_value(row: dict, path: str):
    """row[path], or row[a][b] for 'a.b'."""
    for key in path.split("."):
        row = row[key] if isinstance(row, Mapping) and key in row else None
    return row


def task_rows(flag: str, name: str, d, pcol: str, acol: str, instr: str):
    """-> (rows, dropped): every row of d with "prompt" (pcol's value as given: text, or a list of
    {role, content} messages; a known set's instruction after a text prompt), "answer" (acol's
    value as text, after '####' where it has one; rows without one dropped and counted) and every
    other column of d under its own name. A prompt that is neither fails in one line naming its
    row."""
    from datasets import disable_progress_bars

    disable_progress_bars()
    prompts = d[pcol] if "." not in pcol else [column_value(r, pcol) for r in d]
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p.strip() or is_messages(p)):
            fail(f"{flag} {name} row {i + 1}: '{pcol}' is {p!r:.40}; every row needs a text prompt "
                 "or a list of {role, content} messages")
    answers = d[acol] if "." not in acol else [column_value(r, acol) for r in d]
    for i, a in enumerate(answers):
        if isinstance(a, bool) or not isinstance(a, (str, int, float, type(None))):
            fail(f"{flag} {name} row {i + 1}: '{acol}' is a {type(a).__name__}; give the answer as "
                 "text or a number")

    def to_row(r):  # new columns, renamed below: map keeps an overwritten column's type
        p, a = column_value(r, pcol), column_value(r, acol)
        a = "" if a is None else str(a)
        a = a.split("####")[-1].strip() if "####" in a else a.strip()
        row = {"answer_": a}
        if pcol != "prompt" or instr:  # else the prompt column stays as it is, whatever its type
            row["prompt_"] = f"{p}\n{instr}".strip() if instr and isinstance(p, str) else p
        return row

    rows = d.map(to_row).filter(lambda r: len(r["answer_"]) > 0)
    for col in ("answer", "prompt"):
        if col + "_" in rows.column_names:
            rows = rows.remove_columns(col) if col in rows.column_names else rows
            rows = rows.rename_column(col + "_", col)
    return rows, len(d) - len(rows)


def is_messages(p) -> bool:
    """A conversational prompt: a non-empty list of {role, content} messages with text in both."""
    return isinstance(p, list) and len(p) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in p)


def is_local(spec: str) -> bool:
    """A local file, folder or glob (else a hub id or nothing)."""
    return (os.path.exists(spec) or spec.endswith(tuple(FORMATS))
            or glob.has_magic(spec) and bool(glob.glob(spec)))


def read_files(flag: str, spec: str, splits: bool = False):
    """A local file, folder or glob of files in one of FORMATS, as one `datasets.Dataset`, read by
    `datasets.load_dataset`; an empty or malformed file fails in one line naming it (a JSON lines
    file: its first line that is not JSON). A folder's files must be of one format (folder_formats);
    splits=True: {split: Dataset}, a folder's files named for their split (train.jsonl, test.jsonl)
    each their own split, else {"train": the Dataset}."""
    from datasets import disable_progress_bars, load_dataset
    from datasets.utils import logging as datasets_logging

    disable_progress_bars()
    if os.path.isdir(spec):
        check_folder(flag, spec)
        paths, builder = [spec], None
        for files in folder_formats(spec).values():
            for name in files:
                check_utf8(os.path.join(spec, name))
    else:
        paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not paths or not all(os.path.isfile(p) for p in paths):
            fail(f"{flag} {spec!r}: no such file")
        kinds = {os.path.splitext(p)[1].lower() for p in paths}
        if len(kinds) > 1 or not kinds <= set(FORMATS):
            fail(f"{flag} {spec!r}: files of one format, one of {', '.join(FORMATS)} "
                 f"(got {', '.join(sorted(kinds))})")
        builder = FORMATS[kinds.pop()]
        for path in paths:
            if os.path.getsize(path) == 0 or builder == "json" and not open(
                    path, "rb").read().strip():
                fail(f"{path}: empty file" + ("; write one JSON object a line, e.g. "
                                              "{\"prompt\": \"2+2=\", \"answer\": \"4\"}"
                                              if builder == "json" else ""))
            check_utf8(path)
    level = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # its own error lines: ours is one
    try:
        if builder is None:
            found = dict(load_dataset(spec))  # a folder: its splits, or its train (else first)
            return found if splits else found.get("train", next(iter(found.values())))
        if splits and len(paths) > 1:  # a glob: its files keep the splits their names say
            by_split = {}
            for p in paths:
                by_split.setdefault(file_split(p), []).append(p)
            if len(by_split) > 1:
                return {s: load_dataset(builder, data_files=ps, split="train")
                        for s, ps in by_split.items()}
        d = load_dataset(builder, data_files=paths, split="train")
        return {"train": d} if splits else d
    except Exception as e:  # noqa: BLE001 - whatever went wrong, one line says so
        if builder == "json":
            for path in paths:
                json_lines_error(path)
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        fail(f"{flag} {spec!r}: `datasets` cannot read it ({type(cause).__name__}: {first})")
    finally:
        datasets_logging.set_verbosity(level)


def folder_formats(folder: str) -> dict[str, list[str]]:
    """{format: the folder's files in it} for the files `datasets.load_dataset(folder)` takes for
    data (its own resolution: hidden files and dataset cards left out), by the builder that reads
    each (.json and .jsonl: both json). Of several formats `datasets` reads only one, silently:
    check_folder refuses them."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        from datasets.packaged_modules import _EXTENSION_TO_MODULE as modules
        builders = {ext.lower(): module for ext, (module, _) in modules.items()}
    except ImportError:  # another `datasets` layout: the formats read here
        builders = dict(FORMATS)
    try:
        files = DataFilesDict.from_patterns(get_data_patterns(folder), base_path=folder)
    except Exception:  # noqa: BLE001 - no data files at all: load_dataset says so in its own words
        return {}
    found = {}
    for paths in files.values():
        for path in paths:
            ext = os.path.splitext(path)[1].lower()
            if ext in builders:
                found.setdefault(builders[ext], []).append(os.path.relpath(path, folder))
    return {k: sorted(v) for k, v in sorted(found.items())}


def check_folder(flag: str, folder: str):
    """A folder of data files of one format, else one line naming the formats found."""
    found = folder_formats(folder)
    if len(found) < 2:
        return
    listed = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                       for k, v in found.items())
    ext = os.path.splitext(next(iter(found.values()))[0])[1]
    fail(f"{flag} {folder!r}: files of several formats ({listed}), of which `datasets` would read "
         "one format's and drop the others': give files of one format (move the others out, or "
         f"pass a glob of one, e.g. {os.path.join(folder, '*' + ext)!r})")


def check_utf8(path: str):
    """A text data file (JSON, JSON lines, CSV) is UTF-8, else one line naming its first line that
    is not (which `datasets` reads into its columns and fails on, or not, at some later row);
    binary formats (parquet, arrow) are not looked at. Read once, a line at a time."""
    if not path.lower().endswith((".json", ".jsonl", ".csv")):
        return
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                fail(f"{path}:{i}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not UTF-8 "
                     f"({e.reason}): save the file as UTF-8")


def json_lines_error(path: str):
    """Fail naming the first line of a JSON lines file that is not a JSON object (nothing when it
    is one JSON array or every line is fine): the line `datasets` only reports as 'row 1' of its
    block."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{path}: cannot be read as UTF-8 text ({e})")
    if text.lstrip().startswith("["):  # one JSON array
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})")
        return
    for i, line in enumerate(text.split("\n"), 1):  # not splitlines: strings may hold U+2028
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{path}:{i}: not valid JSON ({e.msg}, column {e.colno}); each line must be one "
                 "JSON object")
        if not isinstance(r, dict):
            fail(f"{path}:{i}: a JSON {type(r).__name__}, not an object like "
                 "{\"prompt\": ..., \"answer\": ...}")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set: only cached copies are read."""
    return any(os.environ.get(v, "0").lower() not in ("0", "", "false", "no", "off")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def unreachable_hub() -> str | None:
    """'cannot reach ENDPOINT (why)' when one connection to the hub's endpoint fails (5 s at
    most), where `datasets` and `transformers` would retry for ~30 s; None when it answers, when
    HF_HUB_OFFLINE is set, or behind a proxy (only the libraries know the way there)."""
    import socket
    import urllib.parse

    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                                              "all_proxy"))
    if hub_offline() or proxied:
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlparse(endpoint)
    try:
        socket.create_connection((url.hostname,
                                  url.port or (443 if url.scheme == "https" else 80)), 5).close()
    except OSError as e:
        return f"cannot reach {endpoint} ({e.strerror or e})"
    return None


def load_hub(flag: str, name: str, hub: str, cfg: str | None):
    """A hub set through `datasets`, failing with one line, fast, when the hub cannot be reached:
    without HF_HUB_OFFLINE, one connection to the endpoint (5 s at most) before `datasets` would
    retry for ~30 s; with it, the cached copy or a line saying there is none."""
    from datasets import load_dataset

    offline = hub_offline()
    if (why := unreachable_hub()):
        fail(f"{flag} {name}: {why}; without a network, load it once where there is one and set "
             f"HF_HUB_OFFLINE=1 to use the cached copy, or give a local copy of {hub} "
             f"({local_copy(name)})")
    try:
        return load_dataset(hub, cfg)
    except Exception as e:  # noqa: BLE001 - whatever went wrong, one line says so
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "; HF_HUB_OFFLINE is set, so only a cached copy can be used" if offline else ""
        fail(f"{flag} {name}: loading {hub} failed ({type(e).__name__}: {first}){where}; or "
             f"give a local copy ({local_copy(name)})")


def local_copy(name: str) -> str:
    """How a local copy of a hub set is given."""
    if name in DATASETS:
        return "--data-files, in the set's own columns"
    return "a json, jsonl, parquet, csv or arrow file as --dataset or --eval-dataset"


def chat_prompts(tok, prompts: list, enable_thinking: bool | None = None,
                 system_prompt: str | None = None, tools: list[dict] | None = None) -> list[str]:
    """Each prompt through the tokenizer's chat template: a text prompt as one user message (after
    a system message of system_prompt, if given), a conversational prompt (a list of {role,
    content} messages) whole, its own system message included. enable_thinking is passed to the
    template only when set (None: the template's own default; Qwen3's thinks). A tokenizer without
    a chat template gets text prompts as they are. tools: the tools' schemas (tools_in_prompt)."""
    if not getattr(tok, "chat_template", None):
        if system_prompt is not None or any(not isinstance(p, str) for p in prompts):
            fail("the tokenizer has no chat template: conversational prompts and --system-prompt "
                 "need one (give text prompts, or a model with a chat template)")
        return [tools_in_prompt(tok, p, tools)[0] for p in prompts]
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    given = [tools_in_prompt(tok, system + [{"role": "user", "content": p}]
                             if isinstance(p, str) else p, tools) for p in prompts]
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        return [tok.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=True,
                                        **kw) for m, t in given]
    except SecurityError as e:  # the template reached for what the sandbox blocks (os.popen...)
        fail(f"the model's chat template does what a template may not ({str(e).rstrip('.')}), "
             "blocked: a template formats messages only; check the chat_template of the model's "
             "tokenizer_config.json")
    except TemplateError as e:  # raise_exception in the template, e.g. no system role (Gemma)
        fix = ("this template takes no system message: put the text into the prompts, or drop "
               "--system-prompt") if system_prompt is not None else (
            "give prompts in the form it takes, or a model whose template does")
        fail(f"the model's chat template refuses the prompt ({e}): {fix}")


def check_dataset(name: str, data_files: str | None, flag: str = "--dataset"):
    """--dataset (or --eval-dataset) and --data-files name something that can exist, before
    anything is read: builtin, a known hub set, a local file, folder or glob, or a hub id."""
    kinds = ", ".join(sorted(set(FORMATS.values()) | {"jsonl"}))
    if name not in ("builtin", *DATASETS) and not is_local(name) and not HUB_ID.fullmatch(name):
        fail(f"{flag} {name!r}: unknown (use builtin, {', '.join(DATASETS)}, a hub id like "
             f"trl-lib/DeepMath-103K, or a local {kinds} file)")
    if is_local(name) and not glob.glob(name):
        fail(f"{flag} {name!r}: no such file")
    if os.path.isdir(name):
        check_folder(flag, name)
    if os.path.isfile(name) and not name.lower().endswith(tuple(FORMATS)):
        fail(f"{flag} {name!r}: not a file `datasets` reads here (a {kinds} file)")
    if data_files is not None and name == "builtin":
        fail(f"--data-files {data_files!r} reads a local copy of a hub set (--dataset "
             f"{', '.join(DATASETS)}); --dataset builtin would ignore it: drop it")
    if data_files is not None and name not in DATASETS:
        fail(f"--dataset {name!r} is a {'local file' if is_local(name) else 'hub id'} already "
             f"and --data-files {data_files!r} would be ignored: drop --data-files (it reads a "
             "local copy of a hub set in that set's own columns)")
    if data_files is not None and not glob.glob(data_files):
        fail(f"--data-files {data_files!r}: no such file")
