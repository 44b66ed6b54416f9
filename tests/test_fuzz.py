"""Fuzzing (hypothesis): every bad input ends in one clear sentence, never a raw traceback, never a silently
wrong model (issue 7, item 6).

Four rooms take input from users: model configs (keyword arguments and HF config.json dicts), train configs
(TOML files plus flag overrides), HF model directories, and training checkpoints. For each, the property is:
either megatrain accepts the input and the result is right (a config that round-trips through config.json and
transformers; a model whose weights are bit for bit the file's tensors), or it raises a MegatrainError whose
message is one line, one sentence, ending in '.'. Any other exception escaping fails the test with
hypothesis' shrunk example. Arenas opened along the way must be gone afterwards.

test_config.py and test_checkpoint.py pin the exact message of each known failure; this file throws random
inputs at the same doors. MEGATRAIN_FUZZ_SCALE=20 pytest tests/test_fuzz.py runs 20x the examples.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from helpers import my_segments
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import megatrain
from megatrain.config import (
    COMPILE,
    PRESETS,
    EngineConfig,
    MegatrainError,
    ModelConfig,
    OptimConfig,
    dataclass_from_dict,
)
from megatrain.data import DataConfig
from megatrain.store import ParameterStore, resolve_model
from pipelines.train import TrainConfig, engine_kwargs, with_size_defaults

T = TypeVar("T")
SCALE = float(os.environ.get("MEGATRAIN_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the property ----

def assert_one_sentence(error: BaseException) -> None:
    assert isinstance(error, MegatrainError), f"{type(error).__name__} escaped: {error!r}"
    message = str(error)
    assert message.endswith("."), message
    assert not message.endswith(".."), message
    assert "\n" not in message and "\r" not in message, f"more than one line: {message!r}"
    assert "Traceback" not in message, message
    # generated junk never contains '.', so '. X' in a message is a second sentence of megatrain's own
    assert not re.search(r"\.\s+[A-Z]", message), f"more than one sentence: {message}"


def attempt(build: Callable[[], T]) -> tuple[T | None, MegatrainError | None]:
    """(result, None), or (None, error) for a MegatrainError of one sentence; anything else propagates."""
    try:
        result = build()
    except MegatrainError as e:
        assert_one_sentence(e)
        event(f"refused: {type(e).__name__}")
        return None, e
    event("accepted")
    return result, None


@contextmanager
def no_leaked_segments() -> Iterator[None]:
    before = my_segments()
    yield
    assert my_segments() == before, "an arena segment was left in /dev/shm"


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A fresh directory per example (hypothesis runs many examples inside one function-scoped tmp_path)."""
    path = Path(tempfile.mkdtemp(prefix="megatrain-fuzz-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- junk ----

# No '.' in generated text: a '.' followed by a capital would read as a second sentence in a message that
# quotes the value.
TEXT = st.text(st.characters(exclude_characters=".", codec="utf-8"), max_size=10)
NAMES = st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gpt2", "default", "linear", "llama3", "yarn", ""]) \
    | TEXT
SCALARS = (st.none() | st.booleans() | st.integers(-3, 300) | st.integers(-2**80, 2**80)
           | st.sampled_from([0, -1, 2**31, 2**63, 10**400, 0.0, -0.0, 0.5, 1e-300, 1e300])
           | st.floats() | NAMES)
JUNK = st.recursive(SCALARS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=5)


# ---- 1. model configs ----

POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "head_dim", "max_position_embeddings")
NUMBER = (st.sampled_from([1.0, 2.0, 4.0, 8.0, 0.5, 8192, 0, -1.0]) | st.floats(0.1, 100.0)
          | st.integers(1, 10**5))
ROPE_SCALING = st.one_of(
    st.none(),
    st.just({}),
    st.builds(lambda f: {"rope_type": "linear", "factor": f}, st.floats(1.0, 16.0)),
    st.builds(lambda f: {"type": "linear", "factor": f}, st.floats(1.0, 16.0)),
    st.builds(lambda f, lo, hi, old: {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                      "high_freq_factor": hi, "original_max_position_embeddings": old},
              st.floats(1.0, 32.0), st.sampled_from([1.0, 2.0]), st.sampled_from([4.0, 8.0]),
              st.sampled_from([2048, 8192])),
    st.fixed_dictionaries({}, optional={
        "rope_type": NAMES, "type": NAMES, "factor": NUMBER | JUNK, "low_freq_factor": NUMBER | JUNK,
        "high_freq_factor": NUMBER | JUNK, "original_max_position_embeddings": NUMBER | JUNK,
        "rope_theta": NUMBER, "mrope_section": JUNK}),
    JUNK,
)
# Values a config might plausibly hold: small sizes (valid or not together), every model type and rope
# variant.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "vocab_size": st.integers(1, 512),
    "hidden_size": st.sampled_from([2, 4, 6, 8, 12, 16, 24, 32, 64, 100]),
    "num_layers": st.integers(1, 3),
    "num_heads": st.sampled_from([1, 2, 3, 4, 8]),
    "num_kv_heads": st.sampled_from([None, 1, 2, 4, 8]),
    "intermediate_size": st.sampled_from([None, 1, 8, 48, 176]),
    "head_dim": st.sampled_from([None, None, 2, 4, 8, 16, 6, 3]),
    "rope_theta": st.sampled_from([10000.0, 500000.0, 1e6, 10000]) | st.floats(1.0, 1e7),
    "rope_scaling": ROPE_SCALING,
    "rms_norm_eps": st.sampled_from([1e-5, 1e-6]) | st.floats(1e-9, 1e-2),
    "tie_embeddings": st.booleans(),
    "qkv_bias": st.booleans(),
    "o_bias": st.booleans(),
    "max_position_embeddings": st.integers(1, 1 << 17),
    "initializer_range": st.floats(0.0, 0.1),
    "bos_token_id": st.none() | st.integers(0, 511),
    "eos_token_id": st.none() | st.integers(0, 511),
    "model_type": st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]),
    "sliding_window": st.none() | st.integers(1, 1 << 17),
}
TINY = dict(PRESETS["tiny"])


def check_valid_config(c: ModelConfig) -> None:
    """What an accepted config promises: sane sizes, and a config.json that means the same model to megatrain
    and to transformers."""
    for name in POSITIVE_INTS:
        value = getattr(c, name)
        assert type(value) is int and value > 0, (name, value)
    assert c.head_dim % 2 == 0 and c.num_heads % c.num_kv_heads == 0
    for name in ("rope_theta", "rms_norm_eps"):
        assert type(getattr(c, name)) is float and 0 < getattr(c, name) < math.inf, name
    assert type(c.initializer_range) is float and 0 <= c.initializer_range < math.inf
    for name in ("tie_embeddings", "qkv_bias", "o_bias"):
        assert type(getattr(c, name)) is bool, name
    for name in ("bos_token_id", "eos_token_id", "sliding_window"):
        value = getattr(c, name)
        assert value is None or type(value) is int, (name, value)
    assert c.sliding_window is None or c.sliding_window > 0
    n = c.num_params()
    assert type(n) is int and n > 0
    text = json.dumps(c.to_hf(), allow_nan=False)  # strict JSON: other readers reject NaN and Infinity
    assert ModelConfig.from_hf(json.loads(text)) == c
    if c.num_layers <= 1024:  # transformers lists every layer's type: 10^12 layers would never finish
        back = AutoConfig.for_model(**json.loads(text))  # what transformers makes of the config.json we write
        # on the generic path (an option its native family does not implement) the config.json itself is kept,
        # and transformers' copy spells out its defaults: the same model, another dict
        assert without_hf_config(ModelConfig.from_hf(back.to_dict())) == without_hf_config(c)


def without_hf_config(c: ModelConfig) -> dict[str, Any]:
    return {**c.to_dict(), "hf_config": None}


@fuzz(300)
@given(kwargs=st.fixed_dictionaries({}, optional=PLAUSIBLE))
def test_model_config_from_plausible_values(kwargs: dict[str, Any]) -> None:
    config, _ = attempt(lambda: ModelConfig(**kwargs))
    if config is not None:
        check_valid_config(config)
        assert ModelConfig(**config.to_dict()) == config


# A junk value must be refused with a message that names its field (or the size it derives, for the shapes).
NAMED_BY = {"hidden_size": ("hidden_size", "head_dim"), "num_heads": ("num_heads", "head_dim"),
            "rope_scaling": ("rope_scaling", "rope scaling"),
            "model_type": ("model_type", "qkv_bias")}  # a valid type may not fit the base's bias layout


@fuzz(300)
@given(field=st.sampled_from(sorted(PLAUSIBLE)), value=JUNK,
       base=st.sampled_from(["tiny", "qwen2", "llama3"]))
def test_model_config_junk_field_is_named(field: str, value: Any, base: str) -> None:
    kwargs = {**TINY, "model_type": "qwen2", "qkv_bias": True} if base == "qwen2" else dict(TINY)
    if base == "llama3":
        kwargs["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    kwargs[field] = value
    config, error = attempt(lambda: ModelConfig(**kwargs))
    if error is not None:
        assert any(name in str(error) for name in NAMED_BY.get(field, (field,))), (field, str(error))
    else:
        check_valid_config(config)


def hf_bases() -> dict[str, dict[str, Any]]:
    small = dict(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return {
        "llama": LlamaConfig(**small).to_dict(),
        "llama3": LlamaConfig(**small, tie_word_embeddings=True, attention_bias=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}).to_dict(),
        "qwen2": Qwen2Config(**small, tie_word_embeddings=True).to_dict(),
        "qwen3": Qwen3Config(**small, head_dim=8).to_dict(),
        "tiny": ModelConfig.from_name("tiny").to_hf(),
        "minimal": {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2},
    }


HF_BASES = hf_bases()
HF_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id",
           "sliding_window")
HF_KEYS = HF_INTS + ("model_type", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
                     "tie_word_embeddings", "attention_bias", "mlp_bias", "initializer_range",
                     "use_sliding_window")
# the megatrain field an HF key lands in: a message may name either
HF_FIELD = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "num_key_value_heads": "num_kv_heads", "tie_word_embeddings": "tie_embeddings",
            "attention_bias": "qkv_bias", "rope_parameters": "rope", "rope_scaling": "rope",
            "use_sliding_window": "sliding_window"}
HF_VALUE = st.one_of(st.integers(-2, 130), st.sampled_from([2**40, 10**12, True, False, None, [], {}]),
                     ROPE_SCALING, NUMBER, JUNK)
HF_EDIT = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(HF_KEYS), HF_VALUE),
    st.tuples(st.just("del"), st.sampled_from(HF_KEYS)),
    st.tuples(st.just("set"), TEXT, JUNK),  # extra keys are ignored
    st.tuples(st.just("set"), st.just("rope_parameters"),
              st.builds(lambda r, t: {**(r or {}), "rope_theta": t},
                        ROPE_SCALING.filter(lambda r: isinstance(r, dict)) | st.none(), NUMBER)),
)


def apply_hf_edits(hf: dict[str, Any], edits: list[tuple[Any, ...]]) -> dict[str, Any]:
    hf = json.loads(json.dumps(hf))
    for edit in edits:
        if edit[0] == "set":
            hf[edit[1]] = edit[2]
        else:
            hf.pop(edit[1], None)
    return hf


def check_config_reads_hf(c: ModelConfig, hf: dict[str, Any]) -> None:
    """An accepted config.json means what it says: no value silently coerced, dropped or defaulted over."""
    assert c.model_type == hf.get("model_type", "llama")
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads) == (
        hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"])
    kv = hf.get("num_key_value_heads")
    assert c.num_kv_heads == (hf["num_attention_heads"] if kv is None else kv)
    for key in ("intermediate_size", "head_dim", "max_position_embeddings", "bos_token_id"):
        if hf.get(key) is not None:
            assert getattr(c, key) == hf[key], key
    assert c.tie_embeddings is (hf.get("tie_word_embeddings") is True)
    if c.hf_config is None:  # the generic path's biases are its layers' own, no field of ModelConfig
        assert c.qkv_bias is (c.model_type == "qwen2" or hf.get("attention_bias") is True)


@fuzz(400)
@given(base=st.sampled_from(sorted(HF_BASES)), edits=st.lists(HF_EDIT, max_size=3))
@example(base="llama", edits=[("set", "hidden_act", True)])  # transformers' validation error spans two lines
def test_model_config_from_hf_dict(base: str, edits: list[tuple[Any, ...]]) -> None:
    hf = apply_hf_edits(HF_BASES[base], edits)
    config, error = attempt(lambda: ModelConfig.from_hf(hf))
    if config is not None:
        check_valid_config(config)
        check_config_reads_hf(config, hf)
    elif len(edits) == 1 and edits[0][1] in HF_KEYS:
        key = edits[0][1]
        names = (key, HF_FIELD.get(key, key), "head_dim", "model_type")
        assert any(n in str(error) for n in names), (key, str(error))


@fuzz(100)
@given(text=st.binary(max_size=64) | st.text(max_size=64).map(str.encode)
       | st.builds(lambda v: json.dumps(v).encode(), JUNK))
def test_model_config_from_corrupt_config_json(text: bytes) -> None:
    with scratch_dir() as d:
        (d / "config.json").write_bytes(text)
        config, _ = attempt(lambda: ModelConfig.from_hf(d))
        if config is not None:
            check_valid_config(config)


@fuzz(150)
@given(cls=st.sampled_from([ModelConfig, OptimConfig, EngineConfig, DataConfig]),
       values=st.dictionaries(st.sampled_from(["lr", "betas", "eps", "max_grad_norm", "warmup_steps",
                                                "total_steps", "weight_decay", "min_lr_ratio", "device",
                                                "precision", "optimizer_workers", "threads_per_worker",
                                                "loss_chunk_tokens", "seed", "vocab_size", "hidden_size",
                                                "batch_size", "seq_len"])
                              | TEXT, JUNK | NUMBER, max_size=4))
def test_dataclass_from_dict(cls: type, values: dict[str, Any]) -> None:
    attempt(lambda: dataclass_from_dict(cls, values, "[section]"))


# ---- 2. train configs ----

def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf \
            else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (JSON escapes are TOML escapes)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return "null"  # not TOML: the file is refused


COUNT = st.integers(-2, 50) | st.sampled_from([0, 1, 2**63, 2**64])
FLOAT = st.floats() | st.sampled_from([0.0, 1e-3, 3e-4, 1.0, 0.5])
TRAIN_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "125m", "nope", "no/such/dir", "", "weights.safetensors"]),
    "steps": COUNT, "out_dir": st.sampled_from(["runs/x", ""]), "lr": FLOAT, "weight_decay": FLOAT,
    "betas": st.lists(st.floats(-0.5, 1.5), max_size=3)
    | st.tuples(st.floats(0, 0.99), st.floats(0, 0.99)).map(list),
    "eps": FLOAT, "max_grad_norm": FLOAT, "warmup_steps": COUNT, "decay": st.booleans(),
    "min_lr_ratio": FLOAT,
    "optimizer_workers": COUNT, "precision": st.sampled_from(["fp32", "tf32", "bf16", "fp8"]),
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1", "tpu"]), "loss_chunk_tokens": COUNT,
    "seed": COUNT, "address": st.sampled_from(["auto", "127.0.0.1:6379"]), "checkpoint_every": COUNT,
    "keep_checkpoints": COUNT, "eval_every": COUNT, "log_every": COUNT, "resume": st.booleans(),
    "trace": st.booleans(), "save_final": st.booleans(), "max_nonfinite_steps": COUNT,
    "grads": st.sampled_from(["auto", "arena", "stream", "device", "gpu"]),
    "compile": st.booleans() | st.sampled_from(["auto", "on", "off", "sometimes"]),
}
DATA_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "source": st.sampled_from(["synthetic", "data.jsonl"]),
    "format": st.sampled_from(["jsonl", "text", "csv"]),
    "text_field": st.just("text"), "text_split": st.sampled_from(["paragraph", "file", "line"]),
    "tokenizer": st.sampled_from(["byte", "gpt2"]), "batch_size": COUNT, "seq_len": COUNT, "seed": COUNT,
    "shuffle": st.booleans(), "epochs": COUNT, "eval_fraction": FLOAT, "eval_count": COUNT,
    "pack": st.booleans(),
    "truncation": st.booleans(), "sft": st.booleans(), "vocab_size": COUNT, "synthetic_docs": COUNT,
    "shard_bytes": COUNT,
}


def maybe_junk(plausible: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    values = {k: v | v | JUNK.filter(lambda x: x is not None) for k, v in plausible.items()}
    return st.fixed_dictionaries({}, optional=values)


TOML_DOC = st.fixed_dictionaries({"top": maybe_junk(TRAIN_PLAUSIBLE)}, optional={
    "data": maybe_junk(DATA_PLAUSIBLE) | JUNK,  # a [data] table, or `data = <junk>`
    "unknown": st.dictionaries(TEXT, JUNK, min_size=1, max_size=2),
    "section": st.dictionaries(TEXT, JUNK, max_size=2),  # a table megatrain does not know
})
OVERRIDE_KEYS = st.sampled_from(sorted(TRAIN_PLAUSIBLE) + [f"data.{k}" for k in DATA_PLAUSIBLE]
                                + ["data", "data.", "nope", "data.nope"])


def render_toml(doc: dict[str, Any]) -> str:
    top = {**doc["top"], **doc.get("unknown", {})}
    lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in top.items()]
    if isinstance(doc.get("data"), dict):
        lines += ["[data]"] + [f"{json.dumps(k)} = {toml_value(v)}" for k, v in doc["data"].items()]
    elif "data" in doc:
        lines.insert(0, f"data = {toml_value(doc['data'])}")
    if "section" in doc:
        lines += ["[optim]"] + [f"{json.dumps(k)} = {toml_value(v)}" for k, v in doc["section"].items()]
    return "\n".join(lines) + "\n"


def corrupt(text: bytes, edits: list[tuple[float, int]]) -> bytes:
    data = bytearray(text)
    for where, byte in edits:
        if data:
            data[int(where * len(data))] = byte
    return bytes(data)


TRAIN_INTS = ("steps", "optimizer_workers", "loss_chunk_tokens", "seed", "checkpoint_every",
              "keep_checkpoints", "eval_every", "log_every", "max_nonfinite_steps")


def check_train_config(cfg: TrainConfig) -> None:
    """An accepted train config holds what its fields say, and the engine's own configs build from it (or
    refuse in one sentence) before any actor starts."""
    for name in TRAIN_INTS:
        assert type(getattr(cfg, name)) is int, name
    for name in ("decay", "resume", "trace", "save_final"):
        assert type(getattr(cfg, name)) is bool, name
    assert cfg.compile in COMPILE  # true / false read as "on" / "off"
    for name in ("model", "out_dir", "precision", "device", "grads"):
        assert type(getattr(cfg, name)) is str, name
    assert cfg.warmup_steps is None or type(cfg.warmup_steps) is int  # None: chosen by the run's length
    assert isinstance(cfg.data, DataConfig)
    kw = engine_kwargs(with_size_defaults(cfg, ModelConfig.from_name("tiny")))  # what run() hands the engine
    attempt(lambda: OptimConfig(lr=kw["lr"], weight_decay=kw["weight_decay"], betas=kw["betas"],
                                eps=kw["eps"],
                                max_grad_norm=kw["max_grad_norm"], warmup_steps=kw["warmup_steps"],
                                total_steps=kw["total_steps"], min_lr_ratio=kw["min_lr_ratio"]))
    attempt(lambda: EngineConfig(device=kw["device"], precision=kw["precision"],
                                 optimizer_workers=kw["optimizer_workers"],
                                 loss_chunk_tokens=kw["loss_chunk_tokens"], seed=kw["seed"], grads=kw["grads"],
                                 compile=kw["compile"]))
    attempt(lambda: resolve_model(cfg.model))


@fuzz(300)
@given(doc=TOML_DOC,
       damage=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=2),
       raw=st.none() | st.binary(max_size=40),
       overrides=st.none() | st.dictionaries(OVERRIDE_KEYS, JUNK | COUNT | FLOAT, max_size=3))
def test_train_config_load(doc: dict[str, Any], damage: list[tuple[float, int]], raw: bytes | None,
                           overrides: dict[str, Any] | None) -> None:
    with scratch_dir() as d:
        path = d / "train.toml"
        path.write_bytes(raw if raw is not None else corrupt(render_toml(doc).encode(), damage))
        cfg, _ = attempt(lambda: TrainConfig.load(path, overrides))
        if cfg is not None:
            check_train_config(cfg)


@fuzz(30)
@given(overrides=st.dictionaries(OVERRIDE_KEYS, JUNK | COUNT, max_size=3),
       where=st.sampled_from(["dir", "none"]))
def test_train_config_path_is_not_a_file(overrides: dict[str, Any], where: str) -> None:
    with scratch_dir() as d:
        path = d if where == "dir" else d / "missing.toml"
        _, error = attempt(lambda: TrainConfig.load(path, overrides))
        assert error is not None


# ---- 3. HF model directories ----

HF_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models written by transformers: Llama (untied, GQA) and Qwen2 (tied, q/k/v bias)."""
    sources = {}
    configs = {"llama": LlamaConfig(**HF_SMALL), "qwen2": Qwen2Config(**HF_SMALL, tie_word_embeddings=True)}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        sources[name] = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(sources[name])
    return sources


WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIX = "rotary_emb.inv_freq"
DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]
HEADER_DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "XX",
                                 ""])
EXTRA_NAMES = st.sampled_from(["lm_head.weight", "model.layers.2.mlp.up_proj.weight", "model.norm.bias",
                               f"model.layers.0.self_attn.{IGNORED_SUFFIX}",
                               "model.embed_tokens.weight"]) | TEXT
SHAPE = st.lists(st.integers(0, 70), max_size=3)
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "tie_word_embeddings", "attention_bias", "model_type",
               "rms_norm_eps", "rope_theta", "rope_scaling")
CONFIG_VALUES = (st.integers(0, 130) | st.sampled_from([8, 16, 64, 96, 2**40, 10**9]) | st.integers(1, 8)
                 | st.booleans() | ROPE_SCALING | JUNK)
PICK = st.integers(0, 2**16)  # which file or tensor, modulo how many there are
FRACTION = st.floats(0, 1, exclude_max=True)

HF_MUTATION = st.one_of(
    st.tuples(st.just("truncate"), PICK, FRACTION),
    st.tuples(st.just("flip"), PICK, FRACTION, st.integers(1, 255), st.booleans()),
    st.tuples(st.just("header"), PICK, st.just("dtype"), HEADER_DTYPES | JUNK),
    st.tuples(st.just("header"), PICK, st.just("shape"),
              SHAPE | st.lists(st.integers(-2, 2**62), max_size=3) | JUNK),
    st.tuples(st.just("header"), PICK, st.just("data_offsets"),
              st.lists(st.integers(-10, 2 * 10**6), min_size=2, max_size=2) | JUNK),
    st.tuples(st.just("header"), PICK, st.sampled_from(["drop", "entry", "rename", "metadata"]), JUNK),
    st.tuples(st.just("retype"), PICK, st.sampled_from(DTYPES)),
    st.tuples(st.just("reshape"), PICK, SHAPE),
    st.tuples(st.just("drop"), PICK),
    st.tuples(st.just("extra"), EXTRA_NAMES, SHAPE),
    st.tuples(st.just("lm_head"), st.booleans()),  # an lm_head equal to the embedding, or not
    st.tuples(st.just("shard"), PICK, st.booleans()),  # two shards plus an index (and the single file or not)
    st.tuples(st.just("index"), JUNK | st.builds(lambda m: {"weight_map": m}, JUNK)
              | st.builds(lambda n, f: {"weight_map": {n: f}}, EXTRA_NAMES,
                          st.sampled_from([WEIGHTS, "x", ""]) | JUNK)),
    st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS), CONFIG_VALUES),
    st.tuples(st.just("config_del"), st.sampled_from(CONFIG_KEYS)),
    st.tuples(st.just("config_raw"),
              st.binary(max_size=30) | st.builds(lambda v: json.dumps(v).encode(), JUNK)),
    st.tuples(st.just("remove"), st.sampled_from(["config.json", WEIGHTS])),
)


def weight_paths(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(".safetensors") and p.is_file())


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_header(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def random_tensor(shape: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def mutate_hf(d: Path, mutation: tuple[Any, ...]) -> None:
    kind, args = mutation[0], mutation[1:]
    files = weight_paths(d) + [p for p in (d / "config.json", d / INDEX) if p.is_file()]
    tensor_file = d / WEIGHTS
    try:  # the tensor-level mutations need a readable weights file; on a broken one they do nothing
        names = sorted(load_file(tensor_file)) if tensor_file.is_file() else []
    except Exception:
        names = []
    if kind in ("truncate", "flip") and files:
        path = files[args[0] % len(files)]
        blob = bytearray(path.read_bytes())
        if kind == "truncate":
            os.truncate(path, int(args[1] * len(blob)))
        elif blob:
            span = len(blob)
            if args[3] and path.suffix == ".safetensors" and len(blob) >= 8:  # aim at the JSON header
                span = min(span, 8 + struct.unpack("<Q", bytes(blob[:8]))[0])
            blob[int(args[1] * span)] ^= args[2]
            path.write_bytes(bytes(blob))
    elif kind == "header" and names:
        header, data = read_header(tensor_file)
        name = names[args[0] % len(names)]
        field, value = args[1], args[2]
        if field == "drop":
            del header[name]
        elif field == "entry":
            header[name] = value
        elif field == "rename":
            header[str(value)] = header.pop(name)
        elif field == "metadata":
            header["__metadata__"] = value
        else:
            header[name][field] = value
        write_header(tensor_file, header, data)
    elif kind == "retype" and names:
        name = names[args[0] % len(names)]
        rewrite(tensor_file, lambda t: t.update({name: (t[name].float() * 8).to(args[1])}))
    elif kind == "reshape" and names:
        name = names[args[0] % len(names)]
        rewrite(tensor_file, lambda t: t.update({name: random_tensor(args[1])}))
    elif kind == "drop" and names:
        rewrite(tensor_file, lambda t: t.pop(names[args[0] % len(names)]))
    elif kind == "extra" and names:
        rewrite(tensor_file, lambda t: t.update({str(args[0]): random_tensor(args[1], seed=1)}))
    elif kind == "lm_head" and "model.embed_tokens.weight" in names:
        embed = "model.embed_tokens.weight"
        rewrite(tensor_file, lambda t: t.update({"lm_head.weight": t[embed].clone() if args[0]
                                                 else random_tensor(list(t[embed].shape), seed=2)}))
    elif kind == "shard" and names:
        tensors = load_file(tensor_file)
        cut = 1 + args[0] % max(1, len(names) - 1)
        shards = {"model-00001-of-00002.safetensors": names[:cut],
                  "model-00002-of-00002.safetensors": names[cut:]}
        for fname, part in shards.items():
            save_file({n: tensors[n] for n in part}, d / fname, metadata={"format": "pt"})
        weight_map = {n: f for f, part in shards.items() for n in part}
        (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        if not args[1]:
            tensor_file.unlink()
    elif kind == "index":
        (d / INDEX).write_text(json.dumps(args[0]))
    elif kind in ("config", "config_del"):
        path = d / "config.json"
        try:
            config = json.loads(path.read_text())
        except Exception:
            return
        if not isinstance(config, dict):
            return
        if kind == "config":
            config[args[0]] = args[1]
        else:
            config.pop(args[0], None)
        path.write_text(json.dumps(config))
    elif kind == "config_raw":
        (d / "config.json").write_bytes(args[0])
    elif kind == "remove":
        (d / args[0]).unlink(missing_ok=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def check_model_is_the_files(model: megatrain.Model, d: Path) -> None:
    """The loaded weights are the files' tensors, bit for bit (after the conversion to fp32): every tensor the
    files hold is a parameter of the model and every parameter comes from the files."""
    index = d / INDEX
    if index.is_file():
        paths = [d / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        paths = [d / WEIGHTS]
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        for name, t in load_file(path).items():
            assert name not in tensors, f"{name} is in two files: the model depends on which was read last"
            tensors[name] = t
    tensors = {n: t for n, t in tensors.items() if not n.endswith(IGNORED_SUFFIX)}
    if model.config.tie_embeddings:
        # A tied model's head is its embedding; megatrain skips an lm_head in the files (test_checkpoint.py's
        # test_harmless_extras_load pins that, even for an lm_head that differs from the embedding).
        tensors.pop("lm_head.weight", None)
    params = model.parameters()
    assert sorted(params) == sorted(tensors)
    for name, t in tensors.items():
        assert t.is_floating_point(), f"{name} of dtype {t.dtype} was loaded"
        assert torch.equal(bits(params[name]), bits(t.to(torch.float32))), name
    assert model.config == ModelConfig.from_hf(d)


@fuzz(250)
@given(source=st.sampled_from(["llama", "qwen2"]), mutations=st.lists(HF_MUTATION, min_size=1, max_size=3))
def test_hf_directory_mutations(hf_sources: dict[str, Path], source: str,
                                mutations: list[tuple[Any, ...]]) -> None:
    with scratch_dir() as tmp, no_leaked_segments():
        d = Path(shutil.copytree(hf_sources[source], tmp / "model"))
        for mutation in mutations:
            mutate_hf(d, mutation)
        model, _ = attempt(lambda: megatrain.from_pretrained(d))
        if model is not None:
            handle = model.store.handle
            try:
                check_model_is_the_files(model, d)
            finally:
                model.close()
            assert not any(handle.path(name).exists() for name, _, _ in handle.segments)


# ---- 4. training checkpoints ----

STATE = {"updates_applied": 3, "steps_done": 3, "data": {"epoch": 0, "offset": 17}}
SAVED = ("params", "exp_avg", "exp_avg_sq")  # the segments a checkpoint holds


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    store = ParameterStore("tiny", seed=0)
    try:
        gen = torch.Generator().manual_seed(1)
        for name in ("params", "exp_avg", "exp_avg_sq"):
            store.arena.tensors[name].copy_(torch.randn(store.arena.tensors[name].shape, generator=gen).abs())
        directory = store.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step-00000003", STATE)
        yield directory, {name: store.arena.tensors[name].clone() for name in SAVED}
    finally:
        store.close()


@pytest.fixture(scope="module")
def target_store() -> Iterator[ParameterStore]:
    store = ParameterStore("tiny", seed=7)
    yield store
    store.close()


MANIFEST_PATHS = st.sampled_from([
    ("format",), ("files",), ("files", "config.json"), ("files", "model.safetensors", "bytes"),
    ("files", "optimizer.safetensors", "crc32"), ("files", "trainer_state.json", "crc32"),
    ("files", "model.safetensors", "extra"), ("extra",)])
CKPT_MUTATION = st.one_of(
    st.tuples(st.just("flip"), PICK, FRACTION, st.integers(1, 255)),
    st.tuples(st.just("truncate"), PICK, FRACTION),
    st.tuples(st.just("append"), PICK, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), PICK),
    st.tuples(st.just("manifest"), MANIFEST_PATHS, JUNK),
    st.tuples(st.just("unlist"), PICK),  # the manifest forgets a file
    st.tuples(st.just("extra"),
              st.sampled_from([INDEX, "optimizer.safetensors.index.json",
                               "model-00001-of-00002.safetensors"]),
              st.binary(max_size=16)),
)


def mutate_checkpoint(d: Path, mutation: tuple[Any, ...]) -> None:
    kind, args = mutation[0], mutation[1:]
    files = sorted(p for p in d.iterdir() if p.is_file())
    if kind in ("flip", "truncate", "append", "delete"):
        path = files[args[0] % len(files)]
        blob = bytearray(path.read_bytes())
        if kind == "flip" and blob:
            blob[int(args[1] * len(blob))] ^= args[2]
        elif kind == "truncate":
            blob = blob[: int(args[1] * len(blob))]
        elif kind == "append":
            blob += args[1]
        if kind == "delete":
            path.unlink()
        else:
            path.write_bytes(bytes(blob))
    elif kind in ("manifest", "unlist"):
        path = d / "manifest.json"
        try:
            manifest = json.loads(path.read_text())
            assert isinstance(manifest["files"], dict)
        except Exception:  # already broken by an earlier mutation
            return
        if kind == "unlist":
            if not manifest["files"]:
                return
            listed = sorted(manifest["files"])
            del manifest["files"][listed[args[0] % len(listed)]]
        else:
            keys, value = args
            parent = manifest
            for key in keys[:-1]:
                parent = parent.get(key) if isinstance(parent, dict) else None
            if not isinstance(parent, dict):
                return
            assume(parent.get(keys[-1], object()) != value)
            parent[keys[-1]] = value
        path.write_text(json.dumps(manifest, indent=2))  # as the writer formats it
    elif kind == "extra":
        (d / args[0]).write_bytes(args[1])


def contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


@fuzz(200)
@given(mutations=st.lists(CKPT_MUTATION, min_size=1, max_size=2))
def test_damaged_training_checkpoint_is_refused(saved_checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                                target_store: ParameterStore,
                                                mutations: list[tuple[Any, ...]]) -> None:
    """A changed byte anywhere, a size change, a lost, extra or unlisted file: load_checkpoint refuses in one
    sentence and leaves the arena as it was."""
    source, _ = saved_checkpoint
    with scratch_dir() as tmp, no_leaked_segments():
        d = Path(shutil.copytree(source, tmp / source.name))
        for mutation in mutations:
            mutate_checkpoint(d, mutation)
        assume(contents(d) != contents(source))  # two flips of one byte cancel out
        before = {name: target_store.arena.tensors[name].clone() for name in SAVED}
        state, error = attempt(lambda: target_store.load_checkpoint(d))
        assert error is not None, f"a damaged checkpoint loaded: {mutations}"
        for name, t in before.items():
            assert torch.equal(target_store.arena.tensors[name], t), "a refused checkpoint changed the arena"


def test_undamaged_checkpoint_loads(saved_checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                    target_store: ParameterStore) -> None:
    """The control for the test above: the same copy, unharmed, loads exactly (a harmless extra file
    included)."""
    source, expected = saved_checkpoint
    with scratch_dir() as tmp:
        d = Path(shutil.copytree(source, tmp / source.name))
        (d / "README.md").write_text("notes")
        assert target_store.load_checkpoint(d) == STATE
        layout = target_store.layout
        for segment, flat in expected.items():  # the tensors, not the alignment padding between them
            loaded = layout.hf_views(target_store.arena.tensors[segment])
            for name, t in layout.hf_views(flat).items():
                assert torch.equal(loaded[name], t), (segment, name)
