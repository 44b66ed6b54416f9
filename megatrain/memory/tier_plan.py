"""The NVMe tier in the memory plan: per kind of state, the bytes it keeps on disk, what it stages in the arena at a
time, its disk traffic per step and the seconds that takes at the disk's rates (megatrain/memory/nvme.py moves them).

Kinds are the arena's segments: the fp32 masters (params), Adam m and v (exp_avg, exp_avg_sq), the held gradients
(grads). Units resident on the device keep theirs in the arena (the executor loads them from there). Per step and
streamed parameter the optimizer reads and writes back each state kind it updates (4 B each way); held gradients are
written as they land and read back for the update (4 B each way); a rollback reads a unit's states and gradient again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatrain.config import ConfigError, ModelConfig
from megatrain.memory.buffers import row
from megatrain.memory.staging import part_numel
from megatrain.model.layout import planned_unit_numels, planning_layout

if TYPE_CHECKING:
    from megatrain.memory.on_device import StepTime
    from megatrain.memory.plan import MemoryPlan

GiB = 2**30
KINDS = {"master": ("params",), "moments": ("exp_avg", "exp_avg_sq"), "grads": ("grads",)}
STAGED_UNITS = 3  # each worker's staging slots of its share of a unit (megatrain/memory/staging.py SLOTS)


def tier_names(states: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """nvme_states as names of KINDS ("auto" is decided by `with_tier`)."""
    if states in ("all", "auto"):
        return tuple(KINDS)
    names = tuple(states.split(",")) if isinstance(states, str) else tuple(states)
    bad = [n for n in names if n not in KINDS]
    if bad:
        raise ConfigError(f"nvme_states must be 'auto', 'all' or a list of {', '.join(KINDS)}, got {states!r}.")
    return names


@dataclass(frozen=True)
class TierPlan:
    """Where the plan puts each kind of state: on disk (`on_disk`, bytes per kind), the arena's staging of them, the
    disk's traffic per step, and its rates (GB/s, None: not known)."""

    directory: str
    names: tuple[str, ...]  # the nvme_states placed there (KINDS' names)
    on_disk: tuple[tuple[str, int], ...]  # (arena segment, bytes on disk)
    staging_bytes: int
    read_bytes: int  # per step
    write_bytes: int
    read_gbps: float | None = None
    write_gbps: float | None = None

    @property
    def nvme_bytes(self) -> int:
        return sum(n for _, n in self.on_disk)

    @property
    def saved_bytes(self) -> int:
        """Host bytes the tier takes out of the arena."""
        return self.nvme_bytes - self.staging_bytes

    def seconds(self) -> float | None:
        """The disk's share of a step: its reads and writes one after the other (one device serves both)."""
        if not self.read_gbps or not self.write_gbps:
            return None
        return self.read_bytes / (self.read_gbps * 1e9) + self.write_bytes / (self.write_gbps * 1e9)

    def bound_s(self, step_s: float, beside_s: float | None = None) -> float | None:
        """The step with the disk as a bound (None: its rates unknown): the disk's share hides behind the `beside_s`
        seconds of compute the optimizer's pass runs beside (Prediction.beside_update_s), the rest adds to the step;
        where that is not known (None), behind the whole step."""
        disk_s = self.seconds()
        if disk_s is None:
            return None
        return max(step_s, disk_s) if beside_s is None else step_s + max(0.0, disk_s - beside_s)

    def report(self, step_s: float | None = None, beside_s: float | None = None) -> list[str]:
        kinds = ", ".join(f"{k} {n / GiB:.2f} GiB" for k, n in self.on_disk)
        lines = [f"nvme ({self.directory}): {kinds}; {self.staging_bytes / GiB:.2f} GiB staged in the arena",
                 f"NVMe per step: {self.read_bytes / GiB:.2f} GiB read, {self.write_bytes / GiB:.2f} GiB written"]
        disk_s = self.seconds()
        if disk_s is None:
            lines.append("NVMe rates unknown: `megatrain calibrate --nvme PATH` or --nvme-gbps READ,WRITE")
        else:
            lines[-1] += f" ({self.read_gbps:.2f} / {self.write_gbps:.2f} GB/s: {disk_s:.2f} s)"
        if disk_s is not None and step_s is not None:
            bound = self.bound_s(step_s, beside_s)
            hidden = "the whole step" if beside_s is None else f"{beside_s:.2f} s of compute"
            lines.append(f"step predicted with the disk as a bound: {bound:.2f} s (the disk's {disk_s:.2f} s beside "
                         f"{hidden}; without it {step_s:.2f} s)")
        return lines


def plan_tier(directory: str, names: tuple[str, ...], streamed_numel: int, grads_numel: int, max_unit_numel: int,
              rates: tuple[float, float] | None = None, nodes: int = 1) -> TierPlan:
    """The tier of kinds `names` for `streamed_numel` elements (the streamed units'; the held gradients':
    `grads_numel`, 0 where they do not wait in the arena), staged up to `max_unit_numel` elements a unit (the workers
    share each unit). One node's of `nodes`: 1/nodes of the moments on its disk, its part of each gradient moved, the
    whole masters (their exchange reads its part again, writes the others': megatrain/distributed/node_exchange.py)."""
    on_disk, read, written = [], 0, 0
    for name in names:
        for kind in KINDS[name]:
            numel = {"grads": grads_numel, "params": streamed_numel}.get(kind, -(-streamed_numel // nodes))
            if numel:
                on_disk.append((kind, numel * 4))
            moved = numel * 4 // nodes if kind in ("grads", "params") else numel * 4  # this node's part
            read += moved * (2 if kind == "params" and nodes > 1 else 1)
            written += numel * 4 if kind == "params" else moved
    per_unit = sum(4 for k, _ in on_disk) * max_unit_numel
    staging = min(sum(n for _, n in on_disk), STAGED_UNITS * per_unit) if on_disk else 0
    return TierPlan(directory, names, tuple(on_disk), staging, read, written, *(rates or (None, None)))


@dataclass(frozen=True)
class TierOption:
    """One way to place the tier: the plan with it, and what nvme_states "auto" ranks it by."""

    plan: MemoryPlan
    fits: bool  # host and GPU
    disk_s: float | None  # the tier's share of a step at the disk's rates (None: rates unknown)
    step_s: float | None  # the step predicted without the disk as a bound (None: no predictor)
    traffic: int  # disk bytes a step, read and written

    @property
    def names(self) -> tuple[str, ...]:
        return self.plan.tier.names if self.plan.tier is not None else ()

    @property
    def bound_s(self) -> float | None:
        """The step predicted with the disk as a bound (None where the disk's rates are unknown)."""
        if self.disk_s is None:
            return None
        tier = self.plan.tier
        return (self.step_s or 0.0) if tier is None else tier.bound_s(self.step_s or 0.0)

    def rank(self) -> tuple[float, ...]:
        """What auto takes the least of, in order: refused by a run, the step with the disk as a bound (the disk's
        bytes where its rates are unknown), the step without it, the host's bytes."""
        cost = self.bound_s if self.bound_s is not None else float(self.traffic)
        return (cost, self.step_s or 0.0, float(self.plan.host_total))

    def describe(self) -> str:
        what = ",".join(self.names) or "none"
        cost = f"{self.bound_s:.2f} s" if self.bound_s is not None else f"{self.traffic / GiB:.1f} GiB of disk traffic"
        per_param = self.plan.arena_host_bytes / max(self.plan.params, 1)
        return f"{what} {cost}, {per_param:.1f} B/param in host memory"


def tier_options(plan: MemoryPlan, copied: MemoryPlan | None, config: ModelConfig | None, directory: str,
                 states: str | tuple[str, ...] | list[str], rates: tuple[float, float] | None = None,
                 step_time: StepTime | None = None) -> list[TierOption]:
    """The ways nvme_states allows (auto: nothing, or any set of KINDS whose every kind has bytes to move), each on
    `plan`, or where it puts the fp32 masters on disk on `copied` (the same run with the bf16 copy of the weights,
    which the executor streams instead of the masters; None: the run has no copy to stream, and auto does not put
    them there)."""
    largest = 0  # what the workers stage of a unit at a time, together: each its slot (staging.py part_numel)
    if config is not None:
        workers = row(plan.buffers, "versions").numel // row(plan.buffers, "issued").numel - (plan.nodes > 1)
        largest = workers * part_numel(planned_unit_numels(config), planning_layout(config).max_layer_numel(), workers)
    if states == "auto":
        sets = [names for count in range(len(KINDS) + 1) for names in itertools.combinations(KINDS, count)]
    else:
        sets = [tier_names(states)]
    options = []
    for names in sets:
        base = copied if "master" in names and copied is not None and not plan.bf16_copy_bytes else plan
        if states == "auto" and "master" in names and not base.bf16_copy_bytes:
            continue
        streamed = base.arena_numel - base.resident_params
        grads = base.grads_bytes // 4 if base.grads == "arena" else 0
        tier = plan_tier(directory, names, streamed, grads, largest, rates, base.nodes)
        placed = {n for n in names if any(kind in KINDS[n] for kind, _ in tier.on_disk)}
        if states == "auto" and placed != set(names):  # a kind with nothing to move: the smaller set covers it
            continue
        tiered = replace(base, tier=tier if tier.on_disk else None)
        if base is not plan:
            tiered = replace(tiered, bf16_copy_note="bf16 copy of the weights in the arena: the fp32 masters are on "
                                                    "NVMe, and the executor streams the copy instead")
        options.append(TierOption(tiered, tiered.host_fits and tiered.gpu_problem() is None,
                                  tier.seconds() if tier.on_disk else (0.0 if rates else None),
                                  step_time(tiered) if step_time is not None else None,
                                  tier.read_bytes + tier.write_bytes))
    return options


def with_tier(plan: MemoryPlan, config: ModelConfig | None, directory: str | None,
              states: str | tuple[str, ...] | list[str], rates: tuple[float, float] | None = None, *,
              copied: MemoryPlan | None = None, step_time: StepTime | None = None) -> MemoryPlan:
    """`plan` with the NVMe tier of `states` in `directory` (None: no tier, the plan as it is); config None: the
    staging left out (a hint's estimate). "auto" (tier_options' sets): of those that fit the host and
    the GPU, the shortest step predicted with the disk as a bound (`step_time`, the predictor, and the disk's `rates`;
    without rates the fewest disk bytes a step), ties to the fewest host bytes; where none fits, the one that keeps
    the fewest host bytes (the plan then says it does not fit). Its tier_note says which and what it beat."""
    if not directory:
        return plan
    options = tier_options(plan, copied, config, directory, states, rates, step_time)
    if states != "auto":
        return options[0].plan
    fitting = sorted((o for o in options if o.fits), key=TierOption.rank)
    if not fitting:
        leanest = min(options, key=lambda o: o.plan.host_total)
        return replace(leanest.plan, tier_note=f"nvme_states auto: {','.join(leanest.names) or 'none'}, the fewest "
                                               "host bytes; no way of placing the states fits")
    best = fitting[0]
    others = "; ".join(o.describe() for o in fitting[1:4])
    why = ("a step predicted with the disk as a bound" if best.bound_s is not None else
           "the fewest disk bytes a step (the disk's rates unknown: `megatrain calibrate --nvme PATH`)")
    note = (f"nvme_states auto: {best.describe()}, of the ways that fit the host the shortest {why}"
            + (f" (then {others})" if others else ""))
    return replace(best.plan, tier_note=note)


def nvme_hint(plan: MemoryPlan) -> str:
    """For a refusal where the arena does not fit: the NVMe tier's states that would make it fit, if any (auto's
    choice by disk bytes: nothing is known of the disk)."""
    tiered = with_tier(plan, None, "NVMe", "auto")
    if tiered.tier is None or not tiered.host_fits:
        return ""
    names = tiered.tier.names
    return (f", or keep the {' and '.join(names)} on a local disk (--nvme PATH --nvme-states "
            f"{','.join(names)}: {tiered.tier.nvme_bytes / GiB:.1f} GiB there)")
