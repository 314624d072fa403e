"""Episodes: a completion with turns, as TRL 1.16's GRPOTrainer tool loop makes them
(`tools=`, `max_tool_calling_iterations`, `_tool_call_loop`). The model's turn is parsed for tool
calls in the Qwen3/Hermes format, the tools run in a worker process under a time bound
(tool_worker.py), their results are appended as the chat template's tool turn and the model
generates again, until a turn has no call, --max-tool-calls rounds, or the --max-new-tokens budget
over the whole episode. An episode travels as one Rollout row: prompt | turn 1 | tool turn | turn 2
..., the mask 1 on the model's tokens only (TRL's tool_mask), so every objective sees nothing the
environment wrote. --environment (TRL's environment_factory): one instance an episode, in the
worker. The engine (--gen-mode engine) keeps each row's KV cache across its turns
(engine/turns.py). Under torchrun each rank runs its own episodes, with its own tool worker, and
makes the generate calls every other rank makes (FSDP2); the tools/* counts are summed over the
ranks. The held-out evaluation runs episodes too (evaluation.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .distributed import all_reduce, fail
from .generation import Rollout, gathered, generate
from .tools import Tools, load_environment, load_tools

# TRL 1.16's qwen3_template (trl/chat_template_utils.py): the response template its parse_response
# gives transformers' parser (transformers.utils.chat_parsing) for a Qwen3/Hermes turn
QWEN3_RESPONSE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}


# -------------------- the flags' checks
def check_tool_args(args, launched: bool):
    """The --tools and --environment flags' one-line checks, before any heavy work (called by
    check_common_args). The two go together as TRL's tools= and environment_factory do: the
    functions and the environment's methods are the episode's tools."""
    env = getattr(args, "environment", None)
    if not args.tools and not env:
        return
    flag = "--tools" if args.tools else "--environment"
    if args.max_tool_calls < 1:
        fail(f"--max-tool-calls {args.max_tool_calls}: give at least 1 (rounds of tool calls)")
    if launched and args.gen_mode == "engine-tp" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        fail(f"{flag} with --gen-mode engine-tp over several processes: each rank's episodes take "
             "their own turns, which engine-tp's shared decoding cannot; use --gen-mode engine")
    names = list(load_tools(args.tools)[0]) if args.tools else []
    twice = sorted(set(names) & set(load_environment(env).methods if env else []))
    if twice:
        fail(f"--tools and --environment both name a tool {twice[0]!r}: rename one (the prompt "
             "would show two tools of one name)")


# -------------------- a model turn's tool calls, a tool turn's tokens
def parse_turn(raw: str, eos: str | None = None, tools: list[dict] | None = None) -> dict | None:
    """A model turn as TRL 1.16's parse_response makes it, or None where TRL falls back to the
    plain text (a malformed turn). raw: what the template pre-wrote of the turn (prewritten),
    then the turn's ids decoded whole (special tokens and its EOS kept: an unclosed call then
    holds the EOS and is bad JSON). transformers' parser reads it with QWEN3_RESPONSE: a <think>
    block is reasoning_content, every '<tool_call>JSON</tool_call>' anywhere in the turn is a call
    (the text around and between calls is content), its arguments typed by the tool's schema
    where a string fits it ('6' -> 6 for an integer; the parser's tools=); then TRL's checks: each
    call's JSON an object with a 'function' object whose name is a string, missing or null
    arguments {} (arguments of another type, a list or a string, are kept: the call runs and
    fails), the content without a trailing EOS."""
    from transformers.utils.chat_parsing import parse_response

    try:
        msg = parse_response(raw, QWEN3_RESPONSE, prefix="", tools=tools)
        if isinstance(msg.get("content"), str) and eos:
            msg["content"] = msg["content"].removesuffix(eos)
        msg["content"] = msg.get("content") or ""
        for call in msg.get("tool_calls", []):
            f = call.get("function") if isinstance(call, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ValueError("a tool call without a function's name")
            if f.get("arguments") is None:
                f["arguments"] = {}
    except (ValueError, TypeError):
        return None
    return msg


def parse_calls(raw: str, tools: list[dict] | None = None) -> list[dict] | None:
    """A model turn's tool calls (parse_turn): [{"name", "arguments"}] ([] for a turn without
    '<tool_call>'); None for a malformed turn: TRL then decodes the turn as plain text, so it has
    no call and the episode ends."""
    if "<tool_call>" not in raw:
        return []
    msg = parse_turn(raw, tools=tools)
    if msg is None:
        return None
    return [dict(c["function"]) for c in msg.get("tool_calls", [])]


def prewritten(history: str) -> str:
    """What the chat template wrote of the model's next turn: the history's text after its last
    assistant header (QWEN3_RESPONSE's start_anchor), e.g. an opened '<think>\n'. TRL gives the
    history to parse_response as prefix=, which the parser reads up to there; it is parsed with
    the turn (the same message: the parser reads text in pieces alike)."""
    anchor = QWEN3_RESPONSE["start_anchor"]
    k = history.rfind(anchor)
    return "" if k < 0 else history[k + len(anchor):]


def typed(call: dict, schemas: list[dict] | None):
    """A call's arguments typed as transformers' parser types them given the tools (TRL's
    parse_response(tools=...)): a string argument cast to its schema's type where it fits."""
    from transformers.utils.chat_parsing.response_parser import _coerce, _schema_types

    arguments = call["arguments"]
    props = next((s["function"].get("parameters", {}).get("properties") or {}
                  for s in schemas or [] if s["function"]["name"] == call["name"]), {})
    if not isinstance(arguments, dict) or not props:
        return arguments
    out = dict(arguments)
    for key, value in arguments.items():
        types = _schema_types(props.get(key))
        if types and isinstance(value, str):
            out[key] = _coerce(value, types)
        elif types and isinstance(value, list) and "array" not in types:
            out[key] = [_coerce(v, types) if isinstance(v, str) else v for v in value]
    return out


def tool_suffix_ids(tok, tool_messages: list[dict], **kw) -> list[int]:
    """The tokens after the model's turn (its EOS included) up to the next turn's header, as TRL
    1.16's _get_tool_suffix_ids makes them: a dummy conversation rendered with and without the tool
    messages (and the generation prompt), the first cut after its last EOS, the difference. kw: the
    template's settings (enable_thinking), as TRL passes its chat_template_kwargs."""
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": tool_messages[0]["name"],
                                                   "arguments": {}}}]}]
    prefix = tok.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                     return_dict=False, **kw)
    full = tok.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                   tokenize=True, return_dict=False, **kw)
    ends = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
    if ends:  # Qwen templates render '<|im_end|>\n' after a turn: cut at the EOS
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving: a tool turn cannot be "
                         "appended to an episode's tokens (tools.check_prefix_preserving)")
    return full[len(prefix):]


# -------------------- the tool loop over generate
@torch.no_grad()
def continue_turns(policy, tok, histories: list[list[int]], room: list[int], eos: list[int],
                   dist_env, sampling, rows: int = 0) -> list[tuple[list[int], bool, str]]:
    """One more model turn after each history (ids, unpadded), at most room[i] tokens -> [(turn
    ids up to and including the first EOS, cut (no EOS), text without the EOS)]. With the engine's
    open episodes (generation.generate(episodes=True)) each row's KV cache is kept: only the
    history's tokens past it (the tool turn) are prefilled, and each token's log-prob is kept
    for turn_logps; else HF generate as generation.generate samples, one row each, prefilling
    the whole history. rows (torchrun, HF generate): the most histories a rank has this round;
    each rank makes its generate calls, as FSDP2's all-gathers inside them need, a call past its
    own histories generating one greedy token (no random draw) for a dummy row, dropped."""
    from .engine import turns as engine_turns

    pad = tok.pad_token_id
    kept = (engine_turns.of(getattr(policy, "lm", None))
            if sampling.mode in ("engine", "engine-tp") else None)
    out = [] if kept is None else [new for new, _ in kept.next(histories, room)]
    size = sampling.gen_batch_size
    with gathered(policy, sampling.unshard):
        for s in range(0, 0 if kept is not None else max(len(histories), rows), size):
            part = histories[s:s + size]
            if not part:  # another rank's rows: the same forwards (synced_gpus), nothing kept
                policy.generate(input_ids=torch.tensor([[pad]], device=dist_env.device),
                                attention_mask=torch.ones(1, 1, dtype=torch.long,
                                                          device=dist_env.device),
                                n=1, do_sample=False, max_new_tokens=1, eos_token_id=eos,
                                pad_token_id=pad, synced_gpus=True)
                continue
            L = max(len(h) for h in part)
            ids = torch.tensor([[pad] * (L - len(h)) + h for h in part], device=dist_env.device)
            am = torch.tensor([[0] * (L - len(h)) + [1] * len(h) for h in part],
                              device=dist_env.device)
            gen = policy.generate(
                input_ids=ids, attention_mask=am, n=1, do_sample=True,
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                min_p=sampling.min_p or None, repetition_penalty=sampling.repetition_penalty,
                max_new_tokens=max(1, *room[s:s + len(part)]),  # room 0: cut to no token below
                min_new_tokens=sampling.min_new_tokens or None, eos_token_id=eos,
                pad_token_id=pad, synced_gpus=dist_env.sharded)[:, L:]
            out += gen.tolist()
    turns = []
    for new, r in zip(out, room):
        new = new[:r]  # TRL: a turn past the episode's budget is cut there
        end = next((k for k, t in enumerate(new) if t in eos), None)
        new = new if end is None else new[:end + 1]
        text = tok.decode(new if end is None else new[:-1], skip_special_tokens=True)
        turns.append((new, end is None, text))
    return turns


def turn_logps(policy, prompt: list[list[int]], comp: list[list[int]], T: int, device):
    """The episodes' log-probs [B, T] as the engine sampled the model's tokens, 0 at the tool
    turns' (mask 0), for --old-logp rollout and the rollout corrections; None where HF generate
    made the turns. Closes the engine's open episodes (their KV cache back to the pool)."""
    from .engine import turns as engine_turns

    logps = engine_turns.end(getattr(policy, "lm", None), [p + c for p, c in zip(prompt, comp)])
    if logps is None:
        return None
    rows = [lp[len(p):] for p, lp in zip(prompt, logps)]
    return torch.tensor([lp + [0.0] * (T - len(lp)) for lp in rows], device=device)


def generate_episodes(policy, tok, prompts, n: int, eos: list[int], dist_env, sampling,
                      tools: Tools, streamer=None) -> Rollout:
    """generation.generate's Rollout, each row an episode (TRL 1.16's _tool_call_loop): turn 1 by
    generate (every --gen-mode; the engine keeps each row's KV cache for the next turns), then up
    to tools.max_calls rounds: the rows whose last turn calls
    tools get the results as a tool turn (mask 0) and generate again (mask 1). The budget
    sampling.max_new_tokens holds over the whole episode: a tool turn that would pass it is
    dropped (its calls counted) and the episode ends with the turn that called (its EOS: not
    truncated, as TRL), as one that would reach the model's context (context_of); a turn is cut
    where the budget ends. prompts: the templated prompts, or the batch's rows (their 'text'; with an
    --environment, each episode's instance is reset(**row) first, open_episodes).
    texts: the model's turns, joined by a newline. With an --environment: env_rewards and
    env_errors (get_reward), turn_rewards (get_turn_rewards), close_episodes. stats:
    tools/call_frequency (calls an episode), tools/failure_frequency (failed calls over calls),
    tools/malformed_turns, tools/rolled_back (episodes whose tool turn was dropped),
    tools/cut_by_budget (episodes truncated: a turn cut by the budget, no EOS; a rolled-back
    episode is not), tools/cut_by_limit (episodes whose last turn calls tools after
    --max-tool-calls rounds), tools/turns_per_episode, tools/episodes (how many); under torchrun
    over every rank's episodes (one all_reduce). logp: the engine's sampled log-probs at the
    model's tokens (turn_logps), None with HF generate. Under torchrun every rank calls this
    together: each runs its own episodes (its own tool worker: tools_of is one a process), and
    with HF generate the ranks take their turns in step (an all_reduce a round: the most rows a
    rank continues), so that each makes the same generate calls (FSDP2); the engine gathers the
    weights in the first turn's generate and takes its later turns alone."""
    from .engine import turns as engine_turns

    G, (ids, prompts, n) = n, open_episodes(tok, prompts, n, tools)
    apart = dist_env.world > 1  # torchrun: the ranks' generate calls and collectives agree
    if apart and getattr(tools, "env", None) is not None and G > 1:
        # a rank whose resets differ generates one prompt a row (open_episodes): then every rank
        # does, so that shared-prefill makes as many generate calls on each
        if all_reduce(torch.tensor([n]), dist.ReduceOp.MIN).item() < n:
            prompts, n = [p for p in prompts for _ in range(n)], 1
    first = generate(policy, tok, prompts, n, eos, dist_env, sampling, streamer=streamer,
                     episodes=True)  # the engine keeps each row's KV for its next turns
    B, P, budget = len(first.texts), first.n_prompt, sampling.max_new_tokens
    context = context_of(policy)
    prompt = [row[m.bool()].tolist() for row, m in zip(first.input_ids[:, :P],
                                                         first.attention_mask[:, :P])]
    comp = [row[P:][m.bool()].tolist() for row, m in zip(first.input_ids, first.mask)]
    mask = [[1] * len(c) for c in comp]
    turns = [[t] for t in first.texts]
    wrote = [[True] for _ in comp]  # has the turn a token (no room left in the budget: none)
    # each turn decoded whole, as TRL parses it, after what the template pre-wrote of it
    raws = [[prewritten(tok.decode(p)) + tok.decode(c)] for p, c in zip(prompt, comp)]
    tails = [""] * B  # the last tool turn's pre-written part of the next model turn
    schemas = getattr(tools, "schemas", None)  # the arguments' types
    thinking = (getattr(tools, "template", None) or {}).get("enable_thinking")
    kw = {} if thinking is None else {"enable_thinking": thinking}  # --enable-thinking, as TRL's
    replies = [[] for _ in range(B)]  # each kept tool turn's messages (TRL's completions)
    cut = first.truncated.tolist()
    calls = failures = malformed = rolled = 0
    live = list(range(B))  # rows whose last turn is read for calls
    # torchrun with HF generate: a round ends when every rank's episodes have ended (one
    # all_reduce a round); the engine's later turns run no collective (its weights are taken)
    sync = apart and engine_turns.of(getattr(policy, "lm", None)) is None
    for _ in range(tools.max_calls):  # TRL's max_tool_calling_iterations: rounds, not calls
        nxt = []
        for i in live:
            parsed = parse_calls(raws[i][-1])
            malformed += parsed is None
            if not parsed:
                continue
            results = []  # TRL's parser types the arguments by the tool's schema
            for name, content, failed in tools.calls([(c["name"], typed(c, schemas))
                                                      for c in parsed], ids[i]):
                calls, failures = calls + 1, failures + failed
                results.append({"role": "tool", "name": name, "content": content})
            suffix = tool_suffix_ids(tok, results, **kw)
            if (len(comp[i]) + len(suffix) > budget  # TRL's rollback: the result dropped,
                    or len(prompt[i]) + len(comp[i]) + len(suffix) >= context):
                rolled += 1  # the episode ends with the calling turn (its EOS: not truncated)
                continue
            comp[i], mask[i] = comp[i] + suffix, mask[i] + [0] * len(suffix)
            tails[i] = prewritten(tok.decode(suffix))
            replies[i].append(results)
            nxt.append(i)
        most = (int(all_reduce(torch.tensor([len(nxt)]), dist.ReduceOp.MAX).item()) if sync
                else len(nxt))  # the most rows a rank takes a turn for
        if not most:
            live = []
            break
        room = [budget - len(comp[i]) for i in nxt]
        for i, (new, no_eos, text) in zip(nxt, continue_turns(
                policy, tok, [prompt[i] + comp[i] for i in nxt], room, eos, dist_env, sampling,
                rows=most)):
            comp[i], mask[i] = comp[i] + new, mask[i] + [1] * len(new)
            turns[i].append(text)
            wrote[i].append(len(new) > 0)
            raws[i].append(tails[i] + tok.decode(new))
            cut[i] = no_eos
        live = nxt
    limited = sum(not cut[i] and bool(parse_calls(raws[i][-1])) for i in live)  # rounds spent
    # get_turn_rewards scores the turns the model wrote, the runs of 1s in the mask
    ends = close_episodes(tools, ids, [[t for t, w in zip(ts, ws) if w]
                                       for ts, ws in zip(turns, wrote)])
    T = max(len(c) for c in comp)
    dev = first.input_ids.device
    tail = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in comp], device=dev)
    am = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c in comp], device=dev)
    counts = torch.tensor([B, calls, failures, malformed, rolled, sum(cut), limited,
                           sum(len(t) for t in turns)], dtype=torch.float64)
    if apart:  # the run's episodes, every rank's (rank 0 logs them)
        counts = all_reduce(counts)
    total, calls, failures, malformed, rolled, cuts, limited, said = counts.tolist()
    stats = {"tools/call_frequency": calls / total,
             "tools/failure_frequency": failures / calls if calls else 0.0,
             "tools/malformed_turns": malformed, "tools/rolled_back": rolled,
             "tools/cut_by_budget": cuts, "tools/cut_by_limit": limited,
             "tools/turns_per_episode": said / total, "tools/episodes": total}
    return Rollout(input_ids=torch.cat([first.input_ids[:, :P], tail], 1),
                   attention_mask=torch.cat([first.attention_mask[:, :P], am], 1), n_prompt=P,
                   mask=torch.tensor([m + [0] * (T - len(m)) for m in mask], device=dev,
                                     dtype=torch.float),
                   truncated=torch.tensor(cut, device=dev), texts=["\n".join(t) for t in turns],
                   logp=turn_logps(policy, prompt, comp, T, dev), stats=stats,
                   messages=[conversation(w, t, r, tok.eos_token, schemas)
                             for w, t, r in zip(raws, turns, replies)], **ends)


def context_of(policy) -> float:
    """The model's context, max_position_embeddings (its text_config's for a VLM; inf where the
    config has none): TRL 1.16 also drops a tool result once prompt + completion + tool turn
    reach it."""
    config = getattr(getattr(policy, "lm", policy), "config", None)
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None) or float("inf")


def conversation(raws: list[str], turns: list[str], replies: list[list[dict]], eos: str,
                 tools: list[dict] | None = None) -> list[dict]:
    """An episode as TRL's completions for a tool episode: each model turn's message (parse_turn;
    a malformed turn is its plain text), then its tool messages ({role: tool, name, content})
    where they were kept (not rolled back)."""
    out = []
    for k, (raw, text) in enumerate(zip(raws, turns)):
        out.append(parse_turn(raw, eos, tools) or {"role": "assistant", "content": text})
        out += replies[k] if k < len(replies) else []
    return out


def open_episodes(tok, prompts, n: int, tools: Tools) -> tuple[list, list[str], int]:
    """-> (each episode's instance id, the prompts to generate from, n). prompts: a list of
    templated prompts, or the batch's rows. With an --environment (TRL's environment_factory), each
    of the B = prompts x n episodes gets its own instance in the tool worker, reset(**row) with its
    prompt's row (every column but our templated 'text'); a string it returns is appended to the
    prompt's last message as TRL appends it, and that prompt goes through the chat template again
    (with the tools). The prompts stay one a group (n each) while a group's episodes share one; else
    one a row (n 1)."""
    rows = None if isinstance(prompts, list) else prompts
    texts = list(prompts) if rows is None else list(rows["text"])
    if getattr(tools, "env", None) is None:
        return [None] * (len(texts) * n), texts, n
    if rows is None:
        raise ValueError("an --environment's episodes need the batch's rows (reset(**row))")
    from .data import chat_prompts

    names = list(rows.column_names if hasattr(rows, "column_names") else rows.keys())
    columns = {k: list(rows[k]) for k in names}
    ids, mine = [], []
    for g, text in enumerate(texts):
        row = {k: v[g] for k, v in columns.items()}
        for _ in range(n):
            i, obs = tools.open(row)
            ids.append(i)
            mine.append(text if obs is None else chat_prompts(
                tok, [with_observation(row["prompt"], obs)], tools.template.get("enable_thinking"),
                tools.template.get("system_prompt"), tools=tools.schemas)[0])
    if all(mine[g * n:(g + 1) * n] == [mine[g * n]] * n for g in range(len(texts))):
        return ids, mine[::n], n
    return ids, mine, 1


def with_observation(prompt, obs: str):
    """TRL 1.16's reset: obs appended to the content of the prompt's last message (a text prompt
    is the one user message chat_prompts makes of it; list content gets a text part)."""
    if isinstance(prompt, str):
        return prompt + obs
    content = prompt[-1]["content"]
    if isinstance(content, list):
        obs = [{"type": "text", "text": obs}]
    return list(prompt[:-1]) + [{**prompt[-1], "content": content + obs}]


def close_episodes(tools: Tools, ids: list, turns: list[list[str]]) -> dict:
    """Each episode's scores, its instance then dropped: env_rewards [B] float64 (get_reward, one
    more reward source of weight 1; NaN where it returned None or failed), env_errors [B] (its
    error or None), turn_rewards [B] lists (get_turn_rewards, one float per model turn). A
    get_turn_rewards that fails or gives another count than the episode's turns stops the run in
    one line. {} without an --environment."""
    env = getattr(tools, "env", None)
    if env is None:
        return {}
    values, errors, per_turn = [], [], []
    for i, said in zip(ids, turns):
        if env.reward:
            r, e = tools.score(i, "reward")
            values.append(float("nan") if r is None else r)
            errors.append(e if e is None else f"{env.name}.get_reward: {e}")
        if env.turn_rewards:
            r, e = tools.score(i, "turn_rewards", said)
            if e is not None or len(r) != len(said):
                what = f"failed ({e})" if e is not None else f"gave {len(r)} rewards"
                fail(f"--environment {env.spec!r}: get_turn_rewards {what} for an episode of "
                     f"{len(said)} model turns: give one float per model turn")
            per_turn.append(r)
        tools.close(i)
    return {"env_rewards": torch.tensor(values, dtype=torch.float64) if env.reward else None,
            "env_errors": errors if env.reward else None,
            "turn_rewards": per_turn if env.turn_rewards else None}


_TOOLS = {}  # the run's Tools by its flags: one worker a run, started on the first call


def env_scores(roll: Rollout, tools) -> dict | None:
    """score's given rewards: {the environment class's name: (get_reward values, their errors)}
    for a rollout of an --environment with get_reward (TRL: one more reward of weight 1, logged
    under the class's name); else None. tools: the Tools that made the rollout, or the run's
    flags (tools_of's); the step's and the held-out evaluation's given rewards."""
    if roll.env_rewards is None:
        return None
    tools = tools if isinstance(tools, Tools) else tools_of(tools)
    return {tools.env.name: (roll.env_rewards, roll.env_errors)}


def tools_of(args) -> Tools:
    """The run's Tools for --tools, --environment and --max-tool-calls (made once a process: under
    torchrun each rank has its own worker for its own episodes)."""
    key = (args.tools, args.environment, args.max_tool_calls)
    if key not in _TOOLS:
        _TOOLS[key] = Tools(args.tools, args.max_tool_calls, environment=args.environment,
                            template={"enable_thinking": args.enable_thinking,
                                      "system_prompt": args.system_prompt})
    return _TOOLS[key]
