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
    assert Artifact.get("data-report") is not None
