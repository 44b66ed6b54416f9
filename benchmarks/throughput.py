"""Training throughput of megatrain against its peers, on one model shape, batch and precision.

    python3 benchmarks/throughput.py --model 2.8b --batch 8 --seq 2048 --precision tf32 \\
        --peers megatrain,resident,fsdp2,deepspeed --optimizer-workers 8 --steps 5 --warmup 2 \\
        --out results.json

Each peer (benchmarks/peers.py) runs in a subprocess of its own, one after another, with a timeout: its
GPU memory is its own, its host memory is sampled from here over its whole process tree (Ray's actors
included), and a crash or an out-of-memory costs one row, not the run. The table gives tokens/s, TFLOP/s
as ModelConfig.flops_per_token * tokens / step time (6 N per token plus attention's 12 * layers * hidden * seq;
RESULTS.md tables before the long-context issue and shared/device/README.md count 6 N only), peak GPU and host
memory, and each peer's throughput over
megatrain's; then megatrain's stall breakdown and PCIe rates from StepResult.stats, and `megatrain plan`'s
host and GPU totals for the shape against megatrain's measured peaks (plan_vs_measured), flagged past 10%.

Without CUDA, megatrain and the resident peer run on the CPU and the offload peers say "needs CUDA".
`--table a.json b.json` prints the table of earlier runs' --out files together (e.g. peers run in
separate commands to stay inside a time limit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    REPO,
    MemorySampler,
    fmt,
    format_table,
    gib,
    machine_summary,
    process_tree,
    pythonpath_with_repo,
)
from benchmarks.peers import LABELS, NEEDS_CUDA, PEERS, BenchSpec, PeerResult, run_peer
from megatrain.memory.arena import process_start_time

# ---- running one peer in its own process ----

# Set on SIGTERM (e.g. `timeout` around a whole run, as benchmarks/gpu_session.sh does): the running peer is
# ended like a timed-out one and the rest are not started, so the table and --out still hold the peers done.
STOP = threading.Event()


def _kill(pids: dict[int, int | None], grace: float) -> None:
    """SIGTERM, then after `grace` seconds SIGKILL, to each (pid, start time) still the same process."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid, start in pids.items() if start is not None and process_start_time(pid) == start]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if process_start_time(pid) == pids[pid]]
        if not alive:
            return


def run_in_subprocess(peer: str, spec: BenchSpec, log_dir: Path, timeout: float,
                      log_name: str | None = None) -> PeerResult:
    """One peer's run in a process of its own, its log at log_dir/LOG_NAME.log (default: the peer's name; give
    one per run where a peer runs more than once)."""
    import torch

    if peer in NEEDS_CUDA and not torch.cuda.is_available():
        return PeerResult(peer, status="needs CUDA")
    # the child's result goes to a scratch file, so --log-dir holds only one log per peer
    result_file = Path(tempfile.mkdtemp(prefix=f"mtbench-{peer}-")) / "result.json"
    log_path = log_dir / f"{log_name or peer}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-peer", peer, "--spec",
           json.dumps(asdict(spec)), "--result-file", str(result_file)]
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo()}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    sampler = MemorySampler(proc.pid).start()
    seen: dict[int, int | None] = {}  # every process of the peer's tree we saw, to leave none behind
    timed_out = False
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        seen.update((pid, process_start_time(pid)) for pid in process_tree(proc.pid) if pid not in seen)
        if time.monotonic() > deadline or STOP.is_set():
            timed_out = True
            _kill({pid: start for pid, start in seen.items()}, grace=10)
            break
        time.sleep(0.5)
    rc = proc.wait()
    peaks = sampler.stop()
    # stragglers: Ray's daemons should be gone with the driver; end any that are not
    _kill({pid: start for pid, start in seen.items() if pid != proc.pid}, grace=10)
    from megatrain.memory.arena import remove_stale_segments

    remove_stale_segments()  # a megatrain run killed before its store unlinked the arena

    if result_file.exists() and not timed_out:
        data = json.loads(result_file.read_text())
        result = PeerResult(**{f.name: data[f.name] for f in fields(PeerResult) if f.name in data})
    elif STOP.is_set():  # the signal reached the peer's process group too: its exit code says only that
        result = PeerResult(peer, status=f"stopped by SIGTERM (log: {log_path})")
    elif timed_out:
        result = PeerResult(peer, status=f"timed out after {timeout:.0f} s (log: {log_path})")
    else:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        why = "killed by SIGKILL (host out of memory?)" if rc == -signal.SIGKILL else f"exit code {rc}"
        last = lines[-1][:120] if lines else ""
        result = PeerResult(peer, status=f"crashed, {why}: {last} (log: {log_path})")
    shutil.rmtree(result_file.parent, ignore_errors=True)
    result.host_rss_peak, result.host_used_peak = peaks.tree_rss, peaks.host_used
    return result


# ---- the report ----

def results_table(results: list[PeerResult]) -> str:
    base = next((r for r in results if r.peer == "megatrain" and r.tokens_per_s), None)
    headers = ["peer", "status", "tokens/s", "TFLOP/s", "step s", "GPU peak GiB", "host RSS GiB",
               "host used GiB", "last loss", "vs megatrain"]
    rows = []
    for r in results:
        tflops = fmt(r.tflops, ".2f" if (r.tflops or 0) >= 1 else ".2g")  # tiny models: keep two digits
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and r.tokens_per_s else "-"
        rows.append([LABELS.get(r.peer, r.peer), r.status, fmt(r.tokens_per_s, ",.0f"), tflops,
                     fmt(r.step_time, ".3f"), gib(r.gpu_peak), gib(r.host_rss_peak), gib(r.host_used_peak),
                     fmt(r.losses[-1] if r.losses else None, ".3f"), ratio])
    return format_table(headers, rows)


def stall_table(stats: dict[str, float]) -> str:
    step = stats["step_time"]
    rows = [[k, fmt(stats[k], ".4f"), fmt(100 * stats[k] / step if step else None, ".1f")]
            for k in ("compute", "wait_weights", "wait_optimizer", "wait_data", "other", "step_time")]
    pcie = (f"PCIe: H2D {stats['h2d_bytes'] / 1e9:.2f} GB/step at {stats['h2d_gbps']:.1f} GB/s, "
            f"D2H {stats['d2h_bytes'] / 1e9:.2f} GB/step at {stats['d2h_gbps']:.1f} GB/s; "
            f"stall fraction (mean of the steps' own) {stats['stall_fraction']:.3f}")
    if "overlap" in stats:
        pcie += f"; transfer time under compute {100 * stats['overlap']:.0f}%"
    return format_table(["part", "seconds", "% of step"], rows) + "\n\n" + pcie


# ---- megatrain's memory plan against what its row measured ----

PLAN_TOLERANCE = 0.10  # the bar: `megatrain plan` predicts a benchmark run's peak host and GPU memory within 10%


def plan_vs_measured(spec: BenchSpec, results: list[PeerResult]) -> list[dict[str, Any]] | None:
    """`megatrain plan`'s host and GPU totals for this shape against the megatrain row's measured peaks, one
    dict per tier (bytes, error in % of the measured value, whether it is within PLAN_TOLERANCE); None
    without a finished megatrain row.

    Host: the plan's total is the arena plus a resident size per process (Ray, store, workers, executor,
    data loader), so it is set against the tree RSS peak, which is built the same way: each process's own
    resident memory plus /dev/shm growth counted once. "host used" is machine-wide instead (anything else
    running, kernel page-locking) and is left out of the comparison. The benchmark has no data-loader
    actor, but its driver process (torch imported) stands where the plan counts one.
    GPU: max_memory_allocated() counts the tensors the plan itemises and nothing else, so the plan's CUDA
    context estimate (a constant no allocator counter sees) is taken off its total before comparing."""
    from megatrain.config import EngineConfig
    from megatrain.memory.plan import CUDA_CONTEXT, plan_run

    mt = next((r for r in results if r.peer == "megatrain" and r.status == "ok"), None)
    if mt is None:
        return None
    on_gpu = mt.device.startswith("cuda")
    # The run the engine started: where its gradients waited (it reports its choice; an engine that reports
    # none kept them all in the arena), the tiles and checkpoint budget its plan picked, and the bf16 copy of
    # the weights where the host had room for it; the engine's default loss chunk, as the megatrain peer runs it.
    try:
        plan = plan_run(spec.config, spec.batch // spec.executors, spec.seq, grads=mt.grads or "arena",
                        clipping=bool(spec.max_grad_norm), name=spec.model, precision=spec.precision,
                        optimizer_workers=spec.optimizer_workers, on_gpu=on_gpu,
                        loss_chunk_tokens=EngineConfig().loss_chunk_tokens, tile_tokens=mt.tile_tokens,
                        checkpoint_budget=mt.checkpoint_budget, find_longest=False, executors=spec.executors)
    except Exception as e:  # the plan's own failure must not cost the table and --out of a finished run
        print(f"memory plan vs measured: plan_run failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    tiers = [("host", "tree RSS peak", plan.host_total, mt.host_rss_peak)]
    if on_gpu:
        tiers.append(("GPU", "max_memory_allocated (plan less CUDA context)", plan.gpu_total - int(CUDA_CONTEXT),
                      mt.gpu_peak))
    else:  # the CPU path computes in host memory: the plan puts it in the host total
        tiers.append(("GPU", "n/a (CPU run)", None, None))
    rows = []
    for tier, measure, predicted, measured in tiers:
        error = 100 * (predicted - measured) / measured if predicted is not None and measured else None
        rows.append({"tier": tier, "measure": measure, "grads": mt.grads, "predicted": predicted,
                     "measured": measured, "error_pct": error,
                     "within_tolerance": None if error is None else abs(error) <= 100 * PLAN_TOLERANCE})
    return rows


def plan_table(checks: list[dict[str, Any]]) -> str:
    flag = {None: "n/a", True: "ok", False: f"OFF by more than {100 * PLAN_TOLERANCE:.0f}%"}
    rows = [[c["tier"], gib(c["predicted"], "n/a"), gib(c["measured"], "n/a"), fmt(c["error_pct"], "+.1f", "n/a"),
             flag[c["within_tolerance"]], c["measure"]] for c in checks]
    return format_table(["tier", "plan GiB", "measured GiB", "error %", "check", "measured as"], rows)


def report(meta: dict, results: list[PeerResult], checks: list[dict[str, Any]] | None = None) -> str:
    spec = meta["spec"]
    lines = [f"throughput: model {spec['model']} ({meta['params']:,} params), batch {spec['batch']} x seq "
             f"{spec['seq']}, {spec['precision']}, {spec['steps']} timed steps after {spec['warmup']} "
             f"warm-up, {spec['optimizer_workers']} megatrain optimizer workers, "
             f"clip {spec['max_grad_norm'] or 'off'}",
             f"machine: {meta['machine']}", f"date: {meta['date']}", "", results_table(results)]
    devices = [f"{LABELS.get(r.peer, r.peer)}: {r.device}" for r in results if r.device]
    if devices:
        lines += ["", "devices: " + "; ".join(devices)]
    mt = next((r for r in results if r.peer == "megatrain" and r.stats), None)
    if mt:
        lines += ["", f"megatrain stall breakdown (mean of {spec['steps']} timed steps, StepResult.stats):",
                  stall_table(mt.stats)]
    if checks:
        grads = f", grads = {checks[0]['grads']}" if checks[0].get("grads") else ""
        lines += ["", f"memory plan vs measured (megatrain row; `megatrain plan` for this shape{grads}, flagged "
                      f"when off by more than {100 * PLAN_TOLERANCE:.0f}%):", plan_table(checks)]
    return "\n".join(lines)


def merge(paths: list[str]) -> tuple[dict, list[PeerResult]]:
    """Results of several --out files of one shape; a later file's row for a peer replaces an earlier one."""
    meta, by_peer = None, {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        shape = {k: data["meta"]["spec"][k] for k in ("model", "batch", "seq", "precision")}
        if meta is None:
            meta, first_shape = data["meta"], shape
        elif shape != first_shape:
            raise SystemExit(f"{path} measured {shape}, not {first_shape}: merge runs of one shape only.")
        for r in data["results"]:
            by_peer[r["peer"]] = PeerResult(**{f.name: r[f.name] for f in fields(PeerResult) if f.name in r})
    order = [p for p in PEERS if p in by_peer] + [p for p in by_peer if p not in PEERS]
    return meta, [by_peer[p] for p in order]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="megatrain preset name (tiny, 125m, 1b, 2.8b, 7b, ...)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="tf32")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per peer")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    ap.add_argument("--optimizer-workers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping for every peer; 0: off")
    ap.add_argument("--object-store-mb", type=int, default=256, help="Ray object store of the megatrain peer")
    ap.add_argument("--grads", default="auto", choices=("auto", "arena", "stream", "device"),
                    help="megatrain: where gradients wait for the optimizer (to compare the placements)")
    ap.add_argument("--compile", action="store_true", help="megatrain: torch.compile the decoder layer")
    ap.add_argument("--executors", type=int, default=1, help="megatrain: data-parallel executors, one per GPU "
                    "(--batch is the step's rows, split among them)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per peer before it is killed")
    ap.add_argument("--log-dir", help="where each peer's log goes (default: a new temporary directory)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print earlier --out files' table")
    # the child side of run_in_subprocess
    ap.add_argument("--run-peer", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_peer:  # child: run one peer, leave its result for the parent
        result = run_peer(args.run_peer, BenchSpec(**json.loads(args.spec)))
        Path(args.result_file).write_text(json.dumps(asdict(result)))
        return 0
    if args.table:
        meta, results = merge(args.table)
        print(report(meta, results, plan_vs_measured(BenchSpec(**meta["spec"]), results)))
        return 0

    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}.")
    spec = BenchSpec(model=args.model, batch=args.batch, seq=args.seq, precision=args.precision,
                     steps=args.steps, warmup=args.warmup, optimizer_workers=args.optimizer_workers,
                     lr=args.lr, max_grad_norm=args.max_grad_norm, object_store_mb=args.object_store_mb,
                     grads=args.grads, compile=args.compile, executors=args.executors)
    if args.executors < 1 or args.batch % args.executors:
        raise SystemExit(f"--batch {args.batch} must split evenly among --executors {args.executors}.")
    meta = {"date": datetime.date.today().isoformat(), "machine": machine_summary(), "spec": asdict(spec),
            "params": spec.config.num_params()}  # an unknown preset fails here, before anything starts
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mtbench-throughput-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"peer logs in {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())
    results = []
    for peer in peers:
        if STOP.is_set():
            results.append(PeerResult(peer, status="not run: stopped by SIGTERM"))
            continue
        t0 = time.perf_counter()
        print(f"running {peer} ...", flush=True)
        results.append(run_in_subprocess(peer, spec, log_dir, args.timeout))
        print(f"  {peer}: {results[-1].status} ({time.perf_counter() - t0:.0f} s)", flush=True)
    checks = plan_vs_measured(spec, results)
    print()
    print(report(meta, results, checks))
    if args.out:
        out = {"meta": meta, "results": [asdict(r) for r in results], "memory_plan": checks}
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
