"""The exported drafter as MLflow sees it: a logged model of the run that trained it (the run's
"Logged models"), registered as a version of a registered model, and the `champion` alias that
scheduled retraining starts from and promotes to."""
from __future__ import annotations

import json
from pathlib import Path

from mlflow.entities import LoggedModelOutput
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from tlt.tracking.base import default_tracking_uri
from tlt.tracking.transient import is_transient

MODEL_TYPE = "eagle3-drafter"


def log_model(client: MlflowClient, run_id: str, local_dir: str | Path, name: str, tags: dict[str, str],
              step: int = 0) -> str:
    """`local_dir` as a logged model `name` of run `run_id` (source run and output at `step`,
    status READY once its files are up); returns the model id. An outage raises."""
    exp_id = client.get_run(run_id).info.experiment_id
    model = client.create_logged_model(exp_id, name=name, source_run_id=run_id, tags=tags, model_type=MODEL_TYPE)
    client.log_model_artifacts(model.model_id, str(local_dir))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    return model.model_id


def register_version(client: MlflowClient, run_id: str, name: str, source: str, tags: dict[str, str],
                     model_id: str | None = None) -> str:
    """A new version of registered model `name` (created if needed); returns the version. Its
    source is the logged model `model_id` (`models:/<model_id>`, and the logged model lists the
    version) or else `source`, an artifact URI of run `run_id`. An outage raises (the caller
    spools the call)."""
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if is_transient(err):
            raise
        # otherwise: already registered
    if model_id is None:
        return str(client.create_model_version(name, source, run_id=run_id, tags=tags).version)
    version = str(client.create_model_version(name, f"models:/{model_id}", run_id=run_id, tags=tags,
                                              model_id=model_id).version)
    listed = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(
        listed + [{"name": name, "version": version}])})
    return version


def champion(name: str, uri: str | None = None, alias: str = "champion") -> dict | None:
    """The version behind `alias` of registered model `name`: {version, source, tags}; None if unset."""
    client = MlflowClient(default_tracking_uri(uri))
    try:
        mv = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return {"version": mv.version, "source": mv.source, "tags": dict(mv.tags), "run_id": mv.run_id}


def set_champion(name: str, version: str, uri: str | None = None, alias: str = "champion") -> None:
    MlflowClient(default_tracking_uri(uri)).set_registered_model_alias(name, alias, version)
