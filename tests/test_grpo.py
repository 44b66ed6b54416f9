"""GRPO's loss side (megatrain/post/grpo.py) against TRL's code on transformers' model: group-normalised advantages as
GRPOTrainer makes them (trl's own nanstd); the gradients of the clipped surrogate of each loss type (grpo, bnpo,
dr_grpo, dapo; epsilon low and high; the k3 KL term; old log-probs from the sampling policy; a temperature) through
megatrain's chunked head and layers against TRL's per-token log-probs (its fused LM head) and its _compute_loss
(post_helpers.trl_grpo_loss), on a native model (Llama) and the generic path (Phi-3), 1e-5; 3 Engine steps against
transformers + TRL's loss + torch.optim.AdamW judged against fp64; the trainer side in test_grpo_trainer.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import assert_matches, build_hf_model, rel_err
from post_helpers import (
    COMPLETION,
    GROUP,
    MODELS,
    OPTIM,
    TEMPERATURE,
    assert_trains_as_transformers,
    hf_logprobs,
    post_model_case,
    rollout_batch,
    trl_grpo_loss,
    trl_logprobs,
)
from trl.trainer.utils import nanstd

import megatrain
from megatrain.config import ConfigError
from megatrain.engine.token_loss import TokenLoss
from megatrain.post.grpo import LOSS_TYPES, GRPOLoss, group_advantages
from pipelines.logprobs import batch_of

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def test_group_advantages_match_trl() -> None:
    """grpo_trainer.py L2763-2787 (sum_then_normalize): weighted rewards, the group's mean and nanstd."""
    gen = torch.Generator().manual_seed(0)
    per_func, weights = torch.rand(4 * GROUP, 2, generator=gen), torch.tensor([1.0, 0.5])
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    mean = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    for scale in ("group", "batch", "none"):
        std = (nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0) if scale == "group"
               else nanstd(rewards).expand_as(rewards))
        want = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
        assert torch.allclose(group_advantages(rewards, GROUP, scale), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="scale_rewards must be one of"):
        group_advantages(rewards, GROUP, "rank")


model_case = pytest.fixture(scope="module", params=list(MODELS))(post_model_case)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradients_match_trl_loss(model_case, loss_type: str) -> None:
    hf, model = model_case
    ids, labels, fields, trl_inputs = rollout_batch(1, hf)
    beta = BETA if loss_type in ("dapo", "grpo") else 0.0  # with and without the KL term
    loss = GRPOLoss(loss_type, EPS_LOW, EPS_HIGH, beta, max_completion_length=COMPLETION)

    def reference(m: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        per_token_logps = trl_logprobs(m, ids, labels, TEMPERATURE)[0][:, -COMPLETION:]
        inputs = {k: v.to(per_token_logps.dtype) for k, v in trl_inputs.items()}
        value = trl_grpo_loss(per_token_logps, inputs, loss_type, EPS_LOW, EPS_HIGH, beta, COMPLETION)
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    token_loss = TokenLoss(loss, fields, temperature=TEMPERATURE)
    value, grads = model.loss_and_grads(ids, labels, loss=token_loss)
    ours = (value, {k: v.clone() for k, v in grads.items()})
    assert_matches(ours, reference(copy.deepcopy(hf)), reference(copy.deepcopy(hf).double()))
    # TRL's logged metrics, reported with the step's loss: the clip fractions and the KL
    clipped = token_loss.reported["clip_ratio/region_mean"]
    assert 0 < clipped < 1 and token_loss.reported["clip_ratio/low_mean"] > 0
    if beta:
        assert token_loss.reported["kl"] > 0


def test_bad_settings_are_one_sentence() -> None:
    with pytest.raises(ConfigError, match="loss_type must be one of grpo, bnpo, dr_grpo, dapo"):
        GRPOLoss("ppo")
    with pytest.raises(ConfigError, match="divides by max_completion_length"):
        GRPOLoss("dr_grpo")
    with pytest.raises(ConfigError, match="0 <= epsilon_low < 1"):
        GRPOLoss(epsilon_low=1.5)


def test_engine_three_steps_match_trl_loss_and_adamw(ray_session: None, tmp_path: Path) -> None:
    """The Engine on dapo with the KL term, old log-probs and a temperature: its log-probs and entropies of the initial
    weights against transformers' log-softmax (1e-5), then 3 steps against transformers + TRL's log-probs and loss +
    torch.optim.AdamW, judged against fp64 (other loss types: slow); the reference's log-probs after them are the
    initial ones bit for bit (Engine(reference=True): megatrain/engine/reference.py)."""
    _three_steps("dapo", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_engine_three_steps_other_loss_types(ray_session: None, tmp_path: Path, loss_type: str) -> None:
    _three_steps(loss_type, tmp_path)


def _three_steps(loss_type: str, tmp_path: Path) -> None:
    hf = build_hf_model(MODELS["llama"]())
    hf.save_pretrained(tmp_path)
    loss = GRPOLoss(loss_type, EPS_LOW, EPS_HIGH, BETA, max_completion_length=COMPLETION)
    batches = [rollout_batch(10 + seed, hf) for seed in range(3)]
    with megatrain.Engine(tmp_path, optimizer_workers=1, precision="fp32", device="cpu", reference=True,
                          **OPTIM) as engine:
        logp, entropy = engine.logprobs(batches[0][0], batches[0][1], temperature=TEMPERATURE, entropy=True)
        results = [engine.step_batch(batch_of(ids, labels, loss=loss, temperature=TEMPERATURE, entropy=True,
                                              fields=fields)) for ids, labels, fields, _ in batches]
        params = engine.parameters()
        # the KL reference (megatrain/engine/reference.py): after the steps, the initial weights' log-probs bit for bit
        assert engine.run_plan.reference and engine.plan.reference_bytes == 4 * engine.plan.arena_numel
        now = engine.logprobs(batches[0][0], batches[0][1], temperature=TEMPERATURE)
        ref = engine.logprobs(batches[0][0], batches[0][1], temperature=TEMPERATURE, reference=True)
    assert torch.equal(ref, logp) and rel_err(now, logp) > 1e-4
    with torch.no_grad():  # Engine.logprobs of the initial weights: transformers' log-softmax at the labels
        want_logp, want_entropy = hf_logprobs(hf, batches[0][0], batches[0][1], TEMPERATURE)
    assert rel_err(logp, want_logp) <= 1e-5 and rel_err(entropy, want_entropy) <= 1e-5
    assert all({"kl", "entropy", "clip_ratio/region_mean"} <= r.loss_metrics.keys() for r in results)
    losses = [r.loss for r in results]

    def trl_loss(logp: torch.Tensor, entropy: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor:
        return trl_grpo_loss(logp[:, -COMPLETION:], f, loss_type, EPS_LOW, EPS_HIGH, BETA, COMPLETION)

    steps = [(ids, labels, trl_inputs) for ids, labels, _, trl_inputs in batches]
    assert_trains_as_transformers((losses, params), tmp_path, steps, trl_loss, temperature=TEMPERATURE)
