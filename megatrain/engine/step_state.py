"""What a step of the executor (megatrain/engine/executor.py) is made of and what it returns: the batch prepared
once for every pass over it, and the step's loss, token count, per-unit squared gradient norms and held gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megatrain.engine.grad_egress import GradsOut
from megatrain.engine.token_loss import TokenLoss
from megatrain.model.architecture import Batch


@dataclass
class PreparedStep:
    """A step's batch, prepared once for every pass over it: micro-batches, embedding rows, targets."""

    batches: list[Batch]  # per micro-batch, what its layers take (rotary tables, documents)
    micro: list[slice]  # per micro-batch, its rows of the step's batch
    rows: torch.Tensor  # the embedding rows the step's tokens use, on the device
    rows_idx: torch.Tensor  # their indices in the table (host)
    row_of_token: torch.Tensor  # per token, its row in `rows` (device)
    targets: torch.Tensor  # shifted labels (device)
    host_targets: torch.Tensor  # the same on the host
    n_tokens: int  # labelled tokens of the whole step: every micro-batch's loss is divided by it
    token_loss: TokenLoss | None = None  # the loss on log-probs the step trains on instead (token_loss.py)


@dataclass
class StepOutput:
    loss: float
    tokens: int  # tokens that carried a label
    unit_grad_norms_sq: list[float] = field(default_factory=list)  # per unit, in layout order
    held: list[GradsOut] = field(default_factory=list)  # hold_grads: the gradients still on the device

    @property
    def grad_norm(self) -> float:
        return sum(self.unit_grad_norms_sq) ** 0.5

    @property
    def finite(self) -> bool:
        """The loss and every gradient are finite: the step's update may be applied."""
        return math.isfinite(self.loss) and math.isfinite(sum(self.unit_grad_norms_sq))
