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
from typing import Optional

from lowvram_grpo.run.errors import AdapterError

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
        raise AdapterError(f"adapter at {path} does not fit this base model (it was made for {made_for}{this}): {detail}") from None


# --------------------------------------------------------------------------- starting a run from an adapter

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's current and older weights file
# adapter_config.json keys that shape the LoRA beyond r / alpha / targets / dropout, passed on when set
LORA_EXTRAS = ("bias", "use_rslora", "modules_to_save", "layers_to_transform", "layers_pattern")


def adapter_settings(path) -> dict:
    """The LoRA settings of the saved PEFT adapter at `path` (ours or another tool's), from its
    adapter_config.json: r, alpha, target_modules, dropout, the base model it was trained on and the
    extras (LORA_EXTRAS). AdapterError with one line when it is not a LoRA adapter that can be trained on."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        if (path / "adapter" / "adapter_config.json").is_file():
            raise AdapterError(f"{path} holds a run, not an adapter: give its adapter, {path / 'adapter'}")
        what = "does not exist" if not path.exists() else "is not a PEFT adapter (no adapter_config.json)"
        raise AdapterError(f"{path} {what}: give the folder of a saved PEFT LoRA adapter (adapter_config.json + weights)")
    if not any((path / name).is_file() for name in ADAPTER_WEIGHTS):
        raise AdapterError(f"adapter at {path} has no weights ({' or '.join(ADAPTER_WEIGHTS)})")
    if (path / ADAPTER_WEIGHTS[0]).is_file():
        problem = safetensors_problem(path / ADAPTER_WEIGHTS[0])
        if problem:
            raise AdapterError(f"adapter at {path} has a damaged {ADAPTER_WEIGHTS[0]} ({problem}): "
                               "give an adapter folder saved completely (a run's adapter/ or checkpoint-N/)")
    try:
        raw = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter at {path} has an unreadable adapter_config.json ({exc})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else type(raw).__name__
        raise AdapterError(f"adapter at {path} is a {kind} adapter: only LoRA adapters can be trained on here")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"adapter at {path} names its target modules as {targets!r}, not a list of layer names: "
                           "only listed target_modules can be trained on here")
    alpha = raw.get("lora_alpha", raw.get("r"))
    if not isinstance(raw.get("r"), int) or not isinstance(alpha, (int, float)) or alpha != int(alpha):
        raise AdapterError(f"adapter at {path} has r={raw.get('r')!r}, lora_alpha={alpha!r}: expected whole numbers")
    return {"r": raw["r"], "alpha": int(alpha), "target_modules": sorted(targets),
            "dropout": float(raw.get("lora_dropout") or 0.0), "base_model": raw.get("base_model_name_or_path"),
            "extras": {key: raw[key] for key in LORA_EXTRAS if raw.get(key) not in (None, False, "none", [], {})}}


def safetensors_problem(path: Path) -> Optional[str]:
    """Why the safetensors file at `path` cannot be read whole (a truncated copy, another format), or None; from
    its header alone, without torch: 8 bytes of header length, the JSON header, every tensor's bytes inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            length = int.from_bytes(head, "little")
            if length > size - 8:
                return f"its header says {length} bytes, the file holds {size}"
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as exc:
        return f"unreadable header: {type(exc).__name__}"
    if not isinstance(header, dict):
        return "unreadable header"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2]
    if not ends:
        return "no tensors in it"
    needed = 8 + length + max(ends)
    if needed > size:
        return f"truncated: {size} of {needed} bytes"
    return None


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
