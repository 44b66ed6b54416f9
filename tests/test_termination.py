"""SIGTERM to an actor process (a job ending before `ray.kill` lands, or `kill` by hand): its cleanup, then a
quiet exit, never a traceback in the driver's log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import ray
from helpers import python_path

import megatrain
from megatrain.memory.arena import proc_stat

# SIGTERM handled while the main thread runs an object's __del__: where Ray's own handler raised SystemExit, which
# Python only prints ("Exception ignored in ... __del__") before carrying on
SIGTERM_IN_DEL = """
import os, signal, sys, time
from pathlib import Path
from actors.termination import exit_on_sigterm

exit_on_sigterm(lambda: Path(sys.argv[1]).write_text("cleaned up"))

class Handle:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecode, so the handler runs here, inside __del__
            time.sleep(0.001)

handle = Handle()
del handle
print("still running after SIGTERM")
sys.exit(3)
"""


def test_sigterm_inside_a_destructor_cleans_up_and_exits_quietly(tmp_path) -> None:
    marker = tmp_path / "cleanup"
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_DEL, str(marker)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": python_path()}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    assert marker.read_text() == "cleaned up"


def wait_exited(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if (stat := proc_stat(pid)) is not None and stat[0] != "Z"]  # Z: exited
        time.sleep(0.05)
    return alive


def test_sigterm_to_every_actor_exits_it_and_unlinks_the_arena(ray_session) -> None:
    engine = megatrain.Engine("tiny", device="cpu", precision="fp32", optimizer_workers=1, batch_size=2, seq_len=16)
    try:
        tokens = np.random.default_rng(0).integers(0, engine.config.vocab_size, (2, 16))
        engine.step(tokens)
        engine.wait_for_updates()
        segments = [engine.handle.path(name) for name, _, _ in engine.handle.segments]
        assert all(p.exists() for p in segments)
        pids = ray.get([a.pid.remote() for a in [*engine.stores, *engine.executors, *engine.workers]])
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        assert wait_exited(pids) == [], "an actor outlived SIGTERM"
        assert not any(p.exists() for p in segments), "the store's SIGTERM left its arena in /dev/shm"
    finally:
        engine.shutdown()
