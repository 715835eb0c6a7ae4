"""Tools the model may call while it answers: multi-turn GRPO through TRL 1.15's own tool loop (`tools.*`).

TRL's GRPOTrainer takes `tools=[functions]`: it renders their JSON schemas (built by transformers'
`get_json_schema` from each function's type hints and Google-style docstring) into the prompt through the
model's chat template, parses `<tool_call>` blocks out of each completion with the tokenizer's
`response_template`, calls the named function with the parsed arguments, appends the result as a `tool`
message and lets the model write on, at most `max_tool_calling_iterations` rounds (`tools.max_turns`). The
tool results' tokens are masked out of the loss (TRL's `tool_mask`). This module is the plain-Python side:

- `BUILTIN_TOOLS`: the built-in tools by name; `calculator`, arithmetic only, evaluated by walking an
  allow-list of `ast` nodes (never eval/exec), bounded in length, nesting, exponent and size;
- a user's tools file (`tools.module`) imported as a reward file is (user_files.import_user_file), its
  functions looked up by `tools.names`, and the checks that need no transformers (a function defined with
  def, a docstring, a type hint on every parameter, no two tools under one name); checks.check_tools adds
  transformers' own `get_json_schema` on top, before the model loads;
- `bounded`: what TRL is handed instead of each function. The model's text is data: its arguments only
  ever reach the tool as keyword values, and every call ends in bounded time with text. A call that raises
  returns "error: <Type>: <message>"; one that runs past `tools.timeout_seconds` returns an error text
  (the call runs in a daemon thread and the wait stops at the limit; a runaway pure-Python call keeps its
  thread until it ends, and a tool with MAX_RUNAWAY calls still running gets no new one); a result is text,
  cut at MAX_RESULT_CHARS. The wrapper keeps the function's name, signature, annotations and docstring
  (functools.wraps), so TRL and transformers build the same schema;
- the tool-calling chat format the built-in models ship with (`tool_chat_template`,
  `TOOL_RESPONSE_TEMPLATE`): ChatML with Qwen2.5's `<tool_call>{json}</tool_call>` calls and
  `<tool_response>` results, rendering exactly the model's old ChatML when no tools are given.

Pure Python: never imports trl, transformers or torch (a tools file may, at its own cost).
"""
from __future__ import annotations

import ast
import asyncio
import functools
import inspect
import json
import math
import operator
import threading
from typing import Callable, Optional

from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.task.user_files import first_line, import_user_file, own_functions

MAX_RESULT_CHARS = 2000  # a tool result longer than this is cut (it becomes prompt tokens of the next turn)
MAX_RUNAWAY = 4  # timed-out calls of one tool still running: beyond this, that tool is not started again


# --------------------------------------------------------------------------- the built-in calculator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # |exponent| of **
MAX_MAGNITUDE = 10 ** 100  # every number and intermediate result: |x| <= 1e100
MAX_DEPTH = 40  # nesting of operators (the parser refuses deep parentheses itself)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_ALLOWED = "numbers, + - * / // % ** and parentheses only"


class CalculatorError(ValueError):
    """An expression the calculator refuses; its message is the tool's answer (after "error: ")."""


def _bounded_number(value):
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("the result is too large (the calculator keeps numbers within 1e100)")
    return value


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {exponent} is too large (at most {MAX_EXPONENT} either way)")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("zero to a negative power")
    if abs(base) > 1 and exponent * math.log10(abs(base)) > 100:  # |result| > 1e100: refused before computing it
        raise CalculatorError("the result is too large (the calculator keeps numbers within 1e100)")
    return base ** exponent


_KINDS = {ast.Call: "a function call", ast.Attribute: "attribute access", ast.Lambda: "a lambda",
          ast.ListComp: "a comprehension", ast.SetComp: "a comprehension", ast.DictComp: "a comprehension",
          ast.GeneratorExp: "a comprehension", ast.Subscript: "indexing", ast.Compare: "a comparison",
          ast.BoolOp: "and/or", ast.IfExp: "if/else", ast.NamedExpr: "an assignment (:=)"}


def _what(node: ast.AST) -> str:
    """What an expression part is, for the error text."""
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the {type(node.value).__name__} value {repr(node.value)[:20]}"
    if isinstance(node, (ast.UnaryOp, ast.BinOp)):
        return f"the operator {type(node.op).__name__}"
    return _KINDS.get(type(node), f"a {type(node).__name__.lower()}")


def _walk(node: ast.AST, depth: int = 0):
    """The value of an allow-listed expression tree: numbers, unary +/-, + - * / // % **. Anything else raises."""
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex, str, bytes, None
        return _bounded_number(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("^ is not a power here: write ** (2 ** 3 = 8)")
        if isinstance(node.op, ast.Pow) or type(node.op) in _OPERATORS:
            left, right = _walk(node.left, depth + 1), _walk(node.right, depth + 1)
            if isinstance(node.op, ast.Pow):
                return _bounded_number(_power(left, right))
            return _bounded_number(_OPERATORS[type(node.op)](left, right))
    raise CalculatorError(f"{_what(node)} is not allowed: {_ALLOWED}")


def evaluate(expression) -> "int | float":
    """The value of an arithmetic expression (CalculatorError, ZeroDivisionError or OverflowError otherwise).
    `ast.parse(mode="eval")` only parses; the tree is evaluated by `_walk`, never compiled or run."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, e.g. \"(2 + 3) * 4\"; got {type(expression).__name__}")
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = text.removesuffix("=").strip()  # "12 * 3 =" as people write it
    if not text:
        raise CalculatorError(f"the expression is empty: give one such as \"(2 + 3) * 4\" ({_ALLOWED})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a null byte
        raise CalculatorError(f"not an arithmetic expression: {_ALLOWED}") from None
    return _walk(tree.body)


def format_number(value) -> str:
    """Plain text: integers without '.0', other floats to 12 significant digits (0.1 + 0.2 -> 0.3)."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


def calculator(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example (12 + 3) * 4 / 5
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: the result is too large (the calculator keeps numbers within 1e100)"
    except Exception as exc:  # defensive: every input is bounded above, but a tool never raises
        return f"error: {type(exc).__name__}: {exc}"[:300]


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}


# --------------------------------------------------------------------------- a user's tools file

_first_line = first_line  # user_files: 'Type: message', one line


def load_tool_module(path: str):
    """Import a user's tools file (user_files: cached by path and modification time). ConfigError says what is wrong."""
    return import_user_file(path, "tools.module", "tool functions", ConfigError)


def module_tool_names(module) -> list[str]:
    """The public functions a tools file defines itself (not the ones it imports)."""
    return own_functions(module)


def lookup_tool(name: str, module=None) -> Callable:
    """A tool by name: a function of the user's tools file, or a built-in tool."""
    if module is not None and name in vars(module):
        if name in BUILTIN_TOOLS:
            raise ConfigError(f"tools.module {module.__file__} defines {name!r}, the name of a built-in tool: "
                              "rename it")
        return getattr(module, name)
    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    where = f"; {module.__file__} defines: {', '.join(module_tool_names(module)) or 'no functions'}" if module else ""
    raise ConfigError(f"unknown tool {name!r} in tools.names: choose from {', '.join(BUILTIN_TOOLS)}{where}"
                      + ("" if module else " (or give your own in tools.module)"))


def check_tool_function(name: str, fn, where: str, method: bool = False) -> None:
    """What TRL and transformers need of a tool, checked without them: a function defined with def (TRL calls
    it by `__name__`), sync or async, not a generator; a docstring; a type hint on every parameter.
    checks.check_tools then builds its JSON schema with transformers (Args: descriptions, supported types)."""
    if not inspect.isfunction(fn):
        raise ConfigError(f"tool {name!r} in {where} is a {type(fn).__name__}, not a function defined with def")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigError(f"tool {name!r} in {where} is a generator: a tool returns its result (text)")
    if fn.__name__ == "<lambda>":
        raise ConfigError(f"tool {name!r} in {where} is a lambda: define it with def, with a docstring and type hints")
    if not (inspect.getdoc(fn) or "").strip():
        raise ConfigError(f"tool {name!r} in {where} has no docstring: the model sees a tool through its docstring and "
                          "type hints; write one with an Args: section describing each parameter")
    for parameter in list(inspect.signature(fn).parameters.values())[1 if method else 0:]:  # a method's self
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigError(f"tool {name!r} in {where} takes *{parameter.name}: a tool's parameters must be named "
                              "ones, each with a type hint")
        if parameter.annotation is inspect.Parameter.empty:
            raise ConfigError(f"tool {name!r} in {where}: parameter {parameter.name!r} has no type hint: annotate "
                              "every parameter (e.g. expression: str)")


def selected_tools(tools_config) -> list[Callable]:
    """The functions `tools.names` picks (built-in or from `tools.module`), checked (ConfigError): each one's
    shape (check_tool_function), and no two tools under one name (the model calls a tool by its name)."""
    if not tools_config.names:
        return []
    module = load_tool_module(tools_config.module) if tools_config.module else None
    chosen, by_name = [], {}
    for name in tools_config.names:
        fn = lookup_tool(name, module)
        where = f"tools.module {tools_config.module}" if fn is not BUILTIN_TOOLS.get(name) else "the built-in tools"
        check_tool_function(name, fn, where)
        called = fn.__name__
        if called in by_name:
            raise ConfigError(f"tools.names: {by_name[called]!r} and {name!r} are both the function {called!r}, and "
                              "the model calls a tool by its function's name: list it once, or give each its own def")
        by_name[called] = name
        chosen.append(fn)
    return chosen


def tool_functions(tools_config) -> list[Callable]:
    """What TRL's GRPOTrainer is handed as `tools`: the selected functions, each wrapped by `bounded`."""
    return [bounded(fn, tools_config.timeout_seconds) for fn in selected_tools(tools_config)]


# --------------------------------------------------------------------------- an environment (environment.*)

# What TRL 1.15's GRPOTrainer reads of an environment class by these names (not tools); every other public method is
# one.
ENVIRONMENT_HOOKS = ("reset", "get_reward")


def environment_class(name: Optional[str], module_path: Optional[str]) -> Optional[type]:
    """The class `name` (environment.name) in the file `module_path` (environment.module), checked without building
    it (ConfigError, one line): a class, with a callable reset, and at least one public method, each a tool as
    check_tool_function wants (its self aside). None without an environment."""
    if not name:
        return None
    module = import_user_file(module_path, "environment.module", "an environment class", ConfigError)
    cls = vars(module).get(name)
    where = f"environment.module {module_path}"
    if not inspect.isclass(cls):
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
        what = "is not a class" if cls is not None else "is not defined there"
        raise ConfigError(f"environment.name {name!r} {what}: {where} defines the classes "
                          f"{', '.join(found) or '(none)'}")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"environment {name!r} in {where} has no reset method: TRL calls reset() before "
                          "each prompt (return None, or text to append to the prompt)")
    methods = environment_methods(cls)
    if not methods:
        raise ConfigError(f"environment {name!r} in {where} has no public method for the model to call: "
                          "each public method (not reset or get_reward) is a tool")
    for method, fn in methods:
        check_tool_function(f"{name}.{method}", fn, where, method=True)
    return cls


def environment_methods(cls: type) -> list[tuple[str, Callable]]:
    """The methods TRL makes tools of, as it finds them: public functions on the class (inherited too), but reset
    and get_reward."""
    return [(n, f) for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ENVIRONMENT_HOOKS]


def bounded_environment(cls: type, timeout_seconds: float) -> type:
    """`cls` with every tool method bounded (each call ends within the limit with text, as `bounded`); reset and
    get_reward as they are. What TRL's environment_factory builds: one instance per concurrent rollout."""
    wrapped = {name: bounded(fn, timeout_seconds) for name, fn in environment_methods(cls)}
    return type(cls.__name__, (cls,), {**wrapped, "__module__": cls.__module__, "__doc__": cls.__doc__})


def build_environment(cls: type, where: str):
    """One instance of the environment (its constructor is the user's code): ConfigError, one line, if it fails."""
    try:
        return cls()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConfigError(f"environment {cls.__name__!r} in {where} cannot be built with no arguments, as TRL builds "
                          f"it: {first_line(exc)}") from None


def check_tool_prompts(rows: list[dict], source: str) -> None:
    """TRL runs tools only for conversational prompts (chat messages): text prompts are refused (ConfigError)."""
    if rows and isinstance(rows[0].get("prompt"), str):
        raise ConfigError(f"tools need chat-message prompts, and the data {source} has text prompts (TRL's 'prompt' "
                          "column as plain text): give a question column (data.question_column) or 'prompt' as a list "
                          "of {'role', 'content'} messages, or drop tools.names")


# --------------------------------------------------------------------------- every call bounded, every answer text

def error_text(exc: BaseException) -> str:
    """A failed call as the tool's answer: "error: <Type>: <message's first line>"."""
    return f"error: {_first_line(exc)}"


def as_text(result) -> str:
    """A tool's return value as the text the model reads: text as it is, lists and mappings as JSON, anything
    else through str(); cut at MAX_RESULT_CHARS."""
    if isinstance(result, str):
        text = result
    elif isinstance(result, (dict, list, tuple)):
        try:
            text = json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # a circular structure
            text = str(result)
    else:
        text = str(result)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f" ... [cut at {MAX_RESULT_CHARS} characters]"
    return text


def bounded(fn: Callable, timeout_seconds: float) -> Callable:
    """`fn` as a tool that always answers with text within `timeout_seconds`: the call (an async tool on an
    event loop of its own) and the conversion of its result run in a daemon thread; a failure is
    error_text, a call still running at the limit is left to its thread and answered with a timeout error
    (its result is dropped). Name, signature, annotations and docstring are `fn`'s (functools.wraps). The
    wrapper is a plain function, so TRL calls it synchronously whether `fn` is async or not. Counts:
    `calls`, `failures` (raised), `timeouts`."""
    name = fn.__name__
    is_async = inspect.iscoroutinefunction(fn)
    running: list[threading.Thread] = []  # timed-out calls whose thread has not ended

    @functools.wraps(fn)
    def tool(*args, **kwargs):
        tool.calls += 1
        running[:] = [t for t in running if t.is_alive()]
        if len(running) >= MAX_RUNAWAY:
            tool.failures += 1
            return (f"error: TimeoutError: tool {name!r} was not started: {len(running)} earlier calls are still "
                    f"running past the {timeout_seconds:g} s limit")
        answer: dict = {}

        def work():
            try:
                result = asyncio.run(fn(*args, **kwargs)) if is_async else fn(*args, **kwargs)
                answer["text"] = as_text(result)
            except BaseException as exc:  # the tool's code, called with the model's arguments: anything can happen
                answer["text"], answer["failed"] = error_text(exc), True

        worker = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
        worker.start()
        worker.join(timeout_seconds)
        if worker.is_alive():
            running.append(worker)
            tool.timeouts += 1
            return f"error: TimeoutError: tool {name!r} did not finish within {timeout_seconds:g} seconds"
        if answer.get("failed"):
            tool.failures += 1
        return answer.get("text", f"error: tool {name!r} gave no answer")

    tool.calls = tool.failures = tool.timeouts = 0
    return tool


# -------------------------------------------------------------------- the built-in models' tool-calling chat format

_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more of these functions, given as JSON signatures within "
    "<tools></tools>:\\n<tools>")
_TOOLS_CALL_FORMAT = (
    "\\n</tools>\\n\\nTo call one, write a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call>")


def tool_chat_template(default_system: Optional[str] = None) -> str:
    """A ChatML chat template that renders tools (Qwen2.5's form: the tools' JSON schemas in the system
    message, an assistant's calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, tool
    results as a user turn of `<tool_response>` blocks). Without tools it renders exactly plain ChatML (every
    message as `<|im_start|>role\\ncontent<|im_end|>\\n`), after `default_system` as a system message when
    the conversation has none and a default is given (SmolLM2's own template does that)."""
    default = json.dumps(default_system or "")
    return (
        "{%- set default_system = " + default + " %}"
        "{%- set has_system = messages and messages[0]['role'] == 'system' %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- set system = messages[0]['content'] if has_system else default_system %}"
        "{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
        "{{- '" + _TOOLS_PREAMBLE + "' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '" + _TOOLS_CALL_FORMAT + "<|im_end|>\\n' }}"
        "{%- elif not has_system and default_system %}"
        "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if loop.first and message['role'] == 'system' and tools %}"
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
        "{{- '<|im_start|>assistant' }}"
        "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
        "{{- tool_call.arguments | tojson }}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


# How transformers (>= 5.13, tokenizer.parse_response) reads a completion written in that format: the text as
# `content`, each `<tool_call>` block's JSON as a tool call (TRL's own Qwen3 template, without <think>).
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
