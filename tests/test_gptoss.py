"""GPT-OSS as published: its experts' weights stored in MXFP4 (megatrain/io/mxfp4.py), decoded as they load to the
values transformers' own loading gives, trained with fp32 masters against transformers' model of the same
checkpoint, saved dense so that transformers loads the trained model; and the refusals of a torn or corrupt pair."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    SHAPE,
    THREE_STEPS_OPTIM,
    assert_engine_matches_transformers,
    assert_matches,
    assert_one_sentence,
    batch,
    build_hf_model,
    fp64_grads,
    hf_loss_and_grads,
    make_labels,
)
from mxfp4_helpers import dequantize_reference, quantize_mxfp4, write_mxfp4_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig

import megatrain
from megatrain.io import mxfp4
from megatrain.model.hf_model import NO_DECAY

# alternating sliding (window 8 < the tests' 16 tokens) and full layers, attention sinks, expert biases, the aux loss;
# hidden 64 and intermediate 32: the experts' inputs are two and one blocks of 32 values
CONFIG = dict(**SHAPE, num_experts_per_tok=2, router_aux_loss_coef=0.05, intermediate_size=32, num_hidden_layers=2,
              num_local_experts=4, sliding_window=8, output_router_logits=True)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny GPT-OSS checkpoint in the published layout, and transformers' own model loaded from it (fp32)."""
    directory = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    decoded = write_mxfp4_checkpoint(build_hf_model(GptOssConfig(**CONFIG)), directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    assert all(torch.equal(params[name], t) for name, t in decoded.items())  # transformers decoded them, as we do
    return directory, hf


def test_decoding_is_transformers_bit_for_bit() -> None:
    """Every byte of blocks (both nibbles, ±0 among them) under scales from 2**-127 up to 2**125, against
    transformers' own decoding, bit for bit; the tests' quantizer is its exact inverse on the values MXFP4 holds."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(6)[torch.randperm(1536, generator=gen)].view(3, 8, 4, 16)
    scales = torch.randint(0, 253, (3, 8, 4), generator=gen, dtype=torch.uint8)  # 6 * 2**126 is beyond fp32
    scales[0, 0, :2] = torch.tensor([0, 252], dtype=torch.uint8)
    ours = mxfp4.Mxfp4Weight("w", blocks, scales).dequantize()
    theirs = dequantize_reference(blocks, scales)
    assert ours.shape == theirs.shape == (3, 128, 8)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))  # -0.0 and subnormals too
    assert torch.equal(mxfp4.Mxfp4Weight("w", *quantize_mxfp4(ours)).dequantize(), ours)


def test_trains_with_transformers_loss_and_grads(published: tuple[Path, torch.nn.Module]) -> None:
    directory, hf = published
    input_ids = batch()
    labels = make_labels("masked", input_ids)
    with megatrain.from_pretrained(directory) as model:
        assert type(model.executor.arch).__name__ == "GenericArchitecture"
        ours = model.loss_and_grads(input_ids, labels)
        ours = (ours[0], {k: v.clone() for k, v in ours[1].items()})
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, labels), fp64_grads(hf, input_ids, labels))


def test_save_pretrained_is_dense_and_loads_in_transformers(published: tuple[Path, torch.nn.Module],
                                                           tmp_path: Path) -> None:
    directory, hf = published
    with megatrain.from_pretrained(directory) as model:
        saved = model.save_pretrained(tmp_path / "out")
    config = json.loads((saved / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    stored = load_file(saved / "model.safetensors")
    assert not any(name.endswith(mxfp4.SUFFIXES) for name in stored)
    assert all(t.dtype == torch.float32 for t in stored.values())
    back = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager", dtype=torch.float32).eval()
    input_ids = batch(seed=5)
    with torch.no_grad():
        assert torch.equal(back(input_ids).logits, hf(input_ids).logits)


# CI: the loss and gradients above (the Engine's store loads the checkpoint by the same code, in its own process)
@pytest.mark.slow
def test_engine_three_steps_match_transformers_adamw(published: tuple[Path, torch.nn.Module], ray_session) -> None:
    """Three Engine steps with clipping on, fp32 masters, from the MXFP4 checkpoint: against transformers (which
    decodes it as it loads) + torch.optim.AdamW decaying what megatrain decays, judged against an fp64 run (Adam's
    eps as test_model_families sets it for GPT-OSS)."""
    directory, _ = published
    assert_engine_matches_transformers(directory, NO_DECAY.search, {**THREE_STEPS_OPTIM, "eps": 1e-6})


@pytest.mark.slow
def test_engine_saves_what_it_trained_for_transformers(published: tuple[Path, torch.nn.Module], tmp_path: Path,
                                                       ray_session) -> None:
    """A step of the Engine, then save_pretrained: transformers loads exactly the fp32 weights the Engine trained."""
    directory, _ = published
    ids = batch(seed=7)
    with megatrain.Engine(directory, optimizer_workers=1, precision="fp32", device="cpu", max_grad_norm=1.0,
                          **{**THREE_STEPS_OPTIM, "warmup_steps": 0}) as engine:  # the first step's lr not 0
        engine.step(ids, ids)
        trained = engine.parameters()
        saved = engine.save_pretrained(tmp_path / "out")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    back = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    state = back.state_dict()
    assert trained.keys() == state.keys()
    assert all(torch.equal(state[name], t) for name, t in trained.items())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(trained[name], dict(published[1].named_parameters())[name])  # trained, not as loaded


def test_pairs_split_across_shards_load(published: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """The published checkpoints come in shards: a tensor's blocks in one file and its scales in another still make
    one weight, and every tensor loads as transformers loads it."""
    directory, hf = published
    tensors = load_file(directory / "model.safetensors")
    first = {n: t for n, t in tensors.items() if not n.endswith("_scales")}
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in first}}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((directory / "config.json").read_text())
    for fname, part in shards.items():
        save_file(part, sharded / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: fname for fname, part in shards.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with megatrain.from_pretrained(sharded) as model:
        ours = model.parameters()
    theirs = dict(hf.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], t) for name, t in theirs.items())


def rewrite(directory: Path, target: Path, change) -> Path:
    target.mkdir()
    (target / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def drop_scales(tensors: dict[str, torch.Tensor]) -> None:
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]


def nan_scale(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.0.mlp.experts.gate_up_proj_scales"][1, 2, 0] = 255  # e8m0's NaN


def huge_scale(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.1.mlp.experts.down_proj_scales"][3, 0, 0] = 254  # 2**127 times FP4's 6: beyond fp32


def wrong_dtype(tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name].to(torch.int32)


@pytest.mark.parametrize("change, words", [
    (drop_scales, "holds model.layers.1.mlp.experts.down_proj_blocks without model.layers.1.mlp.experts.down_proj_"
                  "scales"),
    (nan_scale, "model.layers.0.mlp.experts.gate_up_proj decodes to values beyond fp32's range"),
    (huge_scale, "model.layers.1.mlp.experts.down_proj decodes to values beyond fp32's range"),
    (wrong_dtype, "are not MXFP4 expert weights"),
])
def test_refuses_torn_or_corrupt_mxfp4(published: tuple[Path, torch.nn.Module], tmp_path: Path, change,
                                       words: str) -> None:
    broken = rewrite(published[0], tmp_path / "broken", change)
    with pytest.raises(megatrain.MegatrainError) as e:
        megatrain.from_pretrained(broken)
    assert words in str(e.value)
    assert_one_sentence(str(e.value))


def test_decode_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/mxfp4_load.py at a 32nd of the widths: its table and the whole models' decode times (no rate is
    asserted: on a CI machine it means nothing)."""
    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:  # benchmarks/ is no installed package
        sys.path.insert(0, repo)
    assert importlib.import_module("benchmarks.mxfp4_load").main(["--experts", "2", "--repeats", "1",
                                                                   "--scale", "32"]) == 0
    out = capsys.readouterr().out
    assert "gate_up_proj" in out and "down_proj" in out and "gpt-oss-120b: 4608 experts" in out
