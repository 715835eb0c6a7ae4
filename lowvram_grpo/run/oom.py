"""The out-of-memory line: a CUDA out-of-memory during a run becomes one line (errors.OutOfMemory) that says where
it happened (a training step, the rollout, the evaluation, priming), the plan's largest terms, the settings to
lower and to what (planned lower than the plan that ran out: memory_fit.fit_settings), what is kept on disk, and
the command that goes on.

    with out_of_memory_reported(p, config, run_dir, "training"):   # p: the run's memory.plan, or None
        trainer.train()
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from lowvram_grpo.core.errors import OutOfMemory
from lowvram_grpo.settings.config import RESUME_SETTABLE, RunConfig
from lowvram_grpo.settings.memory_fit import Suggestion, apply_suggestions, fit_settings
from lowvram_grpo.settings.memory_terms import GIB, MemoryPlan, estimate
from lowvram_grpo.settings.resolve import resolve_again

OOM_UNDERESTIMATE = 0.3           # after an OOM, assume the training-side terms were this much larger


# Where a CUDA out-of-memory can happen during a run, as the one-line report names it.
OOM_PHASES = {
    "training": "in a training step",
    "rollout": "while generating the GRPO rollouts",
    "evaluation": "in the held-out evaluation",
    "priming": "in a priming step",
}
# The frames of a rollout: TRL's private GRPOTrainer methods that generate and score the rollouts
# (trl_compat.TRL_ROLLOUT_METHODS, checked there against the installed TRL) + our engine's TRL hook
# (training/vllm_rollouts.TRLRollouts.rollout_func, TRL's public name).
OUR_ROLLOUT_FRAMES = ("rollout_func",)


def oom_phase(exc: BaseException, default: str) -> str:
    """'rollout' when the out-of-memory was raised while TRL generated or scored the rollouts (read from
    the traceback), else `default`."""
    # Imported here, not at the top: trl_compat imports trl, and the pipeline imports this module before training.
    # An out-of-memory in training comes after grpo.py imported trl_compat, so this costs nothing then.
    from lowvram_grpo.training.trl_compat import TRL_ROLLOUT_METHODS

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
    fitted, changes = fit_settings(config, p.resolved, card, reserve)
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
            fitted = resolve_again(apply_suggestions(config, changes), p.resolved)
            planned = (f" (plans {estimate(fitted, p.vram_gb or p.min_vram_gb).total_gb:.1f} instead of "
                       f"{p.total_gb:.1f} GiB)")
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
