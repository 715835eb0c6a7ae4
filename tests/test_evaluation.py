"""The held-out numbers (evaluation.py): the trainer's own rewards and weights, strict and lenient
accuracy with Wilson intervals, and the table that says whether the intervals overlap."""
import json

import pytest

from conftest import run_cli
from lowvram_grpo.backends.base import Completion
from lowvram_grpo.config import load_config
from lowvram_grpo.evaluation import format_table, intervals_overlap, score, wilson_interval
from lowvram_grpo.rewards import xml_formatted

MY_REWARDS = '''
def my_reward(prompts, completions, answer=None, completion_ids=None, trainer_state=None, **kwargs):
    """0.25 per completion; uses the keywords TRL passes, so a missing one fails here."""
    assert len(answer) == len(completions) == len(completion_ids) and trainer_state.global_step >= 0
    return [0.25 for c in completions]
'''


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0)])
def test_wilson_interval_matches_published_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got[0] == pytest.approx(lo, abs=1e-4) and got[1] == pytest.approx(hi, abs=1e-4)


def _rows_and_texts():
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": a, "solution": ""}
            for i, a in enumerate(["17", "0.75", "5", "9"])]
    texts = [
        xml_formatted("12 + 5 = 17", "17"),               # strict and lenient right
        xml_formatted("three quarters", "3/4"),           # a fraction against a decimal gold: right
        "Ava has 2 + 3 = 5 apples.",                      # no format: lenient right, strict wrong
        xml_formatted("4 + 4 = 8", "8"),                  # well formed, wrong
    ]
    return rows, [Completion(t, 10) for t in texts]


def test_score_strict_lenient_and_intervals():
    config = load_config("tiny", ["rewards.names=[correctness, soft_format]", "rewards.weights=[1.0, 2.0]"])
    rows, generated = _rows_and_texts()
    result = score(rows, generated, config)
    assert result["accuracy_strict"] == 0.5 and result["strict_correct"] == [1, 1, 0, 0]
    assert result["accuracy_lenient"] == 0.75 and result["lenient_correct"] == [1, 1, 1, 0]
    assert result["accuracy_strict_ci"] == pytest.approx(list(wilson_interval(2, 4)))
    assert result["format_rate"] == 0.75
    # weights as the trainer uses them: correctness 2.0 on 2 of 4, soft_format 0.5 x 2.0 on 3 of 4
    assert result["reward_mean"] == pytest.approx((2 * 2.0 + 3 * 1.0) / 4)


def test_score_uses_a_reward_files_functions_and_weights(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text(MY_REWARDS)
    config = load_config("tiny", [f"rewards.module={module}", "rewards.names=[correctness, my_reward]",
                                  "rewards.weights=[1.0, 2.0]"])
    rows, generated = _rows_and_texts()
    assert score(rows, generated, config)["reward_mean"] == pytest.approx((2.0 + 2.0 + 0 + 0) / 4 + 0.5)


def test_table_prints_intervals_and_says_whether_they_overlap():
    def row(strict, lenient, n=200):
        return {"reward_mean": 1.0, "accuracy_strict": strict / n, "accuracy_strict_ci": list(wilson_interval(strict, n)),
                "accuracy_lenient": lenient / n, "accuracy_lenient_ci": list(wilson_interval(lenient, n)),
                "format_rate": 1.0, "mean_completion_tokens": 30.0, "n": n}
    before, primed, after = row(0, 40), row(40, 60), row(90, 70)
    table = format_table(before, after, primed)
    assert "0.450 [0.38, 0.52]" in table and "(200 held-out questions; [95% Wilson interval])" in table
    assert "accuracy_strict primed -> after (GRPO's own change): +0.250; the 95% intervals do not overlap" in table
    assert "accuracy_lenient primed -> after (GRPO's own change): +0.050; the 95% intervals overlap" in table
    assert not intervals_overlap((0.1, 0.2), (0.21, 0.3)) and intervals_overlap((0.1, 0.2), (0.2, 0.3))


def test_the_readme_reward_file_example_trains_and_evaluates(tmp_path):
    """README: --set rewards.module=my_rewards.py --set "rewards.names=[correctness, my_reward]", with the
    before/after measurement on (it used to train, then die with KeyError: 'my_reward')."""
    module = tmp_path / "my_rewards.py"
    module.write_text(MY_REWARDS)
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", f"rewards.module={module}",
                   "--set", "rewards.names=[correctness, my_reward]", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for side in ("before", "after"):
        numbers = summary[side]
        assert {"accuracy_strict", "accuracy_lenient", "accuracy_strict_ci", "accuracy_lenient_ci"} <= numbers.keys()
        # my_reward pays 0.25 to every completion; correctness 2.0 to each right one
        right = round((numbers["reward_mean"] - 0.25) * numbers["n"] / 2.0)
        assert numbers["reward_mean"] == pytest.approx(0.25 + 2.0 * right / numbers["n"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["rewards/my_reward/mean"] == pytest.approx(0.25) for row in metrics)
    assert "accuracy_strict" in proc.stdout and "held-out metric" in proc.stdout


def test_paired_change_counts_questions_that_flipped_and_its_mcnemar_p():
    from lowvram_grpo.evaluation import mcnemar_p, paired_change

    start = {"strict_correct": [1, 0, 0, 0, 1, 0], "lenient_correct": [1, 1, 0, 0, 1, 0]}
    end = {"strict_correct": [1, 1, 1, 0, 0, 1], "lenient_correct": [1, 1, 0, 0, 1, 0]}
    assert paired_change(start, end, "accuracy_strict") == (3, 1, pytest.approx(0.625))  # 2 * P(X <= 1), X ~ Bin(4, 1/2)
    assert paired_change(start, end, "accuracy_lenient") == (0, 0, 1.0)
    assert paired_change({}, end, "accuracy_strict") is None
    assert mcnemar_p(10, 0) == pytest.approx(2 / 1024) and mcnemar_p(5, 5) == 1.0


def test_the_table_reports_the_paired_change_when_verdicts_are_there():
    def row(verdicts):
        n, k = len(verdicts), sum(verdicts)
        return {"reward_mean": 0.0, "accuracy_strict": k / n, "accuracy_strict_ci": list(wilson_interval(k, n)),
                "accuracy_lenient": k / n, "accuracy_lenient_ci": list(wilson_interval(k, n)), "format_rate": 1.0,
                "mean_completion_tokens": 1.0, "n": n, "strict_correct": verdicts, "lenient_correct": verdicts}
    table = format_table(row([0] * 20), row([1] * 12 + [0] * 8), row([0] * 20))
    assert "paired over the same 20 questions: 12 newly right, 0 newly wrong (McNemar p < 0.001)" in table
