"""vLLM backend, per batch-size tier: the spec guard's drafter probe after every load, the guard's
run-time switch-off, and the bandit over draft lengths (tlt.rollout.guard, tlt.rollout.vllm_engine.tiers).
Tiny tied-embedding target as in test_vllm_backend (fp32), one engine for the module:
  - the engine's drafter passes the probe at start and after a reload; an export whose weights were
    scaled or zeroed on disk raises DrafterMismatch, and a correct export afterwards loads and passes;
  - with the tuner on, the K chosen per tier changes vLLM's schedule table between rollouts (no
    rebuild): each rollout drafts exactly to its tier's depth (vLLM's per-position draft counts),
    every arm (K = 1..3 and plain) is played and rewarded, greedy outputs stay equal to SD off;
  - the guard: a drafter whose drafts are all rejected trips it in the tail's tier; the next
    rollout drafts nothing there and a new drafter re-arms it.
"""
from __future__ import annotations

import pytest
import torch

from tlt.config import SpecStrategy
from tlt.rollout.acceptance import measure_accept
from tlt.versions import bump, write_weights

from test_vllm_backend import EOS, K, MAX_NEW, VLLM_PY, _few_long, _prompts, _rollout_cfg, _tied_target

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.models import tiny_tokenizer
    from tlt.rollout.vllm_engine.backend import VllmRolloutEngine

    target, prompts = _tied_target(), _prompts()
    torch.manual_seed(0)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=256, ttt_steps=K)).eval()
    engine = VllmRolloutEngine(target, _rollout_cfg().model_copy(update={"tuner": True, "tuner_buckets": [1, 2, 3], "guard_patience": 0}), EOS, 0, drafter=drafter,
                               tokenizer=tiny_tokenizer(), run_dir=tmp_path_factory.mktemp("run"), max_model_len=64,
                               max_num_seqs=16)
    yield target, drafter, engine, prompts
    engine.close()


def _corrupting(real, how: str):
    """export_eagle3 that damages the weights it wrote (as a bad disk or a broken writer would)."""
    from safetensors.torch import load_file, save_file

    def export(drafter, target_config, out_dir, **kw):
        path = real(drafter, target_config, out_dir, **kw)
        tensors = load_file(str(path / "model.safetensors"))
        name = "midlayer.mlp.down_proj.weight"
        tensors[name] = tensors[name] * 0.5 if how == "scaled" else torch.zeros_like(tensors[name])
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    return export


@pytest.mark.parametrize("how", ["scaled", "zeroed"])
def test_probe_catches_a_corrupted_drafter_export(setup, monkeypatch, how):
    from tlt.rollout.vllm_engine import backend as vllm_backend
    from tlt.rollout.guard import DrafterMismatch

    _, drafter, engine, _ = setup
    assert engine.probe_metrics["spec/probe_error"] < 1e-4  # at start: the exported drafter, fp32
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.01)  # a new drafter (a refresh), so that sync sends it
    bump(drafter)  # as a refresh does: the engines sync by version
    monkeypatch.setattr(vllm_backend, "export_eagle3", _corrupting(vllm_backend.export_eagle3, how))
    with pytest.raises(DrafterMismatch, match="not the one just exported"):
        engine.sync()
    monkeypatch.undo()
    metrics = engine.sync()  # the change was not taken as sent: a correct export now loads and passes
    assert metrics["rollout/vllm_rebuilds"] == 0 and engine.probe_metrics["spec/probe_error"] < 1e-4
    print(f"probe after a good reload: {engine.probe_metrics}")


def _tail_prompts(engine, target):
    t = engine.threshold()
    prompts, stops = _few_long(target, 8, t)  # a tail of t long answers (batch size t: tier [t, t])
    return prompts, stops


def test_bandit_sets_the_depth_per_tier_between_rollouts(setup):
    target, _, engine, _ = setup
    prompts, stops = _tail_prompts(engine, target)
    engine.eos_ids = stops
    try:
        ref = engine.generate(prompts, temperature=0.0, spec=False).response_ids
        played = []
        for _ in range(5):
            out = engine.generate(prompts, temperature=0.0)
            assert out.response_ids == ref  # lossless whatever the arm
            depth = dict(engine.last_tiers)[2]  # the tier of batch size 2 (buckets 1, 2, 3)
            drafted = out.stats.drafted_pos + [0] * K
            assert all(d > 0 for d in drafted[:depth]) and not any(drafted[depth:K]), (depth, drafted)
            played.append(depth)
    finally:
        engine.eos_ids = EOS
    print(f"depth per rollout in the tier of batch size 2: {played}; rewards {engine.tuner.values(1)}")
    assert played[:4] == [1, 2, 3, 0]  # untried arms first, in order; the schedule followed each
    assert all(v is not None for v in engine.tuner.values(1)) and engine.rebuilds == 0


def test_guard_trips_on_a_useless_drafter_and_rearms(setup):
    """A drafter whose every draft is rejected (zero LM head: accept length 1) costs more per step
    than plain decoding (K drafter forwards and K + 1 verified tokens instead of one drafter
    forward and one token): the guard switches the tail's tier off within a few rollouts (timed
    steps, so not at an exact rollout), the next rollout drafts nothing there, a new drafter re-arms."""
    from tlt.metrics import rollout_metrics
    from tlt.rollout.guard import SpecGuard

    target, drafter, engine, _ = setup
    prompts, stops = _tail_prompts(engine, target)
    head = drafter.lm_head.weight.detach().clone()
    tuner, cfg, engine.guard = engine.tuner, engine.cfg, SpecGuard([1, 2, 3], patience=2)
    engine.tuner, engine.eos_ids, engine.trace = None, stops, True  # the fixed chain: every rollout drafts
    engine.cfg = cfg.model_copy(update={"guard_patience": 2})
    try:
        with torch.no_grad():
            drafter.lm_head.weight.zero_()
        bump(drafter)
        outs = []
        while not engine.guard.off[1] and len(outs) < 6:
            outs.append(engine.generate(prompts, temperature=0.0))
        print(f"tripped after {len(outs)} rollouts; (accept length, break-even) per tier {engine.guard.last}")
        assert engine.guard.off[1] and outs[0].stats.accept_len == 1.0
        off = engine.generate(prompts, temperature=0.0)
        assert rollout_metrics(off)["spec/guard_tripped"] >= 1 and off.response_ids == outs[0].response_ids
        assert sum(d for n, d in off.stats.vllm["trace"] if n == 2) == 0  # nothing drafted at batch size 2
        write_weights(drafter, {"lm_head.weight": head}, strict=False)  # a new drafter: synced, probed, re-armed
        again = engine.generate(prompts, temperature=0.0)
        assert again.stats.spec_row_passes > 0 and rollout_metrics(again)["spec/guard_tripped"] == 0.0
    finally:
        engine.tuner, engine.eos_ids, engine.cfg, engine.trace = tuner, EOS, cfg, False
    assert len(outs[0].response_ids[0]) <= MAX_NEW


def test_every_tier_off_rebuilds_a_plain_engine_until_a_new_drafter(setup):
    """The K = 0 tax: an SD-built engine runs one drafter forward per step even where no tier drafts. When
    the guard has switched every tier off, the engine is rebuilt without SD (counted in
    rollout/vllm_rebuilds): SD calls then decode plain, same tokens; a new drafter rebuilds SD back in."""
    from tlt.rollout.guard import SpecGuard

    target, drafter, engine, _ = setup
    prompts, stops = _tail_prompts(engine, target)
    head = drafter.lm_head.weight.detach().clone()
    tuner, cfg, guard, rebuilds = engine.tuner, engine.cfg, engine.guard, engine.rebuilds
    engine.guard = SpecGuard([1], patience=1)  # one tier: tripping it switches every batch size off
    engine.tuner, engine.eos_ids = None, stops
    engine.cfg = cfg.model_copy(update={"guard_patience": 1})
    try:
        with torch.no_grad():
            drafter.lm_head.weight.zero_()
        bump(drafter)
        outs = []
        while engine.sd_built and len(outs) < 6:
            outs.append(engine.generate(prompts, temperature=0.0))
        assert not engine.sd_built and engine.rebuilds == rebuilds + 1 and engine.guard.tripped == 1
        plain = engine.generate(prompts, temperature=0.0)  # SD asked for, none possible: a plain engine
        assert plain.stats.vllm["drafts"] == 0 and plain.response_ids == outs[0].response_ids
        # a held-out accept length still measures the drafter: SD is built for the block, plain again after it
        rep = measure_accept(engine, prompts[:2], max_new_tokens=MAX_NEW, strategy=SpecStrategy(depth=1, topk=1, tokens=1))
        assert rep.passes > 0 and rep.accept_len >= 1.0 and not engine.sd_built
        assert engine.rebuilds == rebuilds + 3
        write_weights(drafter, {"lm_head.weight": head}, strict=False)
        metrics = engine.sync()
        assert engine.sd_built and metrics["rollout/vllm_rebuilds"] == rebuilds + 4 and engine.guard.tripped == 0
        again = engine.generate(prompts, temperature=0.0)
        assert again.stats.vllm["drafts"] > 0 and again.response_ids == outs[0].response_ids
    finally:
        engine.tuner, engine.eos_ids, engine.cfg, engine.guard = tuner, EOS, cfg, guard


def test_a_priced_threshold_of_zero_builds_the_engine_plain(setup):
    """`spec_threshold: auto` where SD cannot pay at the drafter's measured acceptance: the engine is rebuilt
    without SD (no K = 0 tax), a held-out accept length still measures the drafter, and a pricing at which
    SD pays builds it back (every rebuild counted)."""
    from tlt.rollout.breakeven import NO_BOUND, CostCurve

    target, _, engine, _ = setup
    prompts, stops = _tail_prompts(engine, target)
    buckets = sorted(engine.tuner.buckets)
    # a round of depth d costs 1 + 0.25 d plain steps: nothing pays at acceptance 0, everything at 1
    curve = CostCurve(buckets, [[0.01 * (1 + 0.25 * d) for d in range(K + 1)] for _ in buckets])
    saved = (engine.calibration, engine.cfg, engine.tuner.state(), engine.eos_ids)
    engine.calibration, engine.eos_ids = curve.summary(), stops
    engine.cfg = engine.cfg.model_copy(update={"spec_threshold": "auto"})
    if not engine.sd_built:  # an earlier test's guard may have left it plain
        engine._respec(engine.method)
    rebuilds = engine.rebuilds
    try:
        ref = engine.generate(prompts, temperature=0.0, spec=False)
        engine.set_accept_prior(0.0)
        assert engine.threshold() == 0 and not engine.sd_built and engine.rebuilds == rebuilds + 1
        plain = engine.generate(prompts, temperature=0.0)
        assert plain.stats.vllm["drafts"] == 0 and plain.response_ids == ref.response_ids
        rep = measure_accept(engine, prompts[:2], max_new_tokens=MAX_NEW, strategy=SpecStrategy(depth=1, topk=1, tokens=1))
        assert rep.passes > 0 and 1.0 <= rep.accept_len <= 2.0 and not engine.sd_built and engine.rebuilds == rebuilds + 3
        engine.set_accept_prior(1.0)
        assert engine.threshold() == NO_BOUND and engine.sd_built and engine.rebuilds == rebuilds + 4
        again = engine.generate(prompts, temperature=0.0)
        assert again.stats.vllm["drafts"] > 0 and again.response_ids == ref.response_ids
    finally:
        engine.calibration, engine.cfg, _, engine.eos_ids = saved
        engine.tuner.load_state(saved[2])
        if not engine.sd_built:
            engine._respec(engine.method)
