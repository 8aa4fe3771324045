"""Extracting and normalising a final numeric answer from free text (GSM8K-style rewards, built-in tasks).

Order of evidence, most explicit first: the text after the last ``####``; the last ``\\boxed{...}``; the
last "the answer is ..." / "answer: ..."; else the last number anywhere. Numbers are normalised to exact
fractions: thousands separators (``1,000``), currency and unit words around them (``$``, ``kg``, ``%``),
trailing zeros (``18.00``), Unicode minus signs and LaTeX fractions all compare equal when their values do.

A final answer is short: a number token longer than :data:`MAX_NUMBER_CHARS` is not an answer (it is never
converted, so a completion ending in ``#### `` plus a million digits costs a regex scan, not minutes of
big-number arithmetic), and a ``\\boxed{`` whose closing brace is more than :data:`MAX_BOXED_CHARS`
characters away is treated as unclosed.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MAX_NUMBER_CHARS = 100  # longest number token converted (digits, separators, sign, point)
MAX_BOXED_CHARS = 1000  # longest \\boxed{...} content searched for its closing brace

# A number not glued to a preceding word or number: "-5" in "x = -5", but "5" (not "-5") in "3-5"; a slash fraction
# ("3/4") is one number, not its numerator or its denominator.
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER = re.compile(rf"(?<![\w.])(?:-\s?)?{_DIGITS}(?:\s?/\s?{_DIGITS}(?![\d.]))?|(?<![\w.])-?\.\d+")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=|was|would\s+be)\s*:?", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d,.]+)\s*\}\s*\{\s*(-?[\d,.]+)\s*\}|\\[dt]?frac(\d)(\d)")
_UNIT_TEXT = re.compile(r"\\(?:text|mathrm|mbox|textrm)\s*\{[^{}]*\}(?:\s*\^\s*(?:\{[^{}]*\}|\d))?")
_MIXED_WHOLE = re.compile(r"(-?\d+)\s*$")
_SCIENTIFIC = re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:\\times|\\cdot|x)\s*10\s*\^\s*\{?\s*(-?\d{1,3})\s*\}?")
_EXPONENT = re.compile(r"\^\s*(?:\{[^{}]*\}|\d)")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\u2010": "-", "\u00a0": " "})


def parse_number(token: str) -> Fraction | None:
    """Exact value of a number token (``"-1,234.50"`` -> ``Fraction(-2469, 2)``), or None (also for a
    token longer than :data:`MAX_NUMBER_CHARS`: no final answer is that long)."""
    if len(token) > MAX_NUMBER_CHARS:
        return None
    cleaned = token.translate(_MINUS_SIGNS).replace(",", "").replace(" ", "")
    numerator, _, denominator = cleaned.partition("/")
    try:
        value = Fraction(Decimal(numerator))
        return value / Fraction(Decimal(denominator)) if denominator else value
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None


def _last_number(text: str) -> Fraction | None:
    matches = _NUMBER.findall(text)
    return parse_number(matches[-1]) if matches else None


def _first_number(text: str) -> Fraction | None:
    match = _NUMBER.search(text)
    return parse_number(match.group(0)) if match else None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent or
    longer than :data:`MAX_BOXED_CHARS`."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    brace = text.find("{", start) if start >= 0 else -1
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, min(len(text), brace + 2 + MAX_BOXED_CHARS)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


def _boxed_value(content: str) -> Fraction | None:
    content = _UNIT_TEXT.sub(" ", content.replace("\\!", "").replace("{,}", ","))  # "72 \text{ cm}^2": 72
    if frac := _FRAC.search(content):
        num, den = (frac.group(1), frac.group(2)) if frac.group(1) is not None else (frac.group(3), frac.group(4))
        n, d = parse_number(num), parse_number(den)
        if n is not None and d:
            whole = _MIXED_WHOLE.search(content[: frac.start()])  # "2\frac{1}{2}": 5/2
            value = n / d + (abs(parse_number(whole.group(1)) or 0) if whole else 0)
            sign = -1 if re.search(r"-\s*(?:\d+\s*)?\\[dt]?frac", content) else 1
            return sign * value
    if scientific := _SCIENTIFIC.search(content):  # "1.5 \times 10^{3}": 1500
        mantissa, exponent = parse_number(scientific.group(1)), int(scientific.group(2))
        if mantissa is not None and abs(exponent) <= 30:
            return mantissa * Fraction(10) ** exponent
    return _last_number(_EXPONENT.sub(" ", content))


def extract_final_number(text: str) -> Fraction | None:
    """The model's final numeric answer in ``text`` (see the module docstring for the order), or None."""
    text = text.translate(_MINUS_SIGNS)
    hashes, boxed, said = text.rfind("####"), last_boxed(text), list(_ANSWER_IS.finditer(text))
    for value in (_first_number(text[hashes + 4 :]) if hashes >= 0 else None,
                  _boxed_value(boxed) if boxed is not None else None,
                  _first_number(text[said[-1].end() :][:80]) if said else None):
        if value is not None:
            return value
    return _last_number(text)


def reference_number(reference: str) -> Fraction:
    """The number a reference answer states (GSM8K: after ``####``); ValueError when it states none."""
    value = extract_final_number(reference)
    if value is None:
        raise ValueError(f"reference answer states no number: {reference[-200:]!r}")
    return value
