"""torch.compile of the decoder layer template (EngineConfig.compile): the same loss and gradients as the
eager template, through the executor's forward and its recompute-and-autograd.grad backward.

What these tests check of torch.compile is dynamo's part (fullgraph capture, one compilation per batch shape
and grad mode, the recompile limit), so they compile with the "eager" backend: the captured graphs run as
traced. Inductor's C++ code generation (minutes on 2 cores) is checked once, by the slow case.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.engine.torch_settings import set_matmul_precision
from megatrain.model.layout import ModelLayout
from megatrain.store import init_weights


@pytest.fixture
def compile_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The executor's torch.compile calls get `backend` (the parameter; "eager" unless given)."""
    backend = getattr(request, "param", "eager")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    return backend


@pytest.mark.parametrize("compile_backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)],
                         indirect=True)
def test_compiled_layers_match_eager(compile_backend: str) -> None:
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=3)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_grads, compiled_grads = torch.zeros(layout.numel), torch.zeros(layout.numel)
    eager = Executor(config, layout, params, eager_grads).run(ids)
    executor = Executor(config, layout, params, compiled_grads, compile=True)
    for _ in range(2):  # the second step reuses the compiled graphs (the same shapes)
        compiled = executor.run(ids)
        assert abs(compiled.loss - eager.loss) <= 1e-5 * abs(eager.loss)
        for unit in layout.units:
            want, got = unit.bind(unit.range_of(eager_grads)), unit.bind(unit.range_of(compiled_grads))
            for name in want:
                rel = ((got[name] - want[name]).abs().max() / want[name].abs().max()).item()
                assert rel <= 1e-5, f"{unit.kind} {unit.layer} {name}: {rel:.2e}"


def test_matmul_precision_leaves_every_torch_flag_readable() -> None:
    """The executor's TF32 switch must not leave torch's legacy and per-backend flags disagreeing: then
    torch.get_float32_matmul_precision(), which torch.compile's autotuning reads, raises."""
    try:
        for precision, tf32 in (("tf32", True), ("bf16", True), ("fp32", False)):
            set_matmul_precision(precision)
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
            if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
                assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    finally:
        torch.set_float32_matmul_precision("highest")  # torch's default


def test_compiled_layers_take_more_batch_shapes_than_torchs_default_limit(compile_backend: str) -> None:
    """Each batch shape compiles the layer twice (forward without grad, recompute with it); torch's default
    recompile limit of 8 would make the fifth shape a hard error under fullgraph=True."""
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=1)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    executor = Executor(config, layout, params, torch.zeros(layout.numel), compile=True)
    gen = torch.Generator().manual_seed(0)
    for seq in range(8, 13):  # five shapes: ten compilations
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen)
        assert torch.isfinite(torch.tensor(executor.run(ids).loss))
