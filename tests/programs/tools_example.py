"""Tools for --tools (grouprl/episodes.py), the example the docs name: plain functions, typed and
documented, from which transformers' get_json_schema makes each schema. `python gspo.py --tools
tests/programs/tools_example.py:multiply --max-tool-calls 2`. The rest misbehave on purpose, for
tests/test_episodes.py: a hang, an exception, a crash of the process, a flood of output."""
import os
import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def hang(seconds: float) -> str:
    """Sleep, longer than any time bound.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def boom(message: str) -> str:
    """Raise.

    Args:
        message: the exception's message
    """
    raise RuntimeError(message)


def die(code: int) -> str:
    """End the process at once.

    Args:
        code: its exit code
    """
    os._exit(code)


def flood(megabytes: int) -> str:
    """Return a huge string.

    Args:
        megabytes: its size in MB
    """
    return "x" * (megabytes << 20)
