"""A LoRA run's side of the executor: the frozen base streams as a whole model's weights do, and each decoder
layer's adapters are bound beside them (megatrain/lora/adapters.py: LoraLayer, whose backward gives the adapters'
gradients alone; on a native family's layers or, hooked onto their nn.Linear modules, on the generic path's).

The run's layout is a LoraLayout (megatrain/lora/layout.py): its units' own tensors are the adapters, unit for unit
beside the base's (`layout.frozen`). The executor streams `layout.frozen` from the arena's frozen segment, in the
dtype it was loaded in (bf16 by default: cast to the compute dtype on the device), and writes each unit's
gradients into the adapters' ranges: the embedding and the head have none (their units are empty), so nothing of
the base's is computed or sent. The adapters are read where they live: on the device with their optimizer state
when resident (ResidentUnits over the adapter units, fp32 masters, cast to the compute dtype inside lora_linear as
PEFT casts them), else from the arena's trainable ranges, once the optimizer's update of the unit is in.
"""

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
