"""Where adapters are written and read. An adapter on disk is either complete or absent.

`save_adapter` writes PEFT's files (`adapter_config.json`, `adapter_model.safetensors`) and the
tokenizer into a hidden staging dir beside the target, checks them, then swaps it into place with
renames, so a crash at any moment leaves the old adapter or the new one, never a mix.
`load_adapter_into` checks an adapter before PEFT sees it and turns PEFT's errors into one line.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterError(ValueError):
    """An adapter that is missing, incomplete, corrupt, or made for another model."""


def atomic_replace_dir(staging: Path, target: Path) -> None:
    """Put `staging` at `target`; an existing `target` is moved aside first and removed after."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file via a temporary name and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_adapter(model, tokenizer, target: Path) -> Path:
    """Save the model's trained ('default') adapter and tokenizer to `target` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        adapters = ["default"] if "default" in getattr(model, "peft_config", {}) else None
        model.save_pretrained(staging, selected_adapters=adapters, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        check_adapter_dir(staging)
        atomic_replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def check_adapter_dir(path: Path) -> dict:
    """The adapter's config, after checking both PEFT files are present and readable."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"no adapter at {path}: expected a directory with {' and '.join(ADAPTER_FILES)}")
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise AdapterError(f"adapter at {path} is incomplete: {', '.join(missing)} missing")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter at {path} has an unreadable adapter_config.json ({exc})") from None
    try:
        from safetensors import safe_open

        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as fh:
            if not list(fh.keys()):
                raise AdapterError(f"adapter at {path} holds no weights")
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(f"adapter at {path} has a corrupt adapter_model.safetensors ({exc})") from None
    return config


def adapter_version(path: Path) -> int:
    """Changes when the adapter's weights file is rewritten (its mtime in ns), 0 when absent."""
    weights = Path(path) / "adapter_model.safetensors"
    return weights.stat().st_mtime_ns if weights.exists() else 0


def load_adapter_into(peft_model, path: Path, adapter_name: str) -> None:
    """Load the adapter at `path` into `peft_model` under `adapter_name` (inactive until selected)."""
    check_adapter_dir(path)
    try:
        peft_model.load_adapter(str(path), adapter_name=adapter_name, is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise AdapterError(f"adapter at {path} does not fit this base model: {first}") from None
