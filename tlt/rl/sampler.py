"""Prompt sampler: a seeded pass over the training rows, resumable from its cursor."""
from __future__ import annotations

import numpy as np
import pandas as pd


class PromptSampler:
    """Yields `n` training rows per RL step; reshuffles (seed + epoch) after each full pass."""

    def __init__(self, rows: pd.DataFrame, seed: int = 0):
        self.rows = rows.reset_index(drop=True)
        self.seed, self.epoch, self.cursor = seed, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.rows))

    def next(self, n: int) -> pd.DataFrame:
        idx = []
        while len(idx) < n:
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._shuffle()
            take = self._order[self.cursor:self.cursor + n - len(idx)]
            idx += take.tolist()
            self.cursor += len(take)
        return self.rows.iloc[idx]

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self._order = self._shuffle()
