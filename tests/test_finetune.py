"""`megatrain finetune` end to end: a tiny Qwen2-shaped HF model with its own BPE tokenizer and ChatML template,
fine-tuned through the CLI on generated chats; the output loads and generates in `transformers`, and --resume
continues the run exactly. Bad inputs end with exit code 2 and one line. Config precedence without Ray."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatrain.config import MegatrainError
from megatrain.data import DataError, load_tokenizer
from pipelines.cli import main as cli
from pipelines.finetune import FINETUNE_DEFAULTS, finetune_config

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["red", "blue", "green", "gold", "fox", "owl", "cat", "dog", "sun", "moon", "star", "sky"]
OPPOSITE = dict(zip(WORDS, WORDS[::-1], strict=True))


def make_chats(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Learnable chats: a word's fixed partner, or the user's words repeated."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        if rng.random() < 0.5:
            word = rng.choice(WORDS)
            user, answer = f"opposite: {word}", OPPOSITE[word]
        else:
            words = rng.sample(WORDS, rng.randint(2, 4))
            user, answer = f"repeat: {' '.join(words)}", " ".join(words)
        chats.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
    return chats


def save_tokenizer(directory: Path, chats: list[list[dict[str, str]]]) -> int:
    """A byte-level BPE tokenizer.json trained on the chats, with Qwen2-style special tokens and config files;
    returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f"{m['role']}\n{m['content']}" for chat in chats for m in chat), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 512, "chat_template": CHATML}))
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIALS[1:]}))
    return tok.get_vocab_size()


def save_model(directory: Path, vocab_size: int) -> None:
    """A tiny Qwen2 (q/k/v bias, tied embeddings) saved by transformers, with a generation_config.json."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def chats() -> list[list[dict[str, str]]]:
    return make_chats(300)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory, chats) -> Path:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, chats) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    vocab = save_tokenizer(directory, chats)
    save_model(directory, 64 * -(-vocab // 64))  # embedding rows padded to a multiple of 64, like real models
    return directory


def steps_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def assistant_loss(model, tokenizer, chats: list[list[dict[str, str]]]) -> float:
    """transformers' loss on the assistant tokens of the chats (megatrain's masks, HF's model)."""
    total = 0.0
    for chat in chats:
        ids, mask = tokenizer.apply_chat(chat)
        labels = [i if m else -100 for i, m in zip(ids, mask, strict=True)]
        with torch.no_grad():
            total += model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
    return total / len(chats)


def test_finetune_cli_end_to_end_and_resume(ray_session, model_dir, chat_file, chats, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "sft"
    args = ["finetune", "--model", str(model_dir), "--data", str(chat_file), "--out", str(out), "--steps", "30",
            "--device", "cpu", "--precision", "fp32", "--batch-size", "4", "--seq-len", "64", "--lr", "3e-3",
            "--optimizer-workers", "1", "--eval-every", "10", "--checkpoint-every", "15", "--log-every", "10"]
    assert cli(args) == 0
    printed = capsys.readouterr().out
    evals = [float(line.rsplit(":", 1)[1]) for line in printed.splitlines() if "eval loss at step" in line]
    assert len(evals) == 3 and evals[-1] < evals[0], printed

    # the fine-tuning defaults under the flags: model's tokenizer, SFT on chats, a 10% eval split, cosine
    used = json.loads((out / "config.json").read_text())
    assert used["data"]["tokenizer"] == str(model_dir) and used["data"]["eval_fraction"] == 0.1
    assert used["lr"] == 3e-3 and used["warmup_steps"] == 1 and used["decay"] and used["min_lr_ratio"] == 0.0
    assert used["max_grad_norm"] == 1.0 and used["weight_decay"] == 0.0
    first = steps_log(out)
    assert [r["step"] for r in first] == list(range(30))
    assert max(r["tokens"] for r in first) < 4 * 64  # only assistant tokens are trained

    final = out / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (final / name).is_file(), name
    assert json.loads((final / "generation_config.json").read_text()) == json.loads(
        (model_dir / "generation_config.json").read_text())

    # transformers loads the result, sees the trained weights, and generates with the copied tokenizer
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    before = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    held = make_chats(20, seed=1)
    mt_tokenizer = load_tokenizer(str(final))
    assert assistant_loss(model, mt_tokenizer, held) < assistant_loss(before, mt_tokenizer, held)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "opposite: fox"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    assert prompt[0].tolist() == mt_tokenizer.apply_chat([{"role": "user", "content": "opposite: fox"}])[0] + \
        mt_tokenizer.encode("<|im_start|>assistant\n")
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > prompt.shape[1]
    assert isinstance(tokenizer.decode(generated[0, prompt.shape[1]:]), str)

    # --resume: drop the last checkpoint, continue from step 15; the same batches again, bit-identical losses
    shutil.rmtree(out / "checkpoints" / "step-00000030")
    assert cli([*args, "--resume"]) == 0
    resumed = steps_log(out)  # the resumed run replaced the records of steps 15-29 rather than adding them again
    assert [r["step"] for r in resumed] == list(range(30))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in first]
    assert (out / "checkpoints" / "step-00000030").is_dir() and (final / "model.safetensors").is_file()


@pytest.mark.slow  # CI: test_data_formats.py holds Alpaca records to the messages chats (ids, masks); above: the chats
def test_finetune_on_an_alpaca_json_file(ray_session, model_dir, chats, tmp_path):
    """An Alpaca export (a JSON array) trains like the messages chats: the data room turns each record into a
    chat, so the model's template, the assistant-only loss and the eval split apply unchanged."""
    records = [{"instruction": user["content"].split(": ")[0], "input": user["content"].split(": ")[1],
                "output": assistant["content"]} for user, assistant in chats]
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(records, indent=2))
    out = tmp_path / "sft"
    assert cli(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--steps", "2",
                "--device", "cpu", "--precision", "fp32", "--batch-size", "2", "--seq-len", "64",
                "--optimizer-workers", "1", "--eval-every", "2", "--log-every", "1"]) == 0
    log = steps_log(out)
    assert [r["step"] for r in log] == [0, 1]
    assert all(0 < r["tokens"] < 2 * 64 for r in log)  # only the assistant turns are trained
    assert (out / "final" / "model.safetensors").is_file()


def one_line_error(capsys, args: list[str]) -> str:
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megatrain: error: "), err
    return err


def test_bad_inputs_exit_2_with_one_line(model_dir, chat_file, chats, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out"), "--device", "cpu"]
    err = one_line_error(capsys, ["finetune", "--model", str(model_dir), "--data", str(tmp_path / "nope.jsonl"), *out])
    assert f"data file {tmp_path / 'nope.jsonl'} does not exist" in err

    err = one_line_error(capsys, ["finetune", "--model", str(tmp_path / "no-model"), "--data", str(chat_file), *out])
    assert f"model directory {tmp_path / 'no-model'} does not exist" in err

    small = tmp_path / "small-vocab"
    vocab = save_tokenizer(small, chats)
    save_model(small, 128)  # fewer embedding rows than the tokenizer has tokens
    err = one_line_error(capsys, ["finetune", "--model", str(small), "--data", str(chat_file), *out])
    assert f"has {vocab} tokens but the model's embedding has 128 rows" in err
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused before anything ran


# ---- the config, without Ray ----

def test_defaults_toml_and_flags(model_dir, chat_file, tmp_path):
    cfg = finetune_config(model_dir, chat_file, tmp_path / "a")
    assert (cfg.lr, cfg.steps, cfg.betas) == (FINETUNE_DEFAULTS["lr"], 1000, (0.9, 0.999))
    assert cfg.warmup_steps == 30 and cfg.eval_every == 100  # 3% of the steps; ten evaluations
    assert cfg.data.seq_len == 512  # min(1024, max_position_embeddings)
    assert cfg.data.tokenizer == str(model_dir) and cfg.data.sft is None  # sft: on for chats (the loader decides)

    toml = tmp_path / "ft.toml"
    toml.write_text('steps = 200\nlr = 1e-4\nwarmup_steps = 5\n[data]\neval_count = 10\nseq_len = 128\n')
    cfg = finetune_config(model_dir, chat_file, tmp_path / "b", config=toml, overrides={"lr": 5e-5, "steps": None})
    assert (cfg.steps, cfg.lr, cfg.warmup_steps, cfg.eval_every) == (200, 5e-5, 5, 20)
    assert (cfg.data.eval_count, cfg.data.eval_fraction, cfg.data.seq_len) == (10, 0.0, 128)

    cfg = finetune_config(model_dir, chat_file, tmp_path / "c", overrides={"data.eval_fraction": 0.0})
    assert cfg.eval_every == 0  # no split, no evaluation
    with pytest.raises(MegatrainError, match="no held-out split"):
        finetune_config(model_dir, chat_file, tmp_path / "d", overrides={"data.eval_fraction": 0.0, "eval_every": 5})
    with pytest.raises(MegatrainError, match="finetune needs a model"):
        finetune_config(None, chat_file, tmp_path / "e")


def test_record_format_from_the_toml(model_dir, chat_file, tmp_path):
    toml = tmp_path / "ft.toml"
    toml.write_text('[data]\nrecord_format = "sharegpt"\n')
    assert finetune_config(model_dir, chat_file, tmp_path / "a", config=toml).data.record_format == "sharegpt"
    toml.write_text('[data]\nrecord_format = "jsonl"\n')
    with pytest.raises(MegatrainError, match="record_format must be one of messages, alpaca, sharegpt"):
        finetune_config(model_dir, chat_file, tmp_path / "b", config=toml)


def test_tokenizer_fallback_to_bytes_only_when_it_fits(model_dir, chat_file, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    assert finetune_config(bare, chat_file, tmp_path / "a").data.tokenizer == "byte"  # 384 rows >= 260
    hf = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**hf, "vocab_size": 128}))
    with pytest.raises(DataError, match="has no tokenizer.json and its vocabulary \\(128 tokens\\)"):
        finetune_config(bare, chat_file, tmp_path / "b")
