"""Loading a run configuration: YAML recipes, dotted `--set` overrides, errors phrased for the user
(the dotted key and the fix), and the flat / YAML / Markdown views of a `RunConfig`."""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tlt.config.stages import RunConfig
from tlt.errors import UserError


class ConfigError(UserError):
    """A config problem, already phrased for the user (dotted key + fix)."""


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _all_keys(ann, dotted + ".")
    return keys


# Keys that older recipes (and run folders' config.yaml) may still hold: why they went, what to do.
_REMOVED = {"drafter.variant": "the drafter is always EAGLE-3 (EAGLE-1 was never implemented); delete the key",
            "drafter.spot": "write drafter.where: spot (spot: true) or drafter.where: sequential (spot: false)"}


def _explain(err: ValidationError) -> str:
    valid = _all_keys(RunConfig)
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden" and key in _REMOVED:
            lines.append(f"key '{key}' was removed: {_REMOVED[key]}")
        elif e["type"] == "extra_forbidden":
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"did you mean '{near[0]}'?" if near else "remove it (every key is listed in docs/configuration.md, or run `tlt config reference`)"
            lines.append(f"unknown key '{key}': {hint}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a check across keys: says the fix
            lines.append(f"invalid '{key}': {e['msg'].removeprefix('Value error, ')}")
        else:
            loc = [str(p) for p in e["loc"]]
            while len(loc) > 1 and ".".join(loc) not in valid:  # a union's member tag ('constrained-int'): its key
                loc.pop()
            key, msg = ".".join(loc), e["msg"].removeprefix("Value error, ")
            if lines and lines[-1].startswith(f"invalid value for '{key}': "):  # another member of the same union
                lines[-1] = lines[-1].replace(" (got ", f", or {msg[0].lower()}{msg[1:]} (got ", 1)
            else:
                lines.append(f"invalid value for '{key}': {msg} (got {e.get('input')!r}); fix the value")
    return "\n".join(lines)


def _parse_scalar(text: str) -> Any:
    """A YAML scalar/list when it parses (3, false, [1,2]), else the raw text (e.g. a cron '*/5 * * * *')."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not KEY=VALUE; write e.g. --set rl.steps=3")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{key}': '{part}' is not a section")
        node[parts[-1]] = _parse_scalar(value)
    return data


def build_config(data: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = apply_overrides(dict(data or {}), overrides or [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (or the defaults when path is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' not found; pass a YAML recipe such as conf/default.yaml")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file '{p}' is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, data:, ...)")
    return build_config(data, overrides)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(cfg.model_dump(mode="json"), "")
    return out
