"""`MlflowTracker`: the writing side, one MLflow run through an explicit `MlflowClient` and run id
(MLflow's "active run" is thread-local, and Prefect runs tasks in threads)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.data.dataset_source_registry import get_dataset_source_from_json
from mlflow.entities import DatasetInput, InputTag
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient

from tlt.spool import Spool
from tlt.tracking.base import (NullTracker, default_artifact_location, default_spool_dir, default_tracking_uri,
                               keep_env_uri, unsent_message)
from tlt.tracking.sender import SpoolSender, log
from tlt.tracking.transient import is_transient

EXPERIMENT_KIND = "mlflow.experimentKind"  # read by MLflow 3's UI; "genai_development" is the other kind
TRAINING_KIND = "custom_model_development"


def open_client(uri: str | None) -> tuple[str, MlflowClient]:
    """The resolved URI and a client for it; on a server, MLflow's HTTP retries (minutes by default)
    are cut to one short attempt: an outage is handled by the spool, not by blocking."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = default_tracking_uri(uri)
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    keep_env_uri(lambda: mlflow.set_tracking_uri(uri))  # the default of MLflow's own clients (system metrics)
    return uri, MlflowClient(uri)


def open_experiment(client: MlflowClient, name: str) -> str:
    """The id of experiment `name`, created if needed, tagged as a model-training experiment (the
    tag MLflow's UI sets when a user picks the kind; MLflow 3.17's UI itself picks its view from
    its own switch or the URL, see `readers.run_link`); a kind already chosen is kept."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, artifact_location=default_artifact_location(name),
                                        tags={EXPERIMENT_KIND: TRAINING_KIND})
    if EXPERIMENT_KIND not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, TRAINING_KIND)
    return exp.experiment_id


def dataset_source(source: str):
    """A local path as MLflow's `local` dataset source; URIs with a scheme stay as they are. MLflow
    resolves a raw path string against every registered source, matches its two registrations of
    local files (the '' and 'file' schemes) and warns "can be interpreted in multiple ways" on
    every run; naming the source type leaves nothing to guess."""
    if "://" in source:
        return source
    return get_dataset_source_from_json(json.dumps({"uri": Path(source).resolve().as_uri()}), source_type="local")


class MlflowTracker(SpoolSender, NullTracker):
    """One MLflow run. Pass `run_id` to continue an existing run (resume).

    Outages: when the store cannot be reached (a connection error, a timeout, a 5xx answer; any
    other error raises), metric batches, params, tags, artifacts, logged models and the final
    status are appended in order to a JSONL spool (`<spool_dir>/<run_id>.jsonl`, default
    mlflow/spool/ or $TLT_MLFLOW_SPOOL_DIR; artifacts are copied next to it) and sent, oldest
    first, by the next call that reaches the store, by `end()` (which retries for up to
    `flush_timeout_s`), by the next tracker opened on the same run, or by `tlt tracking sync`. Log
    calls never raise for an outage and block for at most one short HTTP attempt per
    `OFFLINE_RETRY_S`. A resumed tracker skips the (metric, step) pairs the run already holds, so a
    step that is run again after a crash is logged once.
    """

    def __init__(self, experiment: str = "tlt", run_name: str | None = None, uri: str | None = None,
                 tags: dict[str, str] | None = None, run_id: str | None = None, system_metrics: bool = False,
                 spool_dir: str | Path | None = None, flush_timeout_s: float = 0.0):
        uri, client = open_client(uri)
        exp_id = open_experiment(client, experiment)
        resumed = run_id is not None
        if run_id is None:
            run_id = client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        super().__init__(client, run_id, Spool(default_spool_dir(spool_dir), run_id), uri)
        self.flush_timeout_s = flush_timeout_s
        self._logged: set[tuple[str, int]] = set()
        if resumed:
            self._flush()  # what an earlier process of this run could not send (its final status too)
            self.client.update_run(run_id, status="RUNNING")
            self._logged = self._logged_pairs()
        self._monitor = None
        if system_metrics:
            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=5, samples_before_logging=1)
            self._monitor.start()

    def _logged_pairs(self) -> set[tuple[str, int]]:
        """(key, step) of every metric value the run already holds (empty for a new run)."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {(m.key, m.step) for k in keys for m in self.client.get_metric_history(self.run_id, k)}

    def _send_artifact(self, online, name: str, path: str | None, write) -> None:
        """`online()` logs the artifact; during an outage `write(dst)` puts a copy next to the spool
        (`<spool_dir>/<run_id>/<n>/<name>`), logged under `path` once the store is back."""
        if self._online(online):
            return
        stage = self._spool.stage(name)
        write(stage)
        self._spool_append("artifact", {"local": str(stage), "path": path})

    def _send_file(self, path: str, online, write) -> None:
        p = Path(path)
        self._send_artifact(online, p.name, str(p.parent) if str(p.parent) != "." else None, write)

    # -- the Tracker interface ----------------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._send("params", {"items": items[i:i + 100]})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
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
        df = pd.DataFrame(rows)
        self._send_file(path, lambda: self.client.log_table(self.run_id, df, path),
                        lambda dst: dst.write_text(df.to_json(orient="split", index=False)))

    def log_artifacts(self, local_dir: str | Path, path: str | None = None) -> None:
        self._send_artifact(lambda: self.client.log_artifacts(self.run_id, str(local_dir), path),
                            Path(local_dir).name, path, lambda dst: shutil.copytree(local_dir, dst))

    def log_dataset(self, df: Any, name: str, digest: str, source: str, context: str = "train",
                    tags: dict[str, str] | None = None) -> None:
        """A DataFrame as an MLflow dataset input of the run (`mlflow.data`: name, digest, schema,
        profile, source), with `mlflow.data.context` = context and extra tags. Best effort: a store
        outage logs a warning instead (the dataset is a record, not a result)."""
        try:
            ds = mlflow.data.from_pandas(df, source=dataset_source(source), name=name, digest=digest)
            itags = [InputTag("mlflow.data.context", context)] + [InputTag(k, str(v)) for k, v in (tags or {}).items()]
            self.client.log_inputs(self.run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags=itags)])
        except Exception as err:  # noqa: BLE001 - see docstring
            if not is_transient(err):
                raise
            log.warning("could not log dataset %s to MLflow: %s", name, err)

    def log_model(self, local_dir: str | Path, name: str, register_as: str | None = None,
                  tags: dict[str, str] | None = None, step: int = 0) -> str | None:
        """The folder as a logged model `name` of this run (MLflow's "Logged models", output of the
        run at `step`), registered as a new version of `register_as` when given; returns the version.

        During an outage the folder is copied next to the spool and the call spooled (sent, in
        order, once the store is back) and None is returned: the caller cannot promote a version
        it does not know yet, but nothing is lost."""
        payload = {"local": str(local_dir), "name": name, "register_as": register_as, "tags": tags or {}, "step": step}
        version: list[str | None] = []
        if self._online(lambda: version.append(self._log_model(payload))):
            return version[0]
        stage = self._spool.stage(Path(local_dir).name)
        shutil.copytree(local_dir, stage)
        self._spool_append("model", {**payload, "local": str(stage)})
        log.warning("MLflow store %s unreachable: the model '%s'%s is spooled and logged when the store is back",
                    self.uri, name, f" (to be registered as '{register_as}')" if register_as else "")
        return None

    def end(self, status: str = "FINISHED") -> bool:
        """Stop system metrics, send what is spooled and the final status, retrying with backoff for
        up to `flush_timeout_s` while the store is down. False (and a warning naming the spool and
        `tlt tracking sync`) when calls are still unsent after that."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
        self._offline_until = 0.0  # one more try, whatever happened in the last seconds
        self._send("terminate", {"status": status})
        if self.drain(self.flush_timeout_s):
            return True
        log.warning(unsent_message(self.run_id, self.uri, self.spool, self.unsent()))
        return False


def make_tracker(cfg, run_name: str | None = None, tags: dict[str, str] | None = None,
                 run_id: str | None = None) -> MlflowTracker:
    """A tracker for `cfg.tracking` (a TrackingConfig)."""
    return MlflowTracker(cfg.experiment, run_name=run_name, uri=cfg.tracking_uri, tags=tags, run_id=run_id,
                         system_metrics=cfg.system_metrics, flush_timeout_s=cfg.flush_timeout_s)
