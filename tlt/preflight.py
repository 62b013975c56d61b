"""Checks that fail a run in seconds, at data validation, instead of after training."""
from __future__ import annotations

from tlt.rl.rewards import BUILTIN, checked_rewards, get_reward_fn


def check_reward_fn(cfg, rows) -> None:
    """A user reward function that raises or returns NaN on the gold answers themselves raises
    RewardError here, not after warm-start."""
    if cfg.rl.reward not in BUILTIN:
        answers = [str(a) for a in rows["answer"]]
        checked_rewards(get_reward_fn(cfg.rl.reward), answers, answers, tasks=list(rows["task"]),
                        metas=list(rows["meta"]))
