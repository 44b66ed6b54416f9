"""A LoRA run's tensors in and out of the arena: the adapters into their trainable ranges (PEFT's initialisation, a
PEFT adapter directory to start from, a checkpoint) and out (PEFT's format; the base with them merged in, as an HF
model). The base itself is read into the frozen segment as a whole model's weights are (megatrain/store.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.io.checkpoint import load_into
from megatrain.lora.adapters import Adapters
from megatrain.lora.layout import LoraLayout
from megatrain.lora.peft_format import load_adapter


def initial_adapters(layout: LoraLayout, seed: int, directory: str | Path | None = None) -> Adapters:
    """The adapters a run starts from: PEFT's initialisation (B zero: the adapted model starts as the base), or those
    of a PEFT adapter directory, which must have the run's rank and targets."""
    assert layout.frozen is not None and layout.lora is not None
    if directory is not None:
        return load_adapter(directory, layout.frozen, layout.lora)
    return Adapters.init(layout.frozen, layout.lora, seed)


def write_adapters(layout: LoraLayout, params: torch.Tensor, adapters: Adapters, where: str) -> None:
    """The adapters' tensors into their ranges of the trainable `params` (checked by name and shape)."""
    load_into(layout, params, [], where=where, tensors=adapters.tensors.items())


def arena_adapters(layout: LoraLayout, params: torch.Tensor) -> Adapters:
    """The adapters as they are in `params`, by PEFT name (views, not copies)."""
    assert layout.lora is not None
    return Adapters(layout.lora, list(layout.adapters), layout.hf_views(params))


def merged_tensors(layout: LoraLayout, frozen: torch.Tensor, params: torch.Tensor,
                   passthrough: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The base's weights by HF name with each adapter merged in as PEFT's merge_and_unload does it
    (W + scaling * B @ A, computed in fp32 and stored in the base's dtype), and the pass-through tensors.
    Only the merged projections are new tensors; the rest are views of the frozen segment."""
    assert layout.frozen is not None and layout.lora is not None
    tensors = layout.frozen.hf_views(frozen)
    adapters = arena_adapters(layout, params)
    for slot in adapters.slots:
        a, b = adapters.tensors[slot.peft_name("A")], adapters.tensors[slot.peft_name("B")]
        base = tensors[slot.base_hf_name]
        tensors[slot.base_hf_name] = (base.float() + (b.float() @ a.float()) * layout.lora.scaling).to(base.dtype)
    return list(tensors.items()) + sorted((passthrough or {}).items())
