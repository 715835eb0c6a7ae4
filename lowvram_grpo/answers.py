"""Answer checking: is a stated final answer the gold one? Used by the `correctness` reward and by the
held-out accuracy (strict and lenient), so training and measurement judge answers the same way.

Two steps, one verdict:
- both sides plain numbers ('72', '1,000', '$18.00', '-3', '.5', '72.'): compared exactly as decimals
  (fast: GSM8K's integers never reach step two);
- anything else ('3/4', '\\frac{3}{4}', '50%', '\\boxed{0.75}', '2^{10}', sets, intervals): math-verify,
  the verifier Open-R1 uses (`math_verify.parse` + `math_verify.verify`, latex2sympy2 under it), which
  also accepts 3/4 = 0.75 = \\frac{3}{4} and 50% = 0.5 (and 50% = 50).
On plain numbers the two steps agree (tests/test_answers.py checks it on the GSM8K gold answers).

What counts as the stated answer:
- strict (`strict_answer`): the text inside a closed <answer>...</answer> block (the last one);
- lenient (`lenient_answer`): the <answer> block's text when there is one (closed or cut off), else the
  last \\boxed{...}, else the whole completion;
and inside that text `final_answer` takes the whole of it when it is one answer, else its last number
(a fraction, a LaTeX \\frac, a \\boxed{...} or a number with $, commas, % around it): 'The total is 72
clips.' states 72. So a lenient verdict is never stricter than the strict one.
"""
from __future__ import annotations

import functools
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Optional

_PLAIN = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_DECORATION = re.compile(r"^[\s$€£]*|[\s.]*$")  # currency in front, spaces and a full stop after

# The answer-like pieces of a text, for "its last number". Alternatives in priority of span:
_BRACED = r"\{(?:[^{}]|\{[^{}]*\})*\}"  # {...} with one level of nesting
_PIECE = re.compile(
    r"\\boxed" + _BRACED
    + r"|-?\\[dt]?frac" + _BRACED + _BRACED
    + r"|(?<![\w./])-?\d[\d,]*(?:\.\d+)?\s*/\s*\d[\d,]*(?:\.\d+)?(?![\d/])"  # 3/4, 1,000/8
    + r"|(?<![\w./])-?[$€£]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*%)?"              # 72, $1,000.00, .5, 50%
)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed" + _BRACED)


def plain_number(text: str) -> Optional[Decimal]:
    """'1,000', '$18.00', '-3', '.5', '72.' -> Decimal; None when the text is not just one plain number."""
    match = _PLAIN.fullmatch(_DECORATION.sub("", text))
    if match is None:
        return None
    try:
        return Decimal(match.group(0).replace(",", ""))
    except InvalidOperation:
        return None


def final_answer(text: str) -> Optional[str]:
    """The answer a piece of text states: all of it when it is a single answer-like piece, else its last
    number-like piece; None when it has none."""
    stripped = _DECORATION.sub("", text)
    if not stripped:
        return None
    pieces = _PIECE.findall(stripped)
    if not pieces:
        return None
    if _PIECE.fullmatch(stripped):
        return stripped
    return pieces[-1]


def whole_answer(text: str) -> Optional[str]:
    """The text itself when it is just one answer ('72', '$1,000', '3/4', '\\frac{3}{4}'); else None."""
    stripped = _DECORATION.sub("", text)
    return stripped if stripped and _PIECE.fullmatch(stripped) else None


def strict_answer(text: str) -> Optional[str]:
    """The answer inside the last closed <answer>...</answer> block; None without one."""
    blocks = _ANSWER_BLOCK.findall(text)
    return final_answer(blocks[-1]) if blocks else None


def lenient_answer(text: str) -> Optional[str]:
    """The answer stated anywhere, any format: the <answer> block's (closed, else cut off) when there is
    one, else the last \\boxed{...}, else the last number of the whole text."""
    blocks = _ANSWER_BLOCK.findall(text)
    if blocks:  # the strict reading, so lenient is never stricter
        return final_answer(blocks[-1])
    if "<answer>" in text:  # cut off before </answer>
        return final_answer(text.split("<answer>")[-1])
    boxed = _BOXED.findall(text)
    return boxed[-1] if boxed else final_answer(text)


def is_correct(stated: Optional[str], gold) -> bool:
    """`stated` (an extracted answer, e.g. from `strict_answer`) equals the gold answer."""
    if stated is None or gold is None:
        return False
    gold = str(gold).strip()
    a, b = plain_number(stated), plain_number(gold)
    if a is not None and b is not None:
        return a == b
    return _math_verify(stated.strip(), gold)


# --------------------------------------------------------------------------- math-verify

def _latex_delimited(text: str) -> str:
    """math-verify finds LaTeX between $...$; a bare '\\frac{3}{4}' or '\\boxed{2}' gets the delimiters."""
    return f"${text}$" if "\\" in text and "$" not in text else text


def _timeout() -> Optional[int]:
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple:
    from math_verify import parse

    return tuple(parse(_latex_delimited(text), parsing_timeout=_timeout()))


def _math_verify(stated: str, gold: str) -> bool:
    from math_verify import verify

    gold_parsed, stated_parsed = _parsed(gold), _parsed(stated)
    if not gold_parsed or not stated_parsed:
        return False
    try:
        return bool(verify(list(gold_parsed), list(stated_parsed), timeout_seconds=_timeout()))
    except Exception:  # math-verify raises on odd sympy objects; an answer it cannot compare is not right
        return False
