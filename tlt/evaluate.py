"""Greedy evaluation on held-out prompts: accuracy with the run's reward function."""
from __future__ import annotations

import time
from typing import Callable

import pandas as pd

from tlt.rl.rewards import checked_rewards
from tlt.summaries import EvalSummary

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


def evaluate(heldout: pd.DataFrame, prompt_ids: list[list[int]], generate: GenerateFn, decode: Callable,
             reward_fn: Callable, max_new_tokens: int, batch_size: int, step: int = 0
             ) -> tuple[EvalSummary, list[dict]]:
    """Greedy-decode every held-out prompt; a response is correct when its reward is >= 1.

    Returns the summary and one record per prompt (prompt, answer, response, reward) for the
    sample table.
    """
    t0 = time.perf_counter()
    responses: list[list[int]] = []
    for i in range(0, len(prompt_ids), batch_size):
        responses += generate(prompt_ids[i:i + batch_size], max_new_tokens)
    texts = [decode(r) for r in responses]
    rewards = checked_rewards(reward_fn, texts, list(heldout["answer"]), tasks=list(heldout["task"]),
                              metas=list(heldout["meta"]))  # a user function's failure is a RewardError
    records = [{"id": i, "prompt": p, "answer": a, "response": t, "reward": r}
               for i, p, a, t, r in zip(heldout["id"], heldout["prompt"], heldout["answer"], texts, rewards)]
    n = max(len(rewards), 1)
    summary = EvalSummary(step=step, accuracy=sum(r >= 1.0 for r in rewards) / n, n=len(rewards),
                          mean_length=sum(map(len, responses)) / n, time_s=time.perf_counter() - t0)
    return summary, records
