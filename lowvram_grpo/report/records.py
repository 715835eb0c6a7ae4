"""What a run's records hold and how the report reads them back: the held-out curve (PREFIX, `criterion`, `curve`,
`best_point`) read from `curve_rows`, its step 0 (curve_start.json: the adapter GRPO starts from) before metrics.jsonl's
GRPO steps, the steps completions.jsonl is shown for (`steps_to_show`, PREVIEW_CHARS) and the tool transcript's key.
Pure functions of the rows; training writes the rows (training/validation.py, completions.py, tool_metrics.py) and
reads the same functions from here."""
from __future__ import annotations

from typing import Optional

PREFIX = "validation/"
CRITERIA = (f"{PREFIX}accuracy_strict", f"{PREFIX}reward_mean")  # the first the curve has decides the best

START_STEP = 0  # the curve's first point: the adapter GRPO starts from, measured before GRPO's step 1
START_KEY = "start"  # in curve_start.json: what step 0 measured ('primed', 'init_adapter' or 'base')
STARTS = {"primed": "the primed adapter", "init_adapter": "the adapter the run started from (lora.init_adapter)",
          "base": "the base model (a fresh LoRA)"}

PREVIEW_CHARS = 1500  # report/build.py: longer completions are shown cut to this
TRANSCRIPT_KEY = "tools/transcript"


def curve_rows(start: Optional[dict], rows: list[dict]) -> list[dict]:
    """The rows the held-out curve is read from.

    Args:
        start: curve_start.json (RunDir.read_curve_start): the step-0 point, or None when it was not measured.
        rows: metrics.jsonl's rows, GRPO steps 1..max_steps.

    Returns:
        The step-0 point (as a row of step START_STEP) first, then `rows`.
    """
    return ([{**start, "step": START_STEP}] if start else []) + list(rows)


def start_text(start: Optional[dict]) -> str:
    """What the curve's step 0 is, in words ('the primed adapter'); 'the adapter GRPO starts from' when unknown."""
    return STARTS.get((start or {}).get(START_KEY), "the adapter GRPO starts from")


def criterion(rows: list[dict]) -> Optional[str]:
    """The metrics key the best is chosen by: the first of CRITERIA some row has; None without a curve."""
    for key in CRITERIA:
        if any(isinstance(row.get(key), (int, float)) for row in rows):
            return key
    return None


def curve(rows: list[dict], key: Optional[str] = None) -> list[tuple[int, float]]:
    """[(step, value)] of the curve in `rows` (curve_rows: step 0 first where it was measured), by `key` (default:
    `criterion`)."""
    key = key or criterion(rows)
    return [(row["step"], row[key]) for row in rows if key and isinstance(row.get(key), (int, float))]


def best_point(rows: list[dict]) -> Optional[dict]:
    """{'step', 'criterion', 'value'}: the curve's argmax in `rows` (curve_rows: step 0, the adapter GRPO starts from,
    is a point like the others), the earliest step among equals; None without a curve."""
    key = criterion(rows)
    points = curve(rows, key)
    if not points:
        return None
    step, value = max(points, key=lambda point: (point[1], -point[0]))
    return {"step": step, "criterion": key, "value": value}


def steps_to_show(rows: list[dict]) -> list[tuple[str, int]]:
    """[('latest', step), ('worst reward', step)] among the written steps (the worst: the lowest mean `reward`; one
    entry when it is the latest too); [] without rows."""
    if not rows:
        return []
    means: dict[int, list[float]] = {}
    for row in rows:
        means.setdefault(row["step"], [])
        if isinstance(row.get("reward"), (int, float)):
            means[row["step"]].append(row["reward"])
    latest = max(means)
    scored = {step: sum(v) / len(v) for step, v in means.items() if v}
    shown = [("latest", latest)]
    if scored:
        worst = min(scored, key=lambda s: (scored[s], s))
        if worst != latest:
            shown.append(("worst reward", worst))
    return shown
