"""The `unsloth` backend. The only module that imports unsloth, and only inside functions.

On CUDA this is the notebook's recipe: `FastLanguageModel.from_pretrained(load_in_4bit, fast_inference,
max_lora_rank, gpu_memory_utilization)`, `get_peft_model(use_gradient_checkpointing="unsloth")`,
`PatchFastRL("GRPO", FastLanguageModel)`, and generation through vLLM (`VLLMEngine`).
Without CUDA, unsloth (2026.10.9+) switches itself to its CPU backend (stock transformers + PEFT,
no vLLM, no PatchFastRL): the same calls run, with fast_inference off. "unsloth" gradient
checkpointing offloads activations to host RAM, which on a CPU is plain recomputation.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Optional

from lowvram_grpo.core import internals
from lowvram_grpo.model.builtin_models import resolve_model_path
from lowvram_grpo.model.handle import AdapterVersions, Completion, LoraRequest, ModelHandle, SamplingParams
from lowvram_grpo.model.lora_io import adapter_settings, load_adapter_weights
from lowvram_grpo.core.errors import BackendError, EngineStopped
from lowvram_grpo.settings import checks
from lowvram_grpo.task.data import text_tokenizer
from lowvram_grpo.settings.resolve import (
    NO_FLASHINFER_ENV,
    decode_graphs_environment_note,
    follow_loaded_dtype,
    for_unsloth_trainer,
    without_vllm,
)


def prepare() -> None:
    """Import unsloth before trl/transformers so its patches apply, and patch TRL's GRPO into unsloth's
    generated `UnslothGRPOTrainer` (PatchFastRL), on a GPU and, where unsloth's RL module imports, on a CPU.

    On a CPU unsloth's package namespace is its CPU backend, which has no PatchFastRL; the RL module
    (`unsloth.models.rl`) still imports where triton is installed (the GPU set) and patches TRL the same way,
    so the unsloth backend trains with the class a GPU run gets. Where it does not import (the CPU set: no
    triton), training uses stock TRL's GRPOTrainer; `patched_trainer_problem()` says why."""
    import unsloth  # noqa: F401  (first import patches transformers, peft and trl)

    global _PATCH_PROBLEM
    patch = getattr(unsloth, "PatchFastRL", None)
    if patch is None:  # unsloth's CPU backend: its RL module, if it imports here
        try:
            from unsloth.models.rl import PatchFastRL as patch
        except ImportError as exc:
            _PATCH_PROBLEM = f"unsloth's RL module does not import here ({type(exc).__name__}: {exc})"
            return
    patch("GRPO", unsloth.FastLanguageModel)
    _PATCH_PROBLEM = None
    _pool_alias_check_warns()
    for missing in internals.missing_decode_graph_stats():
        print(f"warning: this unsloth has no {missing}: summary.json will not say what its decode CUDA graphs did "
              "(install requirements.txt's unsloth)", file=sys.stderr)


# torch's switch for its custom-op alias check; a user who sets it decides (torch/_functorch/config.py).
ALIAS_CHECK_ENV = "TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING"


def _pool_alias_check_warns() -> None:
    """Keep torch's custom-op alias check a warning under unsloth's compiled GRPO loss, also where `CI` is set.

    unsloth compiles its loss with inductor's `memory_planning` on, so the generated code allocates through
    inductor's own `_alloc_from_pool`, a view of one pool buffer. torch 2.13's check that a custom op returns no
    alias of its inputs flags that op of its own, and `error_on_custom_op_aliasing` defaults to `bool($CI)`: on a
    machine with CI set (GitHub Actions, this project's CI) every unsloth-backend run stopped at its first step
    with `RuntimeError: inductor::_alloc_from_pool ... may not alias`, elsewhere torch only warns. Left alone where
    the user set the variable."""
    if ALIAS_CHECK_ENV in os.environ:
        return
    internals.custom_op_alias_check_warns()


_PATCH_PROBLEM: Optional[str] = "prepare() has not run"


def patched_trainer_problem() -> Optional[str]:
    """None when prepare() patched TRL's GRPOTrainer into unsloth's; else why not."""
    return _PATCH_PROBLEM


def _checkpointing(resolved):
    return {"unsloth": "unsloth", "true": True, "false": False}[resolved.gradient_checkpointing]


def from_pretrained_kwargs(resolved, path: str) -> dict:
    """`FastLanguageModel.from_pretrained`'s arguments (the notebook's call) for the resolved settings.
    The dtype is passed explicitly (resolve.py: bf16 only where native), never left to unsloth's guess."""
    import torch

    plan = resolved.plan.model
    return dict(
        model_name=path,
        max_seq_length=plan.max_seq_length,
        dtype=getattr(torch, resolved.dtype),
        load_in_4bit=resolved.load_in_4bit,
        fast_inference=resolved.fast_inference,
        max_lora_rank=resolved.vllm_max_lora_rank or plan.lora_r,  # vLLM's accepted rank (resolve.vllm_lora_rank)
        gpu_memory_utilization=plan.gpu_memory_utilization,
        float8_kv_cache=resolved.kv_cache_dtype == "fp8",  # resolve.choose_kv_cache_dtype (vLLM kv_cache_dtype="fp8")
        use_gradient_checkpointing=_checkpointing(resolved),
    )


def get_peft_model_kwargs(resolved) -> dict:
    """`FastLanguageModel.get_peft_model`'s arguments (after the model). With `lora.init_adapter`, the r / alpha /
    targets / dropout the config read from its adapter_config.json, plus the options it sets (lora_io.LORA_EXTRAS)."""
    plan = resolved.plan.model
    extras = adapter_settings(plan.init_adapter)["extras"] if plan.init_adapter else {}
    return dict(
        r=plan.lora_r,
        target_modules=list(plan.lora_target_modules),
        lora_alpha=plan.lora_alpha,
        lora_dropout=plan.lora_dropout,
        use_gradient_checkpointing=_checkpointing(resolved),
        random_state=plan.lora_random_state,
        **extras,
    )


def loaded_dtype(model) -> str:
    """The dtype unsloth loaded the unquantized parts in (what its GRPO trainer checks bf16/fp16 against)."""
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if dtype is None or isinstance(dtype, str):
        dtype = model.get_input_embeddings().weight.dtype
    return str(dtype).replace("torch.", "")


def mark_requested_float32(model, dtype) -> None:
    """Record on the model whether float32 was asked for, as unsloth's GPU loader does
    (`loader.py`: `_mark_requested_float32(model, _requested_float32(dtype))`) and its CPU loader does not.
    Its GRPO trainer reads `model._unsloth_user_float32`: without it, a float32 run on a device it deems
    without bf16 (a CPU, a T4) is switched to fp16 mixed precision (`UnslothGRPOTrainer.__init__`)."""
    import torch

    internals.mark_requested_float32(model, dtype is torch.float32)


def load_model(resolved, log=print) -> ModelHandle:
    from unsloth import FastLanguageModel


    path = resolve_model_path(resolved.plan.model.name)
    kwargs = from_pretrained_kwargs(resolved, path)
    os.environ.update(resolved.engine_environment)  # read by unsloth_zoo's load_vllm (resolve: FlashInfer below sm80)

    graphs_env = decode_graphs_environment_note(resolved)
    if graphs_env:
        log(f"note: {graphs_env}")
    try:
        model, tokenizer = FastLanguageModel.from_pretrained(**kwargs)
    except Exception as exc:
        cause = vllm_start_failure(exc) if resolved.fast_inference else None
        if cause is None:
            raise
        raise engine_did_not_start(resolved, cause) from None
    mark_requested_float32(model, kwargs["dtype"])
    checks.after_load(resolved.plan, model)  # lengths and LoRA layers against the loaded model
    model = FastLanguageModel.get_peft_model(model, **get_peft_model_kwargs(resolved))
    if resolved.plan.model.init_adapter:  # its weights into the LoRA just made with its settings
        load_adapter_weights(model, resolved.plan.model.init_adapter, base_model=path)
    pad_with_eos(tokenizer)
    resolved = follow_loaded_dtype(resolved, loaded_dtype(model))
    if patched_trainer_problem() is None:  # GRPO will run on unsloth's patched trainer (prepare())
        resolved = for_unsloth_trainer(resolved)
    handle = ModelHandle(model, tokenizer, resolved, base_model=path)
    engine, problem = vllm_engine_for(model, resolved, tokenizer)
    if problem:
        log(f"warning: {problem}")
        handle.resolved = without_vllm(resolved, problem)  # GRPOConfig: use_vllm off, or TRL starts its own engine
    if engine is not None:
        handle.engine = engine
    return handle


def pad_with_eos(tokenizer) -> None:
    """A pad token where the tokenizer has none: its end-of-sequence token. On the tokenizer inside the processor
    unsloth returns for a vision-language checkpoint (Qwen3.5), which has no pad_token of its own
    (data.text_tokenizer)."""
    text = text_tokenizer(tokenizer)
    if text.pad_token is None:
        text.pad_token = text.eos_token


def vllm_engine_for(model, resolved, tokenizer=None):
    """(VLLMEngine, None) when unsloth really started vLLM for this model; (None, why) when fast_inference
    was asked for and unsloth turned it off (vLLM missing, an unsupported card); (None, None) otherwise."""
    if not resolved.fast_inference:
        return None, None
    if getattr(model, "vllm_engine", None) is None or not hasattr(model, "fast_generate"):
        return None, ("model.fast_inference is on but unsloth loaded the model without vLLM (no vllm_engine: "
                      "vLLM missing or unsupported here); generating with transformers, slower")
    return VLLMEngine(model, resolved, tokenizer), None


# unsloth_zoo's function that starts vLLM inside FastLanguageModel.from_pretrained (unsloth_zoo/vllm_utils.py);
# every failure of the start (FlashInfer on sm75, a JIT compile without nvcc/ninja, out of memory) passes through it.
VLLM_START_FRAME = ("unsloth_zoo", "load_vllm")


def vllm_start_failure(exc: BaseException) -> Optional[str]:
    """The cause, in one line, when `exc` came out of unsloth_zoo's vLLM start (VLLM_START_FRAME in its
    traceback); None for any other error (the model's own loading: a missing file, no access to a repository)."""

    frames = traceback.extract_tb(exc.__traceback__)
    if not any(f.name == VLLM_START_FRAME[1] and VLLM_START_FRAME[0] in f.filename for f in frames):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def vllm_engine_failure(exc: BaseException) -> Optional[str]:
    """The cause, in one line, when `exc` was raised inside vLLM's code (unsloth runs its engine in this process,
    VLLM_ENABLE_V1_MULTIPROCESSING=0: a dead engine core, a FlashInfer JIT failure, a sampler error surface as
    plain exceptions from vllm's frames); None for anything else, an out-of-memory included (oom.py's line)."""

    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not any(f"{os.sep}vllm{os.sep}" in f.filename for f in frames):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__} in vLLM: {lines[0][:300] if lines else ''}"


def engine_did_not_start(resolved, cause: str):
    """The one line for a vLLM start that failed inside unsloth's load: nothing is written yet, the way on."""
    card = f"{resolved.hardware.gpu_name} ({resolved.hardware.sm})" if resolved.cuda else "this machine"
    memory = ("; or give vLLM less of the card: --set memory.gpu_memory_utilization=LOWER"
              if "memory" in cause.lower() else "")
    return EngineStopped(f"unsloth could not start vLLM for model.fast_inference on {card}: {cause}; "
                         f"{_flashinfer_way_on(cause)}nothing is written yet; run without vLLM (generation through "
                         f"transformers, slower): --set model.fast_inference=false{memory}; `lowvram-grpo doctor` "
                         f"lists this card's notes")


def _flashinfer_way_on(cause: str) -> str:
    """For a start that failed on vLLM's FlashInfer (its sampler refuses the card: below sm80, <= 16 SMs, no JIT
    target): what the variable load_vllm read says. vLLM's own advice, "Unset VLLM_USE_FLASHINFER_SAMPLER=1", cannot
    work: unsloth_zoo's load_vllm sets that variable itself unless UNSLOTH_VLLM_NO_FLASHINFER is set (resolve sets
    it below sm80, engine_environment; tests/test_gpu_wheels.py drives both through the pinned load_vllm)."""

    if "flashinfer" not in cause.lower():
        return ""
    if os.environ.get(NO_FLASHINFER_ENV, "0") != "0":
        return (f"{NO_FLASHINFER_ENV}=1 was set for this load and unsloth_zoo still asked vLLM for FlashInfer: the "
                f"installed unsloth_zoo is not requirements.txt's (whose load_vllm keeps FlashInfer off with it); ")
    unset = ("unsloth_zoo's load_vllm sets VLLM_USE_FLASHINFER_SAMPLER=1 itself, so unsetting it does not help: "
             if "VLLM_USE_FLASHINFER_SAMPLER" in cause else "")
    return (f"{unset}set {NO_FLASHINFER_ENV}=1 in the environment to keep vLLM's FlashInfer off on this card (this "
            f"run did not: resolve sets it below sm80 only); ")


def rollout_lora_dir() -> Path:
    """The folder unsloth 2026.10.9's rollouts write the LoRA config vLLM reads into: `vllm_gen_lora` (plus
    `_<CUDA_VISIBLE_DEVICES>` where that is set), relative to the working directory
    (unsloth/models/rl_replacements.py `lora_name`; unsloth_zoo's `_live_lora_config` saves there)."""
    name = "vllm_gen_lora"
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        name += "_" + os.environ.get("CUDA_VISIBLE_DEVICES", "0").replace(",", "")
    return Path(name)


@contextlib.contextmanager
def rollout_files_moved_to(run_path: Path):
    """unsloth's rollout LoRA folder, made in the working directory during training, moved into the run's
    folder when training ends (or stops); one that was there before (a user's, another run's) is left alone."""
    made = rollout_lora_dir()
    existed = made.exists()
    try:
        yield
    finally:
        if not existed and made.is_dir():
            target = Path(run_path) / made.name
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(made), str(target))


# unsloth's savers, as the notebook calls them: (method name, keyword arguments).
EXPORTS = {
    "merged16": ("save_pretrained_merged", {"save_method": "merged_16bit"}),
    "gguf": ("save_pretrained_gguf", {"quantization_method": "q4_k_m"}),
}


def export(model, tokenizer, directory: Path, kind: str) -> Path:
    """Write the model with its adapter merged in through unsloth's saver for `kind` (EXPORTS).
    unsloth writes into `directory` itself (GGUF: it fetches and builds llama.cpp on first use)."""

    method, kwargs = EXPORTS[kind]
    saver = getattr(model, method, None)
    if saver is None:
        raise BackendError(f"this unsloth model has no {method}: --export {kind} needs unsloth's savers")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saver(str(directory), tokenizer, **kwargs)
    return directory


def vllm_sampling_kwargs(params: SamplingParams) -> dict:
    """vLLM `SamplingParams` arguments for our sampling settings."""
    return dict(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, seed=params.seed)


def vllm_generate_kwargs(sampling, lora_request) -> dict:
    """`LLM.generate` keyword arguments (unsloth's `model.fast_generate` is `model.vllm_engine.generate`)."""
    return dict(sampling_params=sampling, lora_request=lora_request, use_tqdm=False)


def load_lora_kwargs(path) -> dict:
    """unsloth_zoo's `load_lora(model, save_directory, load_tensors=False)` (attached as `model.load_lora`):
    vLLM reads the adapter from disk; the trained model's PEFT adapters are not touched."""
    return dict(save_directory=str(path), load_tensors=False)


def token_prompts(tokenizer, texts: list[str]) -> list[dict]:
    """vLLM prompts as token ids (`TokensPrompt`): the chat template already wrote the special tokens,
    and vLLM's own tokenization would add `<|begin_of_text|>` a second time. `tokenizer` may be the processor unsloth
    returns for a vision-language checkpoint (data.text_tokenizer: its tokenizer encodes the text)."""
    tokenizer = text_tokenizer(tokenizer)
    return [{"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]} for text in texts]


class VLLMEngine:
    """Generation through unsloth's vLLM (`model.fast_generate`), sharing the 4-bit weights. CUDA only;
    not run on the CPU machines this project is tested on (tests/test_gpu_contracts.py checks every call
    against the pinned unsloth/vLLM source).

    `load_lora` never PEFT-loads the adapter into the trained model: unsloth's rollout weight sync gathers
    every `lora_A/lora_B` tensor of the model, and vLLM rejects an extra adapter's keys
    (`...lora_A.loaded_1.weight`). vLLM gets the adapter's path instead, one request per adapter version
    (unsloth's `load_lora` numbers its requests itself)."""

    def __init__(self, model, resolved, tokenizer=None):
        self.model = model
        self.resolved = resolved
        self.tokenizer = tokenizer
        self.versions = AdapterVersions()

    def load_lora(self, path: Path) -> LoraRequest:
        def make(name, new_id, path_text, version):
            request = self.model.load_lora(**load_lora_kwargs(path_text))
            return LoraRequest(name=name, id=new_id, path=path_text, version=version, engine_request=request)

        return self.versions.get(path, make)

    def release_lora(self, request: LoraRequest) -> None:
        """Nothing to free here: vLLM reads the adapter from disk and evicts it itself (max_loras)."""
    def generate(self, texts: list[str], params: SamplingParams,
                 lora_request: Optional[LoraRequest]) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams

        sampling = VLLMSamplingParams(**vllm_sampling_kwargs(params))
        lora = lora_request.engine_request if lora_request is not None else None
        outputs = self.model.fast_generate(token_prompts(self.tokenizer, texts), **vllm_generate_kwargs(sampling, lora))
        return [Completion(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outputs]
