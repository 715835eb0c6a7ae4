"""What the model did with its tools, per GRPO step, for metrics.jsonl and the report.

TRL 1.15 logs `tools/call_frequency` (parsed calls per completion) and `tools/failure_frequency`; our wrappers
(tools.bounded) answer a failing call with text, so TRL counts no failures. `ToolUse` wraps the first reward
function TRL is handed (name and docstring kept: TRL logs rewards under it) and, per scored rollout batch, logs
through TRL's `log_metric` hook:
- `tools/written_per_completion`: <tool_call> blocks the model wrote (parsed or not);
- `tools/parsed_share`: the share of those TRL parsed into calls (a block that is not valid JSON of
  {"name", "arguments"} stays text and is never run);
- `tools/ran_share`: the share of the calls run in that batch that answered without an error or a timeout
  (from the wrappers' counts);
- `tools/completions_with_calls`: completions with at least one parsed call.
It keeps the batch's first completion; `transcript_text` renders it, and MetricsWriter stores it as
`tools/transcript` in the row of every checkpoint step and the last one. Pure Python: no trl, no backend.
"""
from __future__ import annotations

import json

from lowvram_grpo.report.records import TRANSCRIPT_KEY  # noqa: F401  (tool_metrics.X)

TOOL_CALL_OPEN = "<tool_call>"
MAX_TRANSCRIPT_CHARS = 4000


def _messages(completion) -> list[dict]:
    if isinstance(completion, list):
        return [m for m in completion if isinstance(m, dict)]
    return [{"role": "assistant", "content": str(completion)}]


def tool_use(completions: list) -> dict:
    """The per-batch numbers of the module docstring (without ran_share), from the completions TRL scored."""
    written = parsed = with_calls = 0
    for completion in completions:
        calls_here = 0
        for message in _messages(completion):
            if message.get("role") != "assistant":
                continue
            calls = message.get("tool_calls") or []
            content = message.get("content") if isinstance(message.get("content"), str) else ""
            calls_here += len(calls)
            parsed += len(calls)
            written += len(calls) + content.count(TOOL_CALL_OPEN)  # a parsed block leaves the content
        with_calls += calls_here > 0
    n = max(len(completions), 1)
    return {"tools/written_per_completion": written / n,
            "tools/parsed_share": parsed / written if written else None,
            "tools/completions_with_calls": with_calls / n}


def transcript_text(completion) -> str:
    """One completion as a readable transcript: the model's turns, its calls, the tools' answers."""
    parts = []
    for message in _messages(completion):
        role = message.get("role", "?")
        content = message.get("content")
        content = content if isinstance(content, str) else json.dumps(content)
        if role == "tool":
            parts.append(f"[tool {message.get('name', '?')}] {content}")
            continue
        if content:
            parts.append(f"[{role}] {content}")
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(f"[{role} calls] {function.get('name')}({json.dumps(function.get('arguments'))})")
    text = "\n".join(parts)
    return text if len(text) <= MAX_TRANSCRIPT_CHARS else text[:MAX_TRANSCRIPT_CHARS] + " ...(cut)"


class ToolUse:
    """The reward function TRL was handed, also logging the batch's tool use (see the module docstring)."""
    def __init__(self, fn, tools: list):
        self.fn, self.tools = fn, tools
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = fn.__doc__
        self.latest = None  # the last scored batch's first completion
        self._counted = self._counts()

    @property
    def failures(self) -> int:
        return getattr(self.fn, "failures", 0)

    def _counts(self) -> tuple[int, int]:
        calls = sum(t.calls for t in self.tools)
        return calls, sum(t.failures + t.timeouts for t in self.tools)

    def __call__(self, prompts, completions, **kwargs):
        log = kwargs.get("log_metric")
        if completions:
            self.latest = completions[0]
            calls, bad = self._counts()
            new_calls, new_bad = calls - self._counted[0], bad - self._counted[1]
            self._counted = (calls, bad)
            if log is not None:
                numbers = tool_use(completions)
                numbers["tools/ran_share"] = (new_calls - new_bad) / new_calls if new_calls else None
                for key, value in numbers.items():
                    if value is not None:
                        log(key, value)
        return self.fn(prompts=prompts, completions=completions, **kwargs)

    def transcript(self):
        return None if self.latest is None else transcript_text(self.latest)


def with_tool_use(reward_funcs: list, tools: list) -> tuple[list, "ToolUse | None"]:
    """`reward_funcs` with the first wrapped by ToolUse when the run has tools (else as they are, and None)."""
    if not tools or not reward_funcs:
        return reward_funcs, None
    recorder = ToolUse(reward_funcs[0], tools)
    return [recorder, *reward_funcs[1:]], recorder
