"""The update beside the backward (issue #25): each unit's AdamW as its gradient lands, validated once the step's
norm is known, and the one-pass update it runs.

Without Ray: the pass in pieces is bit for bit the update of whole groups (clip scale and bf16 copy included);
an update beside the backward that stands is the update; one taken back and redone with the clip coefficient is
within fp32 rounding of AdamW's fp64 result (as near as the serial update, up to twice), one rolled back leaves the
weights within rounding of where they were (the moments exactly, at update 0); a unit sliced among executors
waits for every slice. With Ray: where no step clips the weights are bit for bit those of the serial update
(micro-batches, the trace showing the optimizer's spans inside the backward); where every step clips, within
rounding of transformers + AdamW against fp64 (grads = "device" under the simulated asynchronous streams, and two
executors, whose "auto" speculates at the first step only); a non-finite gradient puts the step's updates back;
an optimizer worker killed while the validation's redo runs recovers bit for bit; the rollbacks in the progress
line and the report. Slow: grads = "device" putting a step back; a head that alone clips (nothing speculated, the
serial update's bits); two nodes against one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    OPTIM,
    TIMEOUT,
    assert_same_model,
    hf_reference,
    kill_once_updates_are_handed_out,
    max_rel,
    rows,
    worker_pids,
)
from transformers import LlamaConfig, LlamaForCausalLM

import megatrain
from megatrain.config import ConfigError, EngineConfig, ModelConfig, OptimConfig
from megatrain.engine.optimizer import AdamWShard
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.model.layout import ALIGN, ModelLayout
from megatrain.telemetry import HANDOUT_LANE

# ---- the plain classes ----

LAYOUT = ModelLayout.build(dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=3))
ADAMW = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)


def arena(seed: int = 0, moments: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = LAYOUT.numel
    return {"params": torch.randn(n, generator=gen) * 0.02, "grads": torch.randn(n, generator=gen) * 1e-2,
            "exp_avg": torch.randn(n, generator=gen) * 1e-3 if moments else torch.zeros(n),
            "exp_avg_sq": torch.rand(n, generator=gen) * 1e-4 if moments else torch.zeros(n),
            BF16_COPY_SEGMENT: torch.zeros(n, dtype=torch.bfloat16)}


def covered() -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of the layout's tensors (not the padding between them), and which of them decay."""
    mask, decay = torch.zeros(LAYOUT.numel, dtype=torch.bool), torch.zeros(LAYOUT.numel, dtype=torch.bool)
    for unit in LAYOUT.units:
        for slot in unit.slots:
            mask[unit.offset + slot.offset : unit.offset + slot.offset + slot.numel] = True
            decay[unit.offset + slot.offset : unit.offset + slot.offset + slot.numel] = slot.decay
    return mask, decay


def adamw_fp64(t: dict[str, torch.Tensor], grads: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    """Update number `step` of AdamW in fp64 from the fp32 state `t` (the exact result fp32 runs are judged by)."""
    beta1, beta2 = ADAMW.betas
    decay = covered()[1].double() * ADAMW.weight_decay
    p, m, v, g = (x.double() for x in (t["params"], t["exp_avg"], t["exp_avg_sq"], grads))
    lr = ADAMW.lr_at(step)
    m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
    denom = (v / (1 - beta2 ** (step + 1))).sqrt() + ADAMW.eps
    return {"params": p * (1 - lr * decay) - lr / (1 - beta1 ** (step + 1)) * m / denom, "exp_avg": m,
            "exp_avg_sq": v}


def assert_bf16_copy_current(t: dict[str, torch.Tensor]) -> None:
    """The bf16 copy is the weights rounded, wherever the layout has weights."""
    mask = covered()[0]
    assert torch.equal(t[BF16_COPY_SEGMENT][mask], t["params"][mask].bfloat16())


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    mask = covered()[0]
    want = want[mask].double()
    return ((got[mask].double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("clip_coef", [1.0, 0.3])
def test_the_pass_in_pieces_is_the_update_of_whole_groups(clip_coef: float) -> None:
    """Pieces of 1 or 3 ALIGN blocks (cut inside tensors, several small tensors in one piece) against one piece per
    decay group (each kernel over the whole group: the update as it was), 2 workers, 3 steps, the bf16 copy."""
    whole = -(-max(u.numel for u in LAYOUT.units) // ALIGN) * ALIGN
    results = []
    for piece in (ALIGN, 3 * ALIGN, whole):
        t = arena()
        shards = [AdamWShard(LAYOUT, t, ADAMW, w, 2, piece_numel=piece) for w in range(2)]
        for step in range(3):
            for shard in shards:
                for unit in LAYOUT.units:
                    shard.update(unit.index, step, clip_coef)
        results.append(t)
    decay, no_decay = AdamWShard(LAYOUT, arena(), ADAMW, 0, 2, piece_numel=ALIGN).groups[1]  # layer 0's
    assert len(decay) > 1 and len(no_decay[0].params) > 1, "pieces cut inside tensors, and shared by small ones"
    for t in results[:2]:
        for name, want in results[2].items():
            assert torch.equal(t[name], want), name
    assert_bf16_copy_current(results[2])


def test_an_update_beside_the_backward_that_stands_is_the_update() -> None:
    serial, spec = arena(moments=True), arena(moments=True)
    a, b = AdamWShard(LAYOUT, serial, ADAMW, 0, 1), AdamWShard(LAYOUT, spec, ADAMW, 0, 1)
    for unit in LAYOUT.units:
        a.update(unit.index, 4)
        assert b.speculate(unit.index, 4, speculation=1)
        assert b.settle(unit.index, 4, 1.0, speculation=1) is None
    for name, want in serial.items():
        assert torch.equal(spec[name], want), name


@pytest.mark.parametrize(("step", "clip_coef"), [(0, 0.1), (5, 0.5), (5, 0.1)])
def test_a_clipped_rollback_is_within_rounding_of_adamw(step: int, clip_coef: float) -> None:
    """The coefficient-1 update taken back and the clipped one applied (one pass) against the serial clipped update,
    both judged against fp64: the weights as near as the serial update's, up to twice, plus 1e-8 / c^2 (the rounding
    of m' and v', relative to what the clipped update leaves, is 1/c and 1/c^2 ulps where the gradient dwarfs their
    history, as it does here for the smallest random v); the moments within 1e-7 / c^2."""
    serial, spec = arena(moments=step > 0), arena(moments=step > 0)
    grads = serial["grads"] * 5  # a step whose norm jumped
    exact = adamw_fp64(serial, grads * clip_coef, step)
    serial["grads"].copy_(grads)
    spec["grads"].copy_(grads)
    a, b = AdamWShard(LAYOUT, serial, ADAMW, 0, 1), AdamWShard(LAYOUT, spec, ADAMW, 0, 1)
    for unit in LAYOUT.units:
        a.update(unit.index, step, clip_coef)
        b.speculate(unit.index, step, speculation=3)
        assert b.settle(unit.index, step, clip_coef, speculation=3) == "rollback"
    slack = 1e-8 / clip_coef**2
    assert rel(spec["params"], exact["params"]) <= 2 * rel(serial["params"], exact["params"]) + slack
    for name in ("exp_avg", "exp_avg_sq"):
        assert rel(spec[name], exact[name]) <= 10 * slack, name
    assert_bf16_copy_current(spec)


@pytest.mark.parametrize("step", [0, 5])
def test_an_update_put_back_leaves_the_unit_as_it_was(step: int) -> None:
    before = arena(moments=step > 0)
    t = {name: x.clone() for name, x in before.items()}
    versions = torch.full((len(LAYOUT.units), 1), step, dtype=torch.int64)
    shard = AdamWShard(LAYOUT, t, ADAMW, 0, 1, versions)
    for unit in LAYOUT.units:
        shard.speculate(unit.index, step, speculation=1)
    assert (versions == step + 1).all()
    assert shard.roll_back(LAYOUT.units[0].index, step, speculation=2) is False, "another try's record does not hold"
    for unit in LAYOUT.units:
        shard.roll_back(unit.index, step, speculation=1)
    assert (versions == step).all()
    assert rel(t["params"], before["params"]) < 3e-7  # a few ulps: p from the update term and the decay factor
    for name in ("exp_avg", "exp_avg_sq"):  # exactly the zeros before the first update; else within the rounding
        assert torch.equal(t[name], before[name]) if step == 0 else rel(t[name], before[name]) < 1e-5, name
    assert (t["exp_avg_sq"] >= 0).all()
    assert_bf16_copy_current(t)


def test_a_unit_sliced_among_executors_waits_for_every_slice() -> None:
    t = arena()
    versions = torch.zeros(len(LAYOUT.units), 1, dtype=torch.int64)
    shard = AdamWShard(LAYOUT, t, ADAMW, 0, 1, versions)
    params = t["params"].clone()
    assert not shard.speculate(1, 0, speculation=7, parts=2) and torch.equal(t["params"], params)
    assert shard.speculate(1, 0, speculation=7, parts=2) and versions[1, 0] == 1
    assert not shard.speculate(2, 0, speculation=8, parts=2), "a new try counts its slices afresh"
    assert not shard.was_speculated(1, 7) and not shard.was_speculated(1, 8)
    shard.roll_back_versions(0)
    assert (versions == 0).all()
    with pytest.raises(ConfigError, match="speculate must be one of auto, on, off, got 'maybe'"):
        EngineConfig(speculate="maybe")


# ---- the Engine ----

ENGINE = dict(optimizer_workers=1, precision="fp32", device="cpu", batch_size=8, seq_len=24, **OPTIM)
# every step's gradient norm here is 1.3 to 1.5: every step clips, once the head (0.5) and the top layer (0.6 to
# 0.7) were updated beside the backward
CLIPS = 1.0


def train(directory: Path, batches: list, **settings) -> tuple[list[Any], dict[str, torch.Tensor], megatrain.Engine]:
    with megatrain.Engine(directory, **{**ENGINE, **settings}) as engine:
        results = [engine.step_batch({"input_ids": ids.numpy(), "labels": labels.numpy()}) for ids, labels in batches]
        return results, engine.parameters(), engine


Reference = tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def clipped_reference(micro_llama) -> Reference:
    """transformers + AdamW on rows 1-3, every step clipped at CLIPS: its fp64 run's losses and weights and its fp32
    run's weights, computed once for the tests held to them."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    exact_losses, exact = hf_reference(directory, batches, CLIPS, OPTIM, torch.float64)
    _, theirs = hf_reference(directory, batches, CLIPS, OPTIM)
    return exact_losses, exact, theirs


def assert_near_fp64(reference: Reference, losses: list[float], params: dict[str, torch.Tensor]) -> None:
    """As near transformers + AdamW's fp64 run as its fp32 run is (twice, or 1e-5), as test_data_parallel judges."""
    exact_losses, exact, theirs = reference
    assert losses == pytest.approx(exact_losses, rel=1e-5)
    theirs_err = max_rel(theirs, exact)
    too_far = {n: (e, theirs_err[n]) for n, e in max_rel(params, exact).items() if e > max(1e-5, 2 * theirs_err[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


def test_where_no_step_clips_the_weights_are_the_serial_updates(ray_session: None, micro_llama) -> None:
    """Two micro-batches a step; the trace shows each step's updates handed to the pool inside its backward (when
    the workers' processes then start them is their scheduling's: benchmarks measure that, the trace shows it)."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    runs = {mode: train(directory, batches, speculate=mode, max_grad_norm=1e3, micro_batches=2, batch_size=4,
                        trace=mode == "on") for mode in ("on", "off")}
    (on, on_params, engine), (off, off_params, _) = runs["on"], runs["off"]
    assert [r.loss for r in on] == [r.loss for r in off]
    assert_same_model(on_params, off_params)
    assert engine.rollbacks == 0 and not any(r.rolled_back for r in on)
    assert [r.update for r in on] == ["speculated"] * 3 and [r.update for r in off] == ["serial"] * 3
    spans = [s for r in on for s in r.spans]  # a step's updates come back with the next step's result
    for step in (0, 1):
        backward = [s for s in spans if s.name == "recompute+backward" and s.step == step]
        updates = [s for s in spans if s.lane.startswith("optimizer") and s.name == "update" and s.step == step]
        handed = {s.layer: s for s in spans if s.lane == HANDOUT_LANE and s.step == step}
        assert backward and updates and set(handed) == {u.layer for u in updates}
        assert min(h.start for h in handed.values()) < max(b.end for b in backward), \
            f"step {step}: no update handed out in the backward"
        assert all(u.start >= handed[u.layer].start for u in updates)  # one clock for every process (recorder.py)


def test_steps_that_clip_roll_back_to_within_rounding_under_simulated_streams(ray_session: None, micro_llama,
                                                                             clipped_reference: Reference) -> None:
    """grads = "device" (the gradients sent out during the backward and kept, then sent again for the redo) on the
    GPU's schedule simulated on the CPU."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    results, params, engine = train(directory, batches, speculate="on", max_grad_norm=CLIPS, grads="device",
                                    device="cpu-async:2")
    assert engine.grads == "device" and engine.rollbacks == 3 and all(r.rolled_back for r in results)
    assert_near_fp64(clipped_reference, [r.loss for r in results], params)


@pytest.mark.slow
def test_where_the_head_alone_clips_nothing_is_taken_back(ray_session: None, micro_llama) -> None:
    """max_grad_norm below the head's norm: no unit is updated beside the backward (with grads = "device" each one's
    host slot is marked free as it lands, versions taken back before the update), the serial update's bits."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    on, on_params, engine = train(directory, batches, speculate="on", max_grad_norm=0.05, grads="device",
                                  device="cpu-async:5")
    off, off_params, _ = train(directory, batches, speculate="off", max_grad_norm=0.05, grads="device")
    assert engine.rollbacks == 0 and [r.loss for r in on] == [r.loss for r in off]
    assert_same_model(on_params, off_params)


def test_two_executors_speculate_until_a_step_clips(ray_session: None, micro_llama, clipped_reference: Reference
                                                    ) -> None:
    """speculate "auto" (the default): the first step is updated beside the backward and clips; the next ones, after
    a step that clipped, are updated after their backward."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    # two workers here: the pool's shards each speculate, take back and redo (the other Engine tests run one)
    results, params, engine = train(directory, batches, max_grad_norm=CLIPS, executors=2, batch_size=4,
                                    optimizer_workers=2)
    assert [r.rolled_back for r in results] == [True, False, False] and engine.rollbacks == 1
    assert [r.update for r in results] == ["rolled back", "serial", "serial"]  # the prediction's cases of each
    assert_near_fp64(clipped_reference, [r.loss for r in results], params)


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer Llama whose RMSNorm eps (1e-24) is far below its activations, and whose tokens 0..7 have zero
    embedding rows: a batch of those has a finite loss (every logit 0) while its gradients overflow below the top
    layers (each norm's backward scales by 1/sqrt(eps)): the head and the top layers land finite and are updated
    beside the backward before a lower one is not finite."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-24))
    with torch.no_grad():
        model.model.embed_tokens.weight[:8] = 0.0
    directory = tmp_path_factory.mktemp("overflowing")
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("grads", "device"), [("arena", "cpu"),
                                               pytest.param("device", "cpu-async:4", marks=pytest.mark.slow)])
def test_a_non_finite_gradient_puts_the_steps_updates_back(ray_session: None, overflowing: Path, grads: str,
                                                           device: str) -> None:
    """With grads = "device" the speculated units' gradients are sent again from the device to be rolled back."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(8, 64, (2, 16), generator=gen), torch.randint(0, 8, (2, 16), generator=gen),
           torch.randint(8, 64, (2, 16), generator=gen)]
    with megatrain.Engine(overflowing, optimizer_workers=1, precision="fp32", device=device, batch_size=2, seq_len=16,
                          speculate="on", max_grad_norm=1e9, lr=1e-2, max_nonfinite_steps=2, grads=grads) as engine:
        engine.step(ids[0])
        before = engine.parameters()
        result = engine.step_batch({"input_ids": ids[1].numpy()})
        after = engine.parameters()
        assert math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
        assert result.skipped and result.rolled_back and engine.rollbacks == 1 and engine.updates_applied == 1
        assert math.isfinite(engine.step(ids[2])) and engine.updates_applied == 2  # the run goes on
    for name, value in before.items():
        diff = (after[name] - value).abs().max().item()
        assert diff <= 3e-7 * max(value.abs().max().item(), 1e-30), f"{name} moved by {diff} on a skipped step"


def test_a_worker_killed_mid_validation_recovers_exactly(ray_session: None, micro_llama, tmp_path: Path) -> None:
    """Every step clips; in the fourth (after a checkpoint at the second), an optimizer worker is SIGKILLed as soon
    as the clipped redo of the step's updates is handed out: the run restores the checkpoint and replays, bit for bit
    the run without the kill."""
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3, 4, 5)]

    def run(kill_at: int | None) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
        with megatrain.Engine(directory, **{**ENGINE, "speculate": "on", "max_grad_norm": CLIPS}) as engine:
            losses = []
            for i, (ids, labels) in enumerate(batches):
                if i == kill_at:
                    kill_once_updates_are_handed_out(engine, worker_pids(engine)[0])
                losses.append(engine.step(ids, labels))
                if i == 1:
                    engine.save_checkpoint(tmp_path / f"ckpt-{kill_at}")
            return losses, engine.parameters(), engine.restarts, engine.rollbacks

    losses, params, restarts, rollbacks = run(kill_at=3)
    clean_losses, clean_params, _, clean_rollbacks = run(kill_at=None)
    assert restarts == 1 and rollbacks == clean_rollbacks == len(batches)
    assert losses == clean_losses
    assert_same_model(params, clean_params)


def test_rollbacks_in_the_progress_line_and_the_report(tmp_path: Path) -> None:
    from megatrain.telemetry.report import report
    from pipelines.engine import StepResult
    from pipelines.train import _progress_fields

    result = StepResult(3, 2.0, 100, 1.5, 1e-3, False, None, [], True)
    assert _progress_fields(result, 0.5, 1e6, 0, rollbacks=2)["rollbacks"] == "2"
    assert "rollbacks" not in _progress_fields(result, 0.5, 1e6, 0)
    stats = {"step": 0, "step_time": 1.0, "compute": 0.5, "wait_weights": 0.1, "wait_optimizer": 0.2,
             "wait_data": 0.0, "other": 0.2, "h2d_bytes": 0, "d2h_bytes": 0, "h2d_gbps": 0.0, "d2h_gbps": 0.0,
             "overlap": 0.0, "stall_fraction": 0.5}
    lines = [json.dumps({"step": s, "loss": 1.0, "rolled_back": s == 1, "stats": {**stats, "step": s}})
             for s in range(3)]
    (tmp_path / "steps.jsonl").write_text("\n".join(lines) + "\n")
    assert "rollbacks: 1 of 3 steps rolled back their updates beside the backward" in report(tmp_path)


# ---- two nodes ----

TWO_NODES = """
import json, sys, ray, torch
from ray.cluster_utils import Cluster
import megatrain

shm0, shm1 = sys.argv[1:3]
node_args = dict(num_cpus=2, object_store_memory=100 * 2**20)
nodes = Cluster(initialize_head=True, head_node_args={**node_args, "env_vars": {"MEGATRAIN_SHM_DIR": shm0}})
nodes.add_node(**node_args, env_vars={"MEGATRAIN_SHM_DIR": shm1})
result = {}
try:
    ray.init(address=nodes.address)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(3)]
    settings = dict(batch_size=4, seq_len=32, device="cpu", optimizer_workers=1, lr=1e-2, max_grad_norm=1.0)
    runs = (("one", dict(executors=2, speculate="on")), ("two", dict(nodes=2, executors=1, speculate="on")),
            ("serial", dict(executors=2, speculate="off")))
    for name, layout in runs:
        with megatrain.Engine("tiny", **settings, **layout) as engine:
            results = [engine.step_batch(ray.put({"input_ids": ids.numpy()})) for ids in batches]
            result[name] = [[r.loss, r.rolled_back] for r in results]
            torch.save(engine.parameters(), f"{shm0}/../{name}.pt")
    print(json.dumps(result))
finally:
    ray.shutdown()
    nodes.shutdown()
"""


@pytest.mark.slow
def test_two_nodes_roll_back_as_one(ray_env: dict[str, str], tmp_path: Path) -> None:
    """Every step clips (norms 1.2 to 1.5): two nodes (each updating its part of every unit beside the backward once
    its executor's slice landed, taking it back, then exchanging the parts) reach what one node with the same two
    executors reaches (which updates a unit beside the backward once both slices landed), within rounding: where
    one executor's slices so far clip before the other's do, a unit's part is updated and taken back on one node,
    updated once on the other, while one node updates that unit once. Rounding, as Adam amplifies it over the steps:
    no further from the one node's weights than those are from the serial update's (twice, or 1e-7)."""
    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    for d in shm:
        d.mkdir()
    proc = subprocess.run([sys.executable, "-c", TWO_NODES, str(shm[0]), str(shm[1])], cwd=tmp_path,
                          env={**ray_env, "MEGATRAIN_SHM_DIR": str(shm[0])}, capture_output=True, text=True,
                          timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [rolled for _, rolled in result["two"]] == [rolled for _, rolled in result["one"]] == [True] * 3
    assert [loss for loss, _ in result["two"]] == pytest.approx([loss for loss, _ in result["one"]], rel=1e-6)
    one, two, serial = (torch.load(tmp_path / f"{name}.pt") for name in ("one", "two", "serial"))
    assert max(max_rel(two, one).values()) <= 2 * max(*max_rel(one, serial).values(), 1e-7)
