"""megatrain's Grafana dashboard: pipeline stalls by cause, where a step's time goes, throughput, the optimizer
workers, transfers and memory, as JSON in the form of Ray's own dashboards.

    json_text = dashboard_json()                     # what `megatrain dashboard --out FILE` writes
    write_into_ray_session(session_dir)              # beside Ray's: <session>/metrics/grafana/dashboards/

Every query is built from the metric specs actors/metrics.py records (docs/design.md#the-grafana-dashboard)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.telemetry import metric_specs as m
from megatrain.telemetry.metric_specs import MetricSpec
from megatrain.telemetry.trace import atomic_write

DASHBOARD_FILE = "megatrain_grafana_dashboard.json"  # Ray names its own <name>_grafana_dashboard.json
UID = "megatrainDashboard"
# Ray's dashboard layout: a 24-unit wide grid, two panels to a row, each 8 units high, rows 1 unit high.
ROW_WIDTH, PANEL_WIDTH, PANEL_HEIGHT, ROW_HEIGHT = 24, 12, 8, 1
# Where Ray's dashboard writes the Grafana dashboards it provisions, under a session directory.
RAY_DASHBOARDS = Path("metrics", "grafana", "dashboards")
RAY_PROVISIONING = Path("metrics", "grafana", "provisioning", "dashboards", "default.yml")
QUANTILES = (0.5, 0.9, 0.99)
# Every query keeps to the variables' choice; $node is matched against Ray's NodeAddress label, which the metrics
# agent puts on every series (Prometheus's `instance` is the agent's host:port instead).
FILTER = 'run=~"$run",NodeAddress=~"$node",executor=~"$executor"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stack: bool = False  # stacked areas: parts of one whole (a step's seconds)


def select(spec: MetricSpec, suffix: str = "", **labels: str) -> str:
    """The series of `spec` for the dashboard's choice of run, node and executor (plus exact `labels`)."""
    extra = "".join(f',{key}="{value}"' for key, value in labels.items())
    return f"{spec.series}{suffix}{{{FILTER}{extra}}}"


def quantiles(spec: MetricSpec) -> tuple[Query, ...]:
    """p50 / p90 / p99 of a histogram over Grafana's rate window, all series of the choice pooled."""
    return tuple(Query(f"histogram_quantile({q}, sum by (le) (rate({select(spec, '_bucket')}[$__rate_interval])))",
                       f"p{round(q * 100)}") for q in QUANTILES)


def wait(cause: str) -> tuple[Query, ...]:
    return (Query(select(m.WAIT_SECONDS, cause=cause), "executor {{executor}}"),)


PER_EXECUTOR = "executor {{executor}}"
PER_WORKER = "worker {{worker}}"
READ_BESIDE_REPORT = ("`megatrain report RUN` shows the same accounting step by step; a run with --trace also "
                      "writes RUN/timeline.png, one step's lanes, to see where in the step the compute lane waited.")

STALLS = [
    PanelSpec("Stall fraction", "1 - compute / step time of the last step, per executor: the share of the step the "
              "compute lane sat idle. The panels beside it say what it waited for. " + READ_BESIDE_REPORT,
              "percentunit", (Query(select(m.STALL_FRACTION), PER_EXECUTOR),)),
    PanelSpec("Waits by cause", "Seconds of the last step the compute lane waited, by cause (all executors "
              "chosen, added up): weights (H2D too slow), optimizer (last step's update of a layer not done yet, or "
              "no free gradient slot), gradients (earlier layers' gradients not yet off the device), data (no batch "
              "ready), other (host overhead, launches).",
              "s", (Query(f"sum by (cause) ({select(m.WAIT_SECONDS)})", "{{cause}}"),), stack=True),
    PanelSpec("Waiting for weights", "Compute idle while a layer's weights were still crossing host to device. The "
              "link is the bound: --precision bf16 moves half the bytes (the optimizer's bf16 copy of the weights); "
              "a larger --batch-size or --seq-len, or more --micro-batches, gives each weight byte more compute to "
              "hide under. H2D GB/s far below `megatrain calibrate`'s: see `megatrain doctor` (page-locked arena).",
              "s", wait("weights")),
    PanelSpec("Waiting for the optimizer", "Compute idle until the CPU optimizer workers had applied the last step's "
              "update of a layer (or freed a host slot for its gradients). More --optimizer-workers (cores), or "
              "fewer updates per token (a larger batch, more --micro-batches); clipping off (--max-grad-norm 0) lets "
              "each layer's update start during backward. See update times and queue depth below.",
              "s", wait("optimizer")),
    PanelSpec("Waiting for gradients", "Compute idle because the gradients of the layers before were still on "
              "the device: the backward computes a layer's gradients only once fewer than two layers' are on their "
              "way to the host, so the device does not run out of memory. The D2H copies are the bound (see D2H "
              "GB/s against the link); a larger --batch-size, --seq-len or more --micro-batches give each gradient "
              "byte more compute to hide under; --grads device keeps them on the GPU and sends them out during the "
              "next forward. Copies held up by a host slot the optimizer has not freed count as the optimizer's.",
              "s", wait("gradients")),
    PanelSpec("Waiting for data", "The driver waited for the step's batch from the data loader: reading and "
              "tokenizing are slower than a step. Tokenize ahead of time, read Parquet / Arrow rather than text, or "
              "give each step more tokens (--batch-size, --seq-len) so the loader has longer to produce one.", "s",
              wait("data")),
    PanelSpec("Other", "Compute idle for none of the causes above: host overhead between kernels, kernel launches, "
              "and on the CPU path the gradient copies themselves. Fewer, larger steps (--batch-size) amortize it; "
              "--compile fuses a layer's kernels into fewer launches.", "s", wait("other")),
]

STEP_TIME = [
    PanelSpec("Where a step's time goes", "The last step's seconds, stacked: compute, then each cause of waiting; "
              "with one executor chosen, the top of the stack is its step time. " + READ_BESIDE_REPORT, "s",
              (Query(select(m.COMPUTE_SECONDS), "compute (executor {{executor}})"),
               Query(select(m.WAIT_SECONDS), "{{cause}} (executor {{executor}})")), stack=True),
    PanelSpec("Transfers hidden under compute", "Fraction of the last step's transfer time (H2D or D2H busy) that "
              "overlapped compute: 1 is a fully hidden pipeline; lower means the copies show up as waits for "
              "weights or gradients, or as other.", "percentunit", (Query(select(m.OVERLAP_FRACTION), PER_EXECUTOR),)),
    PanelSpec("Step time quantiles", "Step wall time from the step histogram over Grafana's rate window. A p99 far "
              "above p50: occasional stalls (a checkpoint, an evaluation, a slow batch) rather than a steady bound.",
              "s", quantiles(m.STEP_DURATION)),
    PanelSpec("Step time", "Wall time of the last step, per executor.", "s",
              (Query(select(m.STEP_SECONDS), PER_EXECUTOR),)),
]

THROUGHPUT = [
    PanelSpec("Tokens/s", "Training throughput: the step's tokens over its wall time. It moves inversely with the "
              "stall fraction at a fixed batch.", "short", (Query(select(m.TOKENS_PER_SECOND), "tokens/s"),)),
    PanelSpec("Model TFLOP/s", "Model FLOPs (6 N per token plus attention, as the benchmarks count) per second: "
              "compare with the matmul TFLOP/s `megatrain calibrate` measured for this precision.", "short",
              (Query(select(m.TFLOPS), "TFLOP/s"),)),
    PanelSpec("Loss", "Training loss of the last step (a non-finite loss is not recorded: the step is skipped).",
              "short", (Query(select(m.LOSS), "loss"),)),
    PanelSpec("Steps/s", "Steps per second from the step counter; a dip is a slower step (a checkpoint, an "
              "evaluation, a stall).", "short",
              (Query(f"sum by (run) (rate({select(m.STEPS)}[$__rate_interval]))", "steps/s"),)),
]

OPTIMIZER = [
    PanelSpec("Optimizer update time quantiles", "Time of one layer's AdamW update on one worker, from the update "
              "histogram. Times the layers per step over the workers bound the step from below: when it nears the "
              "step time, waits for the optimizer grow; add --optimizer-workers.", "s", quantiles(m.UPDATE_DURATION)),
    PanelSpec("Optimizer queue depth", "Layers handed to a worker and not yet updated, as it starts an update. "
              "Growing: the workers fall behind the backward pass and the next forward will wait for them (more "
              "--optimizer-workers); near 0: the optimizer keeps up.", "short",
              (Query(select(m.QUEUE_DEPTH), PER_WORKER),)),
    PanelSpec("Update time per worker", "The last layer update time of each worker: one slower than the rest "
              "(a busy core, another NUMA node) sets the pace of all.", "s",
              (Query(select(m.UPDATE_SECONDS), PER_WORKER),)),
    PanelSpec("Rollbacks", "Steps so far whose updates beside the backward were rolled back: the step's gradient "
              "norm exceeded --max-grad-norm (each unit's update rolled back and redone with the clipped gradient, "
              "in one pass over its weights and moments) or a gradient was not finite. Rising with every "
              "step: clipping is on most steps (with speculate = auto, the engine's default, a step after one "
              "that clipped updates after its backward instead, so a rollback follows a step that did not clip).",
              "short", (Query(select(m.ROLLBACKS), "rollbacks"),)),
    PanelSpec("Post-training", "The last step's metrics of a megatrain dpo or grpo run, as TRL names them: GRPO's "
              "reward mean and spread, KL to the initial policy, clip fraction, completion length; DPO's "
              "rewards/accuracies and margins (eval/...: the held-out pairs').", "short",
              (Query(select(m.POST_TRAINING), "{{metric}}"),)),
]

TRANSFERS = [
    PanelSpec("H2D / D2H GB/s", "Bandwidth of the last step's copies while each lane was busy: weights in (h2d), "
              "gradients out (d2h). Compare with the link: `megatrain calibrate` (or `megatrain doctor`) measures "
              "its registered-memory GB/s; far below it, the copies are not page-locked or share the link.",
              "GBs", (Query(select(m.TRANSFER_GBPS), "{{direction}} (executor {{executor}})"),)),
    PanelSpec("Bytes moved per second", "Bytes copied per second of wall time, by direction (the byte counter's "
              "rate): what the run asks of the link on average, against the GB/s it gets while copying.", "Bps",
              (Query(f"sum by (direction) (rate({select(m.TRANSFER_BYTES)}[$__rate_interval]))", "{{direction}}"),)),
    PanelSpec("Arena bytes", "The shared-memory arena in /dev/shm: weights, Adam moments and gradients in fp32 "
              "(12 B per parameter; 16 with gradients in the arena, 2 more for bf16's copy). `megatrain plan` says "
              "what a model needs before it runs.", "bytes",
              (Query(select(m.ARENA_BYTES), "{{kind}}"),)),
]

ROWS = [("Pipeline stalls", STALLS), ("Where the time goes", STEP_TIME), ("Throughput and loss", THROUGHPUT),
        ("Optimizer workers", OPTIMIZER), ("Transfers and memory", TRANSFERS)]


def variable(name: str, label: str, definition: str, description: str, include_all: bool) -> dict[str, Any]:
    """A Prometheus query variable as Ray's dashboards write them (`label_values(...)` on ${datasource}), refreshed
    when the time range changes so that it lists what that range holds."""
    return {"name": name, "label": label, "type": "query", "description": description, "datasource": "${datasource}",
            "definition": definition, "query": {"query": definition, "refId": "StandardVariableQuery"},
            "refresh": 2, "hide": 0, "includeAll": include_all, "multi": include_all,
            "allValue": ".*" if include_all else None, "sort": 1, "regex": "", "options": [],
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {}}


def templating() -> list[dict[str, Any]]:
    # the datasource variable exactly as Ray's dashboards have it: their provisioning names the datasource
    datasource = {"name": "datasource", "type": "datasource", "description": "Filter queries of a specific "
                  "Prometheus type.", "query": "prometheus", "refresh": 1, "hide": 2, "includeAll": False,
                  "multi": False, "options": [], "regex": "", "skipUrlSync": False, "current": {"selected": False}}
    any_megatrain = '{__name__=~"ray_megatrain_.+",run=~"$run"}'
    return [datasource,
            variable("run", "Run", f"label_values({m.STEPS.series}, run)",
                     "The run: its id is in the names of its actors (megatrain/<run>/...).", include_all=False),
            variable("node", "Node", f"label_values({any_megatrain}, NodeAddress)",
                     "Ray nodes (NodeAddress) the run's processes record from.", include_all=True),
            variable("executor", "Executor", f'label_values({m.STEP_SECONDS.series}{{run=~"$run"}}, executor)',
                     "Executors of the run (data parallel ranks).", include_all=True)]


def panel(spec: PanelSpec, panel_id: int, x: int, y: int) -> dict[str, Any]:
    stacking = {"mode": "normal" if spec.stack else "none", "group": "A"}
    return {
        "id": panel_id, "type": "timeseries", "title": spec.title, "description": spec.description,
        "datasource": "${datasource}", "gridPos": {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": spec.unit, "min": 0, "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if spec.stack else 10, "showPoints": "never",
            "spanNulls": True, "stacking": stacking}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": "${datasource}", "expr": q.expr, "legendFormat": q.legend, "refId": chr(65 + i),
                     "interval": "", "exemplar": False} for i, q in enumerate(spec.queries)],
    }


def panels() -> list[dict[str, Any]]:
    """Rows laid out as Ray lays out its own: a row header, then its panels two to a row."""
    out: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for title, specs in ROWS:
        out.append({"id": next_id, "type": "row", "title": title, "collapsed": False, "panels": [],
                    "gridPos": {"h": ROW_HEIGHT, "w": ROW_WIDTH, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + ROW_HEIGHT
        for i, spec in enumerate(specs):
            out.append(panel(spec, next_id, PANEL_WIDTH * (i % 2), y + PANEL_HEIGHT * (i // 2)))
            next_id += 1
        y += PANEL_HEIGHT * ((len(specs) + 1) // 2)
    return out


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (Ray's base fields: schema 27, the built-in annotations, 30 minutes)."""
    return {
        "title": "megatrain", "uid": UID, "version": 1, "schemaVersion": 27, "editable": True, "graphTooltip": 1,
        "refresh": "10s", "style": "dark", "tags": ["megatrain"], "timezone": "", "links": [], "timepicker": {},
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": [{"builtIn": 1, "datasource": "-- Grafana --", "enable": True, "hide": True,
                                  "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                                  "type": "dashboard"}]},
        "templating": {"list": templating()},
        "panels": panels(),
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def write_dashboard(path: Path) -> Path:
    """The dashboard into `path`, atomically: Grafana's provisioning rereads the folder while it is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, dashboard_json())
    return path


def ray_dashboards_folder(session_dir: Path) -> Path | None:
    """The folder whose dashboards Ray's Grafana provisioning loads for this session: the one its provisioning file
    names (RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR moves it), else <session>/metrics/grafana/dashboards; None where
    Ray wrote none (a Ray started without its dashboard, or not on this node)."""
    provisioning = session_dir / RAY_PROVISIONING
    named = re.search(r"^\s*path:\s*(\S+)\s*$", provisioning.read_text(), re.M) if provisioning.is_file() else None
    folder = Path(named.group(1)) if named else session_dir / RAY_DASHBOARDS
    return folder if folder.is_dir() else None


def write_into_ray_session(session_dir: Path) -> Path | None:
    """megatrain's dashboard beside Ray's in the session's dashboards folder; None (nothing written) without one."""
    folder = ray_dashboards_folder(session_dir)
    return None if folder is None else write_dashboard(folder / DASHBOARD_FILE)
