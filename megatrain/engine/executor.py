"""The layer-streaming schedule: forward, head, backward with recompute, per layer and micro-batch.

While compute runs layer l, the next layer's weights cross on the H2D stream and the last one's gradients leave on
the D2H stream into the arena. The executor knows nothing of Ray or of the optimizer: it is told when a unit's weights
may be read (`weight_waits`) and tells when its gradients have landed (`grads_landed`). On the CPU path the buffers
are views of the arena, so tests run the same schedule. The schedule and the rooms beside this one:
docs/design.md#the-schedule."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from megatrain.config import PRECISIONS, SCHEDULES, MegatrainError, ModelConfig, check_choice
from megatrain.distributed.data_parallel import DataParallel
from megatrain.engine.batch_checks import check_batch, check_extra_loss, check_micro_batches, check_positions
from megatrain.engine.embedding_rows import EmbeddingRows
from megatrain.engine.grad_egress import GradEgress, GradsOut, LandedCallback, Sends, UnitCallback, noop
from megatrain.engine.host_buffers import HostBuffers
from megatrain.engine.layer_passes import LayerPasses
from megatrain.engine.lora_step import LoraStep
from megatrain.engine.resident import ResidentUnits
from megatrain.engine.step_state import PreparedStep, StepOptions, StepOutput
from megatrain.engine.streams import make_streams
from megatrain.engine.token_loss import joined, train_head
from megatrain.engine.torch_settings import set_matmul_precision
from megatrain.engine.weight_slots import WeightSlots
from megatrain.engine.weight_waits import NO_WAITS, ResidentCurrent, WeightWaits
from megatrain.model import ops
from megatrain.model.layout import GradLayout, ModelLayout, Unit
from megatrain.model.logprob_head import LogprobHead
from megatrain.model.templates import Weights, head_loss_and_grads
from megatrain.telemetry import Recorder


@dataclass(frozen=True)
class ExecutorOptions:
    """The executor's settings beyond where its weights are and how it computes (Executor's keywords)."""

    send_thread: bool | None = None  # gradients leave from a thread of their own (None: where streams are asynchronous)
    tile_tokens: int | None = None  # the layers' token-wise parts over tiles of that many tokens (None: whole)
    # device bytes of activation checkpoints, the rest in host memory (None: all on the device)
    checkpoint_budget: int | None = None
    data_parallel: DataParallel | None = None  # one of several executors, each on its rows (data_parallel.py)
    resident_units: int = 0  # the first units live on the device with their optimizer state (resident.py)
    kept_layers: int = 0  # the top decoder layers keep their autograd graphs for the backward (kept_activations.py)
    # a LoRA run's frozen base, which streams (self.layout) while `params` holds what trains (self.trainable)
    frozen: torch.Tensor | None = None
    resident_cast: bool = False  # bf16: the resident units' weights cast at each use, no bf16 copy of them
    reference: torch.Tensor | None = None  # the initial weights, for the reference's pass (reference.py)


class Executor:
    """Runs one forward+backward of a batch over a model whose fp32 weights live in `params` (host)."""

    def __init__(self, config: ModelConfig, layout: ModelLayout, params: torch.Tensor, grads: torch.Tensor,
                 device: str | torch.device = "cpu", precision: str = "fp32", loss_chunk_tokens: int = 4096,
                 recorder: Recorder | None = None, grad_layout: GradLayout | None = None,
                 bf16_copy: torch.Tensor | None = None, compile: bool = False, **options: Any):
        """device: "cpu", "cuda[:N]", "auto", or "cpu-async[:SEED]" (a GPU's asynchronous streams simulated on the
        CPU: streams.py). bf16_copy: a bf16 copy of `params` the optimizer keeps current, read in bf16 runs (half the
        bytes). compile: the layers (tiled: their tiles) and the head through torch.compile (compiled.py). options:
        ExecutorOptions."""
        o = ExecutorOptions(**options)
        frozen, tile_tokens = o.frozen, o.tile_tokens
        self.config, self.trainable, self.params, self.grads = config, layout, params, grads
        self.layout = layout.frozen or layout
        self.grad_layout = grad_layout or GradLayout.full(layout)
        check_choice("precision", precision, PRECISIONS)
        self.streams = make_streams(device)
        self.device = self.streams.device
        self.precision = precision
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.weights = bf16_copy if bf16_copy is not None and self.dtype == torch.bfloat16 else params
        self.weights = self.weights if frozen is None else frozen
        self.loss_chunk_tokens, self.reference = loss_chunk_tokens, o.reference
        self.rec = recorder or Recorder(enabled=False)
        if self.device.type == "cuda":
            set_matmul_precision(precision)
        self.send_thread = self.streams.asynchronous if o.send_thread is None else o.send_thread
        self.arch = config.family.architecture(config)
        if tile_tokens is not None:
            if tile_tokens <= 0:
                raise MegatrainError(f"tile_tokens must be a positive number of tokens, got {tile_tokens}.")
            self.arch.tile(tile_tokens)
        self.dp = o.data_parallel if o.data_parallel is not None and o.data_parallel.world > 1 else None
        self.lora = None if frozen is None else LoraStep(layout, params, self.arch, self.dp.rank if self.dp else 0)
        self.arch = self.arch if self.lora is None else self.lora.architecture
        self.passes = LayerPasses(self.arch, self.streams, self.rec, len(layout.layers), tiled=tile_tokens is not None,
                                  checkpoint_budget=o.checkpoint_budget, kept_layers=o.kept_layers, compile=compile)
        self.activation_checkpoints = self.passes.activation_checkpoints
        if self.dp is not None and not self.grad_layout.full_ranges:
            raise MegatrainError("several executors write slices of every unit's gradient into the arena, which needs "
                                 "grads = 'arena'; set grads = 'arena' (or 'auto').")
        if o.resident_units and self.dp is not None:
            raise MegatrainError("resident units live on one executor; with several, set resident = none.")
        # what trains on the device (a LoRA run's adapters: fp32, cast in the layer), and whose weights are there
        self.resident = ResidentUnits(layout, o.resident_units, self.device, torch.float32 if self.lora else self.dtype,
                                      cast=o.resident_cast)
        self.on_device = self.resident if self.lora is None else ResidentUnits(self.layout, 0, self.device, self.dtype)
        self.slots = WeightSlots(self.layout.max_layer_numel(), self.weights, self.streams, self.dtype, self.rec,
                                 self.on_device)
        self.egress = GradEgress(self.streams, self.grad_layout, self.rec, self.send_thread)
        self.host_buffers = HostBuffers(self.streams)  # gathered embedding rows, their gradients, the loss
        self.embedding = EmbeddingRows(self.layout.embed, self.weights, self.on_device, self.dtype,
                                       self.arch.embed_scale, config.pad_token_id, self.host_buffers, self._to_device,
                                       self.rec)

    # ---- the step ----
    def check_batch(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
        check_batch(self.config, input_ids, labels)

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            **options: Any) -> StepOutput:
        """One forward + backward. Gradients land in `grads` (the arena) unit by unit. position_ids: [batch, seq],
        each packed document's positions from 0 (a document attends within itself only, as transformers reads
        packed position_ids); None: 0..seq-1 in every row. options: StepOptions (the loss is the mean over all
        labelled tokens of the batch, as one batch's, whatever the micro-batches; so are the gradients)."""
        o = StepOptions(**options)
        input_ids = torch.as_tensor(input_ids)
        labels = None if labels is None else torch.as_tensor(labels)
        k = self._check_step(input_ids, labels, o)
        input_ids = input_ids.long()
        labels = None if labels is None else labels.long()
        host_targets = ops.shift_labels(input_ids, labels)
        n_tokens = ops.labelled_tokens(host_targets)
        loss_tokens = n_tokens if o.loss_tokens is None else o.loss_tokens
        if loss_tokens == 0:
            raise MegatrainError("this batch has no tokens to train on (every label is -100); check the loss mask.")
        if o.hold_grads and self.dp is not None:
            raise MegatrainError("several executors sum gradients on their way to the arena: they cannot hold them on "
                                 "the device (grads = 'device'); use grads = 'arena'.")
        if position_ids is not None:
            position_ids = check_positions(position_ids, input_ids)
        weight_waits = o.weight_waits
        if len(self.resident):  # their weights are on the device, updated by this process: nothing to wait for
            weight_waits = ResidentCurrent(weight_waits, self.resident)
        if o.token_loss is not None:
            o.token_loss.check_schedule(self.dp is not None, o.schedule == "per-micro-batch" and k > 1)

        step = self._prepare(input_ids, host_targets, position_ids, k, loss_tokens, weight_waits)
        step.token_loss = o.token_loss
        passes = [list(range(k))] if o.schedule == "layer-major" else [[m] for m in range(k)]
        # loss_ready sees each pass's share of the loss (finite if and only if their sum is); once it says stop
        # (a non-finite loss, or an evaluation), the remaining passes run their forward only, for the loss
        loss, out, backward = 0.0, StepOutput(0.0, n_tokens), True
        for number, ms in enumerate(passes):
            final = number == len(passes) - 1
            out = self._pass(step, ms, weight_waits, o.grads_landed if final else noop, o.loss_ready, o.slot_free,
                             o.hold_grads, accumulate=number > 0, forward_only=not backward, also_send=o.also_send)
            loss += out.loss
            backward = backward and bool(out.unit_grad_norms_sq)
        if not backward:
            return StepOutput(loss, n_tokens)
        return StepOutput(loss, n_tokens, out.unit_grad_norms_sq, out.held)

    def _check_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None, o: StepOptions) -> int:
        """Refuses a batch or a schedule this executor cannot run, before anything runs; returns the micro-batches."""
        self.check_batch(input_ids, labels)
        k = check_micro_batches(o.micro_batches, input_ids.shape[0])
        check_choice("schedule", o.schedule, SCHEDULES)
        if o.schedule == "per-micro-batch" and k > 1 and (o.hold_grads or not self.grad_layout.full_ranges):
            raise MegatrainError("the per-micro-batch schedule adds each micro-batch's gradients to the earlier ones "
                                 "in the arena, which needs grads = 'arena'; set grads = 'arena', or use the "
                                 "layer-major schedule.")
        return k

    def _prepare(self, input_ids: torch.Tensor, host_targets: torch.Tensor, position_ids: torch.Tensor | None,
                 k: int, loss_tokens: int, waits: WeightWaits) -> PreparedStep:
        """The step's k micro-batches, and the embedding rows its tokens use, gathered on the host (every
        micro-batch's: one gather) and brought to the device with the targets. Layer 0's H2D goes first where its
        update is in before the embedding's (the pool's order, backward order, when updates go beside the
        backward): it then runs while the embedding's update ends and the rows are gathered."""
        rows_per_micro = input_ids.shape[0] // k
        micro = [slice(m * rows_per_micro, (m + 1) * rows_per_micro) for m in range(k)]
        batches = [self.arch.batch(rows_per_micro, input_ids.shape[1], self.device, self.dtype,
                                   None if position_ids is None else position_ids[rows]) for rows in micro]
        check_extra_loss(batches)
        self.slots.invalidate()
        layer0, embed_unit = self.layout.layers[0], self.layout.embed
        if waits.wait_first([layer0, embed_unit]) is layer0:
            self._fetch_layer(0, waits)
        waits.wait(embed_unit)
        rows, rows_idx, row_of_token = self.embedding.gather(input_ids)
        targets = self._to_device(host_targets)  # one copy for the head, not one per loss chunk
        return PreparedStep(batches, micro, rows, rows_idx, row_of_token, targets, host_targets, loss_tokens)

    def _pass(self, step: PreparedStep, ms: list[int], waits: WeightWaits, grads_landed: LandedCallback,
              loss_ready: Callable[[float], bool] | None, slot_free: UnitCallback, hold_grads: bool,
              accumulate: bool, forward_only: bool, also_send: bool = False) -> StepOutput:
        """Forward, head and backward of micro-batches `ms` of `step`, layer-major; accumulate: their gradients are
        added to those in the arena (an earlier pass's of the same step). forward_only: the loss alone."""
        batches = [step.batches[m] for m in ms]
        self.passes.begin(batches)
        xs = self._forward(step, ms, waits)
        extra_loss = batches[0].forward_done() if len(ms) == 1 else None  # several: refused by run
        loss, grad_norm_w, grad_lm = self._head(step, ms, xs, waits, extra_loss)
        if forward_only:
            self.passes.end()
            return StepOutput(float(loss), step.n_tokens)
        go_on = None  # asked by the backward once its top layer is queued, the loss copied out on the D2H stream
        if loss_ready is not None:  # (float(loss) now would drain the device before the backward is queued)
            read_loss = self.host_buffers.read_later("loss", loss)
            go_on = lambda: loss_ready(read_loss())  # noqa: E731
        try:  # xs now holds each micro-batch's gradient with respect to the head's input
            return self._backward(step, ms, loss, xs, grad_norm_w, grad_lm, Sends(grads_landed, slot_free),
                                  hold_grads, accumulate, also_send, go_on)
        except BaseException:
            self.egress.abandon()
            raise
        finally:
            self.passes.end()

    def _forward(self, step: PreparedStep, ms: list[int], waits: WeightWaits) -> list[torch.Tensor]:
        """Every layer over micro-batches `ms`, layer-major: what the backward needs of x[l] of the j-th micro-batch
        held as activation checkpoint l * k + j (layer_passes.py). Returns each micro-batch's last layer output."""
        layers = self.layout.layers
        self._fetch_layer(0, waits)
        xs: list[torch.Tensor] = []
        for i, unit in enumerate(layers):
            slot, w = self.slots.acquire(unit)
            w = w if self.lora is None else self.lora.bind(unit, w, self.resident, self._to_device)
            for j, m in enumerate(ms):
                x = self._embedded(step, m) if i == 0 else xs[j]
                x = self.passes.forward(i, unit, j, x, w, step.batches[m])
                if i == 0:
                    xs.append(x)
                else:
                    xs[j] = x
                del x
            self.slots.release(slot)
            if i + 1 < len(layers):
                self._fetch_layer(i + 1, waits, keep=unit)
        return xs

    def _fetch_layer(self, i: int, waits: WeightWaits, keep: Unit | None = None) -> None:
        """Layer i's weights on their way in once current (into the buffer that does not hold `keep`). Behind the
        last layer's, the head's (a tied head: the table's too) where their update is in by now: their copy then runs
        beside the last layer's forward, which never waits for the head's update (else they go in at the head)."""
        layers, head = self.layout.layers, self.layout.head
        waits.wait(layers[i])
        self.slots.fetch(layers[i], keep=keep)
        tied = all(t.name != "lm_head.weight" for t in head.slots)
        whole = [head, self.layout.embed] if tied else [head]
        if i == len(layers) - 1 and all(waits.ready(unit) for unit in whole):
            for unit in whole:
                self.slots.fetch_whole(unit)

    def _embedded(self, step: PreparedStep, m: int) -> torch.Tensor:
        """Micro-batch m's token embeddings: the first layer's input."""
        with self.rec.span("compute", "embed", self.layout.embed.index, self.streams.compute):
            return self.embedding.embedded(step.rows, step.row_of_token[step.micro[m]])

    def _head(self, step: PreparedStep, ms: list[int], xs: list[torch.Tensor], waits: WeightWaits,
              extra_loss: torch.Tensor | None) -> tuple[torch.Tensor, Weights, torch.Tensor]:
        """The head's forward and backward at once, micro-batch by micro-batch, each scaled by the whole step's
        tokens: xs[j] becomes the gradient with respect to its input. Returns the loss (plus `extra_loss`, a
        router's) and the gradients of the final norm's weights and of the lm_head (the table's, tied)."""
        head_unit = self.layout.head
        norm_w, lm_head = self._head_weights(waits)
        with self.rec.span("compute", "head", head_unit.index, self.streams.compute):
            weight_grads = bool(self.trainable.head.slots or self.trainable.embed.slots)  # LoRA: frozen
            if step.token_loss is not None:  # a loss on log-probs, on every micro-batch's rows at once
                rows, tl = [step.micro[m] for m in ms], step.token_loss
                head = self._logprob_head(norm_w, lm_head, tl.temperature)
                loss, sums = train_head(tl, head, xs, [step.targets[r] for r in rows],
                                        [step.host_targets[r] for r in rows], weight_grads)
                return (loss if extra_loss is None else loss + extra_loss), *sums
            sums = None
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for j, m in enumerate(ms):
                micro_loss, xs[j], sums = head_loss_and_grads(  # the compiled head's pieces where compiling
                    xs[j], self.passes.compiled.final_norm, norm_w, lm_head, step.targets[step.micro[m]],
                    self.loss_chunk_tokens, host_targets=step.host_targets[step.micro[m]],
                    softcap=self.arch.logit_softcap, n_valid=step.n_tokens,
                    cross_entropy=self.passes.compiled.cross_entropy, grads_into=sums,
                    logits=getattr(self.arch, "logits", None), weight_grads=weight_grads)
                loss += micro_loss
            grad_norm_w, grad_lm = sums
            if extra_loss is not None:
                loss = loss + extra_loss
        return loss, grad_norm_w, grad_lm  # the head's device weights (a tied table's device copy too) go here

    def _head_weights(self, waits: WeightWaits) -> tuple[Weights, torch.Tensor]:
        """The head's weights on the device once current: (the final norm's and a head bias, the lm_head's; the
        embedding table's, tied)."""
        head_unit, embed_unit = self.layout.head, self.layout.embed
        waits.wait(head_unit)
        head_w = head_unit.bind(self.slots.take_whole(head_unit))  # copied in by now where _fetch_layer started it
        lm_head = head_w.get("lm_head.weight")
        if lm_head is None:  # tied: the embedding table is the output projection
            waits.wait(embed_unit)
            lm_head = embed_unit.bind(self.slots.take_whole(embed_unit))["embed_tokens.weight"]
        return {name: t for name, t in head_w.items() if name != "lm_head.weight"}, lm_head

    def _logprob_head(self, norm_w: Weights, lm_head: torch.Tensor, temperature: float) -> LogprobHead:
        return LogprobHead(self.passes.compiled.final_norm, norm_w, lm_head, self.loss_chunk_tokens,
                           self.arch.logit_softcap, getattr(self.arch, "logits", None), temperature)

    def logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, *, weight_waits: WeightWaits = NO_WAITS,
                 micro_batches: int = 1, temperature: float = 1.0, entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p of each label [b, t], its position's entropy [b, t] or None) on the host, aligned with the labels
        as token_loss.py says; a forward only (each micro-batch's in turn), nothing kept, no gradient."""
        input_ids, labels = torch.as_tensor(input_ids).long(), None if labels is None else torch.as_tensor(labels)
        self.check_batch(input_ids, labels)
        k = check_micro_batches(micro_batches, input_ids.shape[0])
        host_targets = ops.shift_labels(input_ids, None if labels is None else labels.long())
        position_ids = None if position_ids is None else check_positions(position_ids, input_ids)
        weight_waits = ResidentCurrent(weight_waits, self.resident) if len(self.resident) else weight_waits
        step, outs = self._prepare(input_ids, host_targets, position_ids, k, 1, weight_waits), []
        for m in range(k):  # one micro-batch's forward at a time: only its activation checkpoints are held
            self.passes.begin([step.batches[m]])
            try:
                x, head = self._forward(step, [m], weight_waits)[0], self._head_weights(weight_waits)
                outs.append(self._logprob_head(*head, temperature).logprobs(x, step.targets[step.micro[m]],
                                                                             step.host_targets[step.micro[m]], entropy))
            finally:
                self.passes.end()
        return joined([lp for lp, _ in outs]), joined([e for _, e in outs]) if entropy else None

    def _backward(self, step: PreparedStep, ms: list[int], loss: torch.Tensor, grads: list[torch.Tensor],
                  grad_norm_w: Weights, grad_lm: torch.Tensor, sends: Sends, hold_grads: bool,
                  accumulate: bool = False, also_send: bool = False, go_on: Callable[[], bool] | None = None
                  ) -> StepOutput:
        """The head's gradients out, then each layer's (every micro-batch's, their weight gradients summed:
        layer_passes.py), then the embedding's; accumulate: each added to what the arena holds. grads: per
        micro-batch, the gradient with respect to the head's input. go_on, if given, is asked once the top layer's
        backward is queued and before any gradient leaves (False: the loss alone)."""
        layers, batches = self.layout.layers, [step.batches[m] for m in ms]
        held: list[GradsOut] = []
        norms: dict[int, torch.Tensor] = {}

        def emit(out: GradsOut) -> None:
            norms[out.unit.index] = out.norm_sq
            if self.resident.holds(out.unit):  # written where it stays: neither sent nor held, nor handed out
                self.resident.land(out)
                return
            if hold_grads:  # held for send_held (also_send: sent now too, for an update beside the backward)
                held.append(out)
            if not hold_grads or also_send:
                self.egress.emit(replace(out, pairs=list(out.pairs)) if hold_grads else out, sends)

        head: GradsOut | None = self._head_grads(grad_norm_w, grad_lm, accumulate)  # emitted once go_on agrees

        # the layers from the top, each with its weights bound again
        last = len(layers) - 1
        self.slots.fetch(layers[last], keep=None)
        for i in range(last, -1, -1):
            unit = layers[i]
            permit = None if hold_grads or self.resident.holds(unit) else self.egress.permit(sends, unit)
            slot, w = self.slots.acquire(unit)
            w = w if self.lora is None else self.lora.bind(unit, w, self.resident, self._to_device)
            wgrads = self.passes.backward(i, unit, w, batches, grads)
            self.slots.release(slot)
            if i > 0:
                self.slots.fetch(layers[i - 1], keep=unit)
            if head is not None:
                if go_on is not None and not go_on():
                    return StepOutput(float(loss), step.n_tokens)
                emit(head)
                head = None
            dst = self._grad_dst(unit)
            emit(self._gradients(unit, [(g, dst[name]) for name, g in wgrads.items()], permit=permit,
                                 accumulate=accumulate))
            del wgrads  # only the GradsOut keeps them, so they go once they have landed

        emit(self._embed_grads(step, ms, grads, grad_lm, accumulate))

        self.egress.wait_sent()
        with self.rec.span("host", "sync"):
            norm_values = torch.stack([norms[u.index] for u in self.layout.units]).cpu().tolist()
            loss_value = float(loss)
        return StepOutput(loss_value, step.n_tokens, norm_values, held)

    def _head_grads(self, grad_norm_w: Weights, grad_lm: torch.Tensor, accumulate: bool) -> GradsOut:
        """The head's gradients with their places in the arena: the final norm's, and the lm_head's unless it is
        the embedding table (tied: those join the embedding's)."""
        head_unit = self.layout.head
        head_dst = self._grad_dst(head_unit)
        head_grads = [(g, head_dst[name]) for name, g in grad_norm_w.items()]
        if not self.config.tie_embeddings and grad_lm is not None:
            head_grads.append((grad_lm, head_dst["lm_head.weight"]))
        return self._gradients(head_unit, head_grads, accumulate=accumulate)

    def _embed_grads(self, step: PreparedStep, ms: list[int], grads: list[torch.Tensor], grad_lm: torch.Tensor,
                     accumulate: bool) -> GradsOut:
        """The embedding's backward: the gradient rows of the step's tokens (plus the whole table when tied, the
        lm_head's gradient `grad_lm`). grads: per micro-batch, the gradient with respect to the first layer's
        input; each is dropped once used."""
        embed_unit, rows_idx = self.layout.embed, step.rows_idx
        if not self.trainable.embed.slots:  # frozen (a LoRA run's): no gradient
            return self._gradients(embed_unit, [])
        with self.rec.span("compute", "embed-backward", embed_unit.index, self.streams.compute):
            grad_rows = self.embedding.grad_rows(grads, [step.row_of_token[step.micro[m]] for m in ms], rows_idx)
        embed_grad = self._grad_dst(embed_unit)["embed_tokens.weight"]
        if self.config.tie_embeddings or self.dp is not None:  # data parallel: the executors' rows differ
            full = grad_lm.float() if self.config.tie_embeddings else grad_rows.new_zeros(embed_grad.shape)
            full.index_add_(0, self._to_device(rows_idx), grad_rows)
            return self._gradients(embed_unit, [(full, embed_grad)], accumulate=accumulate)
        if accumulate:  # this step's rows, which an earlier pass wrote (resident: on the device)
            on_device = self.resident.holds(embed_unit)  # there the rows are gathered where they are, not copied
            rows = embed_grad.index_select(0, self._to_device(rows_idx) if on_device else rows_idx)
            grad_rows += rows if on_device else self._to_device(rows)
        pairs, scatter = self.embedding.to_arena(grad_rows, rows_idx, embed_grad, self.resident.holds(embed_unit))
        return self._gradients(embed_unit, pairs, scatter)

    def send_held(self, held: list[GradsOut], landed: LandedCallback = noop, slot_free: UnitCallback = noop
                  ) -> None:
        """Copies gradients a `run(hold_grads=True)` held on the device to the host (GradEgress.send_held)."""
        self.egress.send_held(held, landed, slot_free)

    def close(self) -> None:
        self.egress.close()
        self.streams.close()

    # ---- helpers ----
    def _to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """H2D of a small host tensor (token ids, gathered rows) on the h2d stream, ordered before compute."""
        if self.resident.owns(t):  # a resident unit's, already there
            return t if dtype is None else t.to(dtype)
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
        # a unit with no gradient (OpenAI GPT's head: tied, no final norm) still gives a norm tensor
        norm_sq = sum((torch.linalg.vector_norm(g, dtype=torch.float64).square() for g, _ in pairs),
                      torch.zeros((), dtype=torch.float64, device=self.device))
        self.streams.compute_uses(norm_sq, *(g for g, _ in pairs))
        return GradsOut(unit, pairs, norm_sq, self.streams.record(self.streams.compute), scatter, permit)

    def _reduced(self, unit: Unit, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(this executor's slice of the unit's gradient summed over the executors, its range in the arena)]: the
        pairs laid out flat at their destinations' offsets in the unit's range, the gaps (tensors with no gradient
        here) zero."""
        assert self.dp is not None
        whole = self.grad_layout.range_of(self.trainable.units[unit.index], self.grads)
        flat = torch.zeros(whole.numel(), dtype=torch.float32, device=self.device)
        for g, dst in pairs:
            start = (dst.data_ptr() - whole.data_ptr()) // whole.element_size()
            flat[start : start + dst.numel()] = g.reshape(-1)
        return [(self.dp.reduce(flat), whole[self.dp.shard(whole.numel())])]

    def _grad_dst(self, unit: Unit) -> Weights:
        """Where the unit's gradient tensors go: its range of the arena's gradients, or on the device if resident."""
        unit = self.trainable.units[unit.index]  # a LoRA run's: the adapters'
        return self.resident.grads_of(unit) if self.resident.holds(unit) else self.grad_layout.bind(unit, self.grads)
