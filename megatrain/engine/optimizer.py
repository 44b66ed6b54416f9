"""Sharded AdamW over the arena, in place: the work of one optimizer worker.

Worker w of N owns the w-th contiguous shard of every unit's range, cut on ALIGN boundaries so the weights do not
depend on N, and walks it in pieces (clip scale, fused AdamW, bf16 copy) in one pass over memory. A speculated update
is settled (confirmed, or rolled back in closed form and redone clipped) or rolled back in one pass too. Why, and the
arithmetic's error bounds: docs/design.md#the-optimizer and #the-speculative-updates-arithmetic."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from megatrain.config import OptimConfig
from megatrain.memory.arena import BF16_COPY_SEGMENT, Arena
from megatrain.memory.nvme import KINDS
from megatrain.memory.staging import SLOTS, Extent, UnitStager, open_stager, slot_numel, split_range
from megatrain.model.layout import ALIGN, GradLayout, ModelLayout, NodeShard, Unit, aligned_split

# Elements of one piece of the pass: its fp32 weights, gradient and moments (4 MiB each, a 16th of that per core of
# 16) stay in the cache between the clip scale, the fused AdamW and the bf16 copy, while each torch call over the
# piece takes long beside the call's own cost (benchmarks/optimizer.py measures pieces against whole groups).
PIECE_NUMEL = 1024 * ALIGN
MOMENTS = KINDS["moments"]  # packed per node (NodeShard); the other kinds at the units' offsets


def clip_coefficient(grad_norm: float, max_grad_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if not max_grad_norm:
        return 1.0
    return min(1.0, max_grad_norm / (grad_norm + 1e-6))


@dataclass(frozen=True)
class Speculation:
    """A step whose units are updated as their gradients land (clip coefficient 1), before the norm is known."""

    number: int  # this speculation's (a recovery speculates a step again): the workers' record of what they updated
    max_grad_norm: float | None  # once the units landed so far clip, the rest wait for the step's coefficient


def shard_stager(layout: ModelLayout, arena: Arena, worker: int, num_workers: int, node: NodeShard | None = None
                 ) -> UnitStager | None:
    """The worker's stager of the run's NVMe-resident states (None without a tier): its shard of every unit (of the
    node's part of it: its moments at the node's packing, its gradient and weights at the unit's offsets), through its
    slots of the arena's staging segments."""
    tier = arena.handle.tier
    if tier is None:
        return None
    node = node or NodeShard.build(layout)
    numel = slot_numel(layout, tier.from_unit, num_workers)
    extents: dict[int, list[Extent]] = {}
    parts: dict[int, list[int]] = {}  # unit -> its parts of at most a slot, numbered in forward order
    for unit in layout.units:
        lo, hi = shard_bounds(unit, worker, num_workers, node)
        if unit.index < tier.from_unit or hi <= lo:
            continue
        packed = node.offsets[unit.index] - node.bounds[unit.index][0]
        for a, b in split_range(lo, hi, numel):
            parts.setdefault(unit.index, []).append(len(extents))
            extents[len(extents)] = [Extent(k, 4 * at, 4 * (at + b - a))
                                     for k in tier.kinds() for at in [packed + a if k in MOMENTS else unit.offset + a]]
    return open_stager(tier, arena, extents, numel, worker * SLOTS * numel, parts)


def shard_bounds(unit: Unit, worker: int, num_workers: int, node: NodeShard | None = None) -> tuple[int, int]:
    """[start, end) of worker's shard within the unit (of the node's part of it), in elements from the unit's
    start."""
    lo, hi = (0, unit.numel) if node is None else node.bounds[unit.index]
    a, b = aligned_split(hi - lo, worker, num_workers)
    return lo + a, lo + b


@dataclass
class _Piece:
    """A piece of a unit's shard, of one decay group: the tensors each kernel of the pass takes in one call."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    bf16_copy: list[torch.Tensor]  # bf16 copies of params (bf16 runs), rewritten after each update
    staged: list[torch.Tensor]  # the gradient where the NVMe tier stages it back (grads: where the executor landed it)

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.params)


@dataclass
class _Part:
    """A part of a unit's shard the NVMe tier stages at once (the whole shard where the tier holds none of it)."""

    key: int | None  # the stager's (None: nothing of it is staged)
    groups: tuple[list[_Piece], list[_Piece]]  # the decay group's pieces, the no-decay group's


class AdamWShard:
    """One worker's shard of every unit, updated with torch's fused AdamW kernel."""

    def __init__(self, layout: ModelLayout, tensors: dict[str, torch.Tensor], optim: OptimConfig, worker: int,
                 num_workers: int, versions: torch.Tensor | None = None, grad_layout: GradLayout | None = None,
                 issued: torch.Tensor | None = None, node: NodeShard | None = None, piece_numel: int = PIECE_NUMEL,
                 stager: UnitStager | None = None):
        """`node`: the part of each unit this node updates, whose moments are packed in `exp_avg`/`exp_avg_sq`
        (several nodes); by default the whole model, moments at the weights' offsets. piece_numel: a multiple of
        ALIGN. stager: the states this shard keeps on NVMe, brought into their arena ranges around each pass; where it
        holds the gradients, a gradient is stowed to disk once read beside the backward, or as it lands where it is not
        (`stow`), and staged back for the update that reads it later."""
        assert piece_numel % ALIGN == 0, "pieces must be cut where the fused kernel's result does not change"
        self.layout, self.optim, self.worker, self.num_workers = layout, optim, worker, num_workers
        self.node = node or NodeShard.build(layout)
        self.versions = versions  # int64 [units, workers], shared
        self.issued = issued  # int64 [units], shared: the update number each unit has been handed out for
        # where each unit's gradient is read from (its slot of a ring, when gradients stream)
        self.grad_layout = grad_layout or GradLayout.full(layout)
        self.piece_numel = piece_numel
        self.stager = stager
        self.device = tensors["params"].device
        # per unit: its parts (one unless the NVMe tier stages it in several), and their pieces of each decay group
        self.parts: list[list[_Part]] = [self._parts(u, tensors) for u in layout.units]
        self.groups: list[tuple[list[_Piece], list[_Piece]]] = [
            tuple([p for part in parts for p in part.groups[g]] for g in (0, 1)) for parts in self.parts]
        self.numel = sum(p.numel for pair in self.groups for pieces in pair for p in pieces)
        # the speculative update: which speculation's number the record is of, the units speculated in it, and how
        # many executors' gradient slices of each unit have landed (the update waits for all of them)
        self.speculation: int | None = None
        self.speculated: set[int] = set()
        self.arrivals: dict[int, int] = {}
        self.landing: tuple[int, int | None] | None = None  # (step, speculation) the arrivals are of
        self.stowing: set[int] = set()  # units of it some executor stowed (not updated beside the backward)
        self.stowed: set[int] = set()  # units whose gradient is on disk (staged back for its update), not in the arena

    def _parts(self, unit: Unit, tensors: dict[str, torch.Tensor]) -> list[_Part]:
        """The unit's shard in the parts the stager moves it in (its slot's size at most), or whole."""
        lo, hi = shard_bounds(unit, self.worker, self.num_workers, self.node)
        if self.stager is None or not self.stager.holds(unit.index):
            return [_Part(None, self._pieces(unit, tensors, lo, hi, None))]
        spans = split_range(lo, hi, self.stager.slot_numel)
        return [_Part(key, self._pieces(unit, tensors, a, b, key))
                for key, (a, b) in zip(self.stager.parts[unit.index], spans, strict=True)]

    def _pieces(self, unit: Unit, tensors: dict[str, torch.Tensor], lo: int, hi: int, key: int | None
                ) -> tuple[list[_Piece], list[_Piece]]:
        """[lo, hi) of the unit (a part of its shard, staged as `key`) as pieces of at most piece_numel elements per
        decay group: a tensor longer than that is cut every piece_numel elements from its start, shorter ones share a
        piece."""
        grads = self.grad_layout.range_of(unit, tensors["grads"])
        bf16_copy = tensors.get(BF16_COPY_SEGMENT)
        pieces: tuple[list[_Piece], list[_Piece]] = ([], [])
        for slot in unit.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            for start in range(a, b, self.piece_numel):
                end = min(b, start + self.piece_numel)
                group = pieces[0 if slot.decay else 1]
                if not group or group[-1].numel + end - start > self.piece_numel:
                    group.append(_Piece([], [], [], [], [], []))
                piece, at = group[-1], unit.offset + start
                piece.params.append(self._state(unit, tensors, "params", lo, start, end, key))
                piece.grads.append(grads[start:end])
                staged = self._staged(unit, "grads", lo, start, end, key)
                piece.staged.append(grads[start:end] if staged is None else staged)
                piece.exp_avg.append(self._state(unit, tensors, "exp_avg", lo, start, end, key))
                piece.exp_avg_sq.append(self._state(unit, tensors, "exp_avg_sq", lo, start, end, key))
                if bf16_copy is not None:
                    piece.bf16_copy.append(bf16_copy[at : unit.offset + end])
        return pieces

    def _state(self, unit: Unit, tensors: dict[str, torch.Tensor], kind: str, lo: int, start: int, end: int,
               key: int | None) -> torch.Tensor:
        """[start, end) of the unit's weights or moment `kind`: in the arena (a moment: at the node's packing), or in
        the staging slot of the part `key` (from `lo` on) where on NVMe."""
        staged = self._staged(unit, kind, lo, start, end, key)
        if staged is not None:
            return staged
        if kind == "params":
            return tensors[kind][unit.offset + start : unit.offset + end]
        return self.node.moments(unit, tensors[kind], start, end)

    def _staged(self, unit: Unit, kind: str, lo: int, start: int, end: int, key: int | None) -> torch.Tensor | None:
        """[start, end) of the unit's `kind` in the staging slot of its part `key` (from `lo` on) where the NVMe tier
        holds that kind (None: it does not)."""
        if key is None or not self.stager.holds(unit.index, kind):
            return None
        return self.stager.view(kind, key)[start - lo : end - lo]

    # ---- the pass ----
    def update(self, unit_index: int, step: int, clip_coef: float = 1.0) -> float:
        """Applies update number `step` (0-based) to this worker's shard of one unit; returns seconds taken."""
        return self._pass(unit_index, step, clip_coef, roll_back=False, update=True)

    def _pass(self, unit_index: int, step: int, clip_coef: float, roll_back: bool, update: bool, keep: bool = False
              ) -> float:
        """One pass over the unit's shard, piece by piece: `roll_back` takes the coefficient-1 update number `step` out
        (closed form), `update` applies it with `clip_coef`; then the bf16 copy. The unit's version is step + 1 after
        an update, step after a roll back alone. keep: the gradient stays wanted after the pass (an update beside the
        backward, which the step's settling may roll back)."""
        t0 = time.perf_counter()
        lr = self.optim.lr_at(step)
        beta1, beta2 = self.optim.betas
        # read, not written, by the fused kernel: one for every tensor, on their device (resident units': the GPU),
        # filled there: torch.tensor(value, device=...) copies from pageable memory and waits for the stream, so each
        # resident unit's update would wait for the one before it and the executor could queue nothing meanwhile
        steps = torch.full((), float(step + 1), device=self.device)
        # the gradient comes back from disk where it was stowed, else it is where it landed (beside the backward: keep)
        staged = unit_index in self.stowed and not keep
        leaves = self._leaving(unit_index, staged, keep)
        for part in self._in_order(unit_index):
            if part.key is not None:  # the part's states into its slot (the next one read ahead)
                self.stager.take(part.key, skip=() if staged else ("grads",))
            for pieces, weight_decay in zip(part.groups, (self.optim.weight_decay, 0.0), strict=True):
                for piece in pieces:
                    grads = piece.staged if staged else piece.grads
                    if roll_back:
                        self._invert(piece, grads, step, lr, weight_decay)
                    if update:
                        if clip_coef < 1.0:
                            torch._foreach_mul_(grads, clip_coef)
                        torch._fused_adamw_(piece.params, grads, piece.exp_avg, piece.exp_avg_sq, [],
                                            [steps] * len(piece.params), lr=lr, beta1=beta1, beta2=beta2,
                                            weight_decay=weight_decay, eps=self.optim.eps, amsgrad=False,
                                            maximize=False)
                    if piece.bf16_copy:
                        torch._foreach_copy_(piece.bf16_copy, piece.params)  # round to nearest even, as a GPU cast does
            if part.key is not None:  # written behind, and the landed gradient's range with it
                if leaves == "drop":
                    self.stager.drop(unit_index, part.key)
                self.stager.give(part.key, stow=leaves == "stow")
        self._after_pass(unit_index, step + 1 if update else step, leaves)
        return time.perf_counter() - t0

    def _in_order(self, unit_index: int) -> list[_Part]:
        """The unit's parts in the order the stager foresees (the backward's: descending) or forward."""
        parts = self.parts[unit_index]
        if parts[0].key is None or self.stager.order(unit_index)[0] == parts[0].key:
            return parts
        return parts[::-1]

    def _leaving(self, unit_index: int, staged: bool, keep: bool) -> str:
        """Where the tier holds the gradient and the pass reads it where it landed, how it leaves that range: "stow"n
        (`keep`: the update beside the backward, which the settling may roll back) or "drop"ped (a final update);
        "" where there is nothing to do."""
        if self.stager is None or staged or not self.stager.holds(unit_index, "grads"):
            return ""
        return "stow" if keep else "drop"

    def _after_pass(self, unit_index: int, version: int, leaves: str) -> None:
        """The version published: at once (the states written behind), or where the gradient was stowed only once its
        range is punched out, before the executor lands the next step's gradient there."""
        if leaves == "stow":
            self.stowed.add(unit_index)
            self.stager.after(unit_index, lambda: self.publish(unit_index, version))
            return
        if not leaves:
            self.stowed.discard(unit_index)
        if self.stager is not None:
            self._masters_sent(unit_index)
        self.publish(unit_index, version)

    def _masters_sent(self, unit_index: int) -> None:
        """Several nodes with the masters on NVMe: the store sends this node's part from its state file once the
        version says it is updated (megatrain/distributed/node_exchange.py MasterParts), so that waits for the write."""
        if self.node.nodes > 1 and self.stager.holds(unit_index, "params"):
            self.stager.wait(unit_index)

    def _invert(self, piece: _Piece, grads: list[torch.Tensor], step: int, lr: float, weight_decay: float) -> None:
        """The fused kernel's update number `step` with clip coefficient 1, inverted from what it left and the
        gradient: p = (p' + lr / bc1 * m' / (sqrt(v' / bc2) + eps)) / (1 - lr wd), m = (m' - (1-b1) g) / b1,
        v = max(0, (v' - (1-b2) g^2) / b2); after update number 0 the moments were zero."""
        beta1, beta2 = self.optim.betas
        bc1, bc2_sqrt = 1.0 - beta1 ** (step + 1), math.sqrt(1.0 - beta2 ** (step + 1))
        denom = torch._foreach_sqrt(piece.exp_avg_sq)  # (sqrt(v') / sqrt(bc2) + eps) * sqrt(bc2)
        torch._foreach_add_(denom, self.optim.eps * bc2_sqrt)
        torch._foreach_addcdiv_(piece.params, piece.exp_avg, denom, lr / bc1 * bc2_sqrt)
        if weight_decay:
            torch._foreach_div_(piece.params, 1.0 - lr * weight_decay)
        if step == 0:
            torch._foreach_zero_(piece.exp_avg)
            torch._foreach_zero_(piece.exp_avg_sq)
            return
        torch._foreach_lerp_(piece.exp_avg, grads, -(1.0 - beta1) / beta1)  # m' (1 + w) - w g, w = (1-b1)/b1
        torch._foreach_addcmul_(piece.exp_avg_sq, grads, grads, -(1.0 - beta2))
        torch._foreach_div_(piece.exp_avg_sq, beta2)
        torch._foreach_clamp_min_(piece.exp_avg_sq, 0.0)  # rounding must not leave a negative second moment

    def publish(self, unit_index: int, version: int) -> None:
        """This worker's shard of the unit holds update number `version` (the count of updates applied)."""
        if self.versions is not None:
            self.versions[unit_index, self.worker] = version

    # ---- the update beside the backward ----
    def speculate(self, unit_index: int, step: int, speculation: int, parts: int = 1) -> bool:
        """Update number `step` with clip coefficient 1 of a unit whose gradient landed, in speculation number
        `speculation` of the step, once `parts` executors' slices of it have (each calls this); True if this call
        updated it. Where an executor stowed its slice instead (the units it landed so far clip), the unit waits for the
        step's norm."""
        if not self._landed(unit_index, step, speculation, parts) or unit_index in self.speculated:
            return False
        if unit_index in self.stowing:
            self._stow(unit_index)
            return False
        self._pass(unit_index, step, 1.0, roll_back=False, update=True, keep=True)
        self.speculated.add(unit_index)
        return True

    def stow(self, unit_index: int, step: int, speculation: int | None, parts: int = 1) -> bool:
        """A unit's gradient landed for update number `step` (in speculation number `speculation`; None: the serial
        update) and is not updated beside the backward: once `parts` executors' slices of it have, the NVMe tier
        takes it out of the arena until its update reads it back. True if this call stowed it."""
        if not self._landed(unit_index, step, speculation, parts, stow=True):
            return False
        self._stow(unit_index)
        return True

    def _landed(self, unit_index: int, step: int, speculation: int | None, parts: int, stow: bool = False) -> bool:
        """Counts an executor's slice of the unit's gradient in; True once all `parts` have (this speculation's)."""
        if (step, speculation) != self.landing:  # a new speculation: what a failed one recorded does not hold
            self.landing, self.arrivals, self.stowing, self.stowed = (step, speculation), {}, set(), set()
            self.speculation, self.speculated = speculation, set()
        if stow:
            self.stowing.add(unit_index)
        self.arrivals[unit_index] = self.arrivals.get(unit_index, 0) + 1
        return self.arrivals[unit_index] >= parts

    def _stow(self, unit_index: int) -> None:
        """Once a speculation: a second stow would write the range its first punched out (zeros) over the gradient."""
        if self.stager is not None and self.stager.holds(unit_index, "grads") and unit_index not in self.stowed:
            self.stager.stow(unit_index)
            self.stowed.add(unit_index)

    def mark_skipped(self, unit_index: int, step: int) -> None:
        """Leaves the unit as it is for update `step` (its gradient, not finite, leaves the arena unread)."""
        if self.stager is not None and self.stager.holds(unit_index, "grads"):
            self.stager.drop(unit_index)
        self.publish(unit_index, step + 1)

    def flush(self) -> None:
        """The NVMe tier's writes behind on disk (the versions they publish with them), nothing staged, and no record
        of the landings so far: what the tier moved is where it goes, before anything else reads the state files."""
        if self.stager is not None:
            self.stager.flush()
        self.landing, self.arrivals, self.stowing, self.stowed = None, {}, set(), set()

    def was_speculated(self, unit_index: int, speculation: int | None) -> bool:
        return speculation is not None and speculation == self.speculation and unit_index in self.speculated

    def settle(self, unit_index: int, step: int, clip_coef: float, speculation: int | None = None) -> str | None:
        """The step's own update number `step` of the unit, with `clip_coef`, settled: where speculation number
        `speculation` speculated it, that update is confirmed (clip_coef 1) or rolled back and redone clipped, in one
        pass. Returns what was done: "update", "rollback" (redone), None (confirmed)."""
        if not self.was_speculated(unit_index, speculation):
            self.update(unit_index, step, clip_coef)
            return "update"
        if clip_coef < 1.0:
            self._pass(unit_index, step, clip_coef, roll_back=True, update=True)
            return "rollback"
        self.publish(unit_index, step + 1)
        return None

    def roll_back(self, unit_index: int, step: int, speculation: int | None) -> bool:
        """Step `step` is skipped (a non-finite gradient): the unit's update speculated in speculation number
        `speculation`, if any, is rolled back; its version is `step` again either way. True if there was one."""
        speculated = self.was_speculated(unit_index, speculation)
        if speculated:
            self._pass(unit_index, step, 1.0, roll_back=True, update=False)
            self.speculated.discard(unit_index)
        elif self.stager is not None:  # a gradient stowed is out of the arena before the next step lands one there
            self.stager.wait(unit_index)
            self.stowed.discard(unit_index)
        self.publish(unit_index, step)
        if self.issued is not None:  # nothing of this step is handed out any more (the queue depth reads it)
            self.issued[unit_index] = step
        return speculated

    def roll_back_versions(self, step: int) -> None:
        """Every unit's version back to `step` (from step + 1, where it was updated beside the backward): nothing
        reads the weights of a unit until its clipped update replaced the speculative one."""
        if self.stager is not None:  # no version the tier publishes once a gradient is on disk comes after this
            self.stager.flush()
        if self.versions is not None:
            self.versions[:, self.worker].clamp_(max=step)

    def queue_depth(self) -> int:
        """Units handed to this worker whose update it has not finished (the one it is on included)."""
        if self.versions is None or self.issued is None:
            return 0
        return int((self.issued > self.versions[:, self.worker]).sum())
