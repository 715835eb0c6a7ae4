"""Before/after comparison on the held-out questions.

The same prompts, the same sampling settings and the same seed are used for the base model
(`lora_request=None`) and for the trained adapter (`lora_request=handle.load_lora(saved)`), so the
two rows differ only by the adapter. Reported per run: mean total reward (the configured rewards and
weights), accuracy (the `correctness` reward's verdict), format rate (a reasoning block followed by an
answer block) and mean completion length in tokens.
"""
from __future__ import annotations

from typing import Optional

from . import host_memory
from .backends.base import Completion, LoraRequest, ModelHandle, SamplingParams
from .rewards import REWARDS, completion_text, format_ok

METRICS = ("reward_mean", "accuracy", "format_rate", "mean_completion_tokens")


def generate_answers(handle: ModelHandle, rows: list[dict], config, lora_request: Optional[LoraRequest]) -> list[Completion]:
    ev = config.eval
    texts: list[Completion] = []
    for start in range(0, len(rows), ev.batch_size):
        batch = rows[start:start + ev.batch_size]
        params = SamplingParams(
            temperature=ev.temperature, top_p=ev.top_p, max_tokens=config.train.max_completion_length,
            seed=ev.seed + start,  # per batch, identical for before and after
        )
        texts += handle.generate([r["prompt"] for r in batch], params, lora_request=lora_request)
        host_memory.release()  # the batch's KV cache and logits back to the OS (host_memory.py)
    return texts


def score(rows: list[dict], generated: list[Completion], config) -> dict:
    """The four summary numbers for completions of `rows`."""
    completions = [c.text for c in generated]
    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    total = [0.0] * len(rows)
    for name, weight in zip(config.rewards.names, config.rewards.weight_list):
        for i, value in enumerate(REWARDS[name](prompts, completions, answer=answers)):
            total[i] += weight * value
    correct = REWARDS["correctness"](prompts, completions, answer=answers)
    n = len(rows)
    return {
        "reward_mean": sum(total) / n,
        "accuracy": sum(1 for c in correct if c > 0) / n,
        "format_rate": sum(1 for c in completions if format_ok(completion_text(c))) / n,
        "mean_completion_tokens": sum(c.num_tokens for c in generated) / n,
        "n": n,
    }


def evaluate(handle: ModelHandle, rows: list[dict], config, lora_request: Optional[LoraRequest]) -> tuple[dict, list[str]]:
    generated = generate_answers(handle, rows, config, lora_request)
    return score(rows, generated, config), [c.text for c in generated]


def format_table(before: dict, after: dict, primed: Optional[dict] = None) -> str:
    """The before/after table printed at the end of a run (with the primed column when priming ran)."""
    middle = f"{'primed':>10}" if primed else ""
    lines = [f"{'held-out metric':<24}{'before':>10}{middle}{'after':>10}{'change':>10}"]
    for key in METRICS:
        b, a = before[key], after[key]
        mid = f"{primed[key]:>10.3f}" if primed else ""
        lines.append(f"{key:<24}{b:>10.3f}{mid}{a:>10.3f}{a - b:>+10.3f}")
    if primed:
        lines.append(f"(GRPO's own change in reward_mean, primed -> after: {after['reward_mean'] - primed['reward_mean']:+.3f})")
    return "\n".join(lines)
