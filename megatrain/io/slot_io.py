"""SlotIO: how the checkpoint code reads and writes views of a flat tensor (the arena's weights or moments) where their
data do not live in it: the NVMe tier's state files (megatrain/memory/staging.py TierReader), one tensor at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotIO:
    """`read(view)`: a tensor holding the view's data; `fill(view, write)`: has `write` fill a tensor that then is the
    view's data (a checkpoint's tensor loaded, a unit initialised)."""

    read: Callable[[torch.Tensor], torch.Tensor]
    fill: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]


IN_PLACE = SlotIO(lambda view: view, lambda view, write: write(view))  # the data are in the flat tensor itself
