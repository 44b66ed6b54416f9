"""Weight gradients summed over micro-batches inside their GEMMs: a linear layer's weight gradient for a micro-batch
that is not the layer's first in the backward is accumulated straight into the layer's fp32 gradient buffer by its
own GEMM, as Megatron-LM's gradient_accumulation_fusion does, while the model's math knows nothing of it (a torch
function mode in the forward, a buffer named in the backward). How, where not, and why:
docs/design.md#gradient-folding."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatrain.errors import MegatrainError
from megatrain.model.templates import Weights, weight_leaves

log = logging.getLogger(__name__)

# the address of a weight whose folded linears run in the backward now -> its gradient buffer (accumulating_into)
_BUFFERS: dict[int, torch.Tensor] = {}


def accumulate_weight_grad(buffer: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """buffer += grad^T @ x for grad [tokens, out] and x [tokens, in], in one GEMM where the device has one."""
    if grad.dtype == buffer.dtype:
        buffer.addmm_(grad.t(), x)
    elif _has_gemm_into_fp32(buffer.device):  # bf16/fp16 inputs, fp32 accumulation and output, beta = 1
        torch.addmm(buffer, grad.t(), x, out_dtype=buffer.dtype, out=buffer)
    else:  # the CPU has no GEMM from bf16 into fp32 (aten::addmm.dtype is CUDA's alone)
        buffer.add_(grad.t().mm(x))


@functools.cache
def _has_gemm_into_fp32(device: torch.device) -> bool:
    """Whether addmm from bf16 inputs into an fp32 `out` that is also its input runs on `device`, and sums exactly:
    CUDA's aten::addmm.dtype_out, which torch before 2.8 lacks (pyproject allows 2.4). Probed once per device on a
    tiny product against the fp32 one; where it fails, the bf16 GEMM + add (as on the CPU), said once in the log."""
    if device.type != "cuda":
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    grad, x = (torch.randn(64, n, device=device, generator=gen).to(torch.bfloat16) for n in (32, 16))
    buffer = torch.randn(32, 16, device=device, generator=gen)
    exact = buffer + grad.float().t() @ x.float()
    try:
        torch.addmm(buffer, grad.t(), x, out_dtype=torch.float32, out=buffer)
        works = torch.allclose(buffer, exact, rtol=1e-5, atol=1e-5)
    except (RuntimeError, TypeError, NotImplementedError):
        works = False
    if not works:
        log.info("grad fold: this torch has no GEMM from bf16 into an fp32 buffer on %s; later micro-batches' bf16 "
                 "weight gradients are a bf16 GEMM and an add", device)
    return works


def _fold_and_grad_input(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dx of y = x @ weight^T, with dL/dweight added into weight's buffer."""
    buffer = _BUFFERS.get(weight.data_ptr())
    if buffer is None or buffer.shape != weight.shape:
        raise MegatrainError("a folded linear's weight has no gradient buffer in this backward (a bug in "
                             "megatrain/engine/grad_fold.py's caller); set micro_batches = 1 to run without folding.")
    grad2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    accumulate_weight_grad(buffer, grad2d, x2d)
    return grad2d.mm(weight).view(x.shape)


# the same as an op a compiled graph keeps opaque: the compiler sees a function of its inputs, and the buffer is
# found when the op runs
_folded_linear_backward = torch.library.custom_op("megatrain::folded_linear_backward", _fold_and_grad_input,
                                                  mutates_args=())


@_folded_linear_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


class _FoldedLinear(torch.autograd.Function):
    """F.linear whose backward folds the weight's gradient into its buffer and returns none for it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (forward with ctx, not setup_context: apply then binds no signature per call, ~45 us each)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        # the op where a compiler traces this (it must stay opaque), its body where the backward runs eagerly
        backward = _folded_linear_backward if torch.compiler.is_compiling() else _fold_and_grad_input
        return backward(grad, x, weight), None, grad_bias


def foldable(weights: Weights) -> list[str]:
    """The names of `weights` a linear may fold: matrices, each at an address of its own (the buffer's key)."""
    matrices = {name: t for name, t in weights.items() if t.dim() == 2 and t.numel() and t.is_floating_point()}
    seen: dict[int, int] = {}
    for t in weights.values():
        if t.numel():
            seen[t.data_ptr()] = seen.get(t.data_ptr(), 0) + 1
    return [name for name, t in matrices.items() if seen[t.data_ptr()] == 1]


class FoldLinears(TorchFunctionMode):
    """While active: F.linear on one of `leaves`' foldable weights (by identity) runs as a folded linear."""

    def __init__(self, leaves: Weights):
        super().__init__()
        # compared with `is`, not by id(): inside a compiled layer dynamo would guard on each call's fresh leaves' ids
        # and compile the layer anew for every folded call; `is` between its inputs it guards as aliasing
        self.folding = [leaves[name] for name in foldable(leaves)]

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():  # every other call passes straight through
            x, weight, bias = _linear_args(*args, **kwargs)
            if (any(weight is leaf for leaf in self.folding) and x.requires_grad and x.dtype == weight.dtype
                    and not torch.is_autocast_enabled(x.device.type)):
                return _FoldedLinear.apply(x, weight, bias)
        return func(*args, **kwargs)


def _linear_args(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return input, weight, bias


@contextlib.contextmanager
def accumulating_into(w: Weights, buffers: Weights) -> Iterator[None]:
    """While a backward runs: the folded linears of weights `w` (the weights that backward reads: a kept graph's
    resolve to them) add into buffers[name]."""
    keys = {w[name].data_ptr(): buffers[name] for name in foldable(w) if name in buffers}
    if keys.keys() & _BUFFERS.keys():
        raise MegatrainError("two backwards in one process fold into the gradients of the same weights at once; "
                             "run one executor per process.")
    _BUFFERS.update(keys)
    try:
        yield
    finally:
        for key in keys:
            del _BUFFERS[key]


def folded_grads(output: torch.Tensor, x: torch.Tensor, leaves: Weights, grad_out: torch.Tensor, w: Weights,
                 buffers: Weights) -> tuple[torch.Tensor, Weights]:
    """(dL/dx, {name: dL/dw}) of a graph built under FoldLinears(leaves), the folded shares added into `buffers`
    as it runs: a weight appears only where autograd has a gradient of its other uses for it (none: absent)."""
    with accumulating_into(w, buffers):
        grads = torch.autograd.grad(output, [x, *leaves.values()], grad_out, allow_unused=True)
    return grads[0], {name: g for name, g in zip(leaves, grads[1:], strict=True) if g is not None}


def recompute_folded(fn: Callable[..., torch.Tensor], x: torch.Tensor, w: Weights, grad_out: torch.Tensor,
                     args: tuple[Any, ...], buffers: Weights) -> tuple[torch.Tensor, Weights]:
    """templates.recompute_grads with the linears folded into `buffers` (folded_grads)."""
    x = x.detach().requires_grad_(True)
    leaves, _ = weight_leaves(w)
    with torch.enable_grad(), FoldLinears(leaves):
        y = fn(x, leaves, *args)
    return folded_grads(y, x, leaves, grad_out, w, buffers)
