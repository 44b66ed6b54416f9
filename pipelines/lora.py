"""A LoRA run's settings, checked on the driver before any actor starts: the adapters' config from what the user
gave (a LoraConfig, the command line's `r=16,alpha=32,targets=q_proj,v_proj`, a TOML table, or the PEFT adapter
directory a run starts from), checked against the model and the engine's settings, each refusal one sentence.

What a LoRA run is (megatrain/lora/): the base frozen in the arena in lora_base_dtype, its adapters the run's
trainable units, updated on the GPU where they fit (resident) or by the CPU optimizer pool in the arena.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.lora.adapters import refuse_tiled_dropout
from megatrain.lora.config import LoraConfig
from megatrain.lora.layout import lora_layout
from megatrain.lora.peft_format import load_adapter, read_lora_config
from megatrain.memory.arena import FROZEN_SEGMENT, ArenaHandle

log = logging.getLogger(__name__)

GiB = 2**30


def as_lora_config(lora: LoraConfig | str | dict[str, Any] | None) -> LoraConfig | None:
    """A LoraConfig from its command-line form or a TOML table (None: no LoRA)."""
    if lora is None or isinstance(lora, LoraConfig):
        return lora
    if isinstance(lora, str):
        return LoraConfig.parse(lora)
    if isinstance(lora, dict):
        return LoraConfig.from_dict(lora)
    raise ConfigError(f"lora must be settings like 'r=16,alpha=32,targets=q_proj,v_proj' (or a table of them), "
                      f"got {lora!r}.")


def lora_settings(lora: LoraConfig | str | dict[str, Any] | None, adapter: str | Path | None, config: ModelConfig,
                  engine: EngineConfig) -> LoraConfig | None:
    """The run's LoraConfig, its targets checked against the model (and put in its order), or None for a run without
    adapters. adapter: a PEFT adapter directory to start from (its settings are the run's where `lora` is None; else
    they must agree). Refuses in one sentence what a LoRA run cannot do with these engine settings."""
    lora = as_lora_config(lora)
    if adapter is not None:
        lora = lora or read_lora_config(adapter)
    if lora is None:
        return None
    layout = lora_layout(config, lora)  # a target the model lacks: one sentence
    if adapter is not None:
        load_adapter(adapter, layout.frozen, lora)  # another rank, targets or base model: one sentence
    if engine.tile_tokens not in ("auto", None):
        refuse_tiled_dropout(lora)  # (auto: the plan tiles no LoRA run with dropout)
    if engine.grads not in ("auto", "arena"):
        raise ConfigError(f"a LoRA run keeps its adapters' gradients (they are small) in the arena; leave grads "
                          f"unset (auto) or set it to arena, not {engine.grads!r}.")
    if getattr(engine, "keep_activations", "none") not in ("auto", "none", 0):
        raise ConfigError("kept activations would take the frozen base's gradients too; set keep_activations = none "
                          "for a LoRA run.")
    lora, params = layout.lora, layout.adapter_numel()  # targets as the model's projections (all-linear resolved)
    defaults = (f" ({', '.join(lora.defaulted)} not given: TRL's recipe r=16, alpha=2r, targets all-linear)"
                if lora.defaulted else "")
    log.info("LoRA: rank %d, alpha %g%s on %s%s: %s adapter parameters (%.2f MiB, %.2f MiB with their gradients and "
             "Adam state), the %s base frozen in %s", lora.r, lora.alpha, ", rsLoRA" if lora.use_rslora else "",
             ",".join(lora.target_modules), defaults, f"{params:,}", params * 4 / 2**20, params * 16 / 2**20,
             config.model_type, engine.lora_base_dtype)
    return lora


def record_lora_arena(metrics: Any, handle: ArenaHandle) -> None:
    """A LoRA run's arena bytes by kind (the megatrain_arena_bytes gauge): "frozen" (the base) and "adapters" (their
    weights, gradients and Adam moments); nothing for a run without adapters."""
    sizes = {name: numel for name, _, numel in handle.segments}
    if FROZEN_SEGMENT not in sizes:
        return
    frozen = next(numel * (2 if dtype == "bfloat16" else 4) for name, dtype, numel in handle.segments
                  if name == FROZEN_SEGMENT)
    metrics.record_arena(frozen, "frozen")
    metrics.record_arena(4 * sum(sizes[name] for name in ("params", "grads", "exp_avg", "exp_avg_sq")), "adapters")
