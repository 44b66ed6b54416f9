"""Long context on the CPU, exact: a small model at 4096 tokens with 512-token tiles and every layer input kept in
host memory (the checkpoint store's budget 0) against transformers in fp32, with and without packed documents
(per-document position_ids), under simulated asynchronous streams; and the store's own accounting: kept
checkpoints within the budget however many layers, transfers never more than two."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_parity import build_hf_model, rel_err
from transformers import LlamaConfig

import megatrain
from megatrain.engine.checkpoints import CheckpointStore
from megatrain.engine.streams import make_streams

SEQ, TILE = 4096, 512
VOCAB = 128


def config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, Path]]:
    hf = build_hf_model(config())
    directory = tmp_path_factory.mktemp("long")
    hf.save_pretrained(directory)
    yield hf, directory


def packed_positions() -> torch.Tensor:
    """Documents of 1000, 1, 2095 and 1000 tokens in one row, each from position 0."""
    return torch.cat([torch.arange(n) for n in (1000, 1, 2095, 1000)])[None]


def hf_result(hf: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hf.zero_grad(set_to_none=True)
    # use_cache=False: transformers reads packed position_ids as separate documents only without a cache (with
    # one, which its config's use_cache creates even in a plain forward, it restarts the positions but lets every
    # token attend to the whole row before it); training is the former
    loss = hf(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed-documents"])
def test_tiled_and_offloaded_matches_transformers(llama: tuple[torch.nn.Module, Path], packed: bool) -> None:
    hf, directory = llama
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = packed_positions() if packed else None
    hf_loss, hf_grads = hf_result(hf, ids, position_ids)
    with megatrain.from_pretrained(directory, device="cpu-async:3", tile_tokens=TILE, checkpoint_budget=0) as model:
        loss, grads = model.loss_and_grads(ids, position_ids=position_ids) if packed else model.loss_and_grads(ids)
        store = model.executor.checkpoints
        assert store.offloaded == 2 and store.peak_kept_bytes == 0  # every layer input went to the host
        assert rel_err(loss, hf_loss) <= 1e-5, (loss.item(), hf_loss.item())
        errors = {n: rel_err(grads[n], g) for n, g in hf_grads.items()}
        assert max(errors.values()) <= 1e-5, errors


def test_packed_documents_attend_within_themselves(llama: tuple[torch.nn.Module, Path]) -> None:
    """The packed row's loss is not the one-document row's: positions restart and attention stops at each start
    (the check above would pass for a model that ignored position_ids only if transformers did too)."""
    hf, _ = llama
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    assert hf_result(hf, ids, packed_positions())[0] != hf_result(hf, ids, None)[0]


def test_checkpoints_on_the_device_stay_within_the_budget() -> None:
    """The store's accounting as layers are added: kept bytes never above the budget, the top layers kept (the
    first the backward needs), at most two checkpoints crossing at once, and every input returned intact."""
    streams = make_streams("cpu-async:5")
    size = 4 * 64 * 16 * 4  # bytes of one checkpoint: [4, 64, 16] fp32
    try:
        for layers in (1, 4, 16):
            for budget in (0, size, 3 * size + 7, None):
                store = CheckpointStore(streams, budget)
                store.begin(layers)
                inputs = [torch.full((4, 64, 16), float(i)) for i in range(layers)]
                for i, x in enumerate(inputs):
                    streams.compute_uses(x)
                    store.put(i, x)
                    assert budget is None or store.kept_bytes <= budget
                kept = layers if budget is None else min(layers, budget // size)
                assert store.kept_bytes == kept * size and store.offloaded == layers - kept
                for i in reversed(range(layers)):
                    assert torch.equal(store.get(i), inputs[i])
                    assert store.transfer_bytes <= 2 * size
                assert store.peak_transfer_bytes <= 2 * size
                assert budget is None or store.peak_kept_bytes <= budget
                store.end()
    finally:
        streams.close()


def test_negative_budget_is_refused() -> None:
    with pytest.raises(megatrain.MegatrainError, match="non-negative"):
        CheckpointStore(make_streams("cpu"), -1)
