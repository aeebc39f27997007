"""fleet.yaml: schema (typed), staged loading with path-indexed errors, compiled runtime."""

from extproc.config.load import ConfigError, load_config, load_runtime, parse_config
from extproc.config.runtime import Runtime, compile_runtime
from extproc.config.schema import FleetConfig

__all__ = [
    "ConfigError",
    "FleetConfig",
    "Runtime",
    "compile_runtime",
    "load_config",
    "load_runtime",
    "parse_config",
]
