"""The run's model folder served by vLLM's OpenAI-compatible server, as a user deploys it.

A short real run (tiny Llama, warm-start, two RL steps, evaluation, export in fp32) writes the
model folder; vLLM's CPU build serves it with the speculative config its README prints
(`python -m vllm.entrypoints.openai.api_server`: the CPU wheel's `vllm` script does not start), on
127.0.0.1 and a free port; the test queries it with the `openai` client. Checks:
  (a) greedy completions equal the torch engine's greedy outputs of the exported policy, reloaded
      from the folder (fp32 on both sides: bf16 and fp32 greedy outputs differ on random weights);
  (b) speculation ran: the server's /metrics counters drafts > 0 and accepted > 0 (vLLM silently
      runs a drafter with missing weights at acceptance 0, so "it loaded" proves nothing);
  (c) the served accept length 1 + accepted / drafts matches tlt's figure for the same prompts and
      the same chain depth (tlt.rollout.acceptance.measure_accept on the reloaded folder), within
      `tolerance()` below.
The server is a process group of its own, stopped by the fixture also when a check fails.

Server and client: bench/vllm_server.py (the `openai` client is vLLM's own dependency, so the
queries run under .venv-vllm's Python).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
K, MAX_TOKENS = 3, 32

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` or run `make test-vllm`"),
]

vs = load_bench("vllm_server")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, one_thread):
    """A short real run (no tracking store) -> its model folder in fp32, the pipeline's held-out prompt ids."""
    from tlt.config import load_config
    from tlt.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("serve")
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [
        f"trainer.checkpoint_dir={tmp / 'runs'}", "model.tiny_layers=6", "model.tiny_vocab=259",  # ids the tokenizer decodes
        "export.dtype=float32", "drafter.where=sequential", "drafter.corpus_tokens=4096", "drafter.warmstart_epochs=20",
        "data.heldout_size=6",
        f"drafter.eval_strategy.depth={K}", f"drafter.eval_strategy.tokens={K}", "rollout.spec_threshold=64"])
    with Pipeline(cfg) as pipe:
        pipe.validate_data()
        pipe.prepare()
        pipe.warmstart()
        for step in range(pipe.resume(), cfg.rl.steps):
            pipe.rl_step(step)
        summary = pipe.export(pipe.evaluate(cfg.rl.steps))
        prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
    return {"cfg": cfg, "folder": Path(summary.path), "summary": summary, "prompts": prompts, "tmp": tmp}


@pytest.fixture(scope="module")
def server(exported):
    folder, tmp = exported["folder"], exported["tmp"]
    _, spec = vs.serve_args(folder)
    assert spec == {"method": "eagle3", "model": str(folder / "drafter"), "num_speculative_tokens": K}
    # small and exact on CPU: fp32 (the export's dtype), eager, a small KV cache
    extra = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4",
             "--kv-cache-memory-bytes", str(256 * 2**20), "--seed", "0"]
    try:
        with vs.serving(folder, extra, tmp / "vllm-server.log") as srv:
            yield srv
    except RuntimeError as err:
        pytest.fail(str(err))


def _torch_side(exported):
    """The exported policy and drafter reloaded from the folder, in tlt's torch engine."""
    from tlt.model_folder import load_model_folder
    from tlt.models import eos_token_ids
    from tlt.rollout.torch_engine.engine import RolloutEngine

    model, tok, drafter = load_model_folder(exported["folder"])
    rollout = exported["cfg"].rollout.model_copy(update={"dtype": "float32"})
    eos = eos_token_ids(tok, model)
    return RolloutEngine(model, rollout, eos, tok.pad_token_id, drafter=drafter), eos


def tolerance(n_prompts: int, drafts: float) -> float:
    """Allowed |served - tlt| accept length. The two count the same verifies of the same drafter
    over the same greedy tokens, except at each request's end: vLLM counts the last round's
    accepted drafts also past max_tokens / EOS, tlt stops counting there (up to K tokens and one
    verify per request); and fp32 kernels that differ in the last bits may flip a near-tied draft
    argmax (up to K tokens each; allow two). Over `drafts` verifies that is at most
    (n_prompts + 2) * K / drafts tokens per verify; a drafter vLLM loads wrongly is off by far more."""
    return (n_prompts + 2) * K / max(drafts, 1)


def test_served_model_folder_matches_tlt(exported, server):
    from tlt.config import SpecStrategy
    from tlt.rollout.acceptance import measure_accept

    prompts = exported["prompts"]
    served = vs.query(server, prompts, MAX_TOKENS)
    engine, eos = _torch_side(exported)
    ours = [engine.generate([p], max_new_tokens=MAX_TOKENS, temperature=0.0, spec=False).response_ids[0]
            for p in prompts]
    strip = lambda ids: [t for t in ids if t not in eos]  # noqa: E731 - EOS: vLLM returns it, tlt's engine too or not
    assert [strip(s["token_ids"]) for s in served] == [strip(list(o)) for o in ours]  # (a)

    drafts, accepted = vs.spec_counters(server)
    assert drafts > 0 and accepted > 0, (drafts, accepted)  # (b)
    served_len = 1 + accepted / drafts
    tlt_len = measure_accept(engine, prompts, 0.0, MAX_TOKENS, SpecStrategy(depth=K, topk=1, tokens=K),
                             batch_size=1).accept_len
    tol = tolerance(len(prompts), drafts)
    print(f"served accept length {served_len:.3f} ({drafts:.0f} drafts), tlt {tlt_len:.3f}, tolerance {tol:.3f}; "
          f"export figure (depth {K}, {exported['cfg'].drafter.eval_max_new_tokens} tokens) "
          f"{exported['summary'].accept_len}")
    assert abs(served_len - tlt_len) <= tol  # (c)
    assert tlt_len > 1.2  # the run's drafter accepts (measured 1.39): (c) is not 1.0 == 1.0, and a drafter vLLM
    # loads wrongly (served 1.0) falls outside the tolerance
