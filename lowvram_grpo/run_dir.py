"""Where outputs are written: `RunDir`, the one owner of a run's folder and its files.

    run_dir = RunDir("runs/tiny")
    run_dir.check_creatable()           # before anything heavy: can it be made? (nothing written)
    run_dir.create()                    # the first write, once data and model were accepted
    run_dir.write_config(config); run_dir.append_metrics(row); run_dir.write_summary(summary)
    run_dir.latest_checkpoint()         # the newest *complete* checkpoint-N, or None

A run folder holds:
- `config.yaml`: the resolved config (preset + --set), which --resume reads back;
- `metrics.jsonl`: one JSON object per logged GRPO step;
- `summary.json`: `status: training` with the numbers measured before GRPO while it runs (a resumed run
  reuses them), then the whole summary with `status: complete`;
- `checkpoint-N/`: what transformers' Trainer saves (adapter(s), optimizer, scheduler, RNG states,
  trainer_state.json) plus our `run_state.json` (data position, the NaN guard's counters) and
  `metrics.jsonl` as it was at that step. Built under a hidden staging name and renamed into place
  (lora_io.atomic_replace_dir), so a checkpoint that exists is complete; the newest `keep` are kept;
- `adapter/`, `primed_adapter/`, `export-KIND/`, `report.md` and the plots.

Every file is written atomically (a temporary name, then a rename). Every read has one policy: a file
that is absent reads as None (or []), a file that is there but unreadable raises `RunDirError` naming
it (exit 2). Only the main process writes when several run (accelerate): `RunDir(path, writer=False)`
on the others. Nothing here imports torch, transformers or trl.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import yaml

from .errors import AdapterError, ConfigError, RunDirError
from .lora_io import atomic_replace_dir, atomic_write_text, check_adapter_dir, remove_stale_staging

CONFIG, SUMMARY, METRICS, RUN_STATE, REPORT = "config.yaml", "summary.json", "metrics.jsonl", "run_state.json", "report.md"
ADAPTER, PRIMED_ADAPTER = "adapter", "primed_adapter"
STAGING_PREFIX = ".checkpoint-staging-"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# what a checkpoint needs to be resumed from (transformers' files + ours)
REQUIRED_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", RUN_STATE)


def resume_command(path: Path) -> str:
    return f"python -m lowvram_grpo.run --resume {path}"


class RunDir:
    """A run's output folder and the only code that reads or writes its files."""

    def __init__(self, path, writer: bool = True):
        self.path = Path(path)
        self.writer = writer  # False on the non-main processes of a multi-process run: they write nothing

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------ the folder
    def check_creatable(self) -> None:
        """Refuse a folder that cannot be created, writing nothing (it is made just before the first write)."""
        existing = self.path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        problem = None
        if existing == self.path and not self.path.is_dir():
            problem = "it is a file"
        elif existing != self.path and not existing.is_dir():
            problem = f"{existing} is a file"
        elif not os.access(existing, os.W_OK | os.X_OK):
            problem = f"{existing} is not writable"
        if problem:
            raise ConfigError(f"cannot create output dir {self.path}: {problem}; pass a writable --output-dir")

    def create(self) -> "RunDir":
        if not self.writer:
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot create output dir {self.path}: {exc.strerror or exc}; pass a writable --output-dir") from None
        return self

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def adapter_dir(self) -> Path:
        return self.path / ADAPTER

    @property
    def primed_adapter_dir(self) -> Path:
        return self.path / PRIMED_ADAPTER

    def export_dir(self, kind: str) -> Path:
        return self.path / f"export-{kind}"

    # ------------------------------------------------------------------ one read policy
    def _read_text(self, name: str) -> Optional[str]:
        path = self.path / name
        if not path.is_file():
            return None
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RunDirError(f"{path} cannot be read ({exc}): the file is damaged") from None

    def _write_text(self, name: str, text: str) -> None:
        if self.writer:
            atomic_write_text(self.path / name, text)

    # ------------------------------------------------------------------ config.yaml
    def write_config(self, config) -> None:
        self._write_text(CONFIG, config.to_yaml())

    def read_config_raw(self) -> dict:
        """config.yaml as a mapping ({} when absent): what the report needs (names, lengths)."""
        text = self._read_text(CONFIG)
        if text is None:
            return {}
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RunDirError(f"{self.path / CONFIG} is not YAML ({str(exc).splitlines()[0]}): the file is damaged") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{self.path / CONFIG} is not a YAML mapping: the file is damaged")
        return data

    def read_config(self, overrides: "list[str]" = ()):
        """config.yaml as a validated RunConfig (what --resume continues), with `overrides` (--set) applied."""
        from .config import load_config

        if not (self.path / CONFIG).is_file():
            raise ConfigError(f"--resume {self.path}: no config.yaml there; give the --output-dir of an earlier run")
        return load_config(str(self.path / CONFIG), list(overrides))

    # ------------------------------------------------------------------ summary.json
    def read_summary(self) -> Optional[dict]:
        text = self._read_text(SUMMARY)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{self.path / SUMMARY} is not JSON ({exc.msg}): the file is damaged") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{self.path / SUMMARY} is not a JSON object: the file is damaged")
        return data

    def write_summary(self, summary: dict) -> None:
        self._write_text(SUMMARY, json.dumps(summary, indent=2) + "\n")

    def complete_summary(self) -> Optional[dict]:
        """summary.json of a finished run; None while it trains or when it never finished."""
        summary = self.read_summary()
        return summary if summary is not None and summary.get("status", "complete") == "complete" else None

    # ------------------------------------------------------------------ metrics.jsonl
    def reset_metrics(self) -> None:
        """A (re)started run logs afresh."""
        if self.writer:
            (self.path / METRICS).unlink(missing_ok=True)

    def append_metrics(self, row: dict) -> None:
        if self.writer:
            with (self.path / METRICS).open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")

    def read_metrics(self, required: bool = True) -> list[dict]:
        """The logged rows; a missing file raises when `required` (the report needs it), else reads as []."""
        text = self._read_text(METRICS)
        if text is None:
            if required:
                raise RunDirError(f"{self.path} has no {METRICS}: pass the --output-dir of a lowvram_grpo run")
            return []
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunDirError(f"{self.path / METRICS} line {number} is not JSON ({exc.msg}): the file is damaged") from None
            if not isinstance(row, dict) or "step" not in row:
                raise RunDirError(f"{self.path / METRICS} line {number} is not a metrics row (an object with a 'step'): "
                                  "the file is damaged")
            rows.append(row)
        return rows

    def write_report(self, text: str) -> Path:
        self._write_text(REPORT, text)
        return self.path / REPORT

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_dirs(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint-N folder, oldest first."""
        found = []
        for path in self.path.glob("checkpoint-*"):
            match = _CHECKPOINT.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    @staticmethod
    def is_complete(checkpoint: Path) -> bool:
        if not all((Path(checkpoint) / name).is_file() for name in REQUIRED_FILES):
            return False
        if not any(Path(checkpoint).glob("rng_state*.pth")):  # rng_state.pth, or one per process
            return False
        try:
            check_adapter_dir(checkpoint)
        except AdapterError:
            return False
        return True

    def latest_checkpoint(self) -> Optional[Path]:
        """The newest complete checkpoint, or None."""
        for _, path in reversed(self.checkpoint_dirs()):
            if self.is_complete(path):
                return path
        return None

    def save_checkpoint(self, step: int, write_trainer_files: Callable[[Path], None], run_state: dict, keep: int,
                        shared_staging: bool = False, barrier: Callable[[], None] = lambda: None) -> Path:
        """checkpoint-`step`, complete or absent: `write_trainer_files(root)` writes transformers' files under
        a hidden staging root (into root/checkpoint-step), then our run_state.json and metrics copy join
        them and the folder is renamed into place; older checkpoints beyond `keep` are deleted.
        Several processes (`shared_staging`) write into one staging root named by the step, and only the
        writer renames it, after `barrier()`."""
        name = f"checkpoint-{step}"
        if shared_staging:
            root = self.path / f"{STAGING_PREFIX}step-{step}"
            if self.writer:
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(parents=True)
            barrier()
        else:
            root = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=self.path))
        try:
            write_trainer_files(root)
            barrier()
            if self.writer:
                if (self.path / METRICS).is_file():
                    shutil.copyfile(self.path / METRICS, root / name / METRICS)
                atomic_write_text(root / name / RUN_STATE, json.dumps(run_state, indent=2) + "\n")
                atomic_replace_dir(root / name, self.path / name)
        finally:
            if self.writer or not shared_staging:
                shutil.rmtree(root, ignore_errors=True)
        if self.writer:
            self.prune(keep)
        barrier()
        return self.path / name

    def prune(self, keep: int) -> None:
        """Delete all but the `keep` newest checkpoints. Each is renamed to a hidden name first, so a kill
        mid-delete never leaves a half-deleted folder under a checkpoint name."""
        for _, path in self.checkpoint_dirs()[:-keep]:
            doomed = path.with_name(f"{STAGING_PREFIX}{os.getpid()}-deleting-{path.name}")
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Staging folders of checkpoints and adapters that a killed process never finished."""
        remove_stale_staging(self.path, STAGING_PREFIX)
        for path in self.path.glob(f"{STAGING_PREFIX}step-*"):  # a multi-process run's shared staging
            shutil.rmtree(path, ignore_errors=True)
        for name in (ADAPTER, PRIMED_ADAPTER):
            remove_stale_staging(self.path, f".{name}.tmp-")

    @staticmethod
    def read_run_state(checkpoint: Path) -> dict:
        try:
            return json.loads((Path(checkpoint) / RUN_STATE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunDirError(f"{Path(checkpoint) / RUN_STATE} cannot be read ({exc}): the checkpoint is damaged") from None

    def restore_metrics(self, checkpoint: Path) -> None:
        """metrics.jsonl as it was when `checkpoint` was written (rows logged after it are logged again)."""
        saved = Path(checkpoint) / METRICS
        self._write_text(METRICS, saved.read_text() if saved.is_file() else "")

    # ------------------------------------------------------------------ resume
    def resumable_config(self, overrides: "list[str]" = ()):
        """The config of the run in this folder, after checking there is a run to continue (ConfigError if not),
        with the `--set` overrides --resume allows (config.RESUME_SETTABLE) applied."""
        from .config import RESUME_SETTABLE

        for assignment in overrides:
            key = assignment.partition("=")[0].strip()
            if key not in RESUME_SETTABLE:
                raise ConfigError(f"--resume --set {key}: a resumed run keeps its training settings; --resume may "
                                  f"change only {', '.join(RESUME_SETTABLE)} (start a new run to change the rest)")
        if not self.path.is_dir():
            raise ConfigError(f"--resume {self.path}: no such directory; give the --output-dir of an earlier run")
        if not (self.path / CONFIG).is_file():
            raise ConfigError(f"--resume {self.path}: no config.yaml there; give the --output-dir of an earlier run")
        summary = self.read_summary() or {}
        if summary.get("status") == "complete":
            raise ConfigError(f"--resume {self.path}: that run is complete ({summary.get('steps')} steps); "
                              f"to train longer start a new run from its adapter")
        return self.read_config(overrides)

    def started_backend(self) -> str:
        """The backend the run started on ('auto' when it never wrote its start summary)."""
        return (self.read_summary() or {}).get("backend") or "auto"

    def started_export(self) -> Optional[str]:
        """The --export the run was started with (merged16 / gguf), or None."""
        return (self.read_summary() or {}).get("export")

    def resume_hint(self) -> str:
        if self.latest_checkpoint() is None:
            return "no checkpoint was written yet: fix it and start the run again"
        return f"fix it and continue from the last checkpoint with: {resume_command(self.path)}"
