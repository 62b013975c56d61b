"""Atomic, verified run checkpoints: round trip, corruption, leftovers, RNG, pruning."""
import logging
import random

import numpy as np
import pytest
import torch

from tlt.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, load_checkpoint, load_pt,
                            restore_rng, save_checkpoint, torch_blob)


def _policy():
    emb = torch.randn(8, 4)
    flat = torch.arange(12, dtype=torch.float32)  # ZeRO-style: parameters are views of one buffer
    return {"embed": emb, "lm_head": emb, "q": flat[:6].view(2, 3), "k": flat[6:].view(3, 2)}


def _optimizer_state():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    return opt.state_dict()


def _save(root, step, **kw):
    return save_checkpoint(root, step, {"policy": _policy()}, {"cursor": step * 10}, **kw)


def test_round_trip(tmp_path):
    policy, drafter, opt = _policy(), {"fc.weight": torch.randn(3, 5)}, _optimizer_state()
    state = {"cursor": 17, "mlflow_run_id": "abc", "tuner": {"1": [0.5, 2]}, "rng": capture_rng()}
    path = save_checkpoint(tmp_path, 7, {"policy": policy, "drafter": drafter}, state,
                           blobs={"policy_optim": torch_blob(opt)})
    assert path == tmp_path / "step-000007" and latest_checkpoint(tmp_path) == path
    tensors, got_state, pt_paths = load_checkpoint(path)
    for name in policy:
        assert torch.equal(tensors["policy"][name], policy[name])
    assert torch.equal(tensors["drafter"]["fc.weight"], drafter["fc.weight"])
    assert got_state == {**state, "step": 7}
    loaded = load_pt(pt_paths["policy_optim"])
    assert torch.equal(loaded["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])
    assert sorted(p.name for p in path.iterdir()) == ["MANIFEST.json", "drafter.safetensors",
                                                     "policy.safetensors", "policy_optim.pt", "state.json"]


def test_corrupt_file_falls_back_to_previous(tmp_path, caplog):
    first = _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    data = bytearray((second / "policy.safetensors").read_bytes())
    data[-1] ^= 0xFF  # flip one bit of a weight
    (second / "policy.safetensors").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tlt.checkpoint"):
        assert latest_checkpoint(tmp_path) == first
    assert "step-000002" in caplog.text
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(second)


def test_missing_manifest_and_leftover_temp_dir_are_ignored(tmp_path, caplog):
    good = _save(tmp_path, 2)
    half = tmp_path / ".tmp-step-000003-99999-deadbeef"  # a save that died before the rename
    half.mkdir()
    (half / "policy.safetensors").write_bytes(b"partial")
    no_manifest = tmp_path / "step-000004"  # renamed by hand, never verified
    no_manifest.mkdir()
    (no_manifest / "state.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="tlt.checkpoint"):
        assert latest_checkpoint(tmp_path) == good
    assert ".tmp-step-000003" in caplog.text and "step-000004" in caplog.text
    _save(tmp_path, 5)  # the next save clears leftovers of dead processes
    assert not half.exists()


def test_rng_restore_reproduces_random_numbers(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.random(), np.random.rand(), torch.rand(1)  # advance away from the seed
    path = save_checkpoint(tmp_path, 1, {}, {"rng": capture_rng()})  # through JSON
    draw = lambda: (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4).tolist())  # noqa: E731
    want = draw()
    draw()
    restore_rng(load_checkpoint(path)[1]["rng"])
    assert draw() == want


def test_keep_prunes_oldest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005"]
    assert load_checkpoint(latest_checkpoint(tmp_path))[1]["cursor"] == 50


def test_resave_same_step_replaces(tmp_path):
    _save(tmp_path, 3)
    path = save_checkpoint(tmp_path, 3, {}, {"cursor": 99})
    assert load_checkpoint(path)[1] == {"cursor": 99, "step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["step-000003"]


def test_bad_names_and_failed_writers_leave_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="no path separators"):
        save_checkpoint(tmp_path, 1, {"../evil": {}}, {})

    def boom(path):
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {}, {}, blobs={"opt": boom})
    assert list(tmp_path.iterdir()) == [] and latest_checkpoint(tmp_path) is None


def test_optimizer_state_kept_only_in_the_newest(tmp_path):
    """trainer.optimizer_keep: older checkpoints lose the optimizer blob (and its manifest entry) but
    still verify and load; the newest keep it."""
    from tlt.checkpoint import drop_blobs

    opt = _optimizer_state()
    for step in range(3):
        _save(tmp_path, step, blobs={"policy_optim": torch_blob(opt), "refresher": torch_blob({"n": step})})
        drop_blobs(tmp_path, {"policy_optim"}, keep=2)
    have = {p.parent.name for p in tmp_path.glob("step-*/policy_optim.pt")}
    assert have == {"step-000001", "step-000002"}
    oldest = tmp_path / "step-000000"
    tensors, state, pts = load_checkpoint(oldest)  # verifies: the manifest no longer lists the blob
    assert set(pts) == {"refresher"} and state["cursor"] == 0 and torch.equal(tensors["policy"]["q"], _policy()["q"])
    assert drop_blobs(tmp_path, {"policy_optim"}, keep=1) == [tmp_path / "step-000001" / "policy_optim.pt"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"
    assert "policy_optim" in load_checkpoint(tmp_path / "step-000002")[2]
