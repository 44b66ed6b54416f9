"""MXFP4 expert weights, as GPT-OSS's published checkpoints store them, dequantized as they load.

An expert tensor W [experts, in, out] is stored transposed, as `<name>_blocks` (uint8 [experts, out, in/32, 16]: two
FP4 e2m1 codes a byte, the low nibble first) and `<name>_scales` (uint8 [experts, out, in/32]: an e8m0 exponent with
bias 127 for each 32 values). Decoded as transformers decodes it (integrations/mxfp4.py: code -> FP4_VALUES, times
2**(scale - 127), then transposed back), one expert at a time straight into its slot of the arena, so the fp32
tensor is never whole in memory beside its packed bytes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.config import MegatrainError
from megatrain.model.hf_config import check_not_quantized, quant_method

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32  # values that share one scale: 16 bytes of blocks
SUFFIXES = ("_blocks", "_scales")
LARGEST_SCALE = 252  # 2**125: every FP4 value times it is finite in fp32


class Mxfp4Error(MegatrainError):
    pass


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., groups * 32] from blocks uint8 [..., groups, 16] and scales uint8 [..., groups]: transformers' values
    bit for bit (its FP4 table per nibble times 2**(scale - 127), a product of powers of two that is exact either way),
    a byte's two values looked up at once."""
    *lead, groups, half = blocks.shape
    out = _pairs().index_select(0, blocks.reshape(-1).int()).view(torch.float32).view(*lead, groups, half * 2)
    out.mul_(torch.pow(2.0, scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return out.view(*lead, groups * half * 2)


@functools.cache
def _pairs() -> torch.Tensor:
    """Per byte, the FP4 values of its low and its high nibble, as one 8-byte entry (int64) for one gather."""
    lut, codes = torch.tensor(FP4_VALUES, dtype=torch.float32), torch.arange(256)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], -1).contiguous().view(torch.int64).view(256)


@dataclass(frozen=True)
class Mxfp4Weight:
    """One stored expert tensor, packed: what the loader copies into the arena in place of a dense tensor."""

    name: str
    blocks: torch.Tensor  # uint8 [experts, out, in / 32, 16]
    scales: torch.Tensor  # uint8 [experts, out, in / 32]
    where: str = "the checkpoint"  # for the refusal of values fp32 cannot hold

    @property
    def shape(self) -> tuple[int, ...]:
        experts, rows, groups, half = self.blocks.shape
        return experts, groups * half * 2, rows

    def is_floating_point(self) -> bool:
        return True  # what it decodes to

    def dequantize_into(self, out: torch.Tensor) -> None:
        for expert in range(self.blocks.shape[0]):
            values = decode(self.blocks[expert], self.scales[expert])
            # beyond 2**125 FP4's 6 passes fp32's 2**128: transformers would load infs and NaNs, which training spreads
            if int(self.scales[expert].max()) > LARGEST_SCALE and not bool(torch.isfinite(values).all()):
                raise Mxfp4Error(f"{self.where}: {self.name} decodes to values beyond fp32's range (scales of 2**126 "
                                 "and more, or e8m0's NaN, 255); the checkpoint is corrupt, so copy it again.")
            out[expert].copy_(values.T)

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32)
        self.dequantize_into(out)
        return out


def copy_into(slot: torch.Tensor, t: torch.Tensor | Mxfp4Weight) -> None:
    """What the loader does with each tensor it loads: a packed one decoded expert by expert into the slot."""
    if isinstance(t, Mxfp4Weight):
        t.dequantize_into(slot)
    else:
        slot.copy_(t)


def dense(t: torch.Tensor | Mxfp4Weight) -> torch.Tensor:
    return t.dequantize() if isinstance(t, Mxfp4Weight) else t


def packed_weight(name: str, read_blocks: Callable[[], torch.Tensor], read_scales: Callable[[], torch.Tensor],
                  where: str) -> Mxfp4Weight:
    """The pair read and checked: one sentence for bytes that are not MXFP4 as GPT-OSS lays it out."""
    blocks, scales = read_blocks(), read_scales()
    uint8 = blocks.dtype == scales.dtype == torch.uint8
    if not (uint8 and blocks.dim() == 4 and blocks.shape[-1] == BLOCK // 2 and scales.shape == blocks.shape[:-1]):
        raise Mxfp4Error(f"{where}: {name}_blocks {tuple(blocks.shape)} {blocks.dtype} and {name}_scales "
                         f"{tuple(scales.shape)} {scales.dtype} are not MXFP4 expert weights (uint8 [experts, out, "
                         "in/32, 16] and uint8 [experts, out, in/32]); re-export the checkpoint.")
    return Mxfp4Weight(name, blocks, scales, where)


def dequantized(stored: Iterable[tuple[str, Callable[[], torch.Tensor]]], where: str
                ) -> Iterator[tuple[str, Callable[[], torch.Tensor | Mxfp4Weight]]]:
    """A checkpoint's (name, read) pairs with each `<name>_blocks` and `<name>_scales` made one (name, read), whose
    read gives the packed weight; nothing is read until asked for."""
    pending: dict[str, dict[str, Callable[[], torch.Tensor]]] = {}
    for name, read in stored:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, read
            continue
        base = name.removesuffix(suffix)
        pair = pending.setdefault(base, {})
        pair[suffix] = read
        if len(pair) == len(SUFFIXES):
            del pending[base]
            yield base, functools.partial(packed_weight, base, pair["_blocks"], pair["_scales"], where)
    if pending:
        base, pair = next(iter(pending.items()))
        have, lack = next(iter(pair)), next(s for s in SUFFIXES if s not in pair)
        raise Mxfp4Error(f"{where} holds {base}{have} without {base}{lack}; the checkpoint is incomplete, so copy "
                         "it again.")


def decoded(directory: Path, stored: Iterable[tuple[str, Callable[[], torch.Tensor]]]
            ) -> Iterable[tuple[str, Callable[[], torch.Tensor | Mxfp4Weight]]]:
    """An HF directory's (name, read) pairs as its config.json says they are stored: MXFP4 pairs made one, other
    quantized storage refused (ConfigError), dense as it is."""
    config = Path(directory) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}  # read (and checked) before, by ModelConfig
    if quant_method(hf) == "mxfp4":
        return dequantized(stored, str(directory))
    check_not_quantized(hf, directory)
    return stored
