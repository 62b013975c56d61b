"""bench/results/: every committed result carries its provenance header and no machine paths, and
the tables rendered from them (README.md status, docs/performance.md) agree with the files."""
import json
import re
from pathlib import Path

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
render = load_bench("render")
harness = load_bench("harness")
FILES = sorted((ROOT / "bench" / "results").glob("*.json"))


def test_results_are_small_with_a_provenance_header():
    assert FILES, "bench/results/ holds the committed results"
    for path in FILES:
        assert path.stat().st_size < 256 * 1024, path
        res = json.loads(path.read_text())
        assert list(res)[:len(harness.HEADER)] == list(harness.HEADER), path  # the header comes first
        assert res["command"].startswith("python bench/") and re.fullmatch(r"[0-9a-f]{7,40}", res["commit"]), path
        assert re.fullmatch(r"[0-9a-f]{12}", res["config_hash"]), path


def test_results_hold_no_machine_paths():
    for path in FILES:
        text = path.read_text()
        assert not re.search(r"/(work|home|tmp|root|Users)/", text), f"{path.name} holds a machine path"


def test_rendered_pages_agree_with_the_results():
    stale = render.stale()
    assert not stale, f"run `python bench/render.py`: {sorted(stale)} disagree with bench/results/"


def test_a_changed_number_makes_the_pages_stale():
    results = render.load_results()
    name = next(n for n, r in results.items() if render.suite(r) == "precision")
    results[name] = {**results[name], "step_speedup": results[name]["step_speedup"] + 1.0}
    assert set(render.stale(results)) == {"README.md", "docs/performance.md"}


def test_every_block_is_rendered_somewhere():
    pages = "".join((ROOT / page).read_text() for page in render.PAGES)
    for name in render.BLOCKS:
        assert f"<!-- results:{name}:start -->" in pages, name


def test_config_hash_follows_the_resolved_config():
    smoke = str(ROOT / "conf" / "smoke.yaml")
    h = harness.config_hash(smoke, [])
    assert h == harness.config_hash(smoke, []) and h != harness.config_hash(smoke, ["rl.steps=7"])
    assert harness.config_hash(smoke, ["rl.steps=7"]) == harness.config_hash(smoke, ["rl.steps=7"])


def test_parity_block_renders_what_precision_parity_writes():
    """The keys bench/precision_parity.py's summarize writes are the keys the parity table reads."""
    import numpy as np

    parity_bench = load_bench("precision_parity")
    records = [{"rewards": [1.0, 0.0, 1.0, 1.0], "group_index": [0, 0, 1, 1], "reward_mean": 0.75}]
    arm = {"records": records, "accuracy_before": 0.25, "accuracy_after": 0.5, "correct_after": [1.0, 0.0]}
    res = {"command": "python bench/precision_parity.py conf/smoke.yaml", "steps": 1,
           **parity_bench.summarize({0: {"fp32": arm, "bf16": arm}})}
    table = render.parity_block({"parity_smoke": res}, "results")
    assert "(results/parity_smoke.json)" in table and "0.25 → 0.50 / 0.25 → 0.50" in table
    assert np.isclose(res["parity_p_value"], 1.0) and "p = 1.000" in table
