"""MLflow outage: a real `mlflow server` stopped in the middle of a run and started again.

Log calls during the outage must neither raise nor block for long; what they carried is spooled
to disk and sent in order once the server is back; reading the run back, every (key, step) is
there exactly once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tlt.services import free_port
from tlt.tracking import MlflowTracker
from tlt.tracking.sender import OFFLINE_RETRY_S

pytestmark = pytest.mark.slow
KEYS = ("reward/mean", "policy/loss", "timing_s/step")


def _start(tmp: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp / 'db'}",
                             "--default-artifact-root", str(tmp / "art")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    _stop(proc)
    raise RuntimeError("mlflow server did not start")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    port = free_port()
    procs = [_start(tmp_path, port)]
    yield port, procs, lambda: procs.append(_start(tmp_path, port))
    for p in procs:
        _stop(p)


def _log_step(tracker: MlflowTracker, step: int) -> None:
    tracker.log_metrics({k: step * 0.5 + i for i, k in enumerate(KEYS)}, step=step)


def _count_calls(obj, name: str) -> list[int]:
    """Wrap obj.name so that each call is counted (in the returned one-element list)."""
    count, inner = [0], getattr(obj, name)

    def counted(*a, **kw):
        count[0] += 1
        return inner(*a, **kw)
    setattr(obj, name, counted)
    return count


def test_outage_spools_and_flushes_in_order(server, tmp_path):
    from mlflow.tracking import MlflowClient

    port, procs, restart = server
    uri, spool = f"http://127.0.0.1:{port}", tmp_path / "spool"
    tracker = MlflowTracker("outage", run_name="outage", uri=uri, spool_dir=spool)
    other = MlflowTracker("outage", run_name="ends-during-outage", uri=uri, spool_dir=spool)
    tracker.log_params({"a": 1})
    for step in range(1, 6):
        _log_step(tracker, step)
    _log_step(other, 1)
    assert not spool.exists()

    _stop(procs[0])  # outage: the whole server process group goes away
    attempts = _count_calls(tracker.client, "log_batch")
    t0 = time.monotonic()
    for step in range(6, 16):
        _log_step(tracker, step)
    windows = 1 + int((time.monotonic() - t0) // OFFLINE_RETRY_S)
    # Non-blocking by construction: after the first failed call the tracker spools without touching
    # the network for OFFLINE_RETRY_S, so 10 calls reach the dead store once per window, not 10 times.
    assert 1 <= attempts[0] <= windows, (attempts[0], windows)
    tracker.set_tags({"during": "outage"})
    tracker.log_text("written while the store was down", "notes/outage.txt")
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    assert tracker.log_model(export, "drafter", register_as="outage-model", tags={"k": "v"}) is None  # spooled
    assert len(tracker.spool.read_text().splitlines()) == 13  # 10 metric batches, tags, text, model
    _log_step(other, 2)
    other.end("FAILED")  # neither raises nor loses the status: it stays in the spool
    assert other.spool.exists()

    restart()
    tracker._offline_until = 0.0  # don't wait out OFFLINE_RETRY_S in a test
    for step in range(16, 21):  # the first of these sends the spool, in order, then itself
        _log_step(tracker, step)
    assert not tracker.spool.exists()
    tracker.end()

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["during"] == "outage" and run.data.params["a"] == "1"
    assert "notes" in [f.path for f in client.list_artifacts(tracker.run_id)]
    versions = client.search_model_versions("name='outage-model'")
    assert len(versions) == 1 and versions[0].run_id == tracker.run_id and versions[0].tags == {"k": "v"}
    model = client.get_logged_model(versions[0].source.removeprefix("models:/"))  # the run's logged model
    assert model.source_run_id == tracker.run_id and model.name == "drafter" and str(model.status) == "READY"
    for i, key in enumerate(KEYS):
        hist = client.get_metric_history(tracker.run_id, key)
        assert sorted(m.step for m in hist) == list(range(1, 21)), key  # none lost, none twice
        assert all(m.value == m.step * 0.5 + i for m in hist)
    # spooled points keep the time they were logged at: the timeline is in step order
    ts = [m.timestamp for m in sorted(client.get_metric_history(tracker.run_id, KEYS[0]), key=lambda m: m.step)]
    assert ts == sorted(ts)

    # the run that ended during the outage: the next tracker on it sends its spool (status too)
    assert client.get_run(other.run_id).info.status == "RUNNING"
    again = MlflowTracker("outage", uri=uri, run_id=other.run_id, spool_dir=spool)
    assert not again.spool.exists()
    _log_step(again, 2)  # a step the run already holds (a resumed step): not logged twice
    _log_step(again, 3)
    again.end()
    assert sorted(m.step for m in client.get_metric_history(other.run_id, KEYS[0])) == [1, 2, 3]
    assert client.get_run(other.run_id).info.status == "FINISHED"


def test_outage_over_the_end_of_a_run(server, tmp_path, prefect_api):
    """`tlt run conf/smoke.yaml` against a real server stopped after RL step 1 and still down when the
    run ends: `end()` retries for `tracking.flush_timeout_s`, then the run exits 3 naming the spool
    and `tlt tracking sync`; with the server back, `tlt tracking sync` sends every call in order and
    the run is FINISHED with all its metrics and its drafter registration."""
    from cli_runs import ROOT, TLT, cli_env, kill_group, prefect_api_url, run_tlt
    from mlflow.tracking import MlflowClient

    port, procs, restart = server
    uri = f"http://127.0.0.1:{port}"
    env = cli_env(tmp_path, prefect_api_url(), MLFLOW_TRACKING_URI=uri)
    args = ["run", "conf/smoke.yaml", "--set", "tracking.flush_timeout_s=3", "--set", "drafter.where=sequential",
            "--set", "rollout.tuner=false", "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}"]
    proc = subprocess.Popen([TLT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:  # stop the server once RL step 1 (task rl-step-1) is logged
            lines.append(line)
            if "rl-step-1" in line and "Finished in state" in line:
                _stop(procs[0])
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=600)
    finally:
        kill_group(proc.pid)
        proc.wait()
    out = "".join(lines)
    (tmp_path / "run.log").write_text(out)
    assert proc.returncode == 3, out[-3000:]
    assert "held-out accuracy" in out and "tlt tracking sync" in out, out[-3000:]
    spools = list((tmp_path / "spool").glob("*.jsonl"))
    assert len(spools) == 1 and str(spools[0]) in out.replace("\n", "")
    run_id = spools[0].stem

    restart()
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # the end fell in the outage
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward/mean")) == [1]
    sync = run_tlt(["tracking", "sync", "--uri", uri], env, timeout=120)
    assert sync.returncode == 0, sync.stdout
    assert f"run {run_id}: sent" in sync.stdout and "0 left" in sync.stdout and "every spooled call is sent" in sync.stdout
    assert not spools[0].exists()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("reward/mean", "policy/loss", "timing_s/step"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2], key
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/accuracy")) == [0, 1, 2]
    versions = client.search_model_versions("name='tlt-model'")
    assert [v.run_id for v in versions] == [run_id]  # the registration spooled at the end, sent by sync
    again = run_tlt(["tracking", "sync", "--uri", uri], env, timeout=120)
    assert again.returncode == 0 and "nothing to send" in again.stdout
