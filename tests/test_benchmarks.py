"""CPU smoke tests of benchmarks/: each script runs as users run it, prints its table, and leaves nothing in
shared memory. Nothing here asserts a time or a rate: on a CI machine those numbers mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatrain.memory.arena import list_segments

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is no installed package (`python3 -m pytest` finds it anyway)
    sys.path.insert(0, str(REPO))
CUDA = torch.cuda.is_available()


def run_script(script: str, args: list[str], shm_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGATRAIN_SHM_DIR": str(shm_dir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def reprinted(script: str, table_file: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What `SCRIPT --table FILE` prints: that mode only reads the JSON and prints it, so it runs in this process
    (no Python start and imports of its own)."""
    import importlib

    capsys.readouterr()
    assert importlib.import_module(f"benchmarks.{script}").main(["--table", str(table_file)]) == 0
    return capsys.readouterr().out


def table(stdout: str, first_header: str) -> tuple[list[str], dict[str, list[str]]]:
    """The table whose header line starts with `first_header`: (header cells, first cell -> row cells)."""
    headers, rows = table_rows(stdout, first_header)
    return headers, {row[0]: row for row in rows}


def table_rows(stdout: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """The table whose header line starts with `first_header`: (header cells, each row's cells in order)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines[:-1])
                 if line.startswith(first_header + " ") and lines[i + 1].startswith("-"))
    rule = lines[start + 1]
    cuts, pos = [], 0  # column spans come from the dashed rule under the header
    for dashes in rule.split("  "):
        cuts.append((pos, pos + len(dashes)))
        pos += len(dashes) + 2

    def cells(line: str) -> list[str]:
        return [line[a:b].strip() for a, b in cuts]

    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(cells(line))
    return cells(lines[start]), rows


def is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x"))
        return True
    except ValueError:
        return False


def test_throughput_tiny_table(shm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    args = ["--model", "tiny", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
            "--optimizer-workers", "1", "--object-store-mb", "100", "--timeout", "240", "--out", str(out),
            "--log-dir", str(tmp_path / "logs")]
    proc = run_script("throughput.py", args, shm_dir)
    headers, rows = table(proc.stdout, "peer")
    assert headers == ["peer", "status", "tokens/s", "TFLOP/s", "step s", "GPU peak GiB", "host RSS GiB",
                       "host used GiB", "last loss", "vs megatrain"]
    assert list(rows) == ["megatrain", "GPU-resident PyTorch", "FSDP2 CPU offload",
                          "DeepSpeed ZeRO-3 offload"]
    col = {h: i for i, h in enumerate(headers)}
    for peer in ("megatrain", "GPU-resident PyTorch"):
        row = rows[peer]
        assert row[col["status"]] == "ok", proc.stdout
        for name in ("tokens/s", "TFLOP/s", "step s", "host RSS GiB", "last loss", "vs megatrain"):
            assert is_number(row[col[name]]), (peer, name, row)
    assert rows["megatrain"][col["vs megatrain"]] == "1.00x"
    if not CUDA:  # the offload peers have nothing to offload from
        for peer in ("FSDP2 CPU offload", "DeepSpeed ZeRO-3 offload"):
            assert rows[peer][col["status"]] == "needs CUDA"
            assert rows[peer][col["tokens/s"]] == "-"

    _, stall = table(proc.stdout, "part")
    assert list(stall) == ["compute", "wait_weights", "wait_optimizer", "wait_data", "other", "step_time"]
    assert "PCIe: H2D" in proc.stdout and "D2H" in proc.stdout

    data = json.loads(out.read_text())
    assert data["meta"]["spec"]["model"] == "tiny"
    assert [r["peer"] for r in data["results"]] == ["megatrain", "resident", "fsdp2", "deepspeed"]
    stats = data["results"][0]["stats"]
    assert {"step_time", "compute", "wait_weights", "wait_optimizer", "wait_data", "other", "h2d_bytes",
            "d2h_bytes", "h2d_gbps", "d2h_gbps", "stall_fraction"} <= set(stats)
    assert len(data["results"][0]["losses"]) == 3  # warm-up + timed steps
    assert list_segments(shm_dir) == []  # the engine's arena is gone

    # megatrain's memory plan against its measured peaks: computed and printed (no bar on CPU numbers)
    assert "memory plan vs measured" in proc.stdout
    plan_headers, plan_rows = table(proc.stdout, "tier")
    assert plan_headers == ["tier", "plan GiB", "measured GiB", "error %", "check", "measured as"]
    assert list(plan_rows) == ["host", "GPU"]
    assert all(is_number(c) for c in plan_rows["host"][1:4]), plan_rows["host"]
    assert plan_rows["host"][-1] == "tree RSS peak"
    checks = {c["tier"]: c for c in data["memory_plan"]}
    host = checks["host"]
    assert host["measured"] == data["results"][0]["host_rss_peak"] > 0 and host["predicted"] > 0
    assert host["error_pct"] == pytest.approx(100 * (host["predicted"] - host["measured"]) / host["measured"])
    if not CUDA:
        assert plan_rows["GPU"][1:5] == ["n/a"] * 4
        assert checks["GPU"]["predicted"] is None and checks["GPU"]["within_tolerance"] is None

    merged = reprinted("throughput", out, capsys)  # the merge mode reprints it
    assert list(table(merged, "peer")[1]) == list(rows)
    assert table(merged, "tier")[1] == plan_rows


def test_plan_vs_measured_compares_like_with_like() -> None:
    """On a (pretended) GPU row the plan's CUDA context leaves its total before it meets
    max_memory_allocated; a row more than 10% off is flagged. No GPU needed: the numbers are made up."""
    from benchmarks.peers import BenchSpec, PeerResult
    from benchmarks.throughput import plan_table, plan_vs_measured
    from megatrain.memory.plan import CUDA_CONTEXT, plan_run

    spec = BenchSpec(model="tiny", batch=2, seq=32, precision="tf32", steps=1, warmup=0, optimizer_workers=2)
    plan = plan_run(spec.config, 2, 32, grads="arena", name="tiny", optimizer_workers=2, on_gpu=True)
    tensors = plan.gpu_total - int(CUDA_CONTEXT)
    row = PeerResult("megatrain", device="cuda:0 (made up)", gpu_peak=tensors, host_rss_peak=2 * plan.host_total)
    assert plan_vs_measured(spec, [PeerResult("megatrain", status="out of GPU memory")]) is None
    host, gpu = plan_vs_measured(spec, [PeerResult("resident"), row])
    assert (gpu["predicted"], gpu["error_pct"], gpu["within_tolerance"]) == (tensors, 0.0, True)
    assert (host["error_pct"], host["within_tolerance"]) == (-50.0, False)
    assert "OFF by more than 10%" in plan_table([host, gpu]).splitlines()[2]


@pytest.mark.slow  # CI: the throughput and optimizer tables run the same harness
def test_long_context_tiny_table(shm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """megatrain at `--seq auto` (the plan's longest, here capped by --max-seq), 128-token tiles and every layer
    checkpoint offloaded, beside FSDP2 rows that need CUDA; the JSON and the --table reprint."""
    from megatrain.config import ModelConfig
    from megatrain.memory.plan import plan_memory

    out = tmp_path / "long.json"
    args = ["--model", "tiny", "--precision", "bf16", "--seq", "auto", "--max-seq", "512", "--fsdp-seqs", "256,512",
            "--tile-tokens", "128", "--checkpoint-budget-gib", "0", "--optimizer-workers", "2",
            "--object-store-mb", "100", "--timeout", "240", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = run_script("long_context.py", args, shm_dir)
    headers, rows = table_rows(proc.stdout, "peer")
    assert headers == ["peer", "seq", "status", "tokens/s", "TFLOP/s", "step s", "GPU peak GiB", "host RSS GiB",
                       "tile", "ckpt budget GiB", "offloaded GiB"]
    col = {h: i for i, h in enumerate(headers)}
    assert [(r[0], r[1]) for r in rows] == [("megatrain", "512"), ("FSDP2 CPU offload", "256"),
                                            ("FSDP2 CPU offload", "512")]
    mt = rows[0]
    assert mt[col["status"]] == "ok", proc.stdout
    for name in ("tokens/s", "TFLOP/s", "step s", "host RSS GiB", "offloaded GiB"):
        assert is_number(mt[col[name]]), (name, mt)
    assert (mt[col["tile"]], mt[col["ckpt budget GiB"]]) == ("128", "0.00")
    if not CUDA:
        assert all(r[col["status"]] == "needs CUDA" and r[col["tokens/s"]] == "-" for r in rows[1:]), rows
    assert "the plan's longest here" in proc.stdout and "capped at --max-seq 512" in proc.stdout
    assert "megatrain: 1 step(s) after 0 untimed" in proc.stdout  # what is timed is said
    assert "memory plan vs measured, megatrain at 512 tokens" in proc.stdout

    data = json.loads(out.read_text())
    assert data["meta"]["plan_longest"] >= 512 and data["meta"]["max_seq"] == 512
    spec, result = data["runs"][0]["spec"], data["runs"][0]["result"]
    assert (spec["seq"], spec["warmup"], spec["steps"]) == (512, 0, 1)
    assert [r["spec"]["warmup"] for r in data["runs"][1:]] == [1, 1]  # FSDP2's first step holds its lazy init
    assert (result["tile_tokens"], result["checkpoint_budget"]) == (128, 0)
    # every layer's input went to host buffers, as many bytes as the plan said
    plan = plan_memory(ModelConfig.from_name("tiny"), 1, 512, precision="bf16", tile_tokens=128, checkpoint_budget=0)
    assert result["host_checkpoints"] == plan.host_checkpoints > 0
    assert result["tflops"] == pytest.approx(
        ModelConfig.from_name("tiny").flops_per_token(512) * 512 / result["step_time"] / 1e12)
    assert list_segments(shm_dir) == []

    assert table_rows(reprinted("long_context", out, capsys), "peer")[1] == rows


def test_long_context_seq_rounding() -> None:
    from benchmarks.long_context import pick_seq

    assert pick_seq(1_399_808, 524_288) == 524_288  # the cap
    assert pick_seq(614_400 + 512, None) == 614_400  # whole KiB of tokens
    assert (pick_seq(896, None), pick_seq(0, 512)) == (896, 0)  # short ones as the plan gave them; none fits


WHEELS = "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
GPU_SESSION_COMMANDS = {
    "headline": [WHEELS, "calibrate --model 7b --batch 1 --seq 2048 --precision bf16",
                 *(command for k in (16, 4, 1) for command in (
                     f"plan --model 7b --precision bf16 --batch 1 --seq 2048 --micro-batches {k} --optimizer-workers "
                     "8 --grads auto --resident auto --device cuda --clip-rate 1",
                     f"train --model 7b --precision bf16 --batch-size 1 --seq-len 2048 --micro-batches {k} --steps 4 "
                     "--warmup-steps 1 --log-every 1 --optimizer-workers 8 --grads auto --speculate auto")),
                 "--micro-batches 1 --steps 4 --warmup-steps 1 --log-every 1 --optimizer-workers 16 --grads auto",
                 "--optimizer-workers 8 --grads auto --speculate auto --resident auto --max-grad-norm 1e9",
                 "throughput.py --model 7b --batch 16 --seq 2048 --precision bf16 --peers fsdp2"],
    "tests": [WHEELS, "== doctor (timeout 90s): python3 -m pipelines.cli doctor",
              "python3 -m pytest tests/test_gpu.py -m gpu -q -s"],
    "host": [WHEELS, "python3 benchmarks/pcie.py --size-mb 1024 --repeats 10",
             "python3 benchmarks/optimizer.py --params 1e9 --workers 8,16,4,2,1 --repeats 2 --out OUT/optimizer.json"],
    "peers": [WHEELS, "DS_BUILD_OPS=0 python3 -m pip install", "CPUAdamBuilder().load()",
              "python3 benchmarks/throughput.py --model 2.8b --batch 8 --seq 2048 --precision tf32 "
              "--peers megatrain,resident,fsdp2,deepspeed --optimizer-workers 8 --steps 5 --warmup 2 --timeout 105 "],
    "big": [WHEELS,
            "python3 benchmarks/throughput.py --model 7b --batch 8 --seq 2048 --precision bf16 --peers megatrain ",
            " --compile --out OUT/tp-7b-bf16.json",
            "python3 -m pipelines.cli train --model 1b --steps 6 --trace ",
            "--checkpoint-every 0 --no-save-final ",
            "python3 -m pipelines.cli report ",
            "cp /tmp/gpu-session/big/run-1b/timeline.png OUT/timeline-1b.png",
            "python3 benchmarks/throughput.py --model 9b --batch 8 --seq 2048 --precision tf32 --peers megatrain ",
            "python3 benchmarks/throughput.py --model 7b --batch 8 --seq 2048 --precision tf32 --peers megatrain "],
    "long": [WHEELS,
             "python3 benchmarks/long_context.py --model 7b --precision bf16 --seq 131072 --peers megatrain ",
             " --out OUT/long-7b.json",
             "python3 benchmarks/long_context.py --model 1b --precision bf16 --peers fsdp2 "
             "--fsdp-seqs 32768,65536,131072 ",
             " --out OUT/long-1b-fsdp2.json"],
    "long-1b": [WHEELS,
                "python3 benchmarks/long_context.py --model 1b --precision bf16 --seq auto --max-seq 524288 "
                "--peers megatrain ", " --out OUT/long-1b.json"],
    "predict": [WHEELS, "python3 -m pipelines.cli calibrate --model 7b --batch 1 --seq 2048 --precision tf32 ",
                *(f"--model 7b --precision tf32 --batch-size 1 --seq-len 2048 --micro-batches {k} "
                  for k in (16, 1, 4))],
    "defaults": [WHEELS, "python3 -m pipelines.cli train --model 7b --precision bf16 --batch-size 1 --seq-len 2048 "
                 "--micro-batches 4 --steps 20 --log-every 1 ", "python3 -c "],
    "generate": [WHEELS, "python3 benchmarks/generate.py --model 7b --precision bf16 --rows 8 --prompt 128 --new 64 "],
    "multi": [WHEELS, "python3 -m pytest tests/test_gpu.py -m gpu -q -s -k two_gpu_executors",
              *(f"--peers megatrain --executors {n} --optimizer-workers 8 " for n in (1, 2, 4, 8))],
}


@pytest.mark.parametrize("part", list(GPU_SESSION_COMMANDS))
def test_gpu_session_dry_run_lists_its_commands(part: str, tmp_path: Path) -> None:
    """DRY_RUN=1 prints every command of a part (the wheel install first) and runs none of them."""
    knobs = ("STEPS", "PEERS", "PEER_TIMEOUT", "BUDGET_S", "MEGATRAIN_CLI")  # the defaults are under test
    env = {k: v for k, v in os.environ.items() if k not in knobs}
    env |= {"DRY_RUN": "1", "OUT": "OUT", "SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), part], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    positions = []
    for command in GPU_SESSION_COMMANDS[part]:
        found = [i for i, line in enumerate(lines) if command in line]
        assert found, f"{command!r} not in:\n{proc.stdout}"
        positions.append(found[0])
    assert positions == sorted(positions), proc.stdout  # in the order they run
    summary = lines[next(i for i, line in enumerate(lines) if "summary" in line) + 1:]
    assert summary and all(line.endswith("dry run") for line in summary), summary
    if part == "tests":  # the machine is checked before anything is measured on it
        assert summary[0].split()[0] == "doctor", summary
    assert not (tmp_path / "site").exists() and not (REPO / "OUT").exists()  # nothing ran, nothing written


def test_optimizer_tiny_table(shm_dir: Path) -> None:
    proc = run_script("optimizer.py", ["--params", "2e6", "--workers", "1,2", "--repeats", "2"], shm_dir)
    headers, rows = table(proc.stdout, "setup")
    assert headers == ["setup", "workers", "threads each", "best s", "median s", "best G params/s",
                       "median G params/s", "vs 1 worker"]
    names = list(rows)
    assert names[0].startswith("torch.optim.AdamW(fused=True), 1 process x ")
    assert [n.split(" x ")[0] for n in names[1:]] == ["pool 1", "pool 2"]
    for row in rows.values():
        assert all(is_number(c) for c in row[3:7]), row
    assert rows[names[1]][-1] == "1.00x"
    assert list_segments(shm_dir) == []


def test_pcie_without_cuda_says_so(shm_dir: Path) -> None:
    proc = run_script("pcie.py", ["--size-mb", "16", "--repeats", "2"], shm_dir)
    if CUDA:
        assert "host memory" in proc.stdout and "cudaHostRegister" in proc.stdout
    else:
        assert "needs CUDA" in proc.stdout
    assert list_segments(shm_dir) == []


def test_memory_sampler_sees_a_child_allocation() -> None:
    from benchmarks.common import MemorySampler, process_tree

    # a child (and grandchild) that each hold ~64 MiB: the sampled tree RSS covers both
    grandchild = "import time; b = bytearray(64 << 20); time.sleep(30)"
    code = ("import subprocess, sys, time; b = bytearray(64 << 20); "
            f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        sampler = MemorySampler(child.pid, interval=0.05).start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (len(process_tree(child.pid)) < 2
                                               or sampler.peaks.tree_rss < 128 << 20):
            time.sleep(0.05)
        peaks = sampler.stop()
        assert len(process_tree(child.pid)) == 2
        assert peaks.tree_rss >= 128 << 20
    finally:
        for pid in reversed(process_tree(child.pid)):
            os.kill(pid, 9)
        child.wait()


def test_format_table_aligns_columns() -> None:
    from benchmarks.common import format_table

    text = format_table(["peer", "tokens/s"], [["megatrain", "1,234"], ["resident", "56"]])
    assert text.splitlines() == ["peer       tokens/s", "---------  --------", "megatrain     1,234",
                                 "resident         56"]
