"""The tracking seam: the only package of tlt that imports mlflow.

Everything logs through a tracker: `MlflowTracker` (writer.py; sending and the outage spool in
sender.py) talks to one run through an explicit `MlflowClient` and run id; `NullTracker`
(base.py, no MLflow) is for library code and tests that don't track. readers.py is the read side
(`tlt compare`, `tlt export --run`), registry.py the logged model, the model registry and its
`champion` alias, sync.py `tlt tracking sync`, transient.py the line between an outage (spool)
and a bug (raise).

Names are loaded on first use (PEP 562), so `from tlt.tracking import NullTracker` does not
import mlflow (~1.5 s) in library code and tests that never track.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "base": ["DEFAULT_DIR", "NullTracker", "default_artifact_location", "default_spool_dir", "default_tracking_uri",
             "unsent_message"],
    "readers": ["download", "find_run", "list_experiments", "match_run_ids", "metric_histories", "metric_history",
                "read_run", "run_link", "search_runs"],
    "registry": ["champion", "log_model", "register_version", "set_champion"],
    "sender": ["OFFLINE_RETRY_S", "SpoolSender"],
    "sync": ["format_results", "pending", "sync_all", "unsent", "unsent_warning"],
    "transient": ["is_transient"],
    "writer": ["MlflowTracker", "make_tracker", "open_experiment"],
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tlt.tracking' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"tlt.tracking.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
