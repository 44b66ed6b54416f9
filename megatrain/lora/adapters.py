"""LoRA adapters on a frozen, streamed base: their tensors and names, and the LoRA linear inside the layer math.

    y = F.linear(x, W, b) + scaling * F.linear(F.linear(dropout(x), A), B)     A: (r, in), B: (out, r), W frozen

A LoraWeight stands where a target's base weight stood and routes the template's own F.linear to lora_linear, so the
native layers are untouched; the generic path uses forward hooks instead. Gradients, dropout, tiles:
docs/design.md#adapters."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.config import ConfigError
from megatrain.lora.config import LoraConfig
from megatrain.lora.targets import adapted_modules
from megatrain.model.architecture import Architecture, Batch, LayerFn
from megatrain.model.layout import ModelLayout
from megatrain.model.templates import Weights, recompute_grads

LORA = ".lora_"  # in every adapter tensor's name, and in no base tensor's
PEFT_PREFIX = "base_model.model."  # PEFT's prefix on the transformers model's names


@dataclass(frozen=True)
class AdapterSlot:
    """One adapted projection: decoder layer `layer`'s `module` (e.g. "self_attn.q_proj"), its base weight's HF name
    and its shape (out_features, in_features)."""

    layer: int
    module: str
    base_hf_name: str  # "model.layers.0.self_attn.q_proj.weight"
    out_features: int
    in_features: int

    def name(self, which: str) -> str:
        """Name inside the layer's weights of the A or B matrix ("A" | "B"): "self_attn.q_proj.lora_A.weight"."""
        return f"{self.module}{LORA}{which}.weight"

    def peft_name(self, which: str) -> str:
        """The name PEFT saves it under: "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"."""
        return f"{PEFT_PREFIX}{self.base_hf_name.removesuffix('weight')}lora_{which}.weight"

    def shape(self, which: str, r: int) -> tuple[int, int]:
        return (r, self.in_features) if which == "A" else (self.out_features, r)


def adapter_slots(layout: ModelLayout, lora: LoraConfig) -> list[AdapterSlot]:
    """Every adapted projection of the model, layer by layer in layout order: the decoder layers' Linear modules
    lora's targets name (megatrain/lora/targets.py; ConfigError for targets megatrain cannot adapt)."""
    adapted = adapted_modules(lora.target_modules, layout.config)
    return [AdapterSlot(unit.layer, s.name.removesuffix(".weight"), s.hf_name, *s.shape)
            for unit in layout.layers for s in unit.slots
            if s.name.endswith(".weight") and s.hf_name.removesuffix(".weight") in adapted]


@dataclass
class Adapters:
    """A model's adapter tensors by PEFT name (fp32 masters), their slots and the LoraConfig they were made for."""

    lora: LoraConfig
    slots: list[AdapterSlot]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def init(cls, layout: ModelLayout, lora: LoraConfig, seed: int = 0) -> Adapters:
        """PEFT's initialisation: A as nn.Linear's weight (kaiming-uniform, a = sqrt(5)), B zeros, so the adapted
        model starts as the base. Drawn slot by slot in layout order from one generator seeded with `seed`."""
        lora = lora.for_model(layout.config)
        gen = torch.Generator().manual_seed(seed)
        slots, tensors = adapter_slots(layout, lora), {}
        for slot in slots:
            a = torch.empty(slot.shape("A", lora.r))
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            tensors[slot.peft_name("A")] = a
            tensors[slot.peft_name("B")] = torch.zeros(slot.shape("B", lora.r))
        return cls(lora, slots, tensors)

    def layer(self, index: int) -> Weights:
        """Decoder layer `index`'s adapters by their names inside the layer (the tensors themselves, not copies):
        what a LoRA run adds to the layer's bound weights."""
        return {slot.name(which): self.tensors[slot.peft_name(which)]
                for slot in self.slots if slot.layer == index for which in "AB"}

    def from_layer_names(self, index: int, by_layer_name: Weights) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors (its adapters' gradients, say) renamed from names inside the layer to PEFT's."""
        return {slot.peft_name(which): by_layer_name[slot.name(which)]
                for slot in self.slots if slot.layer == index for which in "AB"}

    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float, dropout: float = 0.0, seed: int = 0) -> torch.Tensor:
    """The LoRA linear, in PEFT's order of operations: the base projection, plus the adapter's term (lora_term)."""
    return F.linear(x, weight, bias) + lora_term(x, lora_a, lora_b, scaling, dropout, seed)


def lora_term(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dropout: float = 0.0,
              seed: int = 0) -> torch.Tensor:
    """B(A(dropout(x))) * scaling, what the adapter adds to its projection's output. The adapters are cast to x's
    dtype (bf16 compute on fp32 masters, as PEFT casts); dropout's mask comes from `seed`."""
    h = x
    if dropout > 0:
        gen = torch.Generator(device=x.device).manual_seed(seed)
        keep = torch.rand(x.shape, generator=gen, device=x.device) >= dropout
        h = x * keep.to(x.dtype) / (1.0 - dropout)
    return F.linear(F.linear(h, lora_a.to(x.dtype)), lora_b.to(x.dtype)) * scaling


class LoraWeight:
    """A frozen base weight and its adapter, standing where the base weight stood in a layer's weights: F.linear on
    it is lora_linear. It is no tensor, so anything else done to it fails loudly instead of dropping the adapter."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                 dropout: float, seed: int):
        self.base, self.lora_a, self.lora_b = base, lora_a, lora_b
        self.scaling, self.dropout, self.seed = scaling, dropout, seed

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear or not isinstance(args[1], LoraWeight) or isinstance(args[0], LoraWeight):
            raise TypeError(f"a LoRA-adapted weight only goes through F.linear as its weight, not {func}")
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return lora_linear(x, w.base, bias, w.lora_a, w.lora_b, w.scaling, w.dropout, w.seed)


def _adapted(w: Weights, lora: LoraConfig, seed: int | None) -> list[tuple[str, LoraWeight]]:
    """Each adapted projection of a layer's weights (base and adapters) by its module's name in the layer, as a
    LoraWeight. Target k's dropout mask is seeded seed + k; seed None: no dropout (evaluation, as PEFT's eval mode)."""
    modules = [n.removesuffix(".lora_A.weight") for n in w if n.endswith(".lora_A.weight")]
    dropout = 0.0 if seed is None else lora.dropout
    return [(module, LoraWeight(w[f"{module}.weight"], w[f"{module}.lora_A.weight"], w[f"{module}.lora_B.weight"],
                                lora.scaling, dropout, (seed or 0) + k)) for k, module in enumerate(modules)]


def with_adapters(w: Weights, lora: LoraConfig, seed: int | None = 0) -> dict[str, Any]:
    """A layer's weights (base and adapters, as LoraLayer gets them) as a native template takes them: each adapted
    projection's weight a LoraWeight, the adapters' own entries gone."""
    out: dict[str, Any] = {n: t for n, t in w.items() if LORA not in n}
    out.update((f"{module}.weight", adapted) for module, adapted in _adapted(w, lora, seed))
    return out


@contextlib.contextmanager
def hooked_adapters(module: nn.Module, w: Weights, lora: LoraConfig, seed: int | None) -> Iterator[Weights]:
    """transformers' own layer `module` (the generic path) with adapters, for one call: a forward hook on each adapted
    nn.Linear adds lora_term of the Linear's input to its output, as PEFT's LoRA Linear adds it to its base layer's.
    Yields the base weights alone, which the layer binds as its own (functional_call)."""
    handles = []
    try:
        for name, adapted in _adapted(w, lora, seed):
            def add_term(_: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor, a: LoraWeight = adapted
                         ) -> torch.Tensor:
                x = args[0] if args else kwargs["input"]
                return output + lora_term(x, a.lora_a, a.lora_b, a.scaling, a.dropout, a.seed)

            handles.append(module.get_submodule(name).register_forward_hook(add_term, with_kwargs=True))
        yield {n: t for n, t in w.items() if LORA not in n}
    finally:
        for handle in handles:
            handle.remove()


class LoraLayer:
    """A family's layer function with adapters: fn(x, weights with adapters, *the layer's args, dropout seed)."""

    compilable = False  # torch.compile(fullgraph=True) cannot trace through a LoraWeight
    owns_backward = True  # the executor takes its gradients with `backward` (the base's would be wasted work)

    def __init__(self, layer: LayerFn, lora: LoraConfig):
        self.layer, self.lora = layer, lora

    def __call__(self, x: torch.Tensor, w: Weights, *args: Any) -> torch.Tensor:
        *layer_args, seed = args
        module = getattr(self.layer, "module", None)  # transformers' own layer, on the generic path
        if isinstance(module, nn.Module):
            with hooked_adapters(module, w, self.lora, seed) as base:
                return self.layer(x, base, *layer_args)
        if seed is not None and self._tiled():
            refuse_tiled_dropout(self.lora)
        return self.layer(x, with_adapters(w, self.lora, seed), *layer_args)

    def backward(self, x: torch.Tensor, w: Weights, grad_out: torch.Tensor, *args: Any
                 ) -> tuple[torch.Tensor, Weights]:
        """(dL/dx, {adapter name in the layer: dL/d adapter}) by rerunning the layer with only x and the adapters as
        leaves: the base weights get no gradient. Over sequence tiles where the family's layer runs so (its own tiled
        backward, the adapters bound into each tile's recompute), else the layer whole."""
        if not self._tiled():
            return recompute_grads(self, x, w, grad_out, *args, trainable=is_adapter)
        *layer_args, seed = args
        if seed is not None:
            refuse_tiled_dropout(self.lora)
        return self.layer.backward(x, w, grad_out, *layer_args, trainable=is_adapter,
                                   bind=lambda weights: with_adapters(weights, self.lora, seed))

    def _tiled(self) -> bool:
        """The family's layer runs over sequence tiles (tile_tokens set), forward and backward."""
        return getattr(self.layer, "tile_tokens", None) is not None and hasattr(self.layer, "backward")


def is_adapter(name: str) -> bool:
    """An adapter's tensor (a LoRA run trains these), by its name in the layer; the base's are frozen."""
    return LORA in name


def refuse_tiled_dropout(lora: LoraConfig) -> None:
    """Refuses LoRA dropout over sequence tiles, in one sentence. Why not make it work: a target's mask is drawn from
    the batch's seed over the shape of the projection's input, which over tiles is one tile's, so every tile would
    draw the same mask (correlated from tile to tile, not PEFT's independent dropout); and the tiled backward binds
    each piece's weights apart (q/k/v, o_proj, the MLP), where a target's seed follows its place among the targets
    bound together, so its recompute would draw other masks than the forward. Both right would need masks drawn per
    token position and target name, positions the layer math does not pass to its weights."""
    if lora.dropout > 0:
        raise ConfigError("LoRA dropout cannot run over sequence tiles (each tile would draw the same mask); set the "
                          "LoRA dropout to 0 or tile_tokens to none.")


class LoraBatch:
    """A family's batch with a dropout seed after each layer's arguments: the same in the forward and the recompute
    (None: no dropout)."""

    def __init__(self, batch: Batch, seed: int | None):
        self.inner, self.seed = batch, seed

    def layer_args(self, index: int) -> tuple[Any, ...]:
        seed = None if self.seed is None else hash((self.seed, index)) & 0x7FFF_FFFF_FFFF
        return (*self.inner.layer_args(index), seed)

    @property
    def adds_loss(self) -> bool:
        return getattr(self.inner, "adds_loss", False)

    def forward_done(self) -> torch.Tensor | None:
        return self.inner.forward_done()


class LoraArchitecture:
    """A family's Architecture with adapters in its layers (LoraLayer); the embedding, final norm and head are the
    family's. Batches are seeded from (seed, step, how many batches this step made before): start_step(step) before a
    step's batches, so that a replayed step draws the same dropout masks; start_step(step, training=False) before an
    evaluation's, which draw none. The executor's seed tells data-parallel ranks apart (their rows differ)."""

    def __init__(self, arch: Architecture, lora: LoraConfig, seed: int = 0):
        self.arch, self.lora, self.seed = arch, lora, seed
        self.embed_scale, self.logit_softcap = arch.embed_scale, arch.logit_softcap
        if hasattr(arch, "logits"):
            self.logits = arch.logits
        self._layers: dict[int, LoraLayer] = {}  # id of the family's layer function -> its LoRA form
        self.step, self._batches, self.training = 0, 0, True

    def start_step(self, step: int, training: bool = True) -> None:
        self.step, self._batches, self.training = step, 0, training

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> LoraBatch:
        self._batches += 1
        inner = self.arch.batch(batch_size, seq, device, dtype, position_ids)
        return LoraBatch(inner, hash((self.seed, self.step, self._batches)) if self.training else None)

    def layer(self, index: int) -> LoraLayer:
        fn = self.arch.layer(index)
        if id(fn) not in self._layers:  # one LoraLayer per structure, as the family has one function per structure
            self._layers[id(fn)] = LoraLayer(fn, self.lora)
        return self._layers[id(fn)]

    def tile(self, tile_tokens: int) -> None:
        refuse_tiled_dropout(self.lora)
        self.arch.tile(tile_tokens)

    def cached_batch(self, *args: Any) -> Any:
        """Generation's (architecture.py): the family's; no dropout."""
        return self.arch.cached_batch(*args)  # type: ignore[attr-defined]

    def cached_layer(self, index: int) -> Callable[..., Any]:
        """The family's cached step with the adapters in its layer, as LoraLayer runs it, without dropout."""
        fn, lora = self.arch.cached_layer(index), self.lora  # type: ignore[attr-defined]
        module = getattr(self.arch.layer(index), "module", None)  # transformers' own layer, on the generic path

        def step(x: torch.Tensor, w: Weights, past: Any, *args: Any) -> Any:
            if isinstance(module, nn.Module):
                with hooked_adapters(module, w, lora, None) as base:
                    return fn(x, base, past, *args)
            return fn(x, with_adapters(w, lora, None), past, *args)

        return step

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        return self.arch.final_norm(x, weights)
