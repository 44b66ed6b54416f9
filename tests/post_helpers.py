"""What the post-training tests share (test_token_loss, test_dpo, test_grpo): transformers' per-token log-probs under
autograd, and its training on a loss of them with torch.optim.AdamW, in fp32 and in fp64 (the exact run both fp32
runs are judged against), as tests/helpers.py's hf_reference does for cross-entropy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import max_rel
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

# (ids, labels, fields) of one step
Step = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1, total_steps=4)


def hf_logprobs(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-softmax of logits / temperature gathered at the labels, and each position's entropy, aligned
    with the labels (0 at position 0 and where the label is -100), in the model's dtype; under autograd."""
    logp = torch.log_softmax(hf(input_ids=ids, use_cache=False).logits / temperature, dim=-1)[:, :-1]
    target = labels[:, 1:]
    valid = target != -100
    picked = logp.gather(2, target.clamp_min(0).unsqueeze(2)).squeeze(2) * valid
    entropy = -(logp.exp() * logp).sum(-1) * valid
    zero = torch.zeros(ids.shape[0], 1, dtype=logp.dtype)
    return torch.cat([zero, picked], 1), torch.cat([zero, entropy], 1)


LossOf = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def hf_train(hf_dir: Path, steps: list[Step], loss: LossOf, dtype: torch.dtype = torch.float32,
             max_grad_norm: float | None = 1.0, temperature: float = 1.0, optim: dict[str, Any] = OPTIM,
             scale: float = 1.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' model trained on `loss` of its log-probs by torch.optim.AdamW (norms and biases not decayed) on
    HF's cosine schedule, as the Engine's defaults; fields cast to `dtype`. Parameters returned in fp32. scale: the
    loss differentiated is scaled by it (1 +- 2^-20: the same training, rounded differently; AdamW and clipping
    take the scale out), the losses returned are not."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=dtype)
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("norm.weight") or n.endswith(".bias")]
    decay = [p for n, p in named if not (n.endswith("norm.weight") or n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=optim["lr"], betas=optim["betas"], eps=optim["eps"])
    sched = get_cosine_schedule_with_warmup(opt, optim["warmup_steps"], optim["total_steps"])
    losses = []
    for ids, labels, fields in steps:
        logp, entropy = hf_logprobs(model, ids, labels, temperature)
        value = loss(logp, entropy, {k: v.to(dtype) if v.is_floating_point() else v for k, v in fields.items()})
        (value * scale).backward()
        losses.append(value.item())
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, {n: p.detach().float().clone() for n, p in named}


def assert_trains_as_transformers(ours: tuple[list[float], dict[str, torch.Tensor]], hf_dir: Path,
                                  steps: list[Step], loss: LossOf, **options: Any) -> None:
    """megatrain's losses within 1e-5 of the fp64 run's, and its parameters as close to that run's as transformers'
    fp32 runs are (twice the farthest of three whose roundings differ: the loss scaled by 1 and 1 +- 2^-20, as
    megatrain/self_check.py judges; or 1e-5). A clipped surrogate's kinks amplify rounding, so one run's distance
    is no measure of it."""
    exact_losses, exact = hf_train(hf_dir, steps, loss, torch.float64, **options)
    assert ours[0] == pytest.approx(exact_losses, rel=1e-5, abs=1e-6)
    runs = [hf_train(hf_dir, steps, loss, scale=s, **options)[1] for s in (1.0, 1.0 + 2**-20, 1.0 - 2**-20)]
    assert ours[1].keys() == exact.keys()
    mine = max_rel(ours[1], exact)
    theirs = {n: max(max_rel(run, exact)[n] for run in runs) for n in exact}
    too_far = {n: (e, theirs[n]) for n, e in mine.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"
