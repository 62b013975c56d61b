"""Soak: `tlt run` for many RL steps, RSS sampled at every step; then no leftovers.

    python bench/soak.py [conf/smoke.yaml] [--steps 100] [--set key=value ...] [--json out.json]
"""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

import psutil

import harness
from tlt.tracking import metric_history

STEP_DONE = re.compile(r"Task run 'rl-step-(\d+)' - Finished")


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of proc, RSS of proc + its descendants) in bytes; 0 for processes that just exited."""
    own = total = 0
    with suppress(psutil.Error):
        own = total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            with suppress(psutil.Error):
                total += child.memory_info().rss
    return own, total


class Watch:
    """Samples a process tree's RSS (peaks happen inside steps), the pids it ever had and the ports
    they listened on, while its output is read line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.ps = proc, psutil.Process(proc.pid)
        self.per_step: dict[int, tuple[int, int]] = {}
        self.peak, self.pids, self.ports, self.tail, self.run_id = (0, 0), {proc.pid}, set(), [], None
        self.done = threading.Event()

    def sample(self) -> None:
        while not self.done.is_set():
            self.peak = tuple(map(max, self.peak, tree_rss(self.ps)))
            with suppress(psutil.Error):
                self.pids.update(c.pid for c in self.ps.children(recursive=True))
                for pid in list(self.pids):
                    self.ports.update(c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
                                      if c.status == psutil.CONN_LISTEN)
            time.sleep(0.5)

    def run(self) -> int:
        """Read the output to its end; the exit code."""
        sampler = threading.Thread(target=self.sample, daemon=True)
        sampler.start()
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-40:]
            if m := STEP_DONE.search(line):
                self.per_step[int(m.group(1))] = tree_rss(self.ps)
            if line.startswith("done: MLflow run"):
                self.run_id = line.split()[3]
        self.done.set()
        sampler.join()
        return self.proc.wait()


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, steps=100, config="conf/smoke.yaml"), argv)
    tmp = Path(tempfile.mkdtemp(prefix="tlt-soak-"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect"),
           "TLT_MLFLOW_SPOOL_DIR": str(tmp / "spool"), "PYTHONUNBUFFERED": "1"}
    sets = [f"rl.steps={args.steps}", f"eval.every={max(args.steps // 2, 1)}", f"trainer.checkpoint_dir={tmp / 'runs'}",
            *args.overrides]
    cmd = [str(Path(sys.executable).with_name("tlt")), "run", args.config, *sum((["--set", s] for s in sets), [])]
    proc = subprocess.Popen(cmd, cwd=harness.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    w = Watch(proc)
    rc, wall = harness.timed(w.run)
    time.sleep(2)  # let exiting children go; then the run's pids still alive and ports still listening (leaked)
    alive = [p.pid for p in psutil.process_iter(["pid"]) if p.pid in w.pids and p.is_running()
             and p.status() != psutil.STATUS_ZOMBIE]
    listening = {c.laddr.port for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    steps = sorted(w.per_step)
    first = w.per_step.get(10) or (w.per_step[steps[0]] if steps else (0, 0))
    last = w.per_step[steps[-1]] if steps else (0, 0)
    hist = metric_history(w.run_id, "drafter/buffer_tokens", env["MLFLOW_TRACKING_URI"]) if w.run_id else None
    mib = lambda n_bytes: round(n_bytes / 2 ** 20, 1)  # noqa: E731
    res = {"rc": rc, "steps_done": len(steps), "wall_s": round(wall, 1), "run_id": w.run_id,
           "peak_rss_mib": mib(w.peak[0]), "peak_rss_tree_mib": mib(w.peak[1]), "rss_step10_mib": mib(first[0]),
           "rss_last_mib": mib(last[0]), "rss_growth_10_to_last_mib": mib(last[0] - first[0]),
           "rss_tree_growth_10_to_last_mib": mib(last[1] - first[1]),
           "rss_per_step_mib": {s: mib(w.per_step[s][0]) for s in steps},
           "buffer_tokens": hist[-1][1] if hist else None, "processes_seen": len(w.pids), "ports_seen": sorted(w.ports),
           "leaked_pids": alive, "leaked_listening_ports": sorted(w.ports & listening)}
    print(f"MLflow and Prefect state in {tmp}")
    if rc != 0:
        print("".join(w.tail), file=sys.stderr)
    res = harness.write_result(res, "soak", args, argv, show=[k for k in res if k != "rss_per_step_mib"])
    with suppress(ProcessLookupError):  # whatever is left (it is reported above) must not outlive the bench
        os.killpg(proc.pid, 9)
    return res


if __name__ == "__main__":
    main()
