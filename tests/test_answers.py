"""Answer checking (answers.py): what a completion states, and whether it equals the gold answer.
Real math-verify for fractions, LaTeX and percentages; exact decimals for plain numbers."""
import json
import random

import pytest

from lowvram_grpo.task.answers import (CheckerError, _math_verify, final_answer, is_correct, lenient_answer,
                                       plain_number, strict_answer, whole_answer)
from lowvram_grpo.task.rewards import REWARDS, extract_hash_answer, xml_formatted


@pytest.mark.parametrize("stated,gold", [
    ("3/4", "0.75"), ("\\frac{3}{4}", "0.75"), ("\\dfrac{3}{4}", "0.75"), ("1/2", "0.5"), ("50%", "0.5"),
    ("0.75", "\\frac{3}{4}"), ("\\boxed{0.75}", "3/4"), ("75%", "0.75"), ("50%", "50"),
    ("72", "72"), ("1,000", "1000"), ("$1,000.00", "1,000"), ("72.00", "72"), ("-3", "-3"), (".5", "0.5"),
])
def test_equal_answers_in_any_usual_form(stated, gold):
    assert is_correct(stated, gold)


@pytest.mark.parametrize("stated,gold", [
    ("3/5", "0.75"), ("\\frac{1}{4}", "0.75"), ("1/3", "0.5"), ("5%", "0.5"), ("73", "72"), ("720", "72"),
    ("-72", "72"), ("7.2", "72"), (None, "72"), ("2/3", "0.67"),
])
def test_different_answers_are_wrong(stated, gold):
    assert not is_correct(stated, gold)


@pytest.mark.parametrize("text,strict,lenient", [
    (xml_formatted("12 + 5 = 17", "17"), "17", "17"),
    ("<reasoning>\n12 + 5 = 17\n</reasoning>\n<answer>\nThe total is 17 apples.\n</answer>", "17", "17"),
    ("<answer>\n3/4 cup\n</answer>", "3/4", "3/4"),
    ("<answer>\n\\frac{3}{4}\n</answer>", "\\frac{3}{4}", "\\frac{3}{4}"),
    ("<reasoning>\n12 + 5 = 17\n</reasoning>\n<answer>\n17", None, "17"),          # cut off before </answer>
    ("Ava has 12 + 5 = 17 apples. So the answer is 17.", None, "17"),            # no format at all
    ("So 12 + 5 = 17, and she eats 2 a day for 3 days.", None, "3"),              # the *last* number
    ("The answer is \\boxed{\\frac{1}{2}}, after 3 days.", None, "\\boxed{\\frac{1}{2}}"),
    ("I do not know.", None, None),
    ("<answer>\n-3\n</answer>\n", "-3", "-3"),
    ("He had 12-5 left", None, "5"),                                               # a hyphen is not a sign
])
def test_strict_and_lenient_readings(text, strict, lenient):
    assert strict_answer(text) == strict
    assert lenient_answer(text) == lenient


def test_lenient_is_never_stricter_than_strict():
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<reasoning>", "</reasoning>", "\n", " 17", " 3/4", " x", " 12 + 5 = 17", " 2"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        for gold in ("17", "0.75", "2"):
            if is_correct(strict_answer(text), gold):
                assert is_correct(lenient_answer(text), gold), text


def test_final_and_whole_answer():
    assert final_answer("The total is 72 clips.") == "72"
    assert final_answer("$18.00.") == "18.00"
    assert final_answer("total: 3 boxes of 4 = 12") == "12"
    assert whole_answer(" 72 ") == "72" and whole_answer("$1,000") == "1,000" and whole_answer("3/4") == "3/4"
    assert whole_answer("I think it is 72") is None
    assert plain_number("1,234.5") is not None and plain_number("3/4") is None and plain_number("50%") is None


@pytest.mark.parametrize("stated", ["3/4", "\\frac{3}{4}", "0.75", "75%", "The answer is 3/4."])
def test_correctness_reward_scores_fractions_and_latex(stated):
    completion = f"<reasoning>\nthree quarters\n</reasoning>\n<answer>\n{stated}\n</answer>\n"
    assert REWARDS["correctness"]([None], [completion], answer=["0.75"]) == [2.0]
    assert REWARDS["correctness"]([None], [completion], answer=["0.5"]) == [0.0]


@pytest.mark.slow
def test_fast_path_agrees_with_math_verify_on_every_gsm8k_gold(gsm8k_path):
    """Plain numbers are compared as decimals without math-verify; on GSM8K's golds, written the ways a
    model writes them (and off by one), math-verify gives the same verdict."""
    rows = [json.loads(line) for line in gsm8k_path.open() if line.strip()]
    golds = sorted({extract_hash_answer(r["answer"]) for r in rows})
    assert len(golds) > 500
    disagreements = []
    for gold in golds:
        value = plain_number(gold)
        assert value is not None, gold
        forms = [gold, f"{value:,}", f"${value}", f"{value}.00" if value == value.to_integral() else f"{value}0",
                 str(value + 1), str(-value) if value else "1"]
        for stated in forms:
            if is_correct(stated, gold) != _math_verify(stated, gold):
                disagreements.append((stated, gold))
    assert disagreements == []


def test_a_checker_failure_is_not_a_wrong_answer(monkeypatch):
    """math-verify failing on a pair (here made to raise, as it does on odd sympy objects or a timeout) is
    CheckerError, not a wrong answer: the correctness reward says None (does not apply) and the held-out
    accuracy counts it in checker_failures (before: False, 0.0, silently a wrong answer)."""
    import math_verify

    from lowvram_grpo.evaluate import evaluation

    def broken(*args, **kwargs):
        raise RuntimeError("sympy could not compare")

    monkeypatch.setattr(math_verify, "verify", broken)
    with pytest.raises(CheckerError, match="sympy could not compare"):
        is_correct("5/8", "0.625")
    assert is_correct("72", "72") and not is_correct("73", "72")  # plain numbers never reach math-verify
    completions = [xml_formatted("x", "5/8"), xml_formatted("x", "73")]
    assert REWARDS["correctness"]([None, None], completions, answer=["0.625", "72"]) == [None, 0.0]
    failures = []
    strict, lenient = evaluation.verdicts([{"answer": "0.625"}, {"answer": "72"}], completions, failures)
    assert (strict, lenient) == ([0, 0], [0, 0]) and len(failures) == 2 and "sympy could not compare" in failures[0]
    # a parse that fails is the checker's failure too; one that finds nothing is a wrong answer
    monkeypatch.setattr(math_verify, "parse", broken)
    with pytest.raises(CheckerError, match="could not parse"):
        is_correct("\\frac{7}{9}", "0.7777")
