"""bf16 runs read the weights from a bf16 copy that the optimizer writes beside each update, so the GPU
loads 2 B/param instead of 4. The bf16 copy must always equal the fp32 weights rounded to bf16, and reading
it must give exactly what casting the fp32 weights on the device gives."""

from __future__ import annotations

import torch

import megatrain
from megatrain.config import ModelConfig, OptimConfig
from megatrain.engine.executor import Executor
from megatrain.engine.optimizer import AdamWShard
from megatrain.memory.arena import BF16_COPY_SEGMENT, Arena
from megatrain.model.layout import ModelLayout
from megatrain.store import ParameterStore, init_weights

CONFIG = ModelConfig.from_name("tiny")


def _batch() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def test_executor_reading_the_bf16_copy_equals_casting_the_weights() -> None:
    layout = ModelLayout.build(CONFIG)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=1)
    grads_cast, grads_copied = torch.zeros(layout.numel), torch.zeros(layout.numel)
    cast = Executor(CONFIG, layout, params, grads_cast, precision="bf16").run(_batch())
    copied = Executor(CONFIG, layout, params, grads_copied, precision="bf16", bf16_copy=params.bfloat16()).run(_batch())
    assert cast.loss == copied.loss
    assert torch.equal(grads_cast, grads_copied)
    # and a bf16 copy is only read for bf16 compute: fp32 runs must not see rounded weights
    fp32 = Executor(CONFIG, layout, params, torch.zeros(layout.numel), bf16_copy=params.bfloat16())
    assert fp32.weights is params


def test_optimizer_keeps_the_bf16_copy_equal_to_the_rounded_weights() -> None:
    layout = ModelLayout.build(CONFIG)
    tensors = {name: torch.zeros(layout.numel) for name in ("params", "grads", "exp_avg", "exp_avg_sq")}
    init_weights(layout, tensors["params"], seed=1)
    tensors["grads"].normal_(generator=torch.Generator().manual_seed(2))
    tensors[BF16_COPY_SEGMENT] = tensors["params"].bfloat16()
    before = tensors[BF16_COPY_SEGMENT].clone()
    for worker in range(3):
        shard = AdamWShard(layout, tensors, OptimConfig(lr=1e-2), worker, 3)
        for unit in layout.units:
            shard.update(unit.index, step=0)
    assert not torch.equal(tensors[BF16_COPY_SEGMENT], before)
    assert torch.equal(tensors[BF16_COPY_SEGMENT], tensors["params"].bfloat16())


def test_store_writes_the_bf16_copy_when_weights_change_outside_the_optimizer(tmp_path) -> None:
    store = ParameterStore("tiny", seed=0, bf16_copy=True)
    try:
        bf16_copy = store.arena.tensors[BF16_COPY_SEGMENT]
        assert torch.equal(bf16_copy, store.arena.params.bfloat16()), "after init"
        state = {"steps_done": 0, "updates_applied": 0}
        store.save_checkpoint(tmp_path / "ckpt", state)
        store.arena.params.add_(1.0)
        store.load_checkpoint(tmp_path / "ckpt")
        assert torch.equal(bf16_copy, store.arena.params.bfloat16()), "after a checkpoint load"
        store.arena.params.add_(1.0)
        store.reinitialize()
        assert torch.equal(bf16_copy, store.arena.params.bfloat16()), "after reinitialize"
    finally:
        store.close()
    fp32 = ParameterStore("tiny", seed=0)
    try:
        assert BF16_COPY_SEGMENT not in fp32.arena.tensors, "only bf16 runs pay 2 B/param for a bf16 copy"
    finally:
        fp32.close()


def _bf16_engine_run(device: str) -> list[float]:
    with megatrain.Engine("tiny", optimizer_workers=1, precision="bf16", device=device, lr=1e-2,
                          bf16_copy="keep") as engine:  # auto keeps none on the CPU path (test_bf16_copy.py)
        losses = [engine.step(_batch()) for _ in range(3)]
        assert all(loss == loss for loss in losses)
        engine.wait_for_updates()
        arena = Arena.open(engine.handle)
        try:
            assert torch.equal(arena.tensors[BF16_COPY_SEGMENT], arena.params.bfloat16())
        finally:
            arena.close()
    return losses


def test_bf16_engine_keeps_its_bf16_copy_current_and_reads_it_under_simulated_streams(ray_session) -> None:
    """Both runs keep the bf16 copy the rounded weights; the one under simulated streams (the bf16 copy streamed through
    the weight buffers on late copy streams) trains as the synchronous CPU path, which reads it in place. (One CPU
    run serves both checks: an Engine start is most of each run's time.)"""
    assert _bf16_engine_run("cpu-async:0") == _bf16_engine_run("cpu")
