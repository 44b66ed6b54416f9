"""EngineOptions: everything an Engine is made with besides its model: the optimizer's settings (OptimConfig), the
engine's (EngineConfig, its "auto"s decided by pipelines/run_plan.py: resolve), and the run's own (the Ray cluster,
the step's shape, recovery, telemetry). `Engine(model, options, **overrides)` takes any of their fields by name; what
each setting means: docs/design.md."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from megatrain.config import ConfigError, EngineConfig, OptimConfig

# the EngineConfig fields an Engine takes: not threads_per_worker (a worker's threads are its reserved CPUs)
ENGINE_SETTINGS = tuple(f.name for f in fields(EngineConfig) if f.name != "threads_per_worker")
OPTIM_SETTINGS = tuple(f.name for f in fields(OptimConfig))


@dataclass
class EngineOptions:
    optim: OptimConfig = field(default_factory=OptimConfig)  # the optimizer's settings
    engine: EngineConfig = field(default_factory=EngineConfig)  # what the engine is asked for (its "auto"s left)
    # the run
    address: str | None = None  # the Ray cluster (pipelines/cluster.py: init_ray)
    batch_size: int = 8  # the step's shape the memory plan is made for
    seq_len: int = 2048
    max_nonfinite_steps: int = 5
    max_restarts: int = 10
    max_replay_steps: int = 1000  # batches logged since the last checkpoint for exact recovery
    resource_timeout: float = 60.0  # seconds to wait for Ray to grant the run's CPUs (and GPU)
    trace: bool = False
    metrics: bool = True
    adapter: str | Path | None = None  # a PEFT adapter directory to start from

    @classmethod
    def of(cls, options: EngineOptions | None, overrides: dict[str, Any]) -> EngineOptions:
        """`options` (default: the defaults) with `overrides`, each a field of OptimConfig, EngineConfig (`lora`: a
        LoraConfig, its command-line form or a table of it; `nvme`: a path) or of the run's; an unknown name is
        refused in one sentence."""
        run = {f.name for f in fields(cls)} - {"optim", "engine"}
        unknown = sorted(set(overrides) - run - set(OPTIM_SETTINGS) - set(ENGINE_SETTINGS))
        if unknown:
            raise ConfigError(f"Engine got unknown setting(s) {', '.join(unknown)}; the settings are the fields of "
                              "OptimConfig and EngineConfig (megatrain/config.py) and of the run's in "
                              "pipelines/engine_options.py: EngineOptions.")
        o = options or cls()
        optim = replace(o.optim, **{k: v for k, v in overrides.items() if k in OPTIM_SETTINGS})
        engine = {k: v for k, v in overrides.items() if k in ENGINE_SETTINGS}
        if engine.get("nvme"):
            engine["nvme"] = str(engine["nvme"])
        return replace(o, optim=optim, engine=replace(o.engine, **engine),
                       **{k: v for k, v in overrides.items() if k in run})
