"""What several test modules share, so that no test module imports another: tiny random transformers models and
the references megatrain is held to (transformers' loss and gradients, its training with torch.optim.AdamW), Engine
runs with actors SIGKILLed along the way, the one-sentence check of an error message, the command line called in
this process, look-ups of /dev/shm, Ray processes and ports, and the environment of a test's own Ray. The
fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    get_cosine_schedule_with_warmup,
)

import megatrain
from megatrain import MegatrainError
from megatrain.memory.arena import list_segments, segment_owner_alive
from megatrain.model.layout import ModelLayout
from pipelines.cluster import environment_value

# ---- tiny random transformers models, and their loss and gradients ----

REL_TOL = 1e-5
VOCAB = 128
BATCH, SEQ = 3, 16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}

# name -> HF config factory; each one exercises a different part of the layout or the rope
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2),
    # Llama 3.1 rope scaling, a non-default theta, and attention_bias (q/k/v and o_proj biases)
    "llama3-rope": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE), attention_bias=True),
    "llama-linear-rope": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, rope_theta=1000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # explicit head_dim: q/o projections are 4 * 24 = 96 wide while hidden is 64
    "mistral-head-dim": lambda: MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24),
    # q/k/v biases and tied embeddings
    "qwen2-tied": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True),
    # per-head q/k norms, and an explicit head_dim as every Qwen3 has (more tests in test_qwen3.py)
    "qwen3-head-dim": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, rope_theta=1e6),
}

# the attention shape of test_hf_generic's architectures (and of the Gemmas below)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def gemma2_config() -> Gemma2Config:
    """Attention-logit and final-logit soft-capping, sliding window 8 < 16 tokens, scaled tied embeddings."""
    return Gemma2Config(**SHAPE, intermediate_size=96, num_hidden_layers=2, sliding_window=8,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                        pad_token_id=0)


def gemma3_config() -> Gemma3TextConfig:
    """Gemma 3 text: q/k norms, local and global rotary tables (the global one scaled), sliding / full layers."""
    return Gemma3TextConfig(**SHAPE, intermediate_size=96, num_hidden_layers=3, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            query_pre_attn_scalar=16, pad_token_id=0,
                            rope_scaling={"rope_type": "linear", "factor": 8.0})


REAL = Path(__file__).parent / "data" / "hf_configs"  # config.json files of real models, as published


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the absolute difference where expected is all zero)."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def max_rel(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: ((ours[n] - want).abs().max() / want.abs().max()).item() for n, want in ref.items()}


def build_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # move every parameter off its init value: biases and norms get real gradients
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def saved_hf_model(config: PretrainedConfig, tmp_path_factory: pytest.TempPathFactory, name: str
                   ) -> tuple[torch.nn.Module, Path]:
    """build_hf_model(config) and the directory it is saved in (a module fixture's model, as a user points at one)."""
    hf = build_hf_model(config)
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory)
    return hf, directory


def hf_loss_and_grads(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def fp64_grads(hf: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    exact = copy.deepcopy(hf).double()
    if any(".experts." in n for n, _ in exact.named_parameters()):
        exact.set_experts_implementation("eager")  # torch's grouped matmul has no fp64 kernel
    return hf_loss_and_grads(exact, input_ids, labels)


def assert_matches_hf(loss: torch.Tensor, grads: dict[str, torch.Tensor], hf_loss: torch.Tensor,
                      hf_grads: dict[str, torch.Tensor], all_nonzero: bool = True) -> None:
    assert rel_err(loss, hf_loss) <= REL_TOL, (loss.item(), hf_loss.item())
    assert set(grads) == set(hf_grads)
    errors = {name: rel_err(grads[name], g) for name, g in hf_grads.items()}
    bad = {name: e for name, e in errors.items() if not e <= REL_TOL}
    assert not bad, f"gradients differ from HF: {bad}"
    if all_nonzero:
        for name, g in hf_grads.items():
            assert g.abs().max() > 0, f"HF gradient of {name} is zero: the test would not see a wrong value"


def assert_matches(ours: tuple[torch.Tensor, dict[str, torch.Tensor]], hf: tuple[torch.Tensor, dict[str, torch.Tensor]],
                   exact: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    """Within 1e-5 of transformers in fp32; where transformers' own fp32 result is further than that from the exact
    (fp64) one, within twice transformers' distance of the exact result instead (rounding, not a wrong formula)."""
    (loss, grads), (hf_loss, hf_grads), (_, exact_grads) = ours, hf, exact
    assert rel_err(loss, hf_loss) <= REL_TOL, (loss.item(), hf_loss.item())
    assert set(grads) == set(hf_grads)
    bad = {}
    for name, g in hf_grads.items():
        assert g.abs().max() > 0, f"transformers' gradient of {name} is zero: the test would not see a wrong value"
        if rel_err(grads[name], g) <= REL_TOL:
            continue
        exact_g = exact_grads[name].float()
        if rel_err(grads[name], exact_g) > 2 * max(rel_err(g, exact_g), REL_TOL / 2):
            bad[name] = (rel_err(grads[name], g), rel_err(grads[name], exact_g), rel_err(g, exact_g))
    assert not bad, f"gradients differ from transformers (ours vs fp32, ours vs fp64, fp32 vs fp64): {bad}"


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def make_labels(kind: str, input_ids: torch.Tensor) -> torch.Tensor | None:
    """None; labels = input_ids; or random targets with -100 in places (row 0's prefix, scattered positions
    in row 1, the whole of row 2)."""
    if kind == "none":
        return None
    if kind == "full":
        return input_ids.clone()
    gen = torch.Generator().manual_seed(7)
    labels = torch.randint(0, VOCAB, input_ids.shape, generator=gen)
    labels[0, :6] = -100
    labels[1, torch.randperm(SEQ, generator=gen)[: SEQ // 3]] = -100
    labels[2, :] = -100
    return labels


# ---- a tiny Llama and the rows of a step, split into micro-batches or among executors ----

ROWS, ROWS_SEQ = 8, 24


def micro_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of ids and labels, some -100, unevenly spread over the micro-batches (the last has fewest): a mean of
    per-micro-batch means would differ from the batch's mean."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, ROWS_SEQ), generator=gen)
    labels = ids.clone()
    labels[6:, : ROWS_SEQ - 3] = -100
    labels[1, :5] = -100
    return ids, labels


# ---- training: transformers + torch.optim.AdamW, and the Engine ----

OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=2, total_steps=5)


def hf_reference(hf_dir: Path, batches: list, max_grad_norm: float | None, optim: dict = OPTIM,
                 dtype: torch.dtype = torch.float32, no_decay: Callable[[str], Any] | None = None,
                 attention: str | None = "eager", loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
                 scale: float = 1.0, model: Callable[[torch.dtype], torch.nn.Module] | None = None
                 ) -> tuple[list[float], dict]:
    """transformers' model trained by torch.optim.AdamW (norms and biases not decayed, or the parameters whose
    names `no_decay` accepts) on HF's cosine schedule; `dtype` float64 gives the exact result that fp32 runs are
    judged against (parameters returned in fp32). A batch is (ids, labels) or (ids, labels, position_ids), or what
    `loss(model, batch)` takes (default: transformers' cross-entropy). scale: the loss differentiated is scaled by it
    (1 +- 2^-20: the same training rounded differently; AdamW and clipping take the scale out), the losses returned
    are not. model(dtype): the model to train (default: hf_dir's); only its parameters that require a gradient train
    and are returned (a PEFT model's adapters, by the names PEFT saves them under)."""
    model = model(dtype) if model is not None else AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation=attention, dtype=dtype)
    named = [(n.replace(".default.", "."), p) for n, p in model.named_parameters() if p.requires_grad]
    if dtype == torch.float64 and any(".experts." in n for n, _ in named):
        model.set_experts_implementation("eager")  # torch's grouped matmul has no fp64 kernel
    if no_decay is None:
        no_decay = lambda n: n.endswith("norm.weight") or n.endswith(".bias")  # noqa: E731
    decay = [p for n, p in named if not no_decay(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                             {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}],
                            lr=optim["lr"], betas=optim["betas"], eps=optim["eps"])
    sched = get_cosine_schedule_with_warmup(opt, optim["warmup_steps"], optim["total_steps"])
    losses = []
    for batch in batches:
        value = (loss or cross_entropy)(model, batch)
        (value * scale).backward()
        losses.append(value.item())
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, {n: p.detach().float().clone() for n, p in named}


def cross_entropy(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """transformers' loss of (ids, labels) or (ids, labels, position_ids): use_cache=False is how transformers reads
    packed position_ids in training (see test_long_context.py)."""
    ids, labels, *positions = batch
    return model(input_ids=ids, labels=labels, position_ids=positions[0] if positions else None, use_cache=False).loss


def train_engine(hf_dir: Path, batches: list, workers: int, max_grad_norm: float | None = 1.0, grads: str = "auto",
                 device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor]]:
    with megatrain.Engine(hf_dir, optimizer_workers=workers, precision="fp32", device=device,
                          max_grad_norm=max_grad_norm, grads=grads, **OPTIM) as engine:
        if grads != "auto":
            assert engine.grads == grads
        losses = [engine.step(ids, labels) for ids, labels in batches]
        params = engine.parameters()
    segments = [engine.handle.path(name) for name, _, _ in engine.handle.segments]
    assert not any(p.exists() for p in segments), "the engine left shared memory behind"
    return losses, params


def persistent_buffers(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The buffers transformers saves and loads with the model's weights (a router's correction bias), as loaded."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # tied ones under each name
    return {n: t for n, t in model.state_dict().items() if n not in parameters}


THREE_STEPS_OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1, total_steps=4)


def assert_engine_matches_transformers(directory: Path, no_decay: Callable[[str], Any] | None = None,
                                       optim: dict = THREE_STEPS_OPTIM,
                                       attentions: tuple[str | None, ...] = ("eager",)) -> None:
    """Three Engine steps (clipping on, labels masked in places) on the HF directory's model, against transformers +
    torch.optim.AdamW, both judged against an fp64 run of the reference (test_qwen3.py, test_gemma.py and
    test_model_families.py); `no_decay` and `optim` as hf_reference takes them, transformers' fp32 run once per
    attention implementation of `attentions`. Persistent buffers (a router's correction bias) stream frozen: unchanged
    by the steps."""
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        labels = ids.clone()
        labels[0, :5] = -100
        batches.append((ids, labels))
    # one optimizer worker: how units split among workers is the same for every model (test_engine.py checks it)
    with megatrain.Engine(directory, optimizer_workers=1, precision="fp32", device="cpu", max_grad_norm=1.0,
                          **optim) as engine:
        losses = [engine.step(ids, labels) for ids, labels in batches]
        params = engine.parameters()
    exact_losses, exact = hf_reference(directory, batches, 1.0, optim, torch.float64, no_decay, attentions[0])
    hf_runs = [hf_reference(directory, batches, 1.0, optim, no_decay=no_decay, attention=a) for a in attentions]
    assert losses == pytest.approx(exact_losses, rel=1e-5)
    for hf_losses, _ in hf_runs:
        assert hf_losses == pytest.approx(exact_losses, rel=1e-5)
    frozen = persistent_buffers(directory)  # the Engine streams them frozen, beside the parameters
    # a vision-language model's towers pass through the Engine, untrained (text batches never run them)
    passthrough = set(ModelLayout.build(megatrain.ModelConfig.from_hf(directory)).passthrough)
    exact = {n: t for n, t in exact.items() if n not in passthrough}
    assert params.keys() == exact.keys() | frozen.keys()
    changed = [n for n, b in frozen.items() if not torch.equal(params.pop(n), b.float())]
    assert not changed, f"frozen buffers changed in training: {changed}"
    ours = max_rel(params, exact)
    runs = [max_rel(hf_params, exact) for _, hf_params in hf_runs]
    theirs = {n: max(run[n] for run in runs) for n in exact}
    # fp32 rounding, amplified by Adam where a gradient is near zero, moves both fp32 runs off the exact
    # result: megatrain must be as close to it as transformers' own fp32 run is (the farthest of its runs; or within
    # 1e-5)
    too_far = {n: (e, theirs[n]) for n, e in ours.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


# ---- the Engine with actors SIGKILLed along the way ----

STEPS = 20
KILL_STEPS = {3, 7, 11, 14, 18}  # 5 different steps; a checkpoint at step 10 sits between them
ENGINE = dict(lr=3e-3, warmup_steps=3, total_steps=STEPS, optimizer_workers=1, precision="fp32", device="cpu",
              seed=0)


def executor_pid(engine: megatrain.Engine) -> int:
    """The process of the run's (first) executor, as the actor itself tells it."""
    return ray.get(engine.executor.pid.remote())


def worker_pids(engine: megatrain.Engine) -> list[int]:
    return ray.get([w.pid.remote() for w in engine.workers])


def kill_once_updates_are_handed_out(engine: megatrain.Engine, pid: int) -> None:
    """The next time the driver hands out a step's update (the serial update, or the clipped redo of the updates
    beside the backward), the process `pid` is SIGKILLed right after."""
    update = engine.actors.update

    def update_then_kill(*args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        refs = update(*args, **kwargs)
        os.kill(pid, signal.SIGKILL)
        engine.actors.update = update
        return refs

    engine.actors.update = update_then_kill


def train_with_faults(batches: list[torch.Tensor], tmp: Path, victim: str | None = None,
                      max_grad_norm: float | None = 1.0, seed: int = 0, grads: str = "auto", device: str = "cpu",
                      micro_batches: int = 1, executors: int = 1, kill_steps: set[int] = KILL_STEPS,
                      checkpoint_after: int = 9) -> tuple[list[float], dict[str, torch.Tensor], int, list[Path]]:
    """20 steps with a checkpoint after step 10; with a victim, SIGKILLs it at a random moment of 5 steps (or of
    `kill_steps` of as many steps as `batches` has, the checkpoint after `checkpoint_after`)."""
    rng = random.Random(seed)
    losses = []
    with megatrain.Engine("tiny", max_grad_norm=max_grad_norm, grads=grads, micro_batches=micro_batches,
                          executors=executors, **{**ENGINE, "device": device}) as engine:
        for i, ids in enumerate(batches):
            killer = None
            if victim is not None and i in kill_steps:
                pid = executor_pid(engine) if victim == "executor" else rng.choice(worker_pids(engine))
                killer = threading.Timer(rng.uniform(0.0, 0.15), os.kill, (pid, signal.SIGKILL))
                killer.start()
            losses.append(engine.step(ids))
            if killer is not None:
                killer.join()
            if i == checkpoint_after:
                engine.save_checkpoint(tmp / f"step-{i + 1}")
        params = engine.parameters()
        restarts = engine.restarts
        segments = [engine.handle.path(name) for name, _, _ in engine.handle.segments]
    return losses, params, restarts, segments


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs from the reference run's"


# ---- error messages ----

def assert_one_sentence(message: str) -> None:
    assert message.endswith("."), message
    assert "\n" not in message, message
    assert not re.search(r"\.\s+[A-Z]", message), f"more than one sentence: {message}"


def error(fn, *args, **kw) -> str:
    """The message of the MegatrainError fn raises: checked to be one sentence."""
    with pytest.raises(MegatrainError) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message and message.endswith("."), message
    return message


# a ChatML template that starts with BOS
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---- the command line, called in this process ----

@dataclasses.dataclass
class CliRun:
    returncode: int
    output: str  # stdout and stderr as one stream, in the order written: what a terminal shows


def run_cli(*args: str, cwd: Path | None = None) -> CliRun:
    """`megatrain ARGS` as its main(argv) in this process: a subprocess would add a Python start, imports and a Ray
    start of its own to each call. Returns the exit code (argparse's SystemExit included) and what it printed, its
    log lines too: logging.basicConfig in main is a no-op under pytest's log handlers, so a handler of the format
    it sets stands in. An exception main lets through fails the test, as a traceback would have."""
    from pipelines.cli import main  # where the command line lives (imported when a test calls it)

    output = io.StringIO()
    handler = logging.StreamHandler(output)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level, here = root.level, Path.cwd()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if "-v" in args or "--verbose" in args else logging.INFO)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        os.chdir(here)
        root.removeHandler(handler)
        root.setLevel(level)
    return CliRun(code, output.getvalue())


# ---- /dev/shm, Ray processes and ports ----

ROOT = Path(__file__).resolve().parents[1]  # the repository: a test's Ray imports megatrain from it


def python_path() -> str:
    """PYTHONPATH for a subprocess: the repository (megatrain from it), then what conftest set (tests/ray_site)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


TIMEOUT = 240  # seconds for one subprocess; a hang fails the test instead of the CI job


def my_segments() -> set[Path]:
    """Arena files owned by this process (other runs may use /dev/shm at the same time)."""
    return {p for p in list_segments() if f"-{os.getpid()}-" in p.name}


def dead_segments() -> set[Path]:
    return {p for p in list_segments() if not segment_owner_alive(p)}


def processes_with(variable: str, value: str, names: tuple[bytes, ...] = (b"",)) -> list[int]:
    """Live processes whose environment sets `variable` to `value` (inherited from the process that set it), and
    whose command line starts with one of `names`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(names)
                    and environment_value(proc / "environ", variable.encode()) == value.encode()):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def ray_processes(tmp: str) -> list[int]:
    """Live processes started under RAY_TMPDIR=tmp (a Ray's daemons and workers, the drivers of this test)."""
    return processes_with("RAY_TMPDIR", tmp)


def stop_ray(tmp: str, timeout: float = 30.0) -> list[int]:
    """Kills every process of this RAY_TMPDIR (only those: they are this test's); returns any that survive."""
    deadline = time.monotonic() + timeout
    while (pids := ray_processes(tmp)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return ray_processes(tmp)


@contextlib.contextmanager
def private_ray_env() -> Iterator[dict[str, str]]:
    """The environment of a Ray of a test's own: its own RAY_TMPDIR, short because Ray's unix sockets live under it
    (at most ~107 characters), no RAY_ADDRESS from outside; on leaving, every process of that Ray is killed (after a
    failure too) and the directory removed."""
    tmp = tempfile.mkdtemp(prefix="mt", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's own settings (memory monitor off, no prestarted workers) come with os.environ: conftest's session fixture
    env |= {"RAY_TMPDIR": tmp, "PYTHONPATH": python_path()}
    try:
        yield env
    finally:
        stop_ray(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def assert_nothing_left(env: dict[str, str], dead_before: set[Path]) -> None:
    assert not stop_ray(env["RAY_TMPDIR"]), "Ray processes of this test survive a SIGKILL"
    assert dead_segments() <= dead_before, "the run left shared memory in /dev/shm"


def free_port() -> int:
    """A port nothing listens on (the kernel's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
