"""The generic path: any decoder-only transformers model, its layers run from transformers' own code, statelessly.

Nothing of the model is ever materialised by transformers. The model is built once on the meta device, for its
parameter names and shapes (the layout) and for its layer modules, which are pure code there: a layer is called
through torch.func.functional_call with the streamed buffer's views bound as its parameters, so the executor's
weight buffers, recompute and gradient streaming work as for the native families. Layers whose class, parameter
names and shapes and layer type agree share one module (one structure); MoE and dense layers, linear- and
full-attention layers are different structures.

What a model's own forward computes around its layers (rotary tables, per-layer-type masks, position ids) is made
by that forward: a skeleton of the base model whose layers are stand-ins that record what they are called with
runs once per batch shape, on the real device, with only its parameter-free parts (rotary embeddings) real.
The embedding, the final norm and the head stay megatrain's (gathered embedding rows, chunked loss); the final
norm is the model's own module, called the same way, and its logit soft-capping and embedding scale are followed.

MoE models with `output_router_logits` add the router's auxiliary loss as transformers does: the forward keeps
each MoE layer's router logits, the model's own `load_balancing_loss_func` runs over all of them once the forward
is done, and each layer's share of that gradient is injected into its router logits when the layer is recomputed.
Dropout, where a config enables it, is replayed exactly: each layer's recompute runs from the RNG state its
forward began with.

transformers is needed by this path only (pip install -e '.[hf]').
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.hf_config import causal_lm_types, check_generic, hf_config_object, transformers_module
from megatrain.model.registry import register_fallback
from megatrain.model.templates import Weights

LAYERS_PREFIX = "model.layers."
# what transformers' Trainer leaves out of weight decay, by name: biases and norms
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.", "lm_head.weight"


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


def _base(model: nn.Module) -> nn.Module:
    base = getattr(model, "model", None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ConfigError(f"{type(model).__name__} keeps no decoder layers at model.layers; megatrain's generic path "
                          "needs the usual decoder layout (model.embed_tokens, model.layers, model.norm, lm_head).")
    return base


def check_layout(model: nn.Module, tied: bool) -> None:
    """The model's parameters are the embedding, the layers, the final norm and (untied) lm_head, as megatrain
    streams them; anything else is refused by name."""
    names = [n for n, _ in model.named_parameters()]
    others = [n for n in names if not (n.startswith(LAYERS_PREFIX) or n.startswith(NORM) or n in (EMBED, LM_HEAD))]
    if EMBED not in names or not any(n.startswith(NORM) for n in names):
        others += [n for n in (EMBED, NORM + "weight") if n not in names]
    if (LM_HEAD in names) == tied:
        others.append(LM_HEAD + (" (tied)" if tied else " (missing)"))
    if others:
        raise ConfigError(f"{type(model).__name__} has parameters outside megatrain's decoder layout "
                          f"({', '.join(others[:4])}); its generic path cannot train this model.")
    for i, layer in enumerate(_base(model).layers):
        made_at_init = sorted(set(dict(layer.named_buffers())) - set(layer_buffers(layer)))
        if made_at_init:
            raise ConfigError(f"{type(model).__name__}'s layer {i} keeps buffers that its checkpoint does not hold "
                              f"({', '.join(made_at_init[:3])}); megatrain's generic path runs layers statelessly "
                              "from streamed tensors and cannot train this model.")


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


def layer_structure(model: nn.Module, index: int) -> tuple[Any, ...]:
    """What makes two layers interchangeable: class, parameter and buffer names and shapes, layer type, and every
    plain attribute of every module inside (a no-rope flag, a per-layer constant such as DiffLlama's lambda_init)."""
    layer = _base(model).layers[index]
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
        tied = EMBED in dict(model.named_parameters()) and LM_HEAD not in dict(model.named_parameters())
        check_layout(model, tied)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
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
            pad_token_id=getattr(_base(model).embed_tokens, "padding_idx", None),
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
        layer = _base(meta_model(c.hf_config)).layers[index]
        buffers = dict(layer.named_buffers())
        return [(name, tuple(p.shape), not NO_DECAY.search(name)) for name, p in layer.named_parameters()] + [
            (name, tuple(buffers[name].shape), False) for name in layer_buffers(layer)]  # frozen: never a gradient

    def num_params(self, c: ModelConfig) -> int:
        assert c.hf_config is not None
        model = meta_model(c.hf_config)
        frozen = sum(dict(layer.named_buffers())[name].numel() for layer in _base(model).layers
                     for name in layer_buffers(layer))
        return sum(p.numel() for p in model.parameters()) + frozen  # what the arena holds

    def architecture(self, c: ModelConfig) -> GenericArchitecture:
        return GenericArchitecture(c)


GENERIC = register_fallback(GenericFamily())


class _InjectGrad(torch.autograd.Function):
    """Identity on `y` whose backward also hands `grad` to `source`: a loss term computed outside the layer (the
    router's auxiliary loss) reaches the layer's weights through the layer's recompute."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, source: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad_y, grad, None


class _Recorded(Exception):
    """Raised by a stand-in layer to end the skeleton's forward once every layer has been called."""


class LayerCall:
    """What one layer gets in one batch: the keyword arguments the model's forward gives it, and the batch."""

    def __init__(self, index: int, kwargs: dict[str, Any], batch: GenericBatch):
        self.index, self.kwargs, self.batch = index, kwargs, batch


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


class RouterAux:
    """The auxiliary load-balancing loss of an MoE model, as its ForCausalLM adds it to the loss."""

    def __init__(self, model: nn.Module):
        recorder = getattr(type(model), "_can_record_outputs", {}).get("router_logits")
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
        if recorder is None or loss_fn is None or not all(hasattr(model, a) for a in needed):
            raise ConfigError(f"{type(model).__name__} enables output_router_logits but megatrain cannot find how it "
                              "computes the router's auxiliary loss; set output_router_logits to false.")
        self.router_class, self.index = recorder.target_class, recorder.index
        self.loss_fn = loss_fn
        self.num_experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.coef = float(model.router_aux_loss_coef)


class GenericLayer:
    """One structure's layer function: fn(x, weights, call) -> x through the meta module's own forward."""

    def __init__(self, module: nn.Module, arch: GenericArchitecture):
        self.module, self.arch = module, arch
        self.frozen = tuple(layer_buffers(module))  # constants from the checkpoint: no gradient, so never updated
        aux = arch.aux
        self.routers = [] if aux is None else [m for m in module.modules() if isinstance(m, aux.router_class)]
        self.dropout = arch.dropout or any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())

    def __call__(self, x: torch.Tensor, w: Weights, call: LayerCall) -> torch.Tensor:
        recorded: list[torch.Tensor] = []
        if self.frozen:
            w = {**w, **{name: w[name].detach() for name in self.frozen}}
        with self._rng(call, x.device), self._routers(recorded):
            out = torch.func.functional_call(self.module, w, (x,), call.kwargs, strict=True)
        y = out[0] if isinstance(out, tuple) else out
        if not recorded:
            return y
        if not torch.is_grad_enabled():  # the forward: keep the logits for the loss over all layers
            call.batch.router_logits[call.index] = recorded[0].detach()
            return y
        grad = call.batch.router_grads.get(call.index)
        return y if grad is None else _InjectGrad.apply(y, recorded[0], grad)

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
        """The recompute's dropout masks are the forward's: it runs from the RNG state the forward began with."""
        if not self.dropout:
            yield
            return
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

    def __init__(self, index: int, calls: list[dict[str, Any]], last: int):
        super().__init__()
        self.index, self.calls, self.last = index, calls, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise ConfigError("this model passes its layers positional arguments besides the hidden states, which "
                              "megatrain's generic path does not follow.")
        if self.index and hidden_states is not self.calls[-1]["__output__"]:
            raise ConfigError("this model changes the hidden states between its layers, which megatrain's generic "
                              "path does not follow.")
        self.calls.append({"__input__": hidden_states, "__output__": hidden_states, **kwargs})
        if self.index == self.last:
            raise _Recorded
        return hidden_states


class GenericArchitecture:
    def __init__(self, config: ModelConfig):
        assert config.hf_config is not None
        self.model_config = config
        self.model = build_meta_model(config.hf_config)  # this executor's own: never shipped through Ray
        self.config = self.model.config
        base = _base(self.model)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.aux = RouterAux(self.model) if getattr(text, "output_router_logits", False) else None
        self.dropout = any(k.endswith("dropout") and isinstance(v, (int, float)) and v > 0
                           for k, v in text.to_dict().items())
        structures: dict[tuple[Any, ...], GenericLayer] = {}
        self.layers: list[GenericLayer] = []
        for i, module in enumerate(base.layers):
            key = layer_structure(self.model, i)
            if key not in structures:
                structures[key] = GenericLayer(module, self)
            self.layers.append(structures[key])
        self.norm = base.norm
        softcap = getattr(text, "final_logit_softcapping", None)
        self.logit_softcap = float(softcap) if softcap else None
        self._calls: dict[tuple[int, int, torch.device, torch.dtype], list[dict[str, Any]]] = {}
        self._skeleton: dict[torch.device, nn.Module] = {}
        self.embed_scale = self._embed_scale(base)

    def _embed_scale(self, base: nn.Module) -> float | None:
        """The embedding module's scale (Gemma's scaled embeddings) times what the forward multiplies it by."""
        scale = float(getattr(base.embed_tokens, "scalar_embed_scale", 1.0))
        calls = self._run_skeleton(1, 2, torch.device("cpu"), torch.float32, fill=1.0)
        seen = calls[0]["__input__"]
        ratio = float(seen.flatten()[0])
        if not torch.equal(seen, torch.full_like(seen, ratio)):
            raise ConfigError(f"{type(self.model).__name__} transforms its embeddings before the first layer in a way "
                              "megatrain's generic path does not follow.")
        scale *= ratio
        return None if scale == 1.0 else scale

    def _skeleton_for(self, device: torch.device) -> nn.Module:
        """The base model with stand-ins for its layers and the final norm, its parameter-free parts real."""
        if device not in self._skeleton:
            base = _base(build_meta_model(self.model_config.hf_config))  # type: ignore[arg-type]
            base.norm = nn.Identity()
            for name, module in list(base.named_children()):
                if name in ("layers", "embed_tokens", "norm") or not any(True for _ in module.buffers()):
                    continue
                try:
                    with torch.device("cpu"):
                        rebuilt = type(module)(base.config)
                except Exception as e:
                    raise ConfigError(f"megatrain's generic path cannot rebuild {type(module).__name__} from the "
                                      f"config ({e}); it cannot train this model.") from None
                setattr(base, name, rebuilt.to(device))
            self._skeleton[device] = base
        return self._skeleton[device]

    def _run_skeleton(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
                      fill: float = 0.0, position_ids: torch.Tensor | None = None) -> list[dict[str, Any]]:
        base = self._skeleton_for(device)
        calls: list[dict[str, Any]] = []
        n = len(base.layers)
        base.layers = nn.ModuleList(_StandIn(i, calls, n - 1) for i in range(n))
        x = torch.full((batch_size, seq, self.model_config.hidden_size), fill, device=device, dtype=dtype)
        with contextlib.suppress(_Recorded), torch.no_grad():
            base(inputs_embeds=x, position_ids=position_ids, use_cache=False)
        if len(calls) != n:
            raise ConfigError(f"{type(self.model).__name__}'s forward called {len(calls)} of its {n} layers; "
                              "megatrain's generic path cannot train this model.")
        return calls

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> GenericBatch:
        """The model's own forward makes the layers' arguments: from position_ids too, packed documents and all."""
        if position_ids is not None:
            calls = self._run_skeleton(batch_size, seq, device, dtype, position_ids=position_ids.to(device))
            return GenericBatch(self, [{k: v for k, v in c.items() if not k.startswith("__")} for c in calls])
        key = (batch_size, seq, device, dtype)
        if key not in self._calls:
            calls = self._run_skeleton(batch_size, seq, device, dtype)
            self._calls[key] = [{k: v for k, v in c.items() if not k.startswith("__")} for c in calls]
        return GenericBatch(self, self._calls[key])

    def tile(self, tile_tokens: int) -> None:
        raise ConfigError("sequence tiling (tile_tokens) is for megatrain's native families; the generic path runs "
                          "transformers' layers whole: leave tile_tokens unset for this model.")

    def layer(self, index: int) -> GenericLayer:
        return self.layers[index]

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        params = {name[len("norm."):]: w for name, w in weights.items()}
        return torch.func.functional_call(self.norm, params, (x,), strict=True)
