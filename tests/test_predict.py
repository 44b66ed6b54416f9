"""The calibration cache, the step-time prediction's properties (each term of the engine's schedule it follows: the
pool's rate beside copies, resident units, kept activations, the update beside the backward and its rollbacks,
compiled layers), the split of the GPU's spare memory it chooses, `megatrain calibrate` and `plan --json`, a run's
prediction of its own plan, and predicted beside measured in the progress bar and the report. No timing is asserted:
that is benchmarks/predict.py's."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import pytest
import torch

from megatrain.config import ModelConfig
from megatrain.memory.plan import plan_run
from megatrain.perf.calibrate import CACHE_ENV, Calibration, LayerTiming, layer_key
from megatrain.perf.predict import CASES, ROLLBACK_COST, auto_optimizer_workers, choose, predict, step_time
from pipelines.cli import main

GiB = 2**30
H100 = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrations" / "h100-80gb-hbm3.json"
SEVEN_B = ModelConfig.from_name("7b")
# the bf16 copy kept in every plan compared here, as before its rule (whether to keep it: test_bf16_copy.py)
ON_H100 = dict(on_gpu=True, gpu_free=79 * GiB, host_free=125 * GiB, precision="bf16", optimizer_workers=8,
               find_longest=False, bf16_copy="keep")


def gpu_calibration() -> Calibration:
    """A made-up H100-like machine: 50 GB/s each way, 400 TFLOP/s tf32, 1 G params/s per optimizer worker."""
    return Calibration(device="FakeGPU", host="h", created=0.0, cores=16, compute_threads=4, h2d_gbps=50.0,
                       d2h_gbps=50.0, memcpy_gbps=10.0, matmul_tflops={"tf32": 400.0, "fp32": 50.0, "bf16": 800.0},
                       adamw_gparams={str(w): float(w) for w in range(1, 9)})


def cpu_calibration() -> Calibration:
    return Calibration(device="cpu", host="h", created=0.0, cores=2, compute_threads=2, h2d_gbps=None, d2h_gbps=None,
                       memcpy_gbps=5.0, matmul_tflops={"fp32": 0.1, "tf32": 0.1}, adamw_gparams={"1": 1.0, "2": 1.2})


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CACHE_ENV, str(path))
    return path


def test_calibration_cache_round_trip(cache: Path) -> None:
    cal = cpu_calibration()
    cal.layers["k"] = LayerTiming(0.01, 0.02)
    assert Calibration.load("cpu") is None  # nothing cached yet
    assert cal.save() == cache
    assert Calibration.load("cpu") == cal
    assert Calibration.load("NVIDIA H100") is None  # another device's calibration is not this one's
    cache.write_text("{not json")
    assert Calibration.load("cpu") is None


def test_calibrate_on_the_cpu_quickly(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`megatrain calibrate`: the pool of 1 .. cores workers timed in processes of their own, alone, beside copies (on
    the CPU path a paced host memcpy stands for them) and its rollback pass; the prediction takes the rate beside. The
    layer timings of other shapes cached before are kept."""
    earlier = cpu_calibration()
    earlier.layers["another shape"] = LayerTiming(0.01, 0.02)
    earlier.save()
    assert main(["calibrate", "--device", "cpu", "--model", "tiny", "--batch", "1", "--seq", "32", "--precision",
                 "fp32", "--max-seconds", "1", "--no-step-costs", "--json"]) == 0  # step costs: below
    written = json.loads(capsys.readouterr().out)
    cal = Calibration.load("cpu")
    assert written["path"] == str(cache) and cal is not None
    assert cal.device == "cpu" and cal.h2d_gbps is None and cal.memcpy_gbps > 0
    assert cal.matmul_tflops["fp32"] > 0 and cal.matmul_tflops["tf32"] == cal.matmul_tflops["fp32"]
    workers = {str(w) for w in range(1, len(cal.adamw_gparams) + 1)}
    for rates in (cal.adamw_gparams, cal.adamw_beside_copies_gparams, cal.rollback_gparams):
        assert set(rates) == workers and all(rate > 0 for rate in rates.values())
    assert cal.copies_gbps > 0 and "simulation" in cal.copies_kind and cal.device_adamw_gparams is None
    tiny = ModelConfig.from_name("tiny")
    timing = cal.layers[layer_key(tiny, 1, 32, "fp32")]
    assert timing.layer_s >= 0 and timing.rest_s >= 0
    plan = plan_run(tiny, 1, 32, on_gpu=False, find_longest=False)
    pred = predict(plan, tiny, cal, precision="fp32", optimizer_workers=1)
    assert pred.compute_source == "measured layers" and "beside copies" in pred.optimizer_rate
    assert pred.optimizer_s == pytest.approx(plan.params / (cal.adamw_beside_copies_gparams["1"] * 1e9))
    assert cal.layers["another shape"] == LayerTiming(0.01, 0.02)


def test_layers_timed_on_simulated_streams_from_compute_spans() -> None:
    """Where copies run on streams of their own (a GPU; here the CPU's simulation of one) the layers' times are the
    compute stream's spans, so that the weights' round trip through unregistered memory is not counted as compute
    (on the H100 it made a 7B layer read 10x its compute)."""
    from megatrain.perf.calibrate import time_layers

    tiny = ModelConfig.from_name("tiny")
    layer, rest = time_layers(tiny, 1, 32, device="cpu-async:3", budget_s=30)
    assert layer > 0 and rest > 0


def test_layer_major_pcie_time_falls_as_one_over_k() -> None:
    config, cal = ModelConfig.from_name("1b"), gpu_calibration()
    per_token = {}
    for k in (1, 2, 4):
        plan = plan_run(config, 1, 2048, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, micro_batches=k,
                        schedule="layer-major", find_longest=False)
        pred = predict(plan, config, cal, optimizer_workers=8)
        per_token[k] = (pred.h2d_s + pred.d2h_s) / plan.step_tokens
        assert pred.compute_s == pytest.approx(k * predict(replace(plan, micro_batches=1), config, cal).compute_s)
        assert pred.tokens_per_s == pytest.approx(plan.step_tokens / pred.step_s)
    # weights and gradients cross once a step: only the embedding rows grow with the tokens
    assert per_token[2] == pytest.approx(per_token[1] / 2, rel=0.02)
    assert per_token[4] == pytest.approx(per_token[1] / 4, rel=0.02)
    per_micro = plan_run(config, 1, 2048, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, micro_batches=4,
                         schedule="per-micro-batch", find_longest=False)
    assert predict(per_micro, config, cal).h2d_s > 3 * per_token[1] * per_micro.step_tokens / 4


def test_bound_is_the_biggest_lane_and_the_step_covers_it() -> None:
    config = ModelConfig.from_name("1b")
    plan = plan_run(config, 1, 512, on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB, find_longest=False)
    for cal in (gpu_calibration(), replace(gpu_calibration(), h2d_gbps=0.5),
                replace(gpu_calibration(), adamw_gparams={"1": 0.01})):
        pred = predict(plan, config, cal, optimizer_workers=1)
        lanes = {"compute": pred.compute_s, "h2d": pred.h2d_s, "d2h": pred.d2h_s, "optimizer": pred.optimizer_s,
                 "data": pred.data_s}
        assert pred.bound == max(lanes, key=lanes.get)
        assert pred.step_s >= max(lanes.values())
    assert predict(plan, config, replace(gpu_calibration(), h2d_gbps=0.5)).bound == "h2d"


def test_the_cpu_path_adds_its_lanes_up() -> None:
    tiny, cal = ModelConfig.from_name("tiny"), cpu_calibration()
    plan = plan_run(tiny, 2, 64, on_gpu=False, find_longest=False)
    cal.layers[layer_key(tiny, 2, 64, "tf32")] = LayerTiming(0.01, 0.005)
    pred = predict(plan, tiny, cal, optimizer_workers=2)
    assert pred.compute_source == "measured layers"
    assert pred.compute_s == pytest.approx(tiny.num_layers * 0.01 + 0.005)
    assert pred.h2d_s == pred.d2h_s == 0.0
    assert pred.optimizer_s == pytest.approx(tiny.num_params() / 1.2e9)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.optimizer_s + pred.data_s + pred.overhead_s)
    rolled = predict(plan, tiny, cal, optimizer_workers=2, speculate="on", clip_rate=1.0)  # and the rollback too
    assert rolled.step_s == pytest.approx(pred.step_s + rolled.rollback_s) and rolled.rollback_s > 0


# ---- each term of the step as the engine runs it (pure arithmetic) ----

def h100() -> Calibration:
    return Calibration.read(H100)


def test_the_pool_rate_beside_copies_is_the_one_used() -> None:
    """The pool's update shares host memory bandwidth with the copies: the rate timed beside them is the prediction's;
    a calibration that timed the pool alone only (older ones) is used alone, and the report says which."""
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="none", **ON_H100)
    cal = h100()
    beside = predict(plan, SEVEN_B, cal, precision="bf16", optimizer_workers=8)
    alone = predict(plan, SEVEN_B, replace(cal, adamw_beside_copies_gparams={}), precision="bf16",
                    optimizer_workers=8)
    rate_beside, rate_alone = cal.adamw_beside_copies_gparams["8"], cal.adamw_gparams["8"]
    assert rate_beside < rate_alone  # as measured on the H100 (2.76 against 3.55 G params/s)
    assert beside.optimizer_s == pytest.approx(plan.params / rate_beside / 1e9)
    assert "beside copies" in beside.optimizer_rate
    assert alone.optimizer_s == pytest.approx(plan.params / rate_alone / 1e9) and "alone" in alone.optimizer_rate
    assert beside.step_s > alone.step_s
    one_count = replace(cal, adamw_beside_copies_gparams={"8": rate_beside})  # the count timed is the one taken
    assert predict(plan, SEVEN_B, one_count, precision="bf16", optimizer_workers=16).optimizer_s == beside.optimizer_s


def test_resident_units_take_no_pcie_and_no_pool_time() -> None:
    """Resident units are updated on the device at its rate: their parameters leave the pool's time, their weights and
    gradients leave PCIe, and their update is the device's."""
    cal = h100()
    none = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="none", **ON_H100)
    some = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident=10, **ON_H100)
    a, b = (predict(p, SEVEN_B, cal, precision="bf16", optimizer_workers=8) for p in (none, some))
    streamed = some.params - some.resident_params
    assert b.optimizer_s == pytest.approx(a.optimizer_s * streamed / none.params)
    assert b.h2d_s == pytest.approx(some.h2d_bytes / (cal.h2d_gbps * 1e9)) and b.h2d_s < a.h2d_s and b.d2h_s < a.d2h_s
    assert cal.device_adamw_gparams is not None and a.resident_update_s == 0
    assert b.resident_update_s == pytest.approx(some.resident_params / (cal.device_adamw_gparams * 1e9))
    assert b.step_s < a.step_s
    uncalibrated = predict(some, SEVEN_B, replace(cal, device_adamw_gparams=None), precision="bf16",
                           optimizer_workers=8)
    assert uncalibrated.resident_update_s == 0


def test_kept_layers_skip_their_recompute() -> None:
    """A layer that keeps its activations skips its recompute, a quarter of its forward + recompute + backward, for
    every micro-batch; by default the count is the plan's (plan.kept)."""
    cal = h100()
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="none", keep_activations="none", **ON_H100)
    layer_s = cal.layers[layer_key(SEVEN_B, 1, 2048, "bf16")].layer_s
    base = predict(plan, SEVEN_B, cal, precision="bf16", optimizer_workers=8)
    kept = predict(plan, SEVEN_B, cal, precision="bf16", optimizer_workers=8, kept_layers=6)
    assert base.kept_layers == 0 and kept.kept_layers == 6
    assert base.compute_s - kept.compute_s == pytest.approx(4 * 6 * layer_s / 4)
    assert base.phases["backward"]["s"] - kept.phases["backward"]["s"] == pytest.approx(4 * 6 * layer_s / 4)
    assert base.phases["forward"] == kept.phases["forward"]
    planned = plan_run(SEVEN_B, 1, 2048, micro_batches=1, keep_activations=3, **ON_H100)
    assert predict(planned, SEVEN_B, cal, precision="bf16", optimizer_workers=8).kept_layers == 3


def test_the_spare_gpu_memory_goes_where_the_predicted_step_is_shortest() -> None:
    """Resident units and kept layers both auto, 7B bf16 on the recorded H100 (compiled, as compile auto takes it):
    at K=16, compute-bound, the plan keeps more layers than resident first does, for a shorter predicted step; at K=1,
    optimizer-bound, resident first; either way no longer than either pure order, each made here by asking for the
    count the other order leaves (a count is placed first, the other auto in the rest), and the lines say why."""
    predicted = step_time(SEVEN_B, h100(), precision="bf16", optimizer_workers=8, compiled=True)
    for k in (16, 1):  # the units' bf16 weights a copy throughout (which way is the next test's), and the arena's
        # bf16 copy of the weights kept in every plan compared (ON_H100)
        plan = partial(plan_run, SEVEN_B, 1, 2048, micro_batches=k, resident_weights="copy", **ON_H100)
        chosen = plan(resident="auto", keep_activations="auto", step_time=predicted)
        units = plan(resident="auto", keep_activations="none").resident_units
        layers = len(plan(resident="none", keep_activations="auto").kept.indices)
        resident_first = plan(resident=units, keep_activations="auto")
        kept_first = plan(resident="auto", keep_activations=layers)
        assert predicted(chosen) <= min(predicted(resident_first), predicted(kept_first))
        assert chosen.gpu_problem() is None and chosen.gpu_total + 2 * GiB <= chosen.gpu_free
        note = (f"splits: {predicted(chosen):.2f} s, against {predicted(resident_first):.2f} s resident-first and "
                f"{predicted(kept_first):.2f} s kept-first")
        for line in (chosen.resident_note, chosen.kept.describe()):
            assert "the spare GPU memory split for the shortest predicted step of" in line and note in line
        if k == 16:
            assert len(resident_first.kept.indices) < len(chosen.kept.indices) < layers
            assert predicted(chosen) < predicted(resident_first)
        else:
            assert chosen.resident_units == units and chosen.kept.indices == resident_first.kept.indices


def test_the_resident_weights_are_cast_where_the_units_it_fits_pay_for_the_casts() -> None:
    """In bf16 the resident units' weights for compute are a bf16 copy kept on the GPU (18 B a parameter in all) or
    cast from their fp32 weights at each use (16 B: more units; each resident layer's weights cast twice a step, 6 B a
    parameter at the device's memory rate). With both auto and a predictor, the plan places the spare memory both ways
    and takes the shorter predicted step: on the H100 (every step clipping) the casts, whose units take work off the
    CPU pool that bounds K=1; on the H200 at K=1, where 33 of 34 units fit with their copy, the copy. Without a
    predictor, or a count asked for, the copy, unless the cast is asked for; the line says which and the two times."""
    cal = h100()
    settings = dict(precision="bf16", optimizer_workers=8, compiled=True, clip_rate=1.0)
    predicted = step_time(SEVEN_B, cal, **settings)
    plan = partial(plan_run, SEVEN_B, 1, 2048, micro_batches=1, resident="auto", keep_activations="auto", **ON_H100)
    chosen, copy, cast = (plan(step_time=predicted, resident_weights=w) for w in ("auto", "copy", "cast"))
    assert (chosen.resident_weights, copy.resident_weights, cast.resident_weights) == ("cast", "copy", "cast")
    assert chosen == replace(cast, resident_note=chosen.resident_note)
    assert cast.resident_units > copy.resident_units  # 16 B a unit's parameter, not 18
    assert cast.gpu_resident == cast.resident_params * 16 and copy.gpu_resident == copy.resident_params * 18
    assert predicted(cast) < predicted(copy)
    assert chosen.resident_note.endswith(f"; their bf16 weights cast at each use: {predicted(cast):.2f} s predicted, "
                                         f"against {predicted(copy):.2f} s with a bf16 copy of their weights")
    assert "their bf16 weights cast at each use, no bf16 copy" in chosen.report()
    # the casts are in the prediction: the units' compute weights read in fp32 and written in bf16, twice a step
    cast_s = 2 * cast.resident_params * 6 / (cal.device_adamw_gparams * 1e9 * 28)
    as_copy = predict(replace(cast, resident_weights="copy"), SEVEN_B, cal, **settings)
    assert predict(cast, SEVEN_B, cal, **settings).compute_s == pytest.approx(as_copy.compute_s + cast_s)
    # the H200 at K=1: every unit but the head fits with its copy, and the casts would cost more than the head saves
    h200 = step_time(SEVEN_B, Calibration.read(H100.parent / "h200.json"), **settings)
    big = plan_run(SEVEN_B, 1, 2048, micro_batches=1, resident="auto", keep_activations="auto", step_time=h200,
                   **{**ON_H100, "gpu_free": 139 * GiB})
    assert big.resident_weights == "copy" and big.resident_units == 33
    assert "; a bf16 copy of their weights: " in big.resident_note
    # no predictor (the rule splits), a count asked for, or not bf16: the copy, or what is asked for
    assert plan().resident_weights == "copy" and plan(resident_weights="cast").resident_weights == "cast"
    assert plan(resident=3, step_time=predicted).resident_weights == "copy"
    fp32 = plan_run(SEVEN_B, 1, 2048, **{**ON_H100, "precision": "tf32"}, resident="auto", step_time=predicted,
                    resident_weights="cast")
    assert fp32.resident_weights == "copy" and fp32.gpu_resident == fp32.resident_params * 16


def test_compiled_layers_where_the_run_compiles() -> None:
    cal = h100()
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=4, **ON_H100)
    timed = cal.compiled[layer_key(SEVEN_B, 1, 2048, "bf16")]
    eager, compiled = (predict(plan, SEVEN_B, cal, precision="bf16", optimizer_workers=8, compiled=c)
                       for c in (False, True))
    assert compiled.compute_source == "measured layers, compiled" and eager.compute_source == "measured layers"
    assert compiled.compute_s == pytest.approx(4 * (32 * timed.compiled_layer_s + timed.compiled_rest_s))
    assert eager.compute_s == pytest.approx(4 * (32 * timed.eager_layer_s + timed.eager_rest_s))
    untimed = predict(plan, SEVEN_B, replace(cal, compiled={}), precision="bf16", optimizer_workers=8, compiled=True)
    assert untimed.compute_s == eager.compute_s and "compiled not timed" in untimed.compute_source


def test_the_update_beside_the_backward_hides_it_where_no_step_clips() -> None:
    """Unclipped, each unit's update runs as its gradient lands, beside the backward: at K = 16 the 7B's backward (its
    resident units on the GPU) is longer than the pool's update, and the step is its compute; the serial update
    (speculate off) overlaps the next forward only and shows."""
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=16, resident="auto", keep_activations="none", **ON_H100)
    kwargs = dict(precision="bf16", optimizer_workers=8, compiled=True)
    on, off = (predict(plan, SEVEN_B, h100(), speculate=s, **kwargs) for s in ("on", "off"))
    assert on.cases["speculated"]["share"] == 1.0 and off.cases["serial"]["share"] == 1.0
    assert on.optimizer_s < on.phases["backward"]["s"]  # the pool keeps pace with the gradients landing
    assert on.exposed["optimizer"] == on.resident_update_s > 0  # the resident units' update on the GPU, no more
    assert on.phases["update"]["bound"] == "hidden"
    assert off.exposed["optimizer"] > on.optimizer_s - off.phases["forward"]["s"] - 0.01
    assert on.step_s < off.step_s and on.bound == "compute"
    # clipping off with one executor: every update is final as it lands, whatever speculate says
    stream = plan_run(SEVEN_B, 1, 2048, micro_batches=16, grads="stream", clipping=False, resident="none", **ON_H100)
    never = predict(stream, SEVEN_B, h100(), speculate="off", clipping=False, clip_rate=1.0, **kwargs)
    assert never.cases["speculated"]["share"] == 1.0 and never.clip_rate == 0.0


def test_a_clipped_step_rolls_back_at_the_cost_of_a_serial_update() -> None:
    """A speculated step that clips waits for the updates beside the backward, then undoes and redoes them in one pass,
    beside the next forward as the serial update runs: at the rollback's rate, the serial update's cost and more.
    speculate auto runs the step after a clipped one serially: at clip rate p, (1 - p)^2 speculated, (1 - p) p rolled
    back, p serial."""
    plan = plan_run(SEVEN_B, 1, 2048, micro_batches=4, resident="none", **ON_H100)
    kwargs = dict(precision="bf16", optimizer_workers=8, compiled=True)
    cal = h100()
    as_fast = replace(cal, rollback_gparams={"8": cal.adamw_beside_copies_gparams["8"]})  # at the update's rate
    pred = predict(plan, SEVEN_B, as_fast, speculate="on", clip_rate=1.0, **kwargs)
    rolled, serial = pred.cases["rolled back"], pred.cases["serial"]
    assert pred.rollback_s == pytest.approx(pred.optimizer_s) and rolled["share"] == 1.0
    assert rolled["exposed_update_s"] >= serial["exposed_update_s"]
    assert rolled["step_s"] >= serial["step_s"] > pred.cases["speculated"]["step_s"]
    uncalibrated = predict(plan, SEVEN_B, replace(cal, rollback_gparams={}), speculate="on", clip_rate=1.0, **kwargs)
    assert uncalibrated.rollback_s == pytest.approx(ROLLBACK_COST * uncalibrated.optimizer_s)
    assert uncalibrated.step_s > pred.step_s
    p = 0.25
    mixed = predict(plan, SEVEN_B, as_fast, speculate="auto", clip_rate=p, **kwargs)
    shares = {c: mixed.cases[c]["share"] for c in CASES}
    assert shares == pytest.approx({"speculated": (1 - p) ** 2, "rolled back": (1 - p) * p, "serial": p})
    assert mixed.step_s == pytest.approx(sum(shares[c] * mixed.cases[c]["step_s"] for c in CASES))
    assert mixed.tokens_per_s == pytest.approx(plan.step_tokens / mixed.step_s)
    with pytest.raises(ValueError, match="clip_rate"):
        predict(plan, SEVEN_B, as_fast, clip_rate=1.5)


def test_choose_picks_the_fastest_candidate_that_fits() -> None:
    config, cal = ModelConfig.from_name("1b"), gpu_calibration()
    kwargs = dict(on_gpu=True, gpu_free=80 * GiB, host_free=1000 * GiB)
    choice = choose(config, 1, 2048, cal, clipping=False, max_workers=8, **kwargs)
    assert choice is not None and choice.tried > 1
    for w in (1, 4, 8):
        plan = plan_run(config, 1, 2048, grads="stream", clipping=False, optimizer_workers=w, find_longest=False,
                        **kwargs)
        assert choice.prediction.step_s <= predict(plan, config, cal, optimizer_workers=w, clipping=False).step_s
    assert choose(config, 1, 2048, cal, on_gpu=True, gpu_free=1 * GiB, host_free=1 * GiB) is None  # nothing fits
    # the worker counts tried are those of the calibrated machine's cores, not this one's (the H100's 16 cores: from a
    # 2-core machine, `plan --optimizer-workers auto --calibration` once tried 1 and 2 and picked 2)
    h100_cal = h100()
    best = choose(SEVEN_B, 1, 2048, h100_cal, precision="bf16", resident="none", on_gpu=True, gpu_free=79 * GiB,
                  host_free=125 * GiB)
    rates = h100_cal.adamw_beside_copies_gparams
    assert best is not None and best.optimizer_workers == int(max(rates, key=rates.__getitem__)) == 16


def test_plan_auto_predicts_each_candidate_as_the_run_it_picks(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --optimizer-workers auto` plans and predicts each candidate as `plan` then plans and predicts the one it
    picks: the GPU's spare memory split for that candidate's workers and placement, its layers compiled, the clip rate
    given. On the H100's calibration (7B bf16 at K=1, every step clipping) no worker count and placement given by
    hand predicts a shorter step. The search once planned its candidates with no resident units, eager and never
    clipping, and picked grads = arena with 16 workers: 1,722 tok/s printed where grads = device gives 1,762."""
    argv = ["plan", "--model", "7b", "--precision", "bf16", "--batch", "1", "--seq", "2048", "--micro-batches", "1",
            "--device", "cuda", "--gpu-gib", "78.66", "--host-gib", "123.68", "--calibration", str(H100),
            "--clip-rate", "1", "--compile", "on", "--json"]

    def predicted(*flags: str) -> dict:
        assert main([*argv, *flags]) == 0
        return json.loads(capsys.readouterr().out)

    auto = predicted("--optimizer-workers", "auto")
    given = {(w, g): predicted("--optimizer-workers", w, "--grads", g)["predicted_step_s"]
             for w in ("8", "16") for g in ("arena", "device")}
    assert auto["predicted_step_s"] == pytest.approx(min(given.values()))
    assert (str(auto["plan"]["optimizer_workers"]), auto["plan"]["grads"]) == min(given, key=given.__getitem__)
    assert auto["plan"]["resident_units"] > 0  # the split was made: the search's candidates have resident units


def test_plan_json_and_the_calibration_it_predicts_from(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipelines.train import TrainConfig

    train = TrainConfig()
    cal = cpu_calibration()
    key = layer_key(ModelConfig.from_name(train.model), train.data.batch_size, train.data.seq_len, train.precision)
    cal.layers[key] = LayerTiming(0.01, 0.005)
    cal.save()
    assert main(["plan", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"predicted_step_s", "predicted_tokens_per_s", "bound", "plan", "fits", "cases", "phases", "speculate",
            "clip_rate", "kept_layers", "optimizer_rate", "resident_update_s", "rollback_s"} <= set(out)
    assert out["bound"] in ("compute", "h2d", "d2h", "optimizer", "data") and out["fits"]
    assert out["predicted_tokens_per_s"] == pytest.approx(out["plan"]["step_tokens"] / out["predicted_step_s"])
    assert out["calibration"] == {"device": "cpu", "created": 0.0, "source": cal.source, "path": None}
    assert main(["plan", "--device", "cpu"]) == 0  # with a calibration cached, the plain plan predicts too
    assert "predicted step:" in capsys.readouterr().out
    assert main(["plan", "--device", "cpu", "--optimizer-workers", "auto"]) == 0
    assert "--optimizer-workers" in capsys.readouterr().out
    # a GPU's recorded calibration predicts its run on a machine without it: the 7B in bf16 on the H100, compiled
    # (compile auto: the calibration timed it faster), every step clipping under speculate on
    argv = ["plan", "--model", "7b", "--precision", "bf16", "--batch", "1", "--seq", "2048", "--micro-batches", "4",
            "--device", "cuda", "--gpu-gib", "79", "--host-gib", "125", "--optimizer-workers", "8", "--json",
            "--calibration", str(H100)]
    assert main([*argv, "--speculate", "on", "--clip-rate", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibration"]["device"] == "NVIDIA H100 80GB HBM3" and out["calibration"]["path"] == str(H100)
    assert out["compute_source"] == "measured layers, compiled" and out["plan"]["resident_units"] > 0
    assert "split for the shortest predicted step" in out["plan"]["resident_note"]  # from the calibration given
    assert out["speculate"] == "on" and out["clip_rate"] == 1.0 and out["cases"]["rolled back"]["share"] == 1.0
    assert set(out["phases"]) == {"forward", "head", "backward", "update"}
    assert out["predicted_step_s"] == pytest.approx(out["cases"]["rolled back"]["step_s"])
    assert main([*argv, "--compile", "off", "--clip-rate", "2"]) == 2  # one sentence
    assert "--clip-rate is the share of steps that clip" in capsys.readouterr().err


def test_the_recorded_h100_calibration_has_the_7b_layers() -> None:
    """benchmarks/calibrations/h100-80gb-hbm3.json is keyed by layer_key: a change to ModelConfig's fields changes the
    key, and the recorded 7B timings would silently fall back to the matmul rate."""
    cal = Calibration.read(H100)
    for precision in ("tf32", "bf16"):
        assert layer_key(SEVEN_B, 1, 2048, precision) in cal.layers
    assert layer_key(SEVEN_B, 1, 2048, "bf16") in cal.compiled
    assert cal.adamw_beside_copies_gparams and cal.rollback_gparams and "megatrain calibrate" in cal.source


def test_predicted_beside_measured(tmp_path: Path) -> None:
    from megatrain.telemetry import STEPS_FILE, StepStats, append_step
    from megatrain.telemetry.report import PREDICTION_FILE, report
    from pipelines.engine import StepResult
    from pipelines.train import _progress_fields

    result = StepResult(step=0, loss=1.0, tokens=100, grad_norm=1.0, lr=1e-3, skipped=False)
    fields = _progress_fields(result, 0.5, 1e6, 0, predicted=0.4)
    assert fields["pred s"] == "0.4" and fields["step s"] == "0.5"
    assert "pred s" not in _progress_fields(result, 0.5, 1e6, 0)
    for step in range(3):
        append_step(StepStats(step, 0.5, 0.4, 0.0, 0.0, 0.0, 0.1, 0, 0, 0.0, 0.0, 0.0, 0.2), tmp_path / STEPS_FILE)
    assert "predicted step" not in report(tmp_path)
    (tmp_path / PREDICTION_FILE).write_text(json.dumps({"predicted_step_s": 0.4, "bound": "compute",
                                                        "compute_s": 0.3}))
    assert "predicted step 400.0 ms (bound by compute" in report(tmp_path)
    assert "predicted / measured 0.80" in report(tmp_path)
    # train.py's records say how each step's update ran: each is held to its own case of the prediction (the first
    # step, which starts the pipeline, is left out of both means)
    cases = {"speculated": 0.3, "rolled back": 0.9, "serial": 0.6}
    (tmp_path / PREDICTION_FILE).write_text(json.dumps({
        "predicted_step_s": 0.3, "bound": "optimizer", "cases": {c: {"share": 0.0, "step_s": s}
                                                                 for c, s in cases.items()}}))
    stats = StepStats(0, 0.5, 0.4, 0.0, 0.0, 0.0, 0.1, 0, 0, 0.0, 0.0, 0.0, 0.2)
    updates = ["speculated", "rolled back", "serial", "serial"]
    (tmp_path / STEPS_FILE).write_text("".join(
        json.dumps({"step": s, "update": u, "stats": asdict(replace(stats, step=s))}) + "\n"
        for s, u in enumerate(updates)))
    line = next(x for x in report(tmp_path).splitlines() if x.startswith("predicted step"))
    assert line.startswith("predicted step 700.0 ms for each step's own update: 1 rolled back, 2 serial (bound by")
    assert line.endswith("measured 500.0 ms: predicted / measured 1.40")
    # the progress line: each step beside its own case (the Engine says which: StepResult.update)
    assert _progress_fields(replace(result, update="serial"), 0.5, 1e6, 0, predicted=cases["serial"])["pred s"] == "0.6"


def test_auto_optimizer_workers() -> None:
    """One per free CPU less the GPU executors' host threads (at least one, at most 16); with a calibration, the
    fewest that reach its best AdamW rate."""
    assert auto_optimizer_workers(2.0) == 2 and auto_optimizer_workers(64.0) == 16
    assert auto_optimizer_workers(16.0, reserved_cpus=8) == 8 and auto_optimizer_workers(2.0, reserved_cpus=4) == 1
    assert auto_optimizer_workers(16.0, cal=gpu_calibration()) == 8  # measured up to 8: more gain nothing
    flat = replace(cpu_calibration(), adamw_gparams={"1": 1.0, "2": 1.2, "4": 1.2})
    assert auto_optimizer_workers(8.0, cal=flat) == 2


def test_engine_takes_auto_optimizer_workers_and_micro_batches_and_predicts_its_own_plan(ray_session: None, cache: Path,
                                                                                         tmp_path: Path) -> None:
    """optimizer_workers and micro_batches auto (the fewest micro-batches that fit: one, for the tiny model on the CPU;
    test_micro_batches.py plans a 7B); and the run's prediction (the progress line's, prediction.json) is of the
    Engine's own plan, with the resident units and kept layers it resolved, on its device's cached calibration."""
    import megatrain
    from megatrain.telemetry.report import PREDICTION_FILE
    from pipelines.train import record_prediction

    cal = cpu_calibration()
    cal.save()
    with megatrain.Engine("tiny", optimizer_workers="auto", micro_batches="auto", device="cpu", batch_size=2,
                          seq_len=16, resident=2, keep_activations=1) as engine:
        assert engine.engine_config.optimizer_workers == len(engine.workers) == 2  # the session's 2 CPUs
        assert engine.engine_config.micro_batches == 1
        result = engine.step_batch({"input_ids": torch.randint(0, 256, (2, 16)).numpy()})
        assert (engine.plan.resident_units, len(engine.plan.kept.indices)) == (2, 1)
        expected = predict(engine.plan, engine.config, cal, optimizer_workers=2, speculate="auto")
        prediction = record_prediction(engine, tmp_path)
        assert prediction is not None and prediction.step_s == pytest.approx(expected.step_s)
        assert result.update in prediction.cases  # the progress line predicts each step as its own case
    recorded = json.loads((tmp_path / PREDICTION_FILE).read_text())
    assert recorded["kept_layers"] == 1 and recorded["resident_update_s"] > 0 and recorded["speculate"] == "auto"


# ---- a step's fixed costs (pipelines/step_costs.py), and the progress line's prediction only where calibrated ----

def test_fixed_costs_count_each_streamed_units_message_to_each_worker() -> None:
    """A step costs the driver's round trips once and a Ray message per streamed unit and optimizer worker, twice in
    a rollback (the units are handed out again); resident units send none. Not measured: 0, and the prediction says
    it is not of a calibrated regime, as it says of compute from the matmul rate."""
    tiny = ModelConfig.from_name("tiny")
    plan = plan_run(tiny, 2, 64, on_gpu=False, find_longest=False)
    timed = cpu_calibration()
    timed.layers[layer_key(tiny, 2, 64, "tf32")] = LayerTiming(0.01, 0.005)
    cal = replace(timed, step_fixed_s=0.004, unit_message_s=0.0005)
    messages = (tiny.num_layers + 2) * 2
    pred = predict(plan, tiny, cal, optimizer_workers=2)
    assert pred.overhead_s == pytest.approx(0.004 + messages * 0.0005) and pred.uncalibrated == ""
    assert pred.step_s == pytest.approx(pred.compute_s + pred.optimizer_s + pred.overhead_s)
    cases = pred.cases
    assert cases["rolled back"]["step_s"] - cases["speculated"]["step_s"] == pytest.approx(
        pred.rollback_s + messages * 0.0005)
    resident = predict(replace(plan, resident_units=2), tiny, cal, optimizer_workers=2)
    assert resident.overhead_s == pytest.approx(0.004 + (messages - 4) * 0.0005)
    unmeasured = predict(plan, tiny, timed, optimizer_workers=2)
    assert unmeasured.overhead_s == 0.0 and "not measured" in unmeasured.uncalibrated
    untimed = predict(plan, tiny, replace(cpu_calibration(), step_fixed_s=0.004, unit_message_s=0.0005))
    assert untimed.uncalibrated == "compute from the matmul rate"


def test_the_progress_line_predicts_only_a_calibrated_regime() -> None:
    """pipelines/train.py shows Prediction.shown_step_s beside each step: nothing where compute came from the matmul
    rate (or the fixed costs were not measured), and the report says why and what measures it."""
    tiny = ModelConfig.from_name("tiny")
    plan = plan_run(tiny, 8, 256, on_gpu=False, find_longest=False)
    cal = replace(cpu_calibration(), step_fixed_s=0.004, unit_message_s=0.0005)
    untimed = predict(plan, tiny, cal)
    assert untimed.shown_step_s("speculated") is None
    assert "not shown beside each step: compute from the matmul rate; `megatrain calibrate" in untimed.report()
    cal.layers[layer_key(tiny, 8, 256, "tf32")] = LayerTiming(0.01, 0.005)
    timed = predict(plan, tiny, cal)
    assert timed.shown_step_s("rolled back") == timed.cases["rolled back"]["step_s"]
    assert "not shown" not in timed.report()


def test_step_costs_are_measured_through_ray(ray_session: None, cache: Path) -> None:
    """Two probe Engines (1 and 8 layers) against the same models in-process, step by step in turn; no value is
    asserted (the cores are shared), only what was measured and that a calibration keeps it."""
    from pipelines.step_costs import measure_step_costs

    costs = measure_step_costs(cpu_calibration(), steps=2, warmup=1)
    assert [(p.layers, p.messages) for p in costs.probes] == [(1, 6), (8, 20)]
    assert all(p.measured_s > 0 and p.predicted_s > 0 for p in costs.probes)
    assert costs.step_fixed_s >= 0 and costs.unit_message_s >= 0
    cal = replace(cpu_calibration(), step_fixed_s=costs.step_fixed_s, unit_message_s=costs.unit_message_s)
    cal.save()
    assert Calibration.load("cpu").unit_message_s == costs.unit_message_s
