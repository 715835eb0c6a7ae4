"""The checkpoint cadence and the held-out curve's interval, from this run's own step time (step_time.py).

Before GRPO, resolve.choose_save_steps plans the cadence from a spec-sheet estimate of a step (and
resolve.choose_validation the curve from counts of answers). `MeasuredCadence` times each GRPO step; after
step_time.CALIBRATION_STEPS steps of this process its median replaces the estimate, and from then on, corrected at
every step:
- train.save_steps null (auto): a checkpoint once as many steps as fit in resolve.CHECKPOINT_EVERY_S at the measured
  time have passed since the last one (transformers' fixed `save_steps` modulus is switched off; the last step, a
  stop and the guards still save as before). An explicit train.save_steps is kept.
- eval.every_steps null (auto) with the curve on: its interval is re-decided from the measured step and the
  measured seconds of a held-out answer before GRPO (`answer_seconds`): where the planned interval costs more than
  resolve.VALIDATION_BUDGET of GRPO's time, the smallest N that does not, or off; within the budget the plan's points
  stay (more points than the plan said would cost time it did not announce). A curve planned off stays off (its
  validation questions are in training): the line says what the measure would have decided.
The plan line (`plan_line`) is logged once the measure counts; the progress line shows the figure and the cadence
(`fields`). summary.json keeps `facts()`.
"""
from __future__ import annotations

import time
from typing import Optional

from transformers import TrainerCallback

from lowvram_grpo.settings.resolve import CHECKPOINT_EVERY_S, SAVE_STEPS_WITHOUT_ESTIMATE, VALIDATION_BUDGET, span_text
from lowvram_grpo.settings.step_time import MeasuredStepTime, checkpoint_cadence, curve_cost, curve_every


class MeasuredCadence(TrainerCallback):
    """Times GRPO steps and keeps the checkpoint cadence and the curve's interval on the measured figure.

    Args:
        plan: the run's TrainPlan (save_steps_auto, curve_auto, validation_size, max_steps).
        planned_seconds: the plan's estimate of a step (resolve.Resolved.step_seconds), or None.
        save_steps: the planned cadence (GRPOConfig's save_steps).
        validation: the run's validation.Validation (its `every` is re-decided), or None.
        answer_seconds: a held-out answer's seconds measured before GRPO, or None.
        log: where the plan line goes.
        clock: seconds now (time.perf_counter; a test's own clock).
    """

    def __init__(self, plan, planned_seconds: Optional[float], save_steps: int, validation=None,
                 answer_seconds: Optional[float] = None, log=print, clock=time.perf_counter):
        self.plan, self.validation, self.answer_seconds, self.log = plan, validation, answer_seconds, log
        self.clock = clock
        self.timer = MeasuredStepTime(planned_seconds)
        self.planned_seconds, self.save_steps = planned_seconds, max(1, int(save_steps))
        self.planned_save_steps = self.save_steps
        self.last_saved, self.began, self.said = 0, None, False
        self.curve_note: Optional[str] = None
        self.calibrated_s: Optional[float] = None  # the measured figure when it first counted (the plan line's)

    # ------------------------------------------------------------------ the trainer's events
    def on_train_begin(self, args, state, control, **kwargs):
        self.last_saved = state.global_step
        self.timer = MeasuredStepTime(self.planned_seconds, first_step=state.global_step)
        if self.plan.save_steps_auto:
            state.save_steps = 0  # transformers' modulus off: on_step_end decides (the last step still saves)

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = self.clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        """The step's end: its rollouts, loss and optimizer step, before the curve and a checkpoint (not the step's)."""
        if self.began is not None:
            self.timer.add(self.clock() - self.began)
            self.began = None

    def on_step_end(self, args, state, control, **kwargs):
        if not self.timer.measured:
            return
        seconds = self.timer.seconds
        if self.plan.save_steps_auto:
            self.save_steps = checkpoint_cadence(seconds, self.plan.max_steps, CHECKPOINT_EVERY_S,
                                                 SAVE_STEPS_WITHOUT_ESTIMATE)
            if state.global_step - self.last_saved >= self.save_steps:
                control.should_save = True
        if not self.said:
            self.said, self.calibrated_s = True, seconds
            self._decide_curve(seconds)
            self.log(self.plan_line())

    def on_save(self, args, state, control, **kwargs):
        self.last_saved = state.global_step

    # ------------------------------------------------------------------ what it says
    def _decide_curve(self, seconds: float) -> None:
        """The curve's interval from the measured step (curve_auto, the curve on, a measured answer), once."""
        if not self.plan.curve_auto or self.answer_seconds is None:
            return
        every, share = curve_every(self.plan.max_steps, self.plan.validation_size, self.answer_seconds, seconds,
                                   VALIDATION_BUDGET)
        answer = f"{self.answer_seconds:.2f} s a held-out answer"
        if self.validation is None:
            self.curve_note = (f"held-out curve off as planned; measured ({answer}) it would be "
                               + (f"every {every} steps ({share:.0%})" if every else f"off ({share:.0%})"))
            return
        planned = self.validation.every
        if every == 0:
            self.validation.every = 0
            self.curve_note = (f"held-out curve off from now: measured ({answer}) even two points cost {share:.0%} of "
                               f"GRPO's time (on where under {VALIDATION_BUDGET:.0%}; planned every {planned})")
            return
        if every <= planned:  # within the budget as planned: the plan's points
                              # stay (more would cost what it did not say)
            share = curve_cost(planned, self.plan.max_steps, self.plan.validation_size, self.answer_seconds, seconds)
            self.curve_note = (f"held-out curve every {planned} steps as planned, "
                               f"measured {share:.0%} of GRPO's time at {answer}")
            return
        self.validation.every = every
        self.curve_note = (f"held-out curve every {every} steps (planned every {planned}), measured {share:.0%} of "
                           f"GRPO's time at {answer}")

    def plan_line(self) -> str:
        """'GRPO step time: ~16.6 s a step, measured over steps 2-3 (planned ~41 s, estimated): checkpoint every 54
        GRPO step(s) (~15 min); held-out curve ...'."""
        seconds = self.timer.seconds
        planned = f"planned ~{self.planned_seconds:.0f} s, estimated" if self.planned_seconds else "no planned estimate"
        line = f"GRPO step time: ~{seconds:.1f} s a step, {self.timer.basis()} ({planned}): "
        if self.plan.save_steps_auto:
            line += (f"checkpoint every {self.save_steps} GRPO step(s) (~{span_text(self.save_steps * seconds)})"
                     + ("" if self.save_steps == self.planned_save_steps else f", planned {self.planned_save_steps}"))
        else:
            line += (f"checkpoint every {self.save_steps} GRPO step(s) as set (train.save_steps), "
                     f"~{span_text(self.save_steps * seconds)} at this time")
        if self.curve_note:
            line += f"; {self.curve_note}"
        elif self.validation is not None and self.answer_seconds is not None and self.validation.every:
            share = curve_cost(self.validation.every, self.plan.max_steps, self.plan.validation_size,
                               self.answer_seconds, seconds)
            line += f"; held-out curve every {self.validation.every} steps, measured {share:.0%} of GRPO's time"
        return line

    def fields(self) -> dict:
        """The progress line's fields: the step time (measured or estimated) and the checkpoint cadence."""
        seconds = self.timer.seconds
        if seconds is None:
            return {"ckpt": f"every {self.save_steps}"}
        return {"s/step": f"{seconds:.1f} {'measured' if self.timer.measured else 'est.'}",
                "ckpt": f"every {self.save_steps}"}

    def facts(self) -> dict:
        """summary.json's `step_time`: the plan's estimate, the measured figure and its basis, the cadence, the
        steps' seconds, the curve's decision."""
        return {"planned_s": self.planned_seconds, "planned_save_steps": self.planned_save_steps,
                "calibrated_s": round(self.calibrated_s, 3) if self.calibrated_s is not None else None,
                "measured_s": round(self.timer.seconds, 3) if self.timer.measured else None,
                "basis": self.timer.basis(), "calibration_steps": self.timer.calibration,
                "save_steps": self.save_steps, "save_steps_auto": self.plan.save_steps_auto,
                "steps_s": [round(s, 3) for s in self.timer.steps], "curve": self.curve_note,
                "answer_s": round(self.answer_seconds, 3) if self.answer_seconds is not None else None}
