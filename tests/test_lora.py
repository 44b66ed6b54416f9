"""LoRA on the native layers against PEFT + transformers: loss and every adapter gradient (fp32, 1e-5 relative), no
gradient for the base, dropout masks replayed by the recompute, PEFT's format out and in, one-sentence refusals.

The megatrain side runs what the executor will run once it binds adapters (it does not yet): the family's
architecture wrapped in LoraArchitecture, its layers' forward without grad, the templates' chunked head, then each
layer's LoraLayer.backward from its saved input, top layer first.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FAMILIES,
    REL_TOL,
    assert_one_sentence,
    build_hf_model,
    error,
    gemma2_config,
    micro_llama_config,
    rel_err,
)
from peft.utils import set_peft_model_state_dict

from megatrain.config import ModelConfig
from megatrain.lora import Adapters, LoraArchitecture, LoraConfig, load_adapter, save_adapter
from megatrain.model import ops
from megatrain.model.layout import ModelLayout, Unit
from megatrain.model.templates import embed, head_loss_and_grads

CASES = {  # name -> (transformers config, LoRA settings)
    "llama-all-linear": (micro_llama_config, "r=4,alpha=8,targets=all-linear"),
    "qwen2-biases-rslora": (FAMILIES["qwen2-tied"], "r=4,alpha=16,targets=q_proj,v_proj,down_proj,rslora=true"),
    "gemma2-softcap": (gemma2_config, "r=2,alpha=4,targets=o_proj,gate_proj,up_proj"),
}


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


def unit_weights(unit: Unit, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {s.name: base[s.hf_name] for s in unit.slots}


def megatrain_run(hf: torch.nn.Module, layout: ModelLayout, adapters: Adapters, ids: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, {PEFT name: gradient}, logits) of the native layers with adapters, as the executor's schedule runs
    them; the base weights are the transformers model's own tensors, never leaves of a backward."""
    config = layout.config
    base = {n: t.detach() for n, t in hf.state_dict().items()}
    arch = LoraArchitecture(config.family.architecture(config), adapters.lora)
    batch = arch.batch(ids.shape[0], ids.shape[1], torch.device("cpu"), torch.float32)
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_adapter_gradients_match_peft(case: str) -> None:
    hf, layout, adapters = setup(case)
    ids, labels = tokens()
    loss, grads, _ = megatrain_run(hf, layout, adapters, ids, labels)
    model = peft_model(hf, adapters)
    peft_loss = model(input_ids=ids, labels=labels).loss
    peft_loss.backward()
    peft_grads = {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)  # PEFT's base is frozen
    assert rel_err(loss, peft_loss.detach()) <= REL_TOL, (loss.item(), peft_loss.item())
    assert set(grads) == set(peft_grads) == set(adapters.tensors)
    errors = {n: rel_err(grads[n], g) for n, g in peft_grads.items()}
    assert max(errors.values()) <= REL_TOL, errors
    assert all(g.abs().max() > 0 for g in peft_grads.values())  # else the comparison would not see a wrong value


def test_saved_adapter_loads_in_peft_with_the_same_logits(tmp_path) -> None:
    hf, layout, adapters = setup("qwen2-biases-rslora")
    ids, labels = tokens()
    _, _, logits = megatrain_run(hf, layout, adapters, ids, labels)
    save_adapter(adapters, tmp_path / "ours")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        peft_logits = loaded(input_ids=ids).logits
        assert torch.equal(peft_logits, peft_model(hf, adapters).eval()(input_ids=ids).logits)
    assert rel_err(logits, peft_logits) <= REL_TOL
    # and back in: from our files and from PEFT's own save_pretrained, the same tensors bit for bit
    loaded.save_pretrained(tmp_path / "peft")
    for directory in ("ours", "peft"):
        back = load_adapter(tmp_path / directory, layout, expected=adapters.lora)
        assert back.lora == adapters.lora
        assert back.tensors.keys() == adapters.tensors.keys()
        assert all(torch.equal(back.tensors[n], t) for n, t in adapters.tensors.items())


def test_dropout_masks_replay_in_the_recompute() -> None:
    hf, layout, adapters = setup("llama-all-linear")
    adapters.lora = LoraConfig.parse("r=4,alpha=8,targets=all-linear,dropout=0.3")
    config = layout.config
    arch = LoraArchitecture(config.family.architecture(config), adapters.lora, seed=7)
    unit = layout.layers[0]
    w = {**unit_weights(unit, {n: t.detach() for n, t in hf.state_dict().items()}), **adapters.layer(0)}
    x = torch.randn(2, 12, config.hidden_size, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn_like(x)
    layer, first, second = arch.layer(0), arch.batch(2, 12, x.device, x.dtype), arch.batch(2, 12, x.device, x.dtype)
    with torch.no_grad():
        y = layer(x, w, *first.layer_args(0))
        assert torch.equal(y, layer(x, w, *first.layer_args(0)))  # one batch: the same masks every time
        assert not torch.equal(y, layer(x, w, *second.layer_args(0)))  # another batch: other masks
    # the recompute's gradients are those of the forward's masks: autograd through that same call agrees
    leaves = {n: t.detach().requires_grad_(".lora_" in n) for n, t in w.items()}
    x_leaf = x.clone().requires_grad_(True)
    y_grad = layer(x_leaf, leaves, *first.layer_args(0))
    assert torch.equal(y_grad.detach(), y)
    adapter_leaves = [t for n, t in leaves.items() if ".lora_" in n]
    want = torch.autograd.grad(y_grad, [x_leaf, *adapter_leaves], grad_out)
    grad_x, grads = layer.backward(x, w, grad_out, *first.layer_args(0))
    assert torch.equal(grad_x, want[0])
    assert all(torch.equal(grads[n], g) for n, g in zip([n for n in leaves if ".lora_" in n], want[1:], strict=True))


def test_config_from_the_command_line_and_toml() -> None:
    lora = LoraConfig.parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05,rslora=true")
    assert (lora.r, lora.alpha, lora.target_modules, lora.dropout, lora.use_rslora) == (
        16, 32.0, ("q_proj", "v_proj"), 0.05, True)
    assert lora.scaling == 32 / 4  # rsLoRA: alpha / sqrt(r)
    assert LoraConfig.parse(lora.to_cli()) == lora
    toml = LoraConfig.from_dict({"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]})
    assert toml.scaling == 2.0 and not toml.use_rslora and toml.dropout == 0.0
    config = ModelConfig.from_hf(micro_llama_config().to_dict())
    assert LoraConfig.parse("r=4,alpha=8,targets=all-linear").for_model(config).target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_bad_settings_are_refused_in_one_sentence(tmp_path) -> None:
    config = ModelConfig.from_hf(micro_llama_config().to_dict())
    for text in ("r=0,alpha=32,targets=q_proj", "r=16,alpha=0,targets=q_proj", "r=16,alpha=32,targets=q_proj,dropout=1",
                 "r=16,alpha=32,targets=q_proj,bogus=1", "r=16,alpha=32", "r=sixteen,alpha=32,targets=q_proj",
                 "r=16,alpha=32,targets=q_proj,rslora=maybe", "r=2.5,alpha=32,targets=q_proj"):
        assert_one_sentence(error(LoraConfig.parse, text))
    assert_one_sentence(error(LoraConfig.from_dict, {"r": 16, "alpha": 32, "targets": ["q_proj"], "rank": 4}))
    message = error(LoraConfig.parse("r=16,alpha=32,targets=q_proj,qkv_proj").for_model, config)
    assert "qkv_proj" in message and "q_proj" in message
    dropout = LoraConfig.parse("r=4,alpha=8,targets=q_proj,dropout=0.1")
    arch = LoraArchitecture(config.family.architecture(config), dropout)
    assert_one_sentence(error(arch.tile, 64))
    # an adapter that is not the run's, or not this model's
    hf, layout, adapters = setup("llama-all-linear")
    save_adapter(adapters, tmp_path)
    assert_one_sentence(error(load_adapter, tmp_path, layout, LoraConfig.parse("r=8,alpha=8,targets=all-linear")))
    for other in ({"intermediate_size": 64}, {"num_hidden_layers": 3}):
        other_layout = ModelLayout.build(ModelConfig.from_hf({**micro_llama_config().to_dict(), **other}))
        assert "another base model" in error(load_adapter, tmp_path, other_layout)
    assert_one_sentence(error(load_adapter, tmp_path / "nowhere", layout))
