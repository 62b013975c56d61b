"""`tlt bench`: the benchmark suites of bench/ as subcommands (`tlt bench list`, `tlt bench SUITE ...`)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer
from rich.console import Console

from tlt.cli_help import HELP

bench_app = typer.Typer(help="Benchmarks (ratios measured in one run).", **HELP)
out = Console(soft_wrap=True)


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
BENCH_HELPERS = {"harness", "render", "trl_grpo"}  # bench/ modules that are not suites


def bench_suites() -> dict[str, str]:
    """Suite name -> its one-line description: every bench/*.py with a main(), helpers excepted."""
    import ast

    out = {}
    for path in sorted(BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []:
        if path.stem in BENCH_HELPERS:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            out[path.stem] = (ast.get_docstring(tree) or "").strip().splitlines()[0] if ast.get_docstring(tree) else ""
    return out


@bench_app.command("list")
def bench_list() -> None:
    """The benchmark suites; run one with `tlt bench SUITE CONFIG ...` (`tlt bench SUITE --help` lists its options)."""
    for name, doc in bench_suites().items():
        out.print(f"{name:<14} {doc}", highlight=False, markup=False)


def _bench_command(name: str):
    def command(ctx: typer.Context) -> None:
        from tlt.services import env_defaults  # the shared defaults (offline, project-local caches)

        env_defaults()
        sys.path.insert(0, str(BENCH_DIR))
        harness = importlib.import_module("harness")  # deferred: numpy, and the suites pull in torch
        harness.load(name).main(list(ctx.args))
    return command


for _name, _doc in bench_suites().items():  # `tlt bench SUITE ARGS...` passes ARGS to bench/SUITE.py's parser
    bench_app.command(_name, help=f"{_doc} (options: tlt bench {_name} --help)", add_help_option=False,
                      context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(_bench_command(_name))
