"""Stateless layer templates: the model as pure functions of (activations, weights).

A template holds only the shape config. Weights arrive per call as a dict of views into whatever flat
buffer the unit was just copied into (a GPU weight buffer, or the arena itself on the CPU path), so one
template serves every layer and no autograd graph outlives a call.

Backward never uses torch.utils.checkpoint (it recomputes with whatever weights a module holds at
backward time and raises CheckpointError when they were swapped, DeepSpeed PR 8148). Instead
`recompute_grads` binds the weights again as fresh leaves, reruns the forward from the saved input under
enable_grad, and asks torch.autograd.grad for the input and weight gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatrain.config import MegatrainError, ModelConfig
from megatrain.model import ops

Weights = dict[str, torch.Tensor]


Spans = list[list[tuple[int, int]]] | None  # per row, the packed documents (ops.document_spans)
MLP_WEIGHTS = ("post_attention_layernorm.", "mlp.")  # the second half of a layer: what tiling runs tile by tile


class DecoderLayer:
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)); one instance serves every layer.

    Options a family's config turns on: q/k/v and o_proj biases (present in `w` or not), and Qwen3's RMSNorm
    over each head's query and key (qk_norm).

    tile_tokens: the MLP half runs over tiles of that many tokens, in the forward and in `backward`, so no
    [tokens, intermediate] tensor exists whole (at 128k tokens of a 7B model one is 5.6 GB in fp32); attention
    runs over the whole sequence (SDPA's fused kernels hold O(tokens) beside q, k and v)."""

    def __init__(self, config: ModelConfig, tile_tokens: int | None = None):
        self.config = config
        self.qk_norm = config.qk_norm  # read once: the family lookup behind it is no part of a compiled graph
        self.tile_tokens = tile_tokens

    def __call__(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor], spans: Spans = None
                 ) -> torch.Tensor:
        x = self.attention(x, w, rope, spans)
        if self.tile_tokens is None or torch.is_grad_enabled():
            return self.mlp(x, w)
        out = torch.empty_like(x)
        flat_in, flat_out = x.view(-1, x.shape[-1]), out.view(-1, x.shape[-1])
        for start in range(0, flat_in.shape[0], self.tile_tokens):
            tile = slice(start, start + self.tile_tokens)
            flat_out[tile] = self.mlp(flat_in[tile], w)
        return out

    def backward(self, x: torch.Tensor, w: Weights, grad_out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 spans: Spans = None) -> tuple[torch.Tensor, Weights]:
        """(dL/dx, {name: dL/dw}) by recomputing the layer from x: the attention half once under autograd, the MLP
        half tile by tile (its weight gradients summed in fp32 over the tiles), then the attention half's
        gradients from the MLP's input gradient."""
        attn_w = {n: t for n, t in w.items() if not n.startswith(MLP_WEIGHTS)}
        mlp_w = {n: t for n, t in w.items() if n.startswith(MLP_WEIGHTS)}
        x = x.detach().requires_grad_(True)
        attn_leaves = {n: t.detach().requires_grad_(True) for n, t in attn_w.items()}
        with torch.enable_grad():
            mid = self.attention(x, attn_leaves, rope, spans)
        flat_mid, flat_grad = mid.detach().view(-1, mid.shape[-1]), grad_out.reshape(-1, mid.shape[-1])
        grad_mid = torch.empty_like(flat_mid)
        mlp_grads = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in mlp_w.items()}
        tile_tokens = self.tile_tokens or flat_mid.shape[0]
        for start in range(0, flat_mid.shape[0], tile_tokens):
            tile = slice(start, start + tile_tokens)
            grad_tile, tile_grads = recompute_grads(self.mlp, flat_mid[tile], mlp_w, flat_grad[tile])
            grad_mid[tile] = grad_tile
            for n, g in tile_grads.items():
                mlp_grads[n] += g
        grads = torch.autograd.grad(mid, [x, *attn_leaves.values()], grad_mid.view_as(mid))
        attn_grads = dict(zip(attn_leaves, grads[1:], strict=True))
        return grads[0], {n: attn_grads[n] if n in attn_grads else mlp_grads[n] for n in w}

    def mlp(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        """x + mlp(norm(x)): token by token, so any tiling of the tokens gives the same result."""
        h = ops.rms_norm(x, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return x + ops.swiglu(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

    def attention(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor], spans: Spans = None
                  ) -> torch.Tensor:
        """x + attn(norm(x))."""
        c = self.config
        b, t, _ = x.shape
        h = ops.rms_norm(x, w["input_layernorm.weight"], c.rms_norm_eps)
        q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        q = q.view(b, t, c.num_heads, c.head_dim)
        k = k.view(b, t, c.num_kv_heads, c.head_dim)
        if self.qk_norm:  # over head_dim, one weight shared by the heads, before RoPE (as transformers' Qwen3)
            q = ops.rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps)
            k = ops.rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        attn = ops.causal_attention(q, k, v, spans).transpose(1, 2).reshape(b, t, c.q_size)
        return x + F.linear(attn, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))


def embed(rows: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """Embedding lookup from the gathered rows a batch uses: rows [u, h], row_index [b, t] into rows."""
    return F.embedding(row_index, rows)


def embed_backward(grad_x: torch.Tensor, row_index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Gradient of the gathered rows: scatter-add of the token gradients, [u, h]."""
    grad_rows = grad_x.new_zeros(num_rows, grad_x.shape[-1])
    return grad_rows.index_add_(0, row_index.reshape(-1), grad_x.reshape(-1, grad_x.shape[-1]))


def recompute_grads(fn: Callable[..., torch.Tensor], x: torch.Tensor, weights: Weights, grad_out: torch.Tensor,
                    *args: object) -> tuple[torch.Tensor, Weights]:
    """Reruns fn(x, weights, *args) with grad and returns (dL/dx, {name: dL/dw})."""
    x = x.detach().requires_grad_(True)
    leaves = {name: w.detach().requires_grad_(True) for name, w in weights.items()}
    with torch.enable_grad():
        y = fn(x, leaves, *args)
    grads = torch.autograd.grad(y, [x, *leaves.values()], grad_out)
    return grads[0], dict(zip(leaves, grads[1:], strict=True))


def head_loss_and_grads(x: torch.Tensor, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor],
                        norm_weights: Weights, lm_head: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        host_targets: torch.Tensor | None = None, softcap: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, Weights, torch.Tensor]:
    """Final norm + lm_head + mean cross-entropy, forward and backward at once, in token chunks.

    Never holds more than [chunk_tokens, vocab] logits, nor a [vocab, hidden] tensor beside the lm_head's
    gradient: each chunk's share is added into it from the logits' gradient. final_norm(x, norm_weights) is the
    model's norm before the head; softcap, if set, caps the logits (cap * tanh(logits / cap)). Returns (loss,
    dL/dx, {name: dL/d norm weight}, dL/d lm_head); the loss is the mean over targets that are not IGNORE_INDEX,
    as transformers computes it. targets are on x's device; host_targets, the same on the host (None: targets
    are there), are what counting and skipping chunks read, so that they need not wait for the device.
    """
    flat_x = x.reshape(-1, x.shape[-1])
    flat_t = targets.reshape(-1)
    host_t = flat_t if host_targets is None else host_targets.reshape(-1)
    n_valid = int((host_t != ops.IGNORE_INDEX).sum())
    if n_valid == 0:
        raise MegatrainError("this batch has no tokens to train on (every label is -100); check the loss mask.")
    loss = torch.zeros((), dtype=torch.float32, device=flat_x.device)
    grad_x = torch.zeros_like(flat_x)
    # summed over chunks in fp32 whatever the compute dtype: bf16 sums would round at every chunk
    grad_norm = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in norm_weights.items()}
    grad_head = torch.zeros_like(lm_head, dtype=torch.float32)
    norm_leaves = {name: w.detach().requires_grad_(True) for name, w in norm_weights.items()}
    for start in range(0, flat_x.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        if not bool((host_t[chunk] != ops.IGNORE_INDEX).any()):
            continue  # nothing to learn here (prompt or padding): its gradient is zero
        xc = flat_x[chunk].detach().requires_grad_(True)
        with torch.enable_grad():
            normed = final_norm(xc, norm_leaves)
        hidden = normed.detach()
        chunk_loss, grad_logits = ops.cross_entropy_sum_and_grad(hidden, lm_head, flat_t[chunk], 1.0 / n_valid,
                                                                 softcap)
        grad_head.addmm_(grad_logits.t(), hidden.float())
        grad_hidden = grad_logits.to(lm_head.dtype) @ lm_head
        del grad_logits
        gx, *gn = torch.autograd.grad(normed, [xc, *norm_leaves.values()], grad_hidden)
        loss += chunk_loss
        grad_x[chunk] = gx
        for name, g in zip(norm_leaves, gn, strict=True):
            grad_norm[name] += g
    return loss / n_valid, grad_x.view_as(x), grad_norm, grad_head
