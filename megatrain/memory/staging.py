"""The arena as the NVMe tier's staging buffer: a unit's NVMe-resident states brought into staging slots in the arena
before the optimizer's pass over it and sent back behind it, no Ray.

Each optimizer worker has one UnitStager: `take(u)` (read ahead where the order was foreseen), `give(u)` (written
behind), `stow` for held gradients (docs/design.md#staging)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatrain.io.slot_io import SlotIO
from megatrain.memory.arena import Arena
from megatrain.memory.nvme import StateFiles, TierHandle, TierSpec, aligned_buffer, all_of, punch_out
from megatrain.model.layout import ALIGN, ModelLayout

AHEAD = 1  # units read ahead of the one taken: each holds its share of RAM while it waits
# a worker's staging slots: the unit updated, the next read ahead, the one before written behind; consecutive units
# (the backward's order and the update's) never share one
SLOTS = 3
# elements of a worker's slot at most: 8 MiB of fp32 per kind, two of the state files' requests (each worker keeps one
# part read ahead and one written behind); a unit larger than a slot (an embedding of 18% of a model, a 120B's layer)
# goes through in parts
PART_NUMEL = 2 << 20
READ_AHEAD = 256 << 20  # bytes a checkpoint's or an export's reads of the states on disk run ahead of its writes
STAGE_PREFIX = "stage_"  # the arena's staging segment of a kind on NVMe: stage_exp_avg, ...
# kinds another process lands in their own arena range (the executor's gradients), written to disk from there
LANDING = ("grads",)


@dataclass(frozen=True)
class Extent:
    """Bytes [start, end) of one kind's arena segment and state file (the same offsets in both)."""

    kind: str
    start: int
    end: int


def unit_extents(bounds: dict[int, tuple[int, int]], kinds: tuple[str, ...], element_size: int = 4
                 ) -> dict[int, list[Extent]]:
    """unit -> its extents of each kind, from unit -> [start, end) in elements of the arena's segments."""
    return {u: [Extent(k, a * element_size, b * element_size) for k in kinds] for u, (a, b) in bounds.items() if b > a}


class UnitStager:
    """Moves `extents` (per unit) between `files` and memory: each extent's own range of the arena segment of its kind
    (`tensors`, punched out at `paths` once written), or where `slots` is given, the unit's slot of the staging segments
    `tensors` hold (stage_<kind>: SLOTS ranges of `slot_numel` elements from element `slot_base`), kept allocated. A
    unit larger than a slot is moved in parts (`parts`), numbered in forward order so that consecutive parts (the
    backward's order and the update's) never share a slot.

    Kinds in `landing` (an optimizer worker's held gradients) are placed twice: another process (the executor) lands
    them in their own arena range, from where `stow` writes them to disk and punches the range out; `take` reads them
    back into the unit's slot, and `give` never writes them (nothing reads a gradient after its update)."""

    def __init__(self, files: StateFiles, tensors: dict[str, torch.Tensor], paths: dict[str, Path] | None,
                 extents: dict[int, list[Extent]], ahead: int = AHEAD, slot_numel: int = 0, slot_base: int = 0,
                 landing: tuple[str, ...] = (), parts: dict[int, list[int]] | None = None):
        """parts: unit -> the keys of `extents` it is staged as, in forward order, each at most `slot_numel` elements of
        each kind (by default each unit one part, its own key); take and give move one part, the rest a unit's all."""
        self.files, self.extents, self.ahead, self.paths = files, extents, ahead, paths
        self.slotted, self.landing, self.slot_numel = slot_numel > 0, landing, slot_numel
        self.parts = parts if parts is not None else {u: [u] for u in extents}
        self.memory: dict[int, list[torch.Tensor]] = {}  # part -> the byte view each of its extents moves through
        self.ranges: dict[int, list[torch.Tensor | None]] = {}  # part -> each extent's own arena range (where it lands)
        for part, own in extents.items():
            # a slotted stager's other kinds have no range of theirs here (their arena range stays empty)
            self.ranges[part] = [tensors[e.kind].view(torch.uint8)[e.start : e.end]
                                 if e.kind in landing or not self.slotted else None for e in own]
            at = (slot_base + (part % SLOTS) * slot_numel) * 4
            self.memory[part] = [tensors[STAGE_PREFIX + e.kind].view(torch.uint8)[at : at + e.end - e.start]
                                 if self.slotted else view for e, view in zip(own, self.ranges[part], strict=True)]
        self.io: dict[int, Future] = {}  # part -> its last read or write
        self.staged: dict[int, set[str]] = {}  # part -> the kinds of it in memory (read, or being read)
        self.occupant: dict[int, int] = {}  # slot -> the part whose states it holds or is writing
        self.taken: int | None = None
        self.last: int | None = None
        self.skip: frozenset[str] = frozenset()  # the kinds the last take left out (its read ahead leaves them too)

    def holds(self, unit: int, kind: str | None = None) -> bool:
        return unit in self.parts and (kind is None or any(e.kind == kind for e in self.extents[self.parts[unit][0]]))

    def view(self, kind: str, part: int) -> torch.Tensor:
        """The fp32 memory the part's extent of `kind` is staged in (what the optimizer's pieces are views of)."""
        e = next(i for i, x in enumerate(self.extents[part]) if x.kind == kind)
        return self.memory[part][e].view(torch.float32)

    def order(self, unit: int) -> list[int]:
        """The unit's parts in the order a pass takes them, so the read ahead of one part guesses the next: descending
        where the last part taken is above them (the backward's order), or at the start of a pass anywhere but at the
        first unit (the backward starts at the top, the update and the rollback at the bottom)."""
        parts = self.parts[unit]
        down = self.last > parts[-1] if self.last is not None else parts[0] > 0
        return parts[::-1] if down else parts

    def take(self, part: int, skip: tuple[str, ...] = ()) -> None:
        """Returns once the part's states (but the kinds in `skip`) are in memory; reads the foreseen next one ahead."""
        if part not in self.extents:
            return
        self.skip = frozenset(skip)
        missing = self._kinds(part) - self.staged.get(part, set())
        if missing:
            self._read(part, missing)
        self.io[part].result()
        self.taken = part
        guess = None if self.last is None else part + (part - self.last)
        self.last = part
        if (self.ahead and guess is not None and guess in self.extents and guess not in self.staged
                and not (self.slotted and guess % SLOTS == part % SLOTS)):
            self._drop_unused(keep=part)
            self._read(guess, self._kinds(guess))

    def give(self, part: int, changed: bool = True, stow: bool = False, then: Callable[[], None] | None = None
             ) -> None:
        """The pass over the part is done: its states are written behind (`changed`) and leave memory; `stow`: its
        landing kinds are written from their arena ranges as well; `then` runs once all is on disk."""
        if part not in self.extents:
            return
        self.taken = None
        kinds = self.staged.pop(part, set()) - set(self.landing) if changed else set()
        self.io[part] = self._write(part, kinds, stow, then)

    def after(self, unit: int, then: Callable[[], None]) -> None:
        """`then` runs once what is under way for every part of the unit is done (at once where nothing is)."""
        parts = self.parts[unit]
        self.io[parts[-1]] = all_of([self.io[p] for p in parts if p in self.io], then=then)

    def stow(self, unit: int, then: Callable[[], None] | None = None) -> None:
        """The unit's landing kinds from their arena ranges to disk, the ranges punched out after (then `then`)."""
        if self.holds(unit):
            for part in self.parts[unit]:
                self.io[part] = self._write(part, set(), True, claim=False)
            if then is not None:
                self.after(unit, then)

    def wait(self, unit: int) -> None:
        """What is under way for the unit is done."""
        for part in self.parts.get(unit, ()):
            self._wait(part, claim=False)

    def drop(self, unit: int, part: int | None = None) -> None:
        """The unit's (`part`'s) landing kinds leave their arena ranges unwritten (a final update read them there)."""
        for p in self.parts.get(unit, ()) if part is None else (part,):
            self._wait(p, claim=False)
            self._punch_ranges(p, set(self.landing))

    def flush(self) -> None:
        """Every write on disk and nothing left staged: what another process reads of the files is current."""
        self._drop_unused(keep=None)
        errors = []
        for part in list(self.io):
            try:
                self.io.pop(part).result()
            except Exception as e:  # noqa: BLE001 - all writes are waited for before the first error is raised
                errors.append(e)
        self.last = None
        self.occupant.clear()
        if errors:
            raise errors[0]

    # ---- whole ranges, for the store ----
    def bring_in(self) -> None:
        """Every extent into the arena (a checkpoint reads them there); `send_out` ends it."""
        for part, extents in self.extents.items():
            missing = {e.kind for e in extents} - self.staged.get(part, set())
            if missing:
                self._read(part, missing)
        for part in self.extents:
            self.io[part].result()

    def send_out(self, changed: bool = True) -> None:
        """Every extent to disk (`changed`) and out of the arena."""
        for part, extents in self.extents.items():
            self.staged.pop(part, None)
            self.io[part] = self._write(part, {e.kind for e in extents} if changed else set(), False)
        self.flush()

    # ---- I/O, a part at a time ----
    def _kinds(self, part: int) -> set[str]:
        return {e.kind for e in self.extents[part]} - self.skip

    def _wait(self, part: int, claim: bool = True) -> None:
        """What was under way for the part, and (`claim`: it is about to use its slot) in its slot for the part there
        before it, is done."""
        before = self.io.get(part)
        if before is not None:
            before.result()  # its write: a read must not overtake it
        if self.slotted and claim:
            slot = part % SLOTS
            other = self.occupant.get(slot)
            if other is not None and other != part:
                self.staged.pop(other, None)  # read ahead and never taken: nothing to write
                if other in self.io:
                    self.io.pop(other).result()
            self.occupant[slot] = part

    def _read(self, part: int, kinds: set[str]) -> None:
        self._wait(part)
        self.staged.setdefault(part, set()).update(kinds)
        self.io[part] = all_of([self.files.read(e.kind, e.start, view)
                                for e, view in zip(self.extents[part], self.memory[part], strict=True)
                                if e.kind in kinds])

    def _write(self, part: int, kinds: set[str], stow: bool, then: Callable[[], None] | None = None,
               claim: bool = True) -> Future:
        """Writes the part's `kinds` from memory (and with `stow` its landing kinds from their arena ranges); once on
        disk, what left RAM is punched out and `then` runs."""
        self._wait(part, claim)
        landed = set(self.landing) if stow else set()
        writes = [self.files.write(e.kind, e.start, view)
                  for e, view in zip(self.extents[part], self.memory[part], strict=True) if e.kind in kinds]
        writes += [self.files.write(e.kind, e.start, view)
                   for e, view in zip(self.extents[part], self.ranges[part], strict=True) if e.kind in landed]

        def done() -> None:
            self._punch_ranges(part, landed if self.slotted else {e.kind for e in self.extents[part]})
            if then is not None:
                then()

        return all_of(writes, then=done)

    def _punch_ranges(self, part: int, kinds: set[str]) -> None:
        """The part's arena ranges of `kinds` give their pages back (a slot keeps its pages for the next part)."""
        if self.paths is None:
            return
        for e in self.extents[part]:
            if e.kind in kinds:
                punch_out(self.paths[e.kind], e.start, e.end - e.start)

    def _drop_unused(self, keep: int | None) -> None:
        """Read-ahead parts never taken leave memory (unchanged: nothing to write)."""
        for part in [p for p in self.staged if p != keep and p != self.taken]:
            self.staged.pop(part)
            self.io[part] = self._write(part, set(), False)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.files.close()


def part_numel(unit_numels: Iterable[int], layer_numel: int, workers: int) -> int:
    """Elements of one worker's staging slot, the most of a unit's share it stages at a time: its share of the largest
    unit on NVMe, at most of a decoder layer, and at most PART_NUMEL (ALIGN blocks). The plan counts SLOTS of these per
    worker and kind."""
    blocks = min(max(unit_numels, default=0), max(layer_numel, ALIGN)) // ALIGN
    return min(-(-blocks // max(workers, 1)) * ALIGN, PART_NUMEL)


def slot_numel(layout: ModelLayout, from_unit: int, workers: int) -> int:
    """part_numel of the layout's units on NVMe (from `from_unit` on)."""
    return part_numel((u.numel for u in layout.units if u.index >= from_unit), layout.max_layer_numel(), workers)


def split_range(start: int, end: int, numel: int) -> list[tuple[int, int]]:
    """[start, end) cut every `numel` elements (a multiple of ALIGN) from its start: a shard's parts."""
    return [(a, min(end, a + numel)) for a in range(start, end, numel)]


def stage_segments(layout: ModelLayout, kinds: tuple[str, ...], from_unit: int, workers: int
                   ) -> tuple[tuple[str, str, int], ...]:
    """The arena's staging segments of a tier (name, dtype, numel): SLOTS slots per worker of each kind."""
    numel = workers * SLOTS * slot_numel(layout, from_unit, workers)
    return tuple((STAGE_PREFIX + kind, "float32", numel) for kind in kinds)


def open_stager(tier: TierHandle, arena: Arena, extents: dict[int, list[Extent]], slot_numel: int,
                slot_base: int, parts: dict[int, list[int]] | None = None) -> UnitStager:
    """A worker's stager over `extents` (part -> its extents of each kind; `parts`: unit -> its parts, by default each
    unit one) of the run's state files, through its SLOTS slots of `slot_numel` elements from element `slot_base` of
    the arena's staging segments."""
    landing = tuple(k for k in tier.kinds() if k in LANDING)
    return UnitStager(StateFiles.open(tier), arena.tensors, {k: arena.handle.path(k) for k in landing}, extents,
                      slot_numel=slot_numel, slot_base=slot_base, landing=landing, parts=parts)


class StoreTier:
    """The parameter store's side of the tier: owns the state files, and reads and writes the states on disk one tensor
    at a time (SlotIO: init, loads, checkpoints, exports), never a whole kind in RAM."""

    def __init__(self, spec: TierSpec, arena: Arena, first: dict[str, int]):
        """first: per kind, the element of its segment the units on NVMe start at (the resident ones before)."""
        sizes = {k: arena.tensors[k].numel() * arena.tensors[k].element_size() for k in spec.kinds}
        self.files = StateFiles.create(spec.root, sizes, run_id=arena.handle.run_id, threads=spec.threads,
                                       from_unit=spec.from_unit)
        arena.handle = replace(arena.handle, tier=self.files.handle)  # what workers open the files by
        self.arena, self.kinds = arena, spec.kinds
        self.reader = TierReader(self.files, arena.tensors, spec.kinds, first)
        self.io = self.reader.slot_io()

    def holds(self, kind: str) -> bool:
        return kind in self.kinds

    def zero(self, kinds: tuple[str, ...] | None = None) -> None:
        """The states (of `kinds`, by default all) back to zeros in the arena and on disk, touching no page."""
        for kind in self.kinds if kinds is None else [k for k in kinds if k in self.kinds]:
            t = self.arena.tensors[kind]
            punch_out(self.arena.handle.path(kind), 0, t.numel() * t.element_size())
            self.files.zero(kind)

    def close(self) -> None:
        try:
            self.files.close()
        finally:
            self.files.unlink()


class TierReader:
    """Views of the arena's segments of the kinds on NVMe, read from and written to the state files instead (from
    element first[kind] on: the units before are resident, their states in the arena), one tensor at a time through an
    aligned buffer of its size; any process that opened the files can (the store, the driver)."""

    def __init__(self, files: StateFiles, tensors: dict[str, torch.Tensor], kinds: tuple[str, ...],
                 first: dict[str, int]):
        self.files, self.tensors, self.kinds, self.first = files, tensors, kinds, first

    def _where(self, view: torch.Tensor) -> tuple[str, int] | None:
        """(kind, byte offset) of a view of a segment on NVMe, past the resident units; None where in the arena."""
        for kind in self.kinds:
            seg = self.tensors[kind]
            at = view.data_ptr() - seg.data_ptr()
            if self.first[kind] * seg.element_size() <= at < seg.numel() * seg.element_size():
                return kind, at
        return None

    def read(self, view: torch.Tensor) -> torch.Tensor:
        out, pending = self._start_read(view)
        if pending is not None:
            pending.result()
        return out

    def read_ahead(self, views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """`read` of each view in order, the next ones' reads under way (READ_AHEAD bytes at most, and one) while each
        is used: a checkpoint's disk reads overlap its file writes."""
        queue: deque[tuple[torch.Tensor, Future | None, int]] = deque()
        todo, held = iter(views), 0
        try:
            while True:
                while not queue or held < READ_AHEAD:
                    view = next(todo, None)
                    if view is None:
                        break
                    nbytes = view.numel() * view.element_size()
                    queue.append((*self._start_read(view), nbytes))
                    held += nbytes
                if not queue:
                    return
                out, pending, nbytes = queue.popleft()
                if pending is not None:
                    pending.result()
                held -= nbytes
                yield out
        finally:  # the reads under way land in buffers of their own: wait for them whatever stopped the caller
            for _, pending, _ in queue:
                if pending is not None:
                    pending.exception()

    def _start_read(self, view: torch.Tensor) -> tuple[torch.Tensor, Future | None]:
        """The tensor the view's data will be in, and the read that brings them (None: the view itself, in RAM)."""
        where = self._where(view)
        if where is None:
            return view, None
        nbytes = view.numel() * view.element_size()
        buf = aligned_buffer(nbytes)  # the read fills it, padding included
        return buf[:nbytes].view(view.dtype).view(view.shape), self.files.read(where[0], where[1], buf)

    def fill(self, view: torch.Tensor, write: Callable[[torch.Tensor], None]) -> None:
        where = self._where(view)
        if where is None:
            write(view)
            return
        # zeros past the view: the alignment padding between slots
        buf = aligned_buffer(view.numel() * view.element_size(), zeroed=True)
        write(buf[: view.numel() * view.element_size()].view(view.dtype).view(view.shape))
        self.files.write(where[0], where[1], buf).result()

    def slot_io(self) -> SlotIO:
        return SlotIO(self.read, self.fill, self.read_ahead)
