"""The registry of model families by HF `model_type`: what ModelConfig consults to load, check and save a config.

Each family's own file registers it (`register(LLAMA)` beside its definition); `megatrain/model/catalogue.py`
imports every family file, and the package's `__init__` imports the catalogue, so a family is registered before any
config is read. This module imports nothing of megatrain at run time: config.py sits above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megatrain.config import ModelConfig
    from megatrain.model.architecture import Architecture


class Family(Protocol):
    """What ModelConfig asks of a family (llama.py's LlamaFamily is the one the others build on)."""

    qk_norm: bool  # DecoderLayer option: per-head RMSNorm on q and k
    uniform_layers: bool  # every decoder layer has the same tensors (else num_params counts them)
    tiles: bool  # its layers run over sequence tiles (Architecture.tile)

    @property
    def model_types(self) -> tuple[str, ...]: ...

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """ModelConfig's keyword arguments for a parsed config.json: ConfigError for one that is invalid, NotNative
        (megatrain/config.py) for an option the family does not implement, which ModelConfig.from_hf then hands to
        the generic path."""
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


class FallbackFamily(Family, Protocol):
    """The family of every model_type no native family claims (the generic path: transformers' own layers)."""

    def supports(self, model_type: str) -> bool: ...


FAMILIES: dict[str, Family] = {}  # the native families, by model_type
_fallback: list[FallbackFamily] = []


def register(family: Family) -> Family:
    """Makes `family` the one of each of its model_types."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def register_fallback(family: FallbackFamily) -> FallbackFamily:
    """Makes `family` the one of every model_type no native family claims."""
    _fallback[:] = [family]
    return family


def native_model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_of(model_type: str) -> Family:
    """The native family of `model_type`, or else the generic path (transformers' own layers), which refuses in one
    sentence what it cannot train (and says to install transformers where it is missing)."""
    return FAMILIES.get(model_type) or _fallback[0]


def generic() -> FallbackFamily:
    """The generic path: also a native model_type's, where its config.json sets an option the family does not
    implement (ModelConfig.from_hf)."""
    return _fallback[0]


def is_supported(model_type: object) -> bool:
    return isinstance(model_type, str) and (model_type in FAMILIES or _fallback[0].supports(model_type))
