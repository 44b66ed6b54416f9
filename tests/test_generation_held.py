"""Generation keeping weights on the device for the call (megatrain/engine/generation.py: HeldUnits, residency.py:
held_for_generation) and over several executors: under simulated asynchronous streams with a budget that holds some
units and not all, beyond the run's resident ones, greedy tokens are transformers' generate and the held units are
never streamed (their weights copied in once); an untied embedding is left streaming (its rows alone cross), a tied
one is held as the head's matrix; the memory goes back after the call. Sampling draws each prompt from a generator
seeded by its index among the call's prompts, so a prompt's tokens do not depend on its batch; an Engine with two
CPU executors splits the prompts between them and gives one executor's tokens, greedy and sampled."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, build_hf_model, saved_hf_model
from post_helpers import PROMPTS, hf_greedy

import megatrain
from megatrain.engine.executor import Executor
from megatrain.engine.generation import Generator, Sampling
from megatrain.memory.residency import held_for_generation
from megatrain.store import ParameterStore
from pipelines.generate import split_rows

NEW = 8


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-tied"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, torch.nn.Module, Path, ParameterStore]]:
    hf, directory = saved_hf_model(FAMILIES[request.param](), tmp_path_factory, request.param)
    store = ParameterStore(directory, check_memory=False)
    yield request.param, hf, directory, store
    store.close()


def executor(store: ParameterStore, resident: int) -> Executor:
    ex = Executor(store.config, store.layout, store.arena.params, store.arena.grads, "cpu-async:4", "fp32",
                  resident_units=resident)
    if resident:
        ex.resident.load(store.arena.tensors, 0)
    return ex


def test_held_units_are_chosen_in_forward_order_within_the_budget() -> None:
    numels = [100, 40, 40, 40, 100]  # embedding, 3 layers, head
    assert held_for_generation(numels, 0, 4 * 90, 4, skip=(0,)) == [1, 2]
    assert held_for_generation(numels, 2, 4 * 300, 4, skip=(0,)) == [2, 3, 4]
    assert held_for_generation(numels, 0, 2 * 320, 2) == [0, 1, 2, 3, 4] and held_for_generation(numels, 0, 0, 4) == []


@pytest.mark.parametrize("resident", [0, 1])
def test_greedy_tokens_with_some_units_held_are_transformers(model, resident: int) -> None:
    name, hf, _, store = model
    layout, tied = store.layout, name == "qwen2-tied"
    first = max(resident, 0 if tied else 1)  # an untied embedding streams its rows
    budget = 4 * (layout.units[first].numel + layout.units[first + 1].numel)  # two units, not all
    ex = executor(store, resident)
    fetched: Counter[int] = Counter()  # the units the weight slots bring in (a layer's buffer, the head whole)
    fetch, take_whole = ex.slots.fetch, ex.slots.take_whole
    ex.slots.fetch = lambda unit, keep: (fetched.update([unit.index]), fetch(unit, keep))  # type: ignore[method-assign]
    ex.slots.take_whole = lambda unit: (fetched.update([unit.index]), take_whole(unit))[1]  # type: ignore[method-assign]
    try:
        generator = Generator(ex, budget=budget)
        out = generator.generate(PROMPTS, Sampling(max_new_tokens=NEW))
    finally:
        ex.close()
    assert out.token_ids == hf_greedy(hf, PROMPTS, NEW)
    assert out.held_units == [first, first + 1] and out.held_bytes == budget
    assert not fetched.keys() & set(out.held_units)  # never streamed
    assert fetched[layout.head.index] == NEW  # the head streams for every token
    assert generator.held is None  # released after the call


def test_every_unit_held_and_none(model) -> None:
    _, hf, _, store = model
    for budget in (0, 2**30):
        ex = executor(store, 0)
        try:
            out = Generator(ex, budget=budget).generate(PROMPTS, Sampling(max_new_tokens=NEW))
        finally:
            ex.close()
        assert out.token_ids == hf_greedy(hf, PROMPTS, NEW)
        assert len(out.held_units) == (0 if budget == 0 else len(store.layout.units) - (model[0] != "qwen2-tied"))


def test_a_prompts_sampled_tokens_do_not_depend_on_its_batch(model) -> None:
    _, _, _, store = model
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=7)
    ex = executor(store, 0)
    try:
        together = Generator(ex).generate(PROMPTS, sampling).token_ids
        alone = [Generator(ex).generate([p], sampling, first_row=r).token_ids[0] for r, p in enumerate(PROMPTS)]
        other_seed = Generator(ex).generate(PROMPTS, Sampling(NEW, 1.0, 0.9, seed=8)).token_ids
    finally:
        ex.close()
    assert together == alone and together != other_seed


def test_prompts_split_among_executors() -> None:
    assert split_rows(5, 2) == [(0, 2), (2, 5)] and split_rows(1, 2) == [(0, 1)] and split_rows(4, 1) == [(0, 4)]


def test_two_executors_generate_one_executors_tokens(ray_session: None, tmp_path: Path) -> None:
    hf = build_hf_model(FAMILIES["llama-gqa"]())
    hf.save_pretrained(tmp_path)
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=3)
    store = ParameterStore(tmp_path, check_memory=False)
    try:
        ex = executor(store, 0)
        want = Generator(ex).generate(PROMPTS, sampling).token_ids
        ex.close()
    finally:
        store.close()
    with megatrain.Engine(tmp_path, device="cpu", precision="fp32", executors=2, optimizer_workers=1, batch_size=2,
                          seq_len=16, metrics=False) as engine:
        assert len(engine.executors) == 2
        greedy = engine.generate(PROMPTS, NEW, eos_token_ids=[]).token_ids
        sampled = engine.generate(PROMPTS, NEW, temperature=1.0, top_p=0.9, seed=3, eos_token_ids=[])
    assert greedy == hf_greedy(hf, PROMPTS, NEW) and sampled.token_ids == want
    assert len(sampled.held_units) == 2  # both executors generated
