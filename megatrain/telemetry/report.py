"""`megatrain report RUN_DIR`: the stall table of a run and a picture of one step's timeline.

Reads RUN_DIR/steps.jsonl (one StepStats per step) and RUN_DIR/trace.json (the spans), prints a table of
where each step's time went and writes RUN_DIR/timeline.png: one lane per stream / worker / host waits,
one coloured box per span, a time axis in ms.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from megatrain.config import MegatrainError
from megatrain.telemetry.png import GLYPH_H, draw_text, fill_rect, text_width, write_png
from megatrain.telemetry.recorder import EGRESS_LANE, STEP_LANE, WAIT_LANE, Span, StepStats
from megatrain.telemetry.trace import STEPS_FILE, TRACE_FILE, read_chrome_trace, read_steps

TIMELINE_FILE = "timeline.png"
TABLE_ROWS = 50  # steps shown in the table; the mean row covers all of them

COLORS: dict[str, tuple[int, int, int]] = {
    "forward": (66, 133, 244), "recompute+backward": (219, 68, 55), "backward": (230, 124, 115), "head": (244, 180, 0),
    "embed": (121, 85, 72), "embed-backward": (240, 98, 146), "load": (15, 157, 88), "grads": (171, 71, 188),
    "update": (0, 172, 193), "sync": (158, 158, 158),
    "wait:weights": (255, 112, 67), "wait:optimizer": (55, 71, 79), "wait:data": (144, 164, 174),
    "wait:gradients": (126, 87, 194), "slot": (96, 125, 139),
}
_EXTRA = [(124, 179, 66), (255, 167, 38), (92, 107, 192), (141, 110, 99), (38, 166, 154), (236, 64, 122)]
BACKGROUND, LANE_BG, INK, GRID = (255, 255, 255), (236, 239, 241), (33, 33, 33), (200, 200, 200)


class ReportError(MegatrainError):
    """A one-sentence reason the report cannot be made."""


def color_key(span: Span) -> str:
    return f"wait:{span.name}" if span.lane == WAIT_LANE else span.name


def color_of(key: str) -> tuple[int, int, int]:
    # Names outside the table get a stable colour from their hash, the same in every picture.
    return COLORS.get(key) or _EXTRA[zlib.crc32(key.encode()) % len(_EXTRA)]


# ---- the table ----

def format_table(steps: list[StepStats]) -> str:
    head = (f"{'step':>6} {'time ms':>9} {'compute':>9} {'w.weights':>9} {'w.optim':>9} {'w.grads':>9} "
            f"{'w.data':>9} {'other':>9} {'stall%':>7} {'overlap%':>8} {'H2D GB/s':>9} {'D2H GB/s':>9}")

    def row(label: str, s: StepStats) -> str:
        ms = [1e3 * v for v in (s.step_time, s.compute, s.wait_weights, s.wait_optimizer, s.wait_gradients,
                                s.wait_data, s.other)]
        return (f"{label:>6} " + " ".join(f"{v:9.1f}" for v in ms) + f" {100 * s.stall_fraction:7.1f}"
                f" {100 * s.overlap:8.1f} {s.h2d_gbps:9.2f} {s.d2h_gbps:9.2f}")

    lines = [head] + [row(str(s.step), s) for s in steps[-TABLE_ROWS:]]
    if len(steps) > TABLE_ROWS:
        lines.insert(1, f"{'...':>6} ({len(steps) - TABLE_ROWS} earlier steps not shown)")
    body = steps[1:] if len(steps) > 1 else steps  # the first step warms up (allocations, compilation)
    mean = StepStats(**{f.name: sum(getattr(s, f.name) for s in body) / len(body) for f in fields(StepStats)})
    lines.append(row("mean", mean) + ("  (without the first step)" if len(steps) > 1 else ""))
    return "\n".join(lines)


# ---- the picture ----

@dataclass
class Timeline:
    """Where things are in the picture: what a test needs to find a span's pixels."""

    width: int
    height: int
    plot_x0: int  # pixel column of the window's start
    plot_x1: int  # pixel column of the window's end
    start: float
    end: float
    lanes: dict[str, tuple[int, int]] = field(default_factory=dict)  # lane -> [y0, y1) rows

    def x_of(self, t: float) -> int:
        frac = (t - self.start) / (self.end - self.start) if self.end > self.start else 0.0
        return self.plot_x0 + int(round(frac * (self.plot_x1 - self.plot_x0)))


def _lanes(spans: list[Span]) -> list[str]:
    present = {s.lane for s in spans}
    workers = sorted((lane for lane in present if lane.startswith("optimizer/")),
                     key=lambda lane: (len(lane), lane))
    extra = sorted(present - {"h2d", "compute", "d2h", EGRESS_LANE, "host", WAIT_LANE, STEP_LANE} - set(workers))
    egress = [EGRESS_LANE] if EGRESS_LANE in present else []  # beside the copies it holds up
    return ["h2d", "compute", "d2h", *egress, *workers, *extra, *(["host"] if "host" in present else []), WAIT_LANE]


def _ticks(span_ms: float) -> float:
    """A 1-2-5 tick step giving 5 to 12 ticks across span_ms."""
    step = 10 ** np.floor(np.log10(max(span_ms, 1e-6) / 10))
    for m in (1, 2, 5, 10):
        if span_ms / (m * step) <= 12:
            return float(m * step)
    return float(10 * step)


def _draw_axis(img: np.ndarray, geo: Timeline, top: int, axis_y: int, pad: int, scale: int) -> None:
    """The time axis: a grid line and a label per tick."""
    start, end = geo.start, geo.end
    tick = _ticks((end - start) * 1e3)
    n_ticks = int((end - start) * 1e3 / tick + 1e-9)
    for j in range(n_ticks + 1):
        t_ms = j * tick
        x = geo.x_of(start + t_ms / 1e3)
        fill_rect(img, x, top, x + 1, axis_y + pad // 2, GRID)
        label = f"{t_ms:g}"
        draw_text(img, x - text_width(label, scale) // 2, axis_y + pad, label, INK, scale)
    fill_rect(img, geo.plot_x0, axis_y, geo.plot_x1 + 1, axis_y + 1, INK)
    draw_text(img, pad, axis_y + pad, "time (ms)", INK, scale)


def _draw_spans(img: np.ndarray, geo: Timeline, spans: list[Span]) -> None:
    for s in sorted(spans, key=lambda s: s.start):
        y0, y1 = geo.lanes[s.lane]
        x0 = geo.x_of(max(s.start, geo.start))
        x1 = max(geo.x_of(min(s.end, geo.end)), x0 + 1)  # at least a pixel: short spans stay visible
        color = color_of(color_key(s))
        fill_rect(img, x0, y0 + 2, x1, y1 - 2, color)
        if x1 - x0 >= 4:  # a darker left edge tells neighbouring boxes of one colour apart
            fill_rect(img, x0, y0 + 2, x0 + 1, y1 - 2, tuple(int(c * 0.6) for c in color))


def render_timeline(spans: list[Span], start: float, end: float, title: str = "",
                    width: int = 1600, scale: int = 2) -> tuple[np.ndarray, Timeline]:
    """Draws the spans that overlap [start, end] (seconds) and returns the image and its geometry."""
    spans = [s for s in spans if s.lane != STEP_LANE and s.end > start and s.start < end]
    lanes = _lanes(spans)
    labels = {lane: ("host waits" if lane == WAIT_LANE else lane) for lane in lanes}
    gh, pad = GLYPH_H * scale, 6 * scale
    lane_h, lane_gap = gh + 4 * pad // 2, pad
    label_w = max(text_width(v, scale) for v in labels.values()) + 2 * pad
    top = pad + (gh + pad if title else 0)
    keys = sorted({color_key(s) for s in spans}, key=lambda k: (k.startswith("wait:"), k))
    legend = [(k, color_of(k)) for k in keys]
    # legend entries flow left to right, wrapping
    rows, x = 1, pad
    for k, _ in legend:
        w = gh + pad // 2 + text_width(k, scale) + 2 * pad
        if x + w > width - pad and x > pad:
            rows, x = rows + 1, pad
        x += w
    axis_y = top + len(lanes) * (lane_h + lane_gap)
    height = axis_y + 2 * pad + gh + pad + rows * (gh + pad) + pad
    geo = Timeline(width, height, label_w, width - 3 * pad, start, end)

    img = np.empty((height, width, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    if title:
        draw_text(img, pad, pad, title, INK, scale)
    for i, lane in enumerate(lanes):
        y0 = top + i * (lane_h + lane_gap)
        geo.lanes[lane] = (y0, y0 + lane_h)
        draw_text(img, pad, y0 + (lane_h - gh) // 2, labels[lane], INK, scale)
        fill_rect(img, geo.plot_x0, y0, geo.plot_x1 + 1, y0 + lane_h, LANE_BG)

    _draw_axis(img, geo, top, axis_y, pad, scale)
    _draw_spans(img, geo, spans)
    y, x = axis_y + 2 * pad + gh + pad, pad
    for k, color in legend:
        w = gh + pad // 2 + text_width(k, scale) + 2 * pad
        if x + w > width - pad and x > pad:
            y, x = y + gh + pad, pad
        fill_rect(img, x, y, x + gh, y + gh, color)
        draw_text(img, x + gh + pad // 2, y, k, INK, scale)
        x += w
    return img, geo


# ---- the report ----

def _load(run_dir: Path) -> tuple[list[StepStats], list[Span] | None]:
    """The step records, and the trace's spans (None: the run was not traced)."""
    if not run_dir.is_dir():
        raise ReportError(f"Run directory {run_dir} does not exist; pass the --out directory of a "
                          "`megatrain train --trace` run.")
    steps_path, trace_path = run_dir / STEPS_FILE, run_dir / TRACE_FILE
    if not steps_path.is_file():
        raise ReportError(f"No {STEPS_FILE} in {run_dir}, so no run wrote step telemetry there; pass the --out "
                          "directory of a `megatrain train --trace` run.")
    try:
        steps = read_steps(steps_path)
    except (OSError, ValueError) as e:
        raise ReportError(f"The step log {steps_path} is corrupt ({e}).") from e
    if not steps:
        raise ReportError(f"The step log {steps_path} holds no finished step yet; run the report again "
                          "once the run has finished a step.")
    if not trace_path.is_file():
        return steps, None
    try:
        spans = read_chrome_trace(trace_path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReportError(f"The trace {trace_path} is not a valid Chrome trace ({e!r}).") from e
    return steps, spans


PREDICTION_FILE = "prediction.json"  # written by pipelines/train.py where the machine was calibrated


def predicted_line(run_dir: Path, steps: list[StepStats]) -> str:
    """The run's predicted step time beside the measured mean (without the first step), or "" where the run
    recorded no prediction. Where the step log says how each step's update ran (pipelines/train.py's "update"), the
    prediction is the mean of each step's own case (a run whose steps all clip is held to the serial case, not to the
    share of clipping steps the prediction assumed)."""
    try:
        pred = json.loads((run_dir / PREDICTION_FILE).read_text())
        predicted = float(pred["predicted_step_s"])
        cases = {name: float(case["step_s"]) for name, case in (pred.get("cases") or {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    body = steps[1:] if len(steps) > 1 else steps
    measured = sum(s.step_time for s in body) / len(body)
    # by the step number of the stats each record carries (the table's rows), which is the update's count
    updates = {r["stats"]["step"]: r.get("update") for r in _step_records(run_dir) if r.get("stats")}
    own = [updates.get(s.step) for s in body]
    which = ""
    if all(u in cases for u in own):
        predicted = sum(cases[u] for u in own) / len(own)
        which = " for each step's own update: " + ", ".join(f"{own.count(c)} {c}" for c in cases if c in own)
    lanes = ", ".join(f"{name} {1e3 * float(pred.get(name + '_s', 0.0)):.1f}"
                      for name in ("compute", "h2d", "d2h", "optimizer", "data"))
    return (f"\npredicted step {1e3 * predicted:.1f} ms{which} (bound by {pred.get('bound', '?')}; {lanes} ms), "
            f"measured {1e3 * measured:.1f} ms: predicted / measured {predicted / measured:.2f}" if measured > 0
            else "")


def _step_records(run_dir: Path) -> list[dict]:
    """The step log's records as pipelines/train.py wrote them (the whole records, not only their StepStats)."""
    records = [json.loads(line) for line in (run_dir / STEPS_FILE).read_text().splitlines() if line.endswith("}")]
    return [r for r in records if isinstance(r, dict)]


def rollback_line(run_dir: Path) -> str:
    """How many of the logged steps rolled back their updates beside the backward (pipelines/train.py's records say
    "rolled_back"), or "" where none did."""
    logged = [r for r in _step_records(run_dir) if "rolled_back" in r]
    rolled = sum(bool(r["rolled_back"]) for r in logged)
    return (f"\nrollbacks: {rolled} of {len(logged)} steps rolled back their updates beside the backward (the step "
            "clipped, or a gradient was not finite)") if rolled else ""


def report(run_dir: str | os.PathLike, step: int | None = None) -> str:
    """The stall table of every step (and the predicted step time beside the measured one where the run recorded
    it, and the rollbacks where there were any), and timeline.png of `step` (default: the last step the trace
    holds)."""
    run_dir = Path(run_dir)
    steps, spans = _load(run_dir)
    table = format_table(steps) + predicted_line(run_dir, steps) + rollback_line(run_dir)
    if spans is None:
        return f"{table}\n\nno timeline: {run_dir} has no {TRACE_FILE}; train with --trace to record one."
    windows = {s.step: (s.start, s.end) for s in spans if s.lane == STEP_LANE}
    if not windows:
        raise ReportError(f"The trace {run_dir / TRACE_FILE} holds no step markers, so no step can be drawn; "
                          "record it again with `megatrain train --trace`.")
    if step is None:
        finished = [s.step for s in steps if s.step in windows]
        step = finished[-1] if finished else max(windows)
    if step not in windows:
        raise ReportError(f"Step {step} is not in {run_dir / TRACE_FILE} "
                          f"(it holds steps {min(windows)} to {max(windows)}).")
    start, end = windows[step]
    by_step = {s.step: s for s in steps}
    title = f"step {step}: {1e3 * (end - start):.1f} ms"
    if step in by_step:
        s = by_step[step]
        title += (f", compute {100 * (1 - s.stall_fraction):.0f}%, waits weights {1e3 * s.wait_weights:.1f}"
                  f" optimizer {1e3 * s.wait_optimizer:.1f} gradients {1e3 * s.wait_gradients:.1f}"
                  f" data {1e3 * s.wait_data:.1f}"
                  f" other {1e3 * s.other:.1f} ms")
    img, _ = render_timeline(spans, start, end, title)
    png = run_dir / TIMELINE_FILE
    try:
        write_png(img, png)
    except OSError as e:
        raise ReportError(f"Could not write {png} ({e.strerror}).") from e
    return f"{table}\n\ntimeline of step {step}: {png}"


def main_report(run_dir: str, step: int | None = None) -> int:
    """Prints the report; a ReportError is the CLI's to print, as every MegatrainError is."""
    print(report(run_dir, step))
    return 0
