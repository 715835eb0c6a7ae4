"""The model handle every backend returns: the model, its tokenizer, and the notebook's LoRA calls.

`ModelHandle` gives the Unsloth notebook's interface on every backend:
- `fast_generate(prompts, sampling_params, lora_request=None)` -> list of completion texts. With
  `lora_request=None` the base model answers (adapters off), as in the notebook's first generation;
  with a handle from `load_lora(path)`, that saved adapter answers.
- `save_lora(path)` writes the trained adapter in PEFT format, atomically.
- `load_lora(path)` checks a saved adapter and returns a `LoraRequest` to pass as `lora_request=`.

Generation runs through a small engine interface (`GenerationEngine`): `TransformersEngine` here
(transformers' `generate` with the KV cache), or vLLM's `fast_generate` on a GPU with unsloth's
`fast_inference` (see `unsloth_backend.VLLMEngine`). The engine also owns `load_lora`: the transformers
engine loads a saved adapter into the PEFT model beside the trained one; a vLLM engine hands vLLM the
adapter's path and never adds adapters to the trained model (unsloth's weight sync would gather them).
Either way a request is keyed by the adapter's version, so an adapter re-saved to the same path is
served afresh, never from the old weights.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

from lowvram_grpo.model import lora_io
from lowvram_grpo.task.data import text_tokenizer


@dataclass
class SamplingParams:
    """Sampling settings, named as vLLM names them. temperature 0 = greedy."""
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 256
    seed: Optional[int] = None


@dataclass(frozen=True)
class LoraRequest:
    """A saved adapter made ready for generation (what vLLM's LoRARequest carries). `version` changes
    whenever the adapter's weights file is rewritten (lora_io.adapter_version); `engine_request` is the
    engine's own request object (vLLM's LoRARequest), None for the transformers engine."""

    name: str
    id: int
    path: str
    version: int = 0
    engine_request: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Completion:
    """One generated answer: its text and how many tokens it took (stop token included)."""
    text: str
    num_tokens: int


Prompt = Union[str, Sequence[dict]]


class GenerationEngine(Protocol):
    def generate(self, texts: list[str], params: SamplingParams,
                 lora_request: Optional[LoraRequest]) -> list[Completion]:
        ...

    def load_lora(self, path: Path) -> LoraRequest:
        ...

    def release_lora(self, request: LoraRequest) -> None:
        ...


class AdapterVersions:
    """Requests by (path, version): a re-saved adapter gets a new request with a new integer id; ids are never
    re-used, also after `forget` (vLLM caches an adapter by its id)."""

    def __init__(self):
        self._requests: dict[tuple[str, int], LoraRequest] = {}
        self._ids = itertools.count(1)

    def get(self, path: Path, make) -> LoraRequest:
        """The request for the adapter at `path` as it is now; `make(name, id, path, version)` builds a new one."""
        key = (str(path), lora_io.adapter_version(path))
        if key not in self._requests:
            new_id = next(self._ids)
            self._requests[key] = make(f"loaded_{new_id}", new_id, str(path), key[1])
        return self._requests[key]

    def forget(self, request: LoraRequest) -> bool:
        """Drop `request` (a later `get` of its adapter builds a new one); False if it was not held."""
        return self._requests.pop((request.path, request.version), None) is not None


class TransformersEngine:
    """Batched sampling with transformers' generate on the PEFT model (CPU, or GPU without vLLM)."""
    def __init__(self, handle: "ModelHandle"):
        self.handle = handle
        self.versions = AdapterVersions()

    def load_lora(self, path: Path) -> LoraRequest:
        """Load the saved adapter into the PEFT model beside the trained one (inactive until generation selects it)."""
        def make(name, new_id, path_text, version):
            lora_io.load_adapter_into(self.handle.model, Path(path_text), name, base_model=self.handle.base_model)
            return LoraRequest(name=name, id=new_id, path=path_text, version=version)

        return self.versions.get(path, make)

    def release_lora(self, request: LoraRequest) -> None:
        """Delete the loaded adapter from the PEFT model: otherwise it would stay beside the trained one,
        in memory and in every checkpoint TRL writes (save_pretrained saves all adapters)."""
        if self.versions.forget(request) and request.name in self.handle.model.peft_config:
            self.handle.model.delete_adapter(request.name)

    def _adapter_context(self, lora_request: Optional[LoraRequest]):
        model = self.handle.model
        if lora_request is None:
            return model.disable_adapter()
        return _active_adapter(model, lora_request.name)

    def generate(self, texts: list[str], params: SamplingParams,
                 lora_request: Optional[LoraRequest]) -> list[Completion]:
        import torch

        model, tokenizer = self.handle.model, self.handle.text_tokenizer
        old_side = tokenizer.padding_side
        tokenizer.padding_side = "left"  # decoder-only models continue from the right end
        try:
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tokenizer.padding_side = old_side
        batch = {k: v.to(model.device) for k, v in batch.items()}
        sampling = params.temperature > 0
        kwargs = dict(
            max_new_tokens=params.max_tokens,
            do_sample=sampling,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,  # training turns the cache off in the config; generation needs it for speed
        )
        if sampling:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad(), self._adapter_context(lora_request):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out = model.generate(**batch, **kwargs)
        finally:
            model.train(was_training)
        new_tokens = out[:, batch["input_ids"].shape[1]:]
        texts_out = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        lengths = _generated_lengths(new_tokens, tokenizer)
        return [Completion(text, n) for text, n in zip(texts_out, lengths)]


def _generated_lengths(new_tokens, tokenizer) -> list[int]:
    """Tokens generated per row: up to and including the first end-of-sequence token (the rest is padding)."""
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    lengths = []
    for row in new_tokens.tolist():
        n = len(row)
        for i, token in enumerate(row):
            if token in stop_ids:
                n = i + 1
                break
        lengths.append(n)
    return lengths


@contextlib.contextmanager
def _active_adapter(model, name: str):
    previous = model.active_adapter
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(previous)


class ModelHandle:
    """A PEFT model with its tokenizer and the notebook's LoRA calls. Built by a backend's `load_model`."""
    def __init__(self, model, tokenizer, resolved, base_model: str, engine: Optional[GenerationEngine] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.resolved = resolved      # the settings the model was built with (resolve.py)
        self.base_model = base_model  # the path or id the base weights came from
        self.engine = engine or TransformersEngine(self)

    @property
    def backend(self) -> str:
        return self.resolved.backend

    @property
    def text_tokenizer(self):
        """What encodes and decodes text: `tokenizer` itself, or the tokenizer inside the processor unsloth returns for
        a vision-language checkpoint (Qwen3.5: Qwen3VLProcessor, data.text_tokenizer). `tokenizer` stays what the
        loader returned: TRL's processing_class and the saved adapter's files."""
        return text_tokenizer(self.tokenizer)

    @property
    def plan(self):
        """The run's phases' settings (plans.RunPlan), decided with the rest (resolve.py)."""
        return self.resolved.plan

    # -------------------------------------------------------------- generation
    def apply_chat_template(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.text_tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True,
                                                  **self.plan.prompts.template_kwargs)

    def fast_generate(self, prompts: Union[Prompt, list[Prompt]], sampling_params: Optional[SamplingParams] = None,
                      lora_request: Optional[LoraRequest] = None) -> list[str]:
        """Completion texts for `prompts` (templated strings or chat messages); base model when lora_request is None."""
        return [c.text for c in self.generate(prompts, sampling_params, lora_request)]

    def generate(self, prompts: Union[Prompt, list[Prompt]], sampling_params: Optional[SamplingParams] = None,
                 lora_request: Optional[LoraRequest] = None) -> list[Completion]:
        """Like fast_generate, with each completion's token count."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        texts = [self.apply_chat_template(p) for p in prompts]
        return self.engine.generate(texts, sampling_params or SamplingParams(), lora_request)

    # -------------------------------------------------------------- LoRA io
    def save_lora(self, path: Union[str, Path]) -> Path:
        """Write the trained adapter (PEFT format + tokenizer) to `path`, complete or not at all."""
        return lora_io.save_adapter(self.model, self.tokenizer, Path(path))

    def load_lora(self, path: Union[str, Path]) -> LoraRequest:
        """Check the adapter at `path` and make it ready for generation; pass the result as `lora_request`.
        A re-saved adapter (same path, new weights) gets a new request."""
        path = Path(path).resolve()
        lora_io.restore_interrupted_replace(path)
        lora_io.check_adapter_dir(path)
        return self.engine.load_lora(path)

    def release_lora(self, request: LoraRequest) -> None:
        """Free what `load_lora` loaded for `request` when it is no longer needed (the transformers engine
        loads it into the trained PEFT model; the vLLM engines read it from disk and keep nothing here)."""
        self.engine.release_lora(request)

    # -------------------------------------------------------------- helpers
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)
