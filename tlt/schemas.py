"""Pandera contracts for the DataFrames that cross stage boundaries.

`PromptSchema` is the shape of a validated prompt table (what `tlt.prompts` hands to training);
`RolloutSchema` the shape of rollout rows (one sampled response per row). Both are strict (an
unknown column is an error, not silently carried along) and coerce (a numeric answer such as
42 becomes "42"). Validate with `lazy=True` so that every failure is reported at once.

`failures(schema, df)` runs a schema and turns pandera's failure cases into `BadRow`s
(row, column, reason) that a user can act on; nobody sees a raw SchemaErrors.

Coercion happens before pandera's checks, so `5` would pass as the prompt "5". `RAW_TYPES`
therefore checks the Python type of every cell *before* coercion; `tlt.prompts.validate_rows` runs
it first and reports a wrong type instead of a silently stringified value.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

PROMPT_COLUMNS = ["id", "prompt", "answer", "task", "difficulty", "meta"]
CUSTOM_TASK = "custom"  # task of user rows that no reasoning-gym scorer knows


@dataclass(frozen=True)
class BadRow:
    """One problem: where (row, column) and what, phrased for the user."""

    row: int  # 1-based row / line number; 0 = the whole file (a missing or unknown column)
    column: str
    reason: str

    def __str__(self) -> str:
        where = f"row {self.row}, column" if self.row else "column"
        return f"{where} '{self.column}': {self.reason}"


def is_missing(value: object) -> bool:
    """None / NaN / pd.NA, without choking on lists or dicts (where pd.isna returns arrays)."""
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and math.isnan(value)


def _is_text(value: object) -> bool:
    return is_missing(value) or isinstance(value, str)


def _is_scalar(value: object) -> bool:
    """An answer may be written as a number in JSON; bools, lists and dicts are mistakes."""
    if is_missing(value) or isinstance(value, str):
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_id(value: object) -> bool:
    if is_missing(value) or isinstance(value, str):
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _type_check(fn, expected: str) -> pa.Check:
    return pa.Check(fn, element_wise=True, ignore_na=False, name="raw_type", error=f"wrong type: expected {expected}")


# Checked before coercion; columns optional here (PromptSchema reports missing ones).
RAW_TYPES = pa.DataFrameSchema(
    {
        "id": pa.Column(checks=_type_check(_is_id, "a string or integer"), nullable=True, required=False),
        "prompt": pa.Column(checks=_type_check(_is_text, "a string"), nullable=True, required=False),
        "answer": pa.Column(checks=_type_check(_is_scalar, "a string or number"), nullable=True, required=False),
        "task": pa.Column(checks=_type_check(_is_text, "a string"), nullable=True, required=False),
        "difficulty": pa.Column(checks=_type_check(_is_scalar, "a string or number"), nullable=True,
                                required=False),
        "meta": pa.Column(checks=_type_check(_is_text, "a JSON object"), nullable=True, required=False),
    },
    strict=False,
    name="RawPromptTypes",
)


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


class PromptSchema(pa.DataFrameModel):
    """A validated prompt table: one row per prompt; the index is the source row number."""

    id: Series[str] = pa.Field(unique=True)  # pandera lists every copy; tlt.prompts keeps the first
    prompt: Series[str]
    answer: Series[str]
    task: Series[str]
    difficulty: Series[str] = pa.Field(nullable=True)
    meta: Series[str]

    class Config:
        strict = True
        coerce = True

    @pa.check("prompt", "answer", element_wise=True, name="not_blank")
    def _not_blank(cls, value: str) -> bool:
        return bool(value.strip())

    @pa.check("meta", element_wise=True, name="json_object")
    def _meta_is_json(cls, value: str) -> bool:
        return _json_object(value)


class RolloutSchema(pa.DataFrameModel):
    """One sampled response per row: group `prompt_id`, member `sample_idx` (GRPO group index)."""

    step: Series[int] = pa.Field(ge=0)
    prompt_id: Series[str]
    prompt: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    sample_idx: Series[int] = pa.Field(ge=0)
    response: Series[str]
    reward: Series[float]
    length: Series[int] = pa.Field(ge=0)

    class Config:
        strict = True
        coerce = True
        unique = ["prompt_id", "sample_idx"]

    @pa.check("reward", name="finite")
    def _finite(cls, reward: Series[float]) -> Series[bool]:
        return reward.map(math.isfinite)


def rollout_table(step: int, prompts: pd.DataFrame, group_index: list[int], responses: list[str],
                  rewards: list[float], lengths: list[int]) -> pd.DataFrame:
    """The rollout of one RL step as a validated `RolloutSchema` frame (raises SchemaErrors).

    `prompts` is the step's prompt table (columns id, prompt); `group_index[i]` is the row of
    response i in it. A NaN reward or a repeated (prompt_id, sample_idx) is a bug upstream, so
    it fails here rather than in the tracker's table.
    """
    counts: dict[int, int] = {}
    sample_idx = []
    for g in group_index:
        sample_idx.append(counts.get(g, 0))
        counts[g] = sample_idx[-1] + 1
    df = pd.DataFrame({"step": step, "prompt_id": [str(prompts["id"].iloc[g]) for g in group_index],
                       "prompt": [prompts["prompt"].iloc[g] for g in group_index], "sample_idx": sample_idx,
                       "response": list(responses), "reward": [float(r) for r in rewards],
                       "length": [int(n) for n in lengths]})
    return RolloutSchema.validate(df, lazy=True)


def frame_digest(df: pd.DataFrame) -> str:
    """A content hash of a table (values and column names, not the index): the digest under which
    a validated dataset is logged, equal for equal tables."""
    h = hashlib.sha256(",".join(map(str, df.columns)).encode())
    h.update(pd.util.hash_pandas_object(df, index=False).values.tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- failures -> BadRows
def _reason(check: str, column: str, value: Any) -> str:
    if check.startswith("wrong type"):
        return f"{check}, got {type(value).__name__} {value!r:.40}"
    if check == "not_nullable":
        return f"missing {column}"
    if check == "not_blank":
        return f"empty {column}" if value == "" else f"blank {column} (whitespace only)"
    if check == "json_object":
        return f"meta must be a JSON object, got {value!r:.40}"
    return f"failed check {check} (value {value!r:.40})"


def failures(schema, df: pd.DataFrame) -> list[BadRow]:
    """Validate lazily and translate pandera's failure cases into BadRows (never raises SchemaErrors).

    Rows come from the frame's index; failures that concern a whole column get row 0.
    """
    try:
        schema.validate(df, lazy=True)
        return []
    except pa.errors.SchemaErrors as err:
        cases = err.failure_cases
    cases = cases.assign(row=[0 if is_missing(i) else int(i) for i in cases["index"]]).sort_values("row", kind="stable")
    bad, first_id = [], {}
    for case in cases.itertuples():
        row = case.row
        if case.check == "column_in_dataframe":
            bad.append(BadRow(0, str(case.failure_case), "missing required column"))
        elif case.check == "column_in_schema":
            bad.append(BadRow(0, str(case.failure_case), _unknown_column(str(case.failure_case))))
        elif case.check == "field_uniqueness":  # pandera lists every copy; keep the first as valid
            if case.failure_case in first_id:
                bad.append(BadRow(row, "id", f"duplicate id {case.failure_case!r} (first in row "
                                             f"{first_id[case.failure_case]})"))
            else:
                first_id[case.failure_case] = row
        else:
            bad.append(BadRow(row, str(case.column), _reason(str(case.check), str(case.column), case.failure_case)))
    return bad


ALIASES = {"question": "prompt", "problem": "prompt", "solution": "answer", "target": "answer", "metadata": "meta"}


def _unknown_column(name: str) -> str:
    near = ALIASES.get(name) or next(iter(difflib.get_close_matches(name, PROMPT_COLUMNS, n=1)), None)
    hint = f"rename it to '{near}'" if near else "remove it"
    return f"unknown column; {hint} (allowed: {', '.join(PROMPT_COLUMNS)})"
