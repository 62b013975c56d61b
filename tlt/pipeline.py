"""The stages of one training run, as methods of a `Pipeline` that owns the long-lived parts
(models, engine, drafter, refresher, rollout pool, optimizer) in this process and closes them.

The parts are made by tlt.build, eagerly and in one place per stage that makes them: the dataset by
`validate_data`, the models, drafter and generation engine by `prepare` (`RunParts`), the drafter's
refresher by `warmstart`, the RL steps' context by `start_steps`. A stage whose inputs do not
exist yet refuses with `StageOrderError` naming the stage to run first, instead of running without
them. The stage bodies live in tlt.stages; this module wires them. Every method returns what it
made (small pydantic summaries, tlt.summaries). Prefect tasks (tasks/stages.py) look a pipeline up
by run id and call one method each.
"""
from __future__ import annotations

import time
from pathlib import Path

from tlt import build
from tlt import retrain as retraining
from tlt.config import RunConfig, dump_yaml, flatten
from tlt.report import RunRecord, log_report
from tlt.stages import data, evaluation, export, training
from tlt.stages import warmstart as drafting
from tlt.summaries import DataSummary, EvalSummary, ExportSummary, ModelSummary, StepSummary, WarmstartSummary


class StageOrderError(RuntimeError):
    """A stage was called before the stage that builds its inputs; the message names both."""


class Pipeline:
    def __init__(self, cfg: RunConfig, tracker=None, retrain: bool = False):
        self.cfg, self.precision_notes, self.tracker, self.run_dir = build.open_run(cfg, tracker)
        self.retrain = retrain
        self.tokenizer = None  # the data stage needs it before the models load
        self._dataset = None  # validate_data()
        self.parts: build.RunParts | None = None  # prepare()
        self.refresher = None  # warmstart(), for every run with a drafter
        self.accept_prior: float | None = None  # warmstart(): the drafter's per-token acceptance (tlt.rollout.breakeven)
        self.ctx = self.pool = None  # start_steps()
        self.record = RunRecord()
        self.evals: list[tuple[int, float]] = []
        self.last_checkpoint: Path | None = None

    # -- what the stages made, or a clear refusal -----------------------------------------------
    def _need(self, made, what: str, stage: str, caller: str):
        if made is None:
            raise StageOrderError(f"Pipeline.{caller}() needs {what}, which the {stage}() stage builds: call it first "
                                  "(the tlt-train flow runs validate_data, prepare, warmstart, then the RL steps)")
        return made

    @property
    def dataset(self):
        return self._need(self._dataset, "the validated dataset", "validate_data", "dataset")

    def _parts(self, caller: str) -> build.RunParts:
        return self._need(self.parts, "the models and the generation engine", "prepare", caller)

    @property
    def model(self):
        return self._parts("model").model

    @property
    def engine(self):
        return self._parts("engine").engine

    @property
    def drafter(self):
        return self._parts("drafter").drafter

    @property
    def eos_ids(self) -> list[int]:
        return self._parts("eos_ids").eos_ids

    @property
    def champion(self) -> dict | None:
        return self._parts("champion").champion

    def close(self) -> None:
        """Stop what this run started: the drafter refresher (spot trainer process), the policy updater
        (DeepSpeed's process group, Ray's trainer ranks), the worker or Ray pool and the vLLM worker.
        The one place the run's parts are closed; safe to call twice. The tracker is ended by its owner."""
        updater = self.ctx.updater if self.ctx is not None else None
        engine = self.parts.engine if self.parts is not None else None
        for part in (self.refresher, updater, self.pool, engine):
            if part is not None:
                part.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- stage 0: record what this run is ------------------------------------------------------
    def log_config(self) -> None:
        self.tracker.log_params(flatten(self.cfg))
        self.tracker.log_params({f"precision.why.{n.split('=')[0]}": n.split(" ", 1)[1].strip("()")
                                 for n in self.precision_notes})
        self.tracker.log_text(dump_yaml(self.cfg), "config.yaml")

    # -- stage 1: data -------------------------------------------------------------------------
    def load_tokenizer(self):
        if self.tokenizer is None:
            self.tokenizer = build.tokenizer(self.cfg)
        return self.tokenizer

    def validate_data(self) -> DataSummary:
        self._dataset, summary = data.validate_data(self.cfg, self.load_tokenizer(), self.run_dir, self.tracker)
        return summary

    def prompt_ids(self, prompts) -> list[list[int]]:
        return build.encoder(self.load_tokenizer(), self.cfg)(prompts)

    # -- stage 2: models -----------------------------------------------------------------------
    def prepare(self) -> ModelSummary:
        """Load the models and build the drafter and the generation engine (tlt.build.build_parts)."""
        t0 = time.perf_counter()
        self.parts = p = build.build_parts(self.cfg, self.tracker, self.retrain, self.run_dir)
        self.tokenizer = p.tokenizer
        c = p.model.config
        summary = ModelSummary(target=self.cfg.model.name_or_path, n_params=sum(x.numel() for x in p.model.parameters()),
                               n_layers=c.num_hidden_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                               load_s=time.perf_counter() - t0,
                               drafter_params=sum(x.numel() for x in p.drafter.parameters() if x.requires_grad)
                               if p.drafter is not None else 0)
        self.tracker.log_metrics({"timing_s/load_model": summary.load_s}, step=0)
        return summary

    # -- evaluation ----------------------------------------------------------------------------
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int, sd: str = "config") -> list[list[int]]:
        """Greedy responses through the rollout engine (tlt.stages.evaluation.generate_greedy)."""
        return evaluation.generate_greedy(self.engine, self.cfg, self.eos_ids, prompts, max_new_tokens, sd)

    def evaluate(self, step: int, sd: str = "config", accept: bool = True) -> EvalSummary:
        """Held-out accuracy, records and (with a drafter, unless `accept` is off: the export measures
        them on the exported folder) held-out accept lengths, logged at `step`."""
        parts = self._parts("evaluate")
        summary = evaluation.evaluate(parts, self.dataset.heldout, step, sd, accept)
        self.evals.append((step, summary.accuracy))
        rate = drafting.accept_prior(self.cfg, summary.accept_len, summary.accept_len_sampled)
        if rate is not None and self.refresher is not None:  # the drafter moved: speculation is priced again
            self.accept_prior = rate
            drafting.price_prior(parts.engine, rate, self.tracker, step)
            if self.ctx is not None and self.ctx.engine is not parts.engine:  # the steps' workers or actors
                drafting.price_prior(self.ctx.engine, rate, self.tracker, step)
        return summary

    def load_weights(self, checkpoint: str | Path) -> int:
        """Policy (and drafter, when present) from a run checkpoint, for evaluation; returns its step."""
        return evaluation.load_weights(self.model, self.drafter, checkpoint)

    def report(self) -> str:
        return log_report(self.record, self.evals, self.tracker, self.cfg.rollout.max_new_tokens)

    # -- stage 3: drafter warm-start -------------------------------------------------------------
    def build_corpus(self):
        """The drafter's self-distilled warm-start corpus (tlt.corpus), logged as a dataset input."""
        return drafting.corpus(self._parts("build_corpus"), self.dataset)

    def warmstart(self, corpus=None) -> WarmstartSummary:
        """Warm-start on `corpus` (default: `build_corpus()`; a caller that also needs the corpus'
        captured features, e.g. bench/adaptive.py, builds it once and passes it); retrain: the
        champion drafter instead. Builds the refresher that trains the drafter during RL."""
        parts = self._parts("warmstart")
        heldout = parts.encode(self.dataset.heldout["prompt"][: self.cfg.drafter.warmstart_eval_prompts])
        if parts.champion is not None:
            summary, trainer = drafting.champion_drafter(parts, heldout)
        else:
            summary, trainer = drafting.warmstart(parts, heldout, corpus if corpus is not None else self.build_corpus())
        self.refresher = build.build_refresher(self.cfg, parts.model, parts.drafter, trainer, self.run_dir)
        summary.prior_accept_rate = self.accept_prior = drafting.accept_prior(
            self.cfg, summary.accept_len_after, summary.accept_len_sampled)  # the pools of start_steps get it too
        summary.tail_threshold = drafting.price_prior(parts.engine, self.accept_prior, self.tracker)
        return summary

    def promote(self, exported: ExportSummary) -> bool:
        """Move the `champion` alias to the new version unless the policy's held-out accuracy or the
        drafter's accept length dropped (tlt.retrain.should_promote); the reason is logged."""
        old = retraining.champion_accuracy(self.champion, self.evals, len(self.dataset.heldout))
        return export.promote(self.cfg, self.tracker, exported, self.champion, old)

    # -- stage 4: RL steps -----------------------------------------------------------------------
    def start_steps(self):
        """What the RL steps share (tlt.build.build_steps), built once. With `rollout.workers` > 1 (or
        on Ray) this starts the workers (actors); `resume()` and `rl_step()` call it, so the first of
        them pays for the start-up. A run with an EAGLE drafter must be warm-started first (the
        refresher that trains the drafter during RL continues the warm-start's optimizer): before
        that this refuses (`StageOrderError`) instead of running steps that would never train it."""
        if self.ctx is None:
            p = self._parts("start_steps")
            if p.drafter is not None and self.refresher is None:
                self._need(None, "the warm-started drafter and its refresher", "warmstart", "start_steps")
            engine, self.pool = build.build_rollout(self.cfg, p.model, p.drafter, p.engine, p.eos_ids, p.tokenizer,
                                                    self.run_dir, self.tracker)
            if engine is not p.engine:  # workers or actors: each re-prices its own curve at the drafter's acceptance
                drafting.price_prior(engine, self.accept_prior, self.tracker)
            self.ctx = build.build_steps(self.cfg, p.model, p.tokenizer, self.dataset.train, engine,
                                         self.refresher, self.pool)
        return self.ctx

    def resume(self) -> int:
        """Restore the newest verified checkpoint of this run; returns the first step still to run."""
        return training.resume(self.start_steps(), self.run_dir, self.tracker)

    def rl_step(self, step: int) -> StepSummary:
        summary, saved = training.rl_step(self.start_steps(), step, self.run_dir, self.tracker, self.record)
        self.last_checkpoint = saved or self.last_checkpoint
        return summary

    # -- stage 6: export ---------------------------------------------------------------------------
    def export(self, final: EvalSummary | None = None) -> ExportSummary:
        """The model folder (policy/, drafter/, README.md) logged as the run's model and registered as
        one version. `final`: the evaluation of the last step's weights, whose held-out accuracy tags
        the version; the accept lengths are measured on the exported folder itself."""
        accuracy = final.accuracy if final is not None and final.step == self.cfg.rl.steps else None
        return export.export(self._parts("export"), accuracy, list(self.dataset.heldout["prompt"]))
