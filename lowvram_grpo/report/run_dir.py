"""Where outputs are written: `RunDir`, the one owner of a run's folder and its files.

    run_dir = RunDir("runs/tiny")
    run_dir.check_creatable()           # before anything heavy: can it be made? (nothing written)
    run_dir.create()                    # the first write, once data and model were accepted
    run_dir.write_config(config); run_dir.append_metrics(row); run_dir.write_summary(summary)
    run_dir.latest_checkpoint()         # the newest *complete* checkpoint-N, or None

A run folder holds:
- `config.yaml`: the resolved config (preset + --set), which --resume reads back;
- `plan.txt`: the run's plan as `--dry-run` prints it: config.yaml, the settings decided, the memory plan;
- `metrics.jsonl`: one JSON object per logged GRPO step;
- `summary.json`: `status: training` with the numbers measured before GRPO while it runs (a resumed run
  reuses them), then the whole summary with `status: complete`;
- `completions.jsonl`: what the model wrote at logged GRPO steps, with each reward and the advantage (completions.py:
  rows and size policy); appended, thinned by an atomic rewrite under its cap;
- `curve_start.json`: the held-out curve's step 0 (validation.py): the adapter GRPO starts from (primed_adapter/, the
  lora.init_adapter, or a fresh LoRA: the base model) on the validation questions, measured before GRPO's first step
  (metrics.jsonl holds GRPO's steps 1..max_steps; records.curve_rows puts the two together);
- `best_adapter/`: the adapter of the best point of the held-out curve (validation.py), with `best_step.json`;
- `checkpoint-N/`: what transformers' Trainer saves (adapter(s), optimizer, scheduler, RNG states,
  trainer_state.json) plus our `run_state.json` (data position, the NaN guard's counters),
  `metrics.jsonl` as it was at that step and `validation/best_adapter/` (best_adapter/ then). Built under a hidden
  staging name and renamed into place
  (lora_io.atomic_replace_dir), so a checkpoint that exists is complete; the newest `keep` are kept;
- `prime-checkpoint-N/`: the priming after N steps (priming.py: LoRA weights, optimizer, RNG, losses), every
  `prime.save_steps`, at a stop and at its end, written the same atomic way; --resume continues priming from it;
- `adapter/`, `primed_adapter/`, `export-KIND/`, `report.md` and the plots.

Every file is written atomically (a temporary name, then a rename). Every read has one policy: a file
that is absent reads as None (or []), a file that is there but unreadable raises `RunDirError` naming
it (exit 2). Only the main process writes when several run (accelerate): `RunDir(path, writer=False)`
on the others. Nothing here imports torch, transformers or trl.

A run never destroys another: `check_free()` refuses a folder that holds a run (finished, stopped or
running) unless asked to replace it (`overwrite`, then `clear_run()` at the first write), and `lock()`
takes an exclusive lock for the whole run, so a second process writing the same folder is refused at
once. The lock is an flock on a file outside the run folder (in the temp dir, named by the folder's
absolute path): taking it writes nothing into the folder, and it is released when the process ends,
however it ends. Only the writer (the main process under `accelerate launch`) locks. It holds among the
processes of one user on one machine (POSIX; none on Windows).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from lowvram_grpo.settings.config import RESUME_SETTABLE, load_config

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked there
    fcntl = None

from lowvram_grpo.model.lora_io import atomic_replace_dir, atomic_write_text, check_adapter_dir, remove_stale_staging
from lowvram_grpo.core.errors import AdapterError, ConfigError, RunDirError

CONFIG, SUMMARY, METRICS, RUN_STATE, REPORT = ("config.yaml", "summary.json", "metrics.jsonl", "run_state.json",
                                               "report.md")
PLAN = "plan.txt"
ADAPTER, PRIMED_ADAPTER, BEST_ADAPTER = "adapter", "primed_adapter", "best_adapter"
COMPLETIONS = "completions.jsonl"
BEST_STEP = "best_step.json"  # inside best_adapter/: the GRPO step it is, and its validation numbers
CURVE_START = "curve_start.json"  # the held-out curve's step 0: the adapter GRPO starts from (validation.py)
CHECKPOINT_BEST = "validation"  # checkpoint-N/validation/best_adapter: the best adapter as it was at step N
TRL_COMPLETIONS = "completions"  # TRL's log_completions writes its parquet tables there (grpo.py turns it on)
PLOT_FILES = ("reward.png", "kl.png", "completion_length.png", "clipped_ratio.png",
              "loss.png")  # report/build.py draws them
VALIDATION_PLOT = "validation.png"  # report/build.py draws it for a run with the held-out curve
SAMPLER_PLOT = "sampler_gap.png"  # report/build.py draws it for a run with the importance-sampling correction on
# what a run leaves that marks the folder as holding one (any of them)
RUN_MARKERS = (CONFIG, SUMMARY, METRICS, ADAPTER, PRIMED_ADAPTER)
STAGING_PREFIX = ".checkpoint-staging-"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# what a checkpoint needs to be resumed from (transformers' files + ours)
REQUIRED_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", RUN_STATE)
_PRIME_CHECKPOINT = re.compile(r"prime-checkpoint-(\d+)")
PRIME_STATE = "priming_state.json"
# what a priming checkpoint needs (priming.save_state writes them)
PRIME_REQUIRED_FILES = ("priming_weights.pt", "priming_optimizer.pt", "priming_rng.pt", PRIME_STATE)


def resume_command(path: Path) -> str:
    return f"python -m lowvram_grpo.run --resume {path}"


def train_on_command(path: Path, preset: str = "") -> str:
    """The command that trains a new run from the adapter of the finished run in `path`, with its settings."""
    path = Path(path)
    new = path.with_name(f"{path.name}-more")
    number = 2
    while new.exists():
        new, number = path.with_name(f"{path.name}-more{number}"), number + 1
    return (f"python -m lowvram_grpo.run --preset {path / CONFIG} --init-adapter {path / ADAPTER} --output-dir {new}"
            if (path / CONFIG).is_file() else
            f"python -m lowvram_grpo.run --preset {preset or 'PRESET'} --init-adapter {path / ADAPTER} "
            f"--output-dir {new}")


# --------------------------------------------------------------------------- the lock

_HELD: dict[str, list] = {}  # lock file -> [open file, count]: this process's locks (re-entrant)


def _lock_file(path: Path) -> Path:
    """Where the lock of the run folder `path` lives: outside it, named by its absolute path."""
    key = hashlib.sha1(str(Path(path).expanduser().resolve()).encode()).hexdigest()[:20]
    getuid = getattr(os, "getuid", lambda: 0)
    return Path(tempfile.gettempdir()) / f"lowvram_grpo-locks-{getuid()}" / f"{key}.lock"


def _holder(lock_file: Path) -> str:
    try:
        return f"pid {json.loads(lock_file.read_text())['pid']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


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
        else:  # permission bits do not tell (root, a virtual filesystem): write a probe, remove it, keep the mtime
            times = existing.stat()
            try:
                fd, probe = tempfile.mkstemp(prefix=".lowvram-write-probe-", dir=existing)
                os.close(fd)
                os.unlink(probe)
                os.utime(existing, ns=(times.st_atime_ns, times.st_mtime_ns))
            except OSError as exc:
                problem = f"{existing} is not writable ({exc.strerror or type(exc).__name__})"
        if problem:
            raise ConfigError(f"cannot create output dir {self.path}: {problem}; pass a writable --output-dir")

    def holds_run(self) -> bool:
        """Whether the folder holds a run (what a run writes first or last is there), finished or not."""
        return self.path.is_dir() and (any((self.path / name).exists() for name in RUN_MARKERS)
                                       or bool(self.checkpoint_dirs()))

    def describe_run(self) -> str:
        """'a finished run (3 steps)' / 'a stopped run (newest checkpoint: checkpoint-4)' / ..."""
        summary = self._summary_or_none()
        if summary is not None and summary.get("status") == "complete":
            return f"a finished run ({summary.get('steps')} steps)"
        checkpoint = self.latest_checkpoint()
        return f"a stopped run ({f'newest checkpoint: {checkpoint.name}' if checkpoint else 'no checkpoint yet'})"

    def _summary_or_none(self) -> Optional[dict]:
        try:
            return self.read_summary()
        except RunDirError:
            return None

    def check_free(self, overwrite: bool = False) -> None:
        """Refuse a folder another process is writing (always), and one that holds a run unless `overwrite`:
        each with one line saying how to go on (RunDirError). Writes nothing."""
        if not self.writer:
            return
        holder = self.locked_by()
        if holder:
            raise RunDirError(f"output dir {self.path} is being written by a running process ({holder}): wait for it "
                              "to end, or pick another --output-dir")
        if overwrite or not self.holds_run():
            return
        what = self.describe_run()
        if what.startswith("a finished run"):
            how = f"train on from its adapter with: {train_on_command(self.path)}"
        else:
            how = f"continue it with: {resume_command(self.path)}"
        raise RunDirError(f"output dir {self.path} holds {what}: {how}; or pick another --output-dir, or add "
                          "--overwrite to replace it")

    def clear_run(self) -> None:
        """Delete the run this folder holds (its own files only: anything else in the folder stays), for
        `--overwrite`, at the new run's first write."""
        if not self.writer or not self.path.is_dir():
            return
        doomed = [self.path / name for name in (CONFIG, PLAN, SUMMARY, METRICS, REPORT, ADAPTER, PRIMED_ADAPTER, "runs",
                                                  *PLOT_FILES,
                                                 "README.md",  # the run's model card (TRL's, then model_card.py's)
                                                 COMPLETIONS, BEST_ADAPTER, CURVE_START, TRL_COMPLETIONS,
                                                 VALIDATION_PLOT, SAMPLER_PLOT)]
        doomed += list(self.path.glob("vllm_gen_lora*"))  # unsloth's rollout LoRA folder, moved here after training
        doomed += ([p for _, p in self.checkpoint_dirs() + self.prime_checkpoint_dirs()]
                   + list(self.path.glob("export-*")))
        doomed += (list(self.path.glob(f"{STAGING_PREFIX}*")) + list(self.path.glob(".adapter.*"))
                   + list(self.path.glob(".primed_adapter.*")))
        doomed += list(self.path.glob(f".{BEST_ADAPTER}.*"))
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    # ------------------------------------------------------------------ the lock
    def locked_by(self) -> Optional[str]:
        """Who holds this folder's lock ('pid N'), when another process does; None when free or held by us."""
        lock_file = _lock_file(self.path)
        if fcntl is None or str(lock_file) in _HELD or not lock_file.is_file():
            return None
        try:
            with open(lock_file, "rb") as fh:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(lock_file)
        except OSError:
            return None
        return None

    def lock(self) -> "RunDir":
        """Hold this folder's lock until `unlock()` (or the process ends); RunDirError when another process
        holds it. Re-entrant within a process (resume, then the run it starts, take it once each)."""
        if not self.writer or fcntl is None:
            return self
        lock_file = _lock_file(self.path)
        held = _HELD.get(str(lock_file))
        if held is not None:
            held[1] += 1
            return self
        lock_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fh = open(lock_file, "a+")
        for attempt in range(5):  # a moment's shared hold by another process's locked_by() is not a run
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 4:
                    fh.close()
                    raise RunDirError(f"output dir {self.path} is being written by a running process "
                                      f"({_holder(lock_file)}): wait for it to end, "
                                      "or pick another --output-dir") from None
                time.sleep(0.05)
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "path": str(self.path.resolve())}))
        fh.flush()
        _HELD[str(lock_file)] = [fh, 1]
        return self

    def unlock(self) -> None:
        lock_file = str(_lock_file(self.path))
        held = _HELD.get(lock_file)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[lock_file]
            held[0].close()  # closing the file releases the flock

    def create(self) -> "RunDir":
        if not self.writer:
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot create output dir {self.path}: {exc.strerror or exc}; "
                              "pass a writable --output-dir") from None
        return self

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def adapter_dir(self) -> Path:
        return self.path / ADAPTER

    @property
    def primed_adapter_dir(self) -> Path:
        return self.path / PRIMED_ADAPTER

    @property
    def best_adapter_dir(self) -> Path:
        return self.path / BEST_ADAPTER

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

    def write_plan(self, text: str) -> None:
        """plan.txt: the run's plan as `--dry-run` prints it (memory_plan.run_plan_text)."""
        self._write_text(PLAN, text)

    def read_config_raw(self) -> dict:
        """config.yaml as a mapping ({} when absent): what the report needs (names, lengths)."""
        text = self._read_text(CONFIG)
        if text is None:
            return {}
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise RunDirError(f"{self.path / CONFIG} is not YAML ({str(exc).splitlines()[0]}): "
                              "the file is damaged") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{self.path / CONFIG} is not a YAML mapping: the file is damaged")
        return data

    def read_config(self, overrides: "list[str]" = ()):
        """config.yaml as a validated RunConfig (what --resume continues), with `overrides` (--set) applied."""
        if not (self.path / CONFIG).is_file():
            raise ConfigError(f"--resume {self.path}: no config.yaml there; give the --output-dir of an earlier run")
        return load_config(str(self.path / CONFIG), list(overrides))

    # ------------------------------------------------------------------ summary.json
    def _read_json_object(self, name: str) -> Optional[dict]:
        """The run folder's JSON file `name` as a dict, None when it is absent; RunDirError when it is damaged."""
        text = self._read_text(name)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{self.path / name} is not JSON ({exc.msg}): the file is damaged") from None
        if not isinstance(data, dict):
            raise RunDirError(f"{self.path / name} is not a JSON object: the file is damaged")
        return data

    def read_summary(self) -> Optional[dict]:
        return self._read_json_object(SUMMARY)

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

    def _rows(self, name: str, text: str, what: str, cut_tail: bool = False) -> list[dict]:
        """The JSON rows of the file `name` (its `text`): each an object with a 'step', blank lines skipped; any other
        line raises RunDirError, but with `cut_tail` a last line without its newline that is not JSON (an append a
        kill cut short) is skipped."""
        lines = text.split("\n")
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                if cut_tail and number == len(lines):  # no newline after it: the append was cut short
                    break
                raise RunDirError(f"{self.path / name} line {number} is not JSON ({exc.msg}): "
                                  "the file is damaged") from None
            if not isinstance(row, dict) or "step" not in row:
                raise RunDirError(f"{self.path / name} line {number} is not {what} (an object with a 'step'): "
                                  "the file is damaged")
            rows.append(row)
        return rows

    def read_metrics(self, required: bool = True) -> list[dict]:
        """The logged rows; a missing file raises when `required` (the report needs it), else reads as []."""
        text = self._read_text(METRICS)
        if text is None:
            if required:
                raise RunDirError(f"{self.path} has no {METRICS}: pass the --output-dir of a lowvram_grpo run")
            return []
        return self._rows(METRICS, text, "a metrics row")

    def write_report(self, text: str) -> Path:
        self._write_text(REPORT, text)
        return self.path / REPORT

    def write_model_card(self, text: str) -> Path:
        """README.md, the run's model card (model_card.py), over the one TRL's trainer writes at each checkpoint."""
        self._write_text("README.md", text)
        return self.path / "README.md"

    def add_to_metrics_row(self, step: int, values: dict) -> None:
        """`values` merged into the logged row of `step` (the last one of that step), the file rewritten atomically:
        a held-out point measured on resume for a step logged before the stop (validation.py)."""
        rows = self.read_metrics(required=False)
        for row in reversed(rows):
            if row["step"] == step:
                row.update(values)
                break
        else:
            rows.append({"step": step, **values})
        self._write_text(METRICS, "".join(json.dumps(row) + "\n" for row in rows))

    # ------------------------------------------------------------------ completions.jsonl (completions.py's policy)
    def reset_completions(self) -> None:
        if self.writer:
            (self.path / COMPLETIONS).unlink(missing_ok=True)

    def completions_bytes(self) -> int:
        path = self.path / COMPLETIONS
        return path.stat().st_size if path.is_file() else 0

    def append_completions(self, rows: list[dict]) -> None:
        """Rows appended, one JSON object a line, in one write (a kill can leave a last line cut short:
        read_completions skips it)."""
        if self.writer and rows:
            with (self.path / COMPLETIONS).open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(row) + "\n" for row in rows))

    def write_completions(self, rows: list[dict]) -> None:
        """The whole file replaced atomically (completions.py thins it under its cap; a resume drops later steps)."""
        self._write_text(COMPLETIONS, "".join(json.dumps(row) + "\n" for row in rows))

    def read_completions(self) -> list[dict]:
        """The rows of completions.jsonl ([] when absent). A last line without its newline that is not JSON is an
        append a kill cut short and is skipped; any other line that is not a row raises RunDirError."""
        text = self._read_text(COMPLETIONS)
        if text is None:
            return []
        return self._rows(COMPLETIONS, text, "a completion row", cut_tail=True)

    def restore_completions(self, step: int) -> None:
        """completions.jsonl without the rows of steps after `step` (a resumed run writes them again)."""
        if self.writer and (self.path / COMPLETIONS).is_file():
            self.write_completions([row for row in self.read_completions() if row["step"] <= step])

    # ------------------------------------------------------------------ best_adapter/ (validation.py)
    def validation_staging(self) -> Path:
        """A fresh hidden folder to save the adapter being measured into (removed by the caller, or as a dead
        process's leftover by remove_leftovers)."""
        return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-validation-", dir=self.path))

    def keep_best(self, adapter: Path, facts: dict) -> Path:
        """The complete adapter folder `adapter` becomes best_adapter/ (atomically, replacing the one before), with
        `facts` (its step and validation numbers) as its best_step.json."""
        if self.writer:
            atomic_write_text(Path(adapter) / BEST_STEP, json.dumps(facts, indent=2) + "\n")
            atomic_replace_dir(adapter, self.best_adapter_dir)
        return self.best_adapter_dir

    def best_facts(self) -> Optional[dict]:
        """best_adapter/best_step.json ({'step': N, ...}), or None when there is no best adapter."""
        path = self.best_adapter_dir / BEST_STEP
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunDirError(f"{path} cannot be read ({exc}): the file is damaged") from None

    def write_curve_start(self, numbers: dict) -> None:
        """curve_start.json, the held-out curve's step 0, written atomically.

        Args:
            numbers: the point's metrics keys (`validation/<metric>`, validation.logged_numbers) and `start`, what was
                measured ('primed', 'init_adapter' or 'base').
        """
        self._write_text(CURVE_START, json.dumps({"step": 0, **numbers}, indent=2) + "\n")

    def read_curve_start(self) -> Optional[dict]:
        """The held-out curve's step 0 ({'step': 0, 'validation/...': ...}), or None when it was not measured (no
        curve, or a run stopped before it); a damaged file raises RunDirError."""
        data = self._read_json_object(CURVE_START)
        if data is None:
            return None
        if data.get("step") != 0:
            raise RunDirError(f"{self.path / CURVE_START} is not the curve's step 0 (an object with 'step': 0): "
                              "the file is damaged")
        return data

    def reset_curve_start(self) -> None:
        """No step-0 point (a run whose GRPO starts afresh measures it again)."""
        if self.writer:
            (self.path / CURVE_START).unlink(missing_ok=True)

    def reset_best(self) -> None:
        """No best adapter (a run that starts its GRPO afresh)."""
        if self.writer and self.best_adapter_dir.is_dir():
            doomed = self.path / f"{STAGING_PREFIX}{os.getpid()}-deleting-{BEST_ADAPTER}"
            os.rename(self.best_adapter_dir, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def restore_best(self, checkpoint: Path) -> None:
        """best_adapter/ as it was when `checkpoint` was written (none if it had none): a best measured after the
        checkpoint is not kept, since the curve after it is measured again."""
        if not self.writer:
            return
        saved = Path(checkpoint) / CHECKPOINT_BEST / BEST_ADAPTER
        if not saved.is_dir():
            self.reset_best()
            return
        root = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=self.path))
        try:
            shutil.copytree(saved, root / BEST_ADAPTER)
            atomic_replace_dir(root / BEST_ADAPTER, self.best_adapter_dir)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------ checkpoints
    def _numbered_dirs(self, pattern) -> list[tuple[int, Path]]:
        """(N, path) of every folder whose whole name `pattern` matches (N its group 1), lowest N first."""
        found = []
        for path in self.path.iterdir() if self.path.is_dir() else ():
            match = pattern.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def checkpoint_dirs(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint-N folder, oldest first."""
        return self._numbered_dirs(_CHECKPOINT)

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
        a hidden staging root (into root/checkpoint-step), then our run_state.json, metrics copy and best_adapter/
        copy (as validation/best_adapter) join them and the folder is renamed into place; older checkpoints
        beyond `keep` are deleted.
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
                if self.best_adapter_dir.is_dir():  # one level down: transformers loads adapter sub-folders on resume
                    shutil.copytree(self.best_adapter_dir, root / name / CHECKPOINT_BEST / BEST_ADAPTER)
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

    # ------------------------------------------------------------------ priming checkpoints
    def prime_checkpoint_dirs(self) -> list[tuple[int, Path]]:
        """(step, path) of every prime-checkpoint-N folder, oldest first."""
        return self._numbered_dirs(_PRIME_CHECKPOINT)

    def latest_prime_checkpoint(self) -> Optional[Path]:
        """The newest complete priming checkpoint, or None."""
        for _, path in reversed(self.prime_checkpoint_dirs()):
            if all((path / name).is_file() for name in PRIME_REQUIRED_FILES):
                return path
        return None

    def save_prime_checkpoint(self, step: int, write_files: Callable[[Path], None], keep: int) -> Optional[Path]:
        """prime-checkpoint-`step`, complete or absent: `write_files(folder)` fills a hidden staging folder,
        which is renamed into place; priming checkpoints beyond the `keep` newest are deleted."""
        if not self.writer:
            return None
        target = self.path / f"prime-checkpoint-{step}"
        root = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=self.path))
        try:
            (root / target.name).mkdir()
            write_files(root / target.name)
            atomic_replace_dir(root / target.name, target)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        self.prune_prime_checkpoints(keep)
        return target

    def prune_prime_checkpoints(self, keep: int) -> None:
        for _, path in self.prime_checkpoint_dirs()[:-keep]:
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
            raise RunDirError(f"{Path(checkpoint) / RUN_STATE} cannot be read ({exc}): "
                              "the checkpoint is damaged") from None

    def restore_metrics(self, checkpoint: Path) -> None:
        """metrics.jsonl as it was when `checkpoint` was written (rows logged after it are logged again)."""
        saved = Path(checkpoint) / METRICS
        self._write_text(METRICS, saved.read_text() if saved.is_file() else "")

    # ------------------------------------------------------------------ resume
    def resumable_config(self, overrides: "list[str]" = ()):
        """The config of the run in this folder, after checking there is a run to continue (ConfigError if not),
        with the `--set` overrides --resume allows (config.RESUME_SETTABLE) applied."""

        for assignment in overrides:
            key = assignment.partition("=")[0].strip()
            if key not in RESUME_SETTABLE:
                raise ConfigError(f"--resume --set {key}: a resumed run keeps its training settings; --resume may "
                                  f"change only {', '.join(RESUME_SETTABLE)} (start a new run to change the rest)")
        if not self.path.is_dir():
            raise ConfigError(f"--resume {self.path}: no such directory; give the --output-dir of an earlier run")
        if not (self.path / CONFIG).is_file():
            raise ConfigError(f"--resume {self.path}: no config.yaml there; give the --output-dir of an earlier run")
        holder = self.locked_by()
        if holder:
            raise RunDirError(f"--resume {self.path}: that run is still running ({holder}): wait for it to end")
        summary = self.read_summary() or {}
        if summary.get("control"):  # baseline.py's control: it trained with other rewards than its config.yaml's
            raise ConfigError(f"--resume {self.path}: that folder holds the {summary['control']} control of "
                              f"{summary.get('of_run')}, not a run to continue; run the control again with: python -m "
                              f"lowvram_grpo.baseline {summary.get('of_run')} --control {summary['control']}")
        if summary.get("status") == "complete":
            raise ConfigError(f"--resume {self.path}: that run is complete ({summary.get('steps')} steps); "
                              f"to train on from its adapter: {train_on_command(self.path)}")
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
