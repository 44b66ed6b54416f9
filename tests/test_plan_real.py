"""`megatrain plan` from the config.json of the largest models as published (tests/data/hf_configs): GPT-OSS-120B and
-20B (experts stored in MXFP4: the quantization_config stays in config.json) and Llama-3.1-405B. A plan reads
config.json alone: it counts every parameter of the model, builds at most its meta model and allocates no arena."""

from __future__ import annotations

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
