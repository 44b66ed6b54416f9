"""Qwen3 (dense): Llama's layer with an RMSNorm over each head's query and key vector after the projections and
before RoPE (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, head_dim long, shared by the heads).

Its config.json's differences from Llama's, and why sliding layers take the generic path: docs/design.md#qwen3."""

from __future__ import annotations

from typing import Any

from megatrain.config import ConfigError, ModelConfig
from megatrain.model.llama import LlamaFamily, Missing, hf_flag, sliding_layers
from megatrain.model.registry import register


class Qwen3Family(LlamaFamily):
    architectures = {"qwen3": "Qwen3ForCausalLM"}
    qk_norm = True

    def hf_defaults(self, model_type: str) -> dict[str, Any]:
        # Qwen3Config's own defaults, which transformers applies to keys a config.json leaves out
        return {"rms_norm_eps": 1e-6, "head_dim": 128, "max_position_embeddings": 32768}

    def attention_biases(self, hf: dict[str, Any], model_type: str) -> tuple[bool, bool]:
        bias = hf_flag(hf, "attention_bias")
        return bias, bias

    def sliding_window(self, hf: dict[str, Any], model_type: str) -> None:
        self.slides(hf)  # ConfigError for sliding keys that are no Qwen3 config's
        return None  # every layer attends to the whole sequence: one that slides is not_native

    def not_native(self, hf: dict[str, Any], model_type: str) -> Missing | None:
        if self.slides(hf):
            return "sliding-window attention layers", "each of its layers attends to the whole sequence"
        return super().not_native(hf, model_type)

    def slides(self, hf: dict[str, Any]) -> bool:
        """Whether some layer attends to a sliding window (sliding_layers). This family's attention is full causal, so
        such a model takes the generic path rather than being trained as another model."""
        return any(sliding_layers(hf))

    def validate(self, c: ModelConfig) -> None:
        if c.qkv_bias != c.o_bias:
            raise ConfigError(f"model config: qkv_bias={c.qkv_bias} with o_bias={c.o_bias} is no qwen3 layout "
                              "transformers can load; Qwen3's attention_bias puts a bias on q, k, v and o alike.")
        if c.sliding_window is not None:
            raise ConfigError(f"model config: sliding_window={c.sliding_window} is not implemented for qwen3 "
                              "(megatrain trains Qwen3 with full attention in every layer); set it to None.")

    def hf_attention_keys(self, c: ModelConfig) -> dict[str, Any]:
        # full attention everywhere, said the way Qwen3Config reads it (it derives layer_types from these)
        return {"attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": c.num_layers}


QWEN3 = register(Qwen3Family())
