"""Held-out numbers: the base model and adapters on the same questions, under one named protocol.

The protocol (`protocol(plan.eval)`, stored with every column in summary.json) is **greedy decoding** by
default (`eval.temperature: 0`), as published GSM8K numbers are (lm-eval-harness, verl's validation, model
cards): one deterministic answer per question, so a column's accuracy is a property of the adapter, not of
a sampling draw. `eval.temperature > 0` samples one answer per question instead (the same seed in every
column); `eval.samples: k` adds mean@k and pass@k over k answers sampled at `eval.sample_temperature`.
The same prompts and protocol are used for the base model (`lora_request=None`), the primed adapter and
the trained adapter (`lora_request=handle.load_lora(saved)`), so the columns differ only by the adapter.
Reported per column:

- `reward_mean`: the mean total reward, from the very reward functions and weights the trainer used
  (`user_code.of(plan.eval).reward_functions()`: built-in ones and a `rewards.module` file's alike), called
  with the keywords TRL passes (conversational prompts and completions, the dataset columns, completion
  ids, a trainer state at step 0 for every column, so a step-dependent reward is one yardstick);
- `accuracy_strict`: the answer inside a closed <answer>...</answer> block is right;
- `accuracy_lenient`: the answer the text states, in any format, is right (the <answer> block's when
  there is one, else a \\boxed{...}, else the last number), so a base model that answers in prose is not
  scored 0 and a format-only gain shows as strict going up while lenient does not;
  both judged by `answers.is_correct` (exact decimals; math-verify for fractions, LaTeX, percentages),
  each with its 95% Wilson interval (`accuracy_strict_ci`, `accuracy_lenient_ci`); an answer the checker
  failed on (answers.CheckerError) counts as not right and is counted in `checker_failures` (present when
  not 0: verdicts the accuracies hold that are unchecked, not wrong);
- `format_rate`: a reasoning block followed by an answer block;
  with `data.answer_format: think` (a thinking model's format) the accuracies read the answer after </think>
  (strict: of a well-formed <think>...</think> completion; answers.extractors) and `format_rate` counts
  well-formed think completions (answers.think_ok);
- `mean_completion_tokens`;
- `n` and the per-question verdicts (`strict_correct`, `lenient_correct`: 0/1 in question order, for
  paired comparisons between columns: `paired_change`, an exact McNemar test);
- `protocol`: how the answers were decoded (`protocol_label` says it in words);
- with `eval.samples: k`, `sampled`: `strict_mean_at_k` / `lenient_mean_at_k` (mean accuracy of the k
  samples, with a 95% normal interval over questions) and `strict_pass_at_k` / `lenient_pass_at_k` (share
  of questions with a right answer among the k, Wilson interval), and the per-question counts.
"""
from __future__ import annotations

import math
import types
from typing import Optional

from lowvram_grpo.evaluate import tool_turns
from lowvram_grpo.model.handle import Completion, LoraRequest, ModelHandle, SamplingParams
from lowvram_grpo.core import host_memory, stops
from lowvram_grpo.settings.plans import EvalPlan
from lowvram_grpo.task import answers
from lowvram_grpo.task.data import text_tokenizer
from lowvram_grpo.task.rewards import call_reward, completion_text, well_formed
from lowvram_grpo.task.user_code import of as user_code_of

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


def protocol(ev: EvalPlan) -> dict:
    """How the held-out answers are decoded under `ev` (plans.EvalPlan), as stored beside every column's numbers."""
    described = {"decoding": "greedy" if ev.greedy else "sampled", "temperature": ev.temperature,
                 "max_tokens": ev.max_tokens, "batch_size": ev.batch_size}
    if not ev.greedy:
        described.update(top_p=ev.top_p, seed=ev.seed, answers_per_question=1)
    if ev.samples:
        described["samples"] = {"k": ev.samples, "temperature": ev.sample_temperature, "top_p": ev.top_p,
                                "seed": ev.seed}
    tools, prompts = ev.tools, ev.prompts
    if tools.used:  # answered with tools (tool_turns.py): max_tokens per turn
        described["tools"] = {"names": list(tools.names), "environment": tools.environment,
                              "max_turns": tools.max_turns}
        if tools.max_tokens_per_turn is not None:
            described["tools"]["max_tokens_per_turn"] = described["max_tokens"] = tools.turn_tokens
    if prompts.answer_format != "xml":  # answers read in another format (answers.extractors)
        described["answer_format"] = prompts.answer_format
    if prompts.chat_template_kwargs:
        described["chat_template_kwargs"] = prompts.template_kwargs
    return described


def protocol_label(described: Optional[dict]) -> str:
    """The protocol in words, for tables and reports ('greedy decoding, up to 64 new tokens')."""
    if not described:
        return ("protocol not recorded (summaries written before it was: one answer sampled at eval.temperature, "
                "0.8 by default then)")
    if described.get("decoding") == "greedy":
        text = f"greedy decoding, up to {described['max_tokens']} new tokens"
    else:
        text = (f"one answer sampled per question at T={described['temperature']:g}, top-p {described['top_p']:g}, "
                f"seed {described['seed']}, up to {described['max_tokens']} new tokens")
    samples = described.get("samples")
    if samples:
        text += (f"; mean@{samples['k']} / pass@{samples['k']} over {samples['k']} samples at "
                 f"T={samples['temperature']:g}")
    if described.get("answer_format"):
        text += f"; answers read in the {described['answer_format']} format"
    return text


def generate_answers(handle: ModelHandle, rows: list[dict], ev: EvalPlan, lora_request: Optional[LoraRequest],
                     temperature: Optional[float] = None, tool_counts: Optional[dict] = None) -> list[Completion]:
    """One completion per row under `ev` (plans.EvalPlan), in batches of eval.batch_size, at `temperature`
    (default eval.temperature; 0 = greedy). Sampling uses eval.top_p and a seed per batch, identical for every
    column. A run with tools answers with them (tool_turns.py: multi-turn, the answer is the model's last turn);
    `tool_counts` then adds up the calls, the calls that ran and the answers that called a tool."""

    with_tools = ev.tools.used
    temperature = ev.temperature if temperature is None else temperature
    texts: list[Completion] = []
    for start in range(0, len(rows), ev.batch_size):
        stops.check()  # a safe point between batches: a signal stops the measuring here (stops.py)
        batch = rows[start:start + ev.batch_size]
        params = SamplingParams(
            temperature=temperature, top_p=ev.top_p if temperature > 0 else 1.0,
            max_tokens=ev.tools.turn_tokens if with_tools else ev.max_tokens,
            seed=ev.seed + start,  # per batch, identical for before and after
        )
        if with_tools:

            answers, _, counts = tool_turns.generate_with_tools(handle, batch, ev, params, lora_request)
            texts += answers
            if tool_counts is not None:
                for key, value in counts.items():
                    tool_counts[key] = tool_counts.get(key, 0) + value
        else:
            texts += handle.generate([r["prompt"] for r in batch], params, lora_request=lora_request)
        host_memory.release()  # the batch's KV cache and logits back to the OS (host_memory.py)
    return texts


def _reward_keywords(rows: list[dict], completions: list[str], max_steps: int, tokenizer=None) -> dict:
    """What TRL passes a reward function besides prompts and completions: every dataset column but the
    prompt, the completion ids, a trainer state and the two logging hooks."""
    columns = {key: [row[key] for row in rows] for key in rows[0]
               if key not in ("prompt", "completion", "completion_ids")}
    if tokenizer is not None:
        tokenizer = text_tokenizer(tokenizer)  # a processor (a vision-language checkpoint): its tokenizer
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in completions]
    else:
        ids = [[] for _ in completions]
    state = types.SimpleNamespace(global_step=0, max_steps=max_steps, epoch=0.0, log_history=[])
    return {**columns, "completion_ids": ids, "trainer_state": state,
            "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None}


def score(rows: list[dict], generated: list[Completion], ev: EvalPlan, reward_funcs=None, tokenizer=None) -> dict:
    """The summary numbers for completions of `rows`, weighted and read as `ev` (plans.EvalPlan) says.
    `reward_funcs`: what the trainer was handed (default: the run's, `user_code.of(ev).reward_functions()`)."""
    if reward_funcs is None:
        reward_funcs = user_code_of(ev).reward_functions()
    texts = [c.text for c in generated]
    prompts = [r["prompt"] for r in rows]
    # as TRL passes them: messages for chat prompts, plain text for TRL's standard (text) prompts
    completions = texts if isinstance(prompts[0], str) else [[{"role": "assistant", "content": t}] for t in texts]
    keywords = _reward_keywords(rows, texts, ev.max_steps, tokenizer)
    total: list = [None] * len(rows)  # as TRL sums: None (does not apply) and NaN left out; all left out: no score
    for fn, weight in zip(reward_funcs, ev.rewards.weights):
        for i, value in enumerate(call_reward(fn, prompts=prompts, completions=completions, **keywords)):
            if value is not None and not math.isnan(value):
                total[i] = (total[i] or 0.0) + weight * value
    scored = [t for t in total if t is not None]
    n = len(rows)
    numbers = {
        **({"reward_mean": sum(scored) / len(scored)} if scored else {}),
        "format_rate": sum(1 for t in texts if well_formed(ev.prompts.answer_format, completion_text(t))) / n,
        "mean_completion_tokens": sum(c.num_tokens for c in generated) / n,
        "n": n,
    }
    graded = [(r, t) for r, t in zip(rows, texts) if r.get("answer") is not None]
    if not graded:  # data without gold answers: no accuracy to measure
        return numbers
    failures: list[str] = []
    strict, lenient = verdicts([r for r, _ in graded], [t for _, t in graded], failures, ev.prompts.answer_format)
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
        **({"checker_failures": len(failures)} if failures else {}),
    }


def _right(stated, gold, failures: Optional[list]) -> int:
    try:
        return int(answers.is_correct(stated, gold))
    except answers.CheckerError as exc:  # unchecked: not right, and said so
        if failures is not None:
            failures.append(str(exc))
        return 0


def verdicts(rows: list[dict], texts: list[str], failures: Optional[list] = None,
             answer_format: str = "xml") -> tuple[list[int], list[int]]:
    """Per question: is the strict answer right, is the lenient answer right (0/1 each), answers read in
    `answer_format` (answers.extractors). A verdict the checker failed on is 0, and its message is appended to
    `failures` (one per failed verdict)."""
    golds = [r["answer"] for r in rows]
    strict_answer, lenient_answer = answers.extractors(answer_format)
    strict = [_right(strict_answer(t), g, failures) for t, g in zip(texts, golds)]
    lenient = [_right(lenient_answer(t), g, failures) for t, g in zip(texts, golds)]
    return strict, lenient


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float]:
    """A 95% normal interval of the mean of per-question values (clipped to [0, 1])."""
    n = len(values)
    if n < 2:
        return (0.0, 1.0)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return (max(0.0, mean - half), min(1.0, mean + half))


def sampled_numbers(rows: list[dict], texts: list[str], k: int, answer_format: str = "xml") -> dict:
    """mean@k and pass@k, strict and lenient, from k completions per row (row i's are texts[i*k:(i+1)*k]), answers
    read in `answer_format`."""
    repeated = [r for r in rows for _ in range(k)]
    strict, lenient = verdicts(repeated, texts, answer_format=answer_format)
    n = len(rows)
    out: dict = {"k": k}
    for name, flat in (("strict", strict), ("lenient", lenient)):
        counts = [sum(flat[i * k:(i + 1) * k]) for i in range(n)]
        means = [c / k for c in counts]
        passed = sum(1 for c in counts if c)
        out.update({f"{name}_mean_at_k": sum(means) / n, f"{name}_mean_at_k_ci": list(mean_interval(means)),
                    f"{name}_pass_at_k": passed / n, f"{name}_pass_at_k_ci": list(wilson_interval(passed, n)),
                    f"{name}_counts": counts})
    return out


def evaluate(handle: ModelHandle, rows: list[dict], ev: EvalPlan,
             lora_request: Optional[LoraRequest]) -> tuple[dict, list[str]]:
    """The column's numbers under the protocol of `ev` (plans.EvalPlan), and its answers (the greedy ones by
    default)."""
    tool_counts: dict = {}
    generated = generate_answers(handle, rows, ev, lora_request, tool_counts=tool_counts)
    numbers = score(rows, generated, ev, tokenizer=handle.tokenizer)
    numbers["protocol"] = protocol(ev)
    if tool_counts:  # answered with tools (tool_turns.py)
        calls = tool_counts["calls"]
        numbers["tools"] = {"calls_per_answer": calls / len(rows),
                            "answers_with_calls": tool_counts["answers_with_calls"] / len(rows),
                            "ran_share": tool_counts["ran"] / calls if calls else None}
    k = ev.samples
    if k:
        repeated = [r for r in rows for _ in range(k)]
        sampled = generate_answers(handle, repeated, ev, lora_request, temperature=ev.sample_temperature)
        numbers["sampled"] = sampled_numbers(rows, [c.text for c in sampled], k, ev.prompts.answer_format)
    return numbers, [c.text for c in generated]


# --------------------------------------------------------------------------- the table

SAMPLED_ROWS = (("strict", "mean"), ("strict", "pass"), ("lenient", "mean"), ("lenient", "pass"))


def cell(row: dict, key: str) -> str:
    """'0.453 [0.34, 0.57]' for an accuracy with its interval, '2.904' otherwise, '-' when absent
    (a summary written before the field existed)."""
    if key not in row:
        return "-"
    ci = row.get(f"{key}_ci")
    return f"{row[key]:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{row[key]:.3f}"


def metric_rows(columns: list[dict]) -> list[tuple[str, list[str], Optional[tuple[float, float]]]]:
    """(label, one cell per column, (first, last) value for the change) for every metric a table shows:
    METRICS, then mean@k / pass@k where a column has `sampled`."""
    out = []
    for key in METRICS:
        ends = (columns[0][key], columns[-1][key]) if key in columns[0] and key in columns[-1] else None
        out.append((key, [cell(c, key) for c in columns], ends))
    k = next((c["sampled"]["k"] for c in columns if c.get("sampled")), None)
    if k:
        for judge, kind in SAMPLED_ROWS:
            key = f"{judge}_{kind}_at_k"
            cells = [cell(c["sampled"], key) if c.get("sampled") else "-" for c in columns]
            first, last = columns[0].get("sampled"), columns[-1].get("sampled")
            ends = (first[key], last[key]) if first and last else None
            out.append((f"{judge} {kind}@{k}", cells, ends))
    return out


def protocol_lines(columns: list[dict]) -> list[str]:
    """The protocol the columns were measured with, and a warning when they differ."""
    described = [c.get("protocol") for c in columns]
    labels = list(dict.fromkeys(protocol_label(d) for d in described))
    if len(labels) == 1:
        return [f"protocol: {labels[0]}"]
    return [f"warning: the columns were measured under different protocols ({'; '.join(labels)}): "
            "their differences mix the protocol with the adapter"]


def pair_notes(pairs: list[tuple[str, dict, str, dict]], stored: Optional[list[Optional[dict]]] = None) -> list[str]:
    """One sentence per accuracy and (start name, start, end label, end) pair: the change, whether the 95%
    intervals overlap, and the paired count of questions that flipped with its McNemar p. `stored`: per pair, its
    paired changes as `paired_changes` stored them in summary.json (then those are shown, not recomputed)."""
    notes = []
    for key in WITH_INTERVAL:
        for i, (name, start, label, end) in enumerate(pairs):
            if not (f"{key}_ci" in start and f"{key}_ci" in end):
                continue
            change = end[key] - start[key]
            if intervals_overlap(start[f"{key}_ci"], end[f"{key}_ci"]):
                verdict = "the 95% intervals overlap: not a clear difference at this n"
            else:
                verdict = "the 95% intervals do not overlap"
            entry = (stored[i] or {}).get(key) if stored is not None else _paired_entry(start, end, key)
            if entry is not None:
                p = entry["mcnemar_p"]
                verdict += (f"; paired over the same {entry['n']} questions: {entry['newly_right']} newly right, "
                            f"{entry['newly_wrong']} newly wrong (McNemar p "
                            f"{'< 0.001' if p < 0.001 else f'= {p:.3f}'})")
            notes.append(f"{key} {name} -> {label}: {change:+.3f}; {verdict}")
    return notes


def _paired_entry(start: dict, end: dict, key: str) -> Optional[dict]:
    paired = paired_change(start, end, key)
    if paired is None:
        return None
    return {"newly_right": paired[0], "newly_wrong": paired[1], "mcnemar_p": paired[2],
            "n": len(end[{"accuracy_strict": "strict_correct", "accuracy_lenient": "lenient_correct"}[key]])}


def paired_changes(before: Optional[dict], after: Optional[dict], primed: Optional[dict] = None) -> dict:
    """The paired changes a run reports, computed once (summary.json `paired_changes`; report.md, the printed
    table and the model card read them): {'primed_to_after': ..., 'before_to_after': ...} (the first only when
    priming ran), each {accuracy key: {newly_right, newly_wrong, mcnemar_p, n}} over the same questions' verdicts;
    pairs or keys without per-question verdicts are left out."""
    out = {}
    for name, start in (("primed", primed), ("before", before)):
        if not (start and after):
            continue
        entry = {key: found for key in WITH_INTERVAL if (found := _paired_entry(start, after, key)) is not None}
        if entry:
            out[f"{name}_to_after"] = entry
    return out


def paired_against(control: dict, after: dict) -> dict:
    """{accuracy key: after's change over `control`, the paired counts and McNemar p, n} on the same questions
    (a control or baseline column against the run's after column, as summary.json stores it)."""
    out = {}
    for key in WITH_INTERVAL:
        if key not in after or key not in control:
            continue
        entry = {"after_minus_control": after[key] - control[key], "n": after.get("n_graded", after.get("n"))}
        paired = paired_change(control, after, key)
        if paired is not None:
            entry.update(newly_right=paired[0], newly_wrong=paired[1], mcnemar_p=paired[2])
        out[key] = entry
    return out


def beyond_line(headline: str, control: dict, after: dict) -> str:
    """One sentence: what the after column has over a control column on the same questions (each accuracy's change,
    paired: newly right / newly wrong, McNemar p; the held-out reward_mean's change) and whether that is more than
    chance at this n."""
    parts, ps = [], []
    for key, entry in paired_against(control, after).items():
        text = f"{key} {entry['after_minus_control']:+.3f}"
        if "mcnemar_p" in entry:
            p = entry["mcnemar_p"]
            ps.append(p)
            text += (f" ({entry['newly_right']} newly right, {entry['newly_wrong']} newly wrong of {entry['n']} "
                     f"questions, McNemar p {'< 0.001' if p < 0.001 else f'= {p:.3f}'})")
        parts.append(text)
    if "reward_mean" in after and "reward_mean" in control:
        parts.append(f"held-out reward_mean {after['reward_mean'] - control['reward_mean']:+.3f}")
    if not parts:
        return f"{headline}: no held-out numbers to compare."
    verdict = ("" if not ps else " - a paired difference unlikely by chance (p < 0.05)" if min(ps) < 0.05
               else " - not distinguishable from it at this n (every McNemar p >= 0.05)")
    return f"{headline}: {'; '.join(parts)}{verdict}."


def interval_notes(before: dict, after: dict, primed: Optional[dict] = None,
                   changes: Optional[dict] = None) -> list[str]:
    """A run's notes: primed -> after (GRPO's own change) when priming ran, and before -> after. `changes`: the
    run's `paired_changes` as summary.json stores them (None: computed here, for summaries written before)."""
    changes = paired_changes(before, after, primed) if changes is None else changes
    pairs = [("primed", primed, "after (GRPO's own change)", after)] if primed else []
    pairs.append(("before", before, "after", after))
    return pair_notes(pairs, [changes.get(f"{name}_to_after") for name, *_ in pairs])


def format_columns(named: list[tuple[str, dict]], pairs: list[tuple[str, dict, str, dict]]) -> str:
    """A plain-text table of named columns (the first is the reference of the `change` column), the
    protocol, and the pair notes."""
    names, columns = [n for n, _ in named], [c for _, c in named]
    width = max(22, *(len(n) + 2 for n in names))
    lines = [f"{'held-out metric':<24}" + "".join(f"{n:>{width}}" for n in names) + f"{'change':>10}"]
    for label, cells, ends in metric_rows(columns):
        change = f"{ends[1] - ends[0]:>+10.3f}" if ends else f"{'-':>10}"
        lines.append(f"{label:<24}" + "".join(f"{c:>{width}}" for c in cells) + change)
    lines.append(f"({columns[-1].get('n', '?')} held-out questions; [95% Wilson interval])")
    if (names[0], names[-1]) != ("before", "after"):
        lines.append(f"(change = {names[-1]} - {names[0]})")
    lines += protocol_lines(columns)
    lines += pair_notes(pairs)
    return "\n".join(lines)


def format_table(before: dict, after: dict, primed: Optional[dict] = None, changes: Optional[dict] = None) -> str:
    """The before/after table printed at the end of a run (with the primed column when priming ran),
    accuracies with their 95% Wilson intervals, the protocol, and whether the intervals overlap; `changes`: the
    run's `paired_changes` (computed here when None)."""
    named = [("before", before)] + ([("primed", primed)] if primed else []) + [("after", after)]
    table = format_columns(named, [])
    lines = table.splitlines()
    if primed:
        own = "".join(
            f", {key} {after[key] - primed[key]:+.3f}" for key in WITH_INTERVAL if key in after and key in primed)
        lines.append(
            "(GRPO's own change in reward_mean, primed -> after: "
            f"{after['reward_mean'] - primed['reward_mean']:+.3f}{own})")
    lines += interval_notes(before, after, primed, changes)
    return "\n".join(lines)
