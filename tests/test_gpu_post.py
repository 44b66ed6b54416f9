"""Post-training's GPU checks (benchmarks/gpu_session.sh generate runs them with `-m gpu`): GRPO's KL reference
streamed from its arena segment through CUDA copies (with resident units, strict fp32 and bf16) is the initial
model's bit for bit; generation on CUDA keeps the units that fit the GPU there for the call (here all but an untied
embedding) and gives transformers' greedy tokens, as with every unit streamed. Not collected without `-m gpu`; they
fail loudly on a machine without CUDA rather than skipping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, build_hf_model
from post_helpers import PROMPTS, hf_greedy

from megatrain.engine.executor import Executor
from megatrain.engine.generation import Generator, Sampling
from megatrain.engine.reference import initial_weights
from megatrain.engine.torch_settings import set_matmul_precision
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.memory.post_plan import REFERENCE_SEGMENT, reference_dtype
from megatrain.store import ParameterStore

pytestmark = pytest.mark.gpu


@pytest.fixture()
def model_dir(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA GPU"
    set_matmul_precision("fp32")
    hf = build_hf_model(FAMILIES["llama-gqa"]())
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reference_on_cuda_is_the_initial_model(model_dir, precision: str) -> None:
    _, directory = model_dir
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 24), generator=gen)
    store = ParameterStore(directory, reference=reference_dtype(precision), bf16_copy=precision == "bf16",
                           check_memory=False)
    try:
        ex = Executor(store.config, store.layout, store.arena.params, store.arena.grads, "cuda", precision,
                      bf16_copy=store.arena.tensors.get(BF16_COPY_SEGMENT), resident_units=2,
                      reference=store.arena.tensors[REFERENCE_SEGMENT])
        ex.resident.load(store.arena.tensors, 0)
        initial = ex.logprobs(ids)[0]
        store.arena.params.add_(0.05 * torch.randn(store.arena.params.shape, generator=gen))
        if BF16_COPY_SEGMENT in store.arena.tensors:
            store.arena.tensors[BF16_COPY_SEGMENT].copy_(store.arena.params)
        ex.resident.load(store.arena.tensors, 1)
        assert not torch.equal(ex.logprobs(ids)[0], initial)
        with initial_weights(ex):
            assert torch.equal(ex.logprobs(ids)[0], initial)
        ex.close()
    finally:
        store.close()


def test_generation_on_cuda_holds_what_fits_and_is_transformers(model_dir) -> None:
    hf, directory = model_dir
    store = ParameterStore(directory, check_memory=False)
    try:
        ex = Executor(store.config, store.layout, store.arena.params, store.arena.grads, "cuda", "fp32")
        held = Generator(ex).generate(PROMPTS, Sampling(max_new_tokens=8))
        streamed = Generator(ex).generate(PROMPTS, Sampling(max_new_tokens=8), hold=False)
        ex.close()
    finally:
        store.close()
    assert held.held_units == list(range(1, len(store.layout.units))) and streamed.held_units == []
    assert held.token_ids == streamed.token_ids == hf_greedy(hf, PROMPTS, 8)
