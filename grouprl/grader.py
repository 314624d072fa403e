"""The math grader (answer extraction, normalisation, exact decisions, math-verify) and the worker
processes that run it and users' --reward functions under a time bound. Called by rewards.score.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import sys
import threading
import time
from fractions import Fraction

from .distributed import fail
from .reward_worker import make_math_verify, probe, reward_form  # noqa: F401 - reward_form: API


# -------------------- the math grader: answers read where models write them
# Numbers as answers write them: -12, 3.5, .5, 3/4, and thousands in groups of three (1,234). A
# comma that three digits do not follow ends the number, so "the answer is 72, in total" gives 72.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUM_RE = re.compile(_NUM)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_BRACE = re.compile(r"[{}]")
_SPACE = re.compile(r"\s*")
# Math spans: $$..$$, \[..\] and \(..\) may run over lines; $..$ may not, and its closing $ is not
# followed by a digit, so that the currency in "$5 and $6" is no span.
_MATH_OPEN = re.compile(r"\$\$|\\\[|\\\(|(?<!\\)\$")
_MATH_CLOSE = {"$$": re.compile(r"\$\$"), "\\[": re.compile(r"\\\]"), "\\(": re.compile(r"\\\)"),
               "$": re.compile(r"\n|(?<!\\)\$(?!\d)")}
# three words in a row: prose, not math
_PROSE_RUN = re.compile(r"(?<![\\A-Za-z{])[A-Za-z]{2,}(?:[ ,.:;]+[A-Za-z]{2,}\b){2}")
# What may stand between the items of one list of answers: "\boxed{2}, \boxed{3}", "$-2$ and $1$",
# "\boxed{1} \quad \text{or} \quad \boxed{4}". Words other than 'and'/'or' end the list.
_GLUE = re.compile(r"(?:\s|[,;&$]|\\[,;:! ]|\\q?quad(?![A-Za-z])|\\\\|\\[\[\]()]|and|or"
                   r"|\\(?:text|mbox|textrm|mathrm)\s*\{\s*(?:and|or|,)?\s*\})*")
# The final answer sentence begins after the last "answer is", "answers are", "answer:", "final
# answer is", or a "Final Answer" heading that ends its line.
_MARKER = re.compile(r"(?i)\b(?:(?:final\s+)?answers?[ \t]*\**[ \t]*(?:(?:is|are|was|would be|"
                     r"should be|will be)\b[ \t]*:?|[:=])|final\s+answer[ \t]*\**[ \t]*(?=\n))")
# it ends at a newline or at . ! ? before a space (not inside a math span)
_SENTENCE_END = re.compile(r"\n|[.!?](?=\s|\*|$)")
# A number belongs to an expression, and is never the answer, when an operator, ^, _, { or a LaTeX
# command touches it: the 2 of 2\pi, x^2, 1+\sqrt{5}, \sqrt 5, 2x+1 or 48+24 (not the 72 of
# "= 72", a degree 45^\circ, a percent 5\%, or a unit 5\text{ cm}).
# A * is a product, ** markdown's bold: "**42**".
_RELATION = r"approx|equiv|quad|qquad|text|textbf|mbox|mathrm"
_BEFORE_EXPR = re.compile(r"(?:[-+/^_{<>×·÷≤≥≠]|(?<!\*)\*|\\(?!(?:" + _RELATION
                          + r")(?![A-Za-z]))"
                          r"[A-Za-z]+)\s*$")
_AFTER_EXPR = re.compile(r"\s*(?:[-+/_{<>×·÷≤≥≠]|\*(?!\*)|\^(?!\s*\{?\s*\\circ)"
                         r"|\\(?!(?:" + _RELATION + r"|circ|degree)(?![A-Za-z]))[A-Za-z])"
                         r"|\(|[A-Za-z]\s*[-+*/^_(]")
_PERCENT = re.compile(r"(?:\s*(?:\\?%|percent\b|per cent\b))?")
# the most answers one list holds: a longer run of boxes or numbers is cut to its last ones
MAX_LIST = 50
# the longest answer read as text: after a marker ("The answer is (C).", "the answer is
# \frac{1}{2}" without $), or math without delimiters ending a completion
_MAX_REMAINDER = 200
# a word of prose (2 letters or more, a function name excepted), and what makes text math
_PROSE = re.compile(r"(?<![\\A-Za-z0-9])(?!(?:sqrt|sin|cos|tan|cot|sec|csc|log|ln|exp|mod|gcd|lcm"
                    r"|max|min)(?![A-Za-z]))[A-Za-z]{2,}")
_OPERATOR = re.compile(r"\\(?!(?:text|textbf|textrm|textit|mbox|mathrm|quad|qquad)(?![A-Za-z]))"
                       r"[A-Za-z]+|[-+*/^=<>≤≥]")


def math_spans(text: str) -> list[tuple[int, int, int, int]]:
    """Each math span of text, in order: (start, end, content start, content end), the span from its
    opening to after its closing delimiter. A $ that no $ closes on its line, or whose $...$ would
    hold a run of prose ("$10,455. The final answer is $"), is a dollar sign."""
    spans, pos, unclosed = [], 0, set()  # delimiters that nothing after pos closes: linear time
    while (m := _MATH_OPEN.search(text, pos)) is not None:
        kind = m.group()
        close = None if kind in unclosed else _MATH_CLOSE[kind].search(text, m.end())
        if close is None:
            unclosed.add(kind)
        if close is None or close.group() == "\n":  # a $ whose line closes none: the next line
            pos = close.start() if close is not None else m.end()
            continue
        if kind == "$" and _prose(text, m.end(), close.start()):
            pos = m.end()
            continue
        spans.append((m.start(), close.end(), m.end(), close.start()))
        pos = close.end()
    return spans


def _outside_braces(text: str, lo: int, matches):
    """The matches (in order, from lo on) that no brace opened after lo encloses."""
    depth, pos = 0, lo
    for w in matches:
        depth += text.count("{", pos, w.start()) - text.count("}", pos, w.start())
        pos = w.start()
        if depth <= 0:
            yield w


def _prose(text: str, lo: int, hi: int) -> bool:
    """Whether text[lo:hi] holds three words in a row outside braces (\\text{...} excepted)."""
    return next(_outside_braces(text, lo, _PROSE_RUN.finditer(text, lo, hi)), None) is not None


def _closing_brace(text: str, start: int) -> int | None:
    """Where the } that closes the brace opened just before start is; None when none does."""
    depth = 1
    for m in _BRACE.finditer(text, start):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return None


def _glued(text: str, end: int, start: int) -> bool:
    """Whether only list glue (commas, 'and', 'or', spacing, $) lies between two answers."""
    return end <= start and _GLUE.fullmatch(text, end, start) is not None


def _boxes(text: str) -> list[tuple[int, int, int, int]] | None:
    """The last \\boxed{...} (or \\fbox, or a brace-less `\\boxed 5`) with the boxes glued before
    it, as (start, end, content start, content end) each; [] when the last box is unclosed (no
    answer), None when there is no box."""
    boxes = list(_BOX.finditer(text))
    out = []
    for b in reversed(boxes):
        if b.group(1) is None:
            m = re.compile(r"\s*([^\s$]+)").match(text, b.end())
            piece = (b.start(), m.end(1), m.start(1), m.end(1)) if m else None
        else:
            close = _closing_brace(text, b.end())
            piece = (b.start(), close + 1, b.end(), close) if close is not None else None
        if not out and piece is None:
            return []  # an unclosed last box: the completion was cut inside its answer
        if out and (piece is None or not _glued(text, piece[1], out[-1][0])):
            break  # a box that no glue joins to the next one: the list starts after it
        if len(out) == MAX_LIST:
            break
        out.append(piece)
    return out[::-1] if boxes else None


def _standalone(text: str, m: re.Match, spans: list, braces: int) -> bool:
    """Whether the number m stands alone: outside math spans and braces (braces: how many are open
    where it starts), and touching no operator or LaTeX command (_BEFORE_EXPR, _AFTER_EXPR). A minus
    sign after a digit or a letter is binary."""
    s, e = m.span()
    k = bisect.bisect_right(spans, (s, len(text) + 1)) - 1
    if braces > 0 or k >= 0 and spans[k][1] > s:
        return False
    before = text[max(0, s - 40):s]
    if _BEFORE_EXPR.search(before):
        return False
    if m.group().startswith("-") and re.search(r"[\w)}\]]\s*$", before):
        return False
    if before[-1:].isalpha():  # part of a word or a name: K2, x2
        return False
    # a name or a product: room 4b, 3x (not a unit: 12cm); but a completion that is nothing but
    # a number and letters is read as the number cut off (the built-in task's '7a' at
    # --max-new-tokens 2: the digit, then the first letter of whatever followed)
    if _LETTERS_AFTER.match(text, e) and not (
            not text[:s].strip() and re.fullmatch(r"[A-Za-z]+\s*", text[e:])):
        return False
    return _AFTER_EXPR.match(text, e, min(len(text), e + 40)) is None


def _items(text: str, lo: int, hi: int, spans: list, variables: bool) -> list[tuple]:
    """The last answer-like item of text[lo:hi] (a math span, or a standalone number) with the items
    glued before it, as (start, end, content start, content end) each. variables: whether a span of
    letters alone ($n$, $AB$) counts; in running text it names a variable, not an answer."""
    cands = [sp for sp in spans if lo <= sp[0] and sp[1] <= hi
             and (variables or not re.fullmatch(r"\s*[A-Za-z]{1,3}\s*", text[sp[2]:sp[3]]))]
    nums = list(_NUM_RE.finditer(text, lo, hi))
    out, j = [], len(cands) - 1
    braces, at = text.count("{", 0, hi) - text.count("}", 0, hi), hi  # braces open at `at`
    for m in [*reversed(nums), None]:
        # the spans that end after this number come first, latest first
        while j >= 0 and (m is None or cands[j][0] >= m.end()):
            if out and not _glued(text, cands[j][1], out[-1][0]) or len(out) == MAX_LIST:
                return out[::-1]
            out.append(cands[j])
            j -= 1
        if m is None:
            break
        braces -= text.count("{", m.start(), at) - text.count("}", m.start(), at)
        at = m.start()
        if not _standalone(text, m, spans, braces):
            continue
        end = _PERCENT.match(text, m.end()).end()  # its percent sign: "33.5 percent", "20\\%"
        if out and not _glued(text, end, out[-1][0]) or len(out) == MAX_LIST:
            return out[::-1]
        out.append((m.start(), end, m.start(), end))
    return out[::-1]


def _sentence(text: str, marker: re.Match, spans: list, boxed: bool) -> list[tuple]:
    """The answer of the final answer sentence that marker begins: its last math span or standalone
    number, with the items glued before it; else, with no box in the completion, the sentence's
    text after the marker ("The answer is (C).", "the answer is \\frac{1}{2}" without $)."""
    lo = marker.end()
    pos = _SPACE.match(text, lo).end()
    k = bisect.bisect_left(spans, (pos,))
    while True:  # the sentence's end, outside math spans
        end = _SENTENCE_END.search(text, pos)
        hi = end.start() if end else len(text)
        if k < len(spans) and spans[k][0] < hi:
            pos, k = max(pos, spans[k][1]), k + 1
            continue
        break
    found = _items(text, lo, hi, spans, variables=True)
    rest = text[lo:hi].strip().strip("*").strip()
    if found or boxed or not rest or len(rest) > _MAX_REMAINDER:
        return found
    s = text.index(rest, lo)
    return [(s, s + len(rest), s, s + len(rest))]


def _bare_math(text: str, spans: list) -> list[tuple]:
    """The end of the completion's last line when it is math written without delimiters: what
    follows its last word of prose, when that holds an operator or a LaTeX command ('x<2',
    '(-\\infty,-8)\\cup (8,\\infty)', 'so x = 1 + \\sqrt 5'); [] otherwise."""
    end = len(text.rstrip().rstrip(".*").rstrip())
    start = text.rfind("\n", 0, end) + 1
    k = bisect.bisect_left(spans, (start,))
    if k < len(spans) or (k > 0 and spans[k - 1][1] > start):
        return []  # a math span on the line: its items say
    # its words of prose: not those inside \text{...}, nor a unit after a number ('50 km/h')
    words = [w for w in _outside_braces(text, start, _PROSE.finditer(text, start, end))
             if not _unit_after_number(text, start, w)]
    start = words[-1].end() if words else start
    tail = text[start:end].strip(" \t:,")
    if (not tail or len(tail) > _MAX_REMAINDER or _NUM_RE.fullmatch(tail)
            or not _OPERATOR.search(tail)):
        return []
    s = text.index(tail, start)
    return [(s, s + len(tail), s, s + len(tail))]


def _unit_after_number(text: str, lo: int, word: re.Match) -> bool:
    """Whether word is a unit (_UNIT_WORD) written after a number: the cm of '12 cm', '12cm'."""
    return (re.fullmatch(_UNIT_WORD, word.group()) is not None
            and re.search(r"\d\s*$", text[lo:word.start()]) is not None)


def _final_answer(text: str) -> list[tuple[int, int, int, int]]:
    """The final answer's pieces, (start, end, content start, content end) each ([] when there is
    none). The last of these statements of it in the completion: the last \\boxed{} (with the boxes
    glued before it: a list), the final answer sentence (_sentence; after the last box only when it
    holds a math span or a number) and '####' (optionally with a colon: the number after it, else
    the rest of its line). Without one: the last math span or standalone number of the completion
    (with the items glued before it) when it is a math span that ends the completion, else the
    completion's last line when it is math without delimiters (_bare_math: 'x=2' rather than its 2),
    else that last math span or number. A completion with an <answer> tag (the R1-Zero template,
    '<think>...</think><answer>5</answer>') answers inside its last one (_tagged)."""
    tagged = _tagged(text)
    if tagged is not None:
        return tagged
    box = _boxes(text)
    if box == []:
        return []  # an unclosed last box: cut inside its answer
    spans = math_spans(text)
    after = box[-1][1] if box else 0
    said = []  # (where the statement starts, its pieces)
    if box:
        k = bisect.bisect_right(spans, (box[-1][0], len(text) + 1)) - 1
        if k >= 0 and spans[k][1] >= box[-1][1]:  # a box in a math span ends with it: $\\boxed{5}$
            box[-1] = (box[-1][0], spans[k][1], box[-1][2], box[-1][3])
        said.append((box[0][0], box))
    marker = None
    for marker in _MARKER.finditer(text, after):
        pass
    if marker is not None and (found := _sentence(text, marker, spans, box is not None)):
        said.append((marker.start(), found))
    hashes = text.rfind("####", after)
    if hashes >= 0:
        glued = "(?!" + _LETTERS_AFTER.pattern + ")"  # '#### 4b' states no number
        m = (re.compile(r"\s*:?\s*(" + _NUM + ")" + glued).match(text, hashes + 4)
             or re.compile(r"\s*:?\s*(\S[^\n]*)").match(text, hashes + 4))
        said.append((hashes, [(hashes, m.end(1), m.start(1), m.end(1))] if m else []))
    if said:
        return max(said, key=lambda x: x[0])[1]
    found = _items(text, 0, len(text), spans, variables=False)
    span_last = found and found[-1][2] > found[-1][0]  # a span's contents start after its $
    if span_last and not text[found[-1][1]:].strip(" \t\n.,;:!*"):
        return found  # a math span ends the completion
    return _bare_math(text, spans) or found


def _tagged(text: str) -> list[tuple[int, int, int, int]] | None:
    """The final answer of the completion's last <answer> tag: its contents read as a completion
    (_final_answer: boxed or not, a sentence, a number), else, with nothing found there, its text
    (a word, '(C)'); the first piece starts at <answer>, the last ends after </answer> (at the end
    of the completion when no </answer> closes it). None when there is no <answer>."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    lo = start + len("<answer>")
    close = text.find("</answer>", lo)
    hi, end = (close, close + len("</answer>")) if close >= 0 else (len(text), len(text))
    inner = text[lo:hi]
    pieces = _final_answer(inner)
    rest = inner.strip()
    if not pieces and rest and len(rest) <= _MAX_REMAINDER and "\\boxed" not in rest:
        s = inner.index(rest)
        pieces = [(s, s + len(rest), s, s + len(rest))]
    pieces = [(a + lo, b + lo, c + lo, d + lo) for a, b, c, d in pieces]
    if pieces:
        pieces[0] = (start, *pieces[0][1:])
        pieces[-1] = (pieces[-1][0], end, *pieces[-1][2:])
    return pieces


def answer_span(text: str) -> tuple[int, int] | None:
    """Where the final answer (_final_answer) lies in text, as (start, end) character offsets: from
    its first piece's start (\\boxed, the opening $, '####', the number) to after its last piece:
    after the } that closes a box (or the $ that closes the math span holding it), the closing $ of
    a math span, the last digit of a number. What follows end is written after the answer."""
    pieces = _final_answer(text)
    return (pieces[0][0], pieces[-1][1]) if pieces else None


def extract_answer(text: str) -> str | None:
    """The final answer (_final_answer), as text: one piece's contents, or a list of several
    distinct ones as a set, '\\{2, 3\\}', which equals a reference only when it holds the same
    values: '\\boxed{-2} and \\boxed{1}' is right for '1,-2' and wrong for '1', so listing guesses
    never scores. Repeats count once: '\\boxed{4}, \\boxed{4}' is 4. None when there is no
    answer."""
    pieces = _final_answer(text)
    if not pieces:
        return None
    seen = {}
    for p in pieces:
        s = text[p[2]:p[3]].strip()
        seen.setdefault(normalize_answer(s)[0], s)
    return next(iter(seen.values())) if len(seen) == 1 else "\\{" + ", ".join(seen.values()) + "\\}"


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


# Grading runs math-verify (LaTeX parsed by an ANTLR grammar into sympy, never eval) and users'
# reward functions in worker processes (GRADING_WORKERS), each answering one request at a time, with
# a hard time bound: a request not answered within the bound kills its worker and scores 0,
# counted as a reward error. Not math-verify's own timeout: it uses signal.alarm, which raises
# ValueError off the main thread, has a resolution of whole seconds, replaces the process's SIGALRM
# handler, and cannot interrupt a long call into C (a huge integer power); a separate process can
# always be killed, and bounds memory too (RLIMIT_AS for the math grader).
# The math grader's bound counts the worker's CPU seconds (Linux /proc), not the wall clock: on a
# busy machine a request waits for a core without using its bound, so a correct answer is never
# scored 0 because other processes ran (benchmarks/grading.py --busy). A killed worker is replaced
# at once, in the background: the next requests go to the workers that are ready, never to one
# still importing math-verify.
# Each worker is a process of its own, running reward_worker.py (its protocol, its life and death
# with the trainer); inside a --reward worker whose function calls common.math_reward,
# math-verify grades in that process (in_process_math) instead of starting workers of its own
# within the reward's time bound.

# worker processes per Reward (per rank): math-verify's parser is pure Python, one core each
GRADING_WORKERS = 2
# seconds a worker may take to start (importing math-verify or the user's module)
START_TIMEOUT_S = 120.0
# a --reward module's import, in a worker before the run (_probe_in_worker): past this it hangs
IMPORT_TIMEOUT_S = 60.0
# the math grader's bound is in CPU seconds; a request past this many times it in wall seconds
# (a worker that makes no progress) is stopped too
WALL_FACTOR = 30.0
# set in a --reward worker's environment: the math grader grades in that process (in_process_math)
IN_WORKER_ENV = "GRADER_IN_REWARD_WORKER"
_IN_PROCESS = []  # math-verify of this process, made once (in_process_math)
# the worker's program, beside this file: run as a file, it finds the project wherever the trainer
# runs from, and its own imports (standard library only) keep its start-up fast
WORKER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")


def in_process_math():
    """math-verify's comparison in this process (a --reward worker): made once, on first use or
    before the worker says it is ready."""
    if not _IN_PROCESS:
        _IN_PROCESS.append(make_math_verify())
    return _IN_PROCESS[0]


class _Worker:
    """One grading process, answering one request at a time over pipes (JSON lines). It starts in
    the background (launch) and takes requests once it has said it is ready."""

    def __init__(self, spec: str | None, kind: str = "pair"):
        self.spec, self.kind, self.proc, self.buf, self.ready, self.started = (spec, kind, None,
                                                                               b"", False, 0.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self):
        import subprocess

        path = json.dumps(worker_path(self.spec))
        main = threading.current_thread() is threading.main_thread()  # lives as long as we do
        env = {**os.environ, IN_WORKER_ENV: "1"} if self.spec else None
        self.proc = subprocess.Popen([sys.executable, WORKER_FILE, path, self.spec or "",
                                      self.kind, str(os.getpid()), "1" if main else "0"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     # a user's prints show
                                     stderr=None if self.spec else subprocess.DEVNULL,
                                     env=env, start_new_session=True)  # signals to our group
        self.buf, self.ready, self.started = b"", False, time.monotonic()

    def relaunch(self):
        self.stop()
        self.launch()

    def check_start(self, died: bool):
        """Note the ready line of a starting worker; one that failed to start stops the run."""
        msg = self.take()
        if msg is not None and "ready" in msg:
            self.ready = True
            return
        if msg is None and not died and time.monotonic() - self.started < START_TIMEOUT_S:
            return
        self.stop()
        why = (msg.get("fatal", msg) if msg else "it exited" if died
               else f"no answer in {START_TIMEOUT_S:g} s")
        raise RuntimeError(f"the reward worker ({self.spec or 'math grader'}) did not start: {why}")

    def cpu_seconds(self) -> float | None:
        """The worker's CPU seconds so far (user + system, Linux /proc); None where unreadable."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def pull(self) -> bool:
        """Read what the worker wrote; False when it has died."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> bytes | None:
        return self.buf.split(b"\n", 1)[0] if b"\n" in self.buf else None

    def take(self) -> dict | None:
        line = self.line()
        if line is None:
            return None
        self.buf = self.buf[len(line) + 1:]
        try:
            msg = json.loads(line)
            if isinstance(msg, dict):
                return msg
        except ValueError:
            pass
        return {"e": f"RuntimeError: the reward worker wrote {line[:80]!r}"}

    def send(self, request) -> bool:
        """False when the worker has died (it is then restarted in the background)."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            return True
        except OSError:
            self.relaunch()
            return False

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc, self.ready = None, False


class _Watched:
    """What score() keeps of a run's training steps, on the reward it was given: whether every
    group's rewards were equal from the first step on (flat_steps, watch_flat_groups), the steps in
    a row each reward failed on more than half of the completions (bad_steps; the run stops after
    fail_steps of them, 0: never, or when one fails on every completion of the first step), and
    each reward's values in the last step (values; NaN where a TRL reward returned None)."""

    def __init__(self, fail_steps: int = 0):
        # training steps in a row, from the first, in which every group's rewards were equal
        self.flat_steps = 0
        self.fail_steps, self.steps, self.bad_steps = fail_steps, 0, {}
        self.values = {}

    def metrics(self) -> dict:
        """rewards/<name>/mean and rewards/<name>/std of each reward (TRL's names) over the last
        training step's completions on all ranks, those it applied to (not None); population std,
        as charts/reward_std."""
        from .distributed import all_gather_cat

        out = {}
        for name, v in self.values.items():
            v = all_gather_cat(v)
            v = v[~v.isnan()]
            out[f"rewards/{name}/mean"] = v.mean().item() if len(v) else float("nan")
            out[f"rewards/{name}/std"] = v.std(unbiased=False).item() if len(v) else float("nan")
        return out


class Reward(_Watched):
    """One reward function: the math grader (spec None) or a user's function named
    'module:function', of one of two forms (kind): 'pair', f(completion, answer) -> float, one
    request per distinct (completion, answer); or 'trl', TRL's f(prompts, completions, **columns)
    -> list[float | None], one request per group of completions. What score() cannot settle in
    this process (decide) runs in GRADING_WORKERS worker processes, each request bounded by
    timeout_s (a 'trl' request: timeout_s per completion): CPU seconds of its worker for the math
    grader (wall seconds where /proc is missing, and at most WALL_FACTOR x timeout_s of wall time),
    wall seconds for a user's function, which may wait on a sandbox of its own (see above).
    name: its name in the logs (rewards/<name>/mean); params, required: a 'trl' function's named
    parameters and those without a default; more: whether it takes **kwargs."""

    def __init__(self, spec: str | None = None, timeout_s: float = 1.0, kind: str = "pair"):
        self.spec, self.timeout_s, self.kind = spec, timeout_s, kind
        self.name = spec.partition(":")[2] if spec else "math_reward"
        self.params, self.required, self.more = (), (), True
        self.workers = [_Worker(spec, kind) for _ in range(GRADING_WORKERS)]
        self.lock, self.next_id = threading.Lock(), 0
        super().__init__()

    @property
    def parts(self) -> list[tuple[Reward, float]]:
        """The rewards a completion's reward sums, with their weights: this one."""
        return [(self, 1.0)]

    def stop(self):
        for w in self.workers:
            w.stop()

    def __del__(self):
        try:  # at interpreter exit the modules it uses may be gone already
            self.stop()
        except Exception:  # noqa: BLE001
            pass

    def bound(self, request) -> float:
        """The request's time bound: timeout_s, per completion for a group ('trl')."""
        return self.timeout_s * (len(request["completions"]) if self.kind == "trl" else 1)

    def time_left(self, w: _Worker, sent: float, cpu: float | None, bound: float) -> float:
        """Seconds left of the bound of the request sent to w at wall time sent, when w had used cpu
        CPU seconds (<= 0: out of time)."""
        wall = time.monotonic() - sent
        if self.spec is not None or cpu is None:
            return bound - wall
        now = w.cpu_seconds()
        if now is None:
            return bound - wall
        return min(bound - (now - cpu), WALL_FACTOR * bound - wall)

    def run(self, requests: list) -> list[tuple]:
        """(reward, error) per request, each within its bound (timeout_s) of being sent: a request
        that raises, returns a non-finite value, kills its worker or runs out of time gives (0.0,
        the error), and its worker is replaced in the background. A request: (completion, answer)
        ('pair'; (extracted answer, reference) for the math grader), or a dict of keyword
        arguments ('trl', whose reward is a list). A reply that does not name the request or the
        worker is an error too, and its worker is replaced."""
        import select

        if self.spec is None and os.environ.get(IN_WORKER_ENV):  # inside a --reward worker
            fn = in_process_math()
            return [(fn(*r), None) for r in requests]
        out, todo = [None] * len(requests), list(range(len(requests)))[::-1]
        busy = {}  # worker -> (request index, wall time sent, its CPU time then, request id)
        with self.lock:
            for w in self.workers[:len(requests)]:  # start them side by side
                if not w.alive():
                    w.launch()
            while todo or busy:
                for w in self.workers:
                    if w.ready and w not in busy and not w.alive():
                        w.relaunch()  # died while idle
                    if todo and w.ready and w not in busy:
                        i = todo.pop()
                        self.next_id += 1
                        key = "kw" if self.kind in ("trl", "verl") else "a"
                        if w.send({"id": self.next_id, key: requests[i]}):
                            busy[w] = (i, time.monotonic(), w.cpu_seconds(), self.next_id)
                        else:
                            todo.append(i)
                starting = [w for w in self.workers if w.proc is not None and not w.ready]
                wait = min([self.time_left(w, t, c, self.bound(requests[i]))
                            for w, (i, t, c, _) in busy.items()],
                           default=START_TIMEOUT_S)  # a starting worker says when it is ready
                ready = select.select([w.proc.stdout for w in [*busy, *starting]], [], [],
                                      max(0.01, wait))[0]
                for w in starting:
                    w.check_start(w.proc.stdout in ready and not w.pull())
                for w, (i, sent, cpu, rid) in list(busy.items()):
                    died = w.proc.stdout in ready and not w.pull()
                    msg = w.take()
                    if msg is not None and (msg.get("id"), msg.get("pid")) != (rid, w.proc.pid):
                        out[i] = (0.0, f"RuntimeError: a reply from process {msg.get('pid')} for "
                                       f"request {msg.get('id')} came to request {rid} of worker "
                                       f"{w.proc.pid}: {msg.get('e', 'a reward that forks?')} "
                                       "(worker restarted)")
                        msg = None
                    elif msg is not None:
                        out[i] = (msg.get("r", 0.0), msg.get("e"))
                    elif died:
                        out[i] = (0.0, "RuntimeError: the reward worker died (restarted)")
                    elif self.time_left(w, sent, cpu, self.bound(requests[i])) <= 0:
                        b = self.bound(requests[i])
                        bound = (f"{b:g} s" if self.spec is not None or cpu is None
                                 else f"{b:g} s of CPU time")
                        out[i] = (0.0, f"TimeoutError: no reward within {bound} (worker "
                                       "restarted)")
                    else:
                        continue
                    if msg is None:
                        w.relaunch()
                    del busy[w]
        return out


class Rewards(_Watched):
    """Several rewards (--reward repeated), a completion's reward the weighted sum of those that
    apply to it: sum_k w_k r_k over the rewards that did not return None, as TRL's nansum (0 when
    none applies)."""

    def __init__(self, parts: list[tuple[Reward, float]], fail_steps: int = 0):
        super().__init__(fail_steps)
        self.parts = parts

    def stop(self):
        for reward, _ in self.parts:
            reward.stop()


def load_reward(spec: str | list[str] | None, timeout_s: float, weights: list[float] = (),
                fail_steps: int = 0) -> Reward | Rewards:
    """--reward, --reward-timeout, --reward-weights and --reward-fail-steps, checked before any
    heavy work. spec None (or an empty list) is the math grader (it needs math-verify); each
    'module:function' must name a function importable from the current folder or the Python path,
    of either form reward_form reads. A list gives Rewards (weights: one per reward, default 1
    each), a string or None one Reward."""
    if not timeout_s > 0:
        fail(f"--reward-timeout {timeout_s}: must be > 0 seconds")
    if isinstance(fail_steps, bool) or not isinstance(fail_steps, int) or fail_steps < 0:
        fail(f"--reward-fail-steps {fail_steps}: must be an integer >= 0 (0: never stop)")
    if not isinstance(spec, list):
        reward = _load_one(spec, timeout_s)
        reward.fail_steps = fail_steps
        return reward
    specs = spec or [None]
    weights = list(weights) or [1.0] * len(specs)
    if len(weights) != len(specs):
        fail(f"--reward-weights: {len(weights)} weight(s) for {len(specs)} reward(s) "
             f"({', '.join(s or 'the math grader' for s in specs)}); give one weight per --reward")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        fail(f"--reward-weights {bad[0]}: must be a finite number")
    rewards = [_load_one(s, timeout_s) for s in specs]
    names = [r.name for r in rewards]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"--reward: two rewards named {twice[0]!r} (their logs, rewards/<name>/mean, would "
             "mix): give each --reward once, or wrap one under another name")
    return Rewards(list(zip(rewards, weights)), fail_steps)


def _load_one(spec: str | None, timeout_s: float) -> Reward:
    import importlib.util

    if spec is None:
        if importlib.util.find_spec("math_verify") is None:
            fail("the math grader needs math-verify: pip install -r requirements.txt")
        return Reward(None, timeout_s)
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        fail(f"--reward {spec!r}: give module:function, e.g. my_rewards:format_reward for a "
             "function f(completion, answer) -> float in my_rewards.py")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    root, other = module_root(module)
    if other:  # the same name twice: which one the trainer and its workers both use, said
        print(f"note: --reward {spec!r}: {module.split('.')[0]!r} is "
              f"{sys.modules[module.split('.')[0]].__file__} (imported by the trainer, and so by "
              f"its reward workers); your {other} is not used: rename it to use it",
              file=sys.stderr)
    # imported in a worker, under a time bound: a module that exits, hangs or leaves a thread at
    # import stops that process, not this one (one imported here already runs nothing on import)
    found = probe(spec) if module in sys.modules else _probe_in_worker(spec, module)
    if found.get("threads"):
        print(f"warning: --reward {spec!r}: importing {module!r} started a thread that is not a "
              f"daemon ({', '.join(found['threads'])}); the reward workers run it, the trainer "
              "does not import the module: start it in the function, or as a daemon",
              file=sys.stderr)
    if "missing" in found:
        fail(f"--reward {spec!r}: cannot import {found['missing']!r} (run from the folder of "
             f"{module}.py or add it to PYTHONPATH)")
    if "exited" in found:
        fail(f"--reward {spec!r}: importing {module!r} called sys.exit({found['exited']}): a reward "
             "module must not exit at import (put that under if __name__ == '__main__')")
    if "raised" in found:
        fail(f"--reward {spec!r}: importing {module!r} raised {found['raised']}")
    if "absent" in found:
        fail(f"--reward {spec!r}: module {module!r} has no {name!r}")
    if "type" in found:
        fail(f"--reward {spec!r}: {module}.{name} is a {found['type']}, not a function "
             "f(completion, answer)")
    form = found["form"]
    if form is None:
        fail(f"--reward {spec!r}: {module}.{name} fits none of f(completion, answer) -> float, "
             "TRL's f(prompts, completions, **columns) -> list[float | None] and verl's "
             "compute_score(data_source, solution_str, ground_truth, extra_info)")
    reward = Reward(spec, timeout_s, form[0])
    reward.params, reward.required, reward.more = (tuple(form[1]), tuple(form[2]), form[3])
    return reward


def module_root(module: str) -> tuple[str | None, str | None]:
    """Where a --reward module's top package is found, the one rule the trainer and its workers
    share (worker_path puts this folder first): a name already imported here (the project's
    common, the standard library) from where it was imported, else the working folder first, then
    sys.path. Returns (that folder, another file of the name in the working folder that loses to
    it, or None)."""
    import importlib.machinery

    top = module.split(".")[0]
    imported = sys.modules.get(top)
    origin = getattr(imported, "__file__", None) if imported else None
    if imported is None:
        found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path])
        origin = found.origin if found and found.has_location else None
    if not origin:
        return None, None
    root = os.path.dirname(origin)
    if os.path.basename(origin) == "__init__.py":
        root = os.path.dirname(root)
    mine = [p for p in (os.path.join(os.getcwd(), top + ".py"), os.path.join(os.getcwd(), top))
            if os.path.exists(p)]
    other = mine[0] if mine and os.path.realpath(root) != os.path.realpath(os.getcwd()) else None
    return root, other


def worker_path(spec: str | None) -> list[str]:
    """The import path of a reward worker: the trainer's module_root first, so that a worker
    imports the very file the trainer checked (not a same-named one in the working folder)."""
    root = module_root(spec.partition(":")[0])[0] if spec else None
    return [p for p in (root, os.getcwd()) if p] + sys.path


def _probe_in_worker(spec: str, module: str) -> dict:
    """reward_worker.probe(spec) in a worker process of its own, bounded by IMPORT_TIMEOUT_S; one
    line when the import ends that process or does not finish."""
    import subprocess

    main = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen([sys.executable, WORKER_FILE, json.dumps(worker_path(spec)),
                             spec, "probe", str(os.getpid()), "1" if main else "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            env={**os.environ, IN_WORKER_ENV: "1"})
    try:
        out = proc.communicate(timeout=IMPORT_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        fail(f"--reward {spec!r}: importing {module!r} did not finish in {IMPORT_TIMEOUT_S:g} s "
             "(it waits at import: on input, a lock, the network?): move that work into the "
             "function, or out of the module")
    for line in out.decode(errors="replace").splitlines()[::-1]:
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get("pid") == proc.pid:
            return found
    fail(f"--reward {spec!r}: importing {module!r} ended the process (exit code {proc.returncode}, "
         "os._exit or a signal) before the function could be read: a reward module must not "
         "exit at import (put that under if __name__ == '__main__')")
