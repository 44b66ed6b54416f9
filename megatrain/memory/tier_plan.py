"""The NVMe tier in the memory plan: per kind of state, the bytes it keeps on disk, what it stages in the arena at a
time, its disk traffic per step and the seconds that takes at the disk's rates (megatrain/memory/nvme.py moves them).

Kinds are the arena's segments: the fp32 masters (params), Adam m and v (exp_avg, exp_avg_sq), the held gradients
(grads). Units resident on the device keep theirs in the arena (the executor loads them from there). Per step and
streamed parameter the optimizer reads and writes back each state kind it updates (4 B each way); held gradients are
written as they land and read back for the update (4 B each way); a rollback reads a unit's states and gradient again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatrain.config import ConfigError, ModelConfig
from megatrain.memory.nvme import SUPPORTED
from megatrain.model.layout import planned_unit_numels

if TYPE_CHECKING:
    from megatrain.memory.plan import MemoryPlan

GiB = 2**30
KINDS = {"master": ("params",), "moments": ("exp_avg", "exp_avg_sq"), "grads": ("grads",)}
AUTO_ORDER = ("moments", "master", "grads")  # what "auto" moves first: the most bytes for the least traffic first
STAGED_UNITS = 3  # each worker's staging slots of its share of a unit (megatrain/memory/staging.py SLOTS)


def tier_names(states: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """nvme_states as names of KINDS ("auto" is decided by `auto_names`)."""
    if states == "all":
        return tuple(KINDS)
    if states == "auto":
        return AUTO_ORDER
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

    def problem(self) -> str | None:
        """What a run cannot follow of this tier (a plan reports it, the Engine refuses it)."""
        refused = [n for n in self.names if n not in SUPPORTED]
        if not refused:
            return None
        return (f"nvme_states {', '.join(refused)} cannot be placed on NVMe by a run yet (only "
                f"{', '.join(SUPPORTED)}): the GPU streams the fp32 masters and the held gradients wait in the arena; "
                "use nvme_states = \"moments\" on a host with room for the rest.")

    def report(self, step_s: float | None = None) -> list[str]:
        kinds = ", ".join(f"{k} {n / GiB:.2f} GiB" for k, n in self.on_disk)
        lines = [f"nvme ({self.directory}): {kinds}; {self.staging_bytes / GiB:.2f} GiB staged in the arena",
                 f"NVMe per step: {self.read_bytes / GiB:.2f} GiB read, {self.write_bytes / GiB:.2f} GiB written"]
        if self.problem():
            lines.append(f"a run refuses it today: {self.problem()}")
        disk_s = self.seconds()
        if disk_s is None:
            lines.append("NVMe rates unknown: `megatrain calibrate --nvme PATH` or --nvme-gbps READ,WRITE")
            return lines
        lines[-1] += f" ({self.read_gbps:.2f} / {self.write_gbps:.2f} GB/s: {disk_s:.2f} s)"
        if step_s is not None:
            lines.append(f"step predicted with the disk as a bound: {max(step_s, disk_s):.2f} s "
                         f"({'the disk' if disk_s > step_s else 'compute and PCIe'} bound; without it {step_s:.2f} s)")
        return lines


def plan_tier(directory: str, names: tuple[str, ...], streamed_numel: int, grads_numel: int, max_unit_numel: int,
              rates: tuple[float, float] | None = None) -> TierPlan:
    """The tier of kinds `names` for `streamed_numel` elements (the streamed units'; the held gradients':
    `grads_numel`, 0 where they do not wait in the arena), staged up to `max_unit_numel` elements a unit (the workers
    share each unit)."""
    on_disk = []
    for name in names:
        for kind in KINDS[name]:
            numel = grads_numel if kind == "grads" else streamed_numel
            if numel:
                on_disk.append((kind, numel * 4))
    per_unit = sum(4 for k, _ in on_disk) * max_unit_numel
    staging = min(sum(n for _, n in on_disk), STAGED_UNITS * per_unit) if on_disk else 0
    traffic = sum(n for _, n in on_disk)
    return TierPlan(directory, names, tuple(on_disk), staging, traffic, traffic, *(rates or (None, None)))


def auto_names(fits: Callable[[tuple[str, ...]], bool], states: str | tuple[str, ...] | list[str]
               ) -> tuple[str, ...]:
    """nvme_states "auto": nothing where the run fits without the tier, else the fewest kinds in AUTO_ORDER that make
    it fit (all of them where none does); any other setting as given."""
    names = tier_names(states)
    if states != "auto":
        return names
    for count in range(len(AUTO_ORDER) + 1):
        if fits(AUTO_ORDER[:count]):
            return AUTO_ORDER[:count]
    return AUTO_ORDER


def with_tier(plan: MemoryPlan, config: ModelConfig | None, directory: str | None,
              states: str | tuple[str, ...] | list[str], rates: tuple[float, float] | None = None) -> MemoryPlan:
    """`plan` with the NVMe tier of `states` in `directory` (None: no tier, the plan as it is); config None: the
    staging left out (a hint's estimate)."""
    if not directory:
        return plan
    largest = max(planned_unit_numels(config)) if config is not None else 0
    streamed = plan.arena_numel - plan.resident_params
    grads = plan.grads_bytes // 4 if plan.grads == "arena" else 0

    def tiered(names: tuple[str, ...]) -> MemoryPlan:
        tier = plan_tier(directory, names, streamed, grads, largest, rates)
        return replace(plan, tier=tier if tier.on_disk else None)

    return tiered(auto_names(lambda names: tiered(names).host_problem() is None, states))


def nvme_hint(plan: MemoryPlan) -> str:
    """For a refusal where the arena does not fit: the NVMe tier's states that would make it fit, if any."""
    for count in range(1, len(AUTO_ORDER) + 1):
        names = AUTO_ORDER[:count]
        tiered = with_tier(plan, None, "NVMe", names)
        if tiered.tier is not None and tiered.host_problem() is None:
            return (f", or keep the {' and '.join(names)} on a local disk (--nvme PATH --nvme-states "
                    f"{','.join(names)}: {tiered.tier.nvme_bytes / GiB:.1f} GiB there)")
    return ""
