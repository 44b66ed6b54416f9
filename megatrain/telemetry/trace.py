"""Files a run leaves behind: `trace.json` (Chrome trace event format, opens in Perfetto or
chrome://tracing) and `steps.jsonl` (one StepStats per line)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from megatrain.telemetry.recorder import DEVICE_LANES, EGRESS_LANE, STEP_LANE, WAIT_LANE, Span, StepStats

TRACE_FILE = "trace.json"
STEPS_FILE = "steps.jsonl"

# Perfetto groups threads under processes: the executor's lanes in one, the optimizer workers in another.
_EXECUTOR_PID, _OPTIMIZER_PID, _OTHER_PID = 1, 2, 3
_EXECUTOR_LANES = (STEP_LANE, *DEVICE_LANES, EGRESS_LANE, "host", WAIT_LANE)


def _lane_order(lane: str) -> tuple[int, int, str]:
    if lane in _EXECUTOR_LANES:
        return (0, _EXECUTOR_LANES.index(lane), lane)
    if lane.startswith("optimizer/"):
        worker = lane.split("/", 1)[1]
        return (1, int(worker) if worker.isdigit() else 1 << 30, lane)
    return (2, 0, lane)


def spans_to_chrome_trace(spans: Iterable[Span]) -> dict:
    """Chrome trace events: one "X" (complete) event per span, µs on the monotonic clock; one thread per
    lane, named after it; step, layer and bytes in args."""
    spans = list(spans)
    lanes = sorted({s.lane for s in spans}, key=_lane_order)
    tid: dict[str, tuple[int, int]] = {}
    events: list[dict] = []
    for pid, name in ((_EXECUTOR_PID, "executor"), (_OPTIMIZER_PID, "optimizer"), (_OTHER_PID, "other")):
        if any(_lane_order(lane)[0] == pid - 1 for lane in lanes):
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
    for i, lane in enumerate(lanes):
        tid[lane] = (_lane_order(lane)[0] + 1, i + 1)
        pid, t = tid[lane]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t,
                       "args": {"sort_index": i}})
    for s in sorted(spans, key=lambda s: s.start):
        pid, t = tid[s.lane]
        args: dict = {"step": s.step}
        if s.layer is not None:
            args["layer"] = s.layer
        if s.nbytes:
            args["bytes"] = s.nbytes
        events.append({"name": s.name, "cat": s.lane, "ph": "X", "pid": pid, "tid": t,
                       "ts": round(s.start * 1e6, 3), "dur": round(max(s.end - s.start, 0.0) * 1e6, 3),
                       "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def atomic_write(path: Path, text: str) -> None:
    # The trace is rewritten while a run goes on; a reader (megatrain report) must never see half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_chrome_trace(spans: Iterable[Span], path: str | os.PathLike) -> None:
    atomic_write(Path(path), json.dumps(spans_to_chrome_trace(spans), separators=(",", ":")))


def chrome_trace_to_spans(trace: dict) -> list[Span]:
    """The inverse of spans_to_chrome_trace (lanes from "cat", or from thread names for foreign X events)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        lane = e.get("cat") or names.get((e.get("pid"), e.get("tid")), "unknown")
        start = float(e["ts"]) / 1e6
        end = start + float(e.get("dur", 0)) / 1e6
        spans.append(Span(lane, e["name"], int(args.get("step", -1)), start, end, args.get("layer"),
                          int(args.get("bytes", 0))))
    return spans


def read_chrome_trace(path: str | os.PathLike) -> list[Span]:
    return chrome_trace_to_spans(json.loads(Path(path).read_text()))


def append_step(stats: StepStats, path: str | os.PathLike) -> None:
    """Appends one line to steps.jsonl; one write call per line, so a crash leaves whole lines."""
    with open(path, "a") as f:
        f.write(json.dumps(stats.to_dict()) + "\n")


def read_steps(path: str | os.PathLike) -> list[StepStats]:
    """Reads steps.jsonl; a bad line raises ValueError naming it (a torn last line is skipped).

    A line is either a StepStats (append_step) or a training log record that carries one under "stats"
    (pipelines/train.py: loss, lr, tokens/s ... and "stats"); a record whose "stats" is null is skipped.
    """
    lines = Path(path).read_text().splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if isinstance(record, dict) and "stats" in record:
                if record["stats"] is None:
                    continue
                record = record["stats"]
            out.append(StepStats.from_dict(record))
        except (ValueError, TypeError) as e:
            if n == len(lines) and not line.endswith("}"):  # the writer was killed mid-line
                break
            raise ValueError(f"line {n}: {e}") from e
    return out
