"""The stages of one training run, as methods of a `Pipeline` that keeps the long-lived state
(models, engine, drafter, optimizer) in this process.

Prefect tasks are thin wrappers that look a pipeline up by run id (`get_pipeline`) and call
one method; they pass only these methods' small pydantic summaries around.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from tlt import retrain as retraining
from tlt.checkpoint import load_checkpoint
from tlt.config import RunConfig, dump_yaml, flatten
from tlt.corpus import build_corpus
from tlt.data import load_dataset
from tlt.data import prompt_ids as encode_prompt
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.train import DrafterTrainer
from tlt.evaluate import evaluate as evaluate_heldout
from tlt.export import export_eagle3
from tlt.models import eos_token_ids, load_target, load_tokenizer
from tlt.precision import resolve_run
from tlt.preflight import check_reward_fn
from tlt.report import RunRecord, log_report
from tlt.rl.resume import checkpoint_metrics, restore_run_state, save_run_state
from tlt.rl.rewards import get_reward_fn
from tlt.rl.sampler import PromptSampler
from tlt.rl.step import StepContext
from tlt.rl.step import rl_step as run_rl_step
from tlt.rl.update import make_updater
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.tuner import StrategyTuner
from tlt.rollout.vllm_backend import VllmRolloutEngine
from tlt.rollout.workers import WorkerPool
from tlt.schemas import frame_digest
from tlt.summaries import DataSummary, EvalSummary, ExportSummary, ModelSummary, StepSummary, WarmstartSummary
from tlt.tracking import NullTracker
from tlt.warmstart import accept_report, fingerprint
from tlt.warmstart import warmstart as warmstart_drafter

_PIPELINES: dict[str, "Pipeline"] = {}


def open_pipeline(cfg: RunConfig, tracker, retrain: bool = False) -> "Pipeline":
    pipe = Pipeline(cfg, tracker, retrain=retrain)
    _PIPELINES[tracker.run_id] = pipe
    return pipe


def get_pipeline(run_id: str) -> "Pipeline":
    return _PIPELINES[run_id]


def close_pipeline(run_id: str, status: str = "FINISHED") -> None:
    pipe = _PIPELINES.pop(run_id, None)
    if pipe is None:
        return
    try:
        pipe.close()
    finally:  # the MLflow run gets its final status even if a worker fails to stop
        pipe.tracker.end(status)


class Pipeline:
    def __init__(self, cfg: RunConfig, tracker=None, retrain: bool = False):
        cfg, self.precision_notes = resolve_run(cfg)  # 'auto' precisions made concrete for this hardware
        self.cfg, self.retrain = cfg, retrain
        self.tracker = tracker or NullTracker()
        name = tracker.run_id if tracker is not None and tracker.run_id else cfg.name
        self.run_dir = Path(cfg.trainer.checkpoint_dir) / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))  # what `tlt export --checkpoint` rebuilds from
        torch.manual_seed(cfg.rl.seed)
        self.model = self.tokenizer = self.dataset = self.engine = self.drafter = None
        self.refresher = self.ctx = self.pool = None
        self.eos_ids: list[int] = []
        self.record = RunRecord()
        self.evals: list[tuple[int, float]] = []
        self.champion: dict | None = None  # retrain: the registry's champion drafter version
        self.last_checkpoint: Path | None = None

    def close(self) -> None:
        """Stop what this run started: the drafter refresher (spot trainer process), the worker or Ray
        pool and the vLLM worker. Safe to call twice; the tracker is ended by its owner."""
        for part in (self.refresher, self.pool, self.engine):
            close = getattr(part, "close", None)  # the in-process torch engine holds nothing to stop
            if close is not None:
                close()

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
            self.tokenizer = load_tokenizer(self.cfg.model)
        return self.tokenizer

    def validate_data(self) -> DataSummary:
        ds = load_dataset(self.cfg.data, self.load_tokenizer())
        self.dataset = ds
        train_path, heldout_path = self.run_dir / "train.parquet", self.run_dir / "heldout.parquet"
        ds.train.to_parquet(train_path)
        ds.heldout.to_parquet(heldout_path)
        check_reward_fn(self.cfg, ds.train.head(4))
        n_dropped = len(ds.dropped) if ds.dropped is not None else 0
        for frame, name, path, context in ((ds.train, "train-prompts", train_path, "train"),
                                           (ds.heldout, "heldout-prompts", heldout_path, "eval")):
            self.tracker.log_dataset(frame, name=name, digest=frame_digest(frame), source=str(path), context=context,
                                     tags={"rows": len(frame), "source": self.cfg.data.path or "reasoning-gym"})
        if n_dropped:
            self.tracker.log_text(ds.report.format(), "data/dropped_rows.txt")
        tasks = ds.train["task"].value_counts().to_dict()
        self.tracker.log_metrics({"data/rows": ds.report.n_rows, "data/dropped": n_dropped,
                                  "data/train": len(ds.train), "data/heldout": len(ds.heldout)}, step=0)
        return DataSummary(n_rows=ds.report.n_rows, n_train=len(ds.train), n_heldout=len(ds.heldout),
                           n_dropped=n_dropped, tasks={str(k): int(v) for k, v in tasks.items()},
                           train_path=str(train_path), heldout_path=str(heldout_path))

    def prompt_ids(self, prompts) -> list[list[int]]:
        d = self.cfg.data
        return [encode_prompt(self.tokenizer, p, d.instruction, d.system_prompt) for p in prompts]

    # -- stage 2: models -----------------------------------------------------------------------
    def prepare(self) -> ModelSummary:
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_target(self.cfg.model)
        if self.retrain:
            self._load_champion_policy()
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self._build_engine()
        c = self.model.config
        summary = ModelSummary(target=self.cfg.model.name_or_path, n_params=sum(p.numel() for p in self.model.parameters()),
                               n_layers=c.num_hidden_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                               load_s=time.perf_counter() - t0,
                               drafter_params=sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
                               if self.drafter is not None else 0)
        self.tracker.log_metrics({"timing_s/load_model": summary.load_s}, step=0)
        return summary

    def _load_champion_policy(self) -> None:
        """Retrain: continue from the champion's policy checkpoint (tlt.retrain.load_champion_policy)."""
        self.champion = retraining.load_champion_policy(self.model, self.cfg, self.tracker)

    def _build_engine(self) -> None:
        r = self.cfg.rollout
        self.drafter = build_drafter(self.model, self.cfg.drafter) if r.drafter == "eagle" else None
        if r.backend == "vllm":  # every stage's generation (rollout, warm-start, eval) goes through vLLM
            self.engine = VllmRolloutEngine.for_run(self.model, self.tokenizer, self.cfg, self.eos_ids, self.drafter,
                                                    self.run_dir)
            return
        tuner = StrategyTuner.from_config(r, seed=self.cfg.rl.seed) if r.tuner else None
        self.engine = RolloutEngine(self.model, r, self.eos_ids, self.tokenizer.pad_token_id,
                                    drafter=self.drafter, tuner=tuner)

    # -- evaluation ----------------------------------------------------------------------------
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int, sd: str = "config") -> list[list[int]]:
        """Greedy responses (token ids, EOS excluded) through the rollout engine. sd: "config" (SD as
        configured), "off", or "always" (speculate on every step, whatever the batch size)."""
        if sd not in ("config", "off", "always"):
            raise ValueError(f"sd must be 'config', 'off' or 'always', not {sd!r}")
        kw = {"spec_threshold": len(prompts)} if sd == "always" else {}
        out = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                                   spec=self.cfg.rollout.spec if sd == "config" else sd == "always", **kw)
        return [[t for t in r if t not in self.eos_ids] for r in out.response_ids]

    def evaluate(self, step: int, sd: str = "config") -> EvalSummary:
        """Held-out accuracy (greedy, decoding as `generate_greedy(sd=...)`), accept lengths, logged."""
        heldout = self.dataset.heldout
        summary, records = evaluate_heldout(
            heldout, self.prompt_ids(heldout["prompt"]), lambda p, n: self.generate_greedy(p, n, sd),
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), get_reward_fn(self.cfg.rl.reward),
            self.cfg.eval.max_new_tokens, self.cfg.eval.batch_size, step)
        metrics = {"eval/accuracy": summary.accuracy, "eval/response_length/mean": summary.mean_length,
                   "timing_s/eval": summary.time_s}
        if self.drafter is not None:
            summary.accept_len = metrics["eval/accept_len"] = self.heldout_accept_len()
            summary.accept_len_sampled = metrics["eval/accept_len_sampled"] = self.heldout_accept_len(
                self.cfg.rollout.temperature or 1.0)
        self.tracker.log_metrics(metrics, step=step)
        self.evals.append((step, summary.accuracy))
        self.tracker.log_table(records, f"eval/samples_step_{step:04d}.json")
        summary.records = records
        return summary

    def load_weights(self, checkpoint: str | Path) -> int:
        """Policy (and drafter, when present) from a run checkpoint, for evaluation; returns its step."""
        tensors, state, _ = load_checkpoint(Path(checkpoint))
        self.model.load_state_dict(tensors["policy"], strict=True)
        if "drafter" in tensors and self.drafter is not None:
            self.drafter.load_state_dict(tensors["drafter"], strict=True)
        return int(state["step"]) + 1

    def heldout_accept_len(self, temperature: float = 0.0) -> float:
        """Accept length on the first `drafter.warmstart_eval_prompts` held-out prompts: tuner off,
        the fixed `drafter.eval_strategy`, `drafter.eval_max_new_tokens` each (warmstart.accept_report)."""
        prompts = self.prompt_ids(self.dataset.heldout["prompt"][: self.cfg.drafter.warmstart_eval_prompts])
        return accept_report(self.engine, prompts, self.cfg, temperature).accept_len

    def build_corpus(self):
        """The drafter's self-distilled warm-start corpus (tlt.corpus), logged as a dataset input."""
        ds = self.dataset
        corpus = build_corpus(self.engine, self.prompt_ids, self.cfg, ds.train["prompt"].tolist(),
                              ds.heldout["prompt"].tolist(), Path(self.cfg.model.cache_dir).parent / "corpora",
                              fingerprint(self.model, []), capture=self.drafter.aux_layer_ids)
        self.tracker.log_dataset(corpus.frame(), name="drafter-corpus", digest=corpus.key, source=str(corpus.path),
                                 tags={"tokens": corpus.n_tokens, "sequences": len(corpus)})
        self.tracker.log_metrics({"warmstart/corpus_tokens": corpus.n_tokens,
                                  "warmstart/corpus_sequences": len(corpus),
                                  "timing_s/corpus": corpus.build_s}, step=0)
        return corpus

    def report(self) -> str:
        return log_report(self.record, self.evals, self.tracker, self.cfg.rollout.max_new_tokens)

    # -- stage 3: drafter warm-start -------------------------------------------------------------
    def warmstart(self, corpus=None) -> WarmstartSummary:
        """Warm-start on `corpus` (default: `build_corpus()`; a caller that also needs the corpus'
        captured features, e.g. bench/adaptive.py, builds it once and passes it)."""
        ds, d = self.dataset, self.cfg.drafter
        if self.champion is not None:  # retrain: start from the champion drafter, no warm-start
            return self._load_champion_drafter()
        corpus = corpus if corpus is not None else self.build_corpus()
        summary, trainer = warmstart_drafter(
            self.model, self.drafter, self.engine, corpus,
            self.prompt_ids(ds.heldout["prompt"][: d.warmstart_eval_prompts]), self.cfg,
            Path(self.cfg.model.cache_dir).parent / "drafters", log=self.tracker.log_metrics)
        self.refresher = self._make_refresher(trainer)
        self.tracker.log_metrics({"warmstart/accept_len_before": summary.accept_len_before,
                                  "warmstart/accept_len_after": summary.accept_len_after,
                                  "warmstart/accept_len_sampled": summary.accept_len_sampled or 0.0,
                                  "warmstart/vocab_coverage": summary.vocab_coverage or 0.0,
                                  "warmstart/train_tokens": summary.n_tokens, "timing_s/warmstart": summary.time_s}, step=0)
        return summary

    def _load_champion_drafter(self) -> WarmstartSummary:
        t0 = time.perf_counter()
        local = retraining.load_champion_drafter(self.drafter, self.champion, self.cfg, self.run_dir / "champion")
        trainer = DrafterTrainer(self.drafter, self.cfg.drafter, self.model.get_output_embeddings().weight)
        self.refresher = self._make_refresher(trainer)
        acc = self.heldout_accept_len()
        return WarmstartSummary(accept_len_before=acc, accept_len_after=acc, n_samples=0, n_tokens=0, train_steps=0,
                                time_s=time.perf_counter() - t0, cached=True, path=str(local))

    def _make_refresher(self, trainer):
        """Spot trainer (drafter training in the rollout's tail) or sequential refresher."""
        d = self.cfg.drafter
        if d.where == "sequential" or d.schedule == "frozen":  # frozen: no process, never trains
            return DrafterRefresher(trainer, d, seed=self.cfg.rl.seed)
        spot = SpotTrainer(self.model, self.drafter, d, threads=d.spot_threads, seed=self.cfg.rl.seed,
                           checkpoint_dir=self.run_dir / "drafter_checkpoints")
        spot.load(self.drafter.state_dict(), {"optimizer": trainer.opt.state_dict(),
                                                        "num_steps": trainer.num_steps})
        return spot

    def promote(self, export: ExportSummary) -> bool:
        """Move the `champion` alias to the new version unless held-out accept length dropped."""
        return retraining.promote(self.cfg, self.tracker, export.version, export.accept_len, self.champion)

    # -- stage 4: RL steps -----------------------------------------------------------------------
    def start_steps(self) -> StepContext:
        """What the RL steps share (rollout engine, updater, prompt sampler, reward, refresher),
        built once. With `rollout.workers` > 1 (or on Ray) this starts the workers (actors); `resume()` and
        `rl_step()` call it, so the first of them pays for the start-up."""
        if self.ctx is None:
            engine = self._rollout_engine()
            updater = self.pool.updater if self.cfg.cluster.backend == "ray" else make_updater(self.model, self.cfg)
            self.ctx = StepContext(cfg=self.cfg, model=self.model, tokenizer=self.tokenizer, engine=engine,
                                   updater=updater,
                                   sampler=PromptSampler(self.dataset.train, seed=self.cfg.data.seed),
                                   reward_fn=get_reward_fn(self.cfg.rl.reward), encode=self.prompt_ids,
                                   refresher=self.refresher if self.cfg.drafter.schedule != "frozen" else None)
        return self.ctx

    def _rollout_engine(self):
        """The RL steps' rollout engine: this process's engine, `rollout.workers` worker processes, or
        (cluster.backend: ray) rollout actors in the run's placement group, placement logged to MLflow."""
        r = self.cfg.rollout
        if self.cfg.cluster.backend == "ray":
            from tlt.cluster import RayRun  # deferred: ray is an optional extra ('.[ray]'), imported only there

            self.pool = RayRun.start(self.cfg, self.model, self.drafter, self.eos_ids, self.tokenizer.pad_token_id,
                                     tokenizer=self.tokenizer, run_dir=self.run_dir)
            self.tracker.log_params(self.pool.params())
            self.tracker.log_metrics(self.pool.metrics(), step=0)
            return self.pool.engine
        if r.workers <= 1:
            return self.engine
        self.pool = WorkerPool(self.model, r, self.eos_ids, self.tokenizer.pad_token_id, r.workers,
                               drafter=self.drafter, seed=self.cfg.rl.seed)
        return self.pool

    def resume(self) -> int:
        """Restore the newest verified checkpoint of this run; returns the first step still to run."""
        state = restore_run_state(self.start_steps(), self.run_dir / "checkpoints")
        logged = checkpoint_metrics(state)
        if logged:  # a crash between the save and the log: the tracker skips (key, step)s the run has
            self.tracker.log_metrics(logged[1], step=logged[0])
        if state is not None and state["corrupt_skipped"]:  # newer checkpoints failed their checksums
            self.tracker.log_metrics({"checkpoint/corrupt_skipped": float(len(state["corrupt_skipped"]))},
                                     step=state["step"] + 1)
        return 0 if state is None else state["step"] + 1

    def rl_step(self, step: int) -> StepSummary:
        ctx = self.start_steps()
        result = run_rl_step(ctx, step)
        metrics = result.metrics
        if (step + 1) % self.cfg.trainer.checkpoint_every == 0 or step + 1 == self.cfg.rl.steps:
            t0 = time.perf_counter()
            self.last_checkpoint = save_run_state(ctx, step, self.run_dir / "checkpoints",
                                                  self.cfg.trainer.checkpoint_keep,
                                                  extra={"metrics": {k: float(v) for k, v in metrics.items()}})
            metrics["timing_s/checkpoint"] = time.perf_counter() - t0
        self.tracker.log_metrics(metrics, step=step + 1)
        self.record.add_step(step + 1, metrics, result.batch)
        every = self.cfg.tracking.samples_every
        if every and (step + 1) % every == 0:
            self.tracker.log_table(result.samples, f"rollouts/step_{step + 1:04d}.json")
        return StepSummary(step=step + 1, reward_mean=metrics["reward/mean"], accept_len=metrics.get("spec/accept_len/mean"),
                           step_s=metrics["timing_s/step"], metrics={k: float(v) for k, v in metrics.items()},
                           samples=result.samples)

    # -- stage 6: export ---------------------------------------------------------------------------
    def export(self, final: EvalSummary | None = None) -> ExportSummary:
        """EAGLE-3 directory (tlt.export) logged to MLflow as the run's model and registered as a version.
        `final`: the evaluation of the last step's weights, whose accept lengths the model version is
        tagged with (measured here when it is missing or of another step)."""
        t0 = time.perf_counter()
        same = final is not None and final.step == self.cfg.rl.steps
        accept_len = final.accept_len if same else None
        if accept_len is None:
            accept_len = self.heldout_accept_len()
        sampled = final.accept_len_sampled if same else None
        if sampled is None:
            sampled = self.heldout_accept_len(self.cfg.rollout.temperature or 1.0)
        e = self.cfg.export
        out = Path(e.out_dir) if e.out_dir else self.run_dir / "drafter_export"
        export_eagle3(self.drafter, self.model.config, out, force=e.out_dir is None)
        tags = {"target": self.cfg.model.name_or_path, "accept_len": f"{accept_len:.3f}",
                "accept_len_sampled": f"{sampled:.3f}", "accept_strategy": self.cfg.drafter.eval_strategy.name,
                "format": "eagle3",
                "policy_checkpoint": str(self.last_checkpoint.resolve()) if self.last_checkpoint else ""}
        version = self.tracker.log_model(out, "drafter", register_as=e.model_name if e.register_model else None,
                                         tags=tags, step=self.cfg.rl.steps)
        summary = ExportSummary(path=str(out), version=version, accept_len=accept_len, time_s=time.perf_counter() - t0)
        self.tracker.log_metrics({"timing_s/export": summary.time_s}, step=self.cfg.rl.steps)
        return summary
