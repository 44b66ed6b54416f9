"""The shared-memory arena: shared across processes, cleaned up after killed owners, and refused up front
when the model cannot fit.

Most tests put the arena in a tmp directory (`Arena.create(directory=...)`) so they never touch the
segments of other runs in /dev/shm; `test_real_dev_shm_round_trip` uses the real one and cleans up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import python_path

from megatrain import MegatrainError, ModelConfig
from megatrain.config import ConfigError
from megatrain.memory import arena as arena_mod
from megatrain.memory.arena import (
    Arena,
    ArenaHandle,
    list_segments,
    remove_stale_segments,
    segment_owner_alive,
)
from megatrain.memory.plan import GiB, plan_memory, resolve_grads
from megatrain.store import ParameterStore

REPO = Path(__file__).resolve().parents[1]
NUMEL = 4096

# Preamble of every child: import the arena, read a pickled handle from argv (when given).
CHILD_PREAMBLE = """
import pickle, sys, time
import torch
from megatrain.memory.arena import Arena
"""


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    """Starts `python -c script args...` with megatrain importable; stdin/stdout are text pipes."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    pipe = subprocess.PIPE
    return subprocess.Popen([sys.executable, "-c", CHILD_PREAMBLE + textwrap.dedent(script), *args], cwd=REPO,
                            env=env, stdin=pipe, stdout=pipe, stderr=pipe, text=True)


def finish(proc: subprocess.Popen[str], stdin: str = "", timeout: float = 60) -> str:
    out, err = proc.communicate(stdin, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err}"
    return out


def read_handle(proc: subprocess.Popen[str]) -> ArenaHandle:
    """The child prints its handle as one line of pickle hex once its arena exists."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"child exited before printing its arena handle:\n{err}")
    return pickle.loads(bytes.fromhex(line.strip()))


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def handle_paths(handle: ArenaHandle) -> list[Path]:
    return [handle.path(name) for name, _, _ in handle.segments]


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    a = Arena.create(NUMEL, directory=tmp_path, extra_segments=(("versions", "int64", 8),))
    yield a
    a.destroy()


# ---- sharing between processes ----

def test_child_writes_parent_reads(arena: Arena) -> None:
    arena.params.copy_(torch.arange(NUMEL, dtype=torch.float32))
    child = spawn("""
        a = Arena.open(pickle.loads(bytes.fromhex(sys.argv[1])))
        assert not a.owner
        assert torch.equal(a.params, torch.arange(a.params.numel(), dtype=torch.float32)), "params not shared"
        a.grads.fill_(7.0)
        a.exp_avg_sq[5] = 3.5
        a.versions[3] = 42
        a.close()
    """, pickle.dumps(arena.handle).hex())
    finish(child)
    assert torch.all(arena.grads == 7.0)
    assert arena.exp_avg_sq[5] == 3.5 and arena.exp_avg_sq.count_nonzero() == 1
    assert arena.versions.dtype == torch.int64 and arena.versions[3] == 42
    # a non-owner exiting must not unlink the segments (the shared_memory resource-tracker pitfall)
    assert all(p.exists() for p in handle_paths(arena.handle))


def test_parent_writes_child_reads(tmp_path: Path) -> None:
    child = spawn("""
        a = Arena.create(1024, directory=sys.argv[1])
        a.params.fill_(2.0)
        print(pickle.dumps(a.handle).hex(), flush=True)
        sys.stdin.readline()  # the parent writes its gradients now
        assert torch.all(a.grads == 5.0), "the parent's write is not visible"
        assert float(a.exp_avg[-1]) == -1.0
        a.destroy()
        print("ok", flush=True)
    """, str(tmp_path))
    handle = read_handle(child)
    assert handle.owner_pid == child.pid and handle.directory == str(tmp_path)
    opened = Arena.open(handle)
    assert torch.all(opened.params == 2.0)
    opened.grads.fill_(5.0)
    opened.exp_avg[-1] = -1.0
    assert finish(child, "go\n").strip() == "ok"
    assert not any(p.exists() for p in handle_paths(handle)), "the owner's destroy() unlinks the segments"
    assert torch.all(opened.params == 2.0), "a mapping stays valid after the owner unlinked the files"
    opened.close()
    with pytest.raises(MegatrainError, match=r"has no segment\(s\) params, .*its owner has exited"):
        Arena.open(handle)


def test_handle_is_small_and_picklable(arena: Arena) -> None:
    handle = arena.handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert handle.nbytes() == 4 * NUMEL * 4 + 8 * 8
    assert all(str(p).startswith(str(handle.directory)) for p in handle_paths(handle))


# ---- stale segments ----

@pytest.mark.parametrize("cleanup", ["remove_stale_segments", "Arena.create"])
def test_killed_owner_segments_are_removed_at_next_start(tmp_path: Path, arena: Arena, cleanup: str) -> None:
    """A SIGKILLed owner leaves its files; the next start removes them but not a live process's."""
    hold = """
        a = Arena.create(1024, directory=sys.argv[1])
        print(pickle.dumps(a.handle).hex(), flush=True)
        time.sleep(120)
    """
    doomed, live = spawn(hold, str(tmp_path)), spawn(hold, str(tmp_path))
    try:
        doomed_handle, live_handle = read_handle(doomed), read_handle(live)
        kill(doomed)
        stale = handle_paths(doomed_handle)
        assert all(p.exists() for p in stale), "SIGKILL runs no cleanup, so the files are still there"
        assert not any(segment_owner_alive(p) for p in stale)
        kept = handle_paths(live_handle) + handle_paths(arena.handle)
        assert all(segment_owner_alive(p) for p in kept)
        (tmp_path / "not-ours").write_text("x")

        if cleanup == "remove_stale_segments":
            assert sorted(remove_stale_segments(tmp_path)) == sorted(stale)
        else:
            Arena.create(16, directory=tmp_path).destroy()
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in kept), "a live process's segments must survive cleanup"
        assert (tmp_path / "not-ours").exists()
    finally:
        for proc in (doomed, live):
            if proc.poll() is None:
                kill(proc)
    assert sorted(remove_stale_segments(tmp_path)) == sorted(handle_paths(live_handle))


def test_reused_pid_does_not_keep_segments_alive(tmp_path: Path) -> None:
    """Names carry the owner's start time: a live pid with another start time is a different process."""
    me = os.getpid()
    start = arena_mod.process_start_time(me)
    assert start is not None
    alive = tmp_path / f"megatrain-run1-{me}-{start}-params"
    reused = tmp_path / f"megatrain-run2-{me}-{start + 1}-params"
    for p in (alive, reused):
        p.write_bytes(b"")
    assert remove_stale_segments(tmp_path) == [reused]
    assert alive.exists()
    assert remove_stale_segments(tmp_path, everything=True) == [alive]
    assert list_segments(tmp_path) == []


@pytest.mark.parametrize("run_id", ["my-run-1", "sft--2024-01-01", "plain"])
def test_live_arena_with_any_run_id_survives_cleanup(tmp_path: Path, run_id: str) -> None:
    """Run ids are user-chosen (and may contain dashes): the owner is read from the end of the name."""
    a = Arena.create(16, run_id=run_id, directory=tmp_path)
    try:
        assert all(segment_owner_alive(p) for p in handle_paths(a.handle))
        assert remove_stale_segments(tmp_path) == []
        Arena.create(16, directory=tmp_path).destroy()
        assert all(p.exists() for p in handle_paths(a.handle))
    finally:
        a.destroy()


def test_real_dev_shm_round_trip() -> None:
    """The default directory is /dev/shm (or MEGATRAIN_SHM_DIR); everything we create there goes away."""
    mine = f"-{os.getpid()}-"  # other runs may create and remove their own segments meanwhile
    before = {p for p in list_segments() if mine in p.name}
    a = Arena.create(NUMEL, run_id="pytest-arena")
    try:
        paths = handle_paths(a.handle)
        assert all(p.parent == arena_mod.SHM_DIR and p.exists() for p in paths)
        assert all(p.stat().st_size == NUMEL * 4 for p in paths)
        a.params.fill_(1.5)
        finish(spawn("""
            a = Arena.open(pickle.loads(bytes.fromhex(sys.argv[1])))
            a.grads.copy_(a.params * 2)
        """, pickle.dumps(a.handle).hex()))
        assert torch.all(a.grads == 3.0)
    finally:
        a.destroy()
    assert not any(p.exists() for p in paths)
    assert {p for p in list_segments() if mine in p.name} == before


# ---- CUDA registration and out-of-space ----

def test_register_cuda_without_cuda(arena: Arena, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert arena.register_cuda() is False
    arena.params.fill_(1.0)  # still an ordinary, usable mapping
    assert float(arena.params.sum()) == NUMEL
    arena.close()


def test_out_of_space_is_a_clear_error_and_leaves_nothing(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def full_after_two(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(arena_mod.os, "posix_fallocate", full_after_two)
    with pytest.raises(MegatrainError, match=r"ran out of space while allocating the .* GiB arena; free"):
        Arena.create(NUMEL, directory=tmp_path)
    assert list_segments(tmp_path) == [], "the segments created before the failure are removed"


# ---- the memory plan refuses up front ----

def test_plan_for_70b_names_the_numbers() -> None:
    config = ModelConfig.from_name("70b")
    plan = plan_memory(config, 1, 2048, name="70b")
    assert plan.arena_bytes >= 16 * config.num_params()
    problem = plan.host_problem()
    assert problem is not None
    if plan.arena_bytes > plan.shm_free:
        assert f"70b model needs a {plan.arena_bytes / GiB:.1f} GiB arena" in problem
        assert "16.0 B per parameter for 70.55 G parameters" in problem
        assert f"/dev/shm has {plan.shm_free / GiB:.1f} GiB free" in problem
    assert "fits: NO" in plan.report()
    with pytest.raises(MegatrainError, match="70b model needs"):
        plan.check_host()


def test_plan_streamed_gradients_keep_the_host_at_12_bytes_per_param() -> None:
    config = ModelConfig.from_name("9b")
    arena = plan_memory(config, 8, 2048, grads="arena")
    for grads in ("stream", "device"):
        plan = plan_memory(config, 8, 2048, grads=grads, on_gpu=True, gpu_free=80 * GiB)
        assert plan.grads == grads
        assert 12.0 < plan.arena_bytes / config.num_params() < 12.5, "params + m + v, and a ring of a few layers"
        assert arena.arena_bytes - plan.arena_bytes > 3.5 * config.num_params()
        assert f"grads = {grads}" in plan.report()
    device = plan_memory(config, 8, 2048, grads="device", on_gpu=True, gpu_free=80 * GiB)
    assert device.gpu_grads > 4 * 0.9 * config.num_params(), "every layer's gradient waits on the GPU"
    with pytest.raises(ConfigError, match="grads must be one of"):
        plan_memory(config, 8, 2048, grads="gpu")


def test_resolve_grads() -> None:
    config = ModelConfig.from_name("1b")
    fits = plan_memory(config, 8, 2048, grads="device", on_gpu=True, gpu_free=80 * GiB)
    too_small = plan_memory(config, 8, 2048, grads="device", on_gpu=True, gpu_free=1 * GiB)
    cpu = plan_memory(config, 8, 2048, grads="device")
    assert resolve_grads("auto", clipping=False) == "stream"
    assert resolve_grads("auto", clipping=True, device_plan=fits) == "device"
    assert resolve_grads("auto", clipping=True, device_plan=too_small) == "arena"
    assert resolve_grads("auto", clipping=True, device_plan=cpu) == "arena", "no GPU: gradients stay in the arena"
    assert resolve_grads("device", clipping=True, device_plan=cpu) == "device", "an explicit choice is kept"
    with pytest.raises(ConfigError, match="max_grad_norm = 0"):
        resolve_grads("stream", clipping=True)


def test_plan_run_is_the_engines_choice(monkeypatch) -> None:
    """plan_run (the Engine's and `megatrain plan`'s plan): gradients on the GPU when they fit there, the bf16
    copy of the weights only where the host has room, and nothing computed on the GPU counted on the host."""
    from megatrain.memory import plan as plan_mod

    config = ModelConfig.from_name("9b")
    monkeypatch.setattr(plan_mod, "shm_available", lambda directory: 200 * GiB)
    monkeypatch.setattr(plan_mod, "host_available", lambda: 200 * GiB)
    # 1 x 2048 tokens: the fp32 weights' H2D would bound the step (the copy's rule: test_bf16_copy.py)
    roomy = plan_mod.plan_run(config, 1, 2048, precision="bf16", optimizer_workers=8, on_gpu=True, gpu_free=80 * GiB)
    assert (roomy.grads, roomy.bf16_copy_bytes > 0, roomy.host_problem()) == ("device", True, None)
    monkeypatch.setattr(plan_mod, "host_available", lambda: 122 * GiB)
    tight = plan_mod.plan_run(config, 1, 2048, precision="bf16", optimizer_workers=8, on_gpu=True, gpu_free=80 * GiB)
    assert (tight.grads, tight.bf16_copy_bytes, tight.host_problem()) == ("device", 0, None), "no room: no bf16 copy"
    # the store checks the host with on_gpu as the engine runs: a GPU run's gradients are not host memory
    cpu = plan_memory(config, 1, 2048, precision="bf16", optimizer_workers=8, grads="device", bf16_copy=False)
    assert cpu.host_total - tight.host_total > tight.gpu_grads


def test_plan_host_memory_problem_names_the_numbers() -> None:
    plan = dataclasses.replace(plan_memory(ModelConfig.from_name("7b"), 1, 2048, name="7b"),
                               shm_free=2**50, host_free=10 * GiB)
    problem = plan.host_problem()
    assert problem is not None
    assert f"needs {plan.host_total / GiB:.1f} GiB of host memory" in problem
    assert f"({plan.arena_bytes / GiB:.1f} GiB arena + " in problem
    assert "only 10.0 GiB is available" in problem


def test_plan_for_tiny_fits() -> None:
    plan = plan_memory(ModelConfig.from_name("tiny"), 2, 64, name="tiny")
    assert plan.host_problem() is None and plan.gpu_problem() is None
    assert plan.report().endswith("fits: yes")


def test_store_refuses_70b_before_allocating() -> None:
    mine = f"-{os.getpid()}-"
    before = {p for p in list_segments() if mine in p.name}
    with pytest.raises(MegatrainError, match=r"70b model needs .* GiB") as info:
        ParameterStore("70b")
    assert "\n" not in str(info.value) and str(info.value).endswith(".")
    assert {p for p in list_segments() if mine in p.name} == before, "nothing is allocated before refusing"


def test_cleanup_command_says_each_thing_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    from megatrain.memory import arena as arena_module
    from pipelines.cli import main

    monkeypatch.setattr(arena_module, "SHM_DIR", tmp_path)
    doomed = spawn("""
        a = Arena.create(1024, directory=sys.argv[1])
        print(pickle.dumps(a.handle).hex(), flush=True)
        time.sleep(120)
    """, str(tmp_path))
    stale = handle_paths(read_handle(doomed))
    kill(doomed)
    caplog.set_level(logging.INFO)
    assert main(["cleanup"]) == 0
    out = capsys.readouterr().out
    assert all(f"removed {p}" in out for p in stale) and f"removed {len(stale)} segment(s)" in out
    assert "stale arena segment" not in caplog.text  # printed above, not logged a second time
    assert not any(p.exists() for p in stale)
