"""The reference policy's pass (GRPO's KL term): the same executor, the same buffers and the same schedule, reading the
initial weights instead of the current ones, so that no second model is on the device and no checkpoint goes to disk.

A full run keeps the initial weights in an arena segment of their own (REFERENCE_SEGMENT, filled by the parameter store
when it loads the model and never written after, in the dtype compute reads: megatrain/memory/post_plan.py); for the
pass the weight slots and the embedding rows read it, the resident units' device weights (the current ones) set aside.
A LoRA run's reference is its frozen base with the adapters off: the base streams as always and no adapter is bound
(LoraLayer then runs the family's layer alone), which is PEFT's `disable_adapter()`: nothing more in memory.

The weight buffers are forgotten before and after: they hold the other weights' copies.
"""

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
