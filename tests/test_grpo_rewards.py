"""A reward function's None as TRL's GRPOTrainer treats it (trl 1.16.0): the rewards of a rollout batch whose functions
return None for some completions, and for some every function does, scored by megatrain (pipelines/grpo.py: score)
and by TRL's own GRPOTrainer._calculate_rewards (called on a stand-in for the trainer: the attributes it reads), then
the weighted sum, the advantages (each scale) and the logged metrics against grpo_trainer.py L2756-2830
(_generate_and_score_completions, sum_then_normalize: those lines are inline in a method that generates, so they are
replayed here line for line with trl's own nanstd): an unscorable completion is NaN, left out of its group's mean and
std, its advantage 0; a group with one scored completion has a NaN std and advantages 0."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from accelerate import PartialState
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from megatrain.post.grpo import SCALE_REWARDS, group_advantages, reward_metrics
from pipelines.grpo import score

GROUP = 3
# 3 prompts x GROUP completions: group 0 has one completion no function scores, group 1 only one scored completion,
# group 2 a None from one function
COMPLETIONS = ["none", "ab", "abc", "none", "none", "abcd", "a", "halfabc", "abcdef"]


def length(prompts: list, completions: list[str], **columns: object) -> list[float | None]:
    return [None if c == "none" else float(len(c)) for c in completions]


def has_b(prompts: list, completions: list[str], answer: list[int], **columns: object) -> list[float | None]:
    return [None if c == "none" or c.startswith("half") else float("b" in c) + 0.1 * a
            for c, a in zip(completions, answer, strict=True)]


def trl_rewards(records: list[dict], completions: list[str]) -> torch.Tensor:
    """TRL's _calculate_rewards on a stand-in for the trainer (what the method reads of it)."""
    PartialState()  # accelerate's logging (TRL's warning on an unscorable row) needs its state
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[length, has_b], reward_processing_classes=[None, None], reward_func_names=["length", "has_b"],
        state=types.SimpleNamespace(global_step=0), args=types.SimpleNamespace(report_to=[]),
        _log_completion_extra=None, _log_metric=None, environments=None)
    return GRPOTrainer._calculate_rewards(trainer, records, [r["prompt"] for r in records], completions,
                                          [[1]] * len(records))


def trl_advantages(per_func: torch.Tensor, weights: torch.Tensor, scale: str) -> tuple[torch.Tensor, dict]:
    """grpo_trainer.py L2759-2810 and L2821-2830 (sum_then_normalize), line for line."""
    unscorable_mask = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    if scale in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    metrics = {}
    for i, name in enumerate(["length", "has_b"]):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    logged = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable_mask] = torch.nan
    metrics |= {"reward": torch.nanmean(logged).item(), "reward_std": nanstd(logged).item(),
                "frac_reward_zero_std": is_std_zero.float().mean().item()}
    return advantages, metrics


def test_none_rewards_are_trls(caplog: pytest.LogCaptureFixture) -> None:
    records = [{"prompt": f"p{i // GROUP}", "answer": i} for i in range(len(COMPLETIONS))]
    weights = torch.tensor([0.5, 2.0])
    with caplog.at_level(logging.WARNING, logger="pipelines.grpo"):
        per_func, rewards = score([length, has_b], weights, records, COMPLETIONS, [[1]] * len(records))
    assert "All reward functions returned None" in caplog.text  # as TRL warns
    want = trl_rewards(records, COMPLETIONS)
    assert torch.equal(torch.isnan(per_func), torch.isnan(want)) and torch.isnan(want[0]).all()
    assert torch.equal(per_func.nan_to_num(), want.nan_to_num())
    trl_sum = (want * weights.unsqueeze(0)).nansum(dim=1)  # L2763-2764
    trl_sum[torch.isnan(want).all(dim=1)] = torch.nan
    assert torch.equal(rewards.isnan(), trl_sum.isnan()) and torch.equal(rewards.nan_to_num(), trl_sum.nan_to_num())
    for scale in SCALE_REWARDS:
        trl_adv, trl_metrics = trl_advantages(want, weights, scale)
        ours = group_advantages(rewards, GROUP, scale)
        assert torch.equal(ours, trl_adv), (scale, ours, trl_adv)
        assert not ours.isnan().any() and (ours[[0, 3, 4, 5]] == 0).all()  # unscorable; a group of one scored
        got = reward_metrics(per_func, rewards, ["length", "has_b"], GROUP, scale)
        assert got.keys() == trl_metrics.keys()
        assert all(got[k] == pytest.approx(v, rel=1e-6, nan_ok=True) for k, v in trl_metrics.items()), (got,
                                                                                                        trl_metrics)
