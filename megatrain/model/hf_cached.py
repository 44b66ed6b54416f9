"""Generation on the generic path: transformers' own layers run on new tokens beside the keys and values of the earlier
ones, which megatrain/engine/generation.py holds. A LayerKV stands in for transformers' cache, so a layer stays a
function (past in, new out); a layer that needs more of its cache than `update` is refused
(docs/design.md#the-generic-path)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatrain.config import MegatrainError
from megatrain.model.templates import KV, Weights

if TYPE_CHECKING:
    from megatrain.model.hf_architecture import GenericArchitecture, GenericLayer, LayerCall


class SeenTokens:
    """What transformers' mask functions ask of a cache: how many tokens came before the new ones (every layer keeps
    them all; a sliding window is the mask's)."""

    is_compileable = False

    def __init__(self, past: int):
        self.past = past

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0


class LayerKV:
    """One layer's `cache` for one call: update(new keys, values) -> (the earlier ones and the new, concatenated), the
    new ones kept in `new`."""

    def __init__(self, past: KV | None, model: str):
        self.past, self.model = past, model
        self.new: KV | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> KV:
        if self.new is not None:
            raise MegatrainError(f"a {self.model} layer updates its cache twice in one call, which megatrain's "
                                 "generation does not follow; generate with transformers instead.")
        self.new = (key_states, value_states)
        if self.past is None:
            return key_states, value_states
        return torch.cat((self.past[0], key_states), -2), torch.cat((self.past[1], value_states), -2)

    def __getattr__(self, name: str) -> Any:
        raise MegatrainError(f"a {self.model} layer asks its cache for {name!r}: it keeps state other than attention "
                             "keys and values between tokens, which megatrain's generation does not keep; generate "
                             "with transformers instead.")


class CachedBatch:
    """What each layer's cached step gets: its call (the keyword arguments the model's forward gives it), the new
    tokens' positions (for what runs before the first layer), and what the routers record (never read here)."""

    def __init__(self, calls: list[LayerCall], position_ids: torch.Tensor, seen: SeenTokens):
        self.calls, self.position_ids, self.seen = calls, position_ids, seen
        self.router_logits: dict[int, torch.Tensor] = {}
        self.rng: dict[int, Any] = {}

    def layer_args(self, index: int) -> tuple[Any, ...]:
        return (self.calls[index],)


@contextlib.contextmanager
def evaluating(*modules: nn.Module) -> Iterator[None]:
    """The modules in eval mode (no dropout), their own modes back afterwards."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def cached_layer(arch: GenericArchitecture, layer: GenericLayer,
                 before: Callable[[torch.Tensor, Weights, Any], tuple[torch.Tensor, Weights]] | None = None
                 ) -> Callable[..., tuple[torch.Tensor, KV]]:
    """fn(x, weights, past, call) -> (the layer's output, the new tokens' keys and values); before(x, weights, batch):
    what the model's forward runs before the first layer, and the layer's own weights (FirstLayer.before)."""
    model = type(arch.model).__name__

    def step(x: torch.Tensor, w: Weights, past: KV | None, call: LayerCall) -> tuple[torch.Tensor, KV]:
        kv = LayerKV(past, model)
        seen = call.batch.seen  # type: ignore[attr-defined]
        kwargs = {k: kv if v is seen else v for k, v in call.kwargs.items()}  # GPT-2 passes it by position
        args = tuple(kv if a is seen else a for a in call.args)
        own = type(call)(call.index, {**kwargs, "__args__": args}, call.batch)
        skeleton = [arch._skeleton_for(x.device, stop=True)] if before is not None else []
        with evaluating(layer.module, *skeleton):
            if before is not None:
                x, w = before(x, w, call.batch)
            y = layer.run(x, w, own)
        if kv.new is None:
            raise MegatrainError(f"a {model} layer does not hand its keys and values to its cache, which megatrain's "
                                 "generation needs; generate with transformers instead.")
        return y, kv.new

    return step
