"""megatrain.Engine: the driver-side handle on the actors of one training run: start, step, save, stop.

    engine = megatrain.Engine("1b", lr=3e-4, optimizer_workers=8, precision="tf32")
    loss = engine.step(input_ids)             # one optimizer step on this batch
    engine.save_checkpoint("ckpt/step-100")
    engine.shutdown()                          # or use it as a context manager

A step's update runs beside the backward and the driver settles it once the norm is known; the actors:
pipelines/run_actors.py; a dead one: pipelines/recovery.py. See docs/design.md#a-step-as-the-driver-sees-it."""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.executor import gpu_free_memory
from megatrain.config import MegatrainError, ModelConfig
from megatrain.engine.messages import ExecutorStep
from megatrain.engine.optimizer import Speculation, clip_coefficient
from megatrain.engine.resident import resident_update
from megatrain.io.checkpoint import atomic_directory, checkpoint_target, write_manifest
from megatrain.memory.arena import remove_stale_segments
from megatrain.memory.post_plan import reference_problem
from megatrain.perf.calibrate import device_name
from megatrain.run_plan import Machine, Request
from megatrain.store import resolve_model
from megatrain.telemetry import WAIT_LANE, Span, StepStats, add_wait_before
from pipelines.cluster import NodePlacement, driver_node, init_ray, node_resources, reap_orphaned_ray_agents, run_nodes
from pipelines.engine_options import EngineOptions
from pipelines.generate import Generating
from pipelines.logprobs import LogprobQueries, batch_of
from pipelines.lora import record_lora_arena
from pipelines.plan_prediction import run_calibration
from pipelines.recovery import Recovery, is_fault
from pipelines.run_actors import RunActors, absolute, get, save_target
from pipelines.run_plan import resolve, uses_gpu

log = logging.getLogger(__name__)


class NonFiniteError(MegatrainError):
    pass


@dataclass
class StepResult:
    step: int  # index of this step (0-based, counting skipped ones)
    loss: float
    tokens: int
    grad_norm: float
    lr: float
    skipped: bool  # non-finite loss or gradient: no update applied
    stats: dict[str, Any] | None = None
    spans: list[Any] = field(default_factory=list)
    rolled_back: bool = False  # the updates beside the backward were rolled back (the step clipped, or was skipped)
    # how its update ran, as the prediction's cases name them (megatrain/perf/predict.py CASES): "speculated" beside
    # the backward (or final as each gradient landed), "rolled back", "serial" (after the step, its norm known first)
    update: str = "speculated"
    loss_metrics: dict[str, float] = field(default_factory=dict)  # what a loss on log-probs reported (token_loss.py)


class Engine(Generating, LogprobQueries):  # Engine.generate, Engine.logprobs: pipelines/generate.py, logprobs.py
    def __init__(self, model: str | Path | ModelConfig, options: EngineOptions | None = None, **overrides: Any):
        """The run of `model` (a preset name, an HF directory or Hub name, or a ModelConfig) with `options` and the
        keyword `overrides` of its fields (pipelines/engine_options.py; what each means: docs/design.md): the Ray
        cluster joined, the run resolved (self.run_plan), its actors started. A run the plan says will not fit is
        refused before anything is allocated."""
        o = self.options = EngineOptions.of(options, overrides)
        self.optim = o.optim
        self.request = o.engine  # what was asked; resolve (pipelines/run_plan.py) decides its "auto"s at the start
        self.config, hf_dir, self.model_name = resolve_model(model)
        self.adapter = o.adapter and absolute(o.adapter)
        self._longest_seen = 0  # the longest sequence a step was given: warned about once past the model's positions
        # what the store actor builds the model from: an HF directory's absolute path, a preset name or a config
        model_arg = absolute(hf_dir) if hf_dir is not None else model if isinstance(model, ModelConfig) else str(model)
        self.max_nonfinite_steps, self.trace = o.max_nonfinite_steps, o.trace
        self.steps_done = 0  # steps run, skipped ones included
        self.updates_applied = 0  # updates in the arena: AdamW's step count and the LR schedule's index
        self.nonfinite_in_row = self.skipped_steps = 0
        self.rollbacks = 0  # steps whose updates beside the backward were rolled back
        self.speculating = True  # speculate "auto": whether the next step does (not after one that clipped)
        self.speculations = 0  # Speculations made: each has its own number and record at the workers
        self.pending: list[ray.ObjectRef] = []  # the last step's updates
        self.resource_timeout = o.resource_timeout
        remove_stale_segments()  # a killed earlier run's arena
        reap_orphaned_ray_agents()  # ... and its local Ray's agents
        init_ray(o.address)
        self.run_id = uuid.uuid4().hex[:12]
        self.metrics = self._start_metrics() if o.metrics else None
        self.actors = RunActors(self.run_id, self.config, self.optim, o.trace, self.metrics)
        self.recovery = Recovery(self, self.actors, o.max_restarts, o.max_replay_steps)
        try:
            self._start(model_arg, Request(self.config, self.model_name, self.request, self.optim, o.batch_size,
                                           o.seq_len, o.engine.lora, self.adapter))
        except BaseException:
            self.shutdown()
            raise
        if self.metrics is not None:
            self.metrics.record_arena(self.handle.nbytes())
            record_lora_arena(self.metrics, self.handle)  # a LoRA run's frozen base and adapters, by kind

    # ---- start ----
    def _start_metrics(self) -> Any:
        from actors.metrics import EngineMetrics, write_session_dashboard

        metrics = EngineMetrics(run=self.run_id)
        metrics.start_repeating()  # Ray drops gauges not set again for two report intervals: long steps
        write_session_dashboard()  # beside Ray's Grafana dashboards, where the cluster has them
        return metrics

    def _start(self, model_arg: str | ModelConfig, request: Request) -> None:
        node = driver_node()  # the arena's node: the driver maps it from its own /dev/shm
        nodes = run_nodes(node, self.request.nodes)
        run = self.run_plan = resolve(request, self._machine(node, len(nodes)))
        # the memory plan (the progress line's prediction is of it), and the run's settings as an EngineConfig
        self.plan, self.on_gpu, self.engine_config = run.memory, run.on_gpu, run.engine_config()
        for note in run.notes:
            log.info("%s", note)
        for warning in run.warnings:
            log.warning("%s", warning)
        for m, node_id in enumerate(nodes):  # one at a time into the list: a failed one's are released by shutdown
            placement = NodePlacement.reserve(node_id, run.optimizer_workers, run.on_gpu, self.resource_timeout,
                                              f"megatrain/{self.run_id}/node{m}", executors=run.executors)
            self.actors.placements.append(placement)
        if problem := reference_problem(self.plan):  # the run fits, its KL reference's copy does not
            raise MegatrainError(problem)
        self.plan.check()  # before the arena is made: one sentence on what does not fit and what would
        if len(nodes) > 1:
            log.info("%d nodes (%s), each with its parameter store, %d optimizer worker(s) and %d executor(s)",
                     len(nodes), ", ".join(n[:8] for n in nodes), run.optimizer_workers, run.executors)
        self.actors.start(run, model_arg, self.adapter)
        self.device = get(self.executor.device.remote())
        log.info("%s", run.compile_why)

    def _machine(self, node: str, nodes: int) -> Machine:
        """What the driver's Ray node offers the run: its GPUs and free CPUs, the free memory of a GPU the run would
        compute on (measured in a throwaway process: the driver holds no CUDA context) and its cached calibration."""
        total, free = node_resources(node)
        has_gpu = total.get("GPU", 0) >= 1
        on_gpu = uses_gpu(self.request.device, has_gpu)
        gpu_free = None
        if on_gpu:
            ref = gpu_free_memory.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            try:
                gpu_free = get(ref, timeout=self.resource_timeout)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.TaskUnschedulableError):
                ray.cancel(ref, force=True)  # no GPU free, or none: the reservation below says so in one sentence
        cal = run_calibration(on_gpu)
        gpu_name = cal.device if cal is not None else "the GPU"
        if on_gpu and cal is None and torch.cuda.is_available():
            gpu_name = device_name("cuda")
        return Machine(has_gpu=has_gpu, gpus=int(total.get("GPU", 0)), free_cpus=free.get("CPU", 0.0), nodes=nodes,
                       gpu_free=gpu_free, calibration=cal, gpu_name=gpu_name)

    @property
    def grads(self) -> str:
        """Where gradients wait for the optimizer: "arena", "stream" or "device" (see GRAD_PLACEMENTS)."""
        return self.run_plan.grads

    @property
    def updates_after_step(self) -> bool:
        """The driver starts (or settles) a step's update once the step is done (RunPlan.updates_after_step)."""
        return self.run_plan.updates_after_step

    @property
    def scheduling_strategy(self) -> Any:
        """Where this run's actors are: give it to an actor of your own that feeds the run and reserves no CPU
        (a data loader: `DataLoaderActor.options(scheduling_strategy=engine.scheduling_strategy)`)."""
        self._check_running()
        return self.placement.scheduling_strategy

    # ---- the run's actors (pipelines/run_actors.py) and the faults they survived (pipelines/recovery.py) ----
    stores = property(lambda self: self.actors.stores)  # one parameter store per node, the driver's first
    store = property(lambda self: self.stores[0] if self.stores else None)  # the driver node's (the only one, mostly)
    workers = property(lambda self: self.actors.workers)
    executors = property(lambda self: self.actors.executors)  # rank order: the first also evaluates, holds gradients
    executor = property(lambda self: self.executors[0] if self.executors else None)
    placements = property(lambda self: self.actors.placements)  # one per node, the driver's first
    placement = property(lambda self: self.placements[0] if self.placements else None)
    handles = property(lambda self: self.actors.handles)  # the nodes' arenas
    handle = property(lambda self: self.handles[0])
    restarts = property(lambda self: self.actors.restarts)  # actor deaths survived
    replayed_steps = property(lambda self: self.recovery.replayed_steps)  # steps recomputed from a checkpoint

    # ---- step ----
    def step(self, input_ids: Any, labels: Any = None, position_ids: Any = None, *, loss: Any = None,
             temperature: float = 1.0, entropy: bool = False, **fields: Any) -> float:
        """One optimizer step on this batch (tensors or numpy [batch, seq]); returns the loss. position_ids: each
        packed document's positions from 0 (a document attends within itself only), as transformers takes them.
        loss: train on loss(logprobs, entropy, fields) -> scalar instead (megatrain/engine/token_loss.py)."""
        return self.step_batch(batch_of(input_ids, labels, position_ids, loss, temperature, entropy, fields)).loss

    def step_batch(self, batch: Any) -> StepResult:
        """One step on a batch dict or an ObjectRef to one (e.g. straight from the data-loader actor)."""
        self._check_running()
        if not isinstance(batch, ray.ObjectRef):
            self.check_sequence_length(np.shape(batch["input_ids"])[-1])
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        self.recovery.replay.add(ref)
        steps_before = self.steps_done
        while True:
            try:
                result = self.step_once(ref)
                self.recovery.step_completed()
                return result
            except Exception as e:
                if is_fault(e):
                    self.recovery.recover(e)
                    continue
                if self.steps_done == steps_before:  # refused (e.g. a bad token id): nothing to replay after a fault
                    self.recovery.replay.drop_last()
                raise

    def check_sequence_length(self, seq: int) -> None:
        """Warns once a step's sequences are longer than the positions the model was trained for (the `seq_len` the
        Engine was made with only sizes its memory plan: a model fed shorter batches hears nothing)."""
        positions = self.config.max_position_embeddings
        if seq > positions and self._longest_seen <= positions:
            log.warning("seq_len %d is longer than the %d positions %s was trained for; RoPE extrapolates past them, "
                        "usually worse than training at the model's length", seq, positions, self.model_name)
        self._longest_seen = max(self._longest_seen, seq)

    def step_once(self, batch: ray.ObjectRef) -> StepResult:
        """One step, no recovery: a fault raises (step_batch recovers; a recovery replays the steps with this)."""
        step = self.steps_done
        t0 = time.monotonic()
        ray.wait([batch], fetch_local=False)  # a loader's batch may not be made yet: the executors would idle for it
        data_wait = Span(WAIT_LANE, "data", step, t0, time.monotonic())
        speculation = self._speculation()
        out = self.actors.train_step(batch, self.updates_applied, self.pending, speculation)
        add_wait_before(out.stats, out.spans, data_wait)  # the step's accounting and trace count it
        update_spans = [span for spans in get(self.pending) for span in spans]  # done: the step waited on them
        grad_norm = math.sqrt(sum(out.unit_norms_sq)) if out.unit_norms_sq else float("nan")
        finite = math.isfinite(out.loss) and math.isfinite(grad_norm) and not out.skipped_units
        lr = self.optim.lr_at(self.updates_applied)
        coef = clip_coefficient(grad_norm, self.optim.max_grad_norm) if finite else 0.0
        update = "speculated"
        if not self.updates_after_step:
            self.pending = out.updates
        elif speculation is None or not out.updates:  # the serial update: nothing was handed out in the backward
            get(out.updates)  # but the NVMe tier's gradients stowed as they landed: on their way before the update
            self.pending = self.actors.update(self.updates_applied, coef) if finite else self.actors.flush_tier()
            update = "serial"
        else:
            update = self._settle(out, finite, coef, speculation.number)
        resident = resident_update(out.resident, out.unit_norms_sq, finite, coef, self.updates_after_step)
        if resident is not None:  # queued on the executor before the next step (in `pending`, as the pool's)
            self.pending = self.pending + [self.executor.update_resident.remote(self.updates_applied, *resident,
                                                                                self.optim)]
        self.speculating = finite and coef == 1.0
        # clipping off: units updated before a non-finite one was found keep their update (see README)
        if finite or (not self.updates_after_step and (out.updates or resident)):
            self.updates_applied += 1
        self.steps_done += 1
        self._record(out, time.monotonic() - t0, finite)
        self._count_nonfinite(finite, out.loss, grad_norm)
        return StepResult(step, out.loss, out.tokens, grad_norm, lr, not finite, out.stats,
                          out.spans + (update_spans if self.trace else []), update == "rolled back", update,
                          out.loss_metrics)

    def _speculation(self) -> Speculation | None:
        """Whether this step updates its units beside the backward (EngineConfig.speculate), and its number."""
        update = self.run_plan.update
        if update in ("final", "serial") or (update == "unless-clipped" and not self.speculating):
            return None
        self.speculations += 1
        return Speculation(self.speculations, self.optim.max_grad_norm)

    def _settle(self, out: ExecutorStep, finite: bool, coef: float, speculation: int) -> str:
        """After a backward beside which units were speculated: their updates are confirmed where the step does not
        clip (and every unit was speculated), else rolled back: redone with the clip, or only rolled back (a non-finite
        gradient), the units not updated beside the backward (versions bumped only to free a host slot, or waiting
        for another executor's slice) updated or left. Sets `pending`; returns how the step's update ran (StepResult's
        `update`): "speculated" (it stands), "rolled back", or "serial" (none was updated beside the backward)."""
        streamed = len(out.unit_norms_sq) - len(out.resident)  # the resident units are not handed out
        if finite and coef == 1.0 and len(out.speculated) == streamed:
            self.pending = out.updates + self.actors.confirm(self.updates_applied, speculation)
            return "speculated"
        get(out.updates)  # every update beside the backward is in before one is rolled back
        if finite:
            self.actors.roll_back_versions(self.updates_applied)
            self.pending = self.actors.update(self.updates_applied, coef, speculation)
        else:
            self.actors.roll_back(self.updates_applied, speculation)
            self.pending = []
        self.rollbacks += out.speculated_any
        return "rolled back" if out.speculated_any else "serial"

    def _write_back_resident(self) -> None:  # before something reads the arena (after wait_for_updates)
        if self.run_plan.resident_units:
            get(self.executor.write_back.remote())

    def _record(self, out: ExecutorStep, seconds: float, finite: bool) -> None:
        """The step's metrics (the optimizer workers record their own, from their processes)."""
        if self.metrics is None:
            return
        if not finite:
            self.metrics.record_skipped_step()
        self.metrics.record_rollbacks(self.rollbacks)
        if out.stats:
            tokens_per_s = out.tokens / seconds if seconds > 0 else 0.0
            tflops = tokens_per_s * self.config.flops_per_token(out.seq) / 1e12  # attention's included
            self.metrics.record_step(StepStats.from_dict(out.stats), out.loss, tokens_per_s, tflops)

    def evaluate(self, batch: Any) -> tuple[float, int]:
        """(mean loss, tokens) of a batch dict or ObjectRef with the current weights; trains nothing."""
        self._check_running()
        out = get(self.executor.evaluate.remote(batch, self.updates_applied, self.pending))
        return out.loss, out.tokens

    def _count_nonfinite(self, finite: bool, loss: float, grad_norm: float) -> None:
        if finite:
            self.nonfinite_in_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_row += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped (%d in a row)",
                    self.steps_done - 1, loss, grad_norm, self.nonfinite_in_row)
        if self.nonfinite_in_row >= self.max_nonfinite_steps:
            raise NonFiniteError(f"{self.nonfinite_in_row} steps in a row had a non-finite loss or gradient; lower "
                                 "the learning rate, check the data, or resume from an earlier checkpoint.")

    # ---- save ----
    def state(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "updates_applied": self.updates_applied,
                "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks, "speculating": self.speculating,
                "optim": {**self.optim.__dict__, "betas": list(self.optim.betas)}}

    def set_state(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.updates_applied = int(state["updates_applied"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.speculating = bool(state.get("speculating", True))  # a resumed run decides as the run it resumes

    def _check_running(self) -> None:
        if self.store is None:
            raise MegatrainError("this Engine was shut down; create a new one (or load a checkpoint into one).")

    def wait_for_updates(self) -> None:
        """Blocks until the last step's update is in the arena (before reading or saving weights)."""
        self._check_running()
        while True:
            try:
                get(self.pending)  # a worker's megatrain error (a state file gone) as its one sentence
                self.pending = self.actors.flush_tier()  # and the NVMe tier's writes behind on disk: []
                return
            except ray.exceptions.RayError as e:
                if not is_fault(e):  # a collective failure too: a lost node's peer store fails its weight exchange
                    raise
                self.recovery.recover(e, step_in_flight=False)

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """One checkpoint of the whole run, written atomically: every node's store writes its files (the first
        node's: also the weights and the trainer state) into one directory, and the manifest comes last. With
        several hosts the directory must be on a file system they share."""
        self.wait_for_updates()
        self._write_back_resident()
        state = {**self.state(), **(extra_state or {})}
        path = Path(save_target(directory))
        with atomic_directory(checkpoint_target(path)) as tmp:
            get([s.write_checkpoint_part.remote(str(tmp), state if m == 0 else None)
                 for m, s in enumerate(self.stores)])
            write_manifest(tmp)
        self.recovery.replay.restart_at(path)
        return path

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Loads a checkpoint of a run on any number of nodes (each node takes its part of the Adam moments)."""
        self.wait_for_updates()
        directory = absolute(directory)
        state = get([s.load_checkpoint.remote(directory) for s in self.stores])[0]
        get([e.load_resident.remote() for e in self.executors])
        self.set_state(state)
        self.recovery.replay.restart_at(Path(directory))
        return state

    def save_pretrained(self, directory: str | Path, extra_files: list[str | Path] | None = None, merge: bool = False
                        ) -> Path:
        """An HF model directory; a LoRA run's: its adapter in PEFT's format, or with `merge` the merged model."""
        self.wait_for_updates()
        self._write_back_resident()
        extra = [absolute(f) for f in extra_files or []]
        return Path(get(self.store.save_pretrained.remote(save_target(directory), extra, merge)))

    def parameters(self) -> dict[str, torch.Tensor]:
        """HF name -> copy of the current fp32 weights (a LoRA run's: its adapters', by PEFT name)."""
        self.wait_for_updates()
        self._write_back_resident()
        return dict(self.actors.weights())

    # ---- stop ----
    def shutdown(self) -> None:
        """Stops the actors; the stores unlink the arenas first. What a store killed on the way left in /dev/shm
        is removed here, on every node of the run."""
        if self.metrics is not None:
            self.metrics.stop()
        self.actors.stop()
        self.actors.release()
        remove_stale_segments()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
