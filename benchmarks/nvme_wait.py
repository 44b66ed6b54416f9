"""The next forward's wait on a speculated unit's gradient disk write, measured.

    python3 benchmarks/nvme_wait.py --nvme DIR --model 125m --steps 4 --out wait.json

Where the held gradients are on NVMe, a unit updated beside the backward writes its gradient to disk (it may be read
back by a rollback) and its version is published only once that write is done and its range punched out, so the
next step's gradient never lands under it: the next forward, which waits for each unit's version before loading it,
may wait for the disk too. Two runs of the model (fp32, 2 optimizer workers, the update beside the backward,
clipping on at a norm no step reaches, so every speculated update stands) with the Adam moments on DIR, the held
gradients in host memory in one and on DIR in the other: each step's compute idle waiting for the optimizer
(StepStats.wait_optimizer) and the executor's waits on the optimizer per unit (its trace's wait spans), steps after
the first (whose forward waits for nothing). Their difference is the gradients' writes' share of the stall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run(config: object, states: str, nvme: Path, seq: int, steps: int) -> dict:
    """Each step's wait for the optimizer: the accounted stall, and the executor's waits per unit (seconds)."""
    import torch

    import megatrain
    from megatrain.telemetry.recorder import WAIT_LANE

    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    stalls, per_unit, times, updates = [], [], [], []
    with megatrain.Engine(config, precision="fp32", device="cpu", optimizer_workers=2, batch_size=1, seq_len=seq,
                          max_grad_norm=1e9, speculate="on", nvme=str(nvme), nvme_states=states,
                          metrics=False, trace=True) as engine:
        for _ in range(steps):
            result = engine.step_batch(engine_batch(ids))
            stalls.append(result.stats["wait_optimizer"])
            times.append(result.stats["step_time"])
            updates.append(result.update)
            waits: dict[int, float] = {}
            for s in result.spans:  # the executor's (tracing): the lanes are named per executor with several
                if s.lane.startswith(WAIT_LANE) and s.name == "optimizer":
                    waits[s.layer] = waits.get(s.layer, 0.0) + s.duration
            per_unit.append(waits)
        engine.wait_for_updates()
    later = stalls[1:] or stalls
    return {"nvme_states": states, "wait_optimizer_s": stalls, "step_s": times, "updates": updates,
            "waits_per_unit_s": [{str(k): v for k, v in sorted(w.items())} for w in per_unit],
            "mean_wait_s": statistics.mean(later), "median_wait_s": statistics.median(later),
            "mean_step_s": statistics.mean(times[1:] or times)}


def engine_batch(ids: object) -> object:
    from pipelines.logprobs import batch_of

    return batch_of(ids, ids.clone())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme", required=True, type=Path, help="a directory on the disk (ext4, xfs, ...)")
    p.add_argument("--model", default="125m", help="a preset, or 162m (benchmarks/nvme_run.py)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = p.parse_args(argv)
    from benchmarks.nvme_run import model_config

    config = model_config(args.model)
    out: dict = {"model": args.model, "params": config.num_params(), "load_1min_at_start": os.getloadavg()[0],
                 "runs": []}
    for states in ("moments", "moments,grads"):
        r = run(config, states, args.nvme, args.seq, args.steps)
        out["runs"].append(r)
        units: dict[str, float] = {}
        for w in r["waits_per_unit_s"][1:]:
            for k, v in w.items():
                units[k] = units.get(k, 0.0) + v / max(1, args.steps - 1)
        most = sorted(units.items(), key=lambda kv: -kv[1])[:3]
        print(f"{args.model} nvme_states={states}: the forward's wait for the optimizer, steps 2-{args.steps}: mean "
              f"{r['mean_wait_s']:.3f} s, median {r['median_wait_s']:.3f} s (each: "
              f"{', '.join(f'{x:.3f}' for x in r['wait_optimizer_s'][1:])}; the executor's waits a step on the units "
              f"most waited for: {', '.join(f'unit {k} {v:.3f} s' for k, v in most) or 'none'}); step "
              f"{r['mean_step_s']:.2f} s; updates {r['updates']}")
    held, tiered = out["runs"]
    out["added_wait_s"] = tiered["mean_wait_s"] - held["mean_wait_s"]
    out["load_1min_at_end"] = os.getloadavg()[0]
    print(f"the held gradients' disk writes add {out['added_wait_s']:.3f} s a step of waiting (mean)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
