"""RunPlan: every setting of one run, resolved (nothing "auto"), made once on the driver by pipelines/run_plan.py:
resolve(request, machine) from what the user asked (Request) and what the machine offers (Machine). `megatrain plan
--json` prints it and a run writes it to OUT/plan.json: the same object for the same flags."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megatrain.config import EngineConfig, ModelConfig, OptimConfig
from megatrain.lora.config import LoraConfig
from megatrain.memory.nvme import TierSpec
from megatrain.memory.plan import MemoryPlan, plan_memory
from megatrain.memory.post_plan import reference_dtype
from megatrain.memory.tier_plan import with_tier
from megatrain.perf.calibrate import Calibration

PLAN_FILE = "plan.json"

# how a step's update runs (RunPlan.update): each unit's update final as its gradient lands; after the step, its
# norm known ("serial"); beside the backward and settled after it, on every step ("speculative") or on steps after
# one that did not clip ("unless-clipped": speculate "auto")
UPDATES = ("final", "serial", "speculative", "unless-clipped")


@dataclass
class Request:
    """What the user asked: the model, the engine and optimizer settings (any of them "auto"), the step's shape."""

    config: ModelConfig
    name: str
    engine: EngineConfig
    optim: OptimConfig
    batch: int  # rows of a micro-batch (micro_batches "auto": the step's rows, each executor's)
    seq: int
    lora: Any = None  # a LoraConfig, its command-line form or table, or None
    adapter: str | None = None  # a PEFT adapter directory to start from
    clip_rate: float = 0.0  # share of steps assumed to clip, for the predicted step the GPU's memory is split by


@dataclass
class Machine:
    """What the run's node offers: Ray's view of it for a run, this machine's (or the flags') for `megatrain plan`."""

    has_gpu: bool  # a GPU the run can compute on
    gpus: int = 0  # GPUs on the node (executors "auto": one each)
    free_cpus: float = 1.0  # CPUs free for the optimizer workers
    nodes: int = 1  # nodes the run spans (found by the driver)
    gpu_free: int | None = None  # free bytes of the executor's GPU (None: not known)
    host_free: int | None = None  # host bytes to plan for (None: what this machine has available)
    calibration: Calibration | None = None  # the cached calibration of the device the run computes on
    gpu_name: str = "the GPU"
    link_gbps: float | None = None  # between nodes (None: megatrain.config.LINK_GBPS)
    nvme_gbps: tuple[float, float] | None = None  # the NVMe tier's disk (read, write; None: its cached calibration)


@dataclass(frozen=True)
class StorePlan:
    """The parameter store's part of a run's plan: what its arena holds (megatrain/store.py)."""

    optimizer_workers: int = 1  # per node: the version table's columns
    grads: str = "arena"  # the arena's gradient segment: every unit's ("arena") or a ring of slots
    bf16_copy: bool = False  # a bf16 copy of the weights
    nodes: int = 1  # each node's store holds the whole weights and 1/nodes of the Adam moments
    seed: int = 0
    lora: LoraConfig | None = None  # the adapters trained beside a frozen base stored in lora_base_dtype
    lora_base_dtype: str = "bf16"
    tier: TierSpec | None = None  # the states on NVMe
    reference: str | None = None  # the initial weights' segment, in this dtype (megatrain/memory/post_plan.py)

    @classmethod
    def standalone(cls, config: ModelConfig, name: str, check_memory: bool, settings: dict[str, Any]) -> StorePlan:
        """The plan of a store made without a run's (a test's, megatrain.api's): from ParameterStore's keywords,
        the host memory checked first where check_memory (a config may claim an absurd size)."""
        unknown = set(settings) - set(STANDALONE)
        if unknown:
            raise TypeError(f"ParameterStore got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        s = {**STANDALONE, **settings}
        if check_memory:
            plan = plan_memory(config, s["batch"], s["seq"], name=name, optimizer_workers=s["num_workers"],
                               grads=s["grads"], bf16_copy=s["bf16_copy"], on_gpu=s["on_gpu"], nodes=s["nodes"],
                               tile_tokens=s["tile_tokens"], checkpoint_budget=s["checkpoint_budget"],
                               micro_batches=s["micro_batches"], lora=s["lora"], lora_base_dtype=s["lora_base_dtype"])
            tier = s["tier"]
            with_tier(plan, config, tier and tier.root, tier.names if tier else ()).check_host()
        return cls(s["num_workers"], s["grads"], s["bf16_copy"], s["nodes"], s["seed"], s["lora"], s["lora_base_dtype"],
                   s["tier"], s["reference"])


@dataclass(frozen=True)
class WorkerPlan:
    """The optimizer workers' part of a run's plan (actors/optimizer_worker.py): worker `rank` of the run updates its
    share, worker rank % workers of node rank // workers, of that node's part of each unit (NodeShard)."""

    optim: OptimConfig
    workers: int = 1  # per node
    threads: int = 1  # each worker's torch threads (its CPUs of the node's reservation)
    grads: str = "arena"  # where the gradients wait (RunPlan.grads), which decides where they are read
    nodes: int = 1


# ParameterStore's keywords without a run's plan, and their defaults
STANDALONE: dict[str, Any] = dict(num_workers=1, seed=0, batch=1, seq=2048, grads="arena", bf16_copy=False,
                                  on_gpu=False, tile_tokens=None, checkpoint_budget=None, micro_batches=1, nodes=1,
                                  lora=None, lora_base_dtype="bf16", tier=None, reference=None)


@dataclass(frozen=True)
class RunPlan:
    """One run's settings, every one concrete. Sizes are one node's (the batch: one executor's)."""

    model: str
    device: str  # the executor's device: "cuda", "cpu" or "cpu-async[:SEED]"
    on_gpu: bool
    precision: str
    nodes: int
    executors: int  # per node
    optimizer_workers: int  # per node
    grads: str  # where gradients wait: "arena", "stream" or "device"
    micro_batches: int
    batch: int  # rows of a micro-batch
    seq: int
    schedule: str  # "layer-major" or "per-micro-batch"
    tile_tokens: int | None  # None: untiled
    checkpoint_budget: int | None  # device bytes of activation checkpoints (None: every one on the device)
    resident_units: int
    resident_weights: str  # "copy" or "cast"
    kept_layers: int  # the top layers that keep their activations
    bf16_copy: bool  # a bf16 copy of the weights in the arena
    compile: bool
    compile_why: str
    update: str  # UPDATES
    clipping: bool
    loss_chunk_tokens: int
    seed: int
    lora: LoraConfig | None
    lora_base_dtype: str
    threads_per_worker: int | None = None  # None: the node's cores over its workers
    tier: TierSpec | None = None  # the states on NVMe (megatrain/memory/nvme.py); None: all in host memory
    reference: bool = False  # the initial weights in a segment of their own (GRPO's KL reference; not a LoRA run's)
    arena_bytes: int = 0
    host_bytes: int = 0
    gpu_bytes: int = 0
    gpu_memory: int | None = None  # the executor's GPU held to this many bytes (gpu_memory_gib); None: all of it
    notes: tuple[str, ...] = field(default=(), compare=False)  # what the plan decided and why, for the log
    warnings: tuple[str, ...] = field(default=(), compare=False)
    memory: MemoryPlan | None = field(default=None, compare=False, repr=False)  # its bytes, tier by tier

    @property
    def world(self) -> int:
        """Executors of the whole run."""
        return self.executors * self.nodes

    @property
    def updates_after_step(self) -> bool:
        """The driver starts (or settles) a step's update once the step is done (it needs the global norm, or the
        gradients wait on the device, or several executors' slices); else each unit's update is final in the
        backward."""
        return self.update != "final"

    @property
    def speculate(self) -> str:
        """The EngineConfig word of `update`: "on", "off" or "auto"."""
        return {"speculative": "on", "unless-clipped": "auto"}.get(self.update, "off")

    @property
    def store(self) -> StorePlan:
        """The parameter stores' part."""
        return StorePlan(self.optimizer_workers, self.grads, self.bf16_copy, self.nodes, self.seed, self.lora,
                         self.lora_base_dtype, self.tier, reference_dtype(self.precision) if self.reference else None)

    def worker_plan(self, optim: OptimConfig, threads: int) -> WorkerPlan:
        """The optimizer workers' part, with their optimizer settings and each one's threads (its reservation's)."""
        return WorkerPlan(optim, self.optimizer_workers, threads, self.grads, self.nodes)

    def engine_config(self) -> EngineConfig:
        """The plan as an EngineConfig, every field resolved (for code and tests that read one)."""
        budget = self.checkpoint_budget
        return EngineConfig(device=self.device, precision=self.precision, optimizer_workers=self.optimizer_workers,
                            threads_per_worker=self.threads_per_worker, loss_chunk_tokens=self.loss_chunk_tokens,
                            seed=self.seed, grads=self.grads, compile="on" if self.compile else "off",
                            tile_tokens=self.tile_tokens,
                            checkpoint_budget_gib=None if budget is None else budget / 2**30,
                            micro_batches=self.micro_batches, schedule=self.schedule, executors=self.executors,
                            nodes=self.nodes, speculate=self.speculate, resident=self.resident_units,
                            resident_weights=self.resident_weights, keep_activations=self.kept_layers,
                            bf16_copy="keep" if self.bf16_copy else "none",
                            lora=self.lora, lora_base_dtype=self.lora_base_dtype,
                            nvme=None if self.tier is None else self.tier.root, reference=self.reference)

    def to_dict(self) -> dict[str, Any]:
        """JSON's form (what plan.json holds); the notes are left to the log."""
        out = asdict(replace(self, notes=(), warnings=(), memory=None))
        del out["notes"], out["warnings"], out["memory"]
        if self.lora is not None:
            out["lora"] = {**out["lora"], "target_modules": list(self.lora.target_modules)}
        return out
