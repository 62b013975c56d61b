"""What a user of MLflow's UI and registry sees of a run (a real sqlite store): a model-training
experiment, a link to the run in the UI's training view, and an exported folder as the run's
logged model, registered as a version whose artifacts are that folder."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tlt.tracking import MlflowTracker, champion, download, read_run, run_link, set_champion

pytestmark = pytest.mark.slow  # MLflow registry runs: seconds each


def test_experiment_is_tagged_as_model_training(mlflow_uri, tmp_path):
    client = MlflowClient(mlflow_uri)
    MlflowTracker("fresh", uri=mlflow_uri, spool_dir=tmp_path / "spool").end()
    assert client.get_experiment_by_name("fresh").tags["mlflow.experimentKind"] == "custom_model_development"
    # an experiment made elsewhere gets the tag; a kind chosen by the user is kept
    old = client.create_experiment("older")
    chosen = client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    MlflowTracker("older", uri=mlflow_uri, spool_dir=tmp_path / "spool").end()
    MlflowTracker("chosen", uri=mlflow_uri, spool_dir=tmp_path / "spool").end()
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_run_link_opens_the_training_view(mlflow_uri, tmp_path):
    """MLflow 3.17's UI ignores the kind tag and opens the GenAI view unless the URL asks: the link
    `tlt run` prints asks. A local store is served by `tlt ui` (port 5000)."""
    tracker = MlflowTracker("linked", uri=mlflow_uri, spool_dir=tmp_path / "spool")
    tracker.end()
    exp_id = MlflowClient(mlflow_uri).get_run(tracker.run_id).info.experiment_id
    assert run_link(tracker.run_id, mlflow_uri) == (
        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{tracker.run_id}?workflowType=machine_learning")


def test_exported_folder_is_the_runs_registered_logged_model(mlflow_uri, tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (folder / "model.safetensors").write_bytes(b"weights")
    tracker = MlflowTracker("models", uri=mlflow_uri, spool_dir=tmp_path / "spool")
    version = tracker.log_model(folder, "drafter", register_as="tlt-drafter", tags={"accept_len": "2.000"}, step=3)
    unregistered = tracker.log_model(folder, "scratch")
    tracker.end()
    assert version == "1" and unregistered is None

    models = read_run(tracker.run_id, mlflow_uri)["models"]
    assert set(models) == {"drafter", "scratch"}
    drafter = models["drafter"]
    assert drafter["status"] == "READY" and drafter["step"] == 3 and drafter["source_run_id"] == tracker.run_id
    assert drafter["tags"]["accept_len"] == "2.000"
    assert '"version": "1"' in drafter["tags"]["mlflow.modelVersions"]  # the model page lists its version

    set_champion("tlt-drafter", version, mlflow_uri)
    found = champion("tlt-drafter", mlflow_uri)
    assert found["source"] == f"models:/{drafter['model_id']}" and found["run_id"] == tracker.run_id
    local = download(found["source"], tmp_path / "dl", mlflow_uri)
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    assert (local / "model.safetensors").read_bytes() == b"weights"
