"""Telemetry: per-layer spans, stall accounting, Chrome traces, per-step JSON Lines, and a PNG writer.

    rec = Recorder()
    rec.begin_step(step, device)
    with rec.wait("data"): batch = next(loader)
    with rec.span("h2d", "load", layer, stream=h2d_stream, nbytes=n): buffer.copy_(weights, non_blocking=True)
    with rec.span("compute", "forward", layer, stream=compute_stream): x = layer(x, buffer)
    stats = rec.end_step()               # compute + waits + other == step_time
    append_step(stats, run_dir / STEPS_FILE); write_chrome_trace(rec.spans, run_dir / TRACE_FILE)

`megatrain report` reads what these write (megatrain/telemetry/report.py, imported by name: it is not re-exported).
"""

from megatrain.telemetry.png import png_bytes, write_png
from megatrain.telemetry.recorder import (
    DEVICE_LANES,
    EGRESS_LANE,
    HANDOUT_LANE,
    STEP_LANE,
    WAIT_CAUSES,
    WAIT_LANE,
    Recorder,
    Span,
    StepStats,
    account,
    add_wait_before,
    executor_lanes,
    optimizer_lane,
)
from megatrain.telemetry.trace import (
    STEPS_FILE,
    TRACE_FILE,
    append_step,
    chrome_trace_to_spans,
    read_chrome_trace,
    read_steps,
    spans_to_chrome_trace,
    write_chrome_trace,
)

__all__ = [
    "DEVICE_LANES", "EGRESS_LANE", "HANDOUT_LANE", "STEP_LANE", "STEPS_FILE", "TRACE_FILE", "WAIT_CAUSES", "WAIT_LANE",
    "Recorder", "Span", "StepStats", "account", "add_wait_before", "append_step", "chrome_trace_to_spans",
    "executor_lanes", "optimizer_lane", "png_bytes", "read_chrome_trace", "read_steps", "spans_to_chrome_trace",
    "write_chrome_trace", "write_png",
]
