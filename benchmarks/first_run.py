"""Predicted against measured step on a newcomer's first runs, through the CLI as they run it (not a test: it times).

    python3 benchmarks/first_run.py --out first_run.json

In a calibration file of its own (MEGATRAIN_CALIBRATION, not the user's cache): `megatrain calibrate` (the default
run's layers and a step's fixed costs through Ray, pipelines/step_costs.py), then `megatrain calibrate --model M
--no-step-costs` for each other run's layers (the fixed costs stay the ones measured once, on the probe models).
Then each run with `megatrain train`, and from its steps.jsonl the median measured step from step 10 on beside the
median of each step's own predicted case (prediction.json: speculated, rolled back or serial, as the progress line
predicts it), and whether the progress line printed `pred s`:
  default    `megatrain train` as it comes (the tiny preset, 8 x 256)
  held-out   a shape calibrated on nowhere else (3 layers of width 96, 4 x 128 tokens), its layers timed
  125m       the 125m preset at 2 x 256
  untimed    the held-out shape at 2 x 96, its layers never timed: the progress line leaves `pred s` out
The cores are shared with whatever else runs on the machine: a loaded machine measures its load, and the
calibration measured it at other moments than the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, format_table, machine_summary, pythonpath_with_repo

HELD_OUT = dict(vocab_size=260, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=2, intermediate_size=256)
# (name, model ("held-out": the HELD_OUT directory), batch, seq, steps, whether its layers are calibrated)
RUNS = [("default", None, None, None, 60, True), ("held-out", "held-out", 4, 128, 60, True),
        ("125m", "125m", 2, 256, 25, True), ("untimed", "held-out", 2, 96, 30, False)]
FROM_STEP = 10


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"megatrain {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out


def held_out_model(directory: Path) -> Path:
    import megatrain
    from megatrain.config import ModelConfig

    with megatrain.from_pretrained(ModelConfig(**HELD_OUT)) as model:
        model.save_pretrained(directory)
    return directory


def measured_and_predicted(run_dir: Path) -> tuple[float, float | None, list[float]]:
    """(median step from FROM_STEP on, median of each step's own predicted case or None, the steps' times)."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()][FROM_STEP:]
    times = [s["step_time"] for s in steps]
    path = run_dir / "prediction.json"
    if not path.exists():
        return statistics.median(times), None, times
    cases = json.loads(path.read_text())["cases"]
    return statistics.median(times), statistics.median(cases[s["update"]]["step_s"] for s in steps), times


def train(name: str, model: str | None, batch: int | None, seq: int | None, steps: int, work: Path,
          env: dict[str, str]) -> dict:
    args = ["train", "--steps", str(steps), "--out", str(work / name), "--no-save-final", "--checkpoint-every", "0"]
    args += ["--model", model] if model else []
    args += ["--batch-size", str(batch), "--seq-len", str(seq)] if batch else []
    t0 = time.monotonic()
    out = cli(args, env)
    measured, predicted, times = measured_and_predicted(work / name)
    return {"run": name, "command": "megatrain " + " ".join(args), "measured_s": measured, "predicted_s": predicted,
            "pred_s_shown": " pred s " in out.stderr + out.stdout, "step_times": times,
            "wall_s": time.monotonic() - t0, "log": [line for line in out.stderr.splitlines() if "predict" in line]}


def calibrate(runs: list[tuple], held_out: Path, env: dict[str, str]) -> list[str]:
    commands = [["calibrate"]]  # the default run's layers, and the step's fixed costs
    for _, model, batch, seq, _, timed in runs:
        if model and timed:
            commands.append(["calibrate", "--model", str(held_out) if model == "held-out" else model, "--batch",
                             str(batch), "--seq", str(seq), "--no-step-costs"])
    for command in commands:
        print(cli(command, env).stdout.strip(), flush=True)
    return ["megatrain " + " ".join(c) for c in commands]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=",".join(r[0] for r in RUNS))
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--out", help="JSON of the rows")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="megatrain-first-run-"))
    try:
        return measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the runs and their calibration: --out keeps what counts


def measure(args: argparse.Namespace, work: Path) -> int:
    env = dict(os.environ, PYTHONPATH=pythonpath_with_repo(), MEGATRAIN_CALIBRATION=str(work / "calibration.json"))
    runs = [r for r in RUNS if r[0] in args.runs.split(",")]
    held_out = held_out_model(work / "held-out-model")
    commands = calibrate(runs, held_out, env)
    rows, records = [], []
    for name, model, batch, seq, steps, _ in runs:
        record = train(name, str(held_out) if model == "held-out" else model, batch, seq, steps, work, env)
        records.append(record)
        rows.append(row(record, args.tolerance))
        print(format_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(machine_summary())
    print("calibrated with: " + "; ".join(commands))
    print(format_table(HEADERS, rows))
    if args.out:
        cal = json.loads((work / "calibration.json").read_text())
        Path(args.out).write_text(json.dumps({"calibration": cal, "calibrate": commands, "runs": records}, indent=2))
    return 0


def row(r: dict, tolerance: float) -> list[str]:
    ratio = None if r["predicted_s"] is None else r["predicted_s"] / r["measured_s"]
    verdict = ("no pred s printed" if not r["pred_s_shown"] else
               "within" if ratio is not None and abs(ratio - 1) <= tolerance else f"OFF >{100 * tolerance:.0f}%")
    return [r["run"], fmt(1e3 * r["measured_s"]), "-" if ratio is None else fmt(1e3 * r["predicted_s"]),
            "-" if ratio is None else fmt(ratio, ".2f"), "yes" if r["pred_s_shown"] else "no", verdict]


HEADERS = ["run", f"measured ms (median from step {FROM_STEP})", "predicted ms", "pred/meas", "pred s shown", ""]

if __name__ == "__main__":
    sys.exit(main())
