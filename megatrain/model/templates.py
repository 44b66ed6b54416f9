"""Stateless layer templates: the model as pure functions of (activations, weights).

Weights arrive per call as a dict of views into whatever buffer the unit was just copied into, so one template serves
every layer and no autograd graph outlives a call. The backward recomputes explicitly (`recompute_grads`), never
through torch.utils.checkpoint; frozen weights via `trainable` and `bind` (docs/design.md#templates)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.config import MegatrainError, ModelConfig
from megatrain.model import ops

Weights = dict[str, torch.Tensor]
Trainable = Callable[[str], bool]  # the names of the weights whose gradients a backward takes
Bind = Callable[[Weights], Weights]  # the weights -> what the layer math reads, names kept (a subset's to a subset's)
Grads = torch.Tensor | tuple[torch.Tensor, ...]  # the gradient of a function's output (of each, for a tuple of them)


KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [batch, kv_heads, tokens, head_dim] each
Documents = torch.Tensor | None  # where each row's packed documents begin, [batch, seq] bool (ops.document_starts)
MLP_WEIGHTS = ("post_attention_layernorm.", "mlp.")  # the second half of a layer, tiled over all tokens at once
O_WEIGHTS = "self_attn.o_proj."  # the output projection, tiled along the sequence


class DecoderLayer:
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)); one instance serves every layer.

    Options a family's config turns on: q/k/v and o_proj biases (present in `w` or not), and Qwen3's RMSNorm
    over each head's query and key (qk_norm).

    tile_tokens: the token-wise work (norms, q/k/v and output projections, RoPE, the MLP) runs over tiles of about
    that many tokens, in the forward and in `backward`, so no [tokens, intermediate] tensor exists whole (at 128k
    tokens of a 7B model one is 5.6 GB in fp32); attention runs over the whole sequence (SDPA's fused kernels
    hold O(tokens) beside q, k and v).
    """

    def __init__(self, config: ModelConfig, tile_tokens: int | None = None):
        self.config = config
        self.qk_norm = config.qk_norm  # read once: the family lookup behind it is no part of a compiled graph
        self.tile_tokens = tile_tokens
        self._qkv_tile, self._out_tile, self._mlp_tile = self._qkv, self._output_projection, self.mlp  # compile_tiles

    def __call__(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents = None
                 ) -> torch.Tensor:
        if self.tile_tokens is None or torch.is_grad_enabled():
            return self.mlp(self.attention(x, w, rope, documents), w)
        with torch.no_grad():
            x = self._attention_tiled(x, w, rope, documents)[0]
            out = torch.empty_like(x)
            flat_in, flat_out = x.view(-1, x.shape[-1]), out.view(-1, x.shape[-1])
            mlp_w = _subset(w, MLP_WEIGHTS)
            for tile in self._tiles(flat_in.shape[0], 1):
                flat_out[tile] = self._mlp_tile(flat_in[tile], mlp_w)
        return out

    def backward(self, x: torch.Tensor, w: Weights, grad_out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 documents: Documents = None, *, trainable: Trainable | None = None, bind: Bind | None = None
                 ) -> tuple[torch.Tensor, Weights]:
        """(dL/dx, {name: dL/dw}) by recomputing the layer from x, tile by tile wherever the work is token-wise: the
        norm, q/k/v projections and RoPE, the output projection and the MLP half; attention once over the whole
        sequence under autograd. Weight gradients are summed over the tiles in fp32. trainable: the weights whose
        gradients are taken (None: all); bind: what the math reads of the weights (None: them), as recompute_grads."""
        b, t, hidden = x.shape
        x = x.detach()
        grads = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in w.items() if trainable is None or trainable(n)}

        def tile_backward(fn: Callable[..., Any], x_tile: torch.Tensor, tile_w: Weights, grad: Grads, *args: object
                          ) -> torch.Tensor:
            grad_x, tile_grads = recompute_grads(fn, x_tile, tile_w, grad, *args, trainable=trainable, bind=bind)
            for n, g in tile_grads.items():
                grads[n] += g
            return grad_x

        with torch.no_grad():
            mid, q, k, v = self._attention_tiled(x, w if bind is None else bind(w), rope, documents)
        # attention over the whole sequence, kept for its backward below
        q, k, v = (t_.requires_grad_(True) for t_ in (q, k, v))
        with torch.enable_grad():
            attn = self._attend(q, k, v, documents)
        attn_tokens = attn.detach().transpose(1, 2).reshape(b, t, self.config.q_size)
        # the MLP half, tile by tile over all tokens: dL/d mid
        flat_mid, flat_grad = mid.view(-1, hidden), grad_out.reshape(-1, hidden)
        grad_mid = torch.empty_like(flat_mid)
        mlp_w = _subset(w, MLP_WEIGHTS)
        for tile in self._tiles(flat_mid.shape[0], 1):
            grad_mid[tile] = tile_backward(self._mlp_tile, flat_mid[tile], mlp_w, flat_grad[tile])
        del mid, flat_mid
        # mid = x + o_proj(attn): the output projection, tile by tile along the sequence
        grad_mid = grad_mid.view(b, t, hidden)
        o_w = _subset(w, O_WEIGHTS)
        grad_attn = torch.empty_like(attn_tokens)
        for tile in self._tiles(t, b):
            grad_attn[:, tile] = tile_backward(self._out_tile, attn_tokens[:, tile], o_w, grad_mid[:, tile])
        grad_q, grad_k, grad_v = torch.autograd.grad(
            attn, [q, k, v], grad_attn.view(b, t, -1, self.config.head_dim).transpose(1, 2))
        del attn, q, k, v, grad_attn
        # q, k, v = qkv(x): norm, projections and RoPE, tile by tile; the residual passes grad_mid to x
        qkv_w = _subset(w, exclude=(*MLP_WEIGHTS, O_WEIGHTS))
        grad_x = grad_mid
        for tile in self._tiles(t, b):
            grad_x[:, tile] += tile_backward(self._qkv_tile, x[:, tile], qkv_w,
                                             (grad_q[:, :, tile], grad_k[:, :, tile], grad_v[:, :, tile]),
                                             _rope_rows(rope, tile))
        return grad_x, grads

    def compile_tiles(self, compile: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """The tiled path's token-wise pieces (q/k/v with RoPE, the output projection, the MLP half) run through
        `compile` (torch.compile), each compiled once per tile shape and grad mode; the loops over the tiles and the
        attention over the whole sequence between them stay eager (a compiled loop would unroll every tile into one
        graph, and SDPA is one kernel either way)."""
        self._qkv_tile, self._out_tile, self._mlp_tile = compile(self._qkv), compile(self._output_projection), \
            compile(self.mlp)

    def _tiles(self, tokens: int, rows: int) -> list[slice]:
        """Slices of `tokens` positions, each with `rows` rows of them no more than tile_tokens tokens (at least one
        position), covering all."""
        step = max(1, (self.tile_tokens or tokens * rows) // rows)
        return [slice(start, start + step) for start in range(0, tokens, step)]

    def _attention_tiled(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor],
                         documents: Documents) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x + attn(norm(x)), q, k, v) with the token-wise parts in tiles along the sequence; no grad."""
        c = self.config
        b, t, _ = x.shape
        q = x.new_empty(b, c.num_heads, t, c.head_dim)
        k = x.new_empty(b, c.num_kv_heads, t, c.head_dim)
        v = torch.empty_like(k)
        qkv_w, o_w = _subset(w, exclude=(*MLP_WEIGHTS, O_WEIGHTS)), _subset(w, O_WEIGHTS)
        for tile in self._tiles(t, b):
            q[:, :, tile], k[:, :, tile], v[:, :, tile] = self._qkv_tile(x[:, tile], qkv_w, _rope_rows(rope, tile))
        attn = self._attend(q, k, v, documents).transpose(1, 2)
        out = torch.empty_like(x)
        for tile in self._tiles(t, b):
            out[:, tile] = x[:, tile] + self._out_tile(attn[:, tile].reshape(b, -1, c.q_size), o_w)
        return out, q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
        """Causal attention; within Mistral's / Qwen2's sliding window where the config has one (a sequence no longer
        than the window runs the plain fused kernels)."""
        if self.config.sliding_window is None:
            return ops.causal_attention(q, k, v, documents)
        return ops.windowed_attention(q, k, v, documents, window=self.config.sliding_window)

    def mlp(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        """x + mlp(norm(x)): token by token, so any tiling of the tokens gives the same result."""
        h = ops.rms_norm(x, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return x + ops.swiglu(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

    def attention(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor],
                  documents: Documents = None) -> torch.Tensor:
        """x + attn(norm(x))."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x, w, rope)
        attn = self._attend(q, k, v, documents).transpose(1, 2).reshape(b, t, self.config.q_size)
        return x + self._output_projection(attn, w)

    def _qkv(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, heads, t, d], k and v [b, kv_heads, t, d] of x [b, t, hidden], q and k rotated: token-wise, so any
        tiling along the sequence (with rope's rows for it) gives the same result."""
        eps = self.config.rms_norm_eps
        h = ops.rms_norm(x, w["input_layernorm.weight"], eps)
        # Qwen3: over head_dim, one weight shared by the heads, before RoPE (as transformers' Qwen3)
        qk_norm = (lambda heads, g: ops.rms_norm(heads, g, eps)) if self.qk_norm else None
        return project_qkv(h, w, self.config, rope, qk_norm)

    def cached(self, x: torch.Tensor, w: Weights, past: KV | None, rope: tuple[torch.Tensor, torch.Tensor],
               sees: torch.Tensor) -> tuple[torch.Tensor, KV]:
        """One step of cached generation: the layer on new tokens x [b, n, hidden] (rope at their positions), their
        queries attending to the earlier tokens' keys and values `past` ([b, kv_heads, p, d] each; None: none) and
        their own; sees [b, 1, n, p + n] bool: which keys each new token attends to (causality, padding, a window).
        Returns (the layer's output, the new tokens' (k, v)); what keeps them is the caller's."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x, w, rope)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        attn = ops.masked_attention(q, keys, values, sees).transpose(1, 2).reshape(b, n, self.config.q_size)
        return self.mlp(x + self._output_projection(attn, w), w), (k, v)

    @staticmethod
    def _output_projection(attn: torch.Tensor, w: Weights) -> torch.Tensor:
        return F.linear(attn, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))


def project_qkv(h: torch.Tensor, w: Weights, c: ModelConfig, rope: tuple[torch.Tensor, torch.Tensor],
                qk_norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, heads, t, d], k and v [b, kv_heads, t, d] from a layer's normed input h [b, t, hidden]: the q/k/v
    projections (biases where `w` has them), qk_norm(head vectors, weight) on q and k where given (the family's
    norm, before RoPE), then RoPE on q and k."""
    b, t, _ = h.shape
    q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
    k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
    v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
    q = q.view(b, t, c.num_heads, c.head_dim)
    k = k.view(b, t, c.num_kv_heads, c.head_dim)
    if qk_norm is not None:
        q, k = qk_norm(q, w["self_attn.q_norm.weight"]), qk_norm(k, w["self_attn.k_norm.weight"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    cos, sin = rope
    return ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin), v


def _subset(w: Weights, prefixes: tuple[str, ...] | str = (), exclude: tuple[str, ...] = ()) -> Weights:
    """The weights named with one of `prefixes` (all where none given), less those named with one of `exclude`."""
    return {n: t for n, t in w.items() if (not prefixes or n.startswith(prefixes)) and not n.startswith(exclude)}


def _rope_rows(rope: tuple[torch.Tensor, torch.Tensor], tile: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables' rows of one tile of positions ([seq, d] tables, or [batch, 1, seq, d] for packed rows)."""
    cos, sin = rope
    return cos[..., tile, :], sin[..., tile, :]


def embed(rows: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
    """Embedding lookup from the gathered rows a batch uses: rows [u, h], row_index [b, t] into rows."""
    return F.embedding(row_index, rows)


def embed_backward(grad_x: torch.Tensor, row_index: torch.Tensor, num_rows: int, into: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Gradient of the gathered rows: scatter-add of the token gradients, [u, h]; into: the gradient so far (earlier
    micro-batches'), added to in place where a new one would start from zero."""
    grad_rows = grad_x.new_zeros(num_rows, grad_x.shape[-1]) if into is None else into
    return grad_rows.index_add_(0, row_index.reshape(-1), grad_x.reshape(-1, grad_x.shape[-1]))


def recompute_grads(fn: Callable[..., Any], x: torch.Tensor, weights: Weights, grad_out: Grads,
                    *args: object, trainable: Trainable | None = None, bind: Bind | None = None
                    ) -> tuple[torch.Tensor, Weights]:
    """Reruns fn(x, weights, *args) with grad and returns (dL/dx, {name: dL/dw}). A weight the computation did not
    use (an MoE expert no token of this batch was routed to) has a zero gradient. trainable: the weights whose
    gradients are taken and returned (None: all); the others are frozen, read detached. bind: fn reads
    bind(weights), made from the leaves inside the recompute, instead of the weights themselves."""
    x = x.detach().requires_grad_(True)
    leaves, learned = weight_leaves(weights, trainable)
    with torch.enable_grad():
        y = fn(x, leaves if bind is None else bind(leaves), *args)
    grads = torch.autograd.grad(y, [x, *(leaves[n] for n in learned)], grad_out, allow_unused=True,
                                materialize_grads=True)
    return grads[0], dict(zip(learned, grads[1:], strict=True))


def weight_leaves(weights: Weights, trainable: Trainable | None = None) -> tuple[Weights, list[str]]:
    """The weights detached, the trainable ones (all where None) as fresh autograd leaves, in their order; and the
    trainable ones' names."""
    learned = [n for n in weights if trainable is None or trainable(n)]
    wanted = set(learned)
    return {n: w.detach().requires_grad_(n in wanted) for n, w in weights.items()}, learned


@dataclass(frozen=True)
class HeadOptions:
    """head_loss_and_grads' keywords."""

    # the targets on the host (None: `targets` are there), read to count and skip chunks without waiting for the device
    host_targets: torch.Tensor | None = None
    softcap: float | None = None  # the logits capped, cap * tanh(logits / cap)
    # the loss is the targets' sum over n_valid (a micro-batch's share of a whole batch's mean); None: their mean
    n_valid: int | None = None
    # the weight gradients of earlier micro-batches (fp32), added to rather than made anew
    grads_into: tuple[Weights, torch.Tensor | None] | None = None
    # the model's own map from normed hidden states to logits (the generic path: a bias, a logit scale, soft-capping),
    # given lm_head's weight and the head's weights not named "norm.*"; each chunk then runs under autograd
    logits: LogitsFn | None = None
    weight_grads: bool = True  # False: the head's weights are frozen (a LoRA run's); they come back as ({}, None)
    # a chunk's loss and logits' gradient, given the scale 1 / n_valid as a 0-d tensor on the device (a number would
    # be baked into a compiled graph, and n_valid changes every step)
    cross_entropy: CrossEntropyFn = ops.cross_entropy_sum_and_grad


def head_loss_and_grads(x: torch.Tensor, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor],
                        norm_weights: Weights, lm_head: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        **options: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[Weights, torch.Tensor | None]]:
    """Final norm + lm_head + mean cross-entropy, forward and backward at once, in token chunks.

    Never holds more than [chunk_tokens, vocab] logits, nor a [vocab, hidden] tensor beside the lm_head's
    gradient: each chunk's share is added into it from the logits' gradient. final_norm(x, norm_weights) is the
    model's norm before the head; targets are on x's device. Returns (loss, dL/dx, ({name: dL/d norm weight},
    dL/d lm_head)); the loss is the mean over targets that are not IGNORE_INDEX, as transformers computes it.
    options: HeadOptions.
    """
    o = HeadOptions(**options)
    host_targets, n_valid, grads_into, weight_grads = o.host_targets, o.n_valid, o.grads_into, o.weight_grads
    flat_x = x.reshape(-1, x.shape[-1])
    flat_t = targets.reshape(-1)
    host_t = flat_t if host_targets is None else host_targets.reshape(-1)
    if n_valid is None:
        n_valid = ops.labelled_tokens(host_t)
    if n_valid == 0:
        raise MegatrainError("this batch has no tokens to train on (every label is -100); check the loss mask.")
    loss = torch.zeros((), dtype=torch.float32, device=flat_x.device)
    scale = torch.full((), 1.0 / n_valid, dtype=torch.float32, device=flat_x.device)  # a fill: no copy, no sync
    grad_x = torch.zeros_like(flat_x)
    # summed over chunks in fp32 whatever the compute dtype: bf16 sums would round at every chunk
    if grads_into is not None:
        grad_norm, grad_head = grads_into
    elif weight_grads:
        grad_norm = {name: torch.zeros_like(w, dtype=torch.float32) for name, w in norm_weights.items()}
        grad_head = torch.zeros_like(lm_head, dtype=torch.float32)
    else:
        grad_norm, grad_head = {}, None
    norm_leaves = {name: w.detach().requires_grad_(weight_grads) for name, w in norm_weights.items()}
    for start in range(0, flat_x.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        if not bool((host_t[chunk] != ops.IGNORE_INDEX).any()):
            continue  # nothing to learn here (prompt or padding): its gradient is zero
        xc = flat_x[chunk].detach().requires_grad_(True)
        if o.logits is not None:
            chunk_loss, gx = chunk_through(o.logits, final_norm, xc, norm_leaves, lm_head, flat_t[chunk],
                                           partial(_cross_entropy_objective, scale=1.0 / n_valid), grad_norm,
                                           grad_head)
        else:
            chunk_loss, gx = chunk_backward(xc, final_norm, norm_leaves, lm_head, flat_t[chunk],
                                            partial(o.cross_entropy, scale=scale, softcap=o.softcap), grad_norm,
                                            grad_head)
        loss += chunk_loss
        grad_x[chunk] = gx
    return loss / n_valid, grad_x.view_as(x), (grad_norm, grad_head)


def next_token_logits(x: torch.Tensor, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor],
                      norm_weights: Weights, lm_head: torch.Tensor, softcap: float | None = None,
                      logits: LogitsFn | None = None) -> torch.Tensor:
    """fp32 logits [n, vocab] of the last layer's output at n positions [n, hidden], as head_loss_and_grads makes
    them: the final norm, then the lm_head (capped where softcap is set), or the model's own `logits` (the generic
    path's) given lm_head's weight and the head's other weights."""
    hidden = final_norm(x, {n: w for n, w in norm_weights.items() if n.startswith("norm.")})
    if logits is not None:
        others = {n: w for n, w in norm_weights.items() if not n.startswith("norm.")}
        return logits(hidden, {"lm_head.weight": lm_head, **others}).float()
    z = F.linear(hidden, lm_head).float()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


# (hidden [n, h], lm_head, targets [n]) -> (the chunk's value, its gradient wrt the fp32 logits [n, vocab])
LogitsGradFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (logits [n, vocab] under autograd, targets [n]) -> (the chunk's value to report, the scalar to differentiate)
ObjectiveFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_backward(xc: torch.Tensor, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor], leaves: Weights,
                   lm_head: torch.Tensor, targets: torch.Tensor, logits_grad: LogitsGradFn, grad_weights: Weights,
                   grad_head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the native head, backward from the logits' gradient in closed form (`logits_grad`): (its value,
    the gradient wrt the chunk xc); the lm_head's share added into grad_head ([vocab, h], no second one made) and the
    final norm's into grad_weights (leaves that require no grad, and grad_head None: frozen, not asked)."""
    weight_grads = grad_head is not None
    with torch.enable_grad():
        normed = final_norm(xc, leaves)
    hidden = normed.detach()
    value, grad_logits = logits_grad(hidden, lm_head, targets)
    if grad_head is not None:
        grad_head.addmm_(grad_logits.t(), hidden.float())
    grad_hidden = grad_logits.to(lm_head.dtype) @ lm_head
    del grad_logits
    gx, *gn = torch.autograd.grad(normed, [xc, *(leaves.values() if weight_grads else ())], grad_hidden)
    for name, g in zip(leaves if weight_grads else (), gn, strict=True):
        grad_weights[name] += g
    return value, gx


LogitsFn = Callable[[torch.Tensor, Weights], torch.Tensor]  # (normed hidden [n, h], head weights) -> logits [n, vocab]
# (hidden [n, h], lm_head, targets [n], scale, softcap) -> (summed loss, scale x its gradient wrt the fp32 logits)
CrossEntropyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float | None],
                          tuple[torch.Tensor, torch.Tensor]]


def chunk_logits(logits: LogitsFn, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor], xc: torch.Tensor,
                 leaves: Weights, lm_head: torch.Tensor) -> torch.Tensor:
    """One chunk's fp32 logits [n, vocab] through the model's own head (the generic path), under whatever grad mode
    the caller runs: the final norm (the head's weights named "norm.*"), then `logits` with the others."""
    norm = {name: w for name, w in leaves.items() if name.startswith("norm.")}
    others = {name: w for name, w in leaves.items() if not name.startswith("norm.")}
    z = logits(final_norm(xc, norm), {"lm_head.weight": lm_head, **others}).float()
    return z.reshape(-1, z.shape[-1])


def chunk_through(logits: LogitsFn, final_norm: Callable[[torch.Tensor, Weights], torch.Tensor], xc: torch.Tensor,
                  leaves: Weights, lm_head: torch.Tensor, targets: torch.Tensor, objective: ObjectiveFn,
                  grad_weights: Weights, grad_head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through the model's own logits, under autograd: (the objective's value, the gradient of what it
    differentiates wrt the chunk); the head's weights' gradients added into grad_weights and grad_head (None:
    frozen, not asked)."""
    frozen = grad_head is None
    head = lm_head.detach().requires_grad_(not frozen)
    with torch.enable_grad():
        value, differentiated = objective(chunk_logits(logits, final_norm, xc, leaves, head), targets)
    if frozen:
        return value.detach(), torch.autograd.grad(differentiated, [xc])[0]
    gx, gh, *gw = torch.autograd.grad(differentiated, [xc, head, *leaves.values()], allow_unused=True,
                                      materialize_grads=True)
    grad_head += gh.float()
    for name, g in zip(leaves, gw, strict=True):
        grad_weights[name] += g
    return value.detach(), gx


def _cross_entropy_objective(z: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of a chunk's logits, and scale x it to differentiate."""
    loss = F.cross_entropy(z, targets, ignore_index=ops.IGNORE_INDEX, reduction="sum")
    return loss, loss * scale
