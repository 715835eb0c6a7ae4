"""Backends: how the 4-bit/LoRA model is built. Pick one *before* trl/transformers are imported.

- `unsloth`: `FastLanguageModel.from_pretrained(load_in_4bit, fast_inference, max_lora_rank,
  gpu_memory_utilization)` + `get_peft_model(use_gradient_checkpointing="unsloth")`, with
  `PatchFastRL("GRPO", FastLanguageModel)` where the installed unsloth has it. On a machine without
  CUDA, unsloth's own CPU backend runs this same call with fast_inference off.
- `hf`: transformers + bitsandbytes (NF4 4-bit when asked) + peft. Also the multi-GPU path (TRL with accelerate).

Both return a `ModelHandle` and train through TRL's `GRPOTrainer`. `auto` picks unsloth where CUDA
and unsloth are both present, else hf. Usage:

    name = choose_backend("auto")   # imports nothing heavy
    prepare_backend(name)           # imports unsloth first when chosen (it patches transformers/trl)
    handle = load_model(config, name)
"""
from __future__ import annotations

import importlib.util

from .base import LoraRequest, ModelHandle, SamplingParams

BACKENDS = ("auto", "unsloth", "hf")


class BackendError(RuntimeError):
    """A backend that cannot run here; the message says which one can."""


def cuda_available() -> bool:
    import torch  # torch before trl/transformers is fine for unsloth

    return torch.cuda.is_available()


def unsloth_installed() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def choose_backend(requested: str) -> str:
    """The backend to use for `requested` (auto|unsloth|hf)."""
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "unsloth" if (cuda_available() and unsloth_installed()) else "hf"
    if requested == "unsloth" and not unsloth_installed():
        raise BackendError("backend 'unsloth' is not installed: pip install -r requirements-cpu.txt (CPU) or requirements.txt (GPU), or use --backend hf")
    return requested


def prepare_backend(name: str) -> None:
    """Import what must come first. Unsloth patches transformers and trl, so it is imported here, early."""
    if name == "unsloth":
        from . import unsloth_backend

        unsloth_backend.prepare()


def load_model(config, name: str) -> ModelHandle:
    """Build the PEFT model for `config` on backend `name` (after `prepare_backend`)."""
    if name == "unsloth":
        from . import unsloth_backend

        return unsloth_backend.load_model(config)
    from . import hf_backend

    return hf_backend.load_model(config)


def export_model(handle: ModelHandle, adapter_dir, directory, kind: str):
    """Write the base with the trained adapter merged in: kind merged16 (16-bit safetensors checkpoint)
    or gguf (q4_k_m, unsloth only). Through unsloth's savers on the unsloth backend; PEFT's
    merge_and_unload on the saved adapter on the hf backend. Returns the folder written."""
    from pathlib import Path

    directory = Path(directory)
    if handle.backend == "unsloth":
        from . import unsloth_backend

        return unsloth_backend.export(handle.model, handle.tokenizer, directory, kind)
    if kind != "merged16":
        raise BackendError(f"--export {kind} needs the unsloth backend (its llama.cpp converter): use --export merged16")
    from . import hf_backend

    return hf_backend.export_merged16(handle.base_model, Path(adapter_dir), directory)


__all__ = ["BACKENDS", "BackendError", "LoraRequest", "ModelHandle", "SamplingParams", "choose_backend",
           "cuda_available", "export_model", "load_model", "prepare_backend", "unsloth_installed"]
