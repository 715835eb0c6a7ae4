"""What a newcomer reads at the end of a run (issue 44): report.md's warnings agree with its plots, the
samples show what GRPO changed (one of each kind, with the counts), summary.json carries the paired changes
the report shows, the run folder's README.md is our model card (not TRL's "[None]" one), and the log
projects the finish after a few steps.

One real tiny run (priming 2 steps, beta 0, 5 GRPO steps) is read by most tests: the random tiny model answers
nothing right, so its groups are all wrong by correctness on every step, the stretch the all-wrong warning is
for. Copies of its folder with an edited metrics.jsonl / summary.json, rebuilt with the report command, check
the other way round (no stretch: no warning) and that the report reads the stored paired changes. The
choosing, the stretches and the projection are also checked as pure functions on hand-made data."""
import json
import math
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.report import learning_signals as signals
from lowvram_grpo.evaluate.evaluation import paired_changes
from lowvram_grpo.report.build import (BETA_ZERO_LOSS, changed_headline, comparison_table, line_figure,
                                       main as report_main, plot_specs, what_changed)
from lowvram_grpo.training.grpo import compile_note, projection_due, projection_line

PRIME_STEPS, STEPS = 2, 5
ALL_WRONG_LINE = "groups all wrong (correctness), mean of last 5 steps"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("first-run") / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", str(STEPS), "--set", "train.beta=0",
                   "--set", f"prime.steps={PRIME_STEPS}", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _summary(folder):
    return json.loads((folder / "summary.json").read_text())


def _config(folder):
    import yaml

    return yaml.safe_load((folder / "config.yaml").read_text())


def _plotted_stretches(rows, config):
    """Where the clipped_ratio plot, as drawn, shows the all-wrong line at or above its own threshold line for
    STRETCH points in a row, and the steps it shades: read from the figure's artists, not from signals."""
    fig = line_figure(rows=rows, **plot_specs(rows, config)["clipped_ratio"])
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    line, threshold = lines[ALL_WRONG_LINE], lines[f"all-wrong warning threshold {signals.THRESHOLD}"]
    assert line.get_color() == threshold.get_color()  # the threshold is drawn in its own line's colour
    level = threshold.get_ydata()[0]
    above, run = [], []
    for x, y in list(zip(line.get_xdata(), line.get_ydata())) + [(None, math.nan)]:
        if not math.isnan(y) and y >= level:
            run.append(int(x))
            continue
        if len(run) >= signals.STRETCH:
            above.append((run[0], run[-1]))
        run = []
    shaded = sorted((round(p.get_x() + 0.5), round(p.get_x() + p.get_width() - 0.5)) for p in ax.patches
                    if p.get_facecolor()[:3] == threshold_rgb(threshold))
    return above, shaded


def threshold_rgb(line):
    from matplotlib.colors import to_rgb

    return to_rgb(line.get_color())


# ----------------------------------------------------------------------------- the all-wrong warning
def test_a_real_run_with_all_wrong_groups_warns_where_its_plot_shows_it(first_run):
    out, proc = first_run
    rows = _metrics(out)
    shares = [row[signals.ALL_WRONG_KEY] for row in rows]
    assert len(rows) == STEPS and min(shares) >= signals.THRESHOLD, shares  # the premise: a stretch of all-wrong groups
    stretches = signals.all_wrong_stretches(rows)
    assert (stretches and stretches == _plotted_stretches(rows, _config(out))[0]
            == _plotted_stretches(rows, _config(out))[1])
    report = (out / "report.md").read_text()
    first, last = stretches[0]
    assert f"- **all_wrong** (from step {first}):" in report and f"on steps {first}-{last}" in report
    # what to do, in settings this tool has, with this run's values
    assert f"`--set prime.steps={2 * PRIME_STEPS}`; this run primed {PRIME_STEPS} steps" in report
    assert "`--set data.max_operand=10`" in report  # tiny: data.max_operand 20
    assert "None: completions mostly finished" not in report
    live = [line for line in proc.stderr.splitlines() if "most groups were all wrong by correctness" in line]
    assert live and live[0].startswith(f"warning: step {first + signals.STRETCH - 1}:"), proc.stderr[-2000:]


@pytest.mark.parametrize("shares, warned", [([0.0, 0.0, 1.0, 0.0, 0.0], False), ([0.0, 1.0, 1.0, 1.0, 1.0], True),
                                            ([1.0, 0.0, 1.0, 0.0, 1.0], True)])
def test_the_rebuilt_report_warns_exactly_where_the_plot_is_at_or_above_the_threshold(first_run, tmp_path, shares,
                                                                                       warned):
    out, _ = first_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("adapter", "primed_adapter", "*checkpoint-*"))
    rows = _metrics(out)
    for row, share in zip(rows, shares):
        row[signals.ALL_WRONG_KEY] = share
    (copy / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert report_main([str(copy)]) == 0
    report = (copy / "report.md").read_text()
    plotted, shaded = _plotted_stretches(rows, _config(copy))
    assert plotted == shaded == signals.all_wrong_stretches(rows)
    assert bool(plotted) is warned
    assert ("**all_wrong**" in report) is warned
    for first, last in plotted:
        assert f"steps {first}-{last}" in report


def test_all_wrong_stretches_are_at_or_above_the_threshold_for_stretch_steps_in_a_row():
    def rows(values):
        return [{"step": i + 1, signals.ALL_WRONG_KEY: v} for i, v in enumerate(values)]

    at = [signals.THRESHOLD] * 6  # exactly on the line counts (the plot shows it on the line)
    assert signals.all_wrong_stretches(rows(at)) == [(2, 6)]  # the first step alone is never a mean
    assert signals.all_wrong_stretches(rows([1.0] * signals.STRETCH)) == []  # step 1 has no mean: one short
    assert signals.all_wrong_stretches(rows([1.0] * (signals.STRETCH + 1))) == [(2, signals.STRETCH + 1)]
    below = [signals.THRESHOLD - 0.01] * 8
    assert signals.all_wrong_stretches(rows(below)) == [] and signals.all_wrong(rows(below)) is None
    two = [1.0] * 6 + [0.0] * 8 + [1.0] * 8
    found = signals.all_wrong_stretches(rows(two))
    assert len(found) == 2 and found[0][0] == 2 and found[1][1] == len(two)
    message = signals.all_wrong(rows(two), 24, {"prime": {"steps": 0}, "data": {"dataset": None, "max_operand": 50}})
    assert "`--set prime.steps=20`; this run did not prime" in message and "data.max_operand=25" in message
    assert f"steps {found[0][0]}-{found[0][1]} and {found[1][0]}-{found[1][1]}" in message
    cut = [{**row, signals.CLIPPED_KEY: 0.9} for row in rows(two)]
    assert "train.max_completion_length=48" in signals.all_wrong(cut, 24)  # longer completions only when they are cut
    assert "max_completion_length" not in signals.all_wrong(rows(two), 24)
    assert signals.all_wrong(rows(two), 24, {"data": {"dataset": "my.jsonl"}}).count("easier --dataset") == 1
    # the report's replay dates it from the stretch's first step, and lists every stretch
    [replayed] = signals.scan(rows(two))
    assert (replayed.kind, replayed.step) == ("all_wrong", found[0][0]) and " and " in replayed.message


# ----------------------------------------------------------------------------- plots: thresholds, legends, loss
def test_every_legend_is_clear_of_its_title_and_axes_and_the_loss_is_captioned_at_beta_0(first_run):
    out, _ = first_run
    rows, config = _metrics(out), _config(out)
    assert config["train"]["beta"] == 0
    for name, spec in plot_specs(rows, config).items():
        fig = line_figure(rows=rows, **spec)
        if fig is None:
            # beta 0: TRL logs no KL; the held-out curve is off on the tiny preset (resolve's auto: its cost there)
            assert name in ("kl", "validation"), name
            continue
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(fig)  # laid out and drawn as savefig draws it
        canvas.draw()
        renderer = canvas.get_renderer()
        ax = fig.axes[0]
        title, frame = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
        for legend in fig.legends + ([ax.get_legend()] if ax.get_legend() else []):
            box = legend.get_window_extent(renderer)
            assert not box.overlaps(title) and not box.overlaps(frame), name
    assert plot_specs(rows, config)["loss"]["caption"] == BETA_ZERO_LOSS
    assert plot_specs(rows, {"train": {"beta": 0.04}})["loss"]["caption"] is None
    report = (out / "report.md").read_text()
    loss = report[report.index("### Loss"):]
    assert BETA_ZERO_LOSS in loss.split("\n## ")[0] and "TRL's GRPO loss is ~0 by construction" in loss


def test_each_threshold_has_its_own_lines_colour_and_a_name():
    rows = [{"step": i, signals.CLIPPED_KEY: 0.6, signals.ZERO_STD_KEY: 0.2, signals.ALL_RIGHT_KEY: 0.0,
             signals.ALL_WRONG_KEY: 0.7, "completions/max_length": 30, "completions/mean_length": 20}
            for i in range(1, 9)]
    config = {"train": {"max_completion_length": 32}}
    for name in ("clipped_ratio", "completion_length"):
        ax = line_figure(rows=rows, **plot_specs(rows, config)[name]).axes[0]
        labels = {line.get_label(): line.get_color() for line in ax.get_lines()}
        if name == "completion_length":
            assert labels["max_completion_length = 32"] == labels["max"]
            continue
        assert labels["truncation warning threshold 0.5 (above it)"] == labels[
            "completions cut at max_completion_length, mean of last 5 steps"]
        assert labels["all-equal warning threshold 0.5 (above it)"] == labels[
            "groups with all-equal rewards, mean of last 5 steps"]
        assert labels["all-wrong warning threshold 0.5"] == labels[ALL_WRONG_LINE]
        assert len({labels[k] for k in labels if "threshold" in k}) == 3


# ----------------------------------------------------------------------------- paired changes, stored once
def test_summary_holds_the_paired_changes_the_report_and_the_log_show(first_run, tmp_path):
    out, proc = first_run
    summary = _summary(out)
    stored = summary["paired_changes"]
    assert set(stored) == {"primed_to_after", "before_to_after"}
    assert stored == json.loads(json.dumps(paired_changes(summary["before"], summary["after"], summary["primed"])))
    report = (out / "report.md").read_text()
    for pair, label in (("primed_to_after", "primed -> after (GRPO's own change)"),
                        ("before_to_after", "before -> after")):
        for key, change in stored[pair].items():
            line = (f"{key} {label}: ")
            shown = (f"paired over the same {change['n']} questions: {change['newly_right']} newly right, "
                     f"{change['newly_wrong']} newly wrong (McNemar p = {change['mcnemar_p']:.3f})")
            assert any(l.startswith(f"- {line}") and shown in l for l in report.splitlines()), (line, shown)
            assert any(l.startswith(line) and shown in l for l in proc.stdout.splitlines()), (line, shown)
    # the report reads them from summary.json: an edited count there is what it shows
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("adapter", "primed_adapter", "*checkpoint-*"))
    summary["paired_changes"]["before_to_after"]["accuracy_strict"].update(newly_right=7, newly_wrong=3,
                                                                          mcnemar_p=0.34375)
    (copy / "summary.json").write_text(json.dumps(summary))
    assert report_main([str(copy)]) == 0
    assert "7 newly right, 3 newly wrong (McNemar p = 0.344)" in (copy / "report.md").read_text()


# ----------------------------------------------------------------------------- what GRPO changed, one of each
def test_the_run_ends_with_what_grpo_changed_counted_from_the_verdicts(first_run):
    out, proc = first_run
    summary = _summary(out)
    changed = summary["what_changed"]
    primed, after = summary["primed"]["strict_correct"], summary["after"]["strict_correct"]
    right = [i for i, (a, b) in enumerate(zip(primed, after)) if not a and b]
    wrong = [i for i, (a, b) in enumerate(zip(primed, after)) if a and not b]
    assert changed["start"] == "primed"  # priming ran: GRPO's own change
    assert (changed["turned_right"], changed["turned_wrong"], changed["n"]) == (len(right), len(wrong), len(after))
    assert changed_headline(changed) in proc.stdout
    assert f"GRPO turned {len(right)} right and {len(wrong)} wrong of {len(after)} held-out questions" in proc.stdout
    assert len(changed["examples"]) == 2 and len({e["index"] for e in changed["examples"]}) == 2
    for example, found, kind in zip(changed["examples"], (right, wrong), ("turned right", "turned wrong")):
        assert example["index"] == found[0] if found else example["kind"].startswith(f"none {kind}")
        assert example["correct"] == {s: summary[s]["strict_correct"][example["index"]]
                                      for s in ("before", "primed", "after")}
        assert f"[{example['kind']}] Q: {example['question']}" in proc.stdout
    report = (out / "report.md").read_text()
    assert changed_headline(changed) in report[report.index("## Sample answers"):]


def test_what_changed_shows_one_of_each_kind_never_a_success_alone():
    questions, golds = [f"q{i}" for i in range(6)], list(range(6))
    texts = {s: [f"{s}{i}" for i in range(6)] for s in ("before", "primed", "after")}
    before = {"strict_correct": [0, 0, 0, 0, 0, 0]}
    primed = {"strict_correct": [1, 0, 1, 0, 1, 0]}
    after = {"strict_correct": [0, 1, 1, 1, 1, 0]}
    changed = what_changed(questions, golds, texts, {"before": before, "primed": primed, "after": after})
    assert (changed["start"], changed["turned_right"], changed["turned_wrong"]) == ("primed", 2, 1)
    assert [(e["index"], e["kind"]) for e in changed["examples"]] == [(1, "turned right"), (0, "turned wrong")]
    assert changed["examples"][1]["texts"] == {"before": "before0", "primed": "primed0", "after": "after0"}
    assert changed_headline(changed).endswith("one of each:")
    # no priming: against the base model; only successes: the first question not shown stands in, labelled
    only_right = what_changed(questions, golds, texts, {"before": before, "primed": None, "after": after})
    assert only_right["start"] == "before" and (only_right["turned_right"], only_right["turned_wrong"]) == (4, 0)
    assert [(e["index"], e["kind"]) for e in only_right["examples"]] == [
        (1, "turned right"), (0, "none turned wrong; the first question not shown instead")]
    # only failures: the stand-in is not the failure shown
    only_wrong = what_changed(questions, golds, texts, {"before": primed, "primed": None, "after": before})
    assert [(e["index"], e["kind"]) for e in only_wrong["examples"]] == [
        (1, "none turned right; the first question not shown instead"), (0, "turned wrong")]
    # a resumed run keeps the verdicts but not the primed texts; no verdicts (no gold answers): nothing to choose
    resumed = what_changed(questions, golds, {"before": texts["before"], "primed": [], "after": texts["after"]},
                           {"before": before, "primed": primed, "after": after})
    assert resumed["examples"][0]["texts"]["primed"] is None
    assert what_changed(questions, golds, texts, {"before": {"n": 6}, "primed": None, "after": {"n": 6}}) is None


# ----------------------------------------------------------------------------- the model card
def test_the_run_folder_card_names_the_base_model_and_loads_the_adapter(first_run):
    out, proc = first_run
    card = (out / "README.md").read_text()
    summary = _summary(out)
    assert "huggingface.co/None" not in card and "None" not in card
    assert "builtin:tiny" in card and "preset `tiny`" in card
    assert "built-in arithmetic word problems" in card and "4 questions held out" in card
    assert comparison_table(summary) in card  # the held-out numbers, before / primed / after, as the report has them
    for pair, label in (("primed_to_after", "primed -> after"), ("before_to_after", "before -> after")):
        change = summary["paired_changes"][pair]["accuracy_strict"]
        assert (f"- accuracy_strict, {label}" in card and
                f"{change['newly_right']} newly right, {change['newly_wrong']} newly wrong of {change['n']} "
                "questions" in card)
    assert f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), '{out / 'adapter'}')" in card
    assert f"lowvram-grpo eval --adapter {out / 'adapter'}" in card and f"--init-adapter {out / 'adapter'}" in card
    assert f"card:    {out / 'README.md'}" in proc.stdout
    # the card's loading code runs as written (our text, not the model's) and gives the trained adapter
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    check = code + "\nprint(type(model).__name__, sorted(model.peft_config))\n"
    ran = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "PeftModelForCausalLM ['default']" in ran.stdout


# ----------------------------------------------------------------------------- the projected finish
def test_the_log_projects_the_finish_after_a_few_steps(first_run):
    out, proc = first_run
    lines = [line for line in proc.stdout.splitlines() if line.startswith("GRPO: ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert re.fullmatch(r"GRPO: 3 of 5 steps in \d+ s, ~\d+\.\d s/step after the first: projected to end at "
                        r"\d\d:\d\d \(~\d+ (s|min|h) more\) on this machine", lines[0]), lines[0]
    assert "includes compiling" not in proc.stdout  # a CPU compiles nothing


def test_projection_is_due_after_three_steps_or_a_tenth_and_counts_from_the_second_step():
    assert [d for d in range(1, 60) if projection_due(d, 48)][0] == 5  # 10% of 48, rounded up
    assert [d for d in range(1, 10) if projection_due(d, 4)] == [3]
    assert [d for d in range(1, 10) if projection_due(d, 3)] == []  # nothing left to project
    now = time.mktime((2026, 11, 26, 17, 23, 0, 0, 0, -1))
    line = projection_line(3, 48, 3, 74.0, 49.2, now)
    assert line == ("GRPO: 3 of 48 steps in 74 s, ~24.6 s/step after the first: projected to end at 17:41 "
                    "(~18 min more) on this machine")
    resumed = projection_line(13, 48, 3, 74.0, 49.2, now)
    assert resumed.startswith("GRPO: step 13 of 48, 3 steps in 74 s since the resume, ~24.6 s/step")


def test_the_compile_note_is_for_cuda_only():
    assert compile_note("cpu", True) is None and compile_note(None, False) is None
    assert compile_note("cuda", True).startswith("GRPO step 1 includes compiling unsloth's")
    assert ("TRL's Triton kernels" in compile_note("cuda", False, step=11)
            and "step 11" in compile_note("cuda", False, 11))
