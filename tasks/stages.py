"""Thin Prefect tasks: each looks up the run's pipeline, calls one stage, and leaves an artifact.

Models stay in the flow process (in the pipeline); tasks pass run ids and small summaries.

`_PIPELINES` (run id -> open Pipeline) is the project's one global. Prefect hands a task only
what it can serialise and persist (run ids, summaries), never a model or a worker process, so the
tasks of one flow run find their run's live pipeline here: `start_run` opens it, `finish_run` and
`abort_run` close it and take it out. Nothing under tlt/ keeps module-level state.
"""
from __future__ import annotations


from prefect import get_client, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import deployment, flow_run, task_run

from tlt.config import RunConfig
from tlt.console import eval_line, step_line
from tlt.errors import deterministic, exception_chain
from tlt.preflight import check_run_inputs
from tlt.pipeline import Pipeline
from tlt.provenance import source_tags
from tlt.report import close_report
from tlt.stages.warmstart import prior_line
from tlt.summaries import DataSummary, EvalSummary, ExportSummary, ModelSummary, StepSummary, WarmstartSummary
from tlt.tracking import find_run, make_tracker

_PIPELINES: dict[str, Pipeline] = {}


def open_pipeline(cfg: RunConfig, tracker, retrain: bool = False) -> Pipeline:
    pipe = Pipeline(cfg, tracker, retrain=retrain)
    _PIPELINES[tracker.run_id] = pipe
    return pipe


def get_pipeline(run_id: str) -> Pipeline:
    return _PIPELINES[run_id]


def close_pipeline(run_id: str, status: str = "FINISHED") -> None:
    """Close the run's pipeline (its workers) and end its tracker with `status`; a no-op when gone."""
    pipe = _PIPELINES.pop(run_id, None)
    if pipe is None:
        return
    try:
        pipe.close()
    finally:  # the MLflow run gets its final status even if a worker fails to stop
        pipe.tracker.end(status)


def _retry_unless_user_error(task, task_run, state) -> bool:
    """Retry an outage, never a bad input or another deterministic failure (it would fail the same way again)."""
    exc = state.result(raise_on_failure=False)
    return not (isinstance(exc, BaseException) and deterministic(exc))


@task(name="start-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=_retry_unless_user_error)
def start_run(config: RunConfig, resume_run_id: str | None = None, retrain: bool = False) -> str:
    """Check every input (ids, paths, names: tlt.inputs), then open the MLflow run (a retried flow
    run, or --resume, continues its own run)."""
    resume_run_id = check_run_inputs(config, resume_run_id)
    fr = str(flow_run.id or "")
    resume_run_id = resume_run_id or find_run("prefect.flow_run_id", fr, config.tracking.experiment,
                                              config.tracking.tracking_uri)
    tags = {**source_tags("tlt-train"), "prefect.flow_run_id": fr, "prefect.flow_run_name": str(flow_run.name or ""),
            "prefect.deployment": str(deployment.name or "")}
    tracker = make_tracker(config.tracking, run_name=config.name, tags=tags, run_id=resume_run_id)
    open_pipeline(config, tracker, retrain=retrain).log_config()
    return tracker.run_id


@task(name="validate-data", cache_policy=NO_CACHE)
def validate_data(run_id: str) -> DataSummary:
    s = get_pipeline(run_id).validate_data()
    create_table_artifact([{"task": k, "rows": v} for k, v in s.tasks.items()], key="data-report",
                          description=f"{s.n_rows} rows: {s.n_train} train, {s.n_heldout} held out, {s.n_dropped} dropped")
    return s


@task(name="prepare-models", cache_policy=NO_CACHE)
def prepare_models(run_id: str) -> ModelSummary:
    s = get_pipeline(run_id).prepare()
    create_markdown_artifact(f"**target** `{s.target}`: {s.n_params / 1e6:.1f} M params, {s.n_layers} layers, "
                             f"hidden {s.hidden_size}, vocab {s.vocab_size}, loaded in {s.load_s:.1f} s; "
                             f"drafter {s.drafter_params / 1e6:.2f} M trainable params", key="models")
    return s


@task(name="warmstart-drafter", cache_policy=NO_CACHE)
def warmstart_drafter(run_id: str) -> WarmstartSummary:
    s = get_pipeline(run_id).warmstart()
    get_run_logger().info(f"drafter warm-start: held-out accept length (fixed chain, greedy) {s.accept_len_before:.2f} "
                          f"-> {s.accept_len_after:.2f}, {s.train_steps} steps on {s.corpus_tokens} corpus tokens"
                          f"{' (cached corpus)' if s.cached else ''} in {s.time_s:.0f} s")
    if line := prior_line(s.prior_accept_rate, s.tail_threshold):
        get_run_logger().info(line)
    create_table_artifact([s.model_dump()], key="warmstart", description="held-out accept length before/after warm-start")
    return s


@task(name="resume", cache_policy=NO_CACHE)
def resume(run_id: str) -> int:
    start = get_pipeline(run_id).resume()  # rollout workers (rollout.workers > 1) start here, then the checkpoint
    if start:
        get_run_logger().info(f"resumed from checkpoint step-{start:06d} ({start} RL step{'s' * (start > 1)} done): "
                              f"next RL step {start + 1}")
    return start


def _rl_step_name() -> str:
    """`rl-step-N`, N counted from 1 like the log lines, MLflow steps and checkpoint folders (the
    flow passes the 0-based index)."""
    return f"rl-step-{task_run.parameters['step'] + 1}"


@task(name="rl-step", cache_policy=NO_CACHE, task_run_name=_rl_step_name)
def rl_step(run_id: str, step: int) -> StepSummary:
    pipe = get_pipeline(run_id)
    s = pipe.rl_step(step)
    history = pipe.record.history
    prev = history[-2] if len(history) > 1 and history[-2]["step"] == s.step - 1 else None
    get_run_logger().info(step_line(s.step, pipe.cfg.rl.steps, s.metrics, prev,
                                    pipe.cfg.drafter if pipe.refresher is not None else None))
    keys = ("reward/mean", "spec/accept_len/mean", "spec/enabled_share", "rollout/tokens_per_s",
            "rollout/response_length/max", "timing_s/rollout", "timing_s/update_policy", "timing_s/update_drafter",
            "timing_s/step")
    create_table_artifact([{"metric": k, "value": round(s.metrics[k], 4)} for k in keys if k in s.metrics],
                          key="rl-step", description=f"RL step {s.step}")
    return s


@task(name="evaluate", cache_policy=NO_CACHE, task_run_name="evaluate-{step}")
def evaluate(run_id: str, step: int, accept: bool = True) -> EvalSummary:
    s = get_pipeline(run_id).evaluate(step, accept=accept)
    get_run_logger().info(eval_line(s.step, s.accuracy, s.n, s.accept_len, s.accept_len_sampled))
    create_table_artifact([s.model_dump()], key="eval", description=f"greedy held-out accuracy at step {step}")
    return s


@task(name="report", cache_policy=NO_CACHE)
def report(run_id: str) -> str:
    pipe = get_pipeline(run_id)
    md, refreshes = close_report(pipe.report(), pipe.tracker, pipe.cfg, pipe.record.history, pipe.refresher is not None)
    if refreshes:
        get_run_logger().info(refreshes)
    create_markdown_artifact(md, key="run-report")
    return md


@task(name="export-model", cache_policy=NO_CACHE)
def export_model(run_id: str, final: EvalSummary | None = None) -> ExportSummary:
    s = get_pipeline(run_id).export(final)
    create_markdown_artifact(f"model folder (policy/, drafter/) exported to `{s.path}` (model version {s.version}, "
                             f"held-out accept length (fixed chain) greedy {s.accept_len or 0:.2f}, measured on the "
                             f"exported folder) in {s.time_s:.1f} s; serve it with `{s.serve}`", key="export")
    return s


@task(name="promote", cache_policy=NO_CACHE)
def promote(run_id: str, export: ExportSummary) -> bool:
    promoted = get_pipeline(run_id).promote(export)
    create_markdown_artifact(f"model version {export.version}: {'promoted to' if promoted else 'NOT promoted to'} "
                             "`champion`", key="promote")
    return promoted


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(run_id: str) -> None:
    close_pipeline(run_id, "FINISHED")


def abort_run(run_id: str, exc: BaseException | None = None) -> None:
    """End a failed or interrupted run: stop its workers and mark the MLflow run FAILED. A plain
    call, not a task: after SIGTERM or a crash Prefect's API may refuse new task runs or be gone,
    and the run must not stay RUNNING in MLflow. The flow run's retries are cancelled when a retry
    would fail the same way or was not wanted (see `_final`); other errors keep them (a retry
    resumes from the last checkpoint)."""
    close_pipeline(run_id, "FAILED")
    if _final(exc):
        cancel_retries()


def _final(exc: BaseException | None) -> bool:
    """A failure a retry would repeat (`tlt.errors.deterministic`: a `UserError` such as bad data or a drafter
    for another target, a KeyError in a model's config...) or an interruption (SIGTERM, Ctrl-C: not an
    `Exception`) anywhere in the exception's chain."""
    return deterministic(exc) or any(not isinstance(e, Exception) for e in exception_chain(exc))


def cancel_retries() -> None:
    """No further attempt of this flow run (it would fail the same way)."""
    if flow_run.id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            policy = client.read_flow_run(flow_run.id).empirical_policy
            client.update_flow_run(flow_run.id, empirical_policy=policy.model_copy(update={"retries": 0}))
    except Exception as err:  # noqa: BLE001 - the API may be gone during a shutdown; a retry is then harmless
        get_run_logger().warning("could not cancel the flow run's retries: %s", err)


@task(name="load-checkpoint", cache_policy=NO_CACHE)
def load_checkpoint(run_id: str, checkpoint: str) -> int:
    return get_pipeline(run_id).load_weights(checkpoint)
