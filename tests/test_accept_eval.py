"""Teacher-forced accept length (tlt.drafter.accept_eval): the round replay on hand-made inputs, and
agreement with the real engine's measure_accept (chain4, greedy, tuner off) for a trained drafter
on the bundled SmolLM2."""
import numpy as np
import pytest
import torch

from tlt.config import DrafterConfig, ModelConfig, RolloutConfig, SpecStrategy
from tlt.drafter.accept_eval import evaluate_drafter, root_accepts, simulate_rounds

CHAIN4 = SpecStrategy(depth=4, topk=1, tokens=4)


def test_root_accepts_count_leading_matches_only():
    match = np.array([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]], dtype=bool)  # [depth, roots]
    assert root_accepts(match).tolist() == [3, 2, 1, 4]


def test_simulate_rounds_by_hand():
    # 10 tokens; root 0 accepts 5 (4 drafts + bonus) -> root 5 accepts 1 -> root 6 accepts 5, capped at 3
    a = np.array([5, 1, 1, 1, 1, 1, 5, 1, 1])
    assert simulate_rounds(a, 10) == (5 + 1 + 3, 3)
    assert simulate_rounds(np.ones(9, dtype=int), 10) == (9, 9)  # nothing accepted: one token per pass
    assert simulate_rounds(np.zeros(0, dtype=int), 1) == (0, 0)  # EOS at once: no speculative round


@pytest.fixture(scope="module")
def smollm():
    from tlt.models import eos_token_ids, load_target

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_target(ModelConfig(name_or_path="bundled:smollm2-135m-instruct"))
    yield model, tok, eos_token_ids(tok, model)
    torch.set_num_threads(old)


def _prompts(tok, n):
    from tlt.prompts import prompt_ids

    return [prompt_ids(tok, f"What is {a} + {b}?", " Reply with only the final number.", None)
            for a, b in zip(range(1, n + 1), range(n, 0, -1))]


@pytest.mark.slow
def test_teacher_forced_equals_measure_accept(smollm):
    """Greedy, chain4: the replayed rounds give the engine's accept length on the same prompts (the
    drafter is fitted on these very responses, so it accepts far more than 1 token per pass)."""
    from tlt.drafter.model import build_drafter
    from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit
    from tlt.rollout.acceptance import measure_accept
    from tlt.rollout.torch_engine.engine import RolloutEngine

    model, tok, eos = smollm
    prompts = _prompts(tok, 8)
    cfg = DrafterConfig(draft_vocab_size=512, lr=3e-3)
    rcfg = RolloutConfig(tuner=False, max_new_tokens=24, temperature=0.0, strategy=CHAIN4, draft_stop_below=0.0)
    torch.manual_seed(0)
    drafter = build_drafter(model, cfg)
    engine = RolloutEngine(model, rcfg, eos, tok.pad_token_id, drafter=drafter)
    responses = engine.generate(prompts, max_new_tokens=24, temperature=0.0, spec=False).response_ids
    samples = collect_samples(model, [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts],
                              drafter.aux_layer_ids)
    drafter.set_vocab(count_tokens(samples, model.config.vocab_size))
    fit(DrafterTrainer(drafter, cfg, model.get_output_embeddings().weight), samples, epochs=12, batch_tokens=1024)

    real = measure_accept(engine, prompts, temperature=0.0, max_new_tokens=24, strategy=CHAIN4, batch_size=8)
    assert real.responses == responses  # greedy SD is lossless: the same sequences were scored
    tf = evaluate_drafter(drafter, samples, [len(p) for p in prompts], depth=4, temperature=0.7,
                          lm_head_weight=model.get_output_embeddings().weight)
    assert real.accept_len > 1.5  # a drafter that accepts, so the comparison is not 1 == 1
    assert tf.accept_len == pytest.approx(real.accept_len, abs=0.05)
    assert abs(int(tf.passes.sum()) - real.passes) <= 1 and abs(int(tf.tokens.sum()) - real.tokens) <= 2
    assert 0.0 < tf.first_accept <= 1.0 and 1.0 <= tf.accept_pos <= 5.0
    again = evaluate_drafter(drafter, samples, [len(p) for p in prompts], depth=4)
    assert again.tokens.tolist() == tf.tokens.tolist() and again.passes.tolist() == tf.passes.tolist()
