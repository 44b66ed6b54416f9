"""A LoRA run's side of the executor: the frozen base streams as a whole model's weights do, and each decoder
layer's adapters are bound beside them (megatrain/lora/adapters.py: LoraLayer, whose backward gives the adapters'
gradients alone). Nothing of the base's gradients is computed or sent; the adapters are read where they live, on the
device when resident, else in the arena (docs/design.md#layout-step-and-memory)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain.engine.resident import ResidentUnits
from megatrain.lora.adapters import LoraArchitecture
from megatrain.lora.layout import LoraLayout
from megatrain.model.architecture import Architecture
from megatrain.model.layout import Unit
from megatrain.model.templates import Weights


class LoraStep:
    """The adapters of `layout` (their fp32 weights in `params`, the arena's trainable ranges) bound beside the
    base's weights; `architecture` is the family's with adapters in its layers. rank: the data-parallel rank, which
    enters the dropout seeds (the executors' rows differ)."""

    def __init__(self, layout: LoraLayout, params: torch.Tensor, architecture: Architecture, rank: int = 0):
        assert layout.lora is not None and layout.frozen is not None
        self.layout, self.params = layout, params
        self.architecture = LoraArchitecture(architecture, layout.lora, seed=rank)
        self.adapters = True  # False: the base alone (the reference's pass, megatrain/engine/reference.py)

    def start_step(self, step: int, training: bool = True, seed: int = 0) -> None:
        """Before a step's batches are made (training False: an evaluation's, with no dropout): the dropout masks are
        drawn from the run's seed and the step's number, so that a replayed step draws the same ones."""
        self.architecture.start_step(hash((seed, step)), training)

    def bind(self, unit: Unit, weights: Weights, resident: ResidentUnits,
             to_device: Callable[[torch.Tensor], torch.Tensor]) -> Weights:
        """The base's weights of `unit` (bound by the weight slots) with the unit's adapters beside them."""
        adapters = self.layout.units[unit.index]
        if not adapters.slots or not self.adapters:
            return weights
        flat = resident.weights_of(adapters) if resident.holds(adapters) else to_device(adapters.range_of(self.params))
        return {**weights, **adapters.bind(flat)}
