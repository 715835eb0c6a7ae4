import asyncio
import functools
import json
import math
from decimal import Decimal
from fractions import Fraction

import pytest

from lowvram_grpo.core.errors import ConfigError, RewardError
from lowvram_grpo.task.rewards import (REWARD_MAX, REWARDS, call_reward, callable_name, check_rewards, count_xml,
                                       extract_hash_answer, guarded, is_async_callable, xml_formatted)

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


@pytest.mark.parametrize("gold,stated", [("1,000", "1000"), ("1000", "1,000"), ("1,000", "$1,000.00"), ("-3", "-3"),
                                         ("0.5", ".5")])
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
    assert score("int", "<answer>\nThe total is 72.\n</answer>") == 0.0  # not a bare number: no nudge


# (completion, the answer it states as its answer block's reading, by hand)
ONE_READING = [
    ("<answer>\n42\n</answer>", "42"),
    ("42", "42"),                                                      # no tags: the whole completion
    ("<answer>\n72.\n</answer>", "72"),                              # a full stop after it
    ("<answer>\n$1,000\n</answer>", "1000"),
    ("<answer>\n5\n</answer>\nor maybe\n<answer>\n7", "5"),          # the last closed block, not a cut-off one after it
    ("<answer>\nabout 3.5\n</answer>\n<answer>\n7", "3.5"),
    ("<answer>\n4.5\n</answer>", "4.5"),
    ("<reasoning>\n9\n</reasoning>\n<answer>\n17", "17"),              # cut off before </answer>
]


@pytest.mark.parametrize("text,stated", ONE_READING)
def test_int_and_correctness_read_the_same_answer(text, stated):
    """`int` pays for a bare integer exactly when the answer `correctness` reads is that integer (before,
    `int` read the text after the last "<answer>" and `correctness` the last closed block, and `int` missed
    '72.' and '$1,000', which `correctness` reads as 72 and 1000)."""
    assert score("correctness", text, answer=stated) == 2.0
    assert score("correctness", text, answer=str(Decimal(stated) + 1)) == 0.0
    is_integer = Decimal(stated) == Decimal(stated).to_integral_value()
    assert score("int", text) == (0.5 if is_integer else 0.0)


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


def test_gsm8k_gold_answer():
    assert extract_hash_answer("work\n#### 72") == "72"
    assert extract_hash_answer("no marker") is None


@pytest.mark.slow
def test_correctness_scores_every_real_gsm8k_gold_answer_the_maximum(gsm8k_path):
    rows = [json.loads(line) for line in gsm8k_path.open() if line.strip()]
    assert len(rows) > 1000
    golds = [extract_hash_answer(r["answer"]) for r in rows]
    completions = [xml_formatted(r["answer"].split("####")[0], g) for r, g in zip(rows, golds)]
    scores = REWARDS["correctness"]([None] * len(rows), completions, answer=golds)
    failures = [(g, s) for g, s in zip(golds, scores) if s != REWARD_MAX["correctness"]]
    assert failures == []
    # and a wrong number never scores
    wrong = [xml_formatted("x", str(Decimal(g.replace(",", "")) + 1)) for g in golds[:200]]
    assert set(REWARDS["correctness"]([None] * 200, wrong, answer=golds[:200])) == {0.0}


# --------------------------------------------------------------------------- TRL 1.15's reward contract

def _returning(value):
    def fn(prompts, completions, **kwargs):
        return value
    return fn


@pytest.mark.parametrize("value, expected", [
    ([None, 1.0], [None, 1.0]),                       # "does not apply to this sample" (multi-task data)
    ([math.nan, 2], [math.nan, 2.0]),                 # TRL reads NaN as None
    ([True, False], [1.0, 0.0]),
    ((0.5, 1), [0.5, 1.0]),
    (iter([3, 4]), [3.0, 4.0]),
    ([Decimal("0.25"), Fraction(1, 2)], [0.25, 0.5]),
], ids=["none", "nan", "bools", "tuple", "iterator", "decimal-fraction"])
def test_what_trl_takes_from_a_reward_passes_unchanged(value, expected):
    got = guarded(_returning(value), "mine")(prompts=["p", "p"], completions=["a", "b"])
    assert [None if g is None else (math.nan if math.isnan(g) else g) for g in got] == pytest.approx(expected,
                                                                                                    nan_ok=True)


def test_numpy_and_torch_scores_and_an_infinite_one_that_warns_once():
    import numpy as np
    import torch

    assert guarded(_returning(np.array([0.5, 1.0], dtype=np.float32)), "np")(prompts=[0, 0],
                                                                             completions=[0, 0]) == [0.5, 1.0]
    assert guarded(_returning(torch.tensor([[0.5], [2.0]])), "pt")(prompts=[0, 0], completions=[0, 0]) == [0.5, 2.0]
    warnings = []
    reward = guarded(_returning([math.inf, 1.0]), "inf", warn=warnings.append)
    assert reward(prompts=[0, 0], completions=[0, 0]) == [math.inf, 1.0]
    reward(prompts=[0, 0], completions=[0, 0])
    assert len(warnings) == 1 and "reward 'inf' returned an infinite score: TRL takes it" in warnings[0]


async def async_judge(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


class CallableScorer:
    def __call__(self, prompts, completions, **kwargs):
        return [1.0] * len(completions)


class AsyncScorer:
    async def __call__(self, prompts, completions, **kwargs):
        return [2.0] * len(completions)


def _scaled(prompts, completions, scale, **kwargs):
    return [scale] * len(completions)


def test_async_functions_callable_objects_and_partials_as_trl_takes_them():
    reward = guarded(async_judge, "judge")
    assert is_async_callable(reward) and asyncio.run(reward(prompts=[0, 0], completions=["ab", "c"])) == [2.0, 1.0]
    assert call_reward(reward, prompts=[0], completions=["abc"]) == [3.0]  # outside the trainer (evaluation, probe)
    assert call_reward(guarded(CallableScorer(), "obj"), prompts=[0], completions=["x"]) == [1.0]
    assert is_async_callable(AsyncScorer()) and call_reward(guarded(AsyncScorer(), "aobj"), prompts=[0],
                                                            completions=["x"]) == [2.0]
    partial = functools.partial(_scaled, scale=0.25)
    assert call_reward(guarded(partial, "scaled"), prompts=[0], completions=["x"]) == [0.25]
    assert callable_name(partial) == "_scaled" and callable_name(CallableScorer()) == "CallableScorer"  # TRL's names
    with pytest.raises(RewardError, match=r"reward 'judge' raised ZeroDivisionError"):
        call_reward(guarded(_async_failing, "judge"), prompts=[0], completions=["x"])


async def _async_failing(prompts, completions, **kwargs):
    return 1 / 0


def test_a_reward_without_kwargs_is_told_which_keyword_trl_passes():
    def narrow(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"reward 'narrow' does not take the keyword 'trainer_state' that TRL "
                                          r"passes it .*"
                                          r"add \*\*kwargs"):
        guarded(narrow, "narrow")(prompts=[0], completions=["x"], trainer_state=None)


def test_rewards_are_checked_against_the_runs_own_rows(tmp_path):
    from lowvram_grpo.settings.config import RewardsConfig

    rows = [{"prompt": "Say a colour:", "colour": "red"}, {"prompt": "Say a fruit:", "colour": None}]
    with pytest.raises(ConfigError, match=r"reward 'correctness' needs gold answers and the data d.csv gives none "
                                          r"\(its other columns: 'colour'\): map the answer column with "
                                          r"data.answer_column"):
        check_rewards(RewardsConfig(names=["brevity", "correctness"]), rows, "d.csv")
    module = tmp_path / "mine.py"
    module.write_text("def names_colour(prompts, completions, colour, **kwargs):\n"
                      "    assert isinstance(completions[0], str)  # text prompts: text completions, "
                      "as TRL passes them\n"
                      "    return [1.0 if c and c in t else 0.0 for t, c in zip(completions, colour)]\n")
    check_rewards(RewardsConfig(names=["names_colour"], module=str(module)), rows, "d.csv")  # takes the row's column
    gold = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}]
    check_rewards(RewardsConfig(names=["correctness"]), gold, "g.jsonl")


# A reward file that uses the whole contract: text prompts (TRL's standard format), a dataset column, None
# for rows a reward does not apply to, an async function, numpy scores, a partial, a callable object,
# trainer_state, log_metric, log_extra and completion_ids.
CONTRACT_REWARDS = '''
import asyncio, functools
import numpy as np

def says_target(prompts, completions, target, **kwargs):
    assert all(isinstance(p, str) and isinstance(c, str) for p, c in zip(prompts, completions))
    return [1.0 if t in c else 0.0 for c, t in zip(completions, target)]

async def judge(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [min(len(c), 50) / 50 for c in completions]

def only_kind_a(prompts, completions, kind, trainer_state, log_metric, log_extra, completion_ids, **kwargs):
    assert len(completion_ids) == len(completions) and all(isinstance(i, list) for i in completion_ids)
    log_metric("kind_a_share", sum(k == "a" for k in kind) / len(kind))
    log_extra("kind", list(kind))
    return [0.5 if k == "a" else None for k in kind]

def _fixed(prompts, completions, value, **kwargs):
    return np.full(len(completions), value, dtype=np.float32)

fixed = functools.partial(_fixed, value=0.25)

class ByStep:
    def __call__(self, prompts, completions, trainer_state, **kwargs):
        return tuple(float(trainer_state.global_step) for _ in completions)

by_step = ByStep()
'''


def _tiny_reward_model(folder, tiny_model_dir):
    """A sequence-classification model on the tiny model's tokenizer, as a reward model folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1,
                                                       num_labels=1, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_real_run_with_trls_whole_reward_contract_and_a_reward_model_by_name(tmp_path, tiny_model_dir):
    from conftest import run_cli

    (tmp_path / "contract.py").write_text(CONTRACT_REWARDS)
    reward_model = _tiny_reward_model(tmp_path / "tiny-rm", tiny_model_dir)
    rows = [{"prompt": f"Say the word {w}:", "target": w, "kind": "a" if i % 3 else "b"}
            for i, w in enumerate(["apple", "river", "stone", "cloud", "green", "light", "music", "ocean", "paper",
                                   "tiger"])]
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    names = f"[brevity, says_target, judge, only_kind_a, fixed, by_step, {reward_model}]"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--dataset", str(data), "--set",
                   f"rewards.module={tmp_path / 'contract.py'}",
                   "--set", f"rewards.names={names}", "--output-dir", str(out), env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for name in ("brevity", "says_target", "judge", "fixed", "by_step", "tiny-rm"):
        assert all(f"rewards/{name}/mean" in m for m in metrics), name
    assert all(m["rewards/fixed/mean"] == pytest.approx(0.25) for m in metrics)
    assert [m["rewards/by_step/mean"] for m in metrics] == [0.0, 1.0, 2.0]
    # a step on a kind-b prompt: only_kind_a said None for all its completions, TRL left it out (no mean logged)
    shares = [m["kind_a_share"] for m in metrics]
    assert 1.0 in shares and 0.0 in shares
    assert [m.get("rewards/only_kind_a/mean") for m in metrics] == [0.5 if s else None for s in shares]
    assert all(0 <= m["rewards/judge/mean"] <= 1 for m in metrics)
    assert all(isinstance(m["rewards/tiny-rm/mean"], float) for m in metrics)
    summary = json.loads((out / "summary.json").read_text())
    for side in ("before", "after"):  # scored by the same functions, no gold answers: no accuracy
        assert isinstance(summary[side]["reward_mean"], float) and "accuracy_strict" not in summary[side]
    assert summary["samples"][0]["answer"] is None and summary["samples"][0]["question"].startswith("Say the word")


def test_the_random_reward_controls_stand_in_never_reads_the_completion_and_repeats_itself():
    """rewards.random_reward (baseline.py --control random-reward): uniform on the range, spread within a group,
    the same draws for the same seed, step and call, other draws for another step; the completions are not touched."""
    import types

    from lowvram_grpo.task.rewards import random_reward, reward_range

    class Untouchable:
        def __getattribute__(self, name):
            raise AssertionError("the random reward read a completion")

    completions = [Untouchable() for _ in range(8)]
    state = types.SimpleNamespace(global_step=3)
    first = random_reward("correctness", *reward_range("correctness"), seed=7)
    values = first(prompts=[None] * 8, completions=completions, trainer_state=state)
    assert first.__name__ == "random_correctness" and reward_range("correctness") == (0.0, 2.0)
    assert len(values) == 8 and all(0.0 <= v <= 2.0 for v in values) and len(set(values)) == 8
    again = random_reward("correctness", 0.0, 2.0, seed=7)
    assert again(prompts=[None] * 8, completions=completions, trainer_state=state) == values
    assert again(prompts=[None] * 8, completions=completions, trainer_state=state) != values  # the step's second call
    other_step = random_reward("correctness", 0.0, 2.0, seed=7)
    assert other_step(prompts=[None] * 8, completions=completions,
                      trainer_state=types.SimpleNamespace(global_step=4)) != values
    assert reward_range("my_reward_from_a_file") is None


def test_the_think_format_rewards_read_the_answer_after_the_thinking():
    """`think_format` wants one <think> block at the start then an answer; `think_correctness` reads the final answer
    after the last </think>, never a number inside the thinking; without a closed block it scores 0."""
    from lowvram_grpo.task.rewards import REWARDS, think_formatted

    right = think_formatted("6 * 7 = 42", "The answer is 42.")
    assert right == "<think>\n6 * 7 = 42\n</think>\n\nThe answer is 42."
    cases = [right, "<think>\nit is 42\n</think>\n\nno idea", "<think>\nstill thinking about 42", "42",
             "Sure. <think>\nx\n</think>\n42", [{"role": "assistant", "content": right}]]
    assert REWARDS["think_format"](None, cases) == [0.5, 0.5, 0.0, 0.0, 0.0, 0.5]
    assert REWARDS["think_correctness"](None, cases, answer=["42"] * 6) == [2.0, 0.0, 0.0, 0.0, 2.0, 2.0]
