"""`megatrain train` end to end: the default run, Ctrl-C, bad config, trace + stall report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import dead_segments, my_segments, python_path, run_cli

from megatrain.data import DataError
from pipelines.cli import main


def megatrain(*args: str, cwd: Path) -> subprocess.Popen:
    """`megatrain ...` as a terminal's foreground job runs it: its own process group, SIGINT at its default (a test
    run launched in the background of a shell inherits SIGINT ignored, and so would the driver)."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("flags, steps", [
    pytest.param([], 300, marks=pytest.mark.slow, id="default"),
    pytest.param(["--steps", "30", "--checkpoint-every", "10"], 30, id="a-tenth-of-the-steps"),  # CI's case
])
def test_default_train_learns_and_leaves_nothing(ray_session, tmp_path, flags, steps) -> None:
    before, mine = dead_segments(), my_segments()
    run = run_cli("train", *flags, cwd=tmp_path)  # the driver is this process: what it left would not show as dead
    out = run.output
    assert run.returncode == 0, out
    summary = next(line for line in out.splitlines() if line.startswith(f"trained {steps} steps"))
    first, last = (float(x) for x in summary.split("loss ")[1].split(" -> "))
    assert last < first - 1.5, summary  # visibly learning the synthetic data
    assert (tmp_path / "runs/tiny/final/model.safetensors").exists()
    assert len(list((tmp_path / "runs/tiny/checkpoints").iterdir())) == 3
    assert dead_segments() <= before and my_segments() <= mine, "the run left shared memory behind"


# CI: Ctrl-C; SIGTERM to the driver takes the same path (and tests/test_termination.py sends it to every actor)
@pytest.mark.parametrize("stop, code, said", [("ctrl-c", 130, "interrupted"),
                                              pytest.param("sigterm", 143, "terminated", marks=pytest.mark.slow)])
def test_ctrl_c_or_sigterm_stops_and_releases_shared_memory(tmp_path, stop, code, said) -> None:
    """Ctrl-C from a terminal, or SIGTERM from `timeout`, `kill` or a job scheduler (to the driver alone)."""
    before = dead_segments()
    proc = megatrain("train", "--steps", "5000", "--log-every", "1", "--optimizer-workers", "1", cwd=tmp_path)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            break
    if stop == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: the whole foreground group
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == code, out
    assert f"{said}: shared memory released" in out and "SIGTERM received" not in out
    # segments whose owner is gone (a live run beside this test, another test's, is no leak of this one)
    assert dead_segments() <= before, "the run left shared memory behind"


@pytest.mark.parametrize("args, message", [
    (["--model", "13q"], "unknown model preset '13q'"),
    (["--lr", "-1"], "lr must be a non-negative number"),
    (["--config", "missing.toml"], "config file missing.toml does not exist"),
    (["--data", "nowhere.jsonl"], "nowhere.jsonl"),
    (["--eval-every", "2"], "eval_every is set but the data has no held-out split"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, args, message) -> None:
    before = dead_segments()
    run = run_cli("train", "--steps", "2", *args, cwd=tmp_path)
    out = run.output
    assert run.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("megatrain: error:")]
    assert len(errors) == 1 and message in errors[0], out
    assert "Traceback" not in out
    assert dead_segments() <= before
    assert not (tmp_path / "runs").exists(), "a run that could not start left its directory behind"


@pytest.mark.parametrize("source, message", [("nowhere.jsonl", "does not exist"), ("empty", "is empty")])
def test_bad_data_fails_before_the_engine_starts(tmp_path, monkeypatch, source, message) -> None:
    """A mistyped data path costs no Ray start and no arena: for a 7b model those take minutes."""
    import pipelines.train as train

    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(train, "Engine", lambda *a, **k: pytest.fail("the engine started before the data was checked"))
    cfg = train.TrainConfig.load(None, {"data.source": str(tmp_path / source), "out_dir": str(tmp_path / "run")})
    with pytest.raises(DataError, match=message):
        train.run(cfg)


def test_warmup_longer_than_the_run_is_warned_about(tmp_path, monkeypatch, caplog) -> None:
    import pipelines.train as train

    class Started(Exception):
        pass

    def engine(*args, **kwargs):
        raise Started

    monkeypatch.setattr(train, "Engine", engine)
    cfg = train.TrainConfig.load(None, {"steps": 1, "warmup_steps": 20, "out_dir": str(tmp_path)})
    with pytest.raises(Started):
        train.run(cfg)
    assert "warmup_steps 20 is not below steps 1: the learning rate never reaches lr" in caplog.text


def test_trace_and_stall_report_of_a_run_without_checkpoints_or_final_model(ray_session, tmp_path, capsys) -> None:
    """--trace: every layer's passes and every unit's gradient copy and update on the timeline, the stall report's
    parts adding up to each step, `megatrain report` drawing it. The same run is benchmark-style (a big model on a
    small disk): --checkpoint-every 0 and --no-save-final write neither; --grads picks the placement."""
    run = tmp_path / "run"
    assert main(["train", "--steps", "4", "--trace", "--out", str(run), "--batch-size", "2", "--seq-len", "32",
                 "--device", "cpu", "--precision", "fp32", "--log-every", "1", "--checkpoint-every", "0",
                 "--no-save-final", "--grads", "device", "--optimizer-workers", "1"]) == 0
    assert not list((run / "checkpoints").glob("step-*")) and not (run / "final").exists()
    assert len((run / "steps.jsonl").read_text().splitlines()) == 4
    trace = json.loads((run / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {(e["name"], e["args"].get("layer")) for e in events}
    units = 4  # tiny: embedding, 2 layers, head
    for layer in (1, 2):
        assert ("forward", layer) in names and ("recompute+backward", layer) in names
    for unit in range(units):
        assert ("grads", unit) in names and ("update", unit) in names, unit
    for line in (run / "steps.jsonl").read_text().splitlines():
        s = json.loads(line)["stats"]
        parts = s["compute"] + s["wait_weights"] + s["wait_optimizer"] + s["wait_data"] + s["other"]
        assert abs(parts - s["step_time"]) <= 0.05 * s["step_time"]
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert "step" in capsys.readouterr().out
    png = (run / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_resumed_run_logs_each_step_once(ray_session, tmp_path, capsys) -> None:
    """A fresh run into a directory that holds an earlier run's log starts a fresh log; resumed from the step-3
    checkpoint after it went to step 6, steps 3-5 are logged once, by the run that produced the model in the
    directory."""
    run = tmp_path / "run"
    flags = ["--steps", "6", "--checkpoint-every", "3", "--out", str(run), "--batch-size", "2", "--seq-len", "16",
             "--device", "cpu", "--no-save-final", "--optimizer-workers", "1"]
    run.mkdir()
    (run / "steps.jsonl").write_text("".join(json.dumps({"step": step, "loss": 9.0}) + "\n" for step in range(8)))
    assert main(["train", *flags]) == 0  # no --resume: a new run
    assert [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()] == list(range(6))
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    with open(run / "steps.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a line torn by a kill
    capsys.readouterr()
    assert main(["train", *flags, "--resume"]) == 0
    assert "trained steps 4-6 (resumed after step 3): loss" in capsys.readouterr().out
    logged = [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2, 3, 4, 5]
