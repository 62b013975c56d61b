"""tlt-train: validate data -> prepare models -> warm-start drafter -> RL steps -> evaluate -> export."""
from __future__ import annotations

from prefect import flow

from tasks import stages
from tlt.config import RunConfig
from tlt.errors import deterministic


def _eval_due(step: int, cfg: RunConfig) -> bool:
    return cfg.eval.every > 0 and step % cfg.eval.every == 0 and step != cfg.rl.steps


@flow(name="tlt-train", log_prints=True, retries=1, retry_delay_seconds=10)
def tlt_train(config: RunConfig = RunConfig(), resume: str | None = None, retrain: bool = False) -> dict:
    """Train a policy with speculative rollout and an adaptive drafter; every stage is tracked in MLflow.

    The one retry is for transient failures (an outage, a killed worker: it resumes from the last
    checkpoint); a failure that would repeat (tlt.errors.deterministic) cancels it.

    `resume`: an MLflow run id to continue from its last checkpoint. `retrain`: start from the
    registry's champion policy and drafter, promote the new version only if neither the policy's
    held-out accuracy nor the drafter's accept length dropped.
    """
    try:
        run_id = stages.start_run(config, resume, retrain)
    except Exception as exc:
        if deterministic(exc):  # a wrong id, path or model (tlt.inputs, tlt.arch): a retry would fail the same way
            stages.cancel_retries()
        raise
    try:
        stages.validate_data(run_id)
        stages.prepare_models(run_id)
        if config.rollout.drafter == "eagle":
            stages.warmstart_drafter(run_id)
        start = stages.resume(run_id)
        if start == 0 or _eval_due(start, config):  # a resume re-runs an evaluation the crash may have cut
            stages.evaluate(run_id, start)
        for step in range(start, config.rl.steps):
            stages.rl_step(run_id, step)
            if _eval_due(step + 1, config):
                stages.evaluate(run_id, step + 1)
        # with an export, the last step's accept lengths are measured once, on the exported folder
        final = stages.evaluate(run_id, config.rl.steps, accept=not config.export.enabled)
        stages.report(run_id)
        export = None
        if config.export.enabled:
            export = stages.export_model(run_id, final)
            final = final.model_copy(update={"accept_len": export.accept_len,
                                             "accept_len_sampled": export.accept_len_sampled})
            if retrain:
                stages.promote(run_id, export)
    except BaseException as exc:
        stages.abort_run(run_id, exc)
        raise
    stages.finish_run(run_id)
    return {"run_id": run_id, "eval": final.model_dump(), "export": export.model_dump() if export else None}


if __name__ == "__main__":
    tlt_train()
