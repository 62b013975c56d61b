"""vLLM (CPU build) loads tlt's EAGLE-3 export and accepts what tlt predicts (the export's end-to-end check).

A tiny target, a drafter trained briefly on the target's own greedy outputs, `export_eagle3`,
then tlt/vllm_check.py under .venv-vllm (bench/vllm_venv.sh; `make test-vllm`). Asserts:
  (a) greedy outputs with speculation == without (lossless);
  (b) vLLM's mean acceptance length 1 + accepted/drafts > 1;
  (c) vLLM's draft/accept counters match tlt's own prediction (within TOL_*; measured exact)
      for the same drafter, chain-drafting k tokens per round along vLLM's baseline greedy tokens.
      vLLM silently runs a drafter with missing weights (acceptance 0), so "it loaded" proves
      nothing; (c) does.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
CHECK = ROOT / "tlt" / "vllm_check.py"
K, MAX_TOKENS, PROMPT_LEN = 3, 32, 6
# Tolerance of (c). Measured: exact (same drafts, accepted and per-position counts). vLLM's CPU
# kernels and HF's torch ops agree to ~1e-6 in fp32, but a near-tied drafter argmax could still
# flip; one flip changes one round by up to K tokens and may shift later round boundaries, so
# allow two rounds' worth. A drafter that vLLM loads wrongly is off by far more (e.g. 0 accepted).
TOL_DRAFTS, TOL_ACCEPTED = 2, 2 * K

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


# ---- tlt side: target, trained drafter, prediction ----------------------------------------------
def _greedy(target, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF greedy continuations of n tokens (prompts of equal length: one batched call)."""
    ids = torch.tensor(prompts)
    seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return seq[:, ids.shape[1]:].tolist()


def _trained_drafter(target, prompts: list[list[int]], draft_vocab: int, steps: int):
    """EAGLE-3 drafter fit to the target's greedy continuations (a reduced vocab exercises d2t)."""
    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit

    cfg = DrafterConfig(draft_vocab_size=draft_vocab, lr=3e-3, loss_token_weight=1.0, ttt_steps=K)
    torch.manual_seed(0)
    d = build_drafter(target, cfg)
    if steps == 0:
        return d.eval()
    seqs = [p + g for p, g in zip(prompts, _greedy(target, prompts, 40))]
    samples = collect_samples(target, seqs, [len(p) for p in prompts], d.aux_layer_ids)
    d.set_vocab(count_tokens(samples, target.config.vocab_size))
    # 4 sequences of 46 tokens pack into one batch: one optimizer step per epoch.
    fit(DrafterTrainer(d, cfg, target.lm_head.weight), samples, epochs=steps, batch_tokens=512)
    return d.eval()


@torch.no_grad()
def predict_accepts(target, drafter, prompt: list[int], baseline: list[int], k: int, max_tokens: int):
    """What vLLM should count for one request: (drafts, accepted, accepted per position [k]).

    Replays vLLM's chain EAGLE over the greedy `baseline` (>= max_tokens + k tokens): prefill
    emits token m = len(prompt); each round the drafter takes positions 0..m-1 as
    (fuse(aux_p), token_{p+1}), drafts token m+1 from the last, then feeds back (h, draft) k-1
    times; the target accepts the matching prefix a and adds one token. vLLM counts every
    verified round, also the last one whose accepted tokens run past max_tokens.
    """
    from tlt.drafter.train import collect_samples

    seq = prompt + baseline
    aux = collect_samples(target, [seq], [len(prompt)], drafter.aux_layer_ids)[0]["aux"]
    ids = torch.tensor(seq)
    per_pos, drafts, out = [0] * k, 0, 1
    while out < max_tokens:
        m = len(prompt) + out - 1  # index of the newest verified token
        h, lg, past = drafter(ids[1:m + 1][None], drafter.fuse(aux[:m][None]), torch.arange(m)[None])
        h, a = h[:, -1:], 0
        tok = drafter.to_target_ids(lg[:, -1:].argmax(-1))
        while a < k and int(tok) == seq[m + 1 + a]:
            per_pos[a] += 1
            a += 1
            if a < k:
                h, lg, past = drafter(tok, h, torch.tensor([[m + a - 1]]), past=past)  # x_{m+a} sits at m+a-1
                tok = drafter.to_target_ids(lg.argmax(-1))
        drafts += 1
        out += a + 1
    return drafts, sum(per_pos), per_pos


# ---- vLLM side --------------------------------------------------------------------------------
class VllmCheckFailed(RuntimeError):
    """tlt/vllm_check.py exited non-zero; the message lists its error lines, then its log tail."""


def _run_check(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], tmp: Path) -> dict:
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    out = tmp / "vllm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    cmd = [str(VLLM_PY), str(CHECK), str(target_dir), str(drafter_dir), str(tmp / "prompts.json"),
           "--k", str(K), "--max-tokens", str(MAX_TOKENS), "--out", str(out)]
    # vLLM logs to stdout, the engine core's root cause included: keep both streams together.
    proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    if proc.returncode != 0:
        # The engine core's root cause sits above a long traceback: keep every "...Error:" line.
        causes = sorted({ln.split("]", 1)[-1].strip() for ln in proc.stdout.splitlines() if "Error:" in ln})
        raise VllmCheckFailed(f"vllm_check.py failed (rc {proc.returncode}); errors: {causes}\n"
                              f"log tail:\n{proc.stdout[-4000:]}")
    return json.loads(out.read_text())


def _export_and_run(arch: str, tmp: Path, draft_vocab: int = 256, train_steps: int = 150) -> tuple:
    from tlt.drafter.eagle3 import export_eagle3
    from tlt.models import tiny_model, tiny_tokenizer

    target = tiny_model(arch, layers=6, hidden=128, vocab=512, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (PROMPT_LEN,), generator=g).tolist() for _ in range(6)]
    # Trained on prompts 0-3; 4 and 5 are held out (a tiny random target is hard to predict
    # off its training text: expect ~0 accepted there, which the counters must also show).
    drafter = _trained_drafter(target, prompts[:4], draft_vocab, train_steps)
    target.save_pretrained(tmp / "target")
    tiny_tokenizer().save_pretrained(tmp / "target")
    export_eagle3(drafter, target.config, tmp / "drafter")
    result = _run_check(tmp / "target", tmp / "drafter", prompts, tmp)
    return target, drafter, prompts, result


def _check(target, drafter, prompts, result, trained: bool = True) -> dict:
    spec, base, m = result["spec"], result["baseline"], result["metrics"]
    assert [b[:MAX_TOKENS] for b in base] == spec, "greedy outputs differ with and without speculation"  # (a)
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    assert m["vllm:spec_decode_num_draft_tokens"] == K * drafts
    assert sum(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) == accepted
    vllm_len = 1 + accepted / drafts
    if trained:
        assert vllm_len > 1.0, f"vLLM accepted nothing ({m}): drafter weights not loaded?"  # (b)

    preds = [predict_accepts(target, drafter, p, b, K, MAX_TOKENS) for p, b in zip(prompts, base)]
    p_drafts, p_acc = sum(x[0] for x in preds), sum(x[1] for x in preds)
    p_pos = [sum(x[2][i] for x in preds) for i in range(K)]
    report = {"vllm_accept_len": round(vllm_len, 3), "tlt_accept_len": round(1 + p_acc / p_drafts, 3),
              "vllm_drafts_accepted_per_pos": [drafts, accepted, m["vllm:spec_decode_num_accepted_tokens_per_pos"]],
              "tlt_drafts_accepted_per_pos": [p_drafts, p_acc, p_pos], "timing_s": result["timing_s"]}
    print(f"vLLM vs tlt prediction: {report}")
    assert abs(drafts - p_drafts) <= TOL_DRAFTS and abs(accepted - p_acc) <= TOL_ACCEPTED, report  # (c)
    return report


def test_vllm_eagle3_llama(tmp_path):
    target, drafter, prompts, result = _export_and_run("llama", tmp_path)
    # vLLM's target equals HF's greedy: the predictor runs HF's target over vLLM's tokens.
    assert _greedy(target, prompts, MAX_TOKENS) == [b[:MAX_TOKENS] for b in result["baseline"]]
    _check(target, drafter, prompts, result)


def test_vllm_eagle3_qwen2_target(tmp_path):
    """A Qwen2 target (attention biases) with the same Llama-style EAGLE-3 export."""
    target, drafter, prompts, result = _export_and_run("qwen2", tmp_path)
    _check(target, drafter, prompts, result)


def test_vllm_full_vocab_drafter_loads(tmp_path):
    """draft_vocab_size == vocab_size (untrained drafter: only loading and counting are checked).

    The export omits d2t / t2d then (vLLM builds no draft_id_to_target_id for a full vocabulary).
    """
    target, drafter, prompts, result = _export_and_run("llama", tmp_path, draft_vocab=0, train_steps=0)
    _check(target, drafter, prompts, result, trained=False)


def test_bench_vllm_accept_end_to_end(tmp_path):
    """bench/vllm_accept.py: recipe's held-out prompts -> vLLM -> accept length and the greedy check.

    An untrained drafter (loading and counting only; the SmolLM2 figures come from tlt bench vllm_accept).
    """
    from bench_scripts import load_bench

    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.drafter.eagle3 import export_eagle3
    from tlt.models import tiny_model, tiny_tokenizer

    target = tiny_model("llama", layers=4, hidden=128, vocab=512, seed=0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=256)).eval()
    export_eagle3(drafter, target.config, tmp_path / "drafter")
    out = load_bench("vllm_accept").main([str(ROOT / "conf" / "smoke.yaml"), "--drafter", str(tmp_path / "drafter"),
                                          "--set", f"model.name_or_path={tmp_path / 'target'}",
                                          "--json", str(tmp_path / "out.json"), "--vllm-python", str(VLLM_PY)])
    assert json.loads((tmp_path / "out.json").read_text()) == out
    assert out["greedy_identical"] and out["prompts"] == 4 and out["num_drafts"] > 0
    assert 1.0 <= out["accept_len"] <= 1 + K
    assert out["accepted_tokens"] == round(sum(out["accept_rate_per_pos"]) * out["num_drafts"])
    assert 0 < out["response_tokens"] <= 4 * MAX_TOKENS
