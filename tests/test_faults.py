"""Fault injection on the CPU path: kill actors mid-step, kill the driver, and get the same model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ENGINE, KILL_STEPS, assert_same_model, processes_with, run_cli, train_with_faults, worker_pids
from safetensors.torch import load_file

import megatrain
from megatrain.memory.arena import list_segments, segment_owner_alive


@pytest.fixture(scope="module")
def uninterrupted(ray_session, fault_batches, tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, params, restarts, _ = train_with_faults(fault_batches, tmp_path_factory.mktemp("clean"))
    assert restarts == 0
    return losses, params


# slow: five random kills each. CI kills the executor twice under simulated streams (below) and an optimizer worker
# once (test_a_refused_batch_is_not_replayed_and_a_fault_past_the_replay_window_is_one_sentence); the recovery code
# is the same.
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["executor", "optimizer-worker"])
def test_killed_actor_recovers_exactly(ray_session, fault_batches, uninterrupted, tmp_path, victim) -> None:
    losses, params, restarts, segments = train_with_faults(fault_batches, tmp_path, victim=victim)
    assert restarts >= len(KILL_STEPS), f"only {restarts} faults were survived; the kills did not land"
    assert losses == uninterrupted[0]
    assert_same_model(params, uninterrupted[1])
    assert not any(p.exists() for p in segments)


@pytest.mark.slow  # CI: the same kill with clipping on (test_killed_actor_recovers_exactly)
def test_killed_executor_with_clipping_off_recovers_exactly(ray_session, fault_batches, tmp_path) -> None:
    """Clipping off updates layers during the backward: a kill then needs the checkpoint-and-replay path."""
    losses0, params0, _, _ = train_with_faults(fault_batches, tmp_path / "a", max_grad_norm=None)
    losses, params, restarts, _ = train_with_faults(fault_batches, tmp_path / "b", victim="executor",
                                                    max_grad_norm=None, seed=1)
    assert restarts >= len(KILL_STEPS)
    assert losses == losses0
    assert_same_model(params, params0)


@pytest.mark.slow  # CI: the same kills under simulated streams, grads = "device", below
def test_killed_executor_holding_the_gradients_recovers_exactly(ray_session, fault_batches, uninterrupted, tmp_path
                                                                ) -> None:
    """grads = "device": the step's gradients die with the executor, and it may die while sending them out,
    with some units updated and others not; recovery replays from the checkpoint."""
    losses, params, restarts, _ = train_with_faults(fault_batches, tmp_path, victim="executor", grads="device", seed=2)
    assert restarts >= len(KILL_STEPS)
    assert losses == uninterrupted[0], "grads = device trains exactly as grads = arena"
    assert_same_model(params, uninterrupted[1])


@pytest.mark.parametrize("grads", [pytest.param("arena", marks=pytest.mark.slow), "device"])  # CI: the harder one
def test_killed_executor_under_simulated_streams_recovers_exactly(ray_session, fault_batches, uninterrupted, tmp_path,
                                                                  grads) -> None:
    """The GPU's schedule on the CPU (device cpu-async): an executor killed while copies are in flight on its
    simulated streams, once before the checkpoint and once after; recovery gives the synchronous path's model."""
    kills = {7, 14}
    losses, params, restarts, _ = train_with_faults(fault_batches, tmp_path, victim="executor", grads=grads, seed=3,
                                                    device="cpu-async:3", kill_steps=kills)
    assert restarts >= len(kills)
    assert losses == uninterrupted[0]
    assert_same_model(params, uninterrupted[1])


def test_a_refused_batch_is_not_replayed_and_a_fault_past_the_replay_window_is_one_sentence(
        ray_session, fault_batches, uninterrupted) -> None:
    """A batch the executor refused trained nothing: recovering from a later fault replays the steps without it. Once
    more steps than max_replay_steps ran since the last checkpoint, their batches are dropped, and a fault that needs
    a replay stops the run in one sentence."""
    with megatrain.Engine("tiny", max_replay_steps=4, **ENGINE) as engine:
        losses = [engine.step(fault_batches[0])]
        with pytest.raises(megatrain.MegatrainError, match="outside the model's vocabulary"):
            engine.step(torch.full((4, 64), -1))
        losses.append(engine.step(fault_batches[1]))
        os.kill(worker_pids(engine)[0], signal.SIGKILL)
        losses += [engine.step(ids) for ids in fault_batches[2:4]]  # the kill is met in the 3rd step or the 4th
        assert engine.restarts == 1  # and the replay, had it kept the refused batch, would have raised
        assert losses == uninterrupted[0][:4]

        # met in the 5th step (which dropped the 4 batches kept) or the 6th
        os.kill(worker_pids(engine)[0], signal.SIGKILL)
        with pytest.raises(megatrain.MegatrainError, match="cannot be replayed; resume from the last checkpoint"):
            for ids in fault_batches[4:7]:
                engine.step(ids)


def megatrain_cli(*args: str) -> subprocess.Popen:
    code = "import sys; from pipelines.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=Path(__file__).parent.parent)


def test_sigkilled_driver_resumes_to_the_same_model(ray_session, tmp_path) -> None:
    common = ["train", "--steps", "16", "--batch-size", "4", "--seq-len", "64", "--checkpoint-every", "4",
              "--device", "cpu", "--precision", "fp32", "--log-every", "5", "--optimizer-workers", "1"]
    clean = run_cli(*common, "--out", str(tmp_path / "clean"))  # the reference: no driver of its own to kill
    assert clean.returncode == 0, clean.output

    run = tmp_path / "killed"
    driver = megatrain_cli(*common, "--out", str(run))
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step-00000008" / "manifest.json").exists():
        assert driver.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()

    # the next driver, in this process: its start removes the dead run's arena and reaps its private Ray's agents
    resumed = run_cli(*common, "--out", str(run), "--resume")
    assert resumed.returncode == 0, resumed.output
    assert "resumed from" in resumed.output
    want = load_file(tmp_path / "clean" / "final" / "model.safetensors")
    got = load_file(run / "final" / "model.safetensors")
    assert_same_model(got, want)
    assert not [p for p in list_segments() if not segment_owner_alive(p)], "a dead run's arena is still there"
    deadline = time.monotonic() + 10  # the resumed run's own actors (this process's Ray) exit as their kill lands
    while _megatrain_actor_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _megatrain_actor_processes(), "megatrain actors outlived their driver"


def _megatrain_actor_processes() -> list[int]:
    """The megatrain actors of this test process's runs (the killed driver's too): their environment names the arena
    directory conftest gave this process, which another test process beside it (pytest -n 2) does not share."""
    names = (b"ray::ParameterStoreActor", b"ray::OptimizerWorker", b"ray::GPUExecutor", b"ray::DataLoaderActor")
    return processes_with("MEGATRAIN_SHM_DIR", os.environ["MEGATRAIN_SHM_DIR"], names)


def test_cuda_errors_and_failed_collectives_count_as_executor_faults() -> None:
    import ray

    from pipelines.recovery import is_actor_death, is_collective_failure, is_cuda_error, is_fault

    class Wrapped(Exception):  # the shape of Ray's RayTaskError: the original error under .cause
        def __init__(self, cause: BaseException):
            super().__init__(str(cause))
            self.cause = cause

    assert is_cuda_error(Wrapped(RuntimeError("CUDA error: an illegal memory access was encountered")))
    assert not is_cuda_error(Wrapped(RuntimeError("shape mismatch")))
    assert not is_actor_death(Wrapped(ValueError("bad token")))
    # a killed executor's peer, in its all_reduce, fails before Ray reports the death (seen in CI on two nodes)
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12709: Connection "
                        "reset by peer.")
    assert is_collective_failure(Wrapped(gloo)) and not is_collective_failure(Wrapped(RuntimeError("shape mismatch")))

    class TaskError(ray.exceptions.RayError, Wrapped):  # Ray's error around each
        pass

    assert is_fault(TaskError(gloo)) and is_fault(TaskError(RuntimeError("CUDA error: unspecified launch failure")))
    assert not is_fault(TaskError(ValueError("bad token"))) and not is_fault(gloo)  # not through Ray: not the engine
