"""The step's serial points: the loss is read only once the backward's top layer is queued, from a copy of its own
on the D2H stream (issue 25), with results bit for bit those of the synchronous CPU path."""

from __future__ import annotations

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.engine import layer_passes
from megatrain.engine.executor import Executor
from megatrain.model.layout import ModelLayout, Unit
from megatrain.model.templates import recompute_grads

CONFIG = ModelConfig(vocab_size=260, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     intermediate_size=96)


@pytest.fixture(scope="module")
def model() -> tuple[ModelLayout, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    layout = ModelLayout.build(CONFIG)
    gen = torch.Generator().manual_seed(0)
    params = 0.05 * torch.randn(layout.numel, generator=gen)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=gen)
    return layout, params, (ids, ids.clone())


def _logged_run(model, monkeypatch, device: str, go_on: bool) -> tuple[list[str], object, torch.Tensor]:
    """One step, logging in order each layer's backward as compute takes it, the loss read, and each gradient
    landing; returns the log, the step's output and the gradients."""
    layout, params, batch = model
    log: list[str] = []
    seen: list[float] = []

    def logged(fn, x, *args, **kwargs):
        log.append("backward")
        return recompute_grads(fn, x, *args, **kwargs)

    def loss_ready(loss: float) -> bool:
        log.append("loss")
        seen.append(loss)
        return go_on

    def landed(unit: Unit, norm_sq: float) -> None:
        log.append(f"landed {unit.index}")

    monkeypatch.setattr(layer_passes, "recompute_grads", logged)
    grads = torch.zeros(layout.numel)
    executor = Executor(CONFIG, layout, params, grads, device=device)
    out = executor.run(*batch, loss_ready=loss_ready, grads_landed=landed)
    executor.close()
    assert seen == [out.loss]  # the number read is the step's loss
    return log, out, grads


@pytest.mark.parametrize("device", ["cpu", "cpu-async:0", "cpu-async:1"])
def test_the_loss_is_read_after_the_top_layer_backward_is_queued(model, monkeypatch, device) -> None:
    layout, params, batch = model
    reference_grads = torch.zeros(layout.numel)
    reference = Executor(CONFIG, layout, params, reference_grads).run(*batch)
    log, out, grads = _logged_run(model, monkeypatch, device, go_on=True)
    assert log[:2] == ["backward", "loss"], log  # and before any gradient has left the device
    assert log.count("backward") == CONFIG.num_layers and log.count("loss") == 1
    assert out.loss == reference.loss and out.unit_grad_norms_sq == reference.unit_grad_norms_sq
    assert torch.equal(grads, reference_grads)


@pytest.mark.parametrize("device", ["cpu", "cpu-async:0"])
def test_a_refused_loss_sends_no_gradient_and_the_next_step_is_exact(model, monkeypatch, device) -> None:
    layout, params, batch = model
    log, out, grads = _logged_run(model, monkeypatch, device, go_on=False)
    assert log == ["backward", "loss"] and out.unit_grad_norms_sq == [] and not grads.any()
    reference_grads = torch.zeros(layout.numel)
    reference = Executor(CONFIG, layout, params, reference_grads).run(*batch)
    assert out.loss == reference.loss
    executor = Executor(CONFIG, layout, params, grads, device=device)
    executor.run(*batch, loss_ready=lambda loss: False)  # the same executor steps on after a refused one
    again = executor.run(*batch, loss_ready=lambda loss: True)
    executor.close()
    assert again.unit_grad_norms_sq == reference.unit_grad_norms_sq and torch.equal(grads, reference_grads)
