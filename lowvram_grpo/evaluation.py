"""Before/after comparison on the held-out questions.

The same prompts, the same sampling settings and the same seed are used for the base model
(`lora_request=None`), the primed adapter and the trained adapter (`lora_request=handle.load_lora(saved)`),
so the columns differ only by the adapter. Reported per column:

- `reward_mean`: the mean total reward, from the very reward functions and weights the trainer used
  (`rewards.reward_functions(config.rewards)`: built-in ones and a `rewards.module` file's alike), called
  with the keywords TRL passes (conversational prompts and completions, the dataset columns, completion
  ids, a trainer state at step 0 for every column, so a step-dependent reward is one yardstick);
- `accuracy_strict`: the answer inside a closed <answer>...</answer> block is right;
- `accuracy_lenient`: the answer the text states, in any format, is right (the <answer> block's when
  there is one, else a \\boxed{...}, else the last number), so a base model that answers in prose is not
  scored 0 and a format-only gain shows as strict going up while lenient does not;
  both judged by `answers.is_correct` (exact decimals; math-verify for fractions, LaTeX, percentages),
  each with its 95% Wilson interval (`accuracy_strict_ci`, `accuracy_lenient_ci`);
- `format_rate`: a reasoning block followed by an answer block;
- `mean_completion_tokens`;
- `n` and the per-question verdicts (`strict_correct`, `lenient_correct`: 0/1 in question order, for
  paired comparisons between columns).
"""
from __future__ import annotations

import math
import types
from typing import Optional

from . import host_memory
from . import answers
from .backends.base import Completion, LoraRequest, ModelHandle, SamplingParams
from .rewards import call_reward, completion_text, format_ok, reward_functions

METRICS = ("reward_mean", "accuracy_strict", "accuracy_lenient", "format_rate", "mean_completion_tokens")
WITH_INTERVAL = ("accuracy_strict", "accuracy_lenient")
Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default): unlike p +- z*sqrt(p(1-p)/n) it stays
    inside [0, 1] and is not zero-width at 0 or n successes."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def intervals_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar test: the chance of a split of the discordant questions at least this
    uneven if the two columns were equally accurate (binomial, p = 1/2)."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_change(start: dict, end: dict, key: str) -> Optional[tuple[int, int, float]]:
    """(questions newly right, newly wrong, McNemar p) between two columns on the same questions, from
    their per-question verdicts; None when a column lacks them."""
    verdicts = {"accuracy_strict": "strict_correct", "accuracy_lenient": "lenient_correct"}[key]
    a, b = start.get(verdicts), end.get(verdicts)
    if not a or not b or len(a) != len(b):
        return None
    gained = sum(1 for x, y in zip(a, b) if not x and y)
    lost = sum(1 for x, y in zip(a, b) if x and not y)
    return gained, lost, mcnemar_p(gained, lost)


def generate_answers(handle: ModelHandle, rows: list[dict], config, lora_request: Optional[LoraRequest]) -> list[Completion]:
    ev = config.eval
    texts: list[Completion] = []
    for start in range(0, len(rows), ev.batch_size):
        batch = rows[start:start + ev.batch_size]
        params = SamplingParams(
            temperature=ev.temperature, top_p=ev.top_p, max_tokens=config.train.max_completion_length,
            seed=ev.seed + start,  # per batch, identical for before and after
        )
        texts += handle.generate([r["prompt"] for r in batch], params, lora_request=lora_request)
        host_memory.release()  # the batch's KV cache and logits back to the OS (host_memory.py)
    return texts


def _reward_keywords(rows: list[dict], completions: list[str], config, tokenizer=None) -> dict:
    """What TRL passes a reward function besides prompts and completions: every dataset column but the
    prompt, the completion ids, a trainer state and the two logging hooks."""
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")}
    if tokenizer is not None:
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in completions]
    else:
        ids = [[] for _ in completions]
    state = types.SimpleNamespace(global_step=0, max_steps=config.train.max_steps, epoch=0.0, log_history=[])
    return {**columns, "completion_ids": ids, "trainer_state": state,
            "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None}


def score(rows: list[dict], generated: list[Completion], config, reward_funcs=None, tokenizer=None) -> dict:
    """The summary numbers for completions of `rows`. `reward_funcs`: what the trainer was handed
    (default: resolved from `config.rewards` the same way, `rewards.reward_functions`)."""
    if reward_funcs is None:
        reward_funcs = reward_functions(config.rewards)
    texts = [c.text for c in generated]
    prompts = [r["prompt"] for r in rows]
    # as TRL passes them: messages for chat prompts, plain text for TRL's standard (text) prompts
    completions = texts if isinstance(prompts[0], str) else [[{"role": "assistant", "content": t}] for t in texts]
    keywords = _reward_keywords(rows, texts, config, tokenizer)
    total: list = [None] * len(rows)  # as TRL sums: None (does not apply) and NaN left out; all left out: no score
    for fn, weight in zip(reward_funcs, config.rewards.weight_list):
        for i, value in enumerate(call_reward(fn, prompts=prompts, completions=completions, **keywords)):
            if value is not None and not math.isnan(value):
                total[i] = (total[i] or 0.0) + weight * value
    scored = [t for t in total if t is not None]
    n = len(rows)
    numbers = {
        **({"reward_mean": sum(scored) / len(scored)} if scored else {}),
        "format_rate": sum(1 for t in texts if format_ok(completion_text(t))) / n,
        "mean_completion_tokens": sum(c.num_tokens for c in generated) / n,
        "n": n,
    }
    graded = [(t, r["answer"]) for t, r in zip(texts, rows) if r.get("answer") is not None]
    if not graded:  # data without gold answers: no accuracy to measure
        return numbers
    strict = [int(answers.is_correct(answers.strict_answer(t), g)) for t, g in graded]
    lenient = [int(answers.is_correct(answers.lenient_answer(t), g)) for t, g in graded]
    k = len(graded)
    return {
        **numbers,
        "accuracy_strict": sum(strict) / k,
        "accuracy_strict_ci": list(wilson_interval(sum(strict), k)),
        "accuracy_lenient": sum(lenient) / k,
        "accuracy_lenient_ci": list(wilson_interval(sum(lenient), k)),
        "strict_correct": strict,
        "lenient_correct": lenient,
        **({"n_graded": k} if k != n else {}),
    }


def evaluate(handle: ModelHandle, rows: list[dict], config, lora_request: Optional[LoraRequest]) -> tuple[dict, list[str]]:
    generated = generate_answers(handle, rows, config, lora_request)
    return score(rows, generated, config, tokenizer=handle.tokenizer), [c.text for c in generated]


# --------------------------------------------------------------------------- the table

def cell(row: dict, key: str) -> str:
    """'0.453 [0.34, 0.57]' for an accuracy with its interval, '2.904' otherwise, '-' when absent
    (a summary written before the field existed)."""
    if key not in row:
        return "-"
    ci = row.get(f"{key}_ci")
    return f"{row[key]:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{row[key]:.3f}"


def interval_notes(before: dict, after: dict, primed: Optional[dict] = None) -> list[str]:
    """One sentence per accuracy: do the 95% intervals of the compared columns overlap?"""
    notes = []
    pairs = [("primed", primed, "after (GRPO's own change)")] if primed else []
    pairs.append(("before", before, "after"))
    for key in WITH_INTERVAL:
        for name, start, label in pairs:
            if not (f"{key}_ci" in start and f"{key}_ci" in after):
                continue
            change = after[key] - start[key]
            if intervals_overlap(start[f"{key}_ci"], after[f"{key}_ci"]):
                verdict = "the 95% intervals overlap: not a clear difference at this n"
            else:
                verdict = "the 95% intervals do not overlap"
            paired = paired_change(start, after, key)
            if paired is not None:
                p = paired[2]
                verdict += (f"; paired over the same {len(after['strict_correct'])} questions: {paired[0]} newly right, "
                            f"{paired[1]} newly wrong (McNemar p {'< 0.001' if p < 0.001 else f'= {p:.3f}'})")
            notes.append(f"{key} {name} -> {label}: {change:+.3f}; {verdict}")
    return notes


def format_table(before: dict, after: dict, primed: Optional[dict] = None) -> str:
    """The before/after table printed at the end of a run (with the primed column when priming ran),
    accuracies with their 95% Wilson intervals, and whether the intervals overlap."""
    columns = [before] + ([primed] if primed else []) + [after]
    names = ["before"] + (["primed"] if primed else []) + ["after"]
    width = 22
    lines = [f"{'held-out metric':<24}" + "".join(f"{n:>{width}}" for n in names) + f"{'change':>10}"]
    for key in METRICS:
        change = f"{after[key] - before[key]:>+10.3f}" if key in after and key in before else f"{'-':>10}"
        lines.append(f"{key:<24}" + "".join(f"{cell(c, key):>{width}}" for c in columns) + change)
    lines.append(f"({after.get('n', '?')} held-out questions; [95% Wilson interval])")
    if primed:
        own = "".join(f", {key} {after[key] - primed[key]:+.3f}" for key in WITH_INTERVAL if key in after and key in primed)
        lines.append(f"(GRPO's own change in reward_mean, primed -> after: {after['reward_mean'] - primed['reward_mean']:+.3f}{own})")
    lines += interval_notes(before, after, primed)
    return "\n".join(lines)
