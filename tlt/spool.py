"""The outage spool: an append-only JSONL file of tracker calls that could not be sent yet, each
line fsynced, plus a staging folder for copies of artifacts logged meanwhile. No MLflow here:
`tlt.tracking` decides what goes in and sends it, oldest first, when the store is back.

Two processes may hold the same run's spool (a run still logging while `tlt tracking sync` sends
its backlog, or a resumed run): every read-send-rewrite and every append happens under an
exclusive lock on `<run_id>.lock` (`with spool.locked():`), so no call is sent twice or lost."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path


class Spool:
    """`<root>/<run_id>.jsonl`; artifact copies under `<root>/<run_id>/<n>/<name>`."""

    def __init__(self, root: str | Path, run_id: str):
        self.root = Path(root)
        self.path = self.root / f"{run_id}.jsonl"
        self.lock_path = self.root / f"{run_id}.lock"
        self._stage_root = self.root / run_id

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the spool's lock file (blocking). The lock file goes when the spool is empty; a
        waiter that then wakes on the removed file takes the lock again on the new one."""
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            yield
        finally:
            if not self.path.exists():
                self.lock_path.unlink(missing_ok=True)
            os.close(fd)

    def exists(self) -> bool:
        return self.path.exists()

    def append(self, kind: str, payload: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **payload}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def entries(self) -> list[dict]:
        """What is spooled, oldest first (empty when nothing is)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def keep(self, rest: list[dict]) -> None:
        """Replace the spool with `rest` (the unsent tail) atomically; remove it when empty."""
        if not rest:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in rest))
        os.replace(tmp, self.path)

    def stage(self, name: str) -> Path:
        """A fresh path for an artifact copy (its parent folder exists)."""
        dst = self._stage_root / f"{time.time_ns()}" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        return dst
