"""megatrain: train LLMs whose weights, gradients and AdamW states live in host memory.

The package's public names. Importing any part of megatrain runs this file first, so the model families register
here (megatrain/model/catalogue.py) before any config is read. Nothing here imports torch: the data loader's process
(megatrain/data, actors/data_loader.py) never needs it; `Model`, `from_pretrained` and `Engine` load theirs when
asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import megatrain.model.catalogue  # noqa: F401  (registers the model families)
from megatrain.config import ConfigError, EngineConfig, MegatrainError, ModelConfig, OptimConfig

if TYPE_CHECKING:
    from megatrain.api import Model, from_pretrained

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "EngineConfig", "MegatrainError", "Model", "ModelConfig", "OptimConfig",
           "from_pretrained"]


def __getattr__(name: str) -> Any:
    # The Ray engine lives with the other Ray-aware code in pipelines/, above this library: the one name the package
    # hands out from there, imported only when asked for (tests/test_imports.py allows exactly this import).
    if name == "Engine":
        from pipelines.engine import Engine

        return Engine
    if name in ("Model", "from_pretrained"):
        from megatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
