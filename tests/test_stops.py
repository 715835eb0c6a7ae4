"""Stops in every phase (stops.py), in real processes with real signals sent from outside, as a shell or a
scheduler sends them: SIGINT / SIGTERM / SIGHUP in loading, measuring (before, primed, after), priming, GRPO,
saving, exporting, the report, and the `eval` and `baseline` commands. Each stop is one `error:` line with
what is kept and the command that goes on, exit 128 + signal, no process left behind, the folder not locked;
the command it prints goes on to the end. A priming stopped (or killed) and resumed ends with the adapter an
unbroken priming ends with, bit for bit.

A run is held in a phase by a small driver script that pauses one call of that phase for a few seconds (the
signal lands during the pause; the code under test is the unmodified package, which then has to reach its
next safe point on its own); priming and GRPO are long enough by themselves and are caught by the
checkpoints they write. Children start in a session of their own with SIGINT/SIGTERM/SIGHUP at their
defaults (a script's background job would otherwise start with SIGINT ignored)."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_same_adapter, run_cli
from lowvram_grpo.model.lora_io import check_adapter_dir
from lowvram_grpo.report.run_dir import RunDir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TINY = ["--preset", "tiny", "--max-steps", "2"]
NO_EVAL = ["--set", "eval.enabled=false"]


def stopped_by(*names: str):
    """The signals a phase is stopped by. core/stops.py turns SIGINT, SIGTERM and SIGHUP into the same StopRequested
    through one handler, so each phase takes one of them (each signal seen in several phases, its exit code and name
    checked every time) and GRPO, where TRL's trainer runs between our safe points, takes SIGINT and SIGTERM both."""
    return pytest.mark.parametrize("signum", [getattr(signal, n) for n in names], ids=list(names))


# Pauses the PAUSE_CALL-th call of PAUSE_AT (module:function) for PAUSE_SECONDS after touching MARKER, then
# runs DRIVE (lowvram_grpo.run.cli or lowvram_grpo.baseline) with the command line's arguments.
DRIVER = """
import importlib, os, sys, time
from pathlib import Path
target = os.environ.get("PAUSE_AT")
if target:
    module_name, attr = target.split(":")
    module = importlib.import_module(module_name)
    original, calls = getattr(module, attr), [0]
    def paused(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ.get("PAUSE_CALL", "1")):
            Path(os.environ["MARKER"]).touch()
            time.sleep(float(os.environ.get("PAUSE_SECONDS", "4")))
        return original(*args, **kwargs)
    setattr(module, attr, paused)
main = importlib.import_module(os.environ.get("DRIVE", "lowvram_grpo.run.cli")).main
sys.exit(main(sys.argv[1:]))
"""


def _default_signals():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(argv, tmp_path, env=None):
    """A child in a session (and process group) of its own, signals at their defaults; stdout/stderr to files."""
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=err, env={**os.environ, **ENV, **(env or {})},
                            start_new_session=True, preexec_fn=_default_signals)
    out.close()
    err.close()
    return proc


def _wait_for(path, proc, seconds=300):
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, (
            f"the run ended (rc {proc.returncode}) before reaching the phase: "
            f"{(path.parent / 'stderr.txt').read_text()[-2000:] if (path.parent / 'stderr.txt').exists() else ''}")
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _stop(proc, tmp_path, signum, ready):
    """Send `signum` once `ready` exists; the run's stderr, its one error line, after checking exit code and
    processes."""
    try:
        _wait_for(ready, proc)
        os.kill(proc.pid, signum)  # from outside, to the process, as `kill` / a scheduler does
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 128 + signum, stderr[-3000:]
    with pytest.raises(ProcessLookupError):  # nothing of the run's process group is left
        os.killpg(proc.pid, 0)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith(f"error: stopped by {signal.Signals(signum).name}"), errors[0]
    return errors[0]


def _paused(tmp_path, argv, target, call=1, drive="lowvram_grpo.run.cli", seconds=3):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    marker = tmp_path / "paused"
    env = {"PAUSE_AT": target, "PAUSE_CALL": str(call), "MARKER": str(marker), "DRIVE": drive,
           "PAUSE_SECONDS": str(seconds)}
    return _start([sys.executable, str(script), *argv], tmp_path, env), marker


def _goes_on(line: str, expected_prefix: str, env=None) -> subprocess.CompletedProcess:
    """Run the command the error line gives (after `expected_prefix`), with this interpreter."""
    command = line.split(expected_prefix, 1)[1].strip()
    argv = shlex.split(command)
    assert argv[0] == "python", command
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ENV, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _resumed(line: str, out) -> subprocess.CompletedProcess:
    assert line.endswith(f"Continue with: python -m lowvram_grpo.run --resume {out}"), line
    assert RunDir(out).locked_by() is None
    proc = _goes_on(line, "Continue with:")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete"
    check_adapter_dir(out / "adapter")
    # whatever phase the stop came in, the resumed run ends at train.max_steps, never a step past it
    max_steps = RunDir(out).read_config().train.max_steps
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == max_steps and [r["step"] for r in rows] == list(range(1, max_steps + 1)), \
        (summary["steps"], [r["step"] for r in rows])
    return proc


def _adapter(path):
    return load_file(str(path / "adapter_model.safetensors"))


# ------------------------------------------------------------------------------------------- the run command

@stopped_by("SIGTERM")
def test_loading(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, *NO_EVAL, "--output-dir", str(out)],
                           "lowvram_grpo.run.pipeline:load_model")
    line = _stop(proc, tmp_path, signum, marker)
    assert "while loading the model: nothing was written; start it again with: python " in line, line
    assert not out.exists()
    _goes_on(line, "start it again with:")
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"


@stopped_by("SIGINT")
def test_measuring_before(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, "--output-dir", str(out)],
                           "lowvram_grpo.evaluate.evaluation:generate_answers")
    line = _stop(proc, tmp_path, signum, marker)
    assert "while measuring before training; kept: config.yaml and summary.json" in line and "no checkpoint yet" in line
    assert not RunDir(out).checkpoint_dirs() and not RunDir(out).prime_checkpoint_dirs()
    assert json.loads((out / "summary.json").read_text())["before"] is None
    resumed = _resumed(line, out)
    assert "running it again from the start" in resumed.stdout
    assert json.loads((out / "summary.json").read_text())["before"] is not None


@stopped_by("SIGHUP", "SIGINT")  # SIGTERM: test_a_stopped_priming_resumes_to_the_unbroken_adapter
def test_priming(tmp_path, signum):
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "lowvram_grpo.run", *TINY, *NO_EVAL, "--set", "prime.steps=400",
                   "--set", "prime.save_steps=10", "--output-dir", str(out)], tmp_path)
    line = _stop(proc, tmp_path, signum, out / "prime-checkpoint-10")
    assert "during priming; kept: priming checkpoint" in line, line
    step = int(line.split("(step ")[1].split()[0])
    assert 10 <= step < 400
    assert RunDir(out).latest_prime_checkpoint() == out / f"prime-checkpoint-{step}"
    assert not RunDir(out).checkpoint_dirs()
    resumed = _resumed(line, out)
    assert f"resuming priming from {out / f'prime-checkpoint-{step}'} (step {step} of 400)" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["priming"]["steps"] == 400 and len(summary["priming"]["losses"]) == 400
    assert [s for s, _ in RunDir(out).prime_checkpoint_dirs()] == [400]  # the end's, which a later resume starts after


@stopped_by("SIGTERM")
def test_measuring_primed(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, "--set", "prime.steps=3", "--output-dir", str(out)],
                           "lowvram_grpo.evaluate.evaluation:generate_answers", call=2)
    line = _stop(proc, tmp_path, signum, marker)
    assert "while measuring the primed adapter; kept: priming checkpoint" in line and "(step 3 of 3)" in line, line
    assert f"primed adapter {out / 'primed_adapter'}" in line
    resumed = _resumed(line, out)
    assert "(step 3 of 3)" in resumed.stdout  # priming is not done again
    assert json.loads((out / "summary.json").read_text())["primed"] is not None


@stopped_by("SIGINT", "SIGTERM")
def test_grpo(tmp_path, signum):
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "lowvram_grpo.run", "--preset", "tiny", "--max-steps", "30", *NO_EVAL,
                   "--set", "train.save_steps=2", "--output-dir", str(out)], tmp_path)
    line = _stop(proc, tmp_path, signum, out / "checkpoint-2")
    step = int(line.split("after step ")[1].split()[0])
    assert 2 <= step < 30 and f"checkpoint {out / f'checkpoint-{step}'}" in line, line
    assert RunDir(out).latest_checkpoint() == out / f"checkpoint-{step}"
    resumed = _resumed(line, out)  # guards.py's line
    assert f"resuming from {out / f'checkpoint-{step}'}" in resumed.stdout
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))


@stopped_by("SIGINT")
def test_saving(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, *NO_EVAL, "--output-dir", str(out)],
                           "lowvram_grpo.model.lora_io:save_adapter")
    line = _stop(proc, tmp_path, signum, marker)
    assert "while saving the adapter; kept: checkpoint" in line and "(GRPO step 2 of 2)" in line, line
    assert f"adapter {out / 'adapter'}" in line
    check_adapter_dir(out / "adapter")  # the save finished before the stop
    _resumed(line, out)


@stopped_by("SIGTERM")
def test_measuring_after(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, "--output-dir", str(out)],
                           "lowvram_grpo.evaluate.evaluation:generate_answers", call=2)
    line = _stop(proc, tmp_path, signum, marker)
    assert ("while measuring the trained adapter; kept: checkpoint" in line
            and f"adapter {out / 'adapter'}" in line), line
    assert json.loads((out / "summary.json").read_text())["status"] == "training"
    trained = _adapter(out / "adapter")
    _resumed(line, out)  # no step past the last: the adapter it saves again is the one GRPO ended with, bit for bit
    assert json.loads((out / "summary.json").read_text())["after"] is not None
    again = _adapter(out / "adapter")
    assert trained.keys() == again.keys() and all(torch.equal(trained[k], again[k]) for k in trained)


@stopped_by("SIGHUP")
def test_exporting(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, *NO_EVAL, "--export", "merged16", "--output-dir", str(out)],
                           "lowvram_grpo.run.pipeline:export_model")
    line = _stop(proc, tmp_path, signum, marker)
    assert "while exporting; kept: checkpoint" in line and f"adapter {out / 'adapter'}" in line, line
    resumed = _resumed(line, out)
    assert f"exported (merged16): {out / 'export-merged16'}" in resumed.stdout


@stopped_by("SIGINT")
def test_report(tmp_path, signum):
    out = tmp_path / "run"
    proc, marker = _paused(tmp_path, [*TINY, *NO_EVAL, "--output-dir", str(out)],
                           "lowvram_grpo.report.build:write_report")
    line = _stop(proc, tmp_path, signum, marker)
    assert "while writing the report: the run is complete" in line, line
    card = (out / "README.md").read_text()  # the run's model card is written before the report, not TRL's left behind
    assert "builtin:tiny" in card and "huggingface.co/None" not in card
    assert line.endswith(f"write its report with: python -m lowvram_grpo.report {out}")
    assert RunDir(out).locked_by() is None
    _goes_on(line, "write its report with:")
    assert (out / "report.md").is_file()


# ------------------------------------------------------------------------------------------- eval, baseline

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli(*TINY, "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@stopped_by("SIGTERM")
def test_eval_command(tmp_path, finished, signum):
    proc, marker = _paused(tmp_path, ["eval", "--adapter", str(finished / "adapter")],
                           "lowvram_grpo.evaluate.evaluation:generate_answers", call=2)
    line = _stop(proc, tmp_path, signum, marker)
    assert "while measuring adapter: eval writes nothing; run it again: python " in line, line
    again = _goes_on(line, "run it again:")
    assert "accuracy_strict" in again.stdout


@stopped_by("SIGHUP")
def test_baseline_command(tmp_path, finished, signum):
    proc, marker = _paused(tmp_path, [str(finished), "--steps", "4"],
                           "lowvram_grpo.training.priming:completion_loss", call=2,
                           drive="lowvram_grpo.baseline")
    line = _stop(proc, tmp_path, signum, marker)
    assert ": nothing was written; run the same command again: python " in line, line
    assert not (finished / "prime_only").exists()
    _goes_on(line, "run the same command again:", env={"DRIVE": "lowvram_grpo.baseline"})  # the driver runs baseline
    assert json.loads((finished / "prime_only" / "summary.json").read_text())["priming"]["steps"] == 4
    import shutil

    shutil.rmtree(finished / "prime_only")


def test_the_random_reward_control_stops_in_its_grpo_and_runs_again(tmp_path, finished):
    """SIGINT in the control's first GRPO step (baseline.py --control random-reward): one line, exit 130, the run's
    files as they were, and the command it gives trains the control to the end."""
    summary_before = (finished / "summary.json").read_bytes()
    proc, marker = _paused(tmp_path, [str(finished), "--control", "random-reward"],
                           "lowvram_grpo.training.logprobs_fallback:torch_chunked_logprobs",
                           drive="lowvram_grpo.baseline")
    line = _stop(proc, tmp_path, signal.SIGINT, marker)
    assert f"during the random-reward control of {finished}: the run is unchanged" in line, line
    assert (finished / "summary.json").read_bytes() == summary_before
    assert RunDir(finished).locked_by() is None and RunDir(finished / "control_random_reward").locked_by() is None
    _goes_on(line, "when it runs again:", env={"DRIVE": "lowvram_grpo.baseline"})  # the driver runs baseline
    control = json.loads((finished / "control_random_reward" / "summary.json").read_text())
    assert control["status"] == "complete" and control["steps"] == 2
    assert "random-reward" in json.loads((finished / "summary.json").read_text())["controls"]


# ------------------------------------------------------------------------------------------- priming resumes exactly

@pytest.fixture(scope="module")
def unbroken_priming(tmp_path_factory):
    out = tmp_path_factory.mktemp("unbroken") / "run"
    proc = run_cli("--preset", "tiny", "--max-steps", "1", *NO_EVAL, "--set", "prime.steps=60",
                   "--set", "prime.save_steps=10", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_priming_resumes_to_the_unbroken_adapter(tmp_path, unbroken_priming, signum):
    out = tmp_path / "run"
    proc = _start([sys.executable, "-m", "lowvram_grpo.run", "--preset", "tiny", "--max-steps", "1", *NO_EVAL,
                   "--set", "prime.steps=60", "--set", "prime.save_steps=10", "--output-dir", str(out)], tmp_path)
    try:
        _wait_for(out / "prime-checkpoint-20", proc)
        os.kill(proc.pid, signum)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode in (128 + signum, -signum), (tmp_path / "stderr.txt").read_text()[-2000:]
    stopped_at = RunDir(out).latest_prime_checkpoint()
    assert stopped_at is not None and not (out / "primed_adapter").exists()
    resumed = run_cli("--resume", str(out), env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming priming from {stopped_at}" in resumed.stdout
    assert_same_adapter(unbroken_priming / "primed_adapter", out / "primed_adapter", what="priming")
    losses = [json.loads((d / "summary.json").read_text())["priming"]["losses"] for d in (unbroken_priming, out)]
    assert losses[0] == losses[1]
