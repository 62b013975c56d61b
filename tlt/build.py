"""How a run's long-lived parts are built: models, the generation engine (torch or vLLM), the RL
steps' rollout placement (this process, worker processes or Ray actors), the policy updater and the
drafter refresher. `build_parts` makes what every stage after the data shares (`RunParts`, once,
eagerly); `build_steps` puts the RL steps' parts together, top to bottom.

One engine per run where the backend allows it: evaluation, the drafter corpus, warm-start and the
RL rollout share the generation engine (torch or vLLM in this process). A worker pool
(`rollout.workers` > 1) or Ray actors decode the RL rollouts beside it, because a pool cannot run
what the other stages need: a fixed-strategy measurement (the held-out accept length) and the
corpus' hidden-state capture need one engine with one config and one bandit, and each pool worker
keeps its own (tlt.rollout.contract.PerWorkerState).

Every function here only constructs; what a part does is written in its Protocol
(tlt.rollout.contract, tlt.rl.protocols), and tlt.pipeline.Pipeline owns, wires and closes what
these return.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tlt import retrain as retraining
from tlt.config import RunConfig, dump_yaml
from tlt.prompts import prompt_ids as encode_prompt
from tlt.device import resolve_device
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.train import DrafterTrainer
from tlt.models import eos_token_ids, load_target, load_tokenizer
from tlt.precision import resolve_run
from tlt.rl.protocols import Refresher, Updater
from tlt.rollout.contract import Engine
from tlt.rl.rewards import get_reward_fn
from tlt.rl.sampler import PromptSampler
from tlt.rl.step import StepContext
from tlt.rl.update import make_updater
from tlt.rollout.torch_engine.build import build_engine as build_torch_engine
from tlt.rollout.vllm_engine.backend import VllmRolloutEngine
from tlt.rollout.workers import WorkerPool
from tlt.tracking import NullTracker


def open_run(cfg: RunConfig, tracker=None) -> tuple[RunConfig, list[str], object, Path]:
    """(config with 'auto' precisions made concrete for this hardware, one line per such choice,
    tracker (a NullTracker when none), run folder): the folder is `trainer.checkpoint_dir` / the
    tracker's run id (or the run name) and holds the config `tlt export --checkpoint` rebuilds
    from. Seeds torch with `rl.seed`."""
    cfg, notes = resolve_run(cfg, resolve_device(cfg.trainer.device))
    name = tracker.run_id if tracker is not None and tracker.run_id else cfg.name
    run_dir = Path(cfg.trainer.checkpoint_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.rl.seed)
    return cfg, notes, tracker or NullTracker(), run_dir


def tokenizer(cfg: RunConfig):
    """The target's tokenizer alone: the data stage needs it before the models load."""
    return load_tokenizer(cfg.model)


def encoder(tokenizer, cfg: RunConfig):
    """Prompt texts -> token ids with the run's chat template, instruction and system prompt."""
    d = cfg.data
    return lambda prompts: [encode_prompt(tokenizer, p, d.instruction, d.system_prompt) for p in prompts]


def load_models(cfg: RunConfig, tracker, retrain: bool, run_dir: Path):
    """(policy, tokenizer, EOS ids, champion): the target model, continued from the registry's
    champion policy when retraining (tlt.retrain, its files downloaded into run_dir/champion;
    champion None otherwise)."""
    model, tokenizer = load_target(cfg.model, resolve_device(cfg.trainer.device))
    champion = retraining.load_champion_policy(model, cfg, tracker, run_dir / "champion") if retrain else None
    return model, tokenizer, eos_token_ids(tokenizer, model), champion


@dataclass(frozen=True)
class RunParts:
    """What every stage after the data shares, built once by `build_parts`: the policy, its
    tokenizer and EOS ids, the drafter (None: none, or n-gram drafts), the generation engine, the
    registry's champion (retrain; None otherwise), the run's config, tracker and folder."""

    cfg: RunConfig
    tracker: object
    run_dir: Path
    model: object
    tokenizer: object
    eos_ids: list[int]
    drafter: object | None
    engine: Engine
    champion: dict | None

    def encode(self, prompts) -> list[list[int]]:
        """Prompt texts -> token ids with the run's chat template (`encoder`)."""
        return encoder(self.tokenizer, self.cfg)(prompts)


def build_parts(cfg: RunConfig, tracker, retrain: bool, run_dir: Path) -> RunParts:
    """The models (the registry's champion policy when retraining), the drafter and the one
    generation engine, built together."""
    model, tokenizer, eos_ids, champion = load_models(cfg, tracker, retrain, run_dir)
    drafter, engine = build_engine(model, tokenizer, cfg, eos_ids, run_dir)
    return RunParts(cfg=cfg, tracker=tracker, run_dir=run_dir, model=model, tokenizer=tokenizer, eos_ids=eos_ids,
                    drafter=drafter, engine=engine, champion=champion)


def build_engine(model, tokenizer, cfg: RunConfig, eos_ids: list[int], run_dir: Path):
    """(drafter or None, generation engine): the EAGLE drafter when `rollout.drafter` is eagle, and
    the engine every stage generates with (rollout, warm-start, eval): vLLM or this process' torch."""
    r = cfg.rollout
    drafter = build_drafter(model, cfg.drafter) if r.drafter == "eagle" else None
    if r.backend == "vllm":  # both engines calibrate their bandit before it explores (tlt.rollout.breakeven)
        return drafter, VllmRolloutEngine.for_run(model, tokenizer, cfg, eos_ids, drafter, run_dir)
    return drafter, build_torch_engine(model, r, eos_ids, tokenizer.pad_token_id, drafter, seed=cfg.rl.seed,
                                       calibrate_vocab=model.config.vocab_size)


def build_rollout(cfg: RunConfig, model, drafter, engine: Engine, eos_ids: list[int], tokenizer, run_dir: Path,
                  tracker):
    """(RL rollout engine, pool or None): the generation engine itself, `rollout.workers` worker
    processes, or (cluster.backend: ray) rollout actors in the run's placement group, logged."""
    if cfg.cluster.backend == "ray":
        from tlt.cluster import RayRun  # deferred: ray is an optional extra ('.[ray]'), imported only there

        pool = RayRun.start(cfg, model, drafter, eos_ids, tokenizer.pad_token_id, tokenizer=tokenizer,
                            run_dir=run_dir)
        tracker.log_params(pool.params())
        tracker.log_metrics(pool.metrics(), step=0)
        return pool.engine, pool
    if cfg.rollout.workers <= 1:
        return engine, None
    pool = WorkerPool(model, cfg.rollout, eos_ids, tokenizer.pad_token_id, cfg.rollout.workers, drafter=drafter,
                      seed=cfg.rl.seed)
    return pool, pool


def build_updater(model, cfg: RunConfig, pool) -> Updater:
    """The policy update: the Ray run's (data-parallel ranks) or `trainer.backend`'s in this process."""
    return pool.updater if cfg.cluster.backend == "ray" else make_updater(model, cfg)


def build_refresher(cfg: RunConfig, model, drafter, trainer: DrafterTrainer, run_dir: Path) -> Refresher:
    """Spot trainer (drafter training in the rollout's tail, its own process) or the sequential
    refresher, continuing `trainer`'s optimizer."""
    d = cfg.drafter
    if d.where == "sequential" or d.schedule == "frozen":  # frozen: no process, never trains
        return DrafterRefresher(trainer, d, seed=cfg.rl.seed)
    spot = SpotTrainer(model, drafter, d, threads=d.spot_threads, seed=cfg.rl.seed,
                       checkpoint_dir=run_dir / "drafter_checkpoints")
    spot.load(drafter.state_dict(), {"optimizer": trainer.opt.state_dict(), "num_steps": trainer.num_steps})
    return spot


def build_steps(cfg: RunConfig, model, tokenizer, train_rows, engine: Engine, refresher: Refresher | None,
                pool) -> StepContext:
    """What every RL step reads, built once: `engine` (as `build_rollout` placed it), the updater,
    the prompt sampler over `train_rows`, the reward and the refresher (none when frozen)."""
    return StepContext(cfg=cfg, model=model, tokenizer=tokenizer, engine=engine,
                       updater=build_updater(model, cfg, pool),
                       sampler=PromptSampler(train_rows, seed=cfg.data.seed),
                       reward_fn=get_reward_fn(cfg.rl.reward), encode=encoder(tokenizer, cfg),
                       refresher=refresher if cfg.drafter.schedule != "frozen" else None)
