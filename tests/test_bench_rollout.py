"""bench/rollout.py on conf/smoke.yaml (tiny random model, n-gram and EAGLE-3 drafters): the JSON
carries the honest accept lengths and the vocabulary coverage next to the rows. No timing asserts."""
from pathlib import Path

import pytest
from bench_scripts import load_bench

from tlt.config import load_config
from tlt.drafter.model import build_drafter
from tlt.drafter.eagle3 import export_eagle3
from tlt.models import load_target

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.mark.parametrize("kind", ["ngram", "eagle"])
def test_rollout_bench_reports_accept_and_coverage(tmp_path, kind):
    bench = load_bench("rollout")
    cfg = load_config(ROOT / "conf/smoke.yaml", ["drafter.warmstart_eval_prompts=2", "drafter.draft_vocab_size=64"])
    model, tok = load_target(cfg.model)
    drafter_dir = None
    if kind == "eagle":
        drafter_dir = tmp_path / "drafter"
        export_eagle3(build_drafter(model, cfg.drafter), model.config, drafter_dir)
    res = bench.run_bench(cfg, str(drafter_dir) if drafter_dir else None, batches=(1, 2), max_new_tokens=6, reps=1,
                          grpo=False, model_and_tokenizer=(model, tok), prompts="task", row_prompts=4)
    assert res["greedy_identical"] and [(r["batch"], r["prompts"]) for r in res["rows"]] == [(1, 4), (2, 4)]
    for k in ("accept_len_greedy", "accept_len_sampled", "accept_len_sampled_point_mass"):
        assert 1.0 <= res[k] <= 5.0, (k, res[k])
    assert 0.0 <= res["vocab_coverage"] <= 1.0 and res["accept_strategy"] == "chain4"
    if kind == "ngram":
        assert res["vocab_coverage"] == 1.0
