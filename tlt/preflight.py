"""Checks that load something to fail a run in seconds, before Prefect, MLflow, workers or Ray start,
instead of after training: `check_run_inputs` (every id, path and name, through tlt.inputs' cheap
checks, plus the target's architecture and its drafter's export built on meta tensors), and
`check_prompts` (the prompts validated as the data stage will, a user reward function tried on the
gold answers). tlt.inputs holds the checks the loaders share; this module sits above the loaders."""
from __future__ import annotations

from tlt import arch
from tlt.inputs import (BUNDLED, ModelError, check_data_file, check_device, check_empty_target, check_folder_target,
                        check_model, check_resume_config, model_folder, offline, resolve_run_id, tiny_arch)
from tlt.rl.rewards import BUILTIN, checked_rewards, get_reward_fn


def check_reward_fn(cfg, rows) -> None:
    """A user reward function that raises or returns NaN on the gold answers themselves raises
    RewardError here, not after warm-start."""
    if cfg.rl.reward not in BUILTIN:
        answers = [str(a) for a in rows["answer"]]
        checked_rewards(get_reward_fn(cfg.rl.reward), answers, answers, tasks=list(rows["task"]),
                        metas=list(rows["meta"]))


def check_drafter_plan(config, drafter_cfg) -> None:
    """Build the drafter for `config` without weights (meta tensors) and check the export it will
    write: its key set and shapes, and its config.json read back (RoPE, positions, layer ids) — the
    checks the export stage runs at the end of a run, here before the first step."""
    import json
    import tempfile
    from pathlib import Path

    import torch

    from tlt.drafter.model import Eagle3Drafter
    from tlt.drafter.eagle3 import CONFIG, _check_config, eagle3_config, expected_shapes

    a = arch.arch_of(config)
    try:
        with torch.device("meta"):
            drafter = Eagle3Drafter(config, torch.empty(config.vocab_size, config.hidden_size),
                                    drafter_cfg.draft_vocab_size, drafter_cfg.aux_layer_ids)
    except (ValueError, KeyError, TypeError) as err:
        raise arch.ArchError(f"cannot build the EAGLE-3 drafter for this {a.name} target: {err}. Check drafter.* "
                        "(aux_layer_ids must be 3 hidden-state ids in [0, num_hidden_layers]).") from None
    want = expected_shapes(config, drafter.draft_vocab_size)
    have = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k in want or k not in ("d2t", "t2d")}
    problems = [f"{k}: {have.get(k)} vs {want.get(k)}" for k in sorted(set(want) | set(have))
                if have.get(k) != want.get(k)]
    raw = eagle3_config(drafter, config, torch.float32)
    with tempfile.TemporaryDirectory(prefix="tlt-preflight-") as tmp:
        (Path(tmp) / CONFIG).write_text(json.dumps(raw))
        problems += _check_config(Path(tmp), raw, config)
    if problems:
        raise arch.ArchError(f"the EAGLE-3 export for this {a.name} ({a.model_type}) target would fail its checks at the "
                        f"end of the run: {'; '.join(problems)}. This is a tlt limitation for this model; train with "
                        "rollout.drafter: ngram and export.enabled: false, or use another architecture.")


def target_config(model_cfg):
    """The target's transformers config, read without its weights; None for the bundled SmolLM2 (a
    Llama, converted on first use) and for a hub id whose config is not at hand (the loader reports)."""
    name = model_cfg.name_or_path
    tiny = tiny_arch(name)
    if tiny:
        from tlt.models import tiny_config  # deferred: transformers

        return tiny_config(tiny, model_cfg.tiny_layers, model_cfg.tiny_hidden, model_cfg.tiny_vocab)
    if name == BUNDLED:
        return None
    from transformers import AutoConfig

    folder = model_folder(name)
    try:
        return AutoConfig.from_pretrained(str(folder) if folder else name, local_files_only=offline())
    except ValueError as err:  # a model_type this transformers does not know
        raise arch.ArchError(f"model.name_or_path '{name}': transformers cannot read its config.json ({err}); "
                        f"tlt trains {arch.supported_names()}.") from None
    except OSError:
        return None


def check_run_target(cfg) -> None:
    """Preflight of a run's target (`check_run_inputs`): its architecture is in the matrix,
    vLLM serves it with the drafter when rollout.backend is vllm, and the drafter and its export build."""
    config = target_config(cfg.model)
    if config is None:
        return
    arch.arch_of(config)
    if cfg.rollout.drafter != "eagle":
        return
    if cfg.rollout.backend == "vllm":
        arch.require_vllm_eagle3(config, "rollout.backend: vllm with rollout.drafter: eagle")
    check_drafter_plan(config, cfg.drafter)


def check_run_inputs(cfg, resume: str | None = None) -> str | None:
    """Every id, path and name of a run config (plus `--resume`), before anything starts; returns
    the full id of the run to resume (a prefix is resolved), or None."""
    check_model(cfg.model.name_or_path)
    check_run_target(cfg)
    check_device(cfg)
    if cfg.data.path:
        check_data_file(cfg.data.path)
    check_folder_target(cfg.trainer.checkpoint_dir, "trainer.checkpoint_dir")
    e = cfg.export
    if e.enabled and e.out_dir:
        check_empty_target(e.out_dir, "export.out_dir", "remove it (`tlt export --force` replaces a directory from "
                           "a finished run's checkpoint)")
    if cfg.rl.reward not in ("auto", "math", "reasoning_gym"):
        get_reward_fn(cfg.rl.reward)  # imports the user's module: errors name it
    if cfg.rollout.backend == "vllm":
        from tlt.rollout.vllm_engine.process import vllm_python  # deferred: torch

        vllm_python()
    if not resume:
        return None
    run_id = resolve_run_id(resume, cfg.tracking.tracking_uri, "--resume")
    check_resume_config(cfg, run_id)
    return run_id


def check_prompts(cfg, strict: bool = True) -> str:
    """Load the model's tokenizer and the run's prompts (data.path or data.generators), validate every
    row as the data stage will, then score the gold answers with a user reward function. `tlt run`
    calls it before Prefect and MLflow start, so a bad file or reward stops the command with its
    paragraph and leaves no run behind; `tlt config check` calls it with `strict` off, where a model
    this machine does not have (a GPU recipe on a laptop) skips the prompt-length check instead of
    failing. Returns a one-line summary."""
    from tlt.prompts import load_dataset  # deferred: pandas, reasoning-gym

    tokenizer = None
    try:
        check_model(cfg.model.name_or_path)
    except ModelError:
        if strict:
            raise
    else:
        from tlt.models import load_tokenizer  # deferred: torch, transformers

        tokenizer = load_tokenizer(cfg.model)
    ds = load_dataset(cfg.data, tokenizer)
    check_reward_fn(cfg, ds.train.head(4))
    dropped = f", {len(ds.dropped)} invalid rows dropped" if len(ds.dropped) else ""
    limit = "" if tokenizer is not None else "; prompt lengths not checked (the model is not on this machine)"
    return (f"{len(ds.train) + len(ds.heldout)} valid prompts from {cfg.data.path or 'data.generators'}{dropped}, "
            f"reward {cfg.rl.reward}{limit}")
