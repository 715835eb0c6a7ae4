"""Training-signal warnings: the logged metrics say GRPO is not learning, and what to do about it.

GRPO learns from differences between the completions of one prompt's group. Three patterns in TRL's
logged metrics mean it has little or nothing to learn from:

- `truncated`: most completions hit `max_completion_length` (TRL's `completions/clipped_ratio`). A cut-off
  completion never writes its closing tags, so the format and correctness rewards stay at 0.
- `no_signal`: most groups scored all-equal rewards (TRL's `frac_reward_zero_std`): zero advantage,
  zero gradient. Which way says what to do: groups that are all wrong (`groups/all_wrong`, logged by
  training.GroupOutcomes from the correctness reward) need right answers within reach (prime the format,
  partial-credit rewards); groups that are all right need harder questions, more generations or a higher
  temperature, so that answers in a group differ.
- `flat_reward`: the mean reward has not moved for many logged steps.

`moving_average` is the smoothing of the progress bar's and the reward plot's average (SMOOTHING steps).

Everything here is a pure function of metric rows (the dicts of `metrics.jsonl`), so the same checks
run live during training (`training.SignalWarnings`, one print per kind) and afterwards in the report
(`scan` replays them over the whole log).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

CLIPPED_KEY = "completions/clipped_ratio"
ZERO_STD_KEY = "frac_reward_zero_std"
REWARD_KEY = "reward"
ALL_RIGHT_KEY = "groups/all_right"   # share of groups whose completions were all right (training.GroupOutcomes)
ALL_WRONG_KEY = "groups/all_wrong"   # ... all wrong
SMOOTHING = 10      # logged steps in the moving average of the reward (progress bar, reward plot)

WINDOW = 5          # logged steps averaged for the two ratio checks: one odd step is not a pattern
MIN_ROWS = 2        # ... and at least this many, so the very first step alone never warns
THRESHOLD = 0.5     # "most": more than half of the completions / groups
FLAT_STEPS = 10     # logged steps without change before the reward counts as flat
FLAT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Signal:
    """One warning: which check (`kind`), the step it first held at, and what to do (`message`)."""

    kind: str
    step: int
    message: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.message}"


def _values(rows: list[dict], key: str) -> list[float]:
    """The finite values of `key` (metrics.jsonl writes non-finite values as null)."""
    return [row[key] for row in rows if isinstance(row.get(key), (int, float))]


def _recent_mean(rows: list[dict], key: str) -> Optional[float]:
    values = _values(rows, key)[-WINDOW:]
    if len(values) < MIN_ROWS:
        return None
    return sum(values) / len(values)


def truncation(rows: list[dict], max_completion_length: Optional[int] = None) -> Optional[str]:
    """A warning when most recent completions were cut at max_completion_length, else None."""
    ratio = _recent_mean(rows, CLIPPED_KEY)
    if ratio is None or ratio <= THRESHOLD:
        return None
    limit = f"train.max_completion_length={max_completion_length}" if max_completion_length else "train.max_completion_length"
    bigger = f"train.max_completion_length={2 * max_completion_length}" if max_completion_length else "train.max_completion_length=<larger>"
    return (f"{ratio:.0%} of completions were cut off at {limit} (last {min(WINDOW, len(_values(rows, CLIPPED_KEY)))} "
            f"logged steps). A cut-off completion never closes its `<answer>` tag, so format and correctness rewards "
            f"stay at 0. Raise it (`--set {bigger}`) or prime the format first (`--set prime.steps=20`).")


def no_signal(rows: list[dict]) -> Optional[str]:
    """A warning when most recent groups had all-equal rewards (nothing for GRPO to compare), else None.
    It says which way they are equal when the correctness reward logged it (all right or all wrong)."""
    fraction = _recent_mean(rows, ZERO_STD_KEY)
    if fraction is None or fraction <= THRESHOLD:
        return None
    head = (f"{fraction:.0%} of groups scored all-equal rewards (TRL's frac_reward_zero_std): their advantages, and "
            f"so their gradients, are 0.")
    right, wrong = _recent_mean(rows, ALL_RIGHT_KEY), _recent_mean(rows, ALL_WRONG_KEY)
    if right is not None and wrong is not None and max(right, wrong) > 0:
        if right > wrong:
            return (f"{head} Most are all right ({right:.0%} of groups: every answer correct): the model already solves "
                    f"these questions, and only the other groups teach anything. Make the answers in a group differ: "
                    f"harder questions (your own --dataset, or --set data.max_operand=<larger> for the built-in "
                    f"problems), more generations per question (--set train.num_generations=<larger>) or a higher "
                    f"--set train.temperature.")
        return (f"{head} Most are all wrong ({wrong:.0%} of groups: no answer correct): there is nothing right to "
                f"reinforce. Bring right answers within reach: prime the format first (`--set prime.steps=20`), add "
                f"partial-credit rewards such as xmlcount and soft_format, or easier questions.")
    return (f"{head} Give the groups something to tell apart: if they are all wrong, prime the format first "
            f"(`--set prime.steps=20`) or add a partial-credit reward such as xmlcount; if they are all right, use "
            f"harder questions, raise train.num_generations or train.temperature.")


def moving_average(values: list[float], window: int = SMOOTHING) -> list[float]:
    """The trailing mean of the last `window` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def flat_reward(rows: list[dict]) -> Optional[str]:
    """A warning when the mean reward has not changed over the last FLAT_STEPS logged steps, else None."""
    rewards = _values(rows, REWARD_KEY)[-FLAT_STEPS:]
    if len(rewards) < FLAT_STEPS or max(rewards) - min(rewards) > FLAT_TOLERANCE:
        return None
    level = rewards[-1]
    hint = ("every completion scores 0: check the completions reach the answer format (see the truncation and "
            "all-equal-rewards warnings; priming helps)" if abs(level) <= FLAT_TOLERANCE else
            "raise train.learning_rate, train.num_generations or train.temperature, or check the rewards can tell answers apart")
    return f"the reward has stayed at {level:.3f} for the last {FLAT_STEPS} logged steps: {hint}."


def current(rows: list[dict], max_completion_length: Optional[int] = None) -> dict[str, str]:
    """Every check that holds on `rows` now: kind -> message."""
    found = {
        "truncated": truncation(rows, max_completion_length),
        "no_signal": no_signal(rows),
        "flat_reward": flat_reward(rows),
    }
    return {kind: message for kind, message in found.items() if message}


class SignalMonitor:
    """Feeds rows one at a time; returns each kind of warning the first time it holds."""

    def __init__(self, max_completion_length: Optional[int] = None):
        self.max_completion_length = max_completion_length
        self.rows: list[dict] = []
        self.raised: dict[str, Signal] = {}

    def add(self, row: dict) -> list[Signal]:
        self.rows.append(row)
        new = []
        for kind, message in current(self.rows, self.max_completion_length).items():
            if kind not in self.raised:
                self.raised[kind] = Signal(kind, int(row.get("step", len(self.rows))), message)
                new.append(self.raised[kind])
        return new


def scan(rows: Iterable[dict], max_completion_length: Optional[int] = None) -> list[Signal]:
    """The warnings a run raised, replayed over its whole log (what the live monitor printed)."""
    monitor = SignalMonitor(max_completion_length)
    for row in rows:
        monitor.add(row)
    return list(monitor.raised.values())
