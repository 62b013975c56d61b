"""Small pydantic summaries that stages return (and Prefect tasks pass along): no tensors, no models."""
from __future__ import annotations

from pydantic import BaseModel, Field


class DataSummary(BaseModel):
    n_rows: int
    n_train: int
    n_heldout: int
    n_dropped: int = 0
    tasks: dict[str, int] = Field(default_factory=dict)
    train_path: str
    heldout_path: str


class ModelSummary(BaseModel):
    target: str
    n_params: int
    n_layers: int
    hidden_size: int
    vocab_size: int
    load_s: float
    drafter_params: int = 0


class EvalSummary(BaseModel):
    step: int
    accuracy: float
    n: int
    mean_length: float
    time_s: float
    # Held-out accept length of the drafter (fixed strategy, tuner off: tlt.rollout.acceptance.heldout_accept), greedy
    # and at the rollout temperature; None without a drafter.
    accept_len: float | None = None
    accept_len_sampled: float | None = None
    # One record per held-out prompt (id, prompt, answer, response, reward). Kept out of
    # serialisation like `StepSummary.samples`: they are already a tracked table.
    records: list[dict] = Field(default_factory=list, exclude=True)


class WarmstartSummary(BaseModel):
    # Held-out accept lengths (tlt.rollout.acceptance.heldout_accept), greedy unless named sampled.
    accept_len_before: float
    accept_len_after: float
    accept_len_sampled: float | None = None  # at the rollout temperature
    vocab_coverage: float | None = None      # share of held-out greedy tokens inside the draft vocabulary
    # The rollout bandit's prior, priced from the sampled figure (tlt.rollout.breakeven): per-token acceptance
    # and the tail threshold `rollout.spec_threshold: auto` resolves to on this machine (None: no cost curve).
    prior_accept_rate: float | None = None
    tail_threshold: int | None = None
    corpus_key: str = ""
    corpus_tokens: int = 0
    corpus_sequences: int = 0
    n_samples: int
    n_tokens: int
    train_steps: int
    time_s: float
    cached: bool = False
    path: str = ""


class StepSummary(BaseModel):
    step: int
    reward_mean: float
    accept_len: float | None = None  # live: the rollout's own spec/accept_len/mean (None: no SD round)
    step_s: float
    metrics: dict[str, float] = Field(default_factory=dict)
    # The step's rollout, one `RolloutSchema` row per response (validated). Kept out of
    # serialisation: Prefect persists task results, and these are already a tracked table.
    samples: list[dict] = Field(default_factory=list, exclude=True)


class ExportSummary(BaseModel):
    path: str  # the model folder (policy/, drafter/, README.md)
    version: str | None = None
    # Held-out accept length of the exported drafter against the exported policy, reloaded from the
    # folder (greedy; at the rollout temperature): the version's accept_len / accept_len_sampled tags.
    accept_len: float | None = None
    accept_len_sampled: float | None = None
    accuracy: float | None = None  # the policy's held-out accuracy (heldout_accuracy tag), on n prompts
    n: int = 0
    time_s: float
    serve: str = ""  # the command that serves the folder (real paths)
