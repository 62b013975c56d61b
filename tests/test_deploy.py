"""Deployments end to end: a real local Prefect server, `tlt schedule`, a run triggered through the
API (as the UI's Run button does), MLflow holding its metrics, and the retrain schedule."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _services import prefect_server

from tlt.config import load_config
from tlt.services import stop

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    with prefect_server(tmp) as prefect:
        env = prefect["env"]
        sets = ["--set", f"trainer.checkpoint_dir={tmp / 'runs'}", "--set", "deploy.cron=*/5 * * * *"]
        serve = subprocess.Popen([str(BIN / "tlt"), "schedule", "conf/smoke.yaml", *sets], cwd=ROOT, env=env,
                                 stdout=open(tmp / "serve.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield {"env": env, "tmp": tmp, "api": prefect["api"], "serve": serve}
        finally:
            stop(serve)


def _deployments(api):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def names():
        async with get_client() as client:
            return {f"{d.name}": d for d in await client.read_deployments()}

    import asyncio

    with temporary_settings(updates={PREFECT_API_URL: api}):
        return asyncio.run(names())


def _wait_deployments(api, timeout=180):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        deps = _deployments(api)
        if {"manual", "retrain"} <= set(deps):
            return deps
        time.sleep(2)
    raise AssertionError("tlt schedule did not register tlt-train/manual and tlt-train/retrain")


def test_ui_run_completes_and_is_tracked(server):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tlt.tracking import find_run, metric_history

    _wait_deployments(server["api"])
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={server['tmp'] / 'runs'}",
                                                      "rl.steps=1", "name=from-the-ui"])
    with temporary_settings(updates={PREFECT_API_URL: server["api"]}):
        fr = run_deployment("tlt-train/manual", parameters={"config": cfg.model_dump(mode="json")}, timeout=900)
    assert fr.state.is_completed(), (server["tmp"] / "serve.log").read_text()[-3000:]
    uri = server["env"]["MLFLOW_TRACKING_URI"]
    run_id = find_run("prefect.flow_run_id", str(fr.id), "tlt", uri)
    assert run_id, "the flow run left no MLflow run tagged with its id"
    assert metric_history(run_id, "reward/mean", uri) and metric_history(run_id, "eval/accuracy", uri)


def test_retrain_is_scheduled_by_the_server(server):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deps = _wait_deployments(server["api"])
    retrain = deps["retrain"]
    assert retrain.schedules and retrain.schedules[0].schedule.cron == "*/5 * * * *"
    assert deps["manual"].parameter_openapi_schema["properties"]["config"]  # the RunConfig form

    async def scheduled():
        async with get_client() as client:
            runs = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[retrain.id])))
            return [r for r in runs if r.state and r.state.is_scheduled()]

    end = time.monotonic() + 120
    with temporary_settings(updates={PREFECT_API_URL: server["api"]}):
        while time.monotonic() < end and not (runs := asyncio.run(scheduled())):
            time.sleep(3)
    assert runs, "the server's scheduler created no scheduled retrain run"
    assert all(r.parameters.get("retrain") is True for r in runs)
