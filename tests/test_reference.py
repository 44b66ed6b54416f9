"""GRPO's KL reference without swapping checkpoints (megatrain/engine/reference.py): the initial weights in an arena
segment of their own, streamed by the same executor for its log-probs (within initial_weights(executor);
Engine.logprobs(reference=True)). After the weights moved (as training moves them), the reference's log-probs are the
initial model's bit for bit: fp32 (and within 1e-5 of transformers' log-softmax of the initial model), through
simulated asynchronous streams with resident units (whose device weights are the current ones), in bf16 (the segment
in bf16, the bf16 copy's rounding); a LoRA run's is its base with the adapters off (PEFT's disable_adapter()).
Through an Engine (the arena's segment made by its store, the executor actor streaming it): test_grpo.py's three
steps.
A run without the segment refuses in one sentence; the plan counts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, rel_err, saved_hf_model
from lora_helpers import lora_executor, setup, tokens
from post_helpers import hf_logprobs

from megatrain import MegatrainError
from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.engine.reference import initial_weights
from megatrain.memory.arena import BF16_COPY_SEGMENT
from megatrain.memory.plan import plan_run
from megatrain.memory.post_plan import REFERENCE_SEGMENT, post_plan, reference_problem, with_reference
from megatrain.store import ParameterStore

TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf, directory = saved_hf_model(FAMILIES["llama-gqa"](), tmp_path_factory, "llama")
    return hf, directory


def moved(store: ParameterStore, executor: Executor) -> None:
    """The weights as a few steps would leave them: the arena's (and its bf16 copy, the resident units' copies)."""
    gen = torch.Generator().manual_seed(5)
    params = store.arena.params
    params.add_(0.05 * torch.randn(params.shape, generator=gen))
    if BF16_COPY_SEGMENT in store.arena.tensors:
        store.arena.tensors[BF16_COPY_SEGMENT].copy_(params)
    if len(executor.resident):
        executor.resident.load(store.arena.tensors, 1)


@pytest.mark.parametrize("device,precision,resident", [("cpu", "fp32", 0), ("cpu-async:3", "fp32", 2),
                                                       ("cpu", "bf16", 0)])
def test_reference_logprobs_are_the_initial_models(model_dir, device: str, precision: str, resident: int) -> None:
    hf, directory = model_dir
    ids, labels = tokens()
    bf16 = precision == "bf16"
    store = ParameterStore(directory, reference="bfloat16" if bf16 else "float32", bf16_copy=bf16, check_memory=False)
    try:
        assert store.arena.tensors[REFERENCE_SEGMENT].dtype == (torch.bfloat16 if bf16 else torch.float32)
        executor = Executor(store.config, store.layout, store.arena.params, store.arena.grads, device, precision,
                            loss_chunk_tokens=7, bf16_copy=store.arena.tensors.get(BF16_COPY_SEGMENT),
                            resident_units=resident, reference=store.arena.tensors[REFERENCE_SEGMENT])
        if resident:
            executor.resident.load(store.arena.tensors, 0)
        initial, initial_entropy = executor.logprobs(ids, labels, temperature=TEMPERATURE, entropy=True)
        moved(store, executor)
        now = executor.logprobs(ids, labels, temperature=TEMPERATURE)[0]
        assert rel_err(now, initial) > 1e-3  # the weights did move
        with initial_weights(executor):
            ref, ref_entropy = executor.logprobs(ids, labels, temperature=TEMPERATURE, entropy=True)
        assert torch.equal(ref, initial) and torch.equal(ref_entropy, initial_entropy)
        assert torch.equal(executor.logprobs(ids, labels, temperature=TEMPERATURE)[0], now)  # and back
        if not bf16:
            with torch.no_grad():
                assert rel_err(ref, hf_logprobs(hf, ids, labels, TEMPERATURE)[0]) <= 1e-5
        executor.close()
    finally:
        store.close()


def test_a_lora_runs_reference_is_its_base_with_the_adapters_off(tmp_path: Path) -> None:
    hf, _, adapters = setup("llama-all-linear")  # B random: the adapters change the model
    ids, labels = tokens()
    with lora_executor(hf, adapters, tmp_path) as (store, executor):
        adapted = executor.logprobs(ids, labels, temperature=TEMPERATURE)[0]
        with initial_weights(executor):
            ref = executor.logprobs(ids, labels, temperature=TEMPERATURE)[0]
        with torch.no_grad():
            base = hf_logprobs(hf, ids, labels, TEMPERATURE)[0]
        assert rel_err(ref, base) <= 1e-5 and rel_err(adapted, base) > 1e-3
        assert REFERENCE_SEGMENT not in store.arena.tensors  # nothing more in memory
        assert torch.equal(executor.logprobs(ids, labels, temperature=TEMPERATURE)[0], adapted)


def test_without_the_segment_the_reference_is_refused_in_one_sentence(model_dir) -> None:
    _, directory = model_dir
    ids, labels = tokens()
    store = ParameterStore(directory, check_memory=False)
    try:
        executor = Executor(store.config, store.layout, store.arena.params, store.arena.grads)
        with pytest.raises(MegatrainError, match="keeps no copy of its initial weights; make the Engine with "
                                                 "reference=True"), initial_weights(executor):
            executor.logprobs(ids, labels)
    finally:
        store.close()


def test_the_plan_counts_the_segment_and_says_where_it_does_not_fit() -> None:
    config = ModelConfig.from_name("tiny")
    plan = plan_run(config, 4, 64, precision="bf16", on_gpu=False, host_free=2**40)
    numel = plan.arena_numel
    with_ref = with_reference(plan, config, "bf16")
    assert with_ref.reference_bytes == 2 * numel and with_ref.arena_bytes == plan.arena_bytes + 2 * numel
    assert "initial weights (the KL reference)" in with_ref.report()
    assert post_plan(config, "grpo", 32, 80, "fp32", kl=True, run=plan).reference_bytes == 4 * numel
    # a host that holds the run and not the copy: one sentence, before anything is allocated
    tight = plan_run(config, 4, 64, precision="bf16", on_gpu=False, host_free=plan.host_total + numel)
    assert reference_problem(tight) is None and tight.host_problem() is None
    problem = reference_problem(with_reference(tight, config, "bf16"))
    assert problem is not None and problem.count(". ") == 0 and "KL reference" in problem
    short = post_plan(config, "grpo", 32, 80, "bf16", kl=True, run=tight).report()
    assert "the reference segment does not fit" in short and "KL to the initial policy" in short



def test_the_reference_is_the_initial_weights_with_the_masters_on_nvme(tmp_path: Path) -> None:
    """The segment is filled from the masters where they are: on NVMe, through the tier (not the sparse arena range,
    which holds no data): the same bits as the bf16 copy made from them, and as a store's without the tier."""
    from megatrain.memory.nvme import TierSpec

    spec = TierSpec(str(tmp_path), ("master",), ("params",))
    stores = [ParameterStore(ModelConfig.from_name("tiny"), num_workers=1, bf16_copy=True, reference="bfloat16",
                             verify=False, check_memory=False, **extra) for extra in ({}, {"tier": spec})]
    try:
        host, tiered = (st.arena.tensors[REFERENCE_SEGMENT] for st in stores)
        assert torch.equal(tiered, stores[1].arena.tensors[BF16_COPY_SEGMENT]) and torch.equal(tiered, host)
        assert tiered.abs().sum() > 0
    finally:
        for st in stores:
            st.close()
