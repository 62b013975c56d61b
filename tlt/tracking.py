"""The tracking seam: the only module of tlt that imports mlflow.

Everything logs through a `Tracker`. `MlflowTracker` talks to one run through an explicit
`MlflowClient` and run id (MLflow's "active run" is thread-local, and Prefect runs tasks in
threads). `NullTracker` is for library code and tests that don't track.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tlt.spool import Spool

DEFAULT_DIR = Path("mlflow")


def default_tracking_uri(configured: str | None = None) -> str:
    """`MLFLOW_TRACKING_URI` wins, then the config, then the embedded sqlite store under mlflow/."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if configured:
        return configured
    DEFAULT_DIR.mkdir(exist_ok=True)
    return f"sqlite:///{DEFAULT_DIR.resolve() / 'mlflow.db'}"


def default_artifact_location(experiment: str) -> str | None:
    """Artifacts of the embedded store live next to it, in mlflow/artifacts/<experiment>."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (DEFAULT_DIR.resolve() / "artifacts" / experiment).as_uri()


class NullTracker:
    """Accepts everything, stores nothing."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_text(self, text: str, path: str) -> None: ...
    def log_dict(self, data: Any, path: str) -> None: ...
    def log_figure(self, fig: Any, path: str) -> None: ...
    def log_table(self, rows: list[dict], path: str) -> None: ...
    def log_artifacts(self, local_dir: str | Path, path: str | None = None) -> None: ...
    def log_dataset(self, df: Any, name: str, digest: str, source: str, context: str = "train",
                    tags: dict[str, str] | None = None) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...


# Error codes of an unreachable or overloaded store: the call is spooled and sent later. Any other
# MlflowException (a bad name, a deleted run) is a bug of the caller and raises as before.
_TRANSIENT_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "ENDPOINT_NOT_FOUND"}
OFFLINE_RETRY_S = 10.0  # after a failed call, spool without touching the network for this long


def _transient(err: Exception) -> bool:
    from mlflow.exceptions import MlflowException

    return not isinstance(err, MlflowException) or err.error_code in _TRANSIENT_CODES


class MlflowTracker(NullTracker):
    """One MLflow run. Pass `run_id` to continue an existing run (resume).

    Outages: when the store cannot be reached, metric batches, params, tags, artifacts and the
    final status are appended in order to a JSONL spool (`<spool_dir>/<run_id>.jsonl`, default
    mlflow/spool/ or $TLT_MLFLOW_SPOOL_DIR; artifacts are copied next to it) and sent, oldest
    first, by the next call that reaches the store, by `end()`, or by the next tracker opened on
    the same run. Log calls never raise for an outage and block for at most one short HTTP attempt
    per `OFFLINE_RETRY_S`. A resumed tracker skips the (metric, step) pairs the run already holds,
    so a step that is run again after a crash is logged once.
    """

    def __init__(self, experiment: str = "tlt", run_name: str | None = None, uri: str | None = None,
                 tags: dict[str, str] | None = None, run_id: str | None = None, system_metrics: bool = False,
                 spool_dir: str | Path | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.uri = default_tracking_uri(uri)
        if self.uri.startswith(("http://", "https://")):  # MLflow's defaults retry for minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=default_artifact_location(experiment))
        resumed = run_id is not None
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        self.run_id = run_id
        root = Path(spool_dir or os.environ.get("TLT_MLFLOW_SPOOL_DIR") or DEFAULT_DIR / "spool").resolve()
        self._spool = Spool(root, run_id)
        self._offline_until = 0.0
        self._logged: set[tuple[str, int]] = set()
        if resumed:
            self._flush()  # what an earlier process of this run could not send (its final status too)
            self.client.update_run(run_id, status="RUNNING")
            self._logged = self._logged_pairs()
        self._monitor = None
        if system_metrics:
            self._start_system_metrics()

    @property
    def spool(self) -> Path:
        """The run's spool file (exists only while something is unsent)."""
        return self._spool.path

    def _start_system_metrics(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=5, samples_before_logging=1)
        self._monitor.start()

    def _logged_pairs(self) -> set[tuple[str, int]]:
        """(key, step) of every metric value the run already holds (empty for a new run)."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {(m.key, m.step) for k in keys for m in self.client.get_metric_history(self.run_id, k)}

    # -- sending, with the spool as the fallback -------------------------------------------------
    def _apply(self, kind: str, p: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag

        if kind == "metrics":
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, st) for k, v, ts, st in p["items"]])
        elif kind == "params":
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in p["items"]])
        elif kind == "tags":
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in p["items"]])
        elif kind == "artifact":
            if Path(p["local"]).is_dir():
                self.client.log_artifacts(self.run_id, p["local"], p["path"])
            else:
                self.client.log_artifact(self.run_id, p["local"], p["path"])
        elif kind == "register":
            self._register_now(p["name"], p["artifact_path"], p["tags"])
        elif kind == "terminate":
            self.client.set_terminated(self.run_id, status=p["status"])

    def _went_offline(self, err: Exception) -> None:
        import logging
        import time

        self._offline_until = time.monotonic() + OFFLINE_RETRY_S
        logging.getLogger(__name__).warning("MLflow store %s unreachable (%s); spooling to %s",
                                            self.uri, (str(err).splitlines() or [""])[0][:200], self.spool)

    def _flush(self) -> bool:
        """Send the spool in order; True when it is empty afterwards."""
        import logging
        import time

        if not self._spool.exists():
            return True
        if time.monotonic() < self._offline_until:
            return False
        entries = self._spool.entries()
        for i, entry in enumerate(entries):
            try:
                self._apply(entry["kind"], entry)
            except Exception as err:  # noqa: BLE001 - transient: keep the rest; else drop this one
                if not _transient(err):
                    logging.getLogger(__name__).warning("dropping a spooled MLflow call: %s", err)
                    continue
                self._went_offline(err)
                self._spool.keep(entries[i:])
                return False
        self._spool.keep([])
        return True

    def _send(self, kind: str, payload: dict) -> None:
        """Send now (after anything spooled, to keep the order) or spool when the store is down."""
        if not self._flush():
            self._spool.append(kind, payload)
            return
        try:
            self._apply(kind, payload)
        except Exception as err:  # noqa: BLE001 - only transient errors are swallowed
            if not _transient(err):
                raise
            self._went_offline(err)
            self._spool.append(kind, payload)

    def _send_artifact(self, online, name: str, path: str | None, write) -> None:
        """`online()` logs the artifact; during an outage `write(dst)` puts a copy next to the spool
        (`<spool_dir>/<run_id>/<n>/<name>`), logged under `path` once the store is back."""
        if self._flush():
            try:
                online()
                return
            except Exception as err:  # noqa: BLE001 - only transient errors are swallowed
                if not _transient(err):
                    raise
                self._went_offline(err)
        stage = self._spool.stage(name)
        write(stage)
        self._spool.append("artifact", {"local": str(stage), "path": path})

    def _send_file(self, path: str, online, write) -> None:
        p = Path(path)
        self._send_artifact(online, p.name, str(p.parent) if str(p.parent) != "." else None, write)

    # -- the Tracker interface ----------------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._send("params", {"items": items[i:i + 100]})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        now, step = int(time.time() * 1000), step or 0
        items = [(k, float(v), now, step) for k, v in metrics.items() if v == v and (k, step) not in self._logged]
        for i in range(0, len(items), 500):
            self._send("metrics", {"items": items[i:i + 500]})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("tags", {"items": [(k, str(v)) for k, v in tags.items()]})

    def log_text(self, text: str, path: str) -> None:
        self._send_file(path, lambda: self.client.log_text(self.run_id, text, path), lambda dst: dst.write_text(text))

    def log_dict(self, data: Any, path: str) -> None:
        self.log_text(json.dumps(data, indent=2, default=str), path)

    def log_figure(self, fig: Any, path: str) -> None:
        self._send_file(path, lambda: self.client.log_figure(self.run_id, fig, path), lambda dst: fig.savefig(dst))

    def log_table(self, rows: list[dict], path: str) -> None:
        import pandas as pd

        df = pd.DataFrame(rows)
        self._send_file(path, lambda: self.client.log_table(self.run_id, df, path),
                        lambda dst: dst.write_text(df.to_json(orient="split", index=False)))

    def log_artifacts(self, local_dir: str | Path, path: str | None = None) -> None:
        import shutil

        self._send_artifact(lambda: self.client.log_artifacts(self.run_id, str(local_dir), path),
                            Path(local_dir).name, path, lambda dst: shutil.copytree(local_dir, dst))

    def log_dataset(self, df: Any, name: str, digest: str, source: str, context: str = "train",
                    tags: dict[str, str] | None = None) -> None:
        """A DataFrame as an MLflow dataset input of the run (`mlflow.data`: name, digest, schema,
        profile, source), with `mlflow.data.context` = context and extra tags. Best effort: a store
        outage logs a warning instead (the dataset is a record, not a result)."""
        import logging

        import mlflow
        from mlflow.entities import DatasetInput, InputTag

        try:
            ds = mlflow.data.from_pandas(df, source=source, name=name, digest=digest)
            itags = [InputTag("mlflow.data.context", context)] + [InputTag(k, str(v)) for k, v in (tags or {}).items()]
            self.client.log_inputs(self.run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags=itags)])
        except Exception as err:  # noqa: BLE001 - see docstring
            if not _transient(err):
                raise
            logging.getLogger(__name__).warning("could not log dataset %s to MLflow: %s", name, err)

    def artifact_uri(self, path: str = "") -> str:
        base = self.client.get_run(self.run_id).info.artifact_uri
        return f"{base}/{path}" if path else base

    def _register_now(self, name: str, artifact_path: str, tags: dict[str, str]) -> str:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if _transient(err):
                raise
            # otherwise: already registered
        mv = self.client.create_model_version(name, self.artifact_uri(artifact_path), run_id=self.run_id, tags=tags)
        return str(mv.version)

    def register(self, name: str, artifact_path: str, tags: dict[str, str] | None = None) -> str | None:
        """Register an artifact folder of this run as a version of model `name`; returns the version.

        During an outage the registration is spooled after the artifacts it points at (sent, in
        order, once the store is back) and None is returned: the caller cannot promote a version
        it does not know yet, but nothing is lost."""
        import logging

        payload = {"name": name, "artifact_path": artifact_path, "tags": tags or {}}
        if self._flush():
            try:
                return self._register_now(name, artifact_path, tags or {})
            except Exception as err:  # noqa: BLE001 - only transient errors are swallowed
                if not _transient(err):
                    raise
                self._went_offline(err)
        self._spool.append("register", payload)
        logging.getLogger(__name__).warning("MLflow store %s unreachable: the registration of model '%s' is spooled "
                                            "and happens when the store is back", self.uri, name)
        return None

    def end(self, status: str = "FINISHED") -> None:
        """Stop system metrics, send what is spooled, set the final status (spooled too when the
        store is down: the next tracker opened on this run sends it)."""
        import logging

        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        self._offline_until = 0.0  # one more try, whatever happened in the last seconds
        self._send("terminate", {"status": status})
        if self.spool.exists():
            logging.getLogger(__name__).warning("MLflow store %s still unreachable: %s keeps the unsent calls; "
                                                "they are sent when a tracker reopens run %s", self.uri,
                                                self.spool, self.run_id)


def make_tracker(cfg, run_name: str | None = None, tags: dict[str, str] | None = None,
                 run_id: str | None = None) -> MlflowTracker:
    """A tracker for `cfg.tracking` (a TrackingConfig)."""
    return MlflowTracker(cfg.experiment, run_name=run_name, uri=cfg.tracking_uri, tags=tags, run_id=run_id,
                         system_metrics=cfg.system_metrics)


def read_run(run_id: str, uri: str | None = None) -> dict[str, Any]:
    """Params, latest metrics, tags and artifact paths of a run (for compare and tests)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    run = client.get_run(run_id)
    return {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags,
            "status": run.info.status, "name": run.info.run_name,
            "artifacts": [f.path for f in client.list_artifacts(run_id)]}


def metric_history(run_id: str, key: str, uri: str | None = None) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


# --- read side for `tlt compare` -------------------------------------------------------------

def list_experiments(uri: str | None = None) -> list[str]:
    """Names of the active experiments of the store (for "did you mean" messages)."""
    from mlflow.tracking import MlflowClient

    return [e.name for e in MlflowClient(default_tracking_uri(uri)).search_experiments()]


def search_runs(experiment: str, uri: str | None = None, max_results: int = 1000) -> list[str]:
    """Run ids of `experiment`, newest first; [] when the experiment does not exist."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=max_results)
    return [r.info.run_id for r in runs]


def match_run_ids(run_id: str, uri: str | None = None) -> list[str]:
    """Full ids of the runs whose id is `run_id` or starts with it (the short ids `tlt compare` prints)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    try:
        return [client.get_run(run_id).info.run_id]
    except MlflowException:
        pass  # not a full id: try it as a prefix
    exp_ids = [e.experiment_id for e in client.search_experiments()]
    if not exp_ids or not run_id:
        return []
    return [r.info.run_id for r in client.search_runs(exp_ids, max_results=50000) if r.info.run_id.startswith(run_id)]


def metric_histories(run_id: str, keys: list[str], uri: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} sorted by step, one value per step (the latest logged wins, e.g.
    after a resume re-logs a step); a key never logged maps to []."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    out = {}
    for key in keys:
        latest = {}
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            latest[m.step] = m.value
        out[key] = sorted(latest.items())
    return out


# ---- model registry: champion alias for scheduled retraining -----------------------------------
def champion(name: str, uri: str | None = None, alias: str = "champion") -> dict | None:
    """The version behind `alias` of registered model `name`: {version, source, tags}; None if unset."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    try:
        mv = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return {"version": mv.version, "source": mv.source, "tags": dict(mv.tags), "run_id": mv.run_id}


def set_champion(name: str, version: str, uri: str | None = None, alias: str = "champion") -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(default_tracking_uri(uri)).set_registered_model_alias(name, alias, version)


def download(source: str, dst: str | Path, uri: str | None = None) -> Path:
    """Copy a registered model version's artifacts (its `source` URI) to a local folder."""
    import mlflow

    mlflow.set_tracking_uri(default_tracking_uri(uri))
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(dst)))


def find_run(tag: str, value: str, experiment: str, uri: str | None = None) -> str | None:
    """The newest run of `experiment` whose tag `tag` equals `value` (a retried flow run finds its run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(uri))
    exp = client.get_experiment_by_name(experiment)
    if exp is None or not value:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{tag}` = '{value}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None
