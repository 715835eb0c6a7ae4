"""The held-out curve during GRPO, and the best adapter it keeps.

Every `resolved.validation_every` GRPO steps (eval.every_steps; resolve.choose_validation decides it, on by default
where it costs under 10% of the run) and at the last step, the adapter as trained so far is saved, loaded back and
measured under the run's protocol (evaluation.py: greedy by default, one answer a question) on the validation
questions: eval.validation_size questions of the training source that are never trained on and never the held-out
questions of the final comparison (data.validation_questions: built-in problems generated after the training ones,
so the training data is the very one of a run without the curve; other data: taken out of the training questions).
Its numbers go into that step's row of metrics.jsonl as
`validation/<metric>` (so the trackers and the report's plots get them), and when the point is the best so far by
the criterion (`validation/accuracy_strict`; `validation/reward_mean` for data without gold answers; the earliest
step among equals), the saved adapter becomes best_adapter/ (RunDir.keep_best: atomically, with best_step.json).

A signal during a measurement abandons it (the step's checkpoint follows at once); the resumed run measures that
step first, from its checkpoint, and adds the point to the step's row (`catch_up`). Checkpoints keep the
best_adapter/ of their step, so a resume from an earlier checkpoint goes on with the best as it was then and the
curve's rows as they were (RunDir.restore_metrics, restore_best): the curve stays whole and best_adapter/ is always
the argmax of the curve in metrics.jsonl (`best_point`). Nothing here imports torch or transformers at import.
"""
from __future__ import annotations

import contextlib
import random
import shutil
from typing import Optional

from lowvram_grpo.core import stops
from lowvram_grpo.report.records import CRITERIA, PREFIX, best_point, criterion, curve  # noqa: F401  (validation.X)

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


class Validation:
    """Measures the curve's points for one run: `measure(step)` after a GRPO step, `catch_up(step, rows)` on resume.
    `handle`: the model handle; `rows`: the validation prompt rows; `run_dir`: the RunDir."""

    def __init__(self, handle, rows: list[dict], plan, run_dir, every: int, log=print):
        self.handle, self.rows, self.plan, self.run_dir, self.every, self.log = handle, rows, plan, run_dir, every, log
        self.best: Optional[dict] = None  # {'step', 'criterion', 'value'} of best_adapter/

    def restore(self, metric_rows: list[dict]) -> None:
        """The best so far from the curve in metrics.jsonl (a resumed run; best_adapter/ was restored with it)."""
        self.best = best_point(metric_rows)

    def measure(self, step: int) -> Optional[dict]:
        """The curve's point at `step`: the adapter saved, measured, and kept as best_adapter/ when it is the best so
        far. Returns the metrics keys, or None when a signal came (the measurement is abandoned)."""
        if stops.received() is not None:
            return None
        with random_state_kept():  # loading the adapter initialises LoRA layers: it must not move training's streams
            return self._measure(step)

    def _measure(self, step: int) -> Optional[dict]:
        from lowvram_grpo.evaluate.evaluation import generate_answers, score  # loads transformers

        staging = self.run_dir.validation_staging()
        request, training = None, self.handle.model.training  # TRL logs a step as 'train' only in training mode
        try:
            saved = self.handle.save_lora(staging / "adapter")
            request = self.handle.load_lora(saved)
            try:
                generated = generate_answers(self.handle, self.rows, self.plan, request)
            except stops.StopRequested:
                return None
            numbers = logged_numbers(score(self.rows, generated, self.plan, tokenizer=self.handle.tokenizer))
            key = next((k for k in CRITERIA if k in numbers), None)
            if key is not None and (self.best is None or numbers[key] > self.best["value"]):
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
        """On resume from checkpoint `step`: measure its point if it is due and its row lacks it (a stop during the
        measurement), into that row of metrics.jsonl."""
        self.restore(metric_rows)
        if not due(step, self.every, self.plan.max_steps):
            return
        if any(row["step"] == step and criterion([row]) is not None for row in metric_rows):
            return
        numbers = self.measure(step)
        if numbers is not None:
            self.run_dir.add_to_metrics_row(step, numbers)
            self.log(f"held-out curve: step {step}'s point measured on resume ({self.describe(numbers)})")

    @staticmethod
    def describe(numbers: dict) -> str:
        key = next((k for k in CRITERIA if k in numbers), None)
        return (f"{key.removeprefix(PREFIX)} {numbers[key]:.3f} on {numbers[f'{PREFIX}n']} validation questions"
                if key else "no score")
