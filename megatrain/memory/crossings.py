"""What crosses between host and device in a training step, as rows of the buffers table (megatrain/memory/buffers.py)
whose place is H2D or D2H and whose count is how many times a step moves one. The memory plan's PCIe bytes are their
sums, and the predictor (megatrain/perf/predict.py) times them unit by unit. Each row follows the executor
(megatrain/engine/executor.py) and tests/test_buffers.py checks the bytes it copies under cpu-async against them."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ModelConfig
from megatrain.lora.config import LoraConfig
from megatrain.lora.layout import lora_layout
from megatrain.memory.buffers import D2H, H2D, Buffer, element_size
from megatrain.model.layout import ModelLayout, aligned_split

LAYER_IN, HEAD_IN, ROWS_IN, IDS_IN = "layer weights in", "head weights in", "embedding rows in", "token ids in"
SUM_IN, CHECKPOINTS_IN, ADAPTERS_IN = "gradient sums in", "offloaded checkpoints in", "adapters in"
LAYER_OUT, HEAD_OUT, EMBED_OUT = "layer gradients out", "head gradients out", "embedding gradients out"
NORMS_OUT, LOSS_OUT, CHECKPOINTS_OUT = "gradient norms out", "loss out", "offloaded checkpoints out"


@dataclass(frozen=True)
class StepShape:
    """What of a step decides its crossings besides the model: one micro-batch's tokens, the step's micro-batches and
    the passes over the layers they make (per-micro-batch: one each), the dtype the weights stream in, the executors
    on every node (each sends its shard of a summed gradient), the offloaded checkpoints of a pass; a LoRA run's
    adapters, which train beside the frozen base (which then streams in `streamed`, its dtype)."""

    tokens: int
    micro_batches: int = 1
    passes: int = 1
    streamed: str = "float32"
    world: int = 1
    offloaded: Buffer | None = None
    lora: LoraConfig | None = None


def layer_fetches(num_layers: int, resident: int, cast: bool, passes: int) -> list[int]:
    """Each decoder layer's weight copies a step (WeightSlots: two buffers, a layer kept in one is not copied again,
    the buffers forgotten at the step's start): every pass's forward bottom up and backward top down. The first
    `resident` layers live on the device: not copied, though cast at each use (`cast`) they take a buffer."""
    slots: list[int | None] = [None, None]
    copies = [0] * num_layers

    def fetch(i: int, keep: int | None) -> None:
        if (i < resident and not cast) or i in slots:
            return
        slots[next(s for s, held in enumerate(slots) if keep is None or held != keep)] = i
        copies[i] += i >= resident

    for _ in range(passes):
        for i in range(num_layers):
            fetch(i, None if i == 0 else i - 1)
        for i in range(num_layers - 1, -1, -1):
            fetch(i, None if i == num_layers - 1 else i + 1)
    return copies


def layer_copies(num_layers: int, resident: int, cast: bool, passes: int) -> int:
    """sum(layer_fetches(...)) without walking 10^9 alike layers: a few at each end, each one between them copied once
    in every pass's forward and once in its backward."""
    kept, streamed = min(resident, 4), num_layers - resident
    fewer = min(streamed, 4)
    return sum(layer_fetches(kept + fewer, kept, cast, passes)) + 2 * passes * (streamed - fewer)


def crossings(config: ModelConfig, layout: ModelLayout, step: StepShape, resident: int = 0, cast: bool = False
              ) -> tuple[Buffer, ...]:
    """The step's crossings for a model planned from `layout` (planning_layout: one layer where they are alike) with
    the first `resident` units (forward order) on the device (megatrain/engine/resident.py); a LoRA run's: the first
    `resident` units' adapters (its base streams whole)."""
    trains = layout if step.lora is None else lora_layout(layout.config, step.lora)
    if step.lora is not None:
        resident, cast, base = 0, False, resident
    layers, h, p, tied = config.num_layers, config.hidden_size, step.passes, config.tie_embeddings
    embed_on, head_on = resident >= 1, resident >= layers + 2
    rows = min(config.vocab_size, step.micro_batches * step.tokens)  # at most: the step's distinct tokens
    tokens = step.micro_batches * step.tokens
    every_layer = len(layout.layers) == layers
    fetches = (layer_fetches(layers, max(resident - 1, 0), cast, p) if every_layer else
               [layer_copies(layers, max(resident - 1, 0), cast, p)])
    out = [Buffer(LAYER_IN, H2D, u.numel, step.streamed, n) for u, n in zip(layout.layers, fetches, strict=True) if n]
    if step.lora is not None:  # each layer's adapters bound beside its base weights, in its forward and its backward
        streamed = [(u, int(u.index >= base)) if every_layer else (u, layers - min(max(base - 1, 0), layers))
                    for u in trains.layers if u.slots]
        out += [Buffer(ADAPTERS_IN, H2D, u.numel, "float32", 2 * p * n) for u, n in streamed if n]
    head = [u for u in (layout.head, layout.embed if tied else None) if u is not None]
    out += [Buffer(HEAD_IN, H2D, u.numel, step.streamed, p) for u in head if not (embed_on if u is layout.embed
                                                                                   else head_on)]
    # the rows the tokens use, gathered on the host (on the device where the embedding is resident, from their ids)
    out += [Buffer(ROWS_IN, H2D, rows * h, step.streamed)] if not embed_on else [Buffer(IDS_IN, H2D, rows, "int64")]
    out += [Buffer(IDS_IN, H2D, tokens, "int64", 2)]  # each token's row among them, its target
    if config.pad_token_id is not None and trains.embed.slots:  # the padding row's gradient masked, each pass
        out += [Buffer(IDS_IN, H2D, rows, "bool", p)]
    # the embedding's gradient made whole on the device (of every token's)
    whole_table = (tied or step.world > 1) and bool(trains.embed.slots)
    if whole_table:
        out += [Buffer(IDS_IN, H2D, rows, "int64", p)]
    out += _gradients(config, trains, step, resident if step.lora is None else base, whole_table, rows * h)
    if step.offloaded is not None:  # out once and back once a pass
        out += [Buffer(CHECKPOINTS_OUT, D2H, step.offloaded.numel, step.offloaded.dtype, p * step.offloaded.count),
                Buffer(CHECKPOINTS_IN, H2D, step.offloaded.numel, step.offloaded.dtype, p * step.offloaded.count)]
    return tuple(out + [Buffer(LOSS_OUT, D2H, 1, "float32", p)])  # read by the driver before the gradients leave


def _gradients(config: ModelConfig, layout: ModelLayout, step: StepShape, resident: int, whole_table: bool,
               row_numel: int) -> list[Buffer]:
    """The streamed units' gradients out in fp32 each pass (with several executors each its shard of their sum), with
    their squared norms (float64); in the passes after the first, the sums so far in first to add to. A resident
    embedding's gradient stays: its rows' ids go in (Executor._embed_grads)."""
    layers, p, out = config.num_layers, step.passes, []
    on_device = min(max(resident - 1, 0), layers)  # resident decoder layers
    every_layer = len(layout.layers) == layers
    rows = row_numel // config.hidden_size
    for unit in layout.units:
        if unit.kind == "embed":
            n = int(resident < 1)
        elif unit.kind == "head":
            n = int(resident < layers + 2)
        else:
            n = int(unit.layer >= on_device) if every_layer else layers - on_device
        if unit.kind == "embed" and not n and not whole_table and unit.slots:  # Executor._embed_grads, to_arena
            out += [Buffer(IDS_IN, H2D, rows, "int64", 2 * p - 1)]
        if not n:
            continue
        if step.world > 1:  # this executor's shard of the unit's range, summed over the executors
            numel = max(b - a for a, b in (aligned_split(unit.numel, r, step.world) for r in range(step.world)))
        elif unit.kind == "embed" and unit.slots:
            numel = unit.numel if whole_table else row_numel
        else:  # what has a gradient (a LoRA run's frozen units: none, but their norm goes)
            numel = sum(s.numel for s in unit.slots)
        name = {"embed": EMBED_OUT, "head": HEAD_OUT}.get(unit.kind, LAYER_OUT)
        out += [Buffer(name, D2H, numel, "float32", n * p)] if numel else []
        out += [Buffer(NORMS_OUT, D2H, 1, "float64", n * p)]
        out += [Buffer(SUM_IN, H2D, numel, "float32", n * (p - 1))] if p > 1 and numel else []
    return out


def crossing_bytes(rows: tuple[Buffer, ...], name: str) -> int:
    """Bytes of one crossing of the first row named `name` (0 where there is none): a layer's weights in, its
    gradient out."""
    found = next((r for r in rows if r.name == name), None)
    return 0 if found is None else found.numel * element_size(found.dtype)
