"""The NVMe tier's rooms without Ray: the directory check and its refusals, direct I/O of state files into a /dev/shm
mapping, the arena as staging (read ahead, write behind, pages punched out), faults as one sentence, and cleanup.

The state files go under pytest's tmp_path (ext4 here, which takes O_DIRECT); the staged segments into a file under
/dev/shm made by the test, removed after.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from megatrain import MegatrainError
from megatrain.memory import nvme
from megatrain.memory.nvme import StateFiles, check_directory, list_state_dirs, remove_stale_state_dirs
from megatrain.memory.staging import UnitStager, unit_extents

NUMEL = 8 * 1024  # eight 4 KiB-aligned units of 1024 fp32 elements


@pytest.fixture
def shm_segment() -> Iterator[tuple[Path, torch.Tensor]]:
    """A sparse /dev/shm file of NUMEL fp32 elements mapped shared, as an arena segment is."""
    path = Path("/dev/shm") / f"megatrain-test-nvme-{uuid.uuid4().hex[:8]}"
    with open(path, "wb") as f:
        f.truncate(NUMEL * 4)
    try:
        yield path, torch.from_file(str(path), shared=True, size=NUMEL, dtype=torch.float32)
    finally:
        path.unlink(missing_ok=True)


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_check_directory_refuses_memory_and_missing_and_full(tmp_path: Path) -> None:
    with pytest.raises(MegatrainError, match="tmpfs, which keeps its files in RAM"):
        check_directory("/dev/shm")
    with pytest.raises(MegatrainError, match="does not exist"):
        check_directory(tmp_path / "nowhere")
    with pytest.raises(MegatrainError, match="GiB free and the NVMe tier needs"):
        check_directory(tmp_path, need_bytes=1 << 60)
    ok = check_directory(tmp_path)
    assert ok.fs_type not in nvme.MEMORY_FILESYSTEMS and 0 < ok.offset_align <= nvme.MAX_ALIGN


def test_state_files_round_trip_into_shm_mapping(tmp_path: Path, shm_segment: tuple[Path, torch.Tensor]) -> None:
    _, seg = shm_segment
    files = StateFiles.create(tmp_path, {"exp_avg": NUMEL * 4}, threads=3)
    try:
        src = torch.randn(NUMEL)
        seg.copy_(src)
        files.write("exp_avg", 0, seg).result()
        seg.zero_()
        files.read("exp_avg", 4096, seg[1024:]).result()  # a range at an offset
        assert torch.equal(seg[1024:], src[1024:]) and not seg[:1024].any()
        with pytest.raises(ValueError, match="unaligned"):
            files.read("exp_avg", 100, seg[:1024])
        assert list_state_dirs(tmp_path) == [files.handle.directory]
    finally:
        files.destroy()
    assert list_state_dirs(tmp_path) == []


def test_stager_reads_ahead_writes_behind_and_frees_pages(tmp_path: Path,
                                                          shm_segment: tuple[Path, torch.Tensor]) -> None:
    path, seg = shm_segment
    files = StateFiles.create(tmp_path, {"exp_avg": NUMEL * 4})
    units = {u: (u * 1024, (u + 1) * 1024) for u in range(8)}
    stager = UnitStager(files, {"exp_avg": seg}, {"exp_avg": path}, unit_extents(units, ("exp_avg",)))
    try:
        for step in range(3):
            order = range(7, -1, -1) if step % 2 == 0 else range(8)  # the backward's order, then the update's
            for u in order:
                stager.take(u)
                assert torch.equal(seg[u * 1024:(u + 1) * 1024], torch.full((1024,), float(step * 10 + u)) * (step > 0))
                seg[u * 1024:(u + 1) * 1024] = float((step + 1) * 10 + u)
                stager.give(u)
            stager.flush()
            assert allocated(path) == 0  # nothing of the states left in RAM after the pass
        stager.bring_in()
        assert torch.equal(seg.view(8, 1024)[:, 0], torch.tensor([30.0 + u for u in range(8)]))
        stager.send_out(changed=False)
        assert allocated(path) == 0 and not seg.any()
    finally:
        stager.close()
        files.unlink()


def test_slotted_stager_keeps_each_unit_in_its_slot_whatever_the_order(tmp_path: Path,
                                                                      shm_segment: tuple[Path, torch.Tensor]) -> None:
    """An optimizer worker's stager: its units staged in SLOTS slots (kept allocated), read ahead where the order is
    foreseen, and correct where it is not (jumps, repeats, a slot's next unit arriving before its write is done)."""
    from megatrain.memory.staging import SLOTS, STAGE_PREFIX

    _, seg = shm_segment
    files = StateFiles.create(tmp_path, {"exp_avg": NUMEL * 4})
    units = {u: (u * 1024, (u + 1) * 1024) for u in range(8)}
    stager = UnitStager(files, {STAGE_PREFIX + "exp_avg": seg[: SLOTS * 1024]}, None,
                        unit_extents(units, ("exp_avg",)), slot_numel=1024)
    want = torch.zeros(8)
    try:
        for order in (range(7, -1, -1), range(8), [0, 3, 6, 1, 4, 7, 7, 2, 5], [5, 2, 6, 3]):
            for u in order:
                stager.take(u)
                view = stager.view("exp_avg", u)
                assert torch.equal(view, torch.full((1024,), float(want[u]))), (order, u)
                view.add_(u + 1)
                want[u] += u + 1
                stager.give(u)
        stager.flush()
        check = torch.from_file(str(files.handle.path("exp_avg")), size=NUMEL, dtype=torch.float32)
        assert torch.equal(check.view(8, 1024)[:, 0], want)
    finally:
        stager.close()
        files.unlink()


def test_a_unit_larger_than_a_slot_is_staged_in_parts(tmp_path: Path, shm_segment: tuple[Path, torch.Tensor]) -> None:
    """Units of several parts each (two slots' worth, and three): a pass takes them part by part in the order `order`
    gives (the backward's descending, the update's ascending), reads the next part ahead, and `stow` and `after`
    cover every part of a unit before their callback runs."""
    from megatrain.memory.staging import SLOTS, STAGE_PREFIX, Extent

    path, seg = shm_segment
    files = StateFiles.create(tmp_path, {"grads": NUMEL * 4, "exp_avg": NUMEL * 4})
    parts = {0: [0, 1], 1: [2, 3, 4], 2: [5, 6, 7]}  # units of 2, 3 and 3 parts of 1024 elements
    extents = {p: [Extent(k, p * 4096, (p + 1) * 4096) for k in ("grads", "exp_avg")] for p in range(8)}
    tensors = {"grads": seg, STAGE_PREFIX + "exp_avg": torch.zeros(SLOTS * 1024),
               STAGE_PREFIX + "grads": torch.zeros(SLOTS * 1024)}
    tensors = {k: v if k == "grads" else nvme.aligned_buffer(v.numel() * 4).view(torch.float32)[: v.numel()].zero_()
               for k, v in tensors.items()}
    stager = UnitStager(files, tensors, {"grads": path}, extents, slot_numel=1024, landing=("grads",), parts=parts)
    published = []

    def on_disk(unit: int) -> None:  # every part's gradient written when the unit's callback runs
        data = files.handle.path("grads").read_bytes()
        assert all(torch.frombuffer(bytearray(data[p * 4096 : p * 4096 + 4]), dtype=torch.float32).item() == p
                   for p in parts[unit]), unit
        published.append(unit)

    try:
        seg.copy_(torch.arange(8).repeat_interleave(1024).float())
        for u in (2, 1, 0):  # the backward: each unit's gradient stowed as it lands
            stager.stow(u, then=lambda u=u: on_disk(u))
        stager.flush()
        assert sorted(published) == [0, 1, 2] and allocated(path) == 0
        for step in range(2):
            taken = []
            for u in ((2, 1, 0) if step == 0 else (0, 1, 2)):
                for p in stager.order(u):
                    stager.take(p)
                    taken.append(p)
                    assert torch.equal(stager.view("grads", p), torch.full((1024,), float(p)))
                    stager.view("exp_avg", p).add_(p + 1)
                    stager.give(p)
                stager.after(u, lambda u=u: published.append(u))
            assert taken == (list(range(7, -1, -1)) if step == 0 else list(range(8)))
        stager.flush()
        assert sorted(published) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        check = torch.from_file(str(files.handle.path("exp_avg")), size=NUMEL, dtype=torch.float32)
        assert torch.equal(check.view(8, 1024)[:, 0], 2 * torch.arange(1, 9).float())
    finally:
        stager.close()
        files.unlink()


def test_tier_reads_ahead_in_order_and_waits_for_what_it_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TierReader.read_ahead (a checkpoint's writes of the states on disk): each view's data in order, at most
    READ_AHEAD bytes read ahead (and one view), a view before the tier's first element read where it is (in RAM),
    and a caller that stops early leaves no read under way."""
    from megatrain.memory import staging

    monkeypatch.setattr(staging, "READ_AHEAD", 3 * 4096)
    files = StateFiles.create(tmp_path, {"exp_avg": NUMEL * 4})
    seg = torch.arange(NUMEL, dtype=torch.float32)
    try:
        files.write("exp_avg", 0, nvme.aligned_buffer(NUMEL * 4).view(torch.float32)[:NUMEL].copy_(seg)).result()
        reader = staging.TierReader(files, {"exp_avg": torch.zeros(NUMEL)}, ("exp_avg",), {"exp_avg": 1024})
        arena = reader.tensors["exp_avg"]
        views = [arena[a : a + n] for a, n in ((0, 1024), (1024, 3072), (4096, 100), (5120, 1024), (6144, 2048))]
        got = list(reader.read_ahead(views))
        assert got[0].data_ptr() == arena.data_ptr()  # resident: the arena's own
        for view, out in zip(views[1:], got[1:], strict=True):
            start = (view.data_ptr() - arena.data_ptr()) // 4
            assert torch.equal(out, seg[start : start + view.numel()])
        stopped = reader.read_ahead(views[1:])
        assert torch.equal(next(stopped), seg[1024:4096])
        stopped.close()  # the reads ahead of it are waited for
    finally:
        files.destroy()


def test_faults_are_one_sentence(tmp_path: Path, shm_segment: tuple[Path, torch.Tensor]) -> None:
    path, seg = shm_segment
    files = StateFiles.create(tmp_path, {"exp_avg": NUMEL * 4, "exp_avg_sq": NUMEL * 4})
    try:
        files.handle.path("exp_avg").unlink()  # removed while the run uses it
        with pytest.raises(MegatrainError, match="is gone"):
            files.read("exp_avg", 0, seg).result()
        with pytest.raises(MegatrainError, match="is gone"):
            StateFiles.open(files.handle)
        os.truncate(files.handle.path("exp_avg_sq"), 4096)  # torn while the run was away
        with pytest.raises(MegatrainError, match="torn: a read at byte 4096 moved 0"):
            files.read("exp_avg_sq", 4096, seg[1024:2048]).result()
    finally:
        files.destroy()
    assert not files.handle.directory.exists()


def test_stale_state_directories_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "megatrain-oldrun-999999999-1"  # no such process
    dead.mkdir()
    (dead / "exp_avg.bin").write_bytes(b"x")
    mine = StateFiles.create(tmp_path, {"grads": 4096})  # a start cleans what killed runs left
    try:
        assert not dead.exists() and list_state_dirs(tmp_path) == [mine.handle.directory]
        assert remove_stale_state_dirs(tmp_path) == []  # a live run's stay
        assert remove_stale_state_dirs(tmp_path, everything=True) == [mine.handle.directory]  # megatrain cleanup --all
    finally:
        mine.destroy()


def test_measure_rates_small_file(tmp_path: Path) -> None:
    write, read = nvme.measure_rates(tmp_path, 8 << 20, threads=2)
    assert write > 0 and read > 0 and list_state_dirs(tmp_path) == []


# ---- the Engine with its moments on NVMe: bit for bit the host-memory run ----

ENGINE = dict(lr=1e-2, weight_decay=0.1, warmup_steps=1, total_steps=6, optimizer_workers=2, precision="fp32",
              device="cpu", seed=0, batch_size=8, seq_len=24, metrics=False)
CLIPS = 1.0  # every step's gradient norm here is 1.3 to 1.5: each clips (and a speculated one rolls back)


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: the weights and the Adam moments, as the run wrote them."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({f"{f.stem}/{k}": v for k, v in load_file(f).items()})
    return state


def train(directory: Path, tmp: Path, batches: list, resume_from: Path | None = None, save_after: int | None = None,
          kill_worker_at: int | None = None, inspect: Callable | None = None, **settings: object
          ) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """Steps on `batches` (after loading `resume_from`; a checkpoint `tmp/after-N` after step `save_after`; a worker
    SIGKILLed as step `kill_worker_at` hands out its update; `inspect(engine)` after the steps); the losses, the final
    checkpoint's tensors and how each step's update ran."""
    from helpers import kill_once_updates_are_handed_out, worker_pids

    import megatrain
    from pipelines.logprobs import batch_of

    out = tmp / f"ckpt-{uuid.uuid4().hex[:6]}"
    with megatrain.Engine(directory, **{**ENGINE, **settings}) as engine:
        if resume_from is not None:
            engine.load_checkpoint(resume_from)
        losses, updates = [], []
        for i, (ids, labels) in enumerate(batches):
            if i == kill_worker_at:
                kill_once_updates_are_handed_out(engine, worker_pids(engine)[-1])
            result = engine.step_batch(batch_of(ids, labels))
            losses.append(result.loss)
            updates.append(result.update)
            if i == save_after:
                engine.save_checkpoint(tmp / f"after-{i + 1}")
        if settings.get("nvme"):  # the streamed units' states on disk: none of them, nor a gradient, in /dev/shm
            engine.wait_for_updates()
            resident = sum(u.numel * 4 for u in engine.actors.layout.units[:engine.plan.resident_units])
            for kind in engine.actors.tier.kinds:
                assert allocated(engine.handle.path(kind)) <= resident, kind
            assert kill_worker_at is None or engine.restarts == 1
        if inspect is not None:
            inspect(engine)
        engine.save_checkpoint(out)
        engine.save_pretrained(out / "final")
        weights = engine.parameters()
    state = checkpoint_state(out)
    final = checkpoint_state(out / "final")  # the export, read unit by unit from where the weights live
    assert final.keys() == {k for k in state if k.startswith("model/")} == {f"model/{k}" for k in weights}
    for k, v in final.items():
        assert torch.equal(v, state[k]) and torch.equal(weights[k.removeprefix("model/")], v), k
    return losses, state, updates


def assert_same(got: tuple[list[float], dict[str, torch.Tensor]], want: tuple[list[float], dict[str, torch.Tensor]]
                ) -> None:
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "nvme"
    path.mkdir()
    yield path
    assert list_state_dirs(path) == []  # removed with the run


@pytest.mark.parametrize("settings", [
    # slow: tests/test_nvme_states.py's CI runs put the moments on NVMe beside the held gradients
    pytest.param(dict(max_grad_norm=CLIPS, speculate="on", micro_batches=2, batch_size=4, resident=1,
                      device="cpu-async:3"), marks=pytest.mark.slow),
    pytest.param(dict(max_grad_norm=1e3, speculate="on"), marks=pytest.mark.slow),
    pytest.param(dict(max_grad_norm=CLIPS, speculate="off", executors=2), marks=pytest.mark.slow),
    pytest.param(dict(max_grad_norm=None), marks=pytest.mark.slow),
], ids=["clips-rollback-micro-batches-resident-simulated-streams", "no-clip-beside-the-backward",
        "clips-serial-two-executors", "clipping-off"])
def test_moments_on_nvme_train_bit_for_bit(ray_session: None, micro_llama, tmp_path: Path, nvme_dir: Path,
                                           settings: dict) -> None:
    """The host-memory run saves a checkpoint after its first step and goes on; the NVMe run resumes from that
    checkpoint (host memory into NVMe) and its own checkpoint at the end holds the same bytes: an ordinary checkpoint
    a host-memory run resumes from (the slow test below does)."""
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    want = train(directory, tmp_path, batches, save_after=0, **settings)
    got = train(directory, tmp_path, batches[1:], resume_from=tmp_path / "after-1", nvme=nvme_dir,
                nvme_states="moments", **settings)
    assert_same(got, (want[0][1:], want[1]))


@pytest.mark.slow
def test_nvme_run_resumes_into_host_memory_and_back(ray_session: None, micro_llama, tmp_path: Path,
                                                    nvme_dir: Path) -> None:
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    settings = dict(max_grad_norm=CLIPS, speculate="on")
    assert_resumes_across_tiers(directory, tmp_path, nvme_dir, batches, "moments", settings)


def assert_resumes_across_tiers(directory: Path, tmp_path: Path, nvme_dir: Path, batches: list, states: str,
                                settings: dict) -> None:
    """A step with `states` on NVMe, one in host memory from its checkpoint, one on NVMe again from that one: the
    losses and the final checkpoint bit for bit the host-memory run's."""
    runs = [tmp_path / name for name in ("first", "second", "third")]
    for run in runs:
        run.mkdir()
    want = train(directory, tmp_path, batches, **settings)
    first = train(directory, runs[0], batches[:1], save_after=0, nvme=nvme_dir, nvme_states=states, **settings)
    second = train(directory, runs[1], batches[1:2], resume_from=runs[0] / "after-1", save_after=0, **settings)
    third = train(directory, runs[2], batches[2:], resume_from=runs[1] / "after-1", nvme=nvme_dir,
                  nvme_states=states, **settings)
    assert first[0] + second[0] + third[0] == want[0]
    assert_same(third[:2], (third[0], want[1]))


@pytest.mark.slow
def test_a_killed_optimizer_worker_recovers_exactly_with_moments_on_nvme(ray_session: None, micro_llama,
                                                                         tmp_path: Path, nvme_dir: Path) -> None:
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    settings = dict(max_grad_norm=CLIPS, speculate="on")
    want = train(directory, tmp_path, batches, save_after=0, **settings)
    got = train(directory, tmp_path, batches, save_after=0, kill_worker_at=1, nvme=nvme_dir,
                nvme_states="moments", **settings)
    assert_same(got, want)


@pytest.fixture(scope="module")
def wide_vocab_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/helpers.py's micro Llama with a 2,048-token vocabulary: its embedding and head 4x a layer."""
    from helpers import build_hf_model, micro_llama_config

    config = micro_llama_config()
    config.vocab_size = 2048
    directory = tmp_path_factory.mktemp("wide-vocab")
    build_hf_model(config).save_pretrained(directory)
    return directory


def test_a_large_embedding_trains_bit_for_bit_through_slots_of_a_layer(ray_session: None, wide_vocab_llama: Path,
                                                                       tmp_path: Path, nvme_dir: Path) -> None:
    """Every state on NVMe (bf16, the copy streamed), steps that clip and do not (rolled back, then serial): the
    embedding and the head go through each worker's slots in parts of its share of a layer, and the run is bit for bit
    the host-memory run; the staging segments are SLOTS slots of that share per worker (not of the embedding's), as
    the plan counts them."""
    from helpers import rows

    from megatrain.memory.staging import SLOTS, STAGE_PREFIX

    def staged(engine: object) -> None:
        layout, workers = engine.actors.layout, ENGINE["optimizer_workers"]
        share = -(-layout.max_layer_numel() // 1024 // workers) * 1024
        assert layout.embed.numel // workers >= 4 * share  # the embedding in parts
        sizes = [os.stat(engine.handle.path(STAGE_PREFIX + k)).st_size for k in engine.actors.tier.kinds]
        assert sizes == [workers * SLOTS * share * 4] * 4
        assert sum(sizes) == engine.plan.tier.staging_bytes

    settings = dict(max_grad_norm=1.42, speculate="auto", precision="bf16", bf16_copy="keep")
    batches = [rows(seed) for seed in (1, 2, 3)]
    want = train(wide_vocab_llama, tmp_path, batches, **settings)
    got = train(wide_vocab_llama, tmp_path, batches, nvme=nvme_dir, nvme_states="all", inspect=staged, **settings)
    assert got[2] == want[2] and {"rolled back", "serial"} <= set(want[2]), want[2]
    assert_same(got[:2], want[:2])


# ---- the plan, the refusals, the commands ----

def test_the_plan_moves_each_kind_off_the_host_and_names_the_tier_where_it_would_fit(tmp_path: Path) -> None:
    from megatrain.config import ModelConfig
    from megatrain.memory.plan import plan_memory
    from megatrain.memory.tier_plan import with_tier

    config = ModelConfig.from_name("7b")
    plan = plan_memory(config, 1, 512, name="7b", host_free=40 * 2**30, shm_dir="/dev/shm")
    plan = dataclasses.replace(plan, shm_free=40 * 2**30)
    problem = plan.host_problem()
    assert problem is not None and "--nvme PATH --nvme-states moments" in problem
    moments = with_tier(plan, config, str(tmp_path), "moments", rates=(2.0, 1.0))
    every = with_tier(plan, config, str(tmp_path), "all", rates=(2.0, 1.0))
    assert dict(moments.tier.on_disk) == {"exp_avg": plan.arena_numel * 4, "exp_avg_sq": plan.arena_numel * 4}
    assert plan.host_total - moments.host_total == moments.tier.saved_bytes > 0
    assert every.host_total < moments.host_total and every.tier.names == ("master", "moments", "grads")
    assert with_tier(plan, config, str(tmp_path), "auto").host_problem() is None  # auto: the fewest that fit
    assert moments.tier.seconds() == pytest.approx(moments.tier.read_bytes / 2e9 + moments.tier.write_bytes / 1e9)
    assert "step predicted with the disk as a bound: " in "\n".join(moments.tier.report(step_s=1.0))
    # the disk's share hides behind the compute the update runs beside, the rest adds; unknown: behind the whole step
    disk_s = moments.tier.seconds()
    assert moments.tier.bound_s(1.0, beside_s=0.5) == pytest.approx(1.0 + disk_s - 0.5)
    assert moments.tier.bound_s(1.0, beside_s=2 * disk_s) == 1.0 and moments.tier.bound_s(1.0) == max(1.0, disk_s)


def test_the_plan_stages_a_large_layer_in_parts_of_a_slot(tmp_path: Path) -> None:
    """A 7B layer's share (25 M elements a worker of 8) is staged in parts of PART_NUMEL: the plan's staging is SLOTS
    slots of that per worker and kind, whatever the unit's size."""
    from megatrain.config import ModelConfig
    from megatrain.memory.plan import plan_memory
    from megatrain.memory.staging import PART_NUMEL, SLOTS, part_numel
    from megatrain.memory.tier_plan import with_tier

    config = ModelConfig.from_name("7b")
    plan = plan_memory(config, 1, 512, name="7b", optimizer_workers=8, host_free=400 * 2**30, shm_dir="/dev/shm")
    every = with_tier(plan, config, str(tmp_path), "all", rates=(2.0, 1.0))
    assert every.tier.staging_bytes == SLOTS * 8 * PART_NUMEL * 4 * 4  # 4 kinds: masters, m, v, held gradients
    assert part_numel([4096, 1 << 30], 2048, 2) == 1024  # never more than a layer's share
    assert part_numel([1 << 30], 1 << 31, 1) == PART_NUMEL


def test_a_run_refuses_what_it_cannot_place_on_nvme_yet(tmp_path: Path) -> None:
    from megatrain.config import ConfigError, EngineConfig
    from megatrain.memory.nvme import resolve_tier

    with pytest.raises(MegatrainError, match="no bf16 copy to stream instead"):
        resolve_tier(str(tmp_path), ("master", "moments"), copy=False)
    assert resolve_tier(str(tmp_path), ("grads",), grads="stream") is None  # a ring's gradients leave as read
    # on one node or several (each node's store keeps the whole masters: megatrain/distributed/node_exchange.py)
    assert resolve_tier(str(tmp_path), ("master", "moments")).kinds == ("params", "exp_avg", "exp_avg_sq")
    assert resolve_tier(str(tmp_path), ("moments", "grads")).kinds == ("exp_avg", "exp_avg_sq", "grads")
    with pytest.raises(MegatrainError, match="tmpfs"):
        resolve_tier("/dev/shm", ("moments",))
    with pytest.raises(ConfigError, match="nvme_states must be"):
        EngineConfig(nvme=str(tmp_path), nvme_states="weights")
    assert EngineConfig(nvme_states="moments,grads").nvme_states == ("moments", "grads")
    assert resolve_tier(str(tmp_path), ()) is None


def test_doctor_and_calibrate_check_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.perf import disk_rates
    from pipelines.doctor import FAIL, OK, WARN, check_nvme

    assert check_nvme("/dev/shm").status == FAIL
    ok = check_nvme(str(tmp_path), nbytes=8 << 20)
    assert ok.status in (OK, WARN) and "direct I/O read" in ok.value
    monkeypatch.setenv(disk_rates.RATES_ENV, str(tmp_path / "rates.json"))
    entry = disk_rates.calibrate_disk(tmp_path, 8 << 20, threads=2)
    assert disk_rates.disk_rates(tmp_path) == (entry["read_gbps"], entry["write_gbps"])
    assert list_state_dirs(tmp_path) == []


def test_the_benchmark_measures_raw_and_tier_io(tmp_path: Path) -> None:
    """benchmarks/nvme.py on a small file (its step part is the slow Engine runs above, not repeated here)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import nvme as bench

    out = tmp_path / "nvme.json"
    assert bench.main(["--nvme", str(tmp_path), "--gib", "0.125", "--repeats", "1", "--out", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert result["raw_read_gbps"] > 0 and result["tier_write_gbps"] > 0 and list_state_dirs(tmp_path) == []
