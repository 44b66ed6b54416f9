"""The NVMe tier: state files on a local disk, moved with direct I/O to and from the arena, no Ray.

One file per kind of state the plan puts on NVMe, laid out element for element as its arena segment; the arena is the
staging buffer, so only the units in flight hold RAM. Direct I/O because the page cache would quietly hold what the
tier takes out of RAM (docs/design.md#the-nvme-tier)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.config import MegatrainError
from megatrain.memory.arena import PREFIX, parse_owner, process_start_time

log = logging.getLogger(__name__)

STATE_KINDS = ("params", "exp_avg", "exp_avg_sq", "grads")  # the arena's segment names of what may live on NVMe
# filesystems that keep their files in memory (tmpfs even accepts O_DIRECT): a tier there saves nothing
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "rootfs"})
CHUNK = 4 << 20  # bytes of one request: large enough to stream, small enough to spread a unit over the threads
MAX_ALIGN = 4096  # unit and shard ranges are 4 KiB aligned; a disk that needs more cannot take them directly
_STATX_DIOALIGN = 0x2000
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@dataclass(frozen=True)
class DiskCheck:
    """What a directory offers the tier: its filesystem, direct I/O alignment (memory, file offset) and free bytes."""

    path: str
    fs_type: str
    mem_align: int
    offset_align: int
    free_bytes: int


def filesystem_type(path: str | Path) -> str:
    """The type of the filesystem holding `path`, from the longest mount point above it in /proc/self/mountinfo."""
    real, best, fs = os.path.realpath(path), "", "unknown"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount = fields[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fs = mount, fields[fields.index("-") + 1]
    return fs


def dio_alignment(path: str | Path) -> tuple[int, int] | None:
    """(memory, file offset) alignment of direct I/O on `path` from statx(STATX_DIOALIGN); None where the kernel or
    filesystem does not say."""
    buf = ctypes.create_string_buffer(256)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.statx(-100, os.fsencode(str(path)), 0, _STATX_DIOALIGN, buf)  # -100: AT_FDCWD
    except (AttributeError, OSError):
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    if rc != 0 or not mask & _STATX_DIOALIGN:
        return None
    mem, offset = int.from_bytes(buf.raw[152:156], "little"), int.from_bytes(buf.raw[156:160], "little")
    return (mem, offset) if offset else None


def check_directory(path: str | Path, need_bytes: int = 0) -> DiskCheck:
    """The directory's fitness for the tier, or one sentence why not: not a directory, a filesystem in memory, no
    direct I/O (or an alignment above 4 KiB), or fewer than `need_bytes` free."""
    path = Path(path)
    if not path.is_dir():
        raise MegatrainError(f"the NVMe directory {path} does not exist (or is not a directory); create it or pass "
                             "another --nvme path.")
    fs = filesystem_type(path)
    if fs in MEMORY_FILESYSTEMS:
        raise MegatrainError(f"{path} is on {fs}, which keeps its files in RAM: the NVMe tier would save no memory "
                             "there, so pass a directory on a local disk (ext4, xfs, ...) as --nvme.")
    align = dio_alignment(path) or _probe_direct_io(path)
    if align[1] > MAX_ALIGN or align[0] > MAX_ALIGN:
        raise MegatrainError(f"direct I/O on {path} needs {align[1]}-byte aligned requests, more than the 4 KiB "
                             "megatrain's ranges are aligned to; pass a directory on another filesystem.")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise MegatrainError(f"{path} has {free / 2**30:.1f} GiB free and the NVMe tier needs "
                             f"{need_bytes / 2**30:.1f} GiB; free space there or put fewer states on NVMe.")
    return DiskCheck(str(path), fs, align[0], align[1], free)


def _probe_direct_io(path: Path) -> tuple[int, int]:
    """Opens a scratch file with O_DIRECT and writes 4 KiB: where that fails the directory takes no direct I/O."""
    probe = path / f".{PREFIX}-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    buf = aligned_buffer(MAX_ALIGN, zeroed=True)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [_bytes(buf)], 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise MegatrainError(f"{path} does not take direct I/O ({os.strerror(e.errno or 0)}), which the NVMe tier "
                             "needs so the page cache does not hold its states in RAM; pass another --nvme path."
                             ) from None
    finally:
        probe.unlink(missing_ok=True)
    return MAX_ALIGN, MAX_ALIGN


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (the arena's mapping, for preadv/pwritev)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


@dataclass(frozen=True)
class TierHandle:
    """What another process needs to open a run's state files: small and picklable, so Ray passes it around."""

    run_id: str
    owner_pid: int
    owner_start: int
    root: str
    files: tuple[tuple[str, int], ...]  # (kind, bytes)
    from_unit: int = 0  # the units before it keep their states in the arena (resident on the executor's device)

    @property
    def directory(self) -> Path:
        return Path(self.root) / f"{PREFIX}-{self.run_id}-{self.owner_pid}-{self.owner_start}"

    def path(self, kind: str) -> Path:
        return self.directory / f"{kind}.bin"

    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.files)

    def nbytes(self) -> int:
        return sum(n for _, n in self.files)


class StateFiles:
    """A run's state files, read and written with direct I/O in CHUNK-sized requests from `threads` threads."""

    def __init__(self, handle: TierHandle, owner: bool, threads: int = 4):
        self.handle, self.owner = handle, owner
        self.fds: dict[str, int] = {}
        try:
            for kind, nbytes in handle.files:
                self.fds[kind] = _open_state(handle.path(kind), nbytes)
        except BaseException:
            self.close()
            raise
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme")

    @classmethod
    def create(cls, root: str | Path, sizes: dict[str, int], run_id: str | None = None, threads: int = 4,
               from_unit: int = 0) -> StateFiles:
        """Checks `root`, removes stale runs' files there and creates one zero-filled file per kind of `sizes` (bytes,
        rounded up to 4 KiB): the calling process becomes the owner that removes them."""
        root = Path(root)
        remove_stale_state_dirs(root)
        sizes = {kind: -(-n // MAX_ALIGN) * MAX_ALIGN for kind, n in sizes.items()}
        check_directory(root, sum(sizes.values()))
        pid = os.getpid()
        handle = TierHandle(run_id or uuid.uuid4().hex[:12], pid, process_start_time(pid) or 0, str(root),
                            tuple(sizes.items()), from_unit)
        handle.directory.mkdir(mode=0o700)
        try:
            for kind, nbytes in handle.files:
                fd = os.open(handle.path(kind), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    if nbytes:  # blocks reserved now: a full disk says so here, not in a write mid-step
                        os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
        except OSError as e:
            shutil.rmtree(handle.directory, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                raise MegatrainError(f"{root} ran out of space while reserving the {handle.nbytes() / 2**30:.1f} GiB "
                                     "of the NVMe tier's state files; free space there or put fewer states on NVMe."
                                     ) from None
            raise
        return cls(handle, owner=True, threads=threads)

    @classmethod
    def open(cls, handle: TierHandle, threads: int = 4) -> StateFiles:
        return cls(handle, owner=False, threads=threads)

    # ---- moving bytes ----
    def read(self, kind: str, offset: int, dest: torch.Tensor) -> Future:
        """Reads dest.nbytes bytes from byte `offset` of kind's file into `dest` (contiguous, 4 KiB aligned)."""
        return self._submit(kind, offset, dest, os.preadv)

    def write(self, kind: str, offset: int, src: torch.Tensor) -> Future:
        """Writes `src` (contiguous, 4 KiB aligned) at byte `offset` of kind's file."""
        return self._submit(kind, offset, src, os.pwritev)

    def _submit(self, kind: str, offset: int, t: torch.Tensor, io: Callable) -> Future:
        nbytes = t.numel() * t.element_size()
        if offset % MAX_ALIGN or nbytes % MAX_ALIGN or t.data_ptr() % MAX_ALIGN or not t.is_contiguous():
            raise ValueError(f"unaligned NVMe request: {kind} at {offset}, {nbytes} B, address {t.data_ptr():#x}")
        if offset + nbytes > dict(self.handle.files)[kind]:
            raise ValueError(f"NVMe request past the end of the {kind} file: {offset} + {nbytes}")
        fd, view = self.fds[kind], _bytes(t.reshape(-1))
        parts = [self.pool.submit(self._chunk, kind, fd, io, view[a:a + CHUNK], offset + a)
                 for a in range(0, nbytes, CHUNK)]
        return all_of(parts)

    def _chunk(self, kind: str, fd: int, io: Callable, view: memoryview, offset: int) -> None:
        what = "read" if io is os.preadv else "write"
        try:
            if os.fstat(fd).st_nlink == 0:
                raise MegatrainError(f"the NVMe state file {self.handle.path(kind)} is gone (removed while the run "
                                     "was using it); restart the run from its last checkpoint.")
            done = io(fd, [view], offset)
        except OSError as e:
            raise MegatrainError(f"{what} of the NVMe state file {self.handle.path(kind)} failed at byte {offset} "
                                 f"({os.strerror(e.errno or 0)}); restart the run from its last checkpoint.") from None
        if done != len(view):
            raise MegatrainError(f"the NVMe state file {self.handle.path(kind)} is torn: a {what} at byte {offset} "
                                 f"moved {done} of {len(view)} bytes; restart the run from its last checkpoint.")

    # ---- lifetime ----
    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def zero(self, kind: str | None = None) -> None:
        """Every file (`kind`'s) back to zeros (the moments before the first step), without writing them."""
        for name, nbytes in self.handle.files:
            if nbytes and kind in (None, name):
                punch_out(self.handle.path(name), 0, nbytes)

    def unlink(self) -> None:
        shutil.rmtree(self.handle.directory, ignore_errors=True)

    def destroy(self) -> None:
        self.close()
        if self.owner:
            self.unlink()


def _open_state(path: Path, nbytes: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except FileNotFoundError:
        raise MegatrainError(f"the NVMe state file {path} is gone (its run exited or was cleaned up); restart the "
                             "run (or resume from a checkpoint).") from None
    size = os.fstat(fd).st_size
    if size != nbytes:
        os.close(fd)
        raise MegatrainError(f"the NVMe state file {path} is torn: {size} bytes where the run wrote {nbytes}; "
                             "restart the run from its last checkpoint.")
    return fd


def all_of(parts: list[Future], then: Callable[[], None] | None = None) -> Future:
    """One future for `parts`, done once all are (after `then` has run), failed with the first error among them."""
    if not parts:
        done: Future = Future()
        done.set_result(None)
        parts = [done]
    outer: Future = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        error = next((p.exception() for p in parts if p.exception() is not None), None)
        if error is None and then is not None:
            try:
                then()
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
                error = e
        if error is None:
            outer.set_result(None)
        else:
            outer.set_exception(error)

    for p in parts:
        p.add_done_callback(one_done)
    return outer


# ---- stale runs ----
def list_state_dirs(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and parse_owner(p.name, segment=False) is not None)


def remove_stale_state_dirs(root: str | Path, everything: bool = False) -> list[Path]:
    """Removes the state directories under `root` whose owner process is gone (all of megatrain's: everything)."""
    removed = []
    for path in list_state_dirs(root):
        pid, start = parse_owner(path.name, segment=False) or (0, 0)
        if everything or process_start_time(pid) != start:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d stale NVMe state director%s from %s", len(removed), "y" if len(removed) == 1 else "ies",
                 root)
    return removed


# ---- the arena as staging ----
def punch_out(path: str | Path, offset: int, nbytes: int) -> None:
    """Gives the pages of [offset, offset + nbytes) of a /dev/shm file back to the system (every mapping of them then
    reads zeros): what the tier sent to disk stops holding RAM."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        rc = libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_long(offset),
                            ctypes.c_long(nbytes))
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"punching {nbytes} B out of {path}: {os.strerror(e)}")
    finally:
        os.close(fd)


def measure_rates(root: str | Path, nbytes: int, threads: int = 4) -> tuple[float, float]:
    """Sequential (write, read) GB/s of the tier's own I/O on `root`: a file of `nbytes` written then read back in
    CHUNK requests from `threads` threads, direct I/O; the file is removed after."""
    nbytes = max(MAX_ALIGN, nbytes // MAX_ALIGN * MAX_ALIGN)
    files = StateFiles.create(root, {"probe": nbytes}, run_id="rate", threads=threads)
    try:
        buf = aligned_buffer(min(nbytes, 256 << 20))
        torch.randint(0, 255, (buf.numel(),), dtype=torch.uint8, out=buf)
        rates = []
        for io in (files.write, files.read):
            t0 = time.perf_counter()
            futures = [io("probe", at, buf[: min(buf.numel(), nbytes - at)]) for at in range(0, nbytes, buf.numel())]
            for f in futures:
                f.result()
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        return rates[0], rates[1]
    finally:
        files.destroy()


def aligned_buffer(nbytes: int, zeroed: bool = False) -> torch.Tensor:
    """A byte buffer (`zeroed`) of `nbytes` rounded up to the direct I/O alignment, at an aligned address."""
    size = -(-nbytes // MAX_ALIGN) * MAX_ALIGN
    raw = (torch.zeros if zeroed else torch.empty)(size + MAX_ALIGN, dtype=torch.uint8)
    at = (-raw.data_ptr()) % MAX_ALIGN
    return raw[at : at + size]


def wait_all(futures: Iterable[Future]) -> None:
    for f in futures:
        f.result()


# ---- what a run puts on NVMe ----
# nvme_states names (megatrain/memory/tier_plan.py KINDS): the fp32 masters only where the executor streams a bf16 copy
# of them (resolve_tier)
KINDS = {"master": ("params",), "moments": ("exp_avg", "exp_avg_sq"), "grads": ("grads",)}


@dataclass(frozen=True)
class TierSpec:
    """A run's NVMe tier as resolved: the directory, the arena segments whose states live there, and the first unit
    they do for (the units before it are resident on the executor's device, their states loaded from the arena)."""

    root: str
    names: tuple[str, ...]  # the nvme_states (megatrain/memory/tier_plan.py KINDS)
    kinds: tuple[str, ...]
    from_unit: int = 0
    threads: int = 4


def resolve_tier(nvme: str | None, names: tuple[str, ...], resident_units: int = 0,
                 lora: bool = False, grads: str = "arena", copy: bool = True) -> TierSpec | None:
    """The run's tier of the nvme_states the plan placed (`names`; what this build cannot place, the memory plan's
    check refuses: megatrain/memory/tier_plan.py TierPlan.problem), or one sentence why not here. grads: where the
    gradients wait (EngineConfig.grads, resolved): only those held in the arena go to disk, a ring's or the device's
    leave as they are read. copy: the executor streams a bf16 copy of the weights (bf16 precision, in the arena),
    which the optimizer writes beside each update: the masters then need not be in the arena."""
    if not nvme or not names:
        return None
    if lora:
        raise MegatrainError("a LoRA run's trained states are small: the NVMe tier is for a whole model's; drop "
                             "--nvme (the frozen base streams from host memory).")
    if "master" in names and not copy:
        raise MegatrainError("the fp32 master weights cannot live on NVMe in this run: the executor streams them "
                             "from host memory, as there is no bf16 copy to stream instead (precision fp32/tf32, or "
                             "bf16_copy none); set precision = \"bf16\" with bf16_copy = \"keep\", or leave master "
                             "out of nvme_states.")
    check_directory(nvme)
    kinds = tuple(k for n in names for k in KINDS[n] if k != "grads" or grads == "arena")
    return TierSpec(str(Path(nvme).resolve()), names, kinds, resident_units) if kinds else None
