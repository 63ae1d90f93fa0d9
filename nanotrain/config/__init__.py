"""Typed configuration: schema (dataclasses), YAML loading with overrides, validation."""

from nanotrain.config.loader import ConfigError, config_from_dict, config_to_dict, dump_config, load_config
from nanotrain.config.schema import (
    CheckpointArgs,
    Config,
    DataArgs,
    LoggingArgs,
    ModelArgs,
    MoEArgs,
    OptimizerArgs,
    ParallelismArgs,
    RopeScalingArgs,
    SlurmArgs,
    TrainingArgs,
)
from nanotrain.config.validate import validate
from nanotrain.config.validate_slurm import SlurmLayout, check_world_size, slurm_layout

__all__ = [
    "CheckpointArgs",
    "Config",
    "ConfigError",
    "DataArgs",
    "LoggingArgs",
    "ModelArgs",
    "MoEArgs",
    "OptimizerArgs",
    "ParallelismArgs",
    "RopeScalingArgs",
    "SlurmArgs",
    "SlurmLayout",
    "TrainingArgs",
    "check_world_size",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "slurm_layout",
    "validate",
]
