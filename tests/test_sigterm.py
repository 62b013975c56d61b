"""`tlt run` stopped with SIGTERM (what a scheduler or `kill` sends) leaves nothing running: no
temporary Prefect server, no spot-trainer or rollout worker, and the MLflow run is not left RUNNING."""
import os
import signal
import subprocess
import time

import pytest

from _services import live_pids
from cli_runs import ROOT, TLT, cli_env, kill_group

pytestmark = pytest.mark.slow


def test_sigterm_stops_the_whole_run(tmp_path):
    env = cli_env(tmp_path)
    env.pop("PREFECT_API_URL", None)  # the flow starts Prefect's temporary server itself
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([TLT, "run", "conf/smoke.yaml", "--set", "rl.steps=50", "--set", "rollout.workers=2",
                             "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}", "--set", "export.enabled=false"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "rl-step-2" not in (tmp_path / "run.log").read_text():  # workers and spot trainer are up
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
        out = (tmp_path / "run.log").read_text()
        assert rc in (130, 143), out[-3000:]  # Prefect's SIGTERM bridge ends the flow as interrupted
        assert "Stopping temporary server" in out and "--resume" in out
        assert "attempt to run again" not in out, out[-3000:]  # an interrupted run is not retried
        time.sleep(2)
        left = live_pids(lambda pgid, _cmd: pgid == proc.pid)
        assert not left, [open(f"/proc/{p}/cmdline").read() for p in left]
    finally:
        kill_group(proc.pid)
        log.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("tlt").experiment_id])
    spooled = sorted(p.name for p in (tmp_path / "spool").glob("*")) if (tmp_path / "spool").exists() else []
    assert [r.info.status for r in runs] == ["FAILED"], (spooled, out[-4000:])
