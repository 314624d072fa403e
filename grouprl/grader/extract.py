"""Answer extraction: where a completion states its final answer (a box, '####', 'the answer is', a
math span or a number at its end, <answer> tags), read as text (extract_answer) or as a span
(answer_span). Pure text, no grading; equivalence.py decides whether two answers are equal.
"""

from __future__ import annotations

import bisect
import re

from .equivalence import _LETTERS_AFTER, _UNIT_WORD, _closing_brace, normalize_answer


# -------------------- the math grader: answers read where models write them
# Numbers as answers write them: -12, 3.5, .5, 3/4, and thousands in groups of three (1,234). A
# comma that three digits do not follow ends the number, so "the answer is 72, in total" gives 72.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUM_RE = re.compile(_NUM)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
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
