"""Training data: this is where questions enter.

`load_questions(data_config)` returns `(train, eval)` lists of `Question` records from
- the built-in generator of grade-school arithmetic word problems (offline, deterministic by seed), or
- a GSM8K-style file (`.jsonl`, `.json`, `.parquet`) with `question` and `answer` ('... #### 72'), or
- a hub id (`openai/gsm8k[@config][:split]`, needs internet).

`to_prompt_rows` turns them into TRL's conversational rows: `prompt` (system + user messages),
`answer` (the gold final answer, passed to reward functions) and `solution` (worked reasoning).

Every problem with the input raises `DataError` with one line saying what to fix.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from .errors import DataError
from .rewards import extract_hash_answer

BUILTIN_TRAIN_SIZE = 2000


@dataclass(frozen=True)
class Question:
    question: str
    answer: str  # the gold final answer, e.g. "72" or "1,000"
    solution: str = ""  # worked reasoning, when the source has it


# --------------------------------------------------------------------------- built-in generator

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Kira", "Leo", "Maya", "Noah", "Olive", "Paul"]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "coins", "flowers"]


def _problem(rng: random.Random, max_operand: int) -> Question:
    """One word problem with its worked solution. Kinds: add, subtract, multiply, two-step."""
    name, friend = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.choice(["add", "subtract", "multiply", "two_step"])
    a = rng.randint(2, max_operand)
    b = rng.randint(2, max_operand)
    if kind == "add":
        q = f"{name} has {a} {item}. {friend} gives {name} {b} more. How many {item} does {name} have now?"
        s = f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}."
        ans = a + b
    elif kind == "subtract":
        a, b = max(a, b), min(a, b)
        q = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?"
        s = f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b}."
        ans = a - b
    elif kind == "multiply":
        a, b = rng.randint(2, 12), rng.randint(2, max(2, max_operand // 4))
        q = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in all?"
        s = f"There are {a} boxes of {b} {item}, so {a} * {b} = {a * b}."
        ans = a * b
    else:
        c = rng.randint(1, min(a, b))
        q = (f"{name} has {a} {item} and buys {b} more. Then {name} gives {c} {item} to {friend}. "
             f"How many {item} does {name} have now?")
        s = f"After buying, {name} has {a} + {b} = {a + b} {item}. After giving {c} away, {a + b} - {c} = {a + b - c}."
        ans = a + b - c
    return Question(question=q, answer=str(ans), solution=s)


def arithmetic_problems(n: int, seed: int = 0, max_operand: int = 50) -> list[Question]:
    """`n` distinct built-in problems; the same `seed` always gives the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[Question] = []
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise DataError(f"cannot generate {n} distinct problems with data.max_operand={max_operand}: raise it")
        p = _problem(rng, max_operand)
        if p.question not in seen:
            seen.add(p.question)
            problems.append(p)
    return problems


# --------------------------------------------------------------------------- files and hub

def _records_from_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            records = []
            with path.open(encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}): fix or remove that line") from None
            return records
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):  # {"train": [...]} or {"data": [...]}
                lists = [v for v in data.values() if isinstance(v, list)]
                data = lists[0] if len(lists) == 1 else None
            if not isinstance(data, list):
                raise DataError(f"{path} must hold a JSON list of objects with 'question' and 'answer'")
            return data
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise DataError(f"cannot read dataset {path}: {exc}") from None
    except Exception as exc:  # pyarrow raises its own error types for a corrupt file
        raise DataError(f"cannot read dataset {path}: {type(exc).__name__}: {exc}") from None
    raise DataError(f"dataset {path} has an unknown extension {suffix!r}: use .jsonl, .json or .parquet")


def _records_from_hub(spec: str) -> list[dict]:
    """`owner/name[@config][:split]`; gsm8k's config defaults to 'main'."""
    name, _, split = spec.partition(":")
    name, _, config = name.partition("@")
    if not config and name.endswith("gsm8k"):
        config = "main"
    try:
        import datasets

        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot load dataset '{spec}' from the hub ({first[:200]}): without internet, pass a local .jsonl/.json/.parquet file"
        ) from None
    return [dict(r) for r in ds]


def _to_question(record, where: str) -> Question:
    if not isinstance(record, dict):
        raise DataError(f"{where} is not an object with 'question' and 'answer' fields")
    missing = [k for k in ("question", "answer") if k not in record]
    if missing:
        raise DataError(f"{where} lacks the field(s) {', '.join(missing)}: each row needs 'question' and 'answer' ('... #### 42')")
    text = str(record["answer"])
    final = extract_hash_answer(text)
    if final is None:  # a bare final answer, without worked reasoning
        return Question(question=str(record["question"]).strip(), answer=text.strip())
    return Question(question=str(record["question"]).strip(), answer=final, solution=text.split("####")[0].strip())


def _from_spec(spec: str) -> list[Question]:
    path = Path(spec).expanduser()
    looks_like_file = path.suffix.lower() in (".jsonl", ".json", ".parquet") or spec.startswith((".", "/", "~"))
    if looks_like_file:
        if not path.exists():
            raise DataError(f"dataset file {spec} does not exist: check the path")
        if not path.is_file():
            raise DataError(f"dataset {spec} is not a file")
        records = _records_from_file(path)
        source = str(path)
    else:
        records = _records_from_hub(spec)
        source = spec
    if not records:
        raise DataError(f"dataset {source} is empty: it needs rows with 'question' and 'answer'")
    return [_to_question(r, f"{source} row {i + 1}") for i, r in enumerate(records)]


def load_questions(data_config) -> tuple[list[Question], list[Question]]:
    """(train, eval) questions for a `DataConfig`; the eval split is held out by seed (or, with
    `eval_dataset`, drawn from that separate dataset, e.g. GSM8K's test split)."""
    eval_size = data_config.eval_size
    separate = getattr(data_config, "eval_dataset", None)
    if data_config.dataset in (None, "", "builtin", "builtin:arithmetic"):
        n_train = data_config.num_train or BUILTIN_TRAIN_SIZE
        if separate:
            return arithmetic_problems(n_train, data_config.seed, data_config.max_operand), _held_out(separate, data_config)
        problems = arithmetic_problems(n_train + eval_size, data_config.seed, data_config.max_operand)
        return problems[eval_size:], problems[:eval_size]
    questions = _from_spec(data_config.dataset)
    if separate:
        train = questions[: data_config.num_train] if data_config.num_train else questions
        return train, _held_out(separate, data_config)
    if len(questions) < eval_size + 1:
        raise DataError(
            f"dataset {data_config.dataset} has {len(questions)} rows, too few to hold out data.eval_size={eval_size}: "
            f"lower data.eval_size or add rows"
        )
    order = list(range(len(questions)))
    random.Random(data_config.seed).shuffle(order)
    eval_set = [questions[i] for i in order[:eval_size]]
    train = [questions[i] for i in order[eval_size:]]
    if data_config.num_train:
        train = train[: data_config.num_train]
    return train, eval_set


def _held_out(spec: str, data_config) -> list[Question]:
    """`eval_size` questions of the separate eval dataset `spec`, shuffled by the data seed."""
    questions = _from_spec(spec)
    if len(questions) < data_config.eval_size:
        raise DataError(f"data.eval_dataset {spec} has {len(questions)} rows, fewer than data.eval_size="
                        f"{data_config.eval_size}: lower data.eval_size")
    order = list(range(len(questions)))
    random.Random(data_config.seed).shuffle(order)
    return [questions[i] for i in order[: data_config.eval_size]]


# --------------------------------------------------------------------------- prompts

def chat_messages(question: str, system_prompt: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def to_prompt_rows(questions: list[Question], system_prompt: str) -> list[dict]:
    """TRL conversational rows: `prompt`, plus `answer` and `solution` columns for the rewards."""
    return [
        {"prompt": chat_messages(q.question, system_prompt), "answer": q.answer, "solution": q.solution}
        for q in questions
    ]


def drop_long_prompts(rows: list[dict], tokenizer, max_prompt_length: int) -> tuple[list[dict], int]:
    """Keep rows whose templated prompt fits `max_prompt_length` tokens (TRL 1.15 no longer truncates)."""
    kept = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) <= max_prompt_length:
            kept.append(row)
    return kept, len(rows) - len(kept)

