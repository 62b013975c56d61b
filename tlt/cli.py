"""The `tlt` command line. User errors print one paragraph and exit 2, never a traceback.

Commands that need Prefect import `flows` lazily, so `tlt config check` and `tlt data
validate` start fast and the library keeps no dependency on the orchestrator. For the same
reason the modules that pull in torch, transformers or matplotlib are imported inside the
commands that use them (each marked "deferred"); `tlt.tracking` loads mlflow on first use.
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tlt import tracking
from tlt.config import dump_yaml, load_config, reference_markdown
from tlt.cli_bench import bench_app
from tlt.cli_export import export
from tlt.cli_help import HELP, plain_arguments
from tlt.console import closing_lines, starting_line
from tlt.errors import UserError, exception_chain
from tlt.inputs import check_data_file, check_empty_target, finished_run, resolve_run_id
from tlt.preflight import check_prompts, check_run_inputs
from tlt.provenance import version_line
from tlt.services import env_defaults, run_uis

app = typer.Typer(add_completion=False, help="TLT: RL with speculative rollout and an adaptive drafter.", **HELP)
config_app = typer.Typer(help="Check and show run configs.", **HELP)
data_app = typer.Typer(help="Validate datasets.", **HELP)
drafter_app = typer.Typer(help="Drafter warm-start.", **HELP)
tracking_app = typer.Typer(help="The MLflow store: send what an outage left unsent.", **HELP)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(drafter_app, name="drafter")
app.add_typer(bench_app, name="bench")
app.add_typer(tracking_app, name="tracking")
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

SetOpt = typer.Option(None, "--set", metavar="KEY=VALUE", help="Dotted override, e.g. --set rl.steps=3 (repeatable)")
ConfigArg = typer.Argument(..., metavar="CONFIG", help="A run recipe, e.g. conf/default.yaml", show_default=False)
DeployConfigArg = typer.Argument(Path("conf/default.yaml"), metavar="CONFIG", help="A run recipe")


def _version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the tlt version (and git commit) and exit.")) -> None:
    """TLT: RL with speculative rollout and an adaptive drafter."""


def _load(config: Path | None, overrides: list[str] | None):
    return load_config(config, overrides or [])


@config_app.command("check")
def config_check(files: list[Path] = typer.Argument(..., metavar="CONFIG...", show_default=False),
                 set_: Optional[list[str]] = SetOpt) -> None:
    """Exit 0 when every CONFIG (with overrides) is a valid run config, 2 at the first that is not: keys,
    values and their cross-checks (placement, precision, backends), what a Ray run reserves, and the
    checks `tlt run` makes before it starts anything: the data file's rows, the reward function and
    (where the model is on this machine) the prompt lengths. Settings for hardware this machine lacks
    (a GPU, vLLM) are not refused here, so GPU recipes check on a laptop."""
    for file in files:
        cfg = _load(file, set_)
        c, ws = cfg.cluster, cfg.trainer.world_size
        where = ""
        if c.backend == "ray":
            gpus = c.rollout_actors * c.rollout_actor_gpus + (ws > 1) * ws * c.trainer_gpus
            where = (f"; Ray: {c.rollout_actors} {cfg.rollout.backend} rollout actor(s), {ws} trainer rank(s), "
                     f"{c.placement}, {gpus:g} GPU(s)")
        inputs = check_prompts(cfg, strict=False)
        out.print(f"ok: {file} is valid (model {cfg.model.name_or_path}, {cfg.rl.steps} RL steps{where}); {inputs}",
                  highlight=False)


@config_app.command("show")
def config_show(file: Optional[Path] = typer.Argument(None, metavar="CONFIG", show_default=False),
                set_: Optional[list[str]] = SetOpt) -> None:
    """Print the resolved config (defaults filled in) as YAML."""
    out.print(dump_yaml(_load(file, set_)), markup=False)


@config_app.command("reference")
def config_reference(write: Optional[Path] = typer.Option(None, "--write", "--readme", metavar="MARKDOWN",
                                                          help="Rewrite the generated block of this page, e.g. "
                                                               "docs/configuration.md")) -> None:
    """Print the config reference (Markdown), or refresh it inside a page (docs/configuration.md) between
    its `<!-- config-reference:start -->` and `<!-- config-reference:end -->` markers."""
    if write is None:
        print(reference_markdown())
        return
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    text = write.read_text() if write.is_file() else ""
    if start not in text or end not in text:
        raise UserError(f"--write '{write}' has no `{start}` ... `{end}` block; point it at docs/configuration.md, "
                        "or add the two markers where the reference belongs")
    head, rest = text.split(start)
    tail = rest.split(end)[1]
    write.write_text(f"{head}{start}\n{reference_markdown()}\n{end}{tail}")


@data_app.command("validate")
def data_validate(path: Path = typer.Argument(..., metavar="PATH", show_default=False),
                  config: Optional[Path] = typer.Option(None, metavar="CONFIG",
                                                        help="Recipe whose model tokenizer and limits apply"),
                  set_: Optional[list[str]] = SetOpt) -> None:
    """List every bad row (row, column, reason) and exit 2; or print a one-line summary."""
    check_data_file(path)
    cfg = _load(config, set_)
    check_run_inputs(cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": None})}))
    from tlt.prompts import validate_file  # deferred: pandas, reasoning-gym
    from tlt.models import load_tokenizer  # deferred: torch, transformers

    report = validate_file(path, tokenizer=load_tokenizer(cfg.model), max_prompt_tokens=cfg.data.max_prompt_tokens,
                           instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)
    if report.bad:
        err.print(report.format(), markup=False)
        malformed = any(b.column == "(json)" for b in report.bad)  # dropping rows cannot skip an unreadable line
        fix = ("fix them (malformed lines first: data.on_invalid: drop cannot skip them)" if malformed else
               "fix them, or set data.on_invalid: drop to train on the clean rows (dropped rows are logged)")
        err.print(f"{path}: {len(report.bad)} problem(s) in {report.n_rows} rows; {fix}.", markup=False)
        raise typer.Exit(2)
    out.print(report.summary(), markup=False)


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the flow is marked crashed, the MLflow run ends,
    worker processes stop and Prefect stops its temporary server (the default action of SIGTERM
    would kill this process alone and leave them running)."""


_sigterm_received = False


def _by_sigterm(exc: BaseException | None) -> bool:
    """Whether SIGTERM caused `exc` (ours, or Prefect's TerminationSignal, which replaces our
    handler while a flow runs), following the exception's cause/context chain."""
    return any(isinstance(e, Terminated) or type(e).__name__ == "TerminationSignal" for e in exception_chain(exc))


def _terminate_cleanly() -> None:
    def handler(signum, frame):
        global _sigterm_received
        _sigterm_received = True  # click turns the exception into Abort: main() reads this flag
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


@app.command("run")
def run(config: Path = ConfigArg, set_: Optional[list[str]] = SetOpt,
        resume: Optional[str] = typer.Option(None, metavar="RUN_ID",
                                             help="MLflow run id (or a unique prefix) to continue")) -> None:
    """Run the tlt-train flow on CONFIG."""
    cfg = _load(config, set_)
    env_defaults()
    if resume:  # a finished run first: its export folder is full, and that is no error here
        resume = resolve_run_id(resume, cfg.tracking.tracking_uri, "--resume")
        if msg := finished_run(resume, cfg.tracking.tracking_uri):
            out.print(msg, markup=False, highlight=False)
            return
    resume = check_run_inputs(cfg, resume)  # before Prefect, MLflow, workers or Ray start
    err.print(f"checked: {check_prompts(cfg)}", markup=False, highlight=False)
    train = importlib.import_module("flows.train")
    _no_user_error_tracebacks()
    _terminate_cleanly()
    _sync_quietly(cfg.tracking.tracking_uri)
    err.print(starting_line(cfg, resume), markup=False, highlight=False)
    result = train.tlt_train(config=cfg, resume=resume)
    for line in closing_lines(result, cfg):
        out.print(line, markup=False, highlight=False)
    _exit_if_unsent(result["run_id"], cfg.tracking.tracking_uri)


UNSENT_EXIT = 3  # the run finished, but MLflow does not hold all of it yet (see `tlt tracking sync`)


def _sync_quietly(uri: str | None) -> None:
    """Send what earlier runs' outages left in the spool; one line only when there was something."""
    results = tracking.sync_all(uri)
    if results:
        err.print(tracking.format_results(results), markup=False, highlight=False)


def _exit_if_unsent(run_id: str, uri: str | None) -> None:
    if msg := tracking.unsent_warning(run_id, uri):
        err.print(f"warning: {msg}", markup=False, highlight=False)
        raise typer.Exit(UNSENT_EXIT)


@tracking_app.command("sync")
def tracking_sync(uri: Optional[str] = typer.Option(None, "--uri", metavar="URI", help="Tracking URI of the runs' store (default: "
                                                    "MLFLOW_TRACKING_URI, else mlflow/mlflow.db)")) -> None:
    """Send every pending outage spool (mlflow/spool/, or $TLT_MLFLOW_SPOOL_DIR) to the store, oldest call
    first; print what was sent and what remains; exit 3 while calls remain."""
    if uri:  # the flag wins over the environment (elsewhere MLFLOW_TRACKING_URI wins over the config)
        os.environ["MLFLOW_TRACKING_URI"] = uri
    results = tracking.sync_all(uri)
    out.print(tracking.format_results(results), markup=False, highlight=False)
    if any(r.left for r in results):
        raise typer.Exit(UNSENT_EXIT)


class _UserErrorFilter(logging.Filter):
    """Prefect logs a failed task or flow with its traceback; for a UserError the message is the
    whole story (main() prints it once more, last, and exits 2)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def _no_user_error_tracebacks() -> None:
    loggers = [logging.getLogger()] + [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    for handler in {h for lg in loggers for h in lg.handlers}:
        handler.addFilter(_UserErrorFilter())


@drafter_app.command("warmstart")
def drafter_warmstart(config: Path, set_: Optional[list[str]] = SetOpt,
                      export: Optional[Path] = typer.Option(None, "--export", metavar="DIR", help="Also write the warm-started "
                                                            "drafter as an EAGLE-3 directory (e.g. for bench/rollout.py "
                                                            "--drafter, or vLLM)"),
                      force: bool = typer.Option(False, "--force", help="Replace a non-empty --export directory")) -> None:
    """Warm-start the drafter on target responses; prints accept length before and after."""
    from tlt.drafter.eagle3 import export_eagle3  # deferred: torch
    from tlt.pipeline import Pipeline  # deferred: torch, transformers

    cfg = _load(config, set_)
    env_defaults()
    check_run_inputs(cfg)
    if export is not None and not force:
        check_empty_target(export, "--export", "pass --force to replace it")
    pipe = Pipeline(cfg)
    try:
        pipe.validate_data()
        pipe.prepare()
        if pipe.drafter is None:
            raise UserError("drafter warmstart needs rollout.drafter: eagle (this config uses the model-free n-gram "
                            "drafter); drop the override or set rollout.drafter=eagle")
        summary = pipe.warmstart()
        out.print(summary.model_dump_json(indent=2))
        if export is not None:
            export_eagle3(pipe.drafter, pipe.model.config, export, force=force)
            out.print(f"exported the warm-started drafter to {export}")
    finally:
        pipe.close()


app.command("export")(export)


@app.command("compare")
def compare(run_ids: Optional[list[str]] = typer.Argument(None, metavar="RUN_ID...", show_default=False),
            experiment: Optional[str] = typer.Option(None, "--experiment", metavar="NAME",
                                                     help="Compare the newest runs of this experiment"),
            out_png: Optional[Path] = typer.Option(None, "--out", metavar="PNG", help="Write the comparison plot (PNG)")) -> None:
    """Compare runs: accuracy, reward, held-out and live accept lengths, rollout and step tokens/s, step
    time, the drafter's refreshes and share of the step (names: docs/tracking.md)."""
    from tlt.compare import compare_command  # deferred: matplotlib, pandas

    if out_png is not None and not out_png.parent.is_dir():
        raise UserError(f"--out '{out_png}': the folder '{out_png.parent}' does not exist; create it or choose "
                        "another path")
    print(compare_command(run_ids or [], experiment=experiment, out=out_png))


@app.command("deploy")
def deploy(config: Path = DeployConfigArg, set_: Optional[list[str]] = SetOpt) -> None:
    """Register tlt-train/manual and tlt-train/retrain (cron from deploy.cron) with the Prefect API."""
    cfg = _load(config, set_)
    env_defaults()
    check_run_inputs(cfg)
    ids = importlib.import_module("flows.deploy").apply_deployments(cfg)
    out.print(f"registered tlt-train/manual and tlt-train/retrain (cron '{cfg.deploy.cron}'): {', '.join(ids)}")
    out.print("run them with: tlt schedule " + str(config))


@app.command("schedule")
def schedule(config: Path = DeployConfigArg, set_: Optional[list[str]] = SetOpt,
             limit: Optional[int] = typer.Option(None, metavar="N", help="Concurrent runs")) -> None:
    """Register the deployments and execute their runs here: those triggered from the Prefect UI and
    those of the cron schedule (deploy.cron). Runs until stopped."""
    cfg = _load(config, set_)
    env_defaults()
    check_run_inputs(cfg)
    importlib.import_module("flows.deploy").serve_deployments(cfg, limit=limit)


@app.command("serve", hidden=True)
def serve(config: Path = DeployConfigArg, set_: Optional[list[str]] = SetOpt,
          limit: Optional[int] = typer.Option(None, metavar="N", help="Concurrent runs")) -> None:
    """The former name of `tlt schedule` (kept so that scripts keep working)."""
    err.print("warning: `tlt serve` is now `tlt schedule` (it executes Prefect deployments; serving a model is "
              "`vllm serve`, see docs/export.md); `tlt serve` will be removed.", markup=False, highlight=False)
    schedule(config, set_, limit)


@app.command("ui")
def ui(prefect_port: int = typer.Option(4200, metavar="PORT"), mlflow_port: int = typer.Option(5000, metavar="PORT"),
       host: str = typer.Option("127.0.0.1", metavar="HOST")) -> None:
    """Start the Prefect server and the MLflow UI (Ctrl-C or SIGTERM stops both)."""
    env_defaults()
    run_uis(host, prefect_port, mlflow_port)


def main() -> None:
    command = typer.main.get_command(app)
    plain_arguments(command)
    try:
        rc = command(standalone_mode=False)  # returns Exit codes instead of raising in this mode
        if rc in (130, 143):  # interrupted (Prefect turns SIGTERM into a crashed flow run, then 130)
            err.print("interrupted; a `tlt run` continues with `--resume <run id>`", highlight=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except UserError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt) as e:
        if _sigterm_received or _by_sigterm(e):
            err.print("stopped by SIGTERM; continue with `tlt run CONFIG --resume <run id>`", highlight=False)
            sys.exit(143)
        err.print("interrupted; a `tlt run` continues with `--resume <run id>`", highlight=False)
        sys.exit(130)
    except Exception as e:  # usage errors (typer's vendored click) come through here in standalone_mode=False
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
