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
- `all_wrong`: most groups were all wrong by correctness (`groups/all_wrong`) for a stretch of logged
  steps, whatever the other rewards did: correctness, the reward that says the answer is right, gave GRPO
  nothing to compare there. `all_wrong_stretches` finds those stretches; the report's plot draws the very
  series it looks at and shades the stretches it returns, so the warning and the plot cannot disagree.

`windowed` is the trailing mean the ratio checks compare to THRESHOLD (the plot draws it too).

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
# TRL 1.15's gap between the sampler and the trainer, logged where train.is_correction is on (every path that samples
# with log-probs: vLLM engines, our decode loop, transformers' generate when asked): |trainer - sampler| log-prob of
# each sampled token, its mean and max over the step's completion tokens (nats)
SAMPLER_GAP_KEY = "sampling/sampling_logp_difference/mean"
SAMPLER_GAP_MAX_KEY = "sampling/sampling_logp_difference/max"
SAMPLER_GAP_THRESHOLD = 0.1  # nats a token, mean: "large" (the progress line shows it, the report's plot draws it).
# Our CPU vLLM path measures 0.03-0.04 (docs/results.md); 0.1 a token is a ratio of e^0.1 per token, and TRL's
# sequence_mask drops a completion whose summed gap passes log(3) = 1.1
# The sampled tokens scored under the adapter and under the base model (the adapter disabled) on every generation path,
# every train.adapter_check_every GRPO steps (trl_compat.SampledTokenScores), whether or not the correction is on: the
# mean log-prob of a sampled token under the adapter minus under the base (nats). Sampled by the adapter, it averages
# KL(adapter || base) >= 0; by a sampler that skipped the adapter (unsloth #8701: fast_inference rollouts from the base
# model), -KL(base || adapter) <= 0. Where the sampler gives its log-probs, |sampler - base| beside |sampler - adapter|.
ADAPTER_VS_BASE_KEY = "sampling/adapter_minus_base_logp/mean"
SAMPLER_BASE_GAP_KEY = "sampling/sampling_base_logp_difference/mean"
ADAPTER_SKIPPED_KEY = "sampling/adapter_skipped"  # 1.0 on a judged step the guard flagged, 0.0 on one it did not
# training.adapter_check.AdapterGuard: from the GRPO step after ADAPTER_GUARD_AFTER optimizer steps (the adapter has
# moved the policy), a scored step whose rollouts are closer to the base than to the adapter by more than
# ADAPTER_GUARD_MARGIN nats a token is flagged (adapter_check.closer_to_base: the sampler's own log-probs' distance to
# each where it gives them, else the trainer's scores: log-prob under the base minus under the adapter)
ADAPTER_GUARD_AFTER = 2
ADAPTER_GUARD_MARGIN = 0.01  # nats a token
# ... and, judged by the trainer's scores alone, the batch's total log-likelihood ratio base / adapter above this
# (nats):
# a batch the adapter itself drew makes the base e^10 times likelier than the adapter with probability <= e^-10
# (Markov's inequality on the likelihood ratio, for a sampler that draws from the trainer's distribution)
ADAPTER_GUARD_LIKELIHOOD = 10.0
SMOOTHING = 10      # logged steps in the moving average of the reward (progress bar, reward plot)

WINDOW = 5          # logged steps averaged for the ratio checks: one odd step is not a pattern
MIN_ROWS = 2        # ... and at least this many, so the very first step alone never warns
THRESHOLD = 0.5     # "most": more than half of the completions / groups (all wrong: half or more)
STRETCH = 3         # logged steps in a row the averaged all-wrong share stays at/above THRESHOLD before it warns
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


def windowed(rows: list[dict], key: str) -> tuple[list[int], list[Optional[float]]]:
    """(steps, the trailing mean of the last WINDOW values at each step) over the rows where `key` has a number;
    None until MIN_ROWS values are in. What the ratio checks compare to THRESHOLD, and the line the report's plot
    draws against its threshold line."""
    pairs = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    steps, means = [], []
    for i, (step, _) in enumerate(pairs):
        recent = [value for _, value in pairs[max(0, i + 1 - WINDOW):i + 1]]
        steps.append(step)
        means.append(sum(recent) / len(recent) if len(recent) >= MIN_ROWS else None)
    return steps, means


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
    limit = (f"train.max_completion_length={max_completion_length}" if max_completion_length
             else "train.max_completion_length")
    bigger = (f"train.max_completion_length={2 * max_completion_length}" if max_completion_length
              else "train.max_completion_length=<larger>")
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
            return (f"{head} Most are all right ({right:.0%} of groups: every answer correct): the model already "
                    f"solves these questions, and only the other groups teach anything. Make the answers in a group "
                    f"differ: harder questions (your own --dataset, or --set data.max_operand=<larger> for the "
                    f"built-in problems), more generations per question (--set train.num_generations=<larger>) or a "
                    f"higher --set train.temperature.")
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
            "raise train.learning_rate, train.num_generations or train.temperature, or check the rewards can tell "
            "answers apart")
    return f"the reward has stayed at {level:.3f} for the last {FLAT_STEPS} logged steps: {hint}."


def all_wrong_stretches(rows: list[dict]) -> list[tuple[int, int]]:
    """(first step, last step) of each run of at least STRETCH logged steps in a row on which the all-wrong share
    (`groups/all_wrong`), averaged by `windowed`, is at or above THRESHOLD. The one definition of the stretches:
    the `all_wrong` warning holds exactly when there is one, and the report's plot shades these very stretches on
    the very line it draws against its threshold."""
    steps, means = windowed(rows, ALL_WRONG_KEY)
    stretches, run = [], []
    for step, mean in zip(steps + [None], means + [None]):  # a None at the end closes the last run
        if mean is not None and mean >= THRESHOLD:
            run.append(step)
            continue
        if len(run) >= STRETCH:
            stretches.append((run[0], run[-1]))
        run = []
    return stretches


def _steps_text(stretches: list[tuple[int, int]]) -> str:
    parts = [f"{a}-{b}" for a, b in stretches]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + f" and {parts[-1]}"


def all_wrong(rows: list[dict], max_completion_length: Optional[int] = None,
              config: Optional[dict] = None) -> Optional[str]:
    """A warning when most groups were all wrong by correctness for a stretch of steps (all_wrong_stretches),
    else None; what to do, in settings of this tool: prime (longer), easier questions, longer completions when
    most are cut off. `config`: the run's config.yaml mapping, for concrete values (the live monitor has none)."""
    stretches = all_wrong_stretches(rows)
    if not stretches:
        return None
    config = config or {}
    steps, means = windowed(rows, ALL_WRONG_KEY)
    inside = sum(1 for step in steps if any(a <= step <= b for a, b in stretches))
    peak = max(m for step, m in zip(steps, means) if m is not None and any(a <= step <= b for a, b in stretches))
    head = (f"most groups were all wrong by correctness (no completion of the group right): the share of such groups "
            f"(`{ALL_WRONG_KEY}`, mean of the last {WINDOW} logged steps) was at or above {THRESHOLD} on steps "
            f"{_steps_text(stretches)} ({inside} of {len(steps)} logged steps, up to {peak:.0%}). There, correctness "
            f"gave GRPO nothing to compare: what it learned there came from the other rewards (format, length), not "
            f"from right answers.")
    prime_steps = (config.get("prime") or {}).get("steps")
    if isinstance(prime_steps, int) and prime_steps > 0:
        prime = f"prime longer (`--set prime.steps={2 * prime_steps}`; this run primed {prime_steps} steps)"
    elif prime_steps == 0:
        prime = "prime the format and the answers first (`--set prime.steps=20`; this run did not prime)"
    else:
        prime = "prime first, or longer (`--set prime.steps=N`, e.g. 20)"
    data = config.get("data") or {}
    if data and data.get("dataset") is None and isinstance(data.get("max_operand"), int):
        easier = (f"easier questions (`--set data.max_operand={max(2, data['max_operand'] // 2)}` for the built-in "
                  f"problems, or an easier --dataset)")
    else:
        easier = "easier questions (an easier --dataset, or --set data.max_operand=<smaller> for the built-in problems)"
    actions = [prime, easier]
    clipped = _recent_mean(rows, CLIPPED_KEY)
    if clipped is not None and clipped > THRESHOLD:
        longer = (f"`--set train.max_completion_length={2 * max_completion_length}`" if max_completion_length
                  else "a larger train.max_completion_length")
        actions.append(f"room to finish the answer: {clipped:.0%} of the recent completions were cut off, {longer}")
    return f"{head} Bring right answers within reach: {'; '.join(actions)}."


def current(rows: list[dict], max_completion_length: Optional[int] = None,
            config: Optional[dict] = None) -> dict[str, str]:
    """Every check that holds on `rows` now: kind -> message."""
    found = {
        "truncated": truncation(rows, max_completion_length),
        "no_signal": no_signal(rows),
        "all_wrong": all_wrong(rows, max_completion_length, config),
        "flat_reward": flat_reward(rows),
    }
    return {kind: message for kind, message in found.items() if message}


class SignalMonitor:
    """Feeds rows one at a time; returns each kind of warning the first time it holds. `config`: the run's
    config.yaml mapping when known (concrete values in the advice)."""

    def __init__(self, max_completion_length: Optional[int] = None, config: Optional[dict] = None):
        self.max_completion_length = max_completion_length
        self.config = config
        self.rows: list[dict] = []
        self.raised: dict[str, Signal] = {}

    def add(self, row: dict) -> list[Signal]:
        self.rows.append(row)
        new = []
        for kind, message in current(self.rows, self.max_completion_length, self.config).items():
            if kind not in self.raised:
                self.raised[kind] = Signal(kind, int(row.get("step", len(self.rows))), message)
                new.append(self.raised[kind])
        return new


def scan(rows: Iterable[dict], max_completion_length: Optional[int] = None,
         config: Optional[dict] = None) -> list[Signal]:
    """The warnings a run raised, replayed over its whole log (what the live monitor printed); the all_wrong
    warning is the whole log's: from its first stretch's first step, every stretch in its message."""
    rows = list(rows)
    monitor = SignalMonitor(max_completion_length, config)
    for row in rows:
        monitor.add(row)
    found = list(monitor.raised.values())
    stretches = all_wrong_stretches(rows)
    return [Signal(s.kind, stretches[0][0], all_wrong(rows, max_completion_length, config)) if s.kind == "all_wrong"
            else s for s in found]
