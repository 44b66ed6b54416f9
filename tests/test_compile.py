"""torch.compile in the executor (EngineConfig.compile, megatrain/engine/compiled.py): the layers whole, or their
tiles on the tiled path, and the head give the eager executor's loss and gradients, through the forward and the
recompute-and-autograd.grad backward; packed documents compile once whatever their boundaries; and what compile
"auto" decides, from what the calibration measured (megatrain/perf/compile_choice.py).

What these tests check of torch.compile is dynamo's part (fullgraph capture, one compilation per batch shape
and grad mode, the recompile limit), so they compile with the "eager" backend (the captured graphs run as traced),
or "aot_eager" where the joint forward and backward must trace as inductor traces them (the packed-attention op's
fake and its backward op). Inductor's C++ code generation (minutes on 2 cores) is checked by the slow cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import VOCAB, batch, build_hf_model
from torch._dynamo.testing import CompileCounterWithBackend

from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.engine.executor import Executor
from megatrain.engine.torch_settings import set_matmul_precision
from megatrain.model.layout import ModelLayout
from megatrain.perf.calibrate import Calibration, CompiledTiming, LayerTiming, layer_key, time_compiled
from megatrain.perf.compile_choice import auto_on_gpu, compile_choice
from megatrain.store import ParameterStore, init_weights
from pipelines.cli import _add_train_flags
from pipelines.train import TrainConfig


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
    # one-token loss chunks: the head's pieces see one shape whatever the sequence (their compilations are not
    # what this counts)
    executor = Executor(config, layout, params, torch.zeros(layout.numel), compile=True, loss_chunk_tokens=1)
    gen = torch.Generator().manual_seed(0)
    for seq in range(8, 13):  # five shapes: ten compilations
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen)
        assert torch.isfinite(torch.tensor(executor.run(ids).loss))


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def packed_positions(cuts: list[tuple[int, int]], rows: int = 2, seq: int = 16) -> torch.Tensor:
    """position_ids [rows, seq]: each row one document from 0, another beginning at each (row, token) of `cuts`."""
    positions = torch.arange(seq).repeat(rows, 1)
    for row, token in sorted(cuts):
        positions[row, token:] = torch.arange(seq - token)
    return positions


def compiled_and_eager(monkeypatch: pytest.MonkeyPatch, backend: str, num_layers: int = 2, **options: Any
                       ) -> tuple[CompileCounterWithBackend, ModelLayout, Executor, Executor]:
    """(the compile counter, the layout, an eager executor, a compiling one) of a tiny model, both with `options`."""
    counter = CompileCounterWithBackend(backend)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=num_layers)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    eager = Executor(config, layout, params, torch.zeros(layout.numel), **options)
    return counter, layout, eager, Executor(config, layout, params, torch.zeros(layout.numel), compile=True, **options)


def assert_same_step(eager: Executor, compiled: Executor, ids: torch.Tensor, tolerance: float, **run: Any) -> None:
    """One step of each on the batch: the same loss and gradients, to `tolerance` (relative, per tensor)."""
    want, got = eager.run(ids, **run), compiled.run(ids, **run)
    assert abs(got.loss - want.loss) <= tolerance * abs(want.loss)
    for unit in eager.layout.units:
        for name, g in unit.bind(unit.range_of(compiled.grads)).items():
            rel = max_rel(g, unit.bind(unit.range_of(eager.grads))[name])
            assert rel <= tolerance, f"{unit.kind} {unit.layer} {name}: {rel:.2e}"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_packed_documents_compile_once_and_match_eager(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Three batches whose packed documents begin in different places: the layers and the head compile for the first
    and run the same graphs for the next two, as the boundaries enter them as a tensor (ops.document_starts) and
    the loss's 1 / tokens as a 0-d one; every loss and gradient is the eager executor's (to fp32 rounding: inductor's
    kernels sum in their own order)."""
    counter, layout, eager, compiled = compiled_and_eager(monkeypatch, backend)
    gen = torch.Generator().manual_seed(0)
    frames = []
    for cuts in ([(0, 5)], [(0, 3), (1, 9)], [(1, 2), (0, 11), (1, 7)]):
        ids = torch.randint(0, eager.config.vocab_size, (2, 16), generator=gen)
        assert_same_step(eager, compiled, ids, 1e-6 if backend != "inductor" else 1e-5,
                         position_ids=packed_positions(cuts))
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == [frames[0]] * 3, frames  # the first batch compiled, the others reused it


@pytest.mark.parametrize("kept_layers", [0, 2])
def test_folded_micro_batches_compile_once_across_layers_and_steps(monkeypatch: pytest.MonkeyPatch,
                                                                   kept_layers: int) -> None:
    """Micro-batches after a layer's first fold their weight gradients (megatrain/engine/grad_fold.py, its mode traced
    into the graph): that is one more compilation per batch shape, not one per layer and micro-batch. The mode once
    told the layer's weights by id(), and dynamo guarded every call on the fresh leaves' ids: each folded call
    recompiled, and the H200's 7B (2026-11-26) hit the recompile limit and finished no step in 150 s."""
    counter, layout, eager, compiled = compiled_and_eager(monkeypatch, "eager", num_layers=4, kept_layers=kept_layers)
    ids = torch.randint(0, eager.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    frames = []
    for _ in range(3):
        assert_same_step(eager, compiled, ids, 1e-6, micro_batches=4)
        frames.append(counter.frame_count)
    # the head's two pieces, and the layer without grad, with it, and with it folding (kept layers: their forward)
    assert frames == [frames[0]] * 3 and frames[0] <= 5, frames


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_tiles_and_head_match_eager(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The tiled path compiled: the layers' token-wise tiles (q/k/v, the output projection, the MLP: three
    functions, each with and without grad) and the head's two pieces, the loops and the attention between eager,
    with packed documents; the eager executor's loss and gradients."""
    counter, layout, eager, compiled = compiled_and_eager(monkeypatch, backend, tile_tokens=8)
    ids = torch.randint(0, eager.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_same_step(eager, compiled, ids, 1e-6 if backend != "inductor" else 1e-5,
                     position_ids=packed_positions([(0, 3), (1, 9)]))
    assert counter.frame_count == 3 * 2 + 2


def test_compile_settings_and_what_auto_decides(tmp_path: Path) -> None:
    """true / false (the older setting) read as on / off in EngineConfig, a TOML file and on the command line, a bad
    value in one sentence; auto runs the CPU path eager, and on a GPU follows what its calibration measured for
    this model's layer shape and precision (the entry with the most tokens), compiling where it measured nothing."""
    assert [EngineConfig(compile=v).compile for v in (True, False, "auto", "off")] == ["on", "off", "auto", "off"]
    assert EngineConfig().compile == "auto"
    with pytest.raises(ConfigError, match=r"^compile must be one of auto, on, off, got 'yes'\.$"):
        EngineConfig(compile="yes")
    (tmp_path / "run.toml").write_text("compile = true\n")
    assert TrainConfig.load(tmp_path / "run.toml").compile == "on"
    flags = argparse.ArgumentParser()
    _add_train_flags(flags)
    assert [flags.parse_args(a).compile for a in ([], ["--compile"], ["--compile", "off"])] == [None, "on", "off"]

    tiny = ModelConfig.from_name("tiny")
    for setting, on in (("auto", False), ("on", True), ("off", False)):
        assert compile_choice(setting, "cpu-async:1", tiny, "tf32").on is on
    cal = Calibration(device="NVIDIA H100", host="h", created=0.0, cores=16, compute_threads=4, h2d_gbps=50.0,
                      d2h_gbps=50.0, memcpy_gbps=20.0)
    nothing = auto_on_gpu("NVIDIA H100", cal, tiny, "bf16")
    assert nothing.on and "no calibration of NVIDIA H100" in nothing.why
    cal.compiled[layer_key(tiny, 1, 64, "bf16")] = CompiledTiming(0.010, 0.012, 0.0, 0.0, 30.0)  # slower, fewer tokens
    cal.compiled[layer_key(tiny, 4, 64, "tf32")] = CompiledTiming(0.010, 0.020, 0.0, 0.0, 30.0)  # another precision
    other = dataclasses.replace(tiny, hidden_size=tiny.hidden_size * 2)
    cal.compiled[layer_key(other, 4, 64, "bf16")] = CompiledTiming(0.010, 0.020, 0.0, 0.0, 30.0)  # another shape
    slower = auto_on_gpu("NVIDIA H100", cal, tiny, "bf16")
    assert not slower.on and "from the calibration of NVIDIA H100 (1x64 tokens" in slower.why, slower.why
    cal.compiled[layer_key(tiny, 2, 64, "bf16")] = CompiledTiming(0.010, 0.007, 0.0, 0.0, 30.0)  # faster, more tokens
    faster = auto_on_gpu("NVIDIA H100", cal, tiny, "bf16")
    assert faster.on and "a layer 7.0 ms compiled, 10.0 ms eager" in faster.why, faster.why


def test_calibration_times_the_layer_compiled(compile_backend: str, tmp_path: Path) -> None:
    """time_compiled: the model's layer and head through the compiled executor, beside the eager timing it is given,
    kept in the calibration's JSON (simulated streams here: a GPU's calibration runs it, the CPU path's does not)."""
    tiny = ModelConfig.from_name("tiny")
    timing = time_compiled(tiny, 1, 32, "cpu-async:1", "tf32", LayerTiming(0.5, 0.25), repeats=1)
    assert timing is not None and timing.eager_layer_s == 0.5 and timing.eager_rest_s == 0.25
    assert timing.compiled_layer_s > 0 and timing.compiled_rest_s > 0 and timing.compile_s >= 0
    cal = Calibration(device="cpu", host="h", created=0.0, cores=2, compute_threads=2, h2d_gbps=None, d2h_gbps=None,
                      memcpy_gbps=1.0, compiled={layer_key(tiny, 1, 32, "tf32"): timing})
    assert Calibration.load("cpu", cal.save(tmp_path / "cal.json")) == cal


@pytest.mark.parametrize(("case", "backend"), [("phi3-dropout", "eager"), ("mixtral-aux", "eager"),
                                                pytest.param("phi3-dropout", "inductor", marks=pytest.mark.slow)])
def test_the_generic_paths_layers_compile_with_their_rng_replay_eager(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path, case: str, backend: str) -> None:
    """compile = on for transformers' own layers (the generic path; auto runs them eager): each layer's module runs
    through torch.compile with the RNG's replay around it eager (dynamo refuses torch.get_rng_state), the dropout
    masks (Phi-3, over two micro-batches) and the router's auxiliary loss (Mixtral) as in the eager executor. Inductor
    draws the eager masks too (its own random kernels were 2.6% off the eager loss here, 1.5% on CUDA)."""
    from transformers import MixtralConfig, Phi3Config

    counter = CompileCounterWithBackend(backend)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    dense = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 pad_token_id=0, bos_token_id=0, eos_token_id=1)
    hf = (Phi3Config(**dense, intermediate_size=96, resid_pdrop=0.2, attention_dropout=0.3) if case == "phi3-dropout"
          else MixtralConfig(**dense, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                             router_aux_loss_coef=0.05, output_router_logits=True))
    build_hf_model(hf).save_pretrained(tmp_path)
    store = ParameterStore(tmp_path)
    try:
        config, layout, params = store.config, store.layout, store.arena.params
        auto = auto_on_gpu("NVIDIA H100", None, config, "bf16")
        assert not auto.on and "generic path" in auto.why, auto.why
        ids = batch(seed=2)
        results = []
        for compile in (False, True):
            grads = torch.zeros(layout.numel)
            executor = Executor(config, layout, params, grads, compile=compile)
            torch.manual_seed(7)  # the same dropout draws in both
            k = 1 if case == "mixtral-aux" else 2  # (a router's aux loss is over the whole batch: no micro-batches)
            results.append((executor.run(ids[:2], micro_batches=k).loss, grads))
            executor.close()
        (want, want_grads), (got, got_grads) = results
        assert counter.frame_count > 0
        tolerance = 1e-6 if backend == "eager" else 1e-5  # inductor fuses: fp32 rounding
        assert abs(got - want) <= tolerance * abs(want)
        assert max_rel(got_grads, want_grads) <= tolerance
    finally:
        store.close()
