"""`megatrain doctor`: the command as a user runs it (CPU path in CI), and each check's verdicts on machines we
do not have, made with monkeypatch. Nothing here asserts a time or a rate."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from megatrain.memory.arena import list_segments
from megatrain.perf.calibrate import ArenaCopyRates, CopyRates
from pipelines import doctor
from pipelines.doctor import FAIL, OK, SKIPPED, WARN, Check

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
NAMES = ["versions", "gpu", "host", "shm", "memlock", "host_register", "optimizer", "cpu_step", "gpu_step", "ray"]
GPU_CHECKS = ("gpu", "host_register", "gpu_step")


def test_cli_reports_every_check(ray_session: None, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRAIN_SHM_DIR", str(shm_dir))
    run = run_cli("doctor", cwd=REPO)  # in this process: the ray check reports the session's Ray
    out = run.output
    assert run.returncode == 0, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line]
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("megatrain doctor (")):]
    assert lines[0].startswith("megatrain doctor (megatrain ")
    rows = [line.split(None, 2) for line in lines[1:-1] if not line.startswith(" ")]
    assert [name for _, name, _ in rows] == NAMES, out
    status = {name: s for s, name, _ in rows}
    assert FAIL not in status.values()
    if CUDA:
        assert all(status[name] in (OK, WARN) for name in GPU_CHECKS), out
    else:  # each GPU check says it was skipped and, on the line under it, why
        for name in GPU_CHECKS:
            assert status[name] == SKIPPED, out
            i = next(i for i, line in enumerate(lines) if line.split()[1:2] == [name])
            assert lines[i + 1].strip().startswith("why: "), out
    assert status["cpu_step"] == OK and status["optimizer"] == OK and status["ray"] in (OK, WARN)
    assert "G params/s" in out
    assert lines[-1].startswith("10 checks in ") and "0 fail" in lines[-1]
    assert list(shm_dir.iterdir()) == []  # the test segments and the tiny models' arenas are gone


# ---- each check's verdicts ----

def fake_statvfs(size: int, free: int) -> os.statvfs_result:
    # (bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax), in 4 KiB blocks
    return os.statvfs_result((4096, 4096, size // 4096, free // 4096, free // 4096, 0, 0, 0, 0, 255))


def test_tiny_shm_fails_with_advice(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.os, "statvfs", lambda _: fake_statvfs(64 << 20, 60 << 20))  # docker's default
    check = doctor.check_shm(shm_dir)
    assert (check.name, check.status) == ("shm", FAIL)
    assert "64 MiB, 60 MiB free (an arena of up to 3.9 M params" in check.value
    assert "--shm-size" in check.advice and "megatrain cleanup" in check.advice


def test_shm_smaller_than_half_the_host_warns(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(doctor.os, "statvfs", lambda _: fake_statvfs(host // 4, host // 4))
    monkeypatch.setattr(doctor, "fs_type", lambda _: "tmpfs")
    check = doctor.check_shm(shm_dir)
    assert check.status == WARN and "limits the model size" in check.advice
    monkeypatch.setattr(doctor.os, "statvfs", lambda _: fake_statvfs(host, host))
    assert doctor.check_shm(shm_dir).status == OK


def test_shm_stale_segments_and_other_file_systems_warn(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.os, "statvfs", lambda _: fake_statvfs(1 << 40, 1 << 40))
    monkeypatch.setattr(doctor, "fs_type", lambda _: "ext4")
    check = doctor.check_shm(shm_dir)
    assert check.status == WARN and "MEGATRAIN_SHM_DIR" in check.advice
    (shm_dir / "megatrain-run1-999999999-1-params").write_bytes(b"")  # no such owner pid
    check = doctor.check_shm(shm_dir)
    assert check.status == WARN and "1 segment(s) of dead runs" in check.value
    assert "megatrain cleanup" in check.advice
    assert list_segments(shm_dir)  # reported, not removed: that is cleanup's job


def test_missing_shm_fails(tmp_path: Path) -> None:
    check = doctor.check_shm(tmp_path / "nowhere")
    assert check.status == FAIL and "MEGATRAIN_SHM_DIR" in check.advice


@pytest.mark.parametrize(("limit", "text"), [(8 << 20, "8 MiB"), (64 << 10, "64 KiB"), (3 << 29, "1.5 GiB"),
                                             (int(23.54 * 2**30), "23.5 GiB"), (100, "100 B"),
                                             (resource.RLIM_INFINITY, "unlimited")])
def test_limit_text(limit: int, text: str) -> None:
    assert doctor.limit_text(limit) == text


def test_memlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda _: (64 << 10, 64 << 10))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check = doctor.check_memlock()
    assert (check.name, check.status) == ("memlock", WARN)
    assert "ulimit -l: 64 KiB" in check.value and "ulimit -l unlimited" in check.advice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nothing is page-locked on the CPU path
    assert doctor.check_memlock().status == OK
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert "unlimited (hard limit unlimited)" in doctor.check_memlock().value


@pytest.mark.parametrize("line", [
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  (dvs-builder@U16)",
])
def test_nvidia_driver_version(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "version").write_text(line + "\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(doctor, "NVIDIA_VERSION", tmp_path / "version")
    assert doctor.nvidia_driver() == "550.54.15"
    monkeypatch.setattr(doctor, "NVIDIA_VERSION", tmp_path / "absent")
    assert doctor.nvidia_driver() is None


def test_gpu_verdicts_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "nvidia_driver", lambda: None)
    check = doctor.check_gpu()
    assert check.status == SKIPPED and "no NVIDIA driver" in check.advice
    monkeypatch.setattr(doctor, "nvidia_driver", lambda: "550.54.15")
    monkeypatch.setattr(torch.version, "cuda", None)
    check = doctor.check_versions()  # a driver, but torch cannot use it
    assert check.status == WARN and "CUDA build of torch" in check.advice
    assert "CPU-only build" in doctor.check_gpu().advice
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check = doctor.check_gpu()  # driver and CUDA build, yet no GPU: something is wrong
    assert check.status == FAIL and "CUDA_VISIBLE_DEVICES ('')" in check.advice


def test_gpu_verdicts_with_a_busy_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        name, major, minor = "NVIDIA H100 80GB HBM3", 9, 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (79 << 30, 80 << 30))
    check = doctor.check_gpu()
    assert check.status == OK and check.value == "NVIDIA H100 80GB HBM3 (sm_90), 79.0 of 80.0 GiB free"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40 << 30, 80 << 30))
    check = doctor.check_gpu()
    assert check.status == WARN and "nvidia-smi" in check.advice


def test_host_register_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def rates(registered: bool, pinned: float) -> ArenaCopyRates:
        return ArenaCopyRates(registered, CopyRates([7.8] * 3, [6.0] * 3), CopyRates([pinned] * 3, [53.0] * 3,
                                                                                    [94.0] * 3))

    monkeypatch.setattr(doctor, "arena_copy_rates", lambda numel, repeats: rates(True, 55.0))
    check = doctor.check_host_register()
    assert check.status == OK
    assert "H2D 55.0, D2H 53.0, both at once 94.0 registered; H2D 7.8, D2H 6.0 pageable" in check.value
    monkeypatch.setattr(doctor, "arena_copy_rates", lambda numel, repeats: rates(False, 7.8))
    check = doctor.check_host_register()
    assert check.status == FAIL and "memlock" in check.advice
    monkeypatch.setattr(doctor, "arena_copy_rates", lambda numel, repeats: rates(True, 7.0))
    assert doctor.check_host_register().status == WARN


def test_gpu_step_compares_with_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = doctor.tiny_step("cpu")
    assert len(cpu[1]) == 21 and all(torch.isfinite(g).all() for g in cpu[1].values())
    off = {name: g * (1 + 1e-3) if name.endswith("down_proj.weight") else g for name, g in cpu[1].items()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpu, status in ((cpu, OK), ((cpu[0], off), FAIL), ((float("nan"), cpu[1]), FAIL)):
        monkeypatch.setattr(doctor, "tiny_step", lambda device, gpu=gpu: gpu if device == "cuda" else cpu)
        assert doctor.check_gpu_step().status == status


def test_relative_difference() -> None:
    a = (2.0, {"w": torch.tensor([1.0, -4.0])})
    assert doctor.relative_difference(a, a) == 0.0
    assert doctor.relative_difference((2.0, {"w": torch.tensor([1.0, -4.2])}), a) == pytest.approx(0.05)
    assert doctor.relative_difference((2.1, a[1]), a) == pytest.approx(0.05)


def test_ray_at_an_address_where_nothing_listens() -> None:
    import ray

    connected = ray.is_initialized()  # the session's Ray, when an earlier test started it
    check = doctor.check_ray("127.0.0.1:1")  # refused at once, instead of Ray's minutes of retrying
    assert (check.name, check.status) == ("ray", FAIL)
    assert "could not join 127.0.0.1:1" in check.value and "nothing answers" in check.value, check.value
    assert "ray start --head" in check.advice
    assert ray.is_initialized() == connected, "the check neither started a Ray nor dropped the session's"


def test_a_check_that_raises_is_that_checks_failure(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for name in NAMES:  # quick stand-ins, so that only the runner is under test
        monkeypatch.setattr(doctor, f"check_{name}", lambda *_, name=name: Check(name, OK, "fine"))

    def broken() -> Check:
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "check_host", broken)
    checks = list(doctor.run_checks())
    assert [c.name for c in checks] == NAMES
    assert (checks[2].status, checks[2].value) == (FAIL, "RuntimeError: boom")
    assert all(c.status == OK for c in checks if c.name != "host")

    assert doctor.main(as_json=True) == 1  # a failed check: exit code 1
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {OK: 9, WARN: 0, FAIL: 1, SKIPPED: 0}
    assert out["checks"][2] == {"name": "host", "status": FAIL, "value": "RuntimeError: boom",
                                "advice": out["checks"][2]["advice"]} and out["checks"][2]["advice"]


def test_render() -> None:
    assert doctor.render(Check("host", OK, "2 cores")) == "ok       host           2 cores"
    text = doctor.render(Check("gpu", SKIPPED, "no GPU", "no NVIDIA driver is loaded."))
    assert text.splitlines()[1] == " " * 24 + "why: no NVIDIA driver is loaded."
    text = doctor.render(Check("shm", FAIL, "64 MiB", "enlarge it. " * 20))
    assert text.splitlines()[1].startswith(" " * 24 + "fix: enlarge it.")
    assert all(len(line) <= 110 for line in text.splitlines()) and len(text.splitlines()) > 2
