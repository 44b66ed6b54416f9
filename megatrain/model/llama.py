"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 (and TinyLlama, SmolLM, ...): its HF config.json in and out.

Its layer is the template in templates.py (DecoderLayer) with the options this family's configs set: q/k/v
biases (Qwen2), an o_proj bias (Llama's attention_bias), an explicit head_dim (Mistral). Other families
(qwen3.py) build on this one and change what differs. A config.json with what the layer does not implement (Llama's
mlp_bias, another activation, attention dropout) raises NotNative: ModelConfig.from_hf trains such a model on the
generic path instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatrain.config import ConfigError, ModelConfig, NotNative
from megatrain.model.registry import register

if TYPE_CHECKING:
    from megatrain.model.architecture import LlamaArchitecture

# HF config.json keys every family here needs: the shape of the model
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def hf_flag(hf: dict[str, Any], key: str) -> bool:
    value = hf.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise ConfigError(f"HF config has a value of the wrong type for {key} ({value!r}); "
                      "it must be true or false.")


def hf_number(hf: dict[str, Any], key: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            pass
    raise ConfigError(f"HF config has a value of the wrong type for {key} ({value!r}); it must be a number.")


FULL, SLIDING = "full_attention", "sliding_attention"


def sliding_layers(hf: dict[str, Any]) -> list[bool]:
    """Per layer, whether it attends to a sliding window, as Qwen2Config and Qwen3Config derive it: from
    max_window_layers on when use_sliding_window is set, or where layer_types says so."""
    layers = hf.get("num_hidden_layers")
    types = hf.get("layer_types")
    count = layers if isinstance(layers, int) and layers > 0 else 0
    if types is not None:
        if not (isinstance(types, list) and len(types) == layers and all(t in (FULL, SLIDING) for t in types)):
            raise ConfigError(f"HF config's layer_types must list {FULL!r} or {SLIDING!r} for each of its "
                              f"num_hidden_layers ({layers!r}) layers; fix config.json.")
        sliding = [t == SLIDING for t in types]
        if any(sliding) and not (hf_flag(hf, "use_sliding_window") and hf.get("sliding_window")):
            raise ConfigError("HF config's layer_types slide some layers but it sets no sliding_window with "
                              "use_sliding_window, without which transformers cannot run them; fix config.json.")
        return sliding
    first = hf.get("max_window_layers", 28)  # Qwen2Config's and Qwen3Config's default
    on = hf_flag(hf, "use_sliding_window") and hf.get("sliding_window") not in (None, 0)
    first = first if isinstance(first, int) else 0
    return [on and i >= first for i in range(count)]


# what a family's layer does not implement, as NotNative names it: (the option, why)
Missing = tuple[str, str]


def dropout_not_native(hf: dict[str, Any]) -> Missing | None:
    """Attention dropout, which transformers applies in training and megatrain's layers do not."""
    dropout = hf.get("attention_dropout") or 0.0
    if hf_number(hf, "attention_dropout", dropout) != 0.0:
        return f"attention_dropout={dropout!r}", "it has no dropout"
    return None


def native_or_not(kwargs: dict[str, Any], model_type: str, missing: Missing | None) -> dict[str, Any]:
    """A family's reading of a config.json, or NotNative where its layer misses an option; raised once the rest is
    known valid (ModelConfig checks it), so that an invalid config is refused as such, not handed to the generic
    path."""
    if missing is None:
        return kwargs
    ModelConfig(**kwargs)
    raise NotNative(model_type, *missing)


def pad_id(hf: dict[str, Any]) -> int | None:
    """The padding token whose embedding row gets no gradient, if it is one of the vocabulary's."""
    pad = hf.get("pad_token_id")
    vocab = hf.get("vocab_size")
    valid = isinstance(pad, int) and not isinstance(pad, bool) and isinstance(vocab, int) and 0 <= pad < vocab
    return pad if valid else None


def hf_shape(c: ModelConfig) -> dict[str, Any]:
    """The config.json keys of the model's shape, as every family here writes them."""
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim}


def attention_tensors(c: ModelConfig, qk_norm: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """A decoder layer's attention tensors, in layout order: q/k/v/o projections (weight-decayed), their biases
    where the config has them, and the per-head q/k norms (qk_norm)."""
    h, q, kv = c.hidden_size, c.q_size, c.kv_size
    tensors = [
        ("self_attn.q_proj.weight", (q, h), True),
        ("self_attn.k_proj.weight", (kv, h), True),
        ("self_attn.v_proj.weight", (kv, h), True),
        ("self_attn.o_proj.weight", (h, q), True),
    ]
    if c.qkv_bias:
        tensors += [("self_attn.q_proj.bias", (q,), False), ("self_attn.k_proj.bias", (kv,), False),
                    ("self_attn.v_proj.bias", (kv,), False)]
    if c.o_bias:
        tensors.append(("self_attn.o_proj.bias", (h,), False))
    if qk_norm:
        d = c.head_dim
        tensors += [("self_attn.q_norm.weight", (d,), False), ("self_attn.k_norm.weight", (d,), False)]
    return tensors


class LlamaFamily:
    """HF config.json <-> ModelConfig for the model types in `architectures`; subclasses change what differs."""

    architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    qk_norm = False  # per-head RMSNorm on q and k (Qwen3): an option of the DecoderLayer template
    uniform_layers = True
    tiles = True  # its layers run over sequence tiles (tile_tokens)

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.architectures)

    # ---- in ----
    def hf_defaults(self, model_type: str) -> dict[str, Any]:
        """What keys a config.json leaves out are read as (head_dim None: hidden_size / num_attention_heads)."""
        return {"rms_norm_eps": 1e-6 if model_type == "qwen2" else 1e-5, "head_dim": None,
                "max_position_embeddings": 4096}

    def attention_biases(self, hf: dict[str, Any], model_type: str) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Qwen2 always has the first only; Llama's attention_bias sets both."""
        if model_type == "qwen2":
            return True, False
        bias = hf_flag(hf, "attention_bias")
        return bias, bias

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> Any:
        """The attention window that applies, if any (Qwen2 carries one that is off unless use_sliding_window)."""
        window = hf.get("sliding_window")
        if model_type == "qwen2" and not all(sliding_layers(hf)):
            return None  # none slides, or some do (not_native)
        return window if window not in (None, 0) else None

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        """ModelConfig's keyword arguments for a parsed config.json of `model_type` (one of this family's); NotNative
        for what its layer does not implement (native_or_not)."""
        missing = [k for k in REQUIRED_KEYS if k not in hf]
        if missing:
            raise ConfigError(f"HF config lacks {', '.join(missing)}; it does not describe a {model_type} model.")
        rope = hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"HF config has a value of the wrong type for rope_parameters ({rope!r}); "
                              "it must be a JSON object.")
        rope_scaling = hf.get("rope_scaling") or None
        if rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        kv_heads = hf.get("num_key_value_heads")
        defaults = self.hf_defaults(model_type)

        def get(key: str, default: Any) -> Any:
            value = hf.get(key)
            return default if value is None else value

        qkv_bias, o_bias = self.attention_biases(hf, model_type)
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_attention_heads"] if kv_heads is None else kv_heads,
            intermediate_size=hf.get("intermediate_size"),
            head_dim=get("head_dim", defaults["head_dim"]),
            rope_theta=hf_number(hf, "rope_theta", rope.get("rope_theta", get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            rms_norm_eps=hf_number(hf, "rms_norm_eps", get("rms_norm_eps", defaults["rms_norm_eps"])),
            tie_embeddings=hf_flag(hf, "tie_word_embeddings"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            max_position_embeddings=get("max_position_embeddings", defaults["max_position_embeddings"]),
            initializer_range=get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=pad_id(hf),
            model_type=model_type,
            sliding_window=self.sliding_window(hf, model_type),
        )
        return native_or_not(kwargs, model_type, self.not_native(hf, model_type))

    def not_native(self, hf: dict[str, Any], model_type: str) -> Missing | None:
        """The first option of the config.json that this family's layer does not implement, if any."""
        # only LlamaMLP reads mlp_bias: transformers' Mistral, Qwen2 and Qwen3 MLPs have no bias whatever it says
        if model_type == "llama" and hf_flag(hf, "mlp_bias"):
            return "mlp_bias=True", "its MLP projections have no bias"
        activation = hf.get("hidden_act") or "silu"
        if activation not in ("silu", "swish"):  # transformers' two names of one function
            return f"hidden_act={activation!r}", "its MLP is gated by SiLU"
        if model_type == "qwen2" and len(set(sliding_layers(hf))) > 1:
            return "sliding-window attention in some layers", "its layers all attend alike"
        return dropout_not_native(hf)

    # ---- checks ----
    def validate(self, c: ModelConfig) -> None:
        """What a config of this family must satisfy for transformers to load what megatrain writes."""
        if c.model_type == "llama" and c.hidden_size % c.num_heads:
            raise ConfigError(
                f"model config: a llama model needs hidden_size {c.hidden_size} divisible by num_heads "
                f"{c.num_heads} (transformers' LlamaConfig refuses others); use model_type='mistral' for an "
                "explicit head_dim."
            )
        # HF layouts: Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias puts one on all four
        layout = (True, False) if c.model_type == "qwen2" else (c.qkv_bias, c.qkv_bias)
        if (c.qkv_bias, c.o_bias) != layout:
            raise ConfigError(
                f"model config: qkv_bias={c.qkv_bias} with o_bias={c.o_bias} is no {c.model_type} "
                "layout transformers can load; Llama's attention_bias sets both, qwen2 has qkv_bias only."
            )

    # ---- the model ----
    def layer_tensors(self, c: ModelConfig, index: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """Decoder layer `index`'s tensors: (name inside the layer, shape, weight-decayed), in layout order."""
        h, f = c.hidden_size, c.intermediate_size
        return [
            ("input_layernorm.weight", (h,), False),
            *attention_tensors(c, self.qk_norm),
            ("post_attention_layernorm.weight", (h,), False),
            ("mlp.gate_proj.weight", (f, h), True),
            ("mlp.up_proj.weight", (f, h), True),
            ("mlp.down_proj.weight", (h, f), True),
        ]

    def num_params(self, c: ModelConfig) -> int:
        return c.num_params()  # uniform layers: ModelConfig counts them without asking the family

    def architecture(self, c: ModelConfig) -> LlamaArchitecture:
        from megatrain.model.architecture import LlamaArchitecture  # torch: only where the math runs

        return LlamaArchitecture(c)

    # ---- out ----
    def to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The config.json transformers reads back as the same model (its own class for c.model_type)."""
        rope: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
        if c.rope_scaling:
            rope.update(c.rope_scaling)
            rope.setdefault("rope_type", rope.pop("type", "default"))
        hf: dict[str, Any] = {
            "architectures": [self.architectures[c.model_type]],
            **hf_shape(c),
            "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings,
            "initializer_range": c.initializer_range,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": c.rope_scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": c.tie_embeddings,
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
            "dtype": "float32",
            "use_cache": True,
        }
        hf.update(self.hf_attention_keys(c))
        # written even when None: transformers' Llama and Mistral configs default to ids 1 and 2 when absent
        hf["bos_token_id"] = c.bos_token_id
        hf["eos_token_id"] = c.eos_token_id
        hf["pad_token_id"] = c.pad_token_id
        return hf

    def hf_attention_keys(self, c: ModelConfig) -> dict[str, Any]:
        """The config.json keys that say where biases are and which window attention uses."""
        hf: dict[str, Any] = {}
        if c.model_type != "qwen2":
            hf["attention_bias"] = c.qkv_bias
            hf["mlp_bias"] = False
        if c.model_type == "mistral" or c.sliding_window is not None:
            hf["sliding_window"] = c.sliding_window  # MistralConfig defaults to 4096 when absent
        if c.model_type == "qwen2" and c.sliding_window is not None:
            # every layer slides: Qwen2Config slides those from max_window_layers on (28 when absent)
            hf["use_sliding_window"], hf["max_window_layers"] = True, 0
        return hf


LLAMA = register(LlamaFamily())
