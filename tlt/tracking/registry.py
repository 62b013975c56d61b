"""The model registry: versions of the exported drafter and the `champion` alias that scheduled
retraining starts from and promotes to."""
from __future__ import annotations

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tlt.tracking.base import default_tracking_uri
from tlt.tracking.transient import is_transient


def register_version(client: MlflowClient, run_id: str, name: str, source: str, tags: dict[str, str]) -> str:
    """A new version of registered model `name` (created if needed) from `source` (an artifact URI
    of run `run_id`); returns the version. An outage raises (the caller spools the registration)."""
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if is_transient(err):
            raise
        # otherwise: already registered
    return str(client.create_model_version(name, source, run_id=run_id, tags=tags).version)


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
