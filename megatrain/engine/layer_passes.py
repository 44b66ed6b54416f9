"""One decoder layer's forward and backward over a pass's micro-batches, and what the forward leaves for the backward:
an activation checkpoint and a recompute, or, for the top `kept_layers`, a kept graph; the weight gradients summed
over the micro-batches in fp32 (docs/design.md#the-schedule)."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.config import MegatrainError
from megatrain.engine.activation_checkpoints import ActivationCheckpoints
from megatrain.engine.compiled import CompiledFunctions
from megatrain.engine.grad_fold import recompute_folded
from megatrain.engine.kept_activations import KeptActivations
from megatrain.engine.streams import Streams
from megatrain.model.architecture import Architecture, Batch, LayerFn
from megatrain.model.layout import Unit
from megatrain.model.templates import Weights, recompute_grads
from megatrain.telemetry import Recorder


class LayerPasses:
    """Runs decoder layers forward and backward for the executor's schedule (megatrain/engine/executor.py)."""

    def __init__(self, arch: Architecture, streams: Streams, rec: Recorder, num_layers: int, *,
                 checkpoint_budget: int | None = None, kept_layers: int = 0, tiled: bool = False,
                 compile: bool = False):
        """kept_layers: the top that many layers keep their activations (0: every layer recomputes)."""
        if not 0 <= kept_layers <= num_layers:
            raise MegatrainError(f"kept_layers must be between 0 and the model's {num_layers} layers, got "
                                 f"{kept_layers}.")
        if kept_layers and tiled:
            raise MegatrainError("kept activations need each layer's whole forward under autograd, which the tiled "
                                 "long-context path (tile_tokens) does not run; set keep_activations = none, or "
                                 "tile_tokens = none.")
        if kept_layers and getattr(arch.layer(0), "owns_backward", False):
            raise MegatrainError("kept activations take every weight's gradient from the kept graph, and these layers "
                                 "take their own (LoRA's adapters alone); set keep_activations = none.")
        self.arch, self.streams, self.rec = arch, streams, rec
        self.tiled, self.compile, self.num_layers = tiled, compile, num_layers
        self.first_kept = num_layers - kept_layers  # layers from here up keep their graphs
        self.activation_checkpoints = ActivationCheckpoints(streams, checkpoint_budget)
        self.kept = KeptActivations()
        self.compiled = CompiledFunctions(arch, compile, tiled)  # the layers' and the head's (compiled.py)
        self._k = 1

    def keeps(self, i: int) -> bool:
        """Decoder layer i keeps its activations (its graph) from the forward to the backward."""
        return i >= self.first_kept

    def begin(self, batches: list[Batch]) -> None:
        """A pass over these micro-batches: checkpoints for the layers below the kept ones."""
        if self.first_kept < self.num_layers and getattr(batches[0], "adds_loss", False):
            raise MegatrainError("this model's router adds an auxiliary loss whose gradient reaches its layers through "
                                 "their recompute; set keep_activations = none.")
        self._k = len(batches)
        self.activation_checkpoints.begin(self.first_kept * self._k)

    def forward(self, i: int, unit: Unit, j: int, x: torch.Tensor, w: Weights, batch: Batch) -> torch.Tensor:
        """Layer i (`unit`) on micro-batch j of the pass: its output, and what its backward will need kept."""
        index, args = i * self._k + j, batch.layer_args(unit.layer)
        fn = self.layer_fn(unit)
        if self.keeps(i):
            with self.rec.span("compute", "forward", unit.index, self.streams.compute):
                return self.kept.forward(index, fn, x, w, args, fold=self.folds(unit, j, self._k))
        self.activation_checkpoints.put(index, x)
        with torch.no_grad(), self.rec.span("compute", "forward", unit.index, self.streams.compute):
            return fn(x, w, *args)

    def backward(self, i: int, unit: Unit, w: Weights, batches: list[Batch], grads: list[torch.Tensor]) -> Weights:
        """Layer i's backward over the pass's micro-batches, the top one first: grads[m] becomes the gradient with
        respect to its input; returns the weight gradients, summed over the micro-batches in fp32: the first one's
        (autograd's own) are the buffers, the others' linear weights fold into them in their GEMMs (grad_fold.py)
        and what else they have is added."""
        k, kept = len(batches), self.keeps(i)
        wgrads: Weights = {}
        for m in range(k - 1, -1, -1):
            index, into = i * k + m, wgrads if self.folds(unit, m, k) else None
            with self.rec.span("compute", "backward" if kept else "recompute+backward", unit.index,
                               self.streams.compute):
                if kept:
                    grads[m], micro_wgrads = self.kept.backward(index, w, grads[m], into)
                else:
                    grads[m], micro_wgrads = self._recomputed(unit, w, batches[m], grads[m], index, into)
                if k == 1:
                    wgrads = micro_wgrads
                else:  # summed in fp32, whatever the compute dtype
                    for name, g in micro_wgrads.items():
                        if name in wgrads:
                            wgrads[name] += g
                        else:
                            wgrads[name] = g.float()
                del micro_wgrads
        return wgrads

    def folds(self, unit: Unit, m: int, k: int) -> bool:
        """Micro-batch m of k: its weight gradients of `unit`'s layer fold into the layer's buffers (grad_fold.py),
        as every micro-batch's but the first the backward runs (the last), unless the layer takes its own."""
        return m < k - 1 and not self._takes_own_grads(self.arch.layer(unit.layer))

    def _takes_own_grads(self, fn: LayerFn) -> bool:
        """The layer function computes its own gradients (`fn.backward`): tile by tile, or a LoRA layer's (the
        adapters' alone)."""
        return self.tiled or getattr(fn, "owns_backward", False)

    def _recomputed(self, unit: Unit, w: Weights, batch: Batch, grad: torch.Tensor, index: int,
                    into: Weights | None) -> tuple[torch.Tensor, Weights]:
        x = self.activation_checkpoints.get(index)
        args: tuple[Any, ...] = batch.layer_args(unit.layer)
        fn = self.arch.layer(unit.layer)
        if self._takes_own_grads(fn):
            return fn.backward(x, w, grad, *args)
        if into is not None:
            return recompute_folded(self.layer_fn(unit), x, w, grad, args, into)
        return recompute_grads(self.layer_fn(unit), x, w, grad, *args)

    def end(self) -> None:
        """The pass is over (or failed): nothing of it stays."""
        self.activation_checkpoints.end()
        self.kept.end()

    def layer_fn(self, unit: Unit) -> LayerFn:
        """The function of `unit`'s layer (compiled once per layer structure when compiling: compiled.py)."""
        return self.compiled.layer(self.arch.layer(unit.layer))
