"""`megatrain dpo --model M --data pairs.jsonl --out OUT`: DPO (megatrain/post/dpo.py) on the streamed model.

TRL's preference format; the reference's log-probs from the initial weights by the same Engine, cached in
OUT/reference_logps.json; TRL's metrics each step; the trained model in OUT/final (docs/design.md#dpo-runs)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatrain.config import ConfigError
from megatrain.post.dpo import DPOLoss, Pair, encode_pair, pair_batch, sequence_logps
from pipelines.logprobs import batch_of
from pipelines.post_run import EngineOptions, RunLog, file_digest, model_and_tokenizer, read_jsonl, save_final

SHOWN = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
CACHE = "reference_logps.json"


@dataclass
class DPOConfig:
    beta: float = 0.1
    steps: int | None = None  # None: `epochs` passes over the training pairs
    epochs: int = 1
    batch_pairs: int = 4
    max_length: int = 512  # a row's tokens: the prompt's, then as many of the completion's as fit
    eval_fraction: float = 0.1
    eval_every: int | None = None  # None: every steps // 5
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(lr=1e-6))


def run_dpo(model: str | Path, data: str | Path, out: str | Path, cfg: DPOConfig | None = None) -> dict[str, Any]:
    """Trains `model` by DPO on `data` into `out`; returns the first and last metrics and the held-out ones."""
    import megatrain

    cfg = cfg or DPOConfig()
    loss, out = DPOLoss(cfg.beta), Path(out)
    model_dir, tokenizer = model_and_tokenizer(model)
    pairs = [encode_pair(row, tokenizer, tokenizer.eos_id) for row in read_jsonl(data, "--data")]
    train, held_out = split(pairs, cfg.eval_fraction, cfg.engine.seed)
    steps = cfg.steps or max(1, cfg.epochs * math.ceil(len(train) / cfg.batch_pairs))
    with megatrain.Engine(model_dir, total_steps=steps, batch_size=2 * cfg.batch_pairs, seq_len=cfg.max_length,
                          **cfg.engine.engine_kwargs()) as engine:
        run_log = RunLog(out, engine.metrics)
        key = file_digest(Path(data), str(model_dir), str(cfg.max_length))
        refs = reference_logps(engine, out / CACHE, key, {"train": train, "eval": held_out}, tokenizer.pad_id, cfg)
        evals = [evaluate(engine, loss, held_out, refs["eval"], tokenizer.pad_id, cfg)] if held_out else []
        if evals:
            run_log.write("eval", 0, evals[-1], tuple(f"eval/{k}" for k in SHOWN))
        order = random.Random(cfg.engine.seed)
        batches = _batches(len(train), cfg.batch_pairs, order)
        every = cfg.eval_every or max(1, steps // 5)
        first = last = {}
        for step in range(1, steps + 1):
            rows = next(batches)
            ids, labels, mask = pair_batch([train[i] for i in rows], tokenizer.pad_id, cfg.max_length)
            ref = torch.tensor([refs["train"][i][0] for i in rows] + [refs["train"][i][1] for i in rows])
            result = engine.step_batch(batch_of(ids, labels, loss=loss, fields={"mask": mask, "ref": ref}))
            last = {"loss": result.loss, **result.loss_metrics, "grad_norm": result.grad_norm, "lr": result.lr}
            first = first or last
            run_log.write("step", step, last, SHOWN)
            if held_out and (step % every == 0 or step == steps):
                evals.append(evaluate(engine, loss, held_out, refs["eval"], tokenizer.pad_id, cfg))
                run_log.write("eval", step, evals[-1], tuple(f"eval/{k}" for k in SHOWN))
        final = save_final(engine, out, model_dir)
    return {"steps": steps, "first": first, "last": last, "eval_first": evals[0] if evals else None,
            "eval_last": evals[-1] if evals else None, "final": str(final)}


def split(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs): a seeded shuffle, `fraction` of them held out (at least one of two or more)."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {fraction}.")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = min(len(pairs) - 1, max(1 if fraction and len(pairs) > 1 else 0, round(fraction * len(pairs))))
    return [pairs[i] for i in order[held:]], [pairs[i] for i in order[:held]]


def _batches(n: int, size: int, order: random.Random) -> Any:
    """Endless batches of `size` indices of n pairs: a shuffled pass after another."""
    while True:
        indices = list(range(n))
        order.shuffle(indices)
        for start in range(0, n - size + 1 if n >= size else 1, size):
            yield indices[start : start + size] if n >= size else indices


def sequence_logps_of(engine: Any, pairs: list[Pair], pad_id: int, cfg: DPOConfig) -> list[tuple[float, float]]:
    """Per pair, the current weights' sequence log-probs of (chosen, rejected), batch_pairs at a time."""
    out = []
    for start in range(0, len(pairs), cfg.batch_pairs):
        chunk = pairs[start : start + cfg.batch_pairs]
        ids, labels, mask = pair_batch(chunk, pad_id, cfg.max_length)
        chosen, rejected = sequence_logps(engine.logprobs(ids, labels), mask).chunk(2)
        out += list(zip(chosen.tolist(), rejected.tolist(), strict=True))
    return out


def reference_logps(engine: Any, cache: Path, key: str, splits: dict[str, list[Pair]], pad_id: int,
                    cfg: DPOConfig) -> dict[str, list[tuple[float, float]]]:
    """The initial weights' sequence log-probs of every pair of each split: from `cache` where it was made for `key`
    (the data, model and length), else computed now, before any step, and written there (atomically)."""
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key and all(len(saved.get(k, ())) == len(v) for k, v in splits.items()):
            return {k: [tuple(p) for p in saved[k]] for k in splits}
    refs = {name: sequence_logps_of(engine, pairs, pad_id, cfg) for name, pairs in splits.items()}
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, **refs}))
    tmp.replace(cache)
    return refs


def evaluate(engine: Any, loss: DPOLoss, pairs: list[Pair], refs: list[tuple[float, float]], pad_id: int,
             cfg: DPOConfig) -> dict[str, float]:
    """TRL's DPO metrics over the held-out pairs (weighted by their count in each batch) and the mean loss."""
    totals: dict[str, float] = {}
    for start in range(0, len(pairs), cfg.batch_pairs):
        chunk, ref_chunk = pairs[start : start + cfg.batch_pairs], refs[start : start + cfg.batch_pairs]
        ids, labels, mask = pair_batch(chunk, pad_id, cfg.max_length)
        logp = engine.logprobs(ids, labels)
        fields = {"mask": mask, "ref": torch.tensor([r[0] for r in ref_chunk] + [r[1] for r in ref_chunk])}
        values = {"loss": loss(logp, None, fields).item(), **loss.metrics(logp, None, fields)}
        for name, value in values.items():
            totals[f"eval/{name}"] = totals.get(f"eval/{name}", 0.0) + value * len(chunk)
    return {name: total / len(pairs) for name, total in totals.items()}
