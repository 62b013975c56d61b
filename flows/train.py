"""tlt-train: validate data -> prepare models -> evaluate (later: warm-start, RL steps, export)."""
from __future__ import annotations

from prefect import flow

from tasks import stages
from tlt.config import RunConfig


@flow(name="tlt-train", log_prints=True)
def tlt_train(config: RunConfig = RunConfig(), resume: str | None = None) -> dict:
    """Train a policy with speculative rollout and an adaptive drafter; every stage is tracked in MLflow."""
    run_id = stages.start_run(config, resume)
    try:
        data = stages.validate_data(run_id)
        model = stages.prepare_models(run_id)
        final = stages.evaluate(run_id, config.rl.steps)
    except BaseException:
        stages.finish_run(run_id, "FAILED")
        raise
    stages.finish_run(run_id)
    return {"run_id": run_id, "data": data.model_dump(), "model": model.model_dump(), "eval": final.model_dump()}


if __name__ == "__main__":
    tlt_train()
