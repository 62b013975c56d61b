"""Real local services for tests: a Prefect server and an MLflow server on free 127.0.0.1 ports,
each with its state in a temporary folder, started with the command lines of `tlt ui`
(tlt.services) and stopped with their whole process group."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tlt.services import free_port, start_mlflow, start_prefect, stop, wait_http

HOST = "127.0.0.1"


def _tail(path: Path, n: int = 2000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _launch(start: Callable, port: int, env: dict[str, str], cwd: Path, log):
    """`start(HOST, port, log)` (a tlt.services starter, which inherits this process's environment
    and working directory) with `env` and `cwd` in place for the launch only."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            if os.environ.get(key) != value:
                mp.setenv(key, value)
        mp.chdir(cwd)
        return start(HOST, port, log)


@contextlib.contextmanager
def prefect_server(tmp: Path, timeout: float = 180) -> Iterator[dict]:
    """A Prefect server (API + UI) with its own PREFECT_HOME under `tmp`. Yields `env` (the
    environment for clients and subprocesses: PREFECT_API_URL, PREFECT_HOME and a sqlite
    MLFLOW_TRACKING_URI under `tmp`), `api`, `url` (the UI), `port` and `proc`."""
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(tmp / "prefect"), PREFECT_API_URL=f"http://{HOST}:{port}/api",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log_path = tmp / "prefect-server.log"
    with open(log_path, "wb") as log:
        proc = _launch(start_prefect, port, env, tmp, log)
        try:
            assert wait_http(f"http://{HOST}:{port}/api/health", timeout), _tail(log_path)
            yield {"env": env, "api": env["PREFECT_API_URL"], "url": f"http://{HOST}:{port}", "port": port,
                   "proc": proc, "log": log_path}
        finally:
            stop(proc)


@contextlib.contextmanager
def mlflow_server(tmp: Path, timeout: float = 180) -> Iterator[dict]:
    """An MLflow tracking server + UI on a sqlite store under `tmp` (artifacts in tmp/mlflow/artifacts).
    Yields `url` (also the tracking URI for clients), `port` and `proc`."""
    port = free_port()
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow-ui.db'}", "MLFLOW_DISABLE_TELEMETRY": "true"}
    log_path = tmp / "mlflow-server.log"
    with open(log_path, "wb") as log:
        proc = _launch(start_mlflow, port, env, tmp, log)
        try:
            assert wait_http(f"http://{HOST}:{port}/health", timeout), _tail(log_path)
            yield {"url": f"http://{HOST}:{port}", "port": port, "proc": proc, "log": log_path}
        finally:
            stop(proc)


def live_pids(match: Callable[[int, str], bool]) -> list[int]:
    """Pids of running (not zombie) processes for which `match(pgid, cmdline)` holds."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _ppid, pgid = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z" and match(int(pgid), cmdline):
            pids.append(int(entry.name))
    return pids


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((HOST, port)) == 0


def assert_stopped(proc, port: int, timeout: float = 15) -> None:
    """After `stop(proc)`: nothing of its process group runs any more and its port is closed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = live_pids(lambda pgid, _cmd: pgid == proc.pid)
        if not left and not port_open(port):
            return
        time.sleep(0.5)
    for pid in left:  # don't leave them to the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    raise AssertionError(f"still running after stop: pids {left} of group {proc.pid}; port {port} open: "
                         f"{port_open(port)}")
