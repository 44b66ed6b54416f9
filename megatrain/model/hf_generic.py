"""The generic path: any decoder-only transformers model, its layers run from transformers' own code, statelessly.

The model is built once on the meta device, for its layout and its layer modules; its parts are found by structure
(hf_parts.py) and the executor runs what hf_architecture.py makes of it. transformers is imported only when a method
builds the meta model (docs/design.md#the-generic-path)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.hf_config import causal_lm_class, check_generic, dense_config, hf_config_object
from megatrain.model.registry import register_fallback

if TYPE_CHECKING:
    from megatrain.model.hf_architecture import GenericArchitecture

Tensor4 = tuple[str, str, tuple[int, ...], bool]  # (name in its unit, the model's own name, shape, weight-decayed)


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
            return causal_lm_class(model_type) is not None
        except ImportError:
            return False

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        from megatrain.model.hf_model import check_layers, meta_model, model_parts, stack_of

        check_generic(hf)
        hf = dense_config(hf)  # stored quantized, trained and saved dense
        config = hf_config_object(hf)
        model = meta_model(hf)
        parts = model_parts(hf)
        check_layers(model, parts)
        tied = parts.tied
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
            vocab_size=text.vocab_size, hidden_size=hidden, num_layers=len(stack_of(model, parts)), num_heads=heads,
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
        from megatrain.model.hf_model import decayed, layer_buffers, meta_model, model_parts, stack_of

        assert c.hf_config is not None
        layer = stack_of(meta_model(c.hf_config), model_parts(c.hf_config))[index]
        buffers = dict(layer.named_buffers())
        return [(name, tuple(p.shape), decayed(layer, name)) for name, p in layer.named_parameters()] + [
            (name, tuple(buffers[name].shape), False) for name in layer_buffers(layer)]  # frozen: never a gradient

    def num_params(self, c: ModelConfig) -> int:
        from megatrain.model.hf_model import layer_buffers, meta_model, model_parts, stack_of

        assert c.hf_config is not None
        model = meta_model(c.hf_config)
        frozen = sum(dict(layer.named_buffers())[name].numel() for layer in stack_of(model, model_parts(c.hf_config))
                     for name in layer_buffers(layer))
        return sum(p.numel() for p in model.parameters()) + frozen  # what the arena holds

    def unit_tensors(self, c: ModelConfig) -> tuple[list[Tensor4], str, list[Tensor4], list[Tensor4]]:
        """The embedding unit's tensors, the layers' prefix, the tensors of what runs before the first layer (in its
        unit, "pre.*"), and the head unit's tensors (name in the unit, the model's own name, shape, decayed), as this
        model names them: ModelLayout builds its units from these."""
        from megatrain.model.hf_architecture import EXTRA, PRE
        from megatrain.model.hf_model import decayed, meta_model, model_parts
        from megatrain.model.hf_parts import submodule

        assert c.hf_config is not None
        model, parts = meta_model(c.hf_config), model_parts(c.hf_config)
        shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
        embed = [("embed_tokens.weight", parts.embed, shapes[parts.embed], True)]
        base = submodule(model, parts.base)
        pre = [(f"{PRE}{child}.{n}", f"{parts.in_base(child)}.{n}", tuple(t.shape), decayed(base, f"{child}.{n}"))
               for child in parts.pre for n, t in getattr(base, child).named_parameters()
               if f"{parts.in_base(child)}.{n}" != parts.embed]  # the table itself is the embedding unit's
        head: list[Tensor4] = []
        if parts.final is not None:
            final = parts.in_base(parts.final)
            # decayed as Trainer decays it: a norm not, OPT-350m's project_out (a projection after the last layer) so
            head += [(f"norm.{n}", f"{final}.{n}", tuple(t.shape), decayed(model, f"{final}.{n}"))
                     for n, t in submodule(model, final).named_parameters()]
        head += [(f"lm_head.{n}", f"{parts.head}.{n}", shapes[f"{parts.head}.{n}"], n == "weight")
                 for n in parts.head_params]
        head += [(f"{EXTRA}{n}", n, shapes[n], decayed(model, n)) for n in parts.head_extra]
        return embed, parts.stack_prefix, pre, head

    def passthrough_tensors(self, c: ModelConfig) -> tuple[str, ...]:
        """The model's tensors megatrain keeps as the checkpoint stores them and writes back untrained (a
        vision-language model's vision tower and projector, which text batches never run)."""
        from megatrain.model.hf_model import model_parts

        assert c.hf_config is not None
        return model_parts(c.hf_config).passthrough

    def module_kinds(self, c: ModelConfig) -> dict[str, str]:
        """Every module of the model that its text forward runs, but the output projection, by name to its class
        name: what LoRA's target modules are matched against, as PEFT matches them (megatrain/lora/targets.py).
        Modules that hold only pass-through tensors (a vision tower) are left out: text never runs them."""
        from megatrain.model.hf_model import meta_model, model_parts
        from megatrain.model.hf_parts import submodule

        assert c.hf_config is not None
        model, parts = meta_model(c.hf_config), model_parts(c.hf_config)
        head, untrained = submodule(model, parts.head), set(parts.passthrough)
        holding, trained = set(), set()  # the modules that hold tensors, and those that hold some that train
        for name in model.state_dict(keep_vars=True):
            owners = [name[:i] for i, char in enumerate(name) if char == "."]
            holding.update(owners)
            if name not in untrained:
                trained.update(owners)
        return {name: type(m).__name__ for name, m in model.named_modules()
                if name and m is not head and (name in trained or name not in holding)}

    def fused_names(self, c: ModelConfig) -> tuple[str, ...]:
        """The names of the checkpoint's modules whose weights transformers fuses into other tensors as it loads them
        (Mixtral's per-expert w1, w2, w3): PEFT maps LoRA targets so named onto the fused parameters."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        from megatrain.model.hf_model import meta_model

        assert c.hf_config is not None
        mapping = get_model_conversion_mapping(meta_model(c.hf_config))
        return tuple(dict.fromkeys(pattern.removesuffix(".weight").rpartition(".")[2] for converter in mapping
                                   if isinstance(converter, WeightConverter) for pattern in converter.source_patterns))

    def architecture(self, c: ModelConfig) -> GenericArchitecture:
        from megatrain.model.hf_architecture import GenericArchitecture

        return GenericArchitecture(c)


GENERIC = register_fallback(GenericFamily())


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
