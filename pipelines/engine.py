"""megatrain.Engine: the driver-side handle on the actors of one training run.

    engine = megatrain.Engine("1b", lr=3e-4, optimizer_workers=8, precision="tf32")
    loss = engine.step(input_ids)             # one optimizer step on this batch
    engine.save_checkpoint("ckpt/step-100")
    engine.shutdown()                          # or use it as a context manager

One step, as the driver sees it:
  1. the executor runs forward + backward; before loading a unit it waits until the previous step's
     update of that unit is in the arena (the workers' version table)
  2. clipping on: the executor returns the per-unit squared gradient norms, the driver turns them into
     one clip coefficient and starts the update in forward order: with grads = "arena" every worker's
     `apply`, with grads = "device" the executor's `send_grads`, which copies each unit's gradient out of
     the GPU into a ring of host slots and hands it to the workers; either call returns at once, so the
     update overlaps the next step's forward
     clipping off: the executor already handed each unit to the workers as its gradients landed
Ray carries only control messages and token batches; weights and gradients stay in the arena.
Where gradients wait (EngineConfig.grads) is settled before the arena is allocated: "auto" keeps the host
at 12 B/param whenever it can (megatrain/memory/plan.py: plan_run).

Faults. The driver keeps the refs of the batches since the last checkpoint. When an actor dies:
  - only the executor, and the workers' version table shows every unit at the last issued update: a new
    executor maps the same arena and redoes the interrupted step (gradients are recomputed; no update of
    that step had started, because updates start only once a step's gradients are complete)
  - an optimizer worker (an in-place update may be half applied), or an executor whose step had already
    started updates (clipping off): new actors, the arena restored from the last checkpoint (or the
    initial weights), and the steps since replayed from the kept batches. The result is bit-identical
    to an uninterrupted run on the CPU; on a GPU, where the embedding's index_add_ and the attention
    backward use atomics, equal to fp32 rounding.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch

from actors.executor import GPU_HOST_THREADS, GPUExecutor, gpu_free_memory
from actors.optimizer_worker import OptimizerWorker
from actors.parameter_store import ParameterStoreActor
from megatrain.config import ConfigError, EngineConfig, MegatrainError, ModelConfig, OptimConfig, cause_chain
from megatrain.engine.data_parallel import free_port
from megatrain.engine.executor import token_ids
from megatrain.engine.optimizer import clip_coefficient
from megatrain.memory.arena import Arena, ArenaHandle, proc_stat, remove_stale_segments
from megatrain.memory.checkpoint import atomic_directory, check_save_target, checkpoint_target, write_manifest
from megatrain.memory.plan import MemoryPlan, pick_micro_batches, plan_run
from megatrain.memory.predict import Calibration, auto_optimizer_workers
from megatrain.memory.store import resolve_model
from megatrain.telemetry import StepStats
from pipelines.cluster import NodePlacement, driver_node, executor_device, init_ray, node_resources, run_nodes

log = logging.getLogger(__name__)


class NonFiniteError(MegatrainError):
    pass


ACTOR_DEATH = (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError, ray.exceptions.ObjectLostError)


def is_actor_death(e: BaseException) -> bool:
    """An actor process died (possibly seen through another actor's task), as opposed to a user error."""
    return any(isinstance(c, ACTOR_DEATH) for c in cause_chain(e))


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


def get(refs: Any, timeout: float | None = None) -> Any:
    """ray.get that raises a megatrain error from an actor as itself: one sentence, not Ray's traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = cause_chain(e)[-1]
        if isinstance(cause, MegatrainError):
            raise cause from None
        raise


def absolute(path: str | Path) -> str:
    """Actors run in their own working directory: a path from the user is made absolute on the driver."""
    return os.path.abspath(Path(path).expanduser())


def save_target(path: str | Path) -> str:
    """absolute(path), refused here if the driver could not have it replaced (see check_save_target)."""
    path = absolute(path)
    check_save_target(Path(path))
    return path


def is_cuda_error(e: BaseException) -> bool:
    """A CUDA error inside an actor: its context is unusable afterwards, so the actor must be replaced."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return any(isinstance(c, accelerator_error) or (isinstance(c, RuntimeError) and "CUDA error" in str(c))
               for c in cause_chain(e))


RAY_AGENTS = (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")


def reap_orphaned_ray_agents() -> list[int]:
    """Kills Ray agent processes left behind by a local Ray whose driver was SIGKILLed.

    Their raylet is gone, so they were re-parented to init (ppid 1); a live cluster's agents are children
    of its raylet and are never touched. Only this user's processes are considered.
    """
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != os.getuid() or not (proc / "cmdline").read_bytes().startswith(RAY_AGENTS):
                continue
            stat = proc_stat(proc.name)
            if stat is not None and int(stat[1]) == 1:  # ppid
                os.kill(int(proc.name), 9)
                killed.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    if killed:
        log.info("removed %d orphaned Ray agent process(es) of a killed run", len(killed))
    return killed


class Engine:
    def __init__(self, model: str | Path | ModelConfig, *, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                 warmup_steps: int = 0, total_steps: int | None = None, min_lr_ratio: float = 0.0,
                 optimizer_workers: int | str = 2, precision: str = "tf32", device: str = "auto", seed: int = 0,
                 loss_chunk_tokens: int = 4096, address: str | None = None, batch_size: int = 8,
                 seq_len: int = 2048, max_nonfinite_steps: int = 5, max_restarts: int = 10, trace: bool = False,
                 metrics: bool = True, grads: str = "auto", compile: bool = False, max_replay_steps: int = 1000,
                 resource_timeout: float = 60.0, tile_tokens: int | None | str = "auto",
                 checkpoint_budget_gib: float | None | str = "auto", micro_batches: int | str = 1,
                 schedule: str = "auto", executors: int | str = "auto", nodes: int = 1):
        """address: the Ray cluster (pipelines/cluster.py: init_ray): None joins the one `ray start` runs here, or
        starts a private one; "local" always starts a private one; "auto" or host:port must answer.
        max_replay_steps: batches kept since the last checkpoint for exact recovery; past it they are
        dropped (Ray's object store holds them) and a fault that needs a replay stops the run with a message.
        resource_timeout: seconds to wait for Ray to grant the run's CPUs (and GPU) on the driver's node.
        tile_tokens, checkpoint_budget_gib: long sequences (EngineConfig); "auto" lets the memory plan pick, and a
        run the plan says will not fit is refused before anything is allocated.
        micro_batches: a step's batch is that many micro-batches of batch_size rows and one update ("auto": batch_size
        is the step's rows, each executor's, split into the fewest equal micro-batches that fit memory), run
        layer-major (each layer's weights cross once per step; its weight gradients are summed over the
        micro-batches on the device); the loss is the mean over all the step's labelled tokens. schedule "auto"
        takes that layer-major schedule where the memory plan fits it, else "per-micro-batch" (the weights cross
        once per micro-batch, the gradients summed in the arena), and says so. executors: that many executor actors,
        data parallel over each step's rows (which must divide by executors x micro_batches), all streaming from
        the one arena; each unit's gradient is summed between them (torch.distributed: gloo on the CPU path, NCCL
        between GPUs) and each writes its slice into the arena ("auto": one per GPU Ray offers the run's node,
        one on the CPU path). nodes: the run spans that many Ray nodes (the driver's first), each with a parameter
        store holding the whole weights and 1/nodes of the Adam moments, its optimizer workers and `executors`
        executors; the step's rows split over all nodes' executors, each node updates its part of every unit and
        the stores exchange the updated weights (megatrain/memory/nodes.py). A Ray node is a host, or in a test,
        a node of `ray.cluster_utils.Cluster` with its own MEGATRAIN_SHM_DIR."""
        self.optim = OptimConfig(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, max_grad_norm=max_grad_norm,
                                 warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
        self.engine_config = EngineConfig(device=device, precision=precision, optimizer_workers=optimizer_workers,
                                          loss_chunk_tokens=loss_chunk_tokens, seed=seed, grads=grads,
                                          compile=compile, tile_tokens=tile_tokens,
                                          checkpoint_budget_gib=checkpoint_budget_gib, micro_batches=micro_batches,
                                          schedule=schedule, executors=executors, nodes=nodes)
        self.config, hf_dir, self.model_name = resolve_model(model)
        if seq_len > self.config.max_position_embeddings:
            log.warning("seq_len %d is longer than the %d positions %s was trained for; RoPE extrapolates past them, "
                        "usually worse than training at the model's length", seq_len,
                        self.config.max_position_embeddings, self.model_name)
        # what the store actor builds the model from: an HF directory's absolute path, a preset name or a config
        model_arg = absolute(hf_dir) if hf_dir is not None else model if isinstance(model, ModelConfig) else str(model)
        self.max_nonfinite_steps, self.max_restarts, self.trace = max_nonfinite_steps, max_restarts, trace
        self.steps_done = 0  # steps run, skipped ones included
        self.updates_applied = 0  # updates in the arena: AdamW's step count and the LR schedule's index
        self.nonfinite_in_row = 0
        self.skipped_steps = 0
        self.restarts = 0  # actor deaths survived
        self._faults_in_row = 0  # deaths since the last completed step: max_restarts bounds these
        self.replayed_steps = 0  # steps recomputed from a checkpoint to recover (work lost to faults)
        self._pending: list[ray.ObjectRef] = []  # the last step's updates
        self._replay: list[ray.ObjectRef] = []  # batches since the last checkpoint, for exact recovery
        self.max_replay_steps = max_replay_steps
        self._replay_complete = True  # False once batches were dropped: no exact replay until the next checkpoint
        self._last_checkpoint: Path | None = None
        self._arena: Arena | None = None
        self.stores: list[Any] = []  # one per node, the driver's first
        self.handles: list[ArenaHandle] = []  # their arenas
        self.executors: list[Any] = []  # rank order: the first also evaluates and holds gradients on the device
        self.workers: list[Any] = []
        self.placements: list[NodePlacement] = []  # one per node, the driver's first
        self.resource_timeout = resource_timeout
        remove_stale_segments()  # a killed earlier run's arena
        reap_orphaned_ray_agents()  # ... and its local Ray's agents
        init_ray(address)
        self.run_id = uuid.uuid4().hex[:12]
        self.metrics = None
        if metrics:
            from actors.metrics import EngineMetrics

            self.metrics = EngineMetrics(run=self.run_id)
        try:
            self._start(model_arg, seed, batch_size, seq_len)
        except BaseException:
            self.shutdown()
            raise
        if self.metrics is not None:
            self.metrics.record_arena(self.handle.nbytes())

    # ---- actors ----
    def _start(self, model_arg: str | ModelConfig, seed: int, batch: int, seq: int) -> None:
        node = driver_node()  # the arena's node: the driver maps it from its own /dev/shm
        on_gpu = self.on_gpu = self._on_gpu(node)
        nodes = run_nodes(node, self.engine_config.nodes)
        executors = self.engine_config.executors
        if executors == "auto":
            executors = max(1, int(node_resources(node)[0].get("GPU", 0))) if on_gpu else 1
        self.engine_config = replace(self.engine_config, executors=executors)
        world = executors * len(nodes)  # executors of the whole run
        if world > 1 and self.engine_config.grads not in ("auto", "arena"):
            raise ConfigError(f"{world} executors sum each unit's gradient into slices of the arena: grads must be "
                              f"'arena' (or 'auto'), not {self.engine_config.grads!r}.")
        if world > 1:
            self.engine_config = replace(self.engine_config, grads="arena")
        n = self.engine_config.optimizer_workers
        if n == "auto":
            n = auto_optimizer_workers(node_resources(node)[1].get("CPU", 0.0),
                                       executors * GPU_HOST_THREADS if on_gpu else 0,
                                       None if on_gpu else Calibration.load("cpu"))
            log.info("optimizer_workers auto: %d per node", n)
            self.engine_config = replace(self.engine_config, optimizer_workers=n)
        for m, node_id in enumerate(nodes):  # one at a time into the list: a failed one's are released by shutdown
            self.placements.append(NodePlacement.reserve(node_id, n, on_gpu, self.resource_timeout,
                                                         f"megatrain/{self.run_id}/node{m}", executors=executors))
        plan = self._plan(batch, seq, on_gpu)
        plan.check()  # before the arena is made: one sentence on what does not fit and what would
        if self.engine_config.micro_batches == "auto":
            log.info("micro_batches auto: %d micro-batch(es) of %d rows a step", plan.micro_batches, plan.batch)
        budget = plan.checkpoint_budget
        self.engine_config = replace(self.engine_config, grads=plan.grads, tile_tokens=plan.tile_tokens,
                                     checkpoint_budget_gib=None if budget is None else budget / 2**30,
                                     schedule=plan.schedule, micro_batches=plan.micro_batches)
        if plan.micro_batches > 1 and plan.schedule == "per-micro-batch" and self.engine_config.schedule == "auto":
            log.warning("%d micro-batches layer-major do not fit memory: the weights stream once per micro-batch "
                        "(%d times a step) and the gradients add up in the arena", plan.micro_batches,
                        plan.micro_batches)
        if plan.tile_tokens or budget is not None:
            log.info("long sequences: %s, %s", f"{plan.tile_tokens}-token tiles" if plan.tile_tokens else "untiled",
                     "every layer checkpoint on the device" if budget is None else
                     f"{budget / 2**30:.2f} GiB of layer checkpoints on the device, "
                     f"{plan.host_checkpoints / 2**30:.2f} GiB in host memory")
        if len(nodes) > 1:
            log.info("%d nodes (%s), each with its parameter store, %d optimizer worker(s) and %d executor(s)",
                     len(nodes), ", ".join(n[:8] for n in nodes), n, executors)
        # what the parameter stores are made from (again, by a recovery that replaces every actor)
        self._store_args = (model_arg, n, seed, plan.batch, seq, self.run_id, self.grads, plan.shadow_bytes > 0,
                            on_gpu, plan.tile_tokens, plan.checkpoint_budget, plan.micro_batches)
        self._start_actors()
        self.device = get(self.executor.device.remote())

    def _start_actors(self) -> None:
        """The parameter store, optimizer workers and executors of every node, in the placements reserved."""
        nodes = len(self.placements)
        self.stores = [ParameterStoreActor.options(name=self._name("parameter-store" if nodes == 1 else
                                                                   f"parameter-store/{m}"), **p.pinned()
                                                   ).remote(*self._store_args, node=m, nodes=nodes)
                       for m, p in enumerate(self.placements)]
        self.handles = get([s.handle.remote() for s in self.stores])
        if nodes > 1:  # the stores' own group, to keep the nodes' weights equal (megatrain/memory/nodes.py)
            address = f"tcp://{get(self.store.node_ip.remote())}:{free_port()}"
            get([s.join_nodes.remote(address) for s in self.stores])
        self._arena = Arena.open(self.handle)  # the driver reads the version table and, on request, weights
        self.versions = self._arena.versions.view(-1, self.placement.workers + (nodes > 1))
        self.workers = [self._new_worker(w) for w in range(nodes * self.placement.workers)]
        self.executors = self._new_executors()
        get([w.numel.remote() for w in self.workers])  # all up before the first step

    @property
    def store(self) -> Any:
        """The parameter store of the driver's node (the only one, unless `nodes` > 1)."""
        return self.stores[0] if self.stores else None

    @property
    def placement(self) -> NodePlacement | None:
        return self.placements[0] if self.placements else None

    @property
    def handle(self) -> ArenaHandle:
        return self.handles[0]

    @property
    def grads(self) -> str:
        """Where gradients wait for the optimizer: "arena", "stream" or "device" (see GRAD_PLACEMENTS)."""
        return self.engine_config.grads

    @property
    def _updates_after_step(self) -> bool:
        """The driver starts a step's update once the step is done (it needs the global norm, or the gradients
        wait on the GPU); otherwise the executor handed each unit to the workers as its gradients landed."""
        return self.optim.clipping or self.grads == "device" or len(self.executors) > 1

    def _on_gpu(self, node: str) -> bool:
        """Whether the run computes on a GPU of its node (Ray's view: a GPU Ray does not know of is not used)."""
        device = self.engine_config.device
        has_gpu = node_resources(node)[0].get("GPU", 0) >= 1
        if device.startswith("cuda") and not has_gpu:
            raise ConfigError(f"device {device!r} was asked for but the driver's Ray node has no GPU; use "
                              "device='cpu' or 'auto', or start Ray (and the driver) on a machine with one.")
        if device.startswith("cuda:") and has_gpu:
            log.info("device %s: the executor computes on the GPU Ray grants it (choose which with "
                     "CUDA_VISIBLE_DEVICES when starting Ray)", device)
        return (device == "auto" or device.startswith("cuda")) and has_gpu

    @property
    def scheduling_strategy(self) -> Any:
        """Where this run's actors are: give it to an actor of your own that feeds the run and reserves no CPU
        (a data loader: `DataLoaderActor.options(scheduling_strategy=engine.scheduling_strategy)`)."""
        self._check_running()
        return self.placement.scheduling_strategy

    def _plan(self, batch: int, seq: int, on_gpu: bool) -> MemoryPlan:
        """This run's memory plan: where gradients wait, whether a bf16 copy of the weights fits, the tiles and the
        device budget of layer checkpoints. On a GPU its free memory is measured first, in a throwaway process."""
        e = self.engine_config
        budget = e.checkpoint_budget_gib
        settings = dict(grads=e.grads, clipping=self.optim.clipping, name=self.model_name, precision=e.precision,
                        optimizer_workers=e.optimizer_workers, on_gpu=on_gpu, loss_chunk_tokens=e.loss_chunk_tokens,
                        tile_tokens=e.tile_tokens, schedule=e.schedule, nodes=len(self.placements),
                        executors=e.executors,
                        checkpoint_budget=budget if budget in ("auto", None) else round(budget * 2**30),
                        gpu_free=get(gpu_free_memory.options(**self.placement.executor()).remote())
                        if on_gpu else None)
        if e.micro_batches == "auto":  # batch: the step's rows
            plan = pick_micro_batches(self.config, batch, seq, **settings)
        else:
            plan = plan_run(self.config, batch, seq, micro_batches=e.micro_batches, **settings)
        log.info("gradients wait %s", {"arena": "in the host arena", "stream": "in a ring of host slots",
                                        "device": f"on the {'GPU' if on_gpu else 'executor'} until the step ends"
                                        }[plan.grads])
        if on_gpu and e.precision == "bf16" and not plan.shadow_bytes:
            log.warning("no room on the host for a bf16 copy of the weights (%.1f GiB): fp32 weights cross PCIe "
                        "and are cast on the GPU, twice the bytes", plan.arena_numel * 2 / 2**30)
        return plan

    def _new_worker(self, index: int) -> Any:
        """Optimizer worker `index` of the run: worker index % n of node index // n."""
        node, worker = divmod(index, self.placement.workers)
        p = self.placements[node]
        name = f"optimizer/{index}" if len(self.placements) == 1 else f"optimizer/{node}.{worker}"
        return OptimizerWorker.options(name=self._name(name), **p.worker(worker)).remote(
            self.handles[node], self.config, self.optim, worker, p.workers, p.worker_threads, self.grads, self.metrics,
            node, len(self.placements))

    def _new_executors(self) -> list[Any]:
        """The run's executors, joined into one process group when there are several (a new one each time: a
        replacement never joins a group whose member died)."""
        engine = replace(self.engine_config, device=executor_device(self.engine_config.device, self.on_gpu))
        per_node, nodes = engine.executors, len(self.placements)
        assert isinstance(per_node, int)
        world = per_node * nodes  # rank r: executor r % per_node of node r // per_node
        # rank 0, which hosts the rendezvous, runs on the driver's node: its loopback unless other hosts must reach it
        host = "127.0.0.1" if nodes == 1 else ray.util.get_node_ip_address()
        rendezvous = f"tcp://{host}:{free_port()}" if world > 1 else None
        executors = []
        for rank in range(world):
            node, local = divmod(rank, per_node)
            name = "executor" if world == 1 else f"executor/{rank}"
            workers = self.workers[node * self.placement.workers : (node + 1) * self.placement.workers]
            executors.append(GPUExecutor.options(name=self._name(name), **self.placements[node].executor(local)).remote(
                self.handles[node], self.config, engine, workers, self.optim.clipping, self.trace, rank, world,
                rendezvous))
        return executors

    @property
    def executor(self) -> Any:
        """The first executor (the only one, unless `executors` > 1)."""
        return self.executors[0] if self.executors else None

    def _name(self, role: str) -> str:
        """Readable in the dashboard and `ray timeline`; the restart count keeps a replacement's name free."""
        return f"megatrain/{self.run_id}/{role}#{self.restarts}"

    def executor_pid(self) -> int:
        return ray.get(self.executor.pid.remote())

    def worker_pids(self) -> list[int]:
        return ray.get([w.pid.remote() for w in self.workers])

    # ---- training ----
    def step(self, input_ids: Any, labels: Any = None, position_ids: Any = None) -> float:
        """One optimizer step on this batch (tensors or numpy [batch, seq]); returns the loss. position_ids: each
        packed document's positions from 0 (a document attends within itself only), as transformers takes them."""
        batch = {"input_ids": token_ids(input_ids)}
        for key, value in (("labels", labels), ("position_ids", position_ids)):
            if value is not None:
                batch[key] = token_ids(value)
        return self.step_batch(batch).loss

    def step_batch(self, batch: Any) -> StepResult:
        """One step on a batch dict or an ObjectRef to one (e.g. straight from the data-loader actor)."""
        self._check_running()
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        if len(self._replay) >= self.max_replay_steps:
            if self._replay_complete:
                log.warning("%d steps without a checkpoint: the batches kept to replay them after a fault are "
                            "dropped; save checkpoints more often to keep faults recoverable", len(self._replay))
            self._replay, self._replay_complete = [], False
        self._replay.append(ref)
        steps_before = self.steps_done
        while True:
            try:
                result = self._step_once(ref)
                self._faults_in_row = 0
                return result
            except Exception as e:
                if isinstance(e, ray.exceptions.RayError) and (is_actor_death(e) or is_cuda_error(e)):
                    self._recover(e)
                    continue
                if self.steps_done == steps_before:  # refused (e.g. a bad token id): nothing to replay after a fault
                    self._replay.pop()
                raise

    def _step_once(self, batch: ray.ObjectRef) -> StepResult:
        step = self.steps_done
        t0 = time.monotonic()
        out = _merged(get([e.train_step.remote(batch, self.updates_applied, self.updates_applied, self._pending)
                           for e in self.executors]))
        update_spans = [span for spans in get(self._pending) for span in spans]  # done: the step waited on them
        grad_norm = math.sqrt(sum(out["unit_norms_sq"])) if out["unit_norms_sq"] else float("nan")
        finite = math.isfinite(out["loss"]) and math.isfinite(grad_norm) and not out["skipped_units"]
        lr = self.optim.lr_at(self.updates_applied)
        if self._updates_after_step:
            self._pending = []
            if finite:
                coef = clip_coefficient(grad_norm, self.optim.max_grad_norm)
                if self.grads == "device":
                    self._pending = [self.executor.send_grads.remote(self.updates_applied, coef)]
                else:
                    self._pending = [w.apply.remote(self.updates_applied, coef) for w in self.workers]
                    if len(self.stores) > 1:  # each node updated its part: the nodes exchange them
                        self._pending += [s.sync_weights.remote(self.updates_applied) for s in self.stores]
        else:
            self._pending = out["updates"]
        # clipping off: units updated before a non-finite one was found keep their update (see README)
        if finite or (not self.optim.clipping and out["updates"]):
            self.updates_applied += 1
        self.steps_done += 1
        self._record(out, time.monotonic() - t0, finite)
        self._count_nonfinite(finite, out["loss"], grad_norm)
        return StepResult(step, out["loss"], out["tokens"], grad_norm, lr, not finite, out["stats"],
                          out["spans"] + (update_spans if self.trace else []))

    def _record(self, out: dict[str, Any], seconds: float, finite: bool) -> None:
        """The step's metrics (the optimizer workers record their own, from their processes)."""
        if self.metrics is None:
            return
        if not finite:
            self.metrics.record_skipped_step()
        if out["stats"]:
            tokens_per_s = out["tokens"] / seconds if seconds > 0 else 0.0
            tflops = tokens_per_s * self.config.flops_per_token(out["seq"]) / 1e12  # attention's included
            self.metrics.record_step(StepStats.from_dict(out["stats"]), out["loss"], tokens_per_s, tflops)

    def evaluate(self, batch: Any) -> tuple[float, int]:
        """(mean loss, tokens) of a batch dict or ObjectRef with the current weights; trains nothing."""
        self._check_running()
        out = get(self.executor.evaluate.remote(batch, self.updates_applied, self._pending))
        return out["loss"], out["tokens"]

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

    # ---- recovery ----
    def _recover(self, error: BaseException) -> None:
        while True:
            self.restarts += 1
            self._faults_in_row += 1
            if self._faults_in_row > self.max_restarts:
                raise MegatrainError(f"actors died {self.max_restarts} times without a step completing in between "
                                     f"(last: {str(error).splitlines()[0]}); giving up, "
                                     "check the Ray logs (/tmp/ray/session_latest/logs) for the cause.") from None
            try:
                self._recover_once(error)
                return
            except ray.exceptions.RayError as e:
                if not is_actor_death(e):
                    raise
                error = e

    def _recover_once(self, error: BaseException) -> None:
        self._check_stores()
        dead_workers = [i for i, w in enumerate(self.workers) if not _alive(w)]
        if not dead_workers and all(_alive(e) for e in self.executors) and not is_cuda_error(error):
            raise error  # nothing of the engine died: the fault is upstream (e.g. the batch's producer)
        if dead_workers and len(self.stores) > 1:
            # the dead worker's node cannot finish its part of the update, and the other nodes' stores may be waiting
            # for it inside the weight exchange: every actor is replaced (new arenas), then restored and replayed
            self._stop_actors(close=False)
            self._pending = []
            self._start_actors()
            self._restore_and_replay("an optimizer worker")
            return
        for i in dead_workers:
            self.workers[i] = self._new_worker(i)
        for executor in self.executors:  # dead already, holding handles of dead workers, or in a broken group
            ray.kill(executor)
        if self._updates_after_step and not dead_workers:
            try:
                # the previous step's updates, issued by the driver, run to completion (with grads = "device"
                # only if they were all issued before the executor died: its gradients died with it)
                ray.get(self._pending)
            except ray.exceptions.RayError as e:
                if not is_actor_death(e):
                    raise
                dead_workers = [-1]
        self._pending = []
        versions = self._settled_versions()
        consistent = not dead_workers and versions == (self.updates_applied, self.updates_applied)
        self.executors = self._new_executors()
        ray.get([e.device.remote() for e in self.executors] + [w.numel.remote() for w in self.workers])
        if consistent:
            log.warning("the GPU executor died; a new one mapped the same arena and redoes step %d", self.steps_done)
            return
        self._restore_and_replay("an optimizer worker" if dead_workers else "the GPU executor")

    def _restore_and_replay(self, who: str) -> None:
        """The arenas back to the last checkpoint (or the initial weights), and the steps since run again."""
        if not self._replay_complete:
            raise MegatrainError(f"an actor died during an update and the steps since the last checkpoint "
                                 f"(more than max_replay_steps={self.max_replay_steps}) cannot be replayed; resume "
                                 "from the last checkpoint, and save checkpoints more often.")
        replay = self._replay[:-1]
        source = self._last_checkpoint or "the initial weights"
        log.warning("%s died during an update; restoring %s and replaying %d step(s)", who, source, len(replay))
        self._restore_last_checkpoint()
        self.replayed_steps += len(replay)
        for ref in replay:
            self._step_once(ref)

    def _settled_versions(self, quiet: float = 0.3, timeout: float = 30.0) -> tuple[int, int]:
        """(min, max) of the version table once updates already queued at the workers have finished."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = self._version_range()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
            time.sleep(0.02)
        return last  # type: ignore[return-value]

    def _version_range(self) -> tuple[int, int]:
        """(min, max) of every node's version table."""
        if len(self.stores) == 1:
            return int(self.versions.min()), int(self.versions.max())
        ranges = get([s.version_range.remote() for s in self.stores])
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)

    def _check_stores(self) -> None:
        """A dead parameter store took its arena with it: the run stops, saying which node and how to go on."""
        for m, store in enumerate(self.stores):
            if _alive(store):
                continue
            if len(self.stores) == 1:
                raise MegatrainError("the parameter store died, and the arena with it; restart the run with --resume "
                                     "to continue from the last checkpoint.")
            node = self.placements[m].node_id
            ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), "address unknown")
            raise MegatrainError(f"node {m} of the run ({ip}, Ray node {node[:8]}) was lost: its parameter store "
                                 f"died with its arena; restart the run with --resume to continue from the last "
                                 f"checkpoint, on {len(self.stores)} nodes once it is back or on fewer (--nodes "
                                 f"{len(self.stores) - 1}: checkpoints reshard).")

    def _restore_last_checkpoint(self) -> None:
        if self._last_checkpoint is not None:
            state = get([s.load_checkpoint.remote(str(self._last_checkpoint)) for s in self.stores])[0]
            self._set_state(state)
        else:
            get([s.reinitialize.remote() for s in self.stores])
            self._set_state({"steps_done": 0, "updates_applied": 0, "skipped_steps": 0})
        self.nonfinite_in_row = 0

    # ---- state ----
    def state(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "updates_applied": self.updates_applied,
                "skipped_steps": self.skipped_steps, "optim": {**self.optim.__dict__, "betas": list(self.optim.betas)}}

    def _set_state(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.updates_applied = int(state["updates_applied"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def _check_running(self) -> None:
        if self.store is None:
            raise MegatrainError("this Engine was shut down; create a new one (or load a checkpoint into one).")

    def wait_for_updates(self) -> None:
        """Blocks until the last step's update is in the arena (before reading or saving weights)."""
        self._check_running()
        while True:
            try:
                ray.get(self._pending)
                self._pending = []
                return
            except ray.exceptions.RayError as e:
                if not is_actor_death(e):
                    raise
                self._replay.append(None)  # nothing to redo after the replay  # type: ignore[arg-type]
                self._recover(e)
                self._replay.pop()

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """One checkpoint of the whole run, written atomically: every node's store writes its files (the first
        node's: also the weights and the trainer state) into one directory, and the manifest comes last. With
        several hosts the directory must be on a file system they share."""
        self.wait_for_updates()
        state = {**self.state(), **(extra_state or {})}
        path = Path(save_target(directory))
        with atomic_directory(checkpoint_target(path)) as tmp:
            get([s.write_checkpoint_part.remote(str(tmp), state if m == 0 else None)
                 for m, s in enumerate(self.stores)])
            write_manifest(tmp)
        self._last_checkpoint, self._replay, self._replay_complete = path, [], True
        return path

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Loads a checkpoint of a run on any number of nodes (each node takes its part of the Adam moments)."""
        self.wait_for_updates()
        directory = absolute(directory)
        state = get([s.load_checkpoint.remote(directory) for s in self.stores])[0]
        self._set_state(state)
        self._last_checkpoint, self._replay, self._replay_complete = Path(directory), [], True
        return state

    def save_pretrained(self, directory: str | Path, extra_files: list[str | Path] | None = None) -> Path:
        self.wait_for_updates()
        extra = [absolute(f) for f in extra_files or []]
        return Path(get(self.store.save_pretrained.remote(save_target(directory), extra)))

    def parameters(self) -> dict[str, torch.Tensor]:
        """HF name -> copy of the current fp32 weights."""
        from megatrain.model.layout import ModelLayout

        self.wait_for_updates()
        return {k: v.clone() for k, v in ModelLayout.build(self.config).hf_views(self._arena.params).items()}

    def shutdown(self) -> None:
        """Stops the actors; the stores unlink the arenas first. What a store killed on the way left in /dev/shm
        is removed here, on every node of the run."""
        self._stop_actors()
        try:  # the other nodes' /dev/shm (a store that died there, or one a recovery replaced)
            ray.get([remove_dead_segments.options(**p.pinned()).remote() for p in self.placements[1:]], timeout=30)
        except Exception as e:  # noqa: BLE001 - a lost node: its next run there removes them
            log.warning("could not remove dead arena segments on every node (%s)", e)
        for placement in self.placements:
            placement.release()
        self.placements = []
        remove_stale_segments()

    def _stop_actors(self, close: bool = True) -> None:
        """The stores unlink their arenas (close=False: only that, in a recovery, where a store may be stuck in the
        weight exchange waiting for a dead peer); then every actor is killed."""
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        try:
            ray.get([s.close.remote() if close else s.unlink.remote() for s in self.stores], timeout=60)
        except Exception as e:  # a store died: its node's next start removes its segments (this node's: below)
            log.warning("a parameter store did not close cleanly (%s)", e)
        for actor in [*self.executors, *self.workers, *self.stores]:
            ray.kill(actor)
        # the arenas' handles stay: they name the segment files, which a caller may check are gone
        self.stores, self.executors, self.workers = [], [], []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _merged(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's result from its executors' (data parallel): losses, tokens and each unit's squared norm (of
    each one's slice of the summed gradient) added up; the first's stall accounting."""
    if len(outs) == 1:
        return outs[0]
    merged = dict(outs[0])
    for key in ("loss", "tokens"):
        merged[key] = sum(out[key] for out in outs)
    norms = [out["unit_norms_sq"] for out in outs]
    merged["unit_norms_sq"] = [sum(unit) for unit in zip(*norms, strict=True)] if all(norms) else []
    merged["skipped_units"] = sorted({u for out in outs for u in out["skipped_units"]})
    merged["spans"] = [span for out in outs for span in out["spans"]]
    return merged


@ray.remote(num_cpus=0)
def remove_dead_segments() -> int:
    """remove_stale_segments on the node this runs on (its MEGATRAIN_SHM_DIR): the arena files of dead owners."""
    return len(remove_stale_segments())


def _alive(actor: Any, timeout: float = 60.0) -> bool:
    """Whether `actor` answers within `timeout`: one that does not (stuck in a collective with a dead peer) is as
    good as dead to a recovery, which replaces it."""
    try:
        ray.get(actor.pid.remote(), timeout=timeout)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
