"""What a step of the executor (megatrain/engine/executor.py) is asked, is made of and returns: its options, the
batch prepared once for every pass over it, and the step's loss, token count, per-unit squared gradient norms and
held gradients."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain.engine.grad_egress import GradsOut, LandedCallback, UnitCallback, noop
from megatrain.engine.token_loss import TokenLoss
from megatrain.engine.weight_waits import NO_WAITS, WeightWaits
from megatrain.model.architecture import Batch


@dataclass(frozen=True)
class StepOptions:
    """How Executor.run runs one forward + backward (its keywords)."""

    # when a unit's weights in the arena may be read (its update is done), asked blocking or not (weight_waits.py)
    weight_waits: WeightWaits = NO_WAITS
    grads_landed: LandedCallback = noop  # (unit, norm_sq), once the unit's gradients are in the arena
    # asked before the backward whether to go on (False: skip it, e.g. a non-finite loss, or an evaluation)
    loss_ready: Callable[[float], bool] | None = None
    # blocks until the optimizer has read the unit's gradient, whose host slot the next unit is about to reuse
    slot_free: UnitCallback = noop
    hold_grads: bool = False  # the gradients stay on the device for `send_held` (StepOutput.held)
    micro_batches: int = 1  # the batch's rows in that many equal micro-batches, one loss and gradient as one batch's
    # "layer-major": while a layer's weights are on the device its forward (then its backward) runs over every
    # micro-batch, weight gradients summed in fp32 before one copy out (weights cross once per step);
    # "per-micro-batch": a whole forward and backward per micro-batch, its gradients added to the earlier ones'
    # in the arena (grads = "arena" only): one micro-batch's activation checkpoints at a time
    schedule: str = "layer-major"
    # the labelled tokens the loss is the mean over, where they are more than this batch's (data parallel: its
    # rows are an executor's share of a step's); StepOutput.tokens stays this batch's
    loss_tokens: int | None = None
    also_send: bool = False  # with hold_grads: sent now as well
    token_loss: TokenLoss | None = None  # train on that loss on the tokens' log-probs instead (token_loss.py)


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
