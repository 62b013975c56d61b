"""bench/rollout.py on conf/smoke.yaml (tiny random model, n-gram and EAGLE-3 drafters): the JSON
carries the honest accept lengths and the vocabulary coverage next to the rows. No timing asserts."""
from pathlib import Path

import pytest
from bench_scripts import load_bench

from tlt.config import load_config
from tlt.corpus import vocab_coverage
from tlt.drafter.eagle3 import export_eagle3, load_eagle3
from tlt.drafter.model import build_drafter
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine
from tlt.rollout.acceptance import heldout_accept

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
    # the reported accept length is tlt's one definition on the config's held-out prompts, tuner off, the
    # configured eval strategy: the same figure measured here independently of the bench
    drafter = load_eagle3(drafter_dir, model).eval() if drafter_dir else None
    r = cfg.rollout.model_copy(update={"drafter": "eagle" if drafter is not None else "ngram", "tuner": False})
    engine = RolloutEngine(model, r, eos_token_ids(tok, model), tok.pad_token_id, drafter=drafter)
    held = bench.prompts_for(cfg, tok, "task", cfg.drafter.warmstart_eval_prompts)
    greedy = heldout_accept(engine, held, cfg, 0.0)
    assert res["accept_len_greedy"] == greedy.accept_len and res["accept_strategy"] == cfg.drafter.eval_strategy.name
    depth = cfg.drafter.eval_strategy.depth
    for k in ("accept_len_greedy", "accept_len_sampled", "accept_len_sampled_point_mass"):
        assert 1.0 <= res[k] <= depth + 1, (k, res[k])  # tokens per verify pass: accepted <= drafted
    reduced = drafter is not None and drafter.draft_vocab_size < drafter.vocab_size
    assert reduced == (kind == "eagle")
    assert res["vocab_coverage"] == vocab_coverage(drafter.t2d if reduced else None, greedy.responses)
    if kind == "ngram":
        assert res["vocab_coverage"] == 1.0


def test_a_warmstart_drafter_reruns_from_a_clone(tmp_path):
    """`--drafter warmstart`: the result names a drafter any clone makes again (the config's warm-start,
    cached by its inputs), not a folder of one machine's run."""
    bench = load_bench("rollout")
    cfg = load_config(ROOT / "conf/smoke.yaml")
    a, b = bench.warmstarted_drafter(cfg, tmp_path / "a"), bench.warmstarted_drafter(cfg, tmp_path / "b")
    assert (Path(a) / "model.safetensors").read_bytes() == (Path(b) / "model.safetensors").read_bytes()
    res = bench.main([str(ROOT / "conf/smoke.yaml"), "--drafter", "warmstart", "--batches", "1", "--max-new-tokens",
                      "4", "--reps", "1", "--no-grpo", "--row-prompts", "2", "--prompts", "task",
                      "--set", "drafter.warmstart_eval_prompts=2", "--json", str(tmp_path / "r.json")])
    assert res["drafter"] == "warmstart" and "--drafter warmstart" in res["command"]
    assert res["greedy_identical"]
