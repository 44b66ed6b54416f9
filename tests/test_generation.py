"""Generation by the streamed model with a KV cache (megatrain/engine/generation.py): greedy tokens (and the logits of
every step) equal to transformers' `generate` on a left-padded batch, for Llama, Qwen2, Qwen3, Gemma 2 and 3 and, on
the generic path, GPT-2 and GPT-OSS, on the CPU path and under simulated streams, with and without resident units; a
row stops at its end-of-sequence token; sampling repeats with its seed and filters as transformers' warpers do; a layer
with state beyond keys and values is refused; a LoRA run's generation is PEFT's; Engine.generate and `megatrain
generate` with text prompts."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import (
    FAMILIES,
    REL_TOL,
    SHAPE,
    VOCAB,
    assert_one_sentence,
    build_hf_model,
    gemma2_config,
    gemma3_config,
    rel_err,
    saved_hf_model,
)
from lora_helpers import lora_executor, peft_model, setup
from post_helpers import PROMPTS, hf_greedy
from transformers import GPT2Config, GptOssConfig, PretrainedConfig, Qwen3NextConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

import megatrain
from megatrain import MegatrainError
from megatrain.config import ConfigError, ModelConfig
from megatrain.engine import generation
from megatrain.engine.executor import Executor
from megatrain.engine.generation import (
    Generator,
    Sampling,
    cache_bytes,
    check_cache_fits,
    pick_next,
    sampling_scores,
)
from megatrain.store import ParameterStore
from pipelines.cli import main
from pipelines.generate import read_prompts

NEW = 10


# native families (templates.DecoderLayer.cached; Gemma 2's soft-caps and Gemma 3's local and global layers:
# gemma_layers.py), and two on the generic path (transformers' own layers, hf_cached.py): GPT-2 (learned positions
# before its first layer, the cache handed to its layers by position) and GPT-OSS (a sliding window of 4 shorter than
# prompt and completion, attention sinks, MoE)
MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    **{name: FAMILIES[name] for name in ("llama-gqa", "qwen2-tied", "qwen3-head-dim")},
    "gemma2": gemma2_config, "gemma3": gemma3_config,
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                               eos_token_id=1),
    "gpt_oss": lambda: GptOssConfig(**SHAPE, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4),
}


@dataclass
class Family:
    hf: torch.nn.Module
    store: ParameterStore  # the same weights in megatrain's arena
    greedy: list[list[int]]  # transformers' greedy tokens of PROMPTS, NEW a row
    logits: list[torch.Tensor]  # and the logits of each step


@pytest.fixture(scope="module", params=list(MODELS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    hf, directory = saved_hf_model(MODELS[request.param](), tmp_path_factory, request.param)
    store = ParameterStore(directory, check_memory=False)
    logits: list[torch.Tensor] = []
    yield Family(hf, store, hf_greedy(hf, PROMPTS, NEW, logits=logits), logits)
    store.close()


def generated(store: ParameterStore, sampling: Sampling, device: str = "cpu", resident: int = 0,
              prompts: list[list[int]] = PROMPTS, logits: list[torch.Tensor] | None = None) -> list[list[int]]:
    """The executor's generation (the logits each step picks from appended to `logits`, where given)."""
    executor = Executor(store.config, store.layout, store.arena.params, store.arena.grads, device, "fp32",
                        resident_units=resident)
    try:
        if resident:
            executor.resident.load(store.arena.tensors, 0)
        with pytest.MonkeyPatch.context() as patch:
            if logits is not None:
                patch.setattr(generation, "pick_next", lambda z, *args: logits.append(z) or pick_next(z, *args))
            return Generator(executor).generate(prompts, sampling).token_ids
    finally:
        executor.close()


@pytest.mark.parametrize(("device", "resident"), [("cpu", 0), ("cpu-async:2", 2), ("cpu", "all")])
def test_greedy_generation_is_transformers_generate(family: Family, device: str,
                                                    resident: int | str) -> None:
    """Every unit streamed, the embedding and layer 0 resident (simulated streams), and every unit resident."""
    count = len(family.store.layout.units) if resident == "all" else int(resident)
    logits: list[torch.Tensor] = []
    assert generated(family.store, Sampling(max_new_tokens=NEW), device, count, logits=logits) == family.greedy
    assert len(logits) == len(family.logits) == NEW
    assert max(rel_err(z, want) for z, want in zip(logits, family.logits, strict=True)) <= REL_TOL


def test_a_row_stops_at_its_end_of_sequence_token(family: Family) -> None:
    """A token some row picks first after a few others (else its first) is made the end of sequence: that row stops
    there, the others run on (or stop where they pick it too), as in transformers' generate."""
    free = family.greedy
    row, at = next(((r, j) for r, tokens in enumerate(free) for j in range(1, NEW) if tokens[j] not in tokens[:j]),
                   (0, 0))
    eos = free[row][at]
    want = hf_greedy(family.hf, PROMPTS, NEW, eos)
    assert want[row][-1] == eos and len(want[row]) == at + 1
    assert generated(family.store, Sampling(max_new_tokens=NEW, eos_token_ids=(eos,))) == want


def test_sampling_repeats_with_its_seed(family: Family) -> None:
    store = family.store
    sampling = Sampling(max_new_tokens=NEW, temperature=1.5, top_p=0.9, seed=3)
    first = generated(store, sampling)
    assert generated(store, sampling, "cpu-async:1", 2) == first
    other = generated(store, Sampling(max_new_tokens=NEW, temperature=1.5, top_p=0.9, seed=4))
    assert other != first and all(len(row) == NEW for row in first + other)


def test_sampling_filters_as_transformers_warpers() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p in ((0.7, 0.9), (1.3, 0.5), (1.0, 0.01), (2.0, 1.0)):
        want = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        got = sampling_scores(logits, Sampling(temperature=temperature, top_p=top_p))
        assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got[~got.isinf()], want[~want.isinf()])


@pytest.mark.parametrize(("settings", "words"), [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p")])
def test_bad_sampling_settings_are_refused_in_one_sentence(settings: dict, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        Sampling(**settings)
    assert words in str(e.value)
    assert_one_sentence(str(e.value))


def test_a_kv_cache_the_device_cannot_hold_is_refused_before_it_is_made() -> None:
    config = ModelConfig.from_name("tiny")
    need = cache_bytes(config, 8, 100, torch.bfloat16)
    assert need == 2 * config.num_layers * 8 * 100 * config.kv_size * 2
    check_cache_fits(config, 8, 100, torch.bfloat16, None)  # the host's: not checked here
    check_cache_fits(config, 8, 100, torch.bfloat16, 2 * need)
    with pytest.raises(MegatrainError) as e:
        check_cache_fits(config, 8, 100, torch.bfloat16, need)
    assert "fewer prompts" in str(e.value)
    assert_one_sentence(str(e.value))


def test_bad_prompts_are_refused_in_one_sentence(family: Family) -> None:
    store = family.store
    for prompts, words in (([], "at least one prompt"), ([[1, 2], []], "non-empty"), ([[1, 999]], "vocabulary")):
        with pytest.raises(MegatrainError) as e:
            generated(store, Sampling(), prompts=prompts)
        assert words in str(e.value)
        assert_one_sentence(str(e.value))


def test_a_layer_with_state_beyond_keys_and_values_is_refused_in_one_sentence(tmp_path: Path) -> None:
    """Qwen3-Next's linear-attention layers keep a convolution's and a recurrence's state between tokens."""
    hf = build_hf_model(Qwen3NextConfig(**SHAPE, intermediate_size=32, moe_intermediate_size=16, num_experts=2,
                                        num_experts_per_tok=1, shared_expert_intermediate_size=16, num_hidden_layers=2,
                                        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]))
    hf.save_pretrained(tmp_path)
    store = ParameterStore(tmp_path, check_memory=False)
    try:
        with pytest.raises(MegatrainError) as e:
            generated(store, Sampling(max_new_tokens=2))
    finally:
        store.close()
    assert "state other than attention keys and values" in str(e.value)
    assert_one_sentence(str(e.value))


@pytest.mark.parametrize(("case", "device", "resident"), [("llama-all-linear", "cpu-async:3", 2),
                                                        ("phi3-fused", "cpu", 0)])
def test_a_lora_runs_generation_is_pefts(case: str, device: str, resident: int, tmp_path: Path) -> None:
    """A LoRA run generates with its adapters beside the streamed base (resident adapters under simulated streams;
    the generic path's hooked adapters): PEFT's model's greedy generate, which the base alone does not give."""
    hf, _, adapters = setup(case)
    with lora_executor(hf, adapters, tmp_path, device, resident_units=resident) as (store, executor):
        if resident:
            executor.resident.load(store.arena.tensors, 0)
        got = Generator(executor).generate(PROMPTS, Sampling(max_new_tokens=NEW)).token_ids
    want = hf_greedy(peft_model(hf, adapters).eval(), PROMPTS, NEW)
    assert got == want and want != hf_greedy(hf, PROMPTS, NEW)


# ---- Engine.generate and `megatrain generate` ----

def save_word_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer.json of `vocab` words w0, w1, ... (w2 the end of sequence)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "pad_token": "w0"}))


@pytest.fixture(scope="module")
def worded(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf = build_hf_model(FAMILIES["qwen3-head-dim"]())
    hf.generation_config.eos_token_id = None
    directory = tmp_path_factory.mktemp("worded")
    hf.save_pretrained(directory)
    save_word_tokenizer(directory, hf.config.vocab_size)
    return hf, directory


def test_engine_generates_from_text_and_ids_as_transformers(ray_session: None, worded: tuple[torch.nn.Module, Path]
                                                           ) -> None:
    """Under simulated streams with two units resident: text prompts through the model's tokenizer, token ids as
    given; the completions' tokens are transformers' greedy ones, their text the tokenizer's decoding; sampling with a
    seed repeats across calls."""
    hf, directory = worded
    text = ["w5 w6 w7 w8 w9", "w11 w12"]
    with megatrain.Engine(directory, optimizer_workers=1, device="cpu-async:1", precision="fp32", metrics=False,
                          batch_size=3, seq_len=24, resident=2) as engine:
        out = engine.generate([*text, PROMPTS[2]], max_new_tokens=NEW)
        sampled = [engine.generate(text, max_new_tokens=6, temperature=1.0, seed=7).token_ids for _ in range(2)]
    assert out.prompt_ids == PROMPTS
    assert out.token_ids == hf_greedy(hf, PROMPTS, NEW)
    assert out.texts == [" ".join(f"w{t}" for t in row) for row in out.token_ids]
    assert sampled[0] == sampled[1]


def test_the_generate_commands_prompts_are_its_texts_then_its_files_lines(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [3, 4]}) + "\n\n" + json.dumps({"prompt": "w5 w6"}) + "\n")
    assert read_prompts(["w1"], str(prompts)) == ["w1", [3, 4], "w5 w6"]
    prompts.write_text(json.dumps({"text": "w5"}) + "\n")
    for texts, file, words in (([], None, "needs a prompt"), ([], str(prompts), "line 1"),
                               ([], str(tmp_path / "none.jsonl"), "is no file")):
        with pytest.raises(ConfigError) as e:
            read_prompts(texts, file)
        assert words in str(e.value)
        assert_one_sentence(str(e.value))


@pytest.mark.slow  # an Engine of its own; test_engine_generates_from_text_and_ids_as_transformers runs the same path
def test_the_generate_command_prints_a_json_line_per_prompt(ray_session: None, worded: tuple[torch.nn.Module, Path],
                                                            tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf, directory = worded
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": PROMPTS[2]}) + "\n")
    assert main(["generate", "--model", str(directory), "--prompt", "w5 w6 w7 w8 w9", "--prompts", str(prompts),
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    want = hf_greedy(hf, [PROMPTS[0], PROMPTS[2]], 4)
    assert [r["token_ids"] for r in rows] == want
    assert rows[0]["completion"] == " ".join(f"w{t}" for t in want[0]) and not rows[0]["finished"]
