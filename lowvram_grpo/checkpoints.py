"""Checkpoints of a run, and how `--resume` finds and uses them.

Every `train.save_steps` steps the trainer (training.CheckpointingGRPOTrainer) writes
`<output-dir>/checkpoint-<step>/`: what transformers' Trainer saves (the adapter(s) in PEFT format,
optimizer, scheduler, RNG states, trainer_state.json), plus `run_state.json` (data position, the
numerical guard's counters) and `metrics.jsonl` as it was at that step. The whole folder is built
under a hidden staging name and renamed into place (lora_io.atomic_replace_dir), so a checkpoint
that exists is complete; `keep_checkpoints` newest are kept.

A resumed run restores metrics.jsonl from the checkpoint it continues (rows logged after it were
lost with the killed process and are logged again), so the file reads as if never interrupted.
`TrainingStopped` / `Interrupted` end a run early, their messages say how to resume. Nothing here
imports torch or transformers at import time (the CLI imports it before choosing a backend).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from .lora_io import AdapterError, atomic_write_text, check_adapter_dir, remove_stale_staging

RUN_STATE = "run_state.json"
METRICS = "metrics.jsonl"
STAGING_PREFIX = ".checkpoint-staging-"
_NAME = re.compile(r"checkpoint-(\d+)")
# what a checkpoint needs to be resumed from (transformers' files + ours)
REQUIRED_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", RUN_STATE)


class TrainingStopped(RuntimeError):
    """Training ended before train.max_steps; the message says why and what to do (guards.py)."""

    exit_code = 1


class Interrupted(TrainingStopped):
    """Stopped by SIGINT/SIGTERM after writing a checkpoint and the adapter."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def resume_command(run_dir: Path) -> str:
    return f"python -m lowvram_grpo.run --resume {run_dir}"


def resumable_config(run_dir: Path):
    """The config of the run in `run_dir`, after checking there is a run to continue (ConfigError if not)."""
    from .config import ConfigError, load_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume {run_dir}: no such directory; give the --output-dir of an earlier run")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; give the --output-dir of an earlier run")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {}
    if summary.get("status") == "complete":
        raise ConfigError(f"--resume {run_dir}: that run is complete ({summary.get('steps')} steps); "
                          f"to train longer start a new run from its adapter")
    return load_config(str(run_dir / "config.yaml"))


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint-N folder in `run_dir`, oldest first."""
    found = []
    for path in Path(run_dir).glob("checkpoint-*"):
        match = _NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_complete(checkpoint: Path) -> bool:
    if not all((Path(checkpoint) / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        check_adapter_dir(checkpoint)
    except AdapterError:
        return False
    return True


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint in `run_dir`, or None."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        if is_complete(path):
            return path
    return None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints. Each is renamed to a hidden name first, so a kill
    mid-delete never leaves a half-deleted folder under a checkpoint name."""
    for _, path in checkpoint_dirs(run_dir)[:-keep]:
        doomed = path.with_name(f"{STAGING_PREFIX}{os.getpid()}-deleting-{path.name}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(run_dir: Path) -> None:
    """Staging folders of checkpoints and adapters that a killed process never finished."""
    remove_stale_staging(run_dir, STAGING_PREFIX)
    for name in ("adapter", "primed_adapter"):
        remove_stale_staging(run_dir, f".{name}.tmp-")


def write_run_state(checkpoint: Path, state: dict, metrics: Path) -> None:
    """Add our part to a checkpoint being staged: run_state.json and a copy of metrics.jsonl."""
    if Path(metrics).is_file():
        shutil.copyfile(metrics, Path(checkpoint) / METRICS)
    atomic_write_text(Path(checkpoint) / RUN_STATE, json.dumps(state, indent=2) + "\n")


def read_run_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / RUN_STATE).read_text())


def restore_metrics(checkpoint: Path, metrics: Path) -> None:
    """metrics.jsonl as it was when `checkpoint` was written."""
    saved = Path(checkpoint) / METRICS
    atomic_write_text(Path(metrics), saved.read_text() if saved.is_file() else "")


def restore_trained_adapter(model, checkpoint: Path) -> None:
    """Load the checkpoint's top-level adapter weights into the trained 'default' adapter, in place.

    Why: transformers 5.17's Trainer, when a checkpoint has adapter sub-folders (TRL's frozen 'ref'
    copy of the adapter, made when beta > 0), loads only those and leaves 'default' at its initial
    weights; a resumed run would silently restart the adapter from scratch."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights, adapter_name="default")
    if getattr(result, "unexpected_keys", None):
        raise AdapterError(f"checkpoint {checkpoint} does not fit this model: unexpected weights "
                           f"{', '.join(result.unexpected_keys[:3])}")
