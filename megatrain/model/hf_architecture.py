"""What the executor runs of a model on the generic path: transformers' own modules, called statelessly.

A layer is its meta module called through torch.func.functional_call with the streamed buffer's views bound as its
parameters, so weight buffers, recompute and gradient streaming work as for the native families. What the model's
forward does around its layers comes from that forward, run as a skeleton (docs/design.md#the-generic-path)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.architecture import LayerFn
from megatrain.model.hf_model import (
    build_meta_model,
    layer_buffers,
    layer_constants,
    layer_structure,
    model_parts,
    stack_of,
)
from megatrain.model.hf_parts import (
    LAYER_OUTPUT_ARITIES,
    BaseOutput,
    layer_output,
    own_buffers_made,
    posing_as,
    rebuilt_on,
    submodule,
)
from megatrain.model.hf_router import InjectGrad, RouterAux
from megatrain.model.templates import Weights

PRE = "pre."  # the first layer's unit names what runs before it "pre.<child of the base>.<tensor>"
EXTRA = "extra."  # the head unit names the causal LM's other head parameters "extra.<the model's own name>"


class _Recorded(Exception):
    """Raised by a stand-in layer to end the skeleton's forward once every layer has been called."""


class _Reached(Exception):
    """Raised by the first layer's stand-in in the pre-layer skeleton: carries what the first layer would get."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class LayerCall:
    """What one layer gets in one batch: the keyword arguments the model's forward gives it, and the batch."""

    def __init__(self, index: int, kwargs: dict[str, Any], batch: GenericBatch):
        self.index, self.batch = index, batch
        self.kwargs = {k: v for k, v in kwargs.items() if k != "__args__"}
        self.args: tuple[Any, ...] = kwargs.get("__args__", ())  # positional ones after the hidden states


class GenericBatch:
    def __init__(self, arch: GenericArchitecture, calls: list[dict[str, Any]],
                 position_ids: torch.Tensor | None = None):
        self.arch, self.position_ids = arch, position_ids
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

    def __init__(self, module: nn.Module, arch: GenericArchitecture, index: int):
        self.module, self.arch = module, arch
        self.frozen = tuple(layer_buffers(module))  # constants from the checkpoint: no gradient, so never updated
        self.constants = layer_constants(arch.model, module, index)  # made at init (a causal mask), on the CPU
        self._constants_on: dict[torch.device, dict[str, torch.Tensor]] = {}
        aux = arch.aux
        self._router_output = aux.index if aux is not None else 0
        self._recorded: list[torch.Tensor] = []  # the routers' logits of the call running now (forward hooks)
        # hooks for the module's life, not per call: a compiled layer's graph guards on the hooks it was traced with
        for router in [] if aux is None else [m for m in module.modules() if isinstance(m, aux.router_class)]:
            router.register_forward_hook(self._record)

    def __call__(self, x: torch.Tensor, w: Weights, call: LayerCall) -> torch.Tensor:
        with replayed_rng(call, x.device):
            return self.run(x, w, call)

    def compiled(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> LayerFn:
        """This layer with its module's forward (`forward`) through `compile` (torch.compile), and what is around it
        eager: the RNG's replay (dynamo refuses torch.get_rng_state), the buffers' check, the router's gradient."""
        forward = compile(self.forward)

        def layer(x: torch.Tensor, w: Weights, call: LayerCall) -> torch.Tensor:
            with replayed_rng(call, x.device):
                return self.run(x, w, call, forward)
        return layer

    def run(self, x: torch.Tensor, w: Weights, call: LayerCall,
            forward: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """The layer, drawing from the RNG as it stands (the caller replays it); forward: self.forward or its
        compiled form."""
        if self.frozen:
            w = {**w, **{name: w[name].detach() for name in self.frozen}}
        constants = self._constants(x.device)
        versions = [t._version for t in constants.values()]
        self._recorded.clear()
        y = (forward or self.forward)(x, {**w, **constants}, call)
        recorded, self._recorded = self._recorded, []
        if versions != [t._version for t in constants.values()]:
            raise ConfigError(f"{type(self.module).__name__} writes its buffers in its forward (state kept across "
                              "calls), which megatrain's generic path cannot stream; it cannot train this model.")
        if not recorded:
            return y
        if not torch.is_grad_enabled():  # the forward: keep the logits for the loss over all layers
            call.batch.router_logits[call.index] = recorded[0].detach()
            return y
        grad = call.batch.router_grads.get(call.index)
        return y if grad is None else InjectGrad.apply(y, recorded[0], grad)

    def forward(self, x: torch.Tensor, params: Weights, call: LayerCall) -> torch.Tensor:
        """transformers' own layer module with `params` bound: its hidden states (its routers' logits recorded)."""
        out = torch.func.functional_call(self.module, params, (x, *call.args), call.kwargs, strict=True)
        return out[0] if isinstance(out, (tuple, list)) else out  # OpenAI GPT's blocks return a list

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self._recorded.append(output[self._router_output] if isinstance(output, (tuple, list)) else output)

    def _constants(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._constants_on:
            self._constants_on[device] = {n: t.to(device) for n, t in self.constants.items()}
        return self._constants_on[device]


class FirstLayer:
    """The first layer with what the model's forward runs on the embeddings before it: that forward, stopped where
    the first layer begins (GenericArchitecture.pre), then the layer. Its unit holds those modules' tensors too
    ("pre.*"), so they stream, get gradients and are updated like the layer's own."""

    compilable = False  # the stop is an exception, which a full graph does not hold

    def __init__(self, layer: GenericLayer, arch: GenericArchitecture):
        self.layer, self.arch = layer, arch

    @property
    def module(self) -> nn.Module:
        """The layer's module (whose submodules a LoRA run hooks adapters onto)."""
        return self.layer.module

    def __call__(self, x: torch.Tensor, w: Weights, call: LayerCall) -> torch.Tensor:
        with replayed_rng(call, x.device):  # the forward's draws in its order: the embedding dropout, then the layer's
            return self.layer.run(*self.before(x, w, call.batch), call)

    def before(self, x: torch.Tensor, w: Weights, batch: Any) -> tuple[torch.Tensor, Weights]:
        """(what the model's forward gives the first layer from embeddings x, the layer's own weights of w)."""
        pre = {name[len(PRE):]: t for name, t in w.items() if name.startswith(PRE)}
        own = {name: t for name, t in w.items() if not name.startswith(PRE)}
        return self.arch.pre(x, pre, batch), own


@contextlib.contextmanager
def replayed_rng(call: LayerCall, device: torch.device) -> Iterator[None]:
    """The recompute draws the forward's random numbers (dropout masks, a router's jitter noise): it runs from the
    RNG state the forward began with. The forward is a layer's first call in a batch (with grad where its graph is
    kept for the backward, megatrain/engine/kept_activations.py: then there is no recompute)."""
    cuda = device.type == "cuda"
    if call.index not in call.batch.rng:
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


class _Stop(nn.Module):
    """The first layer's place in the pre-layer skeleton: ends the forward with the hidden states it is given."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise _Reached(hidden_states)


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
        self.layers: list[GenericLayer | FirstLayer] = []
        for i, module in enumerate(stack_of(self.model, parts)):
            key = layer_structure(self.model, parts, i)
            if key not in structures:
                structures[key] = GenericLayer(module, self, i)
            self.layers.append(structures[key])
        self.norm = None if parts.final is None else submodule(self.model, parts.in_base(parts.final))
        self.logit_softcap = None  # the model's own logits (self.logits) cap them where it does
        self._calls: dict[tuple[int, int, torch.device, torch.dtype], list[dict[str, Any]]] = {}
        self._skeleton: dict[tuple[torch.device, bool], nn.Module] = {}
        self._head_skeleton: nn.Module | None = None
        self._arity: int | None = None  # how the model's forward reads its layers' outputs (hf_parts.layer_output)
        self._head_path = parts.head
        # the embeddings' width, where the forward projects them to the layers' (OPT-350m's project_in: 512 -> 1024)
        self.embed_width = self.model.get_input_embeddings().weight.shape[-1]
        self._embed_child = child = parts.embed_child
        # the embedding module itself runs with the first layer: a module after its lookup (Inkling's norm)
        self._lookup_in_pre = child in parts.pre and parts.embed_in_base == f"{child}.weight"
        self.embed_scale, through_forward = self._embed_scale()
        if through_forward:
            self.layers[0] = FirstLayer(self.layers[0], self)  # type: ignore[arg-type]

    def _embed_scale(self) -> tuple[float | None, bool]:
        """(the embedding module's scale (Gemma's scaled embeddings), times what the forward multiplies the embeddings
        by where that is all it does; whether the forward's own code must run on them with the first layer
        (FirstLayer): modules before the first layer, XGLM's sinusoidal positions)."""
        embedding = self.model.get_input_embeddings()
        if self._lookup_in_pre:  # its own forward, scale and all, runs in FirstLayer
            embedding = nn.Identity()
        scale = getattr(embedding, "scalar_embed_scale", None)  # Gemma's (its embed_scale is a buffer)
        if not isinstance(scale, (int, float)):
            scale = getattr(embedding, "embed_scale", None)  # BART's, BioGPT's scaled word embeddings
        scale = float(scale) if isinstance(scale, (int, float)) else 1.0
        calls = self._run_skeleton(1, 2, torch.device("cpu"), torch.float32, fill=1.0)
        seen = calls[0]["__input__"]
        if tuple(seen.shape) != (1, 2, self.model_config.hidden_size):
            raise ConfigError(f"{type(self.model).__name__} gives its first layer hidden states of shape "
                              f"{tuple(seen.shape)}, not its embeddings' (hyper-connections, say), which megatrain's "
                              "generic path does not follow.")
        ratio = float(seen.flatten()[0])
        through_forward = bool(self.parts.pre) or not torch.equal(seen, torch.full_like(seen, ratio))
        if not through_forward:
            scale *= ratio
        return (None if scale == 1.0 else scale), through_forward

    def _skeleton_for(self, device: torch.device, stop: bool = False) -> nn.Module:
        """The base model with stand-ins for its layers and the final norm, its parameter-free parts real and the
        modules before the first layer real (zeros; their streamed weights are bound by `pre`). stop: the first
        layer's stand-in ends the forward (the pre-layer skeleton)."""
        if (device, stop) not in self._skeleton:
            parts = self.parts
            base = submodule(build_meta_model(self.model_config.hf_config), parts.base)  # type: ignore[arg-type]
            if parts.final is not None and parts.final not in parts.pre:
                setattr(base, parts.final, nn.Identity())
            embed_child = parts.embed_child
            weighted = {child for child in parts.pre if any(True for _ in getattr(base, child).parameters())}
            kept = {parts.stack, embed_child, *weighted, *([parts.final] if parts.final else [])}
            rebuilt_on(self.model, base, kept, device)
            own_buffers_made(self.model, base, device)
            table = parts.embed_in_base
            for child in weighted:  # zeros, all but the embedding table (an embedding module with a norm: ModernBERT)
                for name, p in list(getattr(base, child).named_parameters()):
                    if f"{child}.{name}" != table:
                        owner, _, leaf = f"{child}.{name}".rpartition(".")
                        setattr(base.get_submodule(owner), leaf, nn.Parameter(torch.zeros(p.shape, device=device),
                                                                             requires_grad=False))
            if stop:
                setattr(base, parts.stack, nn.ModuleList([posing_as(_Stop(), stack_of(self.model, parts)[0])]))
            self._skeleton[device, stop] = base
        return self._skeleton[device, stop]

    def pre(self, x: torch.Tensor, weights: Weights, batch: GenericBatch) -> torch.Tensor:
        """What the model's forward gives its first layer from embeddings `x`: its own code (a position embedding
        from the batch's position ids, an embedding norm, dropout), with the streamed `weights` of those modules."""
        base = self._skeleton_for(x.device, stop=True)
        if self._lookup_in_pre:
            x = self._after_lookup(base, x, weights)
        # a copy: a forward that scales its embeddings in place (CTRL) must not write the activation checkpoint
        kwargs = {"inputs_embeds": x.clone(), "position_ids": batch.position_ids, "use_cache": False}
        try:
            torch.func.functional_call(base, weights, (), kwargs, strict=False)
        except _Reached as reached:
            return reached.hidden
        raise ConfigError(f"{type(self.model).__name__}'s forward did not reach its first layer; megatrain's generic "
                          "path cannot train this model.")

    def _after_lookup(self, base: nn.Module, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        """The embedding module's own forward on looked-up rows `x` (Inkling's norm after the lookup): called on
        positions 0..n-1 of a table that is `x` itself, its other weights the streamed ones."""
        embedding, prefix = getattr(base, self._embed_child), f"{self._embed_child}."
        b, t, h = x.shape
        own = {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}
        ids = torch.arange(b * t, device=x.device).view(b, t)
        return torch.func.functional_call(embedding, {**own, "weight": x.reshape(b * t, h)}, (ids,), strict=False)

    def _run_skeleton(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
                      fill: float = 0.0, position_ids: torch.Tensor | None = None, **forward: Any
                      ) -> list[dict[str, Any]]:
        """The layers' calls in the model's forward on [batch_size, seq] embeddings; forward: its other arguments (a
        cached step's attention mask and cache: hf_cached.py)."""
        base = self._skeleton_for(device)
        x = torch.full((batch_size, seq, self.embed_width), fill, device=device, dtype=dtype)
        layers = list(stack_of(self.model, self.parts))
        n = len(layers)
        # the way the model's forward reads its layers' outputs, tried in turn until known
        arities = [self._arity] if self._arity is not None else list(LAYER_OUTPUT_ARITIES)
        for arity in arities:
            calls: list[dict[str, Any]] = []
            setattr(base, self.parts.stack, nn.ModuleList(posing_as(_StandIn(i, calls, n - 1, arity), layer)
                                                          for i, layer in enumerate(layers)))
            try:  # an embedding dropout runs here too: on a forked RNG, so that the layers draw what transformers' do
                with contextlib.suppress(_Recorded), torch.no_grad(), _forked_rng(device):
                    base(**{"inputs_embeds": x, "position_ids": position_ids, "use_cache": False, **forward})
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
            position_ids = position_ids.to(device)
            calls = self._run_skeleton(batch_size, seq, device, dtype, position_ids=position_ids)
            return GenericBatch(self, [_layer_kwargs(c) for c in calls], position_ids)
        key = (batch_size, seq, device, dtype)
        if key not in self._calls:
            calls = self._run_skeleton(batch_size, seq, device, dtype)
            self._calls[key] = [_layer_kwargs(c) for c in calls]
        return GenericBatch(self, self._calls[key])

    def tile(self, tile_tokens: int) -> None:
        raise ConfigError("sequence tiling (tile_tokens) is for megatrain's native families; the generic path runs "
                          "transformers' layers whole: leave tile_tokens unset for this model.")

    def layer(self, index: int) -> GenericLayer | FirstLayer:
        return self.layers[index]

    def cached_batch(self, positions: torch.Tensor, key_positions: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> Any:
        """Generation's (architecture.py; hf_cached.py): positions [b, n] of the new tokens, key_positions [b, m] of
        every token so far (theirs last; -1: padding, which the forward reads from the attention mask it is given, as
        transformers' generate gives it); the forward sees the m - n tokens before as a cache would show them."""
        from megatrain.model.hf_cached import CachedBatch, SeenTokens, evaluating

        b, n = positions.shape
        seen = SeenTokens(key_positions.shape[1] - n)
        position_ids = positions.clamp_min(0).to(device)
        mask = (key_positions >= 0).long().to(device)
        with evaluating(self._skeleton_for(device)):
            calls = self._run_skeleton(b, n, device, dtype, position_ids=position_ids, attention_mask=mask, cache=seen,
                                       use_cache=True)
        batch = CachedBatch([], position_ids, seen)
        batch.calls = [LayerCall(i, _layer_kwargs(call), batch) for i, call in enumerate(calls)]  # type: ignore
        return batch

    def cached_layer(self, index: int) -> Callable[..., Any]:
        from megatrain.model.hf_cached import cached_layer

        layer = self.layers[index]
        if isinstance(layer, FirstLayer):
            return cached_layer(self, layer.layer, layer.before)
        return cached_layer(self, layer)

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
        params = {name[len(EXTRA):] if name.startswith(EXTRA) else f"{self._head_path}.{name[len('lm_head.'):]}": w
                  for name, w in weights.items()}
        # inputs_embeds, not input_ids: the stand-in ignores them, and a multimodal forward then looks up no embedding
        kwargs = {"inputs_embeds": stand_in.hidden, "use_cache": False}
        out = torch.func.functional_call(model, params, (), kwargs, strict=False)
        return out.logits[0]


def _forked_rng(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    cuda = device.type == "cuda"
    return torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type)


def _layer_kwargs(call: dict[str, Any]) -> dict[str, Any]:
    """What a layer is called with, less the stand-in's own notes (its positional arguments stay, as __args__)."""
    return {k: v for k, v in call.items() if k == "__args__" or not k.startswith("__")}
