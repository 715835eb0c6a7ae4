"""Kill safety, in real processes with real signals: kill -9 mid-run and --resume to the same adapter as
an uninterrupted run; a kill in the middle of writing an adapter never leaves a half-written one;
SIGTERM / Ctrl-C stop at a step boundary with a checkpoint, the adapter and the --resume command.

Faults are injected from small driver scripts (a save that blocks, or kills its own process, at a
chosen point); the code under test is the unmodified package."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_same_adapter, default_signals, run_cli
from lowvram_grpo.report.run_dir import STAGING_PREFIX, RunDir
from lowvram_grpo.model.lora_io import atomic_replace_dir, check_adapter_dir

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

RUN_ARGS = ["--preset", "tiny", "--max-steps", "8", "--set", "train.save_steps=2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

# Blocks inside transformers' checkpoint writer (after the weights and optimizer, before the RNG
# state) when it writes the checkpoint of step HOLD_AT_STEP, so the test can kill -9 it mid-write.
HOLD_DURING_CHECKPOINT = """
import os, sys, time
from pathlib import Path
from transformers import Trainer
hold_at, marker = int(os.environ["HOLD_AT_STEP"]), Path(os.environ["HOLD_MARKER"])
original = Trainer._save_rng_state
def holding(self, output_dir):
    if self.state.global_step == hold_at:
        marker.write_text(str(output_dir))
        time.sleep(600)
    original(self, output_dir)
Trainer._save_rng_state = holding
from lowvram_grpo.run.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _adapter_tensors(path):
    return load_file(str(path / "adapter_model.safetensors"))


def _wait_for(path, proc, seconds=300):
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before reaching the kill point"
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    proc = run_cli(*RUN_ARGS, "--output-dir", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_kill_9_after_the_step_4_checkpoint_then_resume_equals_the_uninterrupted_adapter(uninterrupted, tmp_path):
    out, marker, script = tmp_path / "run", tmp_path / "holding", tmp_path / "hold.py"
    script.write_text(HOLD_DURING_CHECKPOINT)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), *RUN_ARGS, "--output-dir", str(out)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **ENV, "HOLD_AT_STEP": "6", "HOLD_MARKER": str(marker)})
        try:
            _wait_for(marker, proc)
            os.kill(proc.pid, signal.SIGKILL)  # mid-way through writing checkpoint-6
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # what the kill left: checkpoints 2 and 4 complete, 6 only as a hidden half-written staging dir
    assert [step for step, _ in RunDir(out).checkpoint_dirs()] == [2, 4]
    assert RunDir(out).latest_checkpoint() == out / "checkpoint-4"
    assert list(out.glob(f"{STAGING_PREFIX}*/checkpoint-6/adapter_model.safetensors"))
    assert not (out / "adapter").exists()
    assert json.loads((out / "summary.json").read_text())["status"] == "training"

    proc = run_cli("--resume", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in proc.stdout

    assert_same_adapter(uninterrupted / "adapter", out / "adapter", atol=1e-5)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # steps 5-6 of the killed run are not doubled
    for row, ref in zip(rows, reference):
        assert (row["reward"] == pytest.approx(ref["reward"], abs=1e-6)
                and row["loss"] == pytest.approx(ref["loss"], abs=1e-6))
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (out, uninterrupted))
    assert summary["status"] == "complete" and summary["steps"] == 8
    assert summary["before"] == ref_summary["before"] and summary["after"] == ref_summary["after"]

    # keep_checkpoints (2) newest are kept; the killed save's staging dir is gone
    assert [step for step, _ in RunDir(out).checkpoint_dirs()] == [6, 8]
    assert not list(out.glob(".checkpoint-staging-*"))
    state = RunDir.read_run_state(out / "checkpoint-8")
    assert state["data_position"] == {"prompts_seen": 8, "completions_seen": 32}
    assert (out / "checkpoint-8" / "metrics.jsonl").read_text().count("\n") == 8

    again = run_cli("--resume", str(out), env=ENV)
    assert again.returncode == 2 and "that run is complete" in again.stderr


# Saves the tiny model's adapter to TARGET, once completely if FIRST=yes, then again with a kill
# injected at POINT: 'weights' (the safetensors file half written) or 'tokenizer' (after the weights).
KILL_DURING_SAVE = """
import os, signal, sys
from pathlib import Path
import peft.peft_model, torch
from lowvram_grpo.model.backends import load_model
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.resolve import resolve
from lowvram_grpo.settings.config import load_config
target, first, point = Path(sys.argv[1]), sys.argv[2] == "yes", sys.argv[3]
handle = load_model(resolve(load_config("tiny"), detect(), "hf"))
if first:
    handle.save_lora(target)
with torch.no_grad():
    for name, p in handle.model.named_parameters():
        if "lora_B" in name:
            p.fill_(0.5)  # the replacement differs from the first save
def die():
    os.kill(os.getpid(), signal.SIGKILL)
original = peft.peft_model.safe_save_file
def half_then_die(tensors, filename, metadata=None):
    original(tensors, filename + ".full", metadata=metadata)
    data = Path(filename + ".full").read_bytes()
    Path(filename).write_bytes(data[: len(data) // 2])
    os.remove(filename + ".full")
    die()
if point == "weights":
    peft.peft_model.safe_save_file = half_then_die
else:
    handle.tokenizer.save_pretrained = lambda *a, **k: die()
handle.save_lora(target)
print("not killed")
"""


@pytest.mark.parametrize("point, first", [("weights", "yes"), ("tokenizer", "no")],
                         ids=["mid-weights-replacing-an-adapter", "after-weights-new-adapter"])
def test_a_kill_during_an_adapter_save_leaves_the_old_adapter_or_none(tmp_path, point, first):
    script, target = tmp_path / "save.py", tmp_path / "adapter"
    script.write_text(KILL_DURING_SAVE)
    proc = subprocess.run([sys.executable, str(script), str(target), first, point], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **ENV}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    staged = list(tmp_path.glob(".adapter.tmp-*/adapter_model.safetensors"))
    assert staged, "the kill should land inside the save"
    if first == "no":
        assert not target.exists()
    else:
        check_adapter_dir(target)  # the first, complete adapter
        assert all(torch.count_nonzero(v) == 0 for k, v in _adapter_tensors(target).items() if "lora_B" in k)
    if point == "weights":  # the kill really landed mid-file: the staged weights are truncated
        with pytest.raises(Exception):
            load_file(str(staged[0]))


def test_leftover_staging_of_a_dead_process_is_removed_by_the_next_save(tmp_path, tiny_model_dir):
    from lowvram_grpo.model.backends import load_model
    from lowvram_grpo.settings.hardware import detect
    from lowvram_grpo.settings.resolve import resolve
    from lowvram_grpo.settings.config import load_config

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".adapter.tmp-{dead.stdout.strip()}-abc"
    leftover.mkdir()
    mine = tmp_path / f".adapter.tmp-{os.getpid()}-live"  # a live process's staging is left alone
    mine.mkdir()
    handle = load_model(resolve(load_config("tiny"), detect(), "hf"))
    handle.save_lora(tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["adapter", mine.name])


def test_without_an_atomic_exchange_a_kill_between_the_renames_is_repaired(tmp_path, monkeypatch):
    from lowvram_grpo.model import lora_io

    old, new = tmp_path / "target", tmp_path / "staging"
    for path, text in ((old, "old"), (new, "new")):
        path.mkdir()
        (path / "f").write_text(text)
    # the state a kill leaves between the fallback's two renames: target moved aside, new not yet in place
    os.rename(old, lora_io._aside_name(old))
    lora_io.restore_interrupted_replace(old)
    assert (old / "f").read_text() == "old"
    monkeypatch.setattr(lora_io, "_exchange_paths", lambda a, b: False)  # e.g. macOS
    atomic_replace_dir(new, old)
    assert (old / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["target"]


# A reward file whose function is slow from the second step on and then touches MARKER, so a signal
# sent once MARKER exists lands while a step is running.
SLOW_REWARD = """
import os, time
from pathlib import Path

def slow(prompts, completions, trainer_state=None, **kwargs):
    if trainer_state is not None and trainer_state.global_step >= 1:
        Path(os.environ["MARKER"]).touch()
        time.sleep(0.5)
    return [0.0] * len(completions)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_at_the_step_end_with_checkpoint_adapter_and_resume_line(tmp_path, signum):
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    out, marker = tmp_path / "run", tmp_path / "started"
    args = ["--preset", "tiny", "--max-steps", "6", "--set", "eval.enabled=false",
            "--set", f"rewards.module={tmp_path / 'slow.py'}", "--set", "rewards.names=[xmlcount,brevity,slow]"]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lowvram_grpo.run", *args, "--output-dir", str(out)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **ENV, "MARKER": str(marker)},
                                preexec_fn=default_signals)
        try:
            _wait_for(marker, proc)
            proc.send_signal(signum)
            proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 128 + signum, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--resume {out}" in errors[0] and "Traceback" not in stderr
    step = int(errors[0].split("after step ")[1].split()[0])
    assert 2 <= step < 6
    assert RunDir(out).latest_checkpoint() == out / f"checkpoint-{step}"
    check_adapter_dir(out / "adapter")
    weights, saved = _adapter_tensors(out / "adapter"), _adapter_tensors(out / f"checkpoint-{step}")
    assert all(torch.equal(weights[k], saved[k]) for k in weights)
    if signum == signal.SIGTERM:  # and the run goes on to its end from there
        proc = run_cli("--resume", str(out), env={**ENV, "MARKER": str(marker)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 7))
