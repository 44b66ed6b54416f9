"""Several executors on one host, data parallel over a step's rows (gloo on the CPU path).

Two executors train 3 steps to the parameters one executor reaches on the same rows, both within fp32 rounding
of transformers + AdamW's fp64 run, clipping on and off, also with micro-batches; killing one executor in the
middle of a step recovers bit-identically; a batch that does not split among them, and a placement of gradients
that cannot be summed into slices, are one sentence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import OPTIM, assert_same_model, hf_reference, max_rel, rows, train_with_faults

import megatrain
from megatrain.config import ConfigError, EngineConfig


def train(directory: Path, batches: list, executors: int, micro_batches: int, max_grad_norm: float | None
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    with megatrain.Engine(directory, optimizer_workers=1, precision="fp32", device="cpu", max_grad_norm=max_grad_norm,
                          batch_size=8 // (executors * micro_batches), seq_len=24, executors=executors,
                          micro_batches=micro_batches, **OPTIM) as engine:
        assert len(engine.executors) == executors and (executors == 1 or engine.grads == "arena")
        if executors > 1:  # a batch that does not split is one sentence, and the run goes on as if it never came
            with pytest.raises(megatrain.MegatrainError,
                               match=f"does not split among {executors} executors x {micro_batches} micro-batches"):
                engine.step(batches[0][0][:3], batches[0][1][:3])
        losses = [engine.step(ids, labels) for ids, labels in batches]
        return losses, engine.parameters()


# CI: two executors with micro-batches against fp64; clipped, and against one executor, slow (CI clips over two
# executors' ranks in test_nodes and test_speculative_update)
@pytest.mark.parametrize(("micro_batches", "max_grad_norm"), [pytest.param(1, 1.0, marks=pytest.mark.slow), (2, None)],
                         ids=["clipped", "unclipped-2-micro-batches-each"])
def test_two_executors_train_as_one(ray_session: None, micro_llama: tuple[torch.nn.Module, Path],
                                    micro_batches: int, max_grad_norm: float | None) -> None:
    _, directory = micro_llama
    batches = [rows(seed) for seed in (1, 2, 3)]
    runs = {"two executors": train(directory, batches, 2, micro_batches, max_grad_norm)}
    if max_grad_norm:  # one executor on the same rows, once (other tests hold it to transformers too)
        runs["one executor"] = train(directory, batches, 1, 1, max_grad_norm)
        assert runs["two executors"][0] == pytest.approx(runs["one executor"][0], rel=1e-6)
    exact_losses, exact = hf_reference(directory, batches, max_grad_norm, OPTIM, torch.float64)
    _, hf_params = hf_reference(directory, batches, max_grad_norm, OPTIM)
    assert runs["two executors"][0] == pytest.approx(exact_losses, rel=1e-5)
    theirs = max_rel(hf_params, exact)
    for name, (_, params) in runs.items():
        ours = max_rel(params, exact)
        too_far = {n: (e, theirs[n]) for n, e in ours.items() if e > max(1e-5, 2 * theirs[n])}
        assert not too_far, f"{name}: (megatrain, transformers fp32) relative errors against fp64: {too_far}"


@pytest.mark.slow  # CI: test_nodes kills one of two executors (ranks of one process group, on two nodes)
def test_killed_executor_of_two_recovers_exactly(ray_session: None, fault_batches, tmp_path: Path
                                                 ) -> None:
    """The first of two executors SIGKILLed at a random moment of step 4 of 6 (after a checkpoint): both are replaced
    (their process group died with it) and the run ends bit-identical to an uninterrupted one with two."""
    kills = {4}
    options = dict(executors=2, kill_steps=kills, checkpoint_after=2)
    losses0, params0, _, _ = train_with_faults(fault_batches[:6], tmp_path / "a", **options)
    losses, params, restarts, segments = train_with_faults(fault_batches[:6], tmp_path / "b", victim="executor",
                                                           seed=5, **options)
    assert restarts >= len(kills)
    assert losses == losses0
    assert_same_model(params, params0)
    assert not any(p.exists() for p in segments)


def test_bad_settings_are_one_sentence(micro_llama: tuple[torch.nn.Module, Path]) -> None:
    """Refused before anything starts (a batch that does not split among the executors: in train() above)."""
    _, directory = micro_llama
    with pytest.raises(ConfigError, match="executors must be 'auto' or a positive integer"):
        EngineConfig(executors=0)
    with pytest.raises(ConfigError, match="grads must be 'arena'"):
        megatrain.Engine(directory, device="cpu", executors=2, grads="device", batch_size=4, seq_len=24)
