import json

import pytest

from lowvram_grpo.settings.config import DataConfig
from lowvram_grpo.task.data import DataError, arithmetic_problems, load_questions, to_prompt_rows
from lowvram_grpo.task.rewards import REWARDS, xml_formatted


def test_builtin_problems_are_deterministic_distinct_and_correct():
    a = arithmetic_problems(300, seed=7)
    assert a == arithmetic_problems(300, seed=7)
    assert a != arithmetic_problems(300, seed=8)
    assert len({p.question for p in a}) == 300
    # each worked solution ends in the gold answer, which the correctness reward accepts
    completions = [xml_formatted(p.solution, p.answer) for p in a]
    assert set(REWARDS["correctness"]([None] * 300, completions, answer=[p.answer for p in a])) == {2.0}
    for p in a:
        assert p.solution.rstrip(".").endswith(p.answer)


def test_builtin_split_holds_out_eval_questions():
    train, held_out = load_questions(DataConfig(num_train=100, eval_size=10))
    assert len(train) == 100 and len(held_out) == 10
    assert not {q.question for q in train} & {q.question for q in held_out}


def test_prompt_rows_are_conversational_with_the_system_prompt():
    train, _ = load_questions(DataConfig(num_train=3, eval_size=1))
    rows = to_prompt_rows(train, "SYSTEM")
    assert rows[0]["prompt"][0] == {"role": "system", "content": "SYSTEM"}
    assert rows[0]["prompt"][1]["role"] == "user"
    assert rows[0]["answer"] == train[0].answer


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM_ROWS = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(20)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_files_in_each_format(tmp_path, suffix):
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        _write_jsonl(path, GSM_ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(GSM_ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(GSM_ROWS), path)
    train, held_out = load_questions(DataConfig(dataset=str(path), eval_size=5))
    assert len(train) == 15 and len(held_out) == 5
    q = (train + held_out)[0]
    assert q.answer.isdigit() and "####" not in q.solution


@pytest.mark.slow
def test_real_gsm8k_file(gsm8k_path):
    train, held_out = load_questions(DataConfig(dataset=str(gsm8k_path), eval_size=32, num_train=500))
    assert len(train) == 500 and len(held_out) == 32
    assert all(q.answer and q.solution for q in train)


def test_a_separate_eval_dataset_is_the_held_out_set_and_training_keeps_all_rows(tmp_path):
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    _write_jsonl(train_file, GSM_ROWS)
    _write_jsonl(test_file, [{"question": f"What is {i} * 3?", "answer": f"#### {3 * i}"} for i in range(30)])
    train, held_out = load_questions(DataConfig(dataset=str(train_file), eval_dataset=str(test_file), eval_size=8))
    assert len(train) == 20 and len(held_out) == 8
    assert all("* 3" in q.question for q in held_out) and not any("* 3" in q.question for q in train)
    again = load_questions(DataConfig(dataset=str(train_file), eval_dataset=str(test_file), eval_size=8))[1]
    assert again == held_out  # the same questions every run (shuffled by data.seed)
    builtin_train, builtin_eval = load_questions(DataConfig(num_train=50, eval_dataset=str(test_file), eval_size=30))
    assert len(builtin_train) == 50 and len(builtin_eval) == 30
    with pytest.raises(DataError, match="fewer than data.eval_size=31"):
        load_questions(DataConfig(dataset=str(train_file), eval_dataset=str(test_file), eval_size=31))


def _write(path, text, encoding="utf-8"):
    path.write_bytes(text.encode(encoding))
    return path


BAD_DATASETS = [
    (lambda p: p / "missing.jsonl", {}, "does not exist"),
    (lambda p: _write(p / "empty.jsonl", ""), {}, "is empty"),
    (lambda p: _write(p / "blank.csv", "\r\n\r\n,,\r\n"), {}, "is empty"),
    (lambda p: _write_jsonl(p / "cols.jsonl", [{"q": 1, "a": 2}] * 5), {},
     "has no 'question' column and no TRL 'prompt' column: its columns are 'q', 'a'; map the question with "
     "data.question_column=NAME"),
    (lambda p: _write_jsonl(p / "cols.jsonl", [{"q": 1, "a": 2}] * 5),
     {"question_column": "q", "answer_column": "label"},
     "has no column 'label' (data.answer_column): its columns are 'q', 'a'"),
    (lambda p: _write_jsonl(p / "cols.jsonl", [{"q": 1, "a": 2}] * 5), {"question_column": "q", "solution_column": "a",
                                                                        "answer_column": "a"},
     "name the same column"),
    (lambda p: (p / "bad.jsonl").write_text("{not json\n") and p / "bad.jsonl", {}, "not valid JSON"),
    (lambda p: (p / "bad.json").write_text('{"a": 1}') and p / "bad.json", {}, "must hold a JSON list"),
    (lambda p: (p / "bad.json").write_text('[{"a": 1}') and p / "bad.json", {}, "is not valid JSON"),
    (lambda p: (p / "bad.parquet").write_bytes(b"garbage") and p / "bad.parquet", {}, "cannot read dataset"),
    (lambda p: _write_jsonl(p / "few.jsonl", GSM_ROWS[:3]), {}, "too few to hold out"),
    (lambda p: _write(p / "x.xlsx", "x"), {},
     "unknown extension '.xlsx': use .jsonl, .ndjson, .json, .csv, .tsv, .parquet"),
    (lambda p: _write(p / "wide.csv", "question,answer\nWhat is 1, 2?,3,4\n"), {},
     "quote fields that contain the separator"),
    (lambda p: _write(p / "dup.csv", "question,question\na,b\n"), {}, "names the column 'question' twice"),
    (lambda p: (p / "latin.csv").write_bytes(b"question,answer\n\x81\x8d,1\n") and p / "latin.csv", {},
     "neither UTF-8 nor Windows-1252"),
    (lambda p: (p / "u16.csv").write_bytes("question,answer\n".encode("utf-16-le")) and p / "u16.csv", {},
     "UTF-16 without a byte-order mark"),
    (lambda p: _write_jsonl(p / "q.jsonl", [{"question": "", "answer": "1"}] * 6), {}, "row 1 has an empty 'question'"),
    (lambda p: _write_jsonl(p / "pr.jsonl", [{"prompt": 7}] * 6), {},
     "'prompt' must be text or a list of chat messages"),
    (lambda p: _write_jsonl(p / "pr.jsonl", [{"prompt": [{"content": "hi"}]}] * 6), {},
     "'prompt' must be text or a list of chat messages"),
    (lambda p: _write_jsonl(p / "mix.jsonl", [{"prompt": "hi"},
                                              {"prompt": [{"role": "user", "content": "hi"}]}] * 3), {},
     "mixes text prompts and chat-message prompts"),
    (lambda p: _write_jsonl(p / "types.jsonl", [{"question": "a", "answer": "1", "level": 3},
                                                {"question": "b", "answer": "2", "level": "hard"}] * 3), {},
     "column 'level' of dataset"),
    (lambda p: _write_jsonl(p / "kw.jsonl", [{"question": "a", "answer": "1", "completions": "x"}] * 6), {},
     "has a column 'completions', a keyword TRL itself passes the reward functions: rename that column"),
]


@pytest.mark.parametrize("make,mapping,fragment", BAD_DATASETS, ids=[f[:40] for _, _, f in BAD_DATASETS])
def test_bad_datasets_raise_one_clear_error(tmp_path, make, mapping, fragment):
    path = make(tmp_path)
    with pytest.raises(DataError) as info:
        load_questions(DataConfig(dataset=str(path), eval_size=5, **mapping))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- files as tools export them

TRICKY = [  # commas, quotes, a line break inside a field, non-ASCII that Windows-1252 also has
    {"question": 'Zoë buys 3 "café" mugs, at €4 each. Total?', "answer": "She pays 3 * 4 = 12.\n#### 12"},
    {"question": "Line one\nline two: what is 2 + 5?", "answer": "#### 7"},
    {"question": "How many “quoted” apples; 10 - 4?", "answer": "10 - 4 = 6 #### 6"},
] + [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(1, 6)]
GOLDS = {r["question"]: r["answer"].split("####")[1].strip() for r in TRICKY}


def _pandas(kind, **kwargs):
    def write(path):
        import pandas as pd

        frame = pd.DataFrame(TRICKY)
        getattr(frame, f"to_{kind}")(path, **kwargs)
        return path
    return write


def _hf(kind):
    def write(path):
        from datasets import Dataset

        getattr(Dataset.from_list(TRICKY), f"to_{kind}")(str(path))
        return path
    return write


def _jsonl_as_editors_save_it(path):
    """A BOM, CRLF line ends, blank lines, and a raw U+2028 inside a string (legal JSON, not a line break)."""
    lines = [json.dumps(r, ensure_ascii=False) for r in TRICKY]
    lines[3] = lines[3].replace("What is", "What\u2028is")
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(lines).encode() + b"\r\n\r\n")
    return path


EXPORTS = {
    "pandas to_csv (index column, LF)": ("d.csv", _pandas("csv")),
    "Excel 'CSV UTF-8' (BOM, CRLF)": ("d.csv", _pandas("csv", index=False, encoding="utf-8-sig",
                                                       lineterminator="\r\n")),
    "Excel 'CSV' in a ';' locale (Windows-1252, CRLF)": ("d.csv", _pandas("csv", index=False, sep=";",
                                                                       encoding="cp1252", lineterminator="\r\n")),
    "Excel 'Unicode Text' (UTF-16 with BOM, tabs)": ("d.tsv", _pandas("csv", index=False, sep="\t", encoding="utf-16")),
    "old Mac line ends (CR, every field quoted)": ("d.csv", _pandas("csv", index=False, lineterminator="\r",
                                                                    quoting=1)),
    "TSV": ("d.tsv", _pandas("csv", index=False, sep="\t")),
    "pandas to_json (default: columns)": ("d.json", _pandas("json")),
    "pandas to_json records": ("d.json", _pandas("json", orient="records", force_ascii=False)),
    "pandas to_json split": ("d.json", _pandas("json", orient="split")),
    "pandas to_json index": ("d.json", _pandas("json", orient="index")),
    "pandas to_json table": ("d.json", _pandas("json", orient="table")),
    "columns of values": ("d.json", lambda p: _write(p, json.dumps({k: [r[k] for r in TRICKY] for k in TRICKY[0]}))),
    "pandas to_json lines": ("d.jsonl", _pandas("json", orient="records", lines=True)),
    "pandas to_parquet": ("d.parquet", _pandas("parquet")),
    "datasets to_json (JSON Lines named .json)": ("d.json", _hf("json")),
    "datasets to_csv": ("d.csv", _hf("csv")),
    "datasets to_parquet": ("d.parquet", _hf("parquet")),
    "editor JSONL (BOM, CRLF, blank lines, U+2028)": ("d.jsonl", _jsonl_as_editors_save_it),
    "UTF-32 JSON": ("d.json", lambda p: _write(p, json.dumps({"train": TRICKY}), "utf-32")),
    "NDJSON": ("d.ndjson", lambda p: _write(p, "".join(json.dumps(r) + "\n" for r in TRICKY))),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_files_as_common_tools_write_them(tmp_path, name):
    file_name, write = EXPORTS[name]
    path = write(tmp_path / file_name)
    train, held_out = load_questions(DataConfig(dataset=str(path), eval_size=2))
    questions = train + held_out
    assert len(questions) == len(TRICKY)
    expected = {q.replace("What is", "What\u2028is") if "U+2028" in name and q == TRICKY[3]["question"] else q
                for q in GOLDS}
    assert {q.question for q in questions} == expected
    for q in questions:
        assert q.answer == GOLDS[q.question.replace("\u2028", " ")]
        assert "####" not in q.solution
    assert next(q for q in questions if q.answer == "12").solution == "She pays 3 * 4 = 12."


# --------------------------------------------------------------------------- column mapping and gold answers

MATH_ROWS = [  # MATH (hendrycks): problem / solution with the answer boxed inside it, and other columns
    {"problem": f"What is $\\frac{{{i}}}{{2}} + \\frac{{{i}}}{{2}}$?",
     "solution": f"We add: $\\frac{{{2 * i}}}{{2}} = \\boxed{{{i}}}$.",
     "level": "Level 1", "type": "Algebra"} for i in range(1, 7)
] + [{"problem": "Simplify $\\frac{2}{4}$.", "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.", "level": "Level 2",
      "type": "Algebra"}]


def test_math_style_data_maps_the_question_and_takes_the_boxed_answer_from_the_solution(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    config = DataConfig(dataset=str(path), eval_size=2, question_column="problem")
    train, held_out = load_questions(config)
    by_answer = {q.answer: q for q in train + held_out}
    assert set(by_answer) == {"1", "2", "3", "4", "5", "6", "\\frac{1}{2}"}
    half = by_answer["\\frac{1}{2}"]
    assert half.question == "Simplify $\\frac{2}{4}$." and half.solution.startswith("Divide by 2")
    assert half.extra == {"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 2", "type": "Algebra"}
    rows = to_prompt_rows(train + held_out, "SYS")
    assert all(set(r) == {"prompt", "problem", "level", "type", "answer", "solution"} for r in rows)
    # the gold shapes work with the reward that scores them: the boxed answer, stated as the model would
    golds = [r["answer"] for r in rows]
    completions = [xml_formatted("work", g) for g in golds]
    assert REWARDS["correctness"]([None] * len(rows), completions, answer=golds) == [2.0] * len(rows)
    assert REWARDS["correctness"]([None], [xml_formatted("w", "0.5")], answer=["\\frac{1}{2}"]) == [2.0]


def test_answer_column_forms_and_a_mapped_plain_label(tmp_path):
    rows = [{"q": "Is 4 even?", "label": "yes", "notes": "n1"}, {"q": "Is 3 even?", "label": "no", "notes": "n2"},
            {"q": "MATH-500 style", "label": "\\frac{14}{3}", "notes": ""},
            {"q": "boxed", "label": "so \\boxed{7}", "notes": ""},
            {"q": "empty gold", "label": "", "notes": ""}, {"q": "gsm", "label": "2 + 2 = 4 #### 4", "notes": ""}]
    path = tmp_path / "labels.csv"
    import csv

    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["q", "label", "notes"])
        writer.writeheader()
        writer.writerows(rows)
    train, held_out = load_questions(DataConfig(dataset=str(path), eval_size=1, question_column="q",
                                                answer_column="label"))
    got = {q.question: (q.answer, q.solution) for q in train + held_out}
    assert got == {"Is 4 even?": ("yes", ""), "Is 3 even?": ("no", ""), "MATH-500 style": ("\\frac{14}{3}", ""),
                   "boxed": ("7", "so \\boxed{7}"), "empty gold": (None, ""), "gsm": ("4", "2 + 2 = 4")}
    rows_out = to_prompt_rows(train + held_out, "SYS")
    assert {r["label"] for r in rows_out} == {row["label"] for row in rows}  # the raw column reaches the rewards too
    assert {r["notes"] for r in rows_out} == {"n1", "n2", ""}


def test_trl_standard_and_conversational_prompt_columns_with_every_other_column(tmp_path):
    standard = [{"prompt": f"Write a word that rhymes with {w}:", "rhymes_with": w, "min_len": i} for i, w in
                enumerate(["cat", "dog", "sun", "tree", "moon", "star"])]
    train, held_out = load_questions(DataConfig(dataset=str(_write_jsonl(tmp_path / "s.jsonl", standard)), eval_size=2))
    rows = to_prompt_rows(train + held_out, "IGNORED for a given prompt")
    assert {r["prompt"] for r in rows} == {r["prompt"] for r in standard}  # text: TRL's standard format, as it is
    assert all(set(r) == {"prompt", "rhymes_with", "min_len"} for r in rows)  # no gold: no answer column at all
    assert {(r["rhymes_with"], r["min_len"]) for r in rows} == {(r["rhymes_with"], r["min_len"]) for r in standard}
    assert train[0].answer is None and train[0].question == train[0].prompt

    chats = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Capital of {c}?"}],
              "answer": a, "country": c} for c, a in [("France", "Paris"), ("Peru", "Lima"), ("Chad", "N'Djamena"),
                                                      ("Mali", "Bamako"), ("Fiji", "Suva"), ("Iraq", "Baghdad")]]
    train, held_out = load_questions(DataConfig(dataset=str(_write_jsonl(tmp_path / "c.jsonl", chats)), eval_size=2))
    rows = to_prompt_rows(train + held_out, "IGNORED")
    assert all(r["prompt"][0] == {"role": "system", "content": "Be brief."} for r in rows)
    assert ({r["answer"] for r in rows} == {c["answer"] for c in chats}
            and {r["country"] for r in rows} == {c["country"] for c in chats})
    assert {q.question for q in train + held_out} == {f"Capital of {c['country']}?" for c in chats}


def test_a_local_dataset_folder_with_configs_and_splits(tmp_path):
    """`NAME@config:split` goes through datasets.load_dataset, as for a hub id (here a local folder that
    declares its configs and splits in its README, as hub datasets do)."""
    folder = tmp_path / "my_gsm"
    for config, rows in (("main", GSM_ROWS), ("tiny", GSM_ROWS[:4])):
        for split, part in (("train", rows[: len(rows) // 2 + 2]), ("test", rows[len(rows) // 2:])):
            (folder / config).mkdir(parents=True, exist_ok=True)
            _write_jsonl(folder / config / f"{split}.jsonl", part)
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n"
        "- config_name: tiny\n  data_files:\n  - split: train\n    path: tiny/train.jsonl\n"
        "  - split: test\n    path: tiny/test.jsonl\n"
        "---\n")
    train, held_out = load_questions(DataConfig(dataset=f"{folder}@main:train", eval_dataset=f"{folder}@main:test",
                                                eval_size=5))
    assert len(train) == 12 and len(held_out) == 5 and all(q.answer.isdigit() for q in train + held_out)
    train, _ = load_questions(DataConfig(dataset=f"{folder}@tiny:train", eval_dataset=f"{folder}@tiny:test",
                                         eval_size=2))
    assert len(train) == 4
    with pytest.raises(DataError, match=r"cannot load dataset .*@main:validation.*check the folder's config and split"):
        load_questions(DataConfig(dataset=f"{folder}@main:validation", eval_size=2))


# --------------------------------------------------------------------------- docs/data.md's example, run as written

def _docs_data_blocks() -> dict:
    from conftest import REPO

    text = (REPO / "docs" / "data.md").read_text()
    section = text[text.index("## Your data: a task that is not arithmetic"):]
    section = section[:section.index("\n## ", 4)]
    import re

    return {lang: body for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)}


@pytest.mark.slow
def test_the_readme_data_example_trains_on_a_task_that_is_not_arithmetic(tmp_path):
    """docs/data.md "Your data: a task that is not arithmetic" (the README points there): reviews.csv (saved here as
    Excel's "CSV UTF-8" does: BOM, CRLF) and sentiment_reward.py, with the command as written; the reward gets the
    `sentiment` column."""
    import os
    import shlex
    import subprocess
    import sys

    from conftest import REPO

    blocks = _docs_data_blocks()
    (tmp_path / "reviews.csv").write_bytes(b"\xef\xbb\xbf" + blocks["csv"].replace("\n", "\r\n").encode())
    (tmp_path / "sentiment_reward.py").write_text(blocks["python"])
    argv = shlex.split(blocks["bash"].replace("\\\n", " "))
    assert (argv[:3] == ["python", "-m", "lowvram_grpo.run"] and "reviews.csv" in argv
            and "rewards.module=sentiment_reward.py" in argv)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "reviews"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 3
    assert summary["samples"][0]["question"] in blocks["csv"]  # a review, asked after the system prompt
    for side in ("before", "after"):  # scored by says_sentiment + xmlcount; no gold answer column: no accuracy
        assert "reward_mean" in summary[side] and "accuracy_strict" not in summary[side]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all("rewards/says_sentiment/mean" in m for m in metrics)
    assert "Is the review positive or negative?" in (out / "config.yaml").read_text()
