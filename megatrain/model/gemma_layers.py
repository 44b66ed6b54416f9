"""Gemma 2 and Gemma 3's decoder layer as the executor runs it (the family, its config.json in and out: gemma.py).

Both halves are normed around: x + post_attention_norm(attn(input_norm(x))), then x + post_feedforward_norm(mlp(
pre_feedforward_norm(x))), every RMSNorm scaling by (1 + w) in fp32, the MLP gated by GELU's tanh approximation;
attention scores scaled by query_pre_attn_scalar ** -0.5, optionally soft-capped, sliding layers attending to a
window; Gemma 3's per-head (1 + w) RMSNorm on q and k before RoPE.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatrain.config import ModelConfig
from megatrain.model import ops
from megatrain.model.templates import (
    KV,
    Bind,
    Documents,
    Trainable,
    Weights,
    project_qkv,
    recompute_grads,
    weight_leaves,
)

MLP_WEIGHTS = ("pre_feedforward_layernorm.", "mlp.", "post_feedforward_layernorm.")  # the token-wise second half


class GemmaLayer:
    """x -> x + post_norm(attn(norm(x))) -> x + post_norm(mlp(pre_norm(x))); one instance per attention kind
    (sliding, full) serves all layers of that kind: fn(x, weights, rope, documents).

    tile_tokens: the MLP half runs over tiles of that many tokens, in the forward and in `backward`, so no
    [tokens, intermediate] tensor exists whole; attention runs over the whole sequence."""

    def __init__(self, config: ModelConfig, window: int | None, scale: float, softcap: float | None):
        self.config = config
        self.qk_norm = config.qk_norm  # read once: the family lookup behind it is no part of a compiled graph
        self.window, self.scale, self.softcap = window, scale, softcap
        self.tile_tokens: int | None = None

    def __call__(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor], documents: Documents = None
                 ) -> torch.Tensor:
        x = self.attention(x, w, rope, documents)
        if self.tile_tokens is None or torch.is_grad_enabled():
            return self.mlp(x, w)
        out = torch.empty_like(x)
        flat_in, flat_out = x.view(-1, x.shape[-1]), out.view(-1, x.shape[-1])
        for start in range(0, flat_in.shape[0], self.tile_tokens):
            tile = slice(start, start + self.tile_tokens)
            flat_out[tile] = self.mlp(flat_in[tile], w)
        return out

    def backward(self, x: torch.Tensor, w: Weights, grad_out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 documents: Documents = None, *, trainable: Trainable | None = None, bind: Bind | None = None
                 ) -> tuple[torch.Tensor, Weights]:
        """(dL/dx, {name: dL/dw}) by recomputing the layer from x: the attention half once under autograd, the MLP
        half tile by tile (its weight gradients summed in fp32 over the tiles), then the attention half's gradients
        from the MLP's input gradient. trainable, bind: as templates.recompute_grads (the weights whose gradients are
        taken, None: all; what the math reads of the weights, None: them)."""
        attn_w = {n: t for n, t in w.items() if not n.startswith(MLP_WEIGHTS)}
        mlp_w = {n: t for n, t in w.items() if n.startswith(MLP_WEIGHTS)}
        x = x.detach().requires_grad_(True)
        attn_leaves, attn_learned = weight_leaves(attn_w, trainable)
        with torch.enable_grad():
            mid = self.attention(x, attn_leaves if bind is None else bind(attn_leaves), rope, documents)
        flat_mid, flat_grad = mid.detach().view(-1, mid.shape[-1]), grad_out.reshape(-1, mid.shape[-1])
        grad_mid = torch.empty_like(flat_mid)
        mlp_grads = {n: torch.zeros_like(t, dtype=torch.float32) for n, t in mlp_w.items()
                     if trainable is None or trainable(n)}
        tile_tokens = self.tile_tokens or flat_mid.shape[0]
        for start in range(0, flat_mid.shape[0], tile_tokens):
            tile = slice(start, start + tile_tokens)
            grad_mid[tile], tile_grads = recompute_grads(self.mlp, flat_mid[tile], mlp_w, flat_grad[tile],
                                                         trainable=trainable, bind=bind)
            for n, g in tile_grads.items():
                mlp_grads[n] += g
        grads = torch.autograd.grad(mid, [x, *(attn_leaves[n] for n in attn_learned)], grad_mid.view_as(mid))
        attn_grads = dict(zip(attn_learned, grads[1:], strict=True))
        return grads[0], {n: attn_grads[n] if n in attn_grads else mlp_grads[n] for n in w
                          if n in attn_grads or n in mlp_grads}

    def mlp(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        """x + post_norm(mlp(pre_norm(x))): token by token, so any tiling of the tokens gives the same result."""
        eps = self.config.rms_norm_eps
        h = ops.gemma_rms_norm(x, w["pre_feedforward_layernorm.weight"], eps)
        h = ops.gelu_tanh_mlp(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        return x + ops.gemma_rms_norm(h, w["post_feedforward_layernorm.weight"], eps)

    def attention(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor],
                  documents: Documents = None) -> torch.Tensor:
        """x + post_norm(attn(norm(x)))."""
        q, k, v = self._qkv(x, w, rope)
        attn = ops.windowed_attention(q, k, v, documents, window=self.window, scale=self.scale, softcap=self.softcap)
        return self._output(x, attn, w)

    def cached(self, x: torch.Tensor, w: Weights, past: KV | None, rope: tuple[torch.Tensor, torch.Tensor],
               sees: torch.Tensor) -> tuple[torch.Tensor, KV]:
        """One step of cached generation, as templates.DecoderLayer.cached: (the layer's output on new tokens x, their
        (k, v)), attending to the earlier keys and values `past` and their own where `sees` says (the window in it)."""
        q, k, v = self._qkv(x, w, rope)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        attn = ops.masked_attention(q, keys, values, sees, scale=self.scale, softcap=self.softcap)
        return self.mlp(self._output(x, attn, w), w), (k, v)

    def _qkv(self, x: torch.Tensor, w: Weights, rope: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        eps = self.config.rms_norm_eps
        h = ops.gemma_rms_norm(x, w["input_layernorm.weight"], eps)
        # Gemma 3: over head_dim, one weight shared by the heads, before RoPE
        qk_norm = (lambda heads, g: ops.gemma_rms_norm(heads, g, eps)) if self.qk_norm else None
        return project_qkv(h, w, self.config, rope, qk_norm)

    def _output(self, x: torch.Tensor, attn: torch.Tensor, w: Weights) -> torch.Tensor:
        """x + post_norm(o_proj(attn)), attn [b, heads, t, d]."""
        b, t, _ = x.shape
        out = F.linear(attn.transpose(1, 2).reshape(b, t, self.config.q_size), w["self_attn.o_proj.weight"],
                       w.get("self_attn.o_proj.bias"))
        return x + ops.gemma_rms_norm(out, w["post_attention_layernorm.weight"], self.config.rms_norm_eps)


class GemmaBatch:
    """Each layer gets its kind's rotary (cos, sin) and the packed documents; nothing is added to the loss."""

    def __init__(self, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], types: list[str], documents: Documents):
        self.ropes, self.types, self.documents = ropes, types, documents

    def layer_args(self, index: int) -> tuple[Any, ...]:
        return (self.ropes[self.types[index]], self.documents)

    def forward_done(self) -> torch.Tensor | None:
        return None


class GemmaCachedBatch:
    """A cached generation step's: each layer gets its kind's rotary tables at the new tokens' positions and the keys
    they see within its kind's window."""

    def __init__(self, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], types: list[str],
                 sees: dict[str, torch.Tensor]):
        self.ropes, self.types, self.sees = ropes, types, sees

    def layer_args(self, index: int) -> tuple[Any, ...]:
        kind = self.types[index]
        return (self.ropes[kind], self.sees[kind])


class GemmaArchitecture:
    """Gemma 2 / 3's decoder: a GemmaLayer per attention kind (sliding, full), scaled embeddings, (1 + w) final norm,
    capped logits. What each kind is (its window, its rotary's config) the family reads from config.json
    (gemma.py: GemmaFamily.architecture); `types` is each layer's kind."""

    def __init__(self, config: ModelConfig, types: list[str], windows: dict[str, int | None],
                 rope_configs: dict[str, ModelConfig], scale: float, softcap: float | None,
                 logit_softcap: float | None):
        self.config, self.types, self.rope_configs = config, types, rope_configs
        self.embed_scale = config.hidden_size ** 0.5
        self.logit_softcap = logit_softcap
        self.templates = {kind: GemmaLayer(config, window, scale, softcap) for kind, window in windows.items()}
        self._rope: dict[tuple[str, int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(self, batch_size: int, seq: int, device: torch.device, dtype: torch.dtype,
              position_ids: torch.Tensor | None = None) -> GemmaBatch:
        documents = None if position_ids is None else ops.document_starts(position_ids)
        packed = position_ids is not None and not torch.equal(position_ids,
                                                               torch.arange(seq).expand_as(position_ids))
        ropes = {}
        for kind in set(self.types):
            rope_config = self.rope_configs[kind]
            if packed:
                ropes[kind] = ops.rope_cos_sin(rope_config, seq, device, dtype, position_ids)
                continue
            key = (kind, seq, device, dtype)
            if key not in self._rope:
                self._rope[key] = ops.rope_cos_sin(rope_config, seq, device, dtype)
            ropes[kind] = self._rope[key]
        return GemmaBatch(ropes, self.types, documents)

    def cached_batch(self, positions: torch.Tensor, key_positions: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> GemmaCachedBatch:
        """Generation's (architecture.py)."""
        positions, key_positions = positions.to(device), key_positions.to(device)
        ropes, sees = {}, {}
        for kind in set(self.types):
            ropes[kind] = ops.rope_cos_sin(self.rope_configs[kind], positions.shape[1], device, dtype,
                                           positions.clamp_min(0))
            sees[kind] = ops.cached_sees(positions, key_positions, self.templates[kind].window)
        return GemmaCachedBatch(ropes, self.types, sees)

    def cached_layer(self, index: int) -> Any:
        return self.templates[self.types[index]].cached

    def tile(self, tile_tokens: int) -> None:
        for template in self.templates.values():
            template.tile_tokens = tile_tokens

    def layer(self, index: int) -> GemmaLayer:
        return self.templates[self.types[index]]

    def final_norm(self, x: torch.Tensor, weights: Weights) -> torch.Tensor:
        return ops.gemma_rms_norm(x, weights["norm.weight"], self.config.rms_norm_eps)
