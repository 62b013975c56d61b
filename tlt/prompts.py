"""Prompt data: read (JSONL / JSON / Parquet) or generate (reasoning-gym), validate, split.

Nothing is dropped silently: `validate_rows` lists every problem as a `BadRow` (row number,
column, reason) and `load_dataset` refuses invalid data unless `data.on_invalid: drop`, in which
case the dropped rows are returned next to the clean ones so the caller can log them.

Row numbers are the frame's index: 1-based line numbers for JSON lines, 1-based row positions
for Parquet, JSON arrays and generated data. `render_prompt` is the one place where the chat
template is applied, so validation counts exactly the tokens that rollout will feed the model.
"""
from __future__ import annotations

import difflib
import functools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from tlt.config import DataConfig, GeneratorSpec
from tlt.inputs import DataError, check_data_file
from tlt.schemas import CUSTOM_TASK, PROMPT_COLUMNS, RAW_TYPES, BadRow, PromptSchema, failures, is_missing

MAX_LISTED = 20  # malformed lines listed in a DataError before "... and N more"


@dataclass
class ValidationReport:
    n_rows: int
    bad: list[BadRow]
    clean: pd.DataFrame  # PromptSchema-valid rows, index = source row number

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def bad_rows(self) -> list[int]:
        """Row numbers with at least one problem (file-level problems excluded)."""
        return sorted({b.row for b in self.bad if b.row})

    @property
    def file_level(self) -> bool:
        """A missing or unknown column: dropping rows cannot fix it."""
        return any(b.row == 0 for b in self.bad)

    def format(self, limit: int | None = None) -> str:
        lines = [str(b) for b in self.bad[:limit]]
        if limit is not None and len(self.bad) > limit:
            lines.append(f"... and {len(self.bad) - limit} more problems")
        return "\n".join(lines)

    def summary(self) -> str:
        tasks = ", ".join(f"{t}={n}" for t, n in sorted(Counter(self.clean["task"]).items()))
        if self.ok:
            return f"ok: {self.n_rows} rows, tasks {tasks or 'none'}"
        return (f"invalid: {len(self.bad)} problems in {len(self.bad_rows)} of {self.n_rows} rows"
                f"{' (file-level)' if self.file_level else ''}; {len(self.clean)} clean rows, tasks {tasks or 'none'}")


@dataclass
class Dataset:
    train: pd.DataFrame  # PromptSchema columns, fresh RangeIndex
    heldout: pd.DataFrame
    report: ValidationReport
    dropped: pd.DataFrame = field(default_factory=pd.DataFrame)  # invalid source rows (on_invalid: drop)


# ---------------------------------------------------------------- reading
def read_rows(path: str | Path) -> pd.DataFrame:
    """Rows of a .jsonl / .json (JSON lines or one JSON array) / .parquet file, as objects.

    The frame keeps Python values (dtype object) so that validation sees what the file holds:
    a number where a string belongs is reported, not silently stringified.
    """
    df, malformed = read_rows_lenient(path)
    if malformed:
        listed = "\n".join(f"  line {b.row}: {b.reason}" for b in malformed[:MAX_LISTED])
        more = f"\n  ... and {len(malformed) - MAX_LISTED} more" if len(malformed) > MAX_LISTED else ""
        raise DataError(f"data file '{path}' has {len(malformed)} malformed line(s) (lines "
                        f"{', '.join(str(b.row) for b in malformed)}):\n{listed}{more}\n"
                        "fix them so that each line is one JSON object", malformed)
    return df


def read_rows_lenient(path: str | Path) -> tuple[pd.DataFrame, list[BadRow]]:
    """`read_rows`, but JSON lines that are malformed or not objects come back as `BadRow`s next to
    the rows that parsed, so `tlt data validate` lists them together with every row problem."""
    p = check_data_file(path)
    readers = {".jsonl": _read_json, ".json": _read_json, ".parquet": _read_parquet}
    rows, records, malformed = readers[p.suffix.lower()](p)
    if not records and not malformed:
        raise DataError(f"data file '{p}' holds no rows; add one JSON object per line with prompt and answer")
    return pd.DataFrame(records, index=pd.Index(rows, name="row"), dtype=object), malformed


def _decode(p: Path) -> str:
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"data file '{p}' is not UTF-8: byte 0x{data[err.start]:02x} at byte offset {err.start} "
                        f"(line {line}); re-save the file as UTF-8") from None


def _read_json(p: Path) -> tuple[list[int], list[dict], list[BadRow]]:
    text = _decode(p)
    if text.lstrip().startswith("["):
        return _read_json_array(p, text)
    rows, records, bad = [], [], []
    # split("\n"), not splitlines(): U+2028 and friends are legal inside JSON strings.
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) carry no row
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            bad.append(BadRow(n, "(json)", f"malformed JSON: {err.msg} at column {err.colno}"))
            continue
        if not isinstance(obj, dict):
            bad.append(BadRow(n, "(json)", f"expected a JSON object, got {type(obj).__name__}"))
            continue
        rows.append(n)
        records.append(obj)
    return rows, records, bad


def _read_json_array(p: Path, text: str) -> tuple[list[int], list[dict], list[BadRow]]:
    """A .json file holding one array of objects; row numbers are 1-based item positions."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"data file '{p}' is not valid JSON: {err.msg} at line {err.lineno}, "
                        f"column {err.colno}; fix it or write one JSON object per line (.jsonl)") from None
    if not isinstance(items, list):
        raise DataError(f"data file '{p}' holds one JSON {type(items).__name__}, not an array of objects; write one "
                        "JSON object per line (.jsonl)")
    ok = [(i, x) for i, x in enumerate(items, 1) if isinstance(x, dict)]
    bad = [BadRow(i, "(json)", f"expected a JSON object, got {type(x).__name__}")
           for i, x in enumerate(items, 1) if not isinstance(x, dict)]
    return [i for i, _ in ok], [x for _, x in ok], bad


def _read_parquet(p: Path) -> tuple[list[int], list[dict]]:
    import pyarrow as pa_arrow  # deferred: only parquet input needs pyarrow
    import pyarrow.parquet as pq  # deferred: as above

    try:
        table = pq.read_table(p)
    except (pa_arrow.ArrowException, OSError) as err:
        raise DataError(f"data file '{p}' is not a readable Parquet file: {err}") from None
    # A pandas index saved by DataFrame.to_parquet is bookkeeping, not a data column.
    index_cols = (table.schema.pandas_metadata or {}).get("index_columns", [])
    table = table.drop_columns([c for c in index_cols if isinstance(c, str) and c in table.column_names])
    records = table.to_pylist()  # Python values, like the JSON path (no int -> float upcasting)
    return list(range(1, len(records) + 1)), records, []


# ---------------------------------------------------------------- generation
@functools.cache
def task_names() -> frozenset[str]:
    """Names of the registered reasoning-gym datasets (imported lazily: ~1.5 s)."""
    from reasoning_gym.factory import DATASETS  # deferred: reasoning-gym takes ~1 s to import

    return frozenset(DATASETS)


def _to_json(obj: Any) -> Any:
    """json.dumps fallback for reasoning-gym metadata (sets, numpy scalars and arrays, fractions)."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    return str(obj)


def _unknown_task(name: str) -> str:
    near = difflib.get_close_matches(name, sorted(task_names()), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(n) for n in near)}?" if near else "see reasoning_gym.factory.DATASETS"
    return f"unknown reasoning-gym task '{name}'; {hint}"


def generate_rows(specs: Sequence[GeneratorSpec | Mapping], seed: int = 0) -> pd.DataFrame:
    """Prompt rows from reasoning-gym generators; spec k is seeded with `seed + k`.

    `meta` holds the entry's metadata as JSON, so `rg_entry(row)` rebuilds the
    {question, answer, metadata} entry that reasoning-gym scorers expect.
    """
    import reasoning_gym as rg  # deferred: reasoning-gym takes ~1 s to import

    records, seen = [], Counter()
    for k, spec in enumerate(specs):
        spec = spec if isinstance(spec, GeneratorSpec) else GeneratorSpec.model_validate(spec)
        if spec.task not in task_names():
            raise DataError(f"data.generators[{k}]: {_unknown_task(spec.task)}")
        try:
            ds = rg.create_dataset(spec.task, size=spec.size, seed=seed + k, **spec.params)
        except Exception as err:  # generators raise assorted types (TypeError, AssertionError, ...)
            raise DataError(f"data.generators[{k}] ('{spec.task}') rejected params {spec.params}: "
                            f"{type(err).__name__}: {err}") from None
        for entry in ds:
            meta = entry.get("metadata") or {}
            difficulty = meta.get("difficulty")
            records.append({
                "id": f"{spec.task}-{seen[spec.task]}", "prompt": entry["question"], "answer": str(entry["answer"]),
                "task": spec.task, "difficulty": None if difficulty is None else json.dumps(difficulty, default=_to_json),
                "meta": json.dumps(meta, default=_to_json),
            })
            seen[spec.task] += 1
    return pd.DataFrame(records, index=pd.Index(range(1, len(records) + 1), name="row"), columns=PROMPT_COLUMNS,
                        dtype=object)


def rg_entry(row: Mapping) -> dict:
    """The reasoning-gym entry of a prompt row, as `score_answer(answer=..., entry=...)` expects."""
    return {"question": row["prompt"], "answer": row["answer"], "metadata": json.loads(row["meta"])}


# ---------------------------------------------------------------- chat template
def render_prompt(tokenizer, prompt: str, instruction: str = "", system_prompt: str | None = None) -> str:
    """The text the model sees: chat template over (system, user = prompt + instruction) + assistant header.

    A tokenizer without a chat template (a base model) gets the plain prompt + instruction.
    """
    content = prompt + instruction
    if not getattr(tokenizer, "chat_template", None):
        return content
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_ids(tokenizer, prompt: str, instruction: str = "", system_prompt: str | None = None) -> list[int]:
    """Token ids of `render_prompt` (the template already holds the special tokens)."""
    text = render_prompt(tokenizer, prompt, instruction, system_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_counts(tokenizer, prompts: list[str], instruction: str, system_prompt: str | None) -> list[int]:
    texts = [render_prompt(tokenizer, p, instruction, system_prompt) for p in prompts]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------- validation
def _with_defaults(df: pd.DataFrame) -> pd.DataFrame:
    """Fill the optional columns of user files where a row leaves them empty: id = row number, task =
    custom, meta = {}."""
    out = df.copy()
    ids = out["id"] if "id" in out else [None] * len(out)
    out["id"] = [str(r) if is_missing(i) else i for r, i in zip(out.index, ids)]  # a partly filled id column too
    if "difficulty" not in out:
        out["difficulty"] = None
    out["task"] = [CUSTOM_TASK if is_missing(t) or t == "" else t
                   for t in (out["task"] if "task" in out else [None] * len(out))]
    meta = out["meta"] if "meta" in out else [None] * len(out)
    out["meta"] = ["{}" if is_missing(m) else json.dumps(m, default=_to_json) if isinstance(m, dict) else m
                   for m in meta]
    return out.astype(object)


def _extra_checks(df: pd.DataFrame, tokenizer, max_prompt_tokens: int | None, instruction: str,
                  system_prompt: str | None) -> list[BadRow]:
    """What pandera cannot express: task names from reasoning-gym's registry, templated token counts."""
    bad = []
    known = task_names() | {CUSTOM_TASK}
    for row, task in df["task"].items():
        if isinstance(task, str) and task not in known:
            bad.append(BadRow(int(row), "task", _unknown_task(task) + f" (or '{CUSTOM_TASK}' for your own prompts)"))
    if tokenizer is None or max_prompt_tokens is None or "prompt" not in df:
        return bad
    texts = {row: p for row, p in df["prompt"].items() if isinstance(p, str) and p.strip()}
    counts = _token_counts(tokenizer, list(texts.values()), instruction, system_prompt)
    for row, n in zip(texts, counts):
        if n > max_prompt_tokens:
            bad.append(BadRow(int(row), "prompt", f"prompt too long: {n} tokens with chat template and "
                                                  f"instruction > max_prompt_tokens={max_prompt_tokens}"))
    return bad


def validate_rows(df: pd.DataFrame, tokenizer=None, max_prompt_tokens: int | None = None, instruction: str = "",
                  system_prompt: str | None = None) -> ValidationReport:
    """Check every row and list every problem; the index of `df` gives the row numbers.

    Order matters: raw Python types first (before pandera coerces 5 to "5"), then the
    PromptSchema contract, then the checks pandera cannot express. One problem per (row, column)
    is kept, the most specific first. The token limit needs a tokenizer; without one it is skipped.
    A default 0-based RangeIndex is renumbered from 1 (row 0 means "the whole file").
    """
    if isinstance(df.index, pd.RangeIndex) and df.index.start == 0:
        df = df.set_axis(pd.RangeIndex(1, len(df) + 1, name="row"))
    df = _with_defaults(df)
    bad = failures(RAW_TYPES, df)
    typed = df.copy()
    for b in bad:  # wrong-typed cells become missing so later checks do not trip over them twice
        typed.at[b.row, b.column] = None
    bad += failures(PromptSchema, typed)
    bad += _extra_checks(typed, tokenizer, max_prompt_tokens, instruction, system_prompt)
    order = {c: i for i, c in enumerate(PROMPT_COLUMNS)}
    unique = {(b.row, b.column): b for b in reversed(bad)}  # reversed: the first reason wins
    bad = sorted(unique.values(), key=lambda b: (b.row, order.get(b.column, len(order)), b.column))
    bad_rows = {b.row for b in bad}
    keep = [] if 0 in bad_rows else [r for r in typed.index if r not in bad_rows]  # row 0: whole file bad
    clean = PromptSchema.validate(typed.reindex(index=keep, columns=PROMPT_COLUMNS))
    return ValidationReport(n_rows=len(df), bad=bad, clean=clean)


def validate_file(path: str | Path, tokenizer=None, max_prompt_tokens: int | None = 256,
                  instruction: str | None = None, system_prompt: str | None = None) -> ValidationReport:
    """`tlt data validate PATH`: read + validate. Unreadable files raise DataError (exit 2 with its message).

    `instruction` defaults to DataConfig's, so the token count matches a default run.
    """
    if instruction is None:
        instruction = DataConfig().instruction
    df, malformed = read_rows_lenient(path)
    if df.empty:  # every line malformed: nothing else to check
        return ValidationReport(n_rows=len(malformed), bad=malformed, clean=PromptSchema.validate(
            pd.DataFrame(columns=PROMPT_COLUMNS)))
    report = validate_rows(df, tokenizer, max_prompt_tokens, instruction, system_prompt)
    report.bad = sorted(malformed + report.bad, key=lambda b: b.row)
    report.n_rows += len(malformed)
    return report


# ---------------------------------------------------------------- loading
def split_rows(df: pd.DataFrame, heldout_size: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic (train, held-out) split; both keep the source order and get a fresh index."""
    if len(df) <= heldout_size:
        raise DataError(f"only {len(df)} valid rows, but data.heldout_size={heldout_size} leaves none for "
                        "training; lower data.heldout_size or add rows")
    perm = np.random.default_rng(seed).permutation(len(df))
    held, train = np.sort(perm[:heldout_size]), np.sort(perm[heldout_size:])
    return df.iloc[train].reset_index(drop=True), df.iloc[held].reset_index(drop=True)


def load_dataset(cfg: DataConfig, tokenizer) -> Dataset:
    """Read or generate the prompts, validate them, apply `on_invalid`, split train / held-out."""
    source = f"'{cfg.path}'" if cfg.path else "data.generators"
    df = read_rows(cfg.path) if cfg.path else generate_rows(cfg.generators, cfg.seed)
    report = validate_rows(df, tokenizer, cfg.max_prompt_tokens, cfg.instruction, cfg.system_prompt)
    if report.file_level:
        raise DataError(f"{source} has problems that dropping rows cannot fix:\n{report.format(limit=50)}\n"
                        "fix the columns of the file", report.bad)
    if report.bad and cfg.on_invalid == "error":
        raise DataError(f"{source}: {len(report.bad_rows)} of {report.n_rows} rows are invalid:\n"
                        f"{report.format(limit=50)}\nfix these rows, or set data.on_invalid: drop to train on "
                        f"the {len(report.clean)} valid rows (the dropped rows are listed and logged)", report.bad)
    dropped = df.loc[report.bad_rows]
    train, heldout = split_rows(report.clean, cfg.heldout_size, cfg.seed)
    return Dataset(train=train, heldout=heldout, report=report, dropped=dropped)
