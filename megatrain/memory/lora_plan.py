"""The memory plan of a LoRA run: a whole model's plan (megatrain/memory/plan.py) with what the frozen base and the
adapters change in it: the base frozen in the arena (2 B a parameter in bf16) without gradients or moments, the
adapters at 16 B a parameter, resident on the GPU where they fit (`lora_resident`). The lines host, GPU and PCIe:
docs/design.md#layout-step-and-memory."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatrain.config import ConfigError, ModelConfig, check_resident
from megatrain.lora.adapters import refuse_tiled_dropout
from megatrain.lora.config import BASE_DTYPES, LoraConfig
from megatrain.lora.layout import LoraLayout, lora_layout
from megatrain.memory.arena import FROZEN_SEGMENT
from megatrain.memory.buffers import (
    ARENA,
    D2H,
    DEVICE,
    EMBED_GRAD_ROWS,
    GRADIENT_BUFFERS,
    H2D,
    HEAD,
    HEAD_CAST,
    HEAD_GRADS,
    STATE_SEGMENTS,
    WEIGHT_BUFFERS,
    WEIGHT_STAGING,
    WORKING_SET,
    Buffer,
    arena_segments,
    node_moments,
    resident_buffers,
    row,
    total,
    weight_buffers,
)
from megatrain.memory.crossings import crossings
from megatrain.memory.residency import MARGIN_BYTES, MARGIN_FRACTION, GiB
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, planning_layout

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

ADAPTER_BYTES = 16  # an adapter parameter's host (or resident device) bytes: fp32 weight, gradient, Adam m and v


def planned_adapter_numels(config: ModelConfig, lora: LoraConfig) -> tuple[int, ...]:
    """Each unit's adapter elements (padded ranges) in forward order, from a one-layer model where layers are alike."""
    one = replace(config, num_layers=1) if config.family.uniform_layers else config
    numels = tuple(u.numel for u in lora_layout(one, lora).units)
    if len(numels) == config.num_layers + 2:
        return numels
    return (numels[0], *(numels[1],) * config.num_layers, numels[-1])


def lora_memory(plan: MemoryPlan, config: ModelConfig, lora: LoraConfig, base_dtype: str, precision: str,
                executors: int = 1) -> MemoryPlan:
    """`plan` (a whole model's, for the same batch and settings) as a LoRA run's."""
    if base_dtype not in BASE_DTYPES:
        raise ConfigError(f"lora_base_dtype must be one of {', '.join(BASE_DTYPES)}, got {base_dtype!r}.")
    if plan.tile_tokens is not None:
        refuse_tiled_dropout(lora)
    layout = planning_layout(config)
    numels = planned_adapter_numels(config, lora)
    adapters, layer_adapters = sum(numels), max(numels)
    one = lora_layout(replace(config, num_layers=1) if config.family.uniform_layers else config, lora)
    params = one.adapter_numel() * (config.num_layers if config.family.uniform_layers else 1)
    compute = 2 if precision == "bf16" else 4
    # the base's layers cross in its dtype; cast to the compute dtype on the device (on a GPU through a staging
    # buffer in the base's dtype, megatrain/engine/weight_slots.py)
    layer = layout.max_layer_numel()
    head = layout.head.numel + (layout.embed.numel if config.tie_embeddings else 0)
    rows = min(config.vocab_size, plan.step_tokens) * config.hidden_size
    device_weights = weight_buffers(layer, head, "bfloat16" if compute == 2 else "float32", BASE_DTYPES[base_dtype],
                                    staged=plan.on_gpu)
    gpu_weights = total(device_weights) + rows * compute
    gpu_grads = GRAD_SETS_IN_FLIGHT * layer_adapters * 4  # no base gradient; the head's and embedding's: none
    # the weights' fp32 gradient sums: the adapters' only; and the adapters' activations in one layer's recompute
    gpu_working = plan.gpu_working - (layer - layer_adapters) * 4 + adapter_activations(one, plan, compute)
    # what crosses: the base in its dtype, each layer's adapters beside it, their gradients (crossings.py)
    step = replace(plan.step, streamed=BASE_DTYPES[base_dtype], lora=lora)
    pcie = crossings(config, layout, step)
    units = row(plan.buffers, "issued").numel
    segments = arena_segments(adapters, adapters, node_moments([(n, 1) for n in numels], plan.nodes), units=units,
                              bf16_copy=False, columns=row(plan.buffers, "versions").numel // units,
                              frozen_numel=plan.arena_numel, frozen_dtype=BASE_DTYPES[base_dtype])
    process = plan.process_bytes
    if not plan.on_gpu:  # the CPU path computes in host memory, each executor its own
        process += executors * (gpu_weights + gpu_grads + gpu_working - plan.gpu_weights - plan.gpu_grads
                                - plan.gpu_working)
    # the whole model's rows but for its weights', gradients' and crossings
    replaced = (WEIGHT_BUFFERS, WEIGHT_STAGING, HEAD, HEAD_CAST, GRADIENT_BUFFERS, HEAD_GRADS, EMBED_GRAD_ROWS,
                WORKING_SET)
    buffers = (*segments, *device_weights, Buffer(GRADIENT_BUFFERS, DEVICE, layer_adapters, "float32",
                                                  GRAD_SETS_IN_FLIGHT),
               Buffer(WORKING_SET, DEVICE, gpu_working, "uint8"),
               *(b for b in plan.buffers if b.place not in (ARENA, H2D, D2H) and b.name not in replaced), *pcie)
    return replace(plan, arena_bytes=total(segments, *STATE_SEGMENTS), grads="arena",
                   grads_bytes=total(segments, "grads"), bf16_copy_bytes=0,
                   frozen_bytes=total(segments, FROZEN_SEGMENT),
                   frozen_dtype=base_dtype, adapter_params=params, buffers=buffers,
                   adapter_numels=numels, gpu_weights=gpu_weights, gpu_grads=gpu_grads, gpu_working=gpu_working,
                   step=step, h2d_bytes=total(pcie, place=H2D), d2h_bytes=total(pcie, place=D2H), process_bytes=process,
                   network_bytes=int(3 * (plan.nodes - 1) / plan.nodes * adapters * 4))


def adapter_activations(one: LoraLayout, plan: MemoryPlan, compute: int) -> int:
    """Bytes the adapters add to one layer's recompute-backward (`one`: the adapters of one layer, or of every layer
    where they differ, the largest counted): per token of the piece recomputed at once (a tile, or the micro-batch),
    each target's A(x) and its gradient (r wide), and with dropout its dropped input (saved for A's gradient) and
    mask."""
    assert one.lora is not None
    tokens = plan.batch * plan.seq
    piece = min(tokens, plan.tile_tokens or tokens)
    per_layer: dict[int, int] = {}
    for slot in one.adapters:
        dropped = slot.in_features * (compute + 1) if one.lora.dropout > 0 else 0
        per_layer[slot.layer] = per_layer.get(slot.layer, 0) + 2 * one.lora.r * compute + dropped
    return piece * max(per_layer.values(), default=0)


def lora_resident(plan: MemoryPlan, config: ModelConfig, requested: int | str, world: int) -> MemoryPlan:
    """The plan with the adapters of the first units resident on the device with their Adam state and updated there:
    "auto" all of them on a GPU whose free memory holds them (none on the CPU path, where the pool updates them in
    the arena), or a count; none with several executors (each would hold its own copy)."""
    check_resident(requested)
    numels = plan.adapter_numels
    count, why = 0, ""
    if world > 1:
        if requested not in ("auto", "none", 0):
            raise ConfigError(f"resident units live on one executor; with {world} executors set resident = none "
                              "(or auto).")
        why = f"{world} executors: the CPU pool updates the adapters in the arena"
    elif requested in ("none", 0):
        why = "resident = none"
    elif requested != "auto":
        count, why = min(int(requested), len(numels)), f"resident = {requested}"
    elif not plan.on_gpu:
        why = "the CPU path: the pool updates the adapters in the arena; ask for a count with resident = N"
    elif plan.gpu_free is None:
        why = "the GPU's free memory is not known"
    else:
        room = plan.gpu_free - plan.gpu_total
        fits = sum(numels) * ADAPTER_BYTES <= room - max(MARGIN_BYTES, int(MARGIN_FRACTION * room))
        count, why = (len(numels), "they fit beside the pipeline's buffers") if fits else (0, "no room on the GPU")
    if not count:
        return replace(plan, resident_note=f"resident adapters: none ({why})")
    held = sum(numels[:count])
    # their adapters and gradients no longer cross (crossings.py)
    state = resident_buffers(held, "float32", False)  # fp32 adapters: no copy (megatrain/engine/resident.py)
    rows = (*(b for b in plan.buffers if b.place not in (H2D, D2H)),
            *crossings(config, planning_layout(config), plan.step, count), *state)
    pcie = dict(buffers=rows, h2d_bytes=total(rows, place=H2D), d2h_bytes=total(rows, place=D2H))
    note = (f"resident adapters: {'all units' if count == len(numels) else f'the first {count} units'} "
            f"({held * ADAPTER_BYTES / GiB:.3f} GiB with their Adam state): updated on the device, no PCIe, no CPU "
            f"pool; {why}")
    return replace(plan, resident_units=count, resident_params=held, gpu_resident=total(state),
                   resident_note=note, **pcie,
                   process_bytes=plan.process_bytes + (0 if plan.on_gpu else held * ADAPTER_BYTES))
