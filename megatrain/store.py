"""The parameter store: owns the arena's lifetime, the layout, weight init, and checkpoints (their files:
megatrain/io/checkpoint.py).

Plain class; `actors/parameter_store.py` is its Ray shell. Checkpoints are HF-named safetensors (so
`model.safetensors` of a training checkpoint is also a loadable HF model) plus the Adam moments, the
trainer's state as JSON, and a manifest written last. A LoRA run's arena holds the frozen base in a segment of its own
and the adapters as what trains (megatrain/lora/layout.py); its checkpoints and exports hold the adapter in PEFT's
format (adapter_config.json, adapter_model.safetensors) where a full run's hold the model's weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from megatrain.config import PRESETS, ConfigError, ModelConfig, is_hub_name
from megatrain.distributed.node_exchange import MasterParts, NodeGroup
from megatrain.io import checkpoint as ckpt
from megatrain.io.hub import hub_model
from megatrain.io.slot_io import IN_PLACE, SlotIO
from megatrain.lora.arena_io import arena_adapters, initial_adapters, merged_tensors, write_adapters
from megatrain.lora.config import BASE_DTYPES
from megatrain.lora.layout import training_layout
from megatrain.lora.peft_format import is_adapter_file, load_adapter, write_adapter
from megatrain.memory.arena import BF16_COPY_SEGMENT, FP32_SEGMENTS, REFERENCE_SEGMENT, Arena, ArenaHandle
from megatrain.memory.buffers import ARENA, Buffer, arena_segments
from megatrain.memory.staging import StoreTier, stage_segments
from megatrain.memory.versions import VersionTable
from megatrain.model.layout import GradLayout, ModelLayout, NodeShard, Unit
from megatrain.run_plan import StorePlan
from megatrain.self_check import verify as self_check

log = logging.getLogger(__name__)


def resolve_model(model: str | Path | ModelConfig, verify: bool = True) -> tuple[ModelConfig, Path | None, str]:
    """(config, HF directory or None, display name) for a preset name, an HF directory, a Hugging Face Hub name
    (`org/name[@revision]`: its snapshot in the hub's cache, config.json alone where not verify), or a config.
    verify: an HF directory's weight files are there and readable, and a model of the generic path passes
    megatrain's self-check (megatrain/self_check.py: refused in one sentence where megatrain's path differs from
    transformers'), before Ray or anything else starts; a plan, which runs nothing, skips both."""
    config, directory, name = _resolved(model, config_only=not verify)
    if verify:
        if directory is not None:
            ckpt.check_readable(ckpt.weight_files(directory, "model"))
        self_check(config)
    return config, directory, name


def _resolved(model: str | Path | ModelConfig, config_only: bool) -> tuple[ModelConfig, Path | None, str]:
    if isinstance(model, ModelConfig):
        return model, None, "model"
    path = Path(model)
    if path.is_dir():
        return ckpt.read_hf_config(path), path, path.name
    if str(model).lower() not in PRESETS and is_hub_name(str(model)):
        directory = hub_model(str(model), config_only)
        return ckpt.read_hf_config(directory), directory, str(model)
    # a preset name is no path even where it looks like one: "2.8b" has the suffix ".8b"
    if str(model).lower() not in PRESETS and (path.suffix or "/" in str(model) or path.exists()):
        raise ConfigError(f"model {str(model)!r} is neither an HF model directory nor a preset name; "
                          "pass a directory holding config.json and safetensors weights, a Hugging Face Hub name "
                          "like 'Qwen/Qwen2.5-7B', or a preset like 'tiny'.")
    return ModelConfig.from_name(str(model)), None, str(model)


def for_each_unit(layout: ModelLayout, work: Callable[[Unit], None]) -> None:
    """Runs `work` on every unit, units spread over a thread per core: torch's fills and copies release the
    GIL, and in a Ray actor (OMP_NUM_THREADS from num_cpus) each of them alone would use one core, so a 9 G
    parameter init would take over half a minute instead of seconds."""
    threads = min(len(layout.units), os.cpu_count() or 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="per-unit") as pool:
        list(pool.map(work, layout.units))  # list(): re-raises a unit's failure here


def init_weights(layout: ModelLayout, params: torch.Tensor, seed: int, io: SlotIO = IN_PLACE) -> None:
    """HF Llama init: matrices ~ N(0, initializer_range), norms 1 (the family's norm_init), biases 0; one generator
    per unit so each unit's values do not depend on the others (nor on the order the threads take them in). io: where
    a unit's weights are written (the NVMe tier's: through a buffer of one unit per thread)."""
    std = layout.config.initializer_range
    norm = getattr(layout.config.family, "norm_init", 1.0)  # Gemma's (1 + w) norms start at 0

    def init_unit(flat: torch.Tensor, unit: Unit) -> None:
        gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
        for name, t in unit.bind(flat).items():
            if name.endswith("norm.weight"):
                t.fill_(norm)
            elif name.endswith(".bias"):
                t.zero_()
            else:
                t.normal_(0.0, std, generator=gen)

    for_each_unit(layout, lambda unit: io.fill(unit.range_of(params), lambda flat: init_unit(flat, unit)))


class ParameterStore:
    def __init__(self, model: str | Path | ModelConfig, plan: StorePlan | None = None, *, node: int = 0,
                 run_id: str | None = None, adapter: str | Path | None = None, verify: bool = True,
                 check_memory: bool = True, **settings: Any):
        """The store of node `node` of a run whose plan is `plan` (its store part: RunPlan.store): what the arena holds
        is the plan's, which the driver checked. Without one (a test's store, megatrain.api's), its settings are the
        keywords StorePlan.standalone takes (num_workers, seed, grads, bf16_copy, nodes, lora, lora_base_dtype, tier,
        and batch, seq, on_gpu, tile_tokens, checkpoint_budget, micro_batches for the host memory's check).
        adapter: the PEFT adapter directory a LoRA run starts from. verify: resolve_model's checks first (weight files
        readable, the self-check); False where a driver made them. The arena: megatrain/memory/arena.py; the NVMe
        tier's states staged through it: megatrain/memory/staging.py."""
        self.config, self.source_dir, self.name = resolve_model(model, verify)
        if plan is None:  # before the layout: its size is the config's claim, which may be absurd
            plan = StorePlan.standalone(self.config, self.name, check_memory, settings)
        elif settings:
            raise TypeError(f"ParameterStore takes a plan or its settings, not both ({', '.join(sorted(settings))})")
        self.plan, self.num_workers = plan, plan.optimizer_workers
        self.layout = training_layout(self.config, plan.lora)  # a LoRA run's: the adapters, its `frozen` the base
        self.grad_layout = GradLayout.build(self.layout, plan.grads)
        self.node = NodeShard.build(self.layout, node, plan.nodes)
        self.arena = self._allocate(run_id)
        self.versions = self.arena.versions.view(len(self.layout.units), -1)
        self.seed, self.adapter = plan.seed, adapter
        self.node_group: NodeGroup | None = None
        self.master_parts: MasterParts | None = None  # several nodes, the masters on NVMe: their exchange's buffers
        self.passthrough: dict[str, torch.Tensor] = {}  # pass-through tensors (a vision tower), as stored
        self.tier: StoreTier | None = None
        try:
            if plan.tier is not None:
                self.tier = StoreTier(plan.tier, self.arena, self._tier_starts(plan.tier.from_unit))
            self._init_params()
        except BaseException:
            # the half-built store is unreachable but the traceback keeps it (and its arena) alive: unlink now
            self.close()
            raise

    def _allocate(self, run_id: str | None) -> Arena:
        """The arena of the plan: versions (per unit and worker, the updates applied; several nodes: and a last
        column, the update whose weights every node has, see NodeGroup.sync_weights), issued (per unit, the updates
        handed out: what is issued and not applied is a worker's queue), the resident flags (1 where the executor
        keeps a unit on its device and updates it there: megatrain/engine/resident.py), the bf16 copy, the frozen
        base, GRPO's KL reference (the initial weights): the rows of megatrain/memory/buffers.py's arena_segments,
        which the memory plan sums too."""
        plan, frozen = self.plan, self.layout.frozen
        staging = ()  # each optimizer worker's slots the NVMe tier's states are staged in
        if plan.tier is not None:
            staging = tuple(Buffer(name, ARENA, numel, dtype) for name, dtype, numel in
                            stage_segments(self.layout, plan.tier.kinds, plan.tier.from_unit, plan.optimizer_workers))
        segments = arena_segments(self.layout.numel, self.grad_layout.numel, self.node.numel,
                                  units=len(self.layout.units), columns=plan.optimizer_workers + (plan.nodes > 1),
                                  bf16_copy=plan.bf16_copy, frozen_numel=0 if frozen is None else frozen.numel,
                                  frozen_dtype=BASE_DTYPES[plan.lora_base_dtype], staging=staging,
                                  reference=plan.reference if frozen is None else None)
        return Arena.create(self.layout.numel, run_id=run_id, grads_numel=self.grad_layout.numel,
                            moments_numel=self.node.numel, sparse=plan.tier.kinds if plan.tier is not None else (),
                            extra_segments=tuple((b.name, b.dtype, b.numel) for b in segments
                                                 if b.name not in FP32_SEGMENTS))

    def _tier_starts(self, from_unit: int) -> dict[str, int]:
        """Per kind of state, the element of its arena segment where the units on NVMe (from `from_unit`) start: the
        moments at the node's packing of them, the weights and gradients at the units' offsets."""
        units = self.layout.units
        at = units[from_unit].offset if from_unit < len(units) else self.layout.numel
        packed = self.node.offsets[from_unit] if from_unit < len(units) else self.node.numel
        return {"params": at, "grads": at, "exp_avg": packed, "exp_avg_sq": packed}

    def _init_params(self, base: bool = True) -> None:
        """The model's weights from its directory (or initialised); a LoRA run's into the frozen segment (base False:
        they are there, never written since), and its adapters' initial values into the trainable ranges."""
        frozen = self.layout.frozen
        model, weights = (self.layout, self.arena.params) if frozen is None else (frozen, self.arena.frozen)
        if base or frozen is None:
            if self.source_dir is not None:
                self.passthrough = ckpt.load_hf_weights(self.source_dir, model, weights, self.io)
            else:
                init_weights(model, weights, self.seed, self.io)
        if frozen is not None:
            adapters = initial_adapters(self.layout, self.seed, self.adapter)
            write_adapters(self.layout, self.arena.params, adapters, str(self.adapter or "the initial adapters"))
        self._refresh_bf16_copy()
        if REFERENCE_SEGMENT in self.arena.tensors:  # the initial weights, never written after (post_plan.py)
            self._copy_weights(REFERENCE_SEGMENT)

    def _refresh_bf16_copy(self) -> None:
        """After the weights were written other than by the optimizer (which keeps the bf16 copy itself)."""
        if BF16_COPY_SEGMENT in self.arena.tensors:
            self._copy_weights(BF16_COPY_SEGMENT)

    def _copy_weights(self, segment: str) -> None:
        """The weights into `segment`, unit by unit (read through the tier where the masters are on NVMe)."""
        copy, params = self.arena.tensors[segment], self.arena.params
        for_each_unit(self.layout, lambda unit: unit.range_of(copy).copy_(self.io.read(unit.range_of(params))))

    def reinitialize(self) -> None:
        """Back to the state before the first step: initial weights, zero moments, version 0."""
        self._init_params(base=False)
        for name in ("grads", "exp_avg", "exp_avg_sq"):
            if self.tier is None or name not in self.tier.kinds:
                self.arena.tensors[name].zero_()
        if self.tier is not None:  # the weights were written again above
            self.tier.zero(("grads", "exp_avg", "exp_avg_sq"))
        self.set_version(0)

    @property
    def io(self) -> SlotIO:
        """How the store reads and writes the arena's states: in place, or those on NVMe in their state files."""
        return self.tier.io if self.tier is not None else IN_PLACE

    @property
    def handle(self) -> ArenaHandle:
        return self.arena.handle

    def set_version(self, updates_applied: int) -> None:
        self.versions.fill_(updates_applied)
        self.arena.issued.fill_(updates_applied)

    def join_nodes(self, address: str) -> None:
        """Several nodes: joins the other nodes' stores (at tcp://host:port) to keep the weights equal."""
        self.node_group = NodeGroup.join(self.node, address)
        if self.tier is not None and self.tier.holds("params"):
            self.master_parts = MasterParts(self.tier.files, self._tier_starts(self.plan.tier.from_unit)["params"],
                                            max(u.numel for u in self.layout.units))

    def sync_weights(self, step: int) -> None:
        """Several nodes: once this node's workers applied update `step`, unit by unit, the updated parts of the
        weights are exchanged with the other nodes (NodeGroup.sync_weights)."""
        self.node_group.sync_weights(self.layout, step, self.arena.params, self.versions,
                                     self.arena.tensors.get(BF16_COPY_SEGMENT), self.master_parts)

    def version_range(self) -> tuple[int, int]:
        """(min, max) of the version table: the update every unit has, and the newest any part of one has."""
        return VersionTable(self.versions).range()

    def save_pretrained(self, directory: str | Path, extra_files: list[Path] | None = None, merge: bool = False
                        ) -> Path:
        """An HF model directory; a LoRA run's: its adapter in PEFT's format, or with `merge` the base with the
        adapter merged in (an HF model directory)."""
        if self.layout.frozen is None:
            return ckpt.save_hf(Path(directory), self.layout, self.arena.params, extra_files or [],
                                passthrough=self.passthrough, io=self.io)
        if merge:
            tensors = merged_tensors(self.layout, self.arena.frozen, self.arena.params, self.passthrough)
            return ckpt.save_hf(Path(directory), self.layout.frozen, self.arena.frozen, extra_files or [],
                                tensors=tensors)
        with ckpt.atomic_directory(Path(directory), keep=lambda name: not is_adapter_file(name)) as tmp:
            self._write_adapter(tmp)
            for f in extra_files or []:
                shutil.copy2(f, tmp / Path(f).name)
        return Path(os.path.abspath(directory))

    def _write_adapter(self, directory: Path) -> None:
        """A LoRA run's adapter in PEFT's format (adapter_config.json and adapter_model.safetensors)."""
        write_adapter(arena_adapters(self.layout, self.arena.params), directory,
                      None if self.source_dir is None else str(self.source_dir))

    def save_checkpoint(self, directory: str | Path, state: dict[str, Any]) -> Path:
        """Weights (HF names), Adam moments, `state` as trainer_state.json, then the manifest; atomic."""
        with ckpt.atomic_directory(ckpt.checkpoint_target(Path(directory))) as tmp:
            self.write_checkpoint_part(tmp, state)
            ckpt.write_manifest(tmp)
        return Path(os.path.abspath(directory))

    def write_checkpoint_part(self, directory: Path, state: dict[str, Any] | None) -> None:
        """This node's files of a checkpoint being written into `directory`: with `state` (one node of the run
        gives it) the config, the weights (HF names) and trainer_state.json; always its Adam moments: with HF names
        on one node, else the node's part (ckpt.write_moment_part). The caller writes the manifest once all are."""
        directory = Path(directory)
        if state is not None:
            (directory / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2))
            if self.layout.frozen is not None:  # the adapter, as PEFT loads it; the frozen base is the model's own
                self._write_adapter(directory)
            else:
                tensors = ckpt.model_tensors(self.layout, self.arena.params, self.passthrough)
                ckpt.write_sharded(directory, "model", tensors, io=self.io)
            (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
        self._write_moments(directory)

    def _write_moments(self, directory: Path) -> None:
        if self.node.nodes == 1:
            moments = (ckpt.hf_tensors(self.layout, self.arena.exp_avg, "exp_avg.")
                       + ckpt.hf_tensors(self.layout, self.arena.exp_avg_sq, "exp_avg_sq."))
            ckpt.write_sharded(directory, "optimizer", moments, io=self.io)
        else:
            ckpt.write_moment_part(directory, self.layout, self.node, self.arena.exp_avg, self.arena.exp_avg_sq,
                                   io=self.io)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Verifies and loads a training checkpoint into the arena; returns its trainer state."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ckpt.CheckpointError(f"checkpoint {directory} does not exist; check the path.")
        if not (directory / ckpt.MANIFEST).is_file() and (directory / "config.json").is_file() \
                and not (directory / "trainer_state.json").is_file():
            raise ckpt.CheckpointError(f"{directory} is an HF model directory, not a training checkpoint; start from "
                                       "its weights by passing it as the model (Engine(path), --model path).")
        ckpt.verify_manifest(directory)
        ckpt.check_config_matches(directory, self.config)
        state = ckpt.read_json(directory / "trainer_state.json", "trainer state")
        # every check that can fail comes before the arena changes
        frozen = self.layout.frozen
        if frozen is None:
            model_files = ckpt.weight_files(directory, "model")
        else:  # a LoRA run's checkpoint holds its adapter (the base is the model's own, unchanged)
            adapters = load_adapter(directory, frozen, getattr(self.layout, "lora", None))
        parts = ckpt.moment_parts(directory, self.layout)  # written by a run on several nodes
        opt_files = [] if parts else ckpt.weight_files(directory, "optimizer")
        if frozen is None:
            passthrough: dict[str, torch.Tensor] = {}
            ckpt.load_into(self.layout, self.arena.params, model_files, where=str(directory), passthrough=passthrough,
                           io=self.io)
            self.passthrough = passthrough
        else:
            write_adapters(self.layout, self.arena.params, adapters, str(directory))
        self._refresh_bf16_copy()
        moments = {"exp_avg": self.arena.exp_avg, "exp_avg_sq": self.arena.exp_avg_sq}
        if parts:
            ckpt.load_moment_parts(parts, self.layout, self.node, moments, io=self.io)
        else:
            for name, flat in moments.items():
                ckpt.load_into(self.layout, flat, opt_files, prefix=f"{name}.", where=str(directory),
                               shard=self.node, io=self.io)
        if self.tier is not None and "grads" in self.tier.kinds:
            self.tier.zero(("grads",))
        else:
            self.arena.grads.zero_()
        self.set_version(int(state.get("updates_applied", 0)))
        return state

    def unlink(self) -> None:
        """The arena's files and the NVMe tier's state directory removed, the mappings and open files staying valid:
        before a recovery kills this store, which may be stuck in the weight exchange (so `close` could wait)."""
        self.arena.unlink()
        if self.tier is not None:
            self.tier.files.unlink()

    def close(self) -> None:
        if getattr(self, "tier", None) is not None:
            self.tier.close()
            self.tier = None
        if getattr(self, "node_group", None) is not None:
            self.node_group.close()
            self.node_group = None
        if getattr(self, "arena", None) is not None:
            self.arena.destroy()
            self.arena = None  # type: ignore[assignment]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the next start removes what is left
            pass
