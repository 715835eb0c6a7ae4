"""Held-out answers with tools: the multi-turn loop at evaluation time, on whichever engine the handle generates with.

Training runs TRL's own tool loop; measuring a tool-using model without its tools would measure another task. Here,
per held-out question: the conversation is rendered with the tools' schemas (the model's chat template), a turn is
generated, parsed with the tokenizer's `response_template` (`tokenizer.parse_response`, as TRL parses), every call
is run through the same bounded tools training uses (text within tools.timeout_seconds, errors as text), the
results are appended as `tool` messages and the model writes on, at most `tools.max_turns` rounds; the answer
scored is the model's last turn (as the rewards read it), its token count every turn's. With an environment, each
question gets a fresh instance, `reset(**row)` first (its text appended to the question, as TRL does).
Turns are generated in batches across questions (one engine call per round). Pure Python: no trl.
"""
from __future__ import annotations

import json
from typing import Optional

from lowvram_grpo.model.handle import Completion, LoraRequest, SamplingParams
from lowvram_grpo.task.tools import environment_methods
from lowvram_grpo.task.user_code import of as user_code_of


def _tools_for(plan, rows: list[dict]) -> tuple[list[list], list[list[dict]]]:
    """Per row: the tools it may call and its conversation (an environment's reset text appended)."""
    user = user_code_of(plan)  # the run's tools and environment, looked up once (user_code.load)
    functions = user.tool_functions()
    bounded_cls = user.bounded_environment()
    tools, conversations = [], []
    for row in rows:
        messages = [dict(m) for m in row["prompt"]]
        found = list(functions)
        if bounded_cls is not None:
            env = user.build_environment(bounded_cls)
            observation = env.reset(**row)
            if isinstance(observation, str) and isinstance(messages[-1].get("content"), str):
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            found += [getattr(env, name) for name, _ in environment_methods(bounded_cls)]
        tools.append(found)
        conversations.append(messages)
    return tools, conversations


def _well_formed(calls) -> bool:
    """Tool calls as TRL 1.15 accepts them (trl.chat_template_utils._validate_tool_calls): a list of dicts, each a
    {"function": {"name": str, ...}} or a flat {"name": str, ...}. The parser turns any JSON in a <tool_call> block
    into a call, so a model that writes `<tool_call>"6 * 7"</tool_call>` gives a call that is a string."""
    if calls is None:
        return True
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return False
    return True


def _parsed(tokenizer, text: str, prefix: str) -> dict:
    """The turn as a message (content, tool_calls); text the parser cannot read, or whose calls are not well formed,
    stays the turn's content (as TRL's parse_response falls back to the text)."""
    try:
        message = dict(tokenizer.parse_response(text, prefix=prefix) or {})
    except Exception:  # a malformed call: the model's text, not an error of the run
        return {"role": "assistant", "content": text}
    if not _well_formed(message.get("tool_calls")):
        return {"role": "assistant", "content": text}
    return {"role": "assistant", **{k: v for k, v in message.items() if k != "role"}}


def _call(tool_by_name: dict, call: dict) -> tuple[str, str, bool]:
    """(name, result text, ran without an error) for one parsed call; never raises."""
    function = call.get("function", call)  # TRL's nested form, or a flat {"name", "arguments"}
    name = str(function.get("name"))
    arguments = function.get("arguments")
    if arguments is None:  # a call without arguments (TRL: {})
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return name, f"error: arguments of {name!r} are not a JSON object", False
    if name not in tool_by_name:
        return name, f"error: there is no tool {name!r}", False
    if not isinstance(arguments, dict):
        return name, f"error: arguments of {name!r} are not a JSON object", False
    try:
        text = tool_by_name[name](**arguments)  # bounded: text within the limit, errors as text
    except TypeError as exc:  # arguments that do not fit the signature
        return name, f"error: TypeError: {exc}", False
    return name, str(text), not str(text).startswith("error: ")


def generate_with_tools(handle, rows: list[dict], plan, params: SamplingParams,
                        lora_request: Optional[LoraRequest]) -> tuple[list[Completion], list[list[dict]], dict]:
    """`plan`: a plans.EvalPlan (or any phase's plan: its tools, prompts and rewards). Each row's answer (its last turn)
    with its tokens over all turns, each row's turns and tool messages, and the batch's counts: tool calls, calls that
    ran without an error, answers with at least one call."""
    tokenizer = handle.text_tokenizer
    tools, conversations = _tools_for(plan, rows)
    turns: list[list[dict]] = [[] for _ in rows]
    answers, tokens = [""] * len(rows), [0] * len(rows)
    counts = {"calls": 0, "ran": 0, "answers_with_calls": 0}
    active = list(range(len(rows)))
    for round_number in range(plan.tools.max_turns + 1):
        prefixes = [tokenizer.apply_chat_template(conversations[i], tools=tools[i] or None, tokenize=False,
                                                  add_generation_prompt=True, **plan.prompts.template_kwargs)
                    for i in active]
        generated = handle.engine.generate(prefixes, params, lora_request)
        still = []
        for i, prefix, completion in zip(active, prefixes, generated):
            tokens[i] += completion.num_tokens
            message = _parsed(tokenizer, completion.text, prefix)
            turns[i].append(message)
            answers[i] = message.get("content") or ""
            calls = message.get("tool_calls") or []
            if not calls or round_number == plan.tools.max_turns:  # answered, or out of rounds
                continue
            if round_number == 0:
                counts["answers_with_calls"] += 1
            conversations[i].append(message)
            by_name = {t.__name__: t for t in tools[i]}
            for call in calls:
                name, text, ok = _call(by_name, call)
                counts["calls"] += 1
                counts["ran"] += ok
                result = {"role": "tool", "name": name, "content": text}
                conversations[i].append(result)
                turns[i].append(result)
            still.append(i)
        active = still
        if not active:
            break
    return [Completion(a, t) for a, t in zip(answers, tokens)], turns, counts
