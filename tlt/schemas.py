"""Pandera contracts for the DataFrames that cross stage boundaries.

`PromptSchema` is the shape of a validated prompt table (what `tlt.data` hands to training);
`RolloutSchema` the shape of rollout rows (one sampled response per row). Both are strict (an
unknown column is an error, not silently carried along) and coerce (a numeric answer such as
42 becomes "42"). Validate with `lazy=True` so that every failure is reported at once.

Coercion happens before pandera's checks, so `5` would pass as the prompt "5". `RAW_TYPES`
therefore checks the Python type of every cell *before* coercion; `tlt.data.validate_rows` runs
it first and reports a wrong type instead of a silently stringified value.
"""
from __future__ import annotations

import json
import math
import numbers

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

PROMPT_COLUMNS = ["id", "prompt", "answer", "task", "difficulty", "meta"]
REQUIRED_COLUMNS = ["prompt", "answer"]  # the others get defaults in tlt.data (id, task, meta)
CUSTOM_TASK = "custom"  # task of user rows that no reasoning-gym scorer knows


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

    id: Series[str] = pa.Field(unique=True)  # pandera lists every copy; tlt.data keeps the first
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

    prompt_id: Series[str]
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
