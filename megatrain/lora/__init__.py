"""LoRA on a frozen, streamed base: the adapters' config, the modules its targets name (PEFT's rule), their tensors
and the LoRA linear inside the layer math (native and generic), and PEFT's format out and in."""

from megatrain.lora.adapters import Adapters, LoraArchitecture, LoraLayer, adapter_slots, lora_linear
from megatrain.lora.config import LoraConfig
from megatrain.lora.peft_format import load_adapter, read_lora_config, save_adapter

__all__ = ["Adapters", "LoraArchitecture", "LoraConfig", "LoraLayer", "adapter_slots", "load_adapter", "lora_linear",
           "read_lora_config", "save_adapter"]
