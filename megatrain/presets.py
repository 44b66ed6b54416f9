"""Named model shapes (`--model 7b`): tiny for tests and the laptop default, the rest the shapes of public models of
that size, as ModelConfig keyword arguments."""

from __future__ import annotations

import math
from typing import Any

# The peak learning rate a run gets where none is given, by the model's parameter count: what published recipes
# train that size at (GPT-3's table 2.1 and Pythia: 6e-4 at 125-160M; Pythia and LLaMA: 3e-4 from 410M to 13B;
# LLaMA-33B/65B and Llama-2-70B: 1.5e-4). The tiny test sizes keep 3e-3, which they were tuned with. 3e-3 at 7B
# diverged on the H100 (loss 11.2 -> 31.2 with one warm-up step).
LR_BY_SIZE = ((50e6, 3e-3), (400e6, 6e-4), (20e9, 3e-4), (math.inf, 1.5e-4))  # (below this many parameters, lr)
WARMUP_STEPS, WARMUP_FRACTION = 20, 0.03  # warm-up: 3% of the steps, at least 20, at most half of them


def default_lr(num_params: int) -> float:
    return next(lr for below, lr in LR_BY_SIZE if num_params < below)


def default_warmup(steps: int) -> int:
    """Warm-up steps for a run of `steps`: 3% of them, at least 20, and never over half (a short run still trains)."""
    return min(max(WARMUP_STEPS, math.ceil(WARMUP_FRACTION * steps)), steps // 2)

# Named shapes. tiny is for tests and the laptop default; the rest follow public models of that size.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=260, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=176, max_position_embeddings=1024, bos_token_id=256, eos_token_id=257),
    "125m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048),
    # TinyLlama-1.1B
    "1b": dict(vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
               intermediate_size=5632, max_position_embeddings=2048),
    # the 2.8B peer shape measured in shared/device/README.md
    "2.8b": dict(vocab_size=32000, hidden_size=3072, num_layers=26, num_heads=24, num_kv_heads=8,
                 intermediate_size=8192),
    # Llama-3.2-3B
    "3b": dict(vocab_size=128256, hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8,
               intermediate_size=8192, rope_theta=500000.0, tie_embeddings=True),
    # Llama-2-7B (6.7B)
    "7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008),
    # Llama-3.1-8B layers, Llama-2's vocab, 41 layers: 9.2 G params, the fp32 + AdamW size target on a
    # 125 GiB host (12 B/param = 103 GiB with gradients streamed; FSDP2 offload tops out at 6.7 B there)
    "9b": dict(vocab_size=32000, hidden_size=4096, num_layers=41, num_heads=32, num_kv_heads=8,
               intermediate_size=14336, rope_theta=500000.0),
    # Qwen2.5-14B
    "14b": dict(vocab_size=152064, hidden_size=5120, num_layers=48, num_heads=40, num_kv_heads=8,
                intermediate_size=13824, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
                model_type="qwen2"),
    # Qwen2.5-32B
    "32b": dict(vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8,
                intermediate_size=27648, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
                model_type="qwen2"),
    # Llama-3-70B
    "70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                intermediate_size=28672, rope_theta=500000.0),
    # Qwen3-0.6B and Qwen3-8B (per-head q/k norms; head_dim 128 whatever the width)
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, intermediate_size=3072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, tie_embeddings=True, model_type="qwen3"),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, intermediate_size=12288, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, model_type="qwen3"),
    # Gemma-2-9B, and the text decoders of Gemma-3-4B and 12B (scaled embeddings, (1 + w) norms, sliding layers)
    "gemma2-9b": dict(vocab_size=256000, hidden_size=3584, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                      intermediate_size=14336, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_embeddings=True,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0, model_type="gemma2"),
    "gemma3-4b": dict(vocab_size=262208, hidden_size=2560, num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                      intermediate_size=10240, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      rms_norm_eps=1e-6, max_position_embeddings=131072, tie_embeddings=True, bos_token_id=2,
                      eos_token_id=1, pad_token_id=0, family_options={"sliding_window": 1024},
                      model_type="gemma3_text"),
    "gemma3-12b": dict(vocab_size=262208, hidden_size=3840, num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
                       intermediate_size=15360, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                       rms_norm_eps=1e-6, max_position_embeddings=131072, tie_embeddings=True, bos_token_id=2,
                       eos_token_id=1, pad_token_id=0, family_options={"sliding_window": 1024},
                       model_type="gemma3_text"),
}
