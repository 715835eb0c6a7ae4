import json

import pytest

from lowvram_grpo.rewards import (
    REWARD_MAX, REWARDS, answer_number, count_xml, extract_hash_answer, parse_number, xml_formatted,
)
from decimal import Decimal

NOTEBOOK_FIVE = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]


def score(name, text, answer="72"):
    return REWARDS[name]([None], [text], answer=[answer])[0]


def test_registry_has_the_notebooks_five_with_trl_names():
    for name in NOTEBOOK_FIVE:
        assert name in REWARDS
        assert REWARDS[name].__name__ == name  # TRL logs rewards/<__name__>/mean


def test_perfect_answer_scores_each_maximum():
    text = xml_formatted("48 + 24 = 72", "72")
    for name in NOTEBOOK_FIVE:
        assert score(name, text) == pytest.approx(REWARD_MAX[name]), name


def test_conversational_completions_are_read():
    completion = [{"role": "assistant", "content": xml_formatted("x", "72")}]
    assert REWARDS["correctness"]([None], [completion], answer=["72"]) == [2.0]


@pytest.mark.parametrize("stated", ["72", "72.0", "$72", "72.", " 72 ", "72 clips", "The answer is 72.", "72.00"])
def test_correctness_accepts_the_number_however_written(stated):
    assert score("correctness", f"<reasoning>\nok\n</reasoning>\n<answer>\n{stated}\n</answer>") == 2.0


@pytest.mark.parametrize("gold,stated", [("1,000", "1000"), ("1000", "1,000"), ("1,000", "$1,000.00"), ("-3", "-3"), ("0.5", ".5")])
def test_correctness_normalises_gold_and_stated(gold, stated):
    assert score("correctness", f"<answer>{stated}</answer>", gold) == 2.0


@pytest.mark.parametrize("stated", ["73", "7.2", "", "seventy-two", "720", "-72"])
def test_correctness_rejects_wrong_answers(stated):
    assert score("correctness", f"<reasoning>\n72\n</reasoning>\n<answer>\n{stated}\n</answer>") == 0.0


def test_correctness_without_tags_needs_the_bare_number():
    assert score("correctness", "72") == 2.0
    assert score("correctness", "I think it is 72") == 0.0


def test_strict_format_accepts_multiline_reasoning_and_rejects_loose_layout():
    multiline = "<reasoning>\nstep one\nstep two\n</reasoning>\n<answer>\n72\n</answer>\n"
    assert score("strict_format", multiline) == 0.5
    assert score("strict_format", "<reasoning>x</reasoning><answer>72</answer>") == 0.0
    assert score("strict_format", "preamble " + multiline) == 0.0


def test_soft_format_accepts_loose_layout_only_with_both_blocks():
    assert score("soft_format", "<reasoning>x</reasoning> <answer>72</answer>") == 0.5
    assert score("soft_format", "<answer>72</answer>") == 0.0
    assert score("soft_format", "no tags at all") == 0.0


def test_int_reward():
    assert score("int", "<answer>\n42\n</answer>") == 0.5
    assert score("int", "<answer>\n1,000\n</answer>") == 0.5
    assert score("int", "<answer>\n4.5\n</answer>") == 0.0
    assert score("int", "<answer>\nforty\n</answer>") == 0.0


def test_xmlcount_partial_credit_and_trailing_penalty():
    assert count_xml("<reasoning>\n") == pytest.approx(0.125)
    assert count_xml(xml_formatted("r", "1")) == pytest.approx(0.5)
    trailing = xml_formatted("r", "1") + "extra text"
    assert count_xml(trailing) == pytest.approx(0.5 - 2 * 0.001 * len("extra text"))
    assert count_xml("nothing") == 0.0


def test_brevity_prefers_shorter_text():
    short, long = REWARDS["brevity"]([None, None], ["a" * 10, "a" * 600])
    assert short > long > 0
    assert REWARDS["brevity"]([None], ["a" * 5000]) == [0.0]


def test_number_helpers():
    assert parse_number("1,234.5") == Decimal("1234.5")
    assert parse_number("abc") is None
    assert answer_number("total: 3 boxes of 4 = 12") == Decimal(12)
    assert extract_hash_answer("work\n#### 72") == "72"
    assert extract_hash_answer("no marker") is None


def test_correctness_scores_every_real_gsm8k_gold_answer_the_maximum(gsm8k_path):
    rows = [json.loads(line) for line in gsm8k_path.open() if line.strip()]
    assert len(rows) > 1000
    golds = [extract_hash_answer(r["answer"]) for r in rows]
    completions = [xml_formatted(r["answer"].split("####")[0], g) for r, g in zip(rows, golds)]
    scores = REWARDS["correctness"]([None] * len(rows), completions, answer=golds)
    failures = [(g, s) for g, s in zip(golds, scores) if s != REWARD_MAX["correctness"]]
    assert failures == []
    # and a wrong number never scores
    wrong = [xml_formatted("x", str(parse_number(g) + 1)) for g in golds[:200]]
    assert set(REWARDS["correctness"]([None] * 200, wrong, answer=golds[:200])) == {0.0}
