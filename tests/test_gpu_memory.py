"""gpu_memory_gib (EngineConfig, TOML, --gpu-memory-gib / --gpu-memory, Engine(gpu_memory_gib=)): a run's GPU held to
that many GiB. The plan takes min(the GPU's free memory, the cap) (pipelines/run_plan.py held_to), and the executor
caps its CUDA allocator there (megatrain/memory/plan.py cap_gpu_memory), so a smaller GPU's run can be tried on a larger
one: the 7B bf16 held to an RTX 3080's 10 GiB."""

from __future__ import annotations

import json

import pytest

from megatrain.config import ConfigError, EngineConfig
from pipelines.cli import main

GiB = 2**30
SEVEN_B = ["plan", "--model", "7b", "--precision", "bf16", "--batch", "1", "--seq", "2048", "--device", "cuda",
           "--gpu-gib", "80", "--host-gib", "125", "--json"]


def test_the_plan_fits_the_7b_in_a_gpu_held_to_10_gib(capsys: pytest.CaptureFixture[str]) -> None:
    """On an 80 GiB GPU held to 10: the plan has 10 GiB to fill (its resident units and kept layers take what is
    left), uses at most that, and the run plan carries the cap to the executor; held to 4 GiB it does not fit, in one
    sentence naming the GPU's memory; with no cap, the 80."""
    assert main([*SEVEN_B, "--gpu-memory-gib", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan, run = out["plan"], out["run_plan"]
    assert out["fits"] and plan["gpu_free"] == 10 * GiB and plan["gpu_total"] <= 10 * GiB
    assert run["gpu_memory"] == 10 * GiB
    assert main([*SEVEN_B, "--gpu-memory", "4"]) == 1
    small = json.loads(capsys.readouterr().out)
    assert not small["fits"] and "GiB of GPU memory but 4.0 GiB is free" in small["problem"]
    assert main(SEVEN_B) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["plan"]["gpu_free"] == 80 * GiB and whole["run_plan"]["gpu_memory"] is None


def test_the_setting_is_checked_and_reaches_the_engine(tmp_path) -> None:
    from pipelines.train import TrainConfig, engine_kwargs

    for bad in (0, -1, "10", True):
        with pytest.raises(ConfigError, match="gpu_memory_gib must be a positive number"):
            EngineConfig(gpu_memory_gib=bad)
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\ngpu_memory_gib = 10\n')
    assert engine_kwargs(TrainConfig.load(str(toml), {}))["gpu_memory_gib"] == 10


@pytest.mark.gpu
def test_the_executor_allocator_is_held_to_the_cap() -> None:
    """cap_gpu_memory: past the cap (less the CUDA context the plan counts) an allocation fails as out of memory."""
    import torch

    from megatrain.memory.plan import CUDA_CONTEXT, cap_gpu_memory

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = cap_gpu_memory(2 * GiB)
    assert fraction == pytest.approx((2 * GiB - CUDA_CONTEXT) / total)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)
