"""GPU-only failures injected into real CPU runs at the point where they happen on a card
(tests/inject_failures.py): each must end as the README says, with one `error:` line that gives the
advice, exit code 1, the last checkpoint kept and complete, the command that goes on, and that command
must then finish the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.report.run_dir import RunDir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

RUN = ["--preset", "tiny", "--max-steps", "3", "--set", "train.save_steps=1"]


def run_with(failure: str, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tests" / "inject_failures.py"), failure, *RUN,
                           "--output-dir", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("failure, where", [
    ("oom-training", "in a training step"),
    ("oom-rollout", "while generating the GRPO rollouts"),
])
def test_an_out_of_memory_during_grpo_keeps_the_checkpoint_and_resume_finishes(tmp_path, failure, where):
    out = tmp_path / "run"
    proc = run_with(failure, out)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith(f"error: CUDA out of memory {where}; "), line
    checkpoint = RunDir(out).latest_checkpoint()
    assert checkpoint is not None and RunDir.is_complete(checkpoint)
    assert f"the last checkpoint is kept in {checkpoint}" in line
    # no plan on a CPU run: the knobs it names are not ones --resume may change
    assert "lower train.num_generations or train.max_completion_length" in line
    assert "start a new run with them lowered" in line
    assert json.loads((out / "summary.json").read_text())["status"] == "training"
    # the memory was there after all (another process had it): the same run goes on from the checkpoint
    resumed = run_cli("--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"


def test_an_out_of_memory_in_the_evaluation_after_training_keeps_the_adapter_and_resume_with_its_advice_finishes(
        tmp_path):
    out = tmp_path / "run"
    proc = run_with("oom-evaluation", out)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert line.startswith("error: CUDA out of memory in the held-out evaluation; set eval.batch_size=2 "
                           "(was 4); "), line
    assert f"the trained adapter is saved in {out / 'adapter'}" in line
    assert RunDir.is_complete(out / "checkpoint-3")
    command = line.split("then continue with: ", 1)[1]
    assert command == f"python -m lowvram_grpo.run --resume {out} --set eval.batch_size=2"
    resumed = run_cli(*command.split()[3:])  # the advised command, as written
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["after"]["n"] == 4
    assert "batch_size: 2" in (out / "config.yaml").read_text()  # what the resumed run ran with


def test_resume_refuses_a_setting_that_changes_the_training(tmp_path):
    proc = run_cli("--resume", str(tmp_path), "--set", "train.num_generations=2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --resume --set train.num_generations: a resumed run keeps its training "
                                  "settings; --resume may change only memory.gradient_checkpointing"), proc.stderr


@pytest.mark.parametrize("at_start, at_resume", [((), ("--export", "merged16")), (("--export", "merged16"), ())])
def test_a_resumed_run_writes_the_export_asked_at_resume_or_at_start(tmp_path, at_start, at_resume):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "inject_failures.py"), "oom-training", *RUN, *at_start,
                           "--output-dir", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and not (out / "export-merged16").exists(), proc.stderr[-3000:]
    resumed = run_cli("--resume", str(out), *at_resume)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    export = out / "export-merged16"
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors")), resumed.stdout[-2000:]
    assert f"exported (merged16): {export}" in resumed.stdout
