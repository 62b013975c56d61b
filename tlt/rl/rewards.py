"""Rewards: pure functions `(completions, answers, **kw) -> list[float]` that never raise on model output.

- `math_reward`: math-verify (`verify(parse(gold), parse(pred))`), lenient: the last `\\boxed{}`
  when there is one, else the whole text, else the last number (SmolLM2-135M mostly answers
  with a bare number; measured on SmolLM2-135M).
- `reasoning_gym_reward`: the task's own reasoning-gym scorer on the extracted final answer.
- `auto_reward`: per row, reasoning-gym when the row's task is a reasoning-gym dataset, else math.

math-verify's timeouts use `signal.alarm`, which fails outside the main thread (Prefect runs
tasks in threads), so they are switched off here and replaced by cheap guards: only the tail
of a completion is read, and power towers, huge exponents / factorials and very long numbers
never reach sympy (`9^9^9^9` would otherwise hang `verify`).
"""
from __future__ import annotations

from tlt.errors import UserError

import importlib
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

RewardFn = Callable[..., list[float]]

MAX_TAIL_CHARS = 1000  # final answers sit at the end; sympy cost grows with the text
MAX_NUMBER_DIGITS = 100
MAX_EXPONENT = 300
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
_NUMERIC_GOLD = re.compile(r"\s*-?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?\s*")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_EXPONENT = re.compile(r"\^\s*[{(]?\s*([0-9]+)")
_FACTORIAL = re.compile(r"([0-9]+)\s*!")
_TOWER = re.compile(r"[0-9]\s*\^\s*[{(]?\s*[0-9.]+\s*[})]?\s*\^|\^\s*[{(][^})]*\^")


class RewardError(UserError):
    """A user reward function failed or returned something unusable; names the function and the fix."""


class _NoTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


# ---------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}`; None when absent or unbalanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def last_number(text: str) -> str | None:
    """The last ASCII number ("1,234" -> "1234", "-5", "2.5", "1/2"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_answer(text: str, gold: str = "") -> str:
    """The model's final answer: boxed content, else the last number when the gold is numeric,
    else the text after the last "answer:" or the last non-empty line."""
    text = text or ""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if _NUMERIC_GOLD.fullmatch(gold or ""):
        number = last_number(text[-MAX_TAIL_CHARS:])
        if number is not None:
            return number
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    marker = last.lower().rfind("answer:")
    if marker >= 0:
        last = last[marker + len("answer:"):]
    return last.strip().strip("*$").rstrip(".").strip()


def _too_costly(text: str) -> bool:
    """Inputs that can make sympy run for minutes: power towers, big exponents/factorials, long numbers."""
    flat = text.replace("**", "^")
    if _TOWER.search(flat) or re.search(rf"[0-9]{{{MAX_NUMBER_DIGITS},}}", flat):
        return True
    big = _EXPONENT.findall(flat) + _FACTORIAL.findall(flat)
    return any(len(n) > 6 or int(n) > MAX_EXPONENT for n in big)


# ---------------------------------------------------------------- math-verify


def _mv_parse(text: str) -> list:
    from math_verify import parse  # deferred: math-verify pulls sympy (~1 s)

    if _too_costly(text):
        return []
    return parse(text, parsing_timeout=None)  # None: no signal.alarm, works in any thread


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """Gold answers are usually bare ("72", "0.5", "x=3"): wrapped in $...$ they parse as LaTeX."""
    gold = gold.strip()
    if not gold:
        return ()
    tries = [gold] if ("$" in gold or "\\boxed" in gold) else [f"${gold}$", gold]
    for text in tries:
        parsed = _mv_parse(text)
        if parsed:
            return tuple(parsed)
    return (gold,)  # math-verify then compares strings


def _verifies(gold: tuple, text: str | None) -> bool:
    from math_verify import verify  # deferred: math-verify pulls sympy (~1 s)

    if not text:
        return False
    pred = _mv_parse(text)
    return bool(pred) and verify(list(gold), pred, timeout_seconds=None)


def _math_score(completion: str, gold: str) -> float:
    gold_parsed = _parse_gold(str(gold))
    tail = str(completion or "")[-MAX_TAIL_CHARS:]
    if not gold_parsed or not tail.strip():
        return 0.0
    boxed = last_boxed(tail)
    if boxed is not None:  # an explicit final answer decides alone
        return float(_verifies(gold_parsed, "\\boxed{" + boxed + "}"))
    number = last_number(tail)
    for text in (tail, f"${number}$" if number else None):
        if _verifies(gold_parsed, text):
            return 1.0
    return 0.0


def _safe(score: Callable[[], float]) -> float:
    """Any failure or non-finite score on model output is a 0 reward, never an exception."""
    try:
        value = float(score())
    except Exception:  # noqa: BLE001 - model output is untrusted; a crash here would stop the run
        return 0.0
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def math_reward(completions: list[str], answers: list[str], **kw: Any) -> list[float]:
    """1.0 when math-verify finds the completion's final answer equal to the gold, else 0.0."""
    return [_safe(lambda c=c, a=a: _math_score(c, a)) for c, a in zip(completions, answers, strict=True)]


# ---------------------------------------------------------------- reasoning-gym


@lru_cache(maxsize=None)
def _rg_scorer(task: str) -> Callable[..., float]:
    import reasoning_gym  # deferred: reasoning-gym takes ~1 s to import

    return reasoning_gym.get_score_answer_fn(task)


def is_reasoning_gym_task(task: Any) -> bool:
    if not isinstance(task, str) or not task:
        return False
    from reasoning_gym.factory import DATASETS  # deferred: reasoning-gym takes ~1 s to import

    return task in DATASETS


def _meta_dict(meta: Any) -> dict:
    if isinstance(meta, dict):
        return meta
    if isinstance(meta, str) and meta.strip():
        loaded = json.loads(meta)
        return loaded if isinstance(loaded, dict) else {}
    return {}


def _rg_score(completion: str, gold: str, task: str, meta: Any) -> float:
    entry = {"question": "", "answer": str(gold), "metadata": _meta_dict(meta)}
    return _rg_scorer(task)(answer=final_answer(str(completion or ""), str(gold)), entry=entry)


def reasoning_gym_reward(completions: list[str], answers: list[str], tasks: Sequence[str] | None = None,
                         metas: Sequence[Any] | None = None, **kw: Any) -> list[float]:
    """The task's reasoning-gym scorer on the extracted final answer, clamped to [0, 1]."""
    n = len(completions)
    tasks = list(tasks) if tasks is not None else [""] * n
    metas = list(metas) if metas is not None else [None] * n
    rows = zip(completions, answers, tasks, metas, strict=True)
    return [_safe(lambda c=c, a=a, t=t, m=m: _rg_score(c, a, t, m)) for c, a, t, m in rows]


def auto_reward(completions: list[str], answers: list[str], tasks: Sequence[str] | None = None,
                metas: Sequence[Any] | None = None, **kw: Any) -> list[float]:
    """Per row: the reasoning-gym scorer when the row's task is a reasoning-gym dataset, else math."""
    n = len(completions)
    tasks = list(tasks) if tasks is not None else [""] * n
    metas = list(metas) if metas is not None else [None] * n
    out = []
    for c, a, t, m in zip(completions, answers, tasks, metas, strict=True):
        if is_reasoning_gym_task(t):
            out += reasoning_gym_reward([c], [a], [t], [m])
        else:
            out += math_reward([c], [a])
    return out


# ---------------------------------------------------------------- selection and checks

BUILTIN: dict[str, RewardFn] = {"auto": auto_reward, "math": math_reward, "reasoning_gym": reasoning_gym_reward}


def get_reward_fn(name: str) -> RewardFn:
    """'auto' | 'math' | 'reasoning_gym', or a user function as 'package.module:function'.

    User functions are called as `fn(completions, answers, tasks=..., metas=...)` and must
    return one finite float per completion; wrap calls in `checked_rewards`.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise RewardError(f"unknown reward '{name}'; use one of {', '.join(BUILTIN)} "
                          "or a function of yours as 'module:function'")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise RewardError(f"reward function '{name}' cannot be imported ({err}); check that the module "
                          "is importable (on PYTHONPATH) and defines that function") from None
    if not callable(fn):
        raise RewardError(f"reward '{name}' is not a function (got {type(fn).__name__})")
    return fn


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def checked_rewards(fn: RewardFn, completions: list[str], answers: list[str], **kw: Any) -> list[float]:
    """Call a reward function and check its result: a list of len(completions) finite floats."""
    name = _fn_name(fn)
    try:
        result = fn(completions, answers, **kw)
    except Exception as err:  # noqa: BLE001 - re-raised with the function's name and the fix
        hint = " (reward functions are called as fn(completions, answers, **kwargs))" if isinstance(err, TypeError) else ""
        raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}{hint}") from err
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        raise RewardError(f"reward function {name} returned {type(result).__name__}; it must return a list "
                          "with one float per completion")
    if len(result) != len(completions):
        raise RewardError(f"reward function {name} returned {len(result)} values for {len(completions)} "
                          "completions; it must return one float per completion")
    out = []
    for i, value in enumerate(result):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name} returned {value!r} at index {i}, which is not a "
                              "number; return floats") from None
        if not math.isfinite(value):
            raise RewardError(f"reward function {name} returned {value} at index {i}; return a finite "
                              "float for every completion (e.g. 0.0 for an unparseable one)")
        out.append(value)
    return out
