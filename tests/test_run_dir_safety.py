"""A run never destroys another: a folder that holds a run (finished, stopped or running) is refused before
anything loads, `--overwrite` replaces only the run's own files, and a lock keeps a second process out of a
folder a run is writing (also under `accelerate launch`, where only the main process writes). Real runs of
the tiny preset, real processes."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.core.errors import RunDirError
from lowvram_grpo.report.run_dir import RunDir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

ENV = {"OMP_NUM_THREADS": "1"}


def _snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*"))


def _one_error(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_a_finished_run_is_refused_before_anything_loads_and_left_as_it_was(tiny_run):
    out, _ = tiny_run
    before = _snapshot(out)
    proc = run_cli("--preset", "tiny", "--max-steps", "1", "--output-dir", str(out), env=ENV)
    error = _one_error(proc)
    assert f"output dir {out} holds a finished run (3 steps)" in error and "--overwrite" in error
    assert f"--init-adapter {out / 'adapter'}" in error
    assert proc.stdout == "" and "Loading" not in proc.stderr  # refused before any model or data loaded
    assert _snapshot(out) == before
    # the same from Python
    from lowvram_grpo.run.pipeline import train

    with pytest.raises(RunDirError, match="holds a finished run"):
        train("tiny", ["train.max_steps=1"], output_dir=str(out))
    assert _snapshot(out) == before


def test_overwrite_replaces_only_the_runs_own_files(tiny_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tiny_run[0], out)
    (out / "notes.txt").write_text("mine")  # the user's own file in the folder
    shutil.copytree(out / "adapter", out / "checkpoint-99")  # a stale checkpoint --resume must never pick up later
    (out / ".checkpoint-staging-1-x").mkdir()
    (out / "README.md").write_text("the old run's card")  # the run's model card goes with the run
    proc = run_cli("--preset", "tiny", "--max-steps", "1", "--set", "eval.enabled=false", "--overwrite",
                   "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 1 and summary["before"] is None
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "max_steps: 1" in (out / "config.yaml").read_text()
    assert not (out / "checkpoint-99").exists() and not (out / ".checkpoint-staging-1-x").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert "old run" not in (out / "README.md").read_text() and "builtin:tiny" in (out / "README.md").read_text()


# A reward that, from the second step on, touches MARKER and waits for RELEASE, so the run is mid-training
# (holding its folder) for as long as the test needs, however loaded the machine is.
SLOW_REWARD = """
import os, time
from pathlib import Path

def slow(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 1:
        Path(os.environ["MARKER"]).touch()
        deadline = time.time() + 600
        while not Path(os.environ["RELEASE"]).exists() and time.time() < deadline:
            time.sleep(0.1)
    return [0.0] * len(completions)
"""


def test_a_second_process_is_refused_at_once_while_a_run_writes_its_folder(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    out, marker, release = tmp_path / "run", tmp_path / "training", tmp_path / "release"
    env = {**ENV, "MARKER": str(marker), "RELEASE": str(release)}
    args = ["--preset", "tiny", "--max-steps", "4", "--set", "eval.enabled=false", "--set", "train.save_steps=2",
            "--set", f"rewards.module={tmp_path / 'slow.py'}", "--set", "rewards.names=[brevity, slow]"]
    with open(tmp_path / "stderr.txt", "w") as err:
        first = subprocess.Popen([sys.executable, "-m", "lowvram_grpo.run", *args, "--output-dir", str(out)], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **env})
        try:
            deadline = time.time() + 300
            while not marker.exists():
                assert first.poll() is None, (tmp_path / "stderr.txt").read_text()[-2000:]
                assert time.time() < deadline
                time.sleep(0.2)
            assert RunDir(out).locked_by() == f"pid {first.pid}"
            for extra in ([], ["--overwrite"]):
                second = run_cli(*args, *extra, "--output-dir", str(out), env=env)
                assert f"output dir {out} is being written by a running process (pid {first.pid})" in _one_error(second)
            resume = run_cli("--resume", str(out), env=ENV)
            assert f"that run is still running (pid {first.pid})" in _one_error(resume)
            assert first.poll() is None  # it was running all along
            release.touch()
            assert first.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
        finally:
            first.kill()
            first.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert RunDir(out).locked_by() is None  # released with the process


HOLD_LOCK = ("import sys, time; from lowvram_grpo.report.run_dir import RunDir; RunDir(sys.argv[1]).lock(); "
             "print('locked', flush=True); time.sleep(3600)")


def test_the_lock_goes_with_its_process_however_it_ends(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert RunDir(folder).locked_by() == f"pid {holder.pid}"
        with pytest.raises(RunDirError, match=f"is being written by a running process \\(pid {holder.pid}\\)"):
            RunDir(folder).lock()
        RunDir(folder, writer=False).lock()  # a non-main process of a launch never locks, nor refuses: no error
        RunDir(folder, writer=False).check_free()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert RunDir(folder).locked_by() is None
        run_dir = RunDir(folder).lock()  # free again; and re-entrant within one process (--resume, then its run)
        run_dir.lock()
        run_dir.unlock()
        assert RunDir(folder).locked_by() is None  # still ours
        run_dir.unlock()
    finally:
        holder.kill()
        holder.wait()
    assert not folder.exists()  # locking wrote nothing into the folder


def _accelerate(out, env_extra=None):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "lowvram_grpo.run",
         "--preset", "tiny", "--max-steps", "2", "--output-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_under_accelerate_launch_the_main_process_refuses_and_nothing_is_written(tiny_run, tmp_path):
    """Two processes: the main one checks and locks the folder (the other one writes nothing and never
    locks, so it cannot trip over its own main process's lock); a refused launch leaves the folder as it was."""
    out, _ = tiny_run
    before = _snapshot(out)
    proc = _accelerate(out)
    assert proc.returncode != 0
    assert proc.stderr.count(f"error: output dir {out} holds a finished run (3 steps)") == 1, proc.stderr[-3000:]
    assert _snapshot(out) == before

    folder = tmp_path / "running"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = _accelerate(folder)
        assert proc.returncode != 0
        assert proc.stderr.count(f"error: output dir {folder} is being written by a running process "
                                 f"(pid {holder.pid})") == 1, \
            proc.stderr[-3000:]
        assert not folder.exists()
    finally:
        holder.kill()
        holder.wait()


def test_an_append_a_kill_cut_short_is_skipped_in_completions_and_any_other_damage_is_one_line(tmp_path):
    """completions.jsonl is appended to (a kill can cut its last line): that line is skipped; a damaged line elsewhere,
    or a cut line in metrics.jsonl (whose rows resume reads back), is a RunDirError naming the file and line."""
    from lowvram_grpo.report.run_dir import RunDir

    run = RunDir(tmp_path / "run").create()
    run.append_completions([{"step": 1, "completion": "a"}, {"step": 2, "completion": "b"}])
    (run.path / "completions.jsonl").write_text((run.path / "completions.jsonl").read_text() + '{"step": 3, "compl')
    assert [r["step"] for r in run.read_completions()] == [1, 2]
    (run.path / "completions.jsonl").write_text('{"step": 1}\n{"step": 2, "compl\n{"step": 3}\n')
    with pytest.raises(RunDirError, match=r"completions.jsonl line 2 is not JSON"):
        run.read_completions()
    (run.path / "completions.jsonl").write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(RunDirError, match=r"line 2 is not a completion row"):
        run.read_completions()
    (run.path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 2 is not JSON"):
        run.read_metrics()
    (run.path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n\n{"reward": 1}\n')
    with pytest.raises(RunDirError, match=r"line 3 is not a metrics row"):
        run.read_metrics()
