"""PEFT's adapter format, out and in: `adapter_config.json` + `adapter_model.safetensors`, as
`peft.PeftModel.from_pretrained(transformers_model, directory)` loads them (JSON and safetensors only, no pickles).

Reading refuses, in one sentence, what would not be the adapter megatrain trains: another PEFT method, options
megatrain's LoRA does not implement (DoRA, per-module ranks, bias training, ...), a rank or targets other than the
run asks for, and tensors that do not fit the model (another base model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from megatrain.config import ConfigError
from megatrain.io.checkpoint import atomic_directory, write_safetensors
from megatrain.lora.adapters import Adapters, adapter_slots
from megatrain.lora.config import LoraConfig
from megatrain.lora.targets import adapted_modules
from megatrain.model.layout import ModelLayout

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# options of PEFT's LoraConfig megatrain does not implement, with the value that means "off"
UNSUPPORTED = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
               "layers_to_transform": None, "layers_pattern": None, "modules_to_save": None, "lora_bias": False,
               "target_parameters": None, "exclude_modules": None, "layer_replication": None, "use_qalora": False}
# those written out: the ones every PEFT release since LoRA's rsLoRA option knows (newer ones default to off)
WRITTEN = ("use_dora", "bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform",
           "layers_pattern", "modules_to_save")


def peft_config(adapters: Adapters, base_model: str | None = None) -> dict[str, Any]:
    """adapter_config.json's contents: PEFT's LoraConfig fields for this adapter (PEFT fills in the rest)."""
    lora = adapters.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "use_rslora": lora.use_rslora,
        "init_lora_weights": True,
        "inference_mode": True,
        **{option: UNSUPPORTED[option] for option in WRITTEN},
    }


def is_adapter_file(name: str) -> bool:
    return name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def write_adapter(adapters: Adapters, directory: Path, base_model: str | None = None,
                  dtype: torch.dtype | None = None) -> None:
    """PEFT's two files into `directory`, which the caller makes whole or not at all (save_adapter; the store's
    export and checkpoints write them into their own atomic directory); dtype: the tensors' (None: as held, fp32)."""
    write_safetensors(directory / ADAPTER_WEIGHTS,
                      ((name, t if dtype is None else t.to(dtype)) for name, t in adapters.tensors.items()))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_config(adapters, base_model), indent=2) + "\n")


def save_adapter(adapters: Adapters, directory: str | Path, base_model: str | None = None,
                 dtype: torch.dtype | None = None) -> Path:
    """Writes the adapter into `directory` in PEFT's format, whole or not at all; what else it holds is kept."""
    with atomic_directory(Path(directory), keep=lambda name: not is_adapter_file(name)) as tmp:
        write_adapter(adapters, tmp, base_model, dtype)
    return Path(directory)


def read_lora_config(directory: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory; refuses other methods and options megatrain does not implement."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        peft = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory} has no {ADAPTER_CONFIG}; point at a directory PEFT's save_pretrained "
                          "(or megatrain's LoRA run) wrote.") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read as JSON ({e}); it is no PEFT adapter config.") from None
    if not isinstance(peft, dict) or peft.get("peft_type") != "LORA":
        kind = peft.get("peft_type") if isinstance(peft, dict) else None
        raise ConfigError(f"{path} describes a {kind!r} adapter, not LoRA; megatrain trains LoRA adapters only.")
    for option, off in UNSUPPORTED.items():
        value = peft.get(option, off)
        if value != off and not (off is None and value in ({}, [])):
            raise ConfigError(f"{path} sets {option}={value!r}, which megatrain's LoRA does not implement; "
                              "train or convert the adapter without it.")
    targets = peft.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"{path} picks target modules by the pattern {targets!r}, which megatrain does not "
                          "read; list the module names instead.")
    return LoraConfig.from_dict({"r": peft.get("r"), "alpha": peft.get("lora_alpha"),
                                 "targets": [targets] if isinstance(targets, str) else targets,
                                 "dropout": peft.get("lora_dropout", 0.0), "rslora": peft.get("use_rslora", False)})


def load_adapter(directory: str | Path, layout: ModelLayout, expected: LoraConfig | None = None) -> Adapters:
    """A PEFT adapter directory's adapters for the model `layout` describes, as fp32 tensors by PEFT name;
    expected: the run's LoraConfig, whose rank and targets the adapter must have."""
    lora = read_lora_config(directory).for_model(layout.config)
    if expected is not None:
        want = expected.for_model(layout.config)
        same_modules = (adapted_modules(lora.target_modules, layout.config)
                        == adapted_modules(want.target_modules, layout.config))  # however the targets spell them
        if lora.r != want.r or not same_modules:
            raise ConfigError(f"the adapter in {directory} has rank {lora.r} on {','.join(lora.target_modules)} but "
                              f"this run asks for rank {want.r} on {','.join(want.target_modules)}; make them agree.")
    slots = adapter_slots(layout, lora)
    tensors = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    tensors = {name.replace(".default.", "."): t for name, t in tensors.items()}  # as PEFT's state_dict names them
    shapes = {slot.peft_name(which): slot.shape(which, lora.r) for slot in slots for which in "AB"}
    extra = sorted(set(tensors) - set(shapes))
    missing = sorted(set(shapes) - set(tensors))
    wrong = sorted(n for n in set(shapes) & set(tensors) if tuple(tensors[n].shape) != shapes[n])
    if extra or missing or wrong:
        name = (extra or missing or wrong)[0]
        what = "has no place in" if extra else "is missing for" if missing else "has the wrong shape for"
        raise ConfigError(f"the adapter in {directory} does not fit this model: {name} {what} it, so it was trained "
                          "on another base model (or another layer count); load it onto the model it was made for.")
    return Adapters(lora, slots, {name: tensors[name].float() for name in shapes})
