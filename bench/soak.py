"""Soak: `tlt run` for many RL steps, RSS sampled at every step; then no leftovers.

    python bench/soak.py [conf/smoke.yaml] [--steps 100] [--set key=value ...] [--json out.json]

Prints peak RSS (the tlt process and all its children), RSS growth between step 10 and the last
step, the drafter buffer size (MLflow `drafter/buffer_tokens`), and whether any process or
listening port of this run outlives it. MLflow and Prefect state live in a temp dir.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="conf/smoke.yaml")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tlt-soak-"))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "PREFECT_HOME": str(tmp / "prefect"),
           "TLT_MLFLOW_SPOOL_DIR": str(tmp / "spool"), "PYTHONUNBUFFERED": "1"}
    sets = [f"rl.steps={args.steps}", f"eval.every={max(args.steps // 2, 1)}", f"trainer.checkpoint_dir={tmp / 'runs'}",
            *args.overrides]
    cmd = [str(Path(sys.executable).with_name("tlt")), "run", args.config, *sum((["--set", s] for s in sets), [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)
    per_step: dict[int, tuple[int, int]] = {}
    peak, seen_pids, ports, done = [0, 0], {proc.pid}, set(), threading.Event()

    def sample() -> None:  # between step ends too: peaks happen inside a step
        while not done.is_set():
            own, total = tree_rss(ps)
            peak[0], peak[1] = max(peak[0], own), max(peak[1], total)
            try:
                seen_pids.update(c.pid for c in ps.children(recursive=True))
            except psutil.Error:
                pass
            ports.update(listening(seen_pids))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, tail, run_id = time.time(), [], None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        m = STEP_DONE.search(line)
        if m:
            per_step[int(m.group(1)) + 1] = tree_rss(ps)
        if line.startswith("done: MLflow run"):
            run_id = line.split()[3]
    rc = proc.wait()
    done.set()
    sampler.join()
    wall = time.time() - t0
    time.sleep(2)  # let exiting children go
    alive = [p.pid for p in psutil.process_iter(["pid"]) if p.pid in seen_pids and p.is_running()
             and p.status() != psutil.STATUS_ZOMBIE]
    still_listening = [port for _, port in ports if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                                                        for c in psutil.net_connections(kind="inet"))]
    buffer_tokens = None
    if run_id:
        from tlt.tracking import metric_history

        hist = metric_history(run_id, "drafter/buffer_tokens", env["MLFLOW_TRACKING_URI"])
        buffer_tokens = hist[-1][1] if hist else None
    steps = sorted(per_step)
    first = per_step.get(10) or (per_step[steps[0]] if steps else (0, 0))
    last = per_step[steps[-1]] if steps else (0, 0)
    mib = 1 / 2**20
    result = {"rc": rc, "steps_done": len(steps), "wall_s": round(wall, 1), "run_id": run_id,
              "peak_rss_mib": round(peak[0] * mib, 1), "peak_rss_tree_mib": round(peak[1] * mib, 1),
              "rss_step10_mib": round(first[0] * mib, 1), "rss_last_mib": round(last[0] * mib, 1),
              "rss_growth_10_to_last_mib": round((last[0] - first[0]) * mib, 1),
              "rss_tree_growth_10_to_last_mib": round((last[1] - first[1]) * mib, 1),
              "rss_per_step_mib": {s: round(per_step[s][0] * mib, 1) for s in steps},
              "buffer_tokens": buffer_tokens, "processes_seen": len(seen_pids), "ports_seen": sorted(p for _, p in ports),
              "leaked_pids": alive, "leaked_listening_ports": still_listening, "tmp": str(tmp)}
    print(f"steps {len(steps)}/{args.steps} in {wall:.0f} s (rc {rc}); peak RSS {result['peak_rss_mib']} MiB "
          f"(with children {result['peak_rss_tree_mib']} MiB); RSS step 10 -> {steps[-1] if steps else '-'}: "
          f"{result['rss_step10_mib']} -> {result['rss_last_mib']} MiB ({result['rss_growth_10_to_last_mib']:+} MiB, "
          f"tree {result['rss_tree_growth_10_to_last_mib']:+} MiB); drafter buffer {buffer_tokens} tokens; "
          f"leaked processes {alive or 'none'}; leaked listening ports {still_listening or 'none'}")
    if rc != 0:
        print("".join(tail), file=sys.stderr)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    try:  # whatever is left (it is reported above) must not outlive the bench
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    return result


if __name__ == "__main__":
    main()
