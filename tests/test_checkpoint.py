"""Checkpoints: HF directories that are broken in each way a user meets are refused with one sentence (and
leave no shared memory behind); training checkpoints round-trip and are verified; writes are atomic."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_one_sentence, my_segments
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import megatrain
from megatrain import ConfigError, MegatrainError
from megatrain.io import checkpoint as ckpt
from megatrain.io.checkpoint import CheckpointError, atomic_directory
from megatrain.store import ParameterStore

HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**HF_CONFIG), dtype=torch.float32)
    directory = tmp_path_factory.mktemp("hf-source")
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def hf_copy(hf_source: Path, tmp_path: Path) -> Path:
    """A fresh copy of a valid HF directory that a test may break."""
    return Path(shutil.copytree(hf_source, tmp_path / "model"))


def rewrite_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---- broken HF directories ----

def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _only_pickle(d: Path) -> None:
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _truncated(d: Path) -> None:
    path = d / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)


def _garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x00" * 100)


def _wrong_shape(d: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    rewrite_weights(d, edit)


def _missing_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def _extra_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(48, 32)}))


def _int_tensor(d: Path) -> None:
    rewrite_weights(d, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int64)}))


def _missing_shard(d: Path) -> None:
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _bad_index(d: Path) -> None:
    (d / "model.safetensors.index.json").write_text("{not json")


def _config_of_other_model(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(config))


BROKEN: list[tuple[Callable[[Path], None], type[MegatrainError], str]] = [
    (_no_config, ConfigError,
     r"no HF config at .*config\.json; pass a model directory that holds config\.json"),
    (_no_weights, CheckpointError,
     r"no model\.safetensors or model\.safetensors\.index\.json in .*model\.$"),
    (_only_pickle, CheckpointError,
     r"found pytorch_model\.bin: megatrain never loads pickles; convert them to safetensors first"),
    (_truncated, CheckpointError,
     r"model\.safetensors is not a readable safetensors file .* truncated or corrupt"),
    (_garbage, CheckpointError, r"model\.safetensors is not a readable safetensors file"),
    (_wrong_shape, CheckpointError,
     r"tensor model\.layers\.1\.self_attn\.k_proj\.weight has shape \(8, 32\) "
     r"but the config implies \(16, 32\)"),
    (_missing_tensor, CheckpointError,
     r"lacks tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight; the checkpoint is incomplete"),
    (_extra_tensor, CheckpointError,
     r"has tensor 'model\.layers\.2\.mlp\.up_proj\.weight' that a llama model of this config does not have"),
    (_int_tensor, CheckpointError,
     r"tensor model\.norm\.weight has dtype torch\.int64, not a floating-point type"),
    (_missing_shard, CheckpointError,
     r"is missing shard\(s\) model-00002-of-00002\.safetensors listed in model\.safetensors\.index\.json"),
    (_bad_index, CheckpointError, r"model\.safetensors\.index\.json is not a valid safetensors index"),
    (_config_of_other_model, CheckpointError,
     r"mlp\.(down|gate|up)_proj\.weight has shape \((48, 32|32, 48)\) "
     r"but the config implies \((64, 32|32, 64)\)"),
]


@pytest.mark.parametrize("breakage, error, expected", BROKEN,
                         ids=[b.__name__.strip("_") for b, _, _ in BROKEN])
def test_broken_hf_directory_is_refused(hf_copy: Path, breakage: Callable[[Path], None],
                                        error: type[MegatrainError], expected: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    breakage(hf_copy)

    def no_pickles(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("megatrain called torch.load")

    monkeypatch.setattr(torch, "load", no_pickles)
    before = my_segments()
    with pytest.raises(error, match=expected) as info:
        megatrain.from_pretrained(hf_copy)
    assert isinstance(info.value, MegatrainError)
    assert_one_sentence(str(info.value))
    # the arena of a store that failed to load is gone at once, not when the traceback is collected
    assert my_segments() == before


@pytest.mark.parametrize("path", ["no/such/dir", "weights.safetensors"])
def test_neither_directory_nor_preset(tmp_path: Path, path: str) -> None:
    with pytest.raises(ConfigError, match="is neither an HF model directory nor a preset name") as info:
        megatrain.from_pretrained(tmp_path / path)
    assert_one_sentence(str(info.value))


def test_harmless_extras_load(hf_copy: Path) -> None:
    """Exporters' rotary inv_freq buffers are skipped; a tied checkpoint may carry lm_head (the embedding)."""
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    rewrite_weights(hf_copy, lambda t: t.update({inv_freq: torch.ones(4)}))
    with megatrain.from_pretrained(hf_copy) as model:
        expected = load_file(hf_copy / "model.safetensors")
        for name, p in model.parameters().items():
            assert torch.equal(p, expected[name]), name
    config = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    embed = "model.embed_tokens.weight"
    with pytest.raises(MegatrainError, match="lm_head.weight differs from model.embed_tokens.weight"):
        megatrain.from_pretrained(hf_copy)  # a separately trained head must not be dropped silently
    rewrite_weights(hf_copy, lambda t: t.update({"lm_head.weight": t[embed].clone()}))
    with megatrain.from_pretrained(hf_copy) as model:
        assert "lm_head.weight" not in model.parameters()
        assert torch.equal(model.parameters()[embed], expected[embed])


# ---- training checkpoints ----

@pytest.fixture
def store() -> Iterator[ParameterStore]:
    s = ParameterStore("tiny", seed=0)
    yield s
    s.close()


def randomize(s: ParameterStore, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for flat in (s.arena.params, s.arena.exp_avg, s.arena.exp_avg_sq):
        for view in s.layout.hf_views(flat).values():
            view.copy_(torch.randn(view.shape, generator=gen).abs())


def assert_same_state(a: ParameterStore, b: ParameterStore) -> None:
    for segment in ("params", "exp_avg", "exp_avg_sq"):
        mine = a.layout.hf_views(a.arena.tensors[segment])
        theirs = b.layout.hf_views(b.arena.tensors[segment])
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (segment, name)


STATE = {"updates_applied": 3, "step": 3, "tokens_seen": 4096, "data": {"epoch": 0, "offset": 17}}


@pytest.fixture
def saved(store: ParameterStore, tmp_path: Path) -> Path:
    randomize(store, seed=1)
    return store.save_checkpoint(tmp_path / "ckpt", STATE)


def test_checkpoint_round_trip(store: ParameterStore, saved: Path) -> None:
    assert sorted(p.name for p in saved.iterdir()) == [
        "config.json", "manifest.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"]
    ckpt.verify_manifest(saved)
    other = ParameterStore("tiny", seed=5)
    try:
        other.arena.grads.fill_(1.0)
        state = other.load_checkpoint(saved)
        assert state == STATE
        assert_same_state(other, store)
        assert torch.all(other.arena.grads == 0)
        assert torch.all(other.versions == 3)
    finally:
        other.close()


def test_checkpoint_weights_are_an_hf_model(store: ParameterStore, saved: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    views = store.layout.hf_views(store.arena.params)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), views[name]), name


def _flip_byte(d: Path) -> None:
    path = d / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_weights(d: Path) -> None:
    os.truncate(d / "model.safetensors", 1000)


def _no_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _lost_file(d: Path) -> None:
    (d / "trainer_state.json").unlink()


def _corrupt_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("{")


CORRUPTIONS: list[tuple[Callable[[Path], None], str]] = [
    (_flip_byte, r"optimizer\.safetensors does not match its manifest \(size or checksum\)"),
    (_truncate_weights, r"model\.safetensors does not match its manifest"),
    (_no_manifest, r"has no manifest\.json, so it was not completely written"),
    (_lost_file, r"lacks trainer_state\.json, which its manifest lists"),
    (_corrupt_manifest, r"manifest\.json is corrupt"),
]


@pytest.mark.parametrize("corrupt, expected", CORRUPTIONS,
                         ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS])
def test_damaged_checkpoint_is_refused(saved: Path, corrupt: Callable[[Path], None], expected: str) -> None:
    corrupt(saved)
    other = ParameterStore("tiny", seed=5)
    try:
        params = other.arena.params.clone()
        with pytest.raises(CheckpointError, match=expected) as info:
            other.load_checkpoint(saved)
        assert_one_sentence(str(info.value))
        assert torch.equal(other.arena.params, params), "a refused checkpoint leaves the arena untouched"
    finally:
        other.close()


def test_checkpoint_of_another_model_is_refused(saved: Path) -> None:
    other = ParameterStore(megatrain.ModelConfig(**{**megatrain.ModelConfig.from_name("tiny").to_dict(),
                                                     "intermediate_size": 192}))
    try:
        expected = r"is of a different model \(differs in intermediate_size\)"
        with pytest.raises(ConfigError, match=expected) as info:
            other.load_checkpoint(saved)
        assert_one_sentence(str(info.value))
    finally:
        other.close()


def test_missing_checkpoint_directory(store: ParameterStore, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint .*nope does not exist"):
        store.load_checkpoint(tmp_path / "nope")


# ---- atomic directories ----

def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_atomic_directory_leaves_nothing_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(target) as tmp:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("boom")
    assert not target.exists()
    assert leftovers(tmp_path) == []


def test_atomic_directory_keeps_the_old_one_on_error_and_replaces_it_on_success(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("boom")
    assert (target / "v").read_text() == "1"
    with atomic_directory(target) as tmp:
        (tmp / "w").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["w"]
    assert leftovers(tmp_path) == []


def test_failed_save_checkpoint_keeps_the_previous_one(store: ParameterStore, saved: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(directory: Path) -> None:
        raise OSError(28, "No space left on device")

    randomize(store, seed=2)
    monkeypatch.setattr(ckpt, "write_manifest", disk_full)
    with pytest.raises(OSError):
        store.save_checkpoint(saved, {"updates_applied": 4})
    with pytest.raises(OSError):
        store.save_checkpoint(saved.parent / "fresh", {"updates_applied": 4})
    assert not (saved.parent / "fresh").exists()
    assert leftovers(saved.parent) == []
    monkeypatch.undo()
    other = ParameterStore("tiny", seed=5)
    try:
        assert other.load_checkpoint(saved) == STATE  # still the first, complete checkpoint
    finally:
        other.close()


# ---- saving into directories that already exist ----

def test_save_pretrained_into_an_existing_directory_keeps_other_files(store: ParameterStore, tmp_path: Path) -> None:
    """As transformers does: the tokenizer and notes beside the weights stay; earlier weight shards go."""
    target = tmp_path / "hf"
    (target / "extra").mkdir(parents=True)
    (target / "tokenizer.json").write_text("{}")
    (target / "extra" / "notes.txt").write_text("mine")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (target / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert store.save_pretrained(target) == target
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "extra", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (target / "extra" / "notes.txt").read_text() == "mine"
    assert ckpt.weight_files(target, "model") == [target / "model.safetensors"]
    assert leftovers(tmp_path) == []


def test_checkpoint_into_a_directory_of_other_files_is_refused(store: ParameterStore, saved: Path,
                                                               tmp_path: Path) -> None:
    target = tmp_path / "notes"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already holds files and is not a megatrain checkpoint") as info:
        store.save_checkpoint(target, STATE)
    assert_one_sentence(str(info.value))
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    store.save_checkpoint(saved, STATE)  # an earlier checkpoint of the same name is replaced
    store.save_checkpoint(tmp_path / "empty-dir", STATE)


@pytest.mark.parametrize("target, expected", [("a-file", "is a file, not a directory"),
                                              (".", "is the working directory or holds it"),
                                              ("..", "is the working directory or holds it")])
def test_save_targets_that_cannot_be_replaced_are_refused(store: ParameterStore, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, target: str,
                                                          expected: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "a-file").write_text("mine")
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointError, match=expected) as info:
        store.save_pretrained(target)
    assert_one_sentence(str(info.value))
    assert (work / "a-file").read_text() == "mine"


def test_an_hf_directory_is_not_a_training_checkpoint(store: ParameterStore, tmp_path: Path) -> None:
    hf = store.save_pretrained(tmp_path / "hf")
    with pytest.raises(CheckpointError, match="is an HF model directory, not a training checkpoint") as info:
        store.load_checkpoint(hf)
    assert_one_sentence(str(info.value))
