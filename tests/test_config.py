"""Configs: presets, HF config.json conversion against configs written by transformers, validation
messages, and the LR schedule against transformers' schedulers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import assert_one_sentence
from transformers import AutoConfig, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from megatrain.config import (
    PRESETS,
    ConfigError,
    EngineConfig,
    MegatrainError,
    ModelConfig,
    OptimConfig,
    dataclass_from_dict,
)
from megatrain.store import resolve_model
from pipelines.cli import main

# ---- presets ----

@pytest.mark.parametrize("name, expected", [
    ("1b", 1.100e9),  # TinyLlama-1.1B
    ("3b", 3.213e9),  # Llama-3.2-3B
    ("7b", 6.738e9),  # Llama-2-7B
    ("14b", 14.77e9),  # Qwen2.5-14B
    ("70b", 70.55e9),  # Llama-3-70B
    ("qwen3-0.6b", 0.596e9),  # Qwen3-0.6B
    ("qwen3-8b", 8.191e9),  # Qwen3-8B
])
def test_preset_param_counts(name: str, expected: float) -> None:
    assert ModelConfig.from_name(name).num_params() == pytest.approx(expected, rel=2e-3)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_and_is_consistent(name: str) -> None:
    c = ModelConfig.from_name(name)
    assert c.head_dim * c.num_heads == c.q_size
    assert c.num_heads % c.num_kv_heads == 0
    assert c.num_params() == (c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
                              + c.num_layers * c.layer_params() + c.hidden_size)
    assert ModelConfig.from_name(name.upper()) == c  # names are case-insensitive


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_name_resolves_as_a_model(name: str) -> None:
    """What Engine, `megatrain train` and `megatrain plan` do with --model: "2.8b" looks like a file name
    with the suffix ".8b" and must still be the preset."""
    assert resolve_model(name) == (ModelConfig.from_name(name), None, name)


def test_plan_of_a_preset_with_a_dot_in_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", "--model", "2.8b", "--batch", "1", "--seq", "128"])
    assert "memory plan for 2.8b (2.814 G params)" in capsys.readouterr().out


def test_defaults_follow_llama() -> None:
    c = ModelConfig(hidden_size=4096, num_heads=32)
    assert c.num_kv_heads == 32 and c.head_dim == 128 and c.intermediate_size == 11008


# ---- HF config.json ----

HF_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2),
    "llama3": lambda: LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rope_theta=500000.0, tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    # sliding_window=None: full attention, as Mistral v0.2+ (and megatrain) compute it
    "mistral": lambda: MistralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, rope_theta=1e6, sliding_window=None),
    "qwen2": lambda: Qwen2Config(
        vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
}

# HF keys that must survive ModelConfig.from_hf -> to_hf -> transformers unchanged
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
              "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_parameters", "sliding_window")


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_hf_reads_transformers_configs(name: str) -> None:
    hf = HF_CONFIGS[name]()
    c = ModelConfig.from_hf(hf.to_dict())
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert c.head_dim == effective_head_dim(hf)
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.tie_embeddings == hf.tie_word_embeddings
    assert c.model_type == hf.model_type
    assert c.qkv_bias == (name in ("llama3", "qwen2"))
    assert c.o_bias == (name == "llama3")
    if name == "llama3":
        assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
        assert c.rope_scaling["factor"] == 8.0
    else:
        assert c.rope_scaling is None
    if name == "mistral":
        assert c.q_size == 4 * 48 != c.hidden_size


def effective_head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_round_trip(name: str, tmp_path: Path) -> None:
    hf = HF_CONFIGS[name]()
    hf.save_pretrained(tmp_path)  # a real config.json, read back from the directory
    c = ModelConfig.from_hf(tmp_path)
    assert ModelConfig.from_hf(c.to_hf()) == c
    back = AutoConfig.for_model(**c.to_hf())
    assert type(back) is type(hf)
    expected, actual = hf.to_dict(), back.to_dict()
    for key in SHAPE_KEYS:
        assert actual.get(key) == expected.get(key), key
    # Qwen2Config has no head_dim attribute and MistralConfig no attention_bias: compare what they mean
    assert effective_head_dim(back) == effective_head_dim(hf)
    assert getattr(back, "attention_bias", False) == getattr(hf, "attention_bias", False)
    assert back.architectures == [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                   "qwen2": "Qwen2ForCausalLM"}[hf.model_type]]


def test_preset_round_trips_through_transformers() -> None:
    c = ModelConfig.from_name("14b")
    back = AutoConfig.for_model(**c.to_hf())
    assert isinstance(back, Qwen2Config)
    assert ModelConfig.from_hf(back.to_dict()) == c


# ---- validation: one sentence each ----

def _bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10,')
    ModelConfig.from_hf(tmp_path)


def _json_not_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    ModelConfig.from_hf(tmp_path / "config.json")


def _no_config(tmp_path: Path) -> None:
    ModelConfig.from_hf(tmp_path)


def _unknown_model_type(tmp_path: Path) -> None:
    ModelConfig.from_hf(transformers.BertConfig().to_dict())


def _missing_keys(tmp_path: Path) -> None:
    ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 64})


def _llama_dict(**overrides: Any) -> dict[str, Any]:
    return {**LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict(), **overrides}


def _string_for_int(tmp_path: Path) -> None:
    ModelConfig.from_hf(_llama_dict(num_hidden_layers="2"))


def _list_for_float(tmp_path: Path) -> None:
    ModelConfig.from_hf(_llama_dict(rope_parameters={"rope_type": "default", "rope_theta": [1.0]}))


def _word_for_float(tmp_path: Path) -> None:
    ModelConfig.from_hf(_llama_dict(rms_norm_eps="tiny"))


def _yarn(tmp_path: Path) -> None:
    ModelConfig(hidden_size=64, num_heads=4, rope_scaling={"rope_type": "yarn", "factor": 4.0})


BAD_CONFIGS: list[tuple[Callable[[Path], Any], str]] = [
    (lambda _: ModelConfig(hidden_size=100, num_heads=3),
     r"hidden_size 100 is not divisible by num_heads 3; .*set head_dim explicitly"),
    (lambda _: ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=3),
     r"num_kv_heads 3 must divide num_heads 4"),
    (lambda _: ModelConfig(hidden_size=64, num_heads=4, num_layers=0),
     r"num_layers must be a positive integer, got 0"),
    (lambda _: ModelConfig(hidden_size=60, num_heads=4),
     r"head_dim must be even for rotary embeddings, got 15"),
    (lambda _: ModelConfig(hidden_size=64, num_heads=4, model_type="gpt9"),
     r"model_type must be llama, mistral, qwen2, qwen3, gemma2 or gemma3_text \(or a decoder-only model "
     r"transformers implements, from its config.json\), got 'gpt9'"),
    (lambda _: ModelConfig(hidden_size=64, num_heads=4, model_type="gpt2"),
     r"model_type 'gpt2' runs on the generic path, which needs the model's config.json"),
    (lambda _: ModelConfig.from_name("huge"), r"unknown model preset 'huge'; choose one of tiny, .*70b"),
    (_unknown_model_type, r"model_type 'bert' is an encoder \(a masked language model"),
    (_bad_json, r"config.json is not valid JSON"),
    (_json_not_object, r"must hold a JSON object"),
    (_no_config, r"no HF config at .*config.json"),
    (_missing_keys, r"HF config lacks num_hidden_layers, num_attention_heads"),
    (_string_for_int, r"num_layers must be a positive integer, got '2'"),
    (_list_for_float, r"HF config has a value of the wrong type"),
    (_word_for_float, r"HF config has a value of the wrong type"),
    (_yarn, r"rope scaling type 'yarn' is not supported"),
    (lambda _: OptimConfig(lr=-1.0), r"lr must be a non-negative number, got -1.0"),
    (lambda _: OptimConfig(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    (lambda _: OptimConfig(warmup_steps=10, total_steps=0), r"total_steps must be positive"),
    (lambda _: EngineConfig(precision="fp8"), r"precision must be one of fp32, tf32, bf16, got 'fp8'"),
    (lambda _: EngineConfig(device="tpu"), r"device must be auto, cpu, cpu-async\[:SEED\], cuda or cuda:N, got 'tpu'"),
    (lambda _: dataclass_from_dict(OptimConfig, {"lr": 1e-3, "learning_rate": 1e-3}, "[optim]"),
     r"\[optim\]: unknown key\(s\) learning_rate; known keys are"),
]


@pytest.mark.parametrize("make, expected", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_validation_errors_are_one_sentence(make: Callable[[Path], Any], expected: str,
                                            tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        make(tmp_path)
    assert isinstance(info.value, MegatrainError)
    assert_one_sentence(str(info.value))


def test_head_dim_may_be_explicit() -> None:
    c = ModelConfig(hidden_size=100, num_heads=4, head_dim=32, intermediate_size=256)
    assert c.q_size == 128 and c.kv_size == 128


# ---- the LR schedule ----

def hf_lrs(make_scheduler: Callable[[torch.optim.Optimizer], Any], lr: float, steps: int) -> list[float]:
    """The LR transformers' scheduler gives the update with index 0, 1, ..., steps-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup, total", [(5, 20), (0, 20), (1, 20), (19, 20), (20, 20)])
def test_lr_at_matches_cosine_with_warmup(warmup: int, total: int) -> None:
    cfg = OptimConfig(lr=3e-4, warmup_steps=warmup, total_steps=total)
    expected = hf_lrs(lambda o: transformers.get_cosine_schedule_with_warmup(o, warmup, total), cfg.lr, 20)
    assert [cfg.lr_at(s) for s in range(20)] == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_lr_at_matches_cosine_with_min_lr() -> None:
    cfg = OptimConfig(lr=1e-3, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    schedule = transformers.get_cosine_with_min_lr_schedule_with_warmup
    expected = hf_lrs(lambda o: schedule(o, 4, 20, min_lr_rate=0.1), cfg.lr, 20)
    assert [cfg.lr_at(s) for s in range(20)] == pytest.approx(expected, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("warmup", [0, 5])
def test_lr_is_constant_after_warmup_without_total_steps(warmup: int) -> None:
    cfg = OptimConfig(lr=2e-4, warmup_steps=warmup, total_steps=None)
    expected = hf_lrs(lambda o: transformers.get_constant_schedule_with_warmup(o, warmup), cfg.lr, 20)
    assert [cfg.lr_at(s) for s in range(20)] == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert cfg.lr_at(10_000) == cfg.lr


def test_configs_serialise(tmp_path: Path) -> None:
    c = ModelConfig.from_name("tiny")
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    assert ModelConfig(**json.loads((tmp_path / "c.json").read_text())) == c


def test_plan_describes_the_run_train_would_make(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Same defaults as `megatrain train`, the same config file, and the same refusals."""
    from megatrain.config import OptimConfig
    from megatrain.memory import plan
    from megatrain.memory.plan import plan_run
    from pipelines.train import TrainConfig

    # the machine's free memory, read once: the two plans compared below are made a moment apart
    for reading in ("host_available", "shm_available"):
        value = getattr(plan, reading)(*(["/dev/shm"] if reading == "shm_available" else []))
        monkeypatch.setattr(plan, reading, lambda *_, value=value: value)

    train = TrainConfig()

    def report(model: str, batch: int, seq: int, workers: int) -> str:
        return plan_run(ModelConfig.from_name(model), batch, seq, grads=train.grads, name=model,
                        clipping=OptimConfig(max_grad_norm=train.max_grad_norm).clipping, precision=train.precision,
                        optimizer_workers=workers, on_gpu=False).report().strip()

    def plan_printed() -> str:  # the plan, less the last line: the longest sequence that would fit
        out = capsys.readouterr().out.strip().splitlines()
        assert out[-1].startswith("longest sequence at batch")
        return "\n".join(out[:-1])

    main(["plan", "--device", "cpu"])
    assert plan_printed() == report(train.model, train.data.batch_size, train.data.seq_len, train.optimizer_workers)
    config = tmp_path / "run.toml"
    config.write_text('model = "125m"\noptimizer_workers = 3\n[data]\nbatch_size = 2\nseq_len = 64\n')
    main(["plan", "--config", str(config), "--device", "cpu", "--seq", "32"])
    assert plan_printed() == report("125m", 2, 32, 3)

    for flags, message in ((["--batch", "0"], "batch_size must be a positive integer"),
                           (["--optimizer-workers", "0"], "optimizer_workers must be 'auto' or a positive integer"),
                           (["--max-grad-norm", "-1"], "max_grad_norm must be positive"),
                           (["--gpu-gib", "-3"], "--gpu-gib must be a positive number of GiB"),
                           (["--host-gib", "0"], "--host-gib must be a positive number of GiB"),
                           (["--checkpoint-budget-gib", "-1"], "checkpoint_budget_gib must be 'auto', none or")):
        assert main(["plan", *flags]) == 2
        assert message in capsys.readouterr().err
