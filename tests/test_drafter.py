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
    names = set(drafter.state_dict())
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


def test_gather_aux_uses_hf_ids(target, drafter):
    ids = torch.randint(0, 512, (1, 5))
    out = target(ids, output_hidden_states=True)
    aux = Eagle3Drafter.gather_aux(out.hidden_states, drafter.aux_layer_ids)
    assert aux.shape == (1, 5, 3 * 128)
    i = drafter.aux_layer_ids[1]
    torch.testing.assert_close(aux[..., 128:256], out.hidden_states[i])
    assert drafter.fuse(aux).shape == (1, 5, 128)



@torch.no_grad()
def test_init_from_target_is_the_last_layer(target):
    """With the high aux at the last layer's input, the initialised drafter IS the target's last
    layer + final norm + head: its logits equal the target's, whatever the input tokens."""
    n = target.config.num_hidden_layers
    d = build_drafter(target, DrafterConfig(draft_vocab_size=0, aux_layer_ids=[0, 1, n - 1],
                                            init_from_target=True)).eval()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    out = target(ids, output_hidden_states=True)
    aux = Eagle3Drafter.gather_aux(out.hidden_states, d.aux_layer_ids)
    other = torch.randint(0, 512, ids.shape)  # the embedding half starts at zero: tokens do not matter
    _, logits, _ = d(other, d.fuse(aux), torch.arange(9).expand(2, 9))
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-4)
    _, random_init, _ = build_drafter(target, DrafterConfig(draft_vocab_size=0, aux_layer_ids=[0, 1, n - 1]))(
        other, d.fuse(aux), torch.arange(9).expand(2, 9))
    assert not torch.allclose(random_init, out.logits, atol=1e-2)

# ---- training ---------------------------------------------------------------------------------
from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, pack, ttt_mask  # noqa: E402


@torch.no_grad()
def chain_accept(d, sample, depth):
    """Mean accepted length when drafting greedily from every verified response position.

    Engine convention (vLLM EAGLE): prefix positions 0..t get fuse(aux_0..t) and tokens 1..t+1;
    the last logits draft token t+2; each later step feeds back h and the drafted token at t+k.
    """
    ids, aux = sample["input_ids"], sample["aux"]
    T, P = ids.shape[0], int((~sample["loss_mask"]).sum())
    accepted = []
    for t in range(P - 1, T - 2):
        n = t + 1
        h, lg, past = d(ids[1:n + 1][None], d.fuse(aux[:n][None]), torch.arange(n)[None])
        h, tok, acc = h[:, -1:], d.to_target_ids(lg[:, -1:].argmax(-1)), 0
        while acc < depth and t + 2 + acc < T and tok.item() == ids[t + 2 + acc].item():
            h, lg, past = d(tok, h, torch.tensor([[n + acc]]), past=past)
            tok, acc = d.to_target_ids(lg.argmax(-1)), acc + 1
        accepted.append(acc)
    return sum(accepted) / len(accepted)


def _synthetic_greedy_sample(target, T=20, P=4, seed=0):
    """Distinct tokens; target_hidden_t points at token_{t+1}, so the sequence is the target's argmax."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(509, generator=g)[:T] + 3
    s = collect_samples(target, [ids.tolist()], [P], [1, 2, 3])[0]
    head = target.lm_head.weight.detach()
    s["target_hidden"] = torch.cat([head[ids[1:]] * 20.0, torch.zeros(1, 128)])
    return s


def _trainer(target, samples, **kw):
    torch.manual_seed(0)
    cfg = DrafterConfig(**{"draft_vocab_size": 64, "lr": 5e-3, "loss_token_weight": 1.0, **kw})
    d = build_drafter(target, cfg)
    d.set_vocab(count_tokens(samples, 512))
    return d, DrafterTrainer(d, cfg, target.lm_head.weight)


def test_alignment_overfit_reproduces_sequence(target):
    """Trained with the trainer's shift, greedy chained drafting (engine convention) replays it."""
    s = _synthetic_greedy_sample(target)
    d, tr = _trainer(target, [s], ttt_steps=4)  # the recipe: token loss only, TTT over the drafted depth
    batch = pack([s], 64)[0]
    for _ in range(40):
        m = tr.step(batch)
    assert m["drafter/top1_acc"] == 1.0
    d.eval()
    assert chain_accept(d, s, depth=1) == 1.0
    best = sum(min(4, 20 - 2 - t) for t in range(3, 18)) / 15  # every draft accepted
    assert chain_accept(d, s, depth=4) >= 0.9 * best


def test_training_on_real_target(target):
    """Real greedy continuation: loss falls, params move, embedding frozen, accuracy rises."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 512, (1, 6))
    seq = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
    s = collect_samples(target, [seq.tolist()], [6], default_aux_ids(4))[0]
    assert s["aux"].shape == (30, 3 * 128) and int(s["loss_mask"].sum()) == 24
    d, tr = _trainer(target, [s], draft_vocab_size=64)
    embed_before = d.embed_weight.clone()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    assert not any(p is d.embed_weight for g in tr.opt.param_groups for p in g["params"])
    batch = pack([s], 64)[0]
    hist = [tr.step(batch) for _ in range(30)]
    assert hist[-1]["drafter/loss"] < 0.8 * hist[0]["drafter/loss"]
    assert hist[-1]["drafter/top1_acc"] > hist[0]["drafter/top1_acc"] + 0.3
    after = d.state_dict()
    for k in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight", "midlayer.hidden_norm.weight"):
        assert not torch.equal(before[k], after[k]), k
    assert torch.equal(d.embed_weight, embed_before)
    assert set(tr.state_dict()["drafter"]) == set(before)
    d.eval()
    assert chain_accept(d, s, depth=1) > 0.5


def test_packing_equals_separate(target):
    """Two samples packed in one row give the same loss terms as each alone (block-diagonal mask)."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 13)]
    samples = collect_samples(target, seqs, [3, 4], [1, 2, 3])
    d, tr = _trainer(target, samples, ttt_steps=2)
    packed = pack(samples, 64)
    assert len(packed) == 1 and packed[0]["input_ids"].shape == (1, 22)
    # First-fit decreasing: the 13-token sample comes first, the 9-token one restarts at 0.
    assert packed[0]["position_ids"][0, 13].item() == 0 and packed[0]["seq_ids"][0, 13].item() == 1
    _, m_packed = tr.compute_loss(packed[0])
    sep = [tr.compute_loss(pack([s], 64)[0])[1] for s in samples]
    n = [x["drafter/tokens"] for x in sep]
    expect = (sep[0]["drafter/top1_acc"] * n[0] + sep[1]["drafter/top1_acc"] * n[1]) / sum(n)
    assert m_packed["drafter/tokens"] == sum(n)
    assert m_packed["drafter/top1_acc"] == pytest.approx(expect)
    w = [x["drafter/loss_feature"] * k for x, k in zip(sep, n)]
    assert m_packed["drafter/loss_feature"] == pytest.approx(sum(w) / sum(n), rel=1e-4)


def test_ttt_mask_pattern():
    seq = torch.tensor([[0, 0, 0, 0, 1, 1]])
    m = ttt_mask(seq, 2)  # [1,6,18]: step-0 keys q <= p-2, step-1 key p-1, step-2 key p
    row = m[0, 3]
    assert row[:6].tolist() == [True, True, False, False, False, False]
    assert row[6:12].tolist() == [False, False, True, False, False, False]
    assert row[12:].tolist() == [False, False, False, True, False, False]
    assert not m[0, 5, :6].any()  # second sample, position 1 < step 2: nothing from step 0


def test_selective_checkpoint_roundtrip(target):
    s = _synthetic_greedy_sample(target)
    d, tr = _trainer(target, [s])
    batch = pack([s], 64)[0]
    tr.step(batch)
    state = tr.state_dict()
    assert "embed_weight" not in state["drafter"]
    m1 = tr.step(batch)
    d2, tr2 = _trainer(target, [s])
    tr2.load_state_dict(state)
    m2 = tr2.step(batch)
    assert m1["drafter/loss"] == pytest.approx(m2["drafter/loss"], rel=1e-5)
    torch.testing.assert_close(d2.fc.weight, d.fc.weight)


# ---- online buffer ------------------------------------------------------------------------
from tlt.drafter.buffer import DraftBuffer  # noqa: E402


def _add(buf, step, T, H=8):
    buf.add(step, torch.arange(T) % 5, torch.randn(T, 3 * H), torch.randn(T, H), torch.arange(T) >= 2)


def test_buffer_keeps_last_steps_and_token_bound():
    buf = DraftBuffer(max_steps=2, max_tokens=100)
    for step in range(3):
        for _ in range(2):
            _add(buf, step, 10)
    assert buf.steps == [1, 2] and len(buf) == 4 and buf.num_tokens == 40  # one-step offset
    for _ in range(8):
        _add(buf, 2, 10)
    assert buf.num_tokens <= 100 and buf.steps == [2] and len(buf) == 10  # oldest evicted first
    meta = buf.metadata()
    assert meta["evicted_sequences"] == 4 and meta["num_tokens"] == 100 and meta["latest_step"] == 2
    # bf16 storage, float32 on read: 10 * (3*8 + 8) * 2 bytes per sequence of hidden states
    assert buf._items[0][1]["aux"].dtype == torch.bfloat16
    s = buf.samples()[0]
    assert s["aux"].dtype == torch.float32 and s["loss_mask"].dtype == torch.bool
    assert buf.nbytes == 10 * (10 * 32 * 2 + 10 * 8 + 10 * 1)
    assert int(buf.token_counts(5).sum()) == 10 * 8
    for rng in (0, torch.Generator().manual_seed(0), __import__("random").Random(0), None):
        batches = buf.batches(64, rng=rng)
        assert sum(int((b["seq_ids"] >= 0).sum()) for b in batches) == 100


def test_buffer_weighs_prompt_positions_like_the_warmstart():
    """Online samples keep response tokens at weight 1 and prompt positions at prompt_weight (the
    warm-start's rule), so a refresh learns mostly from the fresh answers, not the chat template;
    prompt_weight 0 trains response tokens only. token_counts stays response-only either way."""
    from tlt.drafter.train import pack, weight_prompt

    for pw in (0.0, 0.1):
        buf = DraftBuffer(2, 100, prompt_weight=pw)
        buf.add(0, torch.arange(8) % 5, torch.randn(8, 24), torch.randn(8, 8), torch.arange(8) >= 4)  # 4-token prompt
        s = buf.samples()[0]
        if pw == 0:
            assert "loss_weight" not in s and s["loss_mask"].tolist() == [False] * 4 + [True] * 4
        else:
            assert s["loss_weight"].tolist() == pytest.approx([pw] * 4 + [1] * 4)
            assert s["loss_mask"].tolist() == [False] + [True] * 7
        assert int(buf.token_counts(5).sum()) == 4
        # a packed position t is trained on token_{t+2}, at that token's weight
        b = pack(buf.samples(), 64)[0]
        w = (b["loss_weight"][0, :8] * b["loss_mask"][0, :8]).tolist()
        assert w == pytest.approx([pw, pw, 1, 1, 1, 1, 0, 0])
        assert weight_prompt(s, 0.0) is s


def test_buffer_rejects_ragged():
    buf = DraftBuffer(2, 100)
    with pytest.raises(ValueError, match="lengths differ"):
        buf.add(0, torch.arange(4), torch.randn(3, 24), torch.randn(4, 8), torch.ones(4, dtype=torch.bool))
