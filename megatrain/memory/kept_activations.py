"""Which decoder layers keep their activations (megatrain/engine/kept_activations.py does it): from the top, within
the bytes the memory plan leaves them, each costing its saved tensors for every micro-batch whose activations exist
at once (`saved_bytes_per_token`, the Llama template's). The formula and "auto": docs/design.md#kept-activations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatrain.config import ConfigError, ModelConfig, check_resident
from megatrain.model.llama import LlamaFamily
from megatrain.model.ops import _SDPA_HAS_GQA

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

GiB = 2**30


def check_keep_activations(value: object) -> None:
    """"auto", "none", "all" or a count of layers >= 0, or one sentence (EngineConfig checks the same)."""
    check_resident(value, "keep_activations", ("auto", "none", "all"), "layers")


def saved_bytes_per_token(config: ModelConfig, precision: str, seq: int, documents: bool = False) -> int | None:
    """Bytes a decoder layer's kept graph holds per token of a `seq`-token sequence (weights and rotary tables not
    counted), by the formula in docs/design.md#kept-activations; None where the layers are not the Llama template's."""
    if not isinstance(config.family, LlamaFamily) or (config.sliding_window or seq) < seq:
        return None
    a = 2 if precision == "bf16" else 4
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    heads, kv_heads = config.num_heads, config.num_kv_heads
    norm = 4 * h + 4 + 2 * a * h
    grouped_kernel = kv_heads < heads and a == 2 and _SDPA_HAS_GQA
    keys = kv if kv_heads == heads or grouped_kernel else q
    attention = a * (2 * q + 2 * keys) + 4 * heads
    if config.qk_norm:
        attention += (4 + a) * (q + kv) + 4 * (heads + kv_heads)
    if documents:
        attention += a * q
    return 2 * norm + attention + 4 * a * f


@dataclass(frozen=True)
class KeptLayers:
    """The decoder layers that keep their activations (the top ones), of `total_layers`."""

    indices: tuple[int, ...] = ()
    total_layers: int = 0
    bytes: int = 0  # device bytes their graphs hold (0 where the formula does not know the layers)
    why: str = ""  # one line for the plan's report ("": not chosen)

    def describe(self) -> str:
        if not self.indices:
            return f"kept activations: none ({self.why})" if self.why else ""
        first, last = self.indices[0], self.indices[-1]
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        size = f"{self.bytes / GiB:.2f} GiB" if self.bytes else "bytes not planned"
        return (f"kept activations: {which} ({len(self.indices)} of {self.total_layers}, {size}): their backward takes "
                f"the forward's graph, no recompute; {self.why}")


def plan_kept(plan: MemoryPlan, config: ModelConfig, requested: int | str, precision: str, budget: int | None
              ) -> KeptLayers:
    """The layers of the run `plan` describes that keep their activations (choose_kept at its micro-batch shape and
    schedule), in `budget` device bytes (None: not known)."""
    together = plan.micro_batches if plan.schedule == "layer-major" else 1
    recomputes = None  # why this run's layers cannot keep their activations
    if plan.tile_tokens is not None:
        recomputes = "the tiled long-context path (tile_tokens) recomputes tile by tile"
    elif plan.adapter_numels:
        recomputes = "a LoRA run's layers take the adapters' gradients alone"
    return choose_kept(config, requested, budget=budget, on_gpu=plan.on_gpu, precision=precision,
                       tokens=plan.batch * plan.seq, seq=plan.seq, together=together, recomputes=recomputes)


def choose_kept(config: ModelConfig, requested: int | str, *, budget: int | None, on_gpu: bool, precision: str,
                tokens: int, seq: int, together: int, recomputes: str | None = None) -> KeptLayers:
    """The layers to keep: `requested` ("auto", "none", "all" or a count of layers) given `budget`, the device bytes
    they may take (None: not known). tokens: of one micro-batch (of `seq`-token rows); together: micro-batches
    whose activations exist at once; recomputes: why this run's layers cannot keep theirs (None: they can)."""
    check_keep_activations(requested)
    total = config.num_layers
    count = total if requested == "all" else requested

    def kept(n: int, nbytes: int, why: str) -> KeptLayers:
        return KeptLayers(tuple(range(total - n, total)), total, nbytes, why)

    if not on_gpu and count in ("auto", "none", 0):  # as resident units: the "device" is the host
        return kept(0, 0, "the CPU path; ask for them with keep_activations = all or N")
    if count in ("none", 0):
        return kept(0, 0, "keep_activations = none")
    if recomputes is not None:
        if count != "auto":
            raise ConfigError(f"kept activations need each layer's whole forward under autograd, and {recomputes}; "
                              "set keep_activations = none.")
        return kept(0, 0, recomputes)
    per_token = saved_bytes_per_token(config, precision, seq)
    per_layer = None if per_token is None else per_token * tokens * together
    if count != "auto":
        count = min(int(count), total)
        return kept(count, count * (per_layer or 0), f"keep_activations = {requested}")
    if per_layer is None:
        return kept(0, 0, "the plan counts the saved bytes of the Llama template's layers only (unwindowed)")
    if budget is None:
        return kept(0, 0, "the GPU's free memory is not known")
    count = min(total, max(0, budget) // max(per_layer, 1))
    if not count:
        return kept(0, 0, "no room on the device beyond the pipeline, its activation checkpoints and the resident "
                          "units")
    return kept(count, count * per_layer, "every layer fits" if count == total else
                "the top layers, whose backward comes first; the others recompute from their activation checkpoints")
