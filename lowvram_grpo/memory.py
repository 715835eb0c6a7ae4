"""The memory plan: an estimate, by component, of a run's peak GPU memory, and settings that make it fit.

    p = plan(resolve(config, profile("t4")))   # a MemoryPlan: named terms in bytes, total, fits, suggestions
    print(format_plan(p))                      # the table `--dry-run` and every GPU run print
    config = apply_suggestions(config, p.suggestions)   # what `--auto-fit` does

Everything device-dependent (backend, compute dtype, checkpointing mode, vLLM on or off, batch sizes,
the card's size) comes from the `Resolved` settings (resolve.py), the same object the run uses.

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

Model shapes come from a small table of known architectures (no hub access at plan time) or from
the config.json of a local checkpoint dir. Pure Python: no torch, no transformers.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .config import RESUME_SETTABLE, RunConfig, config_from_dict
from .errors import ConfigError, OutOfMemory, PlanError
from .memory_plan_terms import (PrimingPeak, free_memory_text, kv_batch, priming_peak, refuse_standby, usable_gib,
                                used_elsewhere_gib)
from .unsloth_sizing import vllm_budget

GIB = 2 ** 30
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 blocks
LORA_BYTES_PER_PARAM = 8          # fp32 weight + fp32 grad
OPTIMIZER_BYTES_PER_PARAM = {"paged_adamw_8bit": 2, "adamw_8bit": 2, "adamw_torch": 8, "paged_adamw_32bit": 8}
KV_BYTES = 2                      # vLLM keeps its KV cache in 16-bit
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768  # TRL 1.15's fused LM head tile (trl/kernels/chunked_logprob.py)
CUDA_OVERHEAD_BYTES = int(0.6 * GIB)   # CUDA context + cuBLAS workspace + allocator fragmentation
VLLM_RUNTIME_BYTES = int(0.5 * GIB)    # inside vLLM's share: CUDA graphs, sampler, profiling activations
VLLM_PROCESS_BYTES = int(0.6 * GIB)    # a separate vLLM engine's own CUDA context (model.generation=vllm)
SUGGESTION_SPARE = 0.05           # suggested settings leave this share of the card unplanned
OOM_UNDERESTIMATE = 0.3           # after an OOM, assume the training-side terms were this much larger


# --------------------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about an architecture (the config.json fields of a Llama/Qwen-style model)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    head_dim: Optional[int] = None
    context: Optional[int] = None   # max_position_embeddings: the longest prompt + completion the model takes

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer, by its usual module name."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """Parameters in the decoder layers' linear layers: the part 4-bit quantization shrinks."""
        return self.layers * sum(a * b for a, b in self.linear_dims().values())

    @property
    def other_params(self) -> int:
        """Embeddings, lm_head (unless tied) and norms: kept in 16-bit even in a 4-bit model."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params


def _shape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, context, head_dim=None) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim, context)


# The config.json values of the models the presets use (and a few neighbours). Keys are matched
# against the lowercased model name with any "org/" prefix and "meta-" dropped.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": _shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, False, 131072),
    "llama-3-8b": _shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, False, 8192),
    "llama-3.2-3b": _shape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True, 131072),
    "llama-3.2-1b": _shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True, 131072),
    "qwen2.5-7b": _shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, 32768),
    "qwen2.5-3b": _shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, 32768),
    "qwen2.5-1.5b": _shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, 32768),
    "qwen2.5-0.5b": _shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, 32768),
    "smollm2-135m": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:smollm2": _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, 8192, 64),
    "builtin:tiny": _shape("builtin:tiny", 64, 2, 4, 2, 128, 512, False, 2048, 16),
}


def shape_from_config(raw: dict, name: str) -> ModelShape:
    """The shape from a model's config (config.json's mapping, or a loaded model's `config.to_dict()`):
    the one reader of these fields, for the plan, the settings checks and the vLLM engine."""
    raw = raw.get("text_config") or raw  # multimodal configs nest the language model's
    try:
        heads = int(raw["num_attention_heads"])
        return ModelShape(
            name=name, hidden=int(raw["hidden_size"]), layers=int(raw["num_hidden_layers"]), heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads), intermediate=int(raw["intermediate_size"]),
            vocab=int(raw["vocab_size"]), tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim=raw.get("head_dim"), context=raw.get("max_position_embeddings"),
        )
    except KeyError as exc:
        raise PlanError(f"{name} lacks {exc.args[0]!r}: the plan needs hidden_size, num_hidden_layers, "
                        "num_attention_heads, intermediate_size and vocab_size") from None


def local_model_config(name: str) -> Optional[dict]:
    """The config.json of a local checkpoint folder `name` as a mapping, None when `name` is no such folder:
    the one reader of that file for the plan, the settings checks (checks.py) and the vLLM engine."""
    path = Path(name).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the model shape from {path}: {exc}") from None


def shape_from_config_json(path: Path) -> ModelShape:
    """The shape of a local checkpoint from its config.json (transformers' field names)."""
    raw = local_model_config(str(Path(path).parent))
    if raw is None:
        raise PlanError(f"cannot read the model shape from {path}: no such file")
    return shape_from_config(raw, str(Path(path).parent))


def model_shape(name: str) -> ModelShape:
    """The shape of model `name`: a local checkpoint dir (its config.json) or a known architecture."""
    config_json = Path(name) / "config.json"
    if config_json.is_file():
        return shape_from_config_json(config_json)
    key = name.lower()
    if not key.startswith("builtin:"):
        key = key.rsplit("/", 1)[-1].replace("meta-", "")
    for known, shape in KNOWN_SHAPES.items():
        if key == known or key.startswith(known + "-") or key.startswith(known + "_"):
            return shape
    raise PlanError(
        f"no memory plan for model {name!r}: its shape is not in lowvram_grpo.memory.KNOWN_SHAPES "
        f"({', '.join(sorted({s.name for s in KNOWN_SHAPES.values()}))}); download it and set model.name to "
        "the local dir (its config.json gives the shape), or add its shape to KNOWN_SHAPES"
    )


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Term:
    """One component of the planned peak."""

    key: str        # weights, lora, optimizer, activations, logits, vllm, cuda
    label: str      # what it is, with the setting's value (e.g. 'optimizer state, paged_adamw_8bit')
    bytes: int
    detail: str     # how it was computed
    settings: str   # the settings that move it

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Suggestion:
    """Set `key` (section.key) to `value` (it was `was`)."""

    key: str
    value: Any
    was: Any

    def as_override(self) -> str:
        return f"{self.key}={_yaml_value(self.value)}"

    def __str__(self) -> str:
        return f"{self.as_override()} (was {_yaml_value(self.was)})"


def _yaml_value(value: Any) -> str:
    """A value as --set takes it (true/false/null, as YAML spells them)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


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
    kv_sequences: Optional[int] = None     # the larger of the rollout and evaluation batches (memory_plan_terms.kv_batch)
    kv_decided_by: str = ""                # 'rollout' or 'evaluation': which batch that is
    kv_largest_bytes: Optional[int] = None  # KV cache for that batch at full length
    free_gb: Optional[float] = None        # the memory free for the run on the card (None: no card given)
    priming: Optional[PrimingPeak] = None  # priming's own peak (prime.steps > 0 runs it before GRPO)
    vllm_min_share_bytes: Optional[int] = None  # what vLLM's gpu_memory_utilization share must hold at least
    vllm_outside_bytes: Optional[int] = None    # what must fit on the card beside vLLM's share
    vllm_max_model_len: Optional[int] = None    # the max_model_len unsloth_zoo starts vLLM with (unsloth_sizing.vllm_budget)
    suggestions: list[Suggestion] = field(default_factory=list)
    suggested_total_gb: Optional[float] = None  # the plan's total once the suggestions are applied
    no_fit_reason: str = ""           # set when no settings of this preset fit the card

    @property
    def config(self) -> RunConfig:
        return self.resolved.config

    @property
    def backend(self) -> str:
        return self.resolved.backend

    @property
    def model(self) -> str:
        return self.config.model.name

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
        if self.kv_cache_bytes is None or self.kv_decided_by != "evaluation" or self.kv_cache_bytes >= self.kv_largest_bytes:
            return None
        at_once = max(int(self.kv_cache_bytes // (self.kv_largest_bytes // self.kv_sequences)), 0)
        return (f"vLLM's KV cache ({max(self.kv_cache_bytes, 0) / GIB:.2f} GiB) holds {at_once} of an evaluation batch's "
                f"{self.kv_sequences} sequences at full length ({self.kv_largest_bytes / GIB:.2f} GiB): the held-out answers "
                f"are generated in waves (slower, no more memory); --set eval.batch_size={max(at_once, 1)} (--resume can set it) "
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
        t = self.config.train
        return t.max_prompt_length + t.max_completion_length

    def short_max_model_len(self) -> Optional[str]:
        """A warning when unsloth_zoo starts vLLM with a max_model_len below prompt + completion, else None."""
        length, need = self.vllm_max_model_len, self.rollout_tokens
        if length is None or length >= need:
            return None
        return (f"unsloth_zoo starts vLLM with max_model_len {length} (what its KV-cache estimate in vLLM's share holds), "
                f"below train.max_prompt_length + train.max_completion_length = {need}: longer rollouts are cut at {length} "
                f"tokens and a longer prompt is refused: raise memory.gpu_memory_utilization" + (
                    f", or lower train.max_completion_length to {length - self.config.train.max_prompt_length}"
                    if length > self.config.train.max_prompt_length else ""))

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


def _sizes(resolved) -> _Sizes:
    t, config = resolved.config.train, resolved.config
    seq_len = min(t.max_prompt_length + t.max_completion_length, config.model.max_seq_length)
    return _Sizes(batch=resolved.per_device_train_batch_size,
                  generation_batch=resolved.generation_batch_size // resolved.num_processes, seq_len=seq_len,
                  completion=min(t.max_completion_length, seq_len), compute_bytes=resolved.compute_bytes)


def lora_param_count(shape: ModelShape, config: RunConfig) -> int:
    dims = {**shape.linear_dims(), "lm_head": (shape.hidden, shape.vocab)}
    per_layer = sum(sum(dims[m]) for m in config.lora.target_modules if m in dims and m != "lm_head")
    head = sum(dims["lm_head"]) if "lm_head" in config.lora.target_modules else 0
    return config.lora.r * (per_layer * shape.layers + head)


def activation_bytes_per_token_layer(shape: ModelShape, compute_bytes: int) -> int:
    """Tensors one decoder layer keeps for backward, per token: norm inputs/outputs (some in fp32), q,
    attention output (~8 x hidden), k and v (2 x kv_dim), gate, up, act(gate), act x up (4 x intermediate)."""
    return (8 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) * compute_bytes


def _weights_term(shape: ModelShape, resolved, s: _Sizes) -> Term:
    if resolved.load_in_4bit:
        # hf: prepare_model_for_kbit_training casts embeddings, lm_head and norms to fp32
        other_bytes = 4 if resolved.backend == "hf" else s.compute_bytes
        size = int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * other_bytes)
        label = "base weights, 4-bit NF4"
        detail = (f"{shape.linear_params / 1e9:.2f}B linear params x {NF4_BYTES_PER_PARAM:.3f} B + "
                  f"{shape.other_params / 1e9:.2f}B embedding/norm params x {other_bytes} B"
                  + (" (fp32: PEFT's prepare_model_for_kbit_training)" if resolved.backend == "hf" else ""))
    else:
        size = shape.params * s.compute_bytes
        label = f"base weights, {8 * s.compute_bytes}-bit"
        detail = f"{shape.params / 1e9:.2f}B params x {s.compute_bytes} B"
    if resolved.fast_inference:
        label += " (shared with vLLM)"
    return Term("weights", label, size, detail, "model.name, memory.load_in_4bit")


def _activation_term(shape: ModelShape, resolved, s: _Sizes) -> Term:
    tokens = s.batch * s.seq_len
    layer = tokens * activation_bytes_per_token_layer(shape, s.compute_bytes)
    checkpoint = tokens * shape.hidden * s.compute_bytes  # one layer input
    mode = resolved.gradient_checkpointing  # 'unsloth' (offload) exists only on the unsloth backend
    if mode == "false":
        size, how = shape.layers * layer, f"all {shape.layers} layers kept"
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
    chunks; the detail gives the size the logits (+ a log_softmax copy) would take held whole, as older TRL held them."""
    whole = logits_bytes_held_whole(shape, s.batch, s.completion, s.compute_bytes)
    label = f"logits {s.batch} x {s.completion} x {shape.vocab}"
    if backend == "unsloth":
        from .unsloth_sizing import FUSED_BYTES_PER_LOGIT, fused_linear_rows

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
    config = resolved.config
    s = _sizes(resolved)
    lora = lora_param_count(shape, config)
    optim_bytes = OPTIMIZER_BYTES_PER_PARAM[resolved.optim]
    return {
        "weights": _weights_term(shape, resolved, s),
        "lora": Term("lora", f"LoRA params + grads, r={config.lora.r}", lora * LORA_BYTES_PER_PARAM,
                     f"{lora / 1e6:.1f}M params x {LORA_BYTES_PER_PARAM} B (fp32 weight + grad)",
                     "lora.r, lora.target_modules"),
        "optimizer": Term("optimizer", f"optimizer state, {resolved.optim}", lora * optim_bytes,
                          f"{lora / 1e6:.1f}M params x {optim_bytes} B", "train.optim"),
        "activations": _activation_term(shape, resolved, s),
        "logits": _logits_term(shape, s, resolved.backend),
    }


# --------------------------------------------------------------------------- the hf backend's vLLM engine

KV_BLOCK_TOKENS = 32  # vLLM allocates the KV cache in blocks of 32 tokens


def engine_sequences(config: RunConfig) -> int:
    """Sequences the hf backend's vLLM engine decodes at once: a rollout batch, or an evaluation batch."""
    return max(config.train.generation_batch_size, config.eval.batch_size)


def engine_kv_cache_bytes(shape: ModelShape, config: RunConfig, kv_bytes: int) -> int:
    """The KV cache the hf backend's vLLM engine asks vLLM for (`kv_cache_memory_bytes`, which vLLM then
    allocates instead of a gpu_memory_utilization share): memory.vllm_kv_cache_gb, else `engine_sequences`
    sequences of model.max_seq_length tokens in whole 32-token blocks, at `kv_bytes` per element."""
    if config.memory.vllm_kv_cache_gb:
        return int(config.memory.vllm_kv_cache_gb * GIB)
    tokens = math.ceil(config.model.max_seq_length / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return 2 * shape.layers * shape.kv_dim * kv_bytes * engine_sequences(config) * tokens  # K and V


def _engine_weights_bytes(shape: ModelShape, load_in_4bit: bool) -> int:
    """The engine's own copy of the base: NF4 linear layers + 16-bit embeddings (bitsandbytes), or 16-bit."""
    return int(shape.linear_params * NF4_BYTES_PER_PARAM + shape.other_params * 2) if load_in_4bit else shape.params * 2


def engine_share_bytes(shape: ModelShape, resolved) -> int:
    """What the engine allocates inside its process on the card: its weights, runtime, a LoRA slot and its KV cache."""
    return (_engine_weights_bytes(shape, resolved.load_in_4bit) + VLLM_RUNTIME_BYTES
            + lora_param_count(shape, resolved.config) * 2
            + engine_kv_cache_bytes(shape, resolved.config, resolved.compute_bytes))


def engine_gpu_memory_utilization(shape: ModelShape, resolved, card_gib: float) -> float:
    """The gpu_memory_utilization the engine passes on CUDA. With kv_cache_memory_bytes set, vLLM 0.31 sizes
    nothing from it; it only refuses to start unless that share of the card is free
    (vllm/v1/worker/utils.py request_memory). The engine's own share, rounded up to 0.01, makes that
    check ask exactly whether the engine fits beside the trainer loaded before it."""
    return min(max(math.ceil(engine_share_bytes(shape, resolved) / (card_gib * GIB) * 100) / 100, 0.01), 0.95)


def _estimate(resolved, vram_gb: Optional[float]) -> MemoryPlan:
    """The plan's terms for the resolved settings on a card of `vram_gb` GiB (None: the smallest card that fits),
    on the memory free on it for this run (memory_plan_terms.usable_gib)."""
    config = resolved.config
    shape = model_shape(config.model.name)
    terms = _training_terms(shape, resolved)
    cuda = Term("cuda", "CUDA context + allocator", CUDA_OVERHEAD_BYTES,
                "CUDA context, cuBLAS workspace, fragmentation (a constant)", "")
    outside_vllm = sum(t.bytes for k, t in terms.items() if k != "weights") + cuda.bytes
    weights = terms["weights"].bytes
    s = _sizes(resolved)
    elsewhere = used_elsewhere_gib(resolved)
    free = usable_gib(resolved, vram_gb)

    def finish(min_free_gb: float, priming_counted: bool = False, **vllm) -> MemoryPlan:
        terms["cuda"] = cuda
        priming = priming_peak(shape, resolved, terms, free if vram_gb is not None else None,
                               *priming_inputs(shape, resolved, terms))
        if config.prime.steps and not priming_counted:
            min_free_gb = max(min_free_gb, priming.total_gb)
        return MemoryPlan(resolved, shape, terms, vram_gb, min_free_gb + elsewhere,
                          free_gb=free if vram_gb is not None else None, priming=priming, **vllm)

    if resolved.generation == "vllm":
        # our engine (hf backend): its own weights, a LoRA slot and exactly the KV cache it asks for, in a
        # process with its own CUDA context, started once the trainer has loaded; the whole trainer beside it
        share = engine_share_bytes(shape, resolved)
        kv = engine_kv_cache_bytes(shape, config, resolved.compute_bytes)
        terms["vllm"] = Term(
            "vllm", "vLLM engine, its own weights and KV cache", share + VLLM_PROCESS_BYTES,
            f"its copy of the weights {_engine_weights_bytes(shape, resolved.load_in_4bit) / GIB:.2f} GiB, runtime "
            f"{VLLM_RUNTIME_BYTES / GIB:.1f} GiB, LoRA slot, KV cache {kv / GIB:.2f} GiB (kv_cache_memory_bytes: "
            f"{engine_sequences(config)} sequences x {config.model.max_seq_length} tokens), + "
            f"{VLLM_PROCESS_BYTES / GIB:.1f} GiB CUDA context. Asleep during backward, counted in full",
            "memory.vllm_kv_cache_gb, eval.batch_size, model.generation")
        return finish((sum(t.bytes for t in terms.values()) + cuda.bytes) / GIB)
    if resolved.generation != "unsloth_vllm":
        return finish((outside_vllm + weights) / GIB)

    # unsloth's engine shares the trainer's weights and takes util x the free memory for them, its runtime and the
    # KV cache, which must hold the larger of a rollout batch and an evaluation batch at full length
    util = resolved.gpu_memory_utilization
    kv_per_token = 2 * shape.layers * shape.kv_dim * KV_BYTES
    kv_needed = s.generation_batch * s.seq_len * kv_per_token  # a rollout batch: it must fit
    sequences, decided_by = kv_batch(config, s.generation_batch)  # the larger batch: checked, a warning when short
    in_share, outside = weights + VLLM_RUNTIME_BYTES, outside_vllm
    priming_outside = 0
    if config.prime.steps:  # priming's parts beside vLLM's share (weights inside it): its own peak's outside
        priming_outside = priming_peak(shape, resolved, {**terms, "cuda": cuda}, None,
                                       *priming_inputs(shape, resolved, terms)).total_bytes - weights
    min_free = max((in_share + kv_needed) / util, max(outside, priming_outside) / (1 - util)) / GIB
    card = vram_gb if vram_gb is not None else min_free + elsewhere
    free = free if free is not None else min_free
    # unsloth_zoo's load_vllm: util x the memory free at load, its max_model_len from the free and total memory
    budget = vllm_budget(shape, util, free * GIB, card * GIB, config.model.max_seq_length,
                         resolved.vllm_max_lora_rank or config.lora.r, resolved.load_in_4bit)
    reserved = int(budget.share_bytes)
    kv_cache = reserved - in_share
    rollout = s.generation_batch * s.seq_len * kv_per_token
    evaluation = (f"an evaluation batch ({config.eval.batch_size} sequences) needs "
                  f"{config.eval.batch_size * s.seq_len * kv_per_token / GIB:.2f} GiB" if config.eval.enabled
                  else "evaluation is off")
    terms["vllm"] = Term(
        "vllm", f"vLLM KV cache + runtime ({budget.utilization:.3g} x {card:.1f} GiB - weights)", max(reserved - weights, 0),
        f"unsloth_zoo gives vLLM gpu_memory_utilization {util:g} of the {free:.1f} GiB free at load, less the shared "
        f"weights; KV cache {kv_cache / GIB:.2f} GiB: a rollout batch ({s.generation_batch} sequences x {s.seq_len} "
        f"tokens) needs {rollout / GIB:.2f} GiB, {evaluation}; max_model_len {budget.max_model_len}",
        "memory.gpu_memory_utilization")
    return finish(min_free, kv_cache_bytes=kv_cache, kv_needed_bytes=kv_needed, kv_sequences=sequences,
                  kv_decided_by=decided_by, kv_largest_bytes=sequences * s.seq_len * kv_per_token, vllm_min_share_bytes=in_share + kv_needed, vllm_outside_bytes=max(outside, priming_outside),
                  vllm_max_model_len=budget.max_model_len, priming_counted=True)


def priming_inputs(shape, resolved, terms: dict) -> tuple[int, int]:
    """(activation bytes, trainable LoRA parameters) of priming's step: prime.batch_size examples of
    model.max_seq_length tokens under the run's gradient checkpointing (memory_plan_terms.priming_peak)."""
    config = resolved.config
    batch, tokens = config.prime.batch_size, config.model.max_seq_length
    sizes = _Sizes(batch=batch, generation_batch=batch, seq_len=tokens, completion=tokens,
                   compute_bytes=resolved.compute_bytes)
    return _activation_term(shape, resolved, sizes).bytes, terms["lora"].bytes // LORA_BYTES_PER_PARAM


def plan(resolved) -> MemoryPlan:
    """Peak GPU memory of a run with the resolved settings (resolve.py) on the card they were resolved
    for (`resolved.vram_gib`: memory.vram_gb, else the card's; None = no card: the plan then gives the
    smallest card that fits), on the memory free on it (the card present: less what others held when it was
    detected). A plan that does not fit carries suggestions. UNSLOTH_VLLM_STANDBY with unsloth's vLLM is
    refused (memory_plan_terms.refuse_standby): ResolveError, not PlanError, so a run stops on it."""
    refuse_standby(resolved)
    vram_gb = resolved.vram_gib
    result = _estimate(resolved, vram_gb)
    if result.fits is False:
        fitted, changes = fit_settings(resolved, vram_gb, SUGGESTION_SPARE * vram_gb)
        if fitted is None:
            result.no_fit_reason = changes
        else:
            result.suggestions = changes
            result.suggested_total_gb = _estimate(fitted, vram_gb).total_gb
    return result


# --------------------------------------------------------------------------- making a plan fit

def with_settings(config: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A validated copy of `config` with `section.key` settings replaced."""
    raw = config.to_dict()
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        raw[section][key] = value
    return config_from_dict(raw)


def _get(config: RunConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def _fits(resolved, vram_gb: float, reserve_gb: float = 0.0) -> bool:
    """Do these settings fit a card of `vram_gb` GiB with `reserve_gb` of it left unplanned?"""
    p = _estimate(resolved, vram_gb)
    return bool(p.fits) and p.total_gb + reserve_gb <= p.free_gb and (p.priming_fits is None or
                                                                      p.priming.total_gb + reserve_gb <= p.free_gb)


def _tune_utilization(resolved, vram_gb: float, reserve_gb: float = 0.0):
    """With vLLM: the gpu_memory_utilization (a multiple of 0.05 where one works) that leaves room both
    for vLLM's KV cache and for training, nearest the middle of that range; `resolved` if none does."""
    if resolved.generation != "unsloth_vllm" or _fits(resolved, vram_gb, reserve_gb):
        return resolved
    probe = _estimate(resolved.with_config(with_settings(resolved.config, {"memory.gpu_memory_utilization": 0.5})), vram_gb)
    card = probe.free_gb * GIB  # vLLM's share is of the free memory
    low = max(probe.vllm_min_share_bytes / card, 0.05)
    high = min(1 - (probe.vllm_outside_bytes + reserve_gb * GIB) / card, 0.95)
    if low > high:
        return resolved
    grid = [k / 20 for k in range(1, 20) if low <= k / 20 <= high]
    middle = (low + high) / 2
    value = min(grid, key=lambda u: abs(u - middle)) if grid else math.ceil(low * 100) / 100
    return resolved.with_config(with_settings(resolved.config, {"memory.gpu_memory_utilization": value}))


def _num_generations(config: RunConfig, n: int) -> dict[str, Any]:
    """num_generations=n, with per_device_train_batch_size following it where it was set."""
    settings: dict[str, Any] = {"train.num_generations": n}
    if config.train.per_device_train_batch_size is not None:
        settings["train.per_device_train_batch_size"] = n
    return settings


# Knobs in the order they are turned: free ones first, then those that cost quality or speed. Each
# gives the values to try, from the least change to the most.
def _knobs(config: RunConfig) -> list[tuple[str, list]]:
    t = config.train
    return [
        ("memory.gradient_checkpointing", ["unsloth"]),
        ("train.optim", ["paged_adamw_8bit"]),
        ("memory.load_in_4bit", [True]),
        # what GRPO's training does not depend on: priming's examples per step
        *([("prime.batch_size", [b for b in (32, 16, 8, 4, 2, 1) if b < config.prime.batch_size])] if config.prime.steps else []),
        ("train.num_generations", [n for n in (8, 6, 4) if n < t.num_generations]),
        ("train.max_completion_length", [c for c in (1024, 768, 512, 384, 256) if c < t.max_completion_length]),
        ("lora.r", [r for r in (32, 16, 8) if r < config.lora.r]),
        ("model.fast_inference", [False]),
        *([("model.generation", ["transformers"])] if config.model.generation == "vllm" else []),
        ("train.num_generations", [n for n in (3, 2) if n < min(t.num_generations, 4)]),
        ("train.max_completion_length", [c for c in (192, 128) if c < min(t.max_completion_length, 256)]),
    ]


def fit_settings(resolved, vram_gb: float, reserve_gb: float = 0.0) -> tuple[Optional[Any], Any]:
    """Settings that fit a card of `vram_gb` GiB, leaving `reserve_gb` unplanned: (fitted Resolved,
    [Suggestion]) or, when none do, (None, why). Turns the knobs in order until the plan fits, then
    gives back the cuts that turned out not to be needed. Each try is re-resolved for the same hardware."""
    config = resolved.config

    def fits(r):
        return _fits(r, vram_gb, reserve_gb)

    def set_to(r, key, value):
        settings = _num_generations(r.config, value) if key == "train.num_generations" else {key: value}
        return _tune_utilization(r.with_config(with_settings(r.config, settings)), vram_gb, reserve_gb)

    current = _tune_utilization(resolved, vram_gb, reserve_gb)
    turned: list[tuple[str, list]] = []
    for key, values in _knobs(config):
        values = [v for v in values if v != _get(current.config, key)]
        if fits(current) or not values:
            continue
        for value in values:  # the least change that fits, else the most this knob gives
            tried = set_to(current, key, value)
            if fits(tried):
                break
        current = tried
        turned.append((key, values))
    if not fits(current):
        need = _estimate(current, vram_gb).min_vram_gb + reserve_gb
        return None, f"even with {', '.join(s.as_override() for s in _diff(config, current.config))} it needs {need:.1f} GiB"
    for key, values in reversed(turned):  # give back: largest value (original first) that still fits
        for value in [_get(config, key)] + values:
            if value == _get(current.config, key):
                break
            candidate = set_to(current, key, value)
            if fits(candidate):
                current = candidate
                break
    return current, _diff(config, current.config)


_SUGGESTED_KEYS = ["memory.gradient_checkpointing", "train.optim", "memory.load_in_4bit", "model.fast_inference", "model.generation",
                   "memory.gpu_memory_utilization", "train.num_generations", "train.per_device_train_batch_size",
                   "train.max_completion_length", "lora.r", "prime.batch_size"]


def _diff(original: RunConfig, changed: RunConfig) -> list[Suggestion]:
    return [Suggestion(k, _get(changed, k), _get(original, k)) for k in _SUGGESTED_KEYS
            if _get(changed, k) != _get(original, k)]


def apply_suggestions(config: RunConfig, suggestions: list[Suggestion]) -> RunConfig:
    """`config` with the plan's suggested settings (what --auto-fit runs)."""
    return with_settings(config, {s.key: s.value for s in suggestions})


def presets_that_fit(hardware, vram_gb: float, tools: Optional[bool] = None) -> list[tuple[str, float]]:
    """(preset, planned GiB) of the GPU presets whose own settings fit a card of `vram_gb` GiB on `hardware`; with
    `tools`, only those that train with tools (True) or without (False): the same kind of job."""
    from .config import list_presets, load_config
    from .resolve import resolve
    from .tools import uses_tools

    found = []
    for name in list_presets():
        try:
            config = load_config(name)
            if not config.requires_cuda or (tools is not None and uses_tools(config) != tools):
                continue
            p = _estimate(resolve(config, hardware), vram_gb)
        except ConfigError:
            continue
        if p.fits:
            found.append((name, p.total_gb))
    return found


# --------------------------------------------------------------------------- the preset a run without --preset gets

# GPU presets from the largest model down: a run without --preset on a GPU takes the first that fits the card.
GPU_PRESET_ORDER = ("llama8b_4bit", "qwen3b_4bit", "qwen1_5b_4bit")


def default_preset(hardware=None) -> str:
    """smollm2_cpu without CUDA; with a GPU, the largest GPU preset whose memory plan fits the card."""
    from .hardware import detect

    hardware = hardware or detect()
    if not hardware.cuda:
        return "smollm2_cpu"
    fitting = dict(presets_that_fit(hardware, hardware.total_gib, tools=False))
    for name in GPU_PRESET_ORDER:
        if name in fitting:
            print(f"note: {hardware.describe()}: running --preset {name} ({fitting[name]:.1f} GiB planned), the "
                  f"largest that fits; pick another with --preset", file=sys.stderr)
            return name
    print(f"note: {hardware.describe()}: no GPU preset fits this card; running the CPU default smollm2_cpu",
          file=sys.stderr)
    return "smollm2_cpu"


# --------------------------------------------------------------------------- reporting

def format_plan(p: MemoryPlan, title: str = "") -> str:
    """The plan as a table, then whether it fits and what to change."""
    rows = [(t.label, f"{t.gib:6.2f}", t.settings or "-") for t in p.terms.values()]
    rows.append(("total", f"{p.total_gb:6.2f}", ""))
    width = max(len(r[0]) for r in rows)
    head = title or f"memory plan: {p.model} ({p.shape.params / 1e9:.2f}B params)"
    lines = [head, f"  {'component':<{width}}  {'GiB':>6}  lower it with", f"  {'-' * width}  ------  -------------"]
    lines += [f"  {label:<{width}}  {gib}  {settings}" for label, gib, settings in rows]
    lines.append(f"  {free_memory_text(p.resolved, p.vram_gb)}")
    if p.kv_cache_bytes is not None:
        lines.append(f"  {_kv_text(p)}")
    if p.priming is not None:
        lines += [f"  {line}" for line in p.priming.lines()]
    lines.append(_verdict(p))
    return "\n".join(lines)


def _kv_text(p: MemoryPlan) -> str:
    """Which batch vLLM's KV cache must hold, and whether it does."""
    t = p.config.train
    rollout = p.resolved.generation_batch_size // p.resolved.num_processes
    evaluation = p.config.eval.batch_size if p.config.eval.enabled else None
    other = (f"rollout {rollout} sequences, evaluation {evaluation} (eval.batch_size)" if evaluation is not None
             else f"rollout {rollout} sequences, evaluation off")
    holds = "holds" if p.kv_cache_bytes >= p.kv_largest_bytes else "does NOT hold"
    return (f"vLLM's KV cache {max(p.kv_cache_bytes, 0) / GIB:.2f} GiB {holds} the {p.kv_decided_by} batch: "
            f"{p.kv_sequences} sequences x {min(t.max_prompt_length + t.max_completion_length, p.config.model.max_seq_length)} "
            f"tokens = {p.kv_largest_bytes / GIB:.2f} GiB (the larger batch decides: {other})")


def plan_text(resolved) -> str:
    """The memory plan as `--dry-run` prints it (or why there is none)."""
    if not resolved.cuda:
        return ("GPU memory plan: none, this run is on the CPU; plan it for a card with --gpu PROFILE (e.g. t4) "
                "or --vram GB")
    title = f"GPU memory plan for {resolved.config.preset}: {resolved.config.model.name}, {resolved.backend} backend"
    try:
        return format_plan(plan(resolved), title=title)
    except PlanError as exc:
        return f"GPU memory plan: {exc}"


def _verdict(p: MemoryPlan) -> str:
    short = p.short_max_model_len()
    warning = f"\nwarning: {short}" if short else ""
    if p.fits is None:
        return (f"needs a card of at least {p.min_vram_gb:.1f} GiB (estimate); "
                "plan for a given card with --vram GB") + warning
    evaluation = p.evaluation_kv_short()
    warning += f"\nwarning: {evaluation}" if evaluation else ""
    shared = p.free_gb < p.vram_gb - 1e-9  # others hold some of the card
    free = f" of the {p.free_gb:.1f} GiB free" if shared else ""
    if p.fits:
        return (f"fits a {p.vram_gb:g} GiB card: {p.total_gb:.1f} GiB planned, {p.free_gb - p.total_gb:.1f} GiB{free} "
                "to spare") + warning
    why = f"does NOT fit a {p.vram_gb:g} GiB card" + (f" ({p.free_gb:.1f} GiB free)" if shared else "") + \
        f": {p.total_gb:.1f} GiB planned"
    if p.kv_cache_bytes is not None and p.kv_cache_bytes < p.kv_needed_bytes:
        why += (f" and vLLM's KV cache at gpu_memory_utilization={p.config.memory.gpu_memory_utilization:g} "
                f"({max(p.kv_cache_bytes, 0) / GIB:.2f} GiB) is below the {p.kv_needed_bytes / GIB:.2f} GiB a rollout "
                f"batch ({p.resolved.generation_batch_size // p.resolved.num_processes} sequences) needs")
    if p.priming_fits is False:
        why += f" and priming's peak ({p.priming.total_gb:.1f} GiB: prime.batch_size={p.priming.batch}) is above the {p.free_gb:.1f} GiB free"
    if short:
        why += (f" and unsloth_zoo would start vLLM with max_model_len {p.vllm_max_model_len}, below prompt + completion "
                f"({p.rollout_tokens})")
    if p.suggestions:
        sets = " ".join(f"--set {s.as_override()}" for s in p.suggestions)
        return (f"{why}\nto fit, change: {', '.join(map(str, p.suggestions))} -> {p.suggested_total_gb:.1f} GiB planned\n"
                f"  (run with --auto-fit, or add: {sets})")
    from .tools import uses_tools

    others = presets_that_fit(p.resolved.hardware, p.vram_gb, tools=uses_tools(p.config))
    alternative = (f"use a smaller model: {', '.join(f'--preset {n} ({gb:.1f} GiB)' for n, gb in others)}"
                   if others else "no preset fits this card")
    return f"{why}\nno settings of this preset fit: {p.no_fit_reason}; {alternative}"


# Where a CUDA out-of-memory can happen during a run, as the one-line report names it.
OOM_PHASES = {
    "training": "in a training step",
    "rollout": "while generating the GRPO rollouts",
    "evaluation": "in the held-out evaluation",
    "priming": "in a priming step",
}
# The frames of a rollout: TRL's private GRPOTrainer methods that generate and score the rollouts
# (trl_compat.TRL_ROLLOUT_METHODS, checked there against the installed TRL) + our engine's TRL hook
# (backends/vllm/rollouts.TRLRollouts.rollout_func, TRL's public name).
OUR_ROLLOUT_FRAMES = ("rollout_func",)


def oom_phase(exc: BaseException, default: str) -> str:
    """'rollout' when the out-of-memory was raised while TRL generated or scored the rollouts (read from
    the traceback), else `default`."""
    # Imported here, not at the top: trl_compat imports trl, and the memory plan (--dry-run, doctor) must not.
    # An out-of-memory in training comes after training.py imported trl_compat, so this costs nothing then.
    from .trl_compat import TRL_ROLLOUT_METHODS

    rollout_frames = frozenset(TRL_ROLLOUT_METHODS + OUR_ROLLOUT_FRAMES)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in rollout_frames:
            return "rollout"
        tb = tb.tb_next
    return default


def _oom_changes(p: Optional[MemoryPlan], config: RunConfig, phase: str) -> tuple[list[Suggestion], str]:
    """(settings to change, what to say when there are none) for an out-of-memory in `phase` of a run of
    `config` (planned as `p`, or None without a plan)."""
    if phase == "evaluation":
        size = config.eval.batch_size
        if size > 1:
            return [Suggestion("eval.batch_size", max(1, size // 2), size)], ""
        return [], "eval.batch_size is already 1: lower train.max_completion_length (the answers' length)"
    if p is None:
        return [], ("no memory plan for this model: lower train.num_generations or train.max_completion_length "
                    "(the rollout, activations and logits grow with both)")
    if phase == "rollout" and p.resolved.generation == "unsloth_vllm":
        util = config.memory.gpu_memory_utilization
        if p.kv_cache_bytes is not None and p.kv_cache_bytes < (p.kv_needed_bytes or 0) and util <= 0.9:
            return [Suggestion("memory.gpu_memory_utilization", round(min(util + 0.1, 0.95), 2), util)], ""
    card = p.vram_gb or p.min_vram_gb
    growing = sum(p.terms[k].bytes for k in ("lora", "optimizer", "activations", "logits")) / GIB
    # The real peak passed the card, so the plan fell short by at least its spare: plan that much lower,
    # and a margin more on the terms that grow during training.
    reserve = max(card - p.total_gb, 0) + OOM_UNDERESTIMATE * growing
    fitted, changes = fit_settings(p.resolved, card, reserve)
    if fitted is None:
        return [], f"no settings of this preset plan under {card - reserve:.1f} GiB: use a smaller model"
    if not changes:
        return [], "lower train.num_generations or train.max_completion_length (the logits term grows with both)"
    return changes, ""


def oom_message(p: Optional[MemoryPlan], config: RunConfig, phase: str = "training", checkpoint: Optional[Path] = None,
                run_path: Optional[Path] = None, adapter: Optional[Path] = None) -> str:
    """One line for a CUDA out-of-memory during a run: where it happened, the plan's largest terms, the
    settings to lower and to what, what is kept on disk, and the command that goes on. Settings that
    --resume may change (config.RESUME_SETTABLE) continue the run; others need a new run."""
    where = OOM_PHASES.get(phase, phase)
    largest = "" if p is None else "; largest planned terms: " + ", ".join(
        f"{t.key} {t.gib:.1f} GiB ({t.settings or 'fixed'})" for t in p.largest(3))
    changes, otherwise = _oom_changes(p, config, phase)
    if changes:
        planned = ""
        if p is not None and phase != "evaluation":
            fitted = p.resolved.with_config(apply_suggestions(config, changes))
            planned = f" (plans {_estimate(fitted, p.vram_gb or p.min_vram_gb).total_gb:.1f} instead of {p.total_gb:.1f} GiB)"
        advice = f"set {', '.join(map(str, changes))}{planned}"
    else:
        advice = otherwise
    kept = []
    if adapter is not None:
        kept.append(f"the trained adapter is saved in {adapter}")
    kept.append(f"the last checkpoint is kept in {checkpoint}" if checkpoint else "no checkpoint was written yet")
    sets = " ".join(f"--set {c.as_override()}" for c in changes)
    if run_path is None:
        then = ""
    elif changes and all(c.key in RESUME_SETTABLE for c in changes):
        then = f"; then continue with: python -m lowvram_grpo.run --resume {run_path} {sets}"
    elif changes:
        then = f"; these settings change the training itself: start a new run with {sets}"
    else:
        then = "; --resume cannot change these settings: start a new run with them lowered"
    return f"CUDA out of memory {where}{largest}; {advice}; {'; '.join(kept)}{then}"


@contextlib.contextmanager
def out_of_memory_reported(p: Optional[MemoryPlan], config: RunConfig, run_dir, phase: str = "training",
                           adapter: Optional[Path] = None):
    """Turns a CUDA out-of-memory inside the block into `OutOfMemory` with `oom_message`'s one line.
    `run_dir`: the run's RunDir (run_dir.RunDir); nothing is deleted, the checkpoints written so far stay;
    `adapter`: this run's saved adapter, when it was saved already. During training the phase is
    'rollout' when TRL was generating or scoring the rollouts (oom_phase)."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        where = oom_phase(exc, phase) if phase == "training" else phase
        raise OutOfMemory(oom_message(p, config, where, run_dir.latest_checkpoint(), run_dir.path, adapter)) from None
