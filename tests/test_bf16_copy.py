"""bf16 runs: the arena's bf16 copy of the weights (2 B a parameter on the host, half the bytes on PCIe) kept or not
(EngineConfig.bf16_copy = auto | keep | none). auto keeps it only where the fp32 weights' copies to the GPU would bound
the step without it (by the calibration's predictor, else at nominal rates; never on the CPU path, which copies
nothing), or where only the run with it fits; forced either way. Without it the fp32 weights are streamed and cast
(round to nearest even, as the optimizer rounds the copy): same bits."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.memory.arena import BF16_COPY_SEGMENT, Arena
from megatrain.memory.plan import BF16_COPY_RULE, plan_run
from megatrain.perf.calibrate import Calibration
from megatrain.perf.predict import predict, step_time

GiB = 2**30
H100 = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrations" / "h100-80gb-hbm3.json"
SEVEN_B = ModelConfig.from_name("7b")
# the headline's settings (benchmarks/gpu_session.sh headline): 8 workers, the GPU's split auto, clipping on
HEADLINE = dict(on_gpu=True, gpu_free=79 * GiB, host_free=125 * GiB, precision="bf16", optimizer_workers=8,
                find_longest=False, resident="auto", keep_activations="auto")


def per_param(plan) -> float:
    return plan.arena_host_bytes / plan.params


@pytest.mark.parametrize("grads", ["arena", "auto"])
def test_the_copy_stays_only_where_pcie_bounds_the_step(grads: str) -> None:
    """On the H100's calibration (compiled, every step clipping), the default bf16 run with clipping: at K=16 compute
    hides the fp32 weights' H2D, so no copy and at most 16 B a parameter on the host (16.0 with the gradients held in
    the arena, 12.6 with grads auto, which waits on the GPU), although the copy predicts 2.5% shorter there (a resident
    unit more); at K=1 the fp32 stream would bound the step: the copy stays. The plan's line says why and the rule."""
    cal = Calibration.read(H100)
    settings = dict(precision="bf16", optimizer_workers=8, compiled=True, clip_rate=1.0)
    predicted = step_time(SEVEN_B, cal, **settings)
    for k in (16, 1):
        plan = partial(plan_run, SEVEN_B, 1, 2048, micro_batches=k, step_time=predicted, grads=grads, **HEADLINE)
        auto, keep, none = (plan(bf16_copy=c) for c in ("auto", "keep", "none"))
        assert keep.bf16_copy_bytes > 0 and none.bf16_copy_bytes == 0
        assert per_param(none) == pytest.approx(per_param(keep) - 2, abs=0.01)
        exposed = predict(none, SEVEN_B, cal, **settings).exposed["h2d"]
        assert not (auto.host_problem() or auto.gpu_problem())
        assert BF16_COPY_RULE in auto.report()
        if k == 16:
            assert exposed == 0 and auto.bf16_copy_bytes == 0 and per_param(auto) <= 16
            assert "hidden by compute" in auto.bf16_copy_note
        else:
            assert exposed > 0.1 and auto.bf16_copy_bytes == keep.bf16_copy_bytes
            assert f"would bound the step ({1e3 * exposed:.1f} ms exposed, predicted)" in auto.bf16_copy_note


def test_without_a_calibration_the_rule_takes_nominal_rates() -> None:
    """No predictor: the forward's fp32 weights at a nominal 55 GB/s against its matmuls at a nominal 311 TFLOP/s:
    the 7B at K=16 drops the copy (16 B a parameter with grads held in the arena), at K=1 keeps it (18); the CPU path
    copies no weights and keeps none."""
    plan = partial(plan_run, SEVEN_B, 1, 2048, grads="arena", **HEADLINE)
    many, one = plan(micro_batches=16), plan(micro_batches=1)
    assert many.bf16_copy_bytes == 0 and "no longer than" in many.bf16_copy_note
    assert "no calibration" in many.bf16_copy_note
    assert "arena: 16.0 B per parameter in host memory" in many.report()
    assert one.bf16_copy_bytes == one.arena_numel * 2 and "longer than" in one.bf16_copy_note
    assert "arena: 18.0 B per parameter in host memory" in one.report()
    cpu = plan_run(ModelConfig.from_name("tiny"), 2, 64, precision="bf16", find_longest=False)
    assert cpu.bf16_copy_bytes == 0 and "the CPU path copies no weights" in cpu.bf16_copy_note


def test_forcing_the_copy_and_the_room_it_needs() -> None:
    """keep / none as asked (keep even where the host then does not fit: the run is refused, not changed); auto drops
    it where the host has no room for it, however PCIe bound the step."""
    plan = partial(plan_run, SEVEN_B, 1, 2048, grads="arena", **HEADLINE)
    assert plan(bf16_copy="none").bf16_copy_note.endswith("bf16_copy = none")
    small = dict(HEADLINE, host_free=110 * GiB)  # room for 16 B a parameter, not for 18
    dropped = plan_run(SEVEN_B, 1, 2048, grads="arena", **small)
    assert dropped.bf16_copy_bytes == 0 and dropped.bf16_copy_note.startswith("bf16 copy of the weights none: no room")
    forced = plan_run(SEVEN_B, 1, 2048, grads="arena", bf16_copy="keep", **small)
    assert forced.bf16_copy_bytes > 0 and forced.host_problem() is not None
    assert plan(precision="tf32", bf16_copy="keep").bf16_copy_bytes == 0  # only bf16 compute reads a copy
    with pytest.raises(ConfigError, match="bf16_copy"):
        EngineConfig(bf16_copy="sometimes")
    with pytest.raises(ConfigError, match="bf16_copy"):
        plan(bf16_copy="sometimes")


def _run(bf16_copy: str) -> tuple[list[float], torch.Tensor]:
    batch = torch.randint(0, ModelConfig.from_name("tiny").vocab_size, (2, 12),
                          generator=torch.Generator().manual_seed(0))
    with megatrain.Engine("tiny", optimizer_workers=1, precision="bf16", device="cpu", lr=1e-2,
                          bf16_copy=bf16_copy) as engine:
        losses = [engine.step(batch) for _ in range(3)]
        engine.wait_for_updates()
        arena = Arena.open(engine.handle)
        try:
            assert (BF16_COPY_SEGMENT in arena.tensors) == (bf16_copy == "keep")
            params = arena.params.clone()
        finally:
            arena.close()
    return losses, params


@pytest.mark.slow  # two Engine starts (~75 s); CI: test_bf16_copy_weights.py's executor casting the weights, same bits
def test_a_bf16_run_without_the_copy_trains_bit_for_bit_as_with_it(ray_session: None) -> None:
    """The executor casts the streamed fp32 weights (round to nearest even) where it would read the optimizer's copy
    (rounded the same way): the same losses and weights after 3 steps."""
    kept, dropped = _run("keep"), _run("none")
    assert kept[0] == dropped[0]
    assert torch.equal(kept[1], dropped[1])
