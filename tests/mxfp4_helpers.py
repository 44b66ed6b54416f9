"""GPT-OSS checkpoints as published, made in the tests: the experts' weights quantized to MXFP4 by the exact inverse of
the layout transformers decodes (transformers/integrations/mxfp4.py), written with the quantization_config of the
published config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP4 = torch.tensor([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# as in the published config.json of gpt-oss-20b and -120b
QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [experts, in, out] -> (blocks uint8 [experts, out, in/32, 16], scales uint8 [experts, out, in/32]): stored
    transposed, 32 values to a scale 2**(scale - 127) that brings the block's largest within FP4's 6, each value the
    nearest FP4 code, two codes a byte with the even position in the low nibble."""
    experts, rows_in, rows_out = w.shape
    t = w.detach().float().transpose(1, 2).reshape(experts, rows_out, rows_in // 32, 32)
    amax = t.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = t / torch.pow(2.0, exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own decoding, fp32: what its model holds after from_pretrained(dequantize=True)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def write_mxfp4_checkpoint(hf: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """`hf` saved as GPT-OSS is published: each expert tensor as `_blocks` and `_scales`, the quantization_config in
    config.json. Returns the expert tensors as they decode (what a model loaded from the directory holds)."""
    hf.save_pretrained(directory)
    path = directory / "model.safetensors"
    tensors, decoded = load_file(path), {}
    for name in [n for n in tensors if n.endswith(EXPERT_TENSORS)]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded[name] = dequantize_reference(blocks, scales)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    return decoded
