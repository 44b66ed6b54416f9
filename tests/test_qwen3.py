"""Native Qwen3 against transformers' Qwen3ForCausalLM: config.json in and out, loss and every gradient (also under
simulated streams), save_pretrained, three Engine steps against torch.optim.AdamW, and the plan of the real
Qwen3-8B. test_parity.py runs its whole suite on one more Qwen3 ("qwen3-head-dim")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    VOCAB,
    assert_engine_matches_transformers,
    assert_matches_hf,
    assert_one_sentence,
    batch,
    build_hf_model,
    hf_loss_and_grads,
    make_labels,
    saved_hf_model,
)
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

import megatrain
from megatrain import ConfigError
from megatrain.io.checkpoint import CheckpointError
from megatrain.model.layout import ModelLayout
from pipelines.cli import main

GiB = 2**30


def tiny(**overrides: Any) -> Qwen3Config:
    """Three layers, GQA, head_dim 24 (not hidden / heads), untied like Qwen3-8B."""
    kwargs: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1e6)
    return Qwen3Config(**{**kwargs, **overrides})


# the small variants: as published (untied), and tied embeddings with attention_bias on q, k, v and o
VARIANTS = {"untied": {}, "tied-bias": dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[torch.nn.Module, Path]]:
    # every parameter perturbed, q/k norms included
    hf, directory = saved_hf_model(tiny(**VARIANTS[request.param]), tmp_path_factory, f"qwen3-{request.param}")
    yield hf, directory


# ---- config.json in and out ----

def test_from_hf_reads_qwen3(qwen3: tuple[torch.nn.Module, Path]) -> None:
    hf, directory = qwen3
    c = megatrain.ModelConfig.from_hf(directory)
    h = hf.config
    assert c.model_type == "qwen3" and c.qk_norm
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        h.vocab_size, h.hidden_size, h.intermediate_size, h.num_hidden_layers, h.num_attention_heads,
        h.num_key_value_heads)
    assert c.head_dim == 24 and c.q_size == 96 != c.hidden_size
    assert (c.qkv_bias, c.o_bias) == (h.attention_bias, h.attention_bias)
    assert c.tie_embeddings == h.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.rms_norm_eps == h.rms_norm_eps and c.sliding_window is None


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "attention_bias": True},
                                       {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                                       {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3}],
                         ids=["plain", "tied-bias", "linear-rope", "window-on-no-layer"])
def test_hf_round_trip(overrides: dict[str, Any]) -> None:
    """megatrain's config.json is read by transformers as the same Qwen3: every shape key, full attention in
    every layer (use_sliding_window with no layer from max_window_layers on slides nowhere)."""
    hf = tiny(**overrides)
    c = megatrain.ModelConfig.from_hf(hf.to_dict())
    assert megatrain.ModelConfig.from_hf(c.to_hf()) == c
    back = AutoConfig.for_model(**c.to_hf())
    assert type(back) is Qwen3Config and back.architectures == ["Qwen3ForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                "max_position_embeddings", "rope_parameters", "layer_types"):
        assert getattr(back, key) == getattr(hf, key), key
    assert back.layer_types == ["full_attention"] * 3


def test_missing_head_dim_is_qwen3s_default() -> None:
    """Qwen3Config's head_dim is 128 unless given, whatever hidden / heads is: megatrain reads it the same."""
    hf = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "intermediate_size": 96}
    assert megatrain.ModelConfig.from_hf({**hf, "model_type": "qwen3"}).head_dim == Qwen3Config(**hf).head_dim == 128


def _sliding_layers(hf: dict[str, Any]) -> dict[str, Any]:
    return {**hf, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}


# sliding-window layers are not implemented here: such a config takes the generic path (tests/test_native_fallback.py
# trains one against transformers)
@pytest.mark.parametrize("hf", [
    _sliding_layers(tiny().to_dict()),
    {**_sliding_layers(tiny().to_dict()), "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
], ids=["use-sliding-window", "layer-types"])
def test_sliding_layers_take_the_generic_path(hf: dict[str, Any]) -> None:
    c = megatrain.ModelConfig.from_hf(hf)
    assert c.hf_config is not None and type(c.family).__name__ == "GenericFamily"


@pytest.mark.parametrize("make, expected", [
    (lambda: megatrain.ModelConfig.from_hf({**tiny().to_dict(), "layer_types": ["full_attention"]}),
     r"layer_types must list 'full_attention' or 'sliding_attention' for each of its num_hidden_layers \(3\)"),
    (lambda: megatrain.ModelConfig(hidden_size=64, num_heads=4, model_type="qwen3", sliding_window=64),
     r"sliding_window=64 is not implemented for qwen3"),
    (lambda: megatrain.ModelConfig(hidden_size=64, num_heads=4, model_type="qwen3", qkv_bias=True),
     r"qkv_bias=True with o_bias=False is no qwen3 layout"),
], ids=["layer-types-length", "window-field", "qkv-bias-only"])
def test_what_megatrain_does_not_implement_is_refused(make: Any, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        make()
    assert_one_sentence(str(info.value))


def test_layout_has_the_norms_without_weight_decay() -> None:
    c = megatrain.ModelConfig.from_hf(tiny().to_dict())
    layout = ModelLayout.build(c)
    slots = {s.hf_name: s for u in layout.units for s in u.slots}
    for i in range(3):
        for name in ("q_norm", "k_norm"):
            slot = slots[f"model.layers.{i}.self_attn.{name}.weight"]
            assert slot.shape == (24,) and not slot.decay
    assert sum(s.numel for s in slots.values()) == c.num_params() == sum(
        p.numel() for p in build_hf_model(tiny()).parameters())


# ---- loss and gradients ----

@pytest.mark.parametrize("device", ["cpu", "cpu-async:0"])
@pytest.mark.parametrize("labels_kind", ["full", "masked"])
def test_loss_and_grads_match_hf(qwen3: tuple[torch.nn.Module, Path], device: str, labels_kind: str) -> None:
    hf, directory = qwen3
    input_ids = batch()
    labels = make_labels(labels_kind, input_ids)
    hf_loss, hf_grads = hf_loss_and_grads(hf, input_ids, labels)
    assert any(".q_norm." in name for name in hf_grads)
    with megatrain.from_pretrained(directory, device=device) as model:
        assert_matches_hf(*model.loss_and_grads(input_ids, labels), hf_loss, hf_grads)


def test_save_pretrained_is_qwen3_in_transformers(qwen3: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    hf, directory = qwen3
    with megatrain.from_pretrained(directory) as model:
        out = model.save_pretrained(tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == {n for n, _ in hf.named_parameters()}
    assert "model.layers.2.self_attn.k_norm.weight" in names
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(reloaded) is type(hf)
    input_ids = batch(seed=4)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids).logits, hf(input_ids=input_ids).logits)


def test_a_new_qwen3_saves_for_transformers(tmp_path: Path) -> None:
    """Built from a config (HF's init: norms 1), saved, loaded by transformers: the same loss."""
    config = megatrain.ModelConfig.from_hf(tiny(tie_word_embeddings=True).to_dict())
    input_ids = batch()
    with megatrain.from_pretrained(config, seed=3) as model:
        loss, _ = model.loss_and_grads(input_ids)
        out = model.save_pretrained(tmp_path / "new")
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert torch.equal(hf.model.layers[0].self_attn.q_norm.weight, torch.ones(24))
    with torch.no_grad():
        assert float(hf(input_ids=input_ids, labels=input_ids).loss) == pytest.approx(float(loss), rel=1e-5)


def test_a_qwen3_checkpoint_called_llama_is_refused(tmp_path: Path) -> None:
    build_hf_model(tiny()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"[qk]_norm.weight' that a llama model of this config does not have"):
        megatrain.from_pretrained(tmp_path)


# ---- three Engine steps against transformers + AdamW ----

def test_engine_matches_transformers_and_adamw(ray_session: None, tmp_path: Path) -> None:
    directory = tmp_path / "qwen3"
    build_hf_model(tiny()).save_pretrained(directory)
    assert_engine_matches_transformers(directory)


# ---- the plan of the real Qwen3-8B ----

QWEN3_8B = {  # config.json of Qwen/Qwen3-8B as published
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_plan_of_qwen3_8b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "Qwen3-8B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN3_8B))
    c = megatrain.ModelConfig.from_hf(directory)
    assert c == megatrain.ModelConfig(**{**megatrain.ModelConfig.from_name("qwen3-8b").to_dict(),
                                         "bos_token_id": 151643, "eos_token_id": 151645})
    assert c.num_params() == 8_190_735_360  # Qwen3-8B's published parameter count
    rc = main(["plan", "--model", str(directory), "--batch", "1", "--seq", "4096", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("memory plan for Qwen3-8B (8.191 G params), batch 1 x 4096 tokens, untiled\n")
    arena = 12 * ModelLayout.build(c).numel / GiB  # fp32 params, Adam m and v
    assert f"  {'arena: params + Adam m,v (fp32)':<42}{arena:>10.2f} GiB\n" in out
    assert rc == (0 if "fits: yes" in out else 1)
