"""The episode tasks (docs/lab.md, Tasks that learn), as an --environment and --tools of TRL 1.16's
contract (the tool worker loads this file by path: it imports nothing of the project).

Secret, the built-in task the tiny model learns from scratch on the CPU: every prompt asks the
same of a numbered box, each row's answer is the box's secret digit, and only the tool `peek`
tells it.

    python grpo.py --model tiny-tools --environment grouprl/tool_task.py:Secret \
        --dataset experiments/data/secret_digit.jsonl --max-tool-calls 2 --max-new-tokens 30 \
        --learning-rate 1e-3 --prompts-per-rank 8 --eval-every 0 --num-steps 34

(--learning-rate: the scripts' default is the tiny models' 5e-4 for `tiny` and `tiny-moe` only.)

The box's number is drawn apart from its digit, so without the call no policy scores above the
commonest digit's share (~0.1) on boxes it has not seen; with it, the model reads the digit in
the tool's reply and writes it. The answer's reward is the default one (the math grader on the
episode's turns, against the row's answer, the secret); get_reward is the call's own credit,
CALL_CREDIT (TRL's environment sees its calls, not the model's text). `--model tiny-tools` holds
CALL, the whole call of `peek`, as one token (modeling.tiny_tokenizer): a random-init policy
writes it, then its turn's end, with probability ~1/V^2 a position, where the call's 56
characters it would never write.

multiply and products, the real model's task: 3-digit products with a calculator tool.
"""
import json
import random

QUESTION = "Box {}: what is its secret digit?"  # the box number says nothing of the digit
CALL = '<tool_call>{"name": "peek", "arguments": {}}</tool_call>'
PRODUCT = "What is {} * {}? Use the multiply tool, then give the number."  # products' prompt
CALL_CREDIT = 0.3  # get_reward: an episode that called peek; the right answer scores 1 more


class Secret:
    """A secret digit behind a tool."""

    def reset(self, answer: str, **row) -> None:
        """Before the episode (TRL: reset(**row)): the row's answer is the secret; nothing of it
        is appended to the prompt."""
        self.secret, self.peeks = str(answer).strip(), 0

    def peek(self) -> str:
        """Read the secret digit."""
        self.peeks += 1
        return self.secret

    def get_reward(self) -> float:
        """TRL's one more reward, weight 1: the call's credit for one peek (the answer is the
        grader's); a second peek loses it, or a policy that calls in every turn keeps it."""
        return CALL_CREDIT * (self.peeks == 1)

    def get_turn_rewards(self, turns: list[str]) -> list[float]:
        """One reward per model turn (gspo_token.py --turn-credit): the call turn its credit, the
        turn that writes the secret 1."""
        return [CALL_CREDIT if CALL in t else float(t.strip() == self.secret) for t in turns]


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


def rows(n: int, seed: int = 0) -> list[dict]:
    """n rows {"prompt": QUESTION of box i, "answer": a digit drawn uniformly}."""
    rng = random.Random(seed)
    return [{"prompt": QUESTION.format(i), "answer": str(rng.randrange(10))} for i in range(n)]


if __name__ == "__main__":  # the committed rows: experiments/data/{secret_digit,products}.jsonl
    import os
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join("experiments", "data")
    for name, made in (("secret_digit", rows(512)), ("products", products(256))):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in made))
