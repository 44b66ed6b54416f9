"""`megatrain doctor`: what to run first on a new machine; seconds, one line per check.

Each check is a plain function returning a Check: ok, warn, fail or skipped, what it found, and for all but
ok one sentence: what to do (warn, fail) or why it was not checked (skipped). run_checks runs them in order
and turns a check that raises into that check's failure, so one broken check never hides the others. On a
machine without a usable GPU the GPU checks are skipped, each saying why.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import resource
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatrain.config import OptimConfig
from megatrain.memory.arena import SHM_DIR, list_segments, segment_owner_alive
from megatrain.memory.plan import GiB, host_available
from megatrain.model.layout import ModelLayout
from megatrain.perf.calibrate import arena_copy_rates, config_for_params, fused_adamw_seconds

log = logging.getLogger(__name__)

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"
NVIDIA_VERSION = Path("/proc/driver/nvidia/version")
MIN_SHM = 1 * GiB  # below this not even a small model's arena and Ray's 256 MiB object store fit
NEEDS_GPU = "it needs a GPU, and there is none that torch can use here (see gpu)."
TOLERANCE = 1e-4  # relative: the GPU's fp32 loss and gradients against the CPU path's


@dataclass
class Check:
    name: str
    status: str  # OK, WARN, FAIL or SKIPPED
    value: str  # what was found
    advice: str = ""  # WARN and FAIL: what to do; SKIPPED: why it was not checked


# ---- what the machine is ----

def nvidia_driver() -> str | None:
    """The loaded NVIDIA kernel driver's version (None: none is loaded), read without creating a CUDA context."""
    try:
        text = NVIDIA_VERSION.read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d[\d.]*)", text)
    return m.group(1) if m else text.splitlines()[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (its longest mount point in /proc/mounts)."""
    path, best = path.resolve(), ("", "unknown")
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, kind, *_ = line.split()
        mount = mount.replace("\\040", " ")
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > len(best[0]):
            best = (mount, kind)
    return best[1]


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point: 64 MiB, 23.5 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n:.0f} B"


def limit_text(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else size_text(n)


# ---- the checks ----

def check_versions() -> Check:
    driver = nvidia_driver()
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    value = (f"torch {torch.__version__} ({build}), " + (f"NVIDIA driver {driver}" if driver else "no NVIDIA driver")
             + f", Python {platform.python_version()}, {platform.system()} {platform.release()}")
    if driver and not torch.version.cuda:
        return Check("versions", WARN, value, "this machine has an NVIDIA driver that torch cannot use: install a "
                                              "CUDA build of torch (https://pytorch.org/get-started/locally/).")
    return Check("versions", OK, value)


def check_gpu() -> Check:
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        value = (f"{props.name} (sm_{props.major}{props.minor}), {free / GiB:.1f} of {total / GiB:.1f} GiB free"
                 + (f"; {count} GPUs, megatrain uses cuda:0" if count > 1 else ""))
        if total - free > 2 * GiB:  # this process's context takes under 1 GiB: the rest is someone else's
            return Check("gpu", WARN, value, "another process holds GPU memory (nvidia-smi shows which): stop it, "
                                             "or plan for what is free (megatrain plan uses the free memory).")
        return Check("gpu", OK, value)
    driver = nvidia_driver()
    if driver is None:
        return Check("gpu", SKIPPED, "no GPU", "no NVIDIA driver is loaded (no /proc/driver/nvidia/version): a "
                                               "CPU-only machine, where megatrain trains on the CPU path.")
    if torch.version.cuda is None:
        return Check("gpu", SKIPPED, "no GPU", f"torch {torch.__version__} is a CPU-only build (see versions).")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return Check("gpu", FAIL, f"NVIDIA driver {driver} is loaded and torch is built for CUDA {torch.version.cuda}, "
                              "but torch.cuda.is_available() is False",
                 "check that nvidia-smi lists a GPU, that CUDA_VISIBLE_DEVICES "
                 f"({'unset' if visible is None else repr(visible)}) names it, and that the driver supports CUDA "
                 f"{torch.version.cuda} (else update the driver or install a torch build for its CUDA).")


def check_host() -> Check:
    cores, usable = os.cpu_count() or 1, len(os.sched_getaffinity(0))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Check("host", OK, f"{cpu_model()}, {usable} cores" + (f" usable of {cores}" if usable < cores else "")
                 + f", {size_text(total)} memory, {size_text(host_available())} available")


def check_shm(directory: Path | str | None = None) -> Check:
    directory = Path(directory or SHM_DIR)
    if not directory.is_dir():
        return Check("shm", FAIL, f"{directory} does not exist",
                     "the arena lives in shared memory: mount a tmpfs there (mount -t tmpfs -o size=64G tmpfs "
                     f"{directory}) or point MEGATRAIN_SHM_DIR at one.")
    st = os.statvfs(directory)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    kind = fs_type(directory)
    params = free / 16
    value = (f"{directory}: {kind}, {size_text(size)}, {size_text(free)} free (an arena of up to "
             + (f"{params / 1e9:.2f} G" if params >= 1e8 else f"{params / 1e6:.1f} M") + " params at 16 B/param)")
    stale = [p for p in list_segments(directory) if not segment_owner_alive(p)]
    if stale:
        value += f"; {len(stale)} segment(s) of dead runs"
    if free < MIN_SHM:
        return Check("shm", FAIL, value, "enlarge it to about the host's memory (docker run --shm-size=...; "
                                         f"elsewhere mount -o remount,size=...G {directory}) and remove what is "
                                         "left there by killed runs (megatrain cleanup).")
    if stale:
        return Check("shm", WARN, value, "megatrain cleanup removes the segments of runs whose process is gone.")
    if kind != "tmpfs":
        return Check("shm", WARN, value, "this is no tmpfs, so the arena may be written to disk: point "
                                         "MEGATRAIN_SHM_DIR at a tmpfs such as /dev/shm.")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size < host / 2:  # Linux's own default is half of memory; the largest models need most of it
        return Check("shm", WARN, value, f"it is smaller than half of the host's {host / GiB:.0f} GiB, so it, not "
                                         "memory, limits the model size: enlarge it (docker run --shm-size=...; "
                                         f"elsewhere mount -o remount,size=...G {directory}).")
    return Check("shm", OK, value)


def check_nvme(directory: str | None, nbytes: int = 256 << 20) -> Check:
    """The NVMe tier's directory: a filesystem on disk that takes direct I/O, its alignment, free space and the tier's
    own sequential read and write rates on a small file (`megatrain calibrate --nvme` measures a multi-GB one)."""
    from megatrain import MegatrainError
    from megatrain.memory.nvme import check_directory, measure_rates

    if not directory:
        return Check("nvme", SKIPPED, "no --nvme directory given", "megatrain doctor --nvme PATH checks one.")
    try:
        disk = check_directory(directory, nbytes)
    except MegatrainError as e:
        return Check("nvme", FAIL, str(directory), str(e))
    write, read = measure_rates(directory, nbytes)
    value = (f"{directory}: {disk.fs_type}, direct I/O aligned to {disk.offset_align} B (memory {disk.mem_align} B), "
             f"{size_text(disk.free_bytes)} free; direct I/O read {read:.2f} GB/s, write {write:.2f} GB/s "
             f"({size_text(nbytes)})")
    if min(read, write) < 0.5:
        return Check("nvme", WARN, value, "below 0.5 GB/s the states' traffic may bound the step: `megatrain plan "
                                          "--nvme PATH` predicts it; a local NVMe drive reads and writes 2-7 GB/s.")
    return Check("nvme", OK, value)


def check_memlock() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    value = f"ulimit -l: {limit_text(soft)} (hard limit {limit_text(hard)})"
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", OK, value)
    if not torch.cuda.is_available():
        return Check("memlock", OK, value + "; nothing is page-locked on the CPU path")
    return Check("memlock", WARN, value, "page-locking the arena may be refused under a finite limit: if the "
                                         "cudaHostRegister check fails, raise it (ulimit -l unlimited; docker run "
                                         "--ulimit memlock=-1).")


def check_host_register(mib: int = 64, repeats: int = 10) -> Check:
    if not torch.cuda.is_available():
        return Check("host_register", SKIPPED, "cudaHostRegister and copy rates not measured", NEEDS_GPU)
    rates = arena_copy_rates(mib * 2**20 // 4, repeats)
    pinned, pageable = statistics.median(rates.pinned.h2d), statistics.median(rates.pageable.h2d)
    value = (f"{mib} MiB /dev/shm segment, median GB/s: H2D {pinned:.1f}, D2H "
             f"{statistics.median(rates.pinned.d2h):.1f}, both at once {statistics.median(rates.pinned.both):.1f} "
             f"registered; H2D {pageable:.1f}, D2H {statistics.median(rates.pageable.d2h):.1f} pageable")
    if not rates.registered:
        return Check("host_register", FAIL, "cudaHostRegister failed (the warning above says CUDA's error); "
                     + value, "weights would cross PCIe at pageable speed: raise the memlock limit (ulimit -l "
                              "unlimited; docker run --ulimit memlock=-1) and check that /dev/shm is a tmpfs.")
    if pinned <= pageable:
        return Check("host_register", WARN, value, "registering brought no speed-up: check the GPU's PCIe link "
                                                   "(nvidia-smi -q, 'GPU Link Info') and that nothing else copies.")
    return Check("host_register", OK, value)


def check_optimizer(params: float = 16e6, repeats: int = 10) -> Check:
    layout = ModelLayout.build(config_for_params(params))
    threads = torch.get_num_threads()
    times = fused_adamw_seconds(layout, OptimConfig(), repeats, threads)
    best, median = layout.numel / min(times), layout.numel / statistics.median(times)
    # best is what the kernel can do here, median what it got beside whatever else runs on the cores
    return Check("optimizer", OK, f"fused AdamW, 1 process x {threads} threads, {repeats} updates of "
                                  f"{layout.numel / 1e6:.0f} M params: {best / 1e9:.2f} G params/s best, "
                                  f"{median / 1e9:.2f} median (a 7 G-param update: {7e9 / best:.1f} s at best)")


def tiny_step(device: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients (HF name -> tensor) of one fp32 step of the tiny preset (HF init, seed 0), no Ray."""
    from megatrain.api import from_pretrained

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with from_pretrained("tiny", device=device, precision="fp32", seed=0) as model:
        loss, grads = model.loss_and_grads(ids)
        return float(loss), {name: g.detach().cpu().clone() for name, g in grads.items()}


def relative_difference(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]
                        ) -> float:
    """The largest of |loss a - loss b| / |loss b| and, per gradient, max |a - b| / max |b|."""
    diffs = [abs(a[0] - b[0]) / max(abs(b[0]), 1e-30)]
    diffs += [float((a[1][k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in b[1].items()]
    return max(diffs)


def check_cpu_step() -> Check:
    first, second = tiny_step("cpu"), tiny_step("cpu")
    diff = relative_difference(second, first)
    value = (f"tiny model, 2 x 64 tokens: loss {first[0]:.4f}, {len(first[1])} gradients; a second run differs by "
             f"{diff:.1e} (relative)")
    finite = math.isfinite(first[0]) and all(bool(torch.isfinite(g).all()) for g in first[1].values())
    if not finite or diff > TOLERANCE:
        return Check("cpu_step", FAIL, value, "the CPU path is " + ("not finite" if not finite else "not repeatable")
                     + " here: rerun with `megatrain -v doctor` and report this output with the CPU model above.")
    return Check("cpu_step", OK, value)


def check_gpu_step() -> Check:
    if not torch.cuda.is_available():
        return Check("gpu_step", SKIPPED, "the tiny step on the GPU was not compared with the CPU path", NEEDS_GPU)
    cpu, gpu = tiny_step("cpu"), tiny_step("cuda")
    diff = relative_difference(gpu, cpu)
    value = (f"tiny model, fp32: loss {gpu[0]:.6f} on the GPU vs {cpu[0]:.6f} on the CPU; largest relative "
             f"difference over the loss and {len(cpu[1])} gradients {diff:.1e} (tolerance {TOLERANCE:g})")
    if not diff <= TOLERANCE:  # a NaN fails too
        return Check("gpu_step", FAIL, value, "the GPU path disagrees with the CPU path: run python -m pytest "
                                              "tests/test_gpu.py -m gpu and report its output with this one.")
    return Check("gpu_step", OK, value)


def check_ray(address: str | None = None) -> Check:
    import ray

    from pipelines.cluster import init_ray, resolve_address

    started = not ray.is_initialized()
    try:
        resolve_address(address)  # a dead address: one sentence at once, not Ray's minutes of retrying
        init_ray(address)
        res = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    except Exception as e:  # noqa: BLE001 - reported as this check's failure
        if address:
            return Check("ray", FAIL, f"ray {ray.__version__} could not join {address}: {e}",
                         "start the cluster there (ray start --head) or see what it says (ray status); --address "
                         "auto joins the one running on this machine.")
        return Check("ray", FAIL, f"ray {ray.__version__}: Ray did not start: {e}",
                     "read Ray's logs in /tmp/ray/session_latest/logs; megatrain cleanup stops the agents of "
                     "killed runs.")
    finally:
        if started:
            ray.shutdown()  # stops a local Ray started here; from a running cluster it only disconnects
    value = (f"ray {ray.__version__}" + (f" at {address}" if address else "") + f": {nodes} node(s), "
             f"{res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU, object store "
             f"{res.get('object_store_memory', 0) / GiB:.2f} GiB, memory {res.get('memory', 0) / GiB:.1f} GiB")
    if torch.cuda.is_available() and not res.get("GPU"):
        return Check("ray", WARN, value, "Ray sees no GPU although torch does: start Ray where CUDA_VISIBLE_DEVICES "
                                         "names the GPU, or pass ray start --num-gpus.")
    return Check("ray", OK, value)


# ---- running and printing ----

def run_checks(address: str | None = None, nvme: str | None = None) -> Iterator[Check]:
    """Every check in order, each as it finishes; Ray last, so that its processes disturb no timing."""
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("versions", check_versions), ("gpu", check_gpu), ("host", check_host), ("shm", check_shm),
        ("memlock", check_memlock), ("host_register", check_host_register), ("optimizer", check_optimizer),
        ("cpu_step", check_cpu_step), ("gpu_step", check_gpu_step), ("ray", lambda: check_ray(address)),
    ]
    if nvme:  # asked for: the NVMe tier's directory, after shared memory
        checks.insert(4, ("nvme", lambda: check_nvme(nvme)))
    for name, check in checks:
        try:
            result = check()
        except Exception as e:  # noqa: BLE001 - one check's failure, not the command's
            log.debug("check %s raised", name, exc_info=True)
            result = Check(name, FAIL, f"{type(e).__name__}: {e}", "the check itself failed: fix what the error "
                                                                   "names, or rerun with megatrain -v doctor and "
                                                                   "report it.")
        yield result


def render(check: Check, width: int = 110) -> str:
    head = f"{check.status:<8} {check.name:<14} "
    indent = " " * len(head)
    lines = textwrap.wrap(check.value, width, initial_indent=head, subsequent_indent=indent)
    if check.advice:
        label = "why: " if check.status == SKIPPED else "fix: "
        lines += textwrap.wrap(check.advice, width, initial_indent=indent + label,
                               subsequent_indent=indent + " " * len(label))
    return "\n".join(lines)


def main(address: str | None = None, as_json: bool = False, nvme: str | None = None) -> int:
    """Prints the checks (as JSON with as_json); 1 if any failed."""
    from megatrain import __version__

    t0 = time.perf_counter()
    if not as_json:
        print(f"megatrain doctor (megatrain {__version__})", flush=True)
    checks = []
    for check in run_checks(address, nvme):
        checks.append(check)
        if not as_json:
            print(render(check), flush=True)
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIPPED)}
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "counts": counts}, indent=2))
    else:
        print(f"{len(checks)} checks in {time.perf_counter() - t0:.0f} s: " + ", ".join(f"{n} {s}" for s, n in
                                                                                  counts.items()))
    return 1 if counts[FAIL] else 0
