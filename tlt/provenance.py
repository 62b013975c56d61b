"""What code made a run: the tlt version and the git commit of the checkout, for `tlt --version`
and the MLflow run's source tags (MLflow's UI shows `mlflow.source.git.commit` as the run's
Source; `tlt.version` and `tlt.git.dirty` are tlt's own)."""
from __future__ import annotations

import functools
import getpass
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages, where no .git exists)


def tlt_version() -> str:
    try:
        return metadata.version("tlt")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):  # no git binary, or a hung filesystem
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def git_state() -> tuple[str, bool] | None:
    """(commit sha, whether tracked files differ from it) of the checkout tlt runs from; None when
    tlt is not running from a git checkout (an installed wheel)."""
    sha = _git("rev-parse", "HEAD")
    if not sha:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return sha, bool(changed)


def source_tags(entry: str = "tlt run") -> dict[str, str]:
    """MLflow run tags naming the code: MLflow's own source tags where they fit, plus tlt's version."""
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": entry, "tlt.version": tlt_version()}
    try:  # MlflowClient.create_run, unlike mlflow.start_run, sets no user
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (some containers)
        pass
    state = git_state()
    if state is not None:
        tags["mlflow.source.git.commit"] = state[0]
        tags["tlt.git.dirty"] = str(state[1]).lower()
    return tags


def version_line() -> str:
    """`tlt --version`: the version, and the commit when run from a checkout."""
    state = git_state()
    if state is None:
        return f"tlt {tlt_version()}"
    return f"tlt {tlt_version()} (git {state[0][:12]}{', modified' if state[1] else ''})"
