"""Thin Prefect tasks: each looks up the run's pipeline and calls one stage, then leaves an artifact.

Models stay in the flow process (in the pipeline); tasks pass run ids and small summaries.
"""
from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run

from tlt.config import RunConfig
from tlt.pipeline import close_pipeline, get_pipeline, open_pipeline
from tlt.summaries import DataSummary, EvalSummary, ModelSummary
from tlt.tracking import make_tracker


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace("/", "-")


@task(name="start-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def start_run(config: RunConfig, resume_run_id: str | None = None) -> str:
    tags = {"prefect.flow_run_id": str(flow_run.id or ""), "prefect.flow_run_name": str(flow_run.name or ""),
            "prefect.deployment": str(deployment.name or "")}
    tracker = make_tracker(config.tracking, run_name=config.name, tags=tags, run_id=resume_run_id)
    pipe = open_pipeline(config, tracker)
    pipe.log_config()
    return tracker.run_id


@task(name="validate-data", cache_policy=NO_CACHE)
def validate_data(run_id: str) -> DataSummary:
    s = get_pipeline(run_id).validate_data()
    rows = [{"task": k, "rows": v} for k, v in s.tasks.items()]
    create_table_artifact(rows, key="data-report", description=(
        f"{s.n_rows} rows: {s.n_train} train, {s.n_heldout} held out, {s.n_dropped} dropped"))
    return s


@task(name="prepare-models", cache_policy=NO_CACHE)
def prepare_models(run_id: str) -> ModelSummary:
    s = get_pipeline(run_id).prepare()
    create_markdown_artifact(f"**target** `{s.target}`: {s.n_params / 1e6:.1f} M params, {s.n_layers} layers, "
                             f"hidden {s.hidden_size}, vocab {s.vocab_size}; loaded in {s.load_s:.1f} s",
                             key="models")
    return s


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(run_id: str, step: int) -> EvalSummary:
    s = get_pipeline(run_id).evaluate(step)
    create_table_artifact([s.model_dump()], key="eval", description=f"greedy accuracy at step {step}")
    return s


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(run_id: str, status: str = "FINISHED") -> None:
    close_pipeline(run_id, status)
