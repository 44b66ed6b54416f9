"""The head's log-probability of each target token (and each position's entropy), and the gradient of a loss on them,
in token chunks: never more than [chunk_tokens, vocab] logits at once.

A loss reaches the head as two per-token coefficients, a = dL/dlogp_y and c = dL/dH, and the second chunked pass
takes the head's gradients from a closed form in them (docs/design.md#log-probabilities)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from megatrain.config import MegatrainError
from megatrain.model import ops
from megatrain.model.templates import LogitsFn, Weights, chunk_backward, chunk_logits, chunk_through

Coefficients = tuple[torch.Tensor, torch.Tensor | None]  # per token of the head, dL/dlogp and dL/dentropy (or None)


@dataclass(frozen=True)
class LogprobHead:
    """The model's head as a loss on log-probabilities reads it: final norm, lm_head (and, on the generic path, the
    model's own `logits`), soft-cap and the sampler's temperature. Positions whose target is IGNORE_INDEX have
    log-probability and entropy 0 and take no gradient."""

    final_norm: Callable[[torch.Tensor, Weights], torch.Tensor]
    norm_weights: Weights  # the head's weights but lm_head's: the final norm's (a head bias)
    lm_head: torch.Tensor
    chunk_tokens: int
    softcap: float | None = None
    logits: LogitsFn | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_temperature(self.temperature)

    def logprobs(self, x: torch.Tensor, targets: torch.Tensor, host_targets: torch.Tensor | None = None,
                 entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(target) [b, t], entropy [b, t] or None) in fp32 of the head's input x [b, t, h], targets [b, t]
        aligned with the positions (ops.shift_labels); host_targets: the same on the host, what chunk skipping reads.
        No autograd graph is kept."""
        flat_x, flat_t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        host_t = flat_t if host_targets is None else host_targets.reshape(-1)
        logp = torch.zeros(flat_t.shape, dtype=torch.float32, device=x.device)
        ent = torch.zeros_like(logp) if entropy else None
        with torch.no_grad():
            for chunk in self._chunks(host_t):
                z = self._chunk_logits(flat_x[chunk])
                all_logp = torch.log_softmax(z, dim=-1)
                del z
                t = flat_t[chunk]
                valid = t != ops.IGNORE_INDEX
                logp[chunk] = torch.where(valid, all_logp.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
                if ent is not None:
                    ent[chunk] = torch.where(valid, -(all_logp.exp() * all_logp).sum(-1), 0.0)
        return logp.view(targets.shape), None if ent is None else ent.view(targets.shape)

    def grads(self, x: torch.Tensor, targets: torch.Tensor, coefficients: Coefficients,
              host_targets: torch.Tensor | None = None, grads_into: tuple[Weights, torch.Tensor | None] | None = None,
              weight_grads: bool = True) -> tuple[torch.Tensor, tuple[Weights, torch.Tensor | None]]:
        """(dL/dx, ({name: dL/d norm weight}, dL/d lm_head)) of a loss whose gradient wrt each position's log-prob
        (and entropy) is `coefficients` ([b, t] each, aligned with targets). grads_into: earlier micro-batches'
        weight gradients (fp32), added to; weight_grads False: the head is frozen, ({}, None) comes back."""
        flat_x, flat_t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        host_t = flat_t if host_targets is None else host_targets.reshape(-1)
        a, c = (None if k is None else k.reshape(-1).float() for k in coefficients)
        assert a is not None
        if grads_into is not None:
            grad_norm, grad_head = grads_into
        elif weight_grads:
            grad_norm = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in self.norm_weights.items()}
            grad_head = torch.zeros_like(self.lm_head, dtype=torch.float32)
        else:
            grad_norm, grad_head = {}, None
        leaves = {name: w.detach().requires_grad_(weight_grads) for name, w in self.norm_weights.items()}
        grad_x = torch.zeros_like(flat_x)
        for chunk in self._chunks(host_t):
            xc = flat_x[chunk].detach().requires_grad_(True)
            ac, cc = a[chunk], None if c is None else c[chunk]
            if self.logits is not None:
                objective = partial(_objective, a=ac, c=cc, temperature=self.temperature)
                _, gx = chunk_through(self.logits, self.final_norm, xc, leaves, self.lm_head, flat_t[chunk],
                                      objective, grad_norm, grad_head)
            else:
                closed_form = partial(_logits_grad, a=ac, c=cc, softcap=self.softcap, temperature=self.temperature)
                _, gx = chunk_backward(xc, self.final_norm, leaves, self.lm_head, flat_t[chunk], closed_form,
                                       grad_norm, grad_head)
            grad_x[chunk] = gx
        return grad_x.view_as(x), (grad_norm, grad_head)

    def _chunks(self, host_t: torch.Tensor) -> list[slice]:
        """The chunks of the flat positions with at least one target (the others: nothing to compute)."""
        chunks = (slice(s, s + self.chunk_tokens) for s in range(0, host_t.shape[0], self.chunk_tokens))
        return [c for c in chunks if bool((host_t[c] != ops.IGNORE_INDEX).any())]

    def _chunk_logits(self, xc: torch.Tensor) -> torch.Tensor:
        """A chunk's fp32 logits as the sampler reads them: capped, then over the temperature."""
        if self.logits is not None:
            z = chunk_logits(self.logits, self.final_norm, xc, self.norm_weights, self.lm_head)
        else:
            z = _capped(F.linear(self.final_norm(xc, self.norm_weights), self.lm_head).float(), self.softcap)[0]
        return z if self.temperature == 1.0 else z / self.temperature


def check_temperature(temperature: float) -> None:
    """A temperature divides the logits: a positive finite number, or one sentence."""
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise MegatrainError(f"temperature must be a positive number, got {temperature!r}.")


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cap * tanh(logits / cap), the tanh) with a softcap, else (logits, None): as ops.cross_entropy_sum_and_grad."""
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def _logits_grad(hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, a: torch.Tensor,
                 c: torch.Tensor | None, softcap: float | None, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(0, dL/d fp32 logits [n, vocab]) of one chunk from its coefficients a = dL/dlogp_y, c = dL/dH
    (docs/design.md#log-probabilities). With c None and temperature 1 the operations are
    ops.cross_entropy_sum_and_grad's with -a for its scale."""
    logits, capped = _capped(F.linear(hidden, lm_head).float(), softcap)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    del logits
    valid = (targets != ops.IGNORE_INDEX).to(logp.dtype).unsqueeze(1)
    picked = targets.clamp_min(0).unsqueeze(1)  # ignored rows pick column 0; their coefficient is 0
    a = a.unsqueeze(1) * valid
    if c is None:
        grad = logp.exp_().mul_(-a)
    else:  # in place, three [n, vocab] at the peak as the cross-entropy head (megatrain/memory/plan.py budgets)
        p = logp.exp()
        entropy = -(p * logp).sum(-1, keepdim=True)
        grad = logp.add_(entropy).mul_(p).mul_(-(c.unsqueeze(1) * valid)).add_(p.mul_(-a))
        del p
    del logp
    grad.scatter_add_(1, picked, a)
    if temperature != 1.0:
        grad.div_(temperature)
    if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
        grad.mul_(capped.square_().neg_().add_(1.0))
    return torch.zeros((), device=grad.device), grad


def _objective(z: torch.Tensor, targets: torch.Tensor, a: torch.Tensor, c: torch.Tensor | None, temperature: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(0, sum(a * logp_y + c * H)) of a chunk's logits under autograd (the generic path's head)."""
    all_logp = torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)
    valid = (targets != ops.IGNORE_INDEX).to(all_logp.dtype)
    picked = all_logp.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1)
    objective = (a * valid * picked).sum()
    if c is not None:
        objective = objective - (c * valid * (all_logp.exp() * all_logp).sum(-1)).sum()
    return torch.zeros((), device=z.device), objective
