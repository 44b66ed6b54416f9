"""megatrain: train LLMs whose weights, gradients and AdamW states live in host memory."""

from __future__ import annotations

from typing import Any

from megatrain.api import Model, from_pretrained
from megatrain.config import ConfigError, EngineConfig, MegatrainError, ModelConfig, OptimConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "EngineConfig", "MegatrainError", "Model", "ModelConfig", "OptimConfig",
           "from_pretrained"]


def __getattr__(name: str) -> Any:
    # The Ray engine lives with the other Ray-aware code in pipelines/; import it only when asked for.
    if name == "Engine":
        from pipelines.engine import Engine

        return Engine
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
