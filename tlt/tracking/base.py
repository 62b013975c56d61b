"""What tracking needs without MLflow: where the store, its artifacts and the outage spool live,
and the tracker that stores nothing (library code and tests that don't track)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("mlflow")


def default_tracking_uri(configured: str | None = None) -> str:
    """`MLFLOW_TRACKING_URI` wins, then the config, then the embedded sqlite store under mlflow/."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if configured:
        return configured
    DEFAULT_DIR.mkdir(exist_ok=True)
    return f"sqlite:///{DEFAULT_DIR.resolve() / 'mlflow.db'}"


def default_artifact_location(experiment: str) -> str | None:
    """Artifacts of the embedded store live next to it, in mlflow/artifacts/<experiment>."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (DEFAULT_DIR.resolve() / "artifacts" / experiment).as_uri()


def keep_env_uri(set_uri) -> None:
    """Call `mlflow.set_tracking_uri` (passed in: this module stays mlflow-free) without its side
    effect of exporting MLFLOW_TRACKING_URI, which would then win over every URI configured later
    in this process (a second tracker, a test after the one that tracked to a server)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    set_uri()
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def default_spool_dir(configured: str | Path | None = None) -> Path:
    """Where unsent calls wait during an outage: the argument, else $TLT_MLFLOW_SPOOL_DIR, else mlflow/spool/."""
    return Path(configured or os.environ.get("TLT_MLFLOW_SPOOL_DIR") or DEFAULT_DIR / "spool").resolve()


class NullTracker:
    """Accepts everything, stores nothing."""

    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_text(self, text: str, path: str) -> None: ...
    def log_dict(self, data: Any, path: str) -> None: ...
    def log_figure(self, fig: Any, path: str) -> None: ...
    def log_table(self, rows: list[dict], path: str) -> None: ...
    def log_artifacts(self, local_dir: str | Path, path: str | None = None) -> None: ...
    def log_dataset(self, df: Any, name: str, digest: str, source: str, context: str = "train",
                    tags: dict[str, str] | None = None) -> None: ...

    def log_model(self, local_dir: str | Path, name: str, register_as: str | None = None,
                  tags: dict[str, str] | None = None, step: int = 0) -> str | None:
        """No registry: no version."""
        return None

    def end(self, status: str = "FINISHED") -> bool:
        """True: nothing is left unsent."""
        return True


def unsent_message(run_id: str, uri: str, spool: Path, n: int) -> str:
    """What a user reads when calls of a run are still in the spool (the end of a run, compare, export)."""
    default = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DIR.resolve() / 'mlflow.db'}"
    command = "tlt tracking sync" + ("" if uri == default else f" --uri {uri}")
    return (f"MLflow run {run_id}: {n} call(s) (metrics, artifacts, the drafter model, the final status) could not be "
            f"sent to {uri} and wait in {spool}; until they are sent the run shows as RUNNING with partial data. "
            f"Once the store is reachable, send them with `{command}`.")
