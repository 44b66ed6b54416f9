"""The NVMe tier's disk rates: `megatrain calibrate --nvme PATH` measures a directory's sequential read and write GB/s
with the tier's own direct I/O (megatrain/memory/nvme.py measure_rates) and caches them beside the calibration, by
directory; `megatrain plan` and the run's plan read them back (a step's disk share, megatrain/memory/tier_plan.py)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from megatrain.memory.nvme import check_directory, measure_rates
from megatrain.perf.calibrate import CACHE_ENV, Calibration

RATES_ENV = "MEGATRAIN_NVME_RATES"  # a file path: where the disk rates are cached (tests)
DEFAULT_BYTES = 4 << 30  # a multi-GB file: past the drive's own cache, as a step's traffic is


def cache_path() -> Path:
    if os.environ.get(RATES_ENV):
        return Path(os.environ[RATES_ENV])
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).with_suffix(".nvme.json")
    return Calibration.path("cpu").parent / f"nvme-{socket.gethostname()}.json"


def _read() -> dict[str, dict[str, float]]:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def calibrate_disk(directory: str | Path, nbytes: int = DEFAULT_BYTES, threads: int = 4) -> dict[str, float]:
    """Measures and caches `directory`'s (read, write) GB/s; returns the entry written."""
    check_directory(directory, nbytes)
    write, read = measure_rates(directory, nbytes, threads)
    entry = {"read_gbps": read, "write_gbps": write, "bytes": nbytes, "threads": threads, "created": time.time()}
    rates = _read()
    rates[os.path.realpath(directory)] = entry
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rates, indent=2))
    os.replace(tmp, path)  # a reader never sees half a file
    return entry


def disk_rates(directory: str | Path | None) -> tuple[float, float] | None:
    """The cached (read, write) GB/s of `directory`, None where it was not measured."""
    if not directory:
        return None
    entry = _read().get(os.path.realpath(directory))
    return None if entry is None else (entry["read_gbps"], entry["write_gbps"])
