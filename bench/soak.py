"""Soak: `tlt run` for many RL steps, RSS sampled at every step; then no leftovers.

    python bench/soak.py [conf/smoke.yaml] [--steps 100] [--set key=value ...] [--json out.json]

Prints peak RSS (the tlt process and all its children), RSS growth between step 10 and the last
step, the drafter buffer size (MLflow `drafter/buffer_tokens`), and whether any process or
listening port of this run outlives it. MLflow and Prefect state live in a temp dir.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from tlt.tracking import metric_history  # noqa: E402

ROOT = harness.ROOT
STEP_DONE = re.compile(r"Task run 'rl-step-(\d+)' - Finished")


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of proc, RSS of proc + its descendants) in bytes; 0 for processes that just exited."""
    own = total = 0
    try:
        own = total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return own, total


def listening(pids: set[int]) -> set[tuple[int, int]]:
    """(pid, port) of the TCP sockets in LISTEN state owned by `pids`."""
    out = set()
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((pid, c.laddr.port))
        except psutil.Error:
            pass
    return out


class Watch:
    """Samples RSS of a process tree (between step ends too: peaks happen inside a step), the pids
    it ever had and the ports they listened on, while its output is read line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.ps = proc, psutil.Process(proc.pid)
        self.per_step: dict[int, tuple[int, int]] = {}
        self.peak, self.seen_pids, self.ports = [0, 0], {proc.pid}, set()
        self.tail: list[str] = []
        self.run_id: str | None = None
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            own, total = tree_rss(self.ps)
            self.peak = [max(self.peak[0], own), max(self.peak[1], total)]
            try:
                self.seen_pids.update(c.pid for c in self.ps.children(recursive=True))
            except psutil.Error:
                pass
            self.ports.update(listening(self.seen_pids))
            time.sleep(0.5)

    def run(self) -> tuple[int, float]:
        """Read the output to its end; (exit code, wall seconds)."""
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        t0 = time.time()
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-40:]
            if m := STEP_DONE.search(line):
                self.per_step[int(m.group(1)) + 1] = tree_rss(self.ps)
            if line.startswith("done: MLflow run"):
                self.run_id = line.split()[3]
        rc = self.proc.wait()
        self._done.set()
        sampler.join()
        return rc, time.time() - t0

    def leftovers(self) -> tuple[list[int], list[int]]:
        """Pids of this run still alive, and its ports still listening."""
        time.sleep(2)  # let exiting children go
        alive = [p.pid for p in psutil.process_iter(["pid"]) if p.pid in self.seen_pids and p.is_running()
                 and p.status() != psutil.STATUS_ZOMBIE]
        listening_now = {c.laddr.port for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        return alive, [port for _, port in self.ports if port in listening_now]


def _args(argv: list[str] | None) -> argparse.Namespace:
    return harness.parser(__doc__, steps=100, config="conf/smoke.yaml").parse_args(argv)


def _buffer_tokens(run_id: str | None, uri: str) -> float | None:
    if not run_id:
        return None
    hist = metric_history(run_id, "drafter/buffer_tokens", uri)
    return hist[-1][1] if hist else None


def _result(w: Watch, rc: int, wall: float, buffer_tokens: float | None) -> dict:
    alive, still_listening = w.leftovers()
    steps = sorted(w.per_step)
    first = w.per_step.get(10) or (w.per_step[steps[0]] if steps else (0, 0))
    last = w.per_step[steps[-1]] if steps else (0, 0)
    mib = 1 / 2**20
    return {"rc": rc, "steps_done": len(steps), "wall_s": round(wall, 1), "run_id": w.run_id,
            "peak_rss_mib": round(w.peak[0] * mib, 1), "peak_rss_tree_mib": round(w.peak[1] * mib, 1),
            "rss_step10_mib": round(first[0] * mib, 1), "rss_last_mib": round(last[0] * mib, 1),
            "rss_growth_10_to_last_mib": round((last[0] - first[0]) * mib, 1),
            "rss_tree_growth_10_to_last_mib": round((last[1] - first[1]) * mib, 1),
            "rss_per_step_mib": {s: round(w.per_step[s][0] * mib, 1) for s in steps},
            "buffer_tokens": buffer_tokens, "processes_seen": len(w.seen_pids),
            "ports_seen": sorted(p for _, p in w.ports), "leaked_pids": alive,
            "leaked_listening_ports": still_listening}


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tlt-soak-"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect"),
           "TLT_MLFLOW_SPOOL_DIR": str(tmp / "spool"), "PYTHONUNBUFFERED": "1"}
    sets = [f"rl.steps={args.steps}", f"eval.every={max(args.steps // 2, 1)}", f"trainer.checkpoint_dir={tmp / 'runs'}",
            *args.overrides]
    cmd = [str(Path(sys.executable).with_name("tlt")), "run", args.config, *sum((["--set", s] for s in sets), [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    watch = Watch(proc)
    rc, wall = watch.run()
    r = _result(watch, rc, wall, _buffer_tokens(watch.run_id, env["MLFLOW_TRACKING_URI"]))
    print(f"steps {r['steps_done']}/{args.steps} in {wall:.0f} s (rc {rc}); peak RSS {r['peak_rss_mib']} MiB "
          f"(with children {r['peak_rss_tree_mib']} MiB); RSS step 10 -> {max(r['rss_per_step_mib'], default='-')}: "
          f"{r['rss_step10_mib']} -> {r['rss_last_mib']} MiB ({r['rss_growth_10_to_last_mib']:+} MiB, "
          f"tree {r['rss_tree_growth_10_to_last_mib']:+} MiB); drafter buffer {r['buffer_tokens']} tokens; "
          f"leaked processes {r['leaked_pids'] or 'none'}; "
          f"leaked listening ports {r['leaked_listening_ports'] or 'none'}; MLflow and Prefect state in {tmp}")
    if rc != 0:
        print("".join(watch.tail), file=sys.stderr)
    r = harness.write_result(r, "soak", args, argv)
    try:  # whatever is left (it is reported above) must not outlive the bench
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    return r


if __name__ == "__main__":
    main()
