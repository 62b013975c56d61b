"""Sending one run's tracker calls, with the outage spool as the fallback: a call is sent after
everything spooled before it (order kept), or appended to the spool while the store is down."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from tlt.spool import Spool
from tlt.tracking.base import keep_env_uri
from tlt.tracking.registry import log_model, register_version
from tlt.tracking.transient import is_transient

log = logging.getLogger("tlt.tracking")
OFFLINE_RETRY_S = 10.0  # after a failed call, spool without touching the network for this long
MAX_BACKOFF_S = 15.0


class SpoolSender:
    """The sending half of a tracker, also used alone by `tlt tracking sync` (no run is opened)."""

    def __init__(self, client: MlflowClient, run_id: str, spool: Spool, uri: str):
        self.client, self.run_id, self._spool, self.uri = client, run_id, spool, uri
        self._offline_until = 0.0
        self._warned = False  # one warning per outage, not one per retry

    @property
    def spool(self) -> Path:
        """The run's spool file (exists only while something is unsent)."""
        return self._spool.path

    def artifact_uri(self, path: str = "") -> str:
        base = self.client.get_run(self.run_id).info.artifact_uri
        return f"{base}/{path}" if path else base

    def _apply(self, kind: str, p: dict) -> None:
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
        elif kind == "model":
            self._log_model(p)
        elif kind == "register":  # a spool written before the drafter became a logged model
            register_version(self.client, self.run_id, p["name"], self.artifact_uri(p["artifact_path"]), p["tags"])
        elif kind == "terminate":
            self.client.set_terminated(self.run_id, status=p["status"])

    def _log_model(self, p: dict) -> str | None:
        """Folder `p["local"]` as logged model `p["name"]` of the run, registered as a version of
        `p["register_as"]` when set; returns that version."""
        model_id = log_model(self.client, self.run_id, p["local"], p["name"], p["tags"], p["step"])
        if not p["register_as"]:
            return None
        # a sqlite registry looks the logged model up through MLflow's default URI: make it ours
        keep_env_uri(lambda: mlflow.set_tracking_uri(self.uri))
        return register_version(self.client, self.run_id, p["register_as"], "", p["tags"], model_id=model_id)

    def _went_offline(self, err: Exception) -> None:
        self._offline_until = time.monotonic() + OFFLINE_RETRY_S
        if self._warned:
            return
        self._warned = True
        log.warning("MLflow store %s unreachable (%s); spooling to %s",
                    self.uri, (str(err).splitlines() or [""])[0][:200], self.spool)

    def _spool_append(self, kind: str, payload: dict) -> None:
        with self._spool.locked():
            self._spool.append(kind, payload)

    def _flush(self) -> bool:
        """Send the spool in order; True when it is empty afterwards."""
        if not self._spool.exists():
            return True
        if time.monotonic() < self._offline_until:
            return False
        with self._spool.locked():  # another process may be sending or appending to it
            entries = self._spool.entries()
            for i, entry in enumerate(entries):
                try:
                    self._apply(entry["kind"], entry)
                except Exception as err:  # noqa: BLE001 - transient: keep the rest; else drop this one
                    if not is_transient(err):
                        log.warning("dropping a spooled MLflow call (%s): %r", entry["kind"], err)
                        continue
                    self._went_offline(err)
                    self._spool.keep(entries[i:])
                    return False
            self._spool.keep([])
        if self._warned:
            log.info("MLflow store %s reachable again: the spooled calls of run %s are sent", self.uri, self.run_id)
            self._warned = False
        return True

    def _online(self, call) -> bool:
        """Run `call()` now when the spool is empty and the store answers; False (nothing sent) when
        the store is down. Errors that are not an outage raise."""
        if not self._flush():
            return False
        try:
            call()
            return True
        except Exception as err:  # noqa: BLE001 - only transient errors are swallowed
            if not is_transient(err):
                raise
            self._went_offline(err)
            return False

    def _send(self, kind: str, payload: dict) -> None:
        """Send now (after anything spooled, to keep the order) or spool when the store is down."""
        if not self._online(lambda: self._apply(kind, payload)):
            self._spool_append(kind, payload)

    def drain(self, timeout_s: float) -> bool:
        """Send the spool, retrying with backoff (1, 2, 4 … ≤ 15 s) for up to `timeout_s` (0: one
        attempt); True when nothing is left unsent."""
        deadline, delay = time.monotonic() + timeout_s, 1.0
        while True:
            self._offline_until = 0.0  # try now, whatever happened in the last seconds
            if self._flush():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, MAX_BACKOFF_S)

    def unsent(self) -> int:
        """How many calls wait in the spool."""
        return len(self._spool.entries())
