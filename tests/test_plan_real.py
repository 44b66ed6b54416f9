"""`megatrain plan` from the config.json of the largest models as published (tests/data/hf_configs): GPT-OSS-120B and
-20B (experts stored in MXFP4: the quantization_config stays in config.json) and Llama-3.1-405B. A plan reads
config.json alone: it counts every parameter of the model, builds at most its meta model and allocates no arena (nor
any file of the NVMe tier). With an NVMe directory, clipping on and fp32 masters, the host holds at most 8 bytes per
parameter: GPT-OSS-120B on the paper's H200 with 1,536 GiB of host, Llama-3.1-405B on 2 TiB."""

from __future__ import annotations

import json
import re
import resource
from pathlib import Path

import pytest
from helpers import REAL, my_segments

from pipelines.cli import main

# G parameters, counted from each config (every tensor's shape): GPT-OSS's expert weights and biases, router, attention
# with biases and sinks, an untied head of 201,088 rows; Llama-3.1-405B's 126 layers and untied head
PARAMS = {"gpt-oss-120b": 116.83, "gpt-oss-20b": 20.91, "llama-3.1-405b": 405.85}
H200 = ["--device", "cuda", "--gpu-gib", "141", "--host-gib", "1536"]  # a box of the paper: one H200, 1.5 TiB of host


def plan(directory: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, float]:
    """(exit code, report, G params) of `megatrain plan` for one row of 1,024 tokens."""
    code = main(["plan", "--model", str(directory), "--seq", "1024", "--batch", "1", *flags])
    out = capsys.readouterr().out
    found = re.search(r"\(([\d.]+) G params\)", out)
    assert found, out
    return code, out, float(found.group(1))


@pytest.mark.parametrize("name", PARAMS)
def test_plan_counts_every_parameter_and_allocates_nothing(name: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text((REAL / f"{name}.json").read_text())
    segments, peak = my_segments(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    code, out, params = plan(tmp_path, capsys, *H200)
    assert round(params, 2) == PARAMS[name], out
    assert my_segments() == segments  # no arena
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20, "the plan took a GiB of memory"
    assert ("fits: yes" if code == 0 else "fits: NO: ") in out
    if name == "gpt-oss-20b":  # 16 B per parameter, 234 GiB of arena: the H200 box holds it in host memory
        assert code == 0, out


# With an NVMe directory (its rates given), clipping on and fp32 masters: GPT-OSS-120B on the H200 box holds 5.6 B per
# parameter in the host with its moments and held gradients on disk (asked for: `--nvme-states moments,grads`);
# Llama-3.1-405B on 2 TiB fits only so, 4.3 B, and auto finds it (its fp32 masters stay in the host: a tf32 run streams
# them; in bf16 they could go to disk only beside the bf16 copy, which the executor streams instead).
NVME = {"gpt-oss-120b": ("1536", "moments,grads"), "llama-3.1-405b": ("2048", "auto")}


def nvme_plan(name: str, host: str, states: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
              *flags: str) -> tuple[int, dict, Path]:
    """(exit code, `megatrain plan --json`, the NVMe directory) of the model's plan on the H200 with that host."""
    model, nvme = tmp_path / "model", tmp_path / "nvme"
    model.mkdir(exist_ok=True)
    nvme.mkdir(exist_ok=True)
    (model / "config.json").write_text((REAL / f"{name}.json").read_text())
    code = main(["plan", "--model", str(model), "--seq", "1024", "--batch", "1", "--device", "cuda", "--gpu-gib", "141",
                 "--host-gib", host, "--nvme", str(nvme), "--nvme-gbps", "6,5", "--nvme-states", states, "--json",
                 *flags])
    return code, json.loads(capsys.readouterr().out), nvme


@pytest.mark.parametrize("name", NVME)
def test_plan_with_nvme_keeps_at_most_8_bytes_per_parameter_in_the_host(name: str, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The plan fits at <= 8 B a parameter, and a run of it would place what the plan placed (the run plan that
    `megatrain plan --json` prints, a run's OUT/plan.json, is made by the same resolve from the same memory plan)."""
    code, out, nvme = nvme_plan(name, *NVME[name], tmp_path, capsys)
    plan, run = out["plan"], out["run_plan"]
    assert code == 0 and out["fits"], out["problem"]
    assert round(plan["params"] / 1e9, 2) == PARAMS[name]
    assert plan["grads"] == "arena"  # clipping on: the gradients held until the global norm is known
    assert plan["tier"] is not None and plan["tier"]["directory"] == str(nvme)
    assert set(plan["tier"]["names"]) == {"moments", "grads"}
    assert plan["host_total"] / plan["params"] <= 8, plan["host_total"] / plan["params"]
    assert run["tier"]["names"] == plan["tier"]["names"] and run["bf16_copy"] == (plan["bf16_copy_bytes"] > 0)
    assert plan["longest_seq"] >= 1024  # its search places the tier too: without it nothing fits
    assert not any(nvme.iterdir())  # nothing written


def test_nvme_auto_takes_the_shortest_step_with_the_disk_as_a_bound(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-OSS-120B on the H200 box, nvme_states auto: of the ways that fit 1,536 GiB, the one whose step predicted with
    the disk as a bound is shortest (the disk bounds every one: the least traffic), its
    line naming what it beat. In bf16 (no room for the copy beside 16 B a parameter) the masters go to disk only with
    the copy kept, which the executor then streams."""
    from megatrain.memory.tier_plan import KINDS

    code, out, _ = nvme_plan("gpt-oss-120b", "1536", "auto", tmp_path, capsys)
    plan = out["plan"]
    names = tuple(plan["tier"]["names"])
    assert code == 0 and out["fits"] and set(names) <= set(KINDS)
    assert out["run_plan"]["tier"]["names"] == list(names)
    # the disk's share of a step: each kind's bytes read and written at 6 and 5 GB/s; moments 8 B a parameter each way,
    # held gradients 4: the fewest bytes that fit
    traffic = {"moments": 8, "grads": 4, "master": 4}
    fits_alone = {"grads", "moments"}  # 1,536 GiB holds either kind's 16 - 4 or 16 - 8 B a parameter left
    best = min(fits_alone, key=traffic.__getitem__)
    assert names == (best,) and f"nvme_states auto: {best} " in plan["tier_note"]
    assert "moments,grads" in plan["tier_note"] and "B/param in host memory" in plan["tier_note"]  # the leaner ways too
    assert set(KINDS) == set(traffic)
    code, bf16, _ = nvme_plan("gpt-oss-120b", "1536", "master,moments,grads", tmp_path, capsys, "--precision", "bf16")
    assert bf16["plan"]["bf16_copy_bytes"] > 0 and bf16["run_plan"]["bf16_copy"]  # the copy, with the masters on disk
    assert bf16["plan"]["host_total"] / bf16["plan"]["params"] <= 4  # the copy, the staging, the processes
