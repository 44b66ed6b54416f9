"""Native Gemma 2 and Gemma 3 (text) against transformers' Gemma2ForCausalLM / Gemma3ForCausalLM: config.json in and
out, loss and every gradient (also under simulated streams, with packed documents and with sequence tiles),
save_pretrained, a new model's init, the plan of the real Gemma-2-9B and Gemma-3-4B / 12B text configs, and the
one-sentence refusals; slow: three Engine steps against torch.optim.AdamW. The tiny configs are test_hf_generic's,
which runs the same models on the generic path."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    REAL,
    VOCAB,
    assert_engine_matches_transformers,
    assert_matches,
    assert_one_sentence,
    batch,
    build_hf_model,
    fp64_grads,
    gemma2_config,
    gemma3_config,
    hf_loss_and_grads,
    make_labels,
    saved_hf_model,
)
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, PretrainedConfig

import megatrain
from megatrain import ConfigError
from megatrain.model import ops
from megatrain.model.layout import ModelLayout
from pipelines.cli import main

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny(name: str) -> PretrainedConfig:
    """gemma2: test_hf_generic's (tied, both soft-caps, window 8 < the tests' 16 tokens, alternating layers);
    gemma3: test_hf_generic's with an untied head and attention biases (q/k norms, a linear-scaled global rotary)."""
    if name == "gemma2":
        return gemma2_config()
    config = gemma3_config()
    config.tie_word_embeddings, config.attention_bias = False, True
    return Gemma3TextConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[torch.nn.Module, Path]]:
    # every parameter perturbed off its init, norms included
    hf, directory = saved_hf_model(tiny(request.param), tmp_path_factory, request.param)
    yield hf, directory


def grads_of(model: megatrain.Model, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, grads = model.loss_and_grads(*args, **kwargs)
    return loss, {k: v.clone() for k, v in grads.items()}


# ---- config.json in and out ----

@pytest.mark.parametrize("make", [
    lambda: tiny("gemma2"),
    lambda: tiny("gemma3"),
    lambda: Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                         attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=False),
    lambda: Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=7,
                             rope_local_base_freq=5000.0, rope_theta=5e5, final_logit_softcapping=20.0),
    lambda: Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=3,
                             layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
], ids=["gemma2", "gemma3", "gemma2-uncapped-untied", "gemma3-pattern-local-base", "gemma3-layer-list"])
def test_hf_round_trip(make: Any) -> None:
    """megatrain's config.json is read by transformers as the same model: every key its layers use."""
    hf = make()
    c = megatrain.ModelConfig.from_hf(hf.to_dict())
    assert c.model_type == hf.model_type and c.sliding_window is None
    assert megatrain.ModelConfig.from_hf(c.to_hf()) == c
    back = AutoConfig.for_model(**c.to_hf())
    assert type(back) is type(hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                "max_position_embeddings", "rope_parameters", "layer_types", "sliding_window",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
                "pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(back, key) == getattr(hf, key), key


def test_layout_is_transformers_and_decay_skips_norms() -> None:
    for name in ("gemma2", "gemma3"):
        hf = build_hf_model(tiny(name))
        c = megatrain.ModelConfig.from_hf(hf.config.to_dict())
        slots = {s.hf_name: s for u in ModelLayout.build(c).units for s in u.slots}
        assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == {n: s.shape for n, s in slots.items()}
        assert c.num_params() == sum(p.numel() for p in hf.parameters())
        assert {n for n, s in slots.items() if not s.decay} == {
            n for n, _ in hf.named_parameters() if n.endswith("norm.weight") or n.endswith(".bias")}


# ---- loss and gradients ----

@pytest.mark.parametrize("device, labels_kind", [("cpu", "full"), ("cpu", "masked"), ("cpu-async:0", "masked")])
def test_loss_and_grads_match_transformers(gemma: tuple[torch.nn.Module, Path], device: str, labels_kind: str
                                           ) -> None:
    """Within 1e-5 of transformers in fp32 (or, where transformers' fp32 is further than that from its fp64 run,
    within twice its distance): helpers.assert_matches."""
    hf, directory = gemma
    input_ids = batch()
    labels = make_labels(labels_kind, input_ids)
    with megatrain.from_pretrained(directory, device=device) as model:
        assert type(model.executor.arch).__name__ == "GemmaArchitecture"  # the native path, not the generic one
        ours = grads_of(model, input_ids, labels)
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, labels), fp64_grads(hf, input_ids, labels))


def test_packed_documents_and_tiles_match_transformers(gemma: tuple[torch.nn.Module, Path]) -> None:
    """Packed documents (position_ids from 0 in each) attend within themselves, the sliding window counted inside
    each, as transformers reads packed positions in training; and the MLP half run in tiles of 5 tokens."""
    hf, directory = gemma
    input_ids = batch(seed=2)
    position_ids = torch.cat([torch.arange(11), torch.arange(5)]).expand(3, 16).clone()
    position_ids[1] = torch.cat([torch.arange(4), torch.arange(12)])
    position_ids[2] = torch.arange(16)

    def reference(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=input_ids, labels=input_ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    exact = reference(copy.deepcopy(hf).double())
    with megatrain.from_pretrained(directory, tile_tokens=5) as model:
        assert_matches(grads_of(model, input_ids, input_ids, position_ids), reference(hf), exact)
        assert_matches(grads_of(model, input_ids, input_ids), hf_loss_and_grads(hf, input_ids, input_ids),
                       fp64_grads(hf, input_ids, input_ids))


def test_save_pretrained_loads_in_transformers_with_identical_logits(gemma: tuple[torch.nn.Module, Path],
                                                                     tmp_path: Path) -> None:
    hf, directory = gemma
    with megatrain.from_pretrained(directory) as model:
        out = model.save_pretrained(tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == {n for n, _ in hf.named_parameters()}
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf)
    input_ids = batch(seed=5)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids).logits, hf(input_ids=input_ids).logits)


def test_a_new_gemma_starts_as_transformers_does(tmp_path: Path) -> None:
    """Built from a config: its (1 + w) norms start at 0, as transformers initialises them; saved, loaded by
    transformers: the same loss."""
    config = megatrain.ModelConfig.from_hf(tiny("gemma3").to_dict())
    input_ids = batch()
    with megatrain.from_pretrained(config, seed=3) as model:
        loss, _ = model.loss_and_grads(input_ids)
        out = model.save_pretrained(tmp_path / "new")
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.zeros_like(p)), name
    with torch.no_grad():
        assert float(hf(input_ids=input_ids, labels=input_ids).loss) == pytest.approx(float(loss), rel=1e-5)


# ---- three Engine steps against transformers + AdamW ----

# slow: CI holds both models' loss and every gradient to transformers (above), and three Engine steps to transformers +
# AdamW on llama (test_engine.py), qwen3 (test_qwen3.py) and gpt2 (test_model_families.py): the Engine streams every
# family's units alike
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_engine_matches_transformers_and_adamw(name: str, ray_session: None, tmp_path: Path) -> None:
    build_hf_model(tiny(name)).save_pretrained(tmp_path)
    assert_engine_matches_transformers(tmp_path)


# ---- the plan of real configs ----

@pytest.mark.parametrize("name, preset, params", [("gemma-2-9b", "gemma2-9b", 9_241_705_984),
                                                  ("gemma-3-4b", "gemma3-4b", 3_880_263_168),
                                                  ("gemma-3-12b", "gemma3-12b", 11_766_034_176)])
def test_plan_of_real_configs(name: str, preset: str, params: int, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma-2-9B's config.json as published; Gemma-3-4B's and 12B's text decoders (their checkpoints' text_config)
    as gemma3_text configs. Parameter counts: transformers' own models of these configs."""
    (tmp_path / "config.json").write_text((REAL / f"{name}.json").read_text())
    c = megatrain.ModelConfig.from_hf(tmp_path)
    assert c == megatrain.ModelConfig.from_name(preset)
    assert c.num_params() == params
    code = main(["plan", "--model", str(tmp_path), "--batch", "1", "--seq", "4096", "--device", "cuda",
                 "--gpu-gib", "80"])
    out = capsys.readouterr().out
    assert ("fits: yes" if code == 0 else "fits: NO: ") in out  # this machine's host memory decides which
    assert float(re.search(r"\(([\d.]+) G params\)", out).group(1)) == round(params / 1e9, 3)  # type: ignore[union-attr]
    arena = 12 * ModelLayout.build(c).numel / 2**30  # fp32 params, Adam m and v
    assert f"{arena:>10.2f} GiB\n" in out


# ---- what megatrain refuses ----

# what the Gemma layer does not implement takes the generic path (tests/test_native_fallback.py trains one)
@pytest.mark.parametrize("name, key, value", [
    ("gemma2", "hidden_activation", "gelu"), ("gemma3", "use_bidirectional_attention", True),
    ("gemma2", "attention_dropout", 0.1),
    ("gemma3", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
], ids=["activation", "bidirectional", "dropout", "sliding-rope"])
def test_what_the_layer_does_not_implement_takes_the_generic_path(name: str, key: str, value: Any) -> None:
    c = megatrain.ModelConfig.from_hf({**tiny(name).to_dict(), key: value})
    assert c.hf_config is not None and type(c.family).__name__ == "GenericFamily"


@pytest.mark.parametrize("make, expected", [
    (lambda: megatrain.ModelConfig.from_hf({**tiny("gemma3").to_dict(), "layer_types": ["full_attention"]}),
     r"layer_types must list 'full_attention' or 'sliding_attention' for each of its num_hidden_layers \(3\)"),
    (lambda: megatrain.ModelConfig(hidden_size=64, num_heads=4, model_type="gemma2", sliding_window=64),
     r"a gemma2 model's window is family_options' sliding_window"),
    (lambda: megatrain.ModelConfig(hidden_size=64, num_heads=4, model_type="gemma2",
                                   family_options={"sliding_window": None}),
     r"has sliding-window layers but no sliding_window"),
    (lambda: megatrain.ModelConfig(hidden_size=64, num_heads=4, model_type="gemma3_text",
                                   family_options={"attn_softcap": 5.0}),
     r"family_options has key\(s\) attn_softcap that gemma3_text does not know"),
], ids=["layer-types-length", "window-field", "no-window", "unknown-key"])
def test_what_megatrain_does_not_implement_is_refused(make: Any, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        make()
    assert_one_sentence(str(info.value))


@pytest.mark.parametrize("softcap", [None, 50.0], ids=["sdpa", "capped"])
def test_attention_blocks_do_not_change_the_result(softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windowed attention over blocks of 3 query rows (each with the keys its window reaches) is attention over one
    block of all rows: the blocks' key ranges are where the windows begin."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 20, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    whole = ops.windowed_attention(q, k, v, window=5, scale=0.3, softcap=softcap)
    monkeypatch.setattr(ops, "ATTENTION_BLOCK", 3)
    assert torch.allclose(ops.windowed_attention(q, k, v, window=5, scale=0.3, softcap=softcap), whole)
