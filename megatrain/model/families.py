"""The model families megatrain trains natively, by HF `model_type`: what config loading and saving consult.

A family is one file of megatrain/model/ (its HF config.json mapping in and out, its checks, the template
options it sets); adding one means adding its file, a line here, and its tests.
"""

from __future__ import annotations

from megatrain.model.llama import LLAMA, LlamaFamily
from megatrain.model.qwen3 import QWEN3

FAMILIES: dict[str, LlamaFamily] = {t: family for family in (LLAMA, QWEN3) for t in family.model_types}
MODEL_TYPES = tuple(FAMILIES)


def family_of(model_type: str) -> LlamaFamily:
    """The family of a model_type in MODEL_TYPES (ModelConfig checks the type before it asks)."""
    return FAMILIES[model_type]
