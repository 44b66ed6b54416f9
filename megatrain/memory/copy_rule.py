"""bf16_copy "auto": whether a bf16 run keeps the arena's bf16 copy of the weights (2 B a parameter on the host, half
the bytes on PCIe). megatrain/memory/plan.py plan_run plans the run both ways and keeps it where only the run with it
fits, or where both fit and `pcie_bound` says the fp32 weights' copies to the GPU would bound the step without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatrain.config import ModelConfig
from megatrain.memory.on_device import NOMINAL_H2D_GBPS, NOMINAL_TFLOPS
from megatrain.memory.plan_settings import RunSettings

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

# bf16_copy "auto", in one line (the plan's report and docs/memory.md say it)
BF16_COPY_RULE = ("bf16_copy auto keeps the copy only where the fp32 weights' copies to the GPU would bound the step "
                  "without it (by the calibration's prediction, else at nominal rates), or where only the run with it "
                  "fits")


def pcie_bound(plan: MemoryPlan, config: ModelConfig, s: RunSettings) -> tuple[bool, str]:
    """(whether the fp32 weights' copies to the GPU bound the step of `plan`, a run without the bf16 copy; why): by the
    predictor (s.step_time) where there is one, the H2D it leaves exposed beyond the compute it overlaps with; else half
    the step's H2D (the forward's) at a nominal PCIe rate against the forward's matmuls at a nominal bf16 rate."""
    if not s.on_gpu:
        return False, "the CPU path copies no weights to a device"
    if s.step_time is not None:
        exposed = s.step_time.h2d_exposed(plan)
        bound = exposed > 1e-3 * s.step_time(plan)
        return bound, (f"without it the fp32 weights' H2D {'would bound' if bound else 'is hidden by compute in'} "
                       f"the step ({1e3 * exposed:.1f} ms exposed, predicted)")
    h2d = plan.h2d_bytes / 2 / (NOMINAL_H2D_GBPS * 1e9)
    forward = 2 * plan.step_tokens * config.layer_params() * config.num_layers / (NOMINAL_TFLOPS["bf16"] * 1e12)
    bound = h2d > forward
    return bound, (f"without it the forward's fp32 weights cross PCIe in ~{h2d:.2f} s at a nominal "
                   f"{NOMINAL_H2D_GBPS:g} GB/s, {'longer' if bound else 'no longer'} than its ~{forward:.2f} s of "
                   f"matmuls at a nominal {NOMINAL_TFLOPS['bf16']:g} TFLOP/s (no calibration)")
