"""Telemetry without Ray: spans, stall accounting, Chrome trace, steps.jsonl, PNG, the report."""

from __future__ import annotations

import json
import random
import struct
import time
import zlib

import numpy as np
import pytest
import torch

from megatrain.engine.grad_egress import GradEgress, GradsOut, Sends
from megatrain.engine.streams import make_streams
from megatrain.model.layout import GradLayout, Unit
from megatrain.telemetry import (
    EGRESS_LANE,
    STEPS_FILE,
    TRACE_FILE,
    Recorder,
    Span,
    StepStats,
    account,
    add_wait_before,
    append_step,
    chrome_trace_to_spans,
    optimizer_lane,
    png_bytes,
    read_steps,
    spans_to_chrome_trace,
    write_chrome_trace,
    write_png,
)
from megatrain.telemetry.report import COLORS, ReportError, main_report, render_timeline, report
from pipelines.cli import main

LAYERS = 3
STAGES = [("h2d", "load"), ("compute", "forward"), ("compute", "recompute+backward"), ("d2h", "grads")]


def parts(s: StepStats) -> float:
    return s.compute + s.wait_weights + s.wait_optimizer + s.wait_gradients + s.wait_data + s.other


def synthetic_step(rec: Recorder, step: int, data_sleep: float = 0.004) -> StepStats:
    """One CPU step shaped like the executor's: weights copied in per layer, forward, head, backward with
    recompute, grads copied out, and host waits for data and the optimizer."""
    host_w = [torch.randn(128, 128) for _ in range(LAYERS)]
    host_g = [torch.empty(128, 128) for _ in range(LAYERS)]
    buf = torch.empty(128, 128)
    rec.begin_step(step)
    with rec.wait("data"):
        time.sleep(data_sleep)
    x = torch.randn(32, 128)
    checkpoints = []
    for layer in range(LAYERS):
        with rec.span("h2d", "load", layer, None, buf.numel() * 4):
            buf.copy_(host_w[layer])
        checkpoints.append(x)
        with rec.span("compute", "forward", layer):
            x = torch.tanh(x @ buf)
    with rec.span("compute", "head"):
        grad = torch.ones_like(x)
    for layer in reversed(range(LAYERS)):
        with rec.wait("optimizer", layer):
            time.sleep(0.001)
        with rec.span("h2d", "load", layer, None, buf.numel() * 4):
            buf.copy_(host_w[layer])
        with rec.span("compute", "recompute+backward", layer):
            w = buf.clone().requires_grad_(True)
            xin = checkpoints[layer].requires_grad_(True)
            grad, gw = torch.autograd.grad(torch.tanh(xin @ w), (xin, w), grad)
        with rec.span("d2h", "grads", layer, None, gw.numel() * 4):
            host_g[layer].copy_(gw)
    t = time.monotonic()
    rec.add_span(Span(optimizer_lane(0), "update", step, t, t + 0.001, layer=0, nbytes=0))
    return rec.end_step()


# ---- Recorder on the CPU path ----

def test_trace_has_every_layer_and_stage(tmp_path):
    rec = Recorder()
    t0 = time.monotonic()
    stats = synthetic_step(rec, step=0)
    wall = time.monotonic() - t0
    path = tmp_path / TRACE_FILE
    write_chrome_trace(rec.spans, path)
    trace = json.loads(path.read_text())

    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    thread_names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"h2d", "compute", "d2h", "wait", "optimizer/0", "step"} <= thread_names
    for lane, name in STAGES:
        layers = sorted({e["args"]["layer"] for e in xs if e["cat"] == lane and e["name"] == name})
        assert layers == list(range(LAYERS)), (lane, name)
    assert any(e["name"] == "head" for e in xs)
    assert {e["name"] for e in xs if e["cat"] == "wait"} == {"data", "optimizer"}
    loads = [e for e in xs if e["name"] == "load"]
    assert all(e["args"]["bytes"] == 128 * 128 * 4 for e in loads) and len(loads) == 2 * LAYERS
    assert all(e["args"]["step"] == 0 and e["dur"] >= 0 for e in xs)
    # complete events in µs on the monotonic clock, each lane on its own thread
    step_event = next(e for e in xs if e["cat"] == "step")
    assert step_event["dur"] == pytest.approx(stats.step_time * 1e6, abs=1.0)
    assert len({(e["pid"], e["tid"]) for e in xs}) == len({e["cat"] for e in xs})
    assert 0 < stats.step_time <= wall


def test_accounting_adds_up_to_step_time():
    rec = Recorder()
    synthetic_step(rec, step=0)  # warm-up
    stats = synthetic_step(rec, step=1, data_sleep=0.01)
    assert parts(stats) == pytest.approx(stats.step_time, rel=0.05)
    assert abs(parts(stats) - stats.step_time) < 1e-9  # by construction, not by luck
    assert stats.wait_data >= 0.009  # the sleep, minus nothing: compute is idle during a host wait
    assert stats.wait_optimizer >= LAYERS * 0.0009
    assert stats.compute > 0 and stats.wait_weights > 0 and stats.other >= 0
    assert stats.h2d_bytes == 2 * LAYERS * 128 * 128 * 4 and stats.d2h_bytes == LAYERS * 128 * 128 * 4
    assert stats.h2d_gbps > 0 and stats.d2h_gbps > 0
    assert stats.overlap == 0.0  # everything is sequential on the host
    assert stats.stall_fraction == pytest.approx(1 - stats.compute / stats.step_time)
    assert {s.step for s in rec.spans} == {0, 1}


def test_keep_steps_bounds_memory():
    rec = Recorder(keep_steps=2)
    for step in range(4):
        synthetic_step(rec, step, data_sleep=0.0)
    assert {s.step for s in rec.spans} == {2, 3}


def test_disabled_recorder_records_nothing():
    rec = Recorder(enabled=False)
    rec.begin_step(0)
    first, second = rec.span("compute", "forward", 0), rec.wait("data")
    assert first is second  # one shared no-op context: no allocation, no clock read per span
    with first, second:
        time.sleep(0.002)
    rec.add_span(Span("optimizer/0", "update", 0, 0.0, 1.0))
    stats = rec.end_step()
    assert rec.spans == []
    assert stats.step_time >= 0.002 and stats.other == stats.step_time and stats.compute == 0


def test_recorder_errors():
    rec = Recorder()
    with pytest.raises(RuntimeError, match="begin_step"):
        rec.end_step()
    with pytest.raises(ValueError, match="cause"):
        rec.wait("lunch")


# ---- the attribution rule on a hand-built timeline ----

def hand_built() -> list[Span]:
    S = lambda lane, name, a, b, layer=None, nbytes=0: Span(lane, name, 7, a, b, layer, nbytes)  # noqa: E731
    return [
        S("compute", "forward", 1.0, 3.0, 0), S("compute", "forward", 4.0, 6.0, 1),
        S("compute", "head", 8.0, 9.0),
        # gap [0, 1]: a data wait on [0, 0.5] and the first layer's weights arriving over [0, 1]
        S("wait", "data", 0.0, 0.5), S("h2d", "load", 0.0, 1.0, 0, 4_000_000_000),
        # gap [3, 4]: the host waits for the optimizer, then layer 1's copy runs late
        S("wait", "optimizer", 3.0, 3.5), S("h2d", "load", 3.2, 4.0, 1, 1_600_000_000),
        # a prefetch fully hidden under layer 1's compute
        S("h2d", "load", 4.5, 5.5, 2, 2_000_000_000),
        # gap [6, 8]: a gradient copy (not a cause: "other"), then the host waits for weights
        S("d2h", "grads", 6.0, 7.0, 1, 3_000_000_000), S("wait", "weights", 7.0, 8.0),
        # gap [9, 10]: data and optimizer waits at once: data wins; the rest is host overhead
        S("wait", "data", 9.0, 9.6), S("wait", "optimizer", 9.0, 9.6), S("host", "sync", 9.6, 10.0),
        # outside the window: clipped away
        S("compute", "forward", -2.0, -1.0), S("wait", "data", 10.5, 11.0),
        # not causes: optimizer updates and host work
        S("optimizer/0", "update", 2.0, 8.0, 0), S("host", "embed", 0.5, 0.9),
    ]


def test_attribution_rule_on_hand_built_timeline():
    s = account(hand_built(), step=7, start=0.0, end=10.0)
    assert s.step == 7 and s.step_time == 10.0
    assert s.compute == pytest.approx(5.0)
    assert s.wait_data == pytest.approx(0.5 + 0.6)
    assert s.wait_optimizer == pytest.approx(0.5)
    assert s.wait_weights == pytest.approx(0.5 + 0.5 + 1.0)  # h2d [0.5, 1], [3.5, 4]; wait "weights" [7, 8]
    assert s.other == pytest.approx(1.0 + 0.4)  # the d2h copy [6, 7] and the host tail [9.6, 10]
    assert parts(s) == pytest.approx(s.step_time, abs=1e-12)
    # transfers: h2d busy 1 + 0.8 + 1 = 2.8 s, d2h 1 s; 1 s of the 3.8 s runs under compute
    assert s.h2d_bytes == 7_600_000_000 and s.d2h_bytes == 3_000_000_000
    assert s.h2d_gbps == pytest.approx(7.6 / 2.8) and s.d2h_gbps == pytest.approx(3.0)
    assert s.overlap == pytest.approx(1.0 / 3.8)
    assert s.stall_fraction == pytest.approx(0.5)


def test_random_timelines_add_up():
    rng = random.Random(0)
    lanes = [("compute", "forward"), ("h2d", "load"), ("d2h", "grads"), ("wait", "data"),
             ("wait", "optimizer"), ("wait", "weights"), ("wait", "gradients"), (EGRESS_LANE, "slot"),
             ("host", "embed"), ("optimizer/1", "update")]
    for _ in range(200):
        spans = []
        for _ in range(rng.randrange(0, 40)):
            lane, name = rng.choice(lanes)
            a = rng.uniform(-1, 11)
            spans.append(Span(lane, name, 0, a, a + rng.expovariate(2.0)))
        s = account(spans, 0, 0.0, 10.0)
        assert abs(parts(s) - 10.0) < 1e-9
        assert min(s.compute, s.wait_weights, s.wait_optimizer, s.wait_gradients, s.wait_data) >= 0
        assert s.other > -1e-9
        assert 0.0 <= s.overlap <= 1.0 + 1e-12 and s.compute <= 10.0 + 1e-12


def test_gradients_wait_and_the_slot_the_optimizer_holds():
    """Compute waiting for gradients to leave the device (wait "gradients") outranks an h2d copy, yields to the
    optimizer's waits, and counts as the optimizer's while the sender thread waits for a host slot (EGRESS_LANE)."""
    S = lambda lane, name, a, b: Span(lane, name, 0, a, b)  # noqa: E731
    spans = [S("compute", "backward", 0.0, 1.0), S("compute", "backward", 5.0, 6.0),
             S("wait", "gradients", 1.0, 5.0), S("h2d", "load", 1.0, 2.0),  # gradients, not weights
             S(EGRESS_LANE, "slot", 3.0, 4.0),  # the sender waits for the optimizer: [3, 4] is the optimizer's
             S("wait", "optimizer", 4.5, 5.0)]  # an explicit optimizer wait outranks gradients
    s = account(spans, 0, 0.0, 6.0)
    assert s.compute == pytest.approx(2.0) and s.wait_weights == 0.0 and s.other == pytest.approx(0.0, abs=1e-12)
    assert s.wait_gradients == pytest.approx(2.5) and s.wait_optimizer == pytest.approx(1.5)
    assert parts(s) == pytest.approx(s.step_time, abs=1e-12)
    assert account([S(EGRESS_LANE, "slot", 0.0, 6.0)], 0, 0.0, 6.0).other == 6.0  # alone it is no cause
    rec = Recorder()
    rec.begin_step(0)
    with rec.wait("gradients", 3):
        time.sleep(0.002)
    assert rec.end_step().wait_gradients >= 0.001


@pytest.mark.parametrize("slow", ["copies", "optimizer"])
def test_the_egress_records_compute_waiting_for_gradients(slow: str) -> None:
    """GradEgress with its sender thread: while the sets in flight land slowly, the computing thread's wait for a
    place is a "gradients" wait; where the sender waits for the optimizer to free a ring slot, the optimizer's."""
    count, n = 8, 4
    layout = GradLayout(tuple(i % 2 * n for i in range(count)), tuple(i % 2 for i in range(count)), 2 * n) \
        if slow == "optimizer" else GradLayout(tuple(i * n for i in range(count)), tuple(range(count)), count * n)
    host, streams, rec = torch.zeros(layout.numel), make_streams("cpu"), Recorder()
    egress = GradEgress(streams, layout, rec, send_thread=True)
    pause = lambda *args: time.sleep(0.02)  # noqa: E731
    sends = Sends(pause if slow == "copies" else lambda unit, norm_sq: None,
                  pause if slow == "optimizer" else lambda unit: None)
    rec.begin_step(0)
    for i in range(count):
        unit = Unit(i, "layer", i * n, n, (), i)
        permit = egress.permit(sends, unit)
        g, norm_sq = torch.ones(n), torch.tensor(float(n), dtype=torch.float64)
        egress.emit(GradsOut(unit, [(g, layout.range_of(unit, host))], norm_sq, None, permit=permit), sends)
    egress.wait_sent()
    stats = rec.end_step()
    egress.close()
    streams.close()
    assert parts(stats) == pytest.approx(stats.step_time, abs=1e-9)
    if slow == "copies":
        assert stats.wait_gradients > 0 and stats.wait_optimizer == 0
    else:
        assert stats.wait_optimizer > 0 and any(s.lane == EGRESS_LANE for s in rec.spans)


def test_a_wait_before_the_step_joins_its_accounting_and_window():
    """The driver's wait for a batch, timed before the executor began the step (pipelines/engine.py)."""
    stats = account(hand_built(), 7, 0.0, 10.0)
    spans = [s for s in hand_built() if 0.0 <= s.start and s.end <= 10.0] + [Span("step", "step", 7, 0.0, 10.0)]
    record = stats.to_dict()
    add_wait_before(record, spans, Span("wait", "data", 7, -3.0, -1.0))
    grown = StepStats.from_dict(record)
    assert grown.step_time == 12.0 and grown.start == -2.0 and grown.wait_data == pytest.approx(stats.wait_data + 2)
    assert grown.stall_fraction == pytest.approx(1 - 5.0 / 12.0) and parts(grown) == pytest.approx(12.0)
    assert (spans[-2].lane, spans[-2].start, spans[-2].end) == ("step", -2.0, 10.0)
    assert (spans[-1].name, spans[-1].start, spans[-1].end) == ("data", -2.0, 0.0)  # just before the window
    assert account(spans, 7, -2.0, 10.0).to_dict() == pytest.approx(grown.to_dict())  # as the trace shows it
    untraced = stats.to_dict()
    add_wait_before(untraced, [], Span("wait", "data", 7, 5.0, 5.5))
    assert untraced["wait_data"] == pytest.approx(stats.wait_data + 0.5)


# ---- the device path, with CUDA events faked on a CPU-only machine ----

class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def wait_event(self, event) -> None:
        pass


class FakeEvent:
    """A CUDA event on a device whose clock is the host's plus an offset the recorder cannot know."""

    made = 0
    synchronized = 0
    OFFSET = 12345.678

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        FakeEvent.made += 1
        self.t: float | None = None

    def record(self, stream=None) -> None:
        self.t = time.monotonic() + self.OFFSET

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def query(self) -> bool:
        return self.t is not None and not getattr(self, "running", False)

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.t is not None and other.t is not None, "read before completion"
        return (other.t - self.t) * 1e3


def test_device_spans_resolve_once_at_end_step(monkeypatch):
    current, h2d = FakeStream("compute"), FakeStream("h2d")
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("device-wide synchronize"))
    FakeEvent.made = FakeEvent.synchronized = 0
    rec = Recorder()
    made_per_step = []
    for step in range(3):
        rec.begin_step(step, "cuda:0")
        host = []
        for layer in range(4):
            a = time.monotonic()
            with rec.span("h2d", "load", layer, h2d, 100):
                time.sleep(0.001)
            with rec.span("compute", "forward", layer, current):
                time.sleep(0.002)
            host.append((a, time.monotonic()))
        with rec.wait("optimizer"):
            time.sleep(0.001)
        assert FakeEvent.synchronized == 0  # nothing waits on the device inside the step
        stats = rec.end_step()
        assert FakeEvent.synchronized == 1
        FakeEvent.synchronized = 0
        made_per_step.append(FakeEvent.made)
        spans = [s for s in rec.spans if s.step == step and s.lane in ("h2d", "compute")]
        assert len(spans) == 8
        for s in spans:  # back on the host clock, within the layer's host interval
            a, b = host[s.layer]
            assert a - 1e-3 <= s.start <= s.end <= b + 1e-3
        assert parts(stats) == pytest.approx(stats.step_time, abs=1e-9)
        # the union of the 4 compute spans, which never overlap, each around a 2 ms sleep
        compute_spans = [s for s in spans if s.lane == "compute"]
        assert stats.compute == pytest.approx(sum(s.end - s.start for s in compute_spans), abs=1e-6)
        assert stats.compute >= 4 * 0.002 - 1e-6
    assert made_per_step[2] == made_per_step[1]  # events come back to the pool once read


def test_device_span_still_running_at_end_step_is_read_by_the_next_step(monkeypatch):
    """A copy another thread started (the last step's gradients going out) and that has not finished when the
    step ends is neither read early (elapsed_time would fail) nor lost: the next end_step reads it."""
    current, d2h = FakeStream("compute"), FakeStream("d2h")
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    rec = Recorder()
    rec.begin_step(0, "cuda:0")
    with rec.span("compute", "forward", 0, current):
        time.sleep(0.001)
    with rec.span("d2h", "grads", 5, d2h, 100):
        pass
    late_end = rec._device_pending[-1][2]
    late_end.running = True
    rec.end_step()
    assert [s.lane for s in rec.spans if s.lane != "step"] == ["compute"]
    late_end.running = False
    rec.begin_step(1, "cuda:0")
    with rec.span("compute", "forward", 0, current):
        time.sleep(0.001)
    rec.end_step()
    assert [(s.lane, s.layer) for s in rec.spans if s.lane == "d2h"] == [("d2h", 5)]


# ---- files ----

def test_chrome_trace_roundtrip():
    spans = hand_built()
    back = chrome_trace_to_spans(json.loads(json.dumps(spans_to_chrome_trace(spans))))
    key = lambda s: (s.lane, s.start, s.name)  # noqa: E731
    for a, b in zip(sorted(spans, key=key), sorted(back, key=key), strict=True):
        assert (a.lane, a.name, a.step, a.layer, a.nbytes) == (b.lane, b.name, b.step, b.layer, b.nbytes)
        assert b.start == pytest.approx(a.start, abs=1e-9) and b.end == pytest.approx(a.end, abs=1e-9)


def test_steps_jsonl_roundtrip(tmp_path):
    path = tmp_path / STEPS_FILE
    stats = [account(hand_built(), step, 0.0, 10.0) for step in range(3)]
    for s in stats:
        append_step(s, path)
    assert read_steps(path) == stats
    assert json.loads(path.read_text().splitlines()[0])["wait_data"] == pytest.approx(1.1)
    with open(path, "a") as f:
        f.write('{"step": 3, "step_ti')  # a writer killed mid-line
    assert read_steps(path) == stats
    path.write_text(path.read_text().replace('{"step": 3, "step_ti', "") + "not json\n" + json.dumps(
        stats[0].to_dict()) + "\n")
    with pytest.raises(ValueError, match="line 4"):
        read_steps(path)


def test_steps_jsonl_from_the_training_log(tmp_path):
    """pipelines/train.py writes its own records (loss, lr, ...) with the StepStats under "stats"."""
    path = tmp_path / STEPS_FILE
    stats = account(hand_built(), 4, 0.0, 10.0)
    lines = [{"step": 4, "loss": 2.5, "lr": 1e-4, "stats": stats.to_dict()},
             {"step": 5, "loss": 2.4, "stats": None}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_steps(path) == [stats]
    # a record from before gradients were a cause of their own reads as no wait for them
    older = {k: v for k, v in stats.to_dict().items() if k != "wait_gradients"}
    path.write_text(json.dumps({"step": 4, "stats": older}) + "\n")
    assert read_steps(path)[0].wait_gradients == 0.0


def decode_png(data: bytes) -> tuple[dict[bytes, bytes], np.ndarray]:
    """Checks the signature and every chunk's CRC, and undoes filter type 0 of an 8-bit RGB image."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos, order = {}, 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks[tag], pos = body, pos + 12 + n
        order.append(tag)
    assert order[0] == b"IHDR" and order[-1] == b"IEND" and b"IDAT" in order
    w, h, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return chunks, raw[:, 1:].reshape(h, w, 3)


def test_png_writer(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, size=(17, 23, 3), dtype=np.uint8)
    write_png(img, tmp_path / "x.png")
    _, back = decode_png((tmp_path / "x.png").read_bytes())
    assert back.shape == (17, 23, 3) and (back == img).all()
    with pytest.raises(ValueError):
        png_bytes(np.zeros((4, 4), dtype=np.uint8))


# ---- the report ----

def make_run(run_dir, steps: int = 3) -> list[Span]:
    """A run directory written as a run writes it, from hand-built steps 10 s apart."""
    spans = []
    for step in range(steps):
        t0 = 100.0 + 10.0 * step
        step_spans = [Span(s.lane, s.name, step, s.start + t0, s.end + t0, s.layer, s.nbytes)
                      for s in hand_built()]
        append_step(account(step_spans, step, t0, t0 + 10.0), run_dir / STEPS_FILE)
        spans += step_spans + [Span("step", "step", step, t0, t0 + 10.0)]
    write_chrome_trace(spans, run_dir / TRACE_FILE)
    return spans


def test_report_table_and_timeline(tmp_path):
    spans = make_run(tmp_path)
    text = report(tmp_path)
    lines = text.splitlines()
    assert "compute" in lines[0] and "w.weights" in lines[0] and "H2D GB/s" in lines[0]
    row = lines[3].split()  # step 2
    assert row[0] == "2" and float(row[1]) == pytest.approx(10000.0)
    assert float(row[2]) == pytest.approx(5000.0)
    assert float(row[3]) == pytest.approx(2000.0) and float(row[6]) == pytest.approx(1100.0)
    assert float(row[5]) == 0.0 and "w.grads" in lines[0]
    assert float(row[9]) == pytest.approx(100 / 3.8, abs=0.05) and lines[4].startswith("  mean")
    assert "timeline of step 2" in text

    _, img = decode_png((tmp_path / "timeline.png").read_bytes())
    _, geo = render_timeline(spans, 120.0, 130.0, title="step 2")
    assert img.shape == (geo.height, geo.width, 3)
    # the middle of layer 1's forward (compute lane, [124, 126] s) is drawn in the forward colour
    y0, y1 = geo.lanes["compute"]
    assert tuple(img[(y0 + y1) // 2, geo.x_of(125.0)]) == COLORS["forward"]
    y0, y1 = geo.lanes["wait"]
    assert tuple(img[(y0 + y1) // 2, geo.x_of(127.5)]) == COLORS["wait:weights"]
    assert set(geo.lanes) == {"h2d", "compute", "d2h", "optimizer/0", "host", "wait"}

    report(tmp_path, step=0)
    _, img0 = decode_png((tmp_path / "timeline.png").read_bytes())
    assert img0.shape == img.shape


def one_sentence(msg: str) -> bool:
    return "\n" not in msg.strip() and msg.strip().endswith(".") and msg[0].isupper()


def test_report_errors_are_one_sentence(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2  # the CLI prints a report's error, as any other
    err = capsys.readouterr().err
    assert err.startswith("megatrain: error: ") and one_sentence(err.removeprefix("megatrain: error: "))
    assert "does not exist" in err

    def reason(step: int | None = None) -> str:
        with pytest.raises(ReportError) as e:
            report(tmp_path, step)
        assert one_sentence(str(e.value)), str(e.value)
        return str(e.value)

    assert STEPS_FILE in reason()
    (tmp_path / STEPS_FILE).write_text("{broken\n{}\n")
    assert "corrupt" in reason()
    (tmp_path / STEPS_FILE).write_text("")
    assert "no finished step" in reason()
    make_run(tmp_path, steps=2)
    (tmp_path / TRACE_FILE).unlink()  # a run without --trace: the table, and why there is no picture
    untraced = report(tmp_path)
    assert untraced.split()[0] == "step" and f"no timeline: {tmp_path} has no {TRACE_FILE}" in untraced
    assert not (tmp_path / "timeline.png").exists()
    (tmp_path / TRACE_FILE).write_text('{"traceEvents": [{"ph": "X"}]}')
    assert "not a valid Chrome trace" in reason()
    make_run(tmp_path, steps=2)
    assert "Step 9 is not in" in reason(step=9)
    assert main_report(str(tmp_path), 1) == 0
    assert "timeline of step 1" in capsys.readouterr().out
    assert main_report(str(tmp_path), None) == 0  # the CLI's call without --step: the last traced step
    assert "timeline of step 1" in capsys.readouterr().out


def test_an_evaluation_between_steps_is_not_counted_in_the_next_step() -> None:
    """The executor actor's evaluate() records into a step it then drops (end_step(keep=False))."""
    rec = Recorder()
    rec.begin_step(0)
    with rec.span("compute", "forward", 1):
        time.sleep(0.01)
    rec.end_step(keep=False)
    rec.begin_step(0)
    stats = rec.end_step()
    assert [s.name for s in rec.spans] == ["step"] and stats.compute == 0.0
