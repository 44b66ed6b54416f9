"""What post-training adds to a run's memory plan (megatrain/memory/plan.py), by mode (`megatrain plan --post`): policy
(a loss on log-probs), reference (its log-probs, and GRPO's reference segment), rollout (the KV cache and the units
held on the GPU for each generate call). The bytes of each: docs/design.md#post-trainings-memory."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatrain.config import ConfigError, ModelConfig
from megatrain.memory.arena import REFERENCE_SEGMENT
from megatrain.memory.buffers import ARENA, Buffer
from megatrain.memory.residency import held_for_generation, margin
from megatrain.model.layout import planned_unit_numels

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

MODES = ("dpo", "grpo")
PER_TOKEN_TENSORS = 8  # log-probs, entropy, dL/dlogp, dL/dentropy, and four fields
# the arena's copy of the initial weights (GRPO's KL reference), in the dtype compute reads: the bf16 copy's in bf16
# runs (the same rounding as the optimizer's bf16 copy, so the same bits reach the layers), else fp32


def reference_dtype(precision: str) -> str:
    """The reference segment's dtype name (torch's) for a run in `precision`."""
    return "bfloat16" if precision == "bf16" else "float32"


def reference_bytes(config: ModelConfig, precision: str, lora: bool = False) -> int:
    """Host bytes of the reference segment: the arena's weights' elements (padded ranges) in reference_dtype; a LoRA
    run's none (its reference is the base, adapters off)."""
    return 0 if lora else sum(planned_unit_numels(config)) * (2 if precision == "bf16" else 4)


def with_reference(plan: MemoryPlan, config: ModelConfig, precision: str) -> MemoryPlan:
    """The run's plan with the reference segment in its arena (so its host check counts it), a row of its buffers as
    the store allocates it (megatrain/memory/buffers.py)."""
    extra = reference_bytes(config, precision, lora=bool(plan.frozen_bytes))
    rows = (Buffer(REFERENCE_SEGMENT, ARENA, plan.arena_numel, reference_dtype(precision)),) if extra else ()
    return replace(plan, arena_bytes=plan.arena_bytes + extra, reference_bytes=extra, buffers=(*plan.buffers, *rows))


def reference_problem(plan: MemoryPlan) -> str | None:
    """One sentence where the run fits without the reference segment and not with it (None: it fits, or the run
    does not fit anyway and plan.check says so)."""
    ref = plan.reference_bytes
    if not ref or plan.host_problem() is None or replace(plan, arena_bytes=plan.arena_bytes - ref).host_problem():
        return None
    return (f"GRPO's KL reference keeps the initial weights in host memory ({ref / 2**30:.1f} GiB beside the run's "
            f"{(plan.host_total - ref) / 2**30:.1f} GiB, {plan.host_free / 2**30:.1f} GiB available, "
            f"{plan.shm_free / 2**30:.1f} GiB in /dev/shm) and they do not fit; train without the KL term (beta 0), "
            "with LoRA (its reference is the base: no copy), or on a machine with more memory.")


@dataclass(frozen=True)
class PostPlan:
    mode: str
    rows: int
    seq: int
    per_token_bytes: int  # policy: on the device, beside the training plan's
    reference_host_bytes: int  # reference: held on the host (DPO: the whole data's; GRPO: a rollout batch's)
    kv_cache_bytes: int  # rollout: on the device while generating (GRPO)
    reference_bytes: int  # GRPO's KL term: the initial weights' arena segment, in host memory
    room: int | None = None  # host bytes free beside the run's plan (None: not known)
    held: tuple[int, int] | None = None  # rollout: (units, bytes) a generate call holds on the GPU (None: not known)

    def report(self) -> str:
        lines = [f"post-training ({self.mode}, {self.rows} rows x {self.seq} tokens):",
                 f"  policy step: the head within the plan's three [chunk, vocab] fp32; per-token tensors "
                 f"{_mib(self.per_token_bytes)} on the device",
                 f"  reference log-probs: a forward without gradients, within the step; "
                 f"{_mib(self.reference_host_bytes)} held on the host"]
        if self.mode == "grpo":
            lines.append(f"  rollout KV cache: {_mib(self.kv_cache_bytes)} on the device while generating (beside the "
                         "weight buffers and resident units; the step's activations are not alive then)")
            if self.held is not None:
                lines.append(f"  rollout weights: {self.held[0]} more units held on the GPU for each generate call "
                             f"({_mib(self.held[1])}), the rest streamed for every new token")
            if self.reference_bytes:
                lines.append(f"  KL to the initial policy: the initial weights in an arena segment of their own, "
                             f"{_mib(self.reference_bytes)} in host memory, streamed by the executor for the "
                             "reference's forward")
                if self.room is not None and self.reference_bytes > self.room:
                    lines.append(f"  the reference segment does not fit: {_mib(self.room)} of host memory is left "
                                 "beside the run; train without the KL term, with LoRA, or on a bigger host")
        return "\n".join(lines)


def post_plan(config: ModelConfig, mode: str, rows: int, seq: int, precision: str = "bf16", pairs: int = 0,
              kl: bool = False, run: MemoryPlan | None = None) -> PostPlan:
    """The post-training lines of a plan: `rows` x `seq` a step (GRPO: prompts x group size, prompt + new tokens;
    DPO: 2 x pairs a step), `pairs` the DPO data's, `kl` GRPO's KL term on; `run`: the run's memory plan (where the
    reference segment would go, a LoRA run's none)."""
    if mode not in MODES:
        raise ConfigError(f"--post must be one of {', '.join(MODES)}, got {mode!r}.")
    per_token = PER_TOKEN_TENSORS * rows * seq * 4
    reference = 2 * 8 * pairs if mode == "dpo" else rows * seq * 4
    kv = 0
    if mode == "grpo":
        kv = 2 * config.num_layers * rows * config.num_kv_heads * seq * config.head_dim * (
            2 if precision == "bf16" else 4)
    lora = run is not None and bool(run.frozen_bytes)
    segment = reference_bytes(config, precision, lora) if mode == "grpo" and kl else 0
    room = None  # beside the run without the segment
    if run is not None:
        room = min(run.host_free - run.host_total, run.shm_free - run.arena_host_bytes) + run.reference_bytes
    return PostPlan(mode, rows, seq, per_token, reference, kv, segment, room,
                    rollout_held(config, run, kv, precision) if mode == "grpo" else None)


def rollout_held(config: ModelConfig, run: MemoryPlan | None, kv_bytes: int, precision: str) -> tuple[int, int] | None:
    """(units, bytes) a rollout's generate call keeps on the GPU beyond the run's resident units: what the GPU has free
    beyond the run's plan and the KV cache, less the margin (Generator's rule); None off a GPU or where its free
    memory is not known."""
    if run is None or not run.on_gpu or run.gpu_free is None:
        return None
    room = run.gpu_free - run.gpu_total - kv_bytes
    numels = list(planned_unit_numels(config))
    element = 2 if precision == "bf16" else 4
    held = held_for_generation(numels, run.resident_units, room - margin(room) if room > 0 else 0, element,
                               skip=() if config.tie_embeddings else (0,))
    return len(held), sum(numels[i] for i in held) * element


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
