"""Long context on the CPU, exact: a small model at 2048 tokens with 256-token tiles and every layer input kept in
host memory (the activation checkpoints' budget 0) against transformers in fp32, with and without packed documents
(per-document position_ids), under simulated asynchronous streams; three Engine steps so against transformers +
AdamW; the store's own accounting (kept checkpoints within the budget however many layers, transfers never more
than two); packing with per-document positions; and the memory plan at long sequences (7B at 128k and 1B at 512k
fit an 80 GiB GPU with a 125 GiB host, 7B at 512k does not, and the plan says what host would)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import OPTIM, hf_reference, max_rel, rel_err, saved_hf_model
from transformers import LlamaConfig

import megatrain
from megatrain.config import ModelConfig
from megatrain.data.packing import IGNORE, RowPacker, Sample
from megatrain.engine.activation_checkpoints import ActivationCheckpoints
from megatrain.engine.streams import make_streams
from megatrain.memory.plan import plan_run
from pipelines.cli import main

SEQ, TILE = 2048, 256  # 8 tiles a row, as at any length: the tiled path is the same code
VOCAB = 128


def config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, Path]]:
    hf, directory = saved_hf_model(config(), tmp_path_factory, "long")
    yield hf, directory


def packed_positions() -> torch.Tensor:
    """Documents of 500, 1, 1047 and 500 tokens in one row, each from position 0."""
    return torch.cat([torch.arange(n) for n in (500, 1, 1047, 500)])[None]


def hf_result(hf: torch.nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hf.zero_grad(set_to_none=True)
    # use_cache=False: transformers reads packed position_ids as separate documents only without a cache (with
    # one, which its config's use_cache creates even in a plain forward, it restarts the positions but lets every
    # token attend to the whole row before it); training is the former
    loss = hf(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def row() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_results(llama: tuple[torch.nn.Module, Path]) -> Callable[[bool], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """transformers' loss and gradients on row(), packed or one document, each computed once per module (eager
    attention at 2048 tokens is most of a test's time): the tiled runs are held to them, and they to each other."""
    hf, _ = llama
    results: dict[bool, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def result(packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if packed not in results:
            results[packed] = hf_result(hf, row(), packed_positions() if packed else None)
        return results[packed]

    return result


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed-documents"])
def test_tiled_and_offloaded_matches_transformers(llama: tuple[torch.nn.Module, Path], hf_results, packed: bool
                                                  ) -> None:
    _, directory = llama
    ids = row()
    position_ids = packed_positions() if packed else None
    hf_loss, hf_grads = hf_results(packed)
    with megatrain.from_pretrained(directory, device="cpu-async:3", tile_tokens=TILE, checkpoint_budget=0) as model:
        loss, grads = model.loss_and_grads(ids, position_ids=position_ids) if packed else model.loss_and_grads(ids)
        store = model.executor.activation_checkpoints
        assert store.offloaded == 2 and store.peak_device_bytes == 0  # every layer input went to the host
        assert rel_err(loss, hf_loss) <= 1e-5, (loss.item(), hf_loss.item())
        errors = {n: rel_err(grads[n], g) for n, g in hf_grads.items()}
        assert max(errors.values()) <= 1e-5, errors


def test_packed_documents_attend_within_themselves(hf_results) -> None:
    """The packed row's loss is not the one-document row's: positions restart and attention stops at each start
    (the check above would pass for a model that ignored position_ids only if transformers did too)."""
    assert hf_results(True)[0] != hf_results(False)[0]


def test_checkpoints_on_the_device_stay_within_the_budget() -> None:
    """The store's accounting as layers are added: kept bytes never above the budget, the top layers kept (the
    first the backward needs), at most two checkpoints crossing at once, and every input returned intact."""
    streams = make_streams("cpu-async:5")
    size = 4 * 64 * 16 * 4  # bytes of one checkpoint: [4, 64, 16] fp32
    try:
        for layers in (1, 4, 16):
            for budget in (0, size, 3 * size + 7, None):
                store = ActivationCheckpoints(streams, budget)
                store.begin(layers)
                inputs = [torch.full((4, 64, 16), float(i)) for i in range(layers)]
                for i, x in enumerate(inputs):
                    streams.compute_uses(x)
                    store.put(i, x)
                    assert budget is None or store.device_bytes <= budget
                kept = layers if budget is None else min(layers, budget // size)
                assert store.device_bytes == kept * size and store.offloaded == layers - kept
                for i in reversed(range(layers)):
                    assert torch.equal(store.get(i), inputs[i])
                    assert store.transfer_bytes <= 2 * size
                assert store.peak_transfer_bytes <= 2 * size
                assert budget is None or store.peak_device_bytes <= budget
                store.end()
                assert store.host_bytes == (layers - kept) * size  # the page-locked buffers, kept for the next step
                store.begin(1)  # a step of fewer checkpoints keeps no buffers for the others
                assert store.host_bytes <= size
                store.end()
    finally:
        streams.close()


def test_negative_budget_is_refused() -> None:
    with pytest.raises(megatrain.MegatrainError, match="non-negative"):
        ActivationCheckpoints(make_streams("cpu"), -1)


def test_engine_tiled_and_offloaded_matches_transformers_and_adamw(ray_session: None,
                                                                  llama: tuple[torch.nn.Module, Path]) -> None:
    """Three steps at 2048 tokens of packed documents, 256-token tiles, every checkpoint in host memory, simulated
    streams, clipping on: losses and parameters as transformers + torch.optim.AdamW, judged against its fp64 run.
    (One-document rows differ only in the positions, which the loss-and-gradient test above covers.)"""
    _, directory = llama
    gen = torch.Generator().manual_seed(1)
    batches = [(ids, ids.clone(), packed_positions())
               for ids in (torch.randint(0, VOCAB, (1, SEQ), generator=gen) for _ in range(3))]
    with megatrain.Engine(directory, optimizer_workers=1, precision="fp32", device="cpu-async:2", max_grad_norm=1.0,
                          batch_size=1, seq_len=SEQ, tile_tokens=TILE, checkpoint_budget_gib=0, **OPTIM) as engine:
        losses = [engine.step(*batch) for batch in batches]
        params = engine.parameters()
    # SDPA: eager attention's [heads, 2048, 2048] scores in fp64 would take most of this test's time
    exact_losses, exact = hf_reference(directory, batches, 1.0, OPTIM, torch.float64, attention="sdpa")
    hf_losses, hf_params = hf_reference(directory, batches, 1.0, OPTIM, attention="sdpa")
    assert losses == pytest.approx(exact_losses, rel=1e-5)
    assert hf_losses == pytest.approx(exact_losses, rel=1e-5)
    ours, theirs = max_rel(params, exact), max_rel(hf_params, exact)
    too_far = {n: (e, theirs[n]) for n, e in ours.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


def test_packing_restarts_positions_per_document() -> None:
    """Documents of 5, 3 and 6 tokens packed into rows of 4: each document's positions count from 0 and go on into
    the next row where it was cut; the final batch's padding is a run of its own, out of the loss."""
    docs = iter([Sample(np.arange(n) + 10 * n, np.arange(n) + 10 * n, f"doc{n}") for n in (5, 3, 6)])
    packer = RowPacker(batch_size=2, seq_len=4, pad_id=0, pack=True, document_positions=True)
    first = packer.batch(lambda: next(docs))
    second = packer.batch(lambda: next(docs))
    assert first["position_ids"].tolist() == [[0, 1, 2, 3], [4, 0, 1, 2]]
    assert second["position_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 0, 1]]
    assert second["labels"].tolist()[1][2:] == [IGNORE, IGNORE]
    plain = RowPacker(batch_size=2, seq_len=4, pad_id=0, pack=True)
    assert "position_ids" not in plain.batch(lambda: next(iter([Sample(np.arange(8), np.arange(8), "d")])))


GiB = 2**30
H100 = dict(on_gpu=True, gpu_free=80 * GiB, host_free=125 * GiB, precision="bf16")


@pytest.mark.parametrize(("preset", "seq"), [("7b", 128 * 1024), ("1b", 512 * 1024)])
def test_plan_fits_long_sequences_on_an_80_gib_gpu(preset: str, seq: int) -> None:
    plan = plan_run(ModelConfig.from_name(preset), 1, seq, name=preset, **H100)
    assert plan.host_problem() is None and plan.gpu_problem() is None, plan.report()
    assert plan.tile_tokens is not None  # tiled: an untiled layer would not fit beside the checkpoints
    assert plan.gpu_total <= 80 * GiB and plan.host_total <= 125 * GiB


def test_plan_says_7b_at_512k_needs_a_bigger_host() -> None:
    plan = plan_run(ModelConfig.from_name("7b"), 1, 512 * 1024, name="7b", **H100)
    problem = plan.host_problem()
    assert problem is not None and plan.gpu_problem() is None  # the GPU holds it once checkpoints go to the host
    assert plan.host_checkpoints > 100 * GiB
    need = plan.host_total
    assert f"a host with {need / GiB:.0f} GiB available would fit it" in problem
    assert 128 * 1024 < plan.longest_seq < 512 * 1024 and f"{plan.longest_seq} tokens" in problem
    # and the host it names does
    bigger = plan_run(ModelConfig.from_name("7b"), 1, 512 * 1024, name="7b", **{**H100, "host_free": need})
    assert bigger.host_problem() is None and bigger.gpu_problem() is None


def test_plan_command_takes_long_context_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["plan", "--model", "1b", "--batch", "1", "--seq", str(512 * 1024), "--precision", "bf16",
            "--device", "cuda", "--gpu-gib", "80", "--host-gib", "125"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "longest sequence at batch 1 on the GPU and host given:" in out
    assert main([*args, "--checkpoint-budget-gib", "0", "--tile-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "4096-token tiles" in out and "offloaded checkpoints (pinned)" in out
    assert main(["plan", "--model", "7b", "--batch", "1", "--seq", str(512 * 1024), "--precision", "bf16",
                 "--device", "cuda", "--gpu-gib", "80", "--host-gib", "125"]) == 1
    assert "would fit it" in capsys.readouterr().out
    assert main([*args, "--tile-tokens", "-3"]) == 2
    assert "tile_tokens must be" in capsys.readouterr().err
    # none, asked for on the command line or in TOML (which has no null): untiled, every checkpoint on the GPU
    assert main([*args, "--tile-tokens", "none", "--checkpoint-budget-gib", "none"]) == 1  # does not fit so
    out = capsys.readouterr().out
    assert "524288 tokens, untiled" in out and "device checkpoints (all)" in out and "fits: NO" in out
    config = tmp_path / "untiled.toml"
    config.write_text('tile_tokens = "none"\ncheckpoint_budget_gib = "None"\n')
    assert main([*args, "--config", str(config)]) == 1
    assert capsys.readouterr().out == out
