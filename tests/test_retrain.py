"""Scheduled retraining against a real MLflow registry (sqlite in tmp_path): the champion's policy
is continued from, a missing one stops the run (or falls back when the config says so), and the
`champion` alias moves only when held-out accept length holds."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from tlt.config import build_config
from tlt.errors import UserError
from tlt.models import tiny_model
from tlt.pipeline import Pipeline
from tlt.retrain import load_champion_policy
from tlt.summaries import ExportSummary
from tlt.tracking import MlflowTracker, champion, set_champion

pytestmark = pytest.mark.slow  # MLflow registry runs: seconds each

NAME = "tlt-drafter"


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
                            f"tracking.tracking_uri={uri}", *overrides])
    pipe = Pipeline(cfg, MlflowTracker("retrain", uri=uri, spool_dir=tmp_path / "spool"), retrain=True)
    pipe.model = tiny_model(layers=1, seed=1)  # the base policy; prepare() loads it the same way
    return pipe


def _continue_from_champion(pipe) -> None:
    """What `prepare` does when retraining (tlt.build.load_models), on the tiny base policy."""
    pipe.champion = load_champion_policy(pipe.model, pipe.cfg, pipe.tracker)


def _saved_policy(tmp_path) -> tuple[str, dict]:
    ckpt = tmp_path / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    weights = {k: v.contiguous() for k, v in tiny_model(layers=1, seed=7).state_dict().items()}
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
