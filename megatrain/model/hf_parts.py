"""Where a transformers causal LM keeps its parts, found by structure rather than by name.

The stack is the ModuleList of as many blocks as the config has layers (`model.layers`, `transformer.h`,
`gpt_neox.layers`, `model.decoder.layers`, ...); the base model is the module that holds it and runs it; the token
embedding and the output projection are what the model itself answers for `get_input_embeddings()` and
`get_output_embeddings()`. What else the base holds with parameters is placed by running its forward once with
every layer and every such module a recording stand-in: called after the last layer, it belongs to the head (the
final norm, with its bias); called before the first, to the embedding (refused: megatrain gathers embedding rows
on the host and does not stream those). The names all stay the model's own, so `save_pretrained` writes them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError


@dataclass(frozen=True)
class ModelParts:
    base: str  # the module whose forward runs the stack: "model", "transformer", "model.decoder", ...
    stack: str  # the stack's attribute in the base: "layers", "h", "blocks"
    embed: str  # the token embedding's weight: "model.embed_tokens.weight", "transformer.wte.weight", ...
    final: str | None  # the module the base runs after its last layer (the final norm), its name in the base
    head: str | None  # the output projection module ("lm_head", "embed_out"); None where tied to the embedding
    head_params: tuple[str, ...]  # its parameters' names inside it ("weight", "bias")

    @property
    def stack_prefix(self) -> str:
        return f"{self.base}.{self.stack}." if self.base else f"{self.stack}."

    def in_base(self, name: str) -> str:
        return f"{self.base}.{name}" if self.base else name


def submodule(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _path_of(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is target), None) if target is not None else None


def _num_layers(model: nn.Module) -> int | None:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    return n if isinstance(n, int) and n > 0 else None


def _stack(model: nn.Module) -> tuple[str, str]:
    """(base path, stack attribute) of the largest ModuleList with one block per layer."""
    n = _num_layers(model)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise ConfigError(f"{type(model).__name__} keeps no stack of its {n} decoder layers that megatrain can find; "
                          "its generic path cannot train this model.")
    path, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    base, _, stack = path.rpartition(".")
    return base, stack


def find_parts(model: nn.Module) -> ModelParts:
    """The model's parts (a model on the meta device will do); ConfigError in one sentence for what megatrain's
    generic path cannot stream."""
    name = type(model).__name__
    base_path, stack = _stack(model)
    base = submodule(model, base_path)
    embed_module = model.get_input_embeddings()
    embed = _path_of(model, embed_module)
    if embed is None or not isinstance(getattr(embed_module, "weight", None), torch.Tensor):
        raise ConfigError(f"{name} has no token embedding megatrain can find; its generic path cannot train it.")
    if not embed.startswith(base_path):
        raise ConfigError(f"{name}'s token embedding ({embed}) lies outside the module that runs its layers "
                          f"({base_path}); megatrain's generic path cannot train this model.")
    head_module = model.get_output_embeddings()
    tied = head_module is not None and head_module.weight is embed_module.weight
    head = None if tied else _path_of(model, head_module)
    if not tied and head is None:
        raise ConfigError(f"{name} has no output projection megatrain can find; its generic path cannot train it.")
    head_params = tuple(n for n, _ in head_module.named_parameters()) if head_module is not None else ()
    embed_child = embed[len(base_path) + 1:].split(".")[0] if base_path else embed.split(".")[0]
    # modules with weights, and the weightless ones that are not rotary tables (a final norm with no weight: OLMo)
    others = [child for child, m in base.named_children() if child not in (stack, embed_child)
              and (any(True for _ in m.parameters()) or not any(True for _ in m.buffers()))]
    before, after = call_order(model, base_path, stack, embed_child, others) if others else ([], [])
    # megatrain embeds by itself (gathered rows, times a scale): a module the forward runs on the embeddings before the
    # first layer is refused, whether it has weights (a position embedding, an embedding norm) or not (NanoChat's
    # weightless norm), unless it does nothing (a dropout of p = 0)
    before = [child for child in before if not _inert(getattr(base, child))]
    if before:
        raise ConfigError(f"{name} runs {', '.join(base_path + '.' + c for c in before)} on the embeddings before "
                          "its first layer, which megatrain's generic path does not stream; it cannot train this "
                          "model.")
    if len(after) > 1:
        raise ConfigError(f"{name} runs several modules after its last layer ({', '.join(after)}); megatrain's "
                          "generic path follows one final norm and cannot train this model.")
    parts = ModelParts(base_path, stack, f"{embed}.weight", after[0] if after else None, head,
                       ("weight",) if tied else head_params)
    outside = _outside(model, parts)
    if outside:
        raise ConfigError(f"{name} has parameters outside megatrain's decoder layout ({', '.join(outside[:4])}); "
                          "its generic path cannot train this model.")
    return parts


def _inert(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and module.p == 0)


def _outside(model: nn.Module, parts: ModelParts) -> list[str]:
    inside = [parts.stack_prefix, parts.embed]
    if parts.final is not None:
        inside.append(parts.in_base(parts.final) + ".")
    if parts.head is not None:
        inside += [f"{parts.head}.{p}" for p in parts.head_params]
    return [n for n, _ in model.named_parameters() if not any(n == p or n.startswith(p) for p in inside)]


class _Recorder(nn.Module):
    """Stands in for a module of the base: notes that it was called, returns its input the way the model's layers
    return theirs (see layer_output)."""

    def __init__(self, name: str, order: list[str], arity: int = 0):
        super().__init__()
        self.name, self.order, self.arity = name, order, arity

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self.order.append(self.name)
        return layer_output(x, self.arity)


# How a model's forward reads its layers' outputs: the hidden states, a 1-tuple (layer_outputs[0]), or a pair
# (hidden_states, attn_weights = layer(...)); stand-ins answer each way until the forward runs.
LAYER_OUTPUT_ARITIES = (0, 1, 2)


def layer_output(x: Any, arity: int) -> Any:
    return x if arity == 0 else (x, *[None] * (arity - 1))


def rebuilt_on(base: nn.Module, skip: set[str], device: torch.device) -> None:
    """Replaces each child of `base` outside `skip` that keeps buffers (rotary tables) by one built anew on `device`
    from the config: on the meta device they hold no values."""
    for child, module in list(base.named_children()):
        if child in skip or not any(True for _ in module.buffers()):
            continue
        try:
            with torch.device("cpu"):
                rebuilt = type(module)(base.config)
        except Exception as e:
            raise ConfigError(f"megatrain's generic path cannot rebuild {type(module).__name__} from the config ({e}); "
                              "it cannot train this model.") from None
        setattr(base, child, rebuilt.to(device))


def call_order(model: nn.Module, base_path: str, stack: str, embed_child: str, others: list[str]
               ) -> tuple[list[str], list[str]]:
    """(the base's children among `others` its forward calls before the first layer, those it calls after the last),
    from one run of a copy of the base on the CPU with every layer and each of `others` a recording stand-in."""
    import copy

    base = copy.deepcopy(submodule(model, base_path))  # a meta model: copying it copies no data
    rebuilt_on(base, {stack, embed_child, *others}, torch.device("cpu"))
    hidden = getattr(base.config, "hidden_size", None) or model.get_input_embeddings().weight.shape[-1]
    x = torch.zeros(1, 2, hidden)
    n = len(getattr(base, stack))
    for arity in LAYER_OUTPUT_ARITIES:
        order: list[str] = []
        setattr(base, stack, nn.ModuleList(_Recorder("layer", order, arity) for _ in range(n)))
        for child in others:
            setattr(base, child, _Recorder(child, order))
        try:
            with torch.no_grad():
                base(inputs_embeds=x, use_cache=False)
            break
        except Exception as e:
            if order and "layer" not in order:  # a stand-in's output did not fit what follows it, before any layer
                return order, []
            if arity != LAYER_OUTPUT_ARITIES[-1]:
                continue
            what = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"megatrain's generic path cannot run {type(model).__name__}'s forward around its "
                              f"layers ({what}); it cannot train this model.") from None
    if "layer" not in order:
        raise ConfigError(f"{type(model).__name__}'s forward called none of its layers; megatrain's generic path "
                          "cannot train this model.")
    first, last = order.index("layer"), len(order) - 1 - order[::-1].index("layer")
    return order[:first], order[last + 1:]


def path_of_output(model: nn.Module) -> str:
    target = model.get_output_embeddings()
    return next(name for name, m in model.named_modules() if m is target)


class _Outputs(dict):
    """A base model's output as its ForCausalLM reads it: [0] and .last_hidden_state; other fields are None."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)


class BaseOutput(nn.Module):
    """Stands in for the base model in the head's skeleton: returns the hidden states it was made with."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> _Outputs:
        return _Outputs(last_hidden_state=self.hidden)
