"""EAGLE-3 drafter: KV-cache correctness, alignment with the target, vocab maps, training, buffer."""
from __future__ import annotations

import pytest
import torch

from tlt.config import DrafterConfig
from tlt.drafter.model import Eagle3Drafter, build_drafter, default_aux_ids
from tlt.models import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=4, hidden=128, vocab=512, seed=0)


@pytest.fixture
def drafter(target):
    torch.manual_seed(1)
    d = build_drafter(target, DrafterConfig(draft_vocab_size=0))
    with torch.no_grad():  # random (not zero-ish) weights so that masking mistakes show
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return d.eval()


def _inputs(B=2, T=7, H=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (B, T), generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T)
    return ids, hidden, pos


def test_shapes_names_and_frozen_embedding(drafter, target):
    ids, hidden, pos = _inputs()
    h, logits, (k, v) = drafter(ids, hidden, pos)
    assert h.shape == (2, 7, 128) and logits.shape == (2, 7, 512)
    assert k.shape == v.shape == (2, 1, 7, 64)
    names = set(drafter.trainable_state_dict())
    assert "embed_weight" not in names and {"fc.weight", "d2t", "t2d", "lm_head.weight",
                                            "midlayer.hidden_norm.weight", "norm.weight"} <= names
    assert drafter.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert not any(p is drafter.embed_weight for p in drafter.parameters())
    assert drafter.fc.weight.shape == (128, 3 * 128)
    assert drafter.midlayer.self_attn.q_proj.weight.shape == (2 * 64, 2 * 128)


def test_incremental_equals_full(drafter):
    ids, hidden, pos = _inputs()
    h_full, lg_full, (k_full, v_full) = drafter(ids, hidden, pos)
    past, hs, lgs = None, [], []
    for t in range(ids.shape[1]):
        h, lg, past = drafter(ids[:, t:t + 1], hidden[:, t:t + 1], pos[:, t:t + 1], past=past)
        hs.append(h)
        lgs.append(lg)
    torch.testing.assert_close(torch.cat(hs, 1), h_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(lgs, 1), lg_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(past[0], k_full, atol=1e-5, rtol=1e-5)
    # Chunked: 3 then 4 positions.
    _, _, past3 = drafter(ids[:, :3], hidden[:, :3], pos[:, :3])
    h4, _, _ = drafter(ids[:, 3:], hidden[:, 3:], pos[:, 3:], past=past3)
    torch.testing.assert_close(h4, h_full[:, 3:], atol=1e-5, rtol=1e-5)


def test_key_mask_equals_removing_slot(drafter):
    """Masking past slot 2 (e.g. a rejected draft) == a cache that never had it."""
    ids, hidden, pos = _inputs(T=6)
    keep = [0, 1, 3, 4]
    _, _, past = drafter(ids[:, :5], hidden[:, :5], pos[:, :5])
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[:, 2] = False
    h_masked, lg_masked, _ = drafter(ids[:, 5:], hidden[:, 5:], pos[:, 5:], past=past, key_mask=key_mask)
    small = tuple(x[:, :, keep] for x in past)
    h_small, lg_small, _ = drafter(ids[:, 5:], hidden[:, 5:], pos[:, 5:], past=small)
    torch.testing.assert_close(h_masked, h_small, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lg_masked, lg_small, atol=1e-5, rtol=1e-5)
    h_all, _, _ = drafter(ids[:, 5:], hidden[:, 5:], pos[:, 5:], past=past)
    assert not torch.allclose(h_all, h_masked, atol=1e-4)


def test_left_padding_rows_do_not_leak(drafter):
    """A padded row (key_mask False on the pads) gives the same outputs as the unpadded row."""
    ids, hidden, pos = _inputs(B=1, T=5)
    h_ref, _, _ = drafter(ids, hidden, pos)
    pad_ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    pad_hidden = torch.cat([torch.randn(1, 2, 128), hidden], 1)
    pad_pos = torch.cat([torch.zeros(1, 2, dtype=torch.long), pos], 1)
    key_mask = torch.tensor([[False, False] + [True] * 5])
    h_pad, _, _ = drafter(pad_ids, pad_hidden, pad_pos, key_mask=key_mask)
    assert torch.isfinite(h_pad).all()
    torch.testing.assert_close(h_pad[:, 2:], h_ref, atol=1e-5, rtol=1e-5)


def test_vocab_maps(target):
    d = build_drafter(target, DrafterConfig(draft_vocab_size=64))
    counts = torch.zeros(512)
    top = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:64]
    counts[top] = torch.arange(64, dtype=torch.float) + 1
    head = target.lm_head.weight
    d.set_vocab(counts)
    ids = torch.arange(64) + d.d2t
    assert torch.equal(ids, top.sort().values) and bool((ids[1:] > ids[:-1]).all())
    assert int(d.t2d.sum()) == 64 and bool(d.t2d[top].all())
    assert torch.equal(d.to_target_ids(torch.tensor([0, 63])), ids[[0, 63]])
    torch.testing.assert_close(d.lm_head.weight, head[ids])  # rows start from the target's head
    full = build_drafter(target, DrafterConfig(draft_vocab_size=0))
    full.set_vocab(counts)
    assert full.draft_vocab_size == 512 and not full.d2t.any() and bool(full.t2d.all())


def test_default_aux_ids_distinct_and_valid():
    assert default_aux_ids(30) == [2, 15, 27]
    for n in range(2, 12):
        ids = default_aux_ids(n)
        assert len(set(ids)) == 3 and all(0 <= i <= n for i in ids), (n, ids)


def test_eagle1_not_implemented(target):
    with pytest.raises(NotImplementedError, match="drafter.variant"):
        build_drafter(target, DrafterConfig(variant="eagle1"))


def test_gather_aux_uses_hf_ids(target, drafter):
    ids = torch.randint(0, 512, (1, 5))
    out = target(ids, output_hidden_states=True)
    aux = Eagle3Drafter.gather_aux(out.hidden_states, drafter.aux_layer_ids)
    assert aux.shape == (1, 5, 3 * 128)
    i = drafter.aux_layer_ids[1]
    torch.testing.assert_close(aux[..., 128:256], out.hidden_states[i])
    assert drafter.fuse(aux).shape == (1, 5, 128)
