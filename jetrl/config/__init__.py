"""The run configuration: the schema (a validated tree of dataclasses) and its loader (files, overrides, writer).

``from jetrl.config import RunConfig, load_config`` is the usual entry; :mod:`jetrl.config.schema` holds the
sections and their checks, :mod:`jetrl.config.loader` the YAML / JSON / TOML files and ``--a.b=value``
overrides, :mod:`jetrl.config.reference` what each field means (``docs/configuration.md``, commented YAML).
"""

from jetrl.config.loader import apply_override, load_config, parse_override, save_config
from jetrl.config.schema import (
    DTYPES, AlgorithmConfig, ConfigError, ConfigTypeError, DataConfig, DistributedConfig, ModelConfig, OptimConfig,
    RewardLimitsConfig, RolloutConfig, RunConfig, TrainerConfig, from_dict, registered_names, to_dict,
)

__all__ = [
    "ConfigError", "ConfigTypeError", "RunConfig", "ModelConfig", "DataConfig", "RewardLimitsConfig", "RolloutConfig",
    "AlgorithmConfig", "OptimConfig", "TrainerConfig", "DistributedConfig", "load_config", "save_config", "from_dict",
    "to_dict", "apply_override", "parse_override", "registered_names", "DTYPES",
]
