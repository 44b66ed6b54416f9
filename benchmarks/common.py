"""What the benchmark scripts share: a plain-text table, host-memory sampling from /proc, a machine summary.

Memory is read from /proc (psutil is not a dependency). Two host numbers, both sampled while a peer runs:

  tree RSS   sum over the peer's process tree (Ray's daemons and actors included: they are descendants
             of the driver) of RssAnon + RssFile, plus the growth of /dev/shm since the peer started.
             Shared memory is counted once that way: summing each process's RssShmem would count the
             arena once for every actor that maps it. Shared-library pages are still counted once per
             process (a few hundred MB for each torch process), which overstates many-process peers.
  host used  MemTotal - MemAvailable of the whole machine, minus its value before the peer started:
             catches memory no per-process counter shows (pinned/page-locked host buffers) and
             anything else running on the machine at the time.
Both read O(1) kernel counters; /proc/PID/smaps_rollup (PSS) would be exact but walks page tables:
~60 ms per process per 4 GiB mapped, which on a 45 GB arena mapped by ten actors would steal seconds
of CPU per sample from the run being measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from megatrain.memory.arena import proc_stat

GiB = 2**30
REPO = Path(__file__).resolve().parents[1]


def pythonpath_with_repo(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH with the repository first: Ray's workers import megatrain's actors by module name."""
    rest = (env if env is not None else os.environ).get("PYTHONPATH")
    return os.pathsep.join(filter(None, [str(REPO), rest]))


# ---- a plain-text table ----

def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """First column left-aligned, the others right-aligned; one space-padded line per row."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        out = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in pairs]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def fmt(value: float | None, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def gib(nbytes: float | None, missing: str = "-") -> str:
    return fmt(None if nbytes is None else nbytes / GiB, ".2f", missing)


# ---- /proc ----

def _parent_map() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    parents = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = proc_stat(entry.name)
        if stat is not None:  # else it exited while we looked
            parents[int(entry.name)] = int(stat[1])
    return parents


def process_tree(root: int) -> list[int]:
    """root and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_map().items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):  # gone, or a kernel thread without Rss* lines
        pass
    return out


def tree_private_rss(root: int) -> int:
    """Sum of RssAnon + RssFile (bytes) over root's process tree; shared memory is left to shm_used()."""
    total = 0
    for pid in process_tree(root):
        kib = _status_kib(pid, ("RssAnon", "RssFile"))
        total += (kib.get("RssAnon", 0) + kib.get("RssFile", 0)) * 1024
    return total


def shm_used(directory: str = "/dev/shm") -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def host_used() -> int:
    return meminfo("MemTotal") - meminfo("MemAvailable")


@dataclass
class MemoryPeaks:
    tree_rss: int = 0  # bytes: see the module docstring
    host_used: int = 0  # bytes above the machine's use when sampling began


class MemorySampler:
    """Samples a process tree's host memory every `interval` seconds on a thread; keeps the peaks."""

    def __init__(self, root_pid: int, interval: float = 0.2):
        self.root_pid, self.interval = root_pid, interval
        self.peaks = MemoryPeaks()
        self._shm0, self._used0 = shm_used(), host_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        tree = tree_private_rss(self.root_pid) + max(0, shm_used() - self._shm0)
        self.peaks.tree_rss = max(self.peaks.tree_rss, tree)
        self.peaks.host_used = max(self.peaks.host_used, host_used() - self._used0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> MemoryPeaks:
        self._stop.set()
        self._thread.join()
        return self.peaks


# ---- the machine ----

def gpu_names() -> list[str]:
    """GPU names from nvidia-smi, without creating a CUDA context in this process (empty when none)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine_summary() -> str:
    import torch

    from pipelines.doctor import cpu_model

    gpus = gpu_names()
    gpu = ", ".join(gpus) if gpus else "no GPU"
    return (f"{cpu_model()}, {os.cpu_count()} cores, {meminfo('MemTotal') / GiB:.0f} GiB RAM, {gpu}; "
            f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
