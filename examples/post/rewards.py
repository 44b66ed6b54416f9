"""Reward functions for `megatrain grpo`'s example, with TRL's signature: function(prompts, completions, **columns)
-> one float per completion (columns: the prompts file's other fields, here "number", one per completion)."""

from __future__ import annotations

from typing import Any


def digits(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """The fraction of a completion's non-space characters that are digits (0 for an empty one)."""
    out = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


def starts_with_number(prompts: list[str], completions: list[str], number: list[str], **columns: Any
                       ) -> list[float]:
    """1 where the completion's first digits are the prompt's number (verifiable: the prompt says it), else 0."""
    return [1.0 if "".join(c for c in text if c.isdigit()).startswith(n) else 0.0
            for text, n in zip(completions, number, strict=True)]
