"""The `hf` backend: transformers + bitsandbytes + peft. This is where the model is built without unsloth.

4-bit NF4 with double quantization when `memory.load_in_4bit` (bitsandbytes runs it on CPU too),
LoRA from peft on `lora.target_modules` (or, with `lora.init_adapter`, a saved adapter loaded as the trainable
LoRA), gradient checkpointing unless turned off. The same path serves several GPUs later (TRL with accelerate
places the model).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from lowvram_grpo.model.builtin_models import resolve_model_path
from lowvram_grpo.model.handle import ModelHandle
from lowvram_grpo.model.lora_io import atomic_replace_dir, load_trainable_adapter
from lowvram_grpo.settings import checks


def quantization_kwargs(resolved) -> dict:
    """transformers' `BitsAndBytesConfig` arguments: NF4 with double quantization, computing in the resolved dtype."""
    import torch

    return dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=getattr(torch, resolved.dtype))


def load_model(resolved) -> ModelHandle:
    """The PEFT model for `resolved` (resolve.py decided dtype, device and checkpointing)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    plan = resolved.plan.model
    path = resolve_model_path(plan.name)
    dtype = getattr(torch, resolved.dtype)
    checkpointing = resolved.gradient_checkpointing != "false"

    quantization = BitsAndBytesConfig(**quantization_kwargs(resolved)) if resolved.load_in_4bit else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quantization,
                                                 device_map=resolved.device)
    checks.after_load(resolved.plan, model)  # lengths and LoRA layers against the loaded model, before anything is
                                             # written
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=plan.max_seq_length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if quantization is not None:  # casts embeddings, lm_head and norms to fp32 (the memory plan counts it)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()

    if plan.init_adapter:  # a saved adapter as the trainable LoRA, as PEFT loads it (checks.py checked its base)

        return ModelHandle(load_trainable_adapter(model, plan.init_adapter, base_model=path), tokenizer,
                           resolved, base_model=path)
    torch.manual_seed(plan.lora_random_state)  # the adapters' initial A matrices
    model = get_peft_model(model, LoraConfig(**plan.lora_kwargs()))
    return ModelHandle(model, tokenizer, resolved, base_model=path)


def export_merged16(base_model: str, adapter_dir: Path, directory: Path) -> Path:
    """The base model in bfloat16 with the saved adapter merged in (PEFT merge_and_unload), written as a
    plain transformers checkpoint plus the tokenizer, atomically. Built on the CPU from the adapter on
    disk: a 4-bit base in GPU memory cannot be merged without rounding, and the live model stays as it is."""

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer


    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.bfloat16, device_map="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))  # saved beside the adapter
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-{os.getpid()}-", dir=directory.parent))
    try:
        merged.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        atomic_replace_dir(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory
