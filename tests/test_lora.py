"""LoRA against PEFT + transformers, without Ray: loss and every adapter gradient (fp32, 1e-5 relative) on the native
layers and on the generic path (transformers' own layers, adapters hooked onto their nn.Linear modules), no gradient
for the base, micro-batches that are the whole batch, dropout masks replayed by the recompute, the modules PEFT's
target rule picks, PEFT's format out and in, one-sentence refusals.

The native cases run the pieces by hand: the family's architecture wrapped in LoraArchitecture, its layers' forward
without grad, the templates' chunked head, then each layer's LoraLayer.backward from its saved input, top layer first.
The generic path and the micro-batches run the executor itself in this process, on a LoRA store's arena. Both, and
the PEFT reference, are in lora_helpers.py (test_lora_tiled.py runs them over sequence tiles).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import peft
import pytest
import torch
from helpers import (
    REL_TOL,
    SHAPE,
    VOCAB,
    assert_one_sentence,
    build_hf_model,
    error,
    micro_llama_config,
    rel_err,
)
from lora_helpers import (
    CASES,
    GENERIC,
    NATIVE,
    assert_matches_peft,
    lora_executor,
    megatrain_run,
    peft_loss_and_grads,
    peft_model,
    run_executor,
    setup,
    tokens,
    unit_weights,
)
from transformers import GPT2Config, MixtralConfig, Qwen3MoeConfig

from megatrain.config import ModelConfig
from megatrain.lora import LoraArchitecture, LoraConfig, load_adapter, save_adapter
from megatrain.lora.targets import adapted_modules
from megatrain.model.layout import ModelLayout


@pytest.mark.parametrize("case", NATIVE)
def test_loss_and_adapter_gradients_match_peft(case: str) -> None:
    hf, layout, adapters = setup(case)
    ids, labels = tokens()
    loss, grads, _ = megatrain_run(hf, layout, adapters, ids, labels)
    assert set(grads) == set(adapters.tensors)
    assert_matches_peft(loss, grads, *peft_loss_and_grads(hf, adapters, ids, labels))


@pytest.mark.parametrize("case", sorted(GENERIC))
def test_generic_path_loss_and_adapter_gradients_match_peft(case: str, tmp_path: Path) -> None:
    """transformers' own layers with adapters hooked onto their nn.Linear modules, as the executor runs them: PEFT's
    loss and gradients; the base is untouched and no hook outlives the call."""
    hf, _, adapters = setup(case)
    ids, labels = tokens()
    with lora_executor(hf, adapters, tmp_path) as (store, executor):
        frozen = store.arena.frozen.clone()
        loss, grads = run_executor(executor, store, ids, labels)
        assert torch.equal(store.arena.frozen, frozen)
        assert not any(m._forward_hooks for m in executor.arch.arch.model.modules())
    assert set(grads) == set(adapters.tensors)
    assert_matches_peft(loss, grads, *peft_loss_and_grads(hf, adapters, ids, labels))


def test_generic_path_with_dropout_under_simulated_streams_is_bit_identical(tmp_path: Path) -> None:
    """The GPU's schedule (asynchronous copies, the adapters copied in beside the base) on transformers' own layers,
    dropout on: the plain CPU path's loss and gradients, bit for bit (the masks come from the batch's seed)."""
    hf, _, adapters = setup("phi3-fused")
    adapters.lora = replace(adapters.lora, dropout=0.2)
    ids, labels = tokens()
    runs = []
    for device in ("cpu", "cpu-async:3"):
        with lora_executor(hf, adapters, tmp_path / device, device) as (store, executor):
            runs.append(run_executor(executor, store, ids, labels))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(runs[0][1][n], g) for n, g in runs[1][1].items())


@pytest.mark.parametrize("schedule", ["layer-major", "per-micro-batch"])
def test_micro_batches_are_the_whole_batch(schedule: str, tmp_path: Path) -> None:
    """Two micro-batches of one row give the loss and adapter gradients of the batch of two (fp32 rounding apart: the
    gradients are summed in another order) and PEFT's."""
    hf, _, adapters = setup("qwen2-biases-rslora")
    ids, labels = tokens()
    with lora_executor(hf, adapters, tmp_path) as (store, executor):
        whole_loss, whole = run_executor(executor, store, ids, labels)
        loss, grads = run_executor(executor, store, ids, labels, micro_batches=2, schedule=schedule)
    assert rel_err(loss, whole_loss) <= 1e-6
    assert max(rel_err(grads[n], g) for n, g in whole.items()) <= REL_TOL
    assert_matches_peft(loss, grads, *peft_loss_and_grads(hf, adapters, ids, labels))


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


@pytest.mark.parametrize("case", ["llama-all-linear", "phi3-fused"])
def test_dropout_masks_replay_in_the_recompute(case: str) -> None:
    hf, layout, adapters = setup(case)
    adapters.lora = replace(adapters.lora, dropout=0.3)
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


def mixtral_config() -> MixtralConfig:
    """A tiny Mixtral: attention projections that are nn.Linear, a router and fused experts that are not."""
    return MixtralConfig(**SHAPE, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize(("make_config", "settings"), [*CASES.values(), (
    mixtral_config, "r=2,alpha=4,targets=q_proj,self_attn.v_proj")], ids=[*CASES, "mixtral-attention"])
def test_targets_adapt_the_modules_peft_adapts(make_config, settings: str) -> None:
    """PEFT's own target rule on the transformers model (all-linear, and suffixes of a module's name) picks the
    modules megatrain adapts, the same whatever the spelling."""
    hf = build_hf_model(make_config())
    targets = LoraConfig.parse(settings).target_modules
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=2, target_modules="all-linear" if targets == ("all-linear",) else list(targets)))
    theirs = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
              if isinstance(m, peft.tuners.lora.LoraLayer)}
    config = ModelConfig.from_hf(hf.config.to_dict())
    ours = adapted_modules(targets, config)
    assert ours == theirs and ours
    resolved = LoraConfig.parse(settings).for_model(config).target_modules  # what adapter_config.json lists
    assert adapted_modules(resolved, config) == ours and "all-linear" not in resolved


def test_targets_megatrain_cannot_adapt_are_one_sentence() -> None:
    """A router or fused experts (PEFT adapts them through their parameters, by their names in the checkpoint too), a
    whole attention block, a layer picked by index, the embedding or the head, GPT-2's Conv1D (PEFT adapts it
    transposed), and PEFT's all-linear where it would reach more than nn.Linear modules: each one sentence, before
    anything is allocated."""
    mixtral = ModelConfig.from_hf(mixtral_config().to_dict())
    for targets in ("gate", "experts", "gate_up_proj", "w1", "self_attn", "layers.0.self_attn.q_proj", "embed_tokens",
                    "lm_head", "wq", "all-linear"):
        message = error(LoraConfig.parse(f"r=2,alpha=4,targets={targets}").for_model, mixtral)
        assert_one_sentence(message)
        assert "q_proj" in message or "index" in message, message  # what to write instead
    # PEFT reads gate_proj as the checkpoint's experts (fused by transformers), not the dense layer 1's nn.Linear
    moe = ModelConfig.from_hf(Qwen3MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=32,
                                             num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                             mlp_only_layers=[1]).to_dict())
    assert_one_sentence(message := error(LoraConfig.parse("r=2,alpha=4,targets=gate_proj").for_model, moe))
    assert "fuses" in message
    gpt2 = ModelConfig.from_hf(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, bos_token_id=0,
                                          eos_token_id=0).to_dict())
    for targets in ("c_attn", "all-linear"):
        message = error(LoraConfig.parse(f"r=2,alpha=4,targets={targets}").for_model, gpt2)
        assert_one_sentence(message)
        assert "Conv1D" in message


def test_config_from_the_command_line_and_toml() -> None:
    lora = LoraConfig.parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05,rslora=true")
    assert (lora.r, lora.alpha, lora.target_modules, lora.dropout, lora.use_rslora) == (
        16, 32.0, ("q_proj", "v_proj"), 0.05, True)
    assert lora.scaling == 32 / 4  # rsLoRA: alpha / sqrt(r)
    assert LoraConfig.parse(lora.to_cli()) == lora
    assert LoraConfig.parse("r=16,alpha=32") == LoraConfig(16, 32.0, ("all-linear",))  # targets not given: DEFAULTS
    toml = LoraConfig.from_dict({"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]})
    assert toml.scaling == 2.0 and not toml.use_rslora and toml.dropout == 0.0
    config = ModelConfig.from_hf(micro_llama_config().to_dict())
    assert LoraConfig.parse("r=4,alpha=8,targets=all-linear").for_model(config).target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_bad_settings_are_refused_in_one_sentence(tmp_path) -> None:
    config = ModelConfig.from_hf(micro_llama_config().to_dict())
    for text in ("r=0,alpha=32,targets=q_proj", "r=16,alpha=0,targets=q_proj", "r=16,alpha=32,targets=q_proj,dropout=1",
                 "r=16,alpha=32,targets=q_proj,bogus=1", "r=sixteen,alpha=32,targets=q_proj",
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
