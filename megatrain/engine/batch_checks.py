"""What a batch must be before a step runs on it: token ids, labels, positions and micro-batches, each refused
in one sentence that says what to change."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from megatrain.config import MegatrainError, ModelConfig
from megatrain.model import ops
from megatrain.model.architecture import Batch

TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def token_ids(x: Any) -> np.ndarray:
    """A copy of token ids (tensor, array or list) as int64 if they are integers; any other dtype is kept, for
    check_batch to refuse in one sentence: casting floats would silently truncate them."""
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return x.astype(np.int64) if np.issubdtype(x.dtype, np.integer) else x.copy()


def check_batch(config: ModelConfig, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise MegatrainError(f"input_ids must be [batch, seq] with seq >= 2, got shape {tuple(input_ids.shape)}.")
    if input_ids.dtype not in TOKEN_DTYPES:
        raise MegatrainError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= config.vocab_size:
        raise MegatrainError(f"token id {hi if hi >= config.vocab_size else lo} is outside the model's "
                             f"vocabulary [0, {config.vocab_size}); check the tokenizer matches the model.")
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise MegatrainError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(labels.shape)}.")
        if labels.dtype not in TOKEN_DTYPES:
            raise MegatrainError(f"labels must hold integer token ids (-100 = ignored), got dtype {labels.dtype}.")
        bad = (labels != ops.IGNORE_INDEX) & ((labels < 0) | (labels >= config.vocab_size))
        if bool(bad.any()):
            raise MegatrainError(f"label {int(labels[bad][0])} is outside the vocabulary [0, "
                                 f"{config.vocab_size}) and is not -100 (ignored).")


def check_positions(position_ids: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """position_ids as int64, once they are known to be [batch, seq] non-negative integers."""
    position_ids = torch.as_tensor(position_ids)
    if position_ids.shape != input_ids.shape:
        raise MegatrainError(f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{tuple(position_ids.shape)}.")
    if position_ids.dtype not in TOKEN_DTYPES or bool((position_ids < 0).any()):
        raise MegatrainError("position_ids must be non-negative integers (each packed document counting from 0).")
    return position_ids.long()


def check_micro_batches(micro_batches: object, rows: int) -> int:
    """The number of micro-batches, once it is a positive integer that divides the batch's rows."""
    if not (isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1):
        raise MegatrainError(f"micro_batches must be a positive integer, got {micro_batches!r}.")
    if rows % micro_batches:
        raise MegatrainError(f"a batch of {rows} rows does not split into {micro_batches} equal micro-batches; "
                             f"give a multiple of {micro_batches} rows.")
    return micro_batches


def check_extra_loss(batches: list[Batch]) -> None:
    """A model whose forward adds a loss term over the whole batch (a router's auxiliary loss) takes no
    micro-batches: a micro-batch's term is a different function of the router's outputs than the batch's."""
    if len(batches) > 1 and getattr(batches[0], "adds_loss", False):
        raise MegatrainError("this model adds a router auxiliary loss over the whole batch, which micro-batches "
                             "would change; set micro_batches = 1, or turn the config's output_router_logits "
                             "off.")
