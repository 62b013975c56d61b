"""The stages of one training run, as methods of a `Pipeline` that keeps the long-lived state
(models, engine, drafter, optimizer) in this process.

Prefect tasks are thin wrappers that look a pipeline up by run id (`get_pipeline`) and call
one method; they pass only these methods' small pydantic summaries around.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from tlt.config import RunConfig, dump_yaml, flatten
from tlt.summaries import DataSummary, EvalSummary, ModelSummary
from tlt.tracking import NullTracker

_PIPELINES: dict[str, "Pipeline"] = {}


def open_pipeline(cfg: RunConfig, tracker) -> "Pipeline":
    pipe = Pipeline(cfg, tracker)
    _PIPELINES[tracker.run_id] = pipe
    return pipe


def get_pipeline(run_id: str) -> "Pipeline":
    return _PIPELINES[run_id]


def close_pipeline(run_id: str, status: str = "FINISHED") -> None:
    pipe = _PIPELINES.pop(run_id, None)
    if pipe is not None:
        pipe.tracker.end(status)


class Pipeline:
    def __init__(self, cfg: RunConfig, tracker=None):
        self.cfg = cfg
        self.tracker = tracker or NullTracker()
        name = tracker.run_id if tracker is not None and tracker.run_id else cfg.name
        self.run_dir = Path(cfg.trainer.checkpoint_dir) / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.rl.seed)
        self.model = self.tokenizer = self.dataset = None
        self.eos_ids: list[int] = []

    # -- stage 0: record what this run is ------------------------------------------------------
    def log_config(self) -> None:
        self.tracker.log_params(flatten(self.cfg))
        self.tracker.log_text(dump_yaml(self.cfg), "config.yaml")

    # -- stage 1: data -------------------------------------------------------------------------
    def load_tokenizer(self):
        if self.tokenizer is None:
            from tlt.models import load_tokenizer

            self.tokenizer = load_tokenizer(self.cfg.model)
        return self.tokenizer

    def validate_data(self) -> DataSummary:
        from tlt.data import load_dataset

        ds = load_dataset(self.cfg.data, self.load_tokenizer())
        self.dataset = ds
        train_path, heldout_path = self.run_dir / "train.parquet", self.run_dir / "heldout.parquet"
        ds.train.to_parquet(train_path)
        ds.heldout.to_parquet(heldout_path)
        n_dropped = len(ds.dropped) if ds.dropped is not None else 0
        if n_dropped:
            self.tracker.log_text(ds.report.format(), "data/dropped_rows.txt")
        tasks = ds.train["task"].value_counts().to_dict()
        self.tracker.log_metrics({"data/rows": ds.report.n_rows, "data/dropped": n_dropped,
                                  "data/train": len(ds.train), "data/heldout": len(ds.heldout)}, step=0)
        return DataSummary(n_rows=ds.report.n_rows, n_train=len(ds.train), n_heldout=len(ds.heldout),
                           n_dropped=n_dropped, tasks={str(k): int(v) for k, v in tasks.items()},
                           train_path=str(train_path), heldout_path=str(heldout_path))

    def prompt_ids(self, prompts) -> list[list[int]]:
        from tlt.data import prompt_ids

        d = self.cfg.data
        return [prompt_ids(self.tokenizer, p, d.instruction, d.system_prompt) for p in prompts]

    # -- stage 2: models -----------------------------------------------------------------------
    def prepare(self) -> ModelSummary:
        from tlt.models import eos_token_ids, load_target

        t0 = time.perf_counter()
        self.model, self.tokenizer = load_target(self.cfg.model)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        c = self.model.config
        summary = ModelSummary(target=self.cfg.model.name_or_path, n_params=sum(p.numel() for p in self.model.parameters()),
                               n_layers=c.num_hidden_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                               load_s=time.perf_counter() - t0)
        self.tracker.log_metrics({"timing_s/load_model": summary.load_s}, step=0)
        return summary

    # -- evaluation ----------------------------------------------------------------------------
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy responses (token ids, EOS stripped) for a batch of prompt ids."""
        pad = self.tokenizer.pad_token_id
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos_ids, pad_token_id=pad)
        return [_strip(row[width:].tolist(), self.eos_ids, pad) for row in out]

    def evaluate(self, step: int) -> EvalSummary:
        from tlt.evaluate import evaluate
        from tlt.rl.rewards import get_reward_fn

        heldout = self.dataset.heldout
        summary, records = evaluate(
            heldout, self.prompt_ids(heldout["prompt"]), self.generate_greedy,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), get_reward_fn(self.cfg.rl.reward),
            self.cfg.eval.max_new_tokens, self.cfg.eval.batch_size, step)
        self.tracker.log_metrics({"eval/accuracy": summary.accuracy, "eval/response_length/mean": summary.mean_length,
                                  "timing_s/eval": summary.time_s}, step=step)
        self.tracker.log_table(records, f"eval/samples_step_{step:04d}.json")
        self.last_eval_records = records
        return summary


def _strip(ids: list[int], eos_ids: list[int], pad: int) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i]
    return [t for t in ids if t != pad]
