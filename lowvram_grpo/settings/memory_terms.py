"""The memory plan's terms (memory_plan.py sums them): an estimate, by component, of a run's peak GPU memory for the
resolved settings (resolve.py), and what the plan takes besides them: the memory free for the run, the batch vLLM's
KV cache must hold, unsloth's standby mode, and priming's own peak.

    p = estimate(resolve(config, profile("t4")), 15.0)   # a MemoryPlan without suggestions (memory.plan adds them)
    free = usable_gib(resolved, card_gib)       # the card less what others hold on it (hardware.free_gib)
    sequences, which = kv_batch(plan, 6)        # (16, 'evaluation'): the larger of the rollout and eval batches
    refuse_standby(resolved)                    # ResolveError when UNSLOTH_VLLM_STANDBY is on for unsloth's vLLM
    peak = priming_peak(shape, resolved, terms, free_gib, *priming_inputs(shape, resolved, terms))

The terms (GiB = 2**30 bytes; a "16 GB" card has about 15-16 GiB):
- base weights: linear layers in 4-bit NF4 (bitsandbytes, double quantization: ~0.516 bytes/param)
  or 16-bit; embeddings, lm_head and norms stay 16-bit on the unsloth backend, and are fp32 on the hf
  backend (PEFT's `prepare_model_for_kbit_training` upcasts every non-quantized parameter).
- LoRA params + grads: fp32 (trainable weights are upcast for mixed precision), 8 bytes/param.
- optimizer state: paged_adamw_8bit / adamw_8bit 2 bytes/param; 32-bit AdamW 8 bytes/param.
- activations of one training micro-batch (per_device_train_batch_size sequences of prompt +
  completion tokens); with gradient checkpointing only one layer's working set plus the layer
  inputs, and with 'unsloth' checkpointing the layer inputs are offloaded to CPU RAM.
- logits: completions x completion tokens x vocab. Held whole, with the log_softmax copy, they
  take 4 bytes/element in 16-bit (Unsloth's published TRL+FA2 figure, 78.3 GB for Llama-3.1-8B at
  8 x 20K tokens, is 3.8 bytes/element): the term that killed most GRPO runs. TRL 1.15 (pinned here)
  never holds them whole: its fused LM head scores [4096 x 32768] fp32 tiles, so the term is two
  tiles (<= 1 GiB) and the whole size is shown in its detail. On the unsloth backend unsloth replaces
  that computation with its own fused LM head: two chunks of unsloth_zoo's `fused_linear_rows` rows x the
  whole vocabulary in fp32 (unsloth_sizing.py).
- vLLM (model.fast_inference): unsloth_zoo's load_vllm gives vLLM gpu_memory_utilization x the memory
  FREE when it loads (the card planned for: its total on a profile, its free memory in the doctor) for the
  weights (shared with training) and its KV cache; training must fit in the rest. It also starts vLLM with
  a max_model_len its own KV-cache estimate holds (`vllm_max_model_len`, below model.max_seq_length when
  that estimate is small): settings where that is below prompt + completion do not fit, and the
  suggestions avoid them (unsloth_sizing.py).
- vLLM on the hf backend (model.generation=vllm): a separate engine with its own copy of the weights
  (16-bit, or NF4 through bitsandbytes with load_in_4bit), a LoRA slot, its own CUDA context and
  exactly the KV cache it asks vLLM for (`kv_cache_memory_bytes`: max(rollout batch, eval batch)
  sequences of model.max_seq_length tokens; vLLM then sizes nothing from gpu_memory_utilization),
  started after the trainer loaded, the whole trainer beside it. Counted in full although the engine
  sleeps (weights to CPU RAM, KV cache freed) during the backward pass: the plan is for the rollout's
  moment too. The engine's functions below are what backends/vllm/ starts it with.
- CUDA context, cuBLAS workspace and allocator fragmentation: a constant.

Generation without vLLM (transformers' KV cache) happens before the backward pass, never with it,
and is smaller than the training activations, so it does not add to the peak. 'unsloth' gradient
checkpointing offloads only on the unsloth backend (resolve.py makes it 'true' on hf).

- Free memory: unsloth_zoo's load_vllm gives vLLM gpu_memory_utilization x the memory *free* when it loads
  (`get_mem_info`, torch.cuda.mem_get_info), and training gets what is left of the free memory; a plan on the
  card's total overstates the margin by (1 - util) x (total - free), ~0.6 GiB on a card that drives a display.
  The card present records its free memory at detection (hardware.Hardware.free_gib); the plan takes the card
  less what others held then. A named profile (--gpu t4) and memory.vram_gb (--vram: "plan for a card with
  this much memory") describe a card with nothing else on it: free == total, and the plan says so.
- The KV cache: unsloth's engine generates the rollouts (train.generation_batch_size sequences) and the held-out
  answers (eval.batch_size sequences at once, evaluation.generate_answers) through the same engine, each of up to
  prompt + completion tokens: its KV cache is checked against the larger batch, and the plan says which decides.
- UNSLOTH_VLLM_STANDBY (read once, by hardware.py): unsloth_zoo's load_vllm then replaces
  memory.gpu_memory_utilization with its standby share (`standby_target_gpu_util`, by the card's size, x 0.95 for
  vLLM >= 0.11: 0.76 on a T4, 0.78 on a 24 GiB card; unsloth_zoo/vllm_utils.py load_vllm) and starts vLLM with
  sleep mode, and unsloth's trainer turns on TRL's vllm_enable_sleep_mode, which puts the engine to sleep
  (level 2) after every rollout. Our evaluation and priming call the engine outside TRL's wake/sleep cycle, and
  the plan's suggestions tune a gpu_memory_utilization unsloth would ignore: refused, one line.
- Priming (priming.py): supervised steps before GRPO with the engine loaded (its share stays), a
  torch.optim.AdamW of its own (fp32 state: 8 bytes per LoRA parameter, whatever train.optim says), and
  prime.batch_size examples of up to model.max_seq_length tokens (priming._batch's cap), their log-probs in
  logprobs_fallback's chunks. Its peak is a separate moment from a GRPO step's (the priming optimizer is gone
  when GRPO starts), checked against the same free memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from lowvram_grpo.core.errors import ResolveError
from lowvram_grpo.settings.config import RunConfig
from lowvram_grpo.settings.model_shapes import LINEAR, UNSLOTH_FORCE_FLOAT32, ModelShape
from lowvram_grpo.settings.unsloth_sizing import FUSED_BYTES_PER_LOGIT, fused_linear_rows, vllm_budget

GIB = 2 ** 30
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 blocks
LORA_BYTES_PER_PARAM = 8          # fp32 weight + fp32 grad
OPTIMIZER_BYTES_PER_PARAM = {"paged_adamw_8bit": 2, "adamw_8bit": 2, "adamw_torch": 8, "paged_adamw_32bit": 8}
KV_BYTES = 2                      # vLLM keeps its KV cache in 16-bit
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768  # TRL 1.15's fused LM head tile (trl/kernels/chunked_logprob.py)
CUDA_OVERHEAD_BYTES = int(0.6 * GIB)   # CUDA context + cuBLAS workspace + allocator fragmentation
VLLM_RUNTIME_BYTES = int(0.5 * GIB)    # inside vLLM's share: CUDA graphs, sampler, profiling activations
VLLM_PROCESS_BYTES = int(0.6 * GIB)    # a separate vLLM engine's own CUDA context (model.generation=vllm)
PRIMING_OPTIMIZER_BYTES_PER_PARAM = 8   # torch.optim.AdamW on fp32 LoRA weights: exp_avg + exp_avg_sq, fp32
PRIMING_CHUNK_ELEMENTS = 8 * 1024 * 1024  # logprobs_fallback.CHUNK_ELEMENTS: logits per chunk (fp32)
# unsloth_zoo 2026.10.9 load_vllm, vLLM >= 0.11: (10% of the card in GiB at least, standby_target_gpu_util),
# then x 0.95 ("vLLM >= 0.11.0 uses more VRAM and OOMs; reduce further")
STANDBY_TIERS = ((4.0, 0.925), (2.5, 0.9), (2.0, 0.825), (1.4, 0.8), (1.0, 0.775), (0.0, 0.75))
STANDBY_VLLM_FACTOR = 0.95


# --------------------------------------------------------------------------- free memory

def used_elsewhere_gib(resolved) -> float:
    """What other processes held on the card present when it was detected (total - free); 0 for a named profile,
    for memory.vram_gb (a card of that size, nothing else on it) and without a reading."""
    hw = resolved.hardware
    if resolved.vram_asked or hw.free_gib is None or hw.total_gib is None:
        return 0.0
    return max(hw.total_gib - hw.free_gib, 0.0)


def usable_gib(resolved, card_gib: Optional[float]) -> Optional[float]:
    """The memory free for this run on a card of `card_gib` GiB: the card less what others held at detection."""
    if card_gib is None:
        return None
    return max(card_gib - used_elsewhere_gib(resolved), 0.0)


def free_memory_text(resolved, card_gib: Optional[float]) -> str:
    """One line: which memory the plan is made on."""
    if card_gib is None:
        return "card: none given; the plan gives the smallest card (all of it free) that fits"
    elsewhere = used_elsewhere_gib(resolved)
    if elsewhere > 0:
        return (f"card: {card_gib:.1f} GiB, {card_gib - elsewhere:.1f} GiB free when detected "
                f"({elsewhere:.1f} GiB held by others, e.g. a display): the plan and vLLM's share are on the free "
                "memory, as unsloth sizes vLLM")
    if resolved.vram_asked:
        return f"card: {card_gib:g} GiB (memory.vram_gb), planned as all free"
    if resolved.hardware.free_gib is None:
        return (f"card: {card_gib:.1f} GiB ({resolved.hardware.name} profile), planned as all free; unsloth sizes vLLM "
                "on the memory free at load: a card that drives a display has ~0.3-1 GiB less")
    return f"card: {card_gib:.1f} GiB, all free when detected"


# --------------------------------------------------------------------------- the batch vLLM's KV cache must hold

def kv_batch(plan, rollout_sequences: int) -> tuple[int, str]:
    """(sequences, 'rollout' | 'evaluation'): the larger of the rollout batch and the held-out evaluation's
    (eval.batch_size, when evaluation is on) that unsloth's engine generates at once. `plan`: the run's
    (plans.RunPlan)."""
    evaluation = plan.eval.batch_size if plan.eval.enabled else 0
    if evaluation > rollout_sequences:
        return evaluation, "evaluation"
    return rollout_sequences, "rollout"


# --------------------------------------------------------------------------- UNSLOTH_VLLM_STANDBY

def standby_utilization(total_gib: float) -> float:
    """The gpu_memory_utilization unsloth_zoo's load_vllm uses in standby mode on a card of `total_gib` GiB."""
    ten_percent = total_gib * 0.1
    target = next(util for floor, util in STANDBY_TIERS if ten_percent >= floor)
    return target * STANDBY_VLLM_FACTOR


def refuse_standby(resolved) -> None:
    """ResolveError when UNSLOTH_VLLM_STANDBY (hardware.vllm_standby) is on and unsloth's vLLM would generate."""
    value = resolved.hardware.vllm_standby
    if value is None or resolved.generation != "unsloth_vllm":
        return
    card = resolved.vram_gib
    share = (f"{standby_utilization(card):.2f} (its standby share on a {card:.1f} GiB card)" if card else
             f"{standby_utilization(0):.2f}-{standby_utilization(40):.2f} (its standby share, by the card's size)")
    raise ResolveError(
        f"UNSLOTH_VLLM_STANDBY={value} is set in the environment: unsloth would raise vLLM's gpu_memory_utilization "
        f"from {resolved.gpu_memory_utilization:g} to {share} and put vLLM to sleep after every rollout, which the "
        "memory plan does not cover and the held-out evaluation and priming (they call vLLM outside TRL's "
        "wake/sleep) do not expect: unset it (unset UNSLOTH_VLLM_STANDBY) and run again")


# --------------------------------------------------------------------------- priming's peak

@dataclass(frozen=True)
class PrimingPeak:
    """Priming's peak (prime.steps supervised steps before GRPO), in bytes, by component."""
    steps: int
    batch: int
    tokens: int
    parts: dict          # label -> bytes
    free_bytes: Optional[int]   # the memory it must fit (None: no card)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GIB

    @property
    def fits(self) -> Optional[bool]:
        return None if self.free_bytes is None else self.total_bytes <= self.free_bytes

    def lines(self) -> list[str]:
        """What format_plan prints about priming."""
        parts = " + ".join(f"{label} {size / GIB:.2f}" for label, size in self.parts.items())
        head = (f"priming (prime.steps={self.steps}): " if self.steps else
                "priming: off (prime.steps=0); with --set prime.steps=N its steps would peak at ")
        text = f"{head}{self.total_gb:.2f} GiB = {parts}"
        if self.free_bytes is None:
            return [text]
        verdict = "fits" if self.fits else "does NOT fit"
        return [f"{text}; {verdict} the {self.free_bytes / GIB:.1f} GiB free"]


def priming_peak(shape, resolved, terms: dict, free_gib: Optional[float], activation_bytes: int,
                 lora_params: int) -> PrimingPeak:
    """Priming's peak next to the terms of the GRPO plan (`terms`, memory._training_terms + vllm + cuda): the same
    weights, LoRA, vLLM share and CUDA context; its own fp32 AdamW state (`lora_params` trainable parameters);
    `activation_bytes` of prime.batch_size examples of model.max_seq_length tokens under the run's gradient
    checkpointing (priming_inputs); two logits chunks (logprobs_fallback)."""
    plan = resolved.plan
    batch, tokens = plan.prime.batch_size, plan.model.max_seq_length
    rows = max(1, PRIMING_CHUNK_ELEMENTS // shape.vocab)
    parts = {"weights": terms["weights"].bytes, "LoRA + grads": terms["lora"].bytes,
             "AdamW fp32 state": lora_params * PRIMING_OPTIMIZER_BYTES_PER_PARAM,
             f"activations {batch} x {tokens} tokens": activation_bytes,
             "logits chunks": 2 * min(rows, batch * tokens) * shape.vocab * 4 * 2}  # z + log_softmax, 2 chunks
    if "vllm" in terms:
        parts["vLLM"] = terms["vllm"].bytes
    parts["CUDA"] = terms["cuda"].bytes
    return PrimingPeak(plan.prime.steps, batch, tokens, parts,
                       None if free_gib is None else int(free_gib * GIB))


# --------------------------------------------------------------------------- the plan's terms

@dataclass(frozen=True)
class Term:
    """One component of the planned peak."""
    key: str        # weights, lora, optimizer, activations, logits, merged, vllm, cuda
    label: str      # what it is, with the setting's value (e.g. 'optimizer state, paged_adamw_8bit')
    bytes: int
    detail: str     # how it was computed
    settings: str   # the settings that move it

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass
class MemoryPlan:
    """Planned peak GPU memory of a run, by component."""
    resolved: Any = field(repr=False)   # resolve.Resolved: the settings planned for
    shape: ModelShape
    terms: dict[str, Term]
    vram_gb: Optional[float]          # the card planned for (GiB); None = not given
    min_vram_gb: float                # the smallest card these exact settings fit (with what others hold on it)
    kv_cache_bytes: Optional[int] = None   # vLLM KV cache at gpu_memory_utilization (None without vLLM)
    kv_needed_bytes: Optional[int] = None  # KV cache for one rollout batch at full length (fits needs it)
    kv_sequences: Optional[int] = None     # the larger of the rollout and evaluation batches
                                           # (memory_plan_terms.kv_batch)
    kv_decided_by: str = ""                # 'rollout' or 'evaluation': which batch that is
    kv_largest_bytes: Optional[int] = None  # KV cache for that batch at full length
    free_gb: Optional[float] = None        # the memory free for the run on the card (None: no card given)
    priming: Optional[PrimingPeak] = None  # priming's own peak (prime.steps > 0 runs it before GRPO)
    vllm_min_share_bytes: Optional[int] = None  # what vLLM's gpu_memory_utilization share must hold at least
    vllm_outside_bytes: Optional[int] = None    # what must fit on the card beside vLLM's share
    vllm_max_model_len: Optional[int] = None    # the max_model_len unsloth_zoo starts vLLM with
                                                # (unsloth_sizing.vllm_budget)
    suggestions: list = field(default_factory=list)  # [memory_fit.Suggestion]: settings that make it fit
    suggested_total_gb: Optional[float] = None  # the plan's total once the suggestions are applied
    no_fit_reason: str = ""           # set when no settings of this preset fit the card

    @property
    def backend(self) -> str:
        return self.resolved.backend

    @property
    def model(self) -> str:
        return self.resolved.plan.model.name

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms.values())

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GIB

    @property
    def fits(self) -> Optional[bool]:
        """True/False for a given card; None when no card size is known."""
        if self.vram_gb is None:
            return None
        kv_ok = self.kv_cache_bytes is None or self.kv_cache_bytes >= self.kv_needed_bytes
        length_ok = self.vllm_max_model_len is None or self.vllm_max_model_len >= self.rollout_tokens
        return self.total_gb <= self.free_gb + 1e-9 and kv_ok and length_ok and self.priming_fits is not False

    def evaluation_kv_short(self) -> Optional[str]:
        """A warning when vLLM's KV cache holds the rollout batch but not a whole evaluation batch, else None. vLLM
        then runs the held-out answers in waves (its scheduler admits what the KV cache holds): slower, not more memory,
        so it is a warning, not a reason the plan does not fit."""
        if (self.kv_cache_bytes is None or self.kv_decided_by != "evaluation"
                or self.kv_cache_bytes >= self.kv_largest_bytes):
            return None
        at_once = max(int(self.kv_cache_bytes // (self.kv_largest_bytes // self.kv_sequences)), 0)
        return (f"vLLM's KV cache ({max(self.kv_cache_bytes, 0) / GIB:.2f} GiB) holds {at_once} of an evaluation "
                f"batch's {self.kv_sequences} sequences at full length ({self.kv_largest_bytes / GIB:.2f} GiB): the "
                "held-out answers are generated in waves (slower, no more memory); "
                f"--set eval.batch_size={max(at_once, 1)} (--resume can set it) "
                "or raise memory.gpu_memory_utilization")

    @property
    def priming_fits(self) -> Optional[bool]:
        """Priming's peak against the free memory when the run primes (prime.steps > 0); None when it does not."""
        if self.priming is None or not self.priming.steps:
            return None
        return self.priming.fits

    @property
    def rollout_tokens(self) -> int:
        """Prompt + completion tokens a rollout may take."""
        return self.resolved.plan.model.rollout_tokens

    def short_max_model_len(self) -> Optional[str]:
        """A warning when unsloth_zoo starts vLLM with a max_model_len below prompt + completion, else None."""
        length, need = self.vllm_max_model_len, self.rollout_tokens
        if length is None or length >= need:
            return None
        prompt = self.resolved.plan.model.max_prompt_length
        return (f"unsloth_zoo starts vLLM with max_model_len {length} (what its KV-cache estimate in vLLM's share "
                f"holds), below train.max_prompt_length + train.max_completion_length = {need}: longer rollouts are "
                f"cut at {length} tokens and a longer prompt is refused: raise memory.gpu_memory_utilization" + (
                    f", or lower train.max_completion_length to {length - prompt}" if length > prompt else ""))

    def largest(self, n: int = 3) -> list[Term]:
        return sorted(self.terms.values(), key=lambda t: t.bytes, reverse=True)[:n]


@dataclass(frozen=True)
class _Sizes:
    """The run's sizes the terms depend on."""
    batch: int            # sequences per training micro-batch
    generation_batch: int  # sequences vLLM generates at once
    seq_len: int          # prompt + completion tokens
    completion: int
    compute_bytes: int    # 2 for 16-bit compute on a GPU, 4 for fp32


def forced_float32(shape: ModelShape, resolved) -> bool:
    """unsloth trains this family in float32 where the card has no bf16 (its FORCE_FLOAT32 list: Gemma 3, Qwen3.5,
    gpt-oss; model_shapes.UNSLOTH_FORCE_FLOAT32): the activations then take 4 bytes, not the card's 2."""

    return resolved.backend == "unsloth" and resolved.dtype == "float16" and shape.family in UNSLOTH_FORCE_FLOAT32


def _sizes(resolved, shape: Optional[ModelShape] = None) -> _Sizes:
    m = resolved.plan.model
    seq_len = min(m.rollout_tokens, m.max_seq_length)
    compute = 4 if shape is not None and forced_float32(shape, resolved) else resolved.compute_bytes
    return _Sizes(batch=resolved.per_device_train_batch_size,
                  generation_batch=resolved.generation_batch_size // resolved.num_processes, seq_len=seq_len,
                  completion=min(m.max_completion_length, seq_len), compute_bytes=compute)


def lora_param_count(shape: ModelShape, model) -> int:
    """LoRA parameters of the run's LoRA (`model`: its plans.ModelPlan, lora_r and lora_target_modules) on the shape:
    r x (in + out) of each targeted module, in each layer that has it (Qwen3.5's q/k/v/o only in its full-attention
    layers), and of lm_head when targeted."""
    return model.lora_r * sum((a + b) * n for a, b, n in _targeted(shape, model))


def _targeted(shape: ModelShape, model) -> list[tuple[int, int, int]]:
    """(in, out, how many) of each linear module the LoRA targets (`model`: plans.ModelPlan): the layers'
    (layer_modules) and lm_head."""
    modules = {**shape.layer_modules(), "lm_head": (shape.hidden, shape.vocab, 1)}
    return [dims for name, dims in modules.items() if name in model.lora_target_modules]


def _layer_activation_elements(shape: ModelShape, layer_type: str) -> int:
    """Elements per token one decoder layer of `layer_type` keeps for backward: norm inputs/outputs (some in fp32),
    the residual (~8 x hidden); attention: q (with its gate), k, v, their q/k norms; a Gated DeltaNet layer: its
    projections' outputs, the convolution's output, the core's and the gated norm's (7 x hidden + the mixer's: a
    Llama-style layer's q is hidden wide, so 8 x hidden there); the MLP: gate, up, act(gate),
    act x up (4 x intermediate), for each expert a token goes to in a mixture of experts (+ the router's logits)."""

    la = shape.linear_attention
    if layer_type == LINEAR and la is not None:
        mixer = 2 * la.conv_dim + 3 * la.value_dim + 2 * la.value_heads
    else:
        q = shape.q_dim * (2 if shape.attention_gate else 1)
        mixer = q + 2 * shape.kv_dim + ((shape.q_dim + shape.kv_dim) if shape.qk_norm else 0)
    mlp = (4 * shape.intermediate * max(shape.experts_per_token, 1) + shape.experts if shape.experts
           else 4 * shape.intermediate)
    return 7 * shape.hidden + mixer + mlp


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int) -> int:
    """Tensors the largest decoder layer keeps for backward, per token (_layer_activation_elements): for a
    Llama-style layer 8 x hidden + 2 x kv_dim + 4 x intermediate."""
    return max(_layer_activation_elements(shape, t) for t in set(shape.types)) * compute_bytes


def _weights_term(shape: ModelShape, resolved, s: _Sizes) -> Term:
    if resolved.load_in_4bit:
        # hf: prepare_model_for_kbit_training casts embeddings, lm_head and norms to fp32
        other_bytes = 4 if resolved.backend == "hf" else resolved.compute_bytes  # 16-bit, also where unsloth computes
                                                                                 # in fp32
        size = int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * other_bytes)
        label = "base weights, 4-bit NF4"
        detail = (f"{shape.linear_params / 1e9:.2f}B linear params x {NF4_BYTES_PER_PARAM:.3f} B + "
                  f"{shape.other_params / 1e9:.2f}B embedding/norm params x {other_bytes} B"
                  + (" (fp32: PEFT's prepare_model_for_kbit_training)" if resolved.backend == "hf" else ""))
    else:
        size = shape.params * resolved.compute_bytes
        label = f"base weights, {8 * resolved.compute_bytes}-bit"
        detail = f"{shape.params / 1e9:.2f}B params x {resolved.compute_bytes} B"
    if resolved.fast_inference:
        label += " (shared with vLLM)"
    return Term("weights", label, size, detail, "model.name, memory.load_in_4bit")


def _activation_term(shape: ModelShape, resolved, s: _Sizes) -> Term:
    tokens = s.batch * s.seq_len
    layer = tokens * activation_bytes_per_token_layer(shape, s.compute_bytes)
    checkpoint = tokens * shape.hidden * s.compute_bytes  # one layer input
    mode = resolved.gradient_checkpointing  # 'unsloth' (offload) exists only on the unsloth backend
    if mode == "false":
        size = tokens * s.compute_bytes * sum(_layer_activation_elements(shape, t) for t in shape.types)
        how = f"all {shape.layers} layers kept"
    elif mode == "true":
        size, how = shape.layers * checkpoint + layer, "layer inputs kept + one layer recomputed"
    else:
        size, how = checkpoint + layer, "layer inputs offloaded to CPU RAM + one layer recomputed"
    return Term("activations", f"activations, gradient checkpointing={mode}", size,
                f"{s.batch} sequences x {s.seq_len} tokens; {how}",
                "memory.gradient_checkpointing, train.per_device_train_batch_size")


def logits_bytes_held_whole(shape: ModelShape, completions: int, tokens: int, compute_bytes: int = 2) -> int:
    """completions x tokens x vocab logits plus the log_softmax copy, as GRPO code without a chunked
    LM head holds them (older TRL; Unsloth's 'TRL + FA2' comparison)."""
    return completions * tokens * shape.vocab * 2 * compute_bytes


def _logits_term(shape: ModelShape, s: _Sizes, backend: str = "hf") -> Term:
    """The per-token log-probs never hold the whole completions x tokens x vocab logits. TRL 1.15 (the hf
    backend): its fused LM head (trl.kernels.chunked_logprob) projects [4096 tokens, 32768 vocab] fp32 tiles,
    one at a time, in the forward and again in the backward. The unsloth backend replaces that computation with
    unsloth_zoo's fused LM head (chunked_hidden_states_selective_log_softmax -> fused_linear_logprobs): chunks of
    `fused_linear_rows` rows x the whole vocabulary in fp32 (unsloth_sizing.py). The term is two such tiles or
    chunks; the detail gives the size the logits (+ a log_softmax copy) would take held whole, as older TRL
    held them."""
    whole = logits_bytes_held_whole(shape, s.batch, s.completion, s.compute_bytes)
    label = f"logits {s.batch} x {s.completion} x {shape.vocab}"
    if backend == "unsloth":

        rows = fused_linear_rows(s.batch * s.completion, shape.hidden, shape.vocab)
        return Term("logits", f"{label}, in unsloth's fp32 chunks", 2 * rows * shape.vocab * FUSED_BYTES_PER_LOGIT,
                    f"2 chunks of {rows} x {shape.vocab} x {FUSED_BYTES_PER_LOGIT} B (unsloth_zoo fused_linear_rows); "
                    f"held whole with a log_softmax copy they would be {whole / GIB:.2f} GiB",
                    "train.num_generations, train.max_completion_length")
    rows = min(s.batch * s.seq_len, TRL_TOKEN_CHUNK)
    size = 2 * rows * min(shape.vocab, TRL_VOCAB_CHUNK) * 4
    return Term("logits", f"{label}, in fp32 tiles", size,
                f"2 tiles of {rows} x {min(shape.vocab, TRL_VOCAB_CHUNK)} x 4 B; held whole with a log_softmax "
                f"copy they would be {whole / GIB:.2f} GiB",
                "train.num_generations, train.max_completion_length")


def _training_terms(shape: ModelShape, resolved) -> dict[str, Term]:
    model = resolved.plan.model
    s = _sizes(resolved, shape)
    lora = lora_param_count(shape, model)
    optim_bytes = OPTIMIZER_BYTES_PER_PARAM[resolved.optim]
    return {
        "weights": _weights_term(shape, resolved, s),
        "lora": Term("lora", f"LoRA params + grads, r={model.lora_r}", lora * LORA_BYTES_PER_PARAM,
                     f"{lora / 1e6:.1f}M params x {LORA_BYTES_PER_PARAM} B (fp32 weight + grad)",
                     "lora.r, lora.target_modules"),
        "optimizer": Term("optimizer", f"optimizer state, {resolved.optim}", lora * optim_bytes,
                          f"{lora / 1e6:.1f}M params x {optim_bytes} B", "train.optim"),
        "activations": _activation_term(shape, resolved, s),
        "logits": _logits_term(shape, s, resolved.backend),
        **({"int8": _int8_base_term(shape)} if resolved.decode_weights == "int8" else
           {"merged": _merged_copy_term(shape, resolved)} if resolved.decode_merge_lora else {}),
    }


def merged_copy_params(shape: ModelShape, model) -> int:
    """Parameters of the LoRA-targeted projections (and lm_head when targeted; `model`: plans.ModelPlan): what
    decoding.py's merged copy for sampled tokens holds once more while it generates."""
    return sum(a * b * n for a, b, n in _targeted(shape, model))


def _merged_copy_term(shape: ModelShape, resolved) -> Term:
    params = merged_copy_params(shape, resolved.plan.model)
    return Term("merged", "merged LoRA copy for sampled tokens", params * resolved.compute_bytes,
                f"{params / 1e6:.1f}M targeted params x {resolved.compute_bytes} B, while our decode loop samples "
                "(counted whole: the plan adds every term)", "decode.merge_lora")


def int8_base_params(shape: ModelShape) -> int:
    """Parameters fused_decode.build_int8_base packs for decode.weights=int8: every layer's projections (targeted or
    not) and the LM head."""
    return sum(a * b * n for a, b, n in shape.layer_modules().values()) + shape.hidden * shape.vocab


def _int8_base_term(shape: ModelShape) -> Term:
    params = int8_base_params(shape)
    return Term("int8", "int8 base for sampled tokens (decode.weights=int8)", params,
                f"{params / 1e6:.1f}M params x 1 B, packed once and held for the run (no merged copy: the adapter "
                "is added unmerged)", "decode.weights")


# --------------------------------------------------------------------------- the hf backend's vLLM engine

KV_BLOCK_TOKENS = 32  # vLLM allocates the KV cache in blocks of 32 tokens


def engine_sequences(config: RunConfig) -> int:
    """Sequences the hf backend's vLLM engine decodes at once: a rollout batch, or an evaluation batch (the run's
    plan has it: plans.ModelPlan.engine_sequences)."""
    return max(config.train.generation_batch_size, config.eval.batch_size)


def engine_kv_cache_bytes(shape: ModelShape, config: RunConfig, kv_bytes: int) -> int:
    """The KV cache the hf backend's vLLM engine asks vLLM for (`kv_cache_memory_bytes`, which vLLM then
    allocates instead of a gpu_memory_utilization share): memory.vllm_kv_cache_gb, else `engine_sequences`
    sequences of model.max_seq_length tokens in whole 32-token blocks, at `kv_bytes` per element."""
    return kv_cache_bytes_for(shape, engine_sequences(config), config.model.max_seq_length,
                              config.memory.vllm_kv_cache_gb, kv_bytes)


def kv_cache_bytes_for(shape: ModelShape, sequences: int, max_seq_length: int, kv_cache_gb: Optional[float],
                       kv_bytes: int) -> int:
    """engine_kv_cache_bytes from plain values (the run's plan: plans.ModelPlan)."""
    if kv_cache_gb:
        return int(kv_cache_gb * GIB)
    tokens = math.ceil(max_seq_length / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return shape.kv_cache_bytes(sequences, tokens, kv_bytes)  # K and V (+ linear-attention state)


def _engine_weights_bytes(shape: ModelShape, load_in_4bit: bool) -> int:
    """The engine's own copy of the base: NF4 linear layers + 16-bit embeddings (bitsandbytes), or 16-bit."""
    return int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * 2) if load_in_4bit else shape.params * 2


def _engine_kv_bytes(shape: ModelShape, resolved) -> int:
    """engine_kv_cache_bytes of the run's plan (its ModelPlan) at the compute dtype's bytes."""
    m = resolved.plan.model
    return kv_cache_bytes_for(shape, m.engine_sequences, m.max_seq_length, m.vllm_kv_cache_gb, resolved.compute_bytes)


def engine_share_bytes(shape: ModelShape, resolved) -> int:
    """What the engine allocates inside its process on the card: its weights, runtime, a LoRA slot and its KV cache."""
    return (_engine_weights_bytes(shape, resolved.load_in_4bit) + VLLM_RUNTIME_BYTES
            + lora_param_count(shape, resolved.plan.model) * 2
            + _engine_kv_bytes(shape, resolved))


def engine_gpu_memory_utilization(shape: ModelShape, resolved, card_gib: float) -> float:
    """The gpu_memory_utilization the engine passes on CUDA. With kv_cache_memory_bytes set, vLLM 0.31 sizes
    nothing from it; it only refuses to start unless that share of the card is free
    (vllm/v1/worker/utils.py request_memory). The engine's own share, rounded up to 0.01, makes that
    check ask exactly whether the engine fits beside the trainer loaded before it."""
    return min(max(math.ceil(engine_share_bytes(shape, resolved) / (card_gib * GIB) * 100) / 100, 0.01), 0.95)


def estimate(resolved, vram_gb: Optional[float]) -> MemoryPlan:
    """The plan's terms for the resolved settings on a card of `vram_gb` GiB (None: the smallest card that fits),
    on the memory free on it for this run (usable_gib): memory.plan without its suggestions. The model's shape is the
    one its plan derived (plan.model.facts); PlanError where there is none."""
    plan = resolved.plan
    shape = plan.model.facts.require_shape()
    terms = _training_terms(shape, resolved)
    cuda = Term("cuda", "CUDA context + allocator", CUDA_OVERHEAD_BYTES,
                "CUDA context, cuBLAS workspace, fragmentation (a constant)", "")
    outside_vllm = sum(t.bytes for k, t in terms.items() if k != "weights") + cuda.bytes
    weights = terms["weights"].bytes
    s = _sizes(resolved, shape)
    elsewhere = used_elsewhere_gib(resolved)
    free = usable_gib(resolved, vram_gb)

    def finish(min_free_gb: float, priming_counted: bool = False, **vllm) -> MemoryPlan:
        terms["cuda"] = cuda
        priming = priming_peak(shape, resolved, terms, free if vram_gb is not None else None,
                               *priming_inputs(shape, resolved, terms))
        if plan.prime.steps and not priming_counted:
            min_free_gb = max(min_free_gb, priming.total_gb)
        return MemoryPlan(resolved, shape, terms, vram_gb, min_free_gb + elsewhere,
                          free_gb=free if vram_gb is not None else None, priming=priming, **vllm)

    if resolved.generation == "vllm":
        # our engine (hf backend): its own weights, a LoRA slot and exactly the KV cache it asks for, in a
        # process with its own CUDA context, started once the trainer has loaded; the whole trainer beside it
        share = engine_share_bytes(shape, resolved)
        kv = _engine_kv_bytes(shape, resolved)
        terms["vllm"] = Term(
            "vllm", "vLLM engine, its own weights and KV cache", share + VLLM_PROCESS_BYTES,
            f"its copy of the weights {_engine_weights_bytes(shape, resolved.load_in_4bit) / GIB:.2f} GiB, runtime "
            f"{VLLM_RUNTIME_BYTES / GIB:.1f} GiB, LoRA slot, KV cache {kv / GIB:.2f} GiB (kv_cache_memory_bytes: "
            f"{plan.model.engine_sequences} sequences x {plan.model.max_seq_length} tokens), + "
            f"{VLLM_PROCESS_BYTES / GIB:.1f} GiB CUDA context. Asleep during backward, counted in full",
            "memory.vllm_kv_cache_gb, eval.batch_size, model.generation")
        return finish((sum(t.bytes for t in terms.values()) + cuda.bytes) / GIB)
    if resolved.generation != "unsloth_vllm":
        return finish((outside_vllm + weights) / GIB)

    # unsloth's engine shares the trainer's weights and takes util x the free memory for them, its runtime and the
    # KV cache, which must hold the larger of a rollout batch and an evaluation batch at full length
    util = resolved.gpu_memory_utilization
    def kv_of(sequences: int) -> int:  # K and V of the attention layers (a window at most in sliding ones), + state
        return shape.kv_cache_bytes(sequences, s.seq_len, resolved.kv_bytes)  # KV_BYTES, 1 with kv_cache_dtype fp8

    kv_needed = kv_of(s.generation_batch)  # a rollout batch: it must fit
    sequences, decided_by = kv_batch(plan, s.generation_batch)  # the larger batch: checked, a warning when short
    in_share, outside = weights + VLLM_RUNTIME_BYTES, outside_vllm
    priming_outside = 0
    if plan.prime.steps:  # priming's parts beside vLLM's share (weights inside it): its own peak's outside
        priming_outside = priming_peak(shape, resolved, {**terms, "cuda": cuda}, None,
                                       *priming_inputs(shape, resolved, terms)).total_bytes - weights
    min_free = max((in_share + kv_needed) / util, max(outside, priming_outside) / (1 - util)) / GIB
    card = vram_gb if vram_gb is not None else min_free + elsewhere
    free = free if free is not None else min_free
    # unsloth_zoo's load_vllm: util x the memory free at load, its max_model_len from the free and total memory
    budget = vllm_budget(shape, util, free * GIB, card * GIB, plan.model.max_seq_length,
                         resolved.vllm_max_lora_rank or plan.model.lora_r, resolved.load_in_4bit,
                         float8_kv_cache=resolved.kv_cache_dtype == "fp8")
    reserved = int(budget.share_bytes)
    kv_cache = reserved - in_share
    rollout = kv_of(s.generation_batch)
    evaluation = (f"an evaluation batch ({plan.eval.batch_size} sequences) needs "
                  f"{kv_of(plan.eval.batch_size) / GIB:.2f} GiB" if plan.eval.enabled
                  else "evaluation is off")
    terms["vllm"] = Term(
        "vllm", f"vLLM KV cache + runtime ({budget.utilization:.3g} x {card:.1f} GiB - weights)",
        max(reserved - weights, 0),
        f"unsloth_zoo gives vLLM gpu_memory_utilization {util:g} of the {free:.1f} GiB free at load, less the shared "
        f"weights; KV cache {kv_cache / GIB:.2f} GiB ({resolved.kv_cache_dtype}): a rollout batch "
        f"({s.generation_batch} sequences x {s.seq_len} tokens) needs {rollout / GIB:.2f} GiB, {evaluation}; "
        f"max_model_len {budget.max_model_len}",
        "memory.gpu_memory_utilization")
    return finish(min_free, kv_cache_bytes=kv_cache, kv_needed_bytes=kv_needed, kv_sequences=sequences,
                  kv_decided_by=decided_by, kv_largest_bytes=kv_of(sequences),
                  vllm_min_share_bytes=in_share + kv_needed, vllm_outside_bytes=max(outside, priming_outside),
                  vllm_max_model_len=budget.max_model_len, priming_counted=True)


def priming_inputs(shape, resolved, terms: dict) -> tuple[int, int]:
    """(activation bytes, trainable LoRA parameters) of priming's step: prime.batch_size examples of
    model.max_seq_length tokens under the run's gradient checkpointing (priming_peak)."""
    plan = resolved.plan
    batch, tokens = plan.prime.batch_size, plan.model.max_seq_length
    sizes = _Sizes(batch=batch, generation_batch=batch, seq_len=tokens, completion=tokens,
                   compute_bytes=_sizes(resolved, shape).compute_bytes)
    return _activation_term(shape, resolved, sizes).bytes, terms["lora"].bytes // LORA_BYTES_PER_PARAM
