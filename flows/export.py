"""tlt-export: write a run's model folder (policy/ and its EAGLE-3 drafter/) that vLLM and SGLang serve."""
from __future__ import annotations

from prefect import flow

from tasks import stages


@flow(name="tlt-export", log_prints=True)
def tlt_export(out: str, run_id: str | None = None, checkpoint: str | None = None, force: bool = False,
               checkpoint_root: str = "runs") -> dict:
    """Export by MLflow run id (latest checkpoint of that run) or by checkpoint folder."""
    return stages.export_checkpoint(out, run_id, checkpoint, force, checkpoint_root)
