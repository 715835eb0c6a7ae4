"""Reward functions, by name. This is where rewards are computed.

Each function has TRL's reward signature `(prompts, completions, **kwargs) -> list[float]`: one score
per completion. Completions may be plain strings or conversational (a list of `{"role", "content"}`
messages); `answer` (the gold final answer, one per completion) arrives as a keyword from the
dataset column of that name.

The five are the Unsloth Llama-3.1-8B GRPO notebook's, with two deliberate fixes:
- the format regexes match across lines (`re.DOTALL`): the notebook's `.*?` without it never matches a
  reasoning of more than one line, so its strict/soft rewards miss most well-formed answers;
- `correctness` compares answers, not strings (answers.py): "1,000", "$1000.00" and "1000" all equal a
  gold "1,000", and "3/4", "\\frac{3}{4}" and "75%" a gold "0.75", as a careful human grader would score them.

`REWARD_MAX` gives each function's best score, used by tests and the report.

A preset may add its own rewards from a file (`rewards.module: my_rewards.py`): its functions are
selectable by name in `rewards.names`; the file is imported and each named function is probed on a
sample completion when the config loads. TRL gets every reward through `guarded`, which checks one
finite number per completion and names the function when that fails (`rewards.on_error`).
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import re
import sys
import types
from decimal import Decimal
from pathlib import Path
from typing import Callable, Optional

from .errors import RewardError
from . import answers

RewardFn = Callable[..., list]
REWARDS: dict[str, RewardFn] = {}
REWARD_MAX: dict[str, float] = {}


def register(name: str, max_score: float):
    """Add a reward to the registry under `name` (also its `__name__`, which TRL uses in its logs)."""

    def wrap(fn: RewardFn) -> RewardFn:
        fn.__name__ = name
        fn.__qualname__ = name
        REWARDS[name] = fn
        REWARD_MAX[name] = max_score
        return fn

    return wrap


# --------------------------------------------------------------------------- text helpers

def completion_text(completion) -> str:
    """The generated text of one completion, plain or conversational."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion)


def extract_xml_answer(text: str) -> str:
    """The text inside the last <answer>...</answer> (the notebook's rule: without tags, the whole text)."""
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def extract_hash_answer(text: str) -> Optional[str]:
    """GSM8K's gold answer: what follows '####' (None when the marker is missing)."""
    if "####" not in text:
        return None
    return text.split("####")[-1].strip()


_PLAIN_INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+|-?\d+")


def parse_number(text: str) -> Optional[Decimal]:
    """A number written any usual way ('1,000', '$18.00', '-3', '.5') -> Decimal; None if there is none."""
    return answers.plain_number(text)


def answer_number(answer_text: str) -> Optional[Decimal]:
    """The plain number a final answer states ('The total is 72 clips.' -> 72); None when it states none
    or a fraction/LaTeX answer (those are compared by `answers.is_correct`)."""
    stated = answers.final_answer(answer_text)
    return answers.plain_number(stated) if stated is not None else None


def _gold_list(answer, n: int) -> list:
    if answer is None:
        raise ValueError("the dataset has no 'answer' column: correctness needs the gold answers")
    if isinstance(answer, (str, int, float)):
        return [str(answer)] * n
    return [str(a) for a in answer]


# --------------------------------------------------------------------------- the notebook's five

@register("correctness", 2.0)
def correctness_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """2.0 when the stated answer equals the gold answer (answers.is_correct: exact for plain numbers,
    math-verify for fractions, LaTeX, percentages); 0.0 otherwise.

    With <answer> tags the stated answer is the tagged text (its last number if it has words around
    it; a block cut off before </answer> counts); without tags the whole completion must be just the
    answer, as in the notebook."""
    golds = _gold_list(answer, len(completions))
    scores = []
    for completion, gold in zip(completions, golds):
        text = completion_text(completion)
        if "<answer>" in text:
            stated = answers.lenient_answer(text)
        else:
            stated = answers.whole_answer(text)
        scores.append(2.0 if answers.is_correct(stated, gold) else 0.0)
    return scores


@register("int", 0.5)
def int_reward(prompts, completions, **kwargs) -> list[float]:
    """0.5 when the tagged answer is a plain integer ('42', '-3', '1,000'): nudges towards a bare number."""
    return [0.5 if _PLAIN_INTEGER.fullmatch(extract_xml_answer(completion_text(c))) else 0.0 for c in completions]


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


# --------------------------------------------------------------------------- a user's own reward file, checked scores

def check_scores(name: str, scores, n: int) -> list[float]:
    """`scores` as a list of `n` finite floats, else RewardError naming the function and the problem."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__iter__"):
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, not a list of {n} numbers (one per completion)")
    values = list(scores)
    if len(values) != n:
        raise RewardError(f"reward {name!r} returned {len(values)} scores for {n} completions: return one number per completion")
    checked = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward {name!r} returned {value!r} ({type(value).__name__}) as score {i}: scores must be numbers")
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} as score {i}: scores must be finite numbers")
        checked.append(float(value))
    return checked


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def guarded(fn: RewardFn, name: str, on_error: str = "stop", warn=None) -> RewardFn:
    """`fn` with its scores checked. A failure raises RewardError (on_error 'stop') or scores the batch 0
    and warns the first time (on_error 'zero'). Keeps `name` as `__name__`: TRL logs rewards by it."""

    def reward(prompts, completions, **kwargs):
        try:
            return check_scores(name, fn(prompts=prompts, completions=completions, **kwargs), len(completions))
        except RewardError as exc:
            problem = exc
        except Exception as exc:  # the user's code: any failure is reported the same way
            problem = RewardError(f"reward {name!r} raised {_first_line(exc)}")
        if on_error != "zero":
            raise problem from None
        reward.failures += 1
        if reward.failures == 1:
            (warn or _warn)(f"warning: {problem}; scoring its completions 0 (rewards.on_error: zero)")
        return [0.0] * len(completions)

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = fn.__doc__
    reward.failures = 0
    return reward


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


_MODULES: dict[tuple, object] = {}


def load_reward_module(path: str):
    """Import a user's reward file (cached by path and modification time). RewardError says what is wrong."""
    file = Path(path)
    if file.suffix != ".py":
        raise RewardError(f"rewards.module must be a .py file of reward functions; got {path!r}")
    if not file.is_file():
        raise RewardError(f"rewards.module {path} does not exist: give the path of a .py file (relative to the current directory or the preset)")
    key = (str(file.resolve()), file.stat().st_mtime_ns)
    if key not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"lowvram_grpo_user_rewards_{len(_MODULES)}", file)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit, ... all mean the same to the user
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise RewardError(f"rewards.module {path} failed to import: {_first_line(exc)}") from None
        _MODULES[key] = module
    return _MODULES[key]


def module_reward_names(module) -> list[str]:
    """The public functions a reward file defines itself (not the ones it imports)."""
    return sorted(n for n, f in vars(module).items()
                  if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__)


def lookup_reward(name: str, module=None) -> RewardFn:
    """A reward by name: a built-in one, or a function of the user's reward file."""
    if module is not None and name in vars(module):
        if name in REWARDS:
            raise RewardError(f"rewards.module {module.__file__} defines {name!r}, the name of a built-in reward: rename it")
        fn = getattr(module, name)
        if not callable(fn):
            raise RewardError(f"{name!r} in rewards.module {module.__file__} is a {type(fn).__name__}, not a function")
        return fn
    if name in REWARDS:
        return REWARDS[name]
    where = f"; {module.__file__} defines: {', '.join(module_reward_names(module)) or 'no functions'}" if module else ""
    raise RewardError(f"unknown reward {name!r} in rewards.names: choose from {', '.join(REWARDS)}{where}")


def probe_reward(fn: RewardFn, name: str) -> None:
    """Call a user's reward once on a sample completion, with the keywords TRL passes, and check the scores."""
    prompt = [{"role": "system", "content": "Answer in the format."}, {"role": "user", "content": "What is 2 + 2?"}]
    completion = [{"role": "assistant", "content": xml_formatted("2 + 2 = 4", "4")}]
    state = types.SimpleNamespace(global_step=0, max_steps=1, epoch=0.0, log_history=[])
    try:
        guarded(fn, name)(prompts=[prompt], completions=[completion], answer=["4"], solution=["2 + 2 = 4"],
                          completion_ids=[[0]], trainer_state=state, log_extra=lambda *a, **k: None,
                          log_metric=lambda *a, **k: None)
    except RewardError as exc:
        raise RewardError(f"{exc} (on a sample completion, checked when rewards.module loads)") from None


def reward_functions(rewards_config, warn=None) -> list[RewardFn]:
    """The configured rewards, in order, each wrapped by `guarded` (what TRL is handed)."""
    module = load_reward_module(rewards_config.module) if rewards_config.module else None
    return [guarded(lookup_reward(name, module), name, rewards_config.on_error, warn) for name in rewards_config.names]
