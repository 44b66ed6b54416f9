"""Parity with HF transformers: loss and every gradient of the streamed executor match `loss.backward()` of
the HF model (fp32, CPU), and checkpoints written by megatrain load in transformers with identical logits.

Each model family (helpers.FAMILIES) is a random tiny HF model (every parameter perturbed so biases and norms are not at
their init values) saved with `save_pretrained` and loaded with `megatrain.from_pretrained`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    BATCH,
    FAMILIES,
    REL_TOL,
    SEQ,
    VOCAB,
    assert_matches_hf,
    assert_one_sentence,
    batch,
    build_hf_model,
    hf_loss_and_grads,
    make_labels,
    rel_err,
    saved_hf_model,
)
from transformers import AutoModelForCausalLM

import megatrain
from megatrain import ConfigError, MegatrainError
from megatrain.io.checkpoint import save_hf
from megatrain.memory.arena import list_segments

Family = tuple[str, torch.nn.Module, Path]  # (name, the HF model, the directory it was saved to)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    hf, directory = saved_hf_model(FAMILIES[request.param](), tmp_path_factory, request.param)
    yield request.param, hf, directory


@pytest.fixture(scope="module")
def mt_model(family: Family) -> Iterator[megatrain.Model]:
    with megatrain.from_pretrained(family[2]) as model:
        yield model


@pytest.mark.parametrize("labels_kind", ["none", "full", "masked"])
def test_loss_and_grads_match_hf(family: Family, mt_model: megatrain.Model, labels_kind: str) -> None:
    _, hf, _ = family
    input_ids = batch()
    labels = make_labels(labels_kind, input_ids)
    hf_loss, hf_grads = hf_loss_and_grads(hf, input_ids, input_ids if labels is None else labels)
    loss, grads = mt_model.loss_and_grads(input_ids, labels)
    assert_matches_hf(loss, grads, hf_loss, hf_grads)


def test_loaded_config_and_weights(family: Family, mt_model: megatrain.Model) -> None:
    name, hf, _ = family
    c = mt_model.config
    assert c.model_type == hf.config.model_type
    assert c.head_dim == (24 if name in ("mistral-head-dim", "qwen3-head-dim") else 16)
    assert c.qk_norm == (name == "qwen3-head-dim")
    assert c.tie_embeddings == (name == "qwen2-tied")
    assert c.qkv_bias == (name in ("qwen2-tied", "llama3-rope"))
    if name == "llama3-rope":
        assert c.rope_theta == 500000.0
        assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    params = mt_model.parameters()
    hf_params = dict(hf.named_parameters())
    assert set(params) == set(hf_params)
    for n, p in hf_params.items():
        assert torch.equal(params[n], p.detach()), n


def test_repeated_steps_do_not_accumulate(family: Family, mt_model: megatrain.Model) -> None:
    """Gradients of a step are those of that batch alone (the arena's grads are overwritten, not summed),
    including embedding rows a previous batch touched and this one does not."""
    _, hf, _ = family
    mt_model.loss_and_grads(torch.randint(0, VOCAB // 2, (BATCH, SEQ)))
    input_ids = torch.randint(VOCAB // 2, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    hf_loss, hf_grads = hf_loss_and_grads(hf, input_ids, input_ids)
    loss, grads = mt_model.loss_and_grads(input_ids)
    assert_matches_hf(loss, grads, hf_loss, hf_grads)


@pytest.mark.parametrize("shape", [(1, 2), (1, 37), (4, 5)])
def test_other_batch_shapes_match_hf(family: Family, mt_model: megatrain.Model,
                                     shape: tuple[int, int]) -> None:
    _, hf, _ = family
    input_ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(11))
    # with seq 2 the one target sees one key, so q/k grads are truly zero: allow zeros here
    assert_matches_hf(*mt_model.loss_and_grads(input_ids), *hf_loss_and_grads(hf, input_ids, input_ids),
                      all_nonzero=False)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 17])
def test_chunked_loss_matches_hf(family: Family, chunk_tokens: int) -> None:
    _, hf, directory = family
    input_ids = batch(seed=2)
    labels = make_labels("masked", input_ids)
    hf_loss, hf_grads = hf_loss_and_grads(hf, input_ids, labels)
    with megatrain.from_pretrained(directory, loss_chunk_tokens=chunk_tokens) as model:
        assert chunk_tokens < input_ids.numel()
        loss, grads = model.loss_and_grads(input_ids, labels)
        assert_matches_hf(loss, grads, hf_loss, hf_grads)


def test_save_pretrained_loads_in_transformers(family: Family, mt_model: megatrain.Model,
                                               tmp_path: Path) -> None:
    _, hf, _ = family
    out = mt_model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert type(reloaded) is type(hf)
    input_ids = batch(seed=4)
    with torch.no_grad():
        expected = hf(input_ids=input_ids).logits
        actual = reloaded(input_ids=input_ids).logits
    assert rel_err(actual, expected) <= REL_TOL


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-tied"])
def test_sharded_save_loads_in_transformers_and_megatrain(name: str, tmp_path: Path) -> None:
    hf = build_hf_model(FAMILIES[name]())
    hf.save_pretrained(tmp_path / "src")
    out = tmp_path / "sharded"
    with megatrain.from_pretrained(tmp_path / "src") as model:
        save_hf(out, model.layout, model.store.arena.params, shard_bytes=64 * 1024)
        shards = sorted(out.glob("model-*-of-*.safetensors"))
        assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
        assert not (out / "model.safetensors").exists()
        reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
        input_ids = batch(seed=5)
        with torch.no_grad():
            assert rel_err(reloaded(input_ids=input_ids).logits, hf(input_ids=input_ids).logits) <= REL_TOL
    with megatrain.from_pretrained(out) as again:  # megatrain reads its own sharded output too
        hf_params = dict(hf.named_parameters())
        for n, p in again.parameters().items():
            assert torch.equal(p, hf_params[n].detach()), n


# ---- bad input: one clear sentence, and the model is still usable afterwards ----

@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, megatrain.Model]]:
    hf, directory = saved_hf_model(FAMILIES["llama-gqa"](), tmp_path_factory, "llama-bad-input")
    with megatrain.from_pretrained(directory) as model:
        yield hf, model


def _bad_ids_high() -> tuple[torch.Tensor, None]:
    ids = batch()
    ids[1, 3] = VOCAB
    return ids, None


def _bad_ids_negative() -> tuple[torch.Tensor, None]:
    ids = batch()
    ids[0, 0] = -1
    return ids, None


def _bad_labels_shape() -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch()
    return ids, ids[:, :-1].clone()


def _bad_labels_all_ignored() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(), torch.full((BATCH, SEQ), -100)


def _bad_labels_only_first_column() -> tuple[torch.Tensor, torch.Tensor]:
    # position 0 is never a target (labels shift left by one), so this batch has nothing to learn either
    labels = torch.full((BATCH, SEQ), -100)
    labels[:, 0] = 5
    return batch(), labels


def _bad_label_value() -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch()
    labels = ids.clone()
    labels[2, 7] = VOCAB + 372
    return ids, labels


def _bad_ids_rank() -> tuple[torch.Tensor, None]:
    return batch()[0], None


def _bad_ids_float() -> tuple[torch.Tensor, None]:
    return batch().float() + 0.5, None


def _bad_labels_float() -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch()
    return ids, ids.float() + 0.5  # truncating would train on other targets than the user meant


@pytest.mark.parametrize("make, expected", [
    (_bad_ids_high, rf"token id {VOCAB} is outside the model's vocabulary \[0, {VOCAB}\)"),
    (_bad_ids_negative, rf"token id -1 is outside the model's vocabulary \[0, {VOCAB}\)"),
    (_bad_labels_shape,
     rf"labels must have the shape of input_ids \({BATCH}, {SEQ}\), got \({BATCH}, {SEQ - 1}\)"),
    (_bad_labels_all_ignored, r"no tokens to train on \(every label is -100\)"),
    (_bad_labels_only_first_column, r"no tokens to train on"),
    (_bad_label_value, rf"label {VOCAB + 372} is outside the vocabulary \[0, {VOCAB}\) and is not -100"),
    (_bad_ids_rank, rf"input_ids must be \[batch, seq\] with seq >= 2, got shape \({SEQ},\)"),
    (_bad_ids_float, r"input_ids must hold integer token ids, got dtype torch.float32"),
    (_bad_labels_float, r"labels must hold integer token ids \(-100 = ignored\), got dtype torch.float32"),
], ids=lambda v: v.__name__ if callable(v) else "")
def test_bad_input_is_one_clear_sentence(llama: tuple[torch.nn.Module, megatrain.Model],
                                         make: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
                                         expected: str) -> None:
    hf, model = llama
    input_ids, labels = make()
    with pytest.raises(MegatrainError, match=expected) as info:
        model.loss_and_grads(input_ids, labels)
    assert_one_sentence(str(info.value))
    # a refused batch leaves the model as it was
    good = batch(seed=9)
    assert_matches_hf(*model.loss_and_grads(good), *hf_loss_and_grads(hf, good, good))


def test_unusable_device_is_refused_without_leaking_the_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mine = f"-{os.getpid()}-"
    before = {p for p in list_segments() if mine in p.name}
    with pytest.raises(ConfigError, match="device 'cuda' was asked for but no CUDA GPU is visible") as info:
        megatrain.from_pretrained("tiny", device="cuda")
    assert_one_sentence(str(info.value))
    assert {p for p in list_segments() if mine in p.name} == before


def test_a_device_that_is_neither_cpu_nor_cuda_is_refused() -> None:
    with pytest.raises(ConfigError,
                       match=r"device must be auto, cpu, cpu-async\[:SEED\], cuda or cuda:N, got 'tpu'") as info:
        megatrain.from_pretrained("tiny", device="tpu")
    assert_one_sentence(str(info.value))


def test_a_closed_model_says_so() -> None:
    model = megatrain.from_pretrained("tiny")
    model.close()
    for use in (lambda: model.loss_and_grads(torch.zeros(1, 4, dtype=torch.long)), model.parameters,
                lambda: model.save_pretrained("never-written")):
        with pytest.raises(MegatrainError, match="this model was closed") as info:
            use()
        assert_one_sentence(str(info.value))
    assert not Path("never-written").exists()
