import json

import pytest

from lowvram_grpo.config import DataConfig
from lowvram_grpo.data import DataError, arithmetic_problems, load_questions, to_prompt_rows
from lowvram_grpo.rewards import REWARDS, xml_formatted


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


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p / "missing.jsonl", "does not exist"),
    (lambda p: (p / "empty.jsonl").write_text("") and p / "empty.jsonl" or p / "empty.jsonl", "is empty"),
    (lambda p: _write_jsonl(p / "cols.jsonl", [{"q": 1, "a": 2}] * 5), "lacks the field(s) question, answer"),
    (lambda p: (p / "bad.jsonl").write_text("{not json\n") and p / "bad.jsonl", "not valid JSON"),
    (lambda p: (p / "bad.json").write_text('{"a": 1}') and p / "bad.json", "must hold a JSON list"),
    (lambda p: (p / "bad.parquet").write_bytes(b"garbage") and p / "bad.parquet", "cannot read dataset"),
    (lambda p: _write_jsonl(p / "few.jsonl", GSM_ROWS[:3]), "too few to hold out"),
])
def test_bad_datasets_raise_one_clear_error(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(DataError) as info:
        load_questions(DataConfig(dataset=str(path), eval_size=5))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
