"""Data loading and validation: every bad file names its rows, columns and reasons."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pandera.errors import SchemaErrors
import reasoning_gym as rg

from tlt.config import DataConfig, GeneratorSpec
from tlt.prompts import (BadRow, DataError, generate_rows, load_dataset, prompt_ids, read_rows, render_prompt,
                      rg_entry, split_rows, validate_file, validate_rows)
from tlt.models import tiny_tokenizer
from tlt.schemas import PROMPT_COLUMNS, PromptSchema, RolloutSchema, rollout_table

DATA = Path(__file__).parent / "data"
BAD = DATA / "bad"
GOOD = DATA / "good" / "small.jsonl"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def problems(path: Path, tok=None) -> list[tuple[int, str, str]]:
    report = validate_file(path, tok, max_prompt_tokens=256)
    assert not report.ok
    return [(b.row, b.column, b.reason) for b in report.bad]


def test_good_file_is_clean(tok):
    report = validate_file(GOOD, tok)
    assert report.ok, report.format()
    assert report.n_rows == 6 and len(report.clean) == 6
    assert report.summary() == "ok: 6 rows, tasks custom=6"
    assert list(report.clean.columns) == PROMPT_COLUMNS
    assert report.clean.loc[3, "answer"] == "9"  # a numeric answer is coerced to text
    assert json.loads(report.clean.loc[5, "meta"]) == {"source": "hand-written"}
    assert report.format() == ""


@pytest.mark.parametrize("name, expected", [
    ("blank_prompt.jsonl", [(2, "prompt", "blank prompt")]),
    ("empty_prompt.jsonl", [(3, "prompt", "empty prompt")]),
    ("missing_answer.jsonl", [(2, "answer", "missing answer"), (3, "answer", "blank answer"),
                              (4, "answer", "missing answer")]),
    ("duplicate_ids.jsonl", [(3, "id", "duplicate id 'a' (first in row 1)"),
                             (5, "id", "duplicate id 'b' (first in row 2)")]),
    ("unknown_task.jsonl", [(2, "task", "unknown reasoning-gym task 'basic_arithmatic'")]),
    ("wrong_types.jsonl", [(1, "prompt", "wrong type"), (2, "prompt", "wrong type"), (3, "answer", "wrong type"),
                           (5, "task", "wrong type")]),
    ("missing_column.jsonl", [(0, "answer", "missing required column")]),
    ("extra_column.jsonl", [(0, "question", "unknown column; rename it to 'prompt'")]),
])
def test_bad_file_lists_rows(name, expected):
    found = problems(BAD / name)
    assert [(r, c) for r, c, _ in found] == [(r, c) for r, c, _ in expected]
    for (_, _, reason), (_, _, keyword) in zip(found, expected):
        assert keyword in reason


def test_too_long_needs_tokenizer(tok):
    assert validate_file(BAD / "too_long.jsonl").ok  # no tokenizer: the limit cannot be counted
    [(row, column, reason)] = problems(BAD / "too_long.jsonl", tok)
    assert (row, column) == (2, "prompt") and "prompt too long" in reason and "max_prompt_tokens=256" in reason


def test_unknown_task_suggests_the_close_name():
    [(_, _, reason)] = problems(BAD / "unknown_task.jsonl")
    assert "did you mean 'basic_arithmetic'" in reason


def test_format_one_line_per_problem():
    report = validate_file(BAD / "missing_answer.jsonl")
    assert report.format().splitlines()[0] == "row 2, column 'answer': missing answer"
    assert report.bad_rows == [2, 3, 4]
    assert report.summary().startswith("invalid: 3 problems in 3 of 4 rows")
    assert validate_file(BAD / "missing_column.jsonl").format() == "column 'answer': missing required column"


@pytest.mark.parametrize("name, words", [
    ("malformed.jsonl", ["3 malformed line(s) (lines 2, 4, 5)", "line 2:", "line 4:", "line 5: expected a JSON object"]),
    ("non_utf8.jsonl", ["not UTF-8", "byte 0xff", "byte offset 88", "line 2"]),
    ("empty.jsonl", ["is empty"]),
])
def test_unreadable_file_raises_data_error(name, words):
    with pytest.raises(DataError) as err:
        read_rows(BAD / name)
    for word in words:
        assert word in str(err.value)


def test_malformed_lines_are_structured():
    with pytest.raises(DataError) as err:
        read_rows(BAD / "malformed.jsonl")
    assert [b.row for b in err.value.bad] == [2, 4, 5]
    assert isinstance(err.value.bad[0], BadRow)


def test_validate_lists_malformed_lines_and_row_errors_together(tmp_path):
    """`tlt data validate`: a malformed line does not hide the problems of the rows that parsed."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "a?", "answer": "1"}\n{"prompt": "b?", "answer": \n{"prompt": "", "answer": "2"}\n'
                    '[1, 2]\n{"prompt": "c?"}\n')
    report = validate_file(path)
    assert [(b.row, b.column) for b in report.bad] == [(2, "(json)"), (3, "prompt"), (4, "(json)"), (5, "answer")]
    assert report.n_rows == 5 and list(report.clean.index) == [1]


def test_partly_filled_id_column_is_optional(tmp_path):
    """`id` is optional per row: rows without one get their row number, rows with one keep it."""
    path = tmp_path / "ids.jsonl"
    path.write_text('{"id": "x", "prompt": "a?", "answer": "1"}\n{"prompt": "b?", "answer": "2"}\n'
                    '{"id": null, "prompt": "c?", "answer": "3"}\n')
    report = validate_file(path)
    assert report.ok, report.format()
    assert list(report.clean["id"]) == ["x", "2", "3"]


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        read_rows(tmp_path / "x.csv")


def test_blank_lines_keep_line_numbers(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a?", "answer": "1"}\n\n\n{"prompt": "", "answer": "2"}\n\n')
    report = validate_file(path)
    assert [(b.row, b.reason) for b in report.bad] == [(4, "empty prompt")]
    assert report.clean.loc[1, "id"] == "1"  # a missing id column defaults to the row number


def test_plain_frame_rows_are_numbered_from_one():
    df = pd.DataFrame({"prompt": ["a?", "b?", "  "], "answer": ["1", "2", "3"]})
    report = validate_rows(df)
    assert [str(b) for b in report.bad] == ["row 3, column 'prompt': blank prompt (whitespace only)"]
    assert list(report.clean.index) == [1, 2] and list(report.clean["task"]) == ["custom", "custom"]


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a?", "answer": "1"}, {"prompt": "b?", "answer": 2}]))
    assert validate_file(path).ok


@pytest.fixture
def bad_parquet(tmp_path) -> Path:
    table = pa.table({"id": ["p1", "p2", "p3"], "prompt": [7, 8, 9], "answer": [["1"], ["2"], None]})
    pq.write_table(table, tmp_path / "bad.parquet")
    return tmp_path / "bad.parquet"


def test_bad_parquet(bad_parquet):
    found = problems(bad_parquet)
    assert [(r, c) for r, c, _ in found] == [(1, "prompt"), (1, "answer"), (2, "prompt"), (2, "answer"),
                                             (3, "prompt"), (3, "answer")]
    assert "wrong type" in found[0][2] and found[-1][2] == "missing answer"


def test_good_parquet_round_trip(tmp_path):
    df = read_rows(GOOD)
    pd.DataFrame({"prompt": df["prompt"].astype(str), "answer": df["answer"].astype(str)}).to_parquet(
        tmp_path / "ok.parquet")
    assert validate_file(tmp_path / "ok.parquet").ok
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet"):
        read_rows(tmp_path / "junk.parquet")


def test_render_prompt_applies_template_once(tok):
    text = render_prompt(tok, "What is 2 + 2?", " Reply with a number.", system_prompt="Be brief.")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2? Reply with a number."
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = prompt_ids(tok, "What is 2 + 2?", " Reply with a number.", system_prompt="Be brief.")
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


SPECS = [GeneratorSpec(task="basic_arithmetic", size=6, params={"min_terms": 2, "max_terms": 2}),
         GeneratorSpec(task="products", size=5), GeneratorSpec(task="chain_sum", size=5)]


def test_generation_is_deterministic_and_scorable():
    df = generate_rows(SPECS, seed=7)
    assert df.equals(generate_rows(SPECS, seed=7))
    assert not df["prompt"].equals(generate_rows(SPECS, seed=8)["prompt"])
    assert list(df["id"][:2]) == ["basic_arithmetic-0", "basic_arithmetic-1"] and df["id"].is_unique
    assert dict(df["task"].value_counts()) == {"basic_arithmetic": 6, "products": 5, "chain_sum": 5}
    assert validate_rows(df).ok
    for _, row in df.iterrows():  # scorers work on entries rebuilt from the stored JSON meta
        entry = rg_entry(row)
        assert rg.get_score_answer_fn(row["task"])(answer=row["answer"], entry=entry) == 1.0


def test_unknown_generator_lists_close_names():
    with pytest.raises(DataError, match="did you mean 'basic_arithmetic'"):
        generate_rows([GeneratorSpec(task="basic_arithmatic")], seed=0)
    with pytest.raises(DataError, match=r"generators\[0\] \('products'\) rejected params"):
        generate_rows([GeneratorSpec(task="products", params={"bogus": 1})], seed=0)


def test_split_sizes_and_determinism():
    df = PromptSchema.validate(generate_rows([GeneratorSpec(task="chain_sum", size=20)], seed=0))
    train, held = split_rows(df, 5, seed=1)
    assert (len(train), len(held)) == (15, 5)
    assert set(train["id"]).isdisjoint(held["id"]) and set(train["id"]) | set(held["id"]) == set(df["id"])
    assert split_rows(df, 5, seed=1)[1].equals(held)
    assert not split_rows(df, 5, seed=2)[1]["id"].equals(held["id"])
    with pytest.raises(DataError, match="lower data.heldout_size"):
        split_rows(df, 20, seed=0)


def test_load_dataset_from_generators(tok, tmp_path):
    cfg = DataConfig(generators=SPECS, heldout_size=4, seed=3)
    ds = load_dataset(cfg, tok)
    assert (len(ds.train), len(ds.heldout), len(ds.dropped)) == (12, 4, 0)
    assert ds.report.ok and list(ds.train.columns) == PROMPT_COLUMNS
    ds.train.to_parquet(tmp_path / "train.parquet")  # what the pipeline writes must read back as valid data
    assert validate_file(tmp_path / "train.parquet").ok


def test_on_invalid_error_vs_drop(tok):
    cfg = DataConfig(path=str(BAD / "duplicate_ids.jsonl"), heldout_size=1)
    with pytest.raises(DataError) as err:
        load_dataset(cfg, tok)
    msg = str(err.value)
    assert "row 3, column 'id': duplicate id 'a'" in msg and "data.on_invalid: drop" in msg
    ds = load_dataset(cfg.model_copy(update={"on_invalid": "drop"}), tok)
    assert list(ds.dropped.index) == [3, 5] and list(ds.dropped["id"]) == ["a", "b"]
    assert (len(ds.train), len(ds.heldout)) == (2, 1)
    assert sorted(pd.concat([ds.train, ds.heldout])["id"]) == ["a", "b", "c"]


def test_drop_cannot_fix_a_missing_column(tok):
    cfg = DataConfig(path=str(BAD / "missing_column.jsonl"), on_invalid="drop", heldout_size=1)
    with pytest.raises(DataError, match="dropping rows cannot fix"):
        load_dataset(cfg, tok)


def test_rollout_schema():
    good = pd.DataFrame({"step": [0, 0], "prompt_id": ["a", "a"], "prompt": ["2+2?", "2+2?"], "sample_idx": [0, 1],
                         "response": ["4", "5"], "reward": [1.0, 0.0], "length": [1, 1]})
    RolloutSchema.validate(good, lazy=True)
    bad = pd.concat([good, good]).assign(sample_idx=[0, 1, 2, 3], reward=[1.0, float("nan"), float("inf"), 0.0],
                                         length=[1, -1, 1, 1])
    with pytest.raises(SchemaErrors) as err:
        RolloutSchema.validate(bad, lazy=True)
    cases = err.value.failure_cases
    assert set(zip(cases["column"], cases["check"])) == {("reward", "not_nullable"), ("reward", "finite"),
                                                         ("length", "greater_than_or_equal_to(0)")}


def test_rollout_table_numbers_group_members_and_rejects_bad_rewards():
    prompts = pd.DataFrame({"id": ["p0", "p1"], "prompt": ["2+2?", "3+3?"]})
    df = rollout_table(3, prompts, [0, 0, 1, 1, 0], ["4", "5", "6", "7", "4"], [1.0, 0.0, 1.0, 0.0, 1.0], [1, 1, 1, 2, 1])
    assert list(df.columns) == ["step", "prompt_id", "prompt", "sample_idx", "response", "reward", "length"]
    assert list(zip(df["prompt_id"], df["sample_idx"])) == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1), ("p0", 2)]
    assert list(df["prompt"]) == ["2+2?", "2+2?", "3+3?", "3+3?", "2+2?"] and set(df["step"]) == {3}
    with pytest.raises(SchemaErrors):
        rollout_table(3, prompts, [0, 1], ["4", "6"], [float("nan"), 1.0], [1, 1])
