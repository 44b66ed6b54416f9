"""A loss on per-token log-probabilities, as `Engine.step(input_ids, labels=..., loss=fn, **fields)` takes it, and its
way through the head: log-probs (and entropy) in a first chunked pass without gradients, `fn` on those [batch, seq]
tensors under autograd, its gradients fed back into a second chunked pass (megatrain/model/logprob_head.py).

fn sees the whole step's rows at once, so a loss aggregates exactly as it says; the tensors' alignment and the
schedule this needs: docs/design.md#losses-on-log-probabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.config import MegatrainError
from megatrain.model.logprob_head import LogprobHead, check_temperature
from megatrain.model.templates import Weights

# (logprobs [b, t], entropy [b, t] or None, fields) -> a 0-d tensor, differentiable in logprobs (and entropy)
LossFn = Callable[[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class TokenLoss:
    """What a step trains on instead of the mean cross-entropy. temperature: the logits are divided by it before the
    softmax (after a soft-cap), as the sampler that drew the tokens applied it. entropy: fn gets each position's
    entropy too (else None)."""

    fn: LossFn
    fields: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    entropy: bool = False
    # what fn.metrics(logprobs, entropy, fields) -> {name: number} said of the step's batch, where fn has it: set
    # where the loss is evaluated (in the executor's process), returned with the step's result
    reported: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if not callable(self.fn):
            raise MegatrainError(f"loss must be a function (logprobs, entropy, fields) -> scalar, got {self.fn!r}.")

    @staticmethod
    def check_schedule(data_parallel: bool, per_micro_batch: bool) -> None:
        if data_parallel or per_micro_batch:
            raise MegatrainError("a loss on log-probabilities is evaluated once over all of a step's rows, which needs "
                                 "them at the head at once: one executor and the layer-major schedule.")


def label_aligned(head: torch.Tensor) -> torch.Tensor:
    """[b, t] per head position (position t predicts token t + 1) -> aligned with the labels (entry t + 1)."""
    out = torch.zeros_like(head)
    out[:, 1:] = head[:, :-1]
    return out


def head_aligned(label: torch.Tensor) -> torch.Tensor:
    """The inverse of label_aligned: what position t's prediction of label t + 1 carries."""
    out = torch.zeros_like(label)
    out[:, :-1] = label[:, 1:]
    return out


def loss_coefficients(loss: TokenLoss, logp: torch.Tensor, entropy: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(fn's value, dL/dlogp, dL/dentropy or None) of the step's head-aligned log-probs (and entropy) [b, t]; the
    gradients head-aligned too, for the head's second pass."""
    device = logp.device
    fields = {name: torch.as_tensor(value).to(device) for name, value in loss.fields.items()}
    lp = label_aligned(logp).requires_grad_(True)
    ent = None if entropy is None else label_aligned(entropy).requires_grad_(True)
    with torch.enable_grad():
        value = loss.fn(lp, ent, fields)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise MegatrainError("the loss function must return one number computed from the log-probabilities (a "
                             f"0-d tensor with a gradient), got {type(value).__name__} "
                             f"{getattr(value, 'shape', '')}.".replace(" .", "."))
    if hasattr(loss.fn, "metrics"):
        loss.reported = loss.fn.metrics(lp.detach(), None if ent is None else ent.detach(), fields)
    inputs = [lp] if ent is None else [lp, ent]
    grads = torch.autograd.grad(value.reshape(()), inputs, allow_unused=True, materialize_grads=True)
    return value.detach().reshape(()).float(), head_aligned(grads[0]), None if ent is None else head_aligned(grads[1])


def train_head(loss: TokenLoss, head: LogprobHead, xs: list[torch.Tensor], targets: list[torch.Tensor],
               host_targets: list[torch.Tensor], weight_grads: bool
               ) -> tuple[torch.Tensor, tuple[Weights, torch.Tensor | None]]:
    """A step's head on `loss`: every micro-batch's log-probs (xs[j], its head input, with targets[j]), the loss once
    on all of their rows, its gradient back through each micro-batch's head: xs[j] becomes the gradient wrt its
    input. Returns (the loss, the head's weight gradients summed over the micro-batches; weight_grads False: none)."""
    outs = [head.logprobs(x, t, h, loss.entropy) for x, t, h in zip(xs, targets, host_targets, strict=True)]
    logp = torch.cat([lp for lp, _ in outs])
    entropy = torch.cat([e for _, e in outs if e is not None]) if loss.entropy else None
    value, a, c = loss_coefficients(loss, logp, entropy)
    sums, start = None, 0
    for j, (t, h) in enumerate(zip(targets, host_targets, strict=True)):
        rows = slice(start, start + t.shape[0])
        start = rows.stop
        xs[j], sums = head.grads(xs[j], t, (a[rows], None if c is None else c[rows]), h, sums, weight_grads)
    assert sums is not None
    return value, sums


def joined(parts: list[torch.Tensor | None]) -> torch.Tensor:
    """Micro-batches' head-aligned [rows, t] tensors as one, aligned with the labels, on the host."""
    return label_aligned(torch.cat([p for p in parts if p is not None])).cpu()
