"""The held-out numbers (evaluation.py): the trainer's own rewards and weights, strict and lenient
accuracy with Wilson intervals, and the table that says whether the intervals overlap."""
import json

import pytest

from conftest import run_cli
from lowvram_grpo.settings.plans import run_plan
from lowvram_grpo.model.handle import Completion
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.evaluate.evaluation import format_table, intervals_overlap, score, wilson_interval
from lowvram_grpo.task.rewards import xml_formatted

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
    result = score(rows, generated, run_plan(config).eval)
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
    assert score(rows, generated, run_plan(config).eval)["reward_mean"] == pytest.approx((2.0 + 2.0 + 0 + 0) / 4 + 0.5)


def test_table_prints_intervals_and_says_whether_they_overlap():
    def row(strict, lenient, n=200):
        return {"reward_mean": 1.0, "accuracy_strict": strict / n,
                "accuracy_strict_ci": list(wilson_interval(strict, n)),
                "accuracy_lenient": lenient / n, "accuracy_lenient_ci": list(wilson_interval(lenient, n)),
                "format_rate": 1.0, "mean_completion_tokens": 30.0, "n": n}
    before, primed, after = row(0, 40), row(40, 60), row(90, 70)
    table = format_table(before, after, primed)
    assert "0.450 [0.38, 0.52]" in table and "(200 held-out questions; [95% Wilson interval])" in table
    assert "accuracy_strict primed -> after (GRPO's own change): +0.250; the 95% intervals do not overlap" in table
    assert "accuracy_lenient primed -> after (GRPO's own change): +0.050; the 95% intervals overlap" in table
    assert not intervals_overlap((0.1, 0.2), (0.21, 0.3)) and intervals_overlap((0.1, 0.2), (0.2, 0.3))


@pytest.mark.slow
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
    from lowvram_grpo.evaluate.evaluation import mcnemar_p, paired_change

    start = {"strict_correct": [1, 0, 0, 0, 1, 0], "lenient_correct": [1, 1, 0, 0, 1, 0]}
    end = {"strict_correct": [1, 1, 1, 0, 0, 1], "lenient_correct": [1, 1, 0, 0, 1, 0]}
    # 2 * P(X <= 1), X ~ Bin(4, 1/2)
    assert paired_change(start, end, "accuracy_strict") == (3, 1, pytest.approx(0.625))
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


def test_the_protocol_is_greedy_by_default_and_is_said_in_words():
    from lowvram_grpo.evaluate.evaluation import protocol, protocol_label

    for preset in ("tiny", "smollm2_cpu", "llama8b_4bit"):
        described = protocol(run_plan(load_config(preset)).eval)
        assert described["decoding"] == "greedy" and described["temperature"] == 0
    assert protocol_label(protocol(run_plan(load_config("smollm2_cpu")).eval)) == "greedy decoding, up to 64 new tokens"
    sampled = protocol(run_plan(load_config("tiny", ["eval.temperature=0.8", "eval.samples=4"])).eval)
    assert protocol_label(sampled) == ("one answer sampled per question at T=0.8, top-p 0.95, seed 3407, up to 24 new "
                                       "tokens; mean@4 / pass@4 over 4 samples at T=0.8")
    assert protocol_label(None).startswith("protocol not recorded")


def test_mean_and_pass_at_k_from_k_samples_per_question():
    from lowvram_grpo.evaluate.evaluation import sampled_numbers

    rows = [{"prompt": [], "answer": "5"}, {"prompt": [], "answer": "7"}]
    right5, wrong = xml_formatted("2 + 3 = 5", "5"), xml_formatted("x", "1")
    got = sampled_numbers(rows, [right5, wrong, wrong, "so 7", wrong, wrong], k=3)
    assert got["strict_counts"] == [1, 0] and got["lenient_counts"] == [1, 1]
    assert got["strict_mean_at_k"] == pytest.approx(1 / 6) and got["strict_pass_at_k"] == 0.5
    assert got["lenient_mean_at_k"] == pytest.approx(1 / 3) and got["lenient_pass_at_k"] == 1.0
    assert got["strict_pass_at_k_ci"] == pytest.approx(list(wilson_interval(1, 2)))
    assert 0 <= got["lenient_mean_at_k_ci"][0] <= 1 / 3 <= got["lenient_mean_at_k_ci"][1] <= 1


def test_a_table_of_any_columns_has_the_sampled_rows_the_protocol_and_the_pairs():
    from lowvram_grpo.evaluate.evaluation import format_columns

    def column(verdicts, sampled=None):
        n, k = len(verdicts), sum(verdicts)
        return {"reward_mean": 0.0, "accuracy_strict": k / n, "accuracy_strict_ci": list(wilson_interval(k, n)),
                "accuracy_lenient": k / n, "accuracy_lenient_ci": list(wilson_interval(k, n)), "format_rate": 1.0,
                "mean_completion_tokens": 1.0, "n": n, "strict_correct": verdicts, "lenient_correct": verdicts,
                "protocol": {"decoding": "greedy", "temperature": 0.0, "max_tokens": 64, "batch_size": 8},
                **({"sampled": sampled} if sampled else {})}
    sampled = {"k": 4, **{f"{j}_{m}_at_k": 0.5 for j in ("strict", "lenient") for m in ("mean", "pass")}}
    named = [("base", column([0] * 10)), ("primed", column([1] * 4 + [0] * 6)),
             ("trained", column([1] * 9 + [0], sampled))]
    pairs = [("base", named[0][1], "trained", named[2][1]), ("primed", named[1][1], "trained", named[2][1])]
    table = format_columns(named, pairs)
    assert "protocol: greedy decoding, up to 64 new tokens" in table and "(change = trained - base)" in table
    assert "strict pass@4" in table and "lenient mean@4" in table
    assert "accuracy_strict primed -> trained: +0.500; " in table and "5 newly right, 0 newly wrong" in table
    other = dict(named[2][1],
                 protocol={"decoding": "sampled", "temperature": 0.8, "top_p": 0.95, "seed": 1, "max_tokens": 64})
    assert "measured under different protocols" in format_columns([named[0], ("x", other)], [])
