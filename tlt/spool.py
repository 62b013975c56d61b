"""The outage spool: an append-only JSONL file of tracker calls that could not be sent yet, each
line fsynced, plus a staging folder for copies of artifacts logged meanwhile. No MLflow here:
`tlt.tracking` decides what goes in and sends it, oldest first, when the store is back."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Spool:
    """`<root>/<run_id>.jsonl`; artifact copies under `<root>/<run_id>/<n>/<name>`."""

    def __init__(self, root: str | Path, run_id: str):
        self.root = Path(root)
        self.path = self.root / f"{run_id}.jsonl"
        self._stage_root = self.root / run_id

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
