"""The self-check of the generic path (megatrain/self_check.py): an exact model passes and its verdict is cached (a
second check builds nothing); a megatrain path made wrong on purpose (a layer's output scaled, the final norm
scaled, a layer that crashes) is refused in one sentence naming the layer structure or the head, and the refusal is
cached; no tiny model means a warning and no refusal; native families are not checked; from_pretrained and the
Engine refuse before anything is allocated (nothing in the arena directory, no Ray), and `megatrain plan` runs no
self-check."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_one_sentence, run_cli
from transformers import AutoConfig

import megatrain
from megatrain import self_check
from megatrain.memory import arena as arena_mod
from megatrain.model import hf_architecture
from megatrain.model.tiny_config import TinyConfigError, tiny_config
from megatrain.self_check import SelfCheckError, verify

# sliding-window layers 0-2 and a full-attention layer 3 (the tiny config keeps that pattern)
MODEL_TYPE = "olmo3"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own: the session's may hold a pass of the same tiny model from another test."""
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "self-check"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small olmo3 checkpoint (transformers' default config shrunk), as a user would point megatrain at."""
    hf = self_check.build_hf(tiny_config(AutoConfig.for_model(MODEL_TYPE)))
    directory = tmp_path_factory.mktemp("olmo3")
    hf.save_pretrained(directory)
    return directory


@pytest.fixture
def config(model_dir: Path) -> megatrain.ModelConfig:
    return megatrain.ModelConfig.from_hf(model_dir)


def broken_layer(monkeypatch: pytest.MonkeyPatch, index: int, fn: Callable[..., torch.Tensor]) -> None:
    """Layer `index` of the generic path computes fn(its function, x, *args) instead."""
    layer = hf_architecture.GenericArchitecture.layer

    def patched(self: Any, i: int) -> Any:
        original = layer(self, i)
        return (lambda x, *args: fn(original, x, *args)) if i == index else original

    monkeypatch.setattr(hf_architecture.GenericArchitecture, "layer", patched)


def scaled_update(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """What the layer adds to its input, 1% too much (a scaled output alone the final norm would undo)."""
    return x + 1.01 * (fn(x, *args) - x)


def refusal(config: megatrain.ModelConfig) -> str:
    with pytest.raises(SelfCheckError) as info:
        verify(config)
    message = str(info.value)
    assert_one_sentence(message)
    assert message.startswith(f"megatrain refuses this {MODEL_TYPE} model") and "nothing was allocated" in message
    return message


def fails(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the self-check built something")


def test_an_exact_model_passes_and_its_verdict_is_cached(config: megatrain.ModelConfig, cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(7)
    verify(config)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(7).get_state())  # the caller's random state kept
    (entry,) = cache.iterdir()
    verdict = json.loads(entry.read_text())
    assert verdict["passed"] is True and verdict["model_type"] == MODEL_TYPE
    assert verdict["transformers"] and verdict["torch"] == torch.__version__
    monkeypatch.setattr(self_check, "reference", fails)
    monkeypatch.setattr(self_check, "Executor", fails)
    verify(config)  # cached: neither transformers' model nor megatrain's executor is built
    assert list(cache.iterdir()) == [entry]


def test_a_wrong_layer_is_refused_by_its_structure_and_the_refusal_is_cached(
        config: megatrain.ModelConfig, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        broken_layer(patch, 3, scaled_update)
        message = refusal(config)
    assert "the output of layer 3 (Olmo3DecoderLayer, full_attention)" in message, message
    monkeypatch.setattr(self_check, "reference", fails)
    assert refusal(config) == message  # megatrain is right again, but the cached verdict stands


def test_a_wrong_gradient_alone_is_found_in_the_backward(config: megatrain.ModelConfig, cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    class ScaledGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
            return y.view_as(y)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 1.01

    broken_layer(monkeypatch, 1, lambda fn, x, *args: ScaledGrad.apply(fn(x, *args)))
    assert "the gradient of layer 1 (Olmo3DecoderLayer, sliding_attention)" in refusal(config)


def test_a_wrong_final_norm_is_refused_as_the_head(config: megatrain.ModelConfig, cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    final_norm = hf_architecture.GenericArchitecture.final_norm
    monkeypatch.setattr(hf_architecture.GenericArchitecture, "final_norm",
                        lambda self, x, w: final_norm(self, x, w) * 1.001)
    assert "the head (final norm, lm_head, logits)" in refusal(config)


def test_a_crash_of_megatrains_path_is_refused_with_its_first_line(config: megatrain.ModelConfig, cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(fn: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        raise RuntimeError("the layer broke\nTraceback details nobody needs")

    broken_layer(monkeypatch, 0, crash)
    message = refusal(config)
    assert "crashed" in message and "(RuntimeError: the layer broke)" in message, message


def test_without_a_tiny_model_it_warns_and_does_not_refuse(config: megatrain.ModelConfig, cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    def no_tiny(hf: Any) -> Any:
        raise TinyConfigError("keeping layers [0, 1] lost 1 of 2 layer structures")

    monkeypatch.setattr(self_check, "tiny_config", no_tiny)
    with caplog.at_level(logging.WARNING, logger="megatrain.self_check"):
        verify(config)
    (record,) = caplog.records
    assert "could not run" in record.getMessage() and "lost 1 of 2 layer structures" in record.getMessage()
    assert not cache.exists()


def test_native_families_are_not_checked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(self_check, "tiny_config", fails)
    verify(megatrain.ModelConfig.from_name("tiny"))


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch, cache: Path, shm_dir: Path) -> Path:
    """megatrain's layer 3 made wrong, and the arenas' directory a private one (returned): it must stay empty."""
    broken_layer(monkeypatch, 3, scaled_update)
    monkeypatch.setattr(arena_mod, "SHM_DIR", shm_dir)
    return shm_dir


def test_from_pretrained_refuses_before_allocating(model_dir: Path, broken: Path) -> None:
    with pytest.raises(SelfCheckError, match="layer 3"):
        megatrain.from_pretrained(model_dir)
    assert list(broken.iterdir()) == []


def test_engine_refuses_in_the_driver_before_ray_or_an_arena(model_dir: Path, broken: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import pipelines.engine

    monkeypatch.setattr(pipelines.engine, "init_ray", fails)
    with pytest.raises(SelfCheckError, match="layer 3"):
        megatrain.Engine(model_dir, device="cpu", optimizer_workers=1, batch_size=1, seq_len=16)
    assert list(broken.iterdir()) == []


def test_the_self_check_itself_allocates_no_arena(config: megatrain.ModelConfig, cache: Path, shm_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_mod, "SHM_DIR", shm_dir)
    verify(config)
    assert list(shm_dir.iterdir()) == []


def test_plan_runs_no_self_check(model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(self_check, "check", fails)
    run = run_cli("plan", "--model", str(model_dir), "--seq", "16", "--batch", "1", "--device", "cpu")
    assert run.returncode == 0 and "fits: yes" in run.output, run.output
