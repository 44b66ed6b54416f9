"""Pure tensor functions of a Llama-family decoder. No state, no modules, no knowledge of streams.

Numerics follow HF transformers' Llama so fp32 results match it to rounding: RMSNorm in fp32 then cast
back, rotary cos/sin computed in fp32, attention by SDPA.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.config import MegatrainError, ModelConfig

IGNORE_INDEX = -100
# enable_gqa arrived in torch 2.5; older versions get the kv heads repeated
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by (1 + weight) while still in fp32, then cast back (Llama casts before scaling, so
    the two round differently in bf16); its weights start at 0."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":  # Llama 3.1's frequency-dependent stretch
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(config: ModelConfig, seq_len: int, device: torch.device | str, dtype: torch.dtype,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, head_dim] for positions 0..seq-1, or [batch, 1, seq, head_dim] for the given
    positions [batch, seq] (packed documents, each from 0)."""
    if positions is None:
        positions = torch.arange(seq_len, device=device, dtype=torch.float)
    else:
        positions = positions.to(device=device, dtype=torch.float)[:, None]
    freqs = positions[..., None] * rope_inv_freq(config).to(device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] bool on position_ids' device (the host): True where a packed document begins, wherever a position
    is not its predecessor's plus one (as transformers reads packed position_ids); None when every row is one
    document. A tensor, not a list of spans: a compiled layer takes it as an input, so a new packing runs the same
    graph instead of compiling another (PackedAttention)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts if bool(starts[:, 1:].any()) else None


def document_spans(starts: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) token ranges of the documents that `starts` (document_starts) begins."""
    seq = starts.shape[1]
    spans = []
    for row in starts.cpu():
        first = row.nonzero().flatten().tolist()
        spans.append(list(zip(first, first[1:] + [seq], strict=True)))
    return spans


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """q: [b, heads, t, d]; k, v: [b, kv_heads, t, d] (grouped-query when kv_heads < heads). starts: where the
    documents packed in each row begin (document_starts); each attends within itself only, by SDPA over its own
    tokens: no [t, t] mask is ever made, so long packed rows keep the fused kernels."""
    if starts is not None:
        return packed_attention(q, k, v, starts)
    groups = q.shape[1] // k.shape[1]
    # enable_gqa only where a fused kernel takes it: on CUDA the flash kernel (half precision only) does, the
    # memory-efficient one (fp32's) does not, and SDPA would fall back to the math kernel, which materialises
    # [b, heads, t, t] scores (4 GiB per layer at 8 x 2048 tokens). Expanding k and v costs far less.
    if groups > 1 and _SDPA_HAS_GQA and q.dtype in (torch.float16, torch.bfloat16):
        return _fused_sdpa(q, k, v, enable_gqa=True)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return _fused_sdpa(q, k, v)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, *,
                     scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of queries q [b, heads, n, d] over keys and values [b, kv_heads, m, d] (grouped-query when kv_heads <
    heads) where sees [b, 1, n, m] is True: a cached generation step's, whose new tokens attend to earlier ones. scale
    and softcap as windowed_attention's (Gemma's)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=scale)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~sees, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(q.dtype), v)


def cached_sees(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None
                ) -> torch.Tensor:
    """[b, 1, n, m] bool: which of m keys each of n new tokens attends to, given each row's positions of the new tokens
    [b, n] and of all keys so far [b, m], the new ones last (-1: padding, never attended to): the keys at its position
    or before (within `window` positions where set, as a sliding window counts them). A padding token attends to its
    own key alone, so that no row of its attention is empty (its output is never read)."""
    q, k = query_positions[:, None, :, None], key_positions[:, None, None, :]
    sees = (k >= 0) & (k <= q)
    if window is not None:
        sees &= q - k < window
    n, m = query_positions.shape[1], key_positions.shape[1]
    own = torch.zeros(n, m, dtype=torch.bool, device=sees.device)
    own[:, m - n:] = torch.eye(n, dtype=torch.bool, device=sees.device)
    return sees | (own & (q < 0))


# query rows per block of windowed or soft-capped attention: its scores are at most [b, heads, this, this + window]
ATTENTION_BLOCK = 1024


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None = None, *,
                       window: int | None = None, scale: float | None = None, softcap: float | None = None
                       ) -> torch.Tensor:
    """causal_attention with Gemma's options. window: a token attends to itself and the window - 1 tokens before it
    (transformers' sliding window; None: all before it); scale: the scores' factor (None: head_dim ** -0.5);
    softcap: scores -> softcap * tanh(scores / softcap) before masking (Gemma 2). Packed documents (starts) attend
    within themselves, the window counted from each token's own position, as transformers reads packed positions.

    Plain causal attention (no cap, a window no shorter than the sequence) runs in SDPA's fused kernels. Otherwise
    blocks of ATTENTION_BLOCK query rows attend to the keys their window reaches: SDPA with a [block, keys] mask, or
    with a soft-cap, which no fused kernel computes, written out as transformers' eager attention is (scores, cap,
    fp32 softmax). A capped full-attention layer keeps O(t^2) scores for its backward, so on a GPU it is refused
    from FUSED_ONLY_TOKENS tokens on, as the math kernel is."""
    if starts is not None:
        return packed_attention(q, k, v, starts, window, scale, softcap)
    t = q.shape[2]
    window = None if window is not None and window >= t else window
    groups = q.shape[1] // k.shape[1]
    if softcap is None and window is None:
        if groups > 1 and _SDPA_HAS_GQA and q.dtype in (torch.float16, torch.bfloat16):
            return _fused_sdpa(q, k, v, enable_gqa=True, scale=scale)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return _fused_sdpa(q, k, v, scale=scale)
    if softcap is not None and window is None and q.is_cuda and t >= FUSED_ONLY_TOKENS:
        raise MegatrainError(f"soft-capped attention over {t} tokens (Gemma 2's full-attention layers) has no fused "
                             f"kernel and would keep [heads, {t}, {t}] scores for the backward; train with sequences "
                             f"shorter than {FUSED_ONLY_TOKENS} tokens.")
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    positions = torch.arange(t, device=q.device)
    out = []
    for start in range(0, t, ATTENTION_BLOCK):
        end = min(start + ATTENTION_BLOCK, t)
        first = 0 if window is None else max(0, start - window + 1)  # the first key the block's window reaches
        rows, cols = positions[start:end, None], positions[None, first:end]
        allowed = cols <= rows
        if window is not None:
            allowed &= cols > rows - window
        qb, kb, vb = q[:, :, start:end], k[:, :, first:end], v[:, :, first:end]
        if softcap is None:
            out.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale))
            continue
        scores = torch.matmul(qb, kb.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
        out.append(torch.matmul(probs.to(q.dtype), vb))
    return torch.cat(out, dim=2)


# From this many tokens on, attention on a GPU must run in a fused SDPA kernel (flash, memory-efficient, cuDNN):
# the math kernel's [b, heads, t, t] scores would take 16 GiB per head at 64k tokens in fp32.
FUSED_ONLY_TOKENS = 8192


def _fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: bool | float | None
                ) -> torch.Tensor:
    t = q.shape[2]
    if not q.is_cuda or t < FUSED_ONLY_TOKENS or torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    except RuntimeError:
        raise MegatrainError(f"attention over {t} tokens (head_dim {q.shape[-1]}, {q.dtype}) has no fused SDPA kernel "
                             f"on this GPU and would need the math kernel's [heads, {t}, {t}] scores; train in bf16, "
                             "or with a shorter sequence.") from None


# ---- packed documents under torch.compile ----
# Compiled, the documents' boundaries must stay a tensor: Python ints would be baked into the graph, and every new
# packing would compile it again. SDPA per document needs them as ints, so the per-document loop is a custom op that
# the compiler treats as one opaque call and that reads `starts` when it runs. Its backward is a second such op,
# which reruns the documents' attention under autograd (one attention forward more than eager autograd, on packed
# rows only): a traced backward cannot loop over boundaries it does not know.


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                     window: int | None = None, scale: float | None = None, softcap: float | None = None
                     ) -> torch.Tensor:
    """Attention within each document packed in a row (starts: document_starts), by causal_attention, or
    windowed_attention with the options; under torch.compile as the opaque op megatrain::packed_attention."""
    if torch.compiler.is_compiling():
        return _packed_attention_op(q, k, v, starts, window, scale, softcap)
    return _per_document(q, k, v, starts, window, scale, softcap)


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, window: int | None,
                  scale: float | None, softcap: float | None) -> torch.Tensor:
    plain = window is None and scale is None and softcap is None
    rows = []
    for r, row in enumerate(document_spans(starts)):
        docs = []
        for a, e in row:
            qd, kd, vd = q[r:r + 1, :, a:e], k[r:r + 1, :, a:e], v[r:r + 1, :, a:e]
            docs.append(causal_attention(qd, kd, vd) if plain else
                        windowed_attention(qd, kd, vd, window=window, scale=scale, softcap=softcap))
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)


@torch.library.custom_op("megatrain::packed_attention", mutates_args=())
def _packed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                         window: int | None, scale: float | None, softcap: float | None) -> torch.Tensor:
    # contiguous, as the fake below says: the compiler lays out what reads this output by the fake's strides
    return _per_document(q, k, v, starts, window, scale, softcap).contiguous()


@_packed_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, window: int | None,
      scale: float | None, softcap: float | None) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("megatrain::packed_attention_backward", mutates_args=())
def _packed_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               starts: torch.Tensor, window: int | None, scale: float | None, softcap: float | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    # a custom op runs below autograd (its dispatch keys excluded): let the rerun record a graph again
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.AutogradFunctionality, False), \
            torch.enable_grad():
        out = _per_document(q, k, v, starts, window, scale, softcap)
    return tuple(g.contiguous() for g in torch.autograd.grad(out, [q, k, v], grad))  # type: ignore[return-value]


@_packed_attention_backward.register_fake
def _(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
      window: int | None, scale: float | None, softcap: float | None
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _packed_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, starts, *options = inputs
    ctx.save_for_backward(q, k, v, starts)
    ctx.options = options


def _packed_grads(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, starts = ctx.saved_tensors
    return (*_packed_attention_backward(grad, q, k, v, starts, *ctx.options), None, None, None, None)


_packed_attention_op.register_autograd(_packed_grads, setup_context=_packed_setup)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def gelu_tanh_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: swiglu with GELU's tanh approximation (transformers' gelu_pytorch_tanh) for SiLU."""
    return F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up), down)


def shift_labels(input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Targets aligned with positions, as transformers does: position t predicts labels[t + 1]."""
    source = input_ids if labels is None else labels
    shifted = torch.full_like(source, IGNORE_INDEX)
    shifted[:, :-1] = source[:, 1:]
    return shifted


def labelled_tokens(targets: torch.Tensor) -> int:
    """How many of `targets` carry a label (are not IGNORE_INDEX): the tokens a mean loss is over."""
    return int((targets != IGNORE_INDEX).sum())


def cross_entropy_sum_and_grad(hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor,
                               scale: float | torch.Tensor, softcap: float | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy of one chunk (hidden [n, h], targets [n], IGNORE_INDEX skipped) and the
    gradient of scale * that sum with respect to the fp32 logits: scale * (softmax - onehot) on labelled rows.
    softcap: the logits are capped first, cap * tanh(logits / cap) (Gemma 2), and the gradient taken through it.

    The arithmetic is autograd's for F.cross_entropy (log_softmax, then its backward exp(logp) * scale less
    scale at the target), so results agree with transformers' to the last bit where they can; it is written
    out so that the gradient reuses the log-probabilities' memory: one [n, vocab] fp32 tensor at the peak
    (two with a softcap, whose tanh the gradient needs)."""
    logits = F.linear(hidden, lm_head).float()
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    logp = torch.log_softmax(logits, dim=-1)
    del logits
    valid = (targets != IGNORE_INDEX).to(logp.dtype).unsqueeze(1)
    picked_target = targets.clamp_min(0).unsqueeze(1)  # ignored rows pick column 0; `valid` masks them out
    loss = -(logp.gather(1, picked_target) * valid).sum()
    grad = logp.exp_().mul_(valid * scale)
    grad.scatter_add_(1, picked_target, valid * -scale)
    if capped is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
        grad.mul_(capped.square_().neg_().add_(1.0))
    return loss, grad
