"""The episode tasks (docs/lab.md, Tasks that learn), as an --environment and --tools of TRL 1.16's
contract (the tool worker loads this file by path: it imports nothing of the project).

Secret, the built-in task the tiny model learns from scratch on the CPU: every prompt asks the
same of a numbered box; each episode's secret is drawn in reset (one of SYMBOLS), so a group's
episodes hold different ones and only the tool `peek` tells it. The rewards read the episode's
messages (TRL's form; the rows are conversational): answer_reward, 1 when the turn after the
tool's reply begins with the secret the reply told, and reply_credit, CALL_CREDIT for exactly
one call whose reply came back (a call rolled back past the budget earns nothing).

    python grpo.py --model tiny-tools --environment grouprl/tool_task.py:Secret \
        --dataset experiments/data/secret_digit.jsonl --reward grouprl.tool_task:answer_reward \
        --reward grouprl.tool_task:reply_credit --max-tool-calls 1 --max-new-tokens 34 \
        --learning-rate 2e-3 --prompts-per-rank 8 --eval-every 0 --num-steps 80

No policy that does not call scores any answer, and one that calls then guesses scores 1/4 (the
symbols are drawn uniformly): an answer reward well above 1/4 is the copy of the reply. What
makes it learnable (docs/lab.md part 7, the attempts): `--model tiny-tools` holds CALL, the
whole call, as one token and the symbols, <|unk|> and the specials as the rest (V = 9), so a
random-init policy writes a call and ends its turn often; the reply is the secret REPEAT times
(a tenth of the context at the answer's position, for a 2-layer model's attention to find); the
budget of 34 tokens is a 2-token call turn, the 28-token tool turn and at most 4 tokens of answer,
so the answer's token is not one in 25 of its episode's loss; the math grader is not used, as it
reads the turns joined, where 'CALL\n2' is '> 2', not a number.

multiply and products, the real model's task: 3-digit products with a calculator tool.
"""
import json
import random

QUESTION = "Box {}: what is its secret digit?"  # the box number says nothing of the secret
CALL = '<tool_call>{"name": "peek", "arguments": {}}</tool_call>'
PRODUCT = "What is {} * {}? Use the multiply tool, then give the number."  # products' prompt
SYMBOLS = "0123"  # the secrets: a guess is right 1/4 of the time, so a group's guesses vary
REPEAT = 8  # the reply: the secret this many times (a tenth of the context the answer reads)
DRAW = random.Random(0)  # the secrets, one an episode, in the tool worker (one a run)
CALL_CREDIT = 0.3  # reply_credit: one call, its reply back; the right answer scores 1 more


class Secret:
    """A secret digit behind a tool."""

    def reset(self, **row) -> None:
        """Before the episode (TRL: reset(**row)): its own secret, drawn from SYMBOLS (DRAW), so
        that a group's episodes, one prompt's, hold different secrets; nothing of it is appended
        to the prompt."""
        self.secret = DRAW.choice(SYMBOLS)

    def peek(self) -> str:
        """Read the secret digit."""
        return self.secret * REPEAT

    def get_turn_rewards(self, turns: list[str]) -> list[float]:
        """One reward per model turn (gspo_token.py --turn-credit), summing to the episode's
        answer_reward + reply_credit: the call turn CALL_CREDIT where the episode makes one call
        and a turn follows it (its reply came back), the last turn 1 when it has no call and
        begins with the secret, every other turn 0. (A tool turn that fills the budget leaves no
        turn after it: the episode's turns end on its call, credited 0 here, 0.3 by reply_credit.)"""
        last, one = len(turns) - 1, sum(t.count(CALL) for t in turns) == 1
        return [CALL_CREDIT * (one and k < last) if CALL in t
                else float(0 < k == last and first_said(t) == self.secret)
                for k, t in enumerate(turns)]


def first_said(text: str) -> str:
    """A turn's answer: its first character that is not blank."""
    return text.strip()[:1]


def assistant(episode: list[dict]) -> list[dict]:
    """An episode's model messages."""
    return [m for m in episode if m["role"] == "assistant"]


def answer_reward(prompts, completions, **columns) -> list[float]:
    """The answer's reward (TRL's form; --reward grouprl.tool_task:answer_reward): 1 when a tool
    reply came back and the episode's last model message has no call and begins with the secret
    the reply told (first_said), else 0. completions: each episode's messages (TRL's tool loop
    passes them where the prompts are messages)."""
    out = []
    for episode in completions:
        last, told = assistant(episode)[-1], [m["content"] for m in episode if m["role"] == "tool"]
        out.append(float(bool(told) and not last.get("tool_calls")
                         and first_said(last.get("content") or "") == first_said(str(told[0]))))
    return out


def reply_credit(prompts, completions, **columns) -> list[float]:
    """The call's credit (--reward grouprl.tool_task:reply_credit): CALL_CREDIT when the episode
    makes exactly one call and its reply came back (a result past the budget is rolled back: no
    reply, no credit; a call in the answer's turn, past --max-tool-calls, loses it)."""
    return [CALL_CREDIT * (sum(len(m.get("tool_calls") or []) for m in assistant(e)) == 1
                           and sum(m["role"] == "tool" for m in e) == 1) for e in completions]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def products(n: int, seed: int = 0) -> list[dict]:
    """n rows of the real model's task (--tools grouprl/tool_task.py:multiply): a product of two
    3-digit numbers, which SmolLM2-135M-Instruct does not get right unaided."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(100, 1000), rng.randrange(100, 1000)) for _ in range(n)]
    return [{"prompt": PRODUCT.format(a, b), "answer": str(a * b)} for a, b in pairs]


def rows(n: int) -> list[dict]:
    """n rows {"prompt": [the user's QUESTION of box i], "answer": SYMBOLS}: the secret is drawn
    per episode (Secret.reset) and the rewards read it from the tool's reply; the answer column,
    which every row of a --dataset needs, names the symbols it is drawn from."""
    return [{"prompt": [{"role": "user", "content": QUESTION.format(i)}], "answer": SYMBOLS}
            for i in range(n)]


if __name__ == "__main__":  # the committed rows: experiments/data/{secret_digit,products}.jsonl
    import os
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join("experiments", "data")
    for name, made in (("secret_digit", rows(512)), ("products", products(256))):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in made))
