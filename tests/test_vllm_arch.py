"""The vLLM rows of the architecture matrix (tlt.arch.MATRIX): for every architecture vLLM (CPU build,
.venv-vllm) serves as an EAGLE-3 target, tlt's export loads, vLLM's greedy output with the drafter
equals the target's own greedy output, and vLLM's draft/accept counters equal tlt's prediction for the
same drafter (vLLM runs a drafter with missing weights silently, so "it loaded" proves nothing). One
vLLM engine per architecture (with the drafter; the reference is transformers' greedy, which
tests/test_vllm.py checks equals vLLM's own for Llama) keeps the tier's time down. Llama and Qwen2 are
covered by tests/test_vllm.py. The architectures the matrix says vLLM does not serve are checked to be
refused by vLLM itself here, and by tlt before anything starts in tests/test_arch_preflight.py.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from test_vllm import CHECK, K, MAX_TOKENS, PROMPT_LEN, TOL_ACCEPTED, TOL_DRAFTS, VLLM_PY, _greedy, _trained_drafter
from test_vllm import predict_accepts

from tlt import arch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` or run `make test-vllm`"),
]
COVERED = {"llama", "qwen2"}  # tests/test_vllm.py
SERVED = sorted(a.tiny for a in arch.MATRIX.values() if a.vllm is None and a.tiny not in COVERED)


class ServedDrafter:
    """The drafter as vLLM runs it for a target with one sliding window on every layer (Mistral 7B v0.1,
    Phi-3-mini): vLLM's attention layers fall back to the model's window (cache_config.sliding_window)
    when they have none of their own, the drafter's layer included, so it sees only the last `window`
    positions. tlt's prediction replays that; the slots of the predictor's cache are the positions."""

    def __init__(self, drafter, window: int):
        self.d, self.window = drafter, window
        self.fuse, self.to_target_ids, self.aux_layer_ids = drafter.fuse, drafter.to_target_ids, drafter.aux_layer_ids

    def __call__(self, ids, hidden, pos, past=None):
        s_past = 0 if past is None else past[0].shape[2]
        k = torch.arange(s_past + ids.shape[1])
        q = pos[:, :, None]
        mask = (k <= q) & (k > q - self.window)
        return self.d(ids, hidden, pos, past=past, key_mask=mask.expand(ids.shape[0], -1, -1))


def _vllm(target_dir, drafter_dir, prompts, tmp) -> subprocess.CompletedProcess:
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    cmd = [str(VLLM_PY), str(CHECK), str(target_dir), str(drafter_dir), str(tmp / "prompts.json"), "--k", str(K),
           "--max-tokens", str(MAX_TOKENS), "--no-baseline", "--out", str(tmp / "vllm.json")]
    return subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)


def _run_spec_only(target_dir, drafter_dir, prompts, tmp) -> dict:
    proc = _vllm(target_dir, drafter_dir, prompts, tmp)
    causes = sorted({ln.split("]", 1)[-1].strip() for ln in proc.stdout.splitlines() if "Error:" in ln})
    assert proc.returncode == 0, f"vllm_check.py rc {proc.returncode}; errors: {causes}\n{proc.stdout[-4000:]}"
    return json.loads((tmp / "vllm.json").read_text())


def _save(target, drafter, tmp) -> None:
    from tlt.drafter.eagle3 import export_eagle3
    from tlt.models import tiny_tokenizer

    target.save_pretrained(tmp / "target")
    tiny_tokenizer().save_pretrained(tmp / "target")
    export_eagle3(drafter, target.config, tmp / "drafter")


@pytest.mark.parametrize("name", SERVED)
def test_vllm_serves_the_export_for(name, tmp_path):
    from tlt.models import tiny_model

    target = tiny_model(name, layers=6, hidden=128, vocab=512, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (PROMPT_LEN,), generator=g).tolist() for _ in range(4)]
    drafter = _trained_drafter(target, prompts, 256, 150)
    _save(target, drafter, tmp_path)
    result = _run_spec_only(tmp_path / "target", tmp_path / "drafter", prompts, tmp_path)
    base = _greedy(target, prompts, MAX_TOKENS + K)
    assert result["spec"] == [b[:MAX_TOKENS] for b in base], "vLLM with the drafter != the target's greedy output"
    m = result["metrics"]
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    window, per_type = arch.sliding_window(target.config)
    served = ServedDrafter(drafter, window) if window is not None and not per_type else drafter
    preds = [predict_accepts(target, served, p, b, K, MAX_TOKENS) for p, b in zip(prompts, base)]
    p_drafts, p_acc = sum(x[0] for x in preds), sum(x[1] for x in preds)
    report = {"arch": name, "vllm": [drafts, accepted], "tlt": [p_drafts, p_acc], "timing_s": result["timing_s"]}
    print(f"vLLM vs tlt prediction: {report}")
    assert accepted > 0, f"vLLM accepted nothing: drafter weights not loaded? {report}"
    assert abs(drafts - p_drafts) <= TOL_DRAFTS and abs(accepted - p_acc) <= TOL_ACCEPTED, report


@pytest.mark.parametrize("name", sorted(a.tiny for a in arch.MATRIX.values() if a.vllm))
def test_vllm_refuses_what_the_matrix_says_it_does_not_serve(name, tmp_path):
    """The matrix's 'no' is vLLM's own answer (tlt refuses these before anything starts, so this is the
    only place vLLM is asked): when a vLLM upgrade serves the architecture, this fails and the row changes."""
    from tlt.models import tiny_model

    target = tiny_model(name, layers=6, hidden=128, vocab=512, seed=0)
    _save(target, _trained_drafter(target, [], 256, 0), tmp_path)
    proc = _vllm(tmp_path / "target", tmp_path / "drafter", [[5, 6, 7, 8]], tmp_path)
    assert proc.returncode != 0 and "does not support EAGLE3" in proc.stdout, proc.stdout[-3000:]
    assert "does not support EAGLE3" in arch.vllm_reason(target.config)

