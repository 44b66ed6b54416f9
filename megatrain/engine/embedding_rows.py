"""The embedding's part of a step: the table never crosses PCIe whole.

    gather    the rows the step's tokens use, gathered on the host from the arena (on the device where the embedding
              is resident) and brought to the device; each micro-batch's embeddings are looked up there
    backward  their gradient rows: every micro-batch's token gradients scatter-added into one buffer (no buffer per
              micro-batch added to the sum afterwards: one pass fewer each), which goes back to the host and is
              scattered into the (otherwise zero) embedding gradient in the arena
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatrain.engine.host_buffers import HostBuffers
from megatrain.engine.resident import ResidentUnits
from megatrain.model.layout import Unit
from megatrain.model.templates import embed, embed_backward
from megatrain.telemetry import Recorder

ToDevice = Callable[..., torch.Tensor]  # (host tensor, dtype=None) -> its device copy, ordered before compute


class EmbeddingRows:
    """The rows of the embedding table (`unit`'s, read from `weights` on the host or from `on_device`) a step uses."""

    def __init__(self, unit: Unit, weights: torch.Tensor, on_device: ResidentUnits, dtype: torch.dtype,
                 embed_scale: float | None, pad_token_id: int | None, host_buffers: HostBuffers, to_device: ToDevice,
                 rec: Recorder):
        self.unit, self.weights, self.on_device, self.dtype = unit, weights, on_device, dtype
        self.embed_scale, self.pad_token_id = embed_scale, pad_token_id
        self.host_buffers, self.to_device, self.rec = host_buffers, to_device, rec
        self._written: torch.Tensor | None = None  # rows of the arena's embedding gradient written last step

    def gather(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the rows the tokens use, on the device in the compute dtype; their indices in the table, host; per token
        its row among them, device)."""
        with self.rec.span("host", "embed", self.unit.index):
            rows_idx, row_of_token = torch.unique(input_ids, return_inverse=True)
            resident = self.on_device.holds(self.unit)  # then the table is on the device, and gathered there
            weights = self.on_device.weights_of(self.unit) if resident else self.unit.range_of(self.weights)
            table = self.unit.bind(weights)["embed_tokens.weight"]
            if resident:
                rows = torch.index_select(table, 0, self.to_device(rows_idx)).to(self.dtype)
            else:  # gathered straight into page-locked memory on a GPU: one host pass over the rows, not two
                rows = self.host_buffers.get("rows", rows_idx.numel(), table.shape[1], table.dtype)
                rows = self.to_device(torch.index_select(table, 0, rows_idx, out=rows), self.dtype)
            return rows, rows_idx, self.to_device(row_of_token)

    def embedded(self, rows: torch.Tensor, row_of_token: torch.Tensor) -> torch.Tensor:
        """The token embeddings (a micro-batch's `row_of_token`): the first layer's input."""
        x = embed(rows, row_of_token)
        if self.embed_scale is not None:  # in the compute dtype, as transformers' scaled embeddings
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def grad_rows(self, grads: list[torch.Tensor], rows_of_tokens: list[torch.Tensor], rows_idx: torch.Tensor
                  ) -> torch.Tensor:
        """The gathered rows' gradient in fp32, summed over the micro-batches: grads[m], the gradient with respect to
        micro-batch m's embeddings (dropped once used), scattered by rows_of_tokens[m] into one [rows, hidden]
        buffer, in token order (as one batch of all their rows would be)."""
        total = None
        for m, row_of_token in enumerate(rows_of_tokens):
            grad = grads[m]
            if self.embed_scale is not None:
                grad = grad * torch.tensor(self.embed_scale, dtype=grad.dtype)
            total = embed_backward(grad.float(), row_of_token, rows_idx.numel(), into=total)
            grads[m] = grad = None  # type: ignore[assignment]
        assert total is not None
        if self.pad_token_id is not None:  # transformers' embedding (padding_idx) gives the padding row no gradient
            total.masked_fill_(self.to_device(rows_idx == self.pad_token_id).unsqueeze(1), 0.0)
        return total

    def to_arena(self, grad_rows: torch.Tensor, rows_idx: torch.Tensor, embed_grad: torch.Tensor, resident: bool
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Callable[[], None]]:
        """(the gradient rows and where they land, what then writes them into `embed_grad`, the otherwise zero
        embedding gradient): from a host buffer into the arena's, or, `resident`, on the device from where they
        are."""
        if resident:
            on_device = self.to_device(rows_idx)
            return [(grad_rows, grad_rows)], lambda: embed_grad.zero_().index_copy_(0, on_device, grad_rows)
        host_rows = self.host_buffers.get("grad_rows", grad_rows.shape[0], grad_rows.shape[1], torch.float32)

        def scatter() -> None:
            if self._written is None:
                embed_grad.zero_()
            else:
                embed_grad.index_fill_(0, self._written, 0.0)
            embed_grad.index_copy_(0, rows_idx, host_rows)
            self._written = rows_idx

        return [(grad_rows, host_rows)], scatter
