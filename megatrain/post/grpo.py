"""GRPO (Shao et al. 2024) as TRL's GRPOTrainer computes it (trl 1.16.0): group-normalised advantages and the clipped
surrogate with a k3 KL term, per token, aggregated by loss type ("grpo", "bnpo", "dr_grpo", "dapo").

    ratio = exp(logp - old_logp)
    per token: -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL

Rewards' None, the fields a step takes, the aggregations: docs/design.md#grpos-loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.config import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per completion [B] the weighted sum of its rewards [B, F] (NaN where a function returned None) over the
    functions that scored it; NaN where none did (TRL's unscorable_mask)."""
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    return rewards


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Per completion [B] (B = prompts x group_size, each prompt's completions together): its reward less its
    group's mean, over the group's std (scale "group") or the batch's ("batch") plus 1e-4, or not scaled ("none"); the
    means and stds over the scored completions (NaN rewards left out), a NaN advantage 0."""
    if scale not in SCALE_REWARDS:
        raise ConfigError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}.")
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size, dim=0)
    advantages = rewards - mean
    if scale != "none":
        if scale == "group":
            std = nanstd(grouped, dim=1).repeat_interleave(group_size, dim=0) if group_size > 1 else \
                torch.zeros_like(rewards)
        else:
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def reward_metrics(per_func: torch.Tensor, rewards: torch.Tensor, names: list[str], group_size: int,
                   scale: str = "group") -> dict[str, float]:
    """TRL's logged reward metrics of a rollout batch: each function's nanmean and nanstd, the weighted reward's over
    the scored completions, and the share of completions whose group's std (the batch's, scale "batch") is 0."""
    out: dict[str, float] = {}
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, j]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, j]).item()
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, group_size), dim=1).repeat_interleave(group_size, dim=0) if group_size > 1 \
            else torch.zeros_like(rewards)
    out |= {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
            "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    return out


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation over the values that are not NaN, in trl's nanstd's operations (the
    nanmean of squares times n / (n - 1)); NaN where fewer than two are."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


@dataclass(frozen=True)
class GRPOLoss:
    """The clipped surrogate (module doc) on a step's log-probs: Engine.step(loss=GRPOLoss(...), mask=...,
    advantages=..., old_logps=..., ref_logps=...)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_length: int | None = None  # dr_grpo's constant

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}.")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ConfigError("the dr_grpo loss divides by max_completion_length; give it (max_new_tokens).")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0 and self.beta >= 0):
            raise ConfigError("GRPO needs 0 <= epsilon_low < 1, epsilon_high >= 0 and beta >= 0, got "
                              f"{self.epsilon_low}, {self.epsilon_high} and {self.beta}.")

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, fields: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
        per_token, mask, _ = self.per_token(logp, fields)
        if self.loss_type == "grpo":
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        if self.loss_type == "bnpo":
            return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        if self.loss_type == "dr_grpo":
            assert self.max_completion_length is not None
            return (per_token * mask).sum() / (per_token.size(0) * self.max_completion_length)
        num_items = fields.get("num_items", mask.sum())
        return (per_token * mask).sum() / num_items.clamp(min=1.0)

    def per_token(self, logp: torch.Tensor, fields: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the per-token loss, the completion mask, the ratio) as _compute_loss makes them."""
        mask, advantages = fields["mask"], fields["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = fields.get("old_logps", logp.detach())
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if self.beta != 0.0:
            per_token = per_token + self.beta * k3(logp, fields["ref_logps"])
        return per_token, mask, coef_1

    def metrics(self, logp: torch.Tensor, entropy: torch.Tensor | None, fields: dict[str, torch.Tensor]
                ) -> dict[str, float]:
        """TRL's logged GRPO metrics of a batch's log-probs: kl (with reference log-probs), entropy (where given)
        and the clip fractions, each a mean over the completion tokens."""
        with torch.no_grad():
            _, mask, ratio = self.per_token(logp, fields)
            advantages = fields["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
            high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            tokens = mask.sum().clamp(min=1.0)
            out = {"clip_ratio/low_mean": ((low * mask).sum() / tokens).item(),
                   "clip_ratio/high_mean": ((high * mask).sum() / tokens).item(),
                   "clip_ratio/region_mean": (((low | high) * mask).sum() / tokens).item()}
            if "ref_logps" in fields:
                out["kl"] = ((k3(logp, fields["ref_logps"]) * mask).sum() / tokens).item()
            if entropy is not None:
                out["entropy"] = ((entropy * mask).sum() / tokens).item()
            return out


def k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1."""
    return torch.exp(ref - logp) - (ref - logp) - 1
