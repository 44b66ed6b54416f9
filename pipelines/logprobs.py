"""The Engine's side of losses on per-token log-probabilities (megatrain/engine/token_loss.py): a step's batch with
its loss and fields, as the executors take it, and `Engine.logprobs`, the labels' log-probs under the current
weights (a mixin of pipelines/engine.py's Engine, which stays about running steps)."""

from __future__ import annotations

from typing import Any

import torch

from megatrain.config import MegatrainError
from megatrain.engine.batch_checks import token_ids
from megatrain.engine.token_loss import LossFn, TokenLoss
from pipelines.run_actors import get


def batch_of(input_ids: Any, labels: Any = None, position_ids: Any = None, loss: LossFn | None = None,
             temperature: float = 1.0, entropy: bool = False, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A step's batch as the executors take it: numpy token ids, and where a loss is given, the TokenLoss with the
    step's fields (small per-sequence or per-token tensors: they travel with the batch, replayed with it after a
    fault)."""
    batch: dict[str, Any] = {"input_ids": token_ids(input_ids)}
    for key, value in (("labels", labels), ("position_ids", position_ids)):
        if value is not None:
            batch[key] = token_ids(value)
    if loss is not None:
        batch["token_loss"] = TokenLoss(loss, {k: torch.as_tensor(v) for k, v in (fields or {}).items()}, temperature,
                                        entropy)
    elif fields:
        raise MegatrainError(f"fields {sorted(fields)} were given without a loss to read them; pass loss=fn.")
    return batch


class LogprobQueries:
    """Engine.logprobs (the Engine provides _check_running, executor, updates_applied and pending)."""

    def logprobs(self, input_ids: Any, labels: Any = None, position_ids: Any = None, *, temperature: float = 1.0,
                 entropy: bool = False, reference: bool = False) -> Any:
        """Each label's log-probability [batch, seq] under the current weights at `temperature` (with entropy: the
        pair (logprobs, entropy)), aligned with the labels as megatrain/engine/token_loss.py says; chunk by chunk in
        the head, no [batch, seq, vocab] tensor, no gradient; trains nothing. reference: under the initial weights
        instead (an Engine made with reference=True; a LoRA run's: its base, adapters off), streamed by the same
        executor (megatrain/engine/reference.py)."""
        engine: Any = self
        engine._check_running()
        out = get(engine.executor.logprobs.remote(batch_of(input_ids, labels, position_ids), engine.updates_applied,
                                                  engine.pending, temperature, entropy, reference))
        return out if entropy else out[0]
