"""An MoE model's router auxiliary loss on the generic path, as its ForCausalLM adds it: found in the model's own
module (`load_balancing_loss_func`), computed once the forward has run every layer, and its gradient handed to each
layer's router logits when that layer is recomputed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from megatrain.config import ConfigError


class InjectGrad(torch.autograd.Function):
    """Identity on `y` whose backward also hands `grad` to `source`: a loss term computed outside the layer (the
    router's auxiliary loss) reaches the layer's weights through the layer's recompute."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, source: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad_y, grad, None


class RouterAux:
    """The auxiliary load-balancing loss of an MoE model, as its ForCausalLM adds it to the loss."""

    def __init__(self, model: nn.Module):
        recorder = getattr(type(model), "_can_record_outputs", {}).get("router_logits")
        loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
        if recorder is None or loss_fn is None or not all(hasattr(model, a) for a in needed):
            raise ConfigError(f"{type(model).__name__} enables output_router_logits but megatrain cannot find how it "
                              "computes the router's auxiliary loss; set output_router_logits to false.")
        self.router_class, self.index = recorder.target_class, recorder.index
        self.loss_fn = loss_fn
        self.num_experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.coef = float(model.router_aux_loss_coef)
