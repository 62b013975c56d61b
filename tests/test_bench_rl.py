"""bench/rl_step.py: the harness's parity statistics and rl_step's TRL plumbing as pure functions, and one
2-step run of the three tlt RL loops on conf/smoke.yaml with TRL skipped. No timing assertions."""
import json
from pathlib import Path

import pytest

from tlt.config import load_config
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
bench = load_bench("rl_step")
harness = load_bench("harness")


def _record(rewards, group_size=4):
    return {"rewards": rewards, "group_index": [i // group_size for i in range(len(rewards))]}


def test_parity_identical_curves_match():
    steps = [_record([1, 0, 0, 1, 0, 0, 0, 1]), _record([0, 1, 1, 1, 0, 0, 0, 0])]
    out = harness.parity(steps, steps)
    assert out["reward_curves_match"] and out["parity_p_value"] == 1.0
    assert out["parity_n_pairs"] == 4 and out["parity_mean_diff"] == 0.0


def test_parity_detects_a_shifted_curve():
    plain = [_record([0.0] * 16) for _ in range(3)]
    spec = [_record([1.0] * 16) for _ in range(3)]
    out = harness.parity(plain, spec)
    assert not out["reward_curves_match"] and out["parity_p_value"] < harness.ALPHA
    assert not out["welch_all_steps_match"]


def test_group_means_by_group_index():
    assert harness.group_means([1, 0, 1, 1], [0, 0, 1, 1]).tolist() == [0.5, 1.0]


def test_trl_batching_consumes_one_tlt_step():
    assert bench.trl_batching(8, 4, 8) == (8, 4)  # 32 completions = 8 per micro-batch x 4
    for prompts, g, micro in [(4, 2, 8), (3, 4, 8), (5, 3, 4)]:
        per_device, accum = bench.trl_batching(prompts, g, micro)
        assert per_device * accum == prompts * g and per_device <= micro


def test_trl_prompts_follow_tlt_sampler_and_template(tmp_path):
    from tlt.config import load_config
    from tlt.prompts import render_prompt
    from tlt.models import load_tokenizer
    from tlt.pipeline import Pipeline

    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path}"])
    pipe = Pipeline(cfg)
    pipe.validate_data()
    per_step = bench.write_trl_prompts(pipe.dataset.train, cfg, 2, tmp_path / "p.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * cfg.rollout.prompts_per_step == sum(map(len, per_step))
    tok = load_tokenizer(cfg.model)
    assert lines[0]["prompt"] == render_prompt(tok, per_step[0][0], cfg.data.instruction, cfg.data.system_prompt)


@pytest.mark.slow
def test_benchmark_smoke_two_steps(tmp_path):
    out_json = tmp_path / "bench.json"
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--steps", "2", "--no-trl", "--no-vllm", "--json",
                      str(out_json), "--out-dir", str(tmp_path / "runs")])
    saved = json.loads(out_json.read_text())
    for key in ("step_s_plain", "step_s_spec", "step_s_frozen", "step_s_trl", "speedup_vs_plain", "speedup_vs_trl",
                "accept_len_adaptive", "accept_len_frozen", "drafter_overhead_share", "reward_curves_match",
                "parity_test", "curves", "rollout_s_plain", "rollout_s_spec", "rollout_speedup",
                "rollout_share_plain", "amdahl_bound", "tokens_per_target_forward", "step_s_always", "step_s_static",
                "rollout_s_always", "rollout_s_static", "speedup_vs_always", "speedup_vs_static", "static_table"):
        assert key in saved, key
    assert res["speedup_vs_always"] == pytest.approx(res["step_s_always"] / res["step_s_spec"])
    assert res["speedup_vs_static"] == pytest.approx(res["step_s_static"] / res["step_s_spec"])
    assert len(res["static_table"]["depths"]) == len(res["static_table"]["buckets"])
    assert res["curves"]["always"]["spec_enabled_share"][-1] > 0  # the always arm speculates
    assert res["regret"]["always"] is None and res["regret"]["adaptive"] is not None  # the bandit's, tuner on only
    assert res["calibration"]["adaptive"]["can_pay"] and res["calibration"]["always"] is None
    # Amdahl: the step speedup bound from the rollout's share and speedup; 1 when SD does not change the rollout
    share, r = res["rollout_share_plain"], res["rollout_speedup"]
    assert 0.0 < share <= 1.0 and res["amdahl_bound"] == pytest.approx(1 / (1 - share + share / r))
    assert res["tokens_per_target_forward_plain"] > 1.0  # batched decoding: several rows per forward
    assert saved["step_s_trl"] is None and saved["trl"] is None
    ad = res["curves"]["adaptive"]  # the drafter's share of the adaptive run's step time, from its own records
    assert res["drafter_overhead_share"] == pytest.approx(sum(ad["update_drafter_s"]) / sum(ad["step_s"]))
    assert res["same_warmstart_drafter"] and res["same_prompts"]
    assert res["greedy_eval_identical"]  # greedy SD is exactly lossless
    assert res["reward_curves_match"] == (res["parity_p_value"] >= harness.ALPHA)  # the claim follows its test
    depth = load_config(ROOT / "conf" / "smoke.yaml").drafter.eval_strategy.depth
    for mode in ("adaptive", "frozen"):  # tokens per verify pass: 1 .. depth + 1 (accepted <= drafted)
        assert 1.0 <= res["eval"][mode]["accept_len"] <= depth + 1, mode
        assert res[f"accept_len_{mode}"] == res["eval"][mode]["accept_len"], mode
        assert res[f"rollout_accept_len_last_{mode}"] == res["curves"][mode]["accept_len"][-1], mode
    for mode in ("plain", "adaptive", "frozen", "always", "static"):
        assert len(res["curves"][mode]["reward_mean"]) == 2
    assert res["curves"]["plain"]["accept_len"] == [None, None]  # no SD in the plain run


def test_vllm_keys_merge_over_the_best_arms():
    arms = load_bench("rl_step_vllm")
    runs = {a: {"steps": [{"step_s": 9.0, "rollout_s": 5.0}, {"step_s": s, "rollout_s": r}], "rebuilds": 0.0,
                "guard_tripped": 0.0, "greedy_identical": True}
            for a, s, r in (("vllm_plain", 4.0, 2.0), ("vllm_spec", 3.0, 1.6), ("vllm_frozen", 3.5, 1.5))}
    runs["same_warmstart_drafter"] = True
    res = arms.merge({"step_s_plain": 6.0, "step_s_spec": 5.0, "step_s_frozen": 5.5, "trl": {"step_s": 12.0}}, runs)
    assert res["step_s_vllm_spec"] == 3.0 and res["rollout_s_vllm_plain"] == 2.0  # step 0 excluded
    assert res["rollout_speedup_vllm"] == pytest.approx(2.0 / 1.6)
    assert res["speedup_vllm_vs_torch_plain"] == 2.0 and res["speedup_vllm_vs_torch"] == pytest.approx(5.0 / 3.0)
    assert res["speedup_vs_trl"] == 4.0 and res["vllm_greedy_eval_identical"]  # over the best tlt step of any arm
    assert "step_s_vllm_always" not in res and "speedup_vllm_vs_always" not in res  # no baselines ran
    runs["vllm_always"] = {"steps": [{"step_s": 9.0, "rollout_s": 5.0}, {"step_s": 3.6, "rollout_s": 2.4}],
                           "rebuilds": 0.0, "guard_tripped": 0.0}
    runs["static_table"] = {"buckets": [1, 2], "depths": [2, 0]}
    res = arms.merge({"step_s_plain": 6.0, "step_s_spec": 5.0, "step_s_frozen": 5.5, "trl": None}, runs)
    assert res["step_s_vllm_always"] == 3.6 and res["rollout_s_vllm_always"] == 2.4
    assert res["speedup_vllm_vs_always"] == pytest.approx(3.6 / 3.0)
    assert res["rollout_speedup_vllm_vs_always"] == pytest.approx(2.4 / 1.6)
    assert res["static_table_vllm"]["depths"] == [2, 0] and "speedup_vllm_vs_static" not in res
    alone = arms.merge({"step_s_plain": 6.0, "step_s_spec": 5.0, "step_s_frozen": 5.5, "trl": {"step_s": 12.0}}, None)
    assert alone["speedup_vs_trl"] == pytest.approx(12.0 / 5.0) and "step_s_vllm_spec" not in alone


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(), reason="no vLLM venv (bench/vllm_venv.sh)")
def test_benchmark_vllm_arms_one_step(tmp_path):
    """bench/rl_step.py with its vLLM arms on the smoke recipe, one step: the keys, greedy identity
    on vLLM with SD forced on vs off, no engine rebuild."""
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--steps", "1", "--no-trl", "--json",
                      str(tmp_path / "bench.json"), "--out-dir", str(tmp_path / "runs")])
    for key in ("step_s_vllm_plain", "step_s_vllm_spec", "step_s_vllm_frozen", "rollout_s_vllm_plain",
                "rollout_s_vllm_spec", "rollout_speedup_vllm", "speedup_vllm_vs_torch_plain", "speedup_vllm_vs_torch"):
        assert res[key] > 0, key
    assert res["vllm_rebuilds"] == 0 and res["vllm_greedy_eval_identical"] and res["vllm_same_warmstart_drafter"]
    best = min(res[k] for k in ("step_s_plain", "step_s_spec", "step_s_frozen"))
    assert res["speedup_vllm_vs_torch"] == pytest.approx(best / min(res[f"step_s_vllm_{a}"] for a in
                                                                     ("plain", "spec", "frozen")))


def test_sd_needs_fewer_target_forwards_with_a_trained_drafter():
    """The deterministic core of the speedup claim: on the same prompts, greedy SD with a drafter
    trained on the target's own answers gives the same tokens in fewer target forwards than plain
    decoding (at batch 1, so each forward is one row's prefill, decode step or verify pass)."""
    import torch

    from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy
    from tlt.drafter.model import build_drafter
    from tlt.drafter.train import DrafterTrainer, collect_samples, fit
    from tlt.models import tiny_model
    from tlt.rollout.torch_engine.engine import RolloutEngine

    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = tiny_model("llama", layers=2, hidden=64, vocab=96, seed=3)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (8,), generator=g)]
        cfg = DrafterConfig(draft_vocab_size=0, lr=3e-3)
        drafter = build_drafter(model, cfg)
        rcfg = RolloutConfig(max_new_tokens=24, temperature=0.0, tuner=False, spec_threshold=1, draft_stop_below=0.0,
                             strategy=SpecStrategy(depth=4, topk=1, tokens=4))
        eng = RolloutEngine(model, rcfg, eos_ids=[2], pad_id=0, drafter=drafter)

        def run(spec: bool):
            eng.forward_calls = 0
            out = [eng.generate([p], spec=spec).response_ids[0] for p in prompts]
            return out, eng.forward_calls

        plain, plain_calls = run(False)
        samples = collect_samples(model, [p + r for p, r in zip(prompts, plain)], [len(p) for p in prompts],
                                  drafter.aux_layer_ids)
        fit(DrafterTrainer(drafter, cfg, model.get_output_embeddings().weight), samples, epochs=40, batch_tokens=512)
        spec, spec_calls = run(True)
    finally:
        torch.set_num_threads(old_threads)
    assert spec == plain  # lossless
    assert plain_calls == sum(len(r) for r in plain)  # plain: one forward per token (prefill gives the first)
    assert spec_calls < 0.8 * plain_calls, (spec_calls, plain_calls)
