"""transformers' side of a config.json on the generic path: is it a decoder-only causal LM megatrain can follow,
and transformers' config object for it. transformers is needed by the generic path only (pip install -e '.[hf]').
"""

from __future__ import annotations

import functools
from typing import Any

from megatrain.config import ConfigError


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("this model runs on megatrain's generic path, which needs transformers; install it with "
                          "pip install -e '.[hf]'.") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ConfigError(f"megatrain's generic path needs transformers 5 or later (its weight conversion mapping), "
                          f"found {transformers.__version__}; upgrade it with pip install -e '.[hf]'.")
    return transformers


def causal_lm_class(model_type: Any) -> str | None:
    """The class name of transformers' causal LM for a config's model_type (None: no causal LM), the language models
    of multimodal ones (Mllama's `mllama_text_model`: MllamaForCausalLM) included."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if model_type in CAUSAL:
        return CAUSAL[model_type]
    return _text_model_types(tuple(CAUSAL.items())).get(model_type)


@functools.lru_cache(maxsize=1)
def _text_model_types(mapping: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The config model_types that a causal-LM class reads though the auto mapping lists it under another type (a
    multimodal model's language model: `mllama_text_model` for MllamaForCausalLM), from the class's config_class."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    causal = dict(mapping)
    found = {}
    for config_type in CONFIG_MAPPING_NAMES:
        owner = next((t for t in causal if config_type.startswith(f"{t}_")), None)
        if config_type in causal or owner is None:
            continue
        cls = getattr(transformers, causal[owner], None)
        if getattr(getattr(cls, "config_class", None), "model_type", None) == config_type:
            found[config_type] = causal[owner]
    return found


def build_causal_lm(config: Any, **kwargs: Any) -> Any:
    """transformers' causal LM of `config` (AutoModelForCausalLM, or the class that reads a text model's config)."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError:
        class_name = causal_lm_class(getattr(config, "model_type", None))
        if class_name is None:
            raise
        return getattr(transformers, class_name)._from_config(config, **kwargs)


# registered as causal LMs, but not decoder-only language models: the decoders of encoder-decoder models that no
# seq2seq mapping lists (TrOCR's, of a vision encoder-decoder; MusicGen's), and a permutation language model (XLNet)
OTHER_ENCODER_DECODERS = frozenset({"trocr", "musicgen", "musicgen_melody"})  # MusicGen's: of a text encoder
OTHER_ENCODERS = frozenset({"bert-generation", "xlnet"})


def encoder_decoder_types() -> frozenset[str]:
    """Causal-LM model types that are the decoder of an encoder-decoder model (BART, Whisper, ...)."""
    from transformers.models.auto import modeling_auto as auto

    seq2seq = {*auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, *auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}
    return frozenset(seq2seq) | OTHER_ENCODER_DECODERS


def encoder_types() -> frozenset[str]:
    """Causal-LM model types that are encoders (BERT, RoBERTa, ...): transformers has a masked LM of theirs."""
    from transformers.models.auto import modeling_auto as auto

    # Reformer's LM-head model is an autoregressive decoder, whatever else its architecture does
    return (frozenset(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) - encoder_decoder_types() - {"reformer"}) | OTHER_ENCODERS


def check_generic(hf: dict[str, Any]) -> None:
    """ConfigError, in one sentence, for a config.json the generic path cannot train."""
    model_type = hf.get("model_type")
    transformers_module()
    if hf.get("auto_map") and causal_lm_class(model_type) is None:
        raise ConfigError(f"model_type {model_type!r} needs trust_remote_code (its code ships with the checkpoint), "
                          "which megatrain never runs; use a model transformers implements.")
    if hf.get("is_encoder_decoder") or model_type in encoder_decoder_types():
        raise ConfigError(f"model_type {model_type!r} is an encoder-decoder model (its causal LM is the decoder alone, "
                          "made to attend to an encoder); megatrain trains decoder-only causal language models.")
    if model_type in encoder_types():
        raise ConfigError(f"model_type {model_type!r} is an encoder (a masked language model, whose causal-LM head "
                          "runs it as a decoder); megatrain trains decoder-only causal language models.")
    if causal_lm_class(model_type) is None:
        raise ConfigError(f"model_type {model_type!r} is no decoder-only causal language model transformers "
                          "knows; megatrain cannot train it.")


# Quantized storage megatrain decodes to fp32 as it loads (megatrain/io/mxfp4.py: GPT-OSS's experts as published);
# the model's config then drops the quantization_config, so what it saves is dense and transformers loads it.
DEQUANTIZED_ON_LOAD = ("mxfp4",)


def quant_method(hf: dict[str, Any]) -> str | None:
    """The quant_method of a config.json's quantization_config ("unknown" where it names none), None without one."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return method if isinstance(method, str) else "unknown"


def dense_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the model megatrain trains: without a quantization_config it dequantizes on loading."""
    return {k: v for k, v in hf.items() if k != "quantization_config" or quant_method(hf) not in DEQUANTIZED_ON_LOAD}


def check_not_quantized(hf: dict[str, Any], directory: Any) -> None:
    """ConfigError for a checkpoint whose weights are stored quantized in a way megatrain does not decode: it trains
    fp32 master weights and reads the stored tensors as they are, so they must be dequantized (and saved) first."""
    method = quant_method(hf)
    if method is not None and method not in DEQUANTIZED_ON_LOAD:
        raise ConfigError(f"{directory} holds {method}-quantized weights, which megatrain cannot train from; "
                          "dequantize them first (transformers: from_pretrained with the quantization config's "
                          "dequantize=True, then save_pretrained) and drop quantization_config from config.json.")


SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(value: Any) -> Any:
    """transformers writes the floats JSON has no word for as {"__float__": "Infinity"} (a mamba layer's
    time_step_limit, say) and reads them back as floats: so does megatrain."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[value["__float__"]]
        return {k: decode_special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_special_floats(v) for v in value]
    return value


def hf_config_object(hf: dict[str, Any]) -> Any:
    """transformers' config object for a parsed config.json."""
    transformers = transformers_module()
    fields = {k: decode_special_floats(v) for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    try:
        return transformers.AutoConfig.for_model(hf["model_type"], **fields)
    except Exception as e:  # transformers' own refusal of a config, whatever its type (strict dataclass checks too)
        detail = " ".join(str(e).split())  # its validation errors run over several lines: one sentence here
        raise ConfigError(f"transformers refuses this {hf['model_type']} config.json ({detail}); fix config.json."
                          ) from None
