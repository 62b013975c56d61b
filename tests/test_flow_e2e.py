"""The smoke recipe end to end: a real Prefect API and a real sqlite MLflow store.

Two real runs (SD with the spot-trained drafter and two rollout worker processes, and plain
decoding in one process) are made once per module
and then read back, compared, exported and evaluated.
"""
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tlt.config import load_config
from tlt.schemas import RolloutSchema
from tlt.tracking import download, metric_history, read_run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(prefect_api, tmp_path_factory):
    from flows.train import tlt_train

    tmp = tmp_path_factory.mktemp("e2e")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    cfgs = [load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp / 'runs'}", *extra])
            for extra in (["rollout.workers=2"], ["rollout.spec=false", "name=smoke-plain"])]
    lines = _Lines()
    logging.getLogger("prefect").addHandler(lines)  # the task runs' console lines (tlt.console)
    try:
        results = [tlt_train(config=c) for c in cfgs]
    finally:
        logging.getLogger("prefect").removeHandler(lines)
    yield {"uri": uri, "tmp": tmp, "cfgs": cfgs, "results": results, "lines": lines.messages}
    mp.undo()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_console_says_what_happened(runs):
    """One line per RL step with the step's numbers and the drafter's decision, one per evaluation, the
    refresh summary; steps counted from 1 (Prefect task runs rl-step-1, rl-step-2)."""
    steps = [m for m in runs["lines"] if m.startswith("RL step ")]
    assert [s.split(":")[0] for s in steps] == ["RL step 1/2", "RL step 2/2"] * 2, steps
    sd = steps[0]
    for part in ("reward ", "rollout ", "tok/s (step ", "SD share ", "live accept length ", "; drafter "):
        assert part in sd, (part, sd)
    # the smoke recipe refreshes every step; step 1's tail has an empty buffer (one-step offset)
    assert sd.endswith("drafter due, trained 0 steps (empty buffer or no tail)"), sd
    assert "drafter trained" in steps[1], steps[1]
    evals = [m for m in runs["lines"] if m.startswith("evaluation ")]
    assert evals[0].startswith("evaluation before training: held-out accuracy ") and "greedy" in evals[0]
    assert [m for m in runs["lines"] if m.startswith("drafter refreshes: ")][0].startswith(
        "drafter refreshes: 1 of 2 RL steps (schedule every_k, spot), at step 2")
    assert not any("interpreted in multiple ways" in m for m in runs["lines"])


def test_run_tags_and_headline(runs):
    """MLflow: the code's commit and tlt's version as tags, headline summary/* metrics and the description."""
    from tlt.provenance import git_state, tlt_version

    run = read_run(runs["results"][0]["run_id"], runs["uri"])
    tags = run["tags"]
    assert tags["tlt.version"] == tlt_version() and tags["mlflow.source.name"] == "tlt-train"
    assert tags["mlflow.source.git.commit"] == git_state()[0]
    summary = {k: v for k, v in run["metrics"].items() if k.startswith("summary/")}
    assert summary["summary/heldout_accuracy"] == run["metrics"]["eval/accuracy"]
    assert summary["summary/drafter_refreshes"] == 1.0 and summary["summary/live_accept_len"] >= 1.0
    assert "| held-out accept length (fixed chain, greedy) |" in tags["mlflow.note.content"]


def test_every_stage_tracked(runs):
    from prefect.artifacts import Artifact

    from tlt.drafter.eagle3 import check_export
    from tlt.models import load_target

    uri, cfg, result = runs["uri"], runs["cfgs"][0], runs["results"][0]
    rid = result["run_id"]
    run = read_run(rid, uri)
    assert run["status"] == "FINISHED"
    assert run["params"]["rl.steps"] == str(cfg.rl.steps) and run["params"]["model.name_or_path"] == "tiny:llama"
    assert "config.yaml" in run["artifacts"] and run["tags"]["prefect.flow_run_id"]
    acc = metric_history(rid, "eval/accuracy", uri)
    assert [s for s, _ in acc] == list(range(cfg.rl.steps + 1)) and all(0 <= v <= 1 for _, v in acc)
    for key in ("reward/mean", "spec/accept_len/mean", "policy/loss", "drafter/steps", "timing_s/step",
                "timing_s/update_drafter", "rollout/response_length/max", "rollout/worker_idle_s"):
        assert [s for s, _ in metric_history(rid, key, uri)] == list(range(1, cfg.rl.steps + 1)), key
    # spot trainer: step 1's buffer is empty (one-step offset), later steps train in the tail
    spot = dict(metric_history(rid, "drafter/spot_steps", uri))
    assert spot[1] == 0 and spot[2] > 0
    assert metric_history(rid, "warmstart/accept_len_after", uri)
    assert "plots" in run["artifacts"]
    # the model folder is the run's logged model, and the one registered version points at it
    logged = run["models"]["model"]
    assert logged["status"] == "READY" and logged["step"] == cfg.rl.steps and logged["tags"]["format"] == "tlt-model"
    client = MlflowClient(uri)
    version = client.get_model_version(cfg.export.model_name, result["export"]["version"])
    assert version.source == f"models:/{logged['model_id']}" and version.run_id == rid
    assert [v.run_id for v in client.search_model_versions(f"name='{cfg.export.model_name}'")].count(rid) == 1
    assert version.tags["run_id"] == rid and version.tags["base_model"] == "tiny:llama"
    assert float(version.tags["heldout_accuracy"]) == result["eval"]["accuracy"]
    assert float(version.tags["accept_len"]) == result["export"]["accept_len"] >= 1.0
    # the validated prompt tables and the drafter corpus are the run's dataset inputs
    assert {k: v["context"] for k, v in run["datasets"].items()} == {
        "train-prompts": "train", "heldout-prompts": "eval", "drafter-corpus": "train"}
    plain = read_run(runs["results"][1]["run_id"], uri)["datasets"]
    assert plain["train-prompts"]["digest"] == run["datasets"]["train-prompts"]["digest"]  # same data, same digest
    # the rollout table of each step is a validated RolloutSchema frame
    table = json.loads(download(f"runs:/{rid}/rollouts/step_0001.json", runs["tmp"] / "dl", uri).read_text())
    assert table["columns"] == list(RolloutSchema.to_schema().columns)
    assert len(table["data"]) == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    for key in ("data-report", "models", "warmstart", "rl-step", "eval", "run-report", "export"):
        assert Artifact.get(key) is not None, key
    target, _ = load_target(cfg.model)
    assert check_export(Path(result["export"]["path"]) / "drafter", target.config) == []
    assert result["export"]["version"] is not None
    ckpts = sorted((runs["tmp"] / "runs" / rid / "checkpoints").glob("step-*"))
    assert ckpts[-1].name == f"step-{cfg.rl.steps:06d}"  # counted from 1, like the RL steps


def test_plain_run_has_no_speculation(runs):
    rid = runs["results"][1]["run_id"]
    assert metric_history(rid, "spec/enabled_share", runs["uri"])[-1][1] == 0.0
    assert runs["results"][1]["export"] is not None  # the warm-started drafter is still exported with the policy


def _tlt(*args, env_uri):
    import os

    env = dict(os.environ, MLFLOW_TRACKING_URI=env_uri)
    return subprocess.run([sys.executable, "-m", "tlt.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)


def test_compare_two_real_runs(runs, tmp_path):
    from tlt.compare import compare_runs

    ids = [r["run_id"] for r in runs["results"]]
    df = compare_runs(ids, runs["uri"])
    assert list(df["run_id"]) == ids
    assert df["accept_len_live"].iloc[0] >= 1.0 and df["accept_len_heldout"].iloc[0] >= 1.0
    assert df["steps"].tolist() == [2, 2] and df["refreshes"].iloc[0] >= 1  # smoke: every_k, spot
    out = _tlt("compare", *ids, "--out", str(tmp_path / "cmp.png"), env_uri=runs["uri"])
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cmp.png").stat().st_size > 1000 and "smoke" in out.stdout


def test_export_cli_from_checkpoint_and_refuses_non_empty(runs, tmp_path):
    rid = runs["results"][0]["run_id"]
    ckpt_root = runs["tmp"] / "runs" / rid
    out = _tlt("export", "--checkpoint", str(ckpt_root), "--out", str(tmp_path / "d"), env_uri=runs["uri"])
    assert out.returncode == 0, out.stderr
    folder = (tmp_path / "d").resolve()
    assert (folder / "policy" / "model.safetensors").exists() and (folder / "drafter" / "model.safetensors").exists()
    assert f"serve it: vllm serve {folder / 'policy'} --speculative-config" in out.stdout
    assert "registered" not in out.stdout  # only --register registers
    again = _tlt("export", "--checkpoint", str(ckpt_root), "--out", str(tmp_path / "d"), env_uri=runs["uri"])
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr
    forced = _tlt("export", "--checkpoint", str(ckpt_root), "--out", str(tmp_path / "d"), "--force",
                  "--what", "policy", env_uri=runs["uri"])
    assert forced.returncode == 0, forced.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "policy", "tlt-model.json"]


def test_export_register_carries_the_runs_tags(runs, tmp_path):
    rid, cfg = runs["results"][0]["run_id"], runs["cfgs"][0]
    client = MlflowClient(runs["uri"])
    before = len(client.search_model_versions(f"name='{cfg.export.model_name}'"))
    out = _tlt("export", "--run", rid, "--out", str(tmp_path / "r"), "--register", env_uri=runs["uri"])
    assert out.returncode == 0, out.stderr
    versions = client.search_model_versions(f"name='{cfg.export.model_name}'")
    assert len(versions) == before + 1
    new = max(versions, key=lambda v: int(v.version))
    run_version = client.get_model_version(cfg.export.model_name, runs["results"][0]["export"]["version"])
    assert set(new.tags) == set(run_version.tags)
    for key in ("base_model", "run_id", "heldout_accuracy", "checkpoint_step", "draft_strategy", "precision"):
        assert new.tags[key] == run_version.tags[key], key


def test_export_of_a_checkpoint_whose_shapes_disagree_is_refused(runs, tmp_path):
    import shutil

    rid = runs["results"][0]["run_id"]
    run_dir = tmp_path / "copy"
    shutil.copytree(runs["tmp"] / "runs" / rid, run_dir, ignore=shutil.ignore_patterns("model"))
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("tiny_hidden: 128", "tiny_hidden: 192"))
    out = _tlt("export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "bad"), env_uri=runs["uri"])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "policy does not fit the model its run's config.yaml builds" in out.stderr
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_evaluate_flow_on_checkpoint(runs, monkeypatch):
    from flows.evaluate import tlt_evaluate
    from tlt.checkpoint import latest_checkpoint

    monkeypatch.setenv("MLFLOW_TRACKING_URI", runs["uri"])
    rid = runs["results"][0]["run_id"]
    ckpt = latest_checkpoint(runs["tmp"] / "runs" / rid / "checkpoints")
    res = tlt_evaluate(config=runs["cfgs"][0], checkpoint=str(ckpt))
    assert res["eval"]["step"] == runs["cfgs"][0].rl.steps and 0 <= res["eval"]["accuracy"] <= 1
    assert res["eval"]["accept_len"] is not None and res["eval"]["accept_len"] >= 1.0


def test_retrain_from_the_registry_with_runs_deleted(runs, monkeypatch):
    """tlt-train/retrain with the training runs' folders gone: it continues from the champion
    version's files in the registry and ends with a promotion decision and its reason."""
    from flows.train import tlt_train
    from tlt.tracking import set_champion

    monkeypatch.setenv("MLFLOW_TRACKING_URI", runs["uri"])
    cfg, first = runs["cfgs"][0], runs["results"][0]
    set_champion(cfg.export.model_name, first["export"]["version"], runs["uri"])
    aside = runs["tmp"] / "runs-aside"
    (runs["tmp"] / "runs").rename(aside)  # rm -rf runs/, undone after the test for the tests that follow
    try:
        retrain_cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={runs['tmp'] / 'retrain'}",
                                                                "name=smoke-retrain"])
        result = tlt_train(config=retrain_cfg, retrain=True)
    finally:
        aside.rename(runs["tmp"] / "runs")
    run = read_run(result["run_id"], runs["uri"])
    assert run["status"] == "FINISHED"
    assert run["tags"]["retrain.from_version"] == first["export"]["version"]
    assert run["tags"]["retrain.policy"].startswith("models:/")
    reason = run["tags"]["export.promotion_reason"]
    promoted = run["metrics"]["export/promoted"]
    if promoted == 1.0:
        assert "held-out accuracy held" in reason and "accept length held" in reason, reason
    else:
        assert "dropped" in reason, reason
