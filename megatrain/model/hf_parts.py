"""Where a transformers causal LM keeps its parts, found by structure rather than by name: the stack, the base model,
the embedding and the output projection, and (by a forward of recording stand-ins) what belongs to the head or runs
with the first layer. The names stay the model's own (docs/design.md#the-generic-path)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
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
    pre: tuple[str, ...]  # the base's children its forward runs on the embeddings before the first layer
    head: str  # the output projection module ("lm_head", "embed_out")
    tied: bool  # its weight is the token embedding's
    head_params: tuple[str, ...]  # its parameters the head unit holds ("weight", "bias"; tied: CTRL's bias alone)
    passthrough: tuple[str, ...] = ()  # parameters outside the base the text forward does not run (a vision tower)
    head_extra: tuple[str, ...] = ()  # the causal LM's parameters its logits use beside the output projection

    @property
    def stack_prefix(self) -> str:
        return f"{self.base}.{self.stack}." if self.base else f"{self.stack}."

    @property
    def embed_in_base(self) -> str:
        """The token embedding's weight as the base names it ("embed_tokens.weight", "wte.weight")."""
        return relative_to(self.embed, self.base)

    @property
    def embed_child(self) -> str:
        """The base's child that holds the token embedding ("embed_tokens", "wte", "embeddings")."""
        return self.embed_in_base.split(".")[0]

    def in_base(self, name: str) -> str:
        return f"{self.base}.{name}" if self.base else name


def relative_to(path: str, base: str) -> str:
    """`path` (a name in the model) as named in the module at `base`, which holds it."""
    return path[len(base) + 1:] if base else path


def submodule(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _path_of(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is target), None) if target is not None else None


def _layer_counts(model: nn.Module) -> list[int]:
    """What the config says the stack holds: num_hidden_layers, or num_layers where a block holds two layers of
    attention (LongCat-Flash's 28 blocks of its 56 layers)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = [getattr(text, key, None) for key in ("num_hidden_layers", "num_layers")]
    return [n for n in counts if isinstance(n, int) and n > 0]


def _stack(model: nn.Module) -> tuple[str, str]:
    """(base path, stack attribute) of the largest ModuleList with one block per layer."""
    counts = _layer_counts(model)
    n = counts[0] if counts else None
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) in counts]
    if not lists:
        raise ConfigError(f"{type(model).__name__} keeps no stack of its {n} decoder layers that megatrain can find; "
                          "its generic path cannot train this model.")
    path, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    base, _, stack = path.rpartition(".")
    return base, stack


def _embedding_and_head(model: nn.Module, base_path: str) -> tuple[nn.Module, str, nn.Module, str]:
    """(the token embedding, its path, the output projection, its path), or one sentence where one is missing."""
    name = type(model).__name__
    embed_module = model.get_input_embeddings()
    embed = _path_of(model, embed_module)
    if embed is None or not isinstance(getattr(embed_module, "weight", None), torch.Tensor):
        raise ConfigError(f"{name} has no token embedding megatrain can find; its generic path cannot train it.")
    if not embed.startswith(base_path):
        raise ConfigError(f"{name}'s token embedding ({embed}) lies outside the module that runs its layers "
                          f"({base_path}); megatrain's generic path cannot train this model.")
    head_module = model.get_output_embeddings()
    head = _path_of(model, head_module)
    if head is None:
        raise ConfigError(f"{name} has no output projection megatrain can find; its generic path cannot train it.")
    return embed_module, embed, head_module, head


def find_parts(model: nn.Module) -> ModelParts:
    """The model's parts (a model on the meta device will do); ConfigError in one sentence for what megatrain's
    generic path cannot stream."""
    name = type(model).__name__
    base_path, stack = _stack(model)
    base = submodule(model, base_path)
    embed_module, embed, head_module, head = _embedding_and_head(model, base_path)
    tied = head_module.weight is embed_module.weight
    head_params = tuple(n for n, p in head_module.named_parameters() if p is not embed_module.weight)
    embed_child = relative_to(embed, base_path).split(".")[0]
    # modules with weights, and the weightless ones that are not rotary tables (a final norm with no weight: OLMo)
    others = [child for child, m in base.named_children() if child not in (stack, embed_child)
              and (any(True for _ in m.parameters()) or not any(True for _ in m.buffers()))]
    # an embedding module that holds more than the table: a container the forward runs on inputs_embeds (ModernBERT's
    # norm and dropout), or the embedding itself with a module after its lookup (Inkling's norm), which runs with
    # the first layer (hf_architecture.FirstLayer)
    extra = any(p is not embed_module.weight for p in getattr(base, embed_child).parameters())
    own_lookup = extra and getattr(base, embed_child) is embed_module
    if extra and not own_lookup:
        others.append(embed_child)
    before, after, whole = call_order(model, base_path, stack, embed_child, others) if others else ([], [], True)
    if own_lookup:
        before.insert(0, embed_child)
    # what the forward never calls on text (Phi-4-multimodal's image and audio embedding) passes through untrained
    uncalled = [child for child in others if whole and child not in before and child not in after]
    # what the forward runs on the embeddings before the first layer runs with that layer, weights and all (a position
    # embedding, an embedding norm, NanoChat's weightless norm, a dropout), unless it does nothing (a dropout of p = 0)
    before = list(dict.fromkeys(child for child in before if not _inert(getattr(base, child))))
    shared = [child for child in before if child in after and any(True for _ in getattr(base, child).parameters())]
    if shared:
        raise ConfigError(f"{name} runs {base_path}.{shared[0]} both before its first layer and after its last; "
                          "megatrain's generic path streams those weights once and cannot train this model.")
    if len(after) > 1:
        raise ConfigError(f"{name} runs several modules after its last layer ({', '.join(after)}); megatrain's "
                          "generic path follows one final norm and cannot train this model.")
    parts = ModelParts(base_path, stack, f"{embed}.weight", after[0] if after else None, tuple(before), head, tied,
                       head_params)
    # beside the language model, inside the module that wraps it: a multimodal model's towers and projectors, which
    # pass through untrained (their persistent buffers too); the causal LM's own modules around the output projection
    # (ModernBERT's prediction head) run with the head, in the model's own logits
    wrapper = base_path.split(".")[0] + "." if "." in base_path else None
    unused = tuple(parts.in_base(child) + "." for child in uncalled)

    def passes(name: str) -> bool:
        return name.startswith(unused) or (wrapper is not None and name.startswith(wrapper)
                                           and not name.startswith(base_path + "."))

    outside = [n for n in _outside(model, parts) if not passes(n)]
    inside_base = [n for n in outside if not base_path or n.startswith(base_path + ".")]
    if inside_base:
        raise ConfigError(f"{name} has parameters outside megatrain's decoder layout ({', '.join(inside_base[:4])}); "
                          "its generic path cannot train this model.")
    passthrough = tuple(n for n in model.state_dict(keep_vars=True) if passes(n))
    return replace(parts, passthrough=passthrough, head_extra=tuple(outside))


def _inert(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and module.p == 0)


def _outside(model: nn.Module, parts: ModelParts) -> list[str]:
    inside = [parts.stack_prefix, parts.embed, *(parts.in_base(child) + "." for child in parts.pre)]
    if parts.final is not None:
        inside.append(parts.in_base(parts.final) + ".")
    inside += [f"{parts.head}.{p}" for p in parts.head_params]
    return [n for n, _ in model.named_parameters() if not any(n == p or n.startswith(p) for p in inside)]


class _Recorder(nn.Module):
    """Stands in for a module of the base: notes that it was called, returns its input the way the model's layers
    return theirs (see layer_output); one given [batch, seq] positions or a mask (a position embedding) returns
    hidden states of zeros for them."""

    def __init__(self, name: str, order: list[str], arity: int = 0, hidden: int = 0):
        super().__init__()
        self.name, self.order, self.arity, self.hidden = name, order, arity, hidden

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.order.append(self.name)
        # the input: the first tensor given (an embedding module called with input_ids=None, inputs_embeds=x)
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), args[0] if args else None)
        if self.hidden and isinstance(x, torch.Tensor) and x.dim() == 2:  # [batch, seq]: ids, positions, a mask
            return torch.zeros(*x.shape, self.hidden)
        return layer_output(x, self.arity)


def posing_as(stand_in: nn.Module, layer: nn.Module) -> nn.Module:
    """`stand_in` with `layer`'s plain attributes (its attention type, a block type), which the model's forward may
    read off its layers."""
    classes = [c for c in type(layer).__mro__ if issubclass(c, nn.Module) and c is not nn.Module]
    attributes = {k: v for c in reversed(classes) for k, v in vars(c).items()}  # class-level ones too (Inkling 2)
    for name, value in {**attributes, **vars(layer)}.items():
        if not name.startswith("_") and name != "training" and not hasattr(stand_in, name) and plain(value):
            setattr(stand_in, name, value)
    return stand_in


def plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


# How a model's forward reads its layers' outputs: the hidden states, a 1-tuple (layer_outputs[0]), a pair
# (hidden_states, attn_weights = layer(...)) or a triple (RWKV's, with its state); stand-ins answer each way until the
# forward runs.
LAYER_OUTPUT_ARITIES = (0, 1, 2, 3)


def layer_output(x: Any, arity: int) -> Any:
    return x if arity == 0 else (x, *[None] * (arity - 1))


def made_at_init(model: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """The values, on the CPU, of `module`'s own buffers that transformers makes at init (a causal mask, position
    ids, a rotary table), made by its model's `_init_weights` on a shell of it (children and parameters not built):
    those init sets whatever the buffer held before."""
    made = [_initialised_shell(model, module, fill) for fill in (0, 1)]
    if made[0] is None or made[1] is None:
        return {}
    return {n: t for n, t in made[0].items() if torch.equal(t, made[1][n])}


def _initialised_shell(model: nn.Module, module: nn.Module, fill: int) -> dict[str, torch.Tensor] | None:
    shell = copy.copy(module)
    shell._modules, shell._parameters = {}, {}  # type: ignore[assignment]
    shell._buffers = {n: torch.full(b.shape, fill, dtype=b.dtype) for n, b in module._buffers.items()
                      if b is not None}  # type: ignore[assignment]
    try:
        with torch.no_grad():
            model._init_weights(shell)  # type: ignore[operator]
    except Exception:  # init that needs what the shell lacks: nothing made
        return None
    return dict(shell._buffers)  # type: ignore[arg-type]


def own_buffers_made(model: nn.Module, base: nn.Module, device: torch.device) -> None:
    """`base`'s own buffers on the meta device (position ids) made as at init, on `device`."""
    if any(b is not None and b.is_meta for b in base._buffers.values()):
        for name, value in made_at_init(model, base).items():
            base._buffers[name] = value.to(device)


def rebuilt_on(model: nn.Module, base: nn.Module, skip: set[str], device: torch.device) -> None:
    """Replaces each child of `base` outside `skip` that keeps buffers (rotary tables) by one built anew on `device`
    from the config, or else by a copy whose buffers are made as at init (made_at_init): on the meta device they hold
    no values."""
    for child, module in list(base.named_children()):
        if child in skip or not any(True for _ in module.buffers()):
            continue
        try:
            with torch.device("cpu"):
                rebuilt = type(module)(base.config)
        except Exception as e:
            rebuilt = copy.deepcopy(module)
            for sub in rebuilt.modules():
                own_buffers_made(model, sub, torch.device("cpu"))
            if any(b.is_meta for b in rebuilt.buffers()):
                raise ConfigError(f"megatrain's generic path cannot rebuild {type(module).__name__} from the config "
                                  f"({e}); it cannot train this model.") from None
        setattr(base, child, rebuilt.to(device))


def call_order(model: nn.Module, base_path: str, stack: str, embed_child: str, others: list[str]
               ) -> tuple[list[str], list[str], bool]:
    """(the base's children among `others` its forward calls before the first layer, those it calls after the last,
    whether the forward ran through: False where a stand-in's output did not fit what follows it before any layer),
    from one run of a copy of the base on the CPU with every layer and each of `others` a recording stand-in."""
    base = copy.deepcopy(submodule(model, base_path))  # a meta model: copying it copies no data
    rebuilt_on(model, base, {stack, embed_child, *others}, torch.device("cpu"))
    own_buffers_made(model, base, torch.device("cpu"))
    hidden = getattr(base.config, "hidden_size", None) or model.get_input_embeddings().weight.shape[-1]
    x = torch.zeros(1, 2, hidden)
    layers = list(getattr(base, stack))
    for arity in LAYER_OUTPUT_ARITIES:
        order: list[str] = []
        setattr(base, stack, nn.ModuleList(posing_as(_Recorder("layer", order, arity), layer) for layer in layers))
        for child in others:
            setattr(base, child, _Recorder(child, order, hidden=hidden))
        try:
            with torch.no_grad():
                base(inputs_embeds=x, use_cache=False)
            break
        except Exception as e:
            if order and "layer" not in order:  # a stand-in's output did not fit what follows it, before any layer
                return order, [], False
            if arity != LAYER_OUTPUT_ARITIES[-1]:
                continue
            what = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"megatrain's generic path cannot run {type(model).__name__}'s forward around its "
                              f"layers ({what}); it cannot train this model.") from None
    if "layer" not in order:
        raise ConfigError(f"{type(model).__name__}'s forward called none of its layers; megatrain's generic path "
                          "cannot train this model.")
    first, last = order.index("layer"), len(order) - 1 - order[::-1].index("layer")
    return order[:first], order[last + 1:], True


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

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self  # what the ForCausalLM reaches the base through (OPT's self.model.decoder) is the stand-in too
