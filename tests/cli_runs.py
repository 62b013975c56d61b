"""Helpers for tests that run the `tlt` CLI in a subprocess (crash/resume, bad inputs)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TLT = str(Path(sys.executable).with_name("tlt"))


def prefect_api_url() -> str:
    """The API URL of the session's Prefect test server (use inside the `prefect_api` fixture), so
    subprocess runs skip starting their own temporary server (~10-15 s each on 2 cores)."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def cli_env(tmp: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           "PREFECT_HOME": str(tmp / "prefect"), "TLT_MLFLOW_SPOOL_DIR": str(tmp / "spool"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("TLT_FAULT", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    return env


def kill_group(pgid: int) -> None:
    """SIGKILL every process of a process group (gone already: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tlt(args: list[str], env: dict[str, str], timeout: float = 300, log: Path | None = None
            ) -> subprocess.CompletedProcess:
    """`tlt ARGS` in its own process group; whatever it leaves behind (a spot-trainer worker, a
    temporary Prefect server) is killed with the group afterwards, as a crash of the machine would."""
    proc = subprocess.Popen([TLT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc.pid)
        proc.wait()
    if log is not None:
        log.write_text(out or "")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
