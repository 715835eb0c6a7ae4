"""Settings that make a memory plan fit, and the preset a run without --preset gets.

    fitted, changes = fit_settings(config, resolved, 15.0)   # (Resolved that fits, [Suggestion]) or (None, why)
    config = apply_suggestions(config, changes)      # what --auto-fit does
    default_preset()                                 # smollm2_cpu on a CPU; on a GPU the largest preset that fits

The search turns the knobs in order (free ones first, then those that cost quality or speed) on the plan's
estimate (memory_plan_terms.estimate) until it fits, then gives back the cuts that turned out not to be needed.
memory.plan attaches its result to a plan that does not fit; oom.py plans lower after an out-of-memory.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Optional

from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.settings.config import RunConfig, config_from_dict, list_presets, load_config
from lowvram_grpo.settings.hardware import detect
from lowvram_grpo.settings.memory_terms import GIB, estimate
from lowvram_grpo.settings.resolve import resolve, resolve_again

SUGGESTION_SPARE = 0.05           # suggested settings leave this share of the card unplanned


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
    p = estimate(resolved, vram_gb)
    return bool(p.fits) and p.total_gb + reserve_gb <= p.free_gb and (p.priming_fits is None or
                                                                      p.priming.total_gb + reserve_gb <= p.free_gb)


def _tune_utilization(config: RunConfig, resolved, vram_gb: float,
                      reserve_gb: float = 0.0) -> tuple[RunConfig, Any]:
    """With vLLM: (config, resolved) with the gpu_memory_utilization (a multiple of 0.05 where one works) that leaves
    room both for vLLM's KV cache and for training, nearest the middle of that range; `resolved` (`config`
    resolved) as it is if none does."""
    if resolved.generation != "unsloth_vllm" or _fits(resolved, vram_gb, reserve_gb):
        return config, resolved
    probe = estimate(resolve_again(with_settings(config, {"memory.gpu_memory_utilization": 0.5}), resolved), vram_gb)
    card = probe.free_gb * GIB  # vLLM's share is of the free memory
    low = max(probe.vllm_min_share_bytes / card, 0.05)
    high = min(1 - (probe.vllm_outside_bytes + reserve_gb * GIB) / card, 0.95)
    if low > high:
        return config, resolved
    grid = [k / 20 for k in range(1, 20) if low <= k / 20 <= high]
    middle = (low + high) / 2
    value = min(grid, key=lambda u: abs(u - middle)) if grid else math.ceil(low * 100) / 100
    tuned = with_settings(config, {"memory.gpu_memory_utilization": value})
    return tuned, resolve_again(tuned, resolved)


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
        *([("prime.batch_size", [b for b in (32, 16, 8, 4, 2, 1) if b < config.prime.batch_size])]
          if config.prime.steps else []),
        ("train.num_generations", [n for n in (8, 6, 4) if n < t.num_generations]),
        ("train.max_completion_length", [c for c in (1024, 768, 512, 384, 256) if c < t.max_completion_length]),
        ("lora.r", [r for r in (32, 16, 8) if r < config.lora.r]),
        ("model.fast_inference", [False]),
        *([("model.generation", ["transformers"])] if config.model.generation == "vllm" else []),
        ("train.num_generations", [n for n in (3, 2) if n < min(t.num_generations, 4)]),
        ("train.max_completion_length", [c for c in (192, 128) if c < min(t.max_completion_length, 256)]),
    ]


def fit_settings(config: RunConfig, resolved, vram_gb: float,
                 reserve_gb: float = 0.0) -> tuple[Optional[Any], Any]:
    """Settings of `config` (resolved as `resolved`) that fit a card of `vram_gb` GiB, leaving `reserve_gb`
    unplanned: (fitted Resolved, [Suggestion]) or, when none do, (None, why). Turns the knobs in order until the plan
    fits, then gives back the cuts that turned out not to be needed. Each try is re-resolved for the same hardware
    (resolve.resolve_again: the model's facts derived once)."""

    def fits(r):
        return _fits(r, vram_gb, reserve_gb)

    def set_to(c, r, key, value):
        settings = _num_generations(c, value) if key == "train.num_generations" else {key: value}
        changed = with_settings(c, settings)
        return _tune_utilization(changed, resolve_again(changed, r), vram_gb, reserve_gb)

    current_config, current = _tune_utilization(config, resolved, vram_gb, reserve_gb)
    turned: list[tuple[str, list]] = []
    for key, values in _knobs(config):
        values = [v for v in values if v != _get(current_config, key)]
        if fits(current) or not values:
            continue
        for value in values:  # the least change that fits, else the most this knob gives
            tried_config, tried = set_to(current_config, current, key, value)
            if fits(tried):
                break
        current_config, current = tried_config, tried
        turned.append((key, values))
    if not fits(current):
        need = estimate(current, vram_gb).min_vram_gb + reserve_gb
        return None, (f"even with {', '.join(s.as_override() for s in _diff(config, current_config))} "
                      f"it needs {need:.1f} GiB")
    for key, values in reversed(turned):  # give back: largest value (original first) that still fits
        for value in [_get(config, key)] + values:
            if value == _get(current_config, key):
                break
            candidate_config, candidate = set_to(current_config, current, key, value)
            if fits(candidate):
                current_config, current = candidate_config, candidate
                break
    return current, _diff(config, current_config)


_SUGGESTED_KEYS = ["memory.gradient_checkpointing", "train.optim", "memory.load_in_4bit", "model.fast_inference",
                   "model.generation", "memory.gpu_memory_utilization", "train.num_generations",
                   "train.per_device_train_batch_size", "train.max_completion_length", "lora.r", "prime.batch_size"]


def _diff(original: RunConfig, changed: RunConfig) -> list[Suggestion]:
    return [Suggestion(k, _get(changed, k), _get(original, k)) for k in _SUGGESTED_KEYS
            if _get(changed, k) != _get(original, k)]


def apply_suggestions(config: RunConfig, suggestions: list[Suggestion]) -> RunConfig:
    """`config` with the plan's suggested settings (what --auto-fit runs)."""
    return with_settings(config, {s.key: s.value for s in suggestions})


def presets_that_fit(hardware, vram_gb: float, tools: Optional[bool] = None) -> list[tuple[str, float]]:
    """(preset, planned GiB) of the GPU presets whose own settings fit a card of `vram_gb` GiB on `hardware`; with
    `tools`, only those that train with tools (True) or without (False): the same kind of job."""

    found = []
    for name in list_presets():
        try:
            config = load_config(name)
            if not config.requires_cuda or (tools is not None and config.uses_tools != tools):
                continue
            p = estimate(resolve(config, hardware), vram_gb)
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
