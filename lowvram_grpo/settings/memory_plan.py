"""The memory plan: an estimate, by component, of a run's peak GPU memory, and settings that make it fit.

    p = plan(config, resolve(config, profile("t4")))   # a MemoryPlan: named terms in bytes, total, fits, suggestions
    print(format_plan(p))                      # the table `--dry-run` and every GPU run print
    config = apply_suggestions(config, p.suggestions)   # what `--auto-fit` does (memory_fit.py)

Everything device-dependent (backend, compute dtype, checkpointing mode, vLLM on or off, batch sizes,
the card's size) comes from the `Resolved` settings (resolve.py), the same object the run uses, and the run's
settings from its plan (`resolved.plan`); the config itself only where settings that fit are searched for.

The plan by job: model_shapes.py (an architecture's sizes), memory_terms.py (the terms, each explained
there, and their estimate), memory_fit.py (settings that fit; the default preset), this module (the plan with
its suggestions, and its table), oom.py (a run's out-of-memory line). Pure Python: no torch, no transformers.
"""
from __future__ import annotations

from lowvram_grpo.core.errors import PlanError
from lowvram_grpo.settings.memory_fit import SUGGESTION_SPARE, fit_settings, presets_that_fit
from lowvram_grpo.settings.memory_terms import (
    GIB,
    MemoryPlan,
    estimate,
    forced_float32,
    free_memory_text,
    refuse_standby,
)
from lowvram_grpo.settings.model_shapes import UNSLOTH_NO_VLLM, vllm_serves


def plan(config, resolved) -> MemoryPlan:
    """Peak GPU memory of a run of `config` with its resolved settings (resolve.py) on the card they were resolved
    for (`resolved.vram_gib`: memory.vram_gb, else the card's; None = no card: the plan then gives the
    smallest card that fits), on the memory free on it (the card present: less what others held when it was
    detected). A plan that does not fit carries suggestions. UNSLOTH_VLLM_STANDBY with unsloth's vLLM is
    refused (memory_plan_terms.refuse_standby): ResolveError, not PlanError, so a run stops on it."""
    refuse_standby(resolved)
    vram_gb = resolved.vram_gib
    result = estimate(resolved, vram_gb)
    if result.fits is False:
        fitted, changes = fit_settings(config, resolved, vram_gb, SUGGESTION_SPARE * vram_gb)
        if fitted is None:
            result.no_fit_reason = changes
        else:
            result.suggestions = changes
            result.suggested_total_gb = estimate(fitted, vram_gb).total_gb
    return result


# --------------------------------------------------------------------------- reporting

def format_plan(p: MemoryPlan, title: str = "") -> str:
    """The plan as a table, then whether it fits and what to change."""
    rows = [(t.label, f"{t.gib:6.2f}", t.settings or "-") for t in p.terms.values()]
    rows.append(("total", f"{p.total_gb:6.2f}", ""))
    width = max(len(r[0]) for r in rows)
    head = title or f"memory plan: {p.model} ({p.shape.params / 1e9:.2f}B params)"
    lines = [head, *family_lines(p), f"  {'component':<{width}}  {'GiB':>6}  lower it with",
             f"  {'-' * width}  ------  -------------"]
    lines += [f"  {label:<{width}}  {gib}  {settings}" for label, gib, settings in rows]
    lines.append(f"  {free_memory_text(p.resolved, p.vram_gb)}")
    if p.kv_cache_bytes is not None:
        lines.append(f"  {_kv_text(p)}")
    if p.priming is not None:
        lines += [f"  {line}" for line in p.priming.lines()]
    lines.append(_verdict(p))
    return "\n".join(lines)


def family_lines(p: MemoryPlan) -> list[str]:
    """Where the shape came from, what of its family the plan counts, what it cannot know, and whether vLLM 0.31
    serves the family as this run would use it (model_shapes.VLLM_FAMILIES)."""

    shape, resolved = p.shape, p.resolved
    lines = [f"  model: {shape.describe()}", f"  shape from: {shape.source or 'its config.json'}"]
    if forced_float32(shape, resolved):
        lines.append(f"  unsloth trains {shape.family} in float32 on a card without bf16 (its FORCE_FLOAT32 list): "
                     "activations counted at 4 bytes")
    lines += [f"  not known: {what}" for what in shape.unknown]
    serves = vllm_serves(shape)
    uses_vllm = resolved.generation in ("unsloth_vllm", "vllm")
    if serves is None:
        if uses_vllm:
            lines.append(f"  not known: whether vLLM 0.31 serves {shape.family} with LoRA (not read in its wheel)")
        return lines
    where = f"vllm/model_executor/models/{serves.model_file} {serves.model_class}"
    if not uses_vllm and shape.family in UNSLOTH_NO_VLLM:
        lines.append(f"  vLLM: off for {shape.family}: {serves.why_not}")
    elif resolved.generation == "unsloth_vllm" and shape.family in UNSLOTH_NO_VLLM:
        lines.append(f"  vLLM: NOT for {shape.family}: {serves.why_not}; this plan counts a vLLM share "
                     "the run would not take: set model.fast_inference=false")
    elif uses_vllm and not serves.lora:
        lines.append(f"  vLLM: {where} has no LoRA support in vLLM 0.31: set model.fast_inference=false")
    elif uses_vllm:
        bnb = "" if not resolved.load_in_4bit else (
            ", 4-bit through vllm-bnb-plugin" if serves.bnb_4bit else ", NOT 4-bit: vllm-bnb-plugin cannot load it")
        lines.append(f"  vLLM: serves {shape.family} with LoRA ({where}){bnb}")
    return lines


def _kv_text(p: MemoryPlan) -> str:
    """Which batch vLLM's KV cache must hold, and whether it does."""
    run = p.resolved.plan
    rollout = p.resolved.generation_batch_size // p.resolved.num_processes
    evaluation = run.eval.batch_size if run.eval.enabled else None
    other = (f"rollout {rollout} sequences, evaluation {evaluation} (eval.batch_size)" if evaluation is not None
             else f"rollout {rollout} sequences, evaluation off")
    holds = "holds" if p.kv_cache_bytes >= p.kv_largest_bytes else "does NOT hold"
    return (f"vLLM's KV cache {max(p.kv_cache_bytes, 0) / GIB:.2f} GiB {holds} the {p.kv_decided_by} batch: "
            f"{p.kv_sequences} sequences x {min(run.model.rollout_tokens, run.model.max_seq_length)} "
            f"tokens = {p.kv_largest_bytes / GIB:.2f} GiB (the larger batch decides: {other})")


def plan_text(config, resolved) -> str:
    """The memory plan of `config` resolved as `resolved` as `--dry-run` prints it (or why there is none)."""
    if not resolved.cuda:
        return ("GPU memory plan: none, this run is on the CPU; plan it for a card with --gpu PROFILE (e.g. t4) "
                "or --vram GB")
    title = f"GPU memory plan for {resolved.plan.preset}: {resolved.plan.model.name}, {resolved.backend} backend"
    try:
        return format_plan(plan(config, resolved), title=title)
    except PlanError as exc:
        return f"GPU memory plan: {exc}"


def run_plan_text(config, resolved) -> str:
    """The run's plan, whole: `config` as YAML (what --resume reads back), the settings resolve decided and what
    each phase reads (plans.RunPlan) as YAML comments, and the memory plan. What `--dry-run` prints and what a run
    writes to its folder's plan.txt."""
    decided = "\n".join(f"# {line}" for line in (resolved.describe() + "\n" + resolved.plan.describe()).splitlines())
    return f"{config.to_yaml()}{decided}\n{plan_text(config, resolved)}\n"


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
        why += (f" and vLLM's KV cache at gpu_memory_utilization={p.resolved.plan.model.gpu_memory_utilization:g} "
                f"({max(p.kv_cache_bytes, 0) / GIB:.2f} GiB) is below the {p.kv_needed_bytes / GIB:.2f} GiB a rollout "
                f"batch ({p.resolved.generation_batch_size // p.resolved.num_processes} sequences) needs")
    if p.priming_fits is False:
        why += (f" and priming's peak ({p.priming.total_gb:.1f} GiB: prime.batch_size={p.priming.batch}) is above the "
                f"{p.free_gb:.1f} GiB free")
    if short:
        why += (f" and unsloth_zoo would start vLLM with max_model_len {p.vllm_max_model_len}, below prompt + "
                f"completion ({p.rollout_tokens})")
    if p.suggestions:
        sets = " ".join(f"--set {s.as_override()}" for s in p.suggestions)
        return (f"{why}\nto fit, change: {', '.join(map(str, p.suggestions))} "
                f"-> {p.suggested_total_gb:.1f} GiB planned\n"
                f"  (run with --auto-fit, or add: {sets})")

    others = presets_that_fit(p.resolved.hardware, p.vram_gb, tools=p.resolved.plan.tools.used)
    alternative = (f"use a smaller model: {', '.join(f'--preset {n} ({gb:.1f} GiB)' for n, gb in others)}"
                   if others else "no preset fits this card")
    return f"{why}\nno settings of this preset fit: {p.no_fit_reason}; {alternative}"
