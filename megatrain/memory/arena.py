"""The host arena: the model's fp32 params, grads and Adam moments in files under /dev/shm.

Every process that works on the model maps the same files (torch.from_file(shared=True)), so a write in one is a read
in all, with no copies and no Ray serialisation; the executor registers them for fast copies. Why files, and how a
killed run's segments are told apart: docs/design.md#the-arena."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain.config import MegatrainError

log = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("MEGATRAIN_SHM_DIR", "/dev/shm"))
PREFIX = "megatrain"

# name -> dtype of the segments an arena holds; sizes come from the handle
FP32_SEGMENTS = ("params", "grads", "exp_avg", "exp_avg_sq")
# bf16 runs: the weights rounded to bf16, written by the optimizer beside each update, so that the GPU
# loads 2 B/param instead of 4
BF16_COPY_SEGMENT = "params_bf16"
# a LoRA run: the frozen base (ModelLayout.frozen), in the precision it is stored in (bf16 or fp32), read by the
# executor and never written after loading; params, grads and the moments then hold the adapters alone
FROZEN_SEGMENT = "frozen"
# GRPO's KL reference: the initial weights in a segment of their own (megatrain/memory/post_plan.py)
REFERENCE_SEGMENT = "reference"


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...; field n is [n - 3]), None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its closing one
    return stat.rsplit(")", 1)[1].split()


def process_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else int(fields[19])


@dataclass(frozen=True)
class ArenaHandle:
    """What another process needs to map the arena: small and picklable, so Ray passes it around."""

    run_id: str
    owner_pid: int
    owner_start: int
    directory: str
    segments: tuple[tuple[str, str, int], ...]  # (name, dtype name, numel)
    tier: Any = None  # the run's NVMe state files (megatrain/memory/nvme.py TierHandle), None without a tier

    def path(self, segment: str) -> Path:
        return Path(self.directory) / f"{PREFIX}-{self.run_id}-{self.owner_pid}-{self.owner_start}-{segment}"

    def nbytes(self) -> int:
        return sum(numel * torch.empty((), dtype=getattr(torch, dt)).element_size() for _, dt, numel in self.segments)


class Arena:
    """Maps an arena's segments as flat tensors: arena.params, arena.grads, arena.exp_avg, ..."""

    def __init__(self, handle: ArenaHandle, tensors: dict[str, torch.Tensor], owner: bool):
        self.handle = handle
        self.tensors = tensors
        self.owner = owner
        self._registered: list[int] = []

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @classmethod
    def create(cls, numel: int, run_id: str | None = None, directory: Path | str | None = None,
               extra_segments: tuple[tuple[str, str, int], ...] = (), grads_numel: int | None = None,
               moments_numel: int | None = None, sparse: tuple[str, ...] = ()) -> Arena:
        """Creates and zero-fills the segments (params of `numel` elements, grads of `grads_numel` and each Adam
        moment of `moments_numel`, both by default `numel`); the calling process becomes the owner that unlinks
        them. Segments named in `sparse` take no pages until touched: the NVMe tier stages their states there unit
        by unit (megatrain/memory/staging.py)."""
        sizes = {"grads": grads_numel, "exp_avg": moments_numel, "exp_avg_sq": moments_numel}
        directory = Path(directory or SHM_DIR)
        remove_stale_segments(directory)
        pid = os.getpid()
        handle = ArenaHandle(
            run_id=run_id or uuid.uuid4().hex[:12],
            owner_pid=pid,
            owner_start=process_start_time(pid) or 0,
            directory=str(directory),
            segments=tuple((name, "float32", numel if sizes.get(name) is None else sizes[name])
                           for name in FP32_SEGMENTS) + tuple(extra_segments),
        )
        created: list[Path] = []
        try:
            for name, dtype, n in handle.segments:
                path = handle.path(name)
                nbytes = n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created.append(path)
                try:
                    # Reserve the pages now: tmpfs answers a full /dev/shm here with ENOSPC instead of
                    # a SIGBUS at some later first touch.
                    if nbytes and name in sparse:
                        os.ftruncate(fd, nbytes)
                    elif nbytes:
                        os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
        except OSError as e:
            for path in created:
                path.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise MegatrainError(
                    f"{directory} ran out of space while allocating the {handle.nbytes() / 2**30:.1f} GiB arena; "
                    "free shared memory (megatrain cleanup), enlarge /dev/shm, or train a smaller model."
                ) from None
            raise
        return cls(handle, _map(handle), owner=True)

    @classmethod
    def open(cls, handle: ArenaHandle) -> Arena:
        """Maps an existing arena by its handle (from any process on this host)."""
        missing = [name for name, _, _ in handle.segments if not handle.path(name).exists()]
        if missing:
            raise MegatrainError(
                f"arena {handle.run_id} has no segment(s) {', '.join(missing)} in {handle.directory}; "
                "its owner has exited or it was cleaned up, so restart the run (or resume from a checkpoint)."
            )
        return cls(handle, _map(handle), owner=False)

    def register_cuda(self, names: tuple[str, ...] = ("params", "grads")) -> bool:
        """Page-locks segments for fast DMA; on failure warns and leaves them pageable (~7x slower H2D)."""
        if not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        ok = True
        for name in names:
            t = self.tensors[name]
            if t.data_ptr() in self._registered or t.numel() == 0:
                continue
            rc = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(rc) != 0:
                _clear_last_cuda_error()
                ok = False
                log.warning("cudaHostRegister of arena segment %s (%.2f GiB) failed (CUDA error %d: %s); copies "
                            "from it run pageable, about 7x slower (is page-locked memory limited here? see "
                            "`ulimit -l` and the container's memlock limit).",
                            name, t.numel() * t.element_size() / 2**30, int(rc), cudart.cudaGetErrorString(rc))
            else:
                self._registered.append(t.data_ptr())
        return ok

    def close(self) -> None:
        if self._registered and torch.cuda.is_available():
            torch.cuda.synchronize()  # no copy may still be reading or writing pages about to be unpinned
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
        self._registered.clear()
        self.tensors = {}

    def unlink(self) -> None:
        """Removes the segment files; mappings stay valid until each process drops them."""
        for name, _, _ in self.handle.segments:
            self.handle.path(name).unlink(missing_ok=True)

    def destroy(self) -> None:
        self.close()
        if self.owner:
            self.unlink()


def _clear_last_cuda_error() -> None:
    """Resets this thread's "last CUDA error" after a failed cudaHostRegister. Left set, torch's check after the
    next kernel launch would raise it as that kernel's failure, turning a warned-about slow path into a crash.
    torch's cudart bindings have no cudaGetLastError, so it is called in the libcudart torch has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path is None:
            raise OSError("no libcudart.so is mapped in this process")
        ctypes.CDLL(path).cudaGetLastError()
    except OSError as e:
        log.warning("could not reset the CUDA error of the failed cudaHostRegister (%s); the next kernel may "
                    "report it.", e)


def _map(handle: ArenaHandle) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, dtype, numel in handle.segments:
        if numel == 0:
            tensors[name] = torch.empty(0, dtype=getattr(torch, dtype))
            continue
        tensors[name] = torch.from_file(str(handle.path(name)), shared=True, size=numel, dtype=getattr(torch, dtype))
    return tensors


def parse_owner(name: str, segment: bool = True) -> tuple[int, int] | None:
    """(pid, start time) of the process that owns a file named PREFIX-run_id-pid-start-segment (an arena segment), or
    with segment=False PREFIX-run_id-pid-start (the NVMe tier's state directory); None for any other name. Read from
    the right, since a user's run id may contain dashes."""
    parts = name.split("-")
    tail = 1 if segment else 0
    if len(parts) < 4 + tail or parts[0] != PREFIX:
        return None
    try:
        return int(parts[-2 - tail]), int(parts[-1 - tail])
    except ValueError:
        return None


def list_segments(directory: Path | str | None = None) -> list[Path]:
    directory = Path(directory or SHM_DIR)
    if not directory.is_dir():
        return []
    # only names an arena writes (prefix-run-pid-start-segment): never someone else's megatrain-* file
    return sorted(p for p in directory.iterdir()
                  if p.name.startswith(PREFIX + "-") and parse_owner(p.name) is not None and p.is_file())


def segment_owner_alive(path: Path) -> bool:
    owner = parse_owner(path.name)
    if owner is None:
        return False
    pid, start = owner
    return process_start_time(pid) == start


def remove_stale_segments(directory: Path | str | None = None, everything: bool = False) -> list[Path]:
    """Removes segments whose owner process is gone (or all of megatrain's with everything=True)."""
    removed = []
    for path in list_segments(directory):
        if everything or not segment_owner_alive(path):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    if removed:
        log.info("removed %d stale arena segment(s) from %s", len(removed), directory or SHM_DIR)
    return removed
