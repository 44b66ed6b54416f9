"""A native family meeting an option it does not implement hands the model to the generic path (transformers' own
layers) with one log line, instead of refusing it: loss and every gradient against transformers in fp32, the config
round trip, save_pretrained; without transformers the one-sentence refusal says to install it; an invalid config is
refused as before, and a native config is untouched."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import SHAPE, assert_matches, assert_one_sentence, batch, build_hf_model, fp64_grads, hf_loss_and_grads
from transformers import Gemma2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

import megatrain
from megatrain import ConfigError, ModelConfig
from megatrain.config import NotNative
from megatrain.model import registry

DENSE = dict(**SHAPE, intermediate_size=96, num_hidden_layers=3)
# name -> (config transformers builds, the option the log line names)
CASES: dict[str, tuple[Callable[[], PretrainedConfig], str]] = {
    "llama-mlp-bias": (lambda: LlamaConfig(**DENSE, mlp_bias=True, attention_bias=True), "mlp_bias=True"),
    # layer 1 slides (window 8 < the test's 16 tokens), layers 0 and 2 attend to all
    "qwen3-sliding": (lambda: Qwen3Config(**DENSE, use_sliding_window=True, sliding_window=8,
                                          layer_types=["full_attention", "sliding_attention", "full_attention"]),
                      "sliding-window attention layers"),
    "gemma2-gelu": (lambda: Gemma2Config(**DENSE, hidden_activation="gelu", sliding_window=8),
                    "hidden_activation='gelu'"),
    # Qwen2 sliding from layer 1 on (max_window_layers): its layers do not all attend alike
    "qwen2-some-sliding": (lambda: Qwen2Config(**DENSE, use_sliding_window=True, sliding_window=8,
                                               max_window_layers=1), "sliding-window attention in some layers"),
}
# a window every layer has, shorter than the test's 16 tokens, the native family implements (Mistral 7B v0.1)
NATIVE_WINDOWED: dict[str, Callable[[], PretrainedConfig]] = {
    "mistral-v0.1": lambda: MistralConfig(**DENSE, sliding_window=8),
    "qwen2-all-sliding": lambda: Qwen2Config(**DENSE, use_sliding_window=True, sliding_window=8, max_window_layers=0),
}
LOG_LINE = "{} with {} is not implemented natively; training it through transformers' own layers (the generic path)"


@pytest.mark.parametrize("case", list(CASES))
def test_trains_on_the_generic_path_as_transformers_does(case: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    make, option = CASES[case]
    hf = build_hf_model(make())
    hf.save_pretrained(tmp_path)
    input_ids = batch()
    labels = input_ids.clone()
    labels[0, :5] = -100  # ignored positions, as transformers ignores them
    caplog.set_level(logging.INFO, logger="megatrain.config")
    with megatrain.from_pretrained(tmp_path, device="cpu") as model:
        assert type(model.executor.arch).__name__ == "GenericArchitecture"
        assert model.config.model_type == hf.config.model_type and model.config.family is registry.generic()
        ours = model.loss_and_grads(input_ids, labels)
        ours = (ours[0], {k: v.clone() for k, v in ours[1].items()})
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, labels), fp64_grads(hf, input_ids, labels))
    assert LOG_LINE.format(hf.config.model_type, option) in caplog.messages


@pytest.mark.parametrize("case", list(NATIVE_WINDOWED))
def test_a_sliding_window_in_every_layer_trains_natively_past_it(case: str, tmp_path: Path) -> None:
    hf = build_hf_model(NATIVE_WINDOWED[case]())
    hf.save_pretrained(tmp_path)
    input_ids = batch()
    assert input_ids.shape[1] > 8
    with megatrain.from_pretrained(tmp_path, device="cpu") as model:
        assert model.config.hf_config is None and model.config.sliding_window == 8  # the native family's own layers
        ours = model.loss_and_grads(input_ids, input_ids)
        ours = (ours[0], {k: v.clone() for k, v in ours[1].items()})
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, input_ids), fp64_grads(hf, input_ids, input_ids))


def test_config_round_trips_and_save_pretrained_keeps_the_option(tmp_path: Path) -> None:
    hf = build_hf_model(CASES["llama-mlp-bias"][0]())
    hf.save_pretrained(tmp_path / "in")
    c = ModelConfig.from_hf(tmp_path / "in")
    assert c.hf_config is not None and c.hf_config["mlp_bias"] is True
    assert ModelConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c
    assert c.num_params() == sum(p.numel() for p in hf.parameters())
    with megatrain.from_pretrained(tmp_path / "in", device="cpu") as model:
        saved = model.save_pretrained(tmp_path / "out")
    written = json.loads((saved / "config.json").read_text())
    assert (written["model_type"], written["mlp_bias"]) == ("llama", True)
    assert ModelConfig.from_hf(saved) == c


@pytest.mark.parametrize("case", list(CASES))
def test_without_transformers_it_is_refused_in_one_sentence(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, option = CASES[case]
    monkeypatch.setattr(type(registry.generic()), "supports", lambda self, model_type: False)
    with pytest.raises(NotNative) as info:
        ModelConfig.from_hf(make().to_dict())
    message = str(info.value)
    assert option in message and "pip install -e '.[hf]'" in message, message
    assert_one_sentence(message)


def _llama(**overrides: Any) -> dict[str, Any]:
    return {**LlamaConfig(**DENSE).to_dict(), **overrides}


@pytest.mark.parametrize("hf, expected", [
    (_llama(mlp_bias=True, num_key_value_heads=3), r"num_kv_heads 3 must divide num_heads 4"),
    (_llama(mlp_bias="yes"), r"wrong type for mlp_bias"),
    (_llama(attention_dropout="some"), r"wrong type for attention_dropout"),
    ({**Qwen3Config(**DENSE).to_dict(), "layer_types": ["sliding_attention"]},
     r"layer_types must list 'full_attention' or 'sliding_attention' for each of its num_hidden_layers \(3\)"),
    ({**Qwen3Config(**DENSE).to_dict(), "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     r"layer_types slide some layers but it sets no sliding_window"),
], ids=["kv-heads", "mlp-bias-type", "dropout-type", "layer-types-length", "no-window"])
def test_an_invalid_config_is_still_refused(hf: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        ModelConfig.from_hf(hf)
    assert not isinstance(info.value, NotNative)
    assert_one_sentence(str(info.value))


def test_native_configs_are_untouched(caplog: pytest.LogCaptureFixture) -> None:
    """What transformers' Mistral, Qwen2 and Qwen3 ignore (mlp_bias) keeps them native; a hand-built config too."""
    caplog.set_level(logging.INFO, logger="megatrain.config")
    mistral = ModelConfig.from_hf({**_llama(mlp_bias=True), "model_type": "mistral"})
    assert mistral.hf_config is None and type(mistral.family).__name__ == "LlamaFamily"
    llama = ModelConfig.from_hf(_llama(hidden_act="silu", attention_dropout=0.0))
    assert llama.hf_config is None and ModelConfig.from_hf(llama.to_hf()) == llama
    assert not caplog.messages
    by_hand = ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, model_type="qwen3", head_dim=16)
    assert by_hand.family is registry.family_of("qwen3") and by_hand.qk_norm
    with pytest.raises(ConfigError, match="sliding_window=8 is not implemented for qwen3"):
        ModelConfig(hidden_size=64, num_heads=4, model_type="qwen3", sliding_window=8)
