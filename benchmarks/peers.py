"""The systems benchmarks/throughput.py compares, each trained on one model shape, batch and precision.

  megatrain  megatrain.Engine as users run it: a Ray parameter store, optimizer pool and GPU executor
  resident   HF transformers on the GPU, activation checkpointing, torch.optim.AdamW(fused=True)
  fsdp2      the same HF model under FSDP2 `fully_shard`, CPUOffloadPolicy(pin_memory=True), one rank
  deepspeed  the same HF model under DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU

Every runner is called in a process of its own (throughput.py starts one per peer), so
torch.cuda.max_memory_allocated() and the host memory sampled from outside belong to that peer alone, and
a crash or an out-of-memory ends only its row. The same random token batches, optimizer hyper-parameters
and gradient clipping go to every peer.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatrain.config import ModelConfig

PEERS = ("megatrain", "resident", "fsdp2", "deepspeed")
LABELS = {"megatrain": "megatrain", "resident": "GPU-resident PyTorch", "fsdp2": "FSDP2 CPU offload",
          "deepspeed": "DeepSpeed ZeRO-3 offload"}
NEEDS_CUDA = ("fsdp2", "deepspeed")  # offload peers: on a CPU-only machine there is nothing to offload from
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1  # megatrain.Engine's defaults


@dataclass
class BenchSpec:
    model: str  # a megatrain preset name
    batch: int
    seq: int
    precision: str  # fp32 | tf32 | bf16
    steps: int  # timed steps
    warmup: int  # untimed steps first (allocator warm-up, CPU Adam compile, page faults in the arena)
    optimizer_workers: int = 8
    lr: float = 3e-4
    max_grad_norm: float = 1.0  # 0 turns clipping off, for every peer
    object_store_mb: int = 256  # Ray's object store (megatrain): it carries only token batches
    seed: int = 0
    grads: str = "auto"  # megatrain: where gradients wait (EngineConfig.grads)
    compile: bool = False  # megatrain: torch.compile of the decoder layer
    # megatrain, long sequences (EngineConfig): "auto" lets the memory plan pick the tile size and the device
    # budget of the activation checkpoints; None: untiled / every checkpoint on the device
    tile_tokens: int | None | str = "auto"
    checkpoint_budget_gib: float | None | str = "auto"
    executors: int = 1  # megatrain: data-parallel executors (one per GPU), each on batch / executors rows

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_name(self.model)


@dataclass
class PeerResult:
    peer: str
    status: str = "ok"  # "ok", or why the row has no throughput: "needs CUDA", "out of GPU memory", ...
    device: str = ""
    step_time: float | None = None  # mean wall-clock seconds per timed step
    tokens_per_s: float | None = None
    tflops: float | None = None  # ModelConfig.flops_per_token (6 N plus attention) * tokens / step_time / 1e12
    gpu_peak: int | None = None  # bytes: max_memory_allocated() of the computing process, after setup
    host_rss_peak: int | None = None  # bytes, sampled by the parent (benchmarks/common.py)
    host_used_peak: int | None = None
    setup_s: float | None = None  # building the model and optimizer (megatrain: starting the actors)
    losses: list[float] = field(default_factory=list)
    stats: dict[str, float] | None = None  # megatrain: the mean StepStats of the timed steps
    grads: str | None = None  # megatrain: where its gradients waited (Engine.grads), where the engine says
    # megatrain, long sequences: what its memory plan picked (None: untiled / every checkpoint kept on the
    # device), and the bytes of page-locked host buffers its activation checkpoints were offloaded to (measured)
    tile_tokens: int | None = None
    checkpoint_budget: int | None = None
    host_checkpoints: int | None = None

    def finish(self, spec: BenchSpec, step_time: float, losses: list[float]) -> PeerResult:
        tokens = spec.batch * spec.seq
        self.step_time = step_time
        self.tokens_per_s = tokens / step_time
        self.tflops = spec.config.flops_per_token(spec.seq) * tokens / step_time / 1e12
        self.losses = [float(x) for x in losses]
        if not all(math.isfinite(x) for x in self.losses) and self.status == "ok":
            self.status = "non-finite loss"
        return self


def make_batches(spec: BenchSpec) -> list[torch.Tensor]:
    """warmup + steps batches of uniform random token ids, the same for every peer."""
    gen = torch.Generator().manual_seed(spec.seed)
    vocab = spec.config.vocab_size
    shape = (spec.batch, spec.seq)
    return [torch.randint(0, vocab, shape, generator=gen) for _ in range(spec.warmup + spec.steps)]


def describe_error(e: BaseException) -> str:
    """One line for the table: out-of-memory spelled out (also when Ray wraps an actor's error)."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in text or "OutOfMemoryError" in text:
        return "out of GPU memory"
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"error: {type(e).__name__}: {first}"[:200]


def run_peer(name: str, spec: BenchSpec) -> PeerResult:
    runners: dict[str, Callable[[BenchSpec], PeerResult]] = {
        "megatrain": run_megatrain, "resident": run_resident, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed}
    try:
        return runners[name](spec)
    except Exception as e:
        import traceback

        traceback.print_exc()  # into the peer's log; the table gets one line
        result = PeerResult(name, status=describe_error(e))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result.gpu_peak = torch.cuda.max_memory_allocated()
        return result


# ---- shared by the in-process PyTorch peers ----

def hf_model_factory(config: ModelConfig) -> Callable[[], torch.nn.Module]:
    """A constructor of the HF model of a megatrain preset (LlamaForCausalLM for the llama presets): fp32,
    SDPA attention, on the current default device (use `with torch.device(...)`).

    Everything is imported here, before the model is built: DeepSpeed's zero.Init patches torch.Tensor while
    the model is constructed, and transformers' lazy imports fail under that patch (torch._dynamo's
    polyfills check the signature of Tensor.__new__)."""
    import torch._dynamo  # noqa: F401  (see above)
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    hf = config.to_hf()
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf, attn_implementation="sdpa")
    hf_config.use_cache = False  # training: no KV cache
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]  # resolving it imports the modeling module
    return lambda: model_class(hf_config).train()


def build_hf_model(config: ModelConfig) -> torch.nn.Module:
    return hf_model_factory(config)()


def enable_checkpointing(model: torch.nn.Module, use_reentrant: bool = False) -> None:
    """Activation checkpointing of every decoder layer (transformers 5 renamed the method; both work)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """megatrain's decay rule: matrices decay, norms and biases do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("norm.weight") or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def time_steps(step: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], warmup: int,
               sync: Callable[[], None]) -> tuple[float, list[float]]:
    """Runs every batch through `step`; returns (mean seconds of the steps after `warmup`, losses)."""
    losses = [step(b) for b in batches[:warmup]]
    sync()
    t0 = time.perf_counter()
    losses += [step(b) for b in batches[warmup:]]
    sync()
    step_time = (time.perf_counter() - t0) / max(1, len(batches) - warmup)
    return step_time, [float(x) for x in losses]


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _device_name(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


def _train_hf(name: str, spec: BenchSpec, model: torch.nn.Module, optimizer: Any, device: torch.device,
              setup_s: float) -> PeerResult:
    """The training loop of the resident and FSDP2 peers: forward with HF's loss, backward, clip, step."""
    result = PeerResult(name, device=_device_name(device), setup_s=setup_s)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # count the training steps, not the model build

    def step(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device, non_blocking=True)
        with autocast(device, spec.precision):
            loss = model(input_ids=ids, labels=ids).loss  # HF shifts the labels inside, as megatrain does
        loss.backward()
        if spec.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return _timed_torch_run(step, spec, device, result)


def _timed_torch_run(step, spec, device: torch.device, result):  # noqa: ANN001 - the peers' shared tail
    """Times `step` over the spec's batches; a CUDA OOM becomes the row's status instead of a crash."""
    try:
        step_time, losses = time_steps(step, make_batches(spec), spec.warmup, _sync(device))
    except torch.OutOfMemoryError:
        result.status = "out of GPU memory"
        result.gpu_peak = torch.cuda.max_memory_allocated(device)
        return result
    if device.type == "cuda":
        result.gpu_peak = torch.cuda.max_memory_allocated(device)
    return result.finish(spec, step_time, losses)


def _init_single_rank() -> None:
    """Env vars for a one-rank process group (what torchrun would set)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port, so peers run one after another never collide
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


# ---- the peers ----

def run_megatrain(spec: BenchSpec) -> PeerResult:
    import ray

    import megatrain
    from pipelines.cluster import local_ray_environment

    # Our own small local Ray (Engine joins it): its object store carries only the token batches.
    local_ray_environment()
    ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=spec.object_store_mb * 2**20,
             include_dashboard=False, configure_logging=False)
    engine = None
    try:
        t0 = time.perf_counter()
        engine = megatrain.Engine(spec.model, lr=spec.lr, max_grad_norm=spec.max_grad_norm or None,
                                  optimizer_workers=spec.optimizer_workers, precision=spec.precision,
                                  device="auto", seed=spec.seed, batch_size=spec.batch // spec.executors,
                                  seq_len=spec.seq, grads=spec.grads, compile=spec.compile,
                                  tile_tokens=spec.tile_tokens, checkpoint_budget_gib=spec.checkpoint_budget_gib,
                                  executors=spec.executors)
        gpu_name = _executor_cuda(engine, reset=True)  # also zeroes the executor's peak-memory counter
        result = PeerResult("megatrain", device=engine.device + (f" ({gpu_name})" if gpu_name else ""),
                            setup_s=time.perf_counter() - t0, grads=getattr(engine, "grads", None))
        # the engine's config holds what its memory plan resolved "auto" to
        budget = engine.engine_config.checkpoint_budget_gib
        result.tile_tokens = engine.engine_config.tile_tokens
        result.checkpoint_budget = None if budget is None else round(budget * 2**30)
        # Batches go to the object store up front, as the data-loader actor would have them ready.
        refs = [ray.put({"input_ids": b.numpy()}) for b in make_batches(spec)]
        stats: list[dict[str, Any]] = []

        def step(ref: Any) -> float:
            out = engine.step_batch(ref)
            stats.append(out.stats or {})
            return out.loss

        losses = [step(ref) for ref in refs[: spec.warmup]]
        engine.wait_for_updates()  # start the clock with no update in flight ...
        t0 = time.perf_counter()
        losses += [step(ref) for ref in refs[spec.warmup:]]
        engine.wait_for_updates()  # ... and stop it with the last update in the arena
        step_time = (time.perf_counter() - t0) / max(1, spec.steps)
        result.gpu_peak = _executor_cuda(engine, reset=False)
        result.host_checkpoints = _host_checkpoints(engine)
        result.stats = mean_stats(stats[spec.warmup:])
        return result.finish(spec, step_time, losses)
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()


def _executor_call(engine: Any, probe: Callable[..., Any], *args: Any) -> Any:
    """probe(actor, *args) run in the executor actor (Ray's __ray_call__); None where that fails. The probes
    are defined inside the functions below so that Ray pickles them by value: the actor need not import
    benchmarks/."""
    import ray

    try:
        return ray.get(engine.executor.__ray_call__.remote(probe, *args))
    except Exception as e:  # e.g. a Ray without __ray_call__: no number rather than a lost row
        print(f"could not probe the executor: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _executor_cuda(engine: Any, reset: bool) -> Any:
    """Resets the executor's CUDA peak-memory counter and returns the GPU's name, or returns its
    torch.cuda.max_memory_allocated(); None on the CPU path."""
    def probe(actor: Any, reset: bool) -> Any:
        import torch

        device = actor.executor.device
        if device.type != "cuda":
            return None
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
            return torch.cuda.get_device_name(device)
        return torch.cuda.max_memory_allocated(device)

    return _executor_call(engine, probe, reset)


def _host_checkpoints(engine: Any) -> int | None:
    """Bytes of the host buffers the executor's activation checkpoints offloaded layer inputs to (kept from step to
    step): what the memory plan's host_checkpoints predicts."""
    def probe(actor: Any) -> int:
        return actor.executor.activation_checkpoints.host_bytes

    return _executor_call(engine, probe)


def mean_stats(stats: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean of every numeric StepStats field over the timed steps."""
    stats = [s for s in stats if s]
    if not stats:
        return None
    keys = [k for k, v in stats[0].items() if isinstance(v, (int, float)) and k not in ("step", "start")]
    return {k: sum(float(s[k]) for s in stats) / len(stats) for k in keys}


def run_resident(spec: BenchSpec) -> PeerResult:
    from megatrain.engine.torch_settings import set_matmul_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        set_matmul_precision(spec.precision)  # the same TF32 switches megatrain's executor sets
    else:
        torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    try:
        with torch.device(device):  # initialise the weights where they will live
            model = build_hf_model(spec.config)
    except torch.OutOfMemoryError:
        return PeerResult("resident", status="out of GPU memory", device=_device_name(device),
                          gpu_peak=torch.cuda.max_memory_allocated(device))
    enable_checkpointing(model)
    optimizer = torch.optim.AdamW(param_groups(model), lr=spec.lr, betas=BETAS, eps=EPS, fused=True)
    return _train_hf("resident", spec, model, optimizer, device, time.perf_counter() - t0)


def run_fsdp2(spec: BenchSpec) -> PeerResult:
    if not torch.cuda.is_available():
        return PeerResult("fsdp2", status="needs CUDA")
    return _train_fsdp2(spec, torch.device("cuda", 0))


def _train_fsdp2(spec: BenchSpec, device: torch.device) -> PeerResult:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from megatrain.engine.torch_settings import set_matmul_precision

    _init_single_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_matmul_precision(spec.precision)
    # gloo for the CPU-side collectives of clip_grad_norm_ over offloaded gradients (as torchtitan does)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    try:
        torch.set_num_threads(os.cpu_count() or 1)  # the optimizer step runs on the CPU
        t0 = time.perf_counter()
        mesh = init_device_mesh(device.type, (1,))
        # Built on the CPU: fully_shard moves each module's parameters to the GPU to shard them and, with
        # the offload policy, keeps the shard in pinned host memory, so the whole model is never on the GPU.
        model = build_hf_model(spec.config)
        enable_checkpointing(model)
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for layer in model.model.layers:  # one all-gather (H2D copy) per decoder layer
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        # The parameters are CPU DTensors: fused AdamW runs on the CPU, like megatrain's optimizer.
        optimizer = torch.optim.AdamW(param_groups(model), lr=spec.lr, betas=BETAS, eps=EPS, fused=True)
        return _train_hf("fsdp2", spec, model, optimizer, device, time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()


def deepspeed_config(spec: BenchSpec) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer states offloaded to pinned CPU memory; DeepSpeedCPUAdam."""
    return {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(spec.max_grad_norm or 0.0),
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        # bf16: DeepSpeed's own mixed precision (bf16 compute weights, fp32 masters in the CPU optimizer)
        "bf16": {"enabled": spec.precision == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(spec: BenchSpec) -> PeerResult:
    if not torch.cuda.is_available():
        return PeerResult("deepspeed", status="needs CUDA")
    try:
        import deepspeed
    except Exception as e:  # ImportError, or DeepSpeed's own checks failing at import
        return PeerResult("deepspeed", status=f"not importable: {type(e).__name__}: {e}"[:200])
    return _train_deepspeed(spec, deepspeed, torch.device("cuda", 0))


def _train_deepspeed(spec: BenchSpec, deepspeed: Any, device: torch.device) -> PeerResult:
    from megatrain.engine.torch_settings import set_matmul_precision

    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_matmul_precision(spec.precision)
    _init_single_rank()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = deepspeed_config(spec)
    t0 = time.perf_counter()
    # zero.Init partitions (and here offloads) each module's parameters as it is constructed, the way
    # DeepSpeed builds models too large for one device.
    build = hf_model_factory(spec.config)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build()
    # Reentrant checkpointing: the combination HF Trainer has long run with ZeRO-3 (its recompute goes
    # through the module hooks that fetch the partitioned parameters again).
    enable_checkpointing(model, use_reentrant=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    result = PeerResult("deepspeed", device=_device_name(device), setup_s=time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device, non_blocking=True)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clipping (gradient_clipping) and the CPU Adam update
        return loss.detach()

    return _timed_torch_run(step, spec, device, result)
