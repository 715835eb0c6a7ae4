"""Reward functions, by name. This is where rewards are computed.

Each function has TRL's reward signature `(prompts, completions, **kwargs) -> list[float]`: one score
per completion. Completions may be plain strings or conversational (a list of `{"role", "content"}`
messages); `answer` (the gold final answer, one per completion) arrives as a keyword from the
dataset column of that name.

The five are the Unsloth Llama-3.1-8B GRPO notebook's, with three deliberate fixes:
- the format regexes match across lines (`re.DOTALL`): the notebook's `.*?` without it never matches a
  reasoning of more than one line, so its strict/soft rewards miss most well-formed answers;
- `correctness` compares answers, not strings (answers.py): "1,000", "$1000.00" and "1000" all equal a
  gold "1,000", and "3/4", "\\frac{3}{4}" and "75%" a gold "0.75", as a careful human grader would score them;
- `int` and `correctness` read one answer (answers.answer_block): the notebook's `int` read the text after
  the last "<answer>", `correctness` the last closed block, so the two could judge different answers.

`REWARD_MAX` gives each function's best score, used by tests and the report.

TRL 1.15's reward contract, all of it (GRPOTrainer._calculate_rewards): a reward is a function, a
`functools.partial` or a callable object, sync or `async`; it is called with `prompts`, `completions`,
`completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every dataset column as keywords
(`TRL_KEYWORDS`); it returns one value per completion, any iterable of them (list, tuple, numpy array,
tensor), each a real number or None ("does not apply to this sample": TRL leaves it out of that
completion's sum; NaN reads the same). A name with a '/' (a hub id) or of a local folder in
`rewards.names` is a reward model, scored as TRL scores one given by name (`reward_models.RewardModel`).
A preset may add its own rewards from a file (`rewards.module: my_rewards.py`), selectable by name.
TRL gets every function through `guarded`, which refuses, with one line naming the function, only what
TRL itself would fail on (a failure, a wrong count, a value that is not a number), or scores it 0
(`rewards.on_error: zero`); an infinite score passes as in TRL, with a warning. `check_rewards` checks
the configured rewards against the run's data before anything heavy: the built-in answer rewards need a
gold answer, and a user's function is called once on the first training row, as TRL will call it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import random
import re
import sys
import types
from pathlib import Path
from typing import Callable, Optional

from lowvram_grpo.core.errors import ConfigError, RewardError
from lowvram_grpo.task import answers
from lowvram_grpo.task.reward_models import RewardModel, is_reward_model, model_id_name
from lowvram_grpo.task.user_files import first_line, import_user_file, own_functions

# The Unsloth GRPO notebook's system prompt (leading/trailing newlines dropped).
NOTEBOOK_SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""

RewardFn = Callable[..., list]
# The keywords TRL 1.15's GRPOTrainer passes every reward function besides the dataset's columns
# (_calculate_rewards; `environments` only with an environment_factory, which this package does not use).
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
REWARDS: dict[str, RewardFn] = {}
REWARD_MAX: dict[str, float] = {}
NEEDS_GOLD: set[str] = set()  # built-in rewards that score against the gold answer (the `answer` column)


def register(name: str, max_score: float, needs_gold: bool = False):
    """Add a reward to the registry under `name` (also its `__name__`, which TRL uses in its logs)."""
    def wrap(fn: RewardFn) -> RewardFn:
        fn.__name__ = name
        fn.__qualname__ = name
        REWARDS[name] = fn
        REWARD_MAX[name] = max_score
        if needs_gold:
            NEEDS_GOLD.add(name)
        return fn

    return wrap


# --------------------------------------------------------------------------- text helpers

def completion_text(completion) -> str:
    """The generated text of one completion, plain or conversational: with tools (several messages: the model's
    turns and the tools' results) the model's own last turn, never a tool's result that TRL left last."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        own = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return str((own or completion)[-1].get("content") or "")
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion)


def extract_hash_answer(text: str) -> Optional[str]:
    """GSM8K's gold answer: what follows '####' (None when the marker is missing)."""
    if "####" not in text:
        return None
    return text.split("####")[-1].strip()


def _gold_list(answer, n: int) -> list:
    if answer is None:
        raise ValueError("the dataset has no 'answer' column: correctness needs the gold answers")
    if isinstance(answer, (str, int, float)):
        return [str(answer)] * n
    return [None if a is None else str(a) for a in answer]


# --------------------------------------------------------------------------- the notebook's five

@register("correctness", 2.0, needs_gold=True)
def correctness_reward(prompts, completions, answer=None, **kwargs) -> list:
    """2.0 when the stated answer equals the gold answer (answers.is_correct: exact for plain numbers,
    math-verify for fractions, LaTeX, percentages); 0.0 otherwise; None (TRL: does not apply) for a
    row without a gold answer, and for one the checker failed on (answers.CheckerError: unchecked, not wrong).

    The stated answer is `answers.stated_answer`: with <answer> tags the tagged text of the last closed
    block (its last number if it has words around it; a block cut off before </answer> counts); without
    tags the whole completion must be just the answer, as in the notebook."""
    return _scored_against_gold(completions, answer, answers.stated_answer)


def _scored_against_gold(completions, answer, stated) -> list:
    """2.0 / 0.0 per completion as `stated(text)` equals its gold answer; None without a gold answer or where the
    checker failed (unchecked, not wrong)."""
    scores = []
    for completion, gold in zip(completions, _gold_list(answer, len(completions))):
        if gold is None:
            scores.append(None)
            continue
        try:
            right = answers.is_correct(stated(completion_text(completion)), gold)
        except answers.CheckerError:
            scores.append(None)
            continue
        scores.append(2.0 if right else 0.0)
    return scores


@register("int", 0.5)
def int_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the answer block (the one `correctness` reads) is just an integer ('42', '-3', '1,000'):
    nudges towards a bare number."""
    return [0.5 if answers.bare_integer(completion_text(c)) is not None else 0.0 for c in completions]


_STRICT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?$", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)


@register("strict_format", 0.5)
def strict_format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the whole completion is exactly <reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>."""
    return [0.5 if _STRICT.match(completion_text(c)) else 0.0 for c in completions]


@register("soft_format", 0.5)
def soft_format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when a <reasoning> block is followed by an <answer> block anywhere in the completion."""
    return [0.5 if _SOFT.search(completion_text(c)) else 0.0 for c in completions]


def count_xml(text: str) -> float:
    """1/8 for each well-placed tag, minus a little for text after </answer> (the notebook's rule)."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


@register("xmlcount", 0.5)
def xmlcount_reward(prompts, completions, **kwargs) -> list[float]:
    """Partial credit per tag, so a model that writes some of the format already gets a signal."""
    return [count_xml(completion_text(c)) for c in completions]


# --------------------------------------------------------------------------- the `think` format

# The system prompt of `data.answer_format: think` (a thinking model writes its own <think> block).
THINK_SYSTEM_PROMPT = "Think step by step inside <think> </think>, then give the final answer after </think>."
# The rewards of each answer format (`data.answer_format`); a built-in reward of one format is refused with the other.
FORMAT_REWARDS = {"xml": ("xmlcount", "soft_format", "strict_format", "int", "correctness"),
                  "think": ("think_format", "think_correctness")}


@register("think_correctness", 2.0, needs_gold=True)
def think_correctness_reward(prompts, completions, answer=None, **kwargs) -> list:
    """2.0 when the answer after the last </think> (`answers.think_stated_answer`: its final answer) equals the gold
    answer (`answers.is_correct`); 0.0 otherwise, and without a closed </think>; None for a row without a gold
    answer and for one the checker failed on (unchecked, not wrong)."""
    return _scored_against_gold(completions, answer, answers.think_stated_answer)


@register("think_format", 0.5)
def think_format_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the completion is one <think>...</think> block (its opening tag may be the prompt's), then a
    non-empty answer (`answers.think_ok`)."""
    return [0.5 if answers.think_ok(completion_text(c)) else 0.0 for c in completions]


def think_formatted(reasoning: str, answer: str) -> str:
    """A completion in the `think` format (priming examples and tests): the reasoning thought, then the answer."""
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{answer.strip()}"


def formatted(answer_format: str, reasoning: str, answer: str) -> str:
    """A worked example written in `answer_format` (`xml` or `think`)."""
    return think_formatted(reasoning, answer) if answer_format == "think" else xml_formatted(reasoning, answer)


def well_formed(answer_format: str, text: str) -> bool:
    """The held-out `format_rate`'s test for `answer_format`: `format_ok` (xml) or `answers.think_ok` (think)."""
    return answers.think_ok(text) if answer_format == "think" else format_ok(text)


# --------------------------------------------------------------------------- shaping

@register("brevity", 0.5)
def brevity_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 x (1 - characters/1000), at least 0: a small push to finish before max_completion_length
    (completions cut off there earn no format or correctness reward). Any text earns some of it, so
    even an untrained model's group has reward differences to learn from."""
    return [0.5 * max(0.0, 1.0 - len(completion_text(c)) / 1000.0) for c in completions]


def format_ok(text: str) -> bool:
    """The format the report counts as 'well formed' (format_rate): a reasoning block then an answer block."""
    return bool(_SOFT.search(text))


def xml_formatted(reasoning: str, answer: str) -> str:
    """A completion in the exact format the strict reward wants (used for priming examples and tests)."""
    return f"<reasoning>\n{reasoning.strip()}\n</reasoning>\n<answer>\n{answer.strip()}\n</answer>\n"


# --------------------------------------------------------------------------- TRL's contract, checked

def is_async_callable(fn) -> bool:
    """Whether calling `fn` returns a coroutine, as TRL decides it (trl.trainer.utils.is_async_callable):
    partials unwrapped, and a callable object's own `__call__`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def callable_name(fn) -> str:
    """The name TRL logs a reward under (trl.trainer.utils.get_callable_name)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def check_scores(name: str, scores, n: int) -> list:
    """`scores` as TRL takes them: `n` values, each a float or None (None and NaN: the reward does not apply
    to that completion); RewardError naming the function for what TRL would fail on."""
    if isinstance(scores, (str, bytes)) or not hasattr(scores, "__iter__"):
        raise RewardError(
            f"reward {name!r} returned {type(scores).__name__}, not a list of {n} numbers (one per completion)")
    values = list(scores)
    if len(values) != n:
        raise RewardError(
            f"reward {name!r} returned {len(values)} scores for {n} completions: return one number per completion")
    checked = []
    for i, value in enumerate(values):
        if value is None:
            checked.append(None)
            continue
        try:
            if isinstance(value, (str, bytes, complex)):
                raise TypeError
            # what torch.tensor(..., dtype=float32) takes: numbers, numpy, 1-element tensors
            checked.append(float(value))
        except (TypeError, ValueError, OverflowError):
            raise RewardError(f"reward {name!r} returned {value!r} ({type(value).__name__}) as score {i}: scores must "
                              "be numbers (or None where the reward does not apply)") from None
    return checked


_first_line = first_line  # user_files: 'Type: message', one line


_UNEXPECTED_KEYWORD = re.compile(r"unexpected keyword argument '(\w+)'")


def _problem(name: str, exc: Exception) -> RewardError:
    if isinstance(exc, RewardError):
        return exc
    missing = _UNEXPECTED_KEYWORD.search(str(exc)) if isinstance(exc, TypeError) else None
    if missing:
        return RewardError(f"reward {name!r} does not take the keyword {missing.group(1)!r} that TRL passes it (TRL "
                           "passes prompts, completions, completion_ids, trainer_state, log_extra, log_metric and "
                           "every dataset column): add **kwargs to its parameters")
    return RewardError(f"reward {name!r} raised {_first_line(exc)}")


def guarded(fn: RewardFn, name: str, on_error: str = "stop", warn=None) -> RewardFn:
    """`fn` with its scores checked (`check_scores`), sync or async like `fn` (TRL awaits async ones). A
    failure raises RewardError (on_error 'stop') or scores the batch 0 and warns the first time (on_error
    'zero'). An infinite score passes, as TRL takes it, with one warning. Keeps `name` as `__name__`: TRL
    logs rewards by it."""
    say = warn or _warn

    def checked(scores, n):
        values = check_scores(name, scores, n)
        if not reward.warned_inf and any(v is not None and math.isinf(v) for v in values):
            reward.warned_inf = True
            say(f"warning: reward {name!r} returned an infinite score: TRL takes it, but that completion's whole "
                "group then gets advantage 0 (nothing learned from it); return finite numbers")
        return values

    def failed(exc: Exception, n: int) -> list:
        problem = _problem(name, exc)
        if on_error != "zero":
            raise problem from None
        reward.failures += 1
        if reward.failures == 1:
            say(f"warning: {problem}; scoring its completions 0 (rewards.on_error: zero)")
        return [0.0] * n

    if is_async_callable(fn):
        async def reward(prompts, completions, **kwargs):
            try:
                return checked(await fn(prompts=prompts, completions=completions, **kwargs), len(completions))
            except Exception as exc:  # the user's code: any failure is reported the same way
                return failed(exc, len(completions))
    else:
        def reward(prompts, completions, **kwargs):
            try:
                return checked(fn(prompts=prompts, completions=completions, **kwargs), len(completions))
            except Exception as exc:  # the user's code: any failure is reported the same way
                return failed(exc, len(completions))

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = getattr(fn, "__doc__", None)
    reward.failures = 0
    reward.warned_inf = False
    return reward


def call_reward(fn: RewardFn, **kwargs) -> list:
    """Call a reward as TRL does, outside the trainer (evaluation, the probe): an async one is awaited on
    an event loop of its own, in a thread (a notebook's main thread already runs a loop)."""
    if not is_async_callable(fn):
        return fn(**kwargs)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, fn(**kwargs)).result()


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def load_reward_module(path: str):
    """Import a user's reward file (user_files: cached by path and modification time). RewardError says what is
    wrong."""
    return import_user_file(path, "rewards.module", "reward functions", RewardError)


def module_reward_names(module) -> list[str]:
    """The public functions a reward file defines itself (not the ones it imports)."""
    return own_functions(module)


def lookup_reward(name: str, module=None, chat_template_kwargs: Optional[dict] = None) -> RewardFn:
    """A reward by name: a built-in one, a function (or callable) of the user's reward file, or a reward model
    (templating with `chat_template_kwargs`: data.chat_template_kwargs)."""
    if is_reward_model(name):
        return RewardModel(name, chat_template_kwargs)
    if module is not None and name in vars(module):
        if name in REWARDS:
            raise RewardError(
                f"rewards.module {module.__file__} defines {name!r}, the name of a built-in reward: rename it")
        fn = getattr(module, name)
        if not callable(fn):
            raise RewardError(f"{name!r} in rewards.module {module.__file__} is a {type(fn).__name__}, not a function")
        return fn
    if name in REWARDS:
        return REWARDS[name]
    where = f"; {module.__file__} defines: {', '.join(module_reward_names(module)) or 'no functions'}" if module else ""
    raise RewardError(f"unknown reward {name!r} in rewards.names: choose from {', '.join(REWARDS)}{where} "
                      "(or a reward model: a hub id or a local folder)")


def logged_name(name: str) -> str:
    """The name TRL logs a reward under (`rewards/<name>/mean`): a reward model's last path part, as TRL
    names one by its model id."""
    return model_id_name(name) if is_reward_model(name) else name


# --------------------------------------------------------------------------- the random-reward control

def random_reward(name: str, low: float, high: float, seed: int) -> RewardFn:
    """The random-reward control's stand-in for reward `name` (`python -m lowvram_grpo.baseline RUN --control
    random-reward`): one value per completion drawn uniformly from [low, high] (the reward's range), independent of
    the completion, which is never read, evaluated or run. The generator is seeded by `seed`, the name, the training
    step and the call's number within that step (Python's string seeding: the same in every process), so the same
    run draws the same values. Values are spread within a group as real rewards are, so every group has an
    advantage, and it is pure noise. TRL logs it as `random_<name>`."""

    calls: dict[int, int] = {}

    def reward(prompts, completions, trainer_state=None, **kwargs) -> list[float]:
        step = int(getattr(trainer_state, "global_step", 0))
        call = calls.get(step, 0)
        calls[step] = call + 1
        draw = random.Random(f"{seed}:{name}:{step}:{call}")
        return [low + (high - low) * draw.random() for _ in completions]

    reward.__name__ = reward.__qualname__ = f"random_{name}"
    reward.range = (low, high)
    return reward


def reward_range(name: str) -> Optional[tuple[float, float]]:
    """A built-in reward's range, (0, its best score); None for a reward file's function or a reward model."""
    return (0.0, REWARD_MAX[name]) if name in REWARD_MAX and not is_reward_model(name) else None


def sample_completion(row: dict):
    """A completion in the shape TRL hands one for `row`'s prompt: messages for a chat prompt, else text."""
    text = xml_formatted(str(row.get("solution") or "Let me think."), str(row.get("answer") or "yes"))
    return text if isinstance(row["prompt"], str) else [{"role": "assistant", "content": text}]


def probe_reward(fn: RewardFn, name: str, row: Optional[dict] = None) -> None:
    """Call a user's reward once as TRL will: on `row` (a training row: its prompt and every other column)
    with a sample completion and TRL's own keywords, and check the scores."""
    if row is None:
        row = {"prompt": [{"role": "system", "content": "Answer in the format."},
                          {"role": "user", "content": "What is 2 + 2?"}],
               "answer": "4", "solution": "2 + 2 = 4"}
    columns = {key: [value] for key, value in row.items() if key not in ("prompt", "completion", "completion_ids")}
    state = types.SimpleNamespace(global_step=0, max_steps=1, epoch=0.0, log_history=[])
    try:
        call_reward(guarded(fn, name), prompts=[row["prompt"]], completions=[sample_completion(row)], **columns,
                    completion_ids=[[0]], trainer_state=state, log_extra=lambda *a, **k: None,
                    log_metric=lambda *a, **k: None)
    except RewardError as exc:
        raise RewardError(f"{exc} (called once on the first training row, as TRL will call it)") from None


def check_rewards(rewards_config, rows: list[dict], source: str, functions=None) -> None:
    """Before anything heavy: each configured reward against the run's training rows (RewardError): a
    built-in answer reward needs gold answers, a local reward model's folder must be there, and a user's
    function is called once on the first row."""
    try:
        _check_rewards(rewards_config, rows, source, functions)
    except RewardError as exc:  # bad input, refused before anything is written: exit 2
        raise ConfigError(str(exc)) from None


def _check_rewards(rewards_config, rows: list[dict], source: str, functions=None) -> None:
    """`functions`: (name, function) for rewards.names, already looked up (user_code.UserCode.reward_fns)."""
    if functions is None:
        module = load_reward_module(rewards_config.module) if rewards_config.module else None
        functions = [(name, None if is_reward_model(name) else lookup_reward(name, module))
                     for name in rewards_config.names]
    for name, fn in functions:
        if is_reward_model(name):
            folder = Path(name).expanduser()
            if name.startswith((".", "/", "~")) and not (folder / "config.json").is_file():
                raise RewardError(f"reward model {name!r} in rewards.names: no model folder (config.json) there")
            continue
        if name in NEEDS_GOLD and not any(row.get("answer") is not None for row in rows):
            columns = ", ".join(repr(k) for k in rows[0] if k != "prompt") or "none"
            raise RewardError(f"reward {name!r} needs gold answers and the data {source} gives none (its other "
                              f"columns: {columns}): map the answer column with data.answer_column=NAME, or choose "
                              "other rewards.names (your own in rewards.module)")
        if fn is not REWARDS.get(name):
            probe_reward(fn, name, rows[0])
