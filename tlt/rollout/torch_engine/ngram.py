"""Model-free n-gram drafter: prompt lookup, plus the group's own rollouts (TLT's "TLT-Base").

Match the last n tokens (n = max_n .. min_n) of a sequence's prompt + generated history with an
earlier occurrence and propose what followed it. Besides the sequence itself, the lookup may
search reference sequences: in an RL rollout, the other samples of the same GRPO group (their
tokens so far, finished ones whole) and earlier rollouts of the same prompt (`PromptHistory`).
Those are the best model-free drafts there are: the same policy answering the same question.
Several matches with different continuations form a small trie (the draft tree); one is a chain.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

_SEP = -1  # between reference sequences in the lookup array: never equals a token, so no match spans two


class NgramDrafter:
    """Lookup over the last `window` tokens of the sequence and its references; longer n first."""

    def __init__(self, max_n: int = 8, min_n: int = 1, window: int = 2048):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def continuations(self, seq: list[int], depth: int, topk: int, refs=()) -> list[list[int]]:
        """Up to `topk` distinct continuations (each <= depth tokens) of the earlier occurrences of
        the sequence's suffix: longest match first (up to `max_n` tokens), then the most recent
        (the sequence itself, then the references, last first)."""
        parts = [np.asarray(r, dtype=np.int64) for r in refs if len(r)]
        own = np.asarray(seq[-self.window:], dtype=np.int64)
        if own.shape[0] < max(1, self.min_n):
            return []
        arr = np.concatenate([x for r in parts for x in (r, [_SEP])] + [own]) if parts else own
        last = arr.shape[0] - 1
        ends = np.flatnonzero(arr[:last] == arr[last])  # earlier positions holding the newest token
        length = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.ones(ends.shape[0], dtype=bool)
        for k in range(1, min(self.max_n, own.shape[0])):  # extend each match backwards, one token a step
            ok = alive & (ends - k >= 0)
            ok[ok] = arr[ends[ok] - k] == arr[last - k]
            length += ok
            alive = ok
        order = np.lexsort((-ends, -length))  # longest first, then the most recent
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for i in order:
            if length[i] < self.min_n:
                break
            cont = arr[ends[i] + 1: ends[i] + 1 + depth]
            stop = np.flatnonzero(cont == _SEP)
            cont = tuple((cont[: stop[0]] if stop.size else cont).tolist())
            if cont and cont not in seen:
                seen.add(cont)
                found.append(list(cont))
                if len(found) >= topk:
                    break
        return found

    def propose(self, seq: list[int], depth: int, topk: int, tokens: int, refs=()) -> list[tuple[int, int, int]]:
        """A draft trie as nodes (token, parent, depth): parent 0 = the root (the newest token),
        node q (1-based, in list order) has parent < q. At most `tokens` nodes."""
        nodes: list[tuple[int, int, int]] = []
        index: dict[tuple[int, int], int] = {}
        for cont in self.continuations(seq, depth, topk, refs):
            parent = 0
            for d, tok in enumerate(cont, start=1):
                q = index.get((parent, tok))
                if q is None:
                    if len(nodes) >= tokens:
                        break
                    nodes.append((tok, parent, d))
                    q = index[(parent, tok)] = len(nodes)
                parent = q
        return nodes


class PromptHistory:
    """The newest `per_prompt` responses of up to `max_prompts` prompts (least recently used dropped)."""

    def __init__(self, per_prompt: int = 8, max_prompts: int = 2048):
        self.per_prompt, self.max_prompts = per_prompt, max_prompts
        self._data: OrderedDict[tuple[int, ...], deque] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, prompt: list[int]) -> list[np.ndarray]:
        key = tuple(prompt)
        if key not in self._data:
            return []
        self._data.move_to_end(key)
        return list(self._data[key])

    def add(self, prompt: list[int], response: list[int]) -> None:
        if self.per_prompt <= 0 or not response:
            return
        key = tuple(prompt)
        if key not in self._data:
            self._data[key] = deque(maxlen=self.per_prompt)
        self._data[key].append(np.asarray(response, dtype=np.int32))
        self._data.move_to_end(key)
        while len(self._data) > self.max_prompts:
            self._data.popitem(last=False)
