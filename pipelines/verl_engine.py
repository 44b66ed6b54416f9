"""megatrain as a verl training engine: `import pipelines.verl_engine` registers MegatrainVerlEngine in verl's
EngineRegistry (model_type "language_model", backend "megatrain"), so verl's trainer builds it without a fork of verl.

verl's own loss runs on megatrain's per-token log-probs inside the executor's process; one forward_backward_batch per
optimizer_step, anything else refused (docs/design.md#verl)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, EngineRegistry

from megatrain.config import MegatrainError
from megatrain.engine.token_loss import head_aligned

# verl's optimizer settings -> megatrain.Engine's keywords (what is not set keeps megatrain's default)
OPTIMIZER_KEYS = {"lr": "lr", "weight_decay": "weight_decay", "betas": "betas", "clip_grad": "max_grad_norm"}


@dataclass
class PaddedBatch:
    """A verl no-padding batch as megatrain's [batch, seq] rows: the ids right-padded, labels -100 past each end."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor  # the nested input_ids' offsets (cu_seqlens)
    temperature: float


def padded(data: TensorDict) -> PaddedBatch:
    """megatrain's rows of a verl batch; refuses what megatrain cannot follow (positions that do not count from 0 in
    each sequence, temperatures that differ between sequences)."""
    ids = data["input_ids"]
    if not ids.is_nested:
        raise MegatrainError("the megatrain engine takes verl's no-padding batches (nested input_ids, "
                             "left_right_2_no_padding's output).")
    offsets = ids.offsets().cpu()
    lengths = offsets.diff().tolist()
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    labels = torch.full_like(rows, -100)
    for b, seq in enumerate(ids.unbind()):
        rows[b, :lengths[b]] = seq.cpu()
        labels[b, :lengths[b]] = seq.cpu()
    if "position_ids" in data.keys():
        for seq, length in zip(data["position_ids"].unbind(), lengths, strict=True):
            if seq.dim() != 1 or not torch.equal(seq.cpu(), torch.arange(length)):
                raise MegatrainError("the megatrain engine takes position ids counting 0, 1, ... in each sequence "
                                     "(text models, no packing or multimodal rope).")
    return PaddedBatch(rows, labels, offsets, temperature_of(data))


def temperature_of(data: TensorDict) -> float:
    t = data["temperature"] if "temperature" in data.keys() else 1.0
    t = getattr(t, "data", t)  # NonTensorData
    values = torch.as_tensor(t, dtype=torch.float64).flatten().unique()
    if values.numel() != 1:
        raise MegatrainError(f"the megatrain engine samples at one temperature per batch, got {values.tolist()}.")
    return float(values[0])


def nested(label_rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """megatrain's label-aligned [batch, seq] -> verl's nested per-token tensor: entry t of a sequence predicts its
    token t + 1 (verl's rolled ids), the last entry 0 (verl's is the next sequence's first token, always masked)."""
    head = head_aligned(label_rows)
    lengths = offsets.diff().tolist()
    values = torch.cat([head[b, :n] for b, n in enumerate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, offsets.to(values.device))


def number(value: Any) -> float:
    value = value.aggregate() if hasattr(value, "aggregate") else value  # verl's Metric
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


class VerlLoss:
    """verl's loss function as megatrain's fn(logprobs, entropy, fields): evaluated in the executor's process on the
    whole batch (verl's data travels with it, pickled with the step's batch)."""

    def __init__(self, loss_function: Callable, data: TensorDict, offsets: torch.Tensor):
        self.loss_function, self.data, self.offsets = loss_function, data, offsets
        self.reported: dict[str, float] = {}

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, fields: dict) -> torch.Tensor:
        output = {"log_probs": nested(logprobs, self.offsets)}
        if entropy is not None:
            output["entropy"] = nested(entropy, self.offsets)
        loss, metrics = self.loss_function(model_output=output, data=self.data.to(logprobs.device), dp_group=None)
        self.reported = {k: number(v) for k, v in metrics.items()}
        return loss

    def metrics(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, fields: dict) -> dict[str, float]:
        return self.reported  # what verl's loss said in __call__, just before


def batch_info(data: TensorDict) -> None:
    """The global-batch numbers verl's losses normalise by, as verl's FSDP engine sets them (one data-parallel rank)."""
    mask = data["loss_mask"] if "loss_mask" in data.keys() else None
    tokens = None if mask is None else int((mask.values() if mask.is_nested else mask).sum())
    tu.assign_non_tensor(data, batch_num_tokens=tokens, dp_size=1)
    if "global_batch_size" not in data.keys():
        tu.assign_non_tensor(data, global_batch_size=None)


@EngineRegistry.register(model_type="language_model", backend="megatrain", device=["cuda", "cpu"])
class MegatrainVerlEngine(BaseEngine):
    """verl's BaseEngine on a megatrain.Engine. model_config: verl's HFModelConfig (its local_path or path names the
    model) or a path; optimizer_config: verl's (lr, weight_decay, betas, clip_grad); overrides: megatrain.Engine's
    keywords (device, precision, seq_len, ...)."""

    def __init__(self, model_config: Any, engine_config: Any = None, optimizer_config: Any = None,
                 checkpoint_config: Any = None, **overrides: Any):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.overrides = overrides
        self.engine: Any = None
        self.mode: str | None = None
        self.grad_norm: float | None = None  # the last trained step's, until optimizer_step hands it out

    def initialize(self) -> None:
        import megatrain

        if self.overrides.get("lora") or getattr(self.model_config, "lora_rank", 0):
            raise MegatrainError("the megatrain verl engine trains full weights; LoRA (and the PEFT config verl's "
                                 "weight sync expects with it) is not supported by it yet.")
        path = self.model_config
        path = getattr(path, "local_path", None) or getattr(path, "path", path)
        settings = {ours: getattr(self.optimizer_config, theirs) for theirs, ours in OPTIMIZER_KEYS.items()
                    if getattr(self.optimizer_config, theirs, None) is not None}
        if "betas" in settings:
            settings["betas"] = tuple(settings["betas"])
        self.engine = megatrain.Engine(str(path), **{**settings, **self.overrides})

    # megatrain keeps weights and Adam states in its host arena and streams them: nothing to move or offload
    is_param_offload_enabled = property(lambda self: False)
    is_optimizer_offload_enabled = property(lambda self: False)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        super().to(device, model, optimizer, grad)

    @contextmanager
    def _mode(self, mode: str) -> Generator[None, None, None]:
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs: Any) -> Any:
        return self._mode("train")

    def eval_mode(self, **kwargs: Any) -> Any:
        return self._mode("eval")

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only: bool = False) -> Any:
        """verl's batch through megatrain: forward_only, the log-probs (and entropy where the batch asks,
        calculate_entropy) as verl's nested model output; else one trained step on loss_function."""
        batch = padded(data)
        entropy = bool(getattr(data.get("calculate_entropy", False), "data", data.get("calculate_entropy", False)))
        batch_info(data)
        if forward_only:
            return self._infer(data, batch, loss_function, entropy)
        if self.grad_norm is not None:
            raise MegatrainError("megatrain's step applies its update with the backward: call optimizer_step after "
                                 "each forward_backward_batch (gradient accumulation across calls is not supported).")
        loss = VerlLoss(loss_function, data, batch.offsets)
        result = self.engine.step_batch(self._batch(batch, loss, entropy))
        self.grad_norm = result.grad_norm
        return {"model_output": {}, "loss": [result.loss],
                "metrics": {k: [v] for k, v in result.loss_metrics.items()}}

    def _batch(self, batch: PaddedBatch, loss: VerlLoss, entropy: bool) -> dict[str, Any]:
        from pipelines.logprobs import batch_of

        return batch_of(batch.input_ids, batch.labels, loss=loss, temperature=batch.temperature, entropy=entropy)

    def _infer(self, data: TensorDict, batch: PaddedBatch, loss_function: Callable | None, entropy: bool) -> Any:
        out = self.engine.logprobs(batch.input_ids, batch.labels, temperature=batch.temperature, entropy=entropy)
        logprobs, ent = out if entropy else (out, None)
        model_output = {"log_probs": nested(logprobs, batch.offsets)}
        if ent is not None:
            model_output["entropy"] = nested(ent, batch.offsets)
        if loss_function is None:
            return {"model_output": model_output, "loss": [], "metrics": {}}
        loss, metrics = loss_function(model_output=model_output, data=data, dp_group=None)
        return {"model_output": model_output, "loss": [float(loss)], "metrics": {k: [number(v)] for k, v in
                                                                                  metrics.items()}}

    def optimizer_zero_grad(self) -> None:
        """Nothing to do: each megatrain step starts from zero gradients."""

    def optimizer_step(self) -> float:
        """The gradient norm (before clipping) of the step forward_backward_batch ran; its update is applied."""
        if self.grad_norm is None:
            raise MegatrainError("optimizer_step without a forward_backward_batch before it: there is no step.")
        norm, self.grad_norm = self.grad_norm, None
        return norm

    def lr_scheduler_step(self) -> float:
        """The learning rate of the next update: megatrain's schedule advances with each update it applies."""
        return float(self.engine.optim.lr_at(self.engine.updates_applied))

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Generator[tuple[str, torch.Tensor], None, None], None]:
        """(HF name, weight) one tensor at a time from the arena, for the rollout engine's weight sync; each a copy
        made as it is asked for, so the sync holds one tensor beside the arena, never the whole model."""
        self.engine.wait_for_updates()
        self.engine._write_back_resident()
        return self.engine.actors.weights(), None

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs: Any) -> None:
        if hdfs_path is not None:
            raise MegatrainError("the megatrain engine saves to a local (or shared) file system only, not HDFS.")
        self.engine.save_checkpoint(local_path, extra_state={"verl_global_step": global_step})

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **kwargs: Any) -> None:
        if hdfs_path is not None:
            raise MegatrainError("the megatrain engine loads from a local (or shared) file system only, not HDFS.")
        self.engine.load_checkpoint(local_path)

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_group(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


__all__ = ["MegatrainVerlEngine", "VerlLoss"]
