"""The layer-streaming schedule: forward, head, backward with recompute, two rotating weight buffers.

    forward   for each layer l: H2D weights(l+1) into the free buffer while compute runs layer l;
              keep the layer input x[l] as a checkpoint
    head      final norm + lm_head + cross-entropy, forward and backward at once, in token chunks
    backward  for each layer l from the top: H2D weights(l-1) while compute reruns layer l from x[l]
              and takes gradients; D2H stream copies dW[l] into the arena; `grads_landed(unit)` fires once
              they are there
    (or, with hold_grads, the gradients stay on the device and `send_held` copies them out later, in
    forward order, once the caller knows what to do with them: the global norm for clipping)

Where a unit's gradient goes in the host `grads` segment is the GradLayout's business: every unit its own
range, or decoder layers sharing a ring of slots. Before a gradient is written into a shared slot, the
caller's `slot_free(previous occupant)` must return: the optimizer has finished reading it. The copies
out and that wait run on a thread of their own on a GPU, so the compute stream is never held up by them.

The embedding never crosses PCIe whole: the rows a batch uses are gathered on the host and only their
gradient rows come back. On the CPU path the "buffers" are views of the arena and every copy is a plain
copy, so tests exercise the same schedule without a GPU.

This file knows nothing of Ray or of the optimizer: it is told when a unit's weights may be read
(`wait_weights`) and tells when a unit's gradients have landed (`grads_landed`).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatrain.config import PRECISIONS, SCHEDULES, MegatrainError, ModelConfig, check_choice
from megatrain.engine.checkpoints import CheckpointStore
from megatrain.engine.data_parallel import DataParallel
from megatrain.engine.streams import Streams, make_streams
from megatrain.model import ops
from megatrain.model.architecture import Batch, LayerFn
from megatrain.model.layout import GRAD_SETS_IN_FLIGHT, GradLayout, ModelLayout, Unit
from megatrain.model.templates import embed, embed_backward, head_loss_and_grads, recompute_grads
from megatrain.telemetry import Recorder

UnitCallback = Callable[[Unit], None]
LandedCallback = Callable[[Unit, float], None]  # (unit, squared norm of its gradient)


TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def token_ids(x: Any) -> np.ndarray:
    """A copy of token ids (tensor, array or list) as int64 if they are integers; any other dtype is kept, for
    check_batch to refuse in one sentence: casting floats would silently truncate them."""
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return x.astype(np.int64) if np.issubdtype(x.dtype, np.integer) else x.copy()


def _noop(unit: Unit, *args: object) -> None:
    pass


def set_matmul_precision(precision: str) -> None:
    """tf32 for "tf32" and "bf16" (whose fp32 parts may use it), strict fp32 IEEE matmuls for "fp32".

    Through torch.set_float32_matmul_precision, which keeps torch's legacy flags (`allow_tf32`) and its
    per-backend ones (`fp32_precision`, torch >= 2.9) in agreement: setting either kind alone leaves a
    state in which torch.get_float32_matmul_precision() raises ("mix of the legacy and new APIs"), and
    torch.compile's autotuning and transformers read it. Call it in a process that computes on the GPU:
    it also lets oneDNN use reduced precision for the CPU's fp32 matmuls."""
    torch.set_float32_matmul_precision("highest" if precision == "fp32" else "high")


# Batch shapes a compiled decoder layer may see in one process. Each compiles twice (the forward without grad,
# the recompute with it); past torch's default limit of 8 compilations a fullgraph=True function raises.
COMPILED_SHAPES_LIMIT = 32


def allow_recompiles(shapes: int) -> None:
    """Lets torch.compile'd functions compile for `shapes` batch shapes (torch._dynamo's recompile limit,
    named cache_size_limit before torch 2.6), never lowering a limit set higher elsewhere."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 2 * shapes))


@dataclass
class GradsOut:
    """One unit's gradients on their way from the device to the host grads segment."""

    unit: Unit
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (gradient on the device, its host destination)
    norm_sq: torch.Tensor  # squared norm, computed on the device
    ready: Any  # event recorded on compute once the gradients exist (None on the CPU path)
    scatter: Callable[[], None] | None = None  # host work once landed (the embedding rows into its gradient)
    permit: threading.Semaphore | None = None  # a decoder layer's place among the sets in flight, given back
    # once the gradients have landed (see GRAD_SETS_IN_FLIGHT)


@dataclass
class _Step:
    """A step's batch, prepared once for every pass over it: micro-batches, embedding rows, targets."""

    batches: list[Batch]  # per micro-batch, what its layers take (rotary tables, documents)
    micro: list[slice]  # per micro-batch, its rows of the step's batch
    rows: torch.Tensor  # the embedding rows the step's tokens use, on the device
    rows_idx: torch.Tensor  # their indices in the table (host)
    row_of_token: torch.Tensor  # per token, its row in `rows` (device)
    targets: torch.Tensor  # shifted labels (device)
    host_targets: torch.Tensor  # the same on the host
    n_tokens: int  # labelled tokens of the whole step: every micro-batch's loss is divided by it
    table: torch.Tensor  # the embedding table in the arena (a tied head's weights)


@dataclass
class Landing:
    """A GradsOut whose copies to the host are queued: what is left is to wait for them and report."""

    out: GradsOut
    landed: LandedCallback
    event: Any  # recorded on d2h after the copies (None on the CPU path: they are done)
    norm_sq: torch.Tensor  # the squared norm's host copy
    settled: bool = False  # the sender thread is done with it (finished, or dropped after a failure)


@dataclass
class StepOutput:
    loss: float
    tokens: int  # tokens that carried a label
    unit_grad_norms_sq: list[float] = field(default_factory=list)  # per unit, in layout order
    held: list[GradsOut] = field(default_factory=list)  # hold_grads: the gradients still on the device

    @property
    def grad_norm(self) -> float:
        return sum(self.unit_grad_norms_sq) ** 0.5

    @property
    def finite(self) -> bool:
        """The loss and every gradient are finite: the step's update may be applied."""
        return math.isfinite(self.loss) and math.isfinite(sum(self.unit_grad_norms_sq))


class WeightSlots:
    """Two device buffers that decoder layers rotate through; a unit stays resident until evicted, so the
    top two layers of the forward are reused by the backward without a second copy."""

    def __init__(self, numel: int, weights: torch.Tensor, streams: Streams, dtype: torch.dtype, rec: Recorder):
        self.weights, self.streams, self.dtype, self.rec = weights, streams, dtype, rec  # weights: host, flat
        self.copy_needed = streams.asynchronous or dtype != weights.dtype
        n = 2 if self.copy_needed else 0
        dev = streams.device
        # bf16 compute from fp32 weights on a GPU: they arrive in a staging buffer and are cast there
        staged = streams.asynchronous and dtype != weights.dtype
        self.staging = [torch.empty(numel, device=dev) for _ in range(n if staged else 0)]
        self.buffers = [torch.empty(numel, device=dev, dtype=dtype) for _ in range(n)]
        self.resident: list[int | None] = [None] * n
        self.ready: list[Any] = [None] * n
        self.free: list[Any] = [None] * n

    def fetch(self, unit: Unit, keep: Unit | None) -> None:
        """Starts bringing `unit` in, into the buffer that does not hold `keep` (the layer computing now)."""
        if not self.copy_needed or unit.index in self.resident:
            return
        slot = next(i for i, r in enumerate(self.resident) if keep is None or r != keep.index)
        src = unit.range_of(self.weights)
        s = self.streams
        s.wait(s.h2d, self.free[slot])  # before the span: waiting for compute to free the buffer is not copying
        with self.rec.span("h2d", "load", unit.index, s.h2d, src.numel() * src.element_size()):
            if self.staging:
                s.copy(self.staging[slot][: unit.numel], src, s.h2d)
                s.copy(self.buffers[slot][: unit.numel], self.staging[slot][: unit.numel], s.h2d)
            else:
                s.copy(self.buffers[slot][: unit.numel], src, s.h2d)
        self.ready[slot] = s.record(s.h2d)
        self.resident[slot] = unit.index

    def acquire(self, unit: Unit) -> tuple[int, dict[str, torch.Tensor]]:
        """Makes the compute stream wait for `unit`'s weights and binds them."""
        if not self.copy_needed:
            return -1, unit.bind(unit.range_of(self.weights))
        slot = self.resident.index(unit.index)
        self.streams.wait(self.streams.compute, self.ready[slot])
        self.streams.compute_uses(self.buffers[slot])
        return slot, unit.bind(self.buffers[slot][: unit.numel])

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.free[slot] = self.streams.record(self.streams.compute)

    def invalidate(self) -> None:
        """Forgets what is resident: the optimizer may have rewritten the arena since."""
        self.resident = [None] * len(self.resident)


class Executor:
    """Runs one forward+backward of a batch over a model whose fp32 weights live in `params` (host)."""

    def __init__(self, config: ModelConfig, layout: ModelLayout, params: torch.Tensor, grads: torch.Tensor,
                 device: str | torch.device = "cpu", precision: str = "fp32", loss_chunk_tokens: int = 4096,
                 recorder: Recorder | None = None, grad_layout: GradLayout | None = None,
                 shadow: torch.Tensor | None = None, compile: bool = False, send_thread: bool | None = None,
                 tile_tokens: int | None = None, checkpoint_budget: int | None = None,
                 data_parallel: DataParallel | None = None):
        """device: "cpu", "cuda[:N]", "auto", or "cpu-async[:SEED]" (the CPU with a GPU's asynchronous streams
        simulated: megatrain/engine/streams.py). shadow: a bf16 copy of `params` kept current by the optimizer;
        with precision "bf16" the weights are read from it (half the bytes to move), else from params. compile:
        run the decoder layer through torch.compile (every layer has the same shapes, so it compiles once per
        batch shape and grad mode). send_thread: gradients go to the host from a thread of their own (None: on
        a GPU, where the step must not wait on slots or copies, and under simulated streams, which test the
        GPU's path; on the plain CPU path the step's own thread does them). tile_tokens: the layers' token-wise
        parts run over tiles of that many tokens (None: whole). checkpoint_budget: bytes of device memory for the
        layer inputs the backward recomputes from; the rest wait in host memory (None: all on the device;
        megatrain/engine/checkpoints.py). data_parallel: this executor is one of several, each running its share of
        a step's rows; every unit's gradient is summed over them and this one writes its slice of the sum
        (megatrain/engine/data_parallel.py)."""
        self.config, self.layout, self.params, self.grads = config, layout, params, grads
        self.grad_layout = grad_layout or GradLayout.full(layout)
        check_choice("precision", precision, PRECISIONS)
        self.streams = make_streams(device)
        self.device = self.streams.device
        self.precision = precision
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.weights = shadow if shadow is not None and self.dtype == torch.bfloat16 else params
        self.loss_chunk_tokens = loss_chunk_tokens
        self.rec = recorder or Recorder(enabled=False)
        if self.device.type == "cuda":
            set_matmul_precision(precision)
        self.send_thread = self.streams.asynchronous if send_thread is None else send_thread
        self.arch = config.family.architecture(config)
        if tile_tokens is not None:
            if tile_tokens <= 0:
                raise MegatrainError(f"tile_tokens must be a positive number of tokens, got {tile_tokens}.")
            self.arch.tile(tile_tokens)
        self.tiled = tile_tokens is not None
        self.checkpoints = CheckpointStore(self.streams, checkpoint_budget)
        self.dp = data_parallel if data_parallel is not None and data_parallel.world > 1 else None
        if self.dp is not None and not self.grad_layout.full_ranges:
            raise MegatrainError("several executors write slices of every unit's gradient into the arena, which needs "
                                 "grads = 'arena'; set grads = 'arena' (or 'auto').")
        self.compile = compile
        if compile:
            allow_recompiles(COMPILED_SHAPES_LIMIT)
        self._compiled: dict[int, LayerFn] = {}  # id of a structure's layer function -> its compiled form
        self.slots = WeightSlots(layout.max_layer_numel(), self.weights, self.streams, self.dtype, self.rec)
        self._embed_rows_written: torch.Tensor | None = None  # rows of the embedding grad written last step
        # each unit's squared gradient norm lands here (page-locked on a GPU: one buffer, not one per unit)
        self._norms_host = self.streams.pinned(len(layout.units), dtype=torch.float64)
        self._host_buffers: dict[str, torch.Tensor] = {}  # see _host_buffer
        self._outbox: queue.Queue[tuple[GradsOut, LandedCallback, UnitCallback, dict[int, Unit]] | None] = queue.Queue()
        self._outbox_error: BaseException | None = None
        self._sender: threading.Thread | None = None

    # ---- helpers ----
    def _layer(self, unit: Unit) -> LayerFn:
        """The function of `unit`'s layer (compiled once per layer structure when compiling)."""
        fn = self.arch.layer(unit.layer)
        if not self.compile:
            return fn
        if id(fn) not in self._compiled:
            self._compiled[id(fn)] = torch.compile(fn, fullgraph=True, dynamic=False)
        return self._compiled[id(fn)]

    def _to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """H2D of a small host tensor (token ids, gathered rows) on the h2d stream, ordered before compute."""
        s = self.streams
        out = s.to_device(t, s.h2d)
        s.wait(s.compute, s.record(s.h2d))
        return out.to(dtype) if dtype is not None else out

    def _gradients(self, unit: Unit, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                   scatter: Callable[[], None] | None = None, permit: threading.Semaphore | None = None,
                   accumulate: bool = False) -> GradsOut:
        """Packs a unit's gradients, just computed on the compute stream, with their host destinations;
        accumulate: what the destinations hold (an earlier pass's gradients of this step) is added first, so that
        the norm is the sum's. Data parallel, the pairs become this executor's slice of their sum over the
        executors, and the norm that slice's (the engine adds the executors' up)."""
        if self.dp is not None:
            pairs = self._reduced(unit, pairs)
        if accumulate:
            pairs = [(g.float() + self._to_device(dst), dst) for g, dst in pairs]
        norm_sq = sum(self._norm_sq(g) for g, _ in pairs)
        self.streams.compute_uses(norm_sq, *(g for g, _ in pairs))
        return GradsOut(unit, pairs, norm_sq, self.streams.record(self.streams.compute), scatter, permit)

    def _reduced(self, unit: Unit, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(this executor's slice of the unit's gradient summed over the executors, its range in the arena)]: the
        pairs laid out flat at their destinations' offsets in the unit's range, the gaps (tensors with no gradient
        here) zero."""
        assert self.dp is not None
        whole = self.grad_layout.range_of(unit, self.grads)
        flat = torch.zeros(whole.numel(), dtype=torch.float32, device=self.device)
        for g, dst in pairs:
            start = (dst.data_ptr() - whole.data_ptr()) // whole.element_size()
            flat[start : start + dst.numel()] = g.reshape(-1)
        return [(self.dp.reduce(flat), whole[self.dp.shard(whole.numel())])]

    def _emit(self, out: GradsOut, landed: LandedCallback, slot_free: UnitCallback,
              slot_users: dict[int, Unit]) -> None:
        """Sends `out` to the host: through the sender thread (on a GPU), so compute never waits on a slot or a
        copy; else at once."""
        if not self.send_thread:
            self._deliver(out, landed, slot_free, slot_users)
            return
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(target=self._send_loop, name="grads-out", daemon=True)
            self._sender.start()
        self._outbox.put((out, landed, slot_free, slot_users))

    def _deliver(self, out: GradsOut, landed: LandedCallback, slot_free: UnitCallback,
                 slot_users: dict[int, Unit]) -> None:
        self._finish(self._start(out, landed, slot_free, slot_users))

    def _start(self, out: GradsOut, landed: LandedCallback, slot_free: UnitCallback,
               slot_users: dict[int, Unit]) -> Landing:
        """Waits for the unit's host slot to be free and queues the copies of its gradients (and their norm)
        into it on the d2h stream."""
        slot = self.grad_layout.slot_of[out.unit.index]
        previous = slot_users.get(slot)
        if previous is not None and previous.index != out.unit.index:
            slot_free(previous)
        slot_users[slot] = out.unit
        s = self.streams
        s.wait(s.d2h, out.ready)
        nbytes = sum(g.numel() * 4 for g, _ in out.pairs)
        with self.rec.span("d2h", "grads", out.unit.index, s.d2h, nbytes):
            for g, dst in out.pairs:
                s.copy(dst, g, s.d2h)
            # the norm comes along on this stream: reading it on this thread's default stream (the compute
            # stream) would wait for every kernel queued there since, up to a layer of compute
            norm_sq = self._norms_host[out.unit.index]
            s.copy(norm_sq, out.norm_sq, s.d2h)
        return Landing(out, landed, s.record(s.d2h, blocking=True), norm_sq)

    def _finish(self, landing: Landing) -> None:
        """Waits for a unit's gradients to land, scatters what needs it and calls `landed(unit, norm²)`; the
        device copies may be freed from here on."""
        if landing.event is not None:
            landing.event.synchronize()
        out = landing.out
        if out.scatter is not None:
            out.scatter()
        landing.landed(out.unit, float(landing.norm_sq))
        self._release(out)

    @staticmethod
    def _release(out: GradsOut) -> None:
        """The device side of `out` is no longer needed: its tensors go, its place in flight is given back."""
        out.pairs.clear()
        if out.permit is not None:
            out.permit.release()
            out.permit = None

    def _send_loop(self) -> None:
        """The sender thread. A unit's copies are queued as soon as its slot is free, and the unit before is
        finished only then (or once the outbox is empty), so that the D2H copies follow each other on the
        stream instead of each waiting for the host to see the previous one land."""
        landing: Landing | None = None  # started, not finished
        while True:
            if landing is None:
                item = self._outbox.get()
            else:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    self._settle(landing)
                    landing = None
                    continue
            if item is None:
                if landing is not None:
                    self._settle(landing)
                return
            started = None
            if self._outbox_error is None:  # after a failure the step's remaining units are dropped
                try:
                    started = self._start_after(landing, self._settle, *item)
                except BaseException as e:  # surfaced by the step that queued it
                    self._outbox_error = e
            if started is None:
                self._release(item[0])
                self._outbox.task_done()
                if landing is not None:
                    self._settle(landing)
            del item  # a delivered unit's gradients must not stay alive here until the next one comes
            landing = started

    def _start_after(self, landing: Landing | None, finish: Callable[[Landing], None], out: GradsOut,
                     landed: LandedCallback, slot_free: UnitCallback, slot_users: dict[int, Unit]) -> Landing:
        """Starts `out`, then finishes `landing` (the unit before it), so that their copies overlap; first, if
        `out` is to reuse that unit's host slot (whose `slot_free` waits for it to have landed)."""
        slot_of = self.grad_layout.slot_of
        if landing is not None and slot_of[landing.out.unit.index] == slot_of[out.unit.index]:
            finish(landing)
            landing = None
        started = self._start(out, landed, slot_free, slot_users)
        if landing is not None:
            finish(landing)
        return started

    def _settle(self, landing: Landing) -> None:
        """Finishes a started unit on the sender thread (unless an earlier one failed) and marks it done."""
        if landing.settled:
            return
        landing.settled = True
        try:
            if self._outbox_error is None:
                self._finish(landing)
        except BaseException as e:
            self._outbox_error = e
        finally:
            self._release(landing.out)
            self._outbox.task_done()

    def _wait_sent(self) -> None:
        if self._sender is not None:
            self._outbox.join()
        if self._outbox_error is not None:
            err, self._outbox_error = self._outbox_error, None
            raise err

    def send_held(self, held: list[GradsOut], landed: LandedCallback = _noop, slot_free: UnitCallback = _noop
                  ) -> None:
        """Copies gradients a `run(hold_grads=True)` kept on the device to the host, in forward order (the
        order the next forward reads the updated weights), calling `landed` as each unit's arrives. Runs in
        the calling thread, which may be another than the one running the next step. Each unit's copies are
        queued before the previous unit is waited for, and each unit's device memory goes once it landed."""
        slot_users: dict[int, Unit] = {}
        landing: Landing | None = None
        try:
            while held:
                landing = self._start_after(landing, self._finish, held.pop(), landed, slot_free, slot_users)
            if landing is not None:
                self._finish(landing)
        finally:
            held.clear()

    def close(self) -> None:
        if self._sender is not None and self._sender.is_alive():
            self._outbox.put(None)
            self._sender.join(timeout=5)
        self.streams.close()

    # ---- the step ----
    def check_batch(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
            raise MegatrainError(f"input_ids must be [batch, seq] with seq >= 2, got shape {tuple(input_ids.shape)}.")
        if input_ids.dtype not in TOKEN_DTYPES:
            raise MegatrainError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
        window = self.config.sliding_window
        if window and input_ids.shape[1] > window:
            raise MegatrainError(f"sequence length {input_ids.shape[1]} exceeds the model's sliding attention window "
                                 f"{window}, which megatrain does not implement; train with seq <= {window}.")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise MegatrainError(f"token id {hi if hi >= self.config.vocab_size else lo} is outside the model's "
                                 f"vocabulary [0, {self.config.vocab_size}); check the tokenizer matches the model.")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise MegatrainError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                                     f"got {tuple(labels.shape)}.")
            if labels.dtype not in TOKEN_DTYPES:
                raise MegatrainError(f"labels must hold integer token ids (-100 = ignored), got dtype {labels.dtype}.")
            bad = (labels != ops.IGNORE_INDEX) & ((labels < 0) | (labels >= self.config.vocab_size))
            if bool(bad.any()):
                raise MegatrainError(f"label {int(labels[bad][0])} is outside the vocabulary [0, "
                                     f"{self.config.vocab_size}) and is not -100 (ignored).")

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            *, wait_weights: UnitCallback = _noop, grads_landed: LandedCallback = _noop,
            loss_ready: Callable[[float], bool] | None = None, slot_free: UnitCallback = _noop,
            hold_grads: bool = False, micro_batches: int = 1, schedule: str = "layer-major",
            loss_tokens: int | None = None) -> StepOutput:
        """One forward + backward. Gradients land in `grads` (the arena) unit by unit.

        wait_weights(unit) blocks until `unit`'s weights in the arena may be read (its update is done);
        grads_landed(unit, norm_sq) is called once its gradients are in the arena; loss_ready(loss), if given, is
        asked before the backward whether to go on (False: skip, e.g. a non-finite loss); slot_free(unit)
        blocks until the optimizer has read `unit`'s gradient, whose host slot the next unit is about to reuse.
        hold_grads: the gradients stay on the device, returned in StepOutput.held for `send_held`.
        position_ids: [batch, seq], each packed document's positions from 0 (a document attends within itself
        only, as transformers reads packed position_ids); None: 0..seq-1 in every row.
        micro_batches: the batch's rows in that many equal micro-batches; the loss is the mean over all labelled
        tokens of the batch, as one batch's, and so are the gradients. schedule "layer-major": while a layer's
        weights are on the device its forward (and then its backward) runs over every micro-batch, their
        checkpoints in the checkpoint store and its weight gradients summed in fp32 before one copy out: weights
        cross once per step whatever the number. "per-micro-batch": a whole forward and backward per
        micro-batch (weights cross once each), its gradients added to the earlier ones' in the arena (grads =
        "arena" only): one micro-batch's checkpoints at a time, for when every micro-batch's do not fit.
        loss_tokens: the labelled tokens the loss is the mean over, where they are more than this batch's (its
        rows are an executor's share of a step's, data parallel); StepOutput.tokens stays this batch's.
        """
        input_ids = torch.as_tensor(input_ids)
        labels = None if labels is None else torch.as_tensor(labels)
        self.check_batch(input_ids, labels)
        k = self._check_micro_batches(micro_batches, input_ids.shape[0])
        check_choice("schedule", schedule, SCHEDULES)
        if schedule == "per-micro-batch" and k > 1 and (hold_grads or not self.grad_layout.full_ranges):
            raise MegatrainError("the per-micro-batch schedule adds each micro-batch's gradients to the earlier ones "
                                 "in the arena, which needs grads = 'arena'; set grads = 'arena', or use the "
                                 "layer-major schedule.")
        input_ids = input_ids.long()
        labels = None if labels is None else labels.long()
        host_targets = ops.shift_labels(input_ids, labels)
        n_tokens = int((host_targets != ops.IGNORE_INDEX).sum())
        loss_tokens = n_tokens if loss_tokens is None else loss_tokens
        if loss_tokens == 0:
            raise MegatrainError("this batch has no tokens to train on (every label is -100); check the loss mask.")
        if hold_grads and self.dp is not None:
            raise MegatrainError("several executors sum gradients on their way to the arena: they cannot hold them on "
                                 "the device (grads = 'device'); use grads = 'arena'.")
        if position_ids is not None:
            position_ids = self._check_positions(position_ids, input_ids)
        rows_per_micro = input_ids.shape[0] // k
        micro = [slice(m * rows_per_micro, (m + 1) * rows_per_micro) for m in range(k)]
        batches = [self.arch.batch(rows_per_micro, input_ids.shape[1], self.device, self.dtype,
                                   None if position_ids is None else position_ids[rows]) for rows in micro]
        self._extra_loss_refused(batches)
        self.slots.invalidate()

        # embedding: gather on the host only the rows this step uses (every micro-batch's: one gather)
        embed_unit = self.layout.embed
        wait_weights(embed_unit)
        with self.rec.span("host", "embed", embed_unit.index):
            rows_idx, row_of_token = torch.unique(input_ids, return_inverse=True)
            table = embed_unit.bind(embed_unit.range_of(self.weights))["embed_tokens.weight"]
            # gathered straight into page-locked memory on a GPU: one host pass over the rows, not two
            rows = self._host_buffer("rows", rows_idx.numel(), table.shape[1], table.dtype)
            rows = self._to_device(torch.index_select(table, 0, rows_idx, out=rows), self.dtype)
            row_of_token = self._to_device(row_of_token)
            targets = self._to_device(host_targets)  # one copy for the head, not one per loss chunk
        step = _Step(batches, micro, rows, rows_idx, row_of_token, targets, host_targets, loss_tokens, table)
        passes = [list(range(k))] if schedule == "layer-major" else [[m] for m in range(k)]
        # loss_ready sees each pass's share of the loss (finite if and only if their sum is); once it says stop
        # (a non-finite loss, or an evaluation), the remaining passes run their forward only, for the loss
        loss, out, backward = 0.0, StepOutput(0.0, n_tokens), True
        for number, ms in enumerate(passes):
            final = number == len(passes) - 1
            out = self._pass(step, ms, wait_weights, grads_landed if final else _noop, loss_ready, slot_free,
                             hold_grads, accumulate=number > 0, forward_only=not backward)
            loss += out.loss
            backward = backward and bool(out.unit_grad_norms_sq)
        if not backward:
            return StepOutput(loss, n_tokens)
        return StepOutput(loss, n_tokens, out.unit_grad_norms_sq, out.held)

    def _pass(self, step: _Step, ms: list[int], wait_weights: UnitCallback, grads_landed: LandedCallback,
              loss_ready: Callable[[float], bool] | None, slot_free: UnitCallback, hold_grads: bool,
              accumulate: bool, forward_only: bool) -> StepOutput:
        """Forward, head and backward of micro-batches `ms` of `step`, layer-major; accumulate: their gradients are
        added to those in the arena (an earlier pass's of the same step). forward_only: the loss alone."""
        s, layers, head_unit, embed_unit = self.streams, self.layout.layers, self.layout.head, self.layout.embed
        k = len(ms)
        batches = [step.batches[m] for m in ms]

        def embedded(m: int) -> torch.Tensor:
            with self.rec.span("compute", "embed", embed_unit.index, s.compute):
                x = embed(step.rows, step.row_of_token[step.micro[m]])
                if self.arch.embed_scale is not None:  # in the compute dtype, as transformers' scaled embeddings
                    x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
            return x

        # forward, layer-major: x[l] of the j-th micro-batch kept as checkpoint l * k + j
        self.checkpoints.begin(len(layers) * k)
        wait_weights(layers[0])
        self.slots.fetch(layers[0], keep=None)
        xs: list[torch.Tensor] = []
        for i, unit in enumerate(layers):
            slot, w = self.slots.acquire(unit)
            for j, m in enumerate(ms):
                x = embedded(m) if i == 0 else xs[j]
                self.checkpoints.put(i * k + j, x)
                with torch.no_grad(), self.rec.span("compute", "forward", unit.index, s.compute):
                    x = self._layer(unit)(x, w, *batches[j].layer_args(unit.layer))
                if i == 0:
                    xs.append(x)
                else:
                    xs[j] = x
                del x
            self.slots.release(slot)
            if i + 1 < len(layers):
                wait_weights(layers[i + 1])
                self.slots.fetch(layers[i + 1], keep=unit)

        extra_loss = batches[0].forward_done() if k == 1 else None  # several: refused by run
        # head: forward and backward at once, micro-batch by micro-batch, each scaled by the whole step's tokens
        wait_weights(head_unit)
        head_w = head_unit.bind(self._head_weights(head_unit))
        lm_head = head_w.get("lm_head.weight")
        if lm_head is None:  # tied: the embedding table is the output projection
            wait_weights(embed_unit)
            lm_head = self._to_device(step.table, self.dtype)
        with self.rec.span("compute", "head", head_unit.index, s.compute):
            norm_w = {name: t for name, t in head_w.items() if name.startswith("norm.")}
            sums = None
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for j, m in enumerate(ms):
                micro_loss, xs[j], sums = head_loss_and_grads(
                    xs[j], self.arch.final_norm, norm_w, lm_head, step.targets[step.micro[m]], self.loss_chunk_tokens,
                    step.host_targets[step.micro[m]], self.arch.logit_softcap, n_valid=step.n_tokens,
                    grads_into=sums)
                loss += micro_loss
            grad_norm_w, grad_lm = sums
            if extra_loss is not None:
                loss = loss + extra_loss
        del head_w, norm_w, lm_head  # the head's device weights (a tied table's device copy too) are done with
        if forward_only or (loss_ready is not None and not loss_ready(float(loss))):
            self.checkpoints.end()
            return StepOutput(float(loss), step.n_tokens)
        try:  # xs now holds each micro-batch's gradient with respect to the head's input
            return self._backward(loss, step.n_tokens, xs, grad_norm_w, grad_lm, batches, step.rows_idx,
                                  [step.row_of_token[step.micro[m]] for m in ms], grads_landed, slot_free,
                                  hold_grads, accumulate)
        except BaseException:
            self._abandon_sends()
            raise
        finally:
            self.checkpoints.end()

    def _check_micro_batches(self, micro_batches: object, rows: int) -> int:
        if not (isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1):
            raise MegatrainError(f"micro_batches must be a positive integer, got {micro_batches!r}.")
        if rows % micro_batches:
            raise MegatrainError(f"a batch of {rows} rows does not split into {micro_batches} equal micro-batches; "
                                 f"give a multiple of {micro_batches} rows.")
        return micro_batches

    @staticmethod
    def _extra_loss_refused(batches: list[Batch]) -> None:
        """A model whose forward adds a loss term over the whole batch (a router's auxiliary loss) takes no
        micro-batches: a micro-batch's term is a different function of the router's outputs than the batch's."""
        if len(batches) > 1 and getattr(batches[0], "adds_loss", False):
            raise MegatrainError("this model adds a router auxiliary loss over the whole batch, which micro-batches "
                                 "would change; set micro_batches = 1, or turn the config's output_router_logits "
                                 "off.")

    def _backward(self, loss: torch.Tensor, n_tokens: int, grads: list[torch.Tensor],
                  grad_norm_w: dict[str, torch.Tensor], grad_lm: torch.Tensor, batches: list[Batch],
                  rows_idx: torch.Tensor, row_of_token: list[torch.Tensor], grads_landed: LandedCallback,
                  slot_free: UnitCallback, hold_grads: bool, accumulate: bool = False) -> StepOutput:
        """The head's gradients out, then each layer's recomputed from its checkpoints (every micro-batch's, their
        weight gradients summed), then the embedding's; accumulate: each added to what the arena holds."""
        s, layers, head_unit, embed_unit = self.streams, self.layout.layers, self.layout.head, self.layout.embed
        k = len(batches)
        held: list[GradsOut] = []
        slot_users: dict[int, Unit] = {}
        norms: dict[int, torch.Tensor] = {}
        in_flight = threading.Semaphore(GRAD_SETS_IN_FLIGHT)

        def emit(out: GradsOut) -> None:
            norms[out.unit.index] = out.norm_sq
            if hold_grads:
                held.append(out)
            else:
                self._emit(out, grads_landed, slot_free, slot_users)

        head_dst = self.grad_layout.bind(head_unit, self.grads)
        head_grads = [(g, head_dst[name]) for name, g in grad_norm_w.items()]
        if not self.config.tie_embeddings:
            head_grads.append((grad_lm, head_dst["lm_head.weight"]))
            grad_lm = None  # type: ignore[assignment]  # its GradsOut holds it until it has landed
        emit(self._gradients(head_unit, head_grads, accumulate=accumulate))
        del head_grads, grad_norm_w

        # backward: recompute each layer from its checkpoints with its weights bound again, the top micro-batch
        # first (the checkpoint store hands them back in the reverse order of the forward)
        last = len(layers) - 1
        self.slots.fetch(layers[last], keep=None)
        for i in range(last, -1, -1):
            unit = layers[i]
            permit = None if hold_grads else self._permit(in_flight, unit)
            slot, w = self.slots.acquire(unit)
            wgrads: dict[str, torch.Tensor] = {}
            for m in range(k - 1, -1, -1):
                with self.rec.span("compute", "recompute+backward", unit.index, s.compute):
                    x = self.checkpoints.get(i * k + m)
                    args = batches[m].layer_args(unit.layer)
                    if self.tiled:  # the layer takes its own gradients, tile by tile
                        grads[m], micro_wgrads = self.arch.layer(unit.layer).backward(x, w, grads[m], *args)
                    else:
                        grads[m], micro_wgrads = recompute_grads(self._layer(unit), x, w, grads[m], *args)
                    del x
                    if k == 1:
                        wgrads = micro_wgrads
                    else:  # summed in fp32, whatever the compute dtype
                        for name, g in micro_wgrads.items():
                            if name in wgrads:
                                wgrads[name] += g
                            else:
                                wgrads[name] = g.float()
                    del micro_wgrads
            self.slots.release(slot)
            if i > 0:
                self.slots.fetch(layers[i - 1], keep=unit)
            dst = self.grad_layout.bind(unit, self.grads)
            emit(self._gradients(unit, [(g, dst[name]) for name, g in wgrads.items()], permit=permit,
                                 accumulate=accumulate))
            del wgrads  # only the GradsOut keeps them, so they go once they have landed

        # embedding backward: gradient rows of this batch's tokens (plus the whole table when tied)
        with self.rec.span("compute", "embed-backward", embed_unit.index, s.compute):
            grad_rows = None
            for m in range(k):
                grad = grads[m]
                if self.arch.embed_scale is not None:
                    grad = grad * torch.tensor(self.arch.embed_scale, dtype=grad.dtype)
                micro_rows = embed_backward(grad.float(), row_of_token[m], rows_idx.numel())
                grad_rows = micro_rows if grad_rows is None else grad_rows.add_(micro_rows)
                grads[m] = grad = micro_rows = None  # type: ignore[assignment]
            assert grad_rows is not None
            pad = self.config.pad_token_id
            if pad is not None:  # transformers' embedding (padding_idx) gives the padding row no gradient
                grad_rows.masked_fill_(self._to_device(rows_idx == pad).unsqueeze(1), 0.0)
        del grads
        embed_grad = self.grad_layout.bind(embed_unit, self.grads)["embed_tokens.weight"]
        if self.config.tie_embeddings or self.dp is not None:  # data parallel: the executors' rows differ
            full = grad_lm.float() if self.config.tie_embeddings else grad_rows.new_zeros(embed_grad.shape)
            full.index_add_(0, self._to_device(rows_idx), grad_rows)
            del grad_lm
            emit(self._gradients(embed_unit, [(full, embed_grad)], accumulate=accumulate))
        else:
            if accumulate:  # this step's rows, which an earlier pass wrote
                grad_rows += self._to_device(embed_grad.index_select(0, rows_idx))
            emit(self._embed_rows(grad_rows, rows_idx, embed_grad, embed_unit))
        del grad_rows

        self._wait_sent()
        with self.rec.span("host", "sync"):
            norm_values = torch.stack([norms[u.index] for u in self.layout.units]).cpu().tolist()
            loss_value = float(loss)
        return StepOutput(loss_value, n_tokens, norm_values, held)

    def _check_positions(self, position_ids: Any, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.as_tensor(position_ids)
        if position_ids.shape != input_ids.shape:
            raise MegatrainError(f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(position_ids.shape)}.")
        if position_ids.dtype not in TOKEN_DTYPES or bool((position_ids < 0).any()):
            raise MegatrainError("position_ids must be non-negative integers (each packed document counting from 0).")
        return position_ids.long()

    def _permit(self, in_flight: threading.Semaphore, unit: Unit) -> threading.Semaphore:
        """Waits until fewer than GRAD_SETS_IN_FLIGHT layers' gradients are on the device (the others on their
        way to the host, held up by copies or by the optimizer freeing slots): compute stalls rather than
        the device running out of memory. Returns the semaphore to release once `unit`'s gradients landed."""
        if not in_flight.acquire(blocking=False):
            with self.rec.wait("optimizer", unit.index):
                in_flight.acquire()
        return in_flight

    def _abandon_sends(self) -> None:
        """After a failed step: what it queued for the sender thread is dropped, and the thread is idle again
        before anything else runs (its own error, if any, is superseded by the step's)."""
        if self._sender is None:
            return
        if self._outbox_error is None:
            self._outbox_error = MegatrainError("the step failed before its gradients were all sent.")
        self._outbox.join()
        self._outbox_error = None

    def _host_buffer(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] view of a host buffer kept from step to step (page-locked on a GPU), grown when a
        batch needs more: page-locked blocks allocated per step would stay cached by torch's host allocator."""
        buf = self._host_buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype:
            buf = self._host_buffers[name] = self.streams.pinned(rows, cols, dtype=dtype)
        return buf[:rows]

    def _head_weights(self, head_unit: Unit) -> torch.Tensor:
        src = head_unit.range_of(self.weights)
        if not self.streams.asynchronous and self.dtype == src.dtype:
            return src
        with self.rec.span("h2d", "load", head_unit.index, self.streams.h2d, src.numel() * src.element_size()):
            return self._to_device(src, self.dtype)

    def _embed_rows(self, grad_rows: torch.Tensor, rows_idx: torch.Tensor, embed_grad: torch.Tensor,
                    unit: Unit) -> GradsOut:
        """The gradient rows of this batch's tokens, to be written into the (otherwise zero) embedding
        gradient in the arena once they have landed."""
        host_rows = self._host_buffer("grad_rows", grad_rows.shape[0], grad_rows.shape[1], torch.float32)

        def scatter() -> None:
            if self._embed_rows_written is None:
                embed_grad.zero_()
            else:
                embed_grad.index_fill_(0, self._embed_rows_written, 0.0)
            embed_grad.index_copy_(0, rows_idx, host_rows)
            self._embed_rows_written = rows_idx

        return self._gradients(unit, [(grad_rows, host_rows)], scatter)

    @staticmethod
    def _norm_sq(g: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(g, dtype=torch.float64).square()
