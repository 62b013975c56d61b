"""Which tracker errors are an outage (spooled, sent later) and which are bugs (raised at once)."""
from __future__ import annotations

import errno
import socket

import pytest
import requests
import urllib3
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (INTERNAL_ERROR, INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST,
                                          TEMPORARILY_UNAVAILABLE)
from mlflow.tracking import MlflowClient

from tlt.services import free_port
from tlt.tracking import MlflowTracker, is_transient


def _http_error(status: int) -> requests.HTTPError:
    resp = requests.Response()
    resp.status_code = status
    return requests.HTTPError(f"{status}", response=resp)


@pytest.mark.parametrize("err", [
    requests.exceptions.ConnectionError("refused"), requests.exceptions.Timeout("slow"),
    urllib3.exceptions.MaxRetryError(None, "/api", "refused"), ConnectionRefusedError(), TimeoutError(),
    socket.gaierror(-2, "Name or service not known"), OSError(errno.ECONNRESET, "reset"),
    MlflowException("API request failed with exception ... Connection refused", error_code=INTERNAL_ERROR),
    MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE), _http_error(503)], ids=repr)
def test_outages_are_transient(err):
    assert is_transient(err)


@pytest.mark.parametrize("err", [
    TypeError("unsupported operand"), ValueError("bad value"), KeyError("k"), AttributeError("x"),
    FileNotFoundError(errno.ENOENT, "no such file"), PermissionError(errno.EACCES, "denied"),
    MlflowException("no run", error_code=RESOURCE_DOES_NOT_EXIST),
    MlflowException("bad name", error_code=INVALID_PARAMETER_VALUE), _http_error(404)], ids=repr)
def test_bugs_are_not_transient(err):
    assert not is_transient(err)


@pytest.mark.slow  # starts an MLflow server
def test_a_type_error_in_a_log_call_raises(mlflow_uri, tmp_path, monkeypatch):
    tracker = MlflowTracker("errors", uri=mlflow_uri, spool_dir=tmp_path / "spool")

    def broken(*args, **kwargs):
        raise TypeError("log_batch() got an unexpected keyword argument")

    monkeypatch.setattr(tracker.client, "log_batch", broken)
    with pytest.raises(TypeError, match="unexpected keyword"):
        tracker.log_metrics({"loss": 1.0}, step=1)
    with pytest.raises(TypeError):
        tracker.set_tags({"a": "b"})
    assert not tracker.spool.exists()  # nothing was hidden in the spool


@pytest.mark.slow  # starts an MLflow server
def test_a_stopped_server_spools(mlflow_uri, tmp_path, monkeypatch):
    """The store's address answers nothing (a server that was stopped): MLflow's real client error
    counts as an outage, the calls are spooled, `end()` reports them unsent; a sync sends them."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MlflowTracker("errors", uri=mlflow_uri, spool_dir=tmp_path / "spool")
    tracker.log_metrics({"loss": 1.0}, step=1)
    store = tracker.client
    tracker.client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    tracker.log_metrics({"loss": 2.0}, step=2)
    tracker.set_tags({"during": "outage"})
    assert [e["kind"] for e in tracker._spool.entries()] == ["metrics", "tags"]
    assert tracker.end() is False and tracker.unsent() == 3  # + the final status
    assert MlflowClient(mlflow_uri).get_run(tracker.run_id).info.status == "RUNNING"

    from tlt.tracking import sync_all

    [res] = sync_all(mlflow_uri, spool_dir=tmp_path / "spool")
    assert (res.run_id, res.sent, res.left) == (tracker.run_id, 3, 0) and not tracker.spool.exists()
    run = store.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["during"] == "outage"
    assert [(m.step, m.value) for m in store.get_metric_history(tracker.run_id, "loss")] == [(1, 1.0), (2, 2.0)]


@pytest.mark.slow  # starts an MLflow server
def test_end_retries_until_flush_timeout(mlflow_uri, tmp_path, monkeypatch):
    """`end()` keeps trying for `flush_timeout_s` (with backoff), then gives up."""
    import time

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MlflowTracker("errors", uri=mlflow_uri, spool_dir=tmp_path / "spool", flush_timeout_s=2.5)
    tracker.client = MlflowClient(f"http://127.0.0.1:{free_port()}")
    attempts = []
    flush = tracker._flush
    monkeypatch.setattr(tracker, "_flush", lambda: attempts.append(1) or flush())
    t0 = time.monotonic()
    assert tracker.end() is False
    took = time.monotonic() - t0
    assert 2.5 <= took < 10 and len(attempts) >= 3, (took, len(attempts))  # tries at 0, 1, 3 s (deadline 2.5)


@pytest.mark.slow  # starts an MLflow server
def test_sync_command_and_the_quiet_sync_of_tlt_run(mlflow_uri, tmp_path, monkeypatch, capsys):
    """`tlt tracking sync` exits 3 while the store is down (the spool kept), 0 once it is sent; the
    quiet sync that `tlt run` starts with says nothing when no spool is pending."""
    from typer.testing import CliRunner

    from tlt import cli
    from tlt.spool import Spool

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("TLT_MLFLOW_SPOOL_DIR", str(tmp_path / "spool"))
    tracker = MlflowTracker("errors", uri=mlflow_uri)
    Spool(tmp_path / "spool", tracker.run_id).append("terminate", {"status": "FINISHED"})
    runner = CliRunner()
    down = runner.invoke(cli.app, ["tracking", "sync", "--uri", f"http://127.0.0.1:{free_port()}"])
    assert down.exit_code == 3 and "sent 0 call(s), 1 left (store unreachable)" in down.output, down.output
    up = runner.invoke(cli.app, ["tracking", "sync", "--uri", mlflow_uri])
    assert up.exit_code == 0 and "every spooled call is sent" in up.output, up.output
    assert MlflowClient(mlflow_uri).get_run(tracker.run_id).info.status == "FINISHED"
    capsys.readouterr()
    cli._sync_quietly(mlflow_uri)
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # starts an MLflow server
def test_a_tracker_does_not_export_its_uri(tmp_path, monkeypatch):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI, which would win over every URI configured
    later in the process (the next test's store): the tracker keeps the environment as it was."""
    import os

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    MlflowTracker("errors", uri=f"sqlite:///{tmp_path / 'a.db'}", spool_dir=tmp_path / "spool").end()
    assert "MLFLOW_TRACKING_URI" not in os.environ
