"""Rollouts that ignore the adapter are caught: the guard no trainer has (issue 66).

unsloth's fix #8701 (2026-08-14): `fast_inference` GRPO had sampled every rollout from the base model, ignoring the
LoRA, and reported finite losses while doing it. Any sampler that holds its own copy of the weights can do the same
when the adapter does not reach it: a vLLM engine whose LoRA sync is cut, a decode loop that skips the merge.

`trl_compat.SampledTokenScores` scores each scored step's sampled tokens under the adapter and under the base model
(the adapter disabled), on every generation path. `AdapterGuard` judges them: once the adapter has moved the policy
(after ADAPTER_GUARD_AFTER optimizer steps), a step whose tokens score more than ADAPTER_GUARD_MARGIN nats a token
higher under the base than under the adapter is flagged: a warning line above the progress bar, a field on it, the
report's section (report/build.py, from ADAPTER_SKIPPED_KEY in metrics.jsonl); `stop_after` flagged scored steps in a
row stop the run at the end of that step with a checkpoint, and the pipeline raises the one line of `raise_if_stopped`
naming the likely cause (the LoRA sync). `stop_after` 0: it warns and never stops. This module imports transformers.
"""
from __future__ import annotations

import sys
from typing import Optional

from tqdm.auto import tqdm
from transformers import TrainerCallback

from lowvram_grpo.core.errors import TrainingStopped
from lowvram_grpo.report.learning_signals import (
    ADAPTER_GUARD_AFTER,
    ADAPTER_GUARD_LIKELIHOOD,
    ADAPTER_GUARD_MARGIN,
    ADAPTER_SKIPPED_KEY,
)

CAUSE = ("the sampler is not drawing from the adapter being trained: most likely the LoRA sync to the sampler (a vLLM "
         "engine's adapter update, unsloth's fast_inference load_lora, or a merge of the adapter into the sampler's "
         "weights) did not reach it, as in unsloth #8701")


class AdapterGuard(TrainerCallback):
    """Flags steps whose sampled tokens score closer to the base than to the adapter; stops after `stop_after` in a row.

    Args:
        stop_after: flagged scored steps in a row that stop the run (0: never stop, warn only).
        margin: nats a token the base must out-score the adapter by (ADAPTER_GUARD_MARGIN).
        after: optimizer steps before steps are judged (ADAPTER_GUARD_AFTER): until then the adapter is ~ the base."""

    def __init__(self, stop_after: int, margin: float = ADAPTER_GUARD_MARGIN, after: int = ADAPTER_GUARD_AFTER):
        self.stop_after, self.margin, self.after = stop_after, margin, after
        self.flagged, self.in_a_row, self.judged = 0, 0, 0
        self.stopped_at: Optional[int] = None
        self.last: Optional[dict] = None   # the latest judged step: {step, adapter_minus_base, flagged}
        self._warned = False

    def note(self, step: int, scores: dict) -> None:
        """A scored step's numbers (trl_compat.SampledTokenScores calls this once the step's tokens are scored)."""
        if step <= self.after or not scores.get("tokens"):
            return
        closer = closer_to_base(scores)
        flagged = closer > self.margin and (scores.get("sampler_to_base") is not None
                                            or closer * scores["tokens"] > ADAPTER_GUARD_LIKELIHOOD)
        self.judged += 1
        self.flagged += flagged
        self.in_a_row = self.in_a_row + 1 if flagged else 0
        self.last = {"step": step, "closer_to_base": closer, "flagged": flagged, **scores}

    def on_step_end(self, args, state, control, **kwargs):
        last = self.last
        if last is None or last["step"] != state.global_step or not last["flagged"]:
            return
        if not self._warned and state.is_world_process_zero:
            self._warned = True
            tqdm.write(f"warning: {flag_line(last, self.margin)}", file=sys.stderr)
        if self.stop_after and self.in_a_row >= self.stop_after:
            self.stopped_at = state.global_step
            control.should_save = True  # the trainer writes checkpoint-<step> right after this event
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        last = self.last
        if logs is not None and "reward" in logs and last is not None and last["step"] == state.global_step:
            logs[ADAPTER_SKIPPED_KEY] = 1.0 if last["flagged"] else 0.0

    def raise_if_stopped(self, state, checkpoint) -> None:
        """The one line of a run this guard stopped (after the pipeline wrote what it keeps)."""
        if self.stopped_at is None:
            return
        last = self.last
        kept = f"; checkpoint {checkpoint} kept" if checkpoint else ""
        raise TrainingStopped(
            f"stopped at step {self.stopped_at} of {state.max_steps}: the rollouts of {self.in_a_row} scored steps in "
            f"a row were closer to the base model than to the adapter being trained (the latest by "
            f"{last['closer_to_base']:.4f} nats a token, {judged_by(last)}; margin {self.margin:g}, "
            f"train.adapter_guard_steps={self.stop_after}): {CAUSE}{kept}")


def closer_to_base(scores: dict) -> float:
    """How much closer to the base model than to the adapter a scored step's sampled tokens are (nats a token; > 0:
    closer to the base). Where the sampler gave its log-probs: its distance to the adapter's minus its distance to the
    base's (mean |sampler - adapter| - mean |sampler - base|: the sampler's own distribution, whichever it was); else
    the trainer's scores alone: mean log-prob under the base minus under the adapter (-KL(adapter || base) on average
    when the adapter sampled, KL(base || adapter) when the base did). That one alone is noisy in a small batch (96
    tokens of the tiny preset: +-0.015 a token), so AdapterGuard also asks its total over the batch, the log of how
    much likelier the base makes the batch than the adapter, to pass ADAPTER_GUARD_LIKELIHOOD nats."""
    if scores.get("sampler_to_base") is not None:
        return scores["sampler_to_adapter"] - scores["sampler_to_base"]
    return -scores["adapter_minus_base"]


def judged_by(last: dict) -> str:
    """What a judged step's number compares."""
    if last.get("sampler_to_base") is not None:
        return (f"the sampler's own log-probs {last['sampler_to_base']:.4f} from the base's and "
                f"{last['sampler_to_adapter']:.4f} from the adapter's")
    return (f"the sampled tokens' log-prob {-last['adapter_minus_base']:.4f} higher under the base (adapter off) than "
            "under the adapter")


def flag_line(last: dict, margin: float) -> str:
    """The warning of a flagged step."""
    return (f"GRPO step {last['step']}: the rollouts are {last['closer_to_base']:.4f} nats a token closer to the base "
            f"model (adapter off) than to the adapter being trained ({judged_by(last)}; margin {margin:g}): {CAUSE}")


def progress_field(logs: dict) -> Optional[str]:
    """The progress bar's field on a flagged step (ADAPTER_SKIPPED_KEY in the step's logs), else None."""
    if logs.get(ADAPTER_SKIPPED_KEY) == 1.0:
        return "sampled by the base?"
    return None
