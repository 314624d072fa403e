"""The length lab's reward (experiments/length_runs.py): the built-in task ('x%10=', answer x) decided by the
completion's first character alone, so that a completion held to L tokens has one token that scores and L - 1 that
only carry importance weights and gradient."""


def first_digit(completion: str, answer: str) -> float:
    return float(completion[:1] == answer)
