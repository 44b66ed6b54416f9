"""Kept activations: a decoder layer's autograd graph kept from its forward to its backward, so the backward takes its
gradients from it instead of rerunning the layer from its activation checkpoint.

A saved weight is packed as a reference and bound in the backward to the weights brought in again (the buffers rotate
in between): the same graph and kernels as the recompute's, so the same bits (docs/design.md#kept-activations)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.engine.grad_fold import FoldLinears, folded_grads
from megatrain.model.templates import Weights


@dataclass(frozen=True)
class WeightRef:
    """A saved tensor that is a view of weight `name` of the layer: where in it, and how it is laid out."""

    name: str
    offset: int  # elements from the weight's first, in its storage
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class KeptGraph:
    """One layer's forward on one micro-batch, waiting for its backward."""

    input: torch.Tensor  # the input leaf
    leaves: Weights  # the weights as the forward's leaves: gradients are taken with respect to them
    output: torch.Tensor | None = None  # what the layer returned, with its graph
    weights: Weights | None = None  # the backward's weights, which the references resolve to
    saved: dict[int, int] = field(default_factory=dict)  # storage of each activation kept -> its bytes
    folded: bool = False  # its linears fold their weight gradients (grad_fold.py)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _extent(t: torch.Tensor) -> int:
    """Elements of its storage `t` spans from its first."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0


class KeptActivations:
    """The kept graphs of a pass, by activation index (layer x micro-batches + micro-batch, as the checkpoints')."""

    def __init__(self) -> None:
        self._graphs: dict[int, KeptGraph] = {}
        self.saved_bytes = self.peak_saved_bytes = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def forward(self, index: int, fn: Callable[..., torch.Tensor], x: torch.Tensor, w: Weights,
                args: tuple[Any, ...], fold: bool = False) -> torch.Tensor:
        """fn(x, w, *args) with its graph kept as `index`; returns the output, detached. fold: its linears fold their
        weight gradients into the buffers its backward is given (grad_fold.py)."""
        leaves = {name: t.detach().requires_grad_(True) for name, t in w.items()}
        graph = KeptGraph(x.detach().requires_grad_(True), leaves, folded=fold)
        weights: dict[int, list[tuple[int, int, str]]] = {}  # storage -> (first, end, name) of each weight in it
        for name, t in leaves.items():
            weights.setdefault(_storage_key(t), []).append((t.storage_offset(), t.storage_offset() + _extent(t), name))
        shared = {_storage_key(t) for a in args for t in (a if isinstance(a, (tuple, list)) else (a,))
                  if isinstance(t, torch.Tensor)}

        def pack(t: torch.Tensor) -> torch.Tensor | WeightRef:
            key = _storage_key(t)
            start = t.storage_offset()
            for first, end, name in weights.get(key, ()):
                if first <= start and start + _extent(t) <= end and t.dtype == leaves[name].dtype:
                    return WeightRef(name, start - first, tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in shared and key not in graph.saved:
                graph.saved[key] = t.untyped_storage().nbytes()
            return t

        def unpack(saved: torch.Tensor | WeightRef) -> torch.Tensor:
            if not isinstance(saved, WeightRef):
                return saved
            assert graph.weights is not None, "a kept graph's weights resolve in its backward only"
            base = graph.weights[saved.name]
            assert base.dtype == saved.dtype
            return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                FoldLinears(leaves) if fold else contextlib.nullcontext():
            output = fn(graph.input, leaves, *args)
        graph.output = output
        self._graphs[index] = graph
        self._count(sum(graph.saved.values()))
        return output.detach()

    def backward(self, index: int, w: Weights, grad_out: torch.Tensor, into: Weights | None = None
                 ) -> tuple[torch.Tensor, Weights]:
        """(dL/dx, {name: dL/dw}) of kept graph `index`, its weight references bound to `w` (what recompute_grads
        returns for the same layer: a weight the layer did not use has a zero gradient); a folded graph's linears add
        into `into` instead, and their weights are absent (grad_fold.folded_grads, as grad_fold.recompute_folded)."""
        graph = self._graphs.pop(index)
        graph.weights = w
        assert graph.output is not None and graph.folded == (into is not None)
        if into is not None:
            grad_x, grads = folded_grads(graph.output, graph.input, graph.leaves, grad_out, w, into)
        else:
            grad_x, *wgrads = torch.autograd.grad(graph.output, [graph.input, *graph.leaves.values()], grad_out,
                                                  allow_unused=True, materialize_grads=True)
            grads = dict(zip(graph.leaves, wgrads, strict=True))
        self._count(-sum(graph.saved.values()))
        return grad_x, grads

    def _count(self, nbytes: int) -> None:
        self.saved_bytes += nbytes
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.saved_bytes)

    def end(self) -> None:
        """The pass is over (or failed): no graph outlives it."""
        self._graphs.clear()
        self.saved_bytes = 0
