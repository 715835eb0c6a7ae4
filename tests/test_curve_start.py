"""Issue 67, the held-out curve's step 0, on real tiny runs: before GRPO's first step the adapter GRPO starts from
(here the primed adapter) is measured on the validation questions like every later point, kept in curve_start.json
(metrics.jsonl keeps one row a GRPO step); it is a point like the others, so where GRPO never beats it best_adapter/ is
the primed adapter (step 0) and the summary and the report say so; a run resumed from a GRPO checkpoint without a step 0
measures it from primed_adapter/; the curve's plot starts at step 0 on an axis through 0, and the trackers get step 0
too."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.report.run_dir import RunDir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
# Priming, then GRPO steps whose learning rate is too small to move a weight (the config refuses 0): every point of the
# curve ties with step 0, the earliest step, which the best adapter then is.
FLAT = ["--preset", "tiny", "--max-steps", "4", "--set", "prime.steps=2", "--set", "prime.batch_size=2",
        "--set", "train.learning_rate=1e-12", "--set", "eval.every_steps=2", "--set", "eval.validation_size=4",
        "--set", "train.save_steps=2"]
NUMBERS = ("validation/accuracy_strict", "validation/accuracy_lenient", "validation/reward_mean",
           "validation/format_rate", "validation/mean_completion_tokens", "validation/n")

# Measures primed_adapter/ of the run in argv[1] on its validation questions, as validation.py measures a point
# (greedy, the run's eval settings), in a fresh process: prints the metrics keys as JSON.
MEASURE = """
import json, sys
from pathlib import Path
from lowvram_grpo.evaluate.evaluation import generate_answers, score
from lowvram_grpo.model.backends import load_model, prepare_backend
from lowvram_grpo.report.run_dir import RunDir
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve
from lowvram_grpo.task.data import load_questions, to_prompt_rows, validation_questions
from lowvram_grpo.training.validation import logged_numbers
out = Path(sys.argv[1])
config = RunDir(out).read_config()
resolved = resolve(config, detect(), "hf")
prepare_backend(resolved.backend)
handle = load_model(resolved, log=lambda *a: None)
train, held_out = load_questions(config.data)
_, questions = validation_questions(config.data, train, held_out, config.eval.validation_size)
rows = to_prompt_rows(questions, resolved.plan.prompts.system_prompt)
answers = generate_answers(handle, rows, resolved.plan.eval, handle.load_lora(out / "primed_adapter"))
print(json.dumps(logged_numbers(score(rows, answers, resolved.plan.eval, tokenizer=handle.tokenizer))))
"""


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    out = tmp_path_factory.mktemp("flat") / "run"
    proc = run_cli(*FLAT, "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_step_0_is_the_primed_adapter_measured_before_grpo(flat, tmp_path):
    out, proc = flat
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one row a GRPO step: step 0 is kept beside them
    start = RunDir(out).read_curve_start()
    assert start is not None and start["step"] == 0 and start["start"] == "primed", start
    assert set(NUMBERS) <= set(start) and start["validation/n"] == 4
    # measured before GRPO's first step, after priming and its held-out measurement
    log = proc.stdout
    assert log.index("(primed;") < log.index("held-out curve: step 0 (the primed adapter, before GRPO)") < \
        log.index("GRPO as the trainer runs it")
    # the very numbers primed_adapter/ gets on the validation questions, measured on its own
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    measured = subprocess.run([sys.executable, str(script), str(out)], cwd=REPO, capture_output=True, text=True,
                              timeout=600, env={**os.environ, **ENV})
    assert measured.returncode == 0, measured.stderr[-3000:]
    numbers = json.loads(measured.stdout.strip().splitlines()[-1])
    assert {k: start[k] for k in NUMBERS} == pytest.approx(numbers, abs=1e-9)


def test_best_adapter_is_the_primed_adapter_when_grpo_never_beats_it(flat):
    out, proc = flat
    start = RunDir(out).read_curve_start()
    points = [r for r in _rows(out / "metrics.jsonl") if "validation/accuracy_strict" in r]
    assert [r["step"] for r in points] == [2, 4]
    for row in points:  # GRPO moved nothing: every point ties with step 0, and the earliest wins
        assert {k: row[k] for k in NUMBERS} == {k: start[k] for k in NUMBERS}, row
    best = json.loads((out / "best_adapter" / "best_step.json").read_text())
    assert best["step"] == 0 and best["criterion"] == "validation/accuracy_strict"
    assert _same_weights(_weights(out / "best_adapter"), _weights(out / "primed_adapter"))
    summary = json.loads((out / "summary.json").read_text())
    facts = summary["best_adapter"]
    assert (facts["step"], facts["same_as_start"], facts["start"], facts["same_as_after"]) == (0, True, "primed", False)
    assert summary["best"] == summary["primed"]  # its held-out numbers: the primed column's, the same adapter
    assert "best_adapter/ is step 0, the primed adapter: GRPO never beat it" in proc.stdout
    report = (out / "report.md").read_text()
    section = report[report.index("## Held-out curve during GRPO"):].split("\n## ")[0]
    assert "step 0: 0.000, step 2: 0.000, step 4: 0.000" in section
    assert "Best: step 0 (accuracy_strict 0.000), the primed adapter: **GRPO never beat the adapter it started from" \
        in section and "`best_adapter/` is the primed adapter" in section
    assert "It is the primed adapter: its held-out numbers are the primed column's" in section


def test_the_curve_plot_starts_at_step_0_on_an_axis_through_0(flat):
    from lowvram_grpo.report.build import line_figure, plot_specs
    from lowvram_grpo.report.records import curve_rows

    out, _ = flat
    run = RunDir(out)
    rows, start, config = run.read_metrics(), run.read_curve_start(), run.read_config_raw()
    ax = line_figure(rows=curve_rows(start, rows), **plot_specs(rows, config, start)["validation"]).axes[0]
    assert list(ax.get_lines()[0].get_xdata()) == [0, 2, 4]  # step 0 drawn first
    assert ax.get_ylim()[0] <= 0 and ax.get_ylim()[1] >= 1  # accuracies on their whole scale
    assert "step 0: the primed adapter" in ax.get_xlabel()
    assert (out / "validation.png").is_file()
    # a mean reward (data without gold answers) between 0.44 and 0.47: drawn from 0, so a small change is small
    reward = [{"step": s, "validation/reward_mean": v} for s, v in ((24, 0.44), (48, 0.47))]
    begun = {"step": 0, "validation/reward_mean": 0.45, "start": "primed"}
    ax = line_figure(rows=curve_rows(begun, reward), **plot_specs(reward, {}, begun)["validation"]).axes[0]
    low, high = ax.get_ylim()
    assert low <= 0 < 0.47 <= high and list(ax.get_lines()[0].get_xdata()) == [0, 24, 48]


def test_a_resume_without_step_0_measures_it_from_the_primed_adapter(flat, tmp_path):
    """A run resumed from a GRPO checkpoint that has no step 0 (one started before the curve had it; here: killed after
    its last checkpoint, curve_start.json taken away) measures it from primed_adapter/, and keeps the best the same."""
    out, _ = flat
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    run = RunDir(copy)
    want = run.read_curve_start()
    (copy / "curve_start.json").unlink()
    summary = run.read_summary()
    run.write_summary({**summary, "status": "training"})  # as a run killed after its last checkpoint leaves it
    resumed = run_cli("--resume", str(copy), env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"held-out curve: step 0's point measured on resume from {copy / 'primed_adapter'}" in resumed.stdout
    got = run.read_curve_start()
    assert got is not None and {k: got[k] for k in NUMBERS} == {k: want[k] for k in NUMBERS}
    assert run.best_facts()["step"] == 0 and run.read_summary()["best_adapter"]["step"] == 0
    assert _same_weights(_weights(copy / "best_adapter"), _weights(copy / "primed_adapter"))


def _scalars(folder, tag: str) -> list[tuple[int, float]]:
    """[(step, value)] of `tag` in the TensorBoard event files under `folder` (TFRecords of tensorboardX's Event
    protos: length, its CRC, the record, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            found += [(event.step, value.simple_value) for value in event.summary.value if value.tag == tag]
    return found


def test_the_trackers_get_step_0_too(tmp_path):
    """TensorBoard (a `report_to` tracker) gets step 0 as GRPO step 0's log, then the later points in their steps'."""
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "4", "--set", "eval.every_steps=2", "--set",
                   "eval.validation_size=4", "--set", "train.report_to=tensorboard", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = RunDir(out).read_curve_start()
    strict = _scalars(out, "train/validation/accuracy_strict")
    assert [step for step, _ in strict] == [0, 2, 4], strict
    assert strict[0][1] == pytest.approx(start["validation/accuracy_strict"])
    reward = _scalars(out, "train/validation/reward_mean")
    assert reward[0] == (0, pytest.approx(start["validation/reward_mean"]))
