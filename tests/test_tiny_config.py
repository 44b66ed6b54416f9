"""megatrain/model/tiny_config.py: tiny configs of the same model type and options, with tiny widths, every
layer structure of the real model kept, special token ids inside the tiny vocabulary, deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain.model.tiny_config import layer_structures, special_token_ids, text_config, tiny_config
from megatrain.model.tiny_widths import EXPERTS, HIDDEN, VOCAB

REAL = Path(__file__).parent / "data" / "hf_configs"


def tiny_of(model_type: str, **options: object):
    return tiny_config(AutoConfig.for_model(model_type, **options))


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "deepseek_v3", "qwen3_next", "gemma3", "jamba",
                                        "nemotron_h", "falcon_h1", "lfm2", "granitemoehybrid", "llama4", "mamba2"])
def test_every_layer_structure_survives(model_type: str) -> None:
    real = AutoConfig.for_model(model_type)
    tiny = tiny_config(real)
    assert tiny.model_type == real.model_type and type(tiny) is type(real)
    text = text_config(tiny)
    assert text.hidden_size == HIDDEN and text.vocab_size == VOCAB
    assert text.num_hidden_layers <= 8
    # tiny_config itself checks that the real depth has no layer structure the tiny depth lacks
    _, structures = layer_structures(tiny)
    assert len(structures) == text.num_hidden_layers


def test_structures_kept_are_the_real_ones() -> None:
    """DeepSeek-V3: three dense layers, then MoE; Qwen3-Next: three linear-attention layers, then a full one; Gemma
    3: five sliding, then a global one (its layer_types): one of each, in the real order."""
    v3 = text_config(tiny_of("deepseek_v3"))
    assert v3.first_k_dense_replace >= 1 and v3.num_hidden_layers > v3.first_k_dense_replace
    assert v3.n_routed_experts == EXPERTS and v3.num_experts_per_tok == 2 and v3.q_lora_rank and v3.kv_lora_rank
    assert set(text_config(tiny_of("qwen3_next")).layer_types) == {"linear_attention", "full_attention"}
    assert text_config(tiny_of("gemma3")).layer_types == ["sliding_attention", "full_attention"]
    neo = tiny_of("gpt_neo")
    assert neo.attention_layers == ["global", "local"]


def test_per_layer_lists_and_layer_indices_follow_the_cut() -> None:
    llama4 = text_config(tiny_of("llama4"))
    assert len(llama4.no_rope_layers) == len(llama4.layer_types) == llama4.num_hidden_layers
    assert 0 in llama4.no_rope_layers  # the NoPE layer of every four
    zamba2 = tiny_of("zamba2")
    assert zamba2.hybrid_layer_ids == [i for i, t in enumerate(zamba2.layers_block_type) if t == "hybrid"]


def test_special_token_ids_are_renumbered_into_the_vocabulary() -> None:
    real = AutoConfig.for_model("qwen3_5")  # image / video / vision-start ids near 248k
    tiny = tiny_config(real)
    ids = special_token_ids(tiny)
    assert ids and max(ids) < text_config(tiny).vocab_size
    assert len(ids) == len(special_token_ids(real))  # distinct ids stay distinct


def test_a_saved_config_json_with_infinities(tmp_path: Path) -> None:
    AutoConfig.for_model("mamba2").save_pretrained(tmp_path)  # time_step_limit (0, inf)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert text_config(tiny_config(hf)).time_step_limit[1] == float("inf")


def test_deterministic_and_buildable_from_a_config_dict() -> None:
    hf = json.loads((REAL / "qwen3-30b-a3b.json").read_text())
    first, second = tiny_config(hf), tiny_config(dict(hf))
    assert first.to_dict() == second.to_dict()
    assert first.model_type == "qwen3_moe" and first.num_experts == EXPERTS
    model = AutoModelForCausalLM.from_config(first)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


@pytest.mark.parametrize("name", sorted(p.stem for p in REAL.glob("*.json")))
def test_real_configs_shrink(name: str) -> None:
    """Published config.json files (a VLM among them): the tiny model builds, its text model has tiny widths."""
    hf = json.loads((REAL / f"{name}.json").read_text())
    tiny = tiny_config(hf)
    assert tiny.model_type == hf["model_type"] and text_config(tiny).hidden_size == HIDDEN
    model = AutoModelForCausalLM.from_config(tiny)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
