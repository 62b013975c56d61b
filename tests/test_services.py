"""tlt.services: helpers that need no server, and `tlt ui`'s servers stopping with it."""
import os
import signal
import socket
import subprocess

import pytest

from _services import live_pids, port_open
from cli_runs import TLT, cli_env
from tlt.services import free_port


def test_free_port_can_be_bound_on_localhost():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding it again succeeds


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_tlt_ui_stops_both_servers_on(sig, tmp_path):
    """`tlt ui` killed with SIGTERM (a supervisor, `kill`) or SIGINT (Ctrl-C) stops the Prefect and MLflow
    servers it started: they run in their own process groups, so the signal alone would leave them."""
    prefect_port, mlflow_port = free_port(), free_port()
    env = cli_env(tmp_path)
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([TLT, "ui", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    servers = lambda: live_pids(lambda _pgid, cmd: f"--port {prefect_port}" in cmd or f"--port {mlflow_port}" in cmd)
    try:
        lines = []
        for line in proc.stdout:  # "Ctrl-C stops both." follows the two readiness lines
            lines.append(line)
            if line.startswith("Ctrl-C stops both"):
                break
        assert "ready" in "".join(lines) and "NOT ready" not in "".join(lines), "".join(lines)
        assert servers() and port_open(prefect_port) and port_open(mlflow_port)
        os.kill(proc.pid, sig)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode in (0, 130), rest
        assert "stopped Prefect and MLflow" in rest
        assert not servers() and not port_open(prefect_port) and not port_open(mlflow_port)
    finally:
        for pid in servers():
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
