"""Weight gradients summed over micro-batches inside their GEMMs (megatrain/engine/grad_fold.py): a layer's folded
sum is the sum within fp32 rounding (judged against fp64) in fp32 and bf16; a weight's linear uses each fold and its
other uses come back from autograd, so nothing is lost where the fold does not follow; the executor folds every
micro-batch but the first of every layer, recomputed or kept, and the generic path's transformers modules (an MoE's
router folds, its experts' 3-d weights do not) give transformers' gradients; a compiled layer (fullgraph) folds
too."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import SHAPE, build_hf_model, hf_loss_and_grads, rel_err, rows
from transformers import MixtralConfig

import megatrain
from megatrain.config import ModelConfig
from megatrain.engine import grad_fold
from megatrain.engine.compiled import compile_function
from megatrain.engine.executor import Executor
from megatrain.engine.grad_fold import recompute_folded
from megatrain.model.layout import ModelLayout
from megatrain.model.templates import Weights, recompute_grads
from megatrain.store import init_weights

K = 3
LINEARS = 7  # a Llama layer's: q, k, v, o, gate, up, down


@pytest.fixture
def folds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the GEMMs that accumulate into a gradient buffer."""
    count = [0]
    accumulate = grad_fold.accumulate_weight_grad

    def counted(*args: Any) -> None:
        count[0] += 1
        accumulate(*args)

    monkeypatch.setattr(grad_fold, "accumulate_weight_grad", counted)
    return count


def summed(fn: Any, w: Weights, micro: list[tuple[torch.Tensor, torch.Tensor]], args: tuple[Any, ...], fold: bool
           ) -> tuple[Weights, list[set[str]]]:
    """The weight gradients of fn over the micro-batches (x, dL/dy), the last first as the backward runs them, summed
    as LayerPasses sums them (fold: the later ones folded); and the names each later micro-batch returned."""
    buffers: Weights = {}
    returned: list[set[str]] = []
    for x, grad in reversed(micro):
        if buffers and fold:
            _, grads = recompute_folded(fn, x, w, grad, args, buffers)
        else:
            _, grads = recompute_grads(fn, x, w, grad, *args)
        if buffers:
            returned.append(set(grads))
            for name, g in grads.items():
                buffers[name] += g
        else:
            buffers = {name: g.float() for name, g in grads.items()}
    return buffers, returned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_folded_sum_is_the_sum_within_rounding(dtype: torch.dtype, folds: list[int]) -> None:
    config = ModelConfig.from_name("tiny")
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=3)
    unit, arch = layout.layers[0], config.family.architecture(config)
    gen = torch.Generator().manual_seed(0)
    micro = [(torch.randn(2, 16, config.hidden_size, generator=gen), torch.randn(2, 16, config.hidden_size,
                                                                                  generator=gen)) for _ in range(K)]
    w64 = {n: t.double() for n, t in unit.bind(unit.range_of(params)).items()}

    def run(dt: torch.dtype, fold: bool) -> tuple[Weights, list[set[str]]]:
        args = arch.batch(2, 16, torch.device("cpu"), dt).layer_args(0)
        w = {n: t.to(dt) for n, t in w64.items()}
        return summed(arch.layer(0), w, [(x.to(dt), g.to(dt)) for x, g in micro], args, fold)

    exact, _ = run(torch.float64, fold=False)
    unfolded, _ = run(dtype, fold=False)
    folded, returned = run(dtype, fold=True)
    assert folds[0] == LINEARS * (K - 1)
    norms = {n for n in w64 if w64[n].dim() == 1}
    assert returned == [norms] * (K - 1)  # every matrix folded: only the norms' gradients came back
    floor = 1e-7 if dtype == torch.float32 else 1e-3
    for name, want in exact.items():
        assert folded[name].dtype == torch.float32
        assert rel_err(folded[name], want.float()) <= 2 * max(rel_err(unfolded[name], want.float()), floor), name


def test_each_linear_use_folds_and_every_other_use_comes_back_from_autograd(folds: list[int]) -> None:
    """"a": two linear calls and a product; "b": one linear call; "c": an addmm (GPT-2's Conv1D); "d": a linear on a
    slice of it. Only "b" is folded whole; "a"'s product, "c" and "d" come back from autograd and are added."""

    def fn(x: torch.Tensor, w: Weights) -> torch.Tensor:
        h = F.linear(x, w["a"]) + F.linear(torch.tanh(x), w["a"], w["bias"]) + x.sum(-1, keepdim=True) * w["a"][0]
        h = F.linear(torch.relu(h), w["b"])
        h = torch.addmm(h.reshape(-1, 8), torch.sin(h).reshape(-1, 8), w["c"]).view_as(h)
        return F.linear(h, w["d"][:, :8])

    gen = torch.Generator().manual_seed(1)
    shapes = {"a": (8, 8), "bias": (8,), "b": (8, 8), "c": (8, 8), "d": (8, 12)}
    w64 = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    micro = [(torch.randn(3, 5, 8, generator=gen, dtype=torch.float64),
              torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)) for _ in range(K)]
    w32, micro32 = {n: t.float() for n, t in w64.items()}, [(x.float(), g.float()) for x, g in micro]
    exact, _ = summed(fn, w64, micro, (), fold=False)
    unfolded, _ = summed(fn, w32, micro32, (), fold=False)
    folded, returned = summed(fn, w32, micro32, (), fold=True)
    assert folds[0] == 3 * (K - 1)  # a twice, b once, per later micro-batch
    assert returned == [{"a", "bias", "c", "d"}] * (K - 1)
    for name, want in exact.items():
        assert rel_err(folded[name], want.float()) <= 2 * max(rel_err(unfolded[name], want.float()), 1e-7), name


def test_the_executor_folds_every_later_micro_batch_kept_or_recomputed(folds: list[int]) -> None:
    config = dataclasses.replace(ModelConfig.from_name("tiny"), num_layers=3)
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    ids = torch.randint(0, config.vocab_size, (K * 2, 16), generator=torch.Generator().manual_seed(0))
    whole, micro = torch.zeros(layout.numel), torch.zeros(layout.numel)
    Executor(config, layout, params, whole).run(ids)
    assert folds[0] == 0
    Executor(config, layout, params, micro, kept_layers=1).run(ids, micro_batches=K)
    assert folds[0] == config.num_layers * LINEARS * (K - 1)
    assert rel_err(micro, whole) <= 1e-6


def test_the_generic_paths_modules_fold_where_they_call_linear(folds: list[int], tmp_path: Path) -> None:
    """Mixtral on the generic path: attention's projections and the router are nn.Linear modules (folded); the
    experts' 3-d weights are read otherwise (autograd's gradients). Transformers' gradients either way."""
    hf = build_hf_model(MixtralConfig(**SHAPE, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2))
    hf.save_pretrained(tmp_path)
    ids, labels = rows(0)
    ids, labels = ids[:4, :16], labels[:4, :16]
    hf_loss, hf_grads = hf_loss_and_grads(hf, ids, labels)
    with megatrain.from_pretrained(tmp_path) as model:
        loss, grads = model.loss_and_grads(ids, labels, micro_batches=2)
    assert folds[0] == 2 * 5  # per layer: q, k, v, o and the router, for the one later micro-batch
    assert rel_err(loss, hf_loss) <= 1e-5
    for name, want in hf_grads.items():
        assert rel_err(grads[name], want) <= 1e-5, name


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_layer_folds(backend: str, folds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer compiled as the executor compiles it (fullgraph: the mode and the folded linear traced into the
    graph, its backward with it; aot_eager traces as inductor does, inductor's code generation is slow): the folded
    GEMMs run in the compiled layer's backward, and the sum is the eager layer's unfolded one within rounding."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    config = ModelConfig.from_name("tiny")
    layout = ModelLayout.build(config)
    params = torch.zeros(layout.numel)
    init_weights(layout, params, seed=2)
    unit, arch = layout.layers[0], config.family.architecture(config)
    args = arch.batch(2, 16, torch.device("cpu"), torch.float32).layer_args(0)
    gen = torch.Generator().manual_seed(0)
    micro = [(torch.randn(2, 16, config.hidden_size, generator=gen), torch.randn(2, 16, config.hidden_size,
                                                                                  generator=gen)) for _ in range(K)]
    w = unit.bind(unit.range_of(params))
    want, _ = summed(arch.layer(0), w, micro, args, fold=False)
    got, _ = summed(compile_function(arch.layer(0)), w, micro, args, fold=True)
    assert folds[0] == LINEARS * (K - 1)
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-6, name
