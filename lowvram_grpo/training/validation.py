"""The held-out curve during GRPO, and the best adapter it keeps.

The curve starts at step 0: before GRPO's first step (`start`), the adapter GRPO starts from (the primed adapter, the
lora.init_adapter, or a fresh LoRA, which is the base model) is measured the same way as every later point, its numbers
kept in the run's curve_start.json (RunDir.write_curve_start: metrics.jsonl keeps one row a GRPO step, 1..max_steps;
records.curve_rows reads the two together). Then every `resolved.validation_every` GRPO steps (eval.every_steps;
resolve.choose_validation decides it, on by default where it costs under 10% of the run) and at the last step, the
adapter as trained so far is saved, loaded back and
measured under the run's protocol (evaluation.py: greedy by default, one answer a question) on the validation
questions: eval.validation_size questions of the training source that are never trained on and never the held-out
questions of the final comparison (data.validation_questions: built-in problems generated after the training ones,
so the training data is the very one of a run without the curve; other data: taken out of the training questions).
Its numbers go into that step's row of metrics.jsonl as
`validation/<metric>` (so the trackers and the report's plots get them), and when the point is the best so far by
the criterion (`validation/accuracy_strict`; `validation/reward_mean` for data without gold answers; the earliest
step among equals), the saved adapter becomes best_adapter/ (RunDir.keep_best: atomically, with best_step.json). Step 0
is a point like the others: where GRPO never beats the adapter it started from, best_adapter/ is that adapter (step 0).
Every measurement keeps the random streams as they were (`random_state_kept`): the curve changes nothing GRPO trains.

A signal during a measurement abandons it (the step's checkpoint follows at once); the resumed run measures that
step first, from its checkpoint, and adds the point to the step's row (`catch_up`). A signal during step 0's
measurement stops the run before GRPO (pipeline.py), and --resume measures it again; a run resumed from a GRPO
checkpoint without a step 0 (one started before the curve had it) measures it from the start adapter on disk
(`start_adapter`) where there is one. Checkpoints keep the
best_adapter/ of their step, so a resume from an earlier checkpoint goes on with the best as it was then and the
curve's rows as they were (RunDir.restore_metrics, restore_best; curve_start.json holds for every checkpoint): the
curve stays whole and best_adapter/ is always the argmax of the curve (`best_point`). Nothing here imports torch or
transformers at import.
"""
from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path
from typing import Optional

from lowvram_grpo.core import stops
from lowvram_grpo.report.records import (  # noqa: F401  (validation.X)
    CRITERIA,
    PREFIX,
    START_KEY,
    START_STEP,
    best_point,
    criterion,
    curve,
    curve_rows,
    start_text,
)

NUMBERS = ("accuracy_strict", "accuracy_lenient", "reward_mean", "format_rate", "mean_completion_tokens")


def due(step: int, every: int, max_steps: int) -> bool:
    """Is the curve measured after GRPO step `step`?"""
    return every > 0 and step > 0 and (step % every == 0 or step == max_steps)


def logged_numbers(numbers: dict) -> dict:
    """evaluation.score's numbers as metrics.jsonl keys (`validation/accuracy_strict`, ...), plus `validation/n`."""
    out = {f"{PREFIX}{name}": numbers[name] for name in NUMBERS if isinstance(numbers.get(name), (int, float))}
    out[f"{PREFIX}n"] = numbers.get("n_graded", numbers.get("n"))
    return out


@contextlib.contextmanager
def random_state_kept():
    """Python's, numpy's and torch's random states (CPU and CUDA) as they were before the block: a measurement
    leaves the run's sampling and data order where they were."""

    import numpy
    import torch  # lazily: only a training run measures

    states = (random.getstate(), numpy.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def start_to_trackers(trainer, numbers: dict):
    """A callback that gives the run's trackers (transformers' `report_to` integrations: TensorBoard, W&B, trackio)
    the curve's step 0 as GRPO step 0's log, once they are set up when training begins: the later points reach them
    in their steps' logs (grpo.ValidationCurve), so every tracker's curve starts at step 0 too.

    Args:
        trainer: the run's trainer (its callbacks hold the trackers).
        numbers: step 0's metrics keys (`validation/<metric>`).

    Returns:
        The callback, added last by the trainer (grpo.py): the trackers are set up before it.
    """
    from transformers import TrainerCallback  # loads transformers: only a training run has trackers

    from lowvram_grpo.training.trl_compat import trainer_callbacks  # loads TRL, as the trainer it serves has

    class StartToTrackers(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step != START_STEP:  # a resumed run: step 0 went to the trackers when it was measured
                return
            logs = {key: value for key, value in numbers.items() if isinstance(value, (int, float))}
            for callback in trainer_callbacks(trainer):
                if type(callback).__module__.startswith("transformers.integrations"):
                    callback.on_log(args, state, control, logs=dict(logs), **kwargs)

    return StartToTrackers()


class Validation:
    """Measures the curve's points for one run: `start()` before GRPO (step 0), `measure(step)` after a GRPO step,
    `catch_up(step, rows)` on resume.

    Args:
        handle: the model handle.
        rows: the validation prompt rows.
        plan: the evaluation plan (plans.EvalPlan).
        run_dir: the RunDir.
        every: the interval in GRPO steps (cadence.py may re-decide it).
        log: where its lines go.
        start: what step 0 is: 'primed', 'init_adapter' or 'base' (records.STARTS).
        start_adapter: the adapter GRPO starts from as a folder on disk (primed_adapter/, lora.init_adapter), or None
            (a fresh LoRA): step 0 measured on resume from a checkpoint that has none.
    """

    def __init__(self, handle, rows: list[dict], plan, run_dir, every: int, log=print, start: str = "base",
                 start_adapter: Optional[Path] = None):
        self.handle, self.rows, self.plan, self.run_dir, self.every, self.log = handle, rows, plan, run_dir, every, log
        self.start_kind, self.start_adapter = start, start_adapter
        self.best: Optional[dict] = None  # {'step', 'criterion', 'value'} of best_adapter/
        self.started: Optional[dict] = None  # step 0's numbers when this process measured them (start_to_trackers)

    def restore(self, metric_rows: list[dict]) -> None:
        """The best so far from the curve: its step 0 (curve_start.json) and metrics.jsonl's rows (a resumed run;
        best_adapter/ was restored with them)."""
        self.best = best_point(curve_rows(self.run_dir.read_curve_start(), metric_rows))

    def start(self) -> Optional[dict]:
        """The curve's step 0: the model as GRPO starts from it, measured like every point before GRPO's first step,
        written to curve_start.json and kept as best_adapter/ (the first point is the best so far).

        Returns:
            The point's metrics keys, or None when a signal came (the measurement is abandoned, nothing written).
        """
        self.run_dir.reset_curve_start()
        self.best = None
        numbers = self.started = self.measure(START_STEP)
        if numbers is not None:
            self.run_dir.write_curve_start({**numbers, START_KEY: self.start_kind})
            self.log(f"held-out curve: step 0 ({start_text({START_KEY: self.start_kind})}, before GRPO): "
                     f"{self.describe(numbers)}")
        return numbers

    def measure(self, step: int, adapter: Optional[Path] = None) -> Optional[dict]:
        """The curve's point at `step`, kept as best_adapter/ when it is the best so far.

        Args:
            step: the GRPO step (0: GRPO's start).
            adapter: a saved adapter folder to measure instead of the model's trained adapter (step 0 on resume).

        Returns:
            The metrics keys, or None when a signal came (the measurement is abandoned).
        """
        if stops.received() is not None:
            return None
        with random_state_kept():  # loading the adapter initialises LoRA layers: it must not move training's streams
            return self._measure(step, adapter)

    def _is_best(self, step: int, key: Optional[str], numbers: dict) -> bool:
        """Whether the point beats the best so far: a higher value, or an equal one at an earlier step."""
        if key is None:
            return False
        return self.best is None or (numbers[key], -step) > (self.best["value"], -self.best["step"])

    def _measure(self, step: int, adapter: Optional[Path] = None) -> Optional[dict]:
        from lowvram_grpo.evaluate.evaluation import generate_answers, score  # loads transformers

        staging = self.run_dir.validation_staging()
        request, training = None, self.handle.model.training  # TRL logs a step as 'train' only in training mode
        try:
            saved = (self.handle.save_lora(staging / "adapter") if adapter is None
                     else Path(shutil.copytree(adapter, staging / "adapter")))
            request = self.handle.load_lora(saved)
            try:
                generated = generate_answers(self.handle, self.rows, self.plan, request)
            except stops.StopRequested:
                return None
            numbers = logged_numbers(score(self.rows, generated, self.plan, tokenizer=self.handle.tokenizer))
            key = next((k for k in CRITERIA if k in numbers), None)
            if self._is_best(step, key, numbers):
                self.best = {"step": step, "criterion": key, "value": numbers[key]}
                self.handle.release_lora(request)
                request = None
                self.run_dir.keep_best(saved, {**self.best, **numbers})
            return numbers
        finally:
            if request is not None:
                self.handle.release_lora(request)
            shutil.rmtree(staging, ignore_errors=True)
            self.handle.model.train(training)

    def catch_up(self, step: int, metric_rows: list[dict]) -> None:
        """On resume from checkpoint `step`: measure the points the run lacks, step 0 (a run started before the curve
        had it) and `step` if it is due and its row lacks it (a stop during the measurement), into curve_start.json
        and that row of metrics.jsonl."""
        self.restore(metric_rows)
        if self.run_dir.read_curve_start() is None:
            self._catch_up_start()
        if not due(step, self.every, self.plan.max_steps):
            return
        if any(row["step"] == step and criterion([row]) is not None for row in metric_rows):
            return
        numbers = self.measure(step)
        if numbers is not None:
            self.run_dir.add_to_metrics_row(step, numbers)
            self.log(f"held-out curve: step {step}'s point measured on resume ({self.describe(numbers)})")

    def _catch_up_start(self) -> None:
        """Step 0 on resume from a GRPO checkpoint: measured from the start adapter on disk; said when there is none
        (a fresh LoRA: the base model, which no adapter folder holds)."""
        if self.start_adapter is None or not Path(self.start_adapter).is_dir():
            self.log("held-out curve: no step 0 (the run was started without it, and the adapter GRPO started from "
                     "is not on disk): the curve starts at its first GRPO step")
            return
        numbers = self.measure(START_STEP, Path(self.start_adapter))
        if numbers is not None:
            self.run_dir.write_curve_start({**numbers, START_KEY: self.start_kind})
            self.log(f"held-out curve: step 0's point measured on resume from {self.start_adapter} "
                     f"({self.describe(numbers)})")

    @staticmethod
    def describe(numbers: dict) -> str:
        key = next((k for k in CRITERIA if k in numbers), None)
        return (f"{key.removeprefix(PREFIX)} {numbers[key]:.3f} on {numbers[f'{PREFIX}n']} validation questions"
                if key else "no score")
