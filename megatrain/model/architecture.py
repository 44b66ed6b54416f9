"""What the executor runs of a model: per-layer pure functions, the context a batch gives them, the final norm and the
head's options. Each family answers with one (Family.architecture); the executor knows nothing else of the model's
math. The contract (one function per layer structure, replayable forwards, cached steps for generation):
docs/design.md#architecture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatrain.config import ModelConfig
from megatrain.model import ops
from megatrain.model.templates import DecoderLayer, Documents, Weights

LayerFn = Callable[..., torch.Tensor]  # fn(x, weights, *batch.layer_args(i)) -> x


class Batch(Protocol):
    def layer_args(self, index: int) -> tuple[Any, ...]:
        """The arguments after (x, weights) of layer `index`'s function."""
        ...

    def forward_done(self) -> torch.Tensor | None:
        """Called once the forward has run every layer: a term to add to the loss (a scalar on the device), or
        None. Its gradient reaches the layers through their recompute."""
        ...


class Architecture(Protocol):
    embed_scale: float | None  # the embedding's output is multiplied by this (Gemma: sqrt(hidden)), or None
    logit_softcap: float | None  # logits -> cap * tanh(logits / cap) before the loss (Gemma 2), or None

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> Batch:
        """position_ids: [batch, seq] on the host, each packed document from 0 (None: 0..seq-1 in every row); a
        document attends within itself only, as transformers reads packed position_ids."""
        ...

    def layer(self, index: int) -> LayerFn:
        """Layer `index`'s function; one with a `backward(x, w, grad_out, *args) -> (dL/dx, {name: dL/dw})` method
        computes its gradients itself (tiled), else the executor reruns it under autograd (recompute_grads)."""
        ...

    def tile(self, tile_tokens: int) -> None:
        """Run the layers' token-wise parts over tiles of `tile_tokens` tokens (ConfigError where they cannot)."""
        ...

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        """The norm before the head; `weights` are the head unit's tensors named "norm.*"."""
        ...


class RopeBatch:
    """Every layer gets the same rotary (cos, sin) and packed documents; nothing is added to the loss."""

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents = None):
        self.rope, self.documents = rope, documents

    def layer_args(self, index: int) -> tuple[Any, ...]:
        return (self.rope, self.documents)

    def forward_done(self) -> torch.Tensor | None:
        return None


class CachedBatch:
    """What every layer's cached step gets: the rotary tables at the new tokens' positions, and the keys each sees."""

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor], sees: torch.Tensor):
        self.rope, self.sees = rope, sees

    def layer_args(self, index: int) -> tuple[Any, ...]:
        return (self.rope, self.sees)


class LlamaArchitecture:
    """The Llama family's (and Qwen3's) decoder: one DecoderLayer for every layer, RoPE, RMSNorm, plain head."""

    embed_scale = None
    logit_softcap = None

    def __init__(self, config: ModelConfig):
        self.config = config
        self.template = DecoderLayer(config)
        self._rope: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> RopeBatch:
        documents = None if position_ids is None else ops.document_starts(position_ids)
        if position_ids is not None and not torch.equal(position_ids, torch.arange(seq).expand_as(position_ids)):
            return RopeBatch(ops.rope_cos_sin(self.config, seq, device, dtype, position_ids), documents)
        key = (seq, device, dtype)
        if key not in self._rope:
            self._rope[key] = ops.rope_cos_sin(self.config, seq, device, dtype)
        return RopeBatch(self._rope[key], documents)

    def tile(self, tile_tokens: int) -> None:
        self.template.tile_tokens = tile_tokens

    def cached_batch(self, positions: torch.Tensor, key_positions: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> CachedBatch:
        """positions [b, n] of the new tokens, key_positions [b, m] of every key so far (theirs last); -1: padding."""
        positions, key_positions = positions.to(device), key_positions.to(device)
        rope = ops.rope_cos_sin(self.config, positions.shape[1], device, dtype, positions.clamp_min(0))
        return CachedBatch(rope, ops.cached_sees(positions, key_positions, self.config.sliding_window))

    def cached_layer(self, index: int) -> Callable[..., Any]:
        return self.template.cached

    def layer(self, index: int) -> LayerFn:
        return self.template

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        return ops.rms_norm(x, weights["norm.weight"], self.config.rms_norm_eps)
