"""Typed, validated recipes. Importable without torch, Megatron or SGLang."""
from .errors import ConfigError
from .presets import PRESETS
from .recipe import Recipe, build_recipe, load_recipe, parse_override
from .schema import (SECTIONS, AlgorithmConfig, CheckpointConfig, CriticConfig, EvalConfig, LaunchConfig,
                     LoggingConfig, ModelConfig, ParallelConfig, RolloutConfig, RunConfig, WeightSyncConfig)

__all__ = [
    "ConfigError", "PRESETS", "Recipe", "build_recipe", "load_recipe", "parse_override", "SECTIONS",
    "AlgorithmConfig", "CheckpointConfig", "CriticConfig", "EvalConfig", "LaunchConfig", "LoggingConfig",
    "ModelConfig", "ParallelConfig", "RolloutConfig", "RunConfig", "WeightSyncConfig",
]
