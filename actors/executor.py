"""Ray shell of the GPU executor: maps and registers the arena, runs the layer-streaming step, and talks to the
optimizer workers: it waits for their updates before loading a unit, and hands them units as their gradients land,
during the backward. Held gradients go out later (`send_grads`); resident units are updated here
(`update_resident`). See docs/design.md#the-executor-actor."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import ray
import torch

from actors.arena_handle import HandleArg, open_arena
from actors.termination import exit_on_sigterm
from megatrain.config import MegatrainError, ModelConfig, OptimConfig
from megatrain.distributed.data_parallel import DataParallel
from megatrain.engine.batch_checks import token_ids
from megatrain.engine.executor import Executor
from megatrain.engine.generation import Generator, Sampling
from megatrain.engine.grad_egress import GradsOut
from megatrain.engine.messages import Evaluation, ExecutorStep
from megatrain.engine.optimizer import Speculation, clip_coefficient
from megatrain.engine.reference import initial_weights
from megatrain.engine.weight_waits import NO_WAITS, VersionWaits
from megatrain.lora.layout import training_layout
from megatrain.memory.arena import BF16_COPY_SEGMENT, FROZEN_SEGMENT
from megatrain.memory.plan import cap_gpu_memory, gpu_free_here
from megatrain.memory.post_plan import REFERENCE_SEGMENT
from megatrain.memory.residency import RESIDENT_SEGMENT
from megatrain.memory.versions import VersionTable
from megatrain.model import ops
from megatrain.model.layout import GradLayout, Unit
from megatrain.run_plan import RunPlan
from megatrain.telemetry import HANDOUT_LANE, Recorder, Span, executor_lanes

GPU_HOST_THREADS = 4  # host threads of a GPU executor (gathers and scatters of embedding rows; memory-bound)


def _batch_tensors(batch: dict[str, np.ndarray]
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """input_ids, labels and position_ids (None where the batch has none) of a loader batch."""
    # arrays from the object store are read-only views: token_ids copies the (small) integer arrays
    optional = [batch.get(key) for key in ("labels", "position_ids")]
    return (torch.from_numpy(token_ids(batch["input_ids"])),
            *(None if a is None else torch.from_numpy(token_ids(a)) for a in optional))


@ray.remote(num_cpus=0, concurrency_groups={"grads_out": 1})
class GPUExecutor:
    def __init__(self, handle: HandleArg, config: ModelConfig, plan: RunPlan, workers: list[Any], trace: bool = False,
                 rank: int = 0, rendezvous: str | None = None):
        """Executor `rank` of the run `plan` describes (data parallel over a step's rows with the plan's other
        executors, which meet at `rendezvous`, tcp://host:port); `workers`: its node's optimizer workers."""
        exit_on_sigterm()
        self.arena = open_arena(handle)  # waits for the store, which starts beside this actor
        self.layout = training_layout(config, plan.lora)  # what trains: a LoRA run's adapters
        if plan.gpu_memory is not None and plan.device.startswith("cuda"):  # gpu_memory_gib: the plan fits in it
            cap_gpu_memory(plan.gpu_memory)
        self.dp = None
        if plan.world > 1:
            device = torch.device("cuda" if plan.device.startswith("cuda") else "cpu")
            self.dp = DataParallel.join(rank, plan.world, rendezvous or "", device)
        self.executor = Executor(config, self.layout, self.arena.params, self.arena.grads, plan.device,
                                 plan.precision, plan.loss_chunk_tokens, Recorder(),
                                 GradLayout.build(self.layout, plan.grads), self.arena.tensors.get(BF16_COPY_SEGMENT),
                                 plan.compile, tile_tokens=plan.tile_tokens, checkpoint_budget=plan.checkpoint_budget,
                                 data_parallel=self.dp, resident_units=plan.resident_units,
                                 kept_layers=plan.kept_layers, frozen=self.arena.tensors.get(FROZEN_SEGMENT),
                                 resident_cast=plan.resident_weights == "cast",
                                 reference=self.arena.tensors.get(REFERENCE_SEGMENT))
        self.seed = plan.seed  # a LoRA run's dropout masks are drawn from it and the step (LoraStep.start_step)
        self.hold_grads = plan.grads == "device"
        self.executors_per_node = plan.executors
        self.micro_batches, self.schedule = plan.micro_batches, plan.schedule
        self._held: dict[int, list[GradsOut]] = {}  # step -> its gradients still on the device
        self._speculated: dict[int, set[int]] = {}  # step -> the units updated beside its backward
        self.trace = trace  # stall accounting always runs; spans travel to the driver only when tracing
        if self.executor.device.type == "cuda":
            # page-locked: what the copy streams read (the weights the executor streams: the bf16 copy in bf16
            # runs, a LoRA run's frozen base and its adapters, else params) and write (grads)
            read = next(name for name, t in self.arena.tensors.items() if t is self.executor.weights)
            self.arena.register_cuda((read, "grads") if read != FROZEN_SEGMENT else (read, "grads", "params"))
            if REFERENCE_SEGMENT in self.arena.tensors:  # the reference's pass streams it
                self.arena.register_cuda((REFERENCE_SEGMENT,))
            # Ray sets OMP_NUM_THREADS=1 in an actor without CPUs; the embedding rows are gathered and their
            # gradients scattered on the host, on the step's critical path: a few threads, leaving the
            # rest of the cores to the optimizer workers
            torch.set_num_threads(min(GPU_HOST_THREADS, os.cpu_count() or 1))
        else:  # the CPU path computes here: use the cores Ray's num_cpus=0 did not grant us
            torch.set_num_threads(max(1, os.cpu_count() or 1))
        # per unit: each optimizer worker's update, and with several nodes a last column, the update every node has
        self.versions = VersionTable(self.arena.versions.view(len(self.layout.units), -1))
        self.issued = self.arena.issued  # per unit, the update number handed to the workers
        self.resident = self.executor.resident
        flags = self.arena.tensors.get(RESIDENT_SEGMENT)
        if flags is not None:  # the optimizer workers leave these units
            flags.zero_()
            flags[: len(self.resident)] = 1
        self.load_resident()
        self.workers = workers
        # updates handed out as gradients land in the backward are final only when nothing must be known first (the
        # step's norm, other executors' slices of each unit); otherwise they are speculative where the driver asks
        self.final_updates = not plan.updates_after_step
        # the NVMe tier holds the gradients: one the workers do not update beside the backward leaves the arena (stow)
        self.stows = plan.tier is not None and "grads" in plan.tier.kinds
        self.generator: Generator | None = None  # made at the first generate

    def device(self) -> str:
        return str(self.executor.device)

    def pid(self) -> int:
        return os.getpid()

    def train_step(self, batch: dict[str, np.ndarray], step: int, expected_version: int,
                   pending: list[ray.ObjectRef], speculation: Speculation | None = None) -> ExecutorStep:
        """Forward + backward of `batch` as update number `step`; weights are read only once every worker's
        version of a unit reaches `expected_version` (the previous step's update is in). `pending`: the
        driver's refs of that update, watched for a worker's failure while waiting. `speculation`: each unit is
        updated beside the backward as its gradient lands, until one is not finite or the units so far clip."""
        rec = self.executor.rec
        rec.begin_step(step, self.executor.device)
        if self.executor.lora is not None:
            self.executor.lora.start_step(step, seed=self.seed)
        handout = _Handout(self, step, speculation)

        def loss_ready(loss: float) -> bool:
            return bool(np.isfinite(loss)) if self.dp is None else self.dp.all_finite(loss)

        input_ids, labels, position_ids, loss_tokens = self._my_rows(*_batch_tensors(batch))
        out = self.executor.run(input_ids, labels, position_ids, weight_waits=self._waits(expected_version, pending),
                                grads_landed=handout.grads_landed, loss_ready=loss_ready, slot_free=handout.slot_free,
                                hold_grads=self.hold_grads, micro_batches=self.micro_batches,
                                schedule=self.schedule, loss_tokens=loss_tokens, token_loss=batch.get("token_loss"),
                                also_send=speculation is not None)  # held gradients go out now as well
        # only this step's gradients can still be wanted: the last step's were sent before this forward ended;
        # and none of a step whose update the driver will skip (a non-finite norm) unless units were updated beside
        # its backward: putting them back reads their gradients again (every unit resident: none, but the step is held)
        held = self.hold_grads and out.unit_grad_norms_sq and (out.finite or handout.speculated)
        self._held = {step: out.held} if held else {}
        self._speculated = {step: set(handout.speculated)}
        out.held = []
        stats = rec.end_step()
        token_loss = batch.get("token_loss")  # what its loss reported of the batch (TokenLoss.reported)
        spans = self._lanes([s for s in rec.spans if s.step == step]) if self.trace else []
        return ExecutorStep(out.loss, out.tokens, int(input_ids.shape[1]), out.unit_grad_norms_sq, handout.issued,
                            handout.skipped_units, handout.speculated, [u.index for u in self.resident.units],
                            stats.to_dict(), spans, loss_metrics=token_loss.reported if token_loss is not None else {})

    def _my_rows(self, input_ids: torch.Tensor, labels: torch.Tensor | None, position_ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int | None]:
        """This executor's rows of a step's batch, and the labelled tokens of the whole step its loss is the mean
        over (None: one executor, the batch's own)."""
        if self.dp is None:
            return input_ids, labels, position_ids, None
        self.executor.check_batch(input_ids, labels)  # every executor refuses a bad batch, or none does
        share = self.dp.world * self.micro_batches
        if input_ids.shape[0] % share:
            raise MegatrainError(f"a step's batch of {input_ids.shape[0]} rows does not split among "
                                 f"{self.dp.world} executors x {self.micro_batches} micro-batches; give a "
                                 f"multiple of {share} rows.")
        loss_tokens = ops.labelled_tokens(ops.shift_labels(input_ids, labels))
        mine = self.dp.rows(input_ids.shape[0])
        input_ids, labels, position_ids = (None if t is None else t[mine] for t in (input_ids, labels, position_ids))
        return input_ids, labels, position_ids, loss_tokens

    def _lanes(self, spans: list[Span]) -> list[Span]:
        return spans if self.dp is None else executor_lanes(spans, self.dp.rank, self.executors_per_node)

    def evaluate(self, batch: dict[str, np.ndarray], expected_version: int, pending: list[ray.ObjectRef]
                 ) -> Evaluation:
        """Loss of `batch` with the weights of update `expected_version`; no gradients leave the GPU."""
        input_ids, labels, position_ids = _batch_tensors(batch)
        with self._pass_without_update(expected_version):
            out = self.executor.run(input_ids, labels, position_ids,
                                    weight_waits=self._waits(expected_version, pending),
                                    micro_batches=self.micro_batches, schedule=self.schedule,
                                    loss_ready=lambda loss: False)
        return Evaluation(out.loss, out.tokens)

    def generate(self, prompts: list[list[int]], sampling: Sampling, expected_version: int,
                 pending: list[ray.ObjectRef], first_row: int = 0, hold: bool = True) -> dict[str, Any]:
        """New tokens for each prompt (megatrain/engine/generation.py) with the weights of update `expected_version`;
        first_row: the first prompt's index among the call's (several executors share its prompts); hold: units held
        on the device for the call where they fit."""
        if self.generator is None:
            self.generator = Generator(self.executor)
        with self._pass_without_update(expected_version, adapters=False):  # the generator binds its adapters
            out = self.generator.generate(prompts, sampling, self._waits(expected_version, pending), first_row, hold)
        return {"token_ids": out.token_ids, "finished": out.finished, "held_units": out.held_units,
                "held_bytes": out.held_bytes}

    def logprobs(self, batch: dict[str, Any], expected_version: int, pending: list[ray.ObjectRef],
                 temperature: float, entropy: bool, reference: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each label's log-prob (and entropy) with the weights of update `expected_version` (Executor.logprobs;
        reference: the initial weights')."""
        input_ids, labels, position_ids = _batch_tensors(batch)
        # the initial weights are never written: nothing to wait for
        waits = NO_WAITS if reference else self._waits(expected_version, pending)
        weights = initial_weights(self.executor) if reference else nullcontext()
        with self._pass_without_update(expected_version), weights:
            return self.executor.logprobs(input_ids, labels, position_ids, weight_waits=waits,
                                          micro_batches=self.micro_batches, temperature=temperature, entropy=entropy)

    @contextmanager
    def _pass_without_update(self, expected_version: int, adapters: bool = True) -> Iterator[None]:
        """A pass that trains nothing (evaluate, logprobs, generate): recorded apart from the next training step,
        with a LoRA run's adapters of update `expected_version` and no dropout."""
        rec = self.executor.rec
        rec.begin_step(rec.step, self.executor.device)
        if adapters and self.executor.lora is not None:
            self.executor.lora.start_step(expected_version, training=False)
        try:
            yield
        finally:
            rec.end_step(keep=False)  # its spans are not the next training step's

    @ray.method(concurrency_group="grads_out")
    def send_grads(self, step: int, clip_coef: float, speculation: int | None = None, roll_back: bool = False
                   ) -> list[Span]:
        """Update number `step` from the gradients its train_step held on the device: each unit's copied to
        the host in forward order and handed to the workers as it lands (OptimizerWorker.update_unit, which replaces
        a unit speculated in speculation number `speculation` by the clipped update). Units whose speculated update
        stands (clip_coef 1) are not sent; with roll_back (a skipped step) only those are, to be rolled back. Returns
        once all are applied, with the workers' spans."""
        held = self._held.pop(step, None)
        if held is None:
            raise MegatrainError(f"no gradients of step {step} are held on the device; its train_step did not "
                                 "run on this executor or was skipped.")
        speculated = self._speculated.pop(step, set()) if speculation is not None else set()
        if roll_back:
            held = [out for out in held if out.unit.index in speculated]
        elif clip_coef == 1.0:  # where the step does not clip, the updates beside the backward are final
            held = [out for out in held if out.unit.index not in speculated]
        issued: list[ray.ObjectRef] = []
        unit_refs: dict[int, list[ray.ObjectRef]] = {}

        def landed(unit: Unit, norm_sq: float) -> None:
            if roll_back:
                refs = [w.roll_back.remote(step, speculation, unit.index) for w in self.workers]
            else:
                self.issued[unit.index] = step + 1
                refs = [w.update_unit.remote(unit.index, step, clip_coef, speculation) for w in self.workers]
            unit_refs[unit.index] = refs
            issued.extend(refs)

        # not recorded as a stall: this thread waiting for a slot does not hold up the compute stream
        self.executor.send_held(held, landed, lambda unit: ray.get(unit_refs.pop(unit.index, [])))
        del held  # the device memory goes back to the allocator before the workers finish
        return [span for spans in ray.get(issued) for span in spans]

    def update_resident(self, step: int, clip_coef: float, units: list[int] | None, optim: OptimConfig
                        ) -> list[Span]:
        """Update number `step` of the resident units (or of `units` among them) with the step's clip coefficient,
        on the device (ordered before the next step: this actor runs its calls in turn)."""
        self.resident.update(step, clip_coef, optim, units)
        return []

    def write_back(self) -> int:
        """The resident units' weights and Adam moments into the arena, their versions in the table with them (the
        table says what the arena holds: a recovery that finds them behind restores a checkpoint); returns it."""
        version = self.resident.write_back(self.arena.tensors)
        if len(self.resident):
            self.versions.table[: len(self.resident)] = version
        return version

    def load_resident(self) -> None:
        """The resident units from the arena (at the start, after a checkpoint was loaded or restored)."""
        if len(self.resident):
            self.resident.load(self.arena.tensors, int(self.versions.table[: len(self.resident)].min()))

    def _waits(self, expected_version: int, pending: list[ray.ObjectRef], record: bool = True) -> VersionWaits:
        """A unit's weights are current once every worker's update of it reaches `expected_version` (the shared
        version table); while waiting, every 0.1 s, whether one of the `pending` update calls failed instead."""
        return VersionWaits(self.versions, expected_version, lambda: _raise_failed(pending),
                            self.executor.rec if record else None)

    def close(self) -> None:
        self._held.clear()
        self.executor.close()
        self.arena.close()


class _Handout:
    """One train_step's updates, handed to the optimizer workers as the units' gradients land in the backward."""

    def __init__(self, owner: GPUExecutor, step: int, speculation: Speculation | None):
        self.owner, self.step, self.speculation = owner, step, speculation
        self.issued: list[ray.ObjectRef] = []
        self.skipped_units: list[int] = []
        self.speculated: list[int] = []
        self.landed_sq, self.stopped = 0.0, False  # squared norm of the units (this executor's slices) landed so far

    def slot_free(self, unit: Unit) -> None:  # its gradient's host slot is wanted by the next unit
        # a stall of compute only where compute waits for it: not on the sender thread (a GPU's)
        owner = self.owner
        owner._waits(self.step + 1, self.issued, record=not owner.executor.send_thread).wait(unit)

    def hand_out(self, unit: Unit, calls: Iterator[ray.ObjectRef]) -> None:  # the unit's update, to the pool
        with self.owner.executor.rec.span(HANDOUT_LANE, "update", unit.index):
            self.owner.issued[unit.index] = self.step + 1
            self.issued.extend(calls)

    def grads_landed(self, unit: Unit, norm_sq: float) -> None:
        workers, step, speculation = self.owner.workers, self.step, self.speculation
        if self.owner.final_updates:
            if np.isfinite(norm_sq):
                self.hand_out(unit, (w.update_unit.remote(unit.index, step) for w in workers))
            else:
                self.skipped_units.append(unit.index)
                self.issued.extend(w.mark_skipped.remote(unit.index, step) for w in workers)
            return
        if speculation is None:  # the update waits for the step's norm: the driver starts it after this step
            if self.owner.stows:
                self.issued.extend(w.stow.remote(unit.index, step, None, self.owner.executors_per_node)
                                   for w in workers)
            return
        self.landed_sq += norm_sq
        self.stopped = self.stopped or not (np.isfinite(self.landed_sq) and  # the step will be skipped, or it clips
                                            clip_coefficient(self.landed_sq**0.5, speculation.max_grad_norm) == 1.0)
        if not self.stopped:
            self.speculated.append(unit.index)
            self.hand_out(unit, (w.speculate.remote(unit.index, step, speculation.number,
                                                    self.owner.executors_per_node) for w in workers))
        elif self.owner.hold_grads:  # its host slot is free for the next unit: nothing reads it in this backward
            self.issued.extend(w.mark_skipped.remote(unit.index, step) for w in workers)
        elif self.owner.stows:
            self.issued.extend(w.stow.remote(unit.index, step, speculation.number, self.owner.executors_per_node)
                               for w in workers)


def _raise_failed(refs: list[ray.ObjectRef]) -> None:
    if not refs:
        return
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in done:
        ray.get(ref)  # re-raises a worker's failure (RayActorError when it died mid-update)


@ray.remote(num_gpus=1, num_cpus=0, max_calls=1)  # holds no CPU the optimizer workers are sized from
def gpu_free_memory() -> int | None:
    """Free bytes on the GPU an executor would get, measured in a throwaway process (max_calls=1), so the
    driver never holds a CUDA context of its own."""
    return gpu_free_here()
