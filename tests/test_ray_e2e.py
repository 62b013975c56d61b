"""`tlt run conf/smoke.yaml` on Ray (`make test-ray`): 2 rollout actors and 2 DeepSpeed ZeRO-2 ranks
in a placement group on a local Ray instance the run starts and stops, against a local run of the
same recipe: the same kind of MLflow run; rollout actor 1 is SIGKILLed at its first shard and
the run goes on; a run killed in its policy update resumes on Ray from its checkpoint."""
import json
import re
import subprocess

import pytest

pytest.importorskip("ray")

from cli_runs import ROOT, TLT, cli_env, kill_group, prefect_api_url, run_tlt  # noqa: E402
from tlt.tracking import download, metric_history, read_run  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SMOKE = ["run", str(ROOT / "conf" / "smoke.yaml"), "--set", "trainer.backend=deepspeed", "--set", "trainer.zero_stage=2"]
RAY = ["--set", "cluster.backend=ray", "--set", "trainer.world_size=2", "--set", "cluster.rollout_actors=2"]
OWN = ("cluster/", "rollout/policy_version", "rollout/worker_idle_s")  # only a Ray (sharded) run logs these


def _kind(key: str) -> str:
    return re.sub(r"[/_]\d+$", "", key)  # spec/strategy/2 -> spec/strategy, .../pos_4 -> .../pos


def _run(tmp, api, sets, fault=None, resume=None, log=None):
    env = cli_env(tmp, api, RAY_AUTH_MODE="disabled", **({"TLT_FAULT": fault} if fault else {}))
    args = [*SMOKE, *sets, "--set", f"trainer.checkpoint_dir={tmp / 'runs'}", *(["--resume", resume] if resume else [])]
    return run_tlt(args, env, timeout=420, log=log)


def _crash(tmp, api, sets, fault) -> int:
    """`tlt run` until its injected SIGKILL; output to a file, not a pipe: the dead driver's Ray
    agents (orphans until killed with the process group) would hold a pipe open."""
    env = cli_env(tmp, api, RAY_AUTH_MODE="disabled", TLT_FAULT=fault)
    args = [TLT, *SMOKE, *sets, "--set", f"trainer.checkpoint_dir={tmp / 'runs'}"]
    with open(tmp / "crash.log", "w") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=420)
        finally:
            kill_group(proc.pid)


def _only_run_id(uri):
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tlt").experiment_id])
    assert len(runs) == 1
    return runs[0].info.run_id


@pytest.fixture(scope="module")
def runs(prefect_api, tmp_path_factory):
    api = prefect_api_url()
    out = {}
    for name, sets, fault in (("local", [], None), ("ray", RAY, "rollout_actor:1")):
        tmp = tmp_path_factory.mktemp(name)
        proc = _run(tmp, api, sets, fault, log=tmp / "log.txt")
        assert proc.returncode == 0, proc.stdout[-3000:]
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        out[name] = (_only_run_id(uri), uri)
    return out


def _warmstart_step(key: str) -> bool:
    """A metric a warm-start logs per drafter training step (DrafterTrainer.step's, renamed warmstart/*)."""
    name = key.split("/", 1)[1] if key.startswith("warmstart/") else ""
    return name in ("loss", "loss_feature", "loss_token", "top1_acc", "tokens", "lr", "grad_norm") or \
        name.startswith("top1_acc_step")


def test_ray_run_is_the_same_kind_of_run_as_a_local_one(runs):
    (lid, luri), (rid, ruri) = runs["local"], runs["ray"]
    local, ray_run = read_run(lid, luri), read_run(rid, ruri)
    assert local["status"] == ray_run["status"] == "FINISHED"
    own = {k for k in ray_run["metrics"] if k.startswith(OWN)}
    # every kind of local metric, nothing else but ours (per-arm / per-depth keys follow the bandit's draws);
    # the warm-start's per-step training metrics come only from a run whose warm-start trained: the two
    # runs share the drafter cache, so the second restores what the first trained (when the cache was cold)
    kinds = [{_kind(k) for k in keys if not _warmstart_step(k)} for keys in (set(ray_run["metrics"]) - own,
                                                                           local["metrics"])]
    assert kinds[0] == kinds[1]
    assert set(local["artifacts"]) == set(ray_run["artifacts"])
    p = ray_run["params"]
    assert (p["placement.rollout_actors"], p["placement.world_size"], p["placement.ray_address"]) == ("2", "2", "local")
    assert p["trainer.world_size"] == "2" and p["cluster.backend"] == "ray"
    assert metric_history(rid, "cluster/nodes", ruri) == [(0, 1.0)]
    ray_s, start_s = (metric_history(rid, f"cluster/{k}", ruri)[0][1] for k in ("ray_start_s", "start_s"))
    assert 0 < ray_s < start_s
    print(f"Ray fixed start-up: ray.init + placement {ray_s:.1f} s, + 2 rollout actors {start_s:.1f} s")
    # each step's rollout decoded with the version pushed after the step before; one push per update
    assert metric_history(rid, "rollout/policy_version", ruri) == [(1, 0.0), (2, 1.0)]
    assert metric_history(rid, "cluster/weights_version", ruri) == [(1, 1.0), (2, 2.0)]
    for key in ("policy/loss", "policy/grad_norm", "reward/mean", "spec/accept_len/mean", "drafter/spot_steps"):
        assert [s for s, _ in metric_history(rid, key, ruri)] == [1, 2], key


def test_a_rollout_actor_killed_mid_step_is_survived(runs, tmp_path):
    rid, uri = runs["ray"]
    # TLT_FAULT=rollout_actor:1 SIGKILLed actor 1 at its first shard: restarted once, shard re-run
    assert metric_history(rid, "cluster/actor_restarts", uri) == [(1, 1.0), (2, 1.0)]
    for step in (1, 2):  # no sample lost: prompts_per_step * group_size of conf/smoke.yaml each step
        table = json.loads(download(f"runs:/{rid}/rollouts/step_{step:04d}.json", tmp_path / str(step), uri).read_text())
        assert len(table["data"]) == 4 * 2


def test_a_run_killed_in_its_update_resumes_on_ray(prefect_api, tmp_path):
    """SIGKILL of the driver in RL step 2's policy update (`update:1`: faults take the 0-based step
    index; its Ray instance dies with it); `--resume` starts a new Ray instance, new trainer ranks
    load both ranks' ZeRO-2 optimizer state from checkpoint step-000001, and the run ends FINISHED
    in the same MLflow run."""
    api = prefect_api_url()
    assert _crash(tmp_path, api, RAY, "update:1") == -9  # SIGKILL
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rid = _only_run_id(uri)
    resumed = _run(tmp_path, api, RAY, resume=rid, log=tmp_path / "resume.log")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert re.findall(r"resumed from checkpoint step-(\d+) \(1 RL step done\): next RL step (\d+)",
                      resumed.stdout) == [("000001", "2")]
    run = read_run(rid, uri)
    assert run["status"] == "FINISHED" and _only_run_id(uri) == rid
    assert [s for s, _ in metric_history(rid, "policy/loss", uri)] == [1, 2]
    # the new pool's version 0 is the base policy it started with; resume loaded the checkpoint's
    # weights into the driver's model, so step 1's rollout pushed and decoded version 1
    assert metric_history(rid, "rollout/policy_version", uri)[-1] == (2, 1.0)
