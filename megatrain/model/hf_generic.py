"""The generic path: any decoder-only transformers model, its layers run from transformers' own code, statelessly.

Nothing of the model is ever materialised by transformers. The model is built once on the meta device, for its
parameter names and shapes (the layout) and for its layer modules, which are pure code there: a layer is called
through torch.func.functional_call with the streamed buffer's views bound as its parameters (and its persistent
buffers, a router's correction bias, as frozen tensors), so the executor's weight buffers, recompute and gradient
streaming work as for the native families. Layers whose class, tensors, layer type and plain attributes agree share
one module (one structure); MoE and dense layers, linear- and full-attention layers are different structures.

The stack, the embedding, the final norm and the head are found by structure (hf_parts.py), whatever their names
(`model.layers`, `transformer.h`, `gpt_neox.layers`). What a model's own forward computes around its layers
(rotary tables, per-layer-type masks, position ids) is made by that forward: a skeleton of the base model whose
layers are stand-ins that record what they are called with runs once per batch shape, on the real device, with only
its parameter-free parts (rotary embeddings) real. The embedding rows stay megatrain's (gathered on the host, times
the scale the forward applies); the final norm is the model's own module, bias and all; the logits are the model's
own ForCausalLM forward after its base model (lm_head with a bias, logit scales, soft-caps), in token chunks.

MoE models with `output_router_logits` add the router's auxiliary loss as transformers does (hf_router.py).
Randomness in a layer (dropout, a router's jitter noise) is replayed exactly: each layer's recompute runs from the
RNG state its forward began with.

transformers is needed by this path only (pip install -e '.[hf]').
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.hf_config import causal_lm_types, check_generic, hf_config_object, transformers_module
from megatrain.model.hf_parts import (
    LAYER_OUTPUT_ARITIES,
    BaseOutput,
    ModelParts,
    find_parts,
    layer_output,
    path_of_output,
    rebuilt_on,
    submodule,
)
from megatrain.model.hf_router import InjectGrad, RouterAux
from megatrain.model.registry import register_fallback
from megatrain.model.templates import Weights

Tensor4 = tuple[str, str, tuple[int, ...], bool]  # (name in its unit, the model's own name, shape, weight-decayed)

# what transformers' Trainer leaves out of weight decay, by name: biases and norms
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


@functools.lru_cache(maxsize=4)
def _meta_model_cached(key: str) -> nn.Module:
    return build_meta_model(json.loads(key))


def meta_model(hf: dict[str, Any]) -> nn.Module:
    """The ForCausalLM model of `hf` on the meta device (cached: read-only users only)."""
    return _meta_model_cached(json.dumps(hf, sort_keys=True))


def build_meta_model(hf: dict[str, Any]) -> nn.Module:
    transformers = transformers_module()
    config = hf_config_object(hf)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
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
    """Every layer's state streams: parameters, and buffers only where the checkpoint holds them; no weight is
    shared between layers (each layer's weights stream, and are updated, as its own)."""
    owner: dict[int, int] = {}
    for i, layer in enumerate(stack_of(model, parts)):
        for name, p in layer.named_parameters():
            if owner.setdefault(id(p), i) != i:
                raise ConfigError(f"{type(model).__name__} shares weights between its layers {owner[id(p)]} and {i} "
                                  f"({name}); megatrain's generic path streams each layer's own weights and cannot "
                                  "train this model.")
        made_at_init = sorted(set(dict(layer.named_buffers())) - set(layer_buffers(layer)))
        if made_at_init:
            raise ConfigError(f"{type(model).__name__}'s layer {i} keeps buffers that its checkpoint does not hold "
                              f"({', '.join(made_at_init[:3])}); megatrain's generic path runs layers statelessly "
                              "from streamed tensors and cannot train this model.")


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


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def layer_structure(model: nn.Module, parts: ModelParts, index: int) -> tuple[Any, ...]:
    """What makes two layers interchangeable: class, parameter and buffer names and shapes, layer type, and every
    plain attribute of every module inside (a no-rope flag, a per-layer constant such as DiffLlama's lambda_init)."""
    layer = stack_of(model, parts)[index]
    types = getattr(model.config, "layer_types", None)
    kind = types[index] if isinstance(types, (list, tuple)) and index < len(types) else None
    attributes = tuple((name, type(m).__name__, tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                                             if not k.startswith("_") and k != "training"
                                                             and k not in INDEX_ATTRIBUTES and _plain(v))))
                       for name, m in layer.named_modules())
    tensors = tuple((n, tuple(t.shape)) for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    return (type(layer).__name__, kind, tensors, attributes)


class GenericFamily:
    """Every decoder-only causal LM transformers implements that has no native family, run through its own code."""

    qk_norm = False
    uniform_layers = False
    tiles = False  # transformers' layers run whole

    @property
    def model_types(self) -> tuple[str, ...]:
        return ()  # any: registry.family_of asks `supports`

    def supports(self, model_type: str) -> bool:
        try:
            return model_type in causal_lm_types()
        except ImportError:
            return False

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        check_generic(hf)
        config = hf_config_object(hf)
        model = meta_model(hf)
        parts = model_parts(hf)
        check_layers(model, parts)
        tied = parts.head is None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text = _Readable(text)  # a per-layer attribute read globally raises in some configs (Gemma 4): None here
        heads = getattr(text, "num_attention_heads", None) or 1
        hidden = text.hidden_size
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden % heads == 0 else None)
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        active = getattr(text, "num_experts_per_tok", None) or 1  # an MoE layer's experts each token passes
        moe_ffn = (getattr(text, "moe_intermediate_size", None) or 0) * active
        ffn = max(getattr(text, "intermediate_size", None) or 0, moe_ffn)
        if isinstance(head_dim, int) and head_dim % 2:
            head_dim = None  # ModelConfig's check is for its own rotary: the generic path's rotary is the model's
        eps = getattr(text, "rms_norm_eps", None)
        return dict(
            vocab_size=text.vocab_size, hidden_size=hidden, num_layers=text.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, intermediate_size=ffn or 4 * hidden,
            head_dim=head_dim or 2, max_position_embeddings=getattr(text, "max_position_embeddings", None) or 4096,
            initializer_range=getattr(text, "initializer_range", 0.02) or 0.02, tie_embeddings=tied,
            rms_norm_eps=eps if isinstance(eps, (int, float)) and eps > 0 else 1e-6,
            bos_token_id=getattr(text, "bos_token_id", None), eos_token_id=eos, model_type=model_type,
            pad_token_id=getattr(model.get_input_embeddings(), "padding_idx", None),
            hf_config=dict(hf),
        )

    def validate(self, c: ModelConfig) -> None:
        if c.hf_config is None:
            raise ConfigError(f"model config: model_type {c.model_type!r} runs on the generic path, which needs the "
                              "model's config.json (ModelConfig.from_hf).")

    def to_hf(self, c: ModelConfig) -> dict[str, Any]:
        assert c.hf_config is not None
        return dict(c.hf_config)

    def layer_tensors(self, c: ModelConfig, index: int) -> list[tuple[str, tuple[int, ...], bool]]:
        assert c.hf_config is not None
        layer = stack_of(meta_model(c.hf_config), model_parts(c.hf_config))[index]
        buffers = dict(layer.named_buffers())
        return [(name, tuple(p.shape), decayed(layer, name)) for name, p in layer.named_parameters()] + [
            (name, tuple(buffers[name].shape), False) for name in layer_buffers(layer)]  # frozen: never a gradient

    def num_params(self, c: ModelConfig) -> int:
        assert c.hf_config is not None
        model = meta_model(c.hf_config)
        frozen = sum(dict(layer.named_buffers())[name].numel() for layer in stack_of(model, model_parts(c.hf_config))
                     for name in layer_buffers(layer))
        return sum(p.numel() for p in model.parameters()) + frozen  # what the arena holds

    def unit_tensors(self, c: ModelConfig) -> tuple[list[Tensor4], str, list[Tensor4]]:
        """The embedding unit's and the head unit's tensors (name in the unit, the model's own name, shape, decayed)
        and the layers' prefix, as this model names them: ModelLayout builds its units from these."""
        assert c.hf_config is not None
        model, parts = meta_model(c.hf_config), model_parts(c.hf_config)
        shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
        embed = [("embed_tokens.weight", parts.embed, shapes[parts.embed], True)]
        head: list[Tensor4] = []
        if parts.final is not None:
            final = parts.in_base(parts.final)
            head += [(f"norm.{n}", f"{final}.{n}", tuple(t.shape), False)
                     for n, t in submodule(model, final).named_parameters()]
        if parts.head is not None:
            head += [(f"lm_head.{n}", f"{parts.head}.{n}", shapes[f"{parts.head}.{n}"], n == "weight")
                     for n in parts.head_params]
        return embed, parts.stack_prefix, head

    def architecture(self, c: ModelConfig) -> GenericArchitecture:
        return GenericArchitecture(c)


GENERIC = register_fallback(GenericFamily())


class _Recorded(Exception):
    """Raised by a stand-in layer to end the skeleton's forward once every layer has been called."""


class LayerCall:
    """What one layer gets in one batch: the keyword arguments the model's forward gives it, and the batch."""

    def __init__(self, index: int, kwargs: dict[str, Any], batch: GenericBatch):
        self.index, self.batch = index, batch
        self.kwargs = {k: v for k, v in kwargs.items() if k != "__args__"}
        self.args: tuple[Any, ...] = kwargs.get("__args__", ())  # positional ones after the hidden states


class GenericBatch:
    def __init__(self, arch: GenericArchitecture, calls: list[dict[str, Any]]):
        self.arch = arch
        self.calls = [LayerCall(i, kwargs, self) for i, kwargs in enumerate(calls)]
        self.router_logits: dict[int, torch.Tensor] = {}  # forward: each MoE layer's router logits
        self.router_grads: dict[int, torch.Tensor] = {}  # d(aux loss)/d(router logits), for the recompute
        self.rng: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # RNG state each layer's forward began with

    def layer_args(self, index: int) -> tuple[Any, ...]:
        return (self.calls[index],)

    @property
    def adds_loss(self) -> bool:
        """forward_done adds the router's auxiliary loss, a function of the whole batch's router outputs."""
        return self.arch.aux is not None

    def forward_done(self) -> torch.Tensor | None:
        aux = self.arch.aux
        if aux is None or not self.router_logits:
            return None
        order = sorted(self.router_logits)
        leaves = [self.router_logits[i].detach().requires_grad_(True) for i in order]
        with torch.enable_grad():
            loss = aux.coef * aux.loss_fn(tuple(leaves), aux.num_experts, aux.top_k, None)
        grads = torch.autograd.grad(loss, leaves)
        self.router_grads = dict(zip(order, grads, strict=True))
        self.router_logits.clear()
        return loss.detach().float()


class GenericLayer:
    """One structure's layer function: fn(x, weights, call) -> x through the meta module's own forward."""

    def __init__(self, module: nn.Module, arch: GenericArchitecture):
        self.module, self.arch = module, arch
        self.frozen = tuple(layer_buffers(module))  # constants from the checkpoint: no gradient, so never updated
        aux = arch.aux
        self.routers = [] if aux is None else [m for m in module.modules() if isinstance(m, aux.router_class)]

    def __call__(self, x: torch.Tensor, w: Weights, call: LayerCall) -> torch.Tensor:
        recorded: list[torch.Tensor] = []
        if self.frozen:
            w = {**w, **{name: w[name].detach() for name in self.frozen}}
        with self._rng(call, x.device), self._routers(recorded):
            out = torch.func.functional_call(self.module, w, (x, *call.args), call.kwargs, strict=True)
        y = out[0] if isinstance(out, tuple) else out
        if not recorded:
            return y
        if not torch.is_grad_enabled():  # the forward: keep the logits for the loss over all layers
            call.batch.router_logits[call.index] = recorded[0].detach()
            return y
        grad = call.batch.router_grads.get(call.index)
        return y if grad is None else InjectGrad.apply(y, recorded[0], grad)

    @contextlib.contextmanager
    def _routers(self, recorded: list[torch.Tensor]) -> Iterator[None]:
        index = self.arch.aux.index if self.arch.aux is not None else 0

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            recorded.append(output[index] if isinstance(output, (tuple, list)) else output)

        handles = [r.register_forward_hook(hook) for r in self.routers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def _rng(self, call: LayerCall, device: torch.device) -> Iterator[None]:
        """The recompute draws the forward's random numbers (dropout masks, a router's jitter noise): it runs from the
        RNG state the forward began with."""
        cuda = device.type == "cuda"
        if not torch.is_grad_enabled():
            call.batch.rng[call.index] = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)
            yield
            return
        cpu_state, cuda_state = call.batch.rng[call.index]
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            yield


class _StandIn(nn.Module):
    """Takes a decoder layer's place in the skeleton: records its arguments, returns its input."""

    def __init__(self, index: int, calls: list[dict[str, Any]], last: int, arity: int):
        super().__init__()
        self.index, self.calls, self.last, self.arity = index, calls, last, arity

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.index and hidden_states is not self.calls[-1]["__output__"]:
            raise ConfigError("this model changes the hidden states between its layers, which megatrain's generic "
                              "path does not follow.")
        self.calls.append({"__input__": hidden_states, "__output__": hidden_states, "__args__": args, **kwargs})
        if self.index == self.last:
            raise _Recorded
        return layer_output(hidden_states, self.arity)  # as the model's layers return it


class GenericArchitecture:
    def __init__(self, config: ModelConfig):
        assert config.hf_config is not None
        self.model_config = config
        self.model = build_meta_model(config.hf_config)  # this executor's own: never shipped through Ray
        self.config = self.model.config
        self.parts = parts = model_parts(config.hf_config)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.aux = RouterAux(self.model) if getattr(text, "output_router_logits", False) else None
        structures: dict[tuple[Any, ...], GenericLayer] = {}
        self.layers: list[GenericLayer] = []
        for i, module in enumerate(stack_of(self.model, parts)):
            key = layer_structure(self.model, parts, i)
            if key not in structures:
                structures[key] = GenericLayer(module, self)
            self.layers.append(structures[key])
        self.norm = None if parts.final is None else submodule(self.model, parts.in_base(parts.final))
        self.logit_softcap = None  # the model's own logits (self.logits) cap them where it does
        self._calls: dict[tuple[int, int, torch.device, torch.dtype], list[dict[str, Any]]] = {}
        self._skeleton: dict[torch.device, nn.Module] = {}
        self._head_skeleton: nn.Module | None = None
        self._arity: int | None = None  # how the model's forward reads its layers' outputs (hf_parts.layer_output)
        self._head_path = parts.head or path_of_output(self.model)
        self.embed_scale = self._embed_scale()

    def _embed_scale(self) -> float | None:
        """The embedding module's scale (Gemma's scaled embeddings) times what the forward multiplies it by."""
        scale = float(getattr(self.model.get_input_embeddings(), "scalar_embed_scale", 1.0))
        calls = self._run_skeleton(1, 2, torch.device("cpu"), torch.float32, fill=1.0)
        seen = calls[0]["__input__"]
        if tuple(seen.shape) != (1, 2, self.model_config.hidden_size):
            raise ConfigError(f"{type(self.model).__name__} gives its first layer hidden states of shape "
                              f"{tuple(seen.shape)}, not its embeddings' (hyper-connections, say), which megatrain's "
                              "generic path does not follow.")
        ratio = float(seen.flatten()[0])
        if not torch.equal(seen, torch.full_like(seen, ratio)):
            raise ConfigError(f"{type(self.model).__name__} transforms its embeddings before the first layer in a way "
                              "megatrain's generic path does not follow.")
        scale *= ratio
        return None if scale == 1.0 else scale

    def _skeleton_for(self, device: torch.device) -> nn.Module:
        """The base model with stand-ins for its layers and the final norm, its parameter-free parts real."""
        if device not in self._skeleton:
            parts = self.parts
            base = submodule(build_meta_model(self.model_config.hf_config), parts.base)  # type: ignore[arg-type]
            if parts.final is not None:
                setattr(base, parts.final, nn.Identity())
            embed_child = parts.embed[len(parts.base) + 1:].split(".")[0] if parts.base else parts.embed.split(".")[0]
            rebuilt_on(base, {parts.stack, embed_child, *([parts.final] if parts.final else [])}, device)
            self._skeleton[device] = base
        return self._skeleton[device]

    def _run_skeleton(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
                      fill: float = 0.0, position_ids: torch.Tensor | None = None) -> list[dict[str, Any]]:
        base = self._skeleton_for(device)
        x = torch.full((batch_size, seq, self.model_config.hidden_size), fill, device=device, dtype=dtype)
        n = len(getattr(base, self.parts.stack))
        # the way the model's forward reads its layers' outputs, tried in turn until known
        arities = [self._arity] if self._arity is not None else list(LAYER_OUTPUT_ARITIES)
        for arity in arities:
            calls: list[dict[str, Any]] = []
            setattr(base, self.parts.stack, nn.ModuleList(_StandIn(i, calls, n - 1, arity) for i in range(n)))
            try:
                with contextlib.suppress(_Recorded), torch.no_grad():
                    base(inputs_embeds=x, position_ids=position_ids, use_cache=False)
            except Exception:
                if arity == arities[-1]:
                    raise
                continue
            self._arity = arity
            break
        if len(calls) != n:
            raise ConfigError(f"{type(self.model).__name__}'s forward called {len(calls)} of its {n} layers; "
                              "megatrain's generic path cannot train this model.")
        return calls

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> GenericBatch:
        """The model's own forward makes the layers' arguments: from position_ids too, packed documents and all."""
        if position_ids is not None:
            calls = self._run_skeleton(batch_size, seq, device, dtype, position_ids=position_ids.to(device))
            return GenericBatch(self, [_layer_kwargs(c) for c in calls])
        key = (batch_size, seq, device, dtype)
        if key not in self._calls:
            calls = self._run_skeleton(batch_size, seq, device, dtype)
            self._calls[key] = [_layer_kwargs(c) for c in calls]
        return GenericBatch(self, self._calls[key])

    def tile(self, tile_tokens: int) -> None:
        raise ConfigError("sequence tiling (tile_tokens) is for megatrain's native families; the generic path runs "
                          "transformers' layers whole: leave tile_tokens unset for this model.")

    def layer(self, index: int) -> GenericLayer:
        return self.layers[index]

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        if self.norm is None:
            return x
        params = {name[len("norm."):]: w for name, w in weights.items()}
        return torch.func.functional_call(self.norm, params, (x,), strict=True)

    def logits(self, hidden: torch.Tensor, weights: Weights) -> torch.Tensor:
        """The model's own logits of normed hidden states [n, h]: its ForCausalLM forward after the base model (the
        lm_head with its bias, a logit scale, soft-capping), with the base a stand-in that returns `hidden`."""
        if self._head_skeleton is None:
            self._head_skeleton = build_meta_model(self.model_config.hf_config)  # type: ignore[arg-type]
        model, parts = self._head_skeleton, self.parts
        stand_in = BaseOutput(hidden.unsqueeze(0))
        # the ForCausalLM's own child that holds the base (a multimodal model's whole "model", towers and all)
        setattr(model, parts.base.split(".")[0], stand_in)
        params = {f"{self._head_path}.{name[len('lm_head.'):]}": w for name, w in weights.items()}
        # inputs_embeds, not input_ids: the stand-in ignores them, and a multimodal forward then looks up no embedding
        kwargs = {"inputs_embeds": stand_in.hidden, "use_cache": False}
        out = torch.func.functional_call(model, params, (), kwargs, strict=False)
        return out.logits[0]


def _layer_kwargs(call: dict[str, Any]) -> dict[str, Any]:
    """What a layer is called with, less the stand-in's own notes (its positional arguments stay, as __args__)."""
    return {k: v for k, v in call.items() if k == "__args__" or not k.startswith("__")}


class _Readable:
    """A config whose attributes read as None where transformers refuses to answer one globally."""

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._config, name)
        except AttributeError:
            raise
        except Exception:
            return None
