"""Typed configuration: schema, YAML loading with dotted overrides, validation."""
from pivotrl_hpc.config.errors import ConfigError
from pivotrl_hpc.config.load import apply_overrides, build, load_config, to_dict
from pivotrl_hpc.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_overrides", "build", "load_config", "to_dict"]
