"""Load a bench/ script as a module (bench/ is scripts, not a package) for the tests that call it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """bench/<name>.py as a module named bench_<name> (bench/harness.py's loader, so a suite and its
    test share one module object)."""
    spec = importlib.util.spec_from_file_location("bench_harness_loader", ROOT / "bench" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness.load(name)
