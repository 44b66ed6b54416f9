"""Several hosts: a run spanning Ray nodes, each with its parameter store (the whole weights, 1/M of the Adam
moments), optimizer workers and executors.

On the CPU, a 2-node `ray.cluster_utils.Cluster` on this machine, each node with its own arena directory (the
MEGATRAIN_SHM_DIR its processes see), traffic on the loopback only: 3 steps reach bit for bit the parameters of one
node running the same two executors (the same gradient sums, the same AdamW shards), whose equality with one
executor and with transformers is test_data_parallel's; the checkpoint resumes on 1 node and on 2 to the same
parameters as the run that went on; killing the second node's executor in the middle of a step, or its optimizer
worker, recovers exactly; killing its parameter store (the node lost) stops the run in one sentence naming it, and
the dead store's segments are removed when the run shuts down. A LoRA run on two nodes (slow) is bit for bit its run
on one node with the same two executors, recovered and resumed alike. The same cluster has a GPU (a Ray resource
only) on its second node: the one-node run (device 'auto') keeps its actors and a data loader on the driver's node
and computes on its CPU, device 'cuda' is refused, and a GPU placement on the other node grants the executor's
options there.
The plain classes (node parts, resharding of checkpoints) are tested without Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from helpers import TIMEOUT, assert_nothing_left, build_hf_model, dead_segments, private_ray_env
from safetensors.torch import load_file
from test_nvme import checkpoint_state
from transformers import LlamaConfig

import megatrain
from megatrain.config import ConfigError, EngineConfig, MegatrainError, ModelConfig, OptimConfig
from megatrain.engine.optimizer import AdamWShard
from megatrain.io import checkpoint as ckpt
from megatrain.model.layout import ALIGN, ModelLayout, NodeShard, aligned_split
from megatrain.store import ParameterStore

# ---- plain classes ----


def test_nested_splits_agree() -> None:
    """A node's executors' gradient slices (ranks m N .. m N + N - 1 of M N) are exactly the node's part."""
    for blocks in (1, 2, 7, 64, 1001):
        numel = blocks * ALIGN
        for nodes in (1, 2, 3, 4):
            for per_node in (1, 2, 3):
                for m in range(nodes):
                    first = aligned_split(numel, m * per_node, nodes * per_node)[0]
                    last = aligned_split(numel, (m + 1) * per_node - 1, nodes * per_node)[1]
                    assert (first, last) == aligned_split(numel, m, nodes)


def tiny_layout() -> ModelLayout:
    return ModelLayout.build(ModelConfig.from_name("tiny"))


def test_node_parts_update_as_the_whole() -> None:
    """AdamW on each node's part (its moments packed) gives bit for bit what one node updating everything gives."""
    layout = tiny_layout()
    gen = torch.Generator().manual_seed(0)
    params0 = torch.randn(layout.numel, generator=gen)
    grads = [torch.randn(layout.numel, generator=gen) for _ in range(3)]
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)

    def train(nodes: int) -> torch.Tensor:
        params = params0.clone()
        shards = []
        for m in range(nodes):
            node = NodeShard.build(layout, m, nodes)
            tensors = {"params": params, "grads": torch.empty(layout.numel),
                       "exp_avg": torch.zeros(node.numel), "exp_avg_sq": torch.zeros(node.numel)}
            shards += [(tensors, AdamWShard(layout, tensors, optim, w, 2, node=node)) for w in range(2)]
        for step, grad in enumerate(grads):
            for tensors, shard in shards:
                tensors["grads"].copy_(grad)
                for unit in layout.units:
                    shard.update(unit.index, step)
        return params

    whole = train(1)
    assert not torch.equal(whole, params0)
    for nodes in (2, 3):
        assert torch.equal(train(nodes), whole)


def stores(nodes: int) -> list[ParameterStore]:
    return [ParameterStore("tiny", run_id=f"test{nodes}{m}", check_memory=False, node=m, nodes=nodes)
            for m in range(nodes)]


def gathered(parts: list[ParameterStore], name: str) -> torch.Tensor:
    """The whole model's moment `name`, put together from every node's part."""
    layout = parts[0].layout
    whole = torch.empty(layout.numel)
    for store in parts:
        for unit in layout.units:
            lo, hi = store.node.bounds[unit.index]
            whole[unit.offset + lo : unit.offset + hi] = store.node.moments(unit, store.arena.tensors[name], lo, hi)
    return whole


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (2, 3), (1, 2), (3, 2)])
def test_checkpoints_reshard(tmp_path: Path, saved: int, loaded: int) -> None:
    """Moments saved by `saved` nodes load into `loaded` nodes' parts (one node saves them under HF names, which hold
    no padding)."""
    writers = stores(saved)
    gen = torch.Generator().manual_seed(1)
    try:
        for store in writers:
            for name in ckpt.MOMENTS:
                store.arena.tensors[name].copy_(torch.randn(store.node.numel, generator=gen))
        want = {name: gathered(writers, name) for name in ckpt.MOMENTS}
        directory = tmp_path / "ckpt"
        directory.mkdir()
        for m, store in enumerate(writers):
            store.write_checkpoint_part(directory, {"updates_applied": 3} if m == 0 else None)
        ckpt.write_manifest(directory)
        expect_parts = saved > 1
        assert bool(list(directory.glob("optimizer-node*"))) == expect_parts
    finally:
        for store in writers:
            store.close()
    readers = stores(loaded)
    try:
        states = [store.load_checkpoint(directory) for store in readers]
        assert all(state["updates_applied"] == 3 for state in states)
        layout = readers[0].layout
        tensor_elements = torch.cat([torch.arange(u.offset + s.offset, u.offset + s.offset + s.numel)
                                     for u in layout.units for s in u.slots])  # not the padding between them
        for name in ckpt.MOMENTS:
            assert torch.equal(gathered(readers, name)[tensor_elements], want[name][tensor_elements])
    finally:
        for store in readers:
            store.close()


def test_an_incomplete_set_of_parts_is_refused(tmp_path: Path) -> None:
    writers = stores(2)
    try:
        for m, store in enumerate(writers):
            store.write_checkpoint_part(tmp_path, {"updates_applied": 1} if m == 0 else None)
    finally:
        for store in writers:
            store.close()
    (tmp_path / ckpt.moment_part_name(1, 2)).unlink()
    with pytest.raises(ckpt.CheckpointError, match="optimizer parts of 1 node.* do not make one whole"):
        ckpt.moment_parts(tmp_path, tiny_layout())


# ---- a cluster of two nodes ----

TWO_NODES = """
import json, os, signal, sys, threading, ray, torch
from safetensors.torch import save_file
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
import megatrain
from actors.data_loader import DataLoaderActor
from megatrain.data import DataConfig
from pipelines.cluster import NodePlacement
from pipelines.logprobs import batch_of

shm0, shm1, out, mode = sys.argv[1:5]
full = mode == "full"
node_args = dict(num_cpus=2, object_store_memory=100 * 2**20)
# no dashboard: nothing here reads it (test_dashboard.py does), and its processes cost the 2 cores seconds
nodes = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False,
                                                      "env_vars": {"MEGATRAIN_SHM_DIR": shm0}})
# a GPU as a Ray resource only (nothing here runs CUDA), on the node that is not the driver's: the runs compute on
# the CPU all the same (device "cpu", or "auto" on the driver's node, which has none)
nodes.add_node(**node_args, num_gpus=1, env_vars={"MEGATRAIN_SHM_DIR": shm1})
result = {}


def on_the_drivers_node(engine):
    '''Where the one-node run's actors, and a data loader placed beside them, run; what its placement reserved.'''
    loader = DataLoaderActor.options(scheduling_strategy=engine.scheduling_strategy).remote(
        DataConfig(batch_size=2, seq_len=32, vocab_size=engine.config.vocab_size))
    actors = [engine.store, *engine.executors, *engine.workers, loader]
    where = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for a in actors])
    group = sorted(set(placement_group_table(engine.placement.group)["bundles_to_node_id"].values()))
    ray.kill(loader)
    return {"driver": ray.get_runtime_context().get_node_id(), "actors": where, "group": group,
            "nodes": len(ray.nodes()), "worker_cpus": engine.placement.worker_cpus, "device": engine.device}


def gpu_placement():
    '''What the CPU cannot run end to end: "cuda" refused on the driver's node, which has no GPU; a group with a GPU
    bundle on the other node, and the options the executor gets from it.'''
    try:
        megatrain.Engine("tiny", batch_size=2, seq_len=32, device="cuda", optimizer_workers=1)
    except megatrain.ConfigError as e:
        cuda_refused = str(e)
    gpu_node = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU"))
    placement = NodePlacement.reserve(gpu_node, 1, gpu=True, timeout=60)

    @ray.remote(num_cpus=0)
    def probe():
        return ray.get_runtime_context().get_node_id(), len(ray.get_gpu_ids())

    on_gpu = ray.get(probe.options(**placement.executor()).remote(), timeout=60)
    placement.release()
    return {"cuda_refused": cuda_refused, "gpu_node": gpu_node, "on_gpu": on_gpu}


try:
    # connected by its address, as Ray's docs do: found through the record instead, Ray turns its token auth on in
    # this driver alone, and the nodes this process started reject it (actors die unscheduled)
    ray.init(address=nodes.address)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 32), generator=gen) for _ in range(5)]
    settings = dict(batch_size=4, seq_len=32, device="cpu", optimizer_workers=1, lr=1e-2, warmup_steps=0)

    def train(engine, steps, kill_at=None, victim="executor"):
        losses = []
        for i, ids in enumerate(steps):
            killer = None
            if i == kill_at:  # the second node's executor or optimizer worker, a moment into the step
                pid = ray.get((engine.executors if victim == "executor" else engine.workers)[1].pid.remote())
                killer = threading.Timer(0.05, os.kill, (pid, signal.SIGKILL))
                killer.start()
            losses.append(engine.step(ids))
            if killer is not None:
                killer.join()
        return losses

    def lose_the_second_node(engine):
        os.kill(ray.get(engine.stores[1].pid.remote()), signal.SIGKILL)  # the second node lost, with its arena
        try:
            engine.step(batches[0])
            engine.wait_for_updates()
        except megatrain.MegatrainError as e:
            result["lost"] = str(e)

    def where(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    if mode == "lora":  # adapters on the base each node's store loads (sys.argv[5]), dropout on
        lora = dict(settings, lora="r=4,alpha=8,targets=q_proj,v_proj,down_proj,dropout=0.1")
        with megatrain.Engine(sys.argv[5], nodes=2, executors=1, **lora) as two:
            result["two"] = train(two, batches[:1])
            two.save_checkpoint(out + "/ckpt")
            result["two"] += train(two, batches[1:3])
            save_file(two.parameters(), out + "/two.safetensors")
            two.save_pretrained(out + "/two-adapter")
            two.load_checkpoint(out + "/ckpt")
            result["recovered"] = train(two, batches[1:3], kill_at=0, victim="worker")
            result["restarts"] = two.restarts
            save_file(two.parameters(), out + "/recovered.safetensors")
        with megatrain.Engine(sys.argv[5], nodes=1, executors=2, **lora) as one:
            result["one"] = train(one, batches[:3])
            save_file(one.parameters(), out + "/one.safetensors")
            one.save_pretrained(out + "/one-adapter")
            one.load_checkpoint(out + "/ckpt")  # the two nodes' parts of the adapters' moments, on one node
            result["resumed"] = train(one, batches[1:3])
            save_file(one.parameters(), out + "/resumed.safetensors")
        result["files"] = sorted(os.listdir(out + "/ckpt"))
        print(json.dumps(result))
        sys.exit(0)
    # device "auto" on the driver's node, which has no GPU: the CPU's, as the runs below ("cpu")
    with megatrain.Engine("tiny", executors=2, **{**settings, "device": "auto"}) as one:
        result["drivers_node"] = on_the_drivers_node(one)  # test_engine_on_a_two_node_cluster_stays_on_the_drivers_node
        result["one"] = train(one, batches[:3])
        save_file(one.parameters(), out + "/one-3.safetensors")
        result["one"] += train(one, batches[3:])
        save_file(one.parameters(), out + "/one-5.safetensors")
    with megatrain.Engine("tiny", nodes=2, executors=1, **settings) as two:
        result["nodes"] = [p.node_id for p in two.placements]
        result["stores"] = [where(s) for s in two.stores]
        result["executors"] = [where(e) for e in two.executors]
        result["workers"] = [where(w) for w in two.workers]
        result["shm"] = [h.directory for h in two.handles]
        result["two"] = train(two, batches[:3])
        save_file(two.parameters(), out + "/two-3.safetensors")
        two.save_checkpoint(out + "/ckpt")
        if full:
            result["two"] += train(two, batches[3:], kill_at=0, victim="worker")
        else:  # the resumed runs below are left out: this run meets their executor kill and node loss itself
            result["two"] += train(two, batches[3:], kill_at=0)
        save_file(two.parameters(), out + "/two-5.safetensors")
        result["worker-restarts"] = two.restarts  # after parameters(): a kill after the last step's update was
        # issued is found by its wait for the updates
        if not full:
            result["restarts"] = two.restarts
            lose_the_second_node(two)
    result["drivers_node"].update(gpu_placement())
    # bf16 on the two nodes (norms 1.24, 1.27, 1.45: the third clips): in host memory, a checkpoint after a step;
    # with every state on NVMe, a step from its own init, then the rest from that checkpoint
    # (test_two_nodes_with_every_state_on_nvme_train_bit_for_bit)
    bf16 = dict(settings, nodes=2, executors=1, precision="bf16", bf16_copy="keep", max_grad_norm=1.3, speculate="on")
    os.mkdir(out + "/nvme")
    for name, tier in (("host", {}), ("nvme", dict(nvme=out + "/nvme", nvme_states="all"))):
        with megatrain.Engine("tiny", **bf16, **tier) as engine:
            runs = [engine.step_batch(batch_of(ids, None)) for ids in batches[:1]]
            engine.save_checkpoint(out + "/bf16-1") if not tier else engine.load_checkpoint(out + "/bf16-1")
            runs += [engine.step_batch(batch_of(ids, None)) for ids in batches[1:3]]
            engine.save_checkpoint(out + f"/bf16-{name}")
            save_file(engine.parameters(), out + f"/bf16-{name}.safetensors")
            engine.save_pretrained(out + f"/bf16-{name}-export")
            result[f"bf16-{name}"] = [[r.loss for r in runs], [r.update for r in runs]]
            if tier:  # no page of a tiered kind in either node's /dev/shm, each store's state directory
                result["tiered"] = [sum(h.path(k).stat().st_blocks for k in engine.actors.tier.kinds)
                                    for h in engine.handles] + [len(os.listdir(out + "/nvme"))]
    result["tiered"].append(len(os.listdir(out + "/nvme")))
    if not full:
        result["files"] = sorted(os.listdir(out + "/ckpt"))
        print(json.dumps(result))
        sys.exit(0)
    with megatrain.Engine("tiny", nodes=1, executors=2, **settings) as resumed:
        resumed.load_checkpoint(out + "/ckpt")
        result["resumed-1"] = train(resumed, batches[3:])
        save_file(resumed.parameters(), out + "/resumed-1.safetensors")
    with megatrain.Engine("tiny", nodes=2, executors=1, **settings) as resumed:
        resumed.load_checkpoint(out + "/ckpt")
        # the kill lands in the first of two steps or between them (it is joined before the second): either
        # way a step meets it, however fast a step is
        result["resumed-2"] = train(resumed, batches[3:], kill_at=0)
        result["restarts"] = resumed.restarts
        save_file(resumed.parameters(), out + "/resumed-2.safetensors")
        lose_the_second_node(resumed)
    result["files"] = sorted(os.listdir(out + "/ckpt"))
    print(json.dumps(result))
finally:
    ray.shutdown()
    nodes.shutdown()
"""


def run_two_nodes(ray_env: dict[str, str], tmp_path: Path, mode: str, *args: str) -> tuple[dict, list[Path]]:
    """TWO_NODES in `mode` (its result, the nodes' arena directories, each left empty: checked here)."""
    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    for d in shm:
        d.mkdir()
    proc = subprocess.run([sys.executable, "-c", TWO_NODES, str(shm[0]), str(shm[1]), str(tmp_path), mode, *args],
                          cwd=tmp_path, env={**ray_env, "MEGATRAIN_SHM_DIR": str(shm[0])}, capture_output=True,
                          text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not [p for d in shm for p in d.iterdir()], "an arena segment outlived the run"
    # the last JSON line: Ray's log lines (a worker the test killed) may come after it
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1]), shm


@dataclass
class TwoNodesRun:
    """One run of TWO_NODES that the two tests below check: its mode, its Ray's environment, its output directory,
    the nodes' arena directories, the dead segments in /dev/shm before it, and its result."""

    mode: str
    env: dict[str, str]
    out: Path
    shm: list[Path]
    dead_before: set[Path]
    result: dict


# CI: one run on two nodes meets a killed executor and the lost node; slow: a killed worker, and the checkpoint
# resumed on 1 node and on 2 (resharding without Ray: test_checkpoints_reshard). Both first run a one-node Engine
# on the same cluster: one cluster for the two tests (one costs ~10 s to start and stop on 2 cores).
@pytest.fixture(scope="module", params=["ci", pytest.param("full", marks=pytest.mark.slow)])
def two_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodesRun]:
    with private_ray_env() as env:
        out = tmp_path_factory.mktemp(f"two-nodes-{request.param}")
        dead_before = dead_segments()
        result, shm = run_two_nodes(env, out, request.param)
        yield TwoNodesRun(request.param, env, out, shm, dead_before, result)


def test_engine_on_a_two_node_cluster_stays_on_the_drivers_node(two_nodes: TwoNodesRun) -> None:
    """Two 2-CPU nodes (4 CPUs in the cluster, 2 on any node), a GPU on the node that is not the driver's: the
    one optimizer worker reserves its node's 2 CPUs, not the cluster's 4 that no node has (which waited
    forever); every actor, the data loader included, runs on the driver's node; "auto" computes on the CPU there
    and "cuda" is refused, since the cluster's GPU is on another node."""
    result = two_nodes.result["drivers_node"]
    driver = result["driver"]
    assert result["nodes"] == 2 and result["gpu_node"] != driver
    assert result["actors"] == [driver] * 5 and result["group"] == [driver]  # store, 2 executors, worker, loader
    assert result["worker_cpus"] == 2.0
    assert result["device"] == "cpu"
    assert result["cuda_refused"].startswith("device 'cuda' was asked for but the driver's Ray node has no GPU")
    assert result["on_gpu"] == [result["gpu_node"], 1]  # the executor's options: its node, one GPU granted
    assert_nothing_left(two_nodes.env, two_nodes.dead_before)


def test_two_nodes_train_resume_and_recover(two_nodes: TwoNodesRun) -> None:
    result, shm, mode = two_nodes.result, two_nodes.shm, two_nodes.mode
    first, second = result["nodes"]
    assert first != second
    assert result["stores"] == result["executors"] == result["workers"] == [first, second]
    assert result["shm"] == [str(shm[0]), str(shm[1])]  # each node's arena in its own directory
    assert "optimizer-node000-of-002.safetensors" in result["files"] and "model.safetensors" in result["files"]

    def params(name: str) -> dict[str, torch.Tensor]:
        return load_file(two_nodes.out / f"{name}.safetensors")

    assert result["two"] == result["one"]
    for name, value in params("one-3").items():
        assert torch.equal(params("two-3")[name], value), name
    five = params("one-5")
    for run in ("two-5", *(("resumed-1", "resumed-2") if mode == "full" else ())):
        got = params(run)
        for name, value in five.items():
            assert torch.equal(got[name], value), f"{run}: {name}"
    if mode == "full":
        assert result["resumed-1"] == result["resumed-2"] == result["one"][3:]
    assert result["restarts"] >= 1 and (mode == "ci" or result["worker-restarts"] >= 1)
    assert result["lost"].startswith("node 1 of the run (") and f"Ray node {second[:8]}) was lost" in result["lost"]
    assert result["lost"].endswith("on 2 nodes once it is back or on fewer (--nodes 1: checkpoints reshard).")
    assert_nothing_left(two_nodes.env, two_nodes.dead_before)


def test_two_nodes_with_every_state_on_nvme_train_bit_for_bit(two_nodes: TwoNodesRun) -> None:
    """The fp32 masters, moments and held gradients on NVMe on two nodes (bf16, the copy streamed; updates beside the
    backward, the last step's clipped and rolled back, its gradients read back from disk): the losses, the checkpoint
    (an ordinary one; test_nvme_states' slow two-node run resumes one in host memory), the export and
    Engine.parameters bit for bit the host-memory run's on the same nodes, which the NVMe run resumed from after its own
    first step; nothing of a tiered kind in either node's /dev/shm, one state directory per store, none after."""
    result, out = two_nodes.result, two_nodes.out
    assert result["bf16-nvme"] == result["bf16-host"]
    assert result["bf16-host"][1] == ["speculated", "speculated", "rolled back"]
    assert result["tiered"] == [0, 0, 2, 0]
    host, nvme = checkpoint_state(out / "bf16-host"), checkpoint_state(out / "bf16-nvme")
    assert any(k.startswith("optimizer-node001") for k in host)
    weights = [load_file(out / f"bf16-{name}.safetensors") for name in ("host", "nvme")]
    exports = [checkpoint_state(out / f"bf16-{name}-export") for name in ("host", "nvme")]
    for want, got in ((host, nvme), weights, exports):
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k


@pytest.mark.slow  # two Engines and a recovery of every actor (~90 s on 2 cores); no LoRA over nodes in CI
def test_lora_on_two_nodes_trains_resumes_and_recovers_as_on_one(ray_env: dict[str, str], tmp_path: Path) -> None:
    """Adapters (dropout on) over a bf16 base that each node's store loads: 3 steps on two nodes reach bit for bit the
    losses, adapters and PEFT adapter file of one node running the same two executors; from the two nodes'
    checkpoint after the first step, their run with node 1's optimizer worker killed (every actor replaced, the
    base loaded again) and one node's resumed run (the adapters' moments resharded) reach them too."""
    hf = build_hf_model(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "model")
    dead_before = dead_segments()
    result, _ = run_two_nodes(ray_env, tmp_path, "lora", str(tmp_path / "model"))
    assert result["two"] == result["one"] and result["recovered"] == result["resumed"] == result["one"][1:]
    assert result["restarts"] >= 1
    assert "optimizer-node001-of-002.safetensors" in result["files"] and "adapter_model.safetensors" in result["files"]
    want = load_file(tmp_path / "one.safetensors")
    assert want and all(".lora_" in name for name in want)
    for run in ("two", "recovered", "resumed"):
        got = load_file(tmp_path / f"{run}.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items()), run
    adapter = "adapter_model.safetensors"
    assert (tmp_path / "two-adapter" / adapter).read_bytes() == (tmp_path / "one-adapter" / adapter).read_bytes()
    assert_nothing_left(ray_env, dead_before)


def test_the_plan_counts_each_nodes_bytes_and_the_network() -> None:
    """Host bytes per parameter per node: 4 + 8/M (+ gradients, + the bf16 copy in bf16 runs); between the nodes,
    per step, each sends 3 (M-1)/M of the weights' bytes (gloo's all-reduce of the gradients, the weights' parts)."""
    from megatrain.memory.plan import plan_memory
    from megatrain.perf.calibrate import Calibration
    from megatrain.perf.predict import predict

    config = ModelConfig.from_name("1b")
    one, two, four = (plan_memory(config, 1, 512, nodes=m, host_free=2**40) for m in (1, 2, 4))
    n = one.arena_numel
    assert one.arena_bytes - one.grads_bytes == 12 * n and one.network_bytes == 0
    # the moments of the node that holds the most, as the stores split each unit (NodeShard, on ALIGN boundaries)
    layout = ModelLayout.build(config)
    for plan, m in ((two, 2), (four, 4)):
        most = max(NodeShard.build(layout, node, m).numel for node in range(m))
        assert plan.arena_bytes - plan.grads_bytes == 4 * n + 8 * most and most >= -(-n // m)
    assert two.network_bytes == int(3 * 0.5 * n * 4) and four.network_bytes == int(3 * 0.75 * n * 4)
    assert "network per step and node (2 nodes)" in two.report() and "1/2 of Adam m,v" in two.report()

    cal = Calibration("cpu", "host", 0.0, 2, 2, None, None, 10.0, {"tf32": 1.0}, {"2": 1.0})
    alone = predict(one, config, cal)
    spread = predict(two, config, cal, executors=2, link_gbps=1.0)
    assert spread.optimizer_s == pytest.approx(alone.optimizer_s / 2)
    assert spread.network_s == pytest.approx(two.network_bytes / 1e9)
    assert spread.tokens_per_s == pytest.approx(4 * one.step_tokens / spread.step_s)
    loaded = replace(cal, data_s_per_token=1e-6)  # one data loader feeds all 4 executors of the 2 nodes
    assert predict(two, config, loaded, executors=2).data_s == pytest.approx(4 * one.step_tokens * 1e-6)


def test_more_nodes_than_the_cluster_has_is_one_sentence(ray_session: None) -> None:
    with pytest.raises(MegatrainError) as info:
        megatrain.Engine("tiny", nodes=2, device="cpu", batch_size=2, seq_len=16)
    message = str(info.value)
    assert message.startswith("nodes=2 asks for 2 Ray nodes but the cluster has 1 with CPUs (the driver node ")
    assert message.endswith("join more hosts with `ray start --address <head>:6379`, or ask for fewer nodes.")
    assert "\n" not in message
    with pytest.raises(ConfigError, match="nodes must be a positive integer, got 0"):
        EngineConfig(nodes=0)
