"""The NVMe tier's rooms without Ray: the directory check and its refusals, direct I/O of state files into a /dev/shm
mapping, the arena as staging (read ahead, write behind, pages punched out), faults as one sentence, and cleanup.

The state files go under pytest's tmp_path (ext4 here, which takes O_DIRECT); the staged segments into a file under
/dev/shm made by the test, removed after.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
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


def train(directory: Path, tmp: Path, batches: list, resume_from: Path | None = None, **settings: object
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Steps on `batches` (after loading `resume_from`), then the checkpoint's tensors."""
    import megatrain

    out = tmp / f"ckpt-{uuid.uuid4().hex[:6]}"
    with megatrain.Engine(directory, **{**ENGINE, **settings}) as engine:
        if resume_from is not None:
            engine.load_checkpoint(resume_from)
        losses = [engine.step(ids, labels) for ids, labels in batches]
        if settings.get("nvme"):  # the moments of the streamed units are on disk, none in /dev/shm
            engine.wait_for_updates()
            resident = sum(u.numel * 4 for u in engine.actors.layout.units[:engine.plan.resident_units])
            assert allocated(engine.handle.path("exp_avg")) <= resident
        engine.save_checkpoint(out)
    return losses, checkpoint_state(out)


def assert_same(got: tuple[list[float], dict[str, torch.Tensor]], want: tuple[list[float], dict[str, torch.Tensor]]
                ) -> None:
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k


@pytest.mark.parametrize("settings", [
    dict(max_grad_norm=CLIPS, speculate="on", micro_batches=2, batch_size=4, resident=1, device="cpu-async:3"),
    pytest.param(dict(max_grad_norm=1e3, speculate="on"), marks=pytest.mark.slow),
], ids=["clips-rollback-micro-batches-resident-simulated-streams", "no-clip-beside-the-backward"])
def test_moments_on_nvme_train_bit_for_bit(ray_session: None, micro_llama, tmp_path: Path, settings: dict) -> None:
    from helpers import rows

    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    want = train(directory, tmp_path, batches, **settings)
    got = train(directory, tmp_path, batches, nvme=nvme_dir, nvme_states="moments", **settings)
    assert_same(got, want)
    assert list_state_dirs(nvme_dir) == []  # removed with the run
