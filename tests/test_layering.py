"""Architecture rules, checked by parsing imports: tlt/ never imports prefect, only tlt/tracking imports mlflow,
files and functions stay small."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_tlt_never_imports_prefect():
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if "prefect" in _imports(p)]
    assert not bad, f"tlt/ must not import prefect: {bad}"


def test_only_tracking_imports_mlflow():
    tracking = ROOT / "tlt" / "tracking"
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if "mlflow" in _imports(p) and not p.is_relative_to(tracking)]
    assert not bad, f"only tlt/tracking/ may import mlflow: {bad}"
    assert "mlflow" not in _imports(tracking / "base.py"), "tlt/tracking/base.py (NullTracker) stays mlflow-free"


def test_only_cluster_imports_ray():
    """ray is an optional extra (`.[ray]`): only tlt/cluster/ imports it; the pipeline reaches it
    through a deferred `from tlt.cluster import ...` when cluster.backend is ray."""
    cluster = ROOT / "tlt" / "cluster"
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if "ray" in _imports(p) and not p.is_relative_to(cluster)]
    assert not bad, f"only tlt/cluster/ may import ray: {bad}"


def test_tlt_does_not_import_flows_or_tasks_statically():
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if _imports(p) & {"flows", "tasks"}]
    assert not bad, f"tlt/ must not import flows/tasks at module level: {bad}"


def test_no_init_in_mlflow_dir():
    assert not (ROOT / "mlflow" / "__init__.py").exists()


SOURCES = ("tlt", "flows", "tasks", "bench")


def _sources():
    return [p for d in SOURCES for p in (ROOT / d).rglob("*.py")]


def test_modules_stay_small():
    big = [(p, n) for p in _sources() if (n := len(p.read_text().splitlines())) > 400]
    assert not big, f"split these by concern (400 lines at most): {big}"


def test_functions_stay_short():
    """A function reads on one screen: 50 lines at most (docstring and decorators' arguments included)."""
    long = [(f"{p.relative_to(ROOT)}:{n.lineno} {n.name}", n.end_lineno - n.lineno + 1)
            for p in _sources()
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 50]
    assert not long, f"split these: {long}"


def _tlt_imports(path: Path) -> set[str]:
    """Full names of the tlt modules `path` imports, function-level (lazy) imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("tlt.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("tlt."):
            names.add(node.module)
    return names


def test_drafter_does_not_reach_up_into_rollout():
    """rollout -> drafter (the engine runs a drafter, workers build one) points one way: the drafter
    package (model, training, buffer, refresh, spot trainer) never uses the rollout engine; the
    warm-start, which needs both, lives above them (tlt/warmstart.py, tlt/corpus.py)."""
    up = ("tlt.rollout", "tlt.warmstart", "tlt.corpus", "tlt.pipeline", "tlt.rl")
    bad = {p.name: sorted(m for m in _tlt_imports(p) if m.startswith(up)) for p in (ROOT / "tlt/drafter").rglob("*.py")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"tlt/drafter must not import these: {bad}"


def test_no_attribute_probes_on_engine_or_refresher():
    """The engine and the refresher are typed Protocols (tlt/rl/step.py): code calls what they
    declare instead of probing with hasattr/getattr."""
    probes = []
    for p in (ROOT / "tlt").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr") \
                    and n.args and any(w in ast.unparse(n.args[0]) for w in ("engine", "refresher")):
                probes.append(f"{p.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert not probes, probes
