"""A transformers causal LM as megatrain reads it: built once on the meta device (names, shapes, layer modules as
pure code), its parts found by structure (hf_parts.py), its layers grouped into structures, their streamed
tensors (parameters, and persistent buffers as frozen constants) and the weight decay transformers' Trainer gives
them. Shared by the generic family (hf_generic.py) and what the executor runs (hf_architecture.py)."""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError
from megatrain.model.hf_config import build_causal_lm, hf_config_object, transformers_module
from megatrain.model.hf_parts import ModelParts, find_parts, made_at_init, plain, submodule

# what transformers' Trainer leaves out of weight decay, by name: biases and norms
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


@functools.lru_cache(maxsize=4)
def _meta_model_cached(key: str) -> nn.Module:
    return build_meta_model(json.loads(key))


def meta_model(hf: dict[str, Any]) -> nn.Module:
    """The ForCausalLM model of `hf` on the meta device (cached: read-only users only)."""
    return _meta_model_cached(json.dumps(hf, sort_keys=True))


def build_meta_model(hf: dict[str, Any]) -> nn.Module:
    transformers_module()  # one sentence where transformers is missing or too old
    config = hf_config_object(hf)
    with torch.device("meta"):
        try:
            model = build_causal_lm(config)
        except Exception as e:  # transformers' own refusal of a config, whatever its type
            raise ConfigError(f"transformers cannot build this {hf['model_type']} model ({e}); "
                              "fix config.json.") from None
    model.train()  # as transformers trains: dropout where the config enables it
    return model


@functools.lru_cache(maxsize=4)
def _parts_cached(key: str) -> ModelParts:
    return find_parts(_meta_model_cached(key))


def model_parts(hf: dict[str, Any]) -> ModelParts:
    """Where the model of `hf` keeps its stack, embedding, final norm and head (megatrain/model/hf_parts.py)."""
    return _parts_cached(json.dumps(hf, sort_keys=True))


def stack_of(model: nn.Module, parts: ModelParts) -> nn.ModuleList:
    return getattr(submodule(model, parts.base), parts.stack)


def check_layers(model: nn.Module, parts: ModelParts) -> None:
    """Every layer's state streams: parameters, buffers the checkpoint holds, and constants transformers makes at
    init (layer_constants); no weight is shared between layers (each layer's weights stream, and are updated, as its
    own)."""
    owner: dict[int, int] = {}
    made: set[tuple[str, tuple[str, ...]]] = set()
    for i, layer in enumerate(stack_of(model, parts)):
        for name, p in layer.named_parameters():
            if owner.setdefault(id(p), i) != i:
                raise ConfigError(f"{type(model).__name__} shares weights between its layers {owner[id(p)]} and {i} "
                                  f"({name}); megatrain's generic path streams each layer's own weights and cannot "
                                  "train this model.")
        key = (type(layer).__name__, tuple(constant_names(layer)))
        if key[1] and key not in made:
            layer_constants(model, layer, i)
            made.add(key)


def constant_names(layer: nn.Module) -> list[str]:
    """A layer's buffers that its checkpoint does not hold (a causal mask, a rotary table): made at init."""
    return sorted(set(dict(layer.named_buffers())) - set(layer_buffers(layer)))


def layer_constants(model: nn.Module, layer: nn.Module, index: int) -> dict[str, torch.Tensor]:
    """The values of a (meta) layer's constant buffers on the CPU, made as transformers makes them: its model's
    `_init_weights` on each module that owns one (a shell of it: its children and parameters are not built). A
    buffer that init leaves as it found it cannot be made: ConfigError."""
    names = constant_names(layer)
    out: dict[str, torch.Tensor] = {}
    for prefix, module in layer.named_modules():
        own = [n for n, _ in module.named_buffers(recurse=False) if f"{prefix}.{n}".lstrip(".") in names]
        if not own:
            continue
        made = made_at_init(model, module)
        for n in own:
            if n not in made:
                raise ConfigError(f"{type(model).__name__}'s layer {index} keeps a buffer that its checkpoint does not "
                                  f"hold and transformers does not make at init ({f'{prefix}.{n}'.lstrip('.')}); "
                                  "megatrain's generic path runs layers statelessly and cannot train this model.")
            out[f"{prefix}.{n}".lstrip(".")] = made[n]
    return out


def decayed(layer: nn.Module, name: str) -> bool:
    """Weight decay as transformers' Trainer applies it: not on biases and norms, by name or by nn.LayerNorm type."""
    owner = layer.get_submodule(name.rpartition(".")[0])
    return not NO_DECAY.search(name) and not isinstance(owner, nn.LayerNorm)


def layer_buffers(layer: nn.Module) -> list[str]:
    """A layer's persistent buffers (a router's correction bias, say): constants its checkpoint holds, which stream
    with the layer's weights as frozen tensors. The non-persistent ones are made at init, not loaded."""
    saved = set(layer.state_dict(keep_vars=True))
    return [name for name, _ in layer.named_buffers() if name in saved]


# attributes that only say where a layer sits (a KV cache's index): layers differing in these alone are interchangeable
INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})


def layer_structure(model: nn.Module, parts: ModelParts, index: int) -> tuple[Any, ...]:
    """What makes two layers interchangeable: class, parameter and buffer names and shapes, layer type, and every
    plain attribute of every module inside (a no-rope flag, a per-layer constant such as DiffLlama's lambda_init)."""
    layer = stack_of(model, parts)[index]
    types = getattr(model.config, "layer_types", None)
    kind = types[index] if isinstance(types, (list, tuple)) and index < len(types) else None
    attributes = tuple((name, type(m).__name__, tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                                             if not k.startswith("_") and k != "training"
                                                             and k not in INDEX_ATTRIBUTES and plain(v))))
                       for name, m in layer.named_modules())
    tensors = tuple((n, tuple(t.shape)) for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    return (type(layer).__name__, kind, tensors, attributes)

