"""Micro-batches: a step of K micro-batches is one batch of K times the rows, exactly, in either schedule
(layer-major: each layer's weights cross once per step; per-micro-batch: once per micro-batch, the gradients
added up in the arena).

K=4 micro-batches of 2 rows give the loss and every gradient of one batch of 8 and of transformers on it (also
tiled, with every checkpoint in host memory, under simulated streams); three Engine steps give transformers +
AdamW's losses and parameters on the batch of 8 (judged against its fp64 run), for both schedules, clipping on and
off; an executor killed in the middle of a step's micro-batches ends bit-identical to an uninterrupted run; the
data loader hands K micro-batches per step; the plan's PCIe bytes per token fall as 1/K under the layer-major
schedule and not per micro-batch, and the plan falls back to per-micro-batch where layer-major does not fit; bad
settings are one sentence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    OPTIM,
    ROWS,
    ROWS_SEQ,
    assert_same_model,
    hf_loss_and_grads,
    hf_reference,
    max_rel,
    rel_err,
    rows,
    train_with_faults,
)

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.data import DataConfig
from megatrain.data.loader import BatchLoader
from megatrain.memory.plan import pick_micro_batches, plan_run

K = 4


@pytest.mark.parametrize("schedule", ["layer-major", "per-micro-batch"])
@pytest.mark.parametrize("variant", ["plain", "tiled-offloaded-async"])
def test_micro_batches_are_the_whole_batch(micro_llama: tuple[torch.nn.Module, Path], variant: str,
                                           schedule: str) -> None:
    hf, directory = micro_llama
    ids, labels = rows(0)
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, labels)
    options = dict(device="cpu-async:4", tile_tokens=8, checkpoint_budget=0) if variant != "plain" else {}
    with megatrain.from_pretrained(directory, **options) as model:
        whole_loss, grads = model.loss_and_grads(ids, labels)
        whole = {n: g.clone() for n, g in grads.items()}
        loss, grads = model.loss_and_grads(ids, labels, micro_batches=K, schedule=schedule)
        if variant != "plain":  # every micro-batch's checkpoint of every layer went to the host
            store = model.executor.activation_checkpoints
            assert store.offloaded == 2 * (1 + K) and store.peak_device_bytes == 0  # this call K x 2, the first 2
    assert rel_err(loss, whole_loss) <= 1e-6 and rel_err(loss, hf_loss) <= 1e-5
    for name, g in hf_grads.items():
        assert rel_err(grads[name], whole[name]) <= 1e-5, name
        assert rel_err(grads[name], g) <= 1e-5, name


def test_rows_that_do_not_split_are_one_sentence(micro_llama: tuple[torch.nn.Module, Path]) -> None:
    _, directory = micro_llama
    with megatrain.from_pretrained(directory) as model:
        with pytest.raises(megatrain.MegatrainError, match="does not split into 3 equal micro-batches"):
            model.loss_and_grads(rows(0)[0], micro_batches=3)
    with pytest.raises(ConfigError, match="micro_batches must be 'auto' or a positive integer"):
        EngineConfig(micro_batches=0)
    with pytest.raises(ConfigError, match="schedule must be one of auto, layer-major, per-micro-batch"):
        EngineConfig(schedule="breadth-first")
    with pytest.raises(ConfigError, match="per-micro-batch schedule adds gradients up in the arena"):
        plan_run(ModelConfig.from_name("tiny"), 2, 64, grads="device", micro_batches=2, schedule="per-micro-batch")


@pytest.mark.parametrize(("schedule", "max_grad_norm"), [  # CI: each schedule, and clipping on and off, once
    ("layer-major", 1.0), pytest.param("layer-major", None, marks=pytest.mark.slow),
    pytest.param("per-micro-batch", 1.0, marks=pytest.mark.slow), ("per-micro-batch", None)])
def test_engine_with_micro_batches_matches_transformers_and_adamw(ray_session: None,
                                                                  micro_llama: tuple[torch.nn.Module, Path],
                                                                  schedule: str, max_grad_norm: float | None) -> None:
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    with megatrain.Engine(directory, optimizer_workers=1, precision="fp32", device="cpu-async:1",
                          max_grad_norm=max_grad_norm, batch_size=ROWS // K, seq_len=ROWS_SEQ, micro_batches=K,
                          schedule=schedule, **OPTIM) as engine:
        assert engine.engine_config.schedule == schedule
        losses = [engine.step(ids, labels) for ids, labels in batches]
        params = engine.parameters()
    exact_losses, exact = hf_reference(directory, batches, max_grad_norm, OPTIM, torch.float64)
    hf_losses, hf_params = hf_reference(directory, batches, max_grad_norm, OPTIM)
    assert losses == pytest.approx(exact_losses, rel=1e-5)
    assert hf_losses == pytest.approx(exact_losses, rel=1e-5)
    ours, theirs = max_rel(params, exact), max_rel(hf_params, exact)
    too_far = {n: (e, theirs[n]) for n, e in ours.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


@pytest.mark.slow  # CI: kills without micro-batches (test_faults.py), micro-batches without kills (above)
def test_executor_killed_among_micro_batches_recovers_exactly(ray_session: None, fault_batches, tmp_path: Path
                                                              ) -> None:
    """Steps of 2 micro-batches of 2 rows; the executor SIGKILLed at random moments of 2 of 8 steps (within their
    micro-batches' forward or backward), a checkpoint between them: the same losses and bit-identical parameters
    as without the kills."""
    options = dict(micro_batches=2, kill_steps={2, 6}, checkpoint_after=3)
    losses0, params0, _, _ = train_with_faults(fault_batches[:8], tmp_path / "a", **options)
    losses, params, restarts, _ = train_with_faults(fault_batches[:8], tmp_path / "b", victim="executor", seed=4,
                                                    **options)
    assert restarts >= 2
    assert losses == losses0
    assert_same_model(params, params0)


def test_data_loader_hands_k_micro_batches_per_step() -> None:
    """micro_batches=4 of 2 rows: the same rows, in the same order, as batches of 8; resumable the same way."""
    common = dict(seq_len=32, synthetic_docs=200, seed=3)
    big = BatchLoader(DataConfig(batch_size=8, **common))
    micro = BatchLoader(DataConfig(batch_size=2, micro_batches=4, **common))
    for _ in range(3):
        a, b = big.next_batch(), micro.next_batch()
        assert a["input_ids"].shape == b["input_ids"].shape == (8, 32)
        assert (a["input_ids"] == b["input_ids"]).all() and (a["labels"] == b["labels"]).all()
    state = micro.state_dict()
    resumed = BatchLoader(DataConfig(batch_size=2, micro_batches=4, **common))
    resumed.load_state_dict(state)
    assert (resumed.next_batch()["input_ids"] == micro.next_batch()["input_ids"]).all()


def test_plan_pcie_bytes_per_token_fall_as_one_over_k() -> None:
    config = ModelConfig.from_name("7b")
    kwargs = dict(name="7b", precision="bf16", on_gpu=True)
    plans = {k: plan_run(config, 1, 4096, micro_batches=k, **kwargs) for k in (1, 2, 4, 8)}
    # the embedding rows a step gathers grow with its tokens (at most the vocabulary); the weights and gradients,
    # nearly all of it, do not
    for k, plan in plans.items():
        assert plan.schedule == "layer-major" and plan.step_tokens == k * 4096
        assert plan.pcie_bytes_per_token * k == pytest.approx(plans[1].pcie_bytes_per_token, rel=0.02)
        assert plan.gpu_checkpoints == k * plans[1].gpu_checkpoints  # every micro-batch's checkpoints
        each = plan_run(config, 1, 4096, micro_batches=k, schedule="per-micro-batch", **kwargs)
        assert each.gpu_checkpoints == plans[1].gpu_checkpoints  # one micro-batch's
        assert each.pcie_bytes_per_token >= plans[1].pcie_bytes_per_token  # no fewer per token: more (sums back in)


def test_plan_falls_back_to_per_micro_batch_where_layer_major_does_not_fit() -> None:
    """7B at 32k tokens a micro-batch, 16 of them: every micro-batch's checkpoints (128 GiB) fit neither an 80 GiB
    GPU nor, what it cannot keep offloaded, a 150 GiB host; one micro-batch's (8 GiB) do."""
    config = ModelConfig.from_name("7b")
    kwargs = dict(name="7b", precision="bf16", on_gpu=True, gpu_free=80 * 2**30, host_free=150 * 2**30)
    plan = plan_run(config, 1, 32768, micro_batches=16, **kwargs)
    assert plan.schedule == "per-micro-batch" and plan.grads == "arena"
    assert plan.host_problem() is None and plan.gpu_problem() is None
    assert plan_run(config, 1, 32768, micro_batches=2, **kwargs).schedule == "layer-major"


def test_auto_takes_the_fewest_micro_batches_that_fit() -> None:
    """micro_batches = "auto": batch_size is the step's rows, split into the fewest equal micro-batches that fit. 7B
    at 16 rows of 32k tokens on an 80 GiB GPU and a 125 GiB host: 4 micro-batches of 4 rows (1 and 2 do not fit).
    (An Engine's "auto", the tiny model on the CPU: one; test_predict.py's Engine, which takes every "auto".)"""
    config = ModelConfig.from_name("7b")
    kwargs = dict(name="7b", precision="bf16", on_gpu=True, gpu_free=80 * 2**30, host_free=125 * 2**30)
    plan = pick_micro_batches(config, 16, 32768, **kwargs)
    assert (plan.micro_batches, plan.batch) == (4, 4) and plan.host_problem() is None and plan.gpu_problem() is None
    for k in (1, 2):
        worse = plan_run(config, 16 // k, 32768, micro_batches=k, **kwargs)
        assert worse.host_problem() or worse.gpu_problem()
