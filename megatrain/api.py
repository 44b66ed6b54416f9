"""The single-process API: an arena-backed model whose loss and gradients come from the streamed templates.

    m = megatrain.from_pretrained("tiny")                  # or an HF directory, or "Qwen/Qwen2.5-0.5B"
    loss, grads = m.loss_and_grads(input_ids, labels=None)  # grads: HF name -> tensor
    m.save_pretrained("out")

It runs the same Executor the Ray engine schedules, in this process, with no optimizer attached.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.config import MegatrainError
from megatrain.engine.executor import Executor
from megatrain.engine.streams import resolve_device
from megatrain.engine.token_loss import TokenLoss
from megatrain.io.hub import tokenizer_files
from megatrain.model.layout import ModelLayout
from megatrain.store import ParameterStore


class Model:
    def __init__(self, store: ParameterStore, device: str = "cpu", precision: str = "fp32",
                 loss_chunk_tokens: int = 4096, tile_tokens: int | None = None, checkpoint_budget: int | None = None):
        self.store = store
        self.config = store.config
        self.layout: ModelLayout = store.layout
        try:
            self.executor = Executor(self.config, self.layout, store.arena.params, store.arena.grads, device,
                                     precision, loss_chunk_tokens, tile_tokens=tile_tokens,
                                     checkpoint_budget=checkpoint_budget)
        except BaseException:
            store.close()  # e.g. no such device: don't leave the new arena in /dev/shm until GC
            raise
        if self.executor.device.type == "cuda":
            store.arena.register_cuda()

    def loss_and_grads(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, micro_batches: int = 1,
                       schedule: str = "layer-major", loss: TokenLoss | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean next-token loss and its gradient for every parameter, by HF name.

        Labels follow transformers: same shape as input_ids, shifted inside, -100 ignored; None means
        input_ids. position_ids: packed documents, each from 0 (as transformers reads them in training: each
        attends within itself). micro_batches: the rows run as that many micro-batches, in `schedule` (the same
        loss and gradients, less memory per layer's working set). The gradients are views of the arena, valid until
        the next call. loss: a loss on the tokens' log-probs instead (megatrain/engine/token_loss.py).
        """
        self._check_open()
        out = self.executor.run(input_ids, labels, position_ids, micro_batches=micro_batches, schedule=schedule,
                                token_loss=loss)
        return torch.tensor(out.loss), self.layout.hf_views(self.store.arena.grads)

    def logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, micro_batches: int = 1, temperature: float = 1.0,
                 entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p of each label, each position's entropy or None), [batch, seq] aligned with the labels
        (megatrain/engine/token_loss.py), no gradient."""
        self._check_open()
        return self.executor.logprobs(input_ids, labels, position_ids, micro_batches=micro_batches,
                                      temperature=temperature, entropy=entropy)

    def parameters(self) -> dict[str, torch.Tensor]:
        """HF name -> fp32 weight (views of the arena)."""
        self._check_open()
        return self.layout.hf_views(self.store.arena.params)

    def save_pretrained(self, directory: str | Path) -> Path:
        """An HF directory, with the tokenizer's files of the model this one was loaded from."""
        self._check_open()
        return self.store.save_pretrained(directory, tokenizer_files(self.store.source_dir))

    def _check_open(self) -> None:
        if self.store.arena is None:
            raise MegatrainError("this model was closed; load it again with megatrain.from_pretrained.")

    def close(self) -> None:
        self.executor.close()
        self.store.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def from_pretrained(path_or_preset: str | Path, device: str = "cpu", precision: str = "fp32", seed: int = 0,
                    loss_chunk_tokens: int = 4096, tile_tokens: int | None = None,
                    checkpoint_budget: int | None = None) -> Model:
    """Loads an HF directory or a Hugging Face Hub model (`org/name[@revision]`, through the hub's cache), or builds a
    preset with HF's init, into a new shared-memory arena. tile_tokens and
    checkpoint_budget (bytes): sequence tiling and the device budget of the activation checkpoints (the rest wait
    in host memory), for long sequences."""
    on_gpu = resolve_device(device).type == "cuda"  # then activations take GPU memory, not host memory
    return Model(ParameterStore(path_or_preset, seed=seed, on_gpu=on_gpu), device, precision, loss_chunk_tokens,
                 tile_tokens, checkpoint_budget)
