"""The layout of a LoRA run: its units' own tensors are the adapters (what trains: fp32, gradients, Adam moments),
and the base model's layout is their `frozen` part, unit for unit (megatrain/model/layout.py).

The units mirror the base's, so everything that handles units by index handles the adapters as it handles a whole
model (docs/design.md#layout-step-and-memory)."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ModelConfig
from megatrain.lora.adapters import AdapterSlot, adapter_slots
from megatrain.lora.config import LoraConfig
from megatrain.model.layout import ModelLayout


@dataclass
class LoraLayout(ModelLayout):
    lora: LoraConfig | None = None  # checked against the model (LoraConfig.for_model)
    adapters: tuple[AdapterSlot, ...] = ()  # every adapted projection, in layout order

    def adapter_numel(self) -> int:
        """The adapters' parameters (without the ranges' padding)."""
        return sum(s.numel for u in self.units for s in u.slots)


def lora_layout(config: ModelConfig, lora: LoraConfig) -> LoraLayout:
    """The adapters of `lora` on the model of `config` as units beside the base's (ConfigError for targets the model
    does not have)."""
    base = ModelLayout.build(config)
    lora = lora.for_model(config)
    slots = adapter_slots(base, lora)
    layout = LoraLayout(config, frozen=base, lora=lora, adapters=tuple(slots))
    for unit in base.units:
        tensors = [(slot.name(which), slot.peft_name(which), slot.shape(which, lora.r), True)
                   for slot in slots if unit.kind == "layer" and slot.layer == unit.layer for which in "AB"]
        layout._add(unit.kind, tensors, unit.layer)
    return layout


def training_layout(config: ModelConfig, lora: LoraConfig | None) -> ModelLayout:
    """What a run trains: the whole model, or with `lora` its adapters beside the frozen base."""
    return ModelLayout.build(config) if lora is None else lora_layout(config, lora)
