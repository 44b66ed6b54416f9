"""What the executor runs through torch.compile when compiling (EngineConfig.compile on, or auto where it pays): each
layer structure's function whole (or its token-wise tiles), and the head's final norm and chunked cross-entropy.

Each function is compiled once here; nothing that changes from batch to batch enters a graph as a Python number.
What stays eager, and why: docs/design.md#compilation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatrain.engine.torch_settings import COMPILED_SHAPES_LIMIT, allow_recompiles, compile_random_ops_as_eager
from megatrain.model import ops
from megatrain.model.architecture import Architecture, LayerFn
from megatrain.model.templates import CrossEntropyFn, Weights


def compile_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile as the executor uses it: the whole function one graph (a break would be a silent slowdown),
    shapes static (a batch's shapes repeat every step)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


class CompiledFunctions:
    """The executor's compiled functions, or the eager ones where compiling is off."""

    def __init__(self, arch: Architecture, enabled: bool, tiled: bool):
        self.arch, self.enabled, self.tiled = arch, enabled, tiled
        self._layers: dict[int, tuple[LayerFn, LayerFn]] = {}  # id of a structure's function -> (it, what runs)
        self.final_norm: Callable[[torch.Tensor, Weights], torch.Tensor] = arch.final_norm
        self.cross_entropy: CrossEntropyFn = ops.cross_entropy_sum_and_grad
        if not enabled:
            return
        allow_recompiles(COMPILED_SHAPES_LIMIT)
        compile_random_ops_as_eager()
        if getattr(arch, "logits", None) is None:  # the native head (the generic path's stays eager: above)
            self.final_norm = compile_function(arch.final_norm)
            self.cross_entropy = compile_function(ops.cross_entropy_sum_and_grad)

    def layer(self, fn: LayerFn) -> LayerFn:
        """What runs for the layer function `fn`: its compiled form (the same object, its tiles compiled, where tiled),
        or fn itself where compiling is off or fn is not compilable."""
        if not self.enabled or not getattr(fn, "compilable", True):
            return fn
        if id(fn) not in self._layers:
            compile_tiles, compiled = getattr(fn, "compile_tiles", None), getattr(fn, "compiled", None)
            if self.tiled and compile_tiles is not None:
                compile_tiles(compile_function)
                self._layers[id(fn)] = (fn, fn)
            elif compiled is not None:  # the layer says which part of it compiles (the generic path's: not its RNG)
                self._layers[id(fn)] = (fn, compiled(compile_function))
            else:  # (tiled without compile_tiles, Gemma's: the forward compiled whole, its own backward eager)
                self._layers[id(fn)] = (fn, compile_function(fn))
        return self._layers[id(fn)][1]
