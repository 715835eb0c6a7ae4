"""Where adapters are written and read. An adapter on disk is either complete or absent.

`save_adapter` writes PEFT's files (`adapter_config.json`, `adapter_model.safetensors`) and the
tokenizer into a hidden staging dir beside the target, checks them, then swaps it into place
(`atomic_replace_dir`), so a kill at any moment leaves the old adapter or the new one, never a mix.
Checkpoints (run_dir.py) and small files (`atomic_write_text`: config.yaml, summary.json) use
the same two helpers. `load_adapter_into` checks an adapter before PEFT sees it and turns PEFT's
errors into one line.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from lowvram_grpo.core.errors import AdapterError
from lowvram_grpo.settings.adapter_files import (  # noqa: F401  (read here and as lora_io.X)
    ADAPTER_WEIGHTS,
    LORA_EXTRAS,
    adapter_settings,
    safetensors_problem,
)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux/glibc
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # old kernel or a filesystem without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def _aside_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def restore_interrupted_replace(target: Path) -> None:
    """Put back an old copy a kill left aside between the two renames of the fallback path."""
    target, aside = Path(target), _aside_name(Path(target))
    if aside.exists():
        if target.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, target)


def atomic_replace_dir(staging: Path, target: Path) -> None:
    """Put the complete dir `staging` at `target`. An existing `target` is swapped out in one atomic
    step where the OS can (Linux); elsewhere it is renamed aside first, and `restore_interrupted_replace`
    puts it back if a kill lands between the two renames."""
    staging, target = Path(staging), Path(target)
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; the result should not be
    restore_interrupted_replace(target)
    if target.exists() and _exchange_paths(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old copy
        return
    aside = None
    if target.exists():
        aside = _aside_name(target)
        os.rename(target, aside)
    os.rename(staging, target)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file via a temporary name and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a config or summary should not be
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_staging(parent: Path, prefix: str) -> None:
    """Remove hidden staging dirs named `prefix<pid>-...` left by a killed process (never a live one's)."""
    for path in Path(parent).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_adapter(model, tokenizer, target: Path) -> Path:
    """Save the model's trained ('default') adapter and tokenizer to `target` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target.parent, f".{target.name}.tmp-")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
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


def load_adapter_into(peft_model, path: Path, adapter_name: str, base_model: str = "") -> None:
    """Load the adapter at `path` into `peft_model` under `adapter_name` (inactive until selected)."""
    restore_interrupted_replace(Path(path))
    config = check_adapter_dir(path)
    try:
        peft_model.load_adapter(str(path), adapter_name=adapter_name, is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
        detail = next((line for line in lines if "size mismatch" in line), lines[0])[:300]
        made_for = config.get("base_model_name_or_path") or "an unnamed base"
        this = f"; this is {base_model}" if base_model else ""
        raise AdapterError(f"adapter at {path} does not fit this base model (it was made for {made_for}{this}): "
                           f"{detail}") from None


# --------------------------------------------------------------------------- starting a run from an adapter

def _load_error(path: Path, base_model: str, exc: Exception) -> AdapterError:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    detail = next((line for line in lines if "size mismatch" in line), lines[0])[:300]
    return AdapterError(f"adapter at {path} does not fit this base model ({base_model}): {detail}")


def load_trainable_adapter(model, path, base_model: str = ""):
    """`model` (a transformers model) with the saved adapter at `path` as its trainable LoRA ('default'),
    as PEFT loads one (every option of its adapter_config.json)."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=True)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise _load_error(Path(path), base_model, exc) from None


def load_adapter_weights(peft_model, path, base_model: str = "", adapter_name: str = "default") -> None:
    """Put the saved adapter's weights at `path` into `peft_model`'s trainable adapter `adapter_name` (made with
    the same r / alpha / targets, e.g. by unsloth's get_peft_model); every LoRA weight of that adapter must match
    one way or the other (others, such as TRL's frozen "ref" copy, are left as they are)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    try:
        weights = load_peft_weights(str(path), device="cpu")
        result = set_peft_model_state_dict(peft_model, weights, adapter_name=adapter_name)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise _load_error(Path(path), base_model, exc) from None
    missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter_name}." in k]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        first = (unexpected or missing)[0]
        raise AdapterError(f"adapter at {path} does not fit this model's LoRA layers ({len(unexpected)} weights it "
                           f"has no place for, {len(missing)} it lacks, e.g. {first})")
