"""What the model wrote during GRPO: `completions.jsonl` in the run folder, so "the reward stays 0" is answered by
reading the completions with their scores, and the report shows a few (report.completions_section).

One JSON object per completion, for the steps the policy below writes:

- `step`: the GRPO step; `group`: the prompt group's index in the step (TRL's order: a prompt's num_generations
  completions in a row);
- `prompt_id`: a hash of the prompt as TRL rendered it (text, or the chat messages); `prompt`: the prompt in full the
  first time its id is in the file, null after; `answer`: the gold answer when the data has one (else null);
- `completion`: the model's own text (with tools: its turns, joined; the tools' results are in `tool_calls`);
- `rewards`: {reward function: its score, null where it returned None}; `reward`: their weighted sum as TRL adds it
  (null when no function scored it); `advantage`: the advantage TRL trained with;
- `truncated`: cut at max_completion_length (no end-of-sequence token; TRL's own test), null where unknown;
- `tool_calls`: [{`name`, `arguments`, `result`}] in the order the model made them ([] without tools).

The data is TRL 1.15's: the latest rollouts as its `log_completions` machinery keeps them (trl_compat.completion_log:
prompts, completions with their tool messages, each reward function's scores, the advantages) plus what
`CompletionFacts` logs through TRL's public `log_extra` keyword (the truncation and the gold answer; TRL shows them in
its own tables too).

Size policy (log.*): the completions of every `completions_every`-th logged step and of the last step; of each, the
first `completions_groups` prompt groups, all their completions; the full prompt only at its first row. Before a step
would take the file past `completions_max_mb`, every other written step is dropped from it (an atomic rewrite; a
prompt's text moves to its first row left) and `completions_every` doubles: the file stays under its cap and covers the
whole run, more thinly as it goes on. The current `completions_every` is kept in the checkpoints' run state; a resumed
run drops the rows after its checkpoint's step and writes them again. Nothing here imports torch or transformers.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Optional

from lowvram_grpo.report.records import PREVIEW_CHARS, steps_to_show  # noqa: F401  (completions.X)
from lowvram_grpo.task.rewards import is_async_callable

TRUNCATED, ANSWER = "truncated", "answer"  # the log_extra columns CompletionFacts adds to TRL's log
def prompt_id(prompt) -> str:
    """A short stable id of a prompt (text or chat messages)."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def model_text(completion) -> str:
    """The model's own text of a completion: plain text, or its assistant turns joined (tool results left out)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    turns = [str(m.get("content") or "") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    return "\n".join(turns)


def tool_calls(completion) -> list[dict]:
    """[{name, arguments, result}] of a conversational completion (TRL: an assistant turn's `tool_calls`, each
    answered by a `tool` message in order); [] for text."""
    if not isinstance(completion, list):
        return []
    calls: list[dict] = []
    answered = 0
    for message in completion:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                function = call.get("function", call) if isinstance(call, dict) else {}
                calls.append({"name": function.get("name"), "arguments": function.get("arguments"), "result": None})
        elif message.get("role") == "tool" and answered < len(calls):
            content = message.get("content")
            calls[answered]["result"] = content if isinstance(content, str) else json.dumps(content, default=str)
            answered += 1
    return calls


def step_rows(step: int, log: dict, group_size: int, groups: int, weights: dict[str, float]) -> list[dict]:
    """The rows of one step from TRL's log (trl_compat.completion_log): its first `groups` prompt groups, `prompt` in
    full on every row (CompletionsLog blanks the repeats)."""
    prompts, completions = log["prompt"], log["completion"]
    rewards, advantages, extra = log["rewards"], log["advantages"], log["extra"]
    n = min(len(prompts), len(completions), groups * group_size)
    columns = {name: values for name, values in extra.items() if len(values) == len(prompts)}  # aligned ones only
    rows = []
    for i in range(n):
        scores = {name: _number(values[i]) if i < len(values) else None for name, values in rewards.items()}
        scored = [weights.get(name, 1.0) * value for name, value in scores.items() if value is not None]
        truncated = columns.get(TRUNCATED, [None] * len(prompts))[i]
        answer = columns.get(ANSWER, [None] * len(prompts))[i]
        rows.append({
            "step": step, "group": i // group_size, "prompt_id": prompt_id(prompts[i]), "prompt": prompts[i],
            "answer": None if answer is None else str(answer), "completion": model_text(completions[i]),
            "rewards": scores, "reward": sum(scored) if scored else None,
            "advantage": _number(advantages[i]) if i < len(advantages) else None,
            "truncated": None if truncated is None else bool(truncated), "tool_calls": tool_calls(completions[i]),
        })
    return rows


def with_first_prompts(rows: list[dict], texts: dict[str, object]) -> list[dict]:
    """`rows` with each prompt in full on its id's first row only (`texts`: every id's prompt)."""
    seen: set[str] = set()
    out = []
    for row in rows:
        first = row["prompt_id"] not in seen
        seen.add(row["prompt_id"])
        out.append({**row, "prompt": texts.get(row["prompt_id"]) if first else None})
    return out


class CompletionsLog:
    """The size policy above, writing through a RunDir. `logging_steps`: TRL's (the policy counts logged steps)."""
    def __init__(self, run_dir, every: int, groups: int, max_mb: float, group_size: int, weights: dict[str, float],
                 max_steps: int, logging_steps: int = 1):
        self.run_dir, self.every, self.groups = run_dir, every, groups
        self.max_bytes = int(max_mb * 1_000_000)
        self.group_size, self.weights, self.max_steps, self.logging_steps = (
            group_size, weights, max_steps, logging_steps)
        self._texts: Optional[dict] = None  # prompt id -> prompt, of every row seen (read from the file at first use)
        self._in_file: set[str] = set()  # the prompt ids the file has a row of

    def state(self) -> dict:
        return {"completions_every": self.every}

    def load(self, state: dict) -> None:
        """A resumed run: the policy's `completions_every` at the checkpoint."""
        self.every = max(self.every, int(state.get("completions_every", self.every)))

    def due(self, step: int) -> bool:
        if self.every <= 0:
            return False
        return step == self.max_steps or (step // self.logging_steps) % self.every == 0

    def _read(self) -> None:
        if self._texts is None:
            rows = self.run_dir.read_completions()
            self._texts = {row["prompt_id"]: row["prompt"] for row in rows if row.get("prompt") is not None}
            self._in_file = {row["prompt_id"] for row in rows}

    def write(self, step: int, log: dict) -> int:
        """Write `step`'s rows from TRL's log if the policy wants them; how many were written."""
        if not self.due(step):
            return 0
        self._read()
        rows = step_rows(step, log, self.group_size, self.groups, self.weights)
        for row in rows:
            self._texts.setdefault(row["prompt_id"], row["prompt"])
        while True:
            new = self._first_rows(rows)
            if self.run_dir.completions_bytes() + _size(new) <= self.max_bytes:
                break
            if not self._thin():  # the file is empty: what fits of this step alone
                while new and _size(new) > self.max_bytes:
                    rows = rows[:-1]
                    new = self._first_rows(rows)
                break
            if not self.due(step):
                return 0
        self.run_dir.append_completions(new)
        self._in_file.update(row["prompt_id"] for row in new)
        return len(new)

    def _first_rows(self, rows: list[dict]) -> list[dict]:
        """The new rows with the prompt in full only where the file has no row of that id yet."""
        seen = set(self._in_file)
        out = []
        for row in rows:
            out.append({**row, "prompt": None if row["prompt_id"] in seen else self._texts.get(row["prompt_id"])})
            seen.add(row["prompt_id"])
        return out

    def _thin(self) -> bool:
        """Drop every other written step from the file and double `every`; False when the file is empty."""
        rows = self.run_dir.read_completions()
        if not rows:
            return False
        self.every *= 2
        kept = with_first_prompts([row for row in rows if (row["step"] // self.logging_steps) % self.every == 0],
                                  self._texts)
        self.run_dir.write_completions(kept)
        self._in_file = {row["prompt_id"] for row in kept}
        return True


def _size(rows: list[dict]) -> int:
    return len("".join(json.dumps(row) + "\n" for row in rows).encode())


class CompletionFacts:
    """A reward function as TRL was handed it, that also logs per completion, through TRL's `log_extra` keyword, whether
    it was cut at max_completion_length (`truncated`: its last token is no end-of-sequence or pad token, TRL's test)
    and the gold answer (`answer`, when the data has that column). Otherwise the function itself, name and all."""

    def __init__(self, fn, stop_ids: set):
        self.fn, self.stop_ids = fn, set(stop_ids)
        self.__name__ = self.__qualname__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getattr__(self, name):  # failures, transcript, ...: the wrapped function's
        return getattr(self.fn, name)

    def __call__(self, prompts, completions, **kwargs):
        log = kwargs.get("log_extra")
        ids = kwargs.get("completion_ids")
        if log is not None and ids is not None and len(ids) == len(completions):
            log(TRUNCATED, [bool(row) and row[-1] not in self.stop_ids for row in ids])
            answers = kwargs.get(ANSWER)
            if isinstance(answers, list) and len(answers) == len(completions):
                log(ANSWER, answers)
        return self.fn(prompts=prompts, completions=completions, **kwargs)


def with_completion_facts(reward_funcs: list, stop_ids: set) -> list:
    """`reward_funcs` with the first plain (not async, not a reward model) function wrapped by CompletionFacts."""
    for i, fn in enumerate(reward_funcs):
        if callable(fn) and not is_async_callable(fn) and hasattr(fn, "__name__") and not hasattr(fn, "forward"):
            return [*reward_funcs[:i], CompletionFacts(fn, stop_ids), *reward_funcs[i + 1:]]
    return reward_funcs


# --------------------------------------------------------------------------- what the report shows

def markdown_rows(rows: list[dict], step: int, limit: int = 4) -> str:
    """A markdown table of `step`'s first `limit` rows (TensorBoard's text panel)."""
    shown = [row for row in rows if row["step"] == step][:limit]
    lines = ["| group | reward | advantage | truncated | completion |", "|---|---|---|---|---|"]
    for row in shown:
        text = row["completion"][:400].replace("|", "\\|").replace("\n", " ")
        reward = "-" if row.get("reward") is None else f"{row['reward']:.3f}"
        advantage = "-" if row.get("advantage") is None else f"{row['advantage']:.3f}"
        lines.append(f"| {row['group']} | {reward} | {advantage} | {row.get('truncated')} | {text} |")
    return "\n".join(lines)
