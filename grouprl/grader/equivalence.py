"""Answer equivalence without math-verify: one canonical spelling of an answer (normalize_answer),
its exact value (parse_number, stated_number, canonical), and the fast decision (decide) that
settles most pairs in the trainer's process; what it cannot settle goes to math-verify in a worker
(pool.py).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BRACE = re.compile(r"[{}]")


def _closing_brace(text: str, start: int) -> int | None:
    """Where the } that closes the brace opened just before start is; None when none does."""
    depth = 1
    for m in _BRACE.finditer(text, start):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


_TEXT_CMD = r"\\(?:text|textbf|textrm|textit|textnormal|mbox|mathrm|mathbf|operatorname)\s*"
_UNIT = re.compile(r"(?<=\S)\s*" + _TEXT_CMD
                   + r"\{\s*[A-Za-z][A-Za-z\s./^\d]*\}(?:\s*\^\s*\{?[23]\}?)?$")
# Units after a number, written without \\text: SI and common ones, glued to the number or not
# (12cm, 5 kg, 50 km/h, 9.8 m/s^2, 100 m^2); a one-letter unit only after a space (100 m, 3 h), as
# 5m or 3h may be a product with a variable. The number alone is the answer.
_UNIT_WORD = (r"(?:[kcmnµμ]m|\\mu\s*m|[km]g|lbs?|oz|m[lL]|gal|qt|ms|sec|min|hrs?|ft|yd|mi|mph|kph"
              r"|[kMG]?Hz|k[NJW]|kWh|mA|k?Pa|atm|mol|eV|k?cal)")
_UNIT_LETTER = r"(?:[mgshLNJWVK]|in)"
# letters glued after a number, unless a unit: '4b' is a name, '3x' a product, '12cm' or '5m²' a unit
_LETTERS_AFTER = re.compile(r"(?!(?:" + _UNIT_WORD + "|" + _UNIT_LETTER + r"(?=\s*[²³^]))"
                            r"(?![A-Za-z]))[A-Za-z]")
_POWER = r"(?:\^\s*\{?\s*[23]\s*\}?|[²³])?"
_NUMBER_UNIT = re.compile(r"([-+]?[\d.,/]*\d)(?:\s*" + _UNIT_WORD + r"|\s+" + _UNIT_LETTER
                          + ")" + _POWER + r"(?:\s*/\s*(?:" + _UNIT_WORD + "|" + _UNIT_LETTER + ")"
                          + _POWER + r")?\.?")
# currency signs before or after a number ($ and \\$ go with the other dollars)
_CURRENCY = re.compile(r"^(?:[€£¥₹]|\\(?:euro|pounds|yen|textdollar|textsterling)"
                       r"(?![A-Za-z]))\s*|(?<=\d)\s*(?:[€¢]|\\euro(?![A-Za-z]))$")
_WORDS_AFTER_NUMBER = re.compile(r"([-+]?[\d.,/]*\d)\s+([A-Za-z]{2,}(?:\s+[A-Za-z]+)*)\.?")
_WORD = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")
# a longer extracted answer is not graded: it scores 0 and counts as a reward error
MAX_ANSWER_CHARS = 1000


def normalize_answer(s: str) -> tuple[str, bool]:
    """An answer in one canonical spelling, and whether it carried a percent sign: \\dfrac, \\tfrac
    and \\cfrac become \\frac, the Unicode minus -, \\sqrt3 and \\frac12 get their braces;
    \\left/\\right, spacing commands, $, \\$ and the other currency signs (€5, 5€, £20), degrees
    (^\\circ, °, with a C or F after them), %, a trailing unit (\\text{ cm}, an SI or common unit:
    12cm, 50 km/h, 9.8 m/s^2, 100 m; or words after a number: '18.90 dollars', but 'percent' is a %
    and 'pi' is \\pi), a \\boxed{} or \\text{...} around the whole answer, a leading + and a final
    period go; 1{,}000 is 1,000; spaces go except between two letters. Pure text."""
    s = s.strip().replace("−", "-")  # the Unicode minus sign
    boxed = re.fullmatch(r"\\boxed\s*\{(.*)\}", s, re.S)  # a reference written boxed
    if boxed and _closing_brace(s, s.index("{") + 1) == len(s) - 1:
        s = boxed.group(1).strip()
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = re.sub(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle", "", s)
    s = s.replace("{,}", ",").replace("\\$", "").replace("$", "")
    s = re.sub(r"(?<!\\)\\[,!;: ]|~|\\q?quad(?![a-zA-Z])", " ", s)  # not the \\ of a new row
    # degrees, Celsius and Fahrenheit: -5.5°C, 20^{\\circ}\\text{F}
    s = re.sub(r"(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree)\s*"
               r"(?:\\(?:text|mathrm)\s*\{\s*[CF]\s*\}|[CF](?![A-Za-z]))?", "", s)
    s = _CURRENCY.sub("", s)
    percent = "%" in s
    s = re.sub(r"\\?%", "", s).strip()
    s = _UNIT.sub("", s).strip()
    whole = re.fullmatch(_TEXT_CMD + r"\{([^{}]*)\}", s)
    if whole:
        s = whole.group(1).strip()
    unit = _NUMBER_UNIT.fullmatch(s)
    if unit:
        s = unit.group(1)
    after = _WORDS_AFTER_NUMBER.fullmatch(s)
    if after and after.group(2).lower() == "pi":  # '2 pi' is a number times pi, not a unit
        s = after.group(1) + "\\pi"
    elif after:
        percent = percent or after.group(2).lower() in ("percent", "per cent")
        s = after.group(1)
    s = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\s+", " ", s).rstrip(".").strip()
    # the word: compared as text, 'infinity' never equals \\infty
    s = re.sub(r"^([-+]?)(?:infinity|inf|∞)$", r"\1\\infty", s, flags=re.I)
    s = re.sub(r"^\+(?=[\d.\\])", "", s)
    # "x + 1" -> "x+1"; "\pi r" keeps its space
    s = re.sub(r"(?<=[^A-Za-z]) | (?=[^A-Za-z])", "", s)
    choice = re.fullmatch(r"\(([A-Za-z])\)", s)  # multiple choice: (C) is C
    return (choice.group(1) if choice else s), percent


def parse_number(s: str) -> Fraction | None:
    """The exact value of a number as answers write it (after normalize_answer): integers, decimals,
    thousands separators, a/b, \\frac{a}{b}, a sign, and a decimal times a power of ten (1.5 \\times
    10^{3}, \\cdot for \\times); None when s is not one number."""
    s = normalize_answer(s)[0]
    if len(s) > 100:  # past Python's digit limits, and no answer worth an exact comparison
        return None
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.,]+)\}\{(-?[\d.,]+)\}", s)
    sci = _SCIENTIFIC.fullmatch(s)
    try:
        if m:
            v = Fraction(m.group(2).replace(",", "")) / Fraction(m.group(3).replace(",", ""))
            return -v if m.group(1) else v
        if sci:
            return Fraction(sci.group(1)) * Fraction(10) ** int(sci.group(2) or sci.group(3))
        if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
            s = s.replace(",", "")
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+)?", s):
            num, _, den = s.partition("/")
            return Fraction(num) / (Fraction(den) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return None


# a decimal times a power of ten, as normalize_answer leaves it: 1.5\times10^{3}, 2\cdot10^-4
_SCIENTIFIC = re.compile(r"(-?\d+(?:\.\d+)?)(?:\\times|\\cdot|×|·)10\^(?:\{(-?\d{1,3})\}|(-?\d))")
# a fraction: its numerator and denominator as written
_FRACTION = re.compile(r"-?(?:\\frac\{([^{}]*)\}\{([^{}]*)\}|([^/]*)/([^/]*))")
# the last side of an equation or an approximation: x = 5, 62 + 43 = 105, x \approx 7.78
_LAST_SIDE = re.compile(r"(?:(?<![<>!])=|\\approx(?![A-Za-z])|≈)((?:(?!\\approx)[^=≈])*)$")


def _written_out(s: str) -> bool:
    """Whether the number s (normalised, parse_number reads it) is written out rather than left to
    compute: a fraction only with whole numerator and denominator and not equal to a whole number
    (6/8 is 3/4 written out, 210/2 is a division), a power of ten only in scientific notation (a
    first factor from 1 to 10); integers, decimals, thousands are."""
    frac = _FRACTION.fullmatch(s)
    if frac:
        num, den = frac.group(1) or frac.group(3), frac.group(2) or frac.group(4)
        whole = re.compile(r"-?\d+")
        return bool(whole.fullmatch(num) and whole.fullmatch(den)) and int(num) % int(den) != 0
    sci = _SCIENTIFIC.fullmatch(s)
    return sci is None or 1 <= abs(Fraction(sci.group(1))) < 10


def stated_number(answer: str) -> frozenset:
    """The values an answer states as a number written out (_written_out), alone, in one pair of
    brackets, or as the last side of an equation or an approximation (x = 5, 62 + 43 = 105,
    k \\approx 7.78), with its unit, percent sign or currency; none when the answer is an expression
    a grader would have to compute (62+43, 7*15, \\sqrt{16}, 210/2, 10^3). What equals a numeric
    reference (decide): a policy that echoes the question's expression scores 0 (issue 38)."""
    last = _LAST_SIDE.search(answer)
    text, percent = normalize_answer(last.group(1) if last else answer)
    inner = re.fullmatch(r"\(([^,]*)\)|\{([^,]*)\}|\[([^,]*)\]", text)  # not (1,300): a pair
    side = next(g for g in inner.groups() if g is not None) if inner else text
    v = parse_number(side)
    if v is None or not _written_out(normalize_answer(side)[0]):
        return frozenset()
    return frozenset({v, v / 100}) if percent else frozenset({v})


def canonical(answer: str) -> tuple[str, frozenset, frozenset]:
    """(normalised text, the exact values it may mean, the values it states as a number written
    out): one value for a number, two for a percentage (5% is 5, as answers are often written, and
    0.05), none for anything else; stated_number's for the third. Computed once per distinct
    answer."""
    text, percent = normalize_answer(answer)
    v = parse_number(text)
    values = frozenset() if v is None else frozenset({v, v / 100}) if percent else frozenset({v})
    return text, values, stated_number(answer)


def decide(pred: tuple[str, frozenset, frozenset], gold: tuple[str, frozenset, frozenset]
           ) -> float | None:
    """The fast path: 1.0 or 0.0 where canonical forms settle it (equal text, a numeric reference,
    or plain words, compared without case), None where a symbolic comparison must decide
    (math-verify, in the grading worker). A numeric reference is equalled only by a number the
    answer writes out (stated_number): never by an expression that computes it, '62 + 43' for 105,
    which math-verify would evaluate. Numbers compare exactly (0.33 is not 1/3), except against a
    reference of 6 or more decimals, which the answer rounded to as many decimals must give."""
    if pred[0] == gold[0] and pred[0]:
        return 1.0
    if gold[1]:
        # a reference written with 6 or more decimals is a rounded value: 2/3 is right for 0.6666667
        places = re.fullmatch(r"-?\d*\.(\d{6,})%?", gold[0])
        k = len(places.group(1)) if places else None
        return float(bool(pred[2] & gold[1]) or k is not None
                     and any(round(p, k) == g for p in pred[2] for g in gold[1]))
    # text answers; math-verify would read a word as a product of symbols, so 'Evenly' would equal
    # 'Evelyn'
    if _WORD.fullmatch(pred[0]) or _WORD.fullmatch(gold[0]):
        return float(pred[0].lower() == gold[0].lower())
    if not pred[0] or not gold[0]:
        return 0.0
    return None
