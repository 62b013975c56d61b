"""Crash and resume: `tlt run` SIGKILLed at each stage of an RL step, then `tlt run --resume <run id>`.

One chain of runs on one MLflow run (steps 0..2, a checkpoint after every step):
  R1  an exception right after checkpoint 0 is saved, before step 0's metrics are logged: Prefect
      retries the flow, which finds its MLflow run by the flow-run-id tag, resumes from checkpoint
      0 and logs step 0's metrics from it; then SIGKILL in step 1's rollout
  R2  --resume: SIGKILL in step 1's policy update
  R3  --resume: SIGKILL in step 1's drafter refresh
  R4  --resume: SIGKILL while checkpoint 1 is being written (its temp dir is left half written)
  R5  --resume: from checkpoint 0 again (the half-written one is ignored, and so is a complete-looking
      checkpoint 1 whose bytes were damaged on disk: warning + `checkpoint/corrupt_skipped`), runs to the end
and one uninterrupted run with the same seed (in parallel with R1). The resumed run must end with
bitwise the same policy and drafter weights, and hold every (metric, step) exactly once.
Tuner off (its choices depend on wall-clock) and sequential drafter refresh (the spot trainer
trains for as long as the rollout's tail lasts): both are timing-dependent by design.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cli_runs import ROOT, TLT, cli_env, prefect_api_url, run_tlt


STEPS = 3
ARGS = ["run", "conf/smoke.yaml", "--set", f"rl.steps={STEPS}", "--set", "rollout.tuner=false",
        "--set", "drafter.where=sequential", "--set", "eval.every=2", "--set", "tracking.samples_every=0",
        "--set", "export.enabled=false"]


def _args(ckpt: Path, resume: str | None = None) -> list[str]:
    return [*ARGS, "--set", f"trainer.checkpoint_dir={ckpt}", *(["--resume", resume] if resume else [])]


def _run_id(tmp: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tlt").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # resumes and retries never open a second run
    return runs[0].info.run_id


def _first_step(out: str) -> int:
    """The RL step a resumed run continued at (the resume task's log line)."""
    found = re.findall(r"resumed from checkpoint step-\d+ \(\d+ RL steps? done\): next RL step (\d+)", out)
    assert found, out[-3000:]
    return int(found[-1])


def _complete(ckpts: Path) -> list[str]:
    return sorted(p.name for p in ckpts.glob("step-*"))


def _final_weights(ckpts: Path) -> dict[str, torch.Tensor]:
    """Policy and drafter weights, and the drafter refresher's buffer and RNG, of the last checkpoint."""
    from tlt.checkpoint import load_checkpoint, load_pt

    tensors, _, pts = load_checkpoint(ckpts / f"step-{STEPS:06d}")
    refresher = load_pt(pts["refresher"])
    out = {f"{group}.{k}": v for group in ("policy", "drafter") for k, v in tensors[group].items()}
    return out | {f"buffer.{k}": v for k, v in refresher["buffer"].items()} | {"refresher.rng": refresher["rng"]}


def _expect_kill(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == -9, f"{what}: expected SIGKILL, got rc {proc.returncode}\n{proc.stdout[-3000:]}"


@pytest.mark.slow
def test_kill_anywhere_and_resume_equals_uninterrupted(prefect_api, tmp_path):
    api = prefect_api_url()
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "crash"
    ref_dir.mkdir(), dir_.mkdir()
    ckpt = dir_ / "runs"

    # the reference run, in parallel with R1 (separate store and checkpoint dir)
    ref = subprocess.Popen([TLT, *_args(ref_dir / "runs")], cwd=ROOT, env=cli_env(ref_dir, api),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    r1 = run_tlt(_args(ckpt), cli_env(dir_, api, TLT_FAULT="checkpointed:0:raise,rollout:1"),
                 log=tmp_path / "r1.log")
    _expect_kill(r1, "R1")
    assert "injected fault at checkpointed:0" in r1.stdout and "AwaitingRetry" in r1.stdout
    assert _first_step(r1.stdout) == 2  # the flow's retry found its MLflow run and resumed it
    run_id = _run_id(dir_)
    ckpts = ckpt / run_id / "checkpoints"
    assert _complete(ckpts) == ["step-000001"]

    for fault, what in [("update:1", "policy update"), ("refresh:1", "drafter refresh"),
                        ("checkpoint:1", "checkpoint write")]:
        r = run_tlt(_args(ckpt, run_id), cli_env(dir_, api, TLT_FAULT=fault), log=tmp_path / f"{what}.log")
        _expect_kill(r, what)
        assert _first_step(r.stdout) == 2, what  # continued after the last complete checkpoint (step 1)
        assert _complete(ckpts) == ["step-000001"], what
    assert list(ckpts.glob(".tmp-step-000002-*")), "the interrupted save should leave its temp dir"
    # a complete-looking checkpoint 2 whose policy bytes were damaged on disk: skipped, not loaded
    shutil.copytree(ckpts / "step-000001", ckpts / "step-000002")
    damaged = ckpts / "step-000002" / "policy.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-8:] = bytes(8)
    damaged.write_bytes(bytes(data))

    r5 = run_tlt(_args(ckpt, run_id), cli_env(dir_, api), log=tmp_path / "r5.log")
    assert r5.returncode == 0, r5.stdout[-3000:]
    assert "ignoring incomplete checkpoint" in r5.stdout  # the half-written one was seen, not loaded
    assert "skipping corrupt checkpoint" in r5.stdout and "step-000002" in r5.stdout  # the damaged one too
    assert _first_step(r5.stdout) == 2
    assert not list(ckpts.glob(".tmp-*"))

    out, _ = ref.communicate(timeout=300)
    (tmp_path / "ref.log").write_text(out)
    assert ref.returncode == 0, out[-3000:]
    ref_id = _run_id(ref_dir)

    def summary(stdout: str) -> str:  # `tlt run`'s closing line, without the export path
        return next(ln for ln in stdout.splitlines() if ln.startswith("held-out accuracy")).split(";")[0]

    assert summary(r5.stdout) == summary(out)

    # same policy, drafter and drafter buffer, bitwise (CPU, same thread count, same seeds)
    a, b = _final_weights(ckpts), _final_weights(ref_dir / "runs" / ref_id / "checkpoints")
    assert a.keys() == b.keys()
    diff = max((x.float() - b[k].float()).abs().max().item() for k, x in a.items())
    print(f"resumed vs uninterrupted: {len(a)} tensors, max abs diff {diff}")
    assert all(torch.equal(x, b[k]) for k, x in a.items()), f"max abs diff {diff}"

    # one MLflow run, every (key, step) once, no RL step lost
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{dir_ / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    ref_keys = set(MlflowClient(f"sqlite:///{ref_dir / 'mlflow.db'}").get_run(ref_id).data.metrics)
    assert set(run.data.metrics) == ref_keys | {"checkpoint/corrupt_skipped"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "checkpoint/corrupt_skipped")] == [(1, 1.0)]
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps))
    for key in ("reward/mean", "policy/loss", "drafter/loss", "timing_s/step"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, STEPS + 1)), key
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/accuracy")) == [0, 2, 3]
    # step 0's metrics: the first attempt died after checkpoint 0, before logging them; the retry
    # logged the values saved in the checkpoint
    saved = json.loads((ckpts / "step-000001" / "state.json").read_text())["metrics"]
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "reward/mean")}
    assert logged[1] == saved["reward/mean"]


def test_buffer_state_round_trip(tmp_path):
    """Buffer contents (order, dtypes, counters) survive a checkpoint; the packed batches match."""
    from tlt.checkpoint import load_checkpoint, save_checkpoint
    from tlt.drafter.buffer import DraftBuffer

    torch.manual_seed(0)
    buf = DraftBuffer(max_steps=2, max_tokens=40)
    for step in range(3):
        for n in (5, 9):
            ids = torch.randint(0, 50, (n,))
            buf.add(step, ids, torch.randn(n, 12), torch.randn(n, 4), torch.rand(n) > 0.3)
    tensors, meta = buf.state_dict()
    path = save_checkpoint(tmp_path, 0, {"buffer": tensors}, {"buffer_state": meta})
    loaded, state, _ = load_checkpoint(path)
    again = DraftBuffer(max_steps=2, max_tokens=40)
    again.load_state_dict(loaded["buffer"], state["buffer_state"])
    assert again.metadata() == buf.metadata()
    a, b = buf.batches(64, 7), again.batches(64, 7)
    assert len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_faults_are_a_no_op_unless_named(monkeypatch):
    from tlt.faults import InjectedFault, fault

    monkeypatch.delenv("TLT_FAULT", raising=False)
    fault("update", 1)
    monkeypatch.setenv("TLT_FAULT", "update:2:raise")
    fault("update", 1)
    fault("rollout", 2)
    with pytest.raises(InjectedFault):
        fault("update", 2)
    fault("update", 2)  # once per process: a retry gets past it


class _Stub:
    """A sampler or updater for save/restore: its state in, its state out."""

    def __init__(self, state):
        self.s = state

    def state(self):
        return self.s

    def load_state(self, state):
        self.s = state

    state_dict, load_state_dict = state, load_state


def test_engine_bandit_round_trips_through_a_checkpoint(tmp_path):
    """The engine's `state_dict()` (its bandit) is saved with the run and restored through
    `load_state_dict` into a fresh engine; a state that keeps the bandit as a top-level "tuner"
    (older checkpoints) is read as the engine's too."""
    from types import SimpleNamespace

    from tlt.config import RolloutConfig
    from tlt.models import tiny_model
    from tlt.rl.resume import engine_state, restore_run_state, save_run_state
    from tlt.rollout.torch_engine.engine import RolloutEngine
    from tlt.rollout.tuner import StrategyTuner

    torch.manual_seed(0)
    model = tiny_model("llama", layers=2, hidden=64, vocab=128)
    cfg = RolloutConfig(max_new_tokens=4)

    def ctx(seed: int):
        engine = RolloutEngine(model, cfg, [2], 0, tuner=StrategyTuner.from_config(cfg, seed=seed))
        return SimpleNamespace(model=model, updater=_Stub({}), sampler=_Stub({"cursor": seed}), refresher=None,
                               engine=engine)

    a = ctx(1)
    tuner = a.engine.tuner
    for i in range(20):
        tuner.update(1 + i % 8, tuner.choose(1 + i % 8), float(i % 3))
    save_run_state(a, 0, tmp_path, keep=2)
    b = ctx(2)
    assert b.engine.state_dict() != a.engine.state_dict()
    restore_run_state(b, tmp_path)
    assert b.engine.state_dict() == a.engine.state_dict() != {}
    assert engine_state({"step": 0, "tuner": {"rewards": []}}) == {"tuner": {"rewards": []}}
    assert engine_state({"step": 0, "engine": {"tuner": 1}}) == {"tuner": 1} and engine_state({"step": 0}) == {}


def test_optimizer_state_only_in_the_newest_checkpoint(tmp_path, caplog):
    """trainer.optimizer_keep=1: an older checkpoint keeps weights, cursor and RNG but not the
    policy's optimizer state; restoring it (the newer ones failed verification) still works, with
    the optimizer left as it was and a warning."""
    import logging
    import shutil
    from types import SimpleNamespace

    from tlt.config import RolloutConfig
    from tlt.models import tiny_model
    from tlt.rl.resume import restore_run_state, save_run_state, steps_done
    from tlt.rollout.torch_engine.engine import RolloutEngine

    model = tiny_model("llama", layers=2, hidden=64, vocab=128)
    engine = RolloutEngine(model, RolloutConfig(max_new_tokens=4), [2], 0)
    ctx = SimpleNamespace(model=model, updater=_Stub({"moments": 1}), sampler=_Stub({"cursor": 0}), refresher=None,
                          engine=engine)
    for step in range(2):
        ctx.sampler.s = {"cursor": step}
        save_run_state(ctx, step, tmp_path, keep=3, optimizer_keep=1)
    assert sorted(p.parent.name for p in tmp_path.glob("*/policy_optim.pt")) == ["step-000002"]  # after RL step 2
    shutil.rmtree(tmp_path / "step-000002")  # as if the newest were lost: the older one is all there is
    ctx.updater.s, ctx.sampler.s = {"moments": "fresh"}, {"cursor": 9}
    with caplog.at_level(logging.WARNING, logger="tlt.rl.resume"):
        state = restore_run_state(ctx, tmp_path)
    assert steps_done(state) == 1 and ctx.sampler.s == {"cursor": 0} and ctx.updater.s == {"moments": "fresh"}
    assert "holds no optimizer state" in caplog.text
