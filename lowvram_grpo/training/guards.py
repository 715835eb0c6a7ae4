"""What stops a run early, and how: the numerical guard and Ctrl-C / SIGTERM.

- `NonFiniteGuard`: a step whose gradient is NaN/inf (a NaN/inf loss makes it so) is skipped: its
  gradients are dropped just before the optimizer step, so no weight and no optimizer state moves.
  Skipped steps are counted in metrics.jsonl (`skipped_nonfinite`); `train.max_nonfinite_steps` in
  a row stop the run with a message.
- `StopOnSignal`: the first SIGINT (Ctrl-C), SIGTERM or SIGHUP (stops.py, process-wide) asks the trainer
  to stop at the end of the current step and write a checkpoint; the pipeline then writes the adapter and
  raises `Interrupted` (exit 130 / 143 / 129) with the `--resume` command. A second Ctrl-C stops at once.

Both raise `errors.TrainingStopped` (or its `Interrupted`), which the CLI prints as one `error:`
line with its exit code. This module imports transformers: only grpo.py imports it.
"""
from __future__ import annotations

import contextlib
import math
import signal
from pathlib import Path

from transformers import TrainerCallback

from lowvram_grpo.report.run_dir import resume_command
from lowvram_grpo.core import stops
from lowvram_grpo.core.errors import Interrupted, TrainingStopped


class NonFiniteGuard(TrainerCallback):
    """Skips optimizer steps with a non-finite gradient; stops after `max_in_a_row` of them in a row."""
    def __init__(self, max_in_a_row: int, learning_rate: float):
        self.max_in_a_row, self.learning_rate = max_in_a_row, learning_rate
        self.skipped, self.in_a_row, self.stopped_at = 0, 0, None
        self._norm_finite = True

    def state(self) -> dict:
        return {"skipped_nonfinite": self.skipped, "nonfinite_in_a_row": self.in_a_row}

    def load(self, state: dict) -> None:
        self.skipped = int(state.get("skipped_nonfinite", 0))
        self.in_a_row = int(state.get("nonfinite_in_a_row", 0))

    def note_grad_norm(self, norm) -> None:
        """The step's gradient norm before clipping (the trainer calls this). An inf norm matters even
        though clipping then scales every gradient to 0: Adam's momentum would still move the weights."""
        self._norm_finite = norm is None or bool(math.isfinite(float(norm)))

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        import torch

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm_finite, self._norm_finite = self._norm_finite, True
        if norm_finite and (not params or torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in params]))):
            self.in_a_row = 0
            return
        for p in params:
            p.grad = None  # optimizers skip parameters without a gradient: no update, no moment change
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            self.stopped_at = state.global_step + 1  # the step being taken
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "reward" in logs:  # a training step's row (metrics.jsonl)
            logs["skipped_nonfinite"] = self.skipped

    def raise_if_stopped(self, state, checkpoint) -> None:
        if self.stopped_at is None:
            return
        kept = (f"; the newest checkpoint is {checkpoint} (skipped steps leave the weights unchanged)" if checkpoint
                else "")
        raise TrainingStopped(
            f"stopped at step {self.stopped_at} of {state.max_steps}: {self.in_a_row} steps in a row had a NaN/inf "
            f"loss or gradient (each skipped; train.max_nonfinite_steps={self.max_in_a_row}). Lower "
            f"train.learning_rate (now {self.learning_rate:g}) or check that the rewards stay small{kept}"
        )

    def explain(self, exc: BaseException, state):
        """A TrainingStopped for sampling that failed on NaN/inf probabilities (the weights blew up in one
        step, before any gradient was non-finite), else None."""
        if "probability tensor contains" not in str(exc):
            return None
        return TrainingStopped(
            f"sampling failed at step {state.global_step + 1} of {state.max_steps}: the model's outputs are NaN/inf, "
            f"so the last update blew the weights up. Lower train.learning_rate (now {self.learning_rate:g})"
        )


class StopOnSignal(TrainerCallback):
    """Turns the first SIGINT/SIGTERM/SIGHUP during training into a stop at the next step boundary, with a
    checkpoint. The signals are the process-wide ones of stops.py: one received before training started
    (while the trainer was built) stops after the first step."""

    SIGNALS = stops.SIGNALS

    @property
    def received(self):
        return stops.received()

    @contextlib.contextmanager
    def installed(self):
        """The handlers (stops.handled: re-entrant, main thread only) while the block runs; a signal is
        recorded, announced, and acted on at the step's end (the pipeline raises after the adapter is saved)."""
        with stops.handled(), stops.deferred("after this step, with a checkpoint", check_at_exit=False):
            yield

    def on_step_end(self, args, state, control, **kwargs):
        if self.received is not None:
            control.should_save = True  # the trainer writes checkpoint-<step> right after this event
            control.should_training_stop = True

    def raise_if_stopped(self, state, run_dir: Path, adapter_dir: Path) -> None:
        if self.received is None or state.global_step >= state.max_steps:
            return
        name = signal.Signals(self.received).name
        raise Interrupted(
            f"stopped by {name} after step {state.global_step} of {state.max_steps}; checkpoint "
            f"{Path(run_dir) / f'checkpoint-{state.global_step}'} and adapter {adapter_dir} written. "
            f"Continue with: {resume_command(run_dir)}",
            self.received,
        )
