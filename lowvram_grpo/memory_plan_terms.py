"""What the memory plan (memory.py) takes besides the terms of a GRPO step: the memory free for the run, the
batch vLLM's KV cache must hold, unsloth's standby mode, and priming's own peak.

    free = usable_gib(resolved, card_gib)       # the card less what others hold on it (hardware.free_gib)
    sequences, which = kv_batch(config, 6)      # (16, 'evaluation'): the larger of the rollout and eval batches
    refuse_standby(resolved)                    # ResolveError when UNSLOTH_VLLM_STANDBY is on for unsloth's vLLM
    peak = priming_peak(shape, resolved, terms, free_gib, *memory.priming_inputs(shape, resolved, terms))

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

from dataclasses import dataclass
from typing import Optional

from .errors import ResolveError

GIB = 2 ** 30
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
    if resolved.config.memory.vram_gb is not None or hw.free_gib is None or hw.total_gib is None:
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
                f"({elsewhere:.1f} GiB held by others, e.g. a display): the plan and vLLM's share are on the free memory, "
                "as unsloth sizes vLLM")
    if resolved.config.memory.vram_gb is not None:
        return f"card: {card_gib:g} GiB (memory.vram_gb), planned as all free"
    if resolved.hardware.free_gib is None:
        return (f"card: {card_gib:.1f} GiB ({resolved.hardware.name} profile), planned as all free; unsloth sizes vLLM "
                "on the memory free at load: a card that drives a display has ~0.3-1 GiB less")
    return f"card: {card_gib:.1f} GiB, all free when detected"


# --------------------------------------------------------------------------- the batch vLLM's KV cache must hold

def kv_batch(config, rollout_sequences: int) -> tuple[int, str]:
    """(sequences, 'rollout' | 'evaluation'): the larger of the rollout batch and the held-out evaluation's
    (eval.batch_size, when evaluation is on) that unsloth's engine generates at once."""
    evaluation = config.eval.batch_size if config.eval.enabled else 0
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
    checkpointing (memory.priming_inputs); two logits chunks (logprobs_fallback)."""
    config = resolved.config
    batch, tokens = config.prime.batch_size, config.model.max_seq_length
    rows = max(1, PRIMING_CHUNK_ELEMENTS // shape.vocab)
    parts = {"weights": terms["weights"].bytes, "LoRA + grads": terms["lora"].bytes,
             "AdamW fp32 state": lora_params * PRIMING_OPTIMIZER_BYTES_PER_PARAM,
             f"activations {batch} x {tokens} tokens": activation_bytes,
             "logits chunks": 2 * min(rows, batch * tokens) * shape.vocab * 4 * 2}  # z + log_softmax, 2 chunks
    if "vllm" in terms:
        parts["vLLM"] = terms["vllm"].bytes
    parts["CUDA"] = terms["cuda"].bytes
    return PrimingPeak(config.prime.steps, batch, tokens, parts,
                       None if free_gib is None else int(free_gib * GIB))
