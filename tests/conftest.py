"""Test setup: offline, CPU, every service state in temporary folders."""
import os
import tempfile

_TMP = tempfile.mkdtemp(prefix="tlt-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP, "prefect"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_TMP, "torch_extensions"))
os.environ.pop("MLFLOW_TRACKING_URI", None)

import pytest  # noqa: E402


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    """A fresh sqlite MLflow store for one test."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture(scope="session")
def prefect_api():
    """A real (temporary) Prefect API for flow tests."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is ~20x faster than two on a shared, loaded 2-core box."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip on a machine without a CUDA device (make test-gpu selects them)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
        for item in gpu_items:
            item.add_marker(skip)
