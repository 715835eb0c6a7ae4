"""The `unsloth` backend. The only module that imports unsloth, and only inside functions.

On CUDA this is the notebook's recipe: `FastLanguageModel.from_pretrained(load_in_4bit, fast_inference,
max_lora_rank, gpu_memory_utilization)`, `get_peft_model(use_gradient_checkpointing="unsloth")`,
`PatchFastRL("GRPO", FastLanguageModel)`, and generation through vLLM (`VLLMEngine`).
Without CUDA, unsloth (2026.10.9+) switches itself to its CPU backend (stock transformers + PEFT,
no vLLM, no PatchFastRL): the same calls run, with fast_inference off. "unsloth" gradient
checkpointing offloads activations to host RAM, which on a CPU is plain recomputation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..builtin_models import resolve_model_path
from .base import Completion, LoraRequest, ModelHandle, SamplingParams


def prepare() -> None:
    """Import unsloth before trl/transformers so its patches apply; patch TRL's GRPO where it can."""
    import unsloth  # noqa: F401  (first import patches transformers, peft and trl)

    patch = getattr(unsloth, "PatchFastRL", None)
    if patch is not None:  # absent from unsloth's CPU backend
        patch("GRPO", unsloth.FastLanguageModel)


def _dtype(name: str):
    import torch

    return None if name == "auto" else getattr(torch, name)  # None: unsloth picks per device


def _checkpointing(config):
    return {"unsloth": "unsloth", "true": True, "false": False}[config.memory.gradient_checkpointing]


def from_pretrained_kwargs(config, path: str) -> dict:
    """`FastLanguageModel.from_pretrained`'s arguments for `config` (the notebook's call)."""
    return dict(
        model_name=path,
        max_seq_length=config.model.max_seq_length,
        dtype=_dtype(config.model.dtype),
        load_in_4bit=config.memory.load_in_4bit,
        fast_inference=config.model.fast_inference,
        max_lora_rank=config.lora.r,
        gpu_memory_utilization=config.memory.gpu_memory_utilization,
        use_gradient_checkpointing=_checkpointing(config),
    )


def get_peft_model_kwargs(config) -> dict:
    """`FastLanguageModel.get_peft_model`'s arguments (after the model) for `config`."""
    return dict(
        r=config.lora.r,
        target_modules=list(config.lora.target_modules),
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        use_gradient_checkpointing=_checkpointing(config),
        random_state=config.lora.random_state,
    )


def load_model(config) -> ModelHandle:
    import torch
    from unsloth import FastLanguageModel

    from . import BackendError

    cuda = torch.cuda.is_available()
    if config.model.fast_inference and not cuda:
        raise BackendError("model.fast_inference (vLLM) needs an NVIDIA GPU: set model.fast_inference=false on this machine")
    path = resolve_model_path(config.model.name)
    model, tokenizer = FastLanguageModel.from_pretrained(**from_pretrained_kwargs(config, path))
    model = FastLanguageModel.get_peft_model(model, **get_peft_model_kwargs(config))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    handle = ModelHandle(model, tokenizer, backend="unsloth", base_model=path)
    if config.model.fast_inference:
        handle.engine = VLLMEngine(model)
    return handle


# unsloth's savers, as the notebook calls them: (method name, keyword arguments).
EXPORTS = {
    "merged16": ("save_pretrained_merged", {"save_method": "merged_16bit"}),
    "gguf": ("save_pretrained_gguf", {"quantization_method": "q4_k_m"}),
}


def export(model, tokenizer, directory: Path, kind: str) -> Path:
    """Write the model with its adapter merged in through unsloth's saver for `kind` (EXPORTS).
    unsloth writes into `directory` itself (GGUF: it fetches and builds llama.cpp on first use)."""
    from . import BackendError

    method, kwargs = EXPORTS[kind]
    saver = getattr(model, method, None)
    if saver is None:
        raise BackendError(f"this unsloth model has no {method}: --export {kind} needs unsloth's savers")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saver(str(directory), tokenizer, **kwargs)
    return directory


class VLLMEngine:
    """Generation through unsloth's vLLM (`model.fast_generate`), sharing the 4-bit weights. CUDA only;
    not run on the CPU machines this project is tested on."""

    def __init__(self, model):
        self.model = model
        self._vllm_requests: dict[str, object] = {}

    def _vllm_lora(self, lora_request: Optional[LoraRequest]):
        if lora_request is None:
            return None
        if lora_request.path not in self._vllm_requests:
            self._vllm_requests[lora_request.path] = self.model.load_lora(lora_request.path)
        return self._vllm_requests[lora_request.path]

    def generate(self, texts: list[str], params: SamplingParams, lora_request: Optional[LoraRequest]) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams

        sampling = VLLMSamplingParams(
            temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, seed=params.seed
        )
        outputs = self.model.fast_generate(texts, sampling_params=sampling, lora_request=self._vllm_lora(lora_request))
        return [Completion(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]
