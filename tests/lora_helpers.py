"""LoRA's references for the tests of more than one module (test_lora.py, test_lora_tiled.py), so that no test module
imports another: tiny transformers models with adapters (B random), PEFT's loss and adapter gradients on them, the
native layers with adapters run by hand as the executor's schedule runs them, and a LoRA run's executor in this
process on a store's arena."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import torch
import torch.nn.functional as F
from helpers import FAMILIES, REL_TOL, SHAPE, build_hf_model, gemma2_config, micro_llama_config, rel_err
from peft.utils import set_peft_model_state_dict
from transformers import Phi3Config

from megatrain.config import ModelConfig
from megatrain.engine.executor import Executor
from megatrain.lora import Adapters, LoraArchitecture, LoraConfig, save_adapter
from megatrain.model import ops
from megatrain.model.layout import ModelLayout, Unit
from megatrain.model.templates import embed, head_loss_and_grads
from megatrain.store import ParameterStore

CASES = {  # name -> (transformers config, LoRA settings)
    "llama-all-linear": (micro_llama_config, "r=4,alpha=8,targets=all-linear"),
    "qwen2-biases-rslora": (FAMILIES["qwen2-tied"], "r=4,alpha=16,targets=q_proj,v_proj,down_proj,rslora=true"),
    "gemma2-softcap": (gemma2_config, "r=2,alpha=4,targets=o_proj,gate_proj,up_proj"),
}
# the generic path, on a model type no native family covers: Phi-3's fused qkv and gate/up projections, a target
# spelled with its parent (PEFT's suffix rule)
GENERIC = {"phi3-fused": (lambda: Phi3Config(**SHAPE, intermediate_size=96, num_hidden_layers=2, pad_token_id=0),
                          "r=4,alpha=16,targets=qkv_proj,self_attn.o_proj,gate_up_proj,down_proj,rslora=true")}
CASES.update(GENERIC)
NATIVE = sorted(set(CASES) - set(GENERIC))


def setup(case: str, seed: int = 0) -> tuple[torch.nn.Module, ModelLayout, Adapters]:
    """A tiny random transformers model, its layout, and adapters with B random (PEFT starts B at 0, which would
    leave A without a gradient)."""
    make_config, settings = CASES[case]
    hf = build_hf_model(make_config(), seed)
    layout = ModelLayout.build(ModelConfig.from_hf(hf.config.to_dict()))
    adapters = Adapters.init(layout, LoraConfig.parse(settings), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in adapters.tensors.items():
        if ".lora_B." in name:
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    return hf, layout, adapters


def peft_model(hf: torch.nn.Module, adapters: Adapters) -> torch.nn.Module:
    lora = adapters.lora
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=lora.dropout,
        use_rslora=lora.use_rslora))
    result = set_peft_model_state_dict(model, adapters.tensors)
    assert not result.unexpected_keys
    return model


def peft_loss_and_grads(hf: torch.nn.Module, adapters: Adapters, ids: torch.Tensor, labels: torch.Tensor,
                        position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PEFT's loss and its adapters' gradients by PEFT name; its base gets none. position_ids: packed documents
    (read as such without a cache: test_long_context.hf_result says why)."""
    model = peft_model(hf, adapters)
    packed = {} if position_ids is None else dict(position_ids=position_ids, use_cache=False)
    loss = model(input_ids=ids, labels=labels, **packed).loss
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)  # PEFT's base is frozen
    return loss.detach(), {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_matches_peft(loss: torch.Tensor, grads: dict[str, torch.Tensor], peft_loss: torch.Tensor,
                        peft_grads: dict[str, torch.Tensor]) -> None:
    assert rel_err(loss, peft_loss) <= REL_TOL, (loss.item(), peft_loss.item())
    assert set(grads) == set(peft_grads)
    errors = {n: rel_err(grads[n], g) for n, g in peft_grads.items()}
    assert max(errors.values()) <= REL_TOL, errors
    assert all(g.abs().max() > 0 for g in peft_grads.values())  # else the comparison would not see a wrong value


@contextlib.contextmanager
def lora_executor(hf: torch.nn.Module, adapters: Adapters, directory: Path, device: str = "cpu", **options: Any
                  ) -> Iterator[tuple[ParameterStore, Executor]]:
    """The executor of a LoRA run in this process: its store's arena holds `hf` as the frozen base (fp32) and the
    adapters, loaded from the PEFT directory they are saved to. options: the Executor's (tile_tokens, ...)."""
    hf.save_pretrained(directory / "model")
    save_adapter(adapters, directory / "adapter")
    store = ParameterStore(directory / "model", lora=adapters.lora, lora_base_dtype="fp32",
                           adapter=directory / "adapter", check_memory=False)
    try:
        executor = Executor(store.config, store.layout, store.arena.params, store.arena.grads, device, "fp32",
                            frozen=store.arena.frozen, **options)
        try:
            yield store, executor
        finally:
            executor.close()
    finally:
        store.close()


def run_executor(executor: Executor, store: ParameterStore, ids: torch.Tensor, labels: torch.Tensor, **options
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {PEFT name: gradient}) of one forward + backward: the arena's gradients, which are the adapters' alone."""
    loss = executor.run(ids, labels, **options).loss
    return torch.tensor(loss), {n: g.clone() for n, g in store.layout.hf_views(store.arena.grads).items()}


def unit_weights(unit: Unit, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {s.name: base[s.hf_name] for s in unit.slots}


def megatrain_run(hf: torch.nn.Module, layout: ModelLayout, adapters: Adapters, ids: torch.Tensor,
                  labels: torch.Tensor, tile_tokens: int | None = None, position_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, {PEFT name: gradient}, logits) of the native layers with adapters, as the executor's schedule runs
    them (over sequence tiles of tile_tokens where given; position_ids: packed documents); the base weights are the
    transformers model's own tensors, never leaves of a backward."""
    config = layout.config
    base = {n: t.detach() for n, t in hf.state_dict().items()}
    arch = LoraArchitecture(config.family.architecture(config), adapters.lora)
    if tile_tokens is not None:
        arch.tile(tile_tokens)
    batch = arch.batch(ids.shape[0], ids.shape[1], torch.device("cpu"), torch.float32, position_ids)
    x = embed(base["model.embed_tokens.weight"], ids)
    if arch.embed_scale is not None:
        x = x * torch.tensor(arch.embed_scale, dtype=x.dtype)
    xs = []
    for unit in layout.layers:
        xs.append(x)
        w = {**unit_weights(unit, base), **adapters.layer(unit.layer)}
        with torch.no_grad():
            x = arch.layer(unit.layer)(x, w, *batch.layer_args(unit.layer))
    lm_head = base.get("lm_head.weight", base["model.embed_tokens.weight"])
    norm = {"norm.weight": base["model.norm.weight"]}
    loss, grad_x, _ = head_loss_and_grads(x, arch.final_norm, norm, lm_head, ops.shift_labels(ids, labels), 4096,
                                          softcap=arch.logit_softcap)
    logits = F.linear(arch.final_norm(x, norm), lm_head)
    if arch.logit_softcap is not None:
        logits = torch.tanh(logits / arch.logit_softcap) * arch.logit_softcap
    grads: dict[str, torch.Tensor] = {}
    for unit in reversed(layout.layers):
        w = {**unit_weights(unit, base), **adapters.layer(unit.layer)}
        grad_x, layer_grads = arch.layer(unit.layer).backward(xs[unit.layer], w, grad_x,
                                                              *batch.layer_args(unit.layer))
        assert set(layer_grads) == set(adapters.layer(unit.layer))  # the adapters' gradients, no base weight's
        grads.update(adapters.from_layer_names(unit.layer, layer_grads))
    return loss, grads, logits


def tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels
