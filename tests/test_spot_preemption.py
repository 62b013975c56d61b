"""Spot-trainer preemption: the worker process is SIGKILLed at random points of its training and
restarted from its newest verified checkpoint; a corrupt checkpoint is skipped with a warning and
a metric. Real processes and real files, no mocks."""
import logging
import os
import random
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from tlt.checkpoint import newest_verified
from tlt.config import DrafterConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.spot import SpotTrainer
from tlt.models import tiny_model
from test_spot import add_rollouts

EVERY = 4


@pytest.fixture(scope="module")
def spot(tmp_path_factory):
    torch.manual_seed(0)
    target = tiny_model("llama", layers=6, hidden=128, vocab=256)
    cfg = DrafterConfig(draft_vocab_size=0, schedule="every_k", batch_tokens=128, lr=1e-3, spot_checkpoint_every=EVERY)
    drafter = build_drafter(target, cfg)
    ckpt = tmp_path_factory.mktemp("spot") / "drafter_checkpoints"
    spot = SpotTrainer(target, drafter, cfg, threads=1, checkpoint_dir=ckpt)
    add_rollouts(spot, target, [list(range(20, 60)), list(range(70, 110))])
    yield spot
    spot.close()


def _wait_steps(spot, n: int, timeout: float = 60.0) -> None:
    """Let the worker train until its step counter passes n (it is in the tail meanwhile)."""
    deadline = time.monotonic() + timeout
    while spot.progress.value < n:
        assert time.monotonic() < deadline, "spot worker made no progress"
        time.sleep(0.05)


def _weights(spot) -> dict:
    return {k: v.clone() for k, v in spot.drafter.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_killed_at_random_points_resumes_from_last_checkpoint(spot):
    rng = random.Random(0)
    for round_ in range(1, 3):
        spot.start(1)
        _wait_steps(spot, spot.weights_step + 2 * EVERY)
        time.sleep(rng.uniform(0.0, 0.5))  # a random point of the tail (mid-step, mid-write, ...)
        old_pid = spot.proc.pid
        os.kill(old_pid, signal.SIGKILL)
        reached_before_kill = spot.progress.value
        m = spot.finish()
        assert m["drafter/preemptions"] == round_
        assert spot.proc.is_alive() and spot.proc.pid != old_pid
        # What came back is exactly the newest checkpoint that verifies.
        path, skipped = newest_verified(spot.checkpoint_dir)
        assert not skipped
        assert _equal(_weights(spot), load_file(path / "drafter.safetensors"))
        assert spot.weights_step == int(path.name.split("-")[1])
        # Lost: the steps since that checkpoint. The writer is asynchronous (newest snapshot wins),
        # so a kill during a write can cost the steps of that write too; measured well under 2k.
        assert 0 <= m["drafter/steps_lost"] <= 3 * EVERY
        assert m["drafter/steps_lost"] == max(0, reached_before_kill - spot.weights_step)
        assert m["drafter/spot_steps"] >= EVERY  # the restored steps count as done
    # The new worker trains on from the restored weights and optimizer.
    before, step0 = _weights(spot), spot.weights_step
    spot.start(1)
    _wait_steps(spot, step0 + 2)
    m = spot.finish()
    assert "drafter/preemptions" not in m and m["drafter/spot_steps"] >= 2
    assert spot.weights_step > step0 and not _equal(before, _weights(spot))


def test_corrupt_checkpoint_is_skipped_with_warning_and_metric(spot, caplog):
    spot.start(1)
    _wait_steps(spot, spot.weights_step + 4 * EVERY)
    os.kill(spot.proc.pid, signal.SIGSTOP)  # frozen: no newer checkpoint appears behind our back
    (newest, _), dirs = newest_verified(spot.checkpoint_dir), sorted(spot.checkpoint_dir.glob("step-*"))
    previous = dirs[dirs.index(newest) - 1]
    expected = load_file(previous / "drafter.safetensors")
    f = newest / "drafter.safetensors"
    data = bytearray(f.read_bytes())
    data[-16:] = bytes(16)  # flip the last weights: same size, wrong sha256
    f.write_bytes(bytes(data))
    os.kill(spot.proc.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING):
        m = spot.finish()
    assert m["drafter/corrupt_checkpoints"] == 1
    assert _equal(_weights(spot), expected)
    assert spot.weights_step == int(previous.name.split("-")[1])
    text = caplog.text
    assert "corrupt" in text and newest.name in text and "spot trainer process died" in text


def test_worker_dead_between_tails_restarts_before_training(spot):
    before, step0 = _weights(spot), spot.weights_step
    time.sleep(0.5)  # the tail-end checkpoint of the previous test lands
    os.kill(spot.proc.pid, signal.SIGKILL)
    spot.proc.join(5)
    spot.start(1)  # finds the worker gone: restarts it from the newest weights, loses nothing
    assert _equal(before, _weights(spot)) and spot.weights_step >= step0
    _wait_steps(spot, step0 + 2)
    m = spot.finish()
    assert m["drafter/steps_lost"] == 0 and m["drafter/spot_steps"] >= 2
    assert spot.optimizer_state()["num_steps"] == spot.weights_step
