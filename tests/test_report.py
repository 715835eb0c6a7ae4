"""The run report (report.md + PNG plots) and the training-signal warnings.

The warning checks are pure functions over metric rows, tested on hand-made rows; the report and the
live warning are tested on real tiny GRPO runs in fresh processes, one of them with
max_completion_length=4 so that (nearly) every completion is cut off."""
import json
import shutil
import subprocess
import sys

import pytest
from matplotlib.image import imread

from conftest import REPO, run_cli
from lowvram_grpo.report import learning_signals as signals
from lowvram_grpo.report.build import PLOT_FILES, main as report_main, write_report
from lowvram_grpo.report.run_dir import REPORT as REPORT_FILE


def rows_with(key, values, **extra):
    return [{"step": i + 1, key: v, **extra} for i, v in enumerate(values)]


# ----------------------------------------------------------------------------- warning checks
def test_truncation_warns_when_most_recent_completions_are_cut_and_says_what_to_do():
    message = signals.truncation(rows_with(signals.CLIPPED_KEY, [0.9, 1.0, 0.8]), max_completion_length=64)
    assert message and "90%" in message
    assert "train.max_completion_length=128" in message and "prime.steps" in message


@pytest.mark.parametrize("ratios", [[0.1, 0.2, 0.5], [1.0], [], [None, None, None]])
def test_truncation_is_quiet_for_few_cut_completions_a_single_step_or_no_data(ratios):
    assert signals.truncation(rows_with(signals.CLIPPED_KEY, ratios), 64) is None


def test_truncation_looks_at_the_recent_window_only():
    recovered = [1.0] * 6 + [0.0] * signals.WINDOW
    assert signals.truncation(rows_with(signals.CLIPPED_KEY, recovered)) is None
    # ... but the replay over the whole log still reports that it happened, from the step it first held
    found = signals.scan(rows_with(signals.CLIPPED_KEY, recovered))
    assert [(s.kind, s.step) for s in found] == [("truncated", 2)]


def test_no_signal_warns_when_most_groups_have_all_equal_rewards():
    message = signals.no_signal(rows_with(signals.ZERO_STD_KEY, [1.0, 1.0, 0.75]))
    assert message and "all-equal rewards" in message and "num_generations" in message
    assert signals.no_signal(rows_with(signals.ZERO_STD_KEY, [0.25, 0.5])) is None


def test_flat_reward_needs_the_full_run_of_unchanged_steps():
    flat = [0.0] * signals.FLAT_STEPS
    message = signals.flat_reward(rows_with("reward", flat))
    assert message and "0.000" in message and "priming" in message
    assert signals.flat_reward(rows_with("reward", flat[1:])) is None
    assert signals.flat_reward(rows_with("reward", flat[:-1] + [0.2])) is None
    assert "learning_rate" in signals.flat_reward(rows_with("reward", [0.7] * signals.FLAT_STEPS))


def test_monitor_reports_each_kind_once():
    monitor = signals.SignalMonitor(max_completion_length=24)
    row = {signals.CLIPPED_KEY: 1.0, signals.ZERO_STD_KEY: 1.0, "reward": 0.0}
    first = [monitor.add({"step": i, **row}) for i in range(1, 4)]
    assert first[0] == []  # one step alone is not a pattern
    assert sorted(s.kind for s in first[1]) == ["no_signal", "truncated"]
    assert first[2] == []
    later = [monitor.add({"step": i, **row}) for i in range(4, 4 + signals.FLAT_STEPS)]
    assert [s.kind for batch in later for s in batch] == ["flat_reward"]


# ----------------------------------------------------------------------------- report from hand-made files
@pytest.mark.slow
def test_report_of_an_unfinished_run_without_kl(tmp_path):
    """No summary.json (the run stopped) and beta 0 (TRL logs no KL): the report says so, plots what exists."""
    rows = [{"step": i, "reward": 0.0, "loss": 0.0, "rewards/correctness/mean": 0.0, signals.CLIPPED_KEY: 1.0,
             signals.ZERO_STD_KEY: 1.0, "completions/mean_length": 64.0} for i in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("preset: x\ntrain:\n  beta: 0.0\n  max_completion_length: 64\n")
    text = write_report(tmp_path).read_text()
    assert "The run did not finish" in text
    # the summary.json written while training (before numbers only) is not taken for a finished run
    (tmp_path / "summary.json").write_text(json.dumps({"status": "training", "before": {"reward_mean": 0.1}}))
    text = write_report(tmp_path).read_text()
    assert "The run did not finish" in text and "evaluation was off" not in text
    assert "Not logged: train.beta = 0" in text
    assert not (tmp_path / "kl.png").exists()
    for kind in ("truncated", "no_signal", "flat_reward"):
        assert f"**{kind}**" in text
    assert (tmp_path / "reward.png").is_file() and "![Reward per step](reward.png)" in text


# ----------------------------------------------------------------------------- the before/after table
def _measured(strict, lenient, n=200):
    from lowvram_grpo.evaluate.evaluation import wilson_interval

    return {"reward_mean": 1.0, "accuracy_strict": strict / n, "accuracy_strict_ci": list(wilson_interval(strict, n)),
            "accuracy_lenient": lenient / n, "accuracy_lenient_ci": list(wilson_interval(lenient, n)),
            "format_rate": 1.0, "mean_completion_tokens": 30.0, "n": n}


def test_the_table_shows_both_accuracies_with_intervals_and_whether_they_overlap():
    from lowvram_grpo.report.build import comparison_table

    markdown = comparison_table({"before": _measured(0, 40), "primed": _measured(40, 60), "after": _measured(90, 70)})
    assert "| accuracy_strict | 0.000 [0.00, 0.02] | 0.200 [0.15, 0.26] | 0.450 [0.38, 0.52] | +0.450 |" in markdown
    assert "| accuracy_lenient | 0.200 [0.15, 0.26] | 0.300 [0.24, 0.37] | 0.350 [0.29, 0.42] | +0.150 |" in markdown
    assert "- accuracy_strict primed -> after (GRPO's own change): +0.250; the 95% intervals do not overlap" in markdown
    assert "- accuracy_lenient primed -> after (GRPO's own change): +0.050; the 95% intervals overlap" in markdown


def test_an_old_summary_without_the_new_fields_still_renders():
    from lowvram_grpo.report.build import comparison_table

    old = {"reward_mean": 1.0, "accuracy": 0.5, "format_rate": 1.0, "mean_completion_tokens": 3.0, "n": 4}
    assert "| accuracy_strict | - | - | - |" in comparison_table({"before": old, "after": old})


# ----------------------------------------------------------------------------- real tiny runs
@pytest.mark.slow
def test_a_tiny_run_writes_report_and_plots(tiny_run):
    out, proc = tiny_run
    text = (out / REPORT_FILE).read_text()
    assert "| held-out metric | before (base) | after (GRPO) | change |" in text
    assert ("| reward_mean |" in text and "| accuracy_lenient |" in text and "## Sample answers" in text
            and "## Training-signal warnings" in text)
    for name in PLOT_FILES:  # tiny has beta > 0, so KL is logged too
        image = imread(out / name)
        assert image.shape[0] > 300 and image.shape[1] > 600, name
        assert f"]({name})" in text
    assert f"report:  {out / REPORT_FILE}" in proc.stdout
    assert "by construction" not in text  # beta 0.04: no "~0 loss is expected" caption (test_first_run_outputs: beta 0)
    card = (out / "README.md").read_text()  # our model card, over the one TRL's trainer wrote
    assert "builtin:tiny" in card and "huggingface.co/None" not in card
    # per-reward-function lines: TRL logs rewards/<name>/mean for each configured reward
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/brevity/mean", "completions/clipped_ratio", "frac_reward_zero_std", "kl"} <= metrics[0].keys()


@pytest.mark.slow
def test_report_cli_rebuilds_the_report(tiny_run, tmp_path):
    out, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("adapter", "checkpoint-*", "*.png", REPORT_FILE))
    assert report_main([str(copy)]) == 0
    assert (copy / REPORT_FILE).read_text() == (out / REPORT_FILE).read_text().replace(str(out), str(copy))
    assert all((copy / name).is_file() for name in PLOT_FILES)


def test_the_report_shows_the_sampler_against_the_trainer_where_the_run_logged_it(tiny_run, tmp_path):
    """train.is_correction on (vLLM rollouts, our decode loop): TRL 1.15 (and unsloth's loss) log sampling/* per
    step, which metrics.jsonl keeps like every number; the report tables the first and last steps' means. The tiny
    run (our decode loop: the correction on by default) has the section; its rows without them have none. The real
    runs: tests/test_sampler_gap.py, tests/test_vllm_engine.py."""
    out, _ = tiny_run
    assert "## Sampler vs trainer (importance sampling)" in (out / REPORT_FILE).read_text()
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("adapter", "checkpoint-*", "*.png", REPORT_FILE))
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("sampling/")}
            for line in (copy / "metrics.jsonl").read_text().splitlines()]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_main([str(copy)]) == 0
    assert "Sampler vs trainer (importance" not in (copy / REPORT_FILE).read_text()
    assert not (copy / "sampler_gap.png").exists()
    for i, row in enumerate(rows):  # the keys as trl/trainer/grpo_trainer.py logs them
        row.update({"sampling/sampling_logp_difference/mean": 0.03 + 0.001 * i,
                    "sampling/sampling_logp_difference/max": 0.9,
                    "sampling/importance_sampling_ratio/min": 0.5, "sampling/importance_sampling_ratio/mean": 1.01,
                    "sampling/importance_sampling_ratio/max": 2.5})
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report_main([str(copy)]) == 0
    text = (copy / REPORT_FILE).read_text()
    assert "## Sampler vs trainer (importance sampling)" in text
    assert "| abs(trainer - sampler) log-prob of a token, mean (nats) | 0.0300 |" in text
    assert "of 3 logged steps above the threshold 0.1" in text and (copy / "sampler_gap.png").is_file()
    assert "| importance-sampling ratio, mean | 1.0100 | 1.0100 |" in text


def run_report_cli(*args):
    return subprocess.run([sys.executable, "-m", "lowvram_grpo.report", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_report_cli_bad_dirs_give_one_error_line_and_write_nothing(tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {str(tmp_path / "missing"): "does not exist", str(empty): "no metrics.jsonl",
             str(damaged): "line 2 is not JSON"}
    for run_dir, expected in cases.items():
        proc = run_report_cli(run_dir)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert sorted(p.name for p in damaged.iterdir()) == ["metrics.jsonl"]
    assert sorted(p.name for p in empty.iterdir()) == []
    proc = run_report_cli()
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_truncated_run_warns_during_the_run_and_in_the_report(tmp_path):
    """Acceptance: a run whose completions are (nearly) all cut off shows the truncation warning."""
    out = tmp_path / "cut"
    proc = run_cli("--preset", "tiny", "--max-steps", "3", "--set", "train.max_completion_length=4",
                   "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    clipped = [row["completions/clipped_ratio"] for row in metrics]
    assert sum(clipped) / len(clipped) > 0.5, clipped  # the premise: most completions really were cut
    warning = [line for line in proc.stderr.splitlines() if "warning: step" in line]
    assert warning and "cut off at train.max_completion_length=4" in warning[0], proc.stderr[-2000:]
    assert "train.max_completion_length=8" in warning[0] and "prime.steps" in warning[0]
    report = (out / REPORT_FILE).read_text()
    assert "- **truncated** (from step 2):" in report and "cut off at train.max_completion_length=4" in report


# ----------------------------------------------------------------------------- which way the all-equal groups are
def test_the_all_equal_warning_says_which_way_and_what_to_do():
    all_wrong = rows_with(signals.ZERO_STD_KEY, [0.9, 0.8, 0.9],
                          **{signals.ALL_WRONG_KEY: 0.8, signals.ALL_RIGHT_KEY: 0.05})
    message = signals.no_signal(all_wrong)
    assert "Most are all wrong" in message and "prime.steps" in message and "partial-credit" in message
    assert "num_generations" not in message
    all_right = rows_with(signals.ZERO_STD_KEY, [0.9, 0.8, 0.9],
                          **{signals.ALL_WRONG_KEY: 0.0, signals.ALL_RIGHT_KEY: 0.8})
    message = signals.no_signal(all_right)
    assert "Most are all right (80% of groups" in message and "prime.steps" not in message
    assert "data.max_operand" in message and "train.num_generations" in message and "train.temperature" in message
    unknown = signals.no_signal(rows_with(signals.ZERO_STD_KEY, [0.9, 0.8]))  # a run without the correctness reward
    assert "if they are all wrong" in unknown and "if they are all right" in unknown


def test_moving_average_is_the_trailing_mean():
    assert signals.moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert signals.moving_average([], window=3) == []


def test_the_progress_bar_shows_reward_its_average_signal_and_kl_not_the_loss():
    import collections

    from lowvram_grpo.training.grpo import progress_fields

    recent = collections.deque(maxlen=3)
    for reward in (1.0, 2.0, 3.0):
        fields = progress_fields({"reward": reward, "loss": 0.0, signals.ZERO_STD_KEY: 0.25, "kl": 0.01}, recent,
                                 beta=0.04)
    assert fields == {"reward": "3.000", "avg3": "2.000", "signal": "75% of groups", "kl": "0.0100"}
    fields = progress_fields({"reward": 5.0, signals.ZERO_STD_KEY: 0.5, "kl": 0.0}, recent, beta=0.0)
    assert fields == {"reward": "5.000", "avg3": "3.333", "signal": "50% of groups"}  # beta 0: no KL


def test_correctness_logs_the_share_of_all_right_and_all_wrong_groups():
    from lowvram_grpo.task.rewards import REWARDS, xml_formatted
    from lowvram_grpo.training.grpo import with_group_outcomes

    funcs = with_group_outcomes([REWARDS["xmlcount"], REWARDS["correctness"]], group_size=2)
    assert funcs[0] is REWARDS["xmlcount"] and funcs[1].__name__ == "correctness"
    logged = {}
    right, wrong = xml_formatted("1 + 1 = 2", "2"), xml_formatted("1 + 1 = 3", "3")
    scores = funcs[1](prompts=[[]] * 6, completions=[right, right, wrong, wrong, right, wrong], answer=["2"] * 6,
                      log_metric=lambda name, value: logged.__setitem__(name, value))
    assert scores == [2.0, 2.0, 0.0, 0.0, 2.0, 0.0]
    assert logged == {signals.ALL_RIGHT_KEY: pytest.approx(1 / 3), signals.ALL_WRONG_KEY: pytest.approx(1 / 3)}
