"""`tlt tracking sync`: send what outages left in the spool folder, for every run, without
opening the runs again (their status is whatever the spool ends with: a run that ended during an
outage gets its final status from its spool)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tlt.spool import Spool
from tlt.tracking.base import default_spool_dir, default_tracking_uri, unsent_message
from tlt.tracking.sender import SpoolSender
from tlt.tracking.transient import is_transient
from tlt.tracking.writer import open_client


@dataclass
class SyncResult:
    run_id: str
    sent: int  # calls taken off the spool (a call the store rejects as a bug is dropped with a warning)
    left: int  # calls still waiting
    note: str = ""


def pending(spool_dir: str | Path | None = None) -> list[str]:
    """Run ids with unsent calls in the spool folder."""
    return sorted(p.stem for p in default_spool_dir(spool_dir).glob("*.jsonl"))


def unsent(run_id: str, spool_dir: str | Path | None = None) -> int:
    return len(Spool(default_spool_dir(spool_dir), run_id).entries())


def unsent_warning(run_id: str, uri: str | None = None, spool_dir: str | Path | None = None) -> str | None:
    """The user-facing message when `run_id` has unsent calls; None when it has none."""
    spool = Spool(default_spool_dir(spool_dir), run_id)
    n = len(spool.entries())
    return unsent_message(run_id, default_tracking_uri(uri), spool.path, n) if n else None


def _sync_one(client, uri: str, spool: Spool, run_id: str, timeout_s: float) -> SyncResult:
    before = len(spool.entries())
    try:
        client.get_run(run_id)
    except Exception as err:  # noqa: BLE001 - an outage or a run this store does not hold: keep the spool
        if not is_transient(err):
            return SyncResult(run_id, 0, before, f"no such run in {uri}; is it another store's spool? (--uri)")
        return SyncResult(run_id, 0, before, "store unreachable")
    sender = SpoolSender(client, run_id, spool, uri)
    sender.drain(timeout_s)
    left = sender.unsent()
    return SyncResult(run_id, before - left, left, "store unreachable" if left else "")


def sync_all(uri: str | None = None, spool_dir: str | Path | None = None, timeout_s: float = 0.0) -> list[SyncResult]:
    """Send every pending spool to the store at `uri`, oldest call first, retrying each for up to
    `timeout_s`; one result per spool found."""
    ids = pending(spool_dir)
    if not ids:
        return []
    uri, client = open_client(uri)
    root = default_spool_dir(spool_dir)
    return [_sync_one(client, uri, Spool(root, rid), rid, timeout_s) for rid in ids]


def format_results(results: list[SyncResult], spool_dir: str | Path | None = None) -> str:
    if not results:
        return f"nothing to send: no pending spool in {default_spool_dir(spool_dir)}"
    lines = [f"run {r.run_id}: sent {r.sent} call(s), {r.left} left" + (f" ({r.note})" if r.note else "")
             for r in results]
    left = sum(r.left for r in results)
    lines.append(f"{left} call(s) still in {default_spool_dir(spool_dir)}; run `tlt tracking sync` again once the "
                 "store is reachable" if left else "every spooled call is sent")
    return "\n".join(lines)
