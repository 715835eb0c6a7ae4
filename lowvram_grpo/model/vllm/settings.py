"""What the hf backend's vLLM engine is started with, decided before it starts: the settings (from the
resolved run and the model's shape, sized as the memory plan counts: memory_plan_terms.engine_*), vLLM's `LLM(...)`
and `SamplingParams` arguments, and the models vLLM's CPU build cannot serve. No vLLM import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lowvram_grpo.model.handle import SamplingParams
from lowvram_grpo.model.vllm.processes import allowed_cpus
from lowvram_grpo.core.errors import BackendError
from lowvram_grpo.settings.memory_terms import engine_gpu_memory_utilization, kv_cache_bytes_for

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention kernels


class VLLMEngineError(RuntimeError):
    """vLLM cannot serve this model or configuration; the message says why and what to change."""


class VLLMEngineDied(VLLMEngineError):
    """A process of the engine ended while the trainer waited on it (killed, or out of memory)."""


@dataclass(frozen=True)
class EngineSettings:
    """Everything the engine is started with, decided before it starts."""
    model_path: str
    dtype: str                         # float32 | bfloat16 | float16 (the trainer's compute dtype)
    max_model_len: int                 # prompt + completion tokens (model.max_seq_length)
    max_lora_rank: int                 # lora.r
    max_num_seqs: int                  # sequences decoded at once: the rollout batch (or eval batch)
    kv_cache_bytes: int                # the KV cache's size
    device: str = "cpu"                # cpu | cuda
    cpu_threads: Optional[int] = None  # CPU: cores the worker computes on (None: all allowed)
    gpu_memory_utilization: Optional[float] = None
    sleep_between_rollouts: bool = False  # GPU: vLLM sleeps (level 1) while the trainer computes
    enforce_eager: bool = False        # True: no torch.compile (faster start, slower decoding)
    load_in_4bit: bool = False         # GPU: serve the base NF4-quantized like the trainer's (bitsandbytes)
    seed: int = 0

    def describe(self) -> str:
        where = (f"{self.cpu_threads or len(allowed_cpus())} CPU threads" if self.device == "cpu"
                 else f"gpu_memory_utilization {self.gpu_memory_utilization}")
        return (f"vLLM {self.dtype}, max_model_len {self.max_model_len}, {self.max_num_seqs} sequences at once, "
                f"KV cache {self.kv_cache_bytes / 2**20:.0f} MiB, LoRA rank <= {self.max_lora_rank}, {where}")


def check_servable(shape, device: str) -> None:
    """Refuse, before starting anything, a model (model_shapes.ModelShape) vLLM's CPU attention has no kernel for."""
    if device != "cpu":
        return
    if shape.dim_per_head not in CPU_HEAD_SIZES:
        raise VLLMEngineError(f"vLLM's CPU build has no attention kernel for head size {shape.dim_per_head} "
                              f"(it has {', '.join(map(str, CPU_HEAD_SIZES))}): set model.generation=transformers")


def settings_for(resolved, shape, model_path: str) -> EngineSettings:
    """The engine settings for a run: rollout and eval batches, lengths, the LoRA rank vLLM takes
    (resolve.vllm_lora_rank), and exactly the memory the plan counts (memory_plan_terms.engine_*): the KV cache in
    bytes and, on CUDA, the engine's own share of the card as gpu_memory_utilization. `shape`: the
    model's model_shapes.ModelShape (from the loaded model's config, so a hub id needs no local config.json)."""

    model, cuda = resolved.plan.model, resolved.device == "cuda"
    return EngineSettings(
        model_path=model_path,
        dtype=resolved.dtype,
        max_model_len=model.max_seq_length,
        max_lora_rank=resolved.vllm_max_lora_rank,
        max_num_seqs=model.engine_sequences,
        kv_cache_bytes=kv_cache_bytes_for(shape, model.engine_sequences, model.max_seq_length, model.vllm_kv_cache_gb,
                                          resolved.compute_bytes),
        device=resolved.device,
        cpu_threads=model.vllm_cpu_threads,
        gpu_memory_utilization=engine_gpu_memory_utilization(shape, resolved,
                                                             resolved.hardware.total_gib or resolved.vram_gib)
        if cuda else None,
        sleep_between_rollouts=cuda,
        seed=model.seed,
        load_in_4bit=resolved.load_in_4bit and cuda,
    )


def engine_kwargs(s: EngineSettings) -> dict:
    """vLLM's `LLM(**...)` arguments for these settings (tests/test_gpu_set.py builds vLLM's EngineArgs from them)."""
    kwargs = dict(
        model=s.model_path,
        tokenizer=s.model_path,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        enable_lora=True,
        max_lora_rank=s.max_lora_rank,
        max_loras=1,
        kv_cache_memory_bytes=s.kv_cache_bytes,
        logprobs_mode="processed_logprobs",
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        disable_log_stats=True,
    )
    if s.device == "cuda":
        kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.sleep_between_rollouts)
        if s.load_in_4bit:  # the trainer's base is NF4: vLLM quantizes the same checkpoint the same way
                            # (vllm-bnb-plugin)
            kwargs.update(quantization="bitsandbytes")
    return kwargs


def eval_sampling_kwargs(params: SamplingParams, stop_token_ids: list[int]) -> dict:
    """vLLM `SamplingParams` arguments for the before/after evaluation (temperature 0: greedy)."""
    greedy = params.temperature <= 0
    return dict(n=1, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
                max_tokens=params.max_tokens, seed=params.seed, stop_token_ids=list(stop_token_ids), detokenize=False)


def rollout_sampling_kwargs(n: int, *, temperature: float, max_tokens: int, top_p: float = 1.0, top_k=None,
                            min_p=None, repetition_penalty: float = 1.0, stop_token_ids=(), seed=None) -> dict:
    """vLLM `SamplingParams` arguments for one GRPO group of `n` samples with the trainer's sampling settings,
    returning each sampled token's log-prob (logprobs=0) for TRL's importance-sampling correction."""
    return dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k else 0, min_p=min_p or 0.0,
                repetition_penalty=repetition_penalty, max_tokens=max_tokens, logprobs=0,
                stop_token_ids=list(stop_token_ids), seed=seed, detokenize=False)


def bf16_matmul_problem(resolved) -> Optional[str]:
    """Why this engine cannot serve the run's 4-bit base on this card, or None. vllm-bnb-plugin 0.0.3 computes
    every 4-bit matmul in bfloat16 (quantization/linear.py `_apply_4bit_weight`: `x.to(torch.bfloat16)`, a bf16
    output), whatever the model's dtype; unsloth patches that (unsloth_zoo's patch_vllm_compute_dtype) for its
    own engine, ours does not. On a card without native bf16 (a T4, sm75) those matmuls are emulated or fail,
    so the engine is refused there (hardware.Hardware.bf16_native, the one rule)."""
    hardware = resolved.hardware
    if resolved.device != "cuda" or not resolved.load_in_4bit or hardware.bf16_native:
        return None
    return (f"model.generation=vllm with a 4-bit base on {hardware.gpu_name} ({hardware.sm}, no native bf16): "
            "vllm-bnb-plugin computes the 4-bit matmuls in bfloat16, which this card does not have; set "
            "model.generation=transformers, or memory.load_in_4bit=false (vLLM then serves the 16-bit base in "
            "float16), or use the unsloth backend (--backend unsloth with model.fast_inference=true: unsloth "
            "patches the plugin's compute dtype)")


def check_run_servable(resolved) -> None:
    """For a run resolved to generation 'vllm': refuse, before anything heavy starts, a model vLLM's CPU
    build cannot serve, or a 4-bit base on a card without native bf16 (bf16_matmul_problem) (BackendError,
    exit 2). On CUDA every head size has kernels."""
    if resolved.device != "cpu":
        problem = bf16_matmul_problem(resolved)
        if problem:

            raise BackendError(problem)
        return

    try:  # the shape the plan derived once (plans.run_plan: plan.model.facts); PlanError where it has none
        check_servable(resolved.plan.model.facts.require_shape(), resolved.device)
    except VLLMEngineError as exc:
        raise BackendError(str(exc)) from None
