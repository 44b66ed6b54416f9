"""Kept activations (issue #25, item 4): the top decoder layers keep their autograd graph from the forward to the
backward instead of recomputing, and their gradients are the recompute's bit for bit.

Without Ray: a kept graph reads the weights bound for its backward, never the forward's buffer (the weight buffers
rotate); the executor with kept layers against the recompute path (fp32 and bf16, plain and simulated streams,
micro-batches under both schedules, resident units, tied embeddings, the generic path with dropout), its trace
naming a kept layer's backward "backward"; the memory plan's choice (all layers at small K, the top ones at large K
for a 7B on an 80 GB GPU; none where the tiled path runs, or refused where asked for), its split with the resident
units (a count asked for placed first; without a calibration, the rule), the bytes formula against what the pack
hooks see; the settings and the `plan` command. With Ray: an Engine with every layer kept against one with
none, two steps, bit for bit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import VOCAB, assert_one_sentence, batch, build_hf_model, error
from transformers import GPT2Config, MixtralConfig

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.engine.executor import Executor
from megatrain.engine.kept_activations import KeptActivations
from megatrain.memory.kept_activations import saved_bytes_per_token
from megatrain.memory.plan import plan_run
from megatrain.model.layout import ModelLayout
from megatrain.model.templates import recompute_grads
from megatrain.store import ParameterStore, init_weights
from megatrain.telemetry import Recorder
from pipelines.cli import _plan_json, main
from pipelines.train import TrainConfig

GiB = 2**30
TINY = ModelConfig.from_name("tiny")


def tiny(num_layers: int = 4, **changes: Any) -> ModelConfig:
    return dataclasses.replace(TINY, num_layers=num_layers, **changes)


# ---- the kept graph ----

def test_a_kept_graph_reads_the_weights_bound_for_its_backward_not_the_forwards_buffer() -> None:
    """The forward's weights live in a buffer that the next layer's then fill (here: NaN); the backward binds the same
    values in another buffer. The gradients are recompute_grads' bit for bit; no weight was kept as an activation."""
    config = tiny(1)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    unit = layout.layers[0]
    arch = config.family.architecture(config)
    args = arch.batch(2, 16, torch.device("cpu"), torch.float32).layer_args(0)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(0))
    grad_out = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(1))
    forward_buffer, backward_buffer = unit.range_of(params).clone(), unit.range_of(params).clone()
    kept = KeptActivations()
    y = kept.forward(0, arch.layer(0), x, unit.bind(forward_buffer), args)
    assert kept.saved_bytes > 0 and forward_buffer.untyped_storage().data_ptr() not in kept._graphs[0].saved
    forward_buffer.fill_(float("nan"))  # the next layer's weights, as far as this layer is concerned
    grad_x, grads = kept.backward(0, unit.bind(backward_buffer), grad_out)
    want_x, want = recompute_grads(arch.layer(0), x, unit.bind(unit.range_of(params)), grad_out, *args)
    assert torch.equal(y, arch.layer(0)(x, unit.bind(unit.range_of(params)), *args))
    assert torch.equal(grad_x, want_x) and want.keys() == grads.keys()
    assert all(torch.equal(grads[name], want[name]) for name in want)
    assert len(kept) == 0 and kept.saved_bytes == 0


# ---- the executor, without Ray ----

def run_steps(config: ModelConfig, kept: int, device: str, precision: str, micro_batches: int, schedule: str,
              resident: int = 0, bf16_copy: bool = True, rec: Recorder | None = None, steps: int = 1
              ) -> list[tuple[float, torch.Tensor, list[float]]]:
    """Each step's loss, every unit's gradient (the resident ones' from the device) and norms, on fixed weights.
    bf16_copy: bf16 runs read the weights from a bf16 copy (else they are cast into the two rotating buffers, even
    on the plain CPU path)."""
    layout = ModelLayout.build(config)
    t = {name: torch.zeros(layout.numel) for name in ("params", "grads", "exp_avg", "exp_avg_sq")}
    init_weights(layout, t["params"], seed=3)
    executor = Executor(config, layout, t["params"], t["grads"], device=device, precision=precision, recorder=rec,
                        bf16_copy=t["params"].to(torch.bfloat16) if bf16_copy else None, resident_units=resident,
                        kept_layers=kept)
    executor.resident.load(t, 0)
    gen = torch.Generator().manual_seed(1)
    out = []
    try:
        for step in range(steps):
            if rec is not None:
                rec.begin_step(step)
            ids = torch.randint(0, config.vocab_size, (4, 12), generator=gen)
            result = executor.run(ids, micro_batches=micro_batches, schedule=schedule)
            grads = t["grads"].clone()
            grads[: executor.resident.numel] = executor.resident.tensors["grads"]
            out.append((result.loss, grads, result.unit_grad_norms_sq))
            assert len(executor.passes.kept) == 0 and executor.passes.kept.saved_bytes == 0  # nothing outlives a step
            if rec is not None:
                rec.end_step()
        if kept:
            assert executor.passes.kept.peak_saved_bytes > 0
    finally:
        executor.close()
    return out


@pytest.mark.parametrize(("tied", "device", "precision", "micro_batches", "schedule", "resident", "bf16_copy",
                          "kept"), [
    (False, "cpu", "bf16", 2, "layer-major", 0, False, 2),
    (True, "cpu-async:3", "bf16", 2, "layer-major", 3, True, 2),
    (False, "cpu-async:1", "fp32", 2, "per-micro-batch", 0, True, 4),
    pytest.param(False, "cpu", "fp32", 1, "layer-major", 0, True, 4, marks=pytest.mark.slow),
    pytest.param(True, "cpu", "bf16", 2, "layer-major", 6, True, 4, marks=pytest.mark.slow),
    pytest.param(False, "cpu-async:5", "bf16", 2, "per-micro-batch", 0, False, 1, marks=pytest.mark.slow),
    pytest.param(True, "cpu-async:2", "fp32", 1, "layer-major", 3, True, 3, marks=pytest.mark.slow),
])
def test_kept_layers_give_the_recompute_paths_gradients_bit_for_bit(tied: bool, device: str, precision: str,
                                                                   micro_batches: int, schedule: str, resident: int,
                                                                   bf16_copy: bool, kept: int) -> None:
    """The loss, every gradient and norm; the trace names a kept layer's backward "backward", a recomputed one's
    "recompute+backward"."""
    config = tiny(tie_embeddings=tied)
    settings = dict(device=device, precision=precision, micro_batches=micro_batches, schedule=schedule,
                    resident=resident, bf16_copy=bf16_copy)
    rec = Recorder()
    want, got = run_steps(config, 0, **settings), run_steps(config, kept, rec=rec, **settings)
    for (loss, grads, norms), (want_loss, want_grads, want_norms) in zip(got, want, strict=True):
        assert loss == want_loss and norms == want_norms and torch.equal(grads, want_grads)
    names = {(s.name, s.layer) for s in rec.spans if s.lane == "compute"}
    for unit in ModelLayout.build(config).layers:
        backward, other = ("backward", "recompute+backward")[:: 1 if unit.layer >= 4 - kept else -1]
        assert ("forward", unit.index) in names and (backward, unit.index) in names
        assert (other, unit.index) not in names


GPT2 = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.2, embd_pdrop=0.1,
                  attn_pdrop=0.3, bos_token_id=0, eos_token_id=1)


def test_the_generic_paths_dropout_draws_the_same_masks_kept_or_recomputed(tmp_path: Path) -> None:
    """GPT-2 with dropout on (transformers' own layers, the embedding dropout run with the first layer): every layer
    kept (simulated streams) or the top one, against none: the same loss and gradients, and the RNG left where the
    recompute path leaves it; another seed draws other masks."""
    build_hf_model(GPT2).save_pretrained(tmp_path)
    ids = torch.cat([batch(seed=4), batch(seed=5)])[:4]
    store = ParameterStore(tmp_path, verify=False)  # transformers' own layers: nothing of ours to check here
    try:
        def step(kept: int, device: str, seed: int = 123) -> tuple[float, torch.Tensor, torch.Tensor]:
            grads = torch.zeros_like(store.arena.grads)
            executor = Executor(store.config, store.layout, store.arena.params, grads, device=device, kept_layers=kept)
            torch.manual_seed(seed)
            try:
                loss = executor.run(ids, micro_batches=2).loss
            finally:
                executor.close()
            return loss, grads, torch.rand(4)

        want = step(0, "cpu")
        for kept, device in ((2, "cpu-async:2"), (1, "cpu")):
            loss, grads, after = step(kept, device)
            assert loss == want[0] and torch.equal(grads, want[1]) and torch.equal(after, want[2]), (kept, device)
        assert step(0, "cpu", seed=124)[0] != want[0]
    finally:
        store.close()


@pytest.mark.slow
def test_a_router_whose_loss_reaches_the_layers_through_their_recompute_is_refused(tmp_path: Path) -> None:
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True)
    build_hf_model(config).save_pretrained(tmp_path)
    with megatrain.from_pretrained(tmp_path) as model:
        executor = Executor(model.config, model.layout, model.store.arena.params,
                            torch.zeros_like(model.store.arena.grads), kept_layers=1)
        try:
            message = error(executor.run, batch(seed=1))
        finally:
            executor.close()
    assert "auxiliary loss" in message and "keep_activations = none" in message
    assert_one_sentence(message)


def test_the_tiled_path_keeps_none_and_refuses_a_count() -> None:
    config = tiny()
    layout = ModelLayout.build(config)
    message = error(Executor, config, layout, torch.zeros(layout.numel), torch.zeros(layout.numel), tile_tokens=8,
                    kept_layers=2)
    assert "tile_tokens" in message and "keep_activations = none" in message
    assert_one_sentence(message)
    assert "kept_layers must be between 0 and the model's 4 layers" in error(
        Executor, config, layout, torch.zeros(layout.numel), torch.zeros(layout.numel), kept_layers=5)
    seven = ModelConfig.from_name("7b")
    settings = dict(precision="bf16", on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, find_longest=False)
    tiled = plan_run(seven, 1, 32768, keep_activations="auto", **settings)
    assert tiled.tile_tokens and not tiled.kept.indices
    assert "kept activations: none (the tiled long-context path (tile_tokens) recomputes" in tiled.report()
    message = error(plan_run, seven, 1, 32768, keep_activations=4, **settings)
    assert "tile_tokens" in message and "set keep_activations = none" in message
    assert_one_sentence(message)
    untiled = plan_run(seven, 1, 32768, keep_activations=4, tile_tokens=None, **{**settings, "gpu_free": 1000 * GiB})
    assert untiled.kept.indices == (28, 29, 30, 31)


# ---- the plan ----

SEVEN_B = ModelConfig.from_name("7b")
H100 = dict(precision="bf16", on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, optimizer_workers=8,
            find_longest=False)


def test_the_plan_keeps_every_layer_at_small_k_and_the_top_layers_at_large_k() -> None:
    per_layer = saved_bytes_per_token(SEVEN_B, "bf16", 2048) * 2048  # one micro-batch of 1 x 2048 tokens
    small = plan_run(SEVEN_B, 1, 2048, micro_batches=1, keep_activations="auto", **H100)
    assert small.kept.indices == tuple(range(32)) and small.kept.bytes == 32 * per_layer
    assert "kept activations: layers 0-31 (32 of 32" in small.report() and "every layer fits" in small.report()
    large = plan_run(SEVEN_B, 1, 2048, micro_batches=16, keep_activations="auto", **H100)
    n = len(large.kept.indices)
    assert 0 < n < 32 and large.kept.indices == tuple(range(32 - n, 32))  # the top: their backward comes first
    assert large.kept.bytes == n * 16 * per_layer and large.gpu_problem() is None
    room = large.gpu_free - large.gpu_total + large.kept.bytes
    margin = max(2 * GiB, 0.1 * room)  # as the resident units leave it
    assert large.kept.bytes <= room - margin < large.kept.bytes + 16 * per_layer  # one more layer would not fit
    streamed = plan_run(SEVEN_B, 1, 2048, micro_batches=16, **H100)
    assert large.gpu_total - large.kept.bytes == streamed.gpu_total  # placed in what was left
    assert f"kept activations: layers {32 - n}-31 ({n} of 32" in large.report()
    assert "the top layers, whose backward comes first" in large.report()
    as_json = _plan_json(large, None, None, 2048, True, 8)["plan"]
    assert list(as_json["kept"]["indices"]) == list(range(32 - n, 32)) and as_json["kept_note"] == large.kept.describe()


@pytest.mark.parametrize(("config", "settings", "why"), [
    (SEVEN_B, dict(on_gpu=False), "the CPU path; ask for them with keep_activations = all or N"),
    (SEVEN_B, dict(on_gpu=True), "the GPU's free memory is not known"),
    (SEVEN_B, dict(on_gpu=True, gpu_free=80 * GiB, keep_activations="none"), "keep_activations = none"),
    (SEVEN_B, dict(on_gpu=True, gpu_free=80 * GiB, resident="auto", micro_batches=8),
     "no room on the device beyond the pipeline, its activation checkpoints and the resident units; resident first: "
     "no calibration to predict the split by"),
    (dataclasses.replace(SEVEN_B, model_type="gemma2"), dict(on_gpu=True, gpu_free=80 * GiB),
     "the plan counts the saved bytes of the Llama template's layers only (unwindowed)"),
])
def test_where_the_plan_keeps_none_it_says_why(config: ModelConfig, settings: dict[str, Any], why: str) -> None:
    settings = {"keep_activations": "auto", **settings}
    plan = plan_run(config, 1, 2048, precision="bf16", host_free=1000 * GiB, find_longest=False, **settings)
    assert not plan.kept.indices and plan.kept.bytes == 0
    assert f"kept activations: none ({why}" in plan.report()


@pytest.mark.parametrize(("micro_batches", "first"), [(1, "resident"), (16, "kept")])
def test_without_a_calibration_the_split_follows_the_rule_and_says_so(micro_batches: int, first: str) -> None:
    """Resident units and kept layers both auto, no predictor: resident first where the CPU pool's update of every
    parameter at its nominal rate outlasts the backward's compute at the GPU's (7B bf16: K=1), else kept first (K=16):
    the same plan as asking for that order's count of the other."""
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=micro_batches, resident="auto", keep_activations="auto", **H100)
    alone = dict(micro_batches=micro_batches, **H100)
    units = plan_run(SEVEN_B, 1, 2048, resident="auto", keep_activations="none", **alone).resident_units
    layers = len(plan_run(SEVEN_B, 1, 2048, resident="none", keep_activations="auto", **alone).kept.indices)
    order = (plan_run(SEVEN_B, 1, 2048, resident=units, keep_activations="auto", **alone) if first == "resident" else
             plan_run(SEVEN_B, 1, 2048, resident="auto", keep_activations=layers, **alone))
    assert (plan.resident_units, plan.kept.indices) == (order.resident_units, order.kept.indices)
    assert (plan.resident_units == units) == (first == "resident") and plan.kept.indices
    assert (len(plan.kept.indices) == layers) == (first == "kept") and plan.gpu_problem() is None
    rule = f"{first} first: no calibration to predict the split by, and the "
    assert rule in plan.resident_note and rule in plan.kept.describe() and "at a nominal" in plan.resident_note


def test_a_count_asked_for_either_is_placed_first_and_the_other_takes_the_rest() -> None:
    """resident = N with keep_activations auto: N units, the layers in the rest; keep_activations = N with resident
    auto: N layers, the units in the rest (resident first would have left no room for them); both counts: both."""
    alone = dict(micro_batches=16, **H100)
    units = plan_run(SEVEN_B, 1, 2048, resident=8, keep_activations="auto", **alone)
    assert units.resident_units == 8 and "resident = 8" in units.resident_note
    more = plan_run(SEVEN_B, 1, 2048, resident=2, keep_activations="auto", **alone)
    assert 0 < len(units.kept.indices) < len(more.kept.indices)  # the layers take what the units leave
    layers = plan_run(SEVEN_B, 1, 2048, resident="auto", keep_activations=4, **alone)
    resident_first = plan_run(SEVEN_B, 1, 2048, resident="auto", keep_activations="none", **alone)
    assert layers.kept.indices == (28, 29, 30, 31) and "keep_activations = 4" in layers.kept.describe()
    assert 0 < layers.resident_units < resident_first.resident_units
    for plan in (units, layers):
        assert plan.gpu_total + 2 * GiB <= plan.gpu_free and plan.gpu_problem() is None
        assert "split" not in plan.resident_note + plan.kept.describe()  # nothing was left to choose
    both = plan_run(SEVEN_B, 1, 2048, resident=5, keep_activations=2, **alone)
    assert both.resident_units == 5 and both.kept.indices == (30, 31)


def test_a_count_asked_for_on_the_cpu_path_is_host_memory() -> None:
    none = plan_run(TINY, 2, 64, host_free=100 * GiB, find_longest=False)
    every = plan_run(TINY, 2, 64, host_free=100 * GiB, find_longest=False, keep_activations="all")
    one = plan_run(TINY, 2, 64, host_free=100 * GiB, find_longest=False, keep_activations=1)
    per_layer = saved_bytes_per_token(TINY, "tf32", 64) * 2 * 64
    assert every.kept.indices == tuple(range(TINY.num_layers)) and every.kept.bytes == TINY.num_layers * per_layer
    assert every.process_bytes == none.process_bytes + every.kept.bytes
    assert one.kept.indices == (TINY.num_layers - 1,) and "keep_activations = 1" in one.report()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_bytes_formula_is_what_the_pack_hooks_keep(model_type: str, precision: str, kv_heads: int) -> None:
    """Grouped-query and not (fp32 expands k and v for SDPA), Qwen3's q/k norms, packed documents or not: the formula
    of megatrain/memory/kept_activations.py against the bytes a layer's kept graph holds."""
    config = tiny(1, model_type=model_type, num_kv_heads=kv_heads)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=1)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    unit, arch = layout.layers[0], config.family.architecture(config)
    b, t = 2, 16
    for documents in (False, True):
        positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(b, t) if documents else None
        args = arch.batch(b, t, torch.device("cpu"), dtype, positions).layer_args(0)
        kept = KeptActivations()
        kept.forward(0, arch.layer(0), torch.randn(b, t, config.hidden_size).to(dtype),
                     unit.bind(unit.range_of(params).to(dtype)), args)
        assert kept.saved_bytes == b * t * saved_bytes_per_token(config, precision, t, documents), documents


# ---- the settings ----

def test_the_setting_reads_as_residents_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = error(EngineConfig, keep_activations="most")
    assert message == ("keep_activations must be 'auto', 'none', 'all' or a number of layers >= 0, got 'most'.")
    assert EngineConfig(keep_activations="all").keep_activations == "all"
    toml = tmp_path / "run.toml"
    toml.write_text('keep_activations = "all"\nresident = 2\n')
    assert TrainConfig.load(toml, {}).keep_activations == "all"
    assert TrainConfig.load(toml, {"keep_activations": 3}).keep_activations == 3
    with pytest.raises(ConfigError, match="keep_activations must be"):
        TrainConfig.load(toml, {"keep_activations": -1})
    assert main(["plan", "--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "64", "--host-gib", "100",
                 "--keep-activations", "ALL"]) == 0
    assert "kept activations: layers 0-1 (2 of 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--keep-activations", "some"])


# ---- the Engine ----

def test_an_engine_keeping_every_layer_trains_as_one_keeping_none(ray_session: None) -> None:
    """Two steps of the tiny model, clipping on: every layer kept against none, bit for bit; the kept run's trace has
    no recompute."""
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for keep in ("none", "all"):
        with megatrain.Engine("tiny", device="cpu", precision="fp32", optimizer_workers=1, batch_size=2, seq_len=16,
                              metrics=False, keep_activations=keep, trace=keep == "all") as engine:
            assert engine.engine_config.keep_activations == (0 if keep == "none" else TINY.num_layers)
            steps = [engine.step_batch({"input_ids": rows.numpy()}) for rows in (ids, ids.flip(0))]
            results[keep] = [s.loss for s in steps], engine.parameters()
    names = {s.name for s in steps[0].spans + steps[1].spans}
    assert "backward" in names and "recompute+backward" not in names
    assert results["all"][0] == results["none"][0]
    want = results["none"][1]
    assert all(torch.equal(results["all"][1][name], want[name]) for name in want)

