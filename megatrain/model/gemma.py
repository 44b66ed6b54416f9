"""Gemma 2 and Gemma 3 (text): their config.json in and out, and what their decoder layer (gemma_layers.py) is told.

The Gemma-only keys live in ModelConfig.family_options, only where they differ from transformers' defaults, so a
config read in, a preset and a config written out compare equal. How Gemma differs from Llama: docs/design.md#gemma."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.llama import (
    REQUIRED_KEYS,
    Missing,
    attention_tensors,
    dropout_not_native,
    hf_flag,
    hf_number,
    hf_shape,
    native_or_not,
)
from megatrain.model.registry import register

if TYPE_CHECKING:
    from megatrain.model.gemma_layers import GemmaArchitecture

FULL, SLIDING = "full_attention", "sliding_attention"
GELU_TANH = "gelu_pytorch_tanh"  # transformers' name for GELU's tanh approximation, Gemma's only activation here

# transformers' defaults (Gemma2Config, Gemma3TextConfig) for keys a config.json leaves out
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(head_dim=256, num_key_value_heads=4, intermediate_size=9216, rms_norm_eps=1e-6,
                   max_position_embeddings=8192, rope_theta=10000.0, pad_token_id=0,
                   eos_token_id=1, bos_token_id=2),
    "gemma3_text": dict(head_dim=256, num_key_value_heads=4, intermediate_size=9216, rms_norm_eps=1e-6,
                        max_position_embeddings=131072, rope_theta=1e6, pad_token_id=0,
                        eos_token_id=1, bos_token_id=2),
}
# family_options and their defaults, per model type
OPTION_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096, sliding_window_pattern=2, layer_types=None),
    "gemma3_text": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window=4096, sliding_window_pattern=6, layer_types=None, rope_local_base_freq=10000.0),
}


@dataclass(frozen=True)
class GemmaOptions:
    query_pre_attn_scalar: float  # an int where it is one: transformers' configs refuse 256.0
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sliding_window: int | None  # what a sliding layer attends to: the token itself and the window - 1 before it
    sliding_window_pattern: int | None  # every p-th layer (1-based) attends fully, the others slide
    layer_types: tuple[str, ...] | None  # where the layers follow no period
    rope_local_base_freq: float | None = None  # Gemma 3's sliding layers

    def layer_types_for(self, num_layers: int) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        p = self.sliding_window_pattern
        assert p is not None
        return [FULL if (i + 1) % p == 0 else SLIDING for i in range(num_layers)]


def options(c: ModelConfig) -> GemmaOptions:
    """c's Gemma options, transformers' defaults where family_options leaves them out; ConfigError for bad ones."""
    defaults = OPTION_DEFAULTS[c.model_type]
    given = c.family_options or {}
    if not isinstance(given, dict):
        raise ConfigError(f"model config: family_options must be a dict or None, got {given!r}.")
    unknown = sorted(map(str, set(given) - set(defaults)))
    if unknown:
        raise ConfigError(f"model config: family_options has key(s) {', '.join(unknown)} that {c.model_type} does "
                          f"not know; known keys are {', '.join(defaults)}.")
    values = {**defaults, **given}
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "rope_local_base_freq"):
        value = values.get(key)
        optional = key.endswith("softcapping") or key not in defaults
        if value is None and optional:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ConfigError(f"model config: {c.model_type} {key} must be a positive number"
                              f"{' or None' if optional else ''}, got {value!r}.")
        if key != "query_pre_attn_scalar":  # which transformers' configs take as an integer where it is one
            values[key] = float(value)
        elif float(value).is_integer():
            values[key] = int(value)
    window = values["sliding_window"]
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise ConfigError(f"model config: {c.model_type} sliding_window must be a positive integer or None, "
                          f"got {window!r}.")
    types = values["layer_types"]
    if types is not None:
        if not (isinstance(types, (list, tuple)) and len(types) == c.num_layers
                and all(t in (FULL, SLIDING) for t in types)):
            raise ConfigError(f"model config: layer_types must list {FULL!r} or {SLIDING!r} for each of the "
                              f"{c.num_layers} layers, got {types!r}.")
        values["layer_types"], values["sliding_window_pattern"] = tuple(types), None
    else:
        p = values["sliding_window_pattern"]
        if not (isinstance(p, int) and not isinstance(p, bool) and p >= 1):
            raise ConfigError(f"model config: sliding_window_pattern (every p-th layer attends fully) must be a "
                              f"positive integer, got {p!r}.")
    return GemmaOptions(**values)


def _period(types: list[str]) -> int | None:
    """The p with layer i full exactly where (i + 1) % p == 0, as transformers derives layer_types, if any."""
    for p in range(1, len(types) + 2):
        if all((t == FULL) == ((i + 1) % p == 0) for i, t in enumerate(types)):
            return p
    return None


class GemmaFamily:
    """HF config.json <-> ModelConfig for one of gemma2 and gemma3_text (one instance each: qk_norm differs)."""

    uniform_layers = True  # sliding and full layers hold the same tensors
    tiles = True  # the MLP half over sequence tiles (tile_tokens)
    norm_init = 0.0  # (1 + w) norms: transformers initialises w to 0

    def __init__(self, model_type: str, architecture: str):
        self.model_type, self.architecture_name = model_type, architecture
        self.gemma3 = model_type == "gemma3_text"
        self.qk_norm = self.gemma3

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type,)

    # ---- in ----
    def _sliding_pattern(self, hf: dict[str, Any], types: Any, layers: Any) -> int | None:
        """Every how many layers one attends to all tokens (None: layer_types lists them without a period)."""
        if types is None:  # transformers derives them: Gemma 2 alternates; Gemma 3 from sliding_window_pattern
            pattern = 2 if not self.gemma3 else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
            return 6 if pattern is None else pattern
        if isinstance(types, list) and isinstance(layers, int) and len(types) == layers:
            return _period(types)
        raise ConfigError(f"HF config's layer_types must list {FULL!r} or {SLIDING!r} for each of its "
                          f"num_hidden_layers ({layers!r}) layers; fix config.json.")

    def from_hf(self, hf: dict[str, Any], model_type: str) -> dict[str, Any]:
        missing = [k for k in REQUIRED_KEYS if k not in hf]
        if missing:
            raise ConfigError(f"HF config lacks {', '.join(missing)}; it does not describe a {model_type} model.")
        defaults = HF_DEFAULTS[model_type]

        def get(key: str) -> Any:
            value = hf.get(key)
            return defaults[key] if value is None and key in defaults else value

        rope_theta, rope_scaling, local_theta = self._rope(hf)
        types, layers = hf.get("layer_types"), hf["num_hidden_layers"]
        pattern = self._sliding_pattern(hf, types, layers)
        bias = hf_flag(hf, "attention_bias")
        eos = get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        pad = get("pad_token_id")
        vocab = hf["vocab_size"]
        own = OPTION_DEFAULTS[model_type]
        wanted: dict[str, Any] = dict(
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", own["query_pre_attn_scalar"]),
            attn_logit_softcapping=hf.get("attn_logit_softcapping", own["attn_logit_softcapping"]),
            final_logit_softcapping=hf.get("final_logit_softcapping", own["final_logit_softcapping"]),
            sliding_window=hf.get("sliding_window", own["sliding_window"]),
            sliding_window_pattern=pattern,
            layer_types=list(types) if types is not None and pattern is None else None,
        )
        if self.gemma3:
            wanted["rope_local_base_freq"] = local_theta
        family_options = {k: v for k, v in wanted.items() if v != own[k]}  # only what differs from the defaults
        tied = hf.get("tie_word_embeddings")
        kwargs = dict(
            vocab_size=vocab,
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_heads=hf["num_attention_heads"],
            num_kv_heads=get("num_key_value_heads"),
            intermediate_size=get("intermediate_size"),
            head_dim=get("head_dim"),
            rope_theta=hf_number(hf, "rope_theta", rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=hf_number(hf, "rms_norm_eps", get("rms_norm_eps")),
            tie_embeddings=True if tied is None else hf_flag(hf, "tie_word_embeddings"),
            qkv_bias=bias,
            o_bias=bias,
            max_position_embeddings=get("max_position_embeddings"),
            initializer_range=get("initializer_range") or 0.02,
            bos_token_id=get("bos_token_id"),
            eos_token_id=eos,
            # transformers' embedding gives the padding row no gradient (padding_idx), 0 unless config.json says
            pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else None,
            model_type=model_type,
            family_options=family_options or None,
        )
        return native_or_not(kwargs, model_type, self.not_native(hf))

    def not_native(self, hf: dict[str, Any]) -> Missing | None:
        """The first option of the config.json that this family's layer does not implement, if any."""
        activation = hf.get("hidden_activation") or GELU_TANH
        if activation != GELU_TANH:
            return f"hidden_activation={activation!r}", f"its MLP is gated by {GELU_TANH}"
        if hf_flag(hf, "use_bidirectional_attention"):
            return "use_bidirectional_attention=True", "its attention is causal"
        local = (hf.get("rope_parameters") or {}).get(SLIDING) or {}  # a dict where it matters: _rope checked it
        if self.gemma3 and local.get("rope_type", "default") != "default":
            return f"{local['rope_type']!r} rotary embeddings in its sliding layers", "they use the default rope"
        return dropout_not_native(hf)

    def _rope(self, hf: dict[str, Any]) -> tuple[Any, dict[str, Any] | None, Any]:
        """(rope_theta, rope_scaling, local theta) of the full layers and (Gemma 3) the sliding ones, from
        rope_parameters (per layer type in Gemma 3) or the older rope_theta / rope_scaling / rope_local_base_freq."""
        defaults = HF_DEFAULTS[self.model_type]
        params = hf.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"HF config has a value of the wrong type for rope_parameters ({params!r}); "
                              "it must be a JSON object.")
        per_type = self.gemma3 and bool(set(params) & {FULL, SLIDING})
        full = (params.get(FULL) or {}) if per_type else params
        local = (params.get(SLIDING) or {}) if per_type else {}
        if not (isinstance(full, dict) and isinstance(local, dict)):
            raise ConfigError("HF config's rope_parameters must map each layer type to a JSON object.")
        theta = full.get("rope_theta", hf.get("rope_theta"))
        theta = defaults["rope_theta"] if theta is None else theta
        scaling = hf.get("rope_scaling") or None
        if full.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        local_theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
        if local_theta is None:
            local_theta = OPTION_DEFAULTS["gemma3_text"]["rope_local_base_freq"]
        return theta, scaling, hf_number(hf, "rope_local_base_freq", local_theta)

    # ---- checks ----
    def validate(self, c: ModelConfig) -> None:
        o = options(c)
        if c.qkv_bias != c.o_bias:
            raise ConfigError(f"model config: qkv_bias={c.qkv_bias} with o_bias={c.o_bias} is no {c.model_type} "
                              "layout transformers can load; attention_bias puts a bias on q, k, v and o alike.")
        if c.sliding_window is not None:  # ModelConfig's is the Llama family's (it trains sequences up to it)
            raise ConfigError(f"model config: a {c.model_type} model's window is family_options' sliding_window "
                              f"(its sliding layers use it, its full layers attend to all); set sliding_window=None.")
        if SLIDING in o.layer_types_for(c.num_layers) and o.sliding_window is None:
            raise ConfigError(f"model config: this {c.model_type} model has sliding-window layers but no "
                              "sliding_window in family_options; set it (Gemma 2: 4096, Gemma 3: 1024).")
        if not self.gemma3 and c.family_options and "rope_local_base_freq" in c.family_options:
            raise ConfigError("model config: rope_local_base_freq is Gemma 3's; gemma2 rotates every layer with "
                              "rope_theta.")

    # ---- the model ----
    def layer_tensors(self, c: ModelConfig, index: int) -> list[tuple[str, tuple[int, ...], bool]]:
        h, f = c.hidden_size, c.intermediate_size
        return attention_tensors(c, self.qk_norm) + [
            ("mlp.gate_proj.weight", (f, h), True),
            ("mlp.up_proj.weight", (f, h), True),
            ("mlp.down_proj.weight", (h, f), True),
            ("input_layernorm.weight", (h,), False),
            ("post_attention_layernorm.weight", (h,), False),
            ("pre_feedforward_layernorm.weight", (h,), False),
            ("post_feedforward_layernorm.weight", (h,), False),
        ]

    def num_params(self, c: ModelConfig) -> int:
        return c.num_params()  # uniform layers: ModelConfig counts them without asking the family

    def architecture(self, c: ModelConfig) -> GemmaArchitecture:
        from megatrain.model.gemma_layers import GemmaArchitecture  # torch: only where the math runs

        o = options(c)
        softcap = None if self.gemma3 else o.attn_logit_softcapping  # transformers' Gemma 3 never caps attention
        # the rotary of each kind: Gemma 3's sliding layers have their own base and no scaling
        local = replace(c, rope_theta=o.rope_local_base_freq, rope_scaling=None) if self.gemma3 else c
        return GemmaArchitecture(c, o.layer_types_for(c.num_layers), windows={FULL: None, SLIDING: o.sliding_window},
                                 rope_configs={FULL: c, SLIDING: local}, scale=o.query_pre_attn_scalar ** -0.5,
                                 softcap=softcap, logit_softcap=o.final_logit_softcapping)

    # ---- out ----
    def to_hf(self, c: ModelConfig) -> dict[str, Any]:
        o = options(c)
        full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
        if c.rope_scaling:
            full_rope.update(c.rope_scaling)
        hf: dict[str, Any] = {
            "architectures": [self.architecture_name],
            **hf_shape(c),
            "hidden_activation": GELU_TANH,
            "max_position_embeddings": c.max_position_embeddings,
            "initializer_range": c.initializer_range,
            "rms_norm_eps": c.rms_norm_eps,
            "attention_bias": c.qkv_bias,
            "attention_dropout": 0.0,
            "query_pre_attn_scalar": o.query_pre_attn_scalar,
            "attn_logit_softcapping": o.attn_logit_softcapping,
            "final_logit_softcapping": o.final_logit_softcapping,
            "sliding_window": o.sliding_window,
            "layer_types": o.layer_types_for(c.num_layers),
            "tie_word_embeddings": c.tie_embeddings,
            "torch_dtype": "float32",
            "dtype": "float32",
            "use_cache": True,
            # written even when None: transformers' Gemma configs default to ids 2, 1 and 0 when absent
            "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id,
            "pad_token_id": c.pad_token_id,
        }
        if self.gemma3:
            hf["rope_parameters"] = {FULL: full_rope,
                                     SLIDING: {"rope_type": "default", "rope_theta": o.rope_local_base_freq}}
            hf["use_bidirectional_attention"] = False
        else:
            hf["rope_parameters"] = full_rope
        return hf


GEMMA2 = register(GemmaFamily("gemma2", "Gemma2ForCausalLM"))
GEMMA3 = register(GemmaFamily("gemma3_text", "Gemma3ForCausalLM"))
