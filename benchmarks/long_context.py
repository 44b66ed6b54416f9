"""Long-context training: megatrain at the longest sequence its memory plan allows, beside FSDP2 CPU offload.

    python3 benchmarks/long_context.py --model 1b --precision bf16 --seq auto --max-seq 524288 \\
        --fsdp-seqs 32768,65536,131072 --peers megatrain,fsdp2 --out long-1b.json

Rows, one training run each, batch 1 (`--batch`), in a process of its own (throughput.py's
run_in_subprocess: its own GPU memory, host memory sampled over its process tree, a crash or an
out-of-memory costs one row):

  megatrain  megatrain.Engine at `--seq`; `--seq auto` (the default) is the longest sequence `megatrain plan`
             allows on this machine (the GPU's free memory, measured in a throwaway process, and the host's
             available memory), capped at `--max-seq` and rounded down to a multiple of 1024. Tile size and
             device budget of the activation checkpoints are left to the plan ("auto") unless given; the row shows
             what it picked and how many GiB of checkpoints went to host memory.
  fsdp2      the HF model under FSDP2 `fully_shard` with CPUOffloadPolicy, activation checkpointing and, for
             --precision bf16, bf16 autocast over fp32 weights (benchmarks/peers.py), at each of `--fsdp-seqs`.

Both keep fp32 master weights and AdamW states in host memory and compute in bf16 (--precision bf16). What is
timed: `--steps` steps (default 1) after `--warmup` untimed ones for megatrain (default 0: at half a million
tokens one step takes minutes; the timed first step then also holds one-off costs such as first-touch page
faults of the optimizer states, seconds beside it) and `--fsdp-warmup` for FSDP2 (default 1: its steps take
seconds and its first one holds FSDP2's lazy initialisation). TFLOP/s counts attention
(ModelConfig.flops_per_token at the row's sequence: 6 N plus 12 x layers x hidden x seq per token).

Without CUDA, megatrain runs on the CPU (its plan then bounds the sequence by host memory alone: cap it with
--max-seq) and FSDP2 rows say "needs CUDA". `--table a.json b.json` prints earlier --out files as one table
(e.g. megatrain and FSDP2 rows run in separate commands to stay inside a time limit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, GiB, fmt, format_table, gib, machine_summary, pythonpath_with_repo
from benchmarks.peers import LABELS, BenchSpec, PeerResult
from benchmarks.throughput import STOP, plan_table, plan_vs_measured, run_in_subprocess

LONG_PEERS = ("megatrain", "fsdp2")
SEQ_UNIT = 1024  # --seq auto rounds down to this


# ---- megatrain's sequence ----

def measure_gpu_free() -> int | None:
    """The free bytes of this machine's GPU, measured in a throwaway process: a CUDA context in this one would
    hold GPU memory for as long as the rows run. None without CUDA; where CUDA is there but the measurement
    fails, the run stops: a plan without the GPU's size would pick a sequence the GPU cannot hold."""
    import torch

    if not torch.cuda.is_available():  # asks the driver for a device count; creates no context
        return None
    code = "from megatrain.memory.plan import gpu_free_here; print(gpu_free_here())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": pythonpath_with_repo()})
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"could not measure the GPU's free memory ({proc.stderr.strip()[-500:]}); "
                         "give megatrain's sequence length with --seq N.") from None


def checkpoint_budget_bytes(gib_value: float | None | str) -> int | None | str:
    """EngineConfig's checkpoint_budget_gib as plan_run takes it (bytes, or "auto" / None as they are)."""
    return gib_value if gib_value in ("auto", None) else round(float(gib_value) * GiB)


def plan_longest(spec: BenchSpec, gpu_free: int | None) -> int:
    """The longest sequence at spec.batch whose memory plan fits this machine, for the run the Engine would
    start: gradients placed as it would (resolve_grads; at the longest sequence the GPU has no room to keep them
    all, so "auto" is planned as the arena, or the host ring without clipping), the spec's tile size and
    checkpoint budget (or the plan's picks), its loss chunk and optimizer workers."""
    from megatrain.config import EngineConfig
    from megatrain.memory.plan import longest_seq, resolve_grads

    grads = resolve_grads(spec.grads, clipping=bool(spec.max_grad_norm))
    return longest_seq(spec.config, spec.batch, grads=grads, tile_tokens=spec.tile_tokens,
                       checkpoint_budget=checkpoint_budget_bytes(spec.checkpoint_budget_gib), name=spec.model,
                       precision=spec.precision, optimizer_workers=spec.optimizer_workers,
                       on_gpu=gpu_free is not None, gpu_free=gpu_free, host_free=None,
                       loss_chunk_tokens=EngineConfig().loss_chunk_tokens)


def pick_seq(longest: int, max_seq: int | None) -> int:
    """The plan's longest, capped at max_seq, rounded down to a multiple of SEQ_UNIT (where it is that long)."""
    seq = longest if max_seq is None else min(longest, max_seq)
    return seq // SEQ_UNIT * SEQ_UNIT if seq >= SEQ_UNIT else seq


# ---- the report ----

def results_table(runs: list[tuple[BenchSpec, PeerResult]]) -> str:
    headers = ["peer", "seq", "status", "tokens/s", "TFLOP/s", "step s", "GPU peak GiB", "host RSS GiB", "tile",
               "ckpt budget GiB", "offloaded GiB"]
    rows = []
    for spec, r in runs:
        tflops = fmt(r.tflops, ".2f" if (r.tflops or 0) >= 1 else ".2g")  # tiny models: keep two digits
        tile = budget = "-"
        if r.peer == "megatrain" and r.status == "ok":  # what its plan picked ("all": every checkpoint kept)
            tile = "whole" if r.tile_tokens is None else str(r.tile_tokens)
            budget = "all" if r.checkpoint_budget is None else gib(r.checkpoint_budget)
        rows.append([LABELS.get(r.peer, r.peer), f"{spec.seq:,}", r.status, fmt(r.tokens_per_s, ",.0f"), tflops,
                     fmt(r.step_time, ".2f"), gib(r.gpu_peak), gib(r.host_rss_peak), tile, budget,
                     gib(r.host_checkpoints)])
    return format_table(headers, rows)


def report(meta: dict[str, Any], runs: list[tuple[BenchSpec, PeerResult]]) -> str:
    lines = [f"long context: model {meta['model']} ({meta['params']:,} params), {meta['precision']}, "
             f"batch {meta['batch']}; fp32 master weights and AdamW states in host memory",
             f"machine: {meta['machine']}", f"date: {meta['date']}"]
    if meta.get("plan_longest") is not None:
        free = f"{meta['gpu_free'] / GiB:.1f} GiB GPU free" if meta.get("gpu_free") else "no GPU"
        lines.append(f"megatrain's sequence: --seq auto, the plan's longest here {meta['plan_longest']:,} tokens "
                     f"({free}), capped at --max-seq {meta['max_seq'] or 'none'}")
    timed = dict.fromkeys((LABELS.get(r.peer, r.peer), s.warmup, s.steps) for s, r in runs)  # in row order
    lines.append("timed: " + "; ".join(f"{p}: {n} step(s) after {w} untimed" for p, w, n in timed)
                 + "; TFLOP/s counts attention (6 N + 12 x layers x hidden x seq per token)")
    lines += ["", results_table(runs)]
    devices = sorted({f"{LABELS.get(r.peer, r.peer)}: {r.device}" for _, r in runs if r.device})
    if devices:
        lines += ["", "devices: " + "; ".join(devices)]
    for spec, r in runs:  # megatrain's plan for the run it made, against its measured peaks
        checks = plan_vs_measured(spec, [r]) if r.peer == "megatrain" else None
        if checks:
            lines += ["", f"memory plan vs measured, megatrain at {spec.seq:,} tokens (grads = {checks[0]['grads']}):",
                      plan_table(checks)]
    return "\n".join(lines)


def merge(paths: list[str]) -> tuple[dict[str, Any], list[tuple[BenchSpec, PeerResult]]]:
    """The runs of several --out files of one model and precision, in the order given."""
    meta, runs = None, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        shape = {k: data["meta"][k] for k in ("model", "precision", "batch")}
        if meta is None:
            meta, first = data["meta"], shape
        elif shape != first:
            raise SystemExit(f"{path} measured {shape}, not {first}: merge runs of one model and precision only.")
        elif data["meta"].get("plan_longest") is not None:  # the file with megatrain's auto sequence says it
            meta = {**meta, **{k: data["meta"][k] for k in ("plan_longest", "gpu_free", "max_seq")}}
        runs += [(BenchSpec(**run["spec"]), load_result(run["result"])) for run in data["runs"]]
    assert meta is not None
    return meta, runs


def load_result(data: dict[str, Any]) -> PeerResult:
    return PeerResult(**{f.name: data[f.name] for f in fields(PeerResult) if f.name in data})


# ---- the command ----

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="megatrain preset name (tiny, 1b, 7b, ...)")
    ap.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", default="auto", help="megatrain's sequence length, or auto: the plan's longest here")
    ap.add_argument("--max-seq", type=int, help="--seq auto goes no longer than this")
    ap.add_argument("--fsdp-seqs", default="32768,65536,131072", help="FSDP2's sequence lengths, comma-separated")
    ap.add_argument("--peers", default=",".join(LONG_PEERS), help=f"comma-separated subset of {','.join(LONG_PEERS)}")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=0, help="megatrain: untimed steps before them")
    ap.add_argument("--fsdp-warmup", type=int, default=1, help="FSDP2: untimed steps before them")
    ap.add_argument("--tile-tokens", default="auto", help="megatrain: auto, none, or tokens per tile")
    ap.add_argument("--checkpoint-budget-gib", default="auto",
                    help="megatrain: auto, none (every activation checkpoint on the device), or GiB of them kept there")
    ap.add_argument("--optimizer-workers", type=int, default=8)
    ap.add_argument("--object-store-mb", type=int, default=256, help="Ray object store of the megatrain peer")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row before its run is killed")
    ap.add_argument("--log-dir", help="where each row's log goes (default: a new temporary directory)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print earlier --out files' table")
    return ap.parse_args(argv)


def _auto_none_or(value: str, kind: type) -> Any:
    return value if value == "auto" else None if value.lower() == "none" else kind(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(report(*merge(args.table)))
        return 0
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in LONG_PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(LONG_PEERS)}.")
    base = BenchSpec(model=args.model, batch=args.batch, seq=0, precision=args.precision, steps=args.steps,
                     warmup=args.warmup, optimizer_workers=args.optimizer_workers,
                     object_store_mb=args.object_store_mb, tile_tokens=_auto_none_or(args.tile_tokens, int),
                     checkpoint_budget_gib=_auto_none_or(args.checkpoint_budget_gib, float))
    meta: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine_summary(),
                            "model": args.model, "precision": args.precision, "batch": args.batch,
                            "params": base.config.num_params(),  # an unknown preset fails here, before any run
                            "plan_longest": None, "gpu_free": None, "max_seq": args.max_seq}
    specs: list[tuple[str, BenchSpec]] = []
    if "megatrain" in peers:
        if args.seq == "auto":
            meta["gpu_free"] = measure_gpu_free()
            meta["plan_longest"] = plan_longest(base, meta["gpu_free"])
            seq = pick_seq(meta["plan_longest"], args.max_seq)
        else:
            seq = int(args.seq)
        specs.append(("megatrain", BenchSpec(**{**asdict(base), "seq": seq})))
    if "fsdp2" in peers:
        specs += [("fsdp2", BenchSpec(**{**asdict(base), "seq": int(s), "warmup": args.fsdp_warmup}))
                  for s in args.fsdp_seqs.split(",") if s.strip()]

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mtbench-long-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"run logs in {log_dir}", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: STOP.set())  # see throughput.py: the table still prints
    runs: list[tuple[BenchSpec, PeerResult]] = []
    for peer, spec in specs:
        if STOP.is_set():
            runs.append((spec, PeerResult(peer, status="not run: stopped by SIGTERM")))
            continue
        if spec.seq <= 0:  # --seq auto found no length that fits
            runs.append((spec, PeerResult(peer, status="does not fit: the plan fits no sequence here")))
            continue
        t0 = time.perf_counter()
        print(f"running {peer} at {spec.seq:,} tokens ...", flush=True)
        result = run_in_subprocess(peer, spec, log_dir, args.timeout, log_name=f"{peer}-{spec.seq}")
        runs.append((spec, result))
        print(f"  {peer} at {spec.seq:,}: {result.status} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    print(report(meta, runs))
    if args.out:
        out = {"meta": meta, "runs": [{"spec": asdict(s), "result": asdict(r)} for s, r in runs]}
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
