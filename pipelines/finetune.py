"""`megatrain finetune`: supervised fine-tuning of an HF checkpoint, on top of the training run of train.py.

    summary = finetune("models/qwen2-0.5b", "chats.jsonl", "runs/sft", overrides={"steps": 200})
    megatrain finetune --model models/qwen2-0.5b --data chats.jsonl --out runs/sft [--config sft.toml] [flags]

It adds the model's weights and tokenizer, loss masks, a held-out split, fine-tuning defaults, an HF (or PEFT)
directory in OUT_DIR/final/, and checks before any actor starts (docs/design.md#fine-tuning)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import tomllib

from megatrain.config import ConfigError, ModelConfig, is_hub_name
from megatrain.data import BatchLoader, ByteTokenizer, DataConfig, DataError
from megatrain.data.hf_datasets import is_datasets_source
from megatrain.io.checkpoint import weight_files
from megatrain.io.hub import TOKENIZER_FILES, hub_model
from pipelines.train import TrainConfig, run

log = logging.getLogger("megatrain")

# HF Trainer / Alpaca-style SFT settings for a pretrained model. Each is overridable by TOML or flags.
FINETUNE_DEFAULTS: dict[str, Any] = {
    "steps": 1000,
    "lr": 2e-5,  # pretrained weights: 100x below pretraining LRs, or the first steps undo what it knows
    "weight_decay": 0.0,  # a few thousand steps from a good point: decay only pulls weights towards zero
    "betas": (0.9, 0.999),  # HF Trainer's, which SFT recipes are tuned with
    "max_grad_norm": 1.0,
    "decay": True,  # cosine...
    "min_lr_ratio": 0.0,  # ...to zero at the last step, like HF's cosine schedule
    "out_dir": "runs/finetune",
    "data.batch_size": 8,
    "data.eval_fraction": 0.1,
}
LORA_LR = 2e-4  # LoRA's adapters start at zero and learn at PEFT recipes' rates, 10x a full fine-tune's
WARMUP_FRACTION = 0.03  # of the steps (HF's warmup_ratio in SFT recipes), at least one step
EVALS_PER_RUN = 10  # eval_every defaults to steps / 10
MAX_SEQ_LEN = 1024  # the default seq_len, capped at the model's max_position_embeddings



def finetune(model_dir: str | Path | None, data_path: str | Path | None, out_dir: str | Path | None,
             config: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fine-tunes the HF model in `model_dir` on `data_path`; returns train.run's summary plus the tokenizer.

    `config` is a TOML file like train's (top-level keys and a [data] table); `overrides` are flag values
    with train's names ("lr", "data.seq_len", "resume", ...). None arguments fall back to the TOML file.
    """
    cfg = finetune_config(model_dir, data_path, out_dir, config, overrides)
    _check_loader(cfg)
    summary = run(cfg, extra_files=inference_files(cfg))
    return {**summary, "tokenizer": cfg.data.tokenizer}


def finetune_config(model_dir: str | Path | None, data_path: str | Path | None, out_dir: str | Path | None,
                    config: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The TrainConfig of a fine-tuning run: defaults < TOML < overrides, then the derived values."""
    user = {k: v for k, v in (overrides or {}).items() if v is not None}
    given = _toml_keys(config) | set(user)  # what the user decided; defaults fill in only the rest
    fixed = {k: str(v) for k, v in (("model", model_dir), ("out_dir", out_dir), ("data.source", data_path))
             if v is not None}
    given |= set(fixed)
    defaults = {k: v for k, v in FINETUNE_DEFAULTS.items() if k not in given}
    if "data.eval_count" in given:  # the user chose a split by count: no fraction on top (not both)
        defaults.pop("data.eval_fraction", None)
    cfg = TrainConfig.load(config, {**defaults, **user, **fixed})

    model_config = _check_model(cfg.model, "model" in given)
    _check_data(cfg.data.source, "data.source" in given)
    cfg.data.vocab_size = model_config.vocab_size  # the loader checks tokenizer and ids against it
    if "data.tokenizer" not in given:
        cfg.data.tokenizer = _default_tokenizer(model_directory(cfg.model), model_config)
    if "data.seq_len" not in given:
        cfg.data.seq_len = min(MAX_SEQ_LEN, model_config.max_position_embeddings)
    if (cfg.lora is not None or cfg.adapter is not None) and "lr" not in given:
        cfg.lr = LORA_LR
    if "warmup_steps" not in given:
        cfg.warmup_steps = max(1, math.ceil(WARMUP_FRACTION * cfg.steps))
    held_out = bool(cfg.data.eval_fraction or cfg.data.eval_count)
    if "eval_every" not in given:
        cfg.eval_every = max(1, cfg.steps // EVALS_PER_RUN) if held_out else 0
    elif cfg.eval_every and not held_out:
        raise ConfigError("finetune: eval_every is set but the data has no held-out split (eval_fraction and "
                          "eval_count are 0); set one of them, or eval_every = 0.")
    cfg.validate()
    return cfg


def inference_files(cfg: TrainConfig) -> list[Path]:
    """The tokenizer's files and the model's generation_config.json, copied into OUT_DIR/final/."""
    files: dict[str, Path] = {}
    if cfg.data.tokenizer != "byte":
        spec = Path(cfg.data.tokenizer)
        folder = spec if spec.is_dir() else spec.parent  # HFTokenizer reads the files beside tokenizer.json
        if not spec.is_dir():
            files["tokenizer.json"] = spec
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                files.setdefault(name, folder / name)
    generation = model_directory(cfg.model) / "generation_config.json"
    if generation.is_file():  # replaces the minimal one save_pretrained writes: sampling defaults, eos lists
        files["generation_config.json"] = generation
    return list(files.values())


# ---- checks: one sentence each, before any actor starts ----

def _toml_keys(config: str | Path | None) -> set[str]:
    """The keys a TOML config sets ("lr", "data.seq_len"). An unreadable file sets none here: TrainConfig.load
    reports it."""
    if config is None:
        return set()
    try:
        values = tomllib.loads(Path(config).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()
    data = values.pop("data", None)
    return set(values) | ({f"data.{k}" for k in data} if isinstance(data, dict) else set())


def model_directory(model: str) -> Path:
    """The model's directory: `model` itself, or a Hugging Face Hub name's snapshot in the hub's cache (fetched
    where it is not there yet)."""
    return hub_model(model) if is_hub_name(model) else Path(model)


def _check_model(model: str, given: bool) -> ModelConfig:
    if not given:
        raise ConfigError("finetune needs a model: pass --model with an HF model directory or a Hugging Face Hub "
                          "name (or set model in the config file).")
    path = model_directory(model)
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist; pass --model an HF model directory holding "
                          "config.json and safetensors weights, or a Hugging Face Hub name like Qwen/Qwen2.5-0.5B.")
    model_config = ModelConfig.from_hf(path)
    weight_files(path, "model")  # a directory without weights fails here rather than inside the store actor
    return model_config


def _check_data(source: str, given: bool) -> None:
    if not given or source == "synthetic":
        raise DataError("finetune needs data: pass --data with chats (JSON or JSONL of messages, Alpaca or "
                        "ShareGPT records) or a text/jsonl/parquet/arrow file or folder.")
    if not Path(source).exists() and not is_datasets_source(DataConfig(source=source)):
        raise DataError(f"data file {source} does not exist; pass --data an existing file or folder, or a Hugging "
                        "Face Hub data set name.")


def _check_loader(cfg: TrainConfig) -> None:
    """Opens the data with the tokenizer here, as the loader actor will: bad data fails now, in one line."""
    loader = BatchLoader(cfg.data)
    if cfg.eval_every and next(loader.eval_batches(), None) is None:  # else it fails at the first eval
        raise DataError(f"the held-out split of {cfg.data.source} is empty (eval_fraction="
                        f"{cfg.data.eval_fraction}); raise eval_fraction, set eval_count, or set eval_every = 0.")


def _default_tokenizer(model_dir: Path, model_config: ModelConfig) -> str:
    """The model's own tokenizer; the byte tokenizer only for a model without one whose vocab holds it."""
    if (model_dir / "tokenizer.json").is_file():
        return str(model_dir)
    if model_config.vocab_size >= ByteTokenizer.vocab_size:
        log.warning("%s has no tokenizer.json: using the byte tokenizer (ids 0-259 of its %d-token vocabulary)",
                    model_dir, model_config.vocab_size)
        return "byte"
    raise DataError(f"{model_dir} has no tokenizer.json and its vocabulary ({model_config.vocab_size} tokens) is "
                    f"smaller than the byte tokenizer's {ByteTokenizer.vocab_size}; add the model's tokenizer.json "
                    "to the directory or pass --tokenizer.")


__all__ = ["FINETUNE_DEFAULTS", "finetune", "finetune_config", "inference_files"]
