"""DPO (Rafailov et al. 2023) as TRL's DPOTrainer computes it (trl 1.16.0, the "sigmoid" loss type), and its metrics:

    loss = mean over pairs of -logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))

A batch of n pairs is 2n rows, the chosen then the rejected, each prompt then completion (docs/design.md#dpos-loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.config import ConfigError
from megatrain.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class Pair:
    """One preference pair as token ids: the prompt, and the chosen and rejected completions after it."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of its completion tokens' log-probs ([rows, seq] aligned with the labels)."""
    return (logp * mask).sum(-1)


@dataclass(frozen=True)
class DPOLoss:
    """The sigmoid DPO loss on a step's log-probs (Engine.step(loss=DPOLoss(beta), mask=..., ref=...)): fields
    "mask" [2n, seq], 1 on completion tokens, and "ref" [2n], the reference's sequence log-probs, chosen first."""

    beta: float = 0.1

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"DPO's beta must be positive, got {self.beta}.")

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, fields: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
        chosen, rejected = sequence_logps(logp, fields["mask"]).chunk(2, dim=0)
        ref_chosen, ref_rejected = fields["ref"].chunk(2, dim=0)
        delta = (chosen - ref_chosen) - (rejected - ref_rejected)  # dpo_trainer.py: chosen/rejected_logratios
        return -F.logsigmoid(self.beta * delta).mean()

    def metrics(self, logp: torch.Tensor, entropy: torch.Tensor | None, fields: dict[str, torch.Tensor]
                ) -> dict[str, float]:
        """TRL's logged DPO metrics of a batch's log-probs (no gradient)."""
        with torch.no_grad():
            seq = sequence_logps(logp, fields["mask"])
            chosen, rejected = seq.chunk(2, dim=0)
            ref_chosen, ref_rejected = fields["ref"].chunk(2, dim=0)
            chosen_rewards = self.beta * (chosen - ref_chosen)
            rejected_rewards = self.beta * (rejected - ref_rejected)
            return {"rewards/chosen": chosen_rewards.mean().item(),
                    "rewards/rejected": rejected_rewards.mean().item(),
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
                    "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
                    "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}


def encode_pair(row: dict[str, Any], tokenizer: Tokenizer, eos: int | None) -> Pair:
    """A TRL preference record as token ids: "prompt", "chosen", "rejected" as text (the completions end with eos,
    as TRL appends it), or as chat messages (the prompt's turns, then each completion's assistant turns through the
    chat template); or "chosen"/"rejected" conversations alone, whose shared first turns are the prompt."""
    if not isinstance(row, dict) or not {"chosen", "rejected"} <= row.keys():
        raise ConfigError("a preference record needs \"chosen\" and \"rejected\" (and a \"prompt\", or conversations "
                          "that share their first turns), as TRL's DPOTrainer reads them.")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str):
        if not isinstance(prompt, str) or not isinstance(rejected, str):
            raise ConfigError("a text preference record needs \"prompt\", \"chosen\" and \"rejected\" as text.")
        end = [] if eos is None else [eos]
        return Pair(tokenizer.encode(prompt), tokenizer.encode(chosen) + end, tokenizer.encode(rejected) + end)
    if prompt is None:  # implicit prompt: the turns both conversations share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return Pair(*_chat_completions(tokenizer, list(prompt), [list(chosen), list(rejected)]))


def _chat_completions(tokenizer: Tokenizer, prompt: list[dict[str, Any]], completions: list[list[dict[str, Any]]]
                      ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, each completion's ids): each whole conversation through the chat template, the prompt the
    tokens before the completion's first assistant token."""
    out = []
    for completion in completions:
        ids, assistant = tokenizer.apply_chat(prompt + completion)
        start = assistant.index(True) if True in assistant else len(ids)
        out.append((ids[:start], ids[start:]))
    if out[0][0] != out[1][0]:
        raise ConfigError("the chosen and rejected conversations render different prompts; give a \"prompt\".")
    return out[0][0], out[0][1], out[1][1]


def pair_batch(pairs: list[Pair], pad_id: int, max_length: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, completion mask) [2n, seq] of n pairs: the chosen rows then the rejected, right-padded
    with pad_id; the labels and the mask on the completion tokens only. max_length: longer rows keep their
    prompt's end and the completion's start (TRL truncates the completion; here the row's tail goes)."""
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    if max_length is not None:
        rows = [(prompt, completion[: max(1, max_length - len(prompt))]) for prompt, completion in rows]
    seq = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq), -100, dtype=torch.long)
    for r, (prompt, completion) in enumerate(rows):
        row = torch.tensor(prompt + completion, dtype=torch.long)
        ids[r, : len(row)] = row
        labels[r, len(prompt) : len(row)] = row[len(prompt) :]
    return ids, labels, (labels != -100).float()
