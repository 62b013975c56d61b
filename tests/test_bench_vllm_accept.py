"""bench/vllm_accept.py without vLLM: its summary of vLLM's counters (hand-computed) and the bench
prompts (the recipe's held-out split rendered as the pipeline renders it). The vLLM run is in tests/test_vllm.py."""
from pathlib import Path

import pytest
from bench_scripts import load_bench

from tlt.config import load_config
from tlt.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
bench = load_bench("vllm_accept")


def _result(spec, baseline, drafts=4, accepted=6, per_pos=(3, 2, 1)):
    metrics = {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": 3 * drafts,
               "vllm:spec_decode_num_accepted_tokens": accepted,
               "vllm:spec_decode_num_accepted_tokens_per_pos": list(per_pos)}
    return {"spec": spec, "baseline": baseline, "metrics": metrics, "k": 3, "max_tokens": 4,
            "timing_s": {}, "versions": {"vllm": "x"}}


def test_summary_counts_tokens_per_verify():
    out = bench.summarize(_result([[5, 6, 7, 8], [9, 2]], [[5, 6, 7, 8, 1, 1, 1], [9, 2]]))
    assert out["accept_len"] == pytest.approx(1 + 6 / 4) and out["accept_rate_per_pos"] == [0.75, 0.5, 0.25]
    assert out["greedy_identical"] and out["mismatches"] == 0 and out["response_tokens"] == 6


def test_summary_flags_a_different_or_shorter_output():
    # a different token, and an output that stopped (EOS) where the plain one went on
    out = bench.summarize(_result([[5, 6, 7, 3], [9, 2]], [[5, 6, 7, 8, 1, 1, 1], [9, 2, 4, 4]]))
    assert not out["greedy_identical"] and out["mismatches"] == 2


def test_heldout_prompts_are_the_pipelines(tmp_path):
    from tlt.pipeline import Pipeline

    harness = load_bench("harness")
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path}"])
    tok = load_tokenizer(cfg.model)
    prompts = harness.heldout_prompts(cfg, tok)
    assert len(prompts) == cfg.data.heldout_size
    with Pipeline(cfg) as pipe:
        pipe.validate_data()
        assert prompts == pipe.prompt_ids(pipe.dataset.heldout["prompt"])
    assert harness.heldout_prompts(cfg, tok, 2) == prompts[:2]
    assert harness.heldout_prompts(cfg, tok, len(prompts) + 1) == prompts + prompts[:1]  # cycling
