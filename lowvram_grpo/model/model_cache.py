"""The cache of models built on this machine (the built-ins): where they live, and building one exactly once.

`cache_dir()` (settings.builtin_names) is $LOWVRAM_GRPO_CACHE, else ~/.cache/lowvram_grpo. `build_once(name, build)`
builds into a hidden staging dir and renames it into place, so a crash or a concurrent build never leaves a
half-written model behind. Imports nothing heavy.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from lowvram_grpo.settings.builtin_names import cache_dir


def build_once(name: str, build) -> Path:
    """`cache_dir()/name`, made by `build(staging_dir)` on first use and renamed into place, so a
    crash or a concurrent build never leaves a half-written model behind."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=target.parent))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
