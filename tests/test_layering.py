"""Architecture rules, checked by parsing imports (STYLE.md)."""
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
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if "mlflow" in _imports(p) and p.name != "tracking.py"]
    assert not bad, f"only tlt/tracking.py may import mlflow: {bad}"


def test_tlt_does_not_import_flows_or_tasks_statically():
    bad = [p for p in (ROOT / "tlt").rglob("*.py") if _imports(p) & {"flows", "tasks"}]
    assert not bad, f"tlt/ must not import flows/tasks at module level: {bad}"


def test_no_init_in_mlflow_dir():
    assert not (ROOT / "mlflow" / "__init__.py").exists()


def test_modules_stay_small():
    big = [(p, n) for p in (ROOT / "tlt").rglob("*.py") if (n := len(p.read_text().splitlines())) > 450]
    assert not big, f"split these by concern: {big}"
