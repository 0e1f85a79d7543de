"""Configuration: schema (what may be written) and loader (errors with key and line)."""
from gpuguard.config.loader import ConfigError, ConfigProblem, load_config, parse_config
from gpuguard.config.schema import Config

__all__ = ["Config", "ConfigError", "ConfigProblem", "load_config", "parse_config"]
