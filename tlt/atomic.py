"""Write-then-rename: a file or folder appears whole or not at all, even under kill -9.

One helper for every durable write (checkpoints, the converted model, the drafter export, the
drafter corpus): the new content is written beside its final path (same filesystem, so the
rename is atomic), renamed over it, and the parent folder is fsynced so the rename survives a
power loss. An existing folder is moved aside first and removed after the swap.
"""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(final: Path, prefix: str | None = None) -> Path:
    """A unique hidden path beside `final`: `<prefix><name>-<pid>-<rand>` (default prefix `.tmp-`).

    The pid in the name lets a cleaner tell its own in-flight temp paths from a crashed process's."""
    return final.parent / f"{prefix or '.tmp-'}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def replace_dir(new: Path, final: Path) -> None:
    """Swap the finished folder `new` in as `final` (an existing `final` is moved aside and removed)."""
    old = None
    if final.exists() or final.is_symlink():
        old = temp_name(final, ".old-")
        os.replace(final, old)
    os.replace(new, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()


@contextmanager
def staged_dir(final: Path, prefix: str | None = None) -> Iterator[Path]:
    """Yield an empty temp folder beside `final`; when the block ends normally it replaces
    `final` in one rename, when it raises (or is interrupted) the temp folder is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final, prefix)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_file(final: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` writes the content to a temp path beside `final`, which then replaces `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
        write(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)
