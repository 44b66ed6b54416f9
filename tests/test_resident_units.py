"""Resident units (issue #25, item 3): the first units of the forward kept on the executor's device with their fp32
weights, gradient and Adam moments, updated there; on the CPU path (the device's memory is host memory apart from
the arena) bit for bit what streaming them through the arena and the optimizer pool gives.

Without Ray: the memory plan's choice (which units, why, what no longer crosses PCIe, the predicted update time),
the rule for what a step's update of them is, and the executor with resident units against the streamed one over
steps (fp32 and, under simulated streams, bf16; micro-batches both ways; tied embeddings). With Ray: an Engine with
resident units against one without, every step clipping (the serial update), resumed from a checkpoint halfway;
slow: clipping off (each update final as it lands) and a step that clips nowhere with the update beside the
backward, grads = "device" under simulated streams, a step with a non-finite gradient skipped, an optimizer worker
and the executor killed mid-run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from helpers import OPTIM, assert_same_model, build_hf_model, rows, worker_pids
from transformers import LlamaConfig

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig, OptimConfig
from megatrain.engine.executor import Executor
from megatrain.engine.optimizer import AdamWShard
from megatrain.engine.resident import resident_update
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.memory.buffers import GRADIENT_BUFFERS, row
from megatrain.memory.plan import plan_run
from megatrain.memory.residency import MARGIN_BYTES, bytes_per_param
from megatrain.model.layout import ModelLayout
from megatrain.perf.calibrate import Calibration
from megatrain.perf.predict import predict
from megatrain.store import init_weights

GiB = 2**30

# ---- the plan ----

SEVEN_B = ModelConfig.from_name("7b")
H200 = dict(precision="bf16", on_gpu=True, gpu_free=139 * GiB, host_free=1000 * GiB, optimizer_workers=8,
            find_longest=False)


def test_the_plan_keeps_the_first_units_of_the_forward_where_the_gpu_has_room() -> None:
    # the bf16 copy kept in both: bf16_copy auto would drop it where resident units leave PCIe no bound, which changes
    # the streamed weight buffers this compares
    gpu = {**H200, "gpu_free": 100 * GiB, "bf16_copy": "keep"}
    streamed = plan_run(SEVEN_B, 1, 2048, micro_batches=4, **gpu)
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="auto", **gpu)
    layout = ModelLayout.build(SEVEN_B)
    n = plan.resident_units
    assert 2 < n < len(layout.units), "most of the 7b, not all of it, fits beside the pipeline on 100 GiB"
    assert plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="auto", **H200).resident_units == len(layout.units)
    assert plan.resident_params == sum(u.numel for u in layout.units[:n])  # the embedding first, then layers 0, 1, ..
    assert plan.gpu_resident == plan.resident_params * bytes_per_param("bf16") == plan.resident_params * 18
    assert plan.gpu_total + MARGIN_BYTES <= plan.gpu_free and plan.gpu_problem() is None
    # placed in what was left, and their gradients no longer wait on the device in the compute dtype (bf16) until the
    # step ends: each goes into its unit's own fp32 state (the H100's 7B at K=1 peaked 7 GiB under the plan without it)
    assert plan.grads == streamed.grads == "device"
    # (each layer's held gradient: fp32, the sum over the 4 micro-batches; megatrain/memory/buffers.py step_buffers)
    held = (n - 1) * row(streamed.buffers, GRADIENT_BUFFERS).numel * 4
    assert plan.gpu_grads == streamed.gpu_grads - held
    assert plan.gpu_total - plan.gpu_resident + held == streamed.gpu_total
    assert plan.h2d_bytes < streamed.h2d_bytes and plan.d2h_bytes < streamed.d2h_bytes
    assert f"resident units: the embedding + layers 0-{n - 2} ({n} of {len(layout.units)} units" in plan.report()
    assert "the first units the next forward needs" in plan.report()
    cal = Calibration(device="test", host="test", created=0.0, cores=16, compute_threads=4, h2d_gbps=50.0,
                      d2h_gbps=50.0, memcpy_gbps=20.0, matmul_tflops={"bf16": 400.0}, adamw_gparams={"8": 3.3})
    fast, slow = (predict(p, SEVEN_B, cal, precision="bf16", optimizer_workers=8) for p in (plan, streamed))
    assert fast.optimizer_s == pytest.approx(slow.optimizer_s * (plan.params - plan.resident_params) / plan.params)
    assert fast.step_s < slow.step_s
    fewer = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident=3, **gpu)
    assert fewer.resident_units == 3 and "embedding + layers 0-1 (3 of" in fewer.resident_note


@pytest.mark.parametrize(("settings", "why"), [
    (dict(on_gpu=False, resident="auto"), "none (the CPU path; ask for a count with resident = N)"),
    (dict(on_gpu=True, resident="auto"), "none (the GPU's free memory is not known)"),
    (dict(on_gpu=True, gpu_free=139 * GiB, resident="auto", executors=2), "none (2 executors: each would hold"),
    (dict(on_gpu=True, gpu_free=139 * GiB, resident="none"), "none (resident = none)"),
    (dict(on_gpu=True, gpu_free=20 * GiB, resident="auto"), "none (no room on the device beyond the pipeline's"),
])
def test_where_the_plan_keeps_none_it_says_why(settings: dict[str, Any], why: str) -> None:
    plan = plan_run(SEVEN_B, 1, 2048, precision="bf16", host_free=1000 * GiB, find_longest=False, **settings)
    assert plan.resident_units == 0 and plan.gpu_resident == 0
    assert plan.resident_note.startswith(f"resident units: {why}") and plan.resident_note in plan.report()


def test_a_count_asked_for_on_the_cpu_path_is_host_memory_and_several_executors_refuse_one() -> None:
    tiny = ModelConfig.from_name("tiny")
    none = plan_run(tiny, 2, 64, host_free=100 * GiB, find_longest=False)
    two = plan_run(tiny, 2, 64, host_free=100 * GiB, find_longest=False, resident=2)
    layout = ModelLayout.build(tiny)
    assert two.resident_units == 2 and two.gpu_resident == 16 * (layout.units[0].numel + layout.units[1].numel)
    assert two.process_bytes == none.process_bytes + two.gpu_resident
    everything = plan_run(tiny, 2, 64, host_free=100 * GiB, find_longest=False, resident=1000)
    assert everything.resident_units == len(layout.units) and "the head" in everything.resident_note
    with pytest.raises(ConfigError, match="with 2 executors set resident = none"):
        plan_run(tiny, 2, 64, host_free=100 * GiB, find_longest=False, resident=2, executors=2)
    with pytest.raises(ConfigError, match="resident must be 'auto', 'none' or a number of units >= 0, got 'all'"):
        EngineConfig(resident="all")


def test_what_a_steps_update_of_the_resident_units_is() -> None:
    inf = float("inf")
    assert resident_update([0, 1], [1.0, 2.0, 3.0], True, 0.5, after_step=True) == (0.5, None)
    assert resident_update([0, 1], [1.0, inf, 3.0], False, 0.0, after_step=True) is None  # the step is skipped
    assert resident_update([0, 1], [1.0, inf, 3.0], False, 0.0, after_step=False) == (1.0, [0])  # final as it lands
    assert resident_update([0, 1], [inf, inf, 3.0], False, 0.0, after_step=False) is None
    assert resident_update([0, 1], [], False, 0.0, after_step=False) is None  # no backward: a non-finite loss
    assert resident_update([], [1.0], True, 1.0, after_step=True) is None


# ---- the executor, without Ray ----

def executor_steps(config: ModelConfig, resident: int, device: str, precision: str, micro_batches: int,
                   schedule: str, steps: int = 3, cast: bool = False, kept: int = 0
                   ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`steps` steps of the executor and two optimizer workers' shards of the streamed units, the resident ones
    updated on the device (cast: their bf16 weights cast at each use, no copy kept), the top `kept` layers keeping
    their activations, every step clipping to half its norm; the state written back into the arena."""
    layout = ModelLayout.build(config)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    t = {name: torch.zeros(layout.numel) for name in ("params", "grads", "exp_avg", "exp_avg_sq")}
    t[BF16_COPY_SEGMENT] = torch.zeros(layout.numel, dtype=torch.bfloat16)
    init_weights(layout, t["params"], seed=3)
    t[BF16_COPY_SEGMENT].copy_(t["params"])
    executor = Executor(config, layout, t["params"], t["grads"], device=device, precision=precision,
                        bf16_copy=t[BF16_COPY_SEGMENT], resident_units=resident, resident_cast=cast, kept_layers=kept)
    assert executor.resident.cast == (cast and precision == "bf16" and resident > 0)
    assert (BF16_COPY_SEGMENT in executor.resident.tensors) == (precision == "bf16" and resident > 0 and not cast)
    executor.resident.load(t, 0)
    workers = [AdamWShard(layout, t, optim, w, 2) for w in range(2)]
    ids = torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    try:
        for step in range(steps):
            out = executor.run(ids, micro_batches=micro_batches, schedule=schedule)
            coef = min(1.0, optim.max_grad_norm / (out.grad_norm + 1e-6))
            assert coef < 1.0
            for unit in layout.units[resident:]:
                for worker in workers:
                    worker.update(unit.index, step, coef)
            executor.resident.update(step, coef, optim)
            losses.append(out.loss)
            if step == 0:  # written back after an update; a second write-back with no update between copies nothing
                assert executor.resident.write_back(t) == 1
                held = t["exp_avg"][0].item()
                t["exp_avg"][0] = held + 1.0  # (what the arena's copy holds is not looked at again)
                poisoned = t["exp_avg"][0].item()
                assert executor.resident.write_back(t) == 1 and executor.resident.in_arena
                assert t["exp_avg"][0].item() == poisoned
                t["exp_avg"][0] = held
        assert executor.resident.write_back(t) == steps
    finally:
        executor.close()
    return t, losses


@pytest.mark.parametrize(("tied", "device", "precision", "micro_batches", "schedule", "cast"), [
    (False, "cpu", "fp32", 1, "layer-major", False),
    (True, "cpu-async:3", "bf16", 2, "layer-major", False),
    (False, "cpu", "fp32", 2, "per-micro-batch", False),
    (True, "cpu-async:4", "bf16", 2, "layer-major", True),
    (False, "cpu", "bf16", 1, "layer-major", True),
    (False, "cpu-async:5", "bf16", 1, "layer-major", "cast, 2 kept"),
])
def test_the_executors_resident_units_are_the_streamed_ones_bit_for_bit(tied: bool, device: str, precision: str,
                                                                       micro_batches: int, schedule: str,
                                                                       cast: bool | str) -> None:
    """None, three (the embedding, layers 0 and 1) and every unit resident: the weights, their bf16 copy and the
    moments after three steps, and the losses; in bf16 also with the resident weights cast at each use, no bf16 copy
    of them kept (on the plain CPU path the streamed weights are bound where they lie: the pipeline's buffers are
    made for the casts alone)."""
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=4, tie_embeddings=tied)
    kept = 2 if cast == "cast, 2 kept" else 0  # layers 2-3 keep their graphs, resident among the 3 or the 6 units
    runs = {n: executor_steps(config, n, device, precision, micro_batches, schedule, cast=bool(cast), kept=kept)
            for n in (0, 3, 6)}
    (want, want_losses) = runs[0]
    for n, (got, losses) in runs.items():
        assert losses == want_losses, n
        for name in ("params", "exp_avg", "exp_avg_sq", BF16_COPY_SEGMENT):
            assert torch.equal(got[name], want[name]), (n, name)


# ---- the Engine ----

ENGINE = dict(optimizer_workers=1, precision="fp32", device="cpu", batch_size=8, seq_len=24, metrics=False, **OPTIM)
CLIPS = 1.0  # every step's gradient norm here is 1.3 to 1.5


def state_of(engine: megatrain.Engine) -> dict[str, torch.Tensor]:
    """The weights (HF names) and the Adam moments, as the arena holds them once the resident units are written back."""
    state = engine.parameters()
    arena = engine.actors.arena
    state.update({"exp_avg": arena.exp_avg.clone(), "exp_avg_sq": arena.exp_avg_sq.clone()})
    return state


def train(directory: Path, batches: list, *, resume_at: int | None = None, checkpoint: Path | None = None,
          **settings: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Steps on `batches`; with resume_at, a checkpoint there and a new Engine that loads it for the rest."""
    settings = {**ENGINE, **settings}
    losses = []
    stop = len(batches) if resume_at is None else resume_at
    with megatrain.Engine(directory, **settings) as engine:
        # what was asked is what runs: the plan's resolved setting, the executor's resident units
        assert engine.plan.resident_weights == settings.get("resident_weights", "copy")
        losses += [engine.step(ids, labels) for ids, labels in batches[:stop]]
        if resume_at is None:
            return losses, state_of(engine)
        assert checkpoint is not None
        engine.save_checkpoint(checkpoint)
        engine.step(*batches[stop])  # a step the checkpoint does not have: the resumed run must not see it
    with megatrain.Engine(directory, **settings) as engine:
        engine.load_checkpoint(checkpoint)
        losses += [engine.step(ids, labels) for ids, labels in batches[stop:]]
        return losses, state_of(engine)


def test_resident_units_train_as_streamed_ones_and_resume_exactly(ray_session: None, micro_llama,
                                                                   tmp_path: Path) -> None:
    """Every step clips; two micro-batches a step; bf16 compute; the serial update (speculate off) streamed against the
    embedding and layer 0 resident, their bf16 weights cast at each use (no copy kept), checkpointed after two steps
    and resumed in a new Engine: bit for bit (the executor's test holds the copy kept, and fp32, to the same)."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3, 4)]
    settings = dict(max_grad_norm=CLIPS, speculate="off", micro_batches=2, batch_size=4, precision="bf16")
    want_losses, want = train(directory, batches, resident="none", **settings)
    losses, got = train(directory, batches, resident=2, resident_weights="cast", resume_at=2,
                        checkpoint=tmp_path / "ckpt", **settings)
    assert losses == want_losses
    assert_same_model(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(max_grad_norm=None),  # clipping off: each streamed unit's update final as it lands, the resident after
    dict(max_grad_norm=1e3, speculate="on"),  # nothing clips: the updates beside the backward stand
    dict(max_grad_norm=CLIPS, speculate="off", grads="device", device="cpu-async:7"),
], ids=["clipping-off", "beside-the-backward", "grads-device-simulated-streams"])
def test_resident_units_train_as_streamed_ones(ray_session: None, micro_llama, settings: dict[str, Any]) -> None:
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    want_losses, want = train(directory, batches, resident="none", **settings)
    for resident in (1, 4):  # the embedding alone; every unit (the head too)
        losses, got = train(directory, batches, resident=resident, **settings)
        assert losses == want_losses, resident
        assert_same_model(got, want)


@pytest.mark.parametrize("settings", [
    dict(grads="device", micro_batches=2, batch_size=4, device="cpu-async:3"),
    pytest.param(dict(grads="arena"), marks=pytest.mark.slow),
], ids=["grads-device-micro-batches-simulated-streams", "grads-arena"])
def test_resident_units_are_never_handed_to_the_pool_beside_the_backward(ray_session: None, micro_llama,
                                                                        settings: dict[str, Any]) -> None:
    """Nothing clips, the updates beside the backward stand: none is taken back (the resident units' gradients once
    went out to the pool as well, so every step rolled back, and with gradients held on the device the second step
    waited forever for a host slot a resident unit held; found on the H100, 7B at K=4)."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    runs = {}
    for resident in ("none", 2):
        with megatrain.Engine(directory, **{**ENGINE, **settings, "speculate": "on", "max_grad_norm": 1e3,
                                            "resident": resident}) as engine:
            results = [engine.step_batch({"input_ids": ids.numpy(), "labels": labels.numpy()})
                       for ids, labels in batches]
            assert engine.rollbacks == 0 and not any(r.rolled_back for r in results), resident
            runs[resident] = [r.loss for r in results], state_of(engine)
    assert runs[2][0] == runs["none"][0]
    assert_same_model(runs[2][1], runs["none"][1])


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Llama whose RMSNorm eps (1e-24) is far below its activations and whose tokens 0..7 embed as zeros: a
    batch of those has a finite loss while the gradients below the top layer overflow."""
    hf = build_hf_model(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                    num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-24), seed=1)
    hf.model.embed_tokens.weight.data[:8] = 0.0
    hf.save_pretrained(path := tmp_path_factory.mktemp("overflowing"))
    return path


@pytest.mark.slow
def test_a_step_with_a_non_finite_gradient_leaves_the_resident_units(ray_session: None, overflowing: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(8, 48, (2, 16), generator=gen), torch.randint(0, 8, (2, 16), generator=gen),
           torch.randint(8, 48, (2, 16), generator=gen)]
    runs = {}
    for resident in ("none", 3):
        with megatrain.Engine(overflowing, optimizer_workers=2, precision="fp32", device="cpu", batch_size=2,
                              seq_len=16, max_grad_norm=1e9, lr=1e-2, speculate="off", max_nonfinite_steps=2,
                              metrics=False, resident=resident) as engine:
            engine.step(ids[0])
            before = state_of(engine)
            result = engine.step_batch({"input_ids": ids[1].numpy()})
            assert math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
            assert result.skipped and engine.updates_applied == 1
            assert_same_model(state_of(engine), before)
            engine.step(ids[2])
            runs[resident] = state_of(engine)
    assert_same_model(runs[3], runs["none"])


def killing_once(call: Any, pid: int) -> Any:
    """`call`, after whose first return the process `pid` is SIGKILLed (later calls, a replay's, only call)."""
    victims = [pid]

    def call_then_kill(*args: Any) -> Any:
        out = call(*args)
        while victims:
            os.kill(victims.pop(), signal.SIGKILL)
        return out

    return call_then_kill


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "executor"])
def test_a_killed_actor_recovers_exactly_with_resident_units(ray_session: None, micro_llama, tmp_path: Path,
                                                             victim: str) -> None:
    """In the fourth of five steps (a checkpoint after the second), an optimizer worker or the executor (with the
    resident units' state) is SIGKILLed once the step's backward returned, before its update is handed out: the run
    restores the checkpoint, the new executor loads the resident units from it, and the replay is bit for bit the run
    without the kill."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3, 4, 5)]

    def run(kill_at: int | None) -> tuple[list[float], dict[str, torch.Tensor], int]:
        with megatrain.Engine(directory, **{**ENGINE, "speculate": "off", "max_grad_norm": CLIPS, "resident": 2}
                              ) as engine:
            losses = []
            for i, (ids, labels) in enumerate(batches):
                if i == kill_at:
                    pid = worker_pids(engine)[0] if victim == "worker" else ray.get(engine.executor.pid.remote())
                    engine.actors.train_step = killing_once(engine.actors.train_step, pid)
                losses.append(engine.step(ids, labels))
                if i == 1:
                    engine.save_checkpoint(tmp_path / f"ckpt-{kill_at}")
            return losses, state_of(engine), engine.restarts

    losses, state, restarts = run(kill_at=3)
    clean_losses, clean_state, _ = run(kill_at=None)
    assert restarts == 1 and losses == clean_losses
    assert_same_model(state, clean_state)
