"""Online drafter-training buffer (TLT "one-step offset").

Keeps the rollout sequences of the last `max_steps` RL steps, so the long sequences of the
previous step stay in while the current step's short ones arrive (otherwise the drafter is
biased towards short answers), and evicts the oldest sequences beyond `max_tokens`.
Hidden states are stored as bfloat16 on CPU (half the memory) and read back as float32.
"""
from __future__ import annotations

import random
from collections import deque

import torch
from torch import Tensor

from tlt.drafter.train import Sample, pack, weight_prompt


class DraftBuffer:
    def __init__(self, max_steps: int, max_tokens: int, prompt_weight: float = 0.0):
        if max_steps < 1 or max_tokens < 1:
            raise ValueError(f"DraftBuffer needs max_steps >= 1 and max_tokens >= 1, got {max_steps}, {max_tokens}")
        self.max_steps, self.max_tokens = max_steps, max_tokens
        self.prompt_weight = prompt_weight  # loss weight of a prompt position (a response token's is 1)
        self._items: deque[tuple[int, Sample]] = deque()  # (rl step, sample), oldest first
        self.num_tokens = 0
        self.evicted_sequences = 0
        self.latest_step: int | None = None

    def add(self, step: int, input_ids: Tensor, aux: Tensor, target_hidden: Tensor, loss_mask: Tensor) -> None:
        """Add one sequence: input_ids [T], aux [T,3H_t], target_hidden [T,H], loss_mask [T] bool
        (True on response tokens; prompt positions are trained at `prompt_weight`)."""
        T = int(input_ids.shape[0])
        if aux.shape[0] != T or target_hidden.shape[0] != T or loss_mask.shape[0] != T:
            raise ValueError(f"buffer.add: lengths differ (ids {T}, aux {aux.shape[0]}, "
                             f"target_hidden {target_hidden.shape[0]}, loss_mask {loss_mask.shape[0]})")
        sample = {"input_ids": input_ids.detach().to("cpu", torch.long),
                  "aux": aux.detach().to("cpu", torch.bfloat16),
                  "target_hidden": target_hidden.detach().to("cpu", torch.bfloat16),
                  "loss_mask": loss_mask.detach().to("cpu", torch.bool)}
        self._items.append((int(step), sample))
        self.num_tokens += T
        self.latest_step = step if self.latest_step is None else max(self.latest_step, int(step))
        self._evict()

    def add_rows(self, step: int, ids: Tensor, attn: Tensor, resp: Tensor, aux: Tensor, last_hidden: Tensor) -> None:
        """Rows of the RL step's forward ([B,T,...], right padded; resp True on response tokens)
        -> one sample each."""
        for i in range(ids.shape[0]):
            n = int(attn[i].sum())
            self.add(step, ids[i, :n], aux[i, :n], last_hidden[i, :n], resp[i, :n])

    def _evict(self) -> None:
        oldest_kept = self.latest_step - self.max_steps + 1
        kept = deque(item for item in self._items if item[0] >= oldest_kept)
        self.evicted_sequences += len(self._items) - len(kept)
        self._items = kept
        self.num_tokens = sum(s["input_ids"].shape[0] for _, s in self._items)
        while self.num_tokens > self.max_tokens:
            _, s = self._items.popleft()
            self.num_tokens -= s["input_ids"].shape[0]
            self.evicted_sequences += 1

    def __len__(self) -> int:
        return len(self._items)

    @property
    def steps(self) -> list[int]:
        """RL steps that still have sequences in the buffer, ascending."""
        return sorted({step for step, _ in self._items})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, s in self._items for t in s.values())

    def samples(self) -> list[Sample]:
        """All sequences, oldest first, with aux/target_hidden as float32 and prompt positions
        weighted `prompt_weight` (as the warm-start weighs them)."""
        return [weight_prompt({**s, "aux": s["aux"].float(), "target_hidden": s["target_hidden"].float()},
                              self.prompt_weight) for _, s in self._items]

    def batches(self, batch_tokens: int, rng: random.Random | torch.Generator | int | None = None
                ) -> list[dict[str, Tensor]]:
        """Packed training batches (see `tlt.drafter.train.pack`), shuffled by rng (None = unshuffled)."""
        if isinstance(rng, random.Random):
            seed = rng.randrange(2**31)
        elif isinstance(rng, torch.Generator):
            seed = int(torch.randint(2**31, (1,), generator=rng))
        else:
            seed = rng
        return pack(self.samples(), batch_tokens, shuffle_seed=seed)

    def token_counts(self, vocab_size: int) -> Tensor:
        """[V] response-token counts (for `Eagle3Drafter.set_vocab`)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for _, s in self._items:
            counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)
        return counts

    def state_dict(self) -> tuple[dict[str, Tensor], dict]:
        """(tensors, JSON-able meta) that `load_state_dict` turns back into this buffer, for run
        checkpoints: tensor keys are `<index>.<field>` (oldest first), hidden states stay bf16."""
        tensors = {f"{i:06d}.{k}": v for i, (_, s) in enumerate(self._items) for k, v in s.items()}
        meta = {"item_steps": [step for step, _ in self._items], "latest_step": self.latest_step,
                "evicted_sequences": self.evicted_sequences}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict) -> None:
        """Replace the contents with a `state_dict()` (same order, same dtypes, same counters)."""
        fields = ("input_ids", "aux", "target_hidden", "loss_mask")
        self._items = deque((int(step), {k: tensors[f"{i:06d}.{k}"] for k in fields})
                            for i, step in enumerate(meta["item_steps"]))
        self.num_tokens = sum(s["input_ids"].shape[0] for _, s in self._items)
        self.latest_step = meta["latest_step"]
        self.evicted_sequences = int(meta["evicted_sequences"])

    def metadata(self) -> dict:
        """JSON-able summary for checkpoints and tracking."""
        return {"max_steps": self.max_steps, "max_tokens": self.max_tokens, "num_sequences": len(self),
                "num_tokens": self.num_tokens, "steps": self.steps, "latest_step": self.latest_step,
                "evicted_sequences": self.evicted_sequences, "nbytes": self.nbytes}
