"""Every kind of state a run can put on NVMe, in a run: bit for bit the host-memory run (losses, final weights and
moments, the export and Engine.parameters), with the fp32 masters (bf16 runs, which stream the bf16 copy), the Adam
moments and the held gradients on disk: a gradient stowed as it lands or once read beside the backward and staged
back for the rollback, the serial update and roll_back; the store's init, loads, checkpoints and exports one tensor at a
time through the state files. And the stager's two placements of a gradient (its own arena range, where the executor
lands it, and a staging slot, where it comes back) without Ray.

Settings are combined into few runs (each Engine start is seconds here): steps that clip and steps that do not (with
speculate "auto" a clipped step's successor updates serially), micro-batches summed in the arena, a resident unit,
two executors, the simulated asynchronous streams, a resume from host memory into NVMe and back, a killed worker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import test_nvme
import torch
from test_nvme import ENGINE, NUMEL, allocated, assert_resumes_across_tiers, assert_same, checkpoint_state, train

from megatrain.memory.nvme import StateFiles, aligned_buffer
from megatrain.memory.staging import SLOTS, STAGE_PREFIX, UnitStager, unit_extents

# tests/test_nvme.py's fixtures: the state files' directory (checked empty after), a sparse /dev/shm segment
nvme_dir, shm_segment = test_nvme.nvme_dir, test_nvme.shm_segment

# every step's gradient norm here is 1.3 to 1.5 (tests/test_nvme.py): 1.42 clips some steps and not others
MIXED = 1.42


def test_landed_gradients_are_stowed_from_their_range_and_staged_back_into_a_slot(
        tmp_path: Path, shm_segment: tuple[Path, torch.Tensor]) -> None:
    """A worker's stager of moments and gradients: the gradient lands in its own range (the first half of the
    segment), `stow` writes it from there and punches the range out, `take` brings it back into the unit's slot
    (beside the moments, which live only in slots), `give` writes the moments and never the gradient, `drop` punches a
    gradient unwritten; a take that skips the gradient (an update beside the backward reads it where it landed) and
    its read ahead leave it on disk."""
    path, seg = shm_segment
    half = NUMEL // 2  # four units of 1024 elements: their gradients' ranges; the slots after
    tensors = {"grads": seg[:half], STAGE_PREFIX + "grads": seg[half : half + SLOTS * 1024],
               STAGE_PREFIX + "exp_avg": aligned_buffer(SLOTS * 1024 * 4).view(torch.float32)}
    files = StateFiles.create(tmp_path, {"grads": half * 4, "exp_avg": half * 4})
    units = {u: (u * 1024, (u + 1) * 1024) for u in range(4)}
    stager = UnitStager(files, tensors, {"grads": path}, unit_extents(units, ("grads", "exp_avg")), slot_numel=1024,
                        landing=("grads",))
    try:
        for u in range(4):  # the executor lands each unit's gradient, the worker stows it
            tensors["grads"][u * 1024 : (u + 1) * 1024] = float(u + 1)
            stager.stow(u)
        stager.flush()
        assert not tensors["grads"].any() and allocated(path) <= (NUMEL - half) * 4  # only the slots hold pages
        for u in range(4):  # the serial update's order: each gradient back in its slot, the moments beside it
            stager.take(u)
            assert torch.equal(stager.view("grads", u), torch.full((1024,), float(u + 1)))
            stager.view("exp_avg", u).fill_(10.0 + u)
            stager.view("grads", u).mul_(0.5)  # a clip scale: never written back
            stager.give(u)
        tensors["grads"][:1024] = 7.0
        stager.take(0, skip=("grads",))  # beside the backward: the moments only, the gradient where it landed
        assert torch.equal(stager.view("exp_avg", 0), torch.full((1024,), 10.0))
        stager.give(0, stow=True)
        tensors["grads"][1024:2048] = 9.0
        stager.drop(1)  # read where it landed by a final update: out unwritten
        stager.flush()
        check = {k: torch.from_file(str(files.handle.path(k)), size=half, dtype=torch.float32).view(4, 1024)[:, 0]
                 for k in ("grads", "exp_avg")}
        assert torch.equal(check["grads"], torch.tensor([7.0, 2.0, 3.0, 4.0]))
        assert torch.equal(check["exp_avg"], torch.tensor([10.0, 11.0, 12.0, 13.0]))
        assert not tensors["grads"].any()
    finally:
        stager.close()
        files.unlink()


@pytest.mark.parametrize("vocab, workers", [(260, 1), (4096, 2)], ids=["tiny", "large-embedding-in-parts"])
def test_a_worker_with_every_state_on_nvme_updates_bit_for_bit_as_in_host_memory(nvme_dir: Path, vocab: int,
                                                                                 workers: int) -> None:
    """AdamWShard without Ray through the orders a run takes its units in: two executors' slices updated beside the
    backward (the update stands), executors disagreeing (one stows its slice where the other speculated: that unit
    waits) and the rollback, the serial update of stowed gradients, roll_back: the passes on a store whose masters,
    moments and held gradients are on NVMe leave bit for bit what they leave in host memory, and nothing in RAM. With
    an embedding and a head larger than a layer, each worker stages them in parts of at most its share of a layer."""
    from dataclasses import replace

    from megatrain.config import ModelConfig, OptimConfig
    from megatrain.engine.optimizer import AdamWShard, shard_bounds, shard_stager
    from megatrain.memory.nvme import TierSpec
    from megatrain.model.layout import GradLayout
    from megatrain.store import ParameterStore

    spec = TierSpec(str(nvme_dir), ("master", "moments", "grads"), ("params", "exp_avg", "exp_avg_sq", "grads"))
    config = replace(ModelConfig.from_name("tiny"), vocab_size=vocab)
    stores = [ParameterStore(config, num_workers=workers, bf16_copy=True, verify=False, check_memory=False, **extra)
              for extra in ({}, {"tier": spec})]
    try:
        layout, optim = stores[0].layout, OptimConfig(lr=1e-2, weight_decay=0.1)
        shards = [[AdamWShard(layout, st.arena.tensors, optim, w, workers, st.versions,
                              GradLayout.build(layout, "arena"), stager=shard_stager(layout, st.arena, w, workers))
                   for w in range(workers)] for st in stores]
        share = max(b - a for w in range(workers) for a, b in [shard_bounds(layout.embed, w, workers)])
        assert shards[1][0].stager.slot_numel == -(-layout.max_layer_numel() // 1024 // workers) * 1024
        assert (share > shards[1][0].stager.slot_numel) == (vocab > 260)  # the large embedding goes in parts
        units, gen = [u.index for u in layout.units], torch.Generator().manual_seed(0)

        def step(number: int, first: str, second: str, speculation: int | None, after: str, coef: float) -> None:
            grads = torch.randn(layout.numel, generator=gen)  # what the executors land (both slices at once here)
            for st, pool in zip(stores, shards, strict=True):
                st.arena.grads.copy_(grads)
                for shard in pool:
                    for u in reversed(units):  # the backward's order, each executor's call in turn
                        for call in (first, second if u % 2 else first):  # serially a second stow does nothing
                            getattr(shard, call)(u, number, speculation, 2 if speculation is not None else 1)
                    if after == "finish":
                        shard.roll_back_versions(number)
                    for u in units:
                        if after == "finish":
                            shard.settle(u, number, coef, speculation)
                        elif after == "roll_back":
                            shard.roll_back(u, number, speculation)
                    shard.flush()  # the run's versions order the next landing after the punches; here, the flush

        step(0, "speculate", "speculate", 1, "stands", 1.0)
        step(1, "speculate", "stow", 2, "finish", 0.5)  # odd units: one executor stowed, the update waits
        step(2, "stow", "stow", None, "finish", 0.7)  # the serial update
        step(3, "speculate", "stow", 3, "roll_back", 1.0)
        host, tiered = stores[0].arena.tensors, stores[1].arena.tensors
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(host[kind], stores[1].io.read(tiered[kind])), kind
        assert torch.equal(host["params_bf16"], tiered["params_bf16"])
        assert all(allocated(stores[1].arena.handle.path(kind)) == 0 for kind in spec.kinds)
    finally:
        for st in stores:
            st.close()


def test_on_several_nodes_a_tiered_units_version_comes_once_its_masters_are_on_disk(nvme_dir: Path) -> None:
    """Node 0 of 2 with its masters on NVMe, the disk's writes held back: once a unit's version says it is updated, its
    state file holds the update (the store reads its part from there for the other nodes: MasterParts), bit for bit
    a host-memory node's. On one node the version comes before the write (the executor streams the bf16 copy)."""
    import threading
    from concurrent.futures import Future

    from megatrain.config import ModelConfig, OptimConfig
    from megatrain.engine.optimizer import AdamWShard, shard_stager
    from megatrain.memory.nvme import TierSpec
    from megatrain.model.layout import GradLayout
    from megatrain.store import ParameterStore

    spec = TierSpec(str(nvme_dir), ("master",), ("params",))
    stores = [ParameterStore(ModelConfig.from_name("tiny"), num_workers=1, bf16_copy=True, nodes=2, verify=False,
                             check_memory=False, **extra) for extra in ({}, {"tier": spec})]
    try:
        layout, optim, node = stores[0].layout, OptimConfig(lr=1e-2), stores[0].node
        shards = [AdamWShard(layout, st.arena.tensors, optim, 0, 1, st.versions, GradLayout.build(layout, "arena"),
                             node=node, stager=shard_stager(layout, st.arena, 0, 1, node)) for st in stores]
        files, write = shards[1].stager.files, shards[1].stager.files.write

        def held_back(kind: str, offset: int, src: torch.Tensor) -> Future:
            done: Future = Future()
            threading.Timer(0.2, lambda: done.set_result(write(kind, offset, src).result())).start()
            return done

        files.write = held_back
        grads = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
        for st in stores:
            st.arena.grads.copy_(grads)
        for unit in layout.units[:2]:
            lo, hi = node.bounds[unit.index]
            for shard in shards:
                shard.update(unit.index, 0)
            assert int(stores[1].versions[unit.index, 0]) == 1
            part = slice(unit.offset + lo, unit.offset + hi)
            assert torch.equal(stores[1].io.read(stores[1].arena.params[part]), stores[0].arena.params[part])
        shards[1].flush()
    finally:
        for st in stores:
            st.close()


def test_a_store_unlinked_before_a_recovery_kills_it_leaves_no_state_directory(nvme_dir: Path) -> None:
    """Several nodes replace every actor where a worker died (pipelines/recovery.py), unlinking each store first: its
    NVMe state directory goes then, with its arena's files (a killed store's stayed until the next run's start)."""
    from megatrain.config import ModelConfig
    from megatrain.memory.nvme import TierSpec, list_state_dirs
    from megatrain.store import ParameterStore

    spec = TierSpec(str(nvme_dir), ("master", "moments"), ("params", "exp_avg", "exp_avg_sq"))
    store = ParameterStore(ModelConfig.from_name("tiny"), num_workers=1, bf16_copy=True, nodes=2, verify=False,
                           check_memory=False, tier=spec)
    try:
        paths = [store.handle.path(k) for k in spec.kinds]
        assert len(list_state_dirs(nvme_dir)) == 1 and all(p.exists() for p in paths)
        store.unlink()
        assert list_state_dirs(nvme_dir) == [] and not any(p.exists() for p in paths)
    finally:
        store.close()


EXCHANGE = """
import sys, torch
from megatrain.config import ModelConfig
from megatrain.distributed import node_exchange
from megatrain.memory.nvme import StateFiles, aligned_buffer
from megatrain.model.layout import ALIGN, ModelLayout, NodeShard

node_exchange.PART_NUMEL = 3 * ALIGN  # a part crosses in several pieces, the last one short
rank, address, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
layout = ModelLayout.build(ModelConfig.from_name("tiny"))
shard = NodeShard.build(layout, rank, 2)
group = node_exchange.NodeGroup.join(shard, address, timeout_s=60)
files = StateFiles.create(root, {"params": layout.numel * 4}, run_id=f"node{rank}")
try:
    want = torch.arange(layout.numel, dtype=torch.float32)  # each element its own value: a part misplaced shows
    masters = aligned_buffer(layout.numel * 4).view(torch.float32)[: layout.numel]
    masters.fill_(-1.0)  # the other node's parts, stale
    for unit in layout.units:
        lo, hi = shard.bounds[unit.index]
        masters[unit.offset + lo : unit.offset + hi] = want[unit.offset + lo : unit.offset + hi]  # this node's update
    files.write("params", 0, masters).result()
    versions = torch.ones(len(layout.units), 2, dtype=torch.int64)  # the workers' column: update 0 applied
    bf16_copy = torch.zeros(layout.numel, dtype=torch.bfloat16)
    parts = node_exchange.MasterParts(files, 0, max(u.numel for u in layout.units))
    group.sync_weights(layout, 0, torch.zeros(layout.numel), versions, bf16_copy, parts)
    masters.zero_()
    files.read("params", 0, masters).result()
    others = torch.ones(layout.numel, dtype=torch.bool)
    for unit in layout.units:
        lo, hi = shard.bounds[unit.index]
        others[unit.offset + lo : unit.offset + hi] = False
    ok = (torch.equal(masters, want) and torch.equal(bf16_copy[others], want[others].bfloat16())
          and not bf16_copy[~others].any() and bool((versions[:, 1] == 1).all()))
    print("exchanged" if ok else "wrong")
finally:
    files.destroy()
    group.close()
"""


def test_two_stores_exchange_their_parts_of_the_masters_through_their_state_files(tmp_path: Path) -> None:
    """Two stores' processes (gloo on the loopback), each state file holding only its node's part of an update: after
    sync_weights both files hold every part, in pieces of PART_NUMEL elements (several a part here), the other
    node's parts rounded into the bf16 copy (its own the workers round), the sync column at the update."""
    import subprocess
    import sys

    from helpers import TIMEOUT, python_path

    from megatrain.distributed.process_group import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    roots = [tmp_path / f"node{rank}" for rank in (0, 1)]
    procs = []
    for rank, root in enumerate(roots):
        root.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", EXCHANGE, str(rank), address, str(root)],
                                      env={**os.environ, "PYTHONPATH": python_path()}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert [out.strip().splitlines()[-1] for out in outs] == ["exchanged", "exchanged"], outs
    assert not [p for root in roots for p in root.iterdir()]


# ---- the Engine ----



@pytest.mark.parametrize("settings", [
    dict(max_grad_norm=MIXED, speculate="auto", micro_batches=2, batch_size=4, schedule="per-micro-batch",
         resident=1, device="cpu-async:3", precision="bf16", bf16_copy="keep", nvme_states="all"),
    dict(max_grad_norm=MIXED, speculate="on", executors=2, nvme_states="moments,grads", kill_worker_at=1),
    pytest.param(dict(max_grad_norm=1.0, speculate="off", micro_batches=2, batch_size=4,
                      nvme_states="moments,grads"), marks=pytest.mark.slow),
    pytest.param(dict(max_grad_norm=MIXED, speculate="on", micro_batches=2, batch_size=4, precision="bf16",
                      bf16_copy="keep", nvme_states="all", kill_worker_at=1), marks=pytest.mark.slow),
    pytest.param(dict(max_grad_norm=None, grads="arena", nvme_states="moments,grads"), marks=pytest.mark.slow),
], ids=["bf16-all-auto-per-micro-batch-resident-simulated-streams", "fp32-speculate-two-executors-killed-worker",
        "fp32-serial-layer-major", "bf16-all-speculate-layer-major-killed-worker", "fp32-clipping-off-final-updates"])
def test_states_on_nvme_train_bit_for_bit(ray_session: None, micro_llama, tmp_path: Path, nvme_dir: Path,
                                                  settings: dict) -> None:
    """The host-memory run saves a checkpoint after its first step; the NVMe run resumes from it (host memory into
    NVMe) and ends with the same bytes. The steps clip and do not: beside the backward the updates stand or roll back
    (their gradients read back from disk), and after a clipped step (speculate auto) the serial update reads them; a
    worker killed as the driver hands out a step's update is replaced, the checkpoint restored and the steps since
    replayed."""
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3, 4)]
    host = {k: v for k, v in settings.items() if k not in ("nvme_states", "kill_worker_at")}
    want = train(directory, tmp_path, batches, save_after=0, **host)
    got = train(directory, tmp_path, batches[1:], resume_from=tmp_path / "after-1", nvme=nvme_dir, **settings)
    assert got[2] == want[2][1:], (got[2], want[2])
    assert_same(got[:2], (want[0][1:], want[1]))
    if settings["max_grad_norm"] == MIXED:  # auto: a step after one that clipped updates serially
        assert {"rolled back", {"on": "speculated", "auto": "serial"}[settings["speculate"]]} <= set(want[2]), want[2]


def test_a_state_file_removed_mid_run_is_one_sentence_and_leaves_nothing(ray_session: None, micro_llama,
                                                                        nvme_dir: Path) -> None:
    """The held gradients' state file removed under a running run: the next update that reads it back fails in one
    sentence (a megatrain error, not Ray's traceback), and the run's shutdown still removes its state directory (the
    nvme_dir fixture checks)."""
    from helpers import rows

    import megatrain
    from megatrain import MegatrainError

    _, directory = micro_llama
    settings = dict(ENGINE, max_grad_norm=1.0, speculate="off", nvme=nvme_dir, nvme_states="moments,grads")
    with megatrain.Engine(directory, **settings) as engine:
        engine.step(*rows(1))
        engine.wait_for_updates()
        engine.handle.tier.path("grads").unlink()
        with pytest.raises(MegatrainError, match=r"the NVMe state file .*grads.bin is gone \(removed while the run"):
            engine.step(*rows(2))
            engine.wait_for_updates()


@pytest.mark.slow
def test_an_nvme_run_resumes_into_host_memory_and_back(ray_session: None, micro_llama, tmp_path: Path,
                                                       nvme_dir: Path) -> None:
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    settings = dict(max_grad_norm=MIXED, speculate="auto", precision="bf16", bf16_copy="keep")
    assert_resumes_across_tiers(directory, tmp_path, nvme_dir, batches, "all", settings)


@pytest.mark.slow
def test_ctrl_c_of_an_nvme_run_leaves_nothing_in_shared_memory_or_the_nvme_directory(tmp_path: Path,
                                                                                   nvme_dir: Path) -> None:
    """tests/test_pipeline.py's Ctrl-C, with every state on NVMe: the run's state directory goes with its arena (the
    nvme_dir fixture checks it is empty after)."""
    import os
    import signal

    from helpers import dead_segments
    from test_pipeline import megatrain as cli

    before = dead_segments()
    proc = cli("train", "--steps", "5000", "--log-every", "1", "--optimizer-workers", "1", "--precision", "bf16",
               "--bf16-copy", "keep", "--nvme", str(nvme_dir), "--nvme-states", "all", cwd=tmp_path)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: the whole foreground group
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "interrupted: shared memory released" in out
    assert dead_segments() <= before, "the run left shared memory behind"


TWO_NODES = """
import json, os, signal, sys, threading, ray, torch
from pathlib import Path
from ray.cluster_utils import Cluster
from safetensors.torch import save_file
import megatrain

shm0, shm1, nvme, out = sys.argv[1:5]
node_args = dict(num_cpus=2, object_store_memory=100 * 2**20)
nodes = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False,
                                                      "env_vars": {"MEGATRAIN_SHM_DIR": shm0}})
nodes.add_node(**node_args, env_vars={"MEGATRAIN_SHM_DIR": shm1})


def train(engine, steps, kill_at=None):
    losses = []
    for i, ids in enumerate(steps):
        if i == kill_at:  # the second node's optimizer worker, a moment into the step
            pid = ray.get(engine.workers[1].pid.remote())
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
        losses.append(engine.step(ids))
    return losses


try:
    ray.init(address=nodes.address)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(4)]
    fp32 = dict(batch_size=4, seq_len=32, device="cpu", optimizer_workers=1, lr=1e-2, warmup_steps=0,
                max_grad_norm=1.0, speculate="on", nodes=2, executors=1)
    bf16 = dict(fp32, precision="bf16", bf16_copy="keep", max_grad_norm=1.3)  # the third step clips
    result = {}
    runs = (("host", fp32, {}), ("nvme", fp32, dict(nvme=nvme, nvme_states="moments,grads")),
            ("bf16-host", bf16, {}), ("bf16-nvme", bf16, dict(nvme=nvme, nvme_states="all")))
    for name, settings, tier in runs:
        with megatrain.Engine("tiny", **settings, **tier) as engine:
            result[name] = train(engine, batches[:3], kill_at=1 if name == "bf16-nvme" else None)
            engine.save_checkpoint(out + "/ckpt-" + name)
            if tier:  # each node's tiered states on disk, none in its /dev/shm
                engine.wait_for_updates()
                result[name + "-allocated"] = [sum(h.path(k).stat().st_blocks for k in engine.actors.tier.kinds)
                                               for h in engine.handles]
                result[name + "-state-dirs"] = len(list(Path(nvme).iterdir()))
                result[name + "-restarts"] = engine.restarts
            if name == "bf16-host":  # the run goes on, against which the NVMe run's checkpoint resumes below
                result[name] += train(engine, batches[3:])
                save_file(engine.parameters(), out + "/bf16-host.safetensors")
    one = dict(bf16, nodes=1, executors=2)
    for name, settings, ckpt in (("on-two", bf16, "nvme"), ("on-one", one, "nvme"), ("on-one-host", one, "host")):
        with megatrain.Engine("tiny", **settings) as engine:  # NVMe -> host memory (and the host's, on one node)
            engine.load_checkpoint(out + "/ckpt-bf16-" + ckpt)
            result[name] = train(engine, batches[3:])
            save_file(engine.parameters(), out + f"/{name}.safetensors")
    print(json.dumps(result))
finally:
    ray.shutdown()
    nodes.shutdown()
"""


@pytest.mark.slow
def test_two_nodes_with_states_on_nvme_train_recover_and_resume_bit_for_bit(tmp_path: Path, nvme_dir: Path) -> None:
    """Each node's store keeps its packed part of the moments, its held gradients and (bf16, the copy streamed) the
    whole fp32 masters in state files of its own (the same directory here, one per store): the checkpoints' bytes equal
    the host-memory runs' on the same two nodes, also where the second node's worker is killed mid-step (recovered);
    the bf16 NVMe run's checkpoint resumes in host memory on two nodes and on one as the host run's does."""
    import json
    import subprocess
    import sys

    from helpers import TIMEOUT, private_ray_env
    from safetensors.torch import load_file

    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    for d in shm:
        d.mkdir()
    with private_ray_env() as env:
        # seven Engines on the two nodes: ~150 s on 2 idle cores, past TIMEOUT under load
        proc = subprocess.run([sys.executable, "-c", TWO_NODES, *map(str, shm), str(nvme_dir), str(tmp_path)],
                              cwd=tmp_path, env={**env, "MEGATRAIN_SHM_DIR": str(shm[0])}, capture_output=True,
                              text=True, timeout=3 * TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["nvme"] == result["host"] and result["bf16-nvme"] == result["bf16-host"][:3]
    assert result["on-two"] == result["on-one"] == result["on-one-host"] == result["bf16-host"][3:]
    assert result["bf16-nvme-restarts"] == 1
    for name in ("nvme", "bf16-nvme"):
        assert result[name + "-allocated"] == [0, 0] and result[name + "-state-dirs"] == 2, name
    assert not [p for d in shm for p in d.iterdir()], "an arena segment outlived the run"
    for name in ("", "bf16-"):
        host, nvme = checkpoint_state(tmp_path / f"ckpt-{name}host"), checkpoint_state(tmp_path / f"ckpt-{name}nvme")
        assert host.keys() == nvme.keys() and any(k.startswith("optimizer-node001") for k in host)
        for k, v in host.items():
            assert torch.equal(nvme[k], v), k
    # one node's clipped update differs from two nodes' by the units it updated beside the backward before the norm
    # was known (megatrain/engine/optimizer.py), so the one-node resume is held to the host checkpoint's resume there
    for name, other in (("on-two", "bf16-host"), ("on-one", "on-one-host")):
        got, want = load_file(tmp_path / f"{name}.safetensors"), load_file(tmp_path / f"{other}.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()), name


def test_each_nodes_tier_keeps_the_whole_masters_and_its_part_of_the_moments(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan of one node of M: on its disk the whole fp32 masters (the exchange reads its part back and writes the
    others'), 1/M of the moments, the whole gradient file of which it moves its part; the host bytes the tier takes out
    are what the node's arena holds of each kind. Every state on NVMe on 2 nodes (bf16, the copy streamed) fits."""
    import json

    from megatrain.config import ModelConfig
    from megatrain.memory.plan import plan_memory
    from megatrain.memory.tier_plan import plan_tier, with_tier
    from pipelines.cli import main

    n = 1 << 20
    for m in (1, 2, 4):
        tier, part = plan_tier("d", ("master", "moments", "grads"), n, n, 1024, nodes=m), -(-n // m) * 4
        assert dict(tier.on_disk) == {"params": 4 * n, "exp_avg": part, "exp_avg_sq": part, "grads": 4 * n}
        assert tier.read_bytes == 4 * n // m * (2 if m > 1 else 1) + 2 * part + 4 * n // m
        assert tier.write_bytes == 4 * n + 2 * part + 4 * n // m
    config = ModelConfig.from_name("1b")
    two = plan_memory(config, 1, 512, nodes=2, host_free=2**40)
    tiered = with_tier(two, config, str(tmp_path), "moments")
    assert dict(tiered.tier.on_disk)["exp_avg"] == 4 * -(-two.arena_numel // 2)
    assert two.host_total - tiered.host_total == tiered.tier.saved_bytes > 0
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    code = main(["plan", "--model", "1b", "--nodes", "2", "--precision", "bf16", "--bf16-copy", "keep", "--device",
                 "cuda", "--gpu-gib", "80", "--host-gib", "256", "--max-grad-norm", "1", "--nvme", str(nvme),
                 "--nvme-states", "all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] and out["run_plan"]["tier"]["names"] == ["master", "moments", "grads"]
