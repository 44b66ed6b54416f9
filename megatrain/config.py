"""Configs: the model shape (its named presets: megatrain/presets.py), the optimizer and engine settings (and the
errors a user can fix, from megatrain/errors.py).

Every config is a dataclass; `validate()` turns a bad value into one sentence (ConfigError) that says
what is wrong and how to fix it. What a model family's HF config.json holds, and what its layers add, is its
own file's business (megatrain/model/llama.py, qwen3.py, ...: each registers itself in megatrain/model/registry.py,
which this module asks by model_type).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError, MegatrainError, NotNative, Terminated, cause_chain
from megatrain.model import registry
from megatrain.presets import PRESETS


@dataclass
class ModelConfig:
    """A decoder of a native family: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norms), TinyLlama…"""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None  # None: multi-head attention (kv heads = heads)
    intermediate_size: int | None = None  # None: Llama's 8/3 * hidden rounded up to a multiple of 256
    head_dim: int | None = None  # None: hidden / heads (Mistral-style configs may set it explicitly)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None, or {"rope_type": "llama3" | "linear", ...}
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k and v projections
    o_bias: bool = False  # Llama's attention_bias=True also puts one on o_proj
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # the embedding's padding_idx: transformers' nn.Embedding gives its row no gradient, and neither does megatrain
    pad_token_id: int | None = None
    model_type: str = "llama"  # the HF architecture, and so the family: llama | mistral | qwen2 | qwen3
    sliding_window: int | None = None  # Mistral / Qwen2: every layer attends to this many tokens (itself included)
    # the model's config.json, for a model on the generic path (transformers' own layers, megatrain/model/hf_generic.py:
    # a model_type without a native family, or one whose config.json sets what its family does not implement)
    hf_config: dict[str, Any] | None = None
    # what a native family's config.json sets beyond the fields above, checked by the family (Gemma: attention
    # scale, soft-caps, which layers slide, the local rotary base: megatrain/model/gemma.py); None: its defaults
    family_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads"):  # the defaults below derive from these
            _check_positive_int(name, getattr(self, name))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 256 * math.ceil(int(8 * self.hidden_size / 3) / 256)
        if self.head_dim is None and self.hidden_size % self.num_heads == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if isinstance(self.rope_scaling, dict):  # HF's legacy "type" key is "rope_type"; default rope is none
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            scaling = {k: v for k, v in self.rope_scaling.items() if k != "type"}
            empty = not self.rope_scaling
            self.rope_scaling = None if kind == "default" or empty else {**scaling, "rope_type": kind}
        self.validate()
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            setattr(self, name, float(getattr(self, name)))

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            raise ConfigError(
                f"model config: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "choose a head count that divides the hidden size or set head_dim explicitly."
            )
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads} "
                "(grouped-query attention shares each kv head among an equal number of query heads)."
            )
        for name in ("rms_norm_eps", "rope_theta"):
            if not _positive_number(getattr(self, name)):
                raise ConfigError(f"model config: {name} must be a positive number, "
                                  f"got {getattr(self, name)!r}.")
        if not (_finite_number(self.initializer_range) and 0 <= self.initializer_range <= 1):
            raise ConfigError("model config: initializer_range (the init std) must be a number in [0, 1], "
                              f"got {self.initializer_range!r}.")
        for name in ("tie_embeddings", "qkv_bias", "o_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model config: {name} must be true or false, got {getattr(self, name)!r}.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ConfigError(f"model config: {name} must be an integer token id or None, got {value!r}.")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window, "or None")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        if not registry.is_supported(self.model_type):
            raise ConfigError(f"model config: model_type must be {_one_of(registry.native_model_types())} (or a "
                              f"decoder-only model transformers implements, from its config.json), got "
                              f"{self.model_type!r}.")
        self.family.validate(self)

    @property
    def family(self) -> registry.Family:
        """The family of model_type: its HF config mapping and layer options (megatrain/model/registry.py)."""
        return registry.generic() if self.hf_config is not None else registry.family_of(self.model_type)

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head's q and k before RoPE (Qwen3): set by the family, not by a config value."""
        return self.family.qk_norm

    # Sizes derived from the shape: used by the layout, the memory plan and FLOP accounting.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer (the first: a family whose layers differ counts them in num_params)."""
        return sum(math.prod(shape) for _, shape, _ in self.family.layer_tensors(self, 0))

    def num_params(self) -> int:
        if not self.family.uniform_layers:  # layers differ (MoE beside dense, hybrids): the family counts
            return self.family.num_params(self)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else embed
        return embed + self.num_layers * self.layer_params() + self.hidden_size + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6N plus attention scores (PaLM appendix B accounting)."""
        return 6 * self.num_params() + 12 * self.num_layers * self.hidden_size * seq_len

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                              "or pass an HF directory.")
        return cls(**PRESETS[key])

    # ---- HF config.json ----
    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """Reads an HF config.json (a path, a model directory, or the parsed dict)."""
        if isinstance(source, dict):
            hf = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"no HF config at {path}; pass a model directory that holds config.json.")
            try:
                hf = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{path} is not valid JSON ({e}); re-export the checkpoint's config.json.") from None
            if not isinstance(hf, dict):
                raise ConfigError(f"{path} must hold a JSON object; re-export the checkpoint's config.json.")
        model_type = hf.get("model_type", "llama")
        if not isinstance(model_type, str):
            raise ConfigError(f"HF config's model_type must be a string, got {model_type!r}; fix config.json.")
        try:
            try:
                return cls(**registry.family_of(model_type).from_hf(hf, model_type))
            except NotNative as e:
                if not registry.generic().supports(model_type):
                    raise  # no transformers: the refusal says to install it
                config = cls(**registry.generic().from_hf({**hf, "model_type": model_type}, model_type))
                logging.getLogger(__name__).info("%s with %s is not implemented natively; training it through "
                                                 "transformers' own layers (the generic path)", model_type, e.option)
                return config
        except (TypeError, ValueError) as e:
            raise ConfigError(f"HF config has a value of the wrong type ({e}); fix config.json.") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json that transformers reads as this model (the family's own architecture and keys)."""
        self.validate()  # a config changed after it was made may no longer be a layout transformers loads
        return self.family.to_hf(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _one_of(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """One sentence when `value` is not one of `choices` (precision, grads, ...)."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


def _positive_number(value: Any) -> bool:
    return _finite_number(value) and value > 0


def _check_positive_int(name: str, value: Any, alternative: str = "") -> None:
    if not _is_int(value) or value <= 0:
        also = f" {alternative}" if alternative else ""
        raise ConfigError(f"model config: {name} must be a positive integer{also}, got {value!r}.")


ROPE_KEYS = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _check_rope_scaling(scaling: Any) -> None:
    if not isinstance(scaling, dict):
        raise ConfigError(f"model config: rope_scaling must be a dict or None, got {scaling!r}.")
    kind = scaling.get("rope_type")
    if kind not in ROPE_KEYS:
        raise ConfigError(
            f"model config: rope scaling type {kind!r} is not supported; megatrain supports "
            "default, linear and llama3 (remove rope_scaling or convert the checkpoint)."
        )
    for key in ROPE_KEYS[kind]:
        if not _positive_number(scaling.get(key)):
            raise ConfigError(f"model config: {kind} rope_scaling needs a positive number {key}, "
                              f"got {scaling.get(key)!r}.")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ConfigError("model config: llama3 rope_scaling needs low_freq_factor < high_freq_factor, got "
                          f"{scaling['low_freq_factor']!r} and {scaling['high_freq_factor']!r}.")
    unknown = sorted(map(str, set(scaling) - {"rope_type", *ROPE_KEYS[kind]}))
    if unknown:
        raise ConfigError(f"model config: {kind} rope_scaling has unknown key(s) "
                          f"{', '.join(map(repr, unknown))}.")


@dataclass
class OptimConfig:
    """AdamW with HF Trainer's defaults for clipping and schedule (linear warmup, cosine decay)."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # None or 0 turns clipping off
    warmup_steps: int = 0
    total_steps: int | None = None  # None: constant LR after warmup
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr

    def __post_init__(self) -> None:
        if isinstance(self.betas, (list, tuple)):
            self.betas = tuple(self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        if not (_finite_number(self.lr) and self.lr >= 0):
            raise ConfigError(f"optimizer: lr must be a non-negative number, got {self.lr!r}.")
        if not (_finite_number(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"optimizer: weight_decay must be a number >= 0, got {self.weight_decay!r}.")
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2
                and all(_finite_number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError(f"optimizer: betas must be two numbers in [0, 1), got {self.betas!r}.")
        if not _positive_number(self.eps):
            raise ConfigError(f"optimizer: eps must be a positive number, got {self.eps!r}.")
        clip = self.max_grad_norm
        if clip is not None and not (_finite_number(clip) and clip >= 0):
            raise ConfigError("optimizer: max_grad_norm must be positive (or 0/None to turn clipping off), "
                              f"got {self.max_grad_norm!r}.")
        if not (_is_int(self.warmup_steps) and self.warmup_steps >= 0):
            raise ConfigError(f"optimizer: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}.")
        if not (_finite_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise ConfigError(f"optimizer: min_lr_ratio must be a number in [0, 1], "
                              f"got {self.min_lr_ratio!r}.")
        if self.total_steps is not None and not _is_int(self.total_steps):
            raise ConfigError(f"optimizer: total_steps must be an integer or None, got {self.total_steps!r}.")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"optimizer: total_steps must be positive (or None for a constant LR after warmup), "
                              f"got {self.total_steps}.")

    @property
    def clipping(self) -> bool:
        return bool(self.max_grad_norm)

    def lr_at(self, step: int) -> float:
        """LR of the update with 0-based index `step`: HF's get_cosine_schedule_with_warmup."""
        if step < self.warmup_steps:
            return self.lr * step / max(1, self.warmup_steps)
        if self.total_steps is None:
            return self.lr
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


PRECISIONS = ("fp32", "tf32", "bf16")
# Where gradients wait between the backward and the optimizer (megatrain/memory/plan.py chooses for "auto"):
#   arena   all of them in the host arena: 16 B/param on the host, works for everything
#   stream  through a few host slots, each unit updated as soon as its gradient lands (clipping off): 12 B/param
#   device  on the compute device until the step's global norm is known, then streamed through host slots
#           into the optimizer in forward order, overlapping the next forward: 12 B/param host + 4 on the GPU
GRAD_PLACEMENTS = ("auto", "arena", "stream", "device")
# how a step's micro-batches meet the streamed weights (megatrain/engine/executor.py: Executor.run)
SCHEDULES = ("layer-major", "per-micro-batch")
# the update beside the backward (pipelines/engine.py): each unit's AdamW as its gradient lands, rolled back where the
# step then clips or has a non-finite gradient; "auto": not in the step after one that clipped
SPECULATE = ("auto", "on", "off")
COMPILE = ("auto", "on", "off")  # torch.compile: megatrain/perf/compile_choice.py says what auto does
# in bf16 runs, how compute reads the resident units' weights: a bf16 copy beside them on the device (2 B a
# parameter), or cast from their fp32 weights at each use (more units fit); auto: the memory plan picks (residency.py)
RESIDENT_WEIGHTS = ("auto", "copy", "cast")
# in bf16 runs, a bf16 copy of the weights in the arena (2 B a parameter on the host, half the bytes on PCIe); auto:
# the memory plan keeps it only where the calibrated step predicted without it is longer (uncalibrated: where it fits)
BF16_COPY = ("auto", "keep", "none")
# what stays on the executor's device (the memory plan picks for "auto": what the GPU has room for; none on CPUs)
RESIDENT_HELP = ("auto | none | N: units resident on the device with their optimizer state "
                 "(megatrain/memory/residency.py)")
LINK_GBPS = 12.5  # 10^9 B/s between hosts where none is given (predicted step times): 100 Gb Ethernet


def check_nvme(nvme: Any, states: str | tuple[str, ...] | list[str]) -> None:
    """nvme: a directory or None; nvme_states: "auto", "all", or a list of master, moments, grads (a comma-separated
    string from a command line becomes the list)."""
    if nvme is not None and not isinstance(nvme, str):
        raise ConfigError(f"nvme must be a directory (a string), got {nvme!r}.")
    names = ("master", "moments", "grads")
    if states in ("auto", "all"):
        return
    items = tuple(states.split(",")) if isinstance(states, str) else tuple(states)
    if not items or any(i not in names for i in items):
        raise ConfigError(f"nvme_states must be 'auto', 'all' or a list of {', '.join(names)}, got {states!r}.")


@dataclass
class EngineConfig:
    """How the engine runs: where compute happens, how many optimizer workers, how long sequences are chunked."""

    device: str = "auto"  # auto | cpu | cpu-async (CPU with simulated asynchronous streams, for tests) | cuda | cuda:N
    precision: str = "tf32"  # fp32 (strict) | tf32 | bf16 (bf16 compute, fp32 masters)
    optimizer_workers: int | str = 2  # "auto": from the node's free CPUs (megatrain.perf.predict)
    threads_per_worker: int | None = None  # None: cores / workers
    loss_chunk_tokens: int = 4096  # tokens per lm_head + cross-entropy chunk
    seed: int = 0
    grads: str = "auto"  # auto | arena | stream | device: where gradients wait for the optimizer (GRAD_PLACEMENTS)
    compile: str | bool = "auto"  # COMPILE: torch.compile the layers and the head (minutes at the first step)
    # long sequences (megatrain/memory/plan.py picks what is "auto"): the layers' token-wise work in tiles of this
    # many tokens (None: whole), and GiB of device memory for the activation checkpoints (None: all of them; 0: every
    # one in host memory)
    tile_tokens: int | None | str = "auto"
    checkpoint_budget_gib: float | None | str = "auto"
    # a step is this many micro-batches and one update; schedule (SCHEDULES, or "auto": layer-major where it fits,
    # so that weights cross once per step, else per micro-batch)
    micro_batches: int | str = 1  # "auto": the fewest that fit memory (batch_size is then the step's rows)
    schedule: str = "auto"
    # executors, data parallel over a step's rows, all streaming from the one arena ("auto": one per GPU Ray offers
    # the run on its node, one on the CPU path)
    executors: int | str = "auto"
    # Ray nodes the run spans, each with its parameter store (the whole weights, 1/nodes of the Adam moments), its
    # optimizer workers and `executors` executors (pipelines/engine.py)
    nodes: int = 1
    speculate: str = "auto"  # auto | on | off: the update beside the backward (SPECULATE)
    resident: int | str = "auto"  # RESIDENT_HELP; resolved to a count of units by the memory plan
    resident_weights: str = "auto"  # RESIDENT_WEIGHTS; resolved to "copy" or "cast" by the memory plan
    keep_activations: int | str = "auto"  # auto | none | all | N top layers not recomputed (memory/kept_activations.py)
    bf16_copy: str = "auto"  # BF16_COPY; resolved to "keep" or "none" by the memory plan
    gpu_memory_gib: float | None = None  # the run's GPU held to this many GiB (the plan's and the allocator's cap)
    # a LoRA run: a LoraConfig (megatrain/lora/config.py), its adapters trained beside the frozen base, which is stored
    # on the host in lora_base_dtype ("bf16" | "fp32"); None: every parameter trains
    lora: Any = None
    lora_base_dtype: str = "bf16"
    # the NVMe tier (megatrain/memory/nvme.py): a directory on a local disk, and which states live there ("auto",
    # "all" or a list of master, moments, grads); None: every state in host memory
    nvme: str | None = None
    nvme_states: str | tuple[str, ...] = "auto"
    # the initial weights stored in an arena segment of their own, for Engine.logprobs(reference=True): GRPO's KL
    # reference (megatrain/engine/reference.py); a LoRA run's reference is its base with the adapters off, no copy
    reference: bool = False

    def __post_init__(self) -> None:
        check_nvme(self.nvme, self.nvme_states)
        if isinstance(self.nvme_states, str) and self.nvme_states not in ("auto", "all"):
            self.nvme_states = tuple(self.nvme_states.split(","))
        check_tiling(self.tile_tokens, self.checkpoint_budget_gib)
        check_choice("precision", self.precision, PRECISIONS)
        check_auto_or_positive("optimizer_workers", self.optimizer_workers)
        threads = self.threads_per_worker
        if threads is not None and not (_is_int(threads) and threads >= 1):
            raise ConfigError(f"threads_per_worker must be a positive integer or None, got {threads!r}.")
        check_auto_or_positive("micro_batches", self.micro_batches)
        check_choice("schedule", self.schedule, ("auto", *SCHEDULES))
        check_auto_or_positive("executors", self.executors)
        if not (_is_int(self.nodes) and self.nodes >= 1):
            raise ConfigError(f"nodes must be a positive integer, got {self.nodes!r}.")
        if not (_is_int(self.loss_chunk_tokens) and self.loss_chunk_tokens >= 1):
            raise ConfigError(f"loss_chunk_tokens must be a positive integer, got {self.loss_chunk_tokens!r}.")
        if not (_is_int(self.seed) and self.seed >= 0):
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}.")
        self.compile = compile_setting(self.compile)
        check_choice("grads", self.grads, GRAD_PLACEMENTS)
        check_choice("speculate", self.speculate, SPECULATE)
        check_resident(self.resident)
        check_choice("resident_weights", self.resident_weights, RESIDENT_WEIGHTS)
        check_choice("bf16_copy", self.bf16_copy, BF16_COPY)
        cap = self.gpu_memory_gib
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0):
            raise ConfigError(f"gpu_memory_gib must be a positive number of GiB (unset: the whole GPU), got {cap!r}.")
        check_resident(self.keep_activations, "keep_activations", ("auto", "none", "all"), "layers")
        check_device(self.device)
        check_choice("lora_base_dtype", self.lora_base_dtype, ("bf16", "fp32"))


def compile_setting(value: Any) -> str:
    """The compile setting as one of COMPILE (true / false, the older setting: "on" / "off"), or one sentence."""
    value = ("on" if value else "off") if isinstance(value, bool) else value
    check_choice("compile", value, COMPILE)
    return value


def check_resident(value: Any, name: str = "resident", words: tuple = ("auto", "none"), what: str = "units") -> None:
    if not (value in words or (_is_int(value) and value >= 0)):
        raise ConfigError(f"{name} must be {', '.join(map(repr, words))} or a number of {what} >= 0, got {value!r}.")


def check_auto_or_positive(name: str, value: Any) -> None:
    if not (value == "auto" or (_is_int(value) and value >= 1)):
        raise ConfigError(f"{name} must be 'auto' or a positive integer, got {value!r}.")


def check_tiling(tile_tokens: object, checkpoint_budget_gib: object) -> None:
    """tile_tokens: "auto", None or a positive integer; checkpoint_budget_gib: "auto", None or a number >= 0."""
    if not (tile_tokens in ("auto", None) or (_is_int(tile_tokens) and tile_tokens >= 1)):
        raise ConfigError(f"tile_tokens must be 'auto', none or a positive number of tokens, got {tile_tokens!r}.")
    budget = checkpoint_budget_gib
    number = isinstance(budget, int | float) and not isinstance(budget, bool)
    if not (budget in ("auto", None) or (number and math.isfinite(budget) and budget >= 0)):
        raise ConfigError("checkpoint_budget_gib must be 'auto', none or a number of GiB >= 0 (0: every activation "
                          f"checkpoint offloaded to host memory), got {budget!r}.")


def check_device(device: object) -> None:
    """megatrain computes on the CPU or a CUDA GPU; anything else is refused before torch sees it. "cpu-async" is
    the CPU with the GPU's asynchronous streams simulated (megatrain/engine/streams.py), for testing orderings;
    cpu-async:N seeds its delays with N."""
    if not (isinstance(device, str) and re.fullmatch(r"auto|cpu|cpu-async(:\d+)?|cuda(:\d+)?", device)):
        raise ConfigError(f"device must be auto, cpu, cpu-async[:SEED], cuda or cuda:N, got {device!r}.")


def dataclass_from_dict(cls: type, values: dict[str, Any], where: str) -> Any:
    """Builds a config dataclass from a dict, naming unknown keys instead of raising a TypeError."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(map(str, set(values) - known))
    if unknown:
        names = ", ".join(k if k.isidentifier() else repr(k) for k in unknown)  # a key may hold any character
        raise ConfigError(f"{where}: unknown key(s) {names}; known keys are {', '.join(sorted(known))}.")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}.") from None


# A Hugging Face Hub repository as users name a model or a data set: owner/name, then @revision (a branch, tag or
# commit) or not; a path that exists on this machine is read as that path (megatrain/io/hub.py, megatrain/data/)
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_name(text: str) -> bool:
    return HUB_NAME.match(text) is not None and not Path(text).exists()


__all__ = ["ConfigError", "EngineConfig", "MegatrainError", "ModelConfig", "NotNative", "OptimConfig", "PRESETS",
           "Terminated", "cause_chain", "dataclass_from_dict"]
