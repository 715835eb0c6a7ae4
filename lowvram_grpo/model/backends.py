"""Backends: where the 4-bit/LoRA model is built. resolve.py picks one *before* trl/transformers are imported.

- `unsloth`: `FastLanguageModel.from_pretrained(load_in_4bit, fast_inference, max_lora_rank,
  gpu_memory_utilization)` + `get_peft_model(use_gradient_checkpointing="unsloth")`, with
  `PatchFastRL("GRPO", FastLanguageModel)` where the installed unsloth has it. On a machine without
  CUDA, unsloth's own CPU backend runs this same call with fast_inference off.
- `hf`: transformers + bitsandbytes (NF4 4-bit when asked) + peft. Also the multi-GPU path (TRL with accelerate).

Both return a `ModelHandle` and train through TRL's `GRPOTrainer`. Usage:

    resolved = resolve(config, detect(), "auto")   # resolve.py: backend, dtype, ... decided once
    prepare_backend(resolved.backend)              # imports unsloth first when chosen (it patches transformers/trl)
    handle = load_model(resolved)
"""
from __future__ import annotations

from pathlib import Path

from lowvram_grpo.model import hf_backend, unsloth_backend
from lowvram_grpo.model.decoding import install
from lowvram_grpo.model.handle import LoraRequest, ModelHandle, SamplingParams
from lowvram_grpo.core.errors import BackendError
from lowvram_grpo.settings.model_shapes import ModelFacts


def prepare_backend(name: str) -> None:
    """Import what must come first. Unsloth patches transformers and trl, so it is imported here, early."""
    if name == "unsloth":

        unsloth_backend.prepare()


def load_model(resolved, log=print) -> ModelHandle:
    """Build the PEFT model for the resolved settings (after `prepare_backend(resolved.backend)`)."""
    from lowvram_grpo.core.host_memory import contiguous_head_input, limit_kernel_caches  # loads transformers

    limit_kernel_caches()  # before the first bf16 matmul: 8 kernels kept per cache, not 1024 (host_memory.py)
    if resolved.backend == "unsloth":

        handle = unsloth_backend.load_model(resolved, log)
    else:

        handle = hf_backend.load_model(resolved)

    install(handle.model, handle.resolved.decode, log)  # our decode loop where resolve chose it (decoding.py)
    contiguous_head_input(handle.model)  # no [batch, hidden, vocab] copy in each generation prefill (host_memory.py)
    return handle


def check_export(kind, backend: str) -> None:
    """Refuse, before anything is written, an export the chosen backend cannot do."""
    if kind not in (None, "merged16", "gguf"):
        raise BackendError(f"unknown export {kind!r}: choose merged16 or gguf")
    if kind == "gguf" and backend != "unsloth":
        raise BackendError("--export gguf needs the unsloth backend (its llama.cpp converter): "
                           "add --backend unsloth, or use --export merged16 and convert with llama.cpp")


def host_available_bytes() -> "int | None":
    """The host memory the kernel says a new allocation can take (MemAvailable), None where it does not say."""
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def export_host_bytes(kind, model: ModelFacts, backend: str) -> "int | None":
    """The host RAM `--export kind` of the model holds at once on `backend`, in bytes (`model`: its facts, derived once
    for the run: plans.ModelPlan.facts); None when nothing of size passes through it (gguf, no export) or the
    architecture is one the plan has no shape for.

    - hf: PEFT's merge_and_unload builds the whole base in bfloat16 on the CPU (hf_backend.export_merged16): every
      parameter, 2 bytes each (~16.1 GB for Llama-3.1-8B).
    - unsloth: its merged save streams. `save_pretrained_merged` is unsloth_generic_save_pretrained_merged
      (unsloth/save.py patch_saving_functions), whose unsloth_generic_save calls unsloth_zoo's
      merge_and_overwrite_lora(..., low_disk_space_usage=True); that downloads the 16-bit shards and merges each in
      place (unsloth_zoo/saving_utils.py _merge_and_overwrite_lora: the shard mmap'd for writing, one
      `file.get_tensor(key)` at a time, merged and written back with _write_tensor_direct_torch). What it holds is
      one tensor and its merged copy: the largest weight (the embedding or LM head) twice in 16 bits."""
    if kind != "merged16":
        return None

    shape = model.shape
    if shape is None:  # an architecture the plan has no shape for: nothing to check against
        return None
    if backend == "unsloth":
        largest = max([shape.vocab * shape.hidden, *(a * b for a, b in shape.linear_dims().values())])
        return 2 * largest * 2
    return shape.params * 2


def check_export_fits_host(kind, model: ModelFacts, backend: str, available: "int | None" = None) -> None:
    """Refuse, before anything heavy, an export whose host RAM (export_host_bytes: the whole 16-bit base on the hf
    backend, one tensor on unsloth's streamed merge) this machine's available RAM cannot hold (a Colab T4 has
    ~12.7 GB; Llama-3.1-8B's merge on the hf backend needs ~16)."""
    needed = export_host_bytes(kind, model, backend)
    if needed is None:
        return
    available = host_available_bytes() if available is None else available
    if available is not None and needed > available:
        what = ("largest 16-bit tensor and the merged copy (unsloth merges one tensor at a time)"
                if backend == "unsloth" else "16-bit weights")
        raise BackendError(f"--export {kind} needs ~{needed / 1e9:.1f} GB of host RAM for {model.name}'s {what} "
                           f"and this machine has {available / 1e9:.1f} GB available: leave --export out (the run's "
                           "adapter/ loads on the same base anywhere) and export on a machine with more RAM")


def export_model(handle: ModelHandle, adapter_dir, directory, kind: str):
    """Write the base with the trained adapter merged in: kind merged16 (16-bit safetensors checkpoint)
    or gguf (q4_k_m, unsloth only). Through unsloth's savers on the unsloth backend; PEFT's
    merge_and_unload on the saved adapter on the hf backend. Returns the folder written."""

    directory = Path(directory)
    check_export(kind, handle.backend)
    if handle.backend == "unsloth":

        return unsloth_backend.export(handle.model, handle.tokenizer, directory, kind)

    return hf_backend.export_merged16(handle.base_model, Path(adapter_dir), directory)


__all__ = ["BackendError", "LoraRequest", "ModelHandle", "SamplingParams", "check_export", "export_model",
           "load_model", "prepare_backend"]
