"""The run report: `report.md` and PNG plots in a run's output dir, from what the run wrote.

Every run writes it at the end (pipeline.run); `python -m lowvram_grpo.report RUN_DIR` rebuilds it
from `metrics.jsonl`, `summary.json` and `config.yaml`. It holds:

- plots per GRPO step: reward (total, per step under its moving average, and per reward function), KL,
  completion length, the share of completions cut at `max_completion_length` (with the share of groups
  whose rewards were all equal, and of groups all right / all wrong), loss (captioned when train.beta = 0:
  ~0 by construction). Each series a warning checks is drawn as the warning reads it (signals.windowed), its
  threshold dashed in the line's own colour and named in the legend, and the steps the all-wrong warning held
  on (signals.all_wrong_stretches, the very function the warning uses) shaded; legends sit under the axes;
- the before/(primed/)after table on the held-out questions, with the paired changes summary.json stores
  (`paired_changes`, computed once when the run finishes), and what GRPO changed: how many held-out questions
  it turned right and wrong, with one of each (`what_changed`; the first questions for older summaries);
- after beside each control the run was measured against (summary.json `controls`, baseline.py: the random-reward
  control, the prime-only baseline), paired, with one line saying what the run added beyond it;
- the training-signal warnings (learning_signals.py), replayed over the whole log;
- the held-out curve during GRPO (validation.py: `validation/*` in metrics.jsonl, from step 0, the adapter GRPO starts
  from, in curve_start.json), drawn to scale (accuracies on 0..1, a mean reward on an axis through 0), its best step
  and best_adapter/ (step 0 where GRPO never beat its start), and on the held-out questions the best adapter against the
  last (`best`, `paired_changes_best`);
- what the model wrote (completions.jsonl, completions.py): for the latest written step and the worst-reward one, a
  few completions with each reward's score, the advantage and whether they were cut off.

The plots use matplotlib's object API (no pyplot), so writing them never changes the backend of the
process that calls this (a notebook keeps its inline plots).
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Callable, Optional

from lowvram_grpo.evaluate.evaluation import beyond_line, interval_notes, metric_rows, pair_notes, protocol_lines
from lowvram_grpo.report.run_dir import (  # noqa: F401  (PLOT_FILES: the plots below, named where a run's files are)
    PLOT_FILES,
    RunDir,
)
from lowvram_grpo.core.commands import ArgumentParser, guarded
from lowvram_grpo.core.errors import RunDirError
from lowvram_grpo.task.data import prompt_text
from lowvram_grpo.report.peak_memory import describe as describe_peak
from lowvram_grpo.report.learning_signals import (
    ADAPTER_GUARD_AFTER,
    ADAPTER_GUARD_MARGIN,
    ADAPTER_SKIPPED_KEY,
    ADAPTER_VS_BASE_KEY,
    ALL_RIGHT_KEY,
    ALL_WRONG_KEY,
    CLIPPED_KEY,
    SAMPLER_BASE_GAP_KEY,
    SAMPLER_GAP_KEY,
    SAMPLER_GAP_MAX_KEY,
    SAMPLER_GAP_THRESHOLD,
    SMOOTHING,
    STRETCH,
    THRESHOLD,
    WINDOW,
    ZERO_STD_KEY,
    Signal,
    all_wrong_stretches,
    moving_average,
    scan,
    windowed,
)
from lowvram_grpo.report.records import (PREVIEW_CHARS, PREFIX, TRANSCRIPT_KEY, best_point, criterion, curve,
                                         curve_rows, start_text, steps_to_show)


# ----------------------------------------------------------------------------- plots
def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` has a number; metrics.jsonl writes non-finite values as null."""
    pairs = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def line_figure(title: str, ylabel: str, lines: list[tuple[str, str]], rows: list[dict],
                hline: Optional[tuple[float, str, str]] = None, ylim: Optional[tuple[float, float]] = None,
                smooth: Optional[str] = None, checked: Optional[dict[str, str]] = None,
                shade: Optional[tuple[list[tuple[int, int]], str, str]] = None, caption: Optional[str] = None,
                xlabel: str = "GRPO step"):
    """One plot (a matplotlib Figure): each (label, metric key) as a line over GRPO steps, each in its own colour.
    None if no line has data. `smooth`: a key whose raw line is drawn thin and pale under its moving average
    (signals.moving_average). `checked`: key -> the legend name of its warning's threshold: the line is drawn as
    the warning reads it (signals.windowed, the raw steps pale beneath) with the threshold in the line's own
    colour. `shade`: (stretches, key, label): the steps a warning held on, shaded in that key's colour. `hline`: a
    limit (value, label, key) drawn in the colour of `key`'s line. `caption`: a note above the plot. `xlabel`: the
    x-axis's name. The legend goes under the axes, clear of the title and of the lines."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    checked = checked or {}
    drawn = [(label, *_series(rows, key), key) for label, key in lines]
    drawn = [d for d in drawn if d[1]]
    if not drawn:
        return None
    fig = Figure(figsize=(8.5, 4.6 + 0.25 * len(checked)), dpi=110, layout="constrained")
    ax = fig.subplots()
    colours = {key: f"C{i}" for i, (_, _, _, key) in enumerate(drawn)}
    # thresholds at the same height: each colour's dashes take their turn along the line
    dashes = [(0, (5, 3))] if len(checked) <= 1 else [(5 * i, (5, 5 * (len(checked) - 1))) for i in range(len(checked))]
    for label, steps, values, key in drawn:
        colour = colours[key]
        if key == smooth:
            ax.plot(steps, values, label=f"{label}, per step", linewidth=1.0, color="black", alpha=0.3, zorder=2)
            ax.plot(steps, moving_average(values), label=f"{label}, moving average of {SMOOTHING} steps",
                    linewidth=2.6, color="black", zorder=3)
            continue
        if key in checked:
            ax.plot(steps, values, linewidth=0.8, color=colour, alpha=0.3, zorder=2)
            w_steps, means = windowed(rows, key)
            ax.plot(w_steps, [m if m is not None else float("nan") for m in means], color=colour, linewidth=1.8,
                    label=f"{label}, mean of last {WINDOW} steps", zorder=3)
            ax.axhline(THRESHOLD, color=colour, linestyle=dashes[list(checked).index(key)], linewidth=1.3,
                       label=checked[key], zorder=1)
            continue
        ax.plot(steps, values, label=label, color=colour, marker="o" if len(steps) <= 30 else None, markersize=3.5,
                linewidth=1.4)
    if shade is not None and shade[0]:
        stretches, key, label = shade
        for i, (first, last) in enumerate(stretches):
            ax.axvspan(first - 0.5, last + 0.5, color=colours.get(key, "grey"), alpha=0.12, linewidth=0,
                       label=label if i == 0 else None, zorder=0)
    if hline is not None:
        value, label, key = hline
        ax.axhline(value, color=colours.get(key, "black"), linestyle="--", linewidth=1, label=label)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title, pad=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(drawn) > 1 or hline is not None or checked:
        fig.legend(fontsize=8, loc="outside lower center", ncols=2, frameon=False)  # under the axes: over nothing
    if caption:
        fig.suptitle("\n".join(textwrap.wrap(caption, 120)), fontsize=8.5, style="italic", color="dimgray")
    return fig


def _line_plot(path: Path, **spec) -> bool:
    """line_figure(**spec) written to `path` as a PNG; False (nothing written) when no line has data."""
    fig = line_figure(**spec)
    if fig is None:
        return False
    fig.savefig(path)
    return True


BETA_ZERO_LOSS = ("train.beta = 0: TRL's GRPO loss is ~0 by construction (group-normalised advantages sum to 0 over "
                  "each group, and no KL term is added), so a loss near 0 is expected and says nothing about learning: "
                  "the reward plot shows progress.")


def reward_keys(rows: list[dict], config: dict) -> list[str]:
    """Per-reward-function keys TRL logs (`rewards/<name>/mean`), in the config's order where known."""
    logged = {key for row in rows for key in row if key.startswith("rewards/") and key.endswith("/mean")}
    ordered = [f"rewards/{name}/mean" for name in (config.get("rewards") or {}).get("names", [])]
    return [k for k in ordered if k in logged] + sorted(logged - set(ordered))


def through_zero(values: list[float]) -> Optional[tuple[float, float]]:
    """A y-axis that holds `values` and 0, with a little room at each end (None without values): a curve drawn to
    scale, so a small change does not read as a cliff."""
    if not values:
        return None
    low, high = min(0.0, min(values)), max(0.0, max(values))
    room = 0.03 * ((high - low) or 1.0)
    return low - room, high + room


def plot_specs(rows: list[dict], config: dict, start: Optional[dict] = None) -> dict[str, dict]:
    """Plot name -> line_figure's arguments (without `rows`), for the plots of a run's metric rows.

    Args:
        rows: metrics.jsonl's rows.
        config: config.yaml as a mapping.
        start: curve_start.json (the held-out curve's step 0), or None: the validation plot is drawn from
            records.curve_rows(start, rows) (write_plots).

    Returns:
        {plot name: line_figure's keyword arguments}.
    """
    max_len = (config.get("train") or {}).get("max_completion_length")
    per_reward = [(key.split("/")[1], key) for key in reward_keys(rows, config)]
    plots = {
        "reward": dict(title="Reward per step (total = weighted sum of the reward functions)",
                       ylabel="mean reward over the step's completions",
                       lines=[("total (weighted)", "reward")] + per_reward, smooth="reward"),
        "kl": dict(title="KL divergence from the base model", ylabel="KL (per token, mean)", lines=[("KL", "kl")]),
        "completion_length": dict(
            title="Completion length", ylabel="tokens",
            lines=[("mean", "completions/mean_length"), ("min", "completions/min_length"),
                   ("max", "completions/max_length")],
            hline=(max_len, f"max_completion_length = {max_len}", "completions/max_length") if max_len else None),
        "clipped_ratio": dict(
            title="Cut-off completions and groups without signal", ylabel="fraction",
            lines=[("completions cut at max_completion_length", CLIPPED_KEY),
                   ("groups with all-equal rewards", ZERO_STD_KEY),
                   ("groups all right (correctness)", ALL_RIGHT_KEY),
                   ("groups all wrong (correctness)", ALL_WRONG_KEY)],
            checked={CLIPPED_KEY: f"truncation warning threshold {THRESHOLD} (above it)",
                     ZERO_STD_KEY: f"all-equal warning threshold {THRESHOLD} (above it)",
                     ALL_WRONG_KEY: f"all-wrong warning threshold {THRESHOLD}"},
            shade=(all_wrong_stretches(rows), ALL_WRONG_KEY,
                   f"all-wrong warning: at/above {THRESHOLD}, {STRETCH}+ steps in a row"),
            ylim=(-0.03, 1.03)),
        "sampler_gap": dict(
            title="Sampler vs trainer: |trainer - sampler| log-prob of each sampled token",
            ylabel="nats per token", lines=[("mean", SAMPLER_GAP_KEY), ("max", SAMPLER_GAP_MAX_KEY)],
            hline=(SAMPLER_GAP_THRESHOLD, f"large above {SAMPLER_GAP_THRESHOLD} (mean; the progress line shows it)",
                   SAMPLER_GAP_KEY)),
        "loss": dict(title="GRPO loss", ylabel="loss", lines=[("loss", "loss")],
                     caption=BETA_ZERO_LOSS if (config.get("train") or {}).get("beta") == 0 else None),
        "validation": validation_spec(curve_rows(start, rows), start),
    }
    return plots


def validation_spec(rows: list[dict], start: Optional[dict]) -> dict:
    """line_figure's arguments (without `rows`) for the held-out curve, drawn from `rows` (records.curve_rows: step 0
    first): accuracies on their whole scale 0..1, a mean reward on an axis through 0, so the start and the later points
    are drawn to scale and a two-question change reads as what it is, not a cliff.

    Args:
        rows: the curve's rows (step 0, then metrics.jsonl's).
        start: curve_start.json, or None (the x-axis then names no step 0).

    Returns:
        line_figure's keyword arguments.
    """
    reward = criterion(rows) == f"{PREFIX}reward_mean"
    return dict(title="Held-out curve: the adapter during GRPO on the validation questions (greedy)",
                ylabel="mean reward" if reward else "accuracy",
                lines=([("reward_mean", f"{PREFIX}reward_mean")] if reward
                       else [("strict accuracy", f"{PREFIX}accuracy_strict"),
                             ("lenient accuracy", f"{PREFIX}accuracy_lenient")]),
                ylim=through_zero([v for _, v in curve(rows)]) if reward else (-0.03, 1.03),
                xlabel=f"GRPO step (step 0: {start_text(start)}, before GRPO)" if start else "GRPO step")


def write_plots(run_dir: Path, rows: list[dict], config: dict,
                start: Optional[dict] = None) -> dict[str, Optional[str]]:
    """Write the PNGs.

    Args:
        run_dir: where they go.
        rows: metrics.jsonl's rows.
        config: config.yaml as a mapping.
        start: curve_start.json (the held-out curve's step 0), or None.

    Returns:
        plot name -> file name (None where the run logged no such metric).
    """
    written = {}
    for name, spec in plot_specs(rows, config, start).items():
        file_name = f"{name}.png"
        drawn = curve_rows(start, rows) if name == "validation" else rows  # the curve from its step 0
        written[name] = file_name if _line_plot(run_dir / file_name, rows=drawn, **spec) else None
    return written


# ----------------------------------------------------------------------------- markdown
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _printable(text: str) -> str:
    """Sampled text as it can be shown: control characters (random models emit them) as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _fenced(text: str) -> str:
    fence = "~~~~" if "~~~" in text else "~~~"
    return f"{fence}\n{_printable(text).strip() or '(empty)'}\n{fence}"


def comparison_table(summary: dict) -> str:
    """The held-out before/(primed/)after table in markdown, accuracies with their 95% Wilson intervals,
    and the protocol the numbers were measured with (greedy by default)."""
    before, primed, after = summary.get("before"), summary.get("primed"), summary.get("after")
    if not (before and after):
        return "No before/after numbers: evaluation was off for this run (`eval.enabled`)."
    names = ["before (base)"] + (["primed"] if primed else []) + ["after (GRPO)", "change"]
    lines = ["| held-out metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, cells, ends in metric_rows([before] + ([primed] if primed else []) + [after]):
        change = f"{ends[1] - ends[0]:+.3f}" if ends else "-"
        lines.append(f"| {label} | " + " | ".join(cells + [change]) + " |")
    protocol = " ".join(protocol_lines([before] + ([primed] if primed else []) + [after]))
    note = (f"\n\n{after.get('n', '?')} held-out questions, the same prompts for every column; {protocol}; "
            "[95% Wilson interval]. Strict: the answer inside `<answer>...</answer>` is right; lenient: the answer "
            "the text states, in any format, is right.")
    if primed:
        note += (" GRPO's own change in reward_mean (primed -> after): "
                 f"{after['reward_mean'] - primed['reward_mean']:+.3f}.")
    notes = interval_notes(before, after, primed,
                           summary.get("paired_changes"))  # as stored: computed once, in finish()
    return "\n".join(lines) + note + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")


def controls_section(summary: dict) -> str:
    """After vs each control the run was measured against (summary.json `controls`, written by baseline.py: the
    random-reward control, the prime-only baseline): the table, the paired notes, and one line saying what the
    run added beyond it."""
    after = summary.get("after")
    parts = []
    for name, entry in (summary.get("controls") or {}).items():
        control = entry.get("numbers")
        if not (after and control):
            continue
        label = entry.get("label", name)
        lines = [f"### {label}", "", f"{entry.get('about', '')} Definition: {entry.get('definition', '-')}", "",
                 f"| held-out metric | {label} | after (GRPO) | after - control |", "|---|---|---|---|"]
        for metric, cells, ends in metric_rows([control, after]):
            lines.append(f"| {metric} | " + " | ".join(cells) + f" | {f'{ends[1] - ends[0]:+.3f}' if ends else '-'} |")
        lines += ["", " ".join(protocol_lines([control, after])) + "."]
        lines += [f"- {note}" for note in pair_notes([(label, control, "after", after)])]
        lines += ["", f"**{beyond_line(entry.get('headline', f'After vs the {label}'), control, after)}**"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- what changed, one of each
STAGE_NAMES = {"before": "base model", "primed": "primed adapter", "after": "after GRPO"}


def what_changed(questions: list[str], golds: list, texts: dict[str, list[str]],
                 measured: dict[str, Optional[dict]], judge: str = "strict") -> Optional[dict]:
    """The samples a run shows at its end, chosen to show what GRPO changed, honestly: the counts of held-out
    questions GRPO turned right and turned wrong (from the per-question verdicts `strict_correct`; against the
    primed adapter when priming ran, else the base model), and one example of each, the first in question order;
    where none is of a kind, the first question not shown yet stands in, labelled so. None without verdicts
    (evaluation off, data without gold answers)."""
    start = "primed" if measured.get("primed") else "before"
    key = f"{judge}_correct"
    first, last = (measured.get(start) or {}).get(key), (measured.get("after") or {}).get(key)
    if not first or not last or len(first) != len(last) or len(first) != len(questions):
        return None
    right = [i for i, (a, b) in enumerate(zip(first, last)) if not a and b]
    wrong = [i for i, (a, b) in enumerate(zip(first, last)) if a and not b]
    shown = {found[0] for found in (right, wrong) if found}
    rest = [i for i in range(len(questions)) if i not in shown]  # stand-ins, in question order
    picked: list[tuple[int, str]] = []
    for found, kind in ((right, "turned right"), (wrong, "turned wrong")):
        if found:
            picked.append((found[0], kind))
        elif rest:
            picked.append((rest.pop(0), f"none {kind}; the first question not shown instead"))
    stages = [s for s in ("before", "primed", "after") if measured.get(s)]

    def text(stage: str, i: int) -> Optional[str]:
        kept = texts.get(stage) or []
        return kept[i] if i < len(kept) else None  # a resumed run keeps the verdicts, not the primed texts

    examples = [{"index": i, "kind": kind, "question": questions[i], "answer": golds[i],
                 "correct": {s: measured[s].get(key, [None] * len(questions))[i] for s in stages},
                 "texts": {s: text(s, i) for s in stages}} for i, kind in picked]
    return {"judge": judge, "start": start, "turned_right": len(right), "turned_wrong": len(wrong),
            "n": len(questions), "examples": examples}


def changed_headline(changed: dict) -> str:
    """'GRPO turned 17 right and 6 wrong of 200 held-out questions (strict, primed -> after); one of each:'."""
    counts = (f"GRPO turned {changed['turned_right']} right and {changed['turned_wrong']} wrong of {changed['n']} "
              f"held-out questions ({changed['judge']}, {changed['start']} -> after)")
    if changed["turned_right"] and changed["turned_wrong"]:
        return counts + "; one of each:"
    if not (changed["turned_right"] or changed["turned_wrong"]):
        return counts + "; none changed, so the first questions instead:"
    return counts + "; the one kind there is, and the first question not shown yet for the other:"


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def _verdict(value) -> str:
    return {1: "right", 0: "wrong"}.get(value, "?")


def changed_lines(changed: dict) -> list[str]:
    """What a run prints at its end: the headline and, per example, the start and after answers."""
    lines = [changed_headline(changed)]
    for example in changed["examples"]:
        lines.append(f"\n[{example['kind']}] Q: {example['question']}  (gold: {example['answer']})")
        for stage in (changed["start"], "after"):
            kept = example["texts"].get(stage)
            lines.append(f"--- {STAGE_NAMES[stage]} ({_verdict(example['correct'].get(stage))}) ---\n"
                         + (kept.strip() if kept is not None else "(text not kept: the run was resumed)"))
    return lines


def samples_section(summary: dict) -> str:
    changed = summary.get("what_changed")
    if changed:
        parts = [changed_headline(changed)]
        for example in changed["examples"]:
            answers = [f"{_upper_first(STAGE_NAMES[stage])} ({_verdict(example['correct'].get(stage))}):\n\n"
                       + (_fenced(text) if text is not None else "(text not kept: the run was resumed)")
                       for stage, text in example["texts"].items()]
            parts.append(f"**{_upper_first(example['kind'])}: question {example['index'] + 1}:** "
                         f"{_printable(example['question'])}  \n**Gold answer:** {example['answer']}\n\n"
                         + "\n\n".join(answers))
        return "\n\n".join(parts)
    samples = summary.get("samples") or []  # a run without verdicts, or a summary written before what_changed
    if not samples:
        return "No sample answers (evaluation was off)."
    parts = []
    for i, sample in enumerate(samples, start=1):
        parts.append(f"**Question {i}:** {_printable(sample['question'])}  \n**Gold answer:** {sample['answer']}\n\n"
                     f"Base model:\n\n{_fenced(sample['base'])}\n\nTrained adapter:\n\n{_fenced(sample['trained'])}")
    return "\n\n".join(parts)


def first_last_table(rows: list[dict], keys: tuple, title: str, number: str) -> list[str]:
    """A markdown table's lines: for each (metrics key, label) of `keys`, the mean over the first and over the last
    steps of `rows` (up to 10 each, half the rows at most), formatted as `number` ('.3f'); '-' where none logged it."""
    window = max(1, min(10, len(rows) // 2))

    def mean(part: list[dict], key: str) -> str:
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return f"{sum(values) / len(values):{number}}" if values else "-"

    lines = [f"| {title} | first {window} steps | last {window} steps |", "|---|---|---|"]
    return lines + [f"| {label} | {mean(rows[:window], key)} | {mean(rows[-window:], key)} |" for key, label in keys]


TOOL_ROWS = (("tools/call_frequency", "tool calls per completion (parsed, TRL's count)"),
             ("tools/written_per_completion", "<tool_call> blocks written per completion"),
             ("tools/parsed_share", "share of written calls TRL parsed"),
             ("tools/ran_share", "share of run calls that answered without an error or timeout"),
             ("tools/completions_with_calls", "completions with at least one call"))


def tools_section(rows: list[dict]) -> Optional[str]:
    """Tool use over training (tool_metrics.py): the first and the last steps' means, and the newest transcript;
    None when the run had no tools."""

    if not any("tools/call_frequency" in r or TRANSCRIPT_KEY in r for r in rows):
        return None
    lines = first_last_table(rows, TOOL_ROWS, "over training", ".3f")
    transcripts = [(r["step"], r[TRANSCRIPT_KEY]) for r in rows if isinstance(r.get(TRANSCRIPT_KEY), str)]
    if transcripts:
        step, text = transcripts[-1]
        lines += ["", f"A sampled completion at step {step} (one per checkpoint in `metrics.jsonl`, "
                      f"`{TRANSCRIPT_KEY}`):",
                  "", _fenced(text)]
    return "\n".join(lines)


# TRL 1.15's (and unsloth's) metrics of the importance-sampling correction (train.is_correction): the trainer's
# log-probs of the sampled tokens minus the sampler's (a vLLM engine, our decode loop, transformers' generate), and the
# ratios the loss was weighted by.
SAMPLING_ROWS = (("sampling/sampling_logp_difference/mean", "abs(trainer - sampler) log-prob of a token, mean (nats)"),
                 ("sampling/sampling_logp_difference/max", "the same, largest"),
                 ("sampling/importance_sampling_ratio/min", "importance-sampling ratio, smallest"),
                 ("sampling/importance_sampling_ratio/mean", "importance-sampling ratio, mean"),
                 ("sampling/importance_sampling_ratio/max", "importance-sampling ratio, largest"))


def sampling_section(rows: list[dict]) -> Optional[str]:
    """Sampler against trainer (train.is_correction on): the first and the last steps' means of the sampling/*
    metrics in metrics.jsonl, the whole run's mean and largest gap against SAMPLER_GAP_THRESHOLD; None when the run
    logged none (the correction off)."""
    if not any(key in r for r in rows for key, _ in SAMPLING_ROWS):
        return None
    lines = first_last_table(rows, SAMPLING_ROWS, "sampler vs the trainer", ".4f")
    means = [r[SAMPLER_GAP_KEY] for r in rows if isinstance(r.get(SAMPLER_GAP_KEY), (int, float))]
    peaks = [r[SAMPLER_GAP_MAX_KEY] for r in rows if isinstance(r.get(SAMPLER_GAP_MAX_KEY), (int, float))]
    if means:
        large = sum(1 for m in means if m > SAMPLER_GAP_THRESHOLD)
        lines += ["", f"The gap over the run: {sum(means) / len(means):.2e} nats a token on average per step (largest "
                  f"step mean {max(means):.2e}; largest single token {max(peaks) if peaks else float('nan'):.2e}); "
                  f"{large} of {len(means)} logged steps above the threshold {SAMPLER_GAP_THRESHOLD} (large: the "
                  "progress line says so)."]
    lines += ["", "The correction (train.is_correction) re-weights the loss by these ratios; in its default mode "
              "(sequence_mask) a completion whose ratio is above the cap (3) is left out of the loss."]
    return "\n".join(lines)


def adapter_section(rows: list[dict]) -> Optional[str]:
    """The rollouts against the adapter and the base (train.adapter_check_every; training/adapter_check.py): per scored
    step, the sampled tokens' mean log-prob under the adapter minus under the base and, where the sampler gave its
    log-probs, its distance to each; the steps the guard flagged (closer to the base by more than the margin), said
    first. None when the run scored none."""
    scored = [r for r in rows if isinstance(r.get(ADAPTER_VS_BASE_KEY), (int, float))]
    if not scored:
        return None
    flagged = [r["step"] for r in rows if r.get(ADAPTER_SKIPPED_KEY) == 1.0]
    judged = sum(1 for r in rows if r.get(ADAPTER_SKIPPED_KEY) is not None)
    if flagged:
        head = (f"**The rollouts of {len(flagged)} of {judged} judged steps (steps {_steps_text(flagged)}) were "
                f"closer to the base model than to the adapter being trained** (by more than {ADAPTER_GUARD_MARGIN:g} "
                "nats a token): the sampler looks to be ignoring the adapter, most likely a LoRA sync (a vLLM engine's "
                "adapter update, unsloth's load_lora, the decode loop's merge) that does not reach it, as in unsloth "
                "#8701. The trained adapter may be fine; the rollouts GRPO learned from were not its own.")
    else:
        head = (f"The rollouts of every judged step ({judged}, from step {ADAPTER_GUARD_AFTER + 1}) came from the "
                "adapter being trained, not the base model." if judged else
                f"No step judged yet (the guard judges from GRPO step {ADAPTER_GUARD_AFTER + 1}).")
    keys = [(ADAPTER_VS_BASE_KEY,
             "log-prob under the adapter - under the base, mean (nats; > 0: the adapter's tokens)")]
    if any(isinstance(r.get(SAMPLER_BASE_GAP_KEY), (int, float)) for r in scored):  # the sampler gave its log-probs
        keys += [(SAMPLER_GAP_KEY, "abs(sampler - adapter) log-prob, mean (nats)"),
                 (SAMPLER_BASE_GAP_KEY, "abs(sampler - base) log-prob, mean (nats)")]
    return "\n".join([head, "", *first_last_table(scored, tuple(keys), "sampled tokens, scored steps", ".4f")])


def _steps_text(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps[:10]) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")


COMPLETIONS_SHOWN = 3  # completions shown for each step the section shows


def _score(value) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.3f}"


def completions_section(rows: Optional[list[dict]], run_dir: Path) -> str:
    """What the model wrote (completions.jsonl, completions.py): for the latest written step and the one with the lowest
    mean reward, its first COMPLETIONS_SHOWN completions with each reward function's score, the total, the advantage,
    whether it was cut off, and its tool calls."""
    if not rows:
        return ("None written (`completions.jsonl`: log.completions_every = 0, or the run stopped before its first "
                "logged step).")
    prompts = {row["prompt_id"]: row["prompt"] for row in rows if row.get("prompt") is not None}
    parts = [f"From `completions.jsonl` ({len(rows)} completions of {len({r['step'] for r in rows})} steps; each row "
             f"has the prompt, the completion, every reward and the advantage)."]
    for label, step in steps_to_show(rows):
        shown = [row for row in rows if row["step"] == step]
        scored = [row["reward"] for row in shown if isinstance(row.get("reward"), (int, float))]
        mean = (f"mean reward {sum(scored) / len(scored):.3f} over the {len(shown)} completions kept" if scored
                else "no reward")
        parts.append(f"### Step {step} ({label}; {mean})")
        group = None
        for row in shown[:COMPLETIONS_SHOWN]:
            lines = []
            if row["group"] != group:  # the prompt once per group
                group = row["group"]
                prompt = prompts.get(row["prompt_id"])
                question = prompt_text(prompt) if prompt is not None else f"prompt {row['prompt_id']}"
                lines.append(f"**Group {group}:** {_printable(question)}"
                             + (f"  \n**Gold answer:** {row['answer']}" if row.get("answer") is not None else ""))
            scores = ", ".join(f"{name} {_score(value)}" for name, value in (row.get("rewards") or {}).items())
            cut = {True: "cut at max_completion_length", False: "ended", None: "end unknown"}[row.get("truncated")]
            text = row.get("completion") or ""
            if len(text) > PREVIEW_CHARS:
                text = text[:PREVIEW_CHARS] + f" [... {len(text) - PREVIEW_CHARS} more characters in completions.jsonl]"
            lines += [f"reward {_score(row.get('reward'))} ({scores}); advantage {_score(row.get('advantage'))}; {cut}",
                      "", _fenced(text)]
            for call in row.get("tool_calls") or []:
                lines.append(f"- tool call `{call.get('name')}({call.get('arguments')})` -> "
                             f"{_printable(str(call.get('result')))}")
            parts.append("\n".join(lines))
    return "\n\n".join(parts)


def curve_section(rows: list[dict], summary: Optional[dict], start: Optional[dict] = None) -> str:
    """The held-out curve (validation.py): its points from step 0, the best step and best_adapter/ (said plainly when
    it is step 0, the adapter GRPO started from), and on the held-out questions the best adapter against the last
    (summary.json `best`, `paired_changes_best`).

    Args:
        rows: metrics.jsonl's rows.
        summary: summary.json of the finished run, or None.
        start: curve_start.json (the curve's step 0), or None.

    Returns:
        The section's markdown.
    """
    rows = curve_rows(start, rows)
    key = criterion(rows)
    best = best_point(rows)
    points = curve(rows, key)
    begun = (f"from step 0, {start_text(start)} measured before GRPO's first step (`curve_start.json`), "
             if start else "")
    lines = [f"The adapter measured on the validation questions during GRPO, {begun}by `{key}` (metrics.jsonl; "
             "questions of the training source, never trained on, not the held-out ones): "
             + ", ".join(f"step {step}: {value:.3f}" for step, value in points) + ".",
             "", f"Best: step {best['step']} ({key.removeprefix(PREFIX)} {best['value']:.3f}), "
                 "kept as `best_adapter/`."]
    if best["step"] == 0 and len(points) > 1:
        lines[-1] = (f"Best: step 0 ({key.removeprefix(PREFIX)} {best['value']:.3f}), {start_text(start)}: **GRPO "
                     "never beat the adapter it started from on the validation questions** (no later point was higher; "
                     f"the earliest step wins a tie), so `best_adapter/` is {start_text(start)}.")
    elif best["step"] == 0:  # a run stopped before its first GRPO point
        lines[-1] = (f"Best so far: step 0 ({key.removeprefix(PREFIX)} {best['value']:.3f}), the only point yet: "
                     f"`best_adapter/` is {start_text(start)} until a later point beats it.")
    best_column, after = (summary or {}).get("best"), (summary or {}).get("after")
    facts = (summary or {}).get("best_adapter") or {}
    if best_column and after:
        if facts.get("same_as_after"):
            lines += ["", "It is the last step's adapter: the held-out numbers above are its numbers."]
        else:
            if facts.get("same_as_start"):
                column = "primed" if facts.get("start") == "primed" else "before"
                lines += ["", f"It is {start_text(start)}: its held-out numbers are the {column} column's above; "
                              "against the last step's adapter:"]
            lines += ["", "| held-out metric | after (last step) | best adapter | best - after |", "|---|---|---|---|"]
            for metric, cells, ends in metric_rows([after, best_column]):
                lines.append(f"| {metric} | " + " | ".join(cells)
                             + f" | {f'{ends[1] - ends[0]:+.3f}' if ends else '-'} |")
            pairs = [("after", after, "best", best_column)]
            primed = (summary or {}).get("primed")
            if primed and not facts.get("same_as_start"):  # step 0 is the primed adapter: no change to pair
                pairs.insert(0, ("primed", primed, "best (GRPO's own change, best adapter)", best_column))
            lines += [""] + [f"- {note}" for note in pair_notes(pairs)]
    return "\n".join(lines)


def warnings_section(signals: list[Signal]) -> str:
    if not signals:
        return ("None: completions mostly finished within max_completion_length, groups had differing rewards and were "
                "not mostly all wrong for a stretch, and the reward moved.")
    return "\n".join(f"- **{s.kind}** (from step {s.step}): {s.message}" for s in signals)


def plots_section(plots: dict[str, Optional[str]], config: dict) -> str:
    captions = {
        "reward": "Reward per step",
        "kl": "KL divergence from the base model",
        "completion_length": "Completion length",
        "clipped_ratio": "Cut-off completions and groups without signal",
        "loss": "Loss",
        "validation": "Held-out curve during GRPO",
        "sampler_gap": "Sampler vs trainer",
    }
    beta = (config.get("train") or {}).get("beta")
    notes = {"loss": BETA_ZERO_LOSS if beta == 0 else None,
             "clipped_ratio": (f"Each warning's line is drawn as the warning reads it (the mean of the last {WINDOW} "
                               f"logged steps; pale: per step), its threshold dashed in the same colour; the shaded "
                               f"steps are where the all-wrong warning held.")}
    parts = []
    for name, file_name in plots.items():
        if file_name:
            parts.append(f"### {captions[name]}\n\n![{captions[name]}]({file_name})"
                         + (f"\n\n{notes[name]}" if notes.get(name) else ""))
        elif name == "kl" and beta == 0:
            parts.append(f"### {captions[name]}\n\nNot logged: train.beta = 0, so the loss has no KL term.")
        elif name == "sampler_gap":
            parts.append(f"### {captions[name]}\n\nNot measured: the importance-sampling correction was off "
                         "(train.is_correction; `--dry-run` says why).")
        elif name == "validation":
            parts.append(f"### {captions[name]}\n\nNot measured by this run (eval.every_steps: `--dry-run` says why).")
        else:
            parts.append(f"### {captions[name]}\n\nNot logged by this run.")
    return "\n\n".join(parts)


def run_facts(summary: dict) -> list[str]:
    """The run's own peak memory (summary.json's peak_rss, peak_memory.py) and its GRPO step time, measured and
    planned (summary.json's step_time, cadence.py), as the report's lines; none where the summary has neither."""
    lines, peak, step = [], summary.get("peak_rss"), summary.get("step_time")
    if isinstance(peak, dict) and peak.get("gib") is not None:
        lines.append(f"- Memory: {describe_peak(peak['gib'], peak.get('phase'))}, the run process's ru_maxrss.")
    if isinstance(step, dict) and step.get("measured_s") is not None:
        planned = f"~{step['planned_s']:.0f} s planned" if step.get("planned_s") else "no planned estimate"
        lines.append(f"- GRPO step time: {step['measured_s']:.2f} s, {step['basis']} ({planned}); "
                     f"checkpoint every {step['save_steps']} step(s)"
                     + (" (auto)" if step.get("save_steps_auto") else " (train.save_steps)") + ".")
    return [""] + lines if lines else []


def header(run_dir: Path, summary: Optional[dict], config: dict, rows: list[dict]) -> str:
    preset = (summary or {}).get("preset") or config.get("preset") or run_dir.name
    lines = [f"# Run report: {preset}", ""]
    if summary:
        lines.append(f"`{summary.get('model')}` on {summary.get('device')} (backend {summary.get('backend')}): "
                     f"{summary.get('steps')} GRPO steps in {summary.get('train_seconds')} s "
                     f"({summary.get('total_seconds')} s for the whole run).")
        lines += run_facts(summary)
    else:
        lines.append("The run did not finish (no summary.json, or one that says it is still training): "
                     "the plots show the steps it logged; `python -m lowvram_grpo.run --resume RUN_DIR` continues it.")
    lines += ["", f"{len(rows)} logged steps in `metrics.jsonl`. Rebuild this report with "
              f"`python -m lowvram_grpo.report {run_dir}`."]
    return "\n".join(lines)


def render(run_dir: Path, rows: list[dict], summary: Optional[dict], config: dict,
           signals: list[Signal], plots: dict[str, Optional[str]], completions: Optional[list[dict]] = None,
           start: Optional[dict] = None) -> str:
    """report.md's text. `completions`: completions.jsonl's rows (None or []: the run wrote none); `start`:
    curve_start.json, the held-out curve's step 0 (None: not measured)."""
    sections = [
        header(run_dir, summary, config, rows),
        "## Before / after on the held-out questions\n\n" + (comparison_table(summary) if summary
                                                             else "Not available: the run did not finish."),
        *(["## After vs the controls\n\n" + controls_section(summary)] if summary and summary.get("controls") else []),
        *(["## Held-out curve during GRPO\n\n" + curve_section(rows, summary, start)]
          if curve(curve_rows(start, rows)) else []),
        *(["## Tool use\n\n" + tools_section(rows)] if tools_section(rows) else []),
        *(["## Sampler vs trainer (importance sampling)\n\n" + sampling_section(rows)]
          if sampling_section(rows) else []),
        *(["## Rollouts: the adapter or the base?\n\n" + adapter_section(rows)] if adapter_section(rows) else []),
        "## Training-signal warnings\n\n" + warnings_section(signals),
        "## Plots\n\n" + plots_section(plots, config),
        "## Completions during GRPO\n\n" + completions_section(completions, run_dir),
        "## Sample answers\n\n" + (samples_section(summary) if summary else "Not available: the run did not finish."),
    ]
    return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------------------- entry points
def write_report(run_dir, after_plots: Optional[Callable[[], None]] = None) -> Path:
    """Write report.md and the PNGs into `run_dir` from its metrics.jsonl, summary.json and config.yaml.

    Args:
        run_dir: a lowvram_grpo run's output folder.
        after_plots: called once the PNGs are written, before report.md is made from summary.json, which is read
            again after it (the pipeline records there the peak memory that drawing the plots reached).

    Returns:
        report.md's path."""
    folder = RunDir(run_dir)
    if not folder.path.is_dir():
        raise RunDirError(f"run dir {folder} does not exist: pass the --output-dir of a lowvram_grpo run")
    rows = folder.read_metrics()  # everything is read and checked before anything is written
    summary = folder.complete_summary()  # while it trains, the before/after numbers are not there yet
    config = folder.read_config_raw()
    max_len = (config.get("train") or {}).get("max_completion_length")
    signals = scan(rows, max_len, config)
    completions = folder.read_completions()
    start = folder.read_curve_start()  # the held-out curve's step 0 (validation.py)
    plots = write_plots(folder.path, rows, config, start)
    if after_plots is not None:
        after_plots()
        summary = folder.complete_summary()
    return folder.write_report(render(folder.path, rows, summary, config, signals, plots, completions, start))


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m lowvram_grpo.report",
                     description="Rebuild report.md and the PNG plots of a run from its files.")
    parser.add_argument("run_dir", type=Path, help="a run's --output-dir (holds metrics.jsonl and summary.json)")
    args = parser.parse_args(argv)

    def body() -> int:
        try:
            path = write_report(args.run_dir)
        except OSError as exc:
            raise RunDirError(f"cannot write the report into {args.run_dir}: {exc.strerror or exc}") from None
        print(path)
        return 0

    return guarded(body)
