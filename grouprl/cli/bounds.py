"""A flag's value in its range, refused in one line naming the range (check_float, check_int):
the helpers every check of checks.py and rollout_checks.py is written with.
"""

from __future__ import annotations

import math

from ..distributed import fail


def check_float(flag: str, x: float, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, why: str = ""):
    """--flag x is finite and lies in [low, high] (each end open if asked); written so that NaN
    fails every comparison and is refused with the rest."""
    ok = (math.isfinite(x) and (x > low if low_open else x >= low)
          and (x < high if high_open else x <= high))
    if not ok:
        if high == math.inf:
            rule = f"be {'>' if low_open else '>='} {low:g} and finite"
        else:
            rule = (f"lie in {'(' if low_open else '['}{low:g}, {high:g}"
                    f"{')' if high_open else ']'}")
        fail(f"--{flag} {x}: must {rule}{why}")


def check_int(flag: str, n: int, low: int, high: int | None = None, why: str = ""):
    """--flag n lies in [low, high] (no upper bound if high is None)."""
    if not (n >= low and (high is None or n <= high)):
        rule = f"be >= {low}" if high is None else f"lie in [{low}, {high}]"
        fail(f"--{flag} {n}: must {rule}{why}")
