"""tlt-evaluate: greedy held-out accuracy and accept length of a run checkpoint, as its own MLflow run."""
from __future__ import annotations

from prefect import flow

from tasks import stages
from tlt.config import RunConfig


@flow(name="tlt-evaluate", log_prints=True)
def tlt_evaluate(config: RunConfig = RunConfig(), checkpoint: str | None = None) -> dict:
    """Evaluate the target named by `config` (or the policy + drafter of `checkpoint`) on held-out prompts."""
    run_id = stages.start_run(config.model_copy(update={"name": f"{config.name}-eval"}))
    try:
        stages.validate_data(run_id)
        stages.prepare_models(run_id)
        step = stages.load_checkpoint(run_id, checkpoint) if checkpoint else 0
        result = stages.evaluate(run_id, step)
    except BaseException as exc:
        stages.abort_run(run_id, exc)
        raise
    stages.finish_run(run_id)
    return {"run_id": run_id, "eval": result.model_dump()}
