"""Run configuration: one pydantic model per stage under `RunConfig` (stages.py), loaded from YAML
with dotted overrides and user-phrased errors (loading.py).

Defaults live in stages.py and only there. Every model forbids unknown keys, so a typo in a
YAML recipe or a `--set` override fails with the dotted key and the nearest valid name.
`RunConfig` is also the Prefect flow parameter, so the UI renders it as a form.
"""
from tlt.config.loading import (
    ConfigError,
    apply_overrides,
    build_config,
    dump_yaml,
    flatten,
    load_config,
)
from tlt.config.reference import reference_markdown
from tlt.config.stages import (
    ClusterConfig,
    DataConfig,
    DeployConfig,
    DrafterConfig,
    EvalConfig,
    ExportConfig,
    GeneratorSpec,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    RunConfig,
    SpecStrategy,
    Stage,
    TrackingConfig,
    TrainerConfig,
    VllmConfig,
)

__all__ = [
    "ClusterConfig", "ConfigError", "DataConfig", "DeployConfig", "DrafterConfig", "EvalConfig", "ExportConfig", "GeneratorSpec",
    "ModelConfig", "RLConfig", "RolloutConfig", "RunConfig", "SpecStrategy", "Stage", "TrackingConfig",
    "TrainerConfig", "VllmConfig", "apply_overrides", "build_config", "dump_yaml", "flatten", "load_config",
    "reference_markdown",
]
