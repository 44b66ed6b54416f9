"""What `megatrain dpo` and `megatrain grpo` share (pipelines/dpo.py, pipelines/grpo.py): the Engine options of a
post-training run, the model's tokenizer, JSONL records, the run directory (its metrics.jsonl, one JSON object a
step or evaluation, and the progress line beside it) and the HF directory written at the end (OUT/final, with the
source model's tokenizer files)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatrain.config import ConfigError
from megatrain.data.tokenizers import Tokenizer
from megatrain.io.hub import tokenizer_files
from megatrain.store import resolve_model
from pipelines.generate import model_tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineOptions:
    """The Engine's settings a post-training run passes on (its optimizer and where it computes)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    precision: str = "fp32"
    device: str = "auto"
    optimizer_workers: int | str = 1
    seed: int = 0

    def engine_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(EngineOptions)}


def model_and_tokenizer(model: str | Path) -> tuple[Path, Tokenizer]:
    """The model's directory and its tokenizer (a post-training run reads and writes text), or one sentence."""
    _, directory, _ = resolve_model(model)
    tokenizer = model_tokenizer(None if directory is None else Path(directory))
    if directory is None or tokenizer is None:
        raise ConfigError(f"{model} has no tokenizer.json; post-training reads text: give an HF model directory "
                          "(or hub name) with its tokenizer.")
    return Path(directory), tokenizer


def read_jsonl(path: str | Path, what: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line, or one sentence on what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} is no file; give a JSONL file, one JSON object a line.")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {number} is not JSON ({e.msg}).") from None
    if not rows:
        raise ConfigError(f"{what} {path} has no records.")
    return rows


def file_digest(*parts: str | Path) -> str:
    """sha256 over files' bytes and strings: what a cache beside the run is valid for."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(Path(part).read_bytes() if isinstance(part, Path) else part.encode())
    return digest.hexdigest()


class RunLog:
    """OUT/metrics.jsonl, one object a step or evaluation, a progress line for each in the log, and the values in
    the run's Ray metrics (megatrain_post_training, the dashboard's Post-training panel) where it records them."""

    def __init__(self, out: Path, metrics: Any = None):
        self.out, self.metrics = out, metrics
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        self.path.write_text("")
        self.start = time.monotonic()

    def write(self, kind: str, step: int, values: dict[str, float], shown: tuple[str, ...]) -> None:
        row = {"kind": kind, "step": step, "seconds": round(time.monotonic() - self.start, 2), **values}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("%s %d  %s", kind, step, "  ".join(f"{k} {values[k]:.4g}" for k in shown if k in values))
        if self.metrics is not None:
            self.metrics.record_post(values)


def save_final(engine: Any, out: Path, model_dir: Path) -> Path:
    """OUT/final: the trained model as an HF directory, the source model's tokenizer files beside it."""
    return engine.save_pretrained(out / "final", extra_files=tokenizer_files(model_dir))
