"""LoRA over sequence tiles (tile_tokens), without Ray: the native families' tiled backward told which weights train
(the adapters) and how to bind them (with_adapters, inside each tile's recompute). On a tiny Llama (every projection
adapted), Qwen2 (biases, rsLoRA) and Gemma 2 (soft-capping, the MLP half tiled) with tiles small enough for three or
more per sequence: the loss and every adapter gradient match PEFT + transformers (fp32, 1e-5 relative) and the
untiled LoRA path (fp32 rounding apart); packed documents through the executor itself; no base gradient computed or
allocated; the memory plan tiles a LoRA run at long sequence where untiled does not fit; what stays refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import REL_TOL, assert_one_sentence, error, rel_err
from lora_helpers import (
    GENERIC,
    assert_matches_peft,
    lora_executor,
    megatrain_run,
    peft_loss_and_grads,
    run_executor,
    setup,
    tokens,
    unit_weights,
)
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain.config import ConfigError, EngineConfig, ModelConfig
from megatrain.lora import LoraArchitecture, LoraConfig
from megatrain.memory.plan import plan_run
from pipelines.lora import lora_settings

TILE = 10  # tokens.py's batch is 2 x 12: sequence tiles of 5, 5 and 2 positions, MLP tiles of 10, 10 and 4 tokens
GiB = 2**30


@pytest.mark.parametrize("case", ["llama-all-linear", "gemma2-softcap"])
def test_tiled_lora_matches_peft_and_the_untiled_path(case: str) -> None:
    hf, layout, adapters = setup(case)
    ids, labels = tokens()
    loss, grads, _ = megatrain_run(hf, layout, adapters, ids, labels, tile_tokens=TILE)
    assert set(grads) == set(adapters.tensors)
    assert_matches_peft(loss, grads, *peft_loss_and_grads(hf, adapters, ids, labels))
    whole_loss, whole, _ = megatrain_run(hf, layout, adapters, ids, labels)
    assert rel_err(loss, whole_loss) <= 1e-6
    assert max(rel_err(grads[n], g) for n, g in whole.items()) <= REL_TOL  # summed over tiles in another order


@pytest.mark.parametrize("device", ["cpu", "cpu-async:1"])
def test_packed_documents_over_tiles_through_the_executor(tmp_path: Path, device: str) -> None:
    """The executor's own schedule (the family's layers tiled, then wrapped with adapters) on packed rows, also under
    the simulated asynchronous streams."""
    hf, _, adapters = setup("qwen2-biases-rslora")
    ids, labels = tokens()
    position_ids = torch.cat([torch.arange(n) for n in (5, 7, 12)]).view(2, 12)  # two documents, then one
    with lora_executor(hf, adapters, tmp_path, device, tile_tokens=TILE) as (store, executor):
        loss, grads = run_executor(executor, store, ids, labels, position_ids=position_ids)
    assert_matches_peft(loss, grads, *peft_loss_and_grads(hf, adapters, ids, labels, position_ids))


class Outputs(TorchDispatchMode):
    """The shapes of every tensor an aten op makes anew (views and aliases left out): what a backward computes or
    allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(r.alias_info is None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("case", ["llama-all-linear", "gemma2-softcap"])
def test_the_base_gets_no_gradient(case: str) -> None:
    """The tiled backward makes no tensor of a base matrix's shape (no gradient, no fp32 sum of one: the batch's
    tiles are shaped otherwise), where a full fine-tune's makes them all; the base tensors get no .grad."""
    hf, layout, adapters = setup(case)
    config = layout.config
    family = config.family.architecture(config)
    arch = LoraArchitecture(family, adapters.lora)
    arch.tile(TILE)
    base = {n: t.detach().clone().requires_grad_(True) for n, t in hf.state_dict().items()}
    w = {**unit_weights(layout.layers[0], base), **adapters.layer(0)}
    x = torch.randn(2, 12, config.hidden_size, generator=torch.Generator().manual_seed(3))
    args = arch.batch(2, 12, x.device, x.dtype).layer_args(0)
    matrices = {tuple(t.shape) for n, t in w.items() if t.dim() == 2 and ".lora_" not in n}
    with Outputs() as lora:
        _, grads = arch.layer(0).backward(x, w, torch.randn_like(x), *args)
    assert set(grads) == set(adapters.layer(0))
    assert not matrices & lora.shapes and all(t.grad is None for t in base.values())
    with Outputs() as full:  # the probe sees them where they are made
        family.layer(0).backward(x, {n: t for n, t in w.items() if ".lora_" not in n}, torch.randn_like(x), *args[:-1])
    assert matrices <= full.shapes


def test_a_lora_plan_tiles_long_sequences() -> None:
    """Qwen2.5-32B's shape at 64k tokens on an 80 GB GPU: tiled, it fits; untiled, it does not. With dropout, auto
    stays untiled and asked-for tiles are refused."""
    lora = LoraConfig.parse("r=16,alpha=32,targets=q_proj,v_proj")
    gpu = dict(on_gpu=True, gpu_free=79 * GiB, host_free=125 * GiB, resident="auto", find_longest=False)
    config = ModelConfig.from_name("32b")
    plan = plan_run(config, 1, 65536, lora=lora, **gpu)
    assert plan.tile_tokens is not None and plan.gpu_problem() is None and plan.host_problem() is None
    assert plan_run(config, 1, 65536, lora=lora, tile_tokens=None, **gpu).gpu_problem() is not None
    assert "tiles" in plan.report() and "fits: yes" in plan.report()
    dropout = replace(lora, dropout=0.05)
    assert plan_run(config, 1, 65536, lora=dropout, **gpu).tile_tokens is None
    assert_one_sentence(error(plan_run, config, 1, 65536, lora=dropout, tile_tokens=4096, **gpu))


def test_what_stays_refused() -> None:
    """Dropout over tiles (before any actor starts, and in the layer), kept activations, and tiles on the generic path
    (transformers' layers run whole): one sentence each; tiles without dropout are a LoRA run's as a full one's."""
    config = ModelConfig.from_name("tiny")
    lora = "r=4,alpha=8,targets=q_proj,v_proj"
    assert lora_settings(lora, None, config, EngineConfig(tile_tokens=512)) is not None
    for settings, engine in ((f"{lora},dropout=0.1", EngineConfig(tile_tokens=512)),
                             (lora, EngineConfig(keep_activations=2))):
        assert_one_sentence(error(lora_settings, settings, None, config, engine))
    hf, layout, adapters = setup("llama-all-linear")
    arch = LoraArchitecture(layout.config.family.architecture(layout.config), replace(adapters.lora, dropout=0.1))
    arch.arch.tile(TILE)  # tiled underneath, as the executor tiles the family's layers before adding adapters
    w = {**unit_weights(layout.layers[0], hf.state_dict()), **adapters.layer(0)}
    x = torch.zeros(2, 12, layout.config.hidden_size)
    with pytest.raises(ConfigError, match="dropout"), torch.no_grad():
        arch.layer(0)(x, w, *arch.batch(2, 12, x.device, x.dtype).layer_args(0))
    make_generic, generic_lora = GENERIC["phi3-fused"]
    generic = ModelConfig.from_hf(make_generic().to_dict())
    assert_one_sentence(error(plan_run, generic, 1, 64, lora=LoraConfig.parse(generic_lora), tile_tokens=16))
