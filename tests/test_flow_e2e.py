"""The smoke recipe end to end: a real Prefect API and a real sqlite MLflow store."""
from pathlib import Path

import pytest

from tlt.config import load_config
from tlt.tracking import metric_history, read_run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_smoke_flow_end_to_end(prefect_api, mlflow_uri, tmp_path):
    from prefect.artifacts import Artifact

    from flows.train import tlt_train

    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path / 'runs'}"])
    result = tlt_train(config=cfg)
    run = read_run(result["run_id"], mlflow_uri)
    assert run["status"] == "FINISHED"
    assert run["params"]["rl.steps"] == str(cfg.rl.steps)
    assert run["params"]["model.name_or_path"] == "tiny:llama"
    assert "config.yaml" in run["artifacts"]
    assert run["tags"]["prefect.flow_run_id"]
    acc = metric_history(result["run_id"], "eval/accuracy", mlflow_uri)
    assert acc and all(0.0 <= v <= 1.0 for _, v in acc)
    assert [s for s, _ in acc] == list(range(cfg.rl.steps + 1))  # eval every step, incl. the baseline
    for key in ("reward/mean", "spec/accept_len/mean", "policy/loss", "drafter/steps", "timing_s/step",
                "timing_s/update_drafter", "rollout/response_length/max"):
        steps = [s for s, _ in metric_history(result["run_id"], key, mlflow_uri)]
        assert steps == list(range(1, cfg.rl.steps + 1)), key
    # spot trainer: step 1's buffer is empty (one-step offset), later steps train in the tail
    spot = dict(metric_history(result["run_id"], "drafter/spot_steps", mlflow_uri))
    assert spot[1] == 0 and spot[2] > 0
    assert [s for s, _ in metric_history(result["run_id"], "drafter/loss", mlflow_uri)] == [2]
    assert metric_history(result["run_id"], "warmstart/accept_len_after", mlflow_uri)
    plots = {p.split("/")[-1] for p in run["artifacts"]} | set(run["artifacts"])
    assert "plots" in plots and "drafter" in plots
    for key in ("data-report", "models", "warmstart", "rl-step", "eval", "run-report", "export"):
        assert Artifact.get(key) is not None, key
    # the export is a registered model version with the target and accept length as tags
    from tlt.export import check_export
    from tlt.models import load_target

    target, _ = load_target(cfg.model)
    assert check_export(result["export"]["path"], target.config) == []
    assert result["export"]["version"] == "1"
    # the policy moved and a checkpoint exists for every step
    ckpts = sorted((tmp_path / "runs" / result["run_id"] / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts][-1] == f"step-{cfg.rl.steps - 1:06d}"
