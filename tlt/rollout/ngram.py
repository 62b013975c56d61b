"""Model-free n-gram prompt-lookup drafter (TLT's fallback, "TLT-Base").

Match the last n tokens (n = max_n .. min_n) of a sequence's prompt + generated history with an
earlier occurrence and propose what followed it. Several matches with different continuations
form a small trie (the draft tree); one match is a chain.
"""
from __future__ import annotations

import numpy as np


class NgramDrafter:
    """Prompt lookup over the last `window` tokens; longer n-grams are tried first."""

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 2048):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def continuations(self, seq: list[int], depth: int, topk: int) -> list[list[int]]:
        """Up to `topk` distinct continuations (each <= depth tokens), most recent match first."""
        arr = np.asarray(seq[-self.window:], dtype=np.int64)
        n_tok = arr.shape[0]
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(self.max_n, self.min_n - 1, -1):
            if n_tok <= n:
                continue
            key = arr[n_tok - n:]
            hits = np.ones(n_tok - n, dtype=bool)  # start i of an earlier n-gram (not the suffix itself)
            for j in range(n):
                hits &= arr[j: n_tok - n + j] == key[j]
            for i in np.flatnonzero(hits)[::-1]:
                cont = tuple(arr[i + n: i + n + depth].tolist())
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(list(cont))
                    if len(found) >= topk:
                        return found
        return found

    def propose(self, seq: list[int], depth: int, topk: int, tokens: int) -> list[tuple[int, int, int]]:
        """A draft trie as nodes (token, parent, depth): parent 0 = the root (the newest token),
        node q (1-based, in list order) has parent < q. At most `tokens` nodes."""
        nodes: list[tuple[int, int, int]] = []
        index: dict[tuple[int, int], int] = {}
        for cont in self.continuations(seq, depth, topk):
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
