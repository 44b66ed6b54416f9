"""The training run behind `megatrain train` and `megatrain finetune`: config, loop, checkpoints, logs.

    cfg = TrainConfig.load("examples/configs/tiny.toml", overrides={"steps": 50})
    summary = run(cfg)

A run directory holds checkpoints/step-NNNNNNNN/ (the last `keep_checkpoints`), steps.jsonl (one line of
loss and stall accounting per step), trace.json with --trace, and final/ (an HF model directory).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import tomllib

from actors.data_loader import DataLoaderActor
from megatrain.config import (
    RESIDENT_WEIGHTS,
    ConfigError,
    MegatrainError,
    ModelConfig,
    Terminated,
    check_auto_or_positive,
    check_choice,
    check_nvme,
    check_resident,
    check_tiling,
    compile_setting,
    dataclass_from_dict,
)
from megatrain.data import DataConfig, find_data_files
from megatrain.data.hf_datasets import hub_environment
from megatrain.io.checkpoint import CheckpointError
from megatrain.io.hub import tokenizer_files
from megatrain.memory.kept_activations import check_keep_activations
from megatrain.presets import default_lr, default_warmup
from megatrain.run_plan import PLAN_FILE
from megatrain.store import resolve_model
from megatrain.telemetry import write_chrome_trace
from pipelines.engine import Engine, StepResult
from pipelines.lora import as_lora_config

if TYPE_CHECKING:
    from megatrain.perf.predict import Prediction

log = logging.getLogger("megatrain")


@dataclass
class TrainConfig:
    """One run. Defaults: the tiny preset on synthetic data, about a minute on a laptop CPU."""

    model: str = "tiny"  # preset name, HF model directory or Hugging Face Hub name (org/name[@revision])
    steps: int = 300
    out_dir: str = "runs/tiny"
    # optimizer
    lr: float | None = None  # None: by the model's size (megatrain/presets.py LR_BY_SIZE: 3e-4 at 7B)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int | None = None  # None: 3% of the steps, at least 20, at most half (presets.default_warmup)
    decay: bool = True  # cosine decay to min_lr_ratio over `steps` (False: constant after warmup)
    min_lr_ratio: float = 0.1
    # engine
    optimizer_workers: int | str = 2  # "auto": from the node's free CPUs (and the calibration, where cached)
    precision: str = "tf32"
    device: str = "auto"
    grads: str = "auto"  # where gradients wait: auto | arena | stream | device (EngineConfig.grads)
    speculate: str = "auto"  # the update beside the backward: auto | on | off (EngineConfig.speculate)
    resident: int | str = "auto"  # units resident and updated on the GPU: auto | none | N (EngineConfig.resident)
    resident_weights: str = "auto"  # bf16: their compute weights a copy or cast at each use (EngineConfig)
    bf16_copy: str = "auto"  # bf16: a bf16 copy of the weights in the arena: auto | keep | none (EngineConfig)
    gpu_memory_gib: float | None = None  # the GPU held to this many GiB (EngineConfig.gpu_memory_gib)
    nvme: str | None = None  # a directory on a local disk for the NVMe tier (EngineConfig.nvme)
    nvme_states: str | list[str] = "auto"  # what lives there: auto | all | a list of master, moments, grads
    keep_activations: int | str = "auto"  # top layers not recomputed: auto | none | all | N (EngineConfig)
    compile: str | bool = "auto"  # auto | on | off: torch.compile the layers and the head (EngineConfig.compile)
    loss_chunk_tokens: int = 4096
    # long sequences (EngineConfig): "auto" lets the memory plan pick the tile size and how many GiB of layer
    # checkpoints stay on the GPU (0: all of them in host memory)
    tile_tokens: int | str | None = "auto"
    checkpoint_budget_gib: float | str | None = "auto"
    # a step is this many micro-batches of data.batch_size rows and one update ("auto": data.batch_size is the
    # step's rows, each executor's, in the fewest micro-batches that fit memory)
    micro_batches: int | str = 1
    schedule: str = "auto"  # layer-major (weights once per step) where memory allows, else per-micro-batch
    # executors, data parallel ("auto": one per GPU Ray offers on the run's node, one on the CPU path); a step's
    # batch is data.batch_size x micro_batches x executors rows
    executors: int | str = "auto"
    # Ray nodes (each with its store, optimizer workers and executors): a step's batch is also x nodes rows
    nodes: int = 1
    seed: int = 0
    # LoRA (megatrain/lora/): adapters trained on the frozen base instead of every weight, as the command line writes
    # them ("r=16,alpha=32,targets=q_proj,v_proj") or a [lora] table; the base stored in lora_base_dtype (bf16 | fp32);
    # adapter: a PEFT adapter directory to start from; merge: final/ holds the adapter, merged/ the merged model
    lora: str | dict[str, Any] | None = None
    lora_base_dtype: str = "bf16"
    adapter: str | None = None
    merge: bool = False
    # the Ray cluster: None joins the one `ray start` runs here, else starts a private one; "local" always a
    # private one; "auto" or host:port that cluster, which must answer (pipelines/cluster.py)
    address: str | None = None
    # bookkeeping
    checkpoint_every: int = 100  # 0: none (the last step is always checkpointed otherwise)
    keep_checkpoints: int = 3
    eval_every: int = 0  # 0: no evaluation (finetune sets it)
    log_every: int = 10
    resume: bool = False
    trace: bool = False
    save_final: bool = True
    max_nonfinite_steps: int = 5
    data: DataConfig = field(default_factory=DataConfig)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """From a TOML file (top-level keys plus a [data] table) and then flag overrides ("data.x" keys too)."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                values = tomllib.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"config file {path} does not exist; check the path.") from None
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"config file {path} is not valid TOML ({e}).") from None
            except OSError as e:
                raise ConfigError(f"config file {path} cannot be read ({e.strerror}); pass a TOML file.") \
                    from None
        data = values.pop("data", {})
        if not isinstance(data, dict):
            raise ConfigError(f"train config: data must be a [data] table, got {data!r}.")
        for key, value in (overrides or {}).items():
            if value is None:
                continue
            if key.startswith("data."):
                data[key[5:]] = value
            elif key == "data":
                raise ConfigError("train config: set data options one by one, as data.<key> overrides.")
            else:
                values[key] = value
        cfg = dataclass_from_dict(cls, values, f"train config{f' {path}' if path else ''}")
        cfg.data = dataclass_from_dict(DataConfig, data, "[data] config")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for names, kind, what in ((TRAIN_INTS, int, "an integer"), (TRAIN_FLAGS, bool, "true or false"),
                                  (TRAIN_STRINGS, str, "a string")):
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise ConfigError(f"train config: {name} must be {what}, got {value!r}.")
        if self.warmup_steps is not None and (not isinstance(self.warmup_steps, int) or
                                              isinstance(self.warmup_steps, bool)):
            raise ConfigError(f"train config: warmup_steps must be an integer, got {self.warmup_steps!r}.")
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigError(f"train config: address must be a string, got {self.address!r}.")
        for name in ("steps", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train config: {name} must be at least 1, got {getattr(self, name)}.")
        if self.checkpoint_every < 0:
            raise ConfigError("train config: checkpoint_every must be >= 0 (0: no checkpoints, e.g. for a benchmark; "
                              f"a fault then restarts from the first step), got {self.checkpoint_every}.")
        if self.eval_every < 0:
            raise ConfigError("train config: eval_every must be >= 0 (0 turns evaluation off).")
        if self.eval_every and not (self.data.eval_fraction or self.data.eval_count):
            raise ConfigError("train config: eval_every is set but the data has no held-out split; set eval_fraction "
                              "or eval_count in the config file's [data] table, or eval_every = 0.")
        for name in ("tile_tokens", "checkpoint_budget_gib"):  # "none" from a flag or TOML (which has no null)
            if isinstance(getattr(self, name), str) and getattr(self, name).lower() == "none":
                setattr(self, name, None)
        check_tiling(self.tile_tokens, self.checkpoint_budget_gib)
        if as_lora_config(self.lora) is None and self.adapter is None and self.merge:
            raise ConfigError("train config: merge writes the base with a LoRA adapter merged in; set lora (or "
                              "adapter), or leave merge off.")
        check_resident(self.resident)
        check_choice("train config: resident_weights", self.resident_weights, RESIDENT_WEIGHTS)
        check_nvme(self.nvme, self.nvme_states)
        check_keep_activations(self.keep_activations)
        self.compile = compile_setting(self.compile)
        for name in ("optimizer_workers", "micro_batches", "executors"):
            check_auto_or_positive(f"train config: {name}", getattr(self, name))
        if self.max_nonfinite_steps < 0:
            raise ConfigError("train config: max_nonfinite_steps must be >= 0, "
                              f"got {self.max_nonfinite_steps}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


TRAIN_INTS = ("steps", "loss_chunk_tokens", "seed", "nodes",
              "checkpoint_every", "keep_checkpoints", "eval_every", "log_every", "max_nonfinite_steps")
TRAIN_FLAGS = ("decay", "resume", "trace", "save_final", "merge")
TRAIN_STRINGS = ("model", "out_dir", "precision", "device", "grads", "schedule", "speculate", "lora_base_dtype",
                 "resident_weights", "bf16_copy")


def with_size_defaults(cfg: TrainConfig, config: ModelConfig, say: Callable[..., None] = log.info) -> TrainConfig:
    """cfg with the lr and warm-up it left unset (None) chosen by the model's size and the run's length, said."""
    n = config.num_params()
    defaults = {"lr": default_lr(n), "warmup_steps": default_warmup(cfg.steps)}  # megatrain/presets.py
    chosen = {k: v for k, v in defaults.items() if getattr(cfg, k) is None}
    for name, value in chosen.items():
        setattr(cfg, name, value)
    if chosen:
        say("%s by default for a %s-parameter model over %d steps (published recipes' rate for the size, warm-up "
                 "3%% of the steps, at least 20, at most half)", ", ".join(f"{k} {v:g}" for k, v in chosen.items()),
                 f"{n / 1e9:.3g} G" if n >= 1e9 else f"{n / 1e6:.3g} M", cfg.steps)
    return cfg


def engine_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    names = ("lr", "weight_decay", "betas", "eps", "max_grad_norm", "warmup_steps", "min_lr_ratio",
             "optimizer_workers", "precision", "device", "grads", "compile", "seed", "loss_chunk_tokens", "address",
             "max_nonfinite_steps", "trace", "tile_tokens", "checkpoint_budget_gib", "micro_batches", "schedule",
             "executors", "nodes", "speculate", "resident", "lora", "lora_base_dtype", "adapter", "keep_activations",
             "resident_weights", "bf16_copy", "gpu_memory_gib", "nvme", "nvme_states")
    return {n: getattr(cfg, n) for n in names} | {
        "total_steps": cfg.steps if cfg.decay else None, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len}


# ---- checkpoints ----

def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Complete-looking checkpoints, newest first (temp dirs of an interrupted save are ignored)."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def resume_latest(engine: Engine, loader: Any, out_dir: Path) -> int:
    """Loads the newest checkpoint that verifies; falls back past torn ones. Returns the step reached."""
    for directory in checkpoint_dirs(out_dir):
        try:
            state = engine.load_checkpoint(directory)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", directory.name, e)
            continue
        if "data" in state:
            ray.get(loader.load_state_dict.remote(state["data"]))
        log.info("resumed from %s (step %d)", directory, state["steps_done"])
        return int(state["steps_done"])
    raise CheckpointError(f"--resume found no complete checkpoint in {out_dir / 'checkpoints'}; "
                          "start without --resume.")


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    for old in checkpoint_dirs(out_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


# ---- progress ----

class Progress:
    """One status line (a bar on a terminal, a log line every log_every steps otherwise)."""

    def __init__(self, total: int, log_every: int, tty: bool | None = None):
        self.total, self.log_every = total, log_every
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.t0 = time.monotonic()

    def update(self, step: int, fields_: dict[str, str]) -> None:
        done = step + 1
        text = " ".join(f"{k} {v}" for k, v in fields_.items())
        if self.tty:
            width = 24
            filled = int(width * done / self.total)
            bar = "█" * filled + "·" * (width - filled)
            sys.stderr.write(f"\r{bar} {done}/{self.total} {text}\033[K")
            sys.stderr.flush()
        elif done % self.log_every == 0 or done == self.total:
            print(f"step {done}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


# ---- the loop ----

def run(cfg: TrainConfig, extra_files: list[Path] | None = None) -> dict[str, Any]:
    """Trains per `cfg`; returns a summary (first/last loss, eval losses, skipped steps, paths)."""
    out_dir = Path(cfg.out_dir)
    data_format, _ = find_data_files(cfg.data)  # a mistyped path fails now, before Ray starts and the arena is filled
    notes: list[tuple] = []  # said once the Engine started: a run refused before then prints its one sentence alone
    cfg = with_size_defaults(cfg, resolve_model(cfg.model, verify=False)[0], lambda *note: notes.append(note))
    if cfg.warmup_steps >= cfg.steps:
        log.warning("warmup_steps %d is not below steps %d: the learning rate never reaches lr %g (the first step's "
                    "is 0); lower warmup_steps", cfg.warmup_steps, cfg.steps, cfg.lr)
    engine = Engine(cfg.model, **engine_kwargs(cfg))
    for note in notes:
        log.info(*note)
    if extra_files is None:  # an HF model's tokenizer files travel with the trained weights into final/
        extra_files = tokenizer_files(resolve_model(cfg.model, verify=False)[1])
    loader = None
    try:
        with sigterm_stops_the_run():
            cfg.data.vocab_size = engine.config.vocab_size
            engine.check_sequence_length(cfg.data.seq_len)  # every batch the loader packs is this long
            # the loader hands a step's micro-batches, every executor's, as one batch
            per_executor = 1 if cfg.micro_batches == "auto" else cfg.micro_batches
            cfg.data.micro_batches = per_executor * engine.engine_config.executors * engine.engine_config.nodes
            loader = DataLoaderActor.options(scheduling_strategy=engine.scheduling_strategy,
                                             runtime_env=hub_environment(data_format)).remote(cfg.data.to_dict())
            ray.get(loader.state_dict.remote())  # a bad data source fails here, in one sentence
            out_dir.mkdir(parents=True, exist_ok=True)  # only now: a run that cannot start leaves no directory
            start = resume_latest(engine, loader, out_dir) if cfg.resume else 0
            (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
            (out_dir / PLAN_FILE).write_text(json.dumps(engine.run_plan.to_dict(), indent=2))  # = plan --json's
            prediction = record_prediction(engine, out_dir)
            return _loop(cfg, engine, loader, out_dir, start, extra_files or [], prediction)
    finally:
        if loader is not None:
            ray.kill(loader)
        engine.shutdown()


@contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """SIGTERM (from `timeout`, `kill`, a job scheduler) unwinds the run like Ctrl-C, so the actors are shut down
    and the arena unlinked. Installed once Ray runs: Ray's driver installs a handler that aborts the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def record_prediction(engine: Engine, out_dir: Path) -> Prediction | None:
    """The predicted step time of this run (megatrain/perf/predict.py): of the Engine's own memory plan (its auto
    settings resolved: resident units, kept layers, micro-batches, ...) with its speculation and compile choice, from
    the cached calibration of its device (the one its plan's split of the GPU took), written to out_dir/prediction.json
    for `megatrain report`; None (and nothing written) where this machine was not calibrated (`megatrain calibrate`),
    or for a LoRA run (the model knows a whole model's update): a run does not spend its time measuring the machine."""
    from megatrain.perf.predict import predict
    from megatrain.telemetry.report import PREDICTION_FILE
    from pipelines.plan_prediction import run_calibration, run_settings

    (out_dir / PREDICTION_FILE).unlink(missing_ok=True)  # an earlier run's, in this directory
    try:
        cal = run_calibration(engine.on_gpu)
        if cal is None or engine.engine_config.lora is not None:
            return None
        pred = predict(engine.plan, engine.config, cal, **run_settings(engine.config, cal, engine.engine_config,
                                                                       engine.optim.clipping, engine.on_gpu))
    except Exception as exc:  # noqa: BLE001 - a prediction is commentary: it never stops a run
        log.warning("no predicted step time: %s", exc)
        return None
    (out_dir / PREDICTION_FILE).write_text(json.dumps(pred.to_dict(), indent=2))
    log.info("%s", pred.report())
    return pred


def _loop(cfg: TrainConfig, engine: Engine, loader: Any, out_dir: Path, start: int,
          extra_files: list[Path], prediction: Prediction | None = None) -> dict[str, Any]:
    flops_per_token = engine.config.flops_per_token(cfg.data.seq_len)
    progress = Progress(cfg.steps, cfg.log_every)
    steps_path = out_dir / "steps.jsonl"
    keep_step_records_before(steps_path, start)
    steps_log = open(steps_path, "a")
    spans: list[Any] = []
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    next_ref = loader.next_batch.remote()
    step = start
    try:
        while step < cfg.steps:
            t0 = time.monotonic()
            batch_ref, next_ref = next_ref, loader.next_batch.remote()  # prefetch the next batch's ref
            try:
                result = engine.step_batch(batch_ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, StopIteration):
                    log.info("the data ran out after %d steps", step)
                    break
                raise
            step_time = time.monotonic() - t0
            losses.append(result.loss)
            _log_step(steps_log, result, step_time, flops_per_token)
            if cfg.trace:
                spans.extend(result.spans)
            # each step beside the prediction of its own case: a run whose steps all clip is predicted serial
            predicted = None if prediction is None else prediction.shown_step_s(result.update)
            progress.update(step, _progress_fields(result, step_time, flops_per_token, engine.skipped_steps,
                                                   predicted, engine.rollbacks))
            step += 1
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                evals.append((step, evaluate(engine, loader)))
                log.info("step %d: eval loss %.4f", step, evals[-1][1])
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                # one next_batch call is already in flight (the prefetched ref): the position is one earlier
                data_state = ray.get(loader.state_dict.remote(unconsumed=1))
                engine.save_checkpoint(out_dir / "checkpoints" / f"step-{step:08d}", {"data": data_state})
                prune_checkpoints(out_dir, cfg.keep_checkpoints)
    finally:
        progress.close()
        steps_log.close()
        if cfg.trace and spans:
            write_chrome_trace(spans, out_dir / "trace.json")
    final = merged = None
    if cfg.save_final:  # a LoRA run's: its adapter in PEFT's format, and with merge the merged model beside it
        final = engine.save_pretrained(out_dir / "final", extra_files)
        merged = engine.save_pretrained(out_dir / "merged", extra_files, merge=True) if cfg.merge else None
    return {"steps": step, "start": start, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "losses": losses, "evals": evals,
            "skipped_steps": engine.skipped_steps, "final": str(final) if final else None, "out_dir": str(out_dir),
            "merged": str(merged) if merged else None, "lora": engine.engine_config.lora is not None}


def evaluate(engine: Engine, loader: Any) -> float:
    """Token-weighted mean loss over the held-out split."""
    batches = ray.get(loader.eval_batches.remote())
    if not batches:
        raise MegatrainError("evaluation was asked for but the data has no held-out split; set data.eval_fraction "
                             "or data.eval_count.")
    total = tokens = 0.0
    for batch in batches:
        loss, n = engine.evaluate(ray.put(batch))
        total += loss * n
        tokens += n
    return total / max(tokens, 1)


def _tokens_per_s(result: StepResult, step_time: float) -> float:
    return result.tokens / step_time if step_time > 0 else 0.0


def _progress_fields(result: StepResult, step_time: float, flops_per_token: float, skipped: int,
                     predicted: float | None = None, rollbacks: int = 0) -> dict[str, str]:
    """The progress line's fields; `predicted`: the predicted step time, shown beside the measured one; rollbacks:
    steps so far whose updates beside the backward were rolled back."""
    tps = _tokens_per_s(result, step_time)
    stall = result.stats["stall_fraction"] if result.stats else float("nan")
    out = {"loss": f"{result.loss:.4f}", "tok/s": f"{tps:,.0f}", "TFLOP/s": f"{tps * flops_per_token / 1e12:.3g}",
           "stall": f"{100 * stall:.0f}%" if math.isfinite(stall) else "-", "lr": f"{result.lr:.2e}"}
    if predicted is not None:
        out["step s"] = f"{step_time:.3g}"
        out["pred s"] = f"{predicted:.3g}"
    if skipped:
        out["skipped"] = str(skipped)
    if rollbacks:
        out["rollbacks"] = str(rollbacks)
    return out


def keep_step_records_before(path: Path, start: int) -> None:
    """The step log describes the run now in the directory: a run resumed at step `start` (or started afresh, 0)
    drops the records of the steps it will redo, which an earlier run went past before it stopped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a kill
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < start:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _log_step(f: Any, result: StepResult, step_time: float, flops_per_token: float) -> None:
    tps = _tokens_per_s(result, step_time)
    record = {"step": result.step, "loss": result.loss, "tokens": result.tokens, "grad_norm": result.grad_norm,
              "lr": result.lr, "skipped": result.skipped, "rolled_back": result.rolled_back, "update": result.update,
              "step_time": step_time,
              "tokens_per_s": tps, "tflops": tps * flops_per_token / 1e12}
    if result.stats:
        record["stats"] = result.stats
    f.write(json.dumps(record) + "\n")
    f.flush()


__all__ = ["TrainConfig", "run"]
