"""Ray as users run it: a running `ray start --head` cluster, a stale record of a killed one; what a run's actors
reserve on the driver's node; and the device the executor actor is given. (A run on a cluster of two nodes that stays
on the driver's node: test_nodes.py, on the cluster of its two-node run.)

A test that needs a Ray of its own runs it in subprocesses (the session's Ray, from conftest, stays the one of
this process) under a fresh RAY_TMPDIR, which also holds Ray's record of "the current cluster". Everything such
a Ray starts inherits RAY_TMPDIR, which is how the test finds its processes and ends them: `ray stop` would
stop every Ray on the machine, other people's included.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from helpers import TIMEOUT, assert_nothing_left, dead_segments, free_port, ray_processes

import megatrain
from megatrain import ConfigError, MegatrainError
from megatrain.memory.arena import proc_stat
from pipelines import cluster
from pipelines.cluster import executor_device, resolve_address

TRAIN = ("train", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1",
         "--checkpoint-every", "0", "--no-save-final", "--log-every", "1", "--optimizer-workers", "1")


def ray_start_head(env: dict[str, str]) -> str:
    """`ray start --head` as a user runs it (on free ports, not to collide with other Rays on this machine);
    returns the address it recorded."""
    ports = {flag: free_port() for flag in ("--port", "--ray-client-server-port", "--dashboard-port",
                                            "--dashboard-agent-listen-port")}
    proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus=2",
                           "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={100 * 2**20}",
                           *(f"{flag}={port}" for flag, port in ports.items())],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return (Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").read_text().strip()


def megatrain_cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, start_new_session=True)


# ---- which Ray ----

def train_without_address(env: dict[str, str], tmp_path: Path, *said: str) -> None:
    """`megatrain train --steps 3` without --address finishes, logs each of `said`, and leaves no Ray process and
    nothing in /dev/shm behind."""
    dead_before = dead_segments()
    proc = megatrain_cli(env, tmp_path, *TRAIN, "--out", str(tmp_path / "run"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "trained 3 steps" in out and "Traceback" not in out
    for words in said:
        assert words in out, out
    assert_nothing_left(env, dead_before)


def test_train_joins_a_running_ray_start_cluster(ray_env, tmp_path) -> None:
    address = ray_start_head(ray_env)
    train_without_address(ray_env, tmp_path, f"joined the Ray cluster at {address} (the one `ray start` recorded in",
                          "--address local) starts a private one instead")


@pytest.mark.slow  # CI: test_address_resolution decides the same in-process
def test_train_after_a_killed_head_starts_a_private_ray(ray_env, tmp_path) -> None:
    """What a SIGKILLed head (or a rebooted container) leaves: Ray's record of an address nobody answers at."""
    record = Path(ray_env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
    record.parent.mkdir(parents=True)
    record.write_text(f"127.0.0.1:{free_port()}")
    train_without_address(ray_env, tmp_path, f"the Ray cluster recorded in {record} is gone (nothing answers at",
                          "starting a private local Ray instead")


def test_a_dead_address_asked_for_is_one_sentence(ray_env, tmp_path) -> None:
    """Only the sentence on stderr: what Ray agents another test's killed driver left (they outlive it a while) are
    not the command's to reap, being of another Ray temp root (cluster.reap_orphaned_ray_agents)."""
    address = f"127.0.0.1:{free_port()}"
    proc = megatrain_cli(ray_env, tmp_path, *TRAIN, "--address", address)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"megatrain: error: address {address!r} names a Ray cluster, but nothing answers at {address} (Connection "
        "refused); start the cluster there (ray start --head), or leave the address out to start a private Ray."]
    assert not ray_processes(ray_env["RAY_TMPDIR"])


def test_only_the_orphaned_agents_of_this_ray_temp_root_are_reaped(monkeypatch, tmp_path) -> None:
    """What a SIGKILLed driver's Ray leaves (agents re-parented to init) under this process's RAY_TMPDIR is reaped;
    under another (a test's private Ray beside this one), and a live parent's agent, are not."""
    def agent(tmpdir: Path, orphaned: bool = True) -> subprocess.Popen | int:
        env = {**os.environ, "RAY_TMPDIR": str(tmpdir)}
        if orphaned:  # the shell exits at once, leaving its child to init
            shell = "(exec -a ray::DashboardAgent sleep 60 >/dev/null 2>&1) & echo $!"
            made = pid = int(subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True,
                                            check=True).stdout)
        else:
            made = subprocess.Popen(["bash", "-c", "exec -a ray::DashboardAgent sleep 60"], env=env)
            pid = made.pid
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the shell has become the agent
        return made

    def alive(pid: int) -> bool:  # a killed orphan may stay a zombie a while: init reaps it when it does
        return (stat := proc_stat(pid)) is not None and stat[0] != "Z"

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    orphan, other, child = agent(ours), agent(theirs), agent(ours, orphaned=False)
    try:
        monkeypatch.setenv("RAY_TMPDIR", str(ours))
        assert cluster.reap_orphaned_ray_agents() == [orphan]
        deadline = time.monotonic() + 10  # until the SIGKILL lands
        while alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(orphan)
        assert alive(other) and child.poll() is None
    finally:
        for pid in (orphan, other, child.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        child.wait()


def test_address_resolution(monkeypatch, tmp_path, caplog) -> None:
    """Ray's order (an explicit address, else RAY_ADDRESS, else the record of `ray start`); a dead cluster asked
    for by name is one sentence, a dead one only recorded is replaced by a private Ray."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    record = tmp_path / "ray" / "ray_current_cluster"
    dead = f"127.0.0.1:{free_port()}"
    with socket.socket() as live_socket:
        live_socket.bind(("127.0.0.1", 0))
        live_socket.listen()
        live = f"127.0.0.1:{live_socket.getsockname()[1]}"

        assert resolve_address(None)[0] is None  # nothing recorded: a private Ray
        with pytest.raises(MegatrainError, match="address 'auto' joins the cluster `ray start --head` runs on this "
                                                 "machine, but none is recorded in"):
            resolve_address("auto")
        record.parent.mkdir()
        record.write_text(live)
        assert resolve_address(None)[0] == live == resolve_address("auto")[0]
        assert resolve_address("local")[0] is None
        assert resolve_address(live)[0] == live

        record.write_text(dead)
        assert resolve_address(None)[0] is None
        assert f"recorded in {record} is gone (nothing answers at {dead}" in caplog.text
        with pytest.raises(MegatrainError, match=f"address 'auto' names the Ray cluster recorded in .* nothing "
                                                 f"answers at {dead}"):
            resolve_address("auto")
        with pytest.raises(MegatrainError, match=f"address '{dead}' names a Ray cluster, but nothing answers"):
            resolve_address(dead)

        monkeypatch.setenv("RAY_ADDRESS", dead)  # explicit too: an error, also with a live record
        record.write_text(live)
        with pytest.raises(MegatrainError, match=f"RAY_ADDRESS '{dead}' names a Ray cluster, but nothing answers"):
            resolve_address(None)
        assert resolve_address(live)[0] == live  # an address argument wins over RAY_ADDRESS, as in Ray
        assert resolve_address("local")[0] is None
    with pytest.raises(ConfigError, match="Ray Client address"):
        resolve_address("ray://head:10001")
    with pytest.raises(ConfigError, match="'head' is not host:port, 'auto' or 'local'"):
        resolve_address("head")


# ---- where: one node ----

def test_a_request_that_cannot_be_met_fails_by_its_deadline(ray_session, monkeypatch) -> None:
    """A node's free CPUs seen a moment too early (here: 4 on a 2-CPU node), or its GPU held by another job: the
    reservation fails after resource_timeout in one sentence of what was asked and what the nodes have."""
    monkeypatch.setattr(cluster, "node_resources", lambda node: ({"CPU": 2.0}, {"CPU": 4.0}))
    t0 = time.monotonic()
    with pytest.raises(MegatrainError) as info:
        megatrain.Engine("tiny", optimizer_workers=2, device="cpu", batch_size=2, seq_len=16, resource_timeout=1.0)
    assert time.monotonic() - t0 < 30
    message = str(info.value)
    assert message.startswith("Ray did not grant the 2 CPU for each of 2 optimizer worker(s) this run asked for on "
                              "the driver's node within 1 s (the driver node ") and "\n" not in message
    assert message.endswith(" has 2 of 2 CPU free); free them (another Engine or job holds them), or start Ray with "
                            "more.")

    monkeypatch.undo()
    monkeypatch.setattr("pipelines.engine.node_resources", lambda node: ({"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0}))
    with pytest.raises(MegatrainError, match=r"the 1 CPU for each of 2 optimizer worker\(s\) and a GPU this run asked "
                                             r"for on the driver's node within 1 s .* has 2 of 2 CPU and 0 of 0 GPU "
                                             r"free\)"):
        megatrain.Engine("tiny", optimizer_workers=2, device="auto", batch_size=2, seq_len=16, resource_timeout=1.0)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0, "a failed reservation kept its placement group"


# ---- the executor's device ----

def test_the_driver_decides_the_executors_device() -> None:
    """Inside the actor Ray shows only the GPU it granted, as cuda:0; without one, compute stays on the CPU."""
    assert executor_device("cuda:1", on_gpu=True) == "cuda" == executor_device("auto", on_gpu=True)
    assert executor_device("auto", on_gpu=False) == "cpu" == executor_device("cpu", on_gpu=False)
    assert executor_device("cpu-async:3", on_gpu=False) == "cpu-async:3"


def test_three_workers_reserve_what_ray_can_grant(ray_session) -> None:
    """The workers share the node's free CPUs in Ray's units: three on the session's 2 take 0.6666 each, as Ray counts
    in 1/10000ths and 3 x 0.6667 is more than 2, which would never be granted."""
    placement = cluster.NodePlacement.reserve(cluster.driver_node(), 3, gpu=False, timeout=60)
    try:
        assert (placement.worker_cpus, placement.worker_threads) == (0.6666, 1)
    finally:
        placement.release()


# CI: the simulated streams' device with one worker; slow: "auto" with three (its reservation: above, without actors;
# "auto" on a node without a GPU: test_the_driver_decides_the_executors_device)
@pytest.mark.parametrize(("device", "given", "workers", "cpus"), [
    pytest.param("auto", "cpu", 3, 0.6666, marks=pytest.mark.slow), ("cpu-async:3", "cpu-async:3", 1, 2.0)])
def test_the_executor_actor_receives_the_decided_device(ray_session, monkeypatch, device, given, workers, cpus
                                                        ) -> None:
    """The device the driver decided reaches the executor actor; the workers share the session's 2 CPUs in Ray's units
    (three: 0.6666 each)."""
    from pipelines import run_actors

    received = []
    options = run_actors.GPUExecutor.options

    class Recording:
        def options(self, **kw):
            actor = options(**kw)

            class Remote:
                def remote(self, handle, config, engine_config, *rest):
                    received.append(engine_config.device)
                    return actor.remote(handle, config, engine_config, *rest)

            return Remote()

    monkeypatch.setattr(run_actors, "GPUExecutor", Recording())
    with megatrain.Engine("tiny", optimizer_workers=workers, device=device, batch_size=2, seq_len=16) as engine:
        assert engine.device == "cpu" and not engine.on_gpu
        assert engine.placement.worker_cpus == cpus
        assert math.isfinite(engine.step(torch.randint(0, 256, (2, 16))))
    assert received == [given]
