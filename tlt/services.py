"""Local services for the UIs: the Prefect server and the MLflow UI, bound to 127.0.0.1."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tlt.tracking import default_tracking_uri


def env_defaults() -> None:
    """The CLI's environment: offline by default; Prefect and caches live in the project folder
    (variables already set win)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PREFECT_HOME", str(Path(".prefect").resolve()))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 90.0) -> bool:
    """Poll `url` until it answers 200 or the timeout passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def start_prefect(host: str, port: int, log) -> subprocess.Popen:
    return subprocess.Popen([_bin("prefect"), "server", "start", "--host", host, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_mlflow(host: str, port: int, log) -> subprocess.Popen:
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    artifacts = Path("mlflow/artifacts").resolve()
    return subprocess.Popen([_bin("mlflow"), "server", "--host", host, "--port", str(port), "--workers", "1",
                             "--backend-store-uri", default_tracking_uri(), "--default-artifact-root", artifacts.as_uri()],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Terminate a server and its children (own process group), then reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Stop(Exception):
    """SIGTERM or SIGHUP while `tlt ui` waits: leave the wait and stop both servers (their own process
    groups do not receive the signal the terminal or a supervisor sends to `tlt ui`)."""


def _stop_on_signals() -> dict:
    def handler(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def run_uis(host: str = "127.0.0.1", prefect_port: int = 4200, mlflow_port: int = 5000) -> None:
    """Start both UIs, print their URLs, and stop both on Ctrl-C (SIGINT), SIGTERM or SIGHUP."""
    Path(".cache").mkdir(exist_ok=True)
    log = open(".cache/ui.log", "ab")
    previous = _stop_on_signals()
    print(f"starting the Prefect server (:{prefect_port}) and the MLflow UI (:{mlflow_port}), ~10-20 s; "
          "their log: .cache/ui.log", flush=True)
    procs = [start_prefect(host, prefect_port, log), start_mlflow(host, mlflow_port, log)]
    try:
        ok_p = wait_http(f"http://{host}:{prefect_port}/api/health")
        ok_m = wait_http(f"http://{host}:{mlflow_port}/health")
        print(f"Prefect UI: http://{host}:{prefect_port}   {'ready' if ok_p else 'NOT ready, see .cache/ui.log'}")
        print(f"MLflow UI:  http://{host}:{mlflow_port}   {'ready' if ok_m else 'NOT ready, see .cache/ui.log'}")
        print(f"Point runs at this Prefect server with: export PREFECT_API_URL=http://{host}:{prefect_port}/api")
        print("Ctrl-C stops both.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        for sig, handler in previous.items():  # a second signal during the stop kills at once
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for p in procs:
            stop(p)
        log.close()
        print("stopped Prefect and MLflow", flush=True)
