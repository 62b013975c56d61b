"""The supported-architecture matrix (tlt.arch.MATRIX), each row end to end on a tiny random model built
from transformers' own config class with the architecture's structure (q/k norms, sliding windows,
per-layer RoPE, scaled embeddings, tied heads, biases, partial rotary, experts): load from a folder,
greedy decoding with SD on == SD off == transformers' generate past the sliding window, one RL step,
a drafter warm start that beats an untrained one, an export that passes check_export, and a
checkpoint that resumes to the same weights and the same next step."""
from __future__ import annotations

import pytest
import torch

from tlt import arch, preflight
from tlt.checkpoint import load_checkpoint, load_pt, save_checkpoint, torch_blob
from tlt.config import DrafterConfig, ModelConfig, RLConfig, RolloutConfig, SpecStrategy, TrainerConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, pack
from tlt.drafter.eagle3 import check_export, export_eagle3, load_eagle3
from tlt.models import TINY_WINDOW, load_target, tiny_model, tiny_tokenizer
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.rl.update import PolicyBatch, TorchUpdater
from tlt.rollout import RolloutEngine
from tlt.rollout.acceptance import measure_accept
from tlt.versions import write_weights

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW = 512, 24
CHAIN = SpecStrategy(depth=3, topk=1, tokens=3)
DRAFT = dict(draft_vocab_size=64, lr=5e-3, loss_token_weight=1.0, ttt_steps=2)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _engine(model, drafter, spec_every_step: bool = True) -> RolloutEngine:
    cfg = RolloutConfig(max_new_tokens=NEW, temperature=0.0, spec_threshold=100 if spec_every_step else 0,
                        spec_patience=0, tuner=False, drafter="eagle", strategy=CHAIN, guard_patience=0)
    return RolloutEngine(model, cfg, eos_ids=[2], pad_id=0, drafter=drafter)


@pytest.fixture(scope="module", params=sorted(arch.TINY))
def row(request):
    """(arch, target, greedy samples of 4 prompts, untrained drafter, drafter trained 30 steps on them)."""
    name = request.param
    model = tiny_model(name, seed=1)
    prompts = _prompts(4, seed=0)
    out = _engine(model, None).generate(prompts, spec=False)
    seqs = [p + r for p, r in zip(prompts, out.response_ids)]
    drafted = {}
    for trained in (False, True):
        torch.manual_seed(0)
        d = build_drafter(model, DrafterConfig(**DRAFT))
        samples = collect_samples(model, seqs, [len(p) for p in prompts], d.aux_layer_ids)
        d.set_vocab(count_tokens(samples, VOCAB))
        if trained:
            tr = DrafterTrainer(d, DrafterConfig(**DRAFT), model.get_output_embeddings().weight)
            batch = pack(samples, 512)[0]
            for _ in range(30):
                tr.step(batch)
        drafted[trained] = d.eval()
    return name, model, prompts, drafted[False], drafted[True]


def test_in_matrix_and_loads_from_a_folder(row, tmp_path):
    name, model, *_ = row
    assert arch.arch_of(model.config).tiny == name
    model.save_pretrained(tmp_path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(tmp_path)
    mcfg = ModelConfig(name_or_path=str(tmp_path))
    loaded, _ = load_target(mcfg)
    assert type(loaded) is type(model)
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    assert preflight.target_config(mcfg).model_type == model.config.model_type


def test_greedy_sd_equals_plain_equals_transformers(row):
    """Greedy is lossless with the drafter, and the slot cache equals transformers' own decoding, also
    for sliding-window layers (sequences run past TINY_WINDOW)."""
    name, model, prompts, _, trained = row
    eng = _engine(model, trained)
    on, off = eng.generate(prompts, spec=True), eng.generate(prompts, spec=False)
    assert on.response_ids == off.response_ids
    assert sum(on.drafted) > 0 and off.stats.spec_tokens == 0  # SD really ran, and really was off
    for p, r in zip(prompts, off.response_ids):
        assert len(p) + len(r) > TINY_WINDOW
        hf = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert r == hf[0, len(p):].tolist()[: len(r)], name


def test_warm_started_drafter_accepts_more_than_untrained(row):
    name, model, prompts, untrained, trained = row
    before = measure_accept(_engine(model, untrained), prompts, max_new_tokens=NEW, strategy=CHAIN)
    after = measure_accept(_engine(model, trained), prompts, max_new_tokens=NEW, strategy=CHAIN)
    assert after.responses == before.responses  # greedy: the target's tokens either way
    assert after.accept_len > before.accept_len + 0.3, (name, before.accept_len, after.accept_len)


def test_export_passes_its_checks_and_reloads(row, tmp_path):
    name, model, _, _, trained = row
    preflight.check_drafter_plan(model.config, DrafterConfig(**DRAFT))  # the preflight says yes ...
    out = export_eagle3(trained, model.config, tmp_path / "eagle3")  # ... and the export agrees
    assert check_export(out, model.config) == []
    back = load_eagle3(out, model)
    ids, hid, pos = torch.randint(3, VOCAB, (2, 6)), torch.randn(2, 6, model.config.hidden_size), torch.arange(6)[None]
    with torch.no_grad():
        torch.testing.assert_close(back(ids, hid, pos.expand(2, 6))[1], trained(ids, hid, pos.expand(2, 6))[1])


def _rl_batch(model) -> PolicyBatch:
    ids, attn, resp, pos = make_batch([[1, 5, 6], [1, 7, 8, 9]], [[20, 21, 22], [23, 24]], pad_id=0)
    with torch.no_grad():
        old = forward_logprobs(model, ids, attn, resp, position_ids=pos).logp
    return PolicyBatch(ids, attn, resp, old, torch.tensor([1.0, -1.0]), position_ids=pos)


def test_rl_step_then_checkpoint_resumes_same_weights_and_next_step(row, tmp_path):
    name, _, _, _, trained = row
    policy = tiny_model(name, seed=2)
    updater = TorchUpdater(policy, RLConfig(lr=1e-3), TrainerConfig(micro_batch_size=2))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    updater.step(_rl_batch(policy))
    unchanged = [k for k, v in policy.state_dict().items() if torch.equal(v, before[k])]
    assert unchanged == [], unchanged
    path = save_checkpoint(tmp_path, 1, {"policy": policy.state_dict(), "drafter": trained.state_dict()}, {},
                           blobs={"policy_optim": torch_blob(updater.state_dict())})
    tensors, _, pts = load_checkpoint(path)
    resumed = tiny_model(name, seed=3)
    write_weights(resumed, tensors["policy"])
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in resumed.state_dict().items())
    drafter = build_drafter(resumed, DrafterConfig(**DRAFT))
    write_weights(drafter, tensors["drafter"])
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in drafter.state_dict().items())
    again = TorchUpdater(resumed, RLConfig(lr=1e-3), TrainerConfig(micro_batch_size=2))
    again.load_state_dict(load_pt(pts["policy_optim"]))
    updater.step(_rl_batch(policy))
    again.step(_rl_batch(resumed))
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in resumed.state_dict().items())


def test_drafter_teacher_logits_are_the_targets(row):
    """The drafter trains towards the target's distribution rebuilt from the captured final hidden
    state (hidden_states[-1], after the final norm) and the LM head: with Granite's logits_scaling or a
    soft cap, the raw head output is not the target's logits."""
    name, model, prompts, _, trained = row
    with torch.no_grad():
        out = model(torch.tensor([prompts[0]]), output_hidden_states=True)
        head = model.get_output_embeddings().weight
        torch.testing.assert_close(trained.target_logits(out.hidden_states[-1] @ head.T), out.logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_smoke_recipe_runs_every_stage_through_the_export(name, tmp_path):
    """The two architectures that failed a smoke run (Gemma 3 at the drafter build, Phi-3 at the very end,
    in the export's checks): every stage of the smoke recipe, export included, on their tiny models."""
    from pathlib import Path

    from tlt.config import load_config
    from tlt.preflight import check_run_inputs
    from tlt.pipeline import Pipeline

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "conf" / "smoke.yaml", [
        f"model.name_or_path=tiny:{name}", "rl.steps=1", f"trainer.checkpoint_dir={tmp_path / 'runs'}",
        f"export.out_dir={tmp_path / 'export'}", "drafter.where=sequential", "drafter.draft_vocab_size=128",
        f"model.cache_dir={tmp_path / 'models'}"])  # corpus and warm-start caches next to it, not in the repo's
    check_run_inputs(cfg)
    with Pipeline(cfg) as p:
        p.validate_data()
        p.prepare()
        p.warmstart()
        assert p.resume() == 0
        p.rl_step(0)
        summary = p.export(p.evaluate(1))
    folder = Path(summary.path)  # the run's model folder: policy/ + drafter/ (tlt.model_folder)
    assert folder == tmp_path / "export" and check_export(folder / "drafter", p.model.config) == []
    assert (folder / "policy" / "config.json").is_file()
