"""Scheduled retraining against a real MLflow registry (sqlite in tmp_path): a model-folder champion
is continued from the registry's files alone (its local folders deleted); an old drafter-only
champion from its policy checkpoint, whose absence stops the run (or falls back when the config
says so); the `champion` alias moves only when neither the policy's held-out accuracy nor the
drafter's accept length dropped (planted regressions of each are refused, with the reason)."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import save_file

from tlt.build import RunParts
from tlt.config import build_config
from tlt.drafter.model import build_drafter
from tlt.errors import UserError
from tlt.model_folder import write_model_folder
from tlt.models import tiny_model, tiny_tokenizer
from tlt.pipeline import Pipeline
from tlt.retrain import accuracy_dropped, load_champion_drafter, load_champion_policy
from tlt.stages.export import tags_of
from tlt.summaries import ExportSummary
from tlt.tracking import MlflowTracker, champion, set_champion

pytestmark = pytest.mark.slow  # MLflow registry runs: seconds each

HELDOUT = 200
NAME = "tlt-drafter"  # an older drafter-only registry (export.model_name: tlt-drafter)


@pytest.fixture
def registry(mlflow_uri, tmp_path):
    """register(accept_len, policy_checkpoint) -> version: a real model version of a real run."""
    def register(accept_len: float, policy_checkpoint: str) -> str:
        tracker = MlflowTracker("retrain", uri=mlflow_uri, spool_dir=tmp_path / "spool")
        folder = tmp_path / "export"
        folder.mkdir(exist_ok=True)
        (folder / "model.txt").write_text("weights")
        version = tracker.log_model(folder, "drafter", register_as=NAME, tags={
            "accept_len": f"{accept_len:.3f}", "policy_checkpoint": policy_checkpoint})
        tracker.end()
        return version

    return register


def _pipeline(tmp_path, uri, *overrides):
    cfg = build_config({}, ["model.name_or_path=tiny:llama", f"trainer.checkpoint_dir={tmp_path / 'runs'}",
                            f"tracking.tracking_uri={uri}", f"export.model_name={NAME}", *overrides])
    pipe = Pipeline(cfg, MlflowTracker("retrain", uri=uri, spool_dir=tmp_path / "spool"), retrain=True)
    # the parts prepare() would build, with the base policy loaded the same way (no engine needed here)
    pipe.parts = RunParts(cfg=pipe.cfg, tracker=pipe.tracker, run_dir=pipe.run_dir, model=tiny_model(layers=4, seed=1),
                          tokenizer=None, eos_ids=[], drafter=None, engine=None, champion=None)
    pipe._dataset = SimpleNamespace(heldout=pd.DataFrame({"prompt": ["p"] * HELDOUT}))
    return pipe


def _continue_from_champion(pipe) -> None:
    """What `prepare` does when retraining (tlt.build.load_models), on the tiny base policy."""
    pipe.parts = dataclasses.replace(pipe.parts, champion=load_champion_policy(pipe.model, pipe.cfg, pipe.tracker,
                                                                               pipe.run_dir / "champion"))


def _saved_policy(tmp_path) -> tuple[str, dict]:
    ckpt = tmp_path / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in tiny_model(layers=4, seed=7).state_dict().items()}
    save_file(weights, ckpt / "policy.safetensors")
    return str(ckpt), weights


def _same(model, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_promotes_when_accept_length_holds_not_when_it_drops(registry, mlflow_uri, tmp_path):
    ckpt, weights = _saved_policy(tmp_path)
    v1 = registry(2.0, ckpt)
    set_champion(NAME, v1, mlflow_uri)

    pipe = _pipeline(tmp_path, mlflow_uri)
    _continue_from_champion(pipe)
    assert _same(pipe.model, weights)  # continued from the champion's policy, not the base
    v2 = registry(2.0, ckpt)
    assert pipe.promote(ExportSummary(path="x", version=v2, accept_len=2.0, time_s=0.0))  # equal holds
    assert str(champion(NAME, mlflow_uri)["version"]) == v2

    pipe = _pipeline(tmp_path, mlflow_uri)
    _continue_from_champion(pipe)
    v3 = registry(1.5, ckpt)
    assert not pipe.promote(ExportSummary(path="x", version=v3, accept_len=1.5, time_s=0.0))
    assert str(champion(NAME, mlflow_uri)["version"]) == v2  # the alias stayed


def test_missing_champion_policy_is_a_user_error_naming_the_path(registry, mlflow_uri, tmp_path):
    gone = tmp_path / "checkpoints" / "step-000009"
    set_champion(NAME, registry(2.0, str(gone)), mlflow_uri)
    pipe = _pipeline(tmp_path, mlflow_uri)
    with pytest.raises(UserError, match="step-000009/policy.safetensors' does not exist.*on_missing_champion_policy"):
        _continue_from_champion(pipe)


def test_missing_champion_policy_falls_back_to_base_when_configured(registry, mlflow_uri, tmp_path, caplog):
    set_champion(NAME, registry(2.0, ""), mlflow_uri)  # e.g. a run of 0 RL steps: no checkpoint tagged
    pipe = _pipeline(tmp_path, mlflow_uri, "deploy.on_missing_champion_policy=base")
    base = {k: v.clone() for k, v in pipe.model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="tlt.retrain"):
        _continue_from_champion(pipe)
    assert _same(pipe.model, base)
    assert "no policy_checkpoint tag" in caplog.text and "base policy" in caplog.text
    assert pipe.champion is not None  # the champion drafter is still continued from


# ---- the model-folder format: the registry holds the files -------------------------------------
MODEL = "tlt-model"


@pytest.fixture
def folder_champion(mlflow_uri, tmp_path):
    """A model folder (policy seed 7 + a drafter) registered as the champion of tlt-model, then every
    local copy deleted (`rm -rf runs/` and the export): only the registry holds the files."""
    cfg = build_config({}, ["model.name_or_path=tiny:llama"])
    policy = tiny_model(layers=4, seed=7)
    drafter = build_drafter(policy, cfg.drafter)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.1)
    figures = {"format": "tlt-model", "accept_len": 2.0, "heldout_accuracy": 0.6, "heldout_n": HELDOUT}
    out, _ = write_model_folder(tmp_path / "runs" / "old" / "model", policy, tiny_tokenizer(), [2], drafter,
                                torch.float32, figures)
    tracker = MlflowTracker("retrain", uri=mlflow_uri, spool_dir=tmp_path / "spool")
    version = tracker.log_model(out, "model", register_as=MODEL, tags=tags_of(figures))
    tracker.end()
    set_champion(MODEL, version, mlflow_uri)
    shutil.rmtree(tmp_path / "runs")
    return {k: v.clone() for k, v in policy.state_dict().items()}, {k: v.clone() for k, v in drafter.state_dict().items()}


def _register_version(uri, tmp_path, tags) -> str:
    folder = tmp_path / "candidate"
    folder.mkdir(exist_ok=True)
    (folder / "README.md").write_text("candidate")
    tracker = MlflowTracker("retrain", uri=uri, spool_dir=tmp_path / "spool")
    version = tracker.log_model(folder, "model", register_as=MODEL, tags=tags)
    tracker.end()
    return version


def test_retrain_continues_from_the_registry_files_after_runs_are_deleted(folder_champion, mlflow_uri, tmp_path):
    policy, drafter_state = folder_champion
    pipe = _pipeline(tmp_path, mlflow_uri, f"export.model_name={MODEL}")
    assert not _same(pipe.model, policy)
    _continue_from_champion(pipe)
    assert _same(pipe.model, policy) and pipe.champion["policy_loaded"]
    drafter = build_drafter(pipe.model, pipe.cfg.drafter)
    load_champion_drafter(drafter, pipe.champion, pipe.cfg, pipe.run_dir / "champion-drafter")
    assert all(torch.equal(v, drafter_state[k]) for k, v in drafter.state_dict().items())
    tags = MlflowClient(mlflow_uri).get_run(pipe.tracker.run_id).data.tags
    assert tags["retrain.from_version"] == "1" and tags["retrain.policy"].startswith("models:/")


def _promote(pipe, uri, tmp_path, accuracy: float, accept_len: float, step0: float = 0.6):
    pipe.evals = [(0, step0)]  # the champion's policy on this run's held-out prompts, before training
    version = _register_version(uri, tmp_path, {"accept_len": str(accept_len), "heldout_accuracy": str(accuracy)})
    ok = pipe.promote(ExportSummary(path="x", version=version, accept_len=accept_len, accuracy=accuracy,
                                    n=HELDOUT, time_s=0.0))
    run = MlflowClient(uri).get_run(pipe.tracker.run_id).data
    return ok, run.tags["export.promotion_reason"], run.metrics["export/promoted"]


def test_planted_accuracy_drop_is_not_promoted(folder_champion, mlflow_uri, tmp_path):
    pipe = _pipeline(tmp_path, mlflow_uri, f"export.model_name={MODEL}")
    _continue_from_champion(pipe)
    ok, reason, metric = _promote(pipe, mlflow_uri, tmp_path, accuracy=0.45, accept_len=2.5)
    assert not ok and metric == 0.0
    assert reason.startswith("held-out accuracy dropped: 0.450 on 200 prompts vs the champion's 0.600 on 200")
    assert str(champion(MODEL, mlflow_uri)["version"]) == "1"  # the alias stayed
    # the same drop allowed by a tolerance, and a drop within the test's noise at this size, are promoted
    pipe = _pipeline(tmp_path, mlflow_uri, f"export.model_name={MODEL}", "deploy.promote_accuracy_tolerance=0.2")
    _continue_from_champion(pipe)
    ok, reason, metric = _promote(pipe, mlflow_uri, tmp_path, accuracy=0.45, accept_len=2.5)
    assert ok and metric == 1.0 and "held-out accuracy held" in reason and "accept length held" in reason
    set_champion(MODEL, "1", mlflow_uri)
    pipe = _pipeline(tmp_path, mlflow_uri, f"export.model_name={MODEL}")
    _continue_from_champion(pipe)
    assert _promote(pipe, mlflow_uri, tmp_path, accuracy=0.57, accept_len=2.5)[0]


def test_planted_accept_length_drop_is_not_promoted(folder_champion, mlflow_uri, tmp_path):
    pipe = _pipeline(tmp_path, mlflow_uri, f"export.model_name={MODEL}")
    _continue_from_champion(pipe)
    ok, reason, metric = _promote(pipe, mlflow_uri, tmp_path, accuracy=0.62, accept_len=1.6)
    assert not ok and metric == 0.0
    assert reason == "accept length dropped: 1.600 vs the champion's 2.000"
    assert str(champion(MODEL, mlflow_uri)["version"]) == "1"


@pytest.mark.parametrize("old,new,n,dropped", [(0.3, 0.2, 32, False), (0.3, 0.1, 32, True), (0.3, 0.27, 500, False),
                                               (0.3, 0.24, 500, True), (0.5, 0.5, 10, False), (1.0, 0.9, 1000, True)])
def test_accuracy_drop_test_at_the_held_out_size(old, new, n, dropped):
    assert accuracy_dropped(old, n, new, n, alpha=0.05)[0] is dropped
