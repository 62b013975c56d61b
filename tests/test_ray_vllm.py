"""vLLM rollout engines as Ray actors (`make test-ray`; needs the vLLM venv, bash bench/vllm_venv.sh):
2 actors in a placement group, each owning a vLLM worker process, on a tiny fp32 Llama with an
EAGLE-3 drafter. Asserts:
  - greedy outputs equal one vLLM engine's on the same prompts (SD on every step), and the
    options each actor's worker resolved on this platform are the CPU ones (eager, no sleep mode);
  - after a policy update the actors report the new version and decode with it (in place: the
    same worker processes), which equals the single engine's decode after a sleep-mode cycle
    (sleep, update, wake, reload: tlt's plumbing, forced on this CPU);
  - an actor SIGKILLed as its first shard starts is restarted, reloaded with the current
    version, its shard re-run: nothing lost; the killed actor's vLLM worker exits with it;
  - `rollout.vllm.sleep_mode: true` on the CPU build: a UserError with the fix, before any engine;
  - `tlt run conf/smoke.yaml` on Ray with 2 vLLM actors and 2 ZeRO-2 ranks, an actor killed in
    step 1: FINISHED with the vLLM and cluster metrics, no sample lost.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from tlt.cluster import RayPlacement, RayVllmPool  # noqa: E402
from tlt.config import ClusterConfig, DrafterConfig, RolloutConfig, SpecStrategy  # noqa: E402
from tlt.drafter.model import build_drafter  # noqa: E402
from tlt.models import tiny_model, tiny_tokenizer  # noqa: E402
from tlt.versions import bump  # noqa: E402
from tlt.rollout.vllm_engine.backend import VllmRolloutEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.skipif(
    not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with `bash bench/vllm_venv.sh`")]
PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 20, 21, 22, 23], [1, 30], [1, 4, 4, 4, 4, 4], [1, 60, 3]]
CFG = RolloutConfig(backend="vllm", max_new_tokens=12, temperature=0.0, spec_threshold=100, tuner=False,
                    strategy=SpecStrategy(depth=3, topk=1, tokens=3))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A local Ray instance with 2 rollout bundles of one CPU, the model, its drafter, a local engine."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("TLT_VLLM_THREADS", "1")  # 2 cores: one per worker
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    placement = RayPlacement.start(ClusterConfig(backend="ray", rollout_actors=2, max_restarts=2), world_size=1)
    torch.manual_seed(0)
    model = tiny_model("llama", layers=2, hidden=128, vocab=512, seed=3).eval()
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    run = tmp_path_factory.mktemp("run")
    yield placement, model, drafter, run
    placement.close()
    ray.shutdown()


def _pool(placement, model, drafter, run) -> RayVllmPool:
    return RayVllmPool(placement, model, CFG, [2], 0, tiny_tokenizer(), run / "actors", drafter=drafter,
                       max_model_len=64)


def _local(model, drafter, run) -> VllmRolloutEngine:
    return VllmRolloutEngine(model, CFG, [2], 0, drafter=drafter, tokenizer=tiny_tokenizer(), run_dir=run / "local",
                             max_model_len=64, max_num_seqs=CFG.prompts_per_step * CFG.group_size)  # as an actor


def test_sleep_mode_true_on_the_cpu_build_stops_with_the_fix(tmp_path):
    """The worker resolves the options on its platform (vLLM's CPU build here) and refuses sleep mode
    before building an engine: a UserError (exit 2) that names the key and the fix."""
    from tlt.errors import UserError

    cfg = RolloutConfig(backend="vllm", spec=False, vllm={"sleep_mode": True})
    with pytest.raises(UserError, match=r"rollout.vllm.sleep_mode: true needs a GPU.*sleep_mode: auto"):
        VllmRolloutEngine(tiny_model("llama", layers=2, hidden=128, vocab=512), cfg, [2], 0, tokenizer=tiny_tokenizer(),
                          run_dir=tmp_path, max_model_len=64, max_num_seqs=4)


def _update(model, undo: bool = False) -> None:
    """A policy update (a seeded perturbation of one MLP weight), or its undo."""
    w = model.model.layers[1].mlp.down_proj.weight
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 0.5
    with torch.no_grad():
        w.sub_(delta) if undo else w.add_(delta)
    bump(model)  # as every write site does


def test_actors_match_one_engine_and_report_the_new_version(setup):
    placement, model, drafter, run = setup
    local = _local(model, drafter, run)  # the reference: one vLLM engine, before and after the update
    try:
        ref = local.generate(PROMPTS, group_size=2, spec=True)
        local_kv = next(o.split("=")[1] for o in local.options if o.startswith("vllm.kv_cache_memory_bytes"))
        assert int(local_kv) > 0
        # tlt's sleep-mode plumbing around the update (on GPUs; forced here, where vLLM's CPU worker
        # keeps its memory): pause, update, wake, then the reload; the pool never sleeps
        local.sleep_mode = True
        assert "rollout/vllm_sleep_s" in local.sleep() and local.asleep and local.sleep() == {}
        _update(model)
        woke = local.sync(model)
        assert "rollout/vllm_wake_s" in woke and "rollout/vllm_reload_s" in woke and not local.asleep
        ref_new = local.generate(PROMPTS, spec=False)
    finally:
        local.close()
        _update(model, undo=True)
    pool = _pool(placement, model, drafter, run)
    try:
        assert pool.version == 0 and len(set(pool.worker_pids())) == 2 and os.getpid() not in pool.pids()
        for opts in pool.options():  # rollout.vllm as each actor's worker resolved it, and as vLLM holds it
            assert {"platform=cpu", "enforce_eager=True", "sleep_mode=False", "vllm.enforce_eager=True",
                    "vllm.enable_sleep_mode=False", "vllm.tensor_parallel_size=1"} <= set(opts)
            assert f"vllm.kv_cache_memory_bytes={local_kv}" in opts  # tlt's KV budget: the CPU build's bytes
        tails = []
        out = pool.generate(PROMPTS, group_size=2, spec=True, on_tail=tails.append)
        assert out.response_ids == ref.response_ids and out.group_index == [i // 2 for i in range(12)]
        # once, from the first actor's engine entering its tail (its running requests) or the first shard back
        assert len(tails) == 1 and tails[0] >= 1 and out.stats.spec_steps > 0 and pool.rollout_version == 0
        workers = pool.worker_pids()
        _update(model)
        m = pool.sync(model)
        assert m["cluster/weights_pushed"] == 1.0 and pool.version == 1 and m["rollout/vllm_rebuilds"] == 0.0
        after = pool.generate(PROMPTS, spec=False)
        assert pool.rollout_version == 1 and pool.sync(model)["rollout/policy_version"] == 1.0
        assert after.response_ids == ref_new.response_ids and after.response_ids != ref.response_ids[::2]
        assert pool.worker_pids() == workers  # reloaded in place: the same engines
    finally:
        pool.close()
        _update(model, undo=True)


def test_an_actor_killed_mid_rollout_loses_nothing(setup, monkeypatch):
    """TLT_FAULT=rollout_actor:1 SIGKILLs actor 1 as its first shard starts: Ray restarts it (a new
    vLLM worker), the pool loads the current version into it and re-runs the shard; the outputs
    equal an undisturbed rollout's, and the dead actor's worker does not outlive it. An actor
    killed between rollouts misses the weight push; it is reloaded before its shard."""
    placement, model, drafter, run = setup
    pool = _pool(placement, model, drafter, run)  # undisturbed: the reference, before and after an update
    try:
        ref = pool.generate(PROMPTS, group_size=2, spec=True).response_ids
        _update(model)
        pool.sync(model)
        ref_new = pool.generate(PROMPTS, spec=False).response_ids
    finally:
        pool.close()
        _update(model, undo=True)
    monkeypatch.setenv("TLT_FAULT", "rollout_actor:1")
    pool, updated = _pool(placement, model, drafter, run), False
    try:
        first = pool.worker_pids()[1]
        out = pool.generate(PROMPTS, group_size=2, spec=True)
        assert out.response_ids == ref and pool.restarts == 1 and pool.rollout_version == pool.version == 0
        assert pool.worker_pids()[1] != first
        deadline = time.monotonic() + 60  # the orphaned worker reads EOF on its pipe and exits
        while _alive(first) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(first)
        dead = pool.pids()[0]
        os.kill(dead, signal.SIGKILL)  # between rollouts, before the weight push of a step
        _update(model)
        updated = True
        pool.sync(model)  # the push reaches the restarted actor, or it fails and the rollout reloads it
        assert pool.generate(PROMPTS, spec=False).response_ids == ref_new
        assert pool.rollout_version == pool.version == 1 and dead not in pool.pids()
    finally:
        if updated:
            _update(model, undo=True)
        pool.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.mark.slow
def test_smoke_run_on_ray_with_vllm_actors_finishes_with_a_killed_actor(prefect_api, tmp_path):
    """`tlt run conf/smoke.yaml` with 2 vLLM rollout actors and 2 ZeRO-2 ranks on a local Ray
    instance, actor 1 SIGKILLed at its first shard: FINISHED, the vLLM sync metrics of a local vLLM
    run next to the cluster's, every rollout complete, each step decoded with the version before."""
    import mlflow
    from cli_runs import cli_env, prefect_api_url, run_tlt

    from tlt.tracking import download, metric_history, read_run

    env = cli_env(tmp_path, prefect_api_url(), RAY_AUTH_MODE="disabled", TLT_FAULT="rollout_actor:1")
    sets = ["cluster.backend=ray", "rollout.backend=vllm", "cluster.rollout_actors=2", "trainer.world_size=2",
            "trainer.backend=deepspeed", "trainer.zero_stage=2", f"trainer.checkpoint_dir={tmp_path / 'runs'}"]
    proc = run_tlt(["run", str(ROOT / "conf" / "smoke.yaml"), *sum((["--set", s] for s in sets), [])], env, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tlt").experiment_id])
    rid = run.info.run_id
    got = read_run(rid, uri)
    assert got["status"] == "FINISHED"
    for key in ("rollout/vllm_sync_s", "rollout/vllm_reload_s", "rollout/vllm_rebuilds", "cluster/start_s",
                "policy/loss", "reward/mean"):
        assert key in got["metrics"], key
    assert metric_history(rid, "rollout/vllm_rebuilds", uri)[-1][1] == 0.0
    assert metric_history(rid, "cluster/actor_restarts", uri)[-1][1] == 1.0
    assert metric_history(rid, "rollout/policy_version", uri) == [(1, 0.0), (2, 1.0)]
    for step in (1, 2):  # no sample lost: prompts_per_step * group_size of conf/smoke.yaml each step
        table = json.loads(download(f"runs:/{rid}/rollouts/step_{step:04d}.json", tmp_path / str(step), uri).read_text())
        assert len(table["data"]) == 4 * 2
    start = metric_history(rid, "cluster/start_s", uri)[0][1]
    print(f"Ray + 2 vLLM actors fixed start-up: {start:.1f} s")
