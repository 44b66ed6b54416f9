"""SlotIO: how the checkpoint code reads and writes views of a flat tensor (the arena's weights or moments) where their
data do not live in it: the NVMe tier's state files (megatrain/memory/staging.py TierReader), one tensor at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotIO:
    """`read(view)`: a tensor holding the view's data; `fill(view, write)`: has `write` fill a tensor that then is the
    view's data (a checkpoint's tensor loaded, a unit initialised)."""

    read: Callable[[torch.Tensor], torch.Tensor]
    fill: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]
    # read's results in order, the next ones read while each is used (None: one at a time)
    ahead: Callable[[list[torch.Tensor]], Iterator[torch.Tensor]] | None = None

    def read_each(self, views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """`read` of each view in turn; where the data are on disk, the next ones' reads run while each is used."""
        return self.ahead(views) if self.ahead is not None else map(self.read, views)


IN_PLACE = SlotIO(lambda view: view, lambda view, write: write(view))  # the data are in the flat tensor itself
