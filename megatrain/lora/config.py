"""LoraConfig: which projections get low-rank adapters, their rank, alpha, dropout and scaling, read from the command
line (`r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05,rslora=true`) or a TOML table, and checked against a model.

Target modules are spelled as PEFT spells them and matched by PEFT's rule (megatrain/lora/targets.py): the end of a
projection's name inside a decoder layer (`q_proj`, `self_attn.q_proj`, `down_proj`, as transformers names them),
or PEFT's `all-linear` for every projection of the layers (never lm_head, as PEFT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from megatrain.config import ConfigError, ModelConfig
from megatrain.lora.targets import resolve_targets

# the keys the command line and TOML take, with PEFT's own spelling of each beside it
KEYS = {"r": "r", "alpha": "alpha", "lora_alpha": "alpha", "dropout": "dropout", "lora_dropout": "dropout",
        "targets": "targets", "target_modules": "targets", "rslora": "rslora", "use_rslora": "rslora"}
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
# What a setting not given is (`--lora` alone): TRL's and PEFT's LoRA recipes (r=16, alpha=2r, every linear
# projection of the layers), not PEFT LoraConfig's bare r=8, alpha=8 on its per-model default targets (q_proj, v_proj
# for Llama), which adapts a fraction of what fine-tuning changes; dropout 0 as PEFT's default.
DEFAULTS = {"r": 16, "targets": "all-linear"}  # alpha: twice r
# the precisions a LoRA run keeps its frozen base in on the host (lora_base_dtype), and their arena dtypes
BASE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class LoraConfig:
    r: int  # rank of each adapter: A is (r, in), B is (out, r)
    alpha: float  # the update B @ A is scaled by alpha / r (alpha / sqrt(r) with rsLoRA)
    target_modules: tuple[str, ...]  # projection names as PEFT spells them, e.g. ("q_proj", "v_proj")
    dropout: float = 0.0  # on the adapter's input only, as PEFT's lora_dropout
    use_rslora: bool = False  # rank-stabilised scaling (Kalajdzievski 2023): alpha / sqrt(r)
    defaulted: tuple[str, ...] = field(default=(), compare=False)  # the settings not given, taken from DEFAULTS

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"LoRA rank r must be a positive whole number, got {self.r!r}; try r=16.")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ConfigError(f"LoRA alpha must be a positive number, got {self.alpha!r}; try alpha=32 (twice r).")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"LoRA dropout must be a number in [0, 1), got {self.dropout!r}; try dropout=0.05.")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"LoRA targets must name one or more projections, got {targets!r}; "
                              "try targets=q_proj,v_proj.")
        object.__setattr__(self, "target_modules", tuple(dict.fromkeys(targets)))  # in order, once each

    @property
    def scaling(self) -> float:
        """The factor on B @ A x, as PEFT computes it."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    @classmethod
    def parse(cls, text: str) -> LoraConfig:
        """The command line's form: comma-separated key=value pairs; the names after targets= run on, comma-separated,
        to the next key=value (`r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05`); "defaults" (what `--lora` alone
        gives) takes every setting from DEFAULTS."""
        values: dict[str, Any] = {}
        if text.strip() in ("", "defaults"):  # `--lora` alone: every setting from DEFAULTS
            return cls.from_dict(values)
        key = None
        for part in (p.strip() for p in text.split(",")):
            if "=" in part:
                key, _, value = (s.strip() for s in part.partition("="))
                values[key] = [value] if KEYS.get(key) == "targets" else value
            elif part and key is not None and KEYS.get(key) == "targets":
                values[key].append(part)
            elif part:
                raise ConfigError(f"--lora has {part!r} without a key; write key=value pairs, e.g. "
                                  "r=16,alpha=32,targets=q_proj,v_proj.")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoraConfig:
        """A TOML table (or parse's pairs): keys r, alpha, targets, dropout, rslora, or PEFT's spelling of them
        (lora_alpha, target_modules, lora_dropout, use_rslora); numbers and flags may be strings. What is not given
        is DEFAULTS' (r 16, alpha twice r, all-linear targets, dropout 0): an empty table is a whole config."""
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            field = KEYS.get(key)
            if field is None:
                raise ConfigError(f"LoRA setting {key!r} is unknown; use r, alpha, targets, dropout and rslora.")
            if field in kwargs:
                raise ConfigError(f"LoRA setting {field!r} is given twice (as {key!r} too); give it once.")
            kwargs[field] = value
        defaulted = tuple(k for k in ("r", "alpha", "targets") if k not in kwargs)
        r = _number(kwargs.get("r", DEFAULTS["r"]), "r", int)
        alpha = kwargs.get("alpha", 2 * r if isinstance(r, int) else r)  # a bad r is LoraConfig's to refuse
        targets = kwargs.get("targets", DEFAULTS["targets"])
        return cls(r=r, alpha=_number(alpha, "alpha", float),
                   target_modules=tuple(targets.split(",")) if isinstance(targets, str) else tuple(targets),
                   dropout=_number(kwargs.get("dropout", 0.0), "dropout", float),
                   use_rslora=_flag(kwargs.get("rslora", False)), defaulted=defaulted)

    def to_cli(self) -> str:
        """The command line's form, which parse reads back as this config."""
        return (f"r={self.r},alpha={self.alpha:g},targets={','.join(self.target_modules)},"
                f"dropout={self.dropout:g},rslora={str(self.use_rslora).lower()}")

    def for_model(self, config: ModelConfig) -> LoraConfig:
        """This config with its targets checked against the model's modules by PEFT's rule and put in their order
        (all-linear: the decoder layers' linear projections; megatrain/lora/targets.py); what megatrain cannot adapt
        is refused in one sentence."""
        return replace(self, target_modules=resolve_targets(self.target_modules, config))


def _number(value: Any, key: str, kind: type) -> Any:
    """int or float from a TOML number or a command-line string; anything else is left for LoraConfig to refuse."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"LoRA setting {key} must be a number, got {value!r}.") from None
    return value


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    raise ConfigError(f"LoRA setting rslora must be true or false, got {value!r}.")
