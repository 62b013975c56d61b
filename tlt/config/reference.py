"""The config reference of docs/configuration.md, generated from the pydantic models: one section per
stage in the order a run meets them, keys relative to their stage, defaults as YAML (a long one below
its table). `tlt config reference --write docs/configuration.md` refreshes the page; a test fails
when it is stale."""
from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from tlt.config.stages import RunConfig

LONG = 40  # characters: a default longer than this is shown as a YAML block under its stage's table
# stage -> what it configures (the models carry the per-key descriptions)
STAGES = {
    "": "The run itself.",
    "model": "The target policy: which model, in which dtype.",
    "data": "The prompts: a file or reasoning-gym generators, their validation and the held-out split.",
    "drafter": "The EAGLE-3 drafter: its shape, the warm-start on a self-distilled corpus, and when and where it "
               "trains during RL (the refresh schedule).",
    "rollout": "Generating the responses: the engine, sampling, speculative decoding in the tail, the bandit.",
    "rl": "The RL step: GRPO, the reward, the number of steps.",
    "trainer": "The policy update: backend, device, precision, checkpoints.",
    "cluster": "Scale-out on Ray (`cluster.backend: ray`) and the vLLM engine's options.",
    "eval": "Held-out evaluation during and after training.",
    "tracking": "MLflow: where runs are stored, what is logged, outages.",
    "export": "The EAGLE-3 export of the drafter and its registered model.",
    "deploy": "Prefect deployments and the retrain schedule.",
}


def _type_name(ann: Any) -> str:
    if get_origin(ann) is Annotated:  # a constrained type (int >= 0): its base type
        return _type_name(get_args(ann)[0])
    if getattr(ann, "__origin__", None) is Literal:
        return " / ".join(str(a) for a in ann.__args__)
    if getattr(ann, "__origin__", None) is Union or isinstance(ann, types.UnionType):  # X | None, bool | Literal
        return " or ".join(_type_name(a) for a in get_args(ann))
    if ann is type(None):
        return "null"
    if getattr(ann, "__origin__", None) is list:
        return f"list of {_type_name(get_args(ann)[0])}" if get_args(ann) else "list"
    return getattr(ann, "__name__", str(ann)).replace("typing.", "")


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _yaml(value: Any, flow: bool = True) -> str:
    return yaml.safe_dump(_plain(value), default_flow_style=flow, sort_keys=False, width=1000).strip().removesuffix(
        "\n...").strip()


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    """(key relative to the stage, field) of every leaf field, nested models flattened (`vllm.x`)."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and prefix is not None:
            out += _rows(ann, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", field))
    return out


def _section(stage: str, rows: list[tuple[str, Any]]) -> list[str]:
    title = f"### `{stage}`" if stage else "### Run"
    lines = [title, "", STAGES.get(stage, ""), "", "| key | type | default | description |", "|---|---|---|---|"]
    long = []
    for key, field in rows:
        default = _plain(field.get_default(call_default_factory=True))
        shown = _yaml(default)
        if len(shown) > LONG:
            long.append((key, default))
            shown = "see below"
        else:
            shown = f"`{shown}`"
        desc = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{key}` | {_type_name(field.annotation).replace('|', chr(92) + '|')} | {shown} | {desc} |")
    for key, default in long:
        lines += ["", f"Default of `{stage + '.' if stage else ''}{key}`:", "", "```yaml", _yaml(default, flow=False),
                  "```"]
    return lines + [""]


def reference_markdown() -> str:
    """The config reference of docs/configuration.md: one section per stage, its keys in a table."""
    top = [(n, f) for n, f in RunConfig.model_fields.items()
           if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    lines = _section("", top)
    stages = [n for n, f in RunConfig.model_fields.items() if (n, f) not in top]
    for stage in sorted(stages, key=lambda s: list(STAGES).index(s) if s in STAGES else len(STAGES)):
        lines += _section(stage, _rows(RunConfig.model_fields[stage].annotation, ""))
    return "\n".join(lines).rstrip()
