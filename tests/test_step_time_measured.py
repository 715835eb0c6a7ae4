"""The GRPO step time a run measures on its own machine (step_time.MeasuredStepTime, training/cadence.py) and what
follows it: the checkpoint cadence where train.save_steps is auto, the held-out curve's interval where
eval.every_steps is auto, the plan line and the progress line; and the run's own peak memory (peak_memory.py) in
summary.json, the report and the progress line's last words."""
import json
import re
import statistics
import subprocess
import sys

import pytest

from conftest import REPO
from lowvram_grpo.report.peak_memory import PeakMemory, peak_rss_bytes
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.settings.plans import run_plan
from lowvram_grpo.settings.step_time import MeasuredStepTime, checkpoint_cadence, curve_every


def test_the_measure_is_the_median_after_the_first_step_once_calibrated_and_follows_the_run():
    timer = MeasuredStepTime(planned=41.0, calibration=3)
    timer.add(30.0)  # the warm-up
    timer.add(10.0)
    assert not timer.measured and timer.seconds == 41.0 and timer.basis() == "estimated"
    timer.add(12.0)
    assert timer.measured and timer.seconds == 11.0 and timer.basis() == "measured over steps 2-3"
    for _ in range(10):  # the machine slows down: the window follows it
        timer.add(20.0)
    assert timer.seconds == 20.0 and timer.basis() == "measured over steps 6-13"
    resumed = MeasuredStepTime(planned=None, calibration=1, first_step=40)
    resumed.add(5.0)
    assert resumed.seconds == 5.0 and resumed.basis() == "measured over step 41"


def test_the_cadence_and_the_curve_from_measured_seconds():
    assert checkpoint_cadence(100.0, 48, 900, 10) == 9
    assert checkpoint_cadence(1.0, 48, 900, 10) == 48  # never past the run
    assert checkpoint_cadence(None, 48, 900, 10) == 10
    every, share = curve_every(48, 32, answer_seconds=0.1, step_seconds=10.0, budget=0.10)
    assert every == 4 and share == pytest.approx(13 * 32 * 0.1 / (48 * 10.0))  # step 0 + 12 points; every 3: 17, 0.113
    # step 0 and the last: 2 x 19.2 s against 480 s (every 24 would add a third point: 12%)
    assert curve_every(48, 32, answer_seconds=0.6, step_seconds=10.0, budget=0.10) == (48, pytest.approx(0.08))
    assert curve_every(48, 32, answer_seconds=5.0, step_seconds=1.0, budget=0.10)[0] == 0  # off: too dear


class _Validation:
    every = 4  # what the cadence reads and re-decides of validation.Validation


def _cadence(sets=(), planned=41.0, save_steps=21, validation=None, answer_seconds=None):
    from lowvram_grpo.training.cadence import MeasuredCadence

    now = [0.0]
    lines: list[str] = []
    plan = run_plan(load_config("smollm2_cpu", list(sets))).train
    cadence = MeasuredCadence(plan, planned, save_steps, validation, answer_seconds, log=lines.append,
                              clock=lambda: now[0])
    return cadence, now, lines


def _steps(cadence, now, seconds: list[float], state, control) -> list[int]:
    """Run GRPO steps of `seconds` through the callback's events; the steps at which it asked for a checkpoint."""
    saved = []
    for took in seconds:
        cadence.on_step_begin(None, state, control)
        now[0] += took
        cadence.on_optimizer_step(None, state, control)
        state.global_step += 1
        cadence.on_step_end(None, state, control)
        if control.should_save:
            saved.append(state.global_step)
            cadence.on_save(None, state, control)
            control.should_save = False
    return saved


def test_auto_checkpoints_follow_the_measured_step_and_the_plan_line_says_it():
    from transformers import TrainerControl, TrainerState

    cadence, now, lines = _cadence(["train.save_steps=null"])
    state, control = TrainerState(max_steps=48, save_steps=21), TrainerControl()
    cadence.on_train_begin(None, state, control)
    assert state.save_steps == 0  # transformers' fixed modulus is off: the measure decides
    saved = _steps(cadence, now, [300.0] + [100.0] * 20, state, control)
    assert cadence.save_steps == 9 and saved == [9, 18]  # 900 s / 100 s, not the planned 21 at ~41 s
    assert lines == ["GRPO step time: ~100.0 s a step, measured over steps 2-3 (planned ~41 s, estimated): checkpoint "
                     "every 9 GRPO step(s) (~15 min), planned 21"]
    assert cadence.fields() == {"s/step": "100.0 measured", "ckpt": "every 9"}
    facts = cadence.facts()
    assert facts["calibrated_s"] == 100.0 and facts["planned_s"] == 41.0 and facts["steps_s"][0] == 300.0


def test_an_explicit_save_steps_is_kept_and_the_line_says_what_it_spans():
    from transformers import TrainerControl, TrainerState

    cadence, now, lines = _cadence(["train.save_steps=12"], save_steps=12)
    state, control = TrainerState(max_steps=48, save_steps=12), TrainerControl()
    cadence.on_train_begin(None, state, control)
    assert state.save_steps == 12
    assert _steps(cadence, now, [100.0] * 12, state, control) == []  # transformers' own modulus saves, not this
    assert lines[0].endswith("checkpoint every 12 GRPO step(s) as set (train.save_steps), ~20 min at this time")


def test_an_auto_curve_is_re_decided_from_the_measured_step_and_answer():
    from transformers import TrainerControl, TrainerState

    validation = _Validation()
    cadence, now, lines = _cadence(["eval.every_steps=null", "eval.validation_size=32"], validation=validation,
                                   answer_seconds=5.0)
    state, control = TrainerState(max_steps=48), TrainerControl()
    cadence.on_train_begin(None, state, control)
    _steps(cadence, now, [10.0] * 3, state, control)  # 32 answers of 5 s against steps of 10 s: too dear
    assert validation.every == 0 and "held-out curve off from now" in lines[0]
    dearer = _Validation()  # every 4 costs 17% at 0.2 s an answer (step 0 + 12 points): every 8 (step 0 + 6, 9%) keeps
    # it under 10%; every 7 (step 0 + 7) would be 10.7%
    cadence, now, lines = _cadence(["eval.every_steps=null", "eval.validation_size=32"], validation=dearer,
                                   answer_seconds=0.2)
    _steps(cadence, now, [10.0] * 3, state, control)
    assert dearer.every == 8 and "held-out curve every 8 steps (planned every 4), measured 9% of GRPO's" in lines[0]
    cheap = _Validation()  # within the budget as planned: the plan's points stay, none added
    cadence, now, lines = _cadence(["eval.every_steps=null", "eval.validation_size=32"], validation=cheap,
                                   answer_seconds=0.01)
    _steps(cadence, now, [10.0] * 3, state, control)
    assert cheap.every == 4 and "held-out curve every 4 steps as planned, measured 1% of GRPO's time" in lines[0]
    fixed = _Validation()
    cadence, now, lines = _cadence(["eval.every_steps=4", "eval.validation_size=32"], validation=fixed,
                                   answer_seconds=5.0)
    _steps(cadence, now, [10.0] * 3, state, control)
    assert fixed.every == 4 and "held-out curve every 4 steps, measured 433% of GRPO's time" in lines[0]  # as asked


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_peak_is_named_by_the_phase_that_raised_it():
    peak = PeakMemory("loading")
    peak.enter("training")
    grow = max(0, peak_rss_bytes() - _rss_bytes()) + 64 * 1024 ** 2  # past the high-water mark so far
    block = bytearray(grow)
    block[::4096] = b"\x01" * len(block[::4096])  # touched: resident
    peak.enter("report")
    del block
    facts = peak.facts()
    assert facts["phase"] == "training" and facts["bytes"] == peak_rss_bytes() and facts["source"] == "ru_maxrss"
    assert peak.text() == f"peak {facts['bytes'] / 1024 ** 3:.2f} GiB (training)"


@pytest.mark.slow
def test_a_tiny_run_measures_its_step_within_25_percent_and_records_its_peak(tmp_path, tiny_model_dir):
    """The estimate after the first GRPO steps (the plan line's figure) against the steps measured after it, on the
    tiny preset; the run's peak in summary.json, the report and the progress line's last words."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lowvram_grpo.run", "--preset", "tiny", "--max-steps", "10", "--output-dir", str(out),
         "--set", "train.save_steps=null", "--set", "eval.enabled=false"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    step = summary["step_time"]
    later = statistics.median(step["steps_s"][3:])  # the steps after the calibration
    assert abs(step["calibrated_s"] - later) <= 0.25 * later, step
    assert f"GRPO step time: ~{step['calibrated_s']:.1f} s a step, measured over steps 2-3 (planned ~" in proc.stdout
    assert step["save_steps_auto"] and step["save_steps"] == checkpoint_cadence(step["measured_s"], 10, 900, 10)
    peak = summary["peak_rss"]
    assert 0.1 < peak["gib"] < 8 and peak["phase"] in ("loading", "training", "saving", "report", "starting")
    assert f"peak {peak['gib']:.2f} GiB ({peak['phase']})" in proc.stdout
    report = (out / "report.md").read_text()
    assert f"- Memory: peak {peak['gib']:.2f} GiB ({peak['phase']})" in report and "- GRPO step time: " in report
    bars = [line for line in re.split(r"[\r\n]", proc.stderr) if line.startswith("GRPO:") and "peak=" in line]
    assert bars and all(re.search(r", peak=[0-9.]+ GiB \(\w+\)\]$", bar) for bar in bars), bars[-1:]
    assert any("s/step=" in bar and "measured" in bar for bar in bars)
