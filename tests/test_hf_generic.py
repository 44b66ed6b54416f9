"""The generic path (megatrain/model/hf_generic.py) against transformers itself: loss and every gradient for tiny
random models of the architectures it is meant for (dense, MoE with and without the router's auxiliary loss, sliding
windows with attention sinks, hybrid linear/full attention), also under simulated streams; checkpoints in the hub's
layout loaded through transformers' conversion mapping; save_pretrained read back by transformers; dropout replayed
in the recompute; three Engine steps against transformers + torch.optim.AdamW; the plan of real configs; and the
one-sentence refusals of what it cannot train."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    REAL,
    REL_TOL,
    SHAPE,
    VOCAB,
    assert_matches,
    assert_one_sentence,
    batch,
    build_hf_model,
    fp64_grads,
    gemma2_config,
    gemma3_config,
    hf_loss_and_grads,
    hf_reference,
    make_labels,
    max_rel,
    rel_err,
    train_engine,
)
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

import megatrain
from megatrain import ConfigError
from megatrain.model import registry
from megatrain.model.hf_model import NO_DECAY
from pipelines.cli import main

DENSE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=2, pad_token_id=0, bos_token_id=0, eos_token_id=1)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.05)

# name -> factory(aux): tiny random configs of the architectures the generic path is for
MODELS: dict[str, Callable[[bool], PretrainedConfig]] = {
    "gemma2": lambda aux: gemma2_config(),  # soft-capping, a sliding window, scaled tied embeddings
    "gemma3": lambda aux: gemma3_config(),  # q/k norms, local and global rotary tables, sliding / full layers
    "phi3": lambda aux: Phi3Config(**DENSE),
    "olmo2": lambda aux: Olmo2Config(**DENSE),
    "mixtral": lambda aux: MixtralConfig(**SHAPE, **MOE, intermediate_size=48, num_hidden_layers=2,
                                         num_local_experts=4, output_router_logits=aux),
    # layer 1 dense (mlp_only_layers): layers of two sizes in one layout
    "qwen3_moe": lambda aux: Qwen3MoeConfig(**SHAPE, **MOE, intermediate_size=96, moe_intermediate_size=32,
                                            num_hidden_layers=3, num_experts=4, mlp_only_layers=[1],
                                            output_router_logits=aux),
    # alternating sliding (window 8 < the test's 16 tokens) and full layers, attention sinks, expert biases
    "gpt_oss": lambda aux: GptOssConfig(**SHAPE, **MOE, intermediate_size=32, num_hidden_layers=2,
                                        num_local_experts=4, sliding_window=8, output_router_logits=aux),
    # hybrid: three gated-delta-net (linear attention) layers, then a full-attention one; MoE with a shared expert
    "qwen3_next": lambda aux: Qwen3NextConfig(**SHAPE, **MOE, intermediate_size=96, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32, num_hidden_layers=4, num_experts=4,
                                              linear_num_value_heads=4, linear_num_key_heads=2,
                                              linear_key_head_dim=16, linear_value_head_dim=16,
                                              output_router_logits=aux),
}
MOE_MODELS = ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_next")
CASES = [f"{name}-aux" for name in MOE_MODELS] + [f"{name}-noaux" for name in MOE_MODELS] + [
    "phi3", "olmo2", "gemma2", "gemma3"]

Case = tuple[str, torch.nn.Module, Path]


def config_of(case: str) -> PretrainedConfig:
    name, _, aux = case.partition("-")
    return MODELS[name](aux == "aux")


@contextlib.contextmanager
def on_the_generic_path(case: str) -> Iterator[None]:
    """Gemma 2 and 3 have native families (megatrain/model/gemma.py, tests/test_gemma.py): here, in this process,
    their model types are taken off the native list so that these tests keep running them on the generic path."""
    model_type = config_of(case).model_type
    with pytest.MonkeyPatch.context() as patch:
        if model_type in registry.FAMILIES:
            patch.delitem(registry.FAMILIES, model_type)
        yield


@pytest.fixture(scope="module", params=CASES)
def model_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    hf = build_hf_model(config_of(request.param))  # every parameter perturbed off its init value
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)  # in the hub's layout (Mixtral's experts one by one, say)
    with on_the_generic_path(request.param):
        yield request.param, hf, directory


@pytest.mark.parametrize("labels_kind", ["full", "masked"])
def test_loss_and_grads_match_transformers(model_case: Case, labels_kind: str) -> None:
    _, hf, directory = model_case
    input_ids = batch()
    labels = make_labels(labels_kind, input_ids)
    with megatrain.from_pretrained(directory) as model:
        assert type(model.executor.arch).__name__ == "GenericArchitecture"
        ours = model.loss_and_grads(input_ids, labels)
        ours = (ours[0], {k: v.clone() for k, v in ours[1].items()})
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, labels), fp64_grads(hf, input_ids, labels))


@pytest.mark.parametrize("case", ["qwen3_next-aux", "gpt_oss-aux", "qwen3_moe-noaux"])
def test_simulated_streams_match_transformers(case: str, tmp_path: Path) -> None:
    """The GPU's schedule (asynchronous copies, two weight buffers of the largest layer's size, layers of
    different sizes passing through them) under the stream simulator."""
    hf = build_hf_model(config_of(case))
    hf.save_pretrained(tmp_path)
    input_ids = batch(seed=3)
    with megatrain.from_pretrained(tmp_path, device="cpu-async:1") as model:
        ours = model.loss_and_grads(input_ids, input_ids)
        ours = (ours[0], {k: v.clone() for k, v in ours[1].items()})
    assert_matches(ours, hf_loss_and_grads(hf, input_ids, input_ids), fp64_grads(hf, input_ids, input_ids))


def test_layouts_hold_layers_of_different_sizes(tmp_path: Path) -> None:
    hf = build_hf_model(config_of("qwen3_moe-aux"))
    hf.save_pretrained(tmp_path)
    with megatrain.from_pretrained(tmp_path) as model:
        sizes = [u.numel for u in model.layout.layers]
        assert sizes[0] == sizes[2] != sizes[1], sizes  # the dense layer 1 is another structure
        assert model.executor.arch.layer(0) is model.executor.arch.layer(2) is not model.executor.arch.layer(1)
        assert model.config.num_params() == sum(p.numel() for p in hf.parameters())
        decayed = {s.hf_name for u in model.layout.units for s in u.slots if s.decay}
        assert decayed == {n for n, _ in hf.named_parameters() if not NO_DECAY.search(n)}


def test_save_pretrained_loads_in_transformers_with_identical_logits(model_case: Case, tmp_path: Path) -> None:
    case, hf, directory = model_case
    with megatrain.from_pretrained(directory) as model:
        saved = model.save_pretrained(tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager", dtype=torch.float32).eval()
    input_ids = batch(seed=5)
    with torch.no_grad():
        assert torch.equal(back(input_ids).logits, hf(input_ids).logits), case
    assert json.loads((saved / "config.json").read_text())["model_type"] == hf.config.model_type


def test_dropout_is_replayed_in_the_recompute(tmp_path: Path) -> None:
    """With dropout on (train mode), the recompute of each layer draws the forward's masks: the gradients are those
    of the forward that made the loss, as transformers computes them from the same seed."""
    config = Phi3Config(**DENSE, attention_dropout=0.3, resid_pdrop=0.2)
    hf = build_hf_model(config)
    hf.save_pretrained(tmp_path)
    input_ids = batch(seed=4)
    hf.train()
    torch.manual_seed(123)
    hf_result = hf_loss_and_grads(hf, input_ids, input_ids)
    with megatrain.from_pretrained(tmp_path) as model:
        torch.manual_seed(123)
        loss, grads = model.loss_and_grads(input_ids)
        assert rel_err(loss, hf_result[0]) <= REL_TOL
        for name, g in hf_result[1].items():
            assert rel_err(grads[name], g) <= REL_TOL, name
        torch.manual_seed(124)  # another draw: another loss, so the dropout is truly on
        assert model.loss_and_grads(input_ids)[0] != loss


# Gemma 2 left this list when it became native (its Ray actors would run it natively): tests/test_gemma.py runs its
# three Engine steps, and the executor's embedding scale and logit soft-cap, which the generic path shares
# CI: the generic path's Engine steps are test_model_families' GPT-2 and test_lora_engine's Mixtral with its aux loss
@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral-aux", "qwen3_next-aux"])
def test_engine_three_steps_match_transformers_adamw(case: str, tmp_path: Path, ray_session: Any) -> None:
    """Three Engine steps (clipping on) against transformers + torch.optim.AdamW, judged against an fp64 run of the
    reference: megatrain within twice fp32 transformers' own distance from it (Adam amplifies rounding)."""
    hf = build_hf_model(config_of(case))
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(9)
    batches = [(ids, ids.clone()) for ids in (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(3))]
    no_decay = NO_DECAY.search
    exact_losses, exact = hf_reference(tmp_path, batches, 1.0, no_decay=no_decay, dtype=torch.float64)
    hf_losses, ref = hf_reference(tmp_path, batches, 1.0, no_decay=no_decay)
    losses, ours = train_engine(tmp_path, batches, workers=2)
    assert losses == pytest.approx(exact_losses, rel=1e-5)
    assert hf_losses == pytest.approx(exact_losses, rel=1e-5)
    # per parameter, as tests/test_qwen3.py judges: as close to the exact result as transformers' own fp32 run
    ours_err, theirs_err = max_rel(ours, exact), max_rel(ref, exact)
    too_far = {n: (e, theirs_err[n]) for n, e in ours_err.items() if e > max(1e-5, 2 * theirs_err[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


# ---- the plan for real configs ----

# G parameters of each published config.json, counted from the config (every tensor's shape, by hand and by
# transformers on the meta device): DeepSeek-V3 without its multi-token-prediction layer (num_nextn_predict_layers:
# transformers builds none) and with an fp8 quantization_config; Falcon-40B ties lm_head to the embedding (its config
# leaves tie_word_embeddings at True), though its checkpoint also stores lm_head (41.84 G there)
REAL_PARAMS = {"qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7, "gpt-oss-120b": 116.8, "deepseek-v3": 671.03,
               "glm-4.5-air": 106.85, "qwen3-235b-a22b": 235.09, "falcon-40b": 41.30, "starcoder2-15b": 15.96,
               "opt-350m": 0.331}  # OPT-350m: 512-wide embeddings, project_in/out to its 1024-wide layers


@pytest.mark.parametrize("name", REAL_PARAMS)
def test_plan_of_real_configs(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = REAL / f"{name}.json"
    if not source.is_file():
        pytest.fail(f"{source} is missing")
    (tmp_path / "config.json").write_text(source.read_text())
    code = main(["plan", "--model", str(tmp_path), "--seq", "1024", "--batch", "1", "--device", "cuda",
                 "--gpu-gib", "80"])
    out = capsys.readouterr().out
    assert ("fits: yes" if code == 0 else "fits: NO: ") in out  # this machine's host memory decides which
    params = float(re.search(r"\(([\d.]+) G params\)", out).group(1))  # type: ignore[union-attr]
    assert abs(params - REAL_PARAMS[name]) / REAL_PARAMS[name] < 0.01, out


# ---- what the generic path refuses ----

def write_config(directory: Path, hf: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


@pytest.mark.parametrize("hf, words", [
    ({"model_type": "t5", "is_encoder_decoder": True, "vocab_size": 32, "d_model": 16}, "encoder-decoder"),
    ({"model_type": "my_private_lm", "auto_map": {"AutoModelForCausalLM": "modeling.MyLM"}}, "trust_remote_code"),
    ({"model_type": "vit"}, "no decoder-only causal language model"),
    # an encoder registered as a causal LM, and the decoder of an encoder-decoder model
    ({"model_type": "bert", "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
      "num_hidden_layers": 1, "is_decoder": True}, "is an encoder (a masked language model"),
    ({"model_type": "bart", "vocab_size": 32, "d_model": 16}, "is an encoder-decoder model"),
])
def test_refuses_what_it_cannot_train(hf: dict[str, Any], words: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        megatrain.ModelConfig.from_hf(write_config(tmp_path, hf))
    assert words in str(e.value)
    assert_one_sentence(str(e.value))


def test_refuses_quantized_checkpoints(tmp_path: Path) -> None:
    hf = build_hf_model(config_of("gpt_oss-noaux"))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}  # MXFP4 decodes as it loads: tests/test_gptoss.py
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(megatrain.MegatrainError) as e:
        megatrain.from_pretrained(tmp_path)
    assert "fp8" in str(e.value) and "dequantize" in str(e.value)
    assert_one_sentence(str(e.value))
