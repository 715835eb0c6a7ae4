"""A user's own Python file (rewards.module, tools.module): imported once per path and modification time, every
failure one line naming the setting. Pure: imports nothing heavy, runs only the user's file."""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

_MODULES: dict[tuple, object] = {}


def first_line(exc: BaseException) -> str:
    """'Type: the first line of its message' (300 characters at most): how an error is named in one line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def import_user_file(path: str, setting: str, holds: str, error: type[Exception]):
    """The module of the .py file `path` given as `setting` (e.g. 'rewards.module', a file of `holds`); `error`
    (a LowvramError class) with one line when it is not a .py file, does not exist, or fails to import."""
    file = Path(path)
    if file.suffix != ".py":
        raise error(f"{setting} must be a .py file of {holds}; got {path!r}")
    if not file.is_file():
        raise error(f"{setting} {path} does not exist: give the path of a .py file (relative to the current directory "
                    "or the preset)")
    key = (str(file.resolve()), file.stat().st_mtime_ns)
    if key not in _MODULES:
        name = f"lowvram_grpo_user_{setting.split('.')[0]}_{len(_MODULES)}"
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit, ... all mean the same to the user
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise error(f"{setting} {path} failed to import: {first_line(exc)}") from None
        _MODULES[key] = module
    return _MODULES[key]


def own_functions(module) -> list[str]:
    """The public functions a user's file defines itself (not the ones it imports), by name, sorted."""
    return sorted(n for n, f in vars(module).items()
                  if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__)
