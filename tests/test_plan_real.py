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


# nvme_states "auto" places the fewest kinds that make the host fit: GPT-OSS-120B fits 1,536 GiB with its moments
# alone on disk (9.2 B per parameter left in the host: the fp32 masters, the held gradients, the staging); with its
# held gradients there too, 5.6. Llama-3.1-405B needs its moments and masters there on 2 TiB (4.5). A run places moments
# alone today (tests/test_nvme.py): the plan says so beside its report.
NVME = {"gpt-oss-120b": ("1536", "moments,grads"), "llama-3.1-405b": ("2048", "auto")}


@pytest.mark.parametrize("name", NVME)
def test_plan_with_nvme_keeps_at_most_8_bytes_per_parameter_in_the_host(name: str, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    host, states = NVME[name]
    model, nvme = tmp_path / "model", tmp_path / "nvme"
    model.mkdir()
    nvme.mkdir()
    (model / "config.json").write_text((REAL / f"{name}.json").read_text())
    code = main(["plan", "--model", str(model), "--seq", "1024", "--batch", "1", "--device", "cuda", "--gpu-gib", "141",
                 "--host-gib", host, "--nvme", str(nvme), "--nvme-gbps", "6,5", "--nvme-states", states, "--json"])
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert code == 0 and out["fits"], out["problem"]
    assert round(plan["params"] / 1e9, 2) == PARAMS[name]
    assert plan["grads"] == "arena"  # clipping on: the gradients held until the global norm is known
    assert plan["tier"] is not None and plan["tier"]["directory"] == str(nvme)
    assert plan["host_total"] / plan["params"] <= 8, plan["host_total"] / plan["params"]
    assert not any(nvme.iterdir())  # nothing written
