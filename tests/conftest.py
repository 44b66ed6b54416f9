"""Fixtures several test modules use: the session's Ray, a Ray of a test's own, a private /dev/shm directory, and
the models and batches that tests in more than one module train on; and the order the test files run in (the
longest first). Plain helpers are in helpers.py."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def session_shm_dir() -> Path:
    """This test process's arena directory on tmpfs: what its runs leave in /dev/shm, and the actors that name it,
    are its own, whatever another test process beside it (pytest -n 2) or another run on the machine does there.
    Directories of test processes that are gone (killed: nothing removed them) are removed first."""
    base = Path(os.environ.get("MEGATRAIN_SHM_DIR") or "/dev/shm")
    base = base if base.is_dir() else Path("/tmp")
    for old in base.glob("mt-tests-*"):
        pid = old.name.removeprefix("mt-tests-")
        if pid.isdigit() and not Path("/proc", pid).exists():
            shutil.rmtree(old, ignore_errors=True)
    path = base / f"mt-tests-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


# Set before megatrain and torch load (pytest loads this file before the test modules), for this process, its
# subprocesses and every Ray actor (they inherit the environment). OMP_WAIT_POLICY: two test processes and their actors
# share CI's 2 cores, and OpenMP threads that spin after each parallel region (libgomp's default) hold a core another
# process waits for.
SHM_DIR = session_shm_dir()
os.environ["MEGATRAIN_SHM_DIR"] = str(SHM_DIR)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray's log monitor lists its log directory for new files every 0.1 s while it holds fewer than this many; a test run
# leaves the logs of ~150 dead actor processes in each Ray, and the listing is then about half the monitor's CPU.
# At 0 it lists every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S): a new actor's first lines reach the driver that much later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# Ray's workers register serializers for Arrow tables and JSON options, which megatrain never passes through Ray (its
# batches are numpy arrays): off. tests/ray_site/sitecustomize.py, on PYTHONPATH for every process a test starts, keeps
# Ray's serializer add-ons from importing pyarrow and pydantic as well: ~0.28 CPU-s in each of the ~300 worker
# processes a test run starts.
os.environ.setdefault("RAY_DISABLE_CUSTOM_ARROW_DATA_SERIALIZATION", "1")
os.environ.setdefault("RAY_DISABLE_CUSTOM_ARROW_JSON_OPTIONS_SERIALIZATION", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent / "ray_site"),
                                                         os.environ.get("PYTHONPATH")]))

# Torch, Ray, transformers (helpers) and megatrain are imported where a fixture needs them, not here: with -n 2
# pytest-xdist's controller loads this file too, before it starts the two test processes, and runs no test (importing
# them here cost its start ~6 CPU-s while both cores waited).
import pytest


@pytest.fixture(autouse=True, scope="session")
def local_ray_environment() -> None:
    """Every Ray a test starts (the session's, a subprocess's, `ray start`, a test cluster's nodes) starts as the
    driver's private one does: subprocesses inherit the variables."""
    from pipelines import cluster

    cluster.local_ray_environment()


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # "local": a private Ray, also where `ray start` runs one (which ray.init() would join, refusing num_cpus)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True, scope="session")
def no_cached_calibration(tmp_path_factory: pytest.TempPathFactory):
    """Tests see no calibration of this machine (`megatrain calibrate` caches one in ~/.cache): what `plan` and
    `train` print must not depend on whether someone ran it here. Subprocesses inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRAIN_CALIBRATION", str(tmp_path_factory.mktemp("calibration") / "none.json"))
        yield


@pytest.fixture(autouse=True, scope="session")
def no_cached_self_checks(tmp_path_factory: pytest.TempPathFactory):
    """Tests read no self-check verdict a user cached (~/.cache/megatrain/self-check) and leave none there: the
    session has a cache of its own (megatrain/self_check.py). Subprocesses inherit the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("megatrain-cache")))
        yield


@pytest.fixture
def ray_env() -> Iterator[dict[str, str]]:
    """The environment of one test's Ray (helpers.private_ray_env: its own RAY_TMPDIR, its processes killed after)."""
    from helpers import private_ray_env

    with private_ray_env() as env:
        yield env


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private arena directory on tmpfs (MEGATRAIN_SHM_DIR for a command under test): what is left there is the
    test's alone, whatever other tests on the machine do in /dev/shm at the same time."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = base / f"mt-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fault_batches() -> list[torch.Tensor]:
    """The 20 batches of helpers.train_with_faults (the tiny preset's vocabulary)."""
    import torch
    from helpers import STEPS

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 64), generator=gen) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def micro_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, Path]]:
    """A 2-layer Llama for helpers.rows (HF's model, and the directory it is saved in)."""
    from helpers import micro_llama_config, saved_hf_model

    hf, directory = saved_hf_model(micro_llama_config(), tmp_path_factory, "micro")
    yield hf, directory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first (seconds in tests/durations.json; a file not there first of all, see
    tests/durations.py): with -n 2 each file runs whole in one process, handed out in this order (pyproject.toml's
    --dist loadfile --no-loadscope-reorder), and a long file handed out last leaves the other process's core idle
    while it runs."""
    from durations import file_order, read

    order = file_order({item.path.name for item in items}, read())
    items.sort(key=lambda item: -order[item.path.name])  # stable: each file's order kept


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
                            ) -> None:
    """Names the test files that ran and that tests/durations.json does not list (they ran first), and how to add
    them: from the tests' reports, which pytest-xdist's controller (which collects nothing itself) receives too."""
    from durations import read, unlisted

    reports = (r for outcome in terminalreporter.stats.values() for r in outcome if hasattr(r, "nodeid"))
    names = unlisted((Path(r.nodeid.split("::")[0]).name for r in reports if r.nodeid), read())
    if names:
        terminalreporter.write_line(f"not in tests/durations.json, so run first: {', '.join(names)} (add them: "
                                    "pytest FILES --junitxml=/tmp/j.xml && python3 tests/durations.py --merge "
                                    "/tmp/j.xml)")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SHM_DIR, ignore_errors=True)  # empty unless a test failed to clean up (its assertion said so)
