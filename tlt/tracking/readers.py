"""The read side: runs, stepped metrics and experiments for `tlt compare`, `tlt export --run`,
retried flows and tests; artifact download for retraining."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tlt.tracking.base import default_tracking_uri, keep_env_uri
from tlt.tracking.transient import is_transient

# MLflow 3.17's UI shows every experiment in its GenAI view unless the URL (or the switch at its
# top left, remembered by the browser) asks for the model-training one; tlt's links ask.
TRAINING_VIEW = "workflowType=machine_learning"
UI_DEFAULT = "http://127.0.0.1:5000"  # `tlt ui` / `make ui`


def _client(uri: str | None) -> MlflowClient:
    return MlflowClient(default_tracking_uri(uri))


def read_run(run_id: str, uri: str | None = None) -> dict[str, Any]:
    """Params, latest metrics, tags, artifact paths, dataset inputs ({name: {digest, context}}) and
    logged models ({name: {model_id, step, status, source_run_id, tags}}) of a run (for compare and tests)."""
    client = _client(uri)
    run = client.get_run(run_id)
    inputs = run.inputs.dataset_inputs if run.inputs else []
    datasets = {d.dataset.name: {"digest": d.dataset.digest,
                                 "context": next((t.value for t in d.tags if t.key == "mlflow.data.context"), None)}
                for d in inputs}
    outputs = run.outputs.model_outputs if run.outputs else []
    models = {}
    for out in outputs:
        lm = client.get_logged_model(out.model_id)
        models[lm.name] = {"model_id": lm.model_id, "step": out.step, "status": str(lm.status),
                           "source_run_id": lm.source_run_id, "tags": lm.tags}
    return {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags,
            "status": run.info.status, "name": run.info.run_name,
            "artifacts": [f.path for f in client.list_artifacts(run_id)], "datasets": datasets, "models": models}


def metric_history(run_id: str, key: str, uri: str | None = None) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, key)]


def metric_histories(run_id: str, keys: list[str], uri: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} sorted by step, one value per step (the latest logged wins, e.g.
    after a resume re-logs a step); a key never logged maps to []."""
    client = _client(uri)
    out = {}
    for key in keys:
        latest = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            latest[m.step] = m.value
        out[key] = sorted(latest.items())
    return out


def list_experiments(uri: str | None = None) -> list[str]:
    """Names of the active experiments of the store (for "did you mean" messages)."""
    return [e.name for e in _client(uri).search_experiments()]


def search_runs(experiment: str, uri: str | None = None, max_results: int = 1000) -> list[str]:
    """Run ids of `experiment`, newest first; [] when the experiment does not exist."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=max_results)
    return [r.info.run_id for r in runs]


def match_run_ids(run_id: str, uri: str | None = None) -> list[str]:
    """Full ids of the runs whose id is `run_id` or starts with it (the short ids `tlt compare` prints)."""
    client = _client(uri)
    try:
        return [client.get_run(run_id).info.run_id]
    except MlflowException:
        pass  # not a full id: try it as a prefix
    exp_ids = [e.experiment_id for e in client.search_experiments()]
    if not exp_ids or not run_id:
        return []
    return [r.info.run_id for r in client.search_runs(exp_ids, max_results=50000) if r.info.run_id.startswith(run_id)]


def find_run(tag: str, value: str, experiment: str, uri: str | None = None) -> str | None:
    """The newest run of `experiment` whose tag `tag` equals `value` (a retried flow run finds its run)."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None or not value:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{tag}` = '{value}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def download(source: str, dst: str | Path, uri: str | None = None) -> Path:
    """Copy a registered model version's artifacts (its `source` URI) to a local folder."""
    keep_env_uri(lambda: mlflow.set_tracking_uri(default_tracking_uri(uri)))
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst)))


def run_link(run_id: str, uri: str | None = None) -> str | None:
    """The run's page in MLflow's UI, in its model-training view: on the tracking server when the
    store is one, else where `tlt ui` serves the local store. None while the store is unreachable."""
    resolved = default_tracking_uri(uri)
    base = resolved.rstrip("/") if resolved.startswith(("http://", "https://")) else UI_DEFAULT
    try:
        experiment_id = _client(uri).get_run(run_id).info.experiment_id
    except Exception as err:  # noqa: BLE001 - an outage only costs the link
        if not is_transient(err):
            raise
        return None
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"
