"""Which Ray a run uses (`init_ray`), and where on it the run's actors go (`NodePlacement`).

As ray.init() decides it, except that a dead cluster is found by a quick TCP connect and a dead recorded cluster
falls back to a private local Ray; every actor of a node in one placement group pinned to it, the driver's node for
the arena (docs/design.md#which-ray-and-where-on-it). `reap_orphaned_ray_agents`: what a killed local Ray left."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray._common.utils import get_ray_address_file
from ray._private.state import available_resources_per_node
from ray._private.utils import read_ray_address
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megatrain.config import ConfigError, MegatrainError
from megatrain.memory.arena import proc_stat

log = logging.getLogger(__name__)

PROBE_SECONDS = 2.0  # a live GCS accepts a connection at once; a dead local one refuses at once
FREE_CPU_WAIT_SECONDS = 10.0  # actors killed just before (an earlier Engine's) release their CPUs soon
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its hex id
RESOURCE_UNITS = 10_000  # Ray counts a resource in 1/10000ths: a share is floored to them, or n shares
# of free/n could round up past what is free (3 x 0.6667 > 2) and never be granted
PRIVATE_HINT = "address='local' (--address local) starts a private one instead"


def local_ray_environment() -> None:
    """Settings for a local Ray about to be started here (its raylet reads the environment when it starts); a user's
    own value of either wins.

    RAY_memory_monitor_refresh_ms=0: Ray's memory monitor kills workers once the machine's used memory passes 95%,
    counting /dev/shm as used. The arena is most of host memory by design (a 9 G-param model takes ~115 of 125 GiB),
    and the memory plan has checked that it fits before allocating; a worker killed for it frees none of it (the arena
    outlives it), so the restarted one would be killed again.
    RAY_prestart_worker_first_driver=0: Ray prestarts an idle Python worker per CPU for the first driver, but each of
    megatrain's actors runs in a placement group bundle, for which the raylet starts a worker of its own (the
    prestarted ones stay idle through a run): each would cost about a CPU-second of imports while the run's actors
    start, and ~100 MB."""
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Joins the cluster `resolve_address` names, or starts a small private one sized for this machine."""
    if ray.is_initialized():
        return
    target, source = resolve_address(address)
    if target is not None:
        try:
            # the address as given, not `target`: Ray sends its auth token (~/.ray/auth_token) to a cluster it
            # finds itself (None, "auto": RAY_ADDRESS or the record, as resolved here) but not to a named address
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as e:  # e.g. this machine is not a node of that cluster
            raise MegatrainError(f"could not join the Ray cluster at {target} ({source}): "
                                 f"{str(e).splitlines()[0]}; run the driver on a node of it, or "
                                 f"{PRIVATE_HINT}.") from None
        log.info("joined the Ray cluster at %s (%s); %s", target, source, PRIVATE_HINT)
        return
    log.debug("starting a private local Ray (%s)", source)
    local_ray_environment()
    # address="local": Ray itself would otherwise join the cluster in RAY_ADDRESS or its record, and refuse
    # num_cpus there. The object store carries only token batches and control messages: keep it small (it
    # lives in /dev/shm).
    ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), object_store_memory=256 * 2**20,
             include_dashboard=False, log_to_driver=True, configure_logging=False)


def ray_record() -> Path:
    """Where `ray start` records the cluster that a plain `ray.init()` on this machine joins."""
    return Path(get_ray_address_file(None))  # RAY_TMPDIR/ray (default /tmp/ray)


def resolve_address(address: str | None) -> tuple[str | None, str]:
    """(host:port of the Ray cluster to join, or None to start a private local Ray; why), in Ray's order: an
    explicit address, else RAY_ADDRESS, else the record of `ray start` (docs/design.md#which-ray-and-where-on-it)."""
    given, source = address or None, "address"
    if given in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        given, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if given == "local":
        return None, f"{source} 'local'"
    if given is not None and given != "auto":
        if given.startswith("ray://"):
            raise ConfigError(f"{source} {given!r} is a Ray Client address, but megatrain's driver maps the arena "
                              "from its own node's /dev/shm and must run on a node of the cluster: run it on the "
                              "head node with address 'auto'.")
        if (why := unreachable(given)) is not None:
            raise MegatrainError(f"{source} {given!r} names a Ray cluster, but {why}; start the cluster there "
                                 "(ray start --head), or leave the address out to start a private Ray.")
        return given, f"from {source}"
    record, recorded = ray_record(), read_ray_address(None) or None
    if recorded is None:
        if given == "auto":
            raise MegatrainError(f"{source} 'auto' joins the cluster `ray start --head` runs on this machine, but "
                                 f"none is recorded in {record}; start one with `ray start --head`, or leave the "
                                 "address out to start a private Ray.")
        return None, f"no cluster recorded in {record}"
    if (why := unreachable(recorded)) is None:
        return recorded, f"the one `ray start` recorded in {record}"
    if given == "auto":
        raise MegatrainError(f"{source} 'auto' names the Ray cluster recorded in {record}, but {why}: it was "
                             "stopped or killed; start it again with `ray start --head`, or leave the address out "
                             "to start a private Ray.")
    log.warning("the Ray cluster recorded in %s is gone (%s; a `ray start` head that was stopped or killed): "
                "starting a private local Ray instead", record, why)
    return None, "the recorded cluster is gone"


def unreachable(address: str, timeout: float = PROBE_SECONDS) -> str | None:
    """Why nothing answers at host:port (a TCP connect to the GCS), or None if something does."""
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"nothing answers at {address} ({e.strerror or e})"
    return None


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"Ray address {address!r} is not host:port, 'auto' or 'local'; pass one of those.")
    return host.strip("[]"), int(port)  # [::1]:6379


# ---- one node ----

def driver_node() -> str:
    """The hex id of the Ray node this driver is connected to (whose /dev/shm it maps)."""
    return ray.get_runtime_context().get_node_id()


def node_resources(node_id: str) -> tuple[dict[str, float], dict[str, float]]:
    """(total, free) Ray resources of one live node. Ray's public calls sum the whole cluster; the per-node
    view of free resources is its developer API (ray._private.state)."""
    total = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), {})
    free = available_resources_per_node().get(node_id, {})
    return total, free


def run_nodes(driver: str, count: int) -> list[str]:
    """The hex ids of the `count` Ray nodes a run spans: the driver's first (its arena is the one the driver maps),
    then the other live nodes with CPUs, in Ray's order; too few fail in one sentence."""
    others = [n["NodeID"] for n in ray.nodes()
              if n["Alive"] and n["NodeID"] != driver and n["Resources"].get("CPU", 0) >= 1]
    if count > 1 + len(others):
        raise MegatrainError(f"nodes={count} asks for {count} Ray nodes but the cluster has {1 + len(others)} with "
                             f"CPUs ({describe_nodes(driver, False)}); join more hosts with `ray start --address "
                             f"<head>:6379`, or ask for fewer nodes.")
    return [driver, *others[: count - 1]]


def describe_nodes(node_id: str, gpu: bool) -> str:
    """What each live node has free of its CPUs (and GPUs, if asked for or there are any), the run's node first."""
    free = available_resources_per_node()
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"] != node_id)
    kinds = ("CPU", "GPU") if gpu or any(n["Resources"].get("GPU") for n in nodes) else ("CPU",)
    parts = []
    for n in nodes:
        have = " and ".join(f"{free.get(n['NodeID'], {}).get(r, 0.0):g} of {n['Resources'].get(r, 0.0):g} {r}"
                            for r in kinds)
        parts.append(f"{'the driver node' if n['NodeID'] == node_id else 'node'} {n['NodeID'][:8]} has {have} free")
    return "; ".join(parts)


@dataclass
class NodePlacement:
    """The placement group of one run: bundle i holds optimizer worker i's CPUs, the last bundles the GPUs (one per
    executor)."""

    node_id: str
    group: PlacementGroup
    workers: int
    worker_cpus: float  # Ray CPUs reserved by each worker (its bundle)
    worker_threads: int
    gpu: bool

    @classmethod
    def reserve(cls, node_id: str, workers: int, gpu: bool, timeout: float, name: str = "", executors: int = 1
                ) -> NodePlacement:
        """Shares the node's free CPUs out among `workers` and reserves them (and a GPU per executor), or fails in
        one sentence after `timeout` seconds, saying what was asked and what the nodes have."""
        driver = node_id == driver_node()
        where = "the driver's node" if driver else f"node {node_id[:8]}"
        deadline = time.monotonic() + FREE_CPU_WAIT_SECONDS
        while (free := node_resources(node_id)[1].get("CPU", 0.0)) < 0.01 * workers and time.monotonic() < deadline:
            time.sleep(0.1)
        if free < 0.01 * workers:
            node = "the driver's Ray node" if driver else f"Ray node {node_id[:8]} of the run"
            raise MegatrainError(f"{node} has no free CPU for the {workers} optimizer worker(s) "
                                 f"({describe_nodes(node_id, gpu)}; other actors, e.g. another Engine, reserve them); "
                                 "shut those down first, or start Ray with more CPUs.")
        per_worker = free / workers
        threads = max(1, int(per_worker))
        cpus = math.floor(round(min(per_worker, threads) * RESOURCE_UNITS, 6)) / RESOURCE_UNITS
        bundles = [{"CPU": cpus}] * workers + ([{"GPU": 1.0}] * executors if gpu else [])
        group = placement_group(bundles, strategy="STRICT_PACK", name=name,
                                bundle_label_selector=[{NODE_ID_LABEL: node_id}] * len(bundles))
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            gpus = "a GPU" if executors == 1 else f"{executors} GPUs"
            asked = f"{cpus:g} CPU for each of {workers} optimizer worker(s)" + (f" and {gpus}" if gpu else "")
            raise MegatrainError(f"Ray did not grant the {asked} this run asked for on {where} within "
                                 f"{timeout:g} s ({describe_nodes(node_id, gpu)}); free them (another Engine or job "
                                 "holds them), or start Ray with more.") from None
        return cls(node_id, group, workers, cpus, threads, gpu)

    def _in(self, bundle: int) -> dict[str, Any]:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.group,
                                                                        placement_group_bundle_index=bundle)}

    def worker(self, index: int) -> dict[str, Any]:
        """Actor options of optimizer worker `index` (a replacement takes the same bundle)."""
        return {"num_cpus": self.worker_cpus, **self._in(index)}

    def executor(self, rank: int = 0) -> dict[str, Any]:
        """Options of executor `rank`, or of a task on its GPU (both declared num_cpus=0: the GPU bundle holds no
        CPU); on the CPU path executors reserve nothing."""
        return {"num_gpus": 1, **self._in(self.workers + rank)} if self.gpu else self.pinned()

    def pinned(self) -> dict[str, Any]:
        """Options of an actor that reserves no resources (num_cpus=0): on the run's node, beside the others."""
        return self._in(-1)

    @property
    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        return self.pinned()["scheduling_strategy"]

    def release(self) -> None:
        try:
            remove_placement_group(self.group)
        except Exception as e:  # noqa: BLE001 - Ray shut down already: the group went with it
            log.debug("placement group not removed (%s)", e)


def executor_device(device: str, on_gpu: bool) -> str:
    """The device the executor actor computes on, decided by the driver. Inside the actor Ray has set
    CUDA_VISIBLE_DEVICES to the one GPU it granted, so "cuda:1" would name a GPU the actor cannot see; without a
    granted GPU, "auto" must not compute on a GPU the run never reserved. cpu-async[:SEED] is the CPU."""
    if on_gpu:
        return "cuda"
    return device if device.startswith("cpu-async") else "cpu"


# ---- what a killed run left ----

RAY_AGENTS = (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")


def reap_orphaned_ray_agents() -> list[int]:
    """Kills Ray agent processes left behind by a local Ray whose driver was SIGKILLed.

    Their raylet is gone, so they were re-parented to init (ppid 1); a live cluster's agents are children
    of its raylet and are never touched. Only this user's processes are considered, of a Ray under this
    process's RAY_TMPDIR (Ray's temp root, as the killed run had it): another temp root is another setup's,
    e.g. a test's private Ray beside this one.
    """
    killed = []
    tmpdir = os.environ.get("RAY_TMPDIR", "").encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != os.getuid() or not (proc / "cmdline").read_bytes().startswith(RAY_AGENTS):
                continue
            if environment_value(proc / "environ", b"RAY_TMPDIR") != tmpdir:
                continue
            stat = proc_stat(proc.name)
            if stat is not None and int(stat[1]) == 1:  # ppid
                os.kill(int(proc.name), 9)
                killed.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    if killed:
        log.info("removed %d orphaned Ray agent process(es) of a killed run", len(killed))
    return killed


def environment_value(environ: Path, name: bytes) -> bytes:
    """`name`'s value in a /proc/PID/environ file (b"" where unset)."""
    for entry in environ.read_bytes().split(b"\0"):
        if entry.startswith(name + b"="):
            return entry[len(name) + 1 :]
    return b""
