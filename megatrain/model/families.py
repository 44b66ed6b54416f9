"""The model families megatrain trains natively, by HF `model_type`: what config loading and saving consult.

A family is one file of megatrain/model/ (its HF config.json mapping in and out, its checks, the template
options it sets); adding one means adding its file, a line here, and its tests.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatrain.config import ModelConfig
from megatrain.model.architecture import Architecture
from megatrain.model.gemma import GEMMA2, GEMMA3
from megatrain.model.hf_generic import GENERIC
from megatrain.model.llama import LLAMA
from megatrain.model.qwen3 import QWEN3


class Family(Protocol):
    """What ModelConfig asks of a family (llama.py's LlamaFamily is the one the others build on)."""

    qk_norm: bool  # DecoderLayer option: per-head RMSNorm on q and k
    uniform_layers: bool  # every decoder layer has the same tensors (else num_params counts them)
    tiles: bool  # its layers run over sequence tiles (Architecture.tile)

    @property
    def model_types(self) -> tuple[str, ...]: ...

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """ModelConfig's keyword arguments for a parsed config.json; ConfigError for what is not implemented."""
        ...

    def validate(self, c: ModelConfig) -> None:
        """ConfigError unless `c` is a layout of this family that transformers loads."""
        ...

    def to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The config.json transformers reads back as the same model."""
        ...

    def layer_tensors(self, c: ModelConfig, index: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """Decoder layer `index`'s tensors: (name inside the layer, shape, weight-decayed), in layout order."""
        ...

    def num_params(self, c: ModelConfig) -> int:
        """All parameters (asked only of a family whose layers are not uniform)."""
        ...

    def architecture(self, c: ModelConfig) -> Architecture:
        """The math the executor runs (megatrain/model/architecture.py)."""
        ...


FAMILIES: dict[str, Family] = {t: family for family in (LLAMA, QWEN3, GEMMA2, GEMMA3) for t in family.model_types}
MODEL_TYPES = tuple(FAMILIES)  # the native ones


def family_of(model_type: str) -> Family:
    """The native family of `model_type`, or else the generic path (transformers' own layers), which refuses in one
    sentence what it cannot train (and says to install transformers where it is missing)."""
    return FAMILIES.get(model_type, GENERIC)


def is_supported(model_type: object) -> bool:
    return isinstance(model_type, str) and (model_type in FAMILIES or GENERIC.supports(model_type))
