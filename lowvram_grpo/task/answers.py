"""Answer checking: is a stated final answer the gold one? Used by the `correctness` reward and by the
held-out accuracy (strict and lenient), so training and measurement judge answers the same way.

Two steps, one verdict:
- both sides plain numbers ('72', '1,000', '$18.00', '-3', '.5', '72.'): compared exactly as decimals
  (fast: GSM8K's integers never reach step two);
- anything else ('3/4', '\\frac{3}{4}', '50%', '\\boxed{0.75}', '2^{10}', sets, intervals): math-verify,
  the verifier Open-R1 uses (`math_verify.parse` + `math_verify.verify`, latex2sympy2 under it), which
  also accepts 3/4 = 0.75 = \\frac{3}{4} and 50% = 0.5 (and 50% = 50).
On plain numbers the two steps agree (tests/test_answers.py checks it on the GSM8K gold answers).
A checker that fails (math-verify raising on an answer it cannot handle, or timing out) is not a wrong
answer: `is_correct` raises `CheckerError`, and each caller says what it counts it as (the `correctness`
reward: None, "does not apply"; the held-out accuracy: not right, counted in `checker_failures`).

What counts as the stated answer:
- strict (`strict_answer`): the text inside a closed <answer>...</answer> block (the last one);
- lenient (`lenient_answer`): the <answer> block's text when there is one (closed or cut off), else the
  last \\boxed{...}, else the whole completion;
and inside that text `final_answer` takes the whole of it when it is one answer, else its last number
(a fraction, a LaTeX \\frac, a \\boxed{...} or a number with $, commas, % around it): 'The total is 72
clips.' states 72. So a lenient verdict is never stricter than the strict one.

One reading for the rewards (`answer_block`): the last closed <answer> block, else a block cut off before
</answer>, else the whole completion. The `correctness` reward reads `stated_answer` from it and the `int`
reward `bare_integer`, so the two never read different answers from one completion.

The `think` answer format (`data.answer_format: think`, thinking models such as Qwen3): one <think>...</think>
block, then the answer as text. Strict (`think_strict_answer`): the final answer after </think> of a well-formed
completion (`think_ok`); lenient (`think_lenient_answer`): the answer stated after the last </think> in any form;
the `think_correctness` reward reads `think_stated_answer`. `extractors(format)` gives a format's two readers.
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


class CheckerError(Exception):
    """The checker (math-verify) failed on a pair of answers: neither right nor wrong, unchecked."""


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
    # the strict reading when a block is closed (so lenient is never stricter), else the cut-off one
    if "<answer>" in text:
        return final_answer(answer_block(text))
    boxed = _BOXED.findall(text)
    return boxed[-1] if boxed else final_answer(text)


def answer_block(text: str) -> str:
    """The text a completion gives as its answer: the last closed <answer>...</answer> block, else a block cut
    off before </answer>, else the whole completion. The one reading of the `correctness` and `int` rewards."""
    blocks = _ANSWER_BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    return text.split("<answer>")[-1] if "<answer>" in text else text


def stated_answer(text: str) -> Optional[str]:
    """The answer the `correctness` reward reads: in an <answer> block its final answer ('The total is 72.'
    states 72); without tags the whole completion, only when it is just one answer (the notebook's rule)."""
    return final_answer(answer_block(text)) if "<answer>" in text else whole_answer(text)


_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+|-?\d+")


def bare_integer(text: str) -> Optional[str]:
    """The integer a completion's answer block is, when the block is just one ('42', '-3', '1,000', '$72',
    '72.'); else None. What the `int` reward reads: when it is not None it is `stated_answer(text)`."""
    whole = whole_answer(answer_block(text))
    return whole if whole is not None and _INTEGER.fullmatch(whole) else None


def is_correct(stated: Optional[str], gold) -> bool:
    """`stated` (an extracted answer, e.g. from `strict_answer`) equals the gold answer. CheckerError when
    math-verify fails on the pair (an error or a timeout): unchecked, not wrong."""
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
    import math_verify  # lazy: loads sympy (about a second)
    from math_verify.errors import TimeoutException  # a BaseException

    try:  # nothing found is [] (not an answer: wrong); an error or a timeout while parsing is the checker's failure
        return tuple(math_verify.parse(_latex_delimited(text), parsing_timeout=_timeout(), raise_on_error=True))
    except (Exception, TimeoutException) as exc:
        raise CheckerError(f"math-verify could not parse {text[:80]!r}: {type(exc).__name__}: {exc}"[:300]) from None


def _math_verify(stated: str, gold: str) -> bool:
    """Any extraction of `stated` equal to any of `gold` (math-verify's own rule, pair by pair): True as soon
    as one pair is equal; False when every pair was compared and none is; CheckerError when none is equal and
    math-verify failed on a pair (before, such a failure read as a wrong answer)."""
    import math_verify  # lazy: loads sympy (about a second)
    from math_verify.errors import TimeoutException  # a BaseException

    gold_parsed, stated_parsed = _parsed(gold), _parsed(stated)
    if not gold_parsed or not stated_parsed:
        return False
    failure = None
    for g in gold_parsed:
        for t in stated_parsed:
            try:
                if math_verify.verify(g, t, timeout_seconds=_timeout(), raise_on_error=True):
                    return True
            except (Exception, TimeoutException) as exc:  # odd sympy objects, a timeout
                failure = failure or exc
    if failure is not None:
        raise CheckerError(f"math-verify failed comparing {stated[:80]!r} with {gold[:80]!r}: "
                           f"{type(failure).__name__}: {failure}"[:300])
    return False


# --------------------------------------------------------------------------- the `think` format

# `data.answer_format: think` (Qwen3-style thinking models): the completion is one <think>...</think> block, then the
# answer as plain text ('<think>\n6 * 7 = 42\n</think>\n\nThe answer is 42.'). Well formed (`think_ok`): one closing
# tag, then a non-empty answer; the opening tag at the start, or nowhere (a template that opens the block in the
# generation prompt, as Qwen3-Thinking-2507's does: the completion starts inside it).
ANSWER_FORMATS = ("xml", "think")
_THINK = re.compile(r"\s*(?:<think>)?(.*?)</think>\s*(\S.*)", re.DOTALL)


def think_tail(text: str) -> Optional[str]:
    """The answer part of a `think` completion: the text after its last </think>; None without one (cut off
    while thinking)."""
    return text.rsplit("</think>", 1)[1] if "</think>" in text else None


def think_ok(text: str) -> bool:
    """A well-formed `think` completion: <think>...</think> at the start (or only the closing tag, the block opened
    by the prompt), one block, then an answer."""
    match = _THINK.fullmatch(text)
    return (bool(match) and "<think>" not in match.group(1) and text.count("</think>") == 1
            and "<think>" not in match.group(2))


def think_strict_answer(text: str) -> Optional[str]:
    """The answer a well-formed `think` completion states after </think> (its final answer, `final_answer`);
    None when the completion is not well formed (`think_ok`)."""
    return final_answer(think_tail(text)) if think_ok(text) else None


def think_lenient_answer(text: str) -> Optional[str]:
    """The answer stated after the last </think> in any form (`lenient_answer` of that text); without </think>,
    of the whole completion."""
    tail = think_tail(text)
    return lenient_answer(text if tail is None else tail)


def think_stated_answer(text: str) -> Optional[str]:
    """The answer the `think_correctness` reward reads: the final answer of the text after the last </think>
    (one closed thinking block is required; text before it is never read as the answer)."""
    tail = think_tail(text)
    return None if tail is None else final_answer(tail)


def extractors(answer_format: str):
    """(strict, lenient) answer readers of an answer format (`ANSWER_FORMATS`): what the held-out accuracy reads."""
    if answer_format == "think":
        return think_strict_answer, think_lenient_answer
    return strict_answer, lenient_answer
