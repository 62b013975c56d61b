"""Checks that fail a run in seconds, at data validation, instead of after training."""
from __future__ import annotations

from pathlib import Path

from tlt.export import ExportError
from tlt.rl.rewards import BUILTIN, checked_rewards, get_reward_fn


def check_reward_fn(cfg, rows) -> None:
    """A user reward function that raises or returns NaN on the gold answers themselves raises
    RewardError here, not after warm-start."""
    if cfg.rl.reward not in BUILTIN:
        answers = [str(a) for a in rows["answer"]]
        checked_rewards(get_reward_fn(cfg.rl.reward), answers, answers, tasks=list(rows["task"]),
                        metas=list(rows["meta"]))


def check_export_dir(cfg) -> None:
    """Refuse a non-empty export.out_dir now rather than after training (export never overwrites it)."""
    e = cfg.export
    out = Path(e.out_dir) if e.enabled and e.out_dir else None
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"export.out_dir '{out}' exists and is not empty; the run would fail at its export "
                          "after training. Choose an empty or new directory, or remove it (`tlt export --force` "
                          "replaces a directory from a finished run's checkpoint).")
