"""bench/baselines.py (the always and static arms) on tiny settings: the arms' configs, the static table's
sweep on a tiny torch engine, the fixed schedule it installs, and bench/rollout.py's GRPO arms on the smoke
recipe. No timing assertions (which depth wins on a shared machine is not asserted)."""
from pathlib import Path

import pytest
from bench_scripts import load_bench

from tlt.config import RolloutConfig, SpecStrategy, load_config
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.rollout.tuner import PLAIN, StrategyTuner

ROOT = Path(__file__).resolve().parents[1]
baselines = load_bench("baselines")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_arm_configs():
    cfg = load_config(ROOT / "conf" / "smoke.yaml")
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert baselines.every_batch(cfg) == max(batch, cfg.eval.batch_size)
    always = load_config(ROOT / "conf" / "smoke.yaml", baselines.overrides("always", cfg)).rollout
    assert always.spec and not always.tuner and always.guard_patience == 0 and always.spec_patience == 0
    assert always.spec_threshold >= batch
    static = cfg.rollout.model_copy(update=baselines.config_update("static", cfg))
    assert static.tuner and static.spec_threshold == baselines.every_batch(cfg) and static.guard_patience == 0
    with pytest.raises(ValueError, match="unknown baseline"):
        baselines.overrides("sometimes", cfg)


def test_static_tuner_is_a_fixed_table():
    tuner = StrategyTuner.static([1, 2, 5, 21], [3, 2, 0, 1])
    assert [tuner.choose(b).depth for b in (1, 3, 8, 40)] == [3, 2, 0, 1]
    assert tuner.choose(8) == PLAIN and tuner.epsilon == 0.0
    with pytest.raises(ValueError, match="one depth"):
        StrategyTuner.static([1, 2], [1])


def test_sweep_times_every_depth_per_tier_and_installs_the_best():
    model = tiny_model("llama", layers=2, hidden=64, vocab=64, seed=1)
    cfg = RolloutConfig(max_new_tokens=6, spec_threshold=4, tuner=True, guard_patience=0,
                        strategy=SpecStrategy(depth=2, topk=1, tokens=2), drafter="ngram")
    engine = RolloutEngine(model, cfg, eos_ids=[], pad_id=0, tuner=StrategyTuner.from_config(cfg))
    prompts = [[5, 6, 7, 5, 6], [9, 8, 9, 8], [3, 4, 3]]
    table = baselines.sweep(engine, prompts, [1, 2, 5], max_depth=2, max_new_tokens=6)
    assert table["buckets"] == [1, 2, 5] and len(table["tokens_per_s"]) == 3
    assert all(len(row) == 3 and min(row) > 0 for row in table["tokens_per_s"])
    assert table["depths"] == [row.index(max(row)) for row in table["tokens_per_s"]]
    assert engine.cfg is cfg  # fixed_strategy left the engine as it was
    baselines.install_static(engine, table)
    out = engine.generate(prompts, max_new_tokens=6, temperature=0.0, spec=True)
    played = {int(b): {int(a) for a in arms} for b, arms in out.stats.strategy.items()}
    assert all(arms == {0} for arms in played.values())  # one arm per tier: the table's


@pytest.mark.slow
def test_rollout_bench_grpo_arms_on_smoke():
    from tlt.models import eos_token_ids, load_target

    bench = load_bench("rollout")
    cfg = load_config(ROOT / "conf" / "smoke.yaml", ["rollout.max_new_tokens=6"])
    model, tok = load_target(cfg.model)
    res = bench.grpo_arms(cfg, model, tok, None, "task", 1, eos_token_ids(tok, model), tok.pad_token_id)
    for key in ("rollout_s_plain", "rollout_s_spec", "rollout_s_always", "rollout_s_static"):
        assert res[key] > 0, key
    assert res["speedup_vs_always"] == pytest.approx(res["rollout_s_always"] / res["rollout_s_spec"])
    assert res["speedup_vs_static"] == pytest.approx(res["rollout_s_static"] / res["rollout_s_spec"])
    table = res["static_table"]
    assert table["buckets"] == sorted(cfg.rollout.tuner_buckets)
    assert all(0 <= d <= cfg.rollout.strategy.depth for d in table["depths"])


def test_paired_interval_and_ratios_by_hand():
    paired = load_bench("paired")
    ci = paired.interval([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["ci_high"] - 2.0 == pytest.approx(4.302653 * 1.0 / 3 ** 0.5, rel=1e-5)  # t(0.975, 2) * sd / sqrt(n)
    assert paired.interval([5.0])["ci_low"] is None
    step = lambda p, a, s, ad: {"plain": {"rollout_s": p, "s_per_token": p / 10}, "always": {"rollout_s": a,  # noqa: E731
                                "s_per_token": a / 10}, "static": {"rollout_s": s, "s_per_token": s / 20},
                                "adaptive": {"rollout_s": ad, "s_per_token": ad / 10}}
    res = paired.summarize([step(4.0, 2.0, 4.0, 2.0), step(6.0, 6.0, 3.0, 3.0)])
    assert res["paired_rollout_ratio"]["always"]["mean"] == pytest.approx((2.0 + 1.0) / 2)
    assert res["paired_token_ratio"]["static"]["mean"] == pytest.approx((0.4 / 0.2 + 0.6 / 0.15) / 2)
    assert res["paired_adaptive_vs_always"] == pytest.approx((1.0 + 2.0) / 2)
    assert res["paired_adaptive_vs_plain"] == pytest.approx(2.0)
    assert res["paired_regret_s"] is None  # no bandit regret recorded
    steps = [step(4.0, 2.0, 4.0, 2.0), step(6.0, 6.0, 3.0, 3.0)]
    steps[0]["adaptive"]["regret_s"], steps[1]["adaptive"]["regret_s"] = 0.5, 1.25  # cumulative: the last one
    assert paired.summarize(steps)["paired_regret_s"] == 1.25


@pytest.mark.slow
def test_paired_mode_on_smoke(tmp_path):
    bench = load_bench("rl_step")
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--paired", "--steps", "2", "--sweep-tokens", "4",
                      "--json", str(tmp_path / "p.json"), "--out-dir", str(tmp_path / "runs")])
    assert res["mode"] == "paired" and len(res["paired_steps"]) == 2
    for step in res["paired_steps"]:
        assert set(step) == {"plain", "always", "static", "adaptive"}
        assert all(v["tokens"] > 0 and v["rollout_s"] > 0 for v in step.values())
        assert step["plain"]["enabled_share"] == 0 and step["always"]["enabled_share"] > 0
        assert isinstance(step["adaptive"]["regret_s"], float)  # the run's bandit's, summed over buckets
    assert res["paired_rollout_ratio"]["adaptive"]["n"] == 2
    assert res["paired_regret_s"] == res["paired_steps"][-1]["adaptive"]["regret_s"]
    # smoke's spec_threshold is a number (8): the run decodes with it; the prior is the warm-start's measured one
    assert res["paired_priced"]["tail_threshold"] == 8 and res["paired_priced"]["prior_accept_rate"] is not None
    assert res["paired_rollout_ratio"]["always"]["ci_low"] is not None  # two steps: an interval


def test_paired_results_render_apart_from_the_rl_step_table():
    render = load_bench("render")
    ratio = {"mean": 1.1, "ci_low": 0.9, "ci_high": 1.3, "n": 3}
    paired = {"command": "python bench/rl_step.py conf/longtail.yaml --paired", "mode": "paired", "steps": 3,
              "paired_rollout_ratio": {"always": ratio, "static": ratio, "adaptive": {**ratio, "mean": 0.95}},
              "paired_token_ratio": {"adaptive": {**ratio, "mean": 1.02}},
              "paired_priced": {"prior_accept_rate": 0.4567, "tail_threshold": 4}, "paired_regret_s": 3.21}
    block = render.paired_block({"p": paired}, "results")
    assert "[`conf/longtail.yaml`](results/p.json), torch engine | 3 | 1.10× (95 % CI 0.90–1.30)" in block
    assert "0.95×" in block and "| 1.02× (95 % CI 0.90–1.30) | 0.46 / draft / ≤ 4 | 3.2 s |" in block
    none = {**paired, "paired_priced": {"prior_accept_rate": 0.2, "tail_threshold": 0}, "paired_regret_s": None}
    assert "0.20 / draft / none (SD off) | — |" in render.paired_block({"p": none}, "results")
    assert "/ every batch |" in render.paired_block(
        {"p": {**paired, "paired_priced": {"prior_accept_rate": 0.9, "tail_threshold": 1 << 20}}}, "results")
    nocal = {**paired, "command": paired["command"] + " --set rollout.tuner_calibrate=false"}
    assert "(results/n.json), torch engine, no start-up calibration | 3 |" in render.paired_block({"n": nocal}, "results")
    on_vllm = {**paired, "command": paired["command"] + " --set rollout.backend=vllm"}
    assert "(results/v.json), vLLM | 3 |" in render.paired_block({"v": on_vllm}, "results")
    assert render.rl_step_block({"p": paired}, "results").startswith("Whole RL steps: not measured")


def test_vllm_rollout_results_render_arms_and_the_k0_tax():
    render = load_bench("render")
    r = {"command": "python bench/vllm_rollout.py conf/default.yaml --fit-epochs 40", "spec_threshold": 4,
         "greedy_identical": True, "k0_tax": 1.25, "rollout_s_vllm_k0": 5.0, "rollout_s_vllm_plain_engine": 4.0,
         "machine": "m", **{f"rollout_s_{e}_{a}": v for e in ("vllm", "torch")
                           for a, v in (("tail", 2.0), ("plain", 2.2), ("always", 3.0), ("static", 2.1))}}
    block = render.vllm_block({"v": r}, "results")
    assert "| [`conf/default.yaml`](results/v.json) | vLLM | ≤ 4 | 1.10× / 1.50× / 1.05× | yes | 5.00 s vs 4.00 s: 0.80× of plain |" \
        in block
    assert "| torch engine | ≤ 4 | 1.10× / 1.50× / 1.05× | yes | — |" in block
    assert "the K = 0 tax) | 0.80× of plain |" in render.status_block({"v": r}, "results")
    assert render.vllm_block({}, "results").endswith("not measured in committed results.")
