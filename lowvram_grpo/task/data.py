"""Training data: this is where questions enter.

`load_questions(data_config)` returns `(train, eval)` lists of `Question` records from
- the built-in generator of grade-school arithmetic word problems (offline, deterministic by seed), or
- a file: `.jsonl`/`.ndjson`, `.json`, `.csv`, `.tsv` or `.parquet`, as common tools and editors write
  them: UTF-8 with or without a byte-order mark, UTF-16/32 with one, or Windows-1252 (Excel's plain
  "CSV"); `\\n`, `\\r\\n` or `\\r` line endings; blank lines and rows skipped; a `.csv` separated by commas,
  semicolons (Excel in many locales) or tabs; a `.json` list of objects, `{"split": [objects]}`, pandas'
  `to_json` layouts or JSON Lines under a .json name (one parser per format: `_PARSERS`), or
- a dataset by hub id or a local dataset folder, `NAME[@config][:split]` (`datasets.load_dataset`; a hub
  id needs internet).

Which column is what is decided in one place, `layout`:
- the question: `data.question_column` (default `question`), put after `data.system_prompt` as a chat; or,
  when the data has no such column but TRL's `prompt` column, that prompt as it is: text (TRL's standard
  format, fed to the model untemplated) or a list of `{"role", "content"}` messages (conversational);
- the gold answer, from `data.answer_column` (default `answer`): GSM8K's `reasoning #### 72` gives 72 and
  the reasoning as the worked solution, a `\\boxed{...}` gives its content, anything else is the answer as
  written; or else from `data.solution_column` (default `solution`), MATH-style: the last `\\boxed{...}`
  inside the worked solution. Data without either has no gold answer (`Question.answer` None): fine for
  rewards of your own, refused by the built-in answer rewards (rewards.check_rewards);
- every other column reaches the reward functions as a keyword of the same name, as TRL hands a dataset's
  columns to them (so a task that is not arithmetic trains with a reward file of your own).

`to_prompt_rows` turns questions into TRL's rows: `prompt`, `answer` (the gold final answer) and
`solution` (worked reasoning) where the data has them, and the other columns. Every problem with the
input raises `DataError` with one line saying what to fix.
"""
from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

from lowvram_grpo.core.errors import DataError
from lowvram_grpo.task.rewards import TRL_KEYWORDS, extract_hash_answer

BUILTIN_TRAIN_SIZE = 2000
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")
PROMPT_COLUMN = "prompt"  # TRL's: text (standard) or messages (conversational)
OURS = (PROMPT_COLUMN, "answer", "solution")  # the row keys this module fills in


@dataclass(frozen=True)
class Question:
    question: str  # the question's text (for a data-given prompt: its last user message)
    answer: Optional[str]  # the gold final answer, e.g. "72" or "1,000"; None when the data gives none
    solution: str = ""  # worked reasoning, when the source has it
    prompt: Any = None  # the data's own TRL prompt (text or messages); None: built from question + system prompt
    extra: dict = field(default_factory=dict)  # every other column of the row, handed to the reward functions


# --------------------------------------------------------------------------- built-in generator

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Kira", "Leo", "Maya", "Noah",
          "Olive", "Paul"]
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


# --------------------------------------------------------------------------- files: text as tools write it

_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))  # UTF-32 LE's BOM starts like UTF-16 LE's
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # not str.splitlines: JSON text may hold U+2028 inside a string


def read_text(path: Path) -> str:
    """A text file's content: by its byte-order mark, else UTF-8, else Windows-1252."""
    raw = path.read_bytes()
    for bom, codec in _BOMS:
        if raw.startswith(bom):
            return raw.decode(codec)
    if b"\x00" in raw[:4096]:
        raise DataError(f"dataset {path} holds NUL bytes (UTF-16 without a byte-order mark?): save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    try:
        return raw.decode("cp1252")
    except UnicodeDecodeError:
        raise DataError(f"dataset {path} is neither UTF-8 nor Windows-1252 text: save it as UTF-8") from None


def _jsonl(text: str, path: Path) -> list:
    records = []
    for lineno, line in enumerate(_LINE_BREAK.split(text), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg}): fix or remove that line") from None
    return records


def _json(text: str, path: Path) -> list:
    """A list of objects; {"train": [objects]}; pandas' to_json layouts (columns, index, split, table);
    {"column": [values]}; JSON Lines named .json."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line under a .json name (datasets' and pandas' lines=True)
            return _jsonl(text, path)
        raise DataError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}): fix the file") from None
    if isinstance(data, dict):
        values = list(data.values())
        lists = [v for v in values if isinstance(v, list)]
        if set(data) >= {"columns", "data"} and isinstance(data["columns"], list):  # pandas orient="split"
            data = [dict(zip(data["columns"], row)) for row in data["data"]]
        elif len(lists) == 1 and all(isinstance(x, dict) for x in lists[0]):  # {"train": [...]}
            data = lists[0]
        elif values and all(isinstance(v, dict) for v in values):
            if all(str(k).isdigit() for k in data):  # pandas' orient="index": {row: {column: value}}
                data = values
            else:  # pandas' default orient="columns": {column: {row: value}}
                index = list(dict.fromkeys(i for v in values for i in v))
                data = [{column: cells.get(i) for column, cells in data.items()} for i in index]
        elif values and len(lists) == len(values) and len({len(v) for v in lists}) == 1:  # {"column": [values]}
            data = [dict(zip(data, row)) for row in zip(*lists)]
    if not isinstance(data, list):
        raise DataError(f"{path} must hold a JSON list of objects (one per row), e.g. "
                        '[{"question": "...", "answer": "..."}]')
    return data


def _delimited(text: str, path: Path, delimiter: Optional[str] = None) -> list:
    """CSV/TSV with a header row. `delimiter` None: the one of , ; tab the header line uses most."""
    lines = [line for line in _LINE_BREAK.split(text) if line.strip()]
    if not lines:
        return []
    if delimiter is None:
        delimiter = max((",", ";", "\t"), key=lines[0].count)
    rows = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = None
    records = []
    try:
        for row in rows:
            if not any(cell.strip() for cell in row):
                continue  # blank lines, and rows of empty cells spreadsheets add at the end
            if header is None:
                header = [cell.strip() for cell in row]
                repeated = sorted({name for name in header if name and header.count(name) > 1})
                if repeated:
                    raise DataError(f"{path}: the header names the column {repeated[0]!r} twice: rename one")
                continue
            if len(row) > len(header):
                raise DataError(f"{path} line {rows.line_num} has {len(row)} fields, the header {len(header)}: "
                                "quote fields that contain the separator")
            row = row + [""] * (len(header) - len(row))
            records.append({name: cell for name, cell in zip(header, row) if name})  # an unnamed index
                                                                                     # column is dropped
    except csv.Error as exc:
        raise DataError(f"{path} line {rows.line_num} is not valid CSV ({exc}): fix that line") from None
    return records


def _parquet(path: Path) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# one parser per format: suffix -> (reads text?, parser)
_PARSERS = {
    ".jsonl": (True, _jsonl), ".ndjson": (True, _jsonl), ".json": (True, _json),
    ".csv": (True, lambda text, path: _delimited(text, path)),
    ".tsv": (True, lambda text, path: _delimited(text, path, "\t")),
    ".parquet": (False, _parquet),
}


def _records_from_file(path: Path) -> list:
    suffix = path.suffix.lower()
    if suffix not in _PARSERS:
        raise DataError(f"dataset {path} has an unknown extension {suffix!r}: use {', '.join(FILE_SUFFIXES)}")
    text_based, parse = _PARSERS[suffix]
    try:
        return parse(read_text(path), path) if text_based else parse(path)
    except DataError:
        raise
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read dataset {path}: {exc}") from None
    except Exception as exc:  # pyarrow raises its own error types for a corrupt file
        raise DataError(f"cannot read dataset {path}: {type(exc).__name__}: {exc}") from None


def _records_from_datasets(name: str, config: str, split: str, spec: str, local: bool) -> list:
    """A hub dataset or a local dataset folder through `datasets.load_dataset(name, config, split=split)`."""
    try:
        import datasets

        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        advice = ("check the folder's config and split names" if local else
                  "without internet, pass a local file (.jsonl, .json, .csv, .tsv, .parquet) or dataset folder")
        raise DataError(f"cannot load dataset '{spec}' ({first[:200]}): {advice}") from None
    return [dict(r) for r in ds]


# --------------------------------------------------------------------------- gold answers

def boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip() or None
    return None


def gold_answer(text, plain_is_answer: bool = True) -> tuple[Optional[str], str]:
    """(the gold final answer, the worked solution) from an answer or solution field: GSM8K's
    '... #### 72' -> ('72', '...'); MATH's '... \\boxed{\\frac{3}{4}} ...' -> ('\\frac{3}{4}', the text);
    other text -> (the text, '') from an answer field, (None, the text) from a solution field
    (`plain_is_answer` False); an empty field -> (None, '')."""
    if text is None:
        return None, ""
    text = str(text).strip()
    final = extract_hash_answer(text)
    if final is not None:
        return final or None, text.split("####")[0].strip()
    inside = boxed(text)
    if inside is not None:
        return inside, text
    return (text or None, "") if plain_is_answer else (None, text)


# --------------------------------------------------------------------------- columns: decided here only

class Layout(NamedTuple):
    question: Optional[str]  # the question column (None: the data's own `prompt` column is used)
    answer: Optional[str]    # where the gold answer comes from, when the data has it
    solution: Optional[str]  # the worked-solution column, when there is one


def _default(data_config, key: str) -> str:
    return next(f.default for f in dataclasses.fields(type(data_config)) if f.name == key)


def layout(columns: list[str], data_config, source: str) -> Layout:
    """Which of `columns` is the question (or TRL's prompt), the answer and the worked solution. A column a
    setting names that is missing is one error line listing the columns found and the setting to change."""
    found = ", ".join(repr(c) for c in columns) or "none"

    def mapped(key: str) -> Optional[str]:
        name = getattr(data_config, key)
        if name in columns:
            return name
        if name != _default(data_config, key):  # set on purpose, and not there
            raise DataError(f"dataset {source} has no column {name!r} (data.{key}): its columns are {found}")
        return None

    question = mapped("question_column")
    if question is None and PROMPT_COLUMN not in columns:
        raise DataError(f"dataset {source} has no {data_config.question_column!r} column and no TRL 'prompt' column: "
                        f"its columns are {found}; map the question with data.question_column=NAME "
                        "(and the answer with data.answer_column=NAME)")
    answer, solution = mapped("answer_column"), mapped("solution_column")
    taken = [name for name in (question, answer, solution) if name]
    if len(set(taken)) < len(taken):
        raise DataError(f"data.question_column, data.answer_column and data.solution_column name the same column "
                        f"of {source}: map each to its own")
    clash = sorted(set(columns) & (set(TRL_KEYWORDS) - {"completion_ids"}))  # TRL drops that column itself
    if clash:
        raise DataError(f"dataset {source} has a column {clash[0]!r}, "
                        "a keyword TRL itself passes the reward functions: "
                        "rename that column")
    return Layout(question, answer, solution)


def _check_prompt(prompt, where: str) -> None:
    if isinstance(prompt, str) and prompt.strip():
        return
    if (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in prompt)):
        return
    raise DataError(f"{where}: 'prompt' must be text or a list of chat messages "
                    f"({{'role': ..., 'content': ...}}); got {str(prompt)[:60]!r}")


def _to_question(record, shape: Layout, where: str) -> Question:
    if not isinstance(record, dict):
        raise DataError(f"{where} is not an object with named fields (e.g. 'question' and 'answer')")
    final, solution = gold_answer(record.get(shape.answer)) if shape.answer else (None, "")
    if shape.solution:
        from_solution, worked = gold_answer(record.get(shape.solution), plain_is_answer=False)
        final, solution = final if final is not None else from_solution, worked or solution
    extra = {k: v for k, v in record.items() if k not in OURS}
    if shape.question is None:
        prompt = record.get(PROMPT_COLUMN)
        _check_prompt(prompt, where)
        return Question(question=prompt_text(prompt), answer=final, solution=solution, prompt=prompt, extra=extra)
    text = record.get(shape.question)
    if text is None or not str(text).strip():
        raise DataError(f"{where} has an empty {shape.question!r}: fill it in or remove that row")
    return Question(question=str(text).strip(), answer=final, solution=solution, extra=extra)


def _check_same_kind_of_prompt(questions: list[Question], source: str) -> None:
    kinds = {isinstance(q.prompt, str) for q in questions if q.prompt is not None}
    if len(kinds) > 1:
        raise DataError(f"dataset {source} mixes text prompts and chat-message prompts: TRL takes one kind per dataset")


def _check_column_types(questions: list[Question], source: str) -> None:
    """Every column handed on must hold one type of value (TRL's dataset is Arrow: it cannot mix them)."""
    import pyarrow as pa

    names = list(dict.fromkeys(k for q in questions for k in q.extra))
    for name in names:
        try:
            pa.array([q.extra.get(name) for q in questions])
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as exc:
            first = str(exc).splitlines()[0][:120]
            raise DataError(f"column {name!r} of dataset {source} mixes kinds of values ({first}): "
                            "make every value of it the same kind") from None


def _from_spec(spec: str, data_config) -> list[Question]:
    path = Path(spec).expanduser()
    if path.suffix.lower() in FILE_SUFFIXES or (path.is_file()):
        if not path.exists():
            raise DataError(f"dataset file {spec} does not exist: check the path")
        if not path.is_file():
            raise DataError(f"dataset {spec} is not a file")
        records, source = _records_from_file(path), str(path)
    else:
        name, _, split = spec.partition(":")
        name, _, config = name.partition("@")
        folder = Path(name).expanduser()
        if folder.is_dir():
            records = _records_from_datasets(str(folder), config, split, spec, local=True)
        elif spec.startswith((".", "/", "~")):
            raise DataError(f"dataset {spec} does not exist: check the path")
        else:
            if not config and name.endswith("gsm8k"):
                config = "main"
            records = _records_from_datasets(name, config, split, spec, local=False)
        source = spec
    if not records:
        raise DataError(f"dataset {source} is empty: it needs rows with 'question' and 'answer' (or TRL's 'prompt')")
    columns = list(dict.fromkeys(k for r in records if isinstance(r, dict) for k in r))
    shape = layout(columns, data_config, source)
    questions = [_to_question(r, shape, f"{source} row {i + 1}") for i, r in enumerate(records)]
    _check_same_kind_of_prompt(questions, source)
    _check_column_types(questions, source)
    return questions


def load_questions(data_config) -> tuple[list[Question], list[Question]]:
    """(train, eval) questions for a `DataConfig`; the eval split is held out by seed (or, with
    `eval_dataset`, drawn from that separate dataset, e.g. GSM8K's test split)."""
    eval_size = data_config.eval_size
    separate = getattr(data_config, "eval_dataset", None)
    if data_config.dataset in (None, "", "builtin", "builtin:arithmetic"):
        n_train = data_config.num_train or BUILTIN_TRAIN_SIZE
        if separate:
            return (arithmetic_problems(n_train, data_config.seed, data_config.max_operand),
                    _held_out(separate, data_config))
        problems = arithmetic_problems(n_train + eval_size, data_config.seed, data_config.max_operand)
        return problems[eval_size:], problems[:eval_size]
    questions = _from_spec(data_config.dataset, data_config)
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


def split_validation(train: list[Question], held_out: list[Question],
                     size: int) -> tuple[list[Question], list[Question]]:
    """(training questions left, validation questions) for the held-out curve (eval.every_steps): the last `size`
    training questions whose text is not one of the held-out questions', taken out of training, so the curve is
    measured on questions neither trained on nor the held-out ones (the final comparison's stay untouched).
    Deterministic: the training list is already in the data seed's order."""
    asked = {q.question for q in held_out}
    picked = [i for i in range(len(train) - 1, -1, -1) if train[i].question not in asked][:size]
    if len(picked) < size or len(train) - size < 1:
        raise DataError(f"eval.validation_size={size} validation questions leave {max(0, len(train) - size)} of the "
                        f"{len(train)} training questions to train on: lower eval.validation_size, or set "
                        "eval.every_steps=0 (no held-out curve)")
    chosen = set(picked)
    return [q for i, q in enumerate(train) if i not in chosen], [train[i] for i in sorted(picked)]


def validation_questions(data_config, train: list[Question], held_out: list[Question],
                         size: int) -> tuple[list[Question], list[Question]]:
    """(training questions, validation questions) for the held-out curve (eval.every_steps). Built-in problems: `size`
    more problems generated after the training ones (the same generator and seed: the training and held-out questions
    are the very ones a run without the curve gets, so the curve changes nothing that is trained); other data: taken
    out of the training questions (split_validation). Either way none is a held-out question or trained on."""
    if data_config.dataset in (None, "", "builtin", "builtin:arithmetic"):
        n_train = data_config.num_train or BUILTIN_TRAIN_SIZE
        before = 0 if getattr(data_config, "eval_dataset", None) else data_config.eval_size
        extra = arithmetic_problems(before + n_train + size, data_config.seed,
                                    data_config.max_operand)[before + n_train:]
        return train, extra
    return split_validation(train, held_out, size)


def _held_out(spec: str, data_config) -> list[Question]:
    """`eval_size` questions of the separate eval dataset `spec`, shuffled by the data seed."""
    questions = _from_spec(spec, data_config)
    if len(questions) < data_config.eval_size:
        raise DataError(f"data.eval_dataset {spec} has {len(questions)} rows, fewer than data.eval_size="
                        f"{data_config.eval_size}: lower data.eval_size")
    order = list(range(len(questions)))
    random.Random(data_config.seed).shuffle(order)
    return [questions[i] for i in order[: data_config.eval_size]]


# --------------------------------------------------------------------------- prompts

def chat_messages(question: str, system_prompt: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def prompt_of(question: Question, system_prompt: str):
    """TRL's `prompt` for a question: the data's own, else the system prompt and the question as a chat."""
    return question.prompt if question.prompt is not None else chat_messages(question.question, system_prompt)


def prompt_text(prompt) -> str:
    """The text a prompt asks (its last user message when conversational), for logs and reports."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1].get("content", ""))


def has_gold_answers(questions: list[Question]) -> bool:
    return any(q.answer is not None for q in questions)


def to_prompt_rows(questions: list[Question], system_prompt: str) -> list[dict]:
    """TRL rows: `prompt`, the other columns of the data, and `answer` / `solution` (the gold final answer and
    the worked reasoning) where the data has them. Every row has the same keys (TRL's dataset is a table)."""
    with_answer = has_gold_answers(questions)
    with_solution = any(q.solution for q in questions)
    extra_keys = list(dict.fromkeys(k for q in questions for k in q.extra))
    rows = []
    for q in questions:
        row = {"prompt": prompt_of(q, system_prompt), **{k: q.extra.get(k) for k in extra_keys}}
        if with_answer:
            row["answer"] = q.answer
        if with_solution:
            row["solution"] = q.solution
        rows.append(row)
    return rows


def text_tokenizer(tokenizer):
    """The tokenizer that turns text into ids: `tokenizer` itself, or, where a loader returned a processor (unsloth
    loads a vision-language checkpoint such as Qwen3.5 with its vision loader and returns e.g. Qwen3VLProcessor), the
    tokenizer inside it. A processor's first positional argument is `images` (a string there is read as an image
    path) and its chat template tokenizes to a [1, n] batch, so text never goes through it; the processor's chat
    template is given to its tokenizer where the tokenizer has none. None stays None."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or not hasattr(inner, "convert_tokens_to_ids"):
        return tokenizer
    if not getattr(inner, "chat_template", None) and getattr(tokenizer, "chat_template", None):
        inner.chat_template = tokenizer.chat_template
    return inner


def prompt_tokens(tokenizer, prompt, tools=None, template_kwargs=None) -> int:
    """How many tokens the model is fed for `prompt`: the chat template's for messages (with the `tools`' schemas
    in it when tools are given, as TRL renders them, and `template_kwargs`: data.chat_template_kwargs), the text's
    own otherwise. `tokenizer` may be a processor (text_tokenizer)."""
    tokenizer = text_tokenizer(tokenizer)
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        **(template_kwargs or {}))
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


def drop_long_prompts(rows: list[dict], tokenizer, max_prompt_length: int, tools=None,
                      template_kwargs=None) -> tuple[list[dict], int]:
    """Keep rows whose prompt (with the `tools`' schemas, when given, and `template_kwargs`) fits
    `max_prompt_length` tokens (TRL 1.15 no longer truncates)."""
    kept = [row for row in rows if prompt_tokens(tokenizer, row["prompt"], tools, template_kwargs) <= max_prompt_length]
    return kept, len(rows) - len(kept)
