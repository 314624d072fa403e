"""Rewards per completion: score, what every script's loop calls between the rollout and the group
advantages, and the watch it keeps over a run's training steps (a reward that keeps failing stops
the run; groups that are all flat from the first step on are said once). The grading itself, the
math grader and users' --reward functions in worker processes under a time bound, is grader's
(reward_worker.py is the worker's program). At the end, the built-in reward functions a --reward
names (math_reward, think_format, length_penalty: common.py imports them, so --reward
common:math_reward finds them).
"""

from __future__ import annotations

import math
import re
import sys

import torch
import torch.distributed as dist

from .distributed import all_reduce, fail
from .grader import MAX_ANSWER_CHARS, Reward, Rewards, canonical, decide, extract_answer

_MATH_GRADER = []  # the default Reward, made on first use


class Given:
    """A reward computed before score, as a part of the rewards (kind 'given'): an
    --environment's get_reward (episodes.env_scores), named for its class, weight 1 (TRL)."""
    kind = "given"

    def __init__(self, name: str):
        self.name = name

    def stop(self):  # Rewards.stop stops every part
        pass


def score(texts: list[str], answers, n: int, reward: Reward | Rewards | None = None,
          watch: bool = True, truncated: torch.Tensor | None = None,
          truncated_scale: float = 1.0, given: dict | None = None,
          messages: list[list[dict]] | None = None) -> tuple[torch.Tensor, int]:
    """Reward per completion (reward: a Reward or Rewards, default the math grader), and on how
    many completions a reward failed (raised, returned a non-finite value or not a reward a
    completion, ran past its time bound, or an answer too long to grade): those score 0 from that
    reward and the first error is printed, so one broken completion never stops a run.
    answers: the prompts' answers, or their rows (a dict of columns or a datasets batch: 'answer',
    and for a TRL-form reward 'prompt' and every other column but 'text'); completions come n per
    prompt. Several rewards: the weighted sum of those that apply (a TRL reward's None does not,
    TRL's nansum). Each answer is normalised once per prompt, and each distinct request (extracted
    answer and reference; for a user's f(completion, answer), completion and answer) is graded
    once; a TRL-form reward is called once per group of n completions.
    truncated [B] (bool), truncated_scale (--truncated-reward-scale): a completion cut at
    --max-new-tokens scores truncated_scale times its reward.
    watch: a training step; say once when every group of each of the first steps has equal
    rewards (watch_flat_groups), keep each reward's values for its logs (reward.metrics()), and
    stop the run on a reward that keeps failing (watch_failures).
    given: {name: (values [B] float64, NaN: does not apply; errors [B], None: scored)}, rewards
    computed elsewhere (an --environment's get_reward): each joins reward's parts on first sight,
    weight 1 (Rewards only; their values log as rewards/<name>/), and scores NaN where not given
    (a rollout without get_reward values). messages: episodes as TRL's completions (model and tool messages),
    what a TRL-form reward gets as completions when the prompts are messages (TRL's tool loop)."""
    if reward is None:
        if not _MATH_GRADER:
            _MATH_GRADER.append(Reward())
        reward = _MATH_GRADER[0]
    rows = answers if hasattr(answers, "keys") or hasattr(answers, "column_names") else None
    answers = [str(a) for a in (rows["answer"] if rows is not None else answers)]
    columns, values, failed, first = {}, {}, torch.zeros(len(texts), dtype=torch.bool), {}
    new = [(Given(name), 1.0) for name in given or {}
           if name not in [part.name for part, _ in reward.parts]]
    if isinstance(reward, Rewards):  # TRL: the environment's reward is one more, weight 1, kept
        reward.parts += new
    parts = reward.parts if isinstance(reward, Rewards) else reward.parts + new
    for part, _ in parts:
        if part.kind == "given":  # not given (an evaluation): it does not apply
            none = torch.full((len(texts),), math.nan, dtype=torch.float64), [None] * len(texts)
            v, errors = (given or {}).get(part.name, none)
        elif part.kind == "trl":
            columns = columns or _columns(rows, answers)
            conversational = any(isinstance(p, list) for p in columns["prompts"][:1])  # messages
            v, errors = _score_groups(part, texts, _taken(columns, part, rows), n,
                                      conversational, messages)
        elif part.kind == "verl":
            v, errors = _score_verl(part, texts, rows, answers, n)
        else:
            v, errors = _score_pairs(part, texts, answers, n)
        values[part.name] = v
        failed |= torch.tensor([e is not None for e in errors], dtype=torch.bool)
        first[part.name] = next((e for e in errors if e is not None), None), sum(
            e is not None for e in errors)
    # sum_k w_k r_k over the rewards that apply (TRL's nansum; 0 when none does), in float64: a finite reward past
    # float32's range (1e308, or 1e38 times a weight of 10) scores 0 and counts as a failure of the reward that
    # weighs most in it, like a non-finite reward, instead of becoming an infinite advantage
    weights = torch.tensor([w for _, w in parts], dtype=torch.float64)
    weighted = torch.stack(list(values.values()), 1) * weights
    r = weighted.nansum(1)
    over = ~torch.isfinite(r.float())
    for i in over.nonzero().flatten().tolist():
        name = list(values)[int(weighted[i].nan_to_num(0.0).abs().argmax())]
        error, count = first[name]
        first[name] = error or f"ValueError: the weighted reward {r[i].item():g} is past float32's range", count + 1
    failed |= over
    r = r.masked_fill(over, 0.0)
    if truncated is not None and truncated_scale != 1.0:
        r = torch.where(truncated.cpu(), truncated_scale * r, r)
    r = r.float()
    for name, (error, count) in first.items():
        if count:
            who = "the reward" if len(first) == 1 else f"the reward {name}"
            print(f"warning: {who} failed on {count} of {len(texts)} completions, scored 0 "
                  f"(first: {error})", file=sys.stderr)
    if watch:
        reward.values = values
        watch_failures(reward, first, len(texts))
        watch_flat_groups(reward, r, n, values)
    return r, int(failed.sum())


def _score_pairs(reward: Reward, texts: list[str], answers: list[str], n: int):
    """f(completion, answer) per completion (the math grader, or a user's function): its reward
    and its error (None when it was scored)."""
    keys, results, requests = [], {}, []  # per completion: its request (None: no answer, scores 0)
    if reward.spec is None:
        golds = [canonical(a) for a in answers]  # once per prompt
        preds = {}  # extracted answer -> canonical form, once per distinct answer
        for i, text in enumerate(texts):
            try:
                pred, gold = extract_answer(text), golds[i // n]
                if pred is None:
                    keys.append(None)
                    continue
                if len(pred) > MAX_ANSWER_CHARS:
                    raise ValueError(f"an answer of {len(pred)} characters (over "
                                     f"{MAX_ANSWER_CHARS}) is not graded")
                p = preds[pred] if pred in preds else preds.setdefault(pred, canonical(pred))
                key = (p, gold)  # the values too: '50%' and '50' share the text '50'
                if key not in results:
                    results[key] = (decide(p, gold), None)
                    if results[key][0] is None:
                        requests.append(key)
            except Exception as e:  # noqa: BLE001 - whatever the completion holds, it scores 0
                # and is counted
                key = ("failed", i)
                results[key] = (0.0, f"{type(e).__name__}: {e}")
            keys.append(key)
        # math-verify compares the texts
        results.update(zip(requests, reward.run([(p[0], gold[0]) for p, gold in requests])))
    else:
        keys = [(text, answers[i // n]) for i, text in enumerate(texts)]
        requests = list(dict.fromkeys(keys))
        results.update(zip(requests, reward.run(requests)))
    v = [results[k][0] if k is not None else 0.0 for k in keys]
    return (torch.tensor(v, dtype=torch.float64),
            [results[k][1] if k is not None else None for k in keys])


def _columns(rows, answers: list[str]) -> dict:
    """A TRL-form reward's keyword arguments, one value per prompt: prompts, and every column of
    the rows but 'prompt' and 'text' (the templated prompt) by its name, as TRL passes them (given
    the answers alone: prompts None, and the answers)."""
    if rows is None:
        rows = {"answer": answers}
    names = list(rows.column_names if hasattr(rows, "column_names") else rows.keys())
    kw = {"prompts": list(rows["prompt"]) if "prompt" in names else [None] * len(answers)}
    kw.update({k: list(rows[k]) for k in names if k not in ("prompt", "text")})
    return kw


def _score_verl(reward: Reward, texts: list[str], rows, answers: list[str], n: int):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info), once per distinct
    completion of a prompt, by keyword as verl's NaiveRewardManager calls it: data_source and
    extra_info from verl's parquet columns (None and {} where there are none), ground_truth from
    reward_model.ground_truth as stored (else the answer). A reward per completion and its
    error."""
    names = set(rows.column_names if hasattr(rows, "column_names") else rows.keys()) if (
        rows is not None) else set()
    cols = {k: list(rows[k]) for k in ("data_source", "reward_model", "extra_info") if k in names}

    def column(name, g, default):
        return default if name not in cols or cols[name][g] is None else cols[name][g]

    keys, requests = [], {}
    for i, text in enumerate(texts):
        g = i // n
        model = column("reward_model", g, {})
        extra = column("extra_info", g, {})
        kw = {"data_source": column("data_source", g, None), "solution_str": text,
              "ground_truth": model.get("ground_truth", answers[g]) if isinstance(model, dict)
              else answers[g],
              "extra_info": dict(extra) if isinstance(extra, dict) else extra}
        kw = {k: v for k, v in kw.items() if reward.more or k in reward.params}
        keys.append((g, text))
        requests.setdefault((g, text), kw)
    results = dict(zip(requests, reward.run(list(requests.values()))))
    return (torch.tensor([results[k][0] for k in keys], dtype=torch.float64),
            [results[k][1] for k in keys])


def _taken(columns: dict, reward: Reward, rows) -> dict:
    """The columns reward takes (all of them when it takes **kwargs); one line naming the columns
    there are when it needs one that is not."""
    missing = [p for p in reward.required if p not in columns and p != "completions"]
    if missing:
        names = list(rows.column_names if hasattr(rows, "column_names") else rows.keys())
        fail(f"--reward {reward.spec}: needs the column {missing[0]!r}, which the data does not "
             f"have (its columns: {', '.join(names)})")
    return {k: v for k, v in columns.items() if reward.more or k in reward.params}


# what a reward written for messages raises on a plain-text completion (string indices, .get ...)
PLAIN_TEXT_ERRORS = ("TypeError", "KeyError", "AttributeError", "IndexError")


def _score_groups(reward: Reward, texts: list[str], columns: dict, n: int, conversational: bool,
                  messages: list[list[dict]] | None = None):
    """TRL's f(prompts, completions, **columns) -> list[float | None], called once per group of n
    completions, each argument given per completion (a prompt's values repeated n times); the
    completions as [{'role': 'assistant', 'content': text}] when the prompts are message lists
    (an episode's: its messages, as TRL's tool loop passes them). A reward per completion (NaN:
    None, not applicable) and its error."""
    requests = []
    for g in range(len(texts) // n):
        group = texts[g * n:(g + 1) * n]
        completions = ([[{"role": "assistant", "content": t}] for t in group] if conversational
                       else list(group))
        if conversational and messages is not None:
            completions = messages[g * n:(g + 1) * n]
        requests.append({**{k: [v[g]] * n for k, v in columns.items()},
                         "completions": completions})
    v, errors = [], []
    for r, error in reward.run(requests):
        if error is not None and not conversational and error.startswith(PLAIN_TEXT_ERRORS):
            error += (" (completions are plain text here; a reward that reads "
                      "completion[0]['content'], as trl.rewards' do, needs conversational data: "
                      "prompts as lists of {role, content} messages)")
        v += [0.0] * n if error is not None else [math.nan if x is None else x for x in r]
        errors += [error] * n
    return torch.tensor(v, dtype=torch.float64), errors


def watch_failures(reward: Reward | Rewards, failures: dict, total: int):
    """Stop the run in one line when a reward failed on every completion of the first training
    step, or on more than half of them in reward.fail_steps steps in a row (0: never). failures:
    per reward name, (its first error, on how many of the total completions it failed); counted
    over all ranks, so that every rank stops together."""
    if not reward.fail_steps:
        return
    counts = all_reduce(torch.tensor([[c, total] for _, c in failures.values()],
                                     dtype=torch.float64))
    reward.steps += 1
    for (name, (error, _)), (bad, all_) in zip(failures.items(), counts.tolist()):
        reward.bad_steps[name] = reward.bad_steps.get(name, 0) + 1 if 2 * bad > all_ else 0
        said = f" (first error: {error})" if error else ""
        if reward.steps == 1 and bad == all_:
            fail(f"the reward {name} failed on every completion of the first step{said}: fix it "
                 "(the run would learn from nothing)")
        if reward.bad_steps[name] >= reward.fail_steps:
            fail(f"the reward {name} failed on more than half of the completions in "
                 f"{reward.bad_steps[name]} steps in a row{said} (--reward-fail-steps "
                 f"{reward.fail_steps}): fix it")


# the first training steps that, all flat, make a run say that its answers may not be gradable
FLAT_STEPS = 5


def watch_flat_groups(reward: Reward | Rewards, r: torch.Tensor, n: int,
                      values: dict | None = None):
    """Say once (main rank) when every group of each of the first FLAT_STEPS training steps had
    equal rewards: every advantage was 0, nothing was learned, and the likely cause is answers the
    grader cannot match. values: each reward's own values [B] (NaN: it does not apply); a group
    whose summed rewards are equal but whose rewards tell its completions apart is not flat (under
    --multi-objective-aggregation normalize-then-sum its advantages are not 0)."""
    # a step with a spread was seen, or the warning was given
    if reward.flat_steps < 0 or r.numel() % n:
        return
    g = r.view(-1, n)
    flat = bool((g == g[:, :1]).all())
    for v in (values or {}).values():  # each reward constant over the rows it applies to
        v = v.view(-1, n)
        flat = flat and bool((v.nan_to_num(-math.inf).amax(1) <= v.nan_to_num(math.inf).amin(1)).all())
    reward.flat_steps = reward.flat_steps + 1 if flat else -1
    if reward.flat_steps == FLAT_STEPS:
        reward.flat_steps = -1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"warning: in each of the first {FLAT_STEPS} steps every group's completions got "
                  f"the same reward (now {r.mean().item():.3f}), so every advantage is 0 and "
                  "nothing is learned; if this goes on, the answers may not be gradable: compare "
                  "them with what the model writes (samples.jsonl)",
                  file=sys.stderr)


# -------------------- the built-in reward functions (--reward common:math_reward ...)
def math_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (extract_answer) equals the reference, else 0.0: exact
    numbers and canonical text first (decide), math-verify on what they cannot settle (radicals,
    expressions, intervals, sets, tuples, matrices, equations), in a worker process with a time
    bound (in the calling process when that is a --reward worker). Model text is parsed, never
    executed."""
    r, errors = score([completion], [answer], 1, watch=False)
    return r.item()


# <think>, the reasoning, one </think>, then an answer: no second <think>, something after
# </think>. The opening tag may be missing where the chat template wrote it into the prompt.
_THINK_FORMAT = re.compile(r"\s*(?:<think>)?(?:(?!<think>|</think>).)*</think>(?!.*<think>)"
                           r"(?!.*</think>)\s*\S.*", re.DOTALL)


def think_format(completion: str, answer: str) -> float:
    """1.0 when the completion reasons inside <think>...</think> and then answers (TRL's
    think_format_reward, which also asks for an answer after </think>), else 0.0. A built-in
    reward: --reward common:think_format."""
    return float(_THINK_FORMAT.fullmatch(completion) is not None)


# DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), with |y| in characters (a reward
# sees text): L_max = LENGTH_MAX_CHARS, L_cache = LENGTH_CACHE_CHARS (DAPO: 20480 and 4096 tokens)
LENGTH_MAX_CHARS = 16384
LENGTH_CACHE_CHARS = 4096


def length_penalty(completion: str, answer: str) -> float:
    """0 up to L_max - L_cache characters, then ((L_max - L_cache) - |y|) / L_cache, falling
    linearly to -1 at L_max, and -1 past it (DAPO eq. 13). A built-in reward:
    --reward common:length_penalty, added to another one with its weight (--reward-weights)."""
    free = LENGTH_MAX_CHARS - LENGTH_CACHE_CHARS
    if len(completion) <= free:
        return 0.0
    if len(completion) <= LENGTH_MAX_CHARS:
        return (free - len(completion)) / LENGTH_CACHE_CHARS
    return -1.0
