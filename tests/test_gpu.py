"""GPU checks, run on the GPU machine with `python -m pytest tests/test_gpu.py -m gpu -q -s`
(benchmarks/gpu_session.sh tests).

Not collected without `-m gpu` (pyproject's addopts deselect them); they fail loudly if asked for on a
machine without CUDA rather than skipping.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from helpers import VOCAB, batch, build_hf_model, hf_loss_and_grads
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Qwen2Config, Qwen2ForCausalLM

import megatrain
from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.engine.torch_settings import set_matmul_precision
from megatrain.memory.arena import Arena
from megatrain.memory.plan import CUDA_CONTEXT, plan_run
from megatrain.model.layout import ModelLayout
from megatrain.perf.calibrate import (
    CACHE_ENV,
    Calibration,
    LayerTiming,
    device_name,
    layer_key,
    time_compiled,
    time_layers,
)
from megatrain.perf.compile_choice import compile_choice
from megatrain.store import ParameterStore, init_weights

pytestmark = pytest.mark.gpu

MiB = 2**20


@pytest.fixture(autouse=True)
def strict_fp32() -> Iterator[None]:
    """Strict fp32 matmuls in this process (the parity tests' 1e-5 needs them), and afterwards the setting as
    it was: the setting is global to the process, and a tf32 or bf16 executor built here changes it too
    (Executor calls set_matmul_precision), so without the restore it would leak into whatever runs next."""
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    before = torch.get_float32_matmul_precision()
    set_matmul_precision("fp32")
    yield
    torch.set_float32_matmul_precision(before)


def perturb_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Fills every norm weight with U(0.5, 1.5) and every bias with N(0, 0.1^2), from a generator of its own.

    HF initialises RMSNorm weights to 1 and q/k/v biases to 0, so a template that ignored them, or read another
    layer's, would still match HF exactly; these values make each of them count. A 1-D parameter that is
    neither is refused, so that a new family's parameter is not silently left at its init value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, the final norm
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif p.dim() == 1:
                raise AssertionError(f"{name}: a 1-D parameter that is neither a norm weight nor a bias")


def hf_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    # 6 layers: more than the host gradient ring's slots, so grads = "device" and "stream" reuse slots
    llama = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=2)
    qwen = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    models = {"llama-gqa": LlamaForCausalLM(llama), "qwen2-tied": Qwen2ForCausalLM(qwen)}
    for seed, model in enumerate(models.values()):
        perturb_norms_and_biases(model, seed)
    return models


def parity_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [2, 128] and labels with the first 17 positions ignored, as a prompt's would be."""
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :17] = -100
    return ids, labels


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-tied"])
def test_cuda_parity_with_transformers_strict_fp32(tmp_path: Path, name: str) -> None:
    hf = hf_models()[name]
    hf.save_pretrained(tmp_path)
    ids, labels = parity_batch()
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, labels)  # on the CPU: the reference of the CUDA paths
    hf_loss = hf_loss.item()
    with megatrain.from_pretrained(tmp_path, device="cuda", precision="fp32") as m:
        loss, grads = m.loss_and_grads(ids, labels)
        assert abs(loss.item() - hf_loss) <= 1e-5 * abs(hf_loss), (loss.item(), hf_loss)
        for pname, g in hf_grads.items():
            rel = ((grads[pname] - g).abs().max() / g.abs().max()).item()
            assert rel <= 1e-5, f"{pname}: {rel:.2e}"


# Errors against HF's fp32 allowed per precision: (loss, gradient), each relative, the gradient's per tensor as
# ||g - g_fp32|| / ||g_fp32||. From the unit roundoff of what is rounded, times what the backward amplifies:
# tf32 rounds matmul inputs to 11 significant bits (u = 2^-11 = 4.9e-4); bf16 also stores activations and
# weights in 8 (u = 2^-8 = 3.9e-3). The q/k projections' gradients come through the softmax's backward,
# P * (dP - rowsum(P * dP)), a difference of nearly equal terms while attention is near uniform (as at init),
# which amplifies the rounding several-fold. Measured on the CPU on these models, with this batch and two
# others (tf32 emulated by rounding the inputs of every matmul and of attention to 11 bits; bf16 by the CPU's
# bf16 path, eager and compiled): gradients up to 1.6e-3 (tf32) and 2.3e-2 (bf16), worst in q_proj/k_proj and
# their biases; losses within 5e-6 and 5e-5 (at init the logits are small, so the loss is mostly ln(vocab) and
# barely moves: the gradients are the real check). The bounds leave 6x (tf32) and 3.4x (bf16) for what the
# GPU's kernels round differently (cuBLAS split-K, attention kernels' own roundings of the probabilities), and
# stay well below what a real mistake gives (a norm weight or bias read from the wrong place, a kv head mapped
# to the wrong query heads): gradients off by tens of percent.
PRECISION_TOLERANCE = {"tf32": (1e-4, 1e-2), "bf16": (1e-3, 8e-2)}


@pytest.mark.parametrize(("name", "precision", "compile"), [
    ("llama-gqa", "tf32", False), ("llama-gqa", "bf16", False), ("llama-gqa", "bf16", True),
    ("qwen2-tied", "tf32", False), ("qwen2-tied", "bf16", False)])
def test_fast_precisions_match_fp32(tmp_path: Path, name: str, precision: str, compile: bool) -> None:
    """tf32, bf16 and the compiled bf16 template against HF's fp32 loss and gradients, on the two GQA models
    (8 query heads on 2 kv heads; 8 on 4 with q/k/v biases and tied embeddings). In bf16, GQA attention goes to
    SDPA with enable_gqa (no expanded k/v): the eager runs exclude SDPA's math kernel, so they fail rather than
    fall back to the [batch, heads, seq, seq] scores that ops.causal_attention exists to avoid. The compiled
    run (only the llama model: each compile takes tens of seconds) is left to inductor's own choice."""
    hf = hf_models()[name]
    hf.save_pretrained(tmp_path)
    ids, labels = parity_batch()
    # the reference first: this process's CPU matmuls follow the global precision the executor below changes
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, labels)  # on the CPU: the reference of the CUDA paths
    hf_loss = hf_loss.item()
    with megatrain.from_pretrained(tmp_path, device="cuda", precision=precision) as m:
        if compile:
            m.executor.close()
            m.executor = Executor(m.config, m.layout, m.store.arena.params, m.store.arena.grads, device="cuda",
                                  precision=precision, compile=True)
            loss, grads = m.loss_and_grads(ids, labels)
        else:
            fused_only = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
            with sdpa_kernel(fused_only):
                loss, grads = m.loss_and_grads(ids, labels)
        assert torch.get_float32_matmul_precision() == "high"  # the run really was tf32 / bf16's fp32 parts
        loss_tol, grad_tol = PRECISION_TOLERANCE[precision]
        loss_err = abs(loss.item() - hf_loss) / abs(hf_loss)
        errors = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in hf_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    print(f"\n{name} {precision}{' compiled' if compile else ''} vs fp32: loss {loss_err:.1e}, "
          f"gradients up to {errors[worst]:.1e} ({worst})")
    assert loss_err <= loss_tol, f"loss {loss.item()} vs fp32 {hf_loss}: {loss_err:.2e}"
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= grad_tol}
    assert not bad, f"gradients off by more than {grad_tol:g}: {bad}"


def test_registered_arena_h2d_bandwidth() -> None:
    arena = Arena.create(256 * 2**20)  # 1 GiB of fp32 per segment
    try:
        assert arena.register_cuda(("params",)), "cudaHostRegister of the arena failed"
        dst = torch.empty(arena.params.numel(), device="cuda")
        for _ in range(3):
            dst.copy_(arena.params, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(arena.params, non_blocking=True)
        torch.cuda.synchronize()
        gbps = 10 * arena.params.numel() * 4 / (time.perf_counter() - t0) / 1e9
        print(f"\nH2D from the registered arena: {gbps:.1f} GB/s")  # reported, never asserted (rule 5)
    finally:
        arena.destroy()


def test_the_optimizer_pool_timed_beside_pcie_copies() -> None:
    """Calibration's optimizer timing on a GPU machine: the pool's processes alone, beside the real copy path (H2D and
    D2H on two streams, page-locked buffers) and its rollback, and the resident units' fused AdamW on the GPU. Rates
    printed, never asserted fast (megatrain/perf/optimizer_timing.py)."""
    import os

    from megatrain.perf.calibrate import config_for_params
    from megatrain.perf.optimizer_timing import time_optimizer

    fields = time_optimizer("cuda", config_for_params(5e7), os.cpu_count() or 1, "bf16", max_workers=4)
    for name in ("adamw_gparams", "adamw_beside_copies_gparams", "rollback_gparams"):
        assert set(fields[name]) == {"1", "2", "3", "4"} and all(r > 0 for r in fields[name].values()), fields
    assert fields["copies_kind"] == "PCIe H2D + D2H" and fields["copies_gbps"] > 1
    assert fields["device_adamw_gparams"] > 1
    print(f"\npool alone {fields['adamw_gparams']}, beside {fields['copies_gbps']:.0f} GB/s of copies "
          f"{fields['adamw_beside_copies_gparams']}, rollback {fields['rollback_gparams']} G params/s; "
          f"the GPU's AdamW {fields['device_adamw_gparams']:.0f} G params/s")


def test_the_resident_units_update_is_queued_without_waiting_for_the_gpu() -> None:
    """The resident units' update (ResidentUnits.update, the executor's update_resident between steps) only queues
    kernels: no call in it waits for the device, so the executor takes the next step's host work while the GPU
    updates (a step count made by torch.tensor(value, device="cuda") waited for the stream before each unit's
    update: the H200's 7B at K=1 spent the update's ~53 ms outside the executor's step). Its result is the CPU's."""
    from megatrain.config import OptimConfig
    from megatrain.engine.resident import ResidentUnits

    config = ModelConfig.from_name("tiny")
    layout = ModelLayout.build(config)
    units = {d: ResidentUnits(layout, len(layout.units), torch.device(d), torch.bfloat16) for d in ("cpu", "cuda")}
    gen = torch.Generator().manual_seed(0)
    start = {name: torch.randn(layout.numel, generator=gen) for name in ("params", "grads")}
    optim = OptimConfig(lr=1e-2)
    for resident in units.values():
        for name, value in start.items():
            resident.tensors[name].copy_(value)
        resident.update(0, 1.0, optim)  # the first builds the pass's pieces (allocations, not timed here)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        units["cuda"].update(1, 0.5, optim)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    units["cpu"].update(1, 0.5, optim)
    for name in ("params", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(units["cuda"].tensors[name].cpu(), units["cpu"].tensors[name], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize(("grads", "max_grad_norm", "resident"),
                         [("arena", 1.0, "none"), ("device", 1.0, "none"), ("stream", None, "none"),
                          ("arena", None, "none"), ("arena", 1.0, 3), ("device", None, "auto")],
                         ids=["arena-clipped", "device-clipped", "stream-unclipped", "arena-unclipped",
                              "3-resident-arena-clipped", "auto-resident-device-unclipped"])
def test_engine_cpu_and_gpu_agree(ray_session, tmp_path: Path, grads: str, max_grad_norm: float | None,
                                  resident: int | str) -> None:
    """The CUDA stream path (three streams, two weight buffers, gradients out through the sender thread or
    held on the GPU and sent by the grads_out concurrency group) against the CPU path, 3 AdamW steps. With
    clipping off each layer is handed to the optimizer workers as soon as its gradients land, during the
    backward: with grads = "stream" through the ring of host slots, which the 6 layers outnumber, so the
    executor must wait for a slot's update to finish before refilling it.

    Adam's eps is 1e-5 here, not 1e-8: its update lr * g / (|g| + eps) turns a gradient difference d at an
    element with |g| below eps into an update difference of up to lr * d / eps. cuBLAS and the CPU's BLAS sum
    in different orders (differences ~1e-9), so with eps 1e-8 near-zero gradients alone could move weights
    by a tenth of lr apart, which says nothing about the pipeline; at 1e-5 the update stays linear there.

    `resident`: "none" streams every unit; 3 keeps the embedding and layers 0-1 on the GPU, updated there by the
    fused AdamW's CUDA kernel, and "auto" as many as the plan finds room for (all of this small model)."""
    hf_models()["llama-gqa"].save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 128), generator=gen) for _ in range(3)]
    results = {}
    for device in ("cpu", "cuda"):
        with megatrain.Engine(tmp_path, device=device, precision="fp32", optimizer_workers=2, lr=1e-3, eps=1e-5,
                              max_grad_norm=max_grad_norm, warmup_steps=1, total_steps=3, compile="off",
                              grads="arena" if device == "cpu" else grads,
                              resident="none" if device == "cpu" else resident) as engine:
            assert engine.grads == ("arena" if device == "cpu" else grads)
            losses = [engine.step(b) for b in batches]
            results[device] = (losses, engine.parameters())
    (cpu_losses, cpu_params), (gpu_losses, gpu_params) = results["cpu"], results["cuda"]
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, value in cpu_params.items():
        rel = ((gpu_params[name] - value).abs().max() / value.abs().max()).item()
        assert rel <= 1e-4, f"{name}: {rel:.2e}"


def test_resident_weights_cast_at_each_use_train_as_a_kept_copy(ray_session, tmp_path: Path) -> None:
    """bf16 on CUDA, the embedding and layers 0-1 resident: their bf16 weights for compute a copy kept on the GPU or
    cast from the fp32 weights into the weight buffers at each use (on the compute stream, after the device's update):
    the same weights either way (round to nearest even), so the same training, up to the GPU's own run-to-run
    differences; and the plan says which ran."""
    hf_models()["llama-gqa"].save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 128), generator=gen) for _ in range(3)]
    results = {}
    for weights in ("copy", "cast"):
        with megatrain.Engine(tmp_path, device="cuda", precision="bf16", optimizer_workers=2, lr=1e-3, eps=1e-5,
                              warmup_steps=1, total_steps=3, compile="off", resident=3,
                              resident_weights=weights) as engine:
            assert engine.plan.resident_weights == weights and engine.plan.resident_units == 3
            results[weights] = ([engine.step(b) for b in batches], engine.parameters())
    (copy_losses, copy_params), (cast_losses, cast_params) = results["copy"], results["cast"]
    assert cast_losses == pytest.approx(copy_losses, rel=1e-5)
    for name, value in copy_params.items():
        rel = ((cast_params[name] - value).abs().max() / value.abs().max()).item()
        assert rel <= 1e-5, f"{name}: {rel:.2e}"


def executor_gpu_memory(engine: megatrain.Engine) -> tuple[int, int]:
    """(max_memory_allocated, max_memory_reserved) of the executor actor's process, where the Engine's GPU
    work runs: read there through Ray's __ray_call__, which calls a function with the actor instance (as
    benchmarks/peers.py reads it). Defined inside so that Ray pickles it by value: the actor's process cannot
    import this test module."""
    def peaks(actor: Any) -> tuple[int, int]:
        import torch

        device = actor.executor.device
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)

    return ray.get(engine.executor.__ray_call__.remote(peaks))


# What max_memory_allocated counts that the plan does not itemise. cuBLAS's workspaces: PyTorch takes them from
# the caching allocator, one per (cuBLAS handle, stream), 32 MiB each on Hopper; handles are per thread, and
# the layers' matmuls run on two threads (the actor's for the forward, autograd's device thread for the
# backward), each with a cuBLAS and possibly a cuBLASLt workspace: up to 4 x 32 MiB. Then small tensors (rope
# tables, token ids and targets, per-unit norms) and the allocator's rounding of every block to 512 bytes:
# 64 MiB covers them many times over.
UNPLANNED_GPU_BYTES = 4 * 32 * MiB + 64 * MiB
PLAN_SLACK = 0.10  # the plan is an estimate: 10%, the bar benchmarks/throughput.py flags plan vs measured at


@pytest.mark.parametrize("grads", ["stream", "arena"])
def test_engine_gpu_peak_memory_within_plan(ray_session, grads: str) -> None:
    """The executor's peak GPU memory over two clipping-off steps against `megatrain plan`'s GPU total for the
    same model, batch, sequence, gradient placement and precision.

    The plan's total includes CUDA_CONTEXT, the memory of the process's CUDA context, which lives outside the
    caching allocator and which max_memory_allocated does not count: it comes off before comparing. The plan
    adds up each phase's largest tensors (weights, gradient buffers, checkpoints plus one layer's working set,
    one loss chunk) though not all are alive at once, so it should sit above the measured peak. The checks:
    the plan never falls short of the peak by more than PLAN_SLACK + UNPLANNED_GPU_BYTES (a run it admits must
    fit), and it is not so far above it that it would refuse runs that fit (at most 2.5x the peak). The
    tensors alive at once in this step, traced on the CPU (peak in a layer's recompute), plus the GPU-only
    weight buffers and head copy, come to 0.58 of the plan; 0.6-0.7 with cuBLAS's workspaces. 125m with a 32k
    vocabulary, 4 x 1024 tokens, 1024-token loss chunks (the head in four chunks): a plan of over a GiB,
    beside which the unplanned allowance is small."""
    batch, seq, chunk = 4, 1024, 1024
    gen = torch.Generator().manual_seed(0)
    with megatrain.Engine("125m", device="cuda", precision="tf32", optimizer_workers=2, lr=1e-4,
                          max_grad_norm=None, grads=grads, batch_size=batch, seq_len=seq,
                          loss_chunk_tokens=chunk, resident="none", compile="off") as engine:  # streamed, eager
        assert engine.grads == grads
        losses = [engine.step(torch.randint(0, engine.config.vocab_size, (batch, seq), generator=gen))
                  for _ in range(2)]
        allocated, reserved = executor_gpu_memory(engine)
        # the plan the Engine made for itself (Engine._plan), for the resolved placement
        plan = plan_run(engine.config, batch, seq, grads=grads, clipping=False, name=engine.model_name,
                        precision="tf32", optimizer_workers=2, on_gpu=True, loss_chunk_tokens=chunk)
    planned = plan.gpu_total - int(CUDA_CONTEXT)
    print(f"\n125m {batch}x{seq} grads={grads}: plan {planned / MiB:.0f} MiB of tensors "
          f"(+{CUDA_CONTEXT / MiB:.0f} context), measured max allocated {allocated / MiB:.0f} MiB "
          f"({allocated / planned:.2f} of the plan), max reserved {reserved / MiB:.0f} MiB; losses {losses}")
    assert plan.grads == grads
    assert all(math.isfinite(loss) for loss in losses), losses  # else the backward was skipped: no real peak
    assert allocated <= planned * (1 + PLAN_SLACK) + UNPLANNED_GPU_BYTES, (
        f"the executor peaked at {allocated / MiB:.0f} MiB, more than the plan's {planned / MiB:.0f} MiB allows")
    assert allocated >= planned / 2.5, (
        f"the plan ({planned / MiB:.0f} MiB) is more than 2.5x the measured peak ({allocated / MiB:.0f} MiB)")


def test_lora_engine_cpu_and_gpu_agree_within_the_plan(ray_session, tmp_path: Path) -> None:
    """LoRA (issue #27) on the CUDA path: the bf16 base streamed through the weight buffers and cast on the GPU, the
    adapters resident there with their Adam state (resident auto) and updated by the fused AdamW's CUDA kernel,
    against the CPU path (adapters in the arena, the pool's AdamW), 3 steps; the executor's peak GPU memory within
    the LoRA plan's total (the allowances of test_engine_gpu_peak_memory_within_plan). eps 1e-5 as in
    test_engine_cpu_and_gpu_agree."""
    hf_models()["llama-gqa"].save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (2, 128), generator=gen) for _ in range(3)]
    results, peak, plan = {}, 0, None
    for device in ("cpu", "cuda"):
        with megatrain.Engine(tmp_path, device=device, precision="fp32", optimizer_workers=2, lr=1e-3, eps=1e-5,
                              max_grad_norm=1.0, warmup_steps=1, total_steps=3, compile="off", batch_size=2,
                              seq_len=128, lora="r=8,alpha=16,targets=all-linear") as engine:
            assert engine.engine_config.resident == (0 if device == "cpu" else 6 + 2)  # every unit's adapters
            losses = [engine.step(b) for b in batches]
            results[device] = (losses, engine.parameters())
            if device == "cuda":
                peak = executor_gpu_memory(engine)[0]
                plan = plan_run(engine.config, 2, 128, clipping=True, precision="fp32", on_gpu=True,
                                lora=engine.engine_config.lora, resident="none")
    (cpu_losses, cpu_params), (gpu_losses, gpu_params) = results["cpu"], results["cuda"]
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, value in cpu_params.items():
        rel = ((gpu_params[name] - value).abs().max() / value.abs().max()).item()
        assert rel <= 1e-4, f"{name}: {rel:.2e}"
    planned = plan.gpu_total - int(CUDA_CONTEXT) + 16 * sum(plan.adapter_numels)  # + the resident adapters
    print(f"\nLoRA llama-gqa 2x128: plan {planned / MiB:.0f} MiB, measured max allocated {peak / MiB:.0f} MiB")
    assert peak <= planned * (1 + PLAN_SLACK) + UNPLANNED_GPU_BYTES


@pytest.mark.parametrize(("precision", "compile"), [("tf32", False), ("bf16", False), ("bf16", True)])
def test_fast_precisions_train(ray_session, precision: str, compile: bool) -> None:
    """bf16 loads the optimizer's bf16 copy of the weights; compile runs the layers through torch.compile."""
    gen = torch.Generator().manual_seed(0)
    with megatrain.Engine("125m", device="cuda", precision=precision, optimizer_workers=4, lr=1e-3,
                          warmup_steps=2, compile=compile) as engine:
        batch = torch.randint(0, 32000, (4, 512), generator=gen)
        losses = [engine.step(batch) for _ in range(8)]  # the same batch: the loss must fall
    assert losses[-1] < losses[0] - 0.5, losses


# ---- long context (issue #16) ----

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_long_sequence_tiled_and_offloaded_matches_cpu(tmp_path: Path, precision: str) -> None:
    """32k tokens of a small model, MLP tiles of 4096 and every checkpoint in host memory, on the GPU against the
    same on the CPU: the fused attention kernels only (the math kernel would need 16 GiB of scores per head), the
    store's D2H/H2D copies on their streams, and peak GPU memory far below one [seq, seq] score matrix."""
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 32768), generator=torch.Generator().manual_seed(0))
    with megatrain.from_pretrained(tmp_path, device="cpu", tile_tokens=4096) as cpu:
        cpu_loss, cpu_grads = cpu.loss_and_grads(ids)
        cpu_grads = {n: g.clone() for n, g in cpu_grads.items()}
    torch.cuda.reset_peak_memory_stats()
    with megatrain.from_pretrained(tmp_path, device="cuda", precision=precision, tile_tokens=4096,
                                   checkpoint_budget=0) as gpu:
        loss, grads = gpu.loss_and_grads(ids)
        assert gpu.executor.activation_checkpoints.offloaded == 4
        tol = 1e-3 if precision == "fp32" else 3e-2  # tf32-free strict fp32 is not set here: kernels differ
        assert abs(loss.item() - cpu_loss.item()) <= tol * abs(cpu_loss.item())
        for n, g in cpu_grads.items():
            assert (grads[n] - g).norm() <= 10 * tol * g.norm(), n
    assert torch.cuda.max_memory_allocated() < 4 * 2**30  # one fp32 score matrix alone would be 4 GiB per head


@pytest.mark.parametrize("schedule", ["layer-major", "per-micro-batch"])
def test_cuda_micro_batches_match_transformers_strict_fp32(tmp_path: Path, schedule: str) -> None:
    """The parity batch's 2 rows as 2 micro-batches on the GPU's three streams: transformers' loss and gradients on
    the whole batch, as on the CPU (tests/test_micro_batches.py)."""
    hf = hf_models()["llama-gqa"]
    hf.save_pretrained(tmp_path)
    ids, labels = parity_batch()
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, labels)  # on the CPU: the reference of the CUDA paths
    hf_loss = hf_loss.item()
    with megatrain.from_pretrained(tmp_path, device="cuda", precision="fp32") as m:
        loss, grads = m.loss_and_grads(ids, labels, micro_batches=2, schedule=schedule)
        assert abs(loss.item() - hf_loss) <= 1e-5 * abs(hf_loss), (loss.item(), hf_loss)
        for pname, g in hf_grads.items():
            rel = ((grads[pname] - g).abs().max() / g.abs().max()).item()
            assert rel <= 1e-5, f"{pname}: {rel:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per executor: this machine has one")
def test_two_gpu_executors_match_one(ray_session, tmp_path: Path) -> None:
    """NCCL between two executor actors (each unit's gradient reduce-scattered, each GPU's slice copied into the
    arena), 3 steps against one executor on the same rows, strict fp32 (the CPU path's gloo twin is
    tests/test_data_parallel.py). Only a machine with two GPUs runs it; the lent ones have one."""
    hf_models()["llama-gqa"].save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (4, 128), generator=gen) for _ in range(3)]
    results = {}
    for executors in (1, 2):
        with megatrain.Engine(tmp_path, device="cuda", precision="fp32", optimizer_workers=2, lr=1e-3, eps=1e-5,
                              executors=executors, batch_size=4 // executors, seq_len=128, compile="off") as engine:
            assert len(engine.executors) == executors
            results[executors] = ([engine.step(b) for b in batches], engine.parameters())
    assert results[2][0] == pytest.approx(results[1][0], rel=1e-5)
    for name, value in results[1][1].items():
        rel = ((results[2][1][name] - value).abs().max() / value.abs().max()).item()
        assert rel <= 1e-4, f"{name}: {rel:.2e}"


def test_compile_auto_follows_this_gpus_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile = auto on this GPU (the Engine's default): the calibration's eager and compiled timings of the model's
    layer (time_layers, time_compiled: inductor) decide it, compiled where faster and eager where slower (the
    timing doctored), and where no timing was recorded it compiles and says so."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "calibration.json"))
    config, batch, seq = ModelConfig.from_name("125m"), 2, 1024
    layer_s, rest_s = time_layers(config, batch, seq, "cuda", "tf32")
    timing = time_compiled(config, batch, seq, "cuda", "tf32", LayerTiming(layer_s, rest_s))
    assert timing is not None, "compiling the 125m layer took longer than the calibration's budget"
    print(f"\n125m tf32 {batch}x{seq}: a layer {1e3 * timing.compiled_layer_s:.2f} ms compiled, "
          f"{1e3 * timing.eager_layer_s:.2f} ms eager; the rest {1e3 * timing.compiled_rest_s:.2f} vs "
          f"{1e3 * timing.eager_rest_s:.2f} ms; {timing.compile_s:.0f} s compiling")
    gpu, key = device_name("cuda"), layer_key(config, batch, seq, "tf32")
    cal = Calibration(device=gpu, host="here", created=0.0, cores=1, compute_threads=1, h2d_gbps=None, d2h_gbps=None,
                      memcpy_gbps=1.0, compiled={key: timing})
    cal.save()
    measured = compile_choice("auto", "cuda", config, "tf32")
    assert measured.on is (timing.compiled_layer_s < timing.eager_layer_s), measured.why
    assert f"from the calibration of {gpu}" in measured.why, measured.why
    cal.compiled[key] = dataclasses.replace(timing, compiled_layer_s=2 * timing.eager_layer_s)
    cal.save()
    assert not compile_choice("auto", "cuda", config, "tf32").on
    cal.compiled.clear()
    cal.save()
    unmeasured = compile_choice("auto", "cuda", config, "tf32")
    assert unmeasured.on and f"no calibration of {gpu}" in unmeasured.why, unmeasured.why
    assert not compile_choice("auto", "cpu", config, "tf32").on


@pytest.mark.parametrize("tile_tokens", [None, 256], ids=["whole", "tiled"])
def test_compiled_layers_tiles_and_head_match_eager(monkeypatch: pytest.MonkeyPatch, tile_tokens: int | None) -> None:
    """Inductor on this GPU, strict fp32: a 2-layer GQA model over packed documents, its layers compiled whole or
    (tiled) their tiles, and the head, against the eager executor: the loss and every gradient to fp32 rounding; a
    second packing runs the graphs the first compiled (the documents' boundaries are a tensor, on the host, handed to
    the packed-attention op)."""
    counter = CompileCounterWithBackend("inductor")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counter))
    config = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=688)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=3)
    eager_grads, compiled_grads = torch.zeros(layout.numel), torch.zeros(layout.numel)
    eager = Executor(config, layout, params, eager_grads, "cuda", "fp32", loss_chunk_tokens=512,
                     tile_tokens=tile_tokens)
    compiled = Executor(config, layout, params, compiled_grads, "cuda", "fp32", loss_chunk_tokens=512,
                        compile=True, tile_tokens=tile_tokens)
    gen = torch.Generator().manual_seed(0)
    frames = []
    for cuts in ([(0, 300)], [(0, 100), (1, 700), (1, 900)]):
        positions = torch.arange(1024).repeat(2, 1)
        for row, token in cuts:
            positions[row, token:] = torch.arange(1024 - token)
        ids = torch.randint(0, 512, (2, 1024), generator=gen)
        want, got = eager.run(ids, position_ids=positions), compiled.run(ids, position_ids=positions)
        frames.append(counter.frame_count)
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (got.loss, want.loss)
        errors = {}
        for unit in layout.units:
            for name, g in unit.bind(unit.range_of(compiled_grads)).items():
                ref = unit.bind(unit.range_of(eager_grads))[name]
                errors[f"{unit.kind} {unit.layer or ''} {name}"] = ((g - ref).norm() / ref.norm()).item()
        worst = max(errors, key=errors.__getitem__)
        print(f"\ncompiled {'tiled' if tile_tokens else 'whole'} vs eager: loss {abs(got.loss - want.loss):.1e}, "
              f"gradients up to {errors[worst]:.1e} ({worst})")
        assert errors[worst] <= 1e-5, errors
    assert frames[0] > 0 and frames[1] == frames[0], frames
    compiled.close()
    eager.close()


def small_llama(num_layers: int) -> tuple[ModelConfig, ModelLayout, torch.Tensor]:
    """A Llama of hidden 256 (4 heads, 2 kv heads), its layout and weights (seed 3), for the executor on CUDA."""
    config = ModelConfig(vocab_size=512, hidden_size=256, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                         intermediate_size=688)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=3)
    return config, layout, params


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_activations_on_cuda_match_the_recompute_and_the_planned_bytes(precision: str) -> None:
    """Every layer kept against none on this GPU (its SDPA kernels: memory-efficient in fp32, flash with grouped
    queries in bf16): the loss and gradients to rounding (the backward kernels may add in another order), and a
    layer's kept graph holds the bytes the memory plan's formula says (megatrain/memory/kept_activations.py)."""
    from megatrain.engine.kept_activations import KeptActivations
    from megatrain.memory.kept_activations import saved_bytes_per_token

    config, layout, params = small_llama(num_layers=3)
    ids = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(0))
    runs = {}
    for kept in (0, 3):
        grads = torch.zeros(layout.numel)
        executor = Executor(config, layout, params, grads, "cuda", precision, kept_layers=kept)
        runs[kept] = executor.run(ids, micro_batches=2).loss, grads
        executor.close()
    (loss, grads), (want_loss, want_grads) = runs[3], runs[0]
    tolerance = 1e-5 if precision == "fp32" else 1e-2
    assert abs(loss - want_loss) <= tolerance * abs(want_loss), (loss, want_loss)
    assert ((grads - want_grads).norm() / want_grads.norm()).item() <= tolerance
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    unit, arch = layout.layers[0], config.family.architecture(config)
    kept_graphs = KeptActivations()
    kept_graphs.forward(0, arch.layer(0), torch.randn(2, 512, 256, device="cuda", dtype=dtype),
                        unit.bind(unit.range_of(params).to("cuda", dtype)),
                        arch.batch(2, 512, torch.device("cuda"), dtype).layer_args(0))
    planned = 2 * 512 * saved_bytes_per_token(config, precision, 512)
    print(f"\nkept graph of one layer, {precision}: {kept_graphs.saved_bytes} B, planned {planned} B")
    assert planned <= kept_graphs.saved_bytes <= planned * 1.05  # the kernels' padding (a log-sum-exp rounded up)


@pytest.mark.parametrize(("precision", "compile"), [("fp32", False), ("bf16", False), ("bf16", True)])
def test_micro_batches_fold_weight_gradients_into_one_gemm(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                           compile: bool) -> None:
    """A later micro-batch's linear weight gradient goes into the fp32 buffer in one GEMM (megatrain/engine/
    grad_fold.py): bf16 inputs within fp32 rounding of the exact sum (torch.addmm out_dtype=float32, out=buffer: no
    bf16 product in between, which would be ~1e-3 off), fp32 by addmm_; the executor folds every later micro-batch of
    every layer, compiled (inductor) too, and four micro-batches give one batch's loss and gradients."""
    from megatrain.engine import grad_fold

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad, x = (torch.randn(2048, n, device="cuda", generator=gen).to(dtype) for n in (384, 256))
    buffer = torch.randn(384, 256, device="cuda", generator=gen)
    exact = buffer.double() + grad.double().t() @ x.double()
    grad_fold.accumulate_weight_grad(buffer, grad, x)
    assert buffer.dtype == torch.float32
    assert ((buffer - exact).abs().max() / exact.abs().max()).item() <= 1e-5

    folds: list[int] = []  # one entry per GEMM into a buffer
    monkeypatch.setattr(grad_fold, "accumulate_weight_grad",
                        lambda *args, accumulate=grad_fold.accumulate_weight_grad: folds.append(1) or accumulate(*args))
    config, layout, params = small_llama(num_layers=2)
    ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(0))

    def run(micro_batches: int) -> tuple[float, torch.Tensor]:
        grads = torch.zeros(layout.numel)
        executor = Executor(config, layout, params, grads, "cuda", precision, compile=compile)
        try:
            return executor.run(ids, micro_batches=micro_batches).loss, grads
        finally:
            executor.close()

    (want_loss, want_grads), (loss, grads) = run(1), run(4)
    assert len(folds) == config.num_layers * 7 * 3  # q, k, v, o, gate, up, down; 3 of the 4 micro-batches
    tolerance = 1e-5 if precision == "fp32" else 1e-2
    assert abs(loss - want_loss) <= tolerance * abs(want_loss), (loss, want_loss)
    assert ((grads - want_grads).norm() / want_grads.norm()).item() <= tolerance


@pytest.mark.gpu
def test_the_generic_paths_layers_compile_on_cuda(tmp_path: Path) -> None:
    """The generic path on this GPU: compile = auto runs transformers' own layers eager (the Engine's default), and
    compile = on (inductor, strict fp32) runs each layer's module compiled with the RNG's replay eager around it:
    Phi-3 with dropout, two micro-batches (the later one's gradients folded into the GEMMs), the eager executor's
    loss and every gradient to fp32 rounding."""
    hf = Phi3Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                    intermediate_size=96, resid_pdrop=0.2, attention_dropout=0.3, pad_token_id=0, bos_token_id=0,
                    eos_token_id=1)
    build_hf_model(hf).save_pretrained(tmp_path)
    store = ParameterStore(tmp_path, on_gpu=True)
    try:
        config, layout = store.config, store.layout
        assert not compile_choice("auto", "cuda", config, "fp32").on
        ids = batch(seed=2)[:2]
        results = []
        for compile in (False, True):
            grads = torch.zeros(layout.numel)
            executor = Executor(config, layout, store.arena.params, grads, "cuda", compile=compile)
            torch.manual_seed(7)
            torch.cuda.manual_seed(7)
            results.append((executor.run(ids, micro_batches=2).loss, grads))
            executor.close()
        (want, want_grads), (got, got_grads) = results
        assert abs(got - want) <= 1e-5 * abs(want)
        assert ((got_grads - want_grads).abs().max() / want_grads.abs().max()).item() <= 1e-5
    finally:
        store.close()


@pytest.mark.parametrize("name", ["bf16 no copy, device", "per-micro-batch, 3 passes",
                                  "2 resident units, tied, padding", "resident embedding, per-micro-batch, padding"])
def test_the_buffers_tables_cases_on_cuda_match_the_cpu_within_the_plan(name: str) -> None:
    """tests/test_buffers.py's crossing cases (copies traced under cpu-async equal the plan's rows) on this GPU: the
    same weights and batch give the CPU's loss and gradients (held on the device, several passes, resident units and
    a resident embedding, whose rows' gradient the executor reads on the device), and the peak stays within the
    plan's device rows as test_engine_gpu_peak_memory_within_plan allows."""
    from test_buffers import CROSSING, crossing_case

    runs = {}
    for device in ("cpu", "cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        plan, executor, _, k, ids, grads = crossing_case(CROSSING[name], device)
        try:
            out = executor.run(ids, micro_batches=k, schedule=plan.schedule, hold_grads=plan.grads == "device",
                               loss_ready=lambda loss: True)
            executor.send_held(out.held)
            executor.streams.synchronize()
            runs[device] = out.loss, torch.cat([grads, executor.resident.tensors["grads"].cpu()])  # resident: there
        finally:
            executor.close()
        peak = torch.cuda.max_memory_allocated() - before
    planned = plan.gpu_total - int(CUDA_CONTEXT)
    print(f"\n{name}: peak {peak / MiB:.1f} MiB, plan {planned / MiB:.1f} MiB")
    assert peak <= planned * (1 + PLAN_SLACK) + UNPLANNED_GPU_BYTES
    (want_loss, want_grads), (loss, got) = runs["cpu"], runs["cuda"]
    tolerance = 1e-5 if CROSSING[name]["precision"] == "fp32" else 1e-2
    assert abs(loss - want_loss) <= tolerance * abs(want_loss), (loss, want_loss)
    assert ((got - want_grads).norm() / want_grads.norm()).item() <= tolerance
