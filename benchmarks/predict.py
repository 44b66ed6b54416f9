"""Predicted against measured step time on the CPU path: three model sizes, two numbers of micro-batches.

    python3 benchmarks/predict.py --steps 6 --warmup 5 --out predict.json

For each model: calibrate this machine for its layer shape (megatrain.perf.calibrate.calibrate, into a file of
this run's own, not the user's cache), then for each K an Engine on the CPU (clipping on, grads in the arena,
the default optimizer workers): --warmup untimed steps, then --steps timed ones (the median is the measured
step; the driver's wall clock around Engine.step, as the train loop's progress bar times it). The prediction
is predict() of the Engine's own memory plan, with its speculate setting and, as the share of steps that clip, what
the timed steps' own gradient norms say (the model takes that as an assumption: here it is known). Rows more than
--tolerance off (|predicted / measured - 1|) are flagged. Not a test: it times things, and the cores are shared with
whatever else runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, format_table, machine_summary, pythonpath_with_repo

# (name, preset or config fields, batch rows per micro-batch, seq)
MODELS: list[tuple[str, str | dict, int, int]] = [
    ("tiny", "tiny", 8, 128),
    ("20m", dict(vocab_size=8192, hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024), 2, 256),
    ("50m", dict(vocab_size=16384, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1408), 2, 256),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(m[0] for m in MODELS))
    p.add_argument("--ks", default="1,4", help="micro-batches per step, comma-separated")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=5)  # fewer: the 50m steps are still falling
    p.add_argument("--optimizer-workers", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--out", help="JSON of the rows")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["PYTHONPATH"] = pythonpath_with_repo()
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    import numpy as np
    import ray

    from megatrain.config import ModelConfig
    from megatrain.memory.plan import plan_run
    from megatrain.perf.calibrate import Calibration, calibrate
    from megatrain.perf.predict import predict
    from pipelines.engine import Engine

    cache = Path(tempfile.mkdtemp(prefix="megatrain-predict-")) / "calibration.json"
    ks = [int(k) for k in args.ks.split(",")]
    wanted = args.models.split(",")
    rows, records = [], []
    cal: Calibration | None = None
    for name, spec, batch, seq in (m for m in MODELS if m[0] in wanted):
        config = ModelConfig.from_name(spec) if isinstance(spec, str) else ModelConfig(**spec)
        t0 = time.monotonic()
        cal = calibrate("cpu", config, batch=batch, seq=seq, precision="fp32", base=cal)
        cal.save(cache)
        print(f"calibrated {name} in {time.monotonic() - t0:.0f} s", flush=True)
        for k in ks:
            engine = Engine(config, optimizer_workers=args.optimizer_workers, precision="fp32", device="cpu",
                            batch_size=batch * k, seq_len=seq, micro_batches=k, metrics=False, address="local")
            try:
                e = engine.engine_config
                plan = plan_run(config, batch, seq, grads=e.grads, clipping=engine.optim.clipping, precision="fp32",
                                optimizer_workers=args.optimizer_workers, micro_batches=k, schedule=e.schedule,
                                tile_tokens=e.tile_tokens, checkpoint_budget=None, find_longest=False)
                rng = np.random.default_rng(0)
                times, stats, clipped = [], [], []
                for step in range(args.warmup + args.steps):
                    ids = rng.integers(0, config.vocab_size, (batch * k, seq))
                    t = time.monotonic()
                    result = engine.step_batch({"input_ids": ids})
                    if step >= args.warmup:
                        times.append(time.monotonic() - t)
                        stats.append(result.stats or {})
                        clipped.append(engine.optim.clipping and result.grad_norm > engine.optim.max_grad_norm)
                clip_rate = sum(clipped) / len(clipped)
                pred = predict(plan, config, cal, precision="fp32", optimizer_workers=args.optimizer_workers,
                               clipping=engine.optim.clipping, speculate=e.speculate, clip_rate=clip_rate)
            finally:
                engine.shutdown()
            measured = statistics.median(times)
            ratio = pred.step_s / measured
            flag = "" if abs(ratio - 1) <= args.tolerance else f"OFF >{100 * args.tolerance:.0f}%"
            rows.append([name, str(k), f"{config.num_params() / 1e6:.1f} M", f"{plan.step_tokens}",
                         fmt(1e3 * pred.compute_s), fmt(1e3 * pred.optimizer_s), fmt(1e3 * pred.step_s),
                         fmt(1e3 * measured), fmt(ratio, ".2f"), fmt(clip_rate, ".2f"), pred.bound, flag])
            records.append({"model": name, "k": k, "params": config.num_params(), "tokens": plan.step_tokens,
                            "prediction": pred.to_dict(), "measured_step_s": measured, "step_times": times,
                            "ratio": ratio, "stats": stats})
            print(format_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
        ray.shutdown()
    print()
    print(machine_summary())
    print(f"{datetime.date.today()}, steps {args.warmup} warm-up + {args.steps} timed (median), fp32, clipping on, "
          f"{args.optimizer_workers} optimizer workers")
    print(format_table(HEADERS, rows))
    off = sum(1 for r in rows if r[-1])
    print(f"{len(rows) - off} of {len(rows)} within {100 * args.tolerance:.0f}%")
    if args.out:
        Path(args.out).write_text(json.dumps({"calibration": json.loads(cache.read_text()), "rows": records},
                                             indent=2))
    return 0


HEADERS = ["model", "K", "params", "tokens", "compute ms", "optim ms", "predicted ms", "measured ms", "pred/meas",
           "clipped", "bound", ""]

if __name__ == "__main__":
    sys.exit(main())
