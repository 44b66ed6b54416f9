"""The reference policy's pass (GRPO's KL term): the same executor, the same buffers and the same schedule, reading the
initial weights instead of the current ones, so that no second model is on the device and no checkpoint goes to disk.

A full run reads the initial weights from an arena segment of their own; a LoRA run's reference is its base with the
adapters off (docs/design.md#the-reference-pass)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from megatrain.config import MegatrainError
from megatrain.engine.resident import ResidentUnits

if TYPE_CHECKING:
    from megatrain.engine.executor import Executor


@contextmanager
def initial_weights(ex: Executor) -> Iterator[None]:
    """Within it, `ex`'s forward reads the initial weights (a LoRA run's: its base, adapters off)."""
    if ex.lora is not None:
        ex.slots.invalidate()
        ex.lora.adapters = False
        try:
            yield
        finally:
            ex.lora.adapters = True
        return
    if ex.reference is None:
        raise MegatrainError("this run keeps no copy of its initial weights; make the Engine with reference=True "
                             "(GRPO does where beta > 0) to compute the reference's log-probs.")
    slots, rows = ex.slots, ex.embedding
    saved = slots.weights, slots.resident_units, rows.weights, rows.on_device
    none_resident = ResidentUnits(ex.layout, 0, ex.device, ex.dtype)
    slots.invalidate()
    slots.weights, slots.resident_units, rows.weights, rows.on_device = ex.reference, none_resident, ex.reference, \
        none_resident
    try:
        yield
    finally:
        slots.weights, slots.resident_units, rows.weights, rows.on_device = saved
        slots.invalidate()
