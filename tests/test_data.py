"""The data room without Ray: tokenizers, sources, packing and masks, resume, and bad-data messages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import CHATML, error

from megatrain.config import ConfigError
from megatrain.data import (
    IGNORE,
    BatchLoader,
    ByteTokenizer,
    DataConfig,
    DataError,
    HFTokenizer,
    load_tokenizer,
    open_source,
)

BOS, EOS, PAD = 256, 257, 258
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "And again?"},
    {"role": "assistant", "content": "hello again"},
]


# ---- helpers ----

def enc(text: str) -> list[int]:
    return list(text.encode())


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def loader(**kw) -> BatchLoader:
    kw = {"batch_size": 1, "seq_len": 64, "shuffle": False, "epochs": 1, **kw}
    return BatchLoader(DataConfig(**kw))


def drain(ld: BatchLoader, limit: int = 10_000) -> list[dict[str, np.ndarray]]:
    out = []
    for _ in range(limit):
        try:
            out.append(ld.next_batch())
        except StopIteration:
            break
    return out


def row_texts(batches: list[dict[str, np.ndarray]]) -> list[str]:
    """Each row of each batch decoded by the byte tokenizer (one document per row with pack=False)."""
    tok = ByteTokenizer()
    return [tok.decode(row) for b in batches for row in b["input_ids"]]


def same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["labels"], y["labels"])
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A real byte-level BPE tokenizer.json plus a tokenizer_config.json with a ChatML Jinja template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, hello again", "Be brief. Say hello. And again?"] * 20, trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>",
        "chat_template": CHATML,
    }))
    return d


# ---- tokenizers ----

def test_byte_tokenizer():
    tok = load_tokenizer("byte")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (260, 256, 257, 258)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([BOS, 104, 195, 169, EOS, PAD]) == "hé"


def test_plain_chat_format_with_byte_tokenizer():
    ids, mask = ByteTokenizer().apply_chat(CHAT[:3])
    prompt = enc("<|system|>\nBe brief.\n<|user|>\nSay hello.\n<|assistant|>\n")
    assert ids == prompt + enc("hello world") + [EOS]
    assert mask == [False] * len(prompt) + [True] * (len("hello world") + 1)


def test_byte_tokenizer_with_jinja_template():
    ids, mask = ByteTokenizer(CHATML).apply_chat(CHAT[1:3])
    text = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\nhello world<|im_end|>\n"
    assert ids == enc(text)
    trained = bytes(i for i, m in zip(ids, mask, strict=True) if m).decode()
    assert trained == "hello world<|im_end|>\n"  # the assistant header is prompt, its closing tag is trained


def test_chat_template_errors_are_one_sentence():
    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}" \
             "{% endif %}{{ m['content'] }}{% endfor %}"
    message = error(ByteTokenizer(strict).apply_chat, CHAT)
    assert message == ("the chat template rejected a conversation (no system role); fix the messages or the "
                       "template.")
    last_turn_only = "{{ messages[-1]['content'] }}"  # not prefix-stable: assistant turns cannot be found
    message = error(ByteTokenizer(last_turn_only).apply_chat, CHAT)
    assert "renders a conversation's prefix differently" in message


def test_hf_tokenizer_ids_and_template(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(str(tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert 260 < tok.vocab_size <= 300  # 256 byte symbols + 6 specials + the merges the corpus allowed
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.encode("<s>hi")[0] == 1 and 1 not in tok.encode("hi")  # encode adds no special tokens itself

    ids, mask = tok.apply_chat(CHAT)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    reference.chat_template = CHATML
    assert ids == list(reference.apply_chat_template(CHAT, tokenize=True)["input_ids"])
    # token by token: the mask is on exactly the two assistant turns (content + closing tag + newline)
    runs, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs.append(current) if current else None
    assert [tok.decode(r) for r in runs] == ["hello world<|im_end|>\n", "hello again<|im_end|>\n"]
    assert not mask[0] and ids[0] == tok.bos_id


def test_hf_tokenizer_from_file_with_config_json_ids(tokenizer_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # pad falls back to eos
    assert tok.chat_template is None
    ids, mask = tok.apply_chat(CHAT[1:3])  # the plain format
    assert ids == tok.encode("<|user|>\n") + tok.encode("Say hello.") + tok.encode("\n") + \
        tok.encode("<|assistant|>\n") + tok.encode("hello world") + [2]
    assert sum(mask) == len(tok.encode("hello world")) + 1
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert load_tokenizer(str(tmp_path)).chat_template == CHATML
    # an explicit null in tokenizer_config.json wins over config.json (Qwen: no BOS): none is added
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id) == (None, 2)
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    ids = loader(source=str(src), tokenizer=str(tmp_path), pack=False).next_batch()["input_ids"][0]
    assert ids[: len(tok.encode("hello")) + 1].tolist() == tok.encode("hello") + [2]


def test_hf_sft_sample_keeps_template_bos_and_trains_closing_eos(tokenizer_dir, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    ld = loader(source=str(src), tokenizer=str(tokenizer_dir), seq_len=128, pack=False)
    assert ld.sft
    batch = ld.next_batch()
    tok = ld.tokenizer
    ids, mask = tok.apply_chat(CHAT)
    n = len(ids) + 1  # the template starts with <s> already: only EOS is added
    assert batch["input_ids"][0, :n].tolist() == ids + [tok.eos_id]
    labels = [i if m else IGNORE for i, m in zip(ids, mask, strict=True)]
    assert batch["labels"][0, :n].tolist() == labels + [tok.eos_id]
    assert (batch["input_ids"][0, n:] == tok.pad_id).all() and (batch["labels"][0, n:] == IGNORE).all()


# ---- sources ----

def test_synthetic_is_deterministic_and_seeded():
    a = drain(BatchLoader(DataConfig(batch_size=2, seq_len=32, seed=1)), 5)
    b = drain(BatchLoader(DataConfig(batch_size=2, seq_len=32, seed=1)), 5)
    c = drain(BatchLoader(DataConfig(batch_size=2, seq_len=32, seed=2)), 5)
    assert same(a, b) and not same(a, c)
    assert a[0]["input_ids"].dtype == np.int64 and a[0]["input_ids"].shape == (2, 32)
    assert np.array_equal(a[0]["input_ids"], a[0]["labels"])  # pretraining: labels = inputs, unshifted


def test_synthetic_data_is_learnable_in_100_steps():
    """A tiny next-token model (the last 8 tokens -> MLP) more than halves its loss in 100 steps."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on a shared 2-core machine
    try:
        torch.manual_seed(0)
        ld = BatchLoader(DataConfig(batch_size=8, seq_len=64, vocab_size=260))
        k, d = 8, 32
        emb = torch.nn.Embedding(260, d)
        mlp = torch.nn.Sequential(torch.nn.Linear(k * d, 128), torch.nn.ReLU(), torch.nn.Linear(128, 260))
        opt = torch.optim.Adam([*emb.parameters(), *mlp.parameters()], lr=3e-3, foreach=True)
        losses = []
        for _ in range(100):
            b = ld.next_batch()
            x, y = torch.from_numpy(b["input_ids"]), torch.from_numpy(b["labels"])
            context = torch.nn.functional.pad(x, (k - 1, 0), value=PAD).unfold(1, k, 1)  # [B, S, k]
            logits = mlp(emb(context).flatten(2))
            # labels are unshifted: position t predicts labels[t + 1]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 260), y[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 5.0 and np.mean(losses[-10:]) < 2.5, (losses[0], losses[-10:])


def test_text_folder_paragraphs_and_files(tmp_path):
    (tmp_path / "a.txt").write_text("first para\n\nsecond para\nline two\n \n\n\nthird\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("fourth")
    (tmp_path / ".hidden.txt").write_text("never read")
    (tmp_path / "empty.txt").write_text("")
    docs = ["first para", "second para\nline two", "third", "fourth"]
    for shard_bytes in (1 << 20, 1):  # one shard per file, or one per paragraph: the same documents
        ld = loader(source=str(tmp_path), pack=False, shard_bytes=shard_bytes)
        assert row_texts(drain(ld)) == docs
    fmt, source = open_source(DataConfig(source=str(tmp_path), shard_bytes=1))
    assert fmt == "text" and [d.where.rsplit("/", 1)[-1] for d in source.read_shard(1)] == ["a.txt line 3"]
    ld = loader(source=str(tmp_path), pack=False, text_split="file")
    assert row_texts(drain(ld)) == ["first para\n\nsecond para\nline two\n \n\n\nthird\n", "fourth"]


def test_jsonl_text_chat_and_token_ids(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc", "id": 1}, {"text": [5, 6, 7]}, {"text": ""}])
    assert row_texts(drain(loader(source=str(src), pack=False))) == ["abc", "\x05\x06\x07"]
    chat = write_jsonl(tmp_path / "c.ndjson", [{"conv": CHAT[1:3]}])
    ld = loader(source=str(chat), messages_field="conv", pack=False)
    assert ld.sft and row_texts(drain(ld)) == ["<|user|>\nSay hello.\n<|assistant|>\nhello world"]
    both = write_jsonl(tmp_path / "b.jsonl", [{"text": "plain", "messages": CHAT[1:3]}])
    assert loader(source=str(both)).sft and not loader(source=str(both), sft=False).sft
    assert row_texts(drain(loader(source=str(both), sft=False, pack=False))) == ["plain"]


def test_parquet_row_groups_columns_and_types(tmp_path):
    texts = [f"doc {i}" for i in range(7)]
    pq.write_table(pa.table({"id": list(range(7)), "body": texts}), tmp_path / "t.parquet", row_group_size=2)
    ld = loader(source=str(tmp_path / "t.parquet"), column="body", pack=False)
    assert ld.source.num_shards == 4 and row_texts(drain(ld)) == texts
    pq.write_table(pa.table({"tokens": [[1, 2], [3]]}), tmp_path / "ids.parquet")
    assert row_texts(drain(loader(source=str(tmp_path / "ids.parquet"), column="tokens", pack=False))) == [
        "\x01\x02", "\x03"]
    pq.write_table(pa.table({"messages": [CHAT[1:3]]}), tmp_path / "chat.parquet")
    ld = loader(source=str(tmp_path / "chat.parquet"), pack=False)
    assert ld.sft and row_texts(drain(ld)) == ["<|user|>\nSay hello.\n<|assistant|>\nhello world"]


@pytest.mark.parametrize("stream_format", [False, True])
def test_arrow_ipc_file_and_stream(tmp_path, stream_format):
    table = pa.table({"text": [f"row {i}" for i in range(5)]})
    path = tmp_path / ("d.arrows" if stream_format else "d.arrow")
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream_format else pa.ipc.new_file)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
        writer.close()
    ld = loader(source=str(path), pack=False)
    assert ld.source.num_shards == 3 and row_texts(drain(ld)) == [f"row {i}" for i in range(5)]


# ---- shuffle, epochs, eval split ----

@pytest.fixture
def twenty_docs(tmp_path) -> Path:
    return write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i:02d}"} for i in range(20)])


def test_shuffle_epochs_and_end(twenty_docs):
    ld = loader(source=str(twenty_docs), pack=False, shuffle=True, epochs=2, seed=3, shard_bytes=40)
    assert ld.source.num_shards > 3
    rows = row_texts(drain(ld))
    first, second = rows[:20], rows[20:]
    assert sorted(first) == sorted(second) == [f"doc {i:02d}" for i in range(20)]
    assert first != second and first != sorted(first)  # a new order each epoch
    with pytest.raises(StopIteration):
        ld.next_batch()
    other = loader(source=str(twenty_docs), pack=False, shuffle=True, seed=4, shard_bytes=40)
    other_seed = row_texts(drain(other))
    assert other_seed != first


def test_eval_split_by_count_and_fraction(twenty_docs):
    ld = loader(source=str(twenty_docs), pack=False, eval_count=3, shuffle=True)
    assert row_texts(list(ld.eval_batches())) == ["doc 00", "doc 01", "doc 02"]
    assert sorted(row_texts(drain(ld))) == [f"doc {i:02d}" for i in range(3, 20)]

    def split(seed: int) -> tuple[list[str], list[str]]:
        ld = loader(source=str(twenty_docs), pack=False, eval_fraction=0.3, shuffle=True, seed=seed,
                    shard_bytes=40)
        return row_texts(list(ld.eval_batches())), row_texts(drain(ld))

    held, train = split(0)
    assert 0 < len(held) < 20 and sorted(held + train) == [f"doc {i:02d}" for i in range(20)]
    assert split(9)[0] == held  # the split ignores the shuffle seed
    assert row_texts(list(loader(source=str(twenty_docs), pack=False).eval_batches())) == []


# ---- packing and masks, token by token ----

def test_packing_token_by_token(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cde"}])
    rows = [b["input_ids"][0].tolist() for b in drain(loader(source=str(src), seq_len=4))]
    assert rows == [[BOS, 97, 98, EOS], [BOS, 99, 100, 101], [EOS, PAD, PAD, PAD]]
    batches = drain(loader(source=str(src), seq_len=4, batch_size=2))
    assert len(batches) == 2
    assert batches[0]["labels"].tolist() == [[BOS, 97, 98, EOS], [BOS, 99, 100, 101]]
    assert batches[1]["input_ids"].tolist() == [[EOS, PAD, PAD, PAD], [PAD] * 4]
    assert batches[1]["labels"].tolist() == [[EOS, IGNORE, IGNORE, IGNORE], [IGNORE] * 4]


def test_padding_mode_and_truncation(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "ab"}, {"text": "cdefg"}])
    batch = drain(loader(source=str(src), seq_len=5, batch_size=2, pack=False))[0]
    assert batch["input_ids"].tolist() == [[BOS, 97, 98, EOS, PAD], [BOS, 99, 100, 101, 102]]
    assert batch["labels"].tolist() == [[BOS, 97, 98, EOS, IGNORE], [BOS, 99, 100, 101, 102]]
    message = error(drain, loader(source=str(src), seq_len=5, pack=False, truncation=False))
    assert f"{src} line 2 is 7 tokens long, more than seq_len=5" in message


def test_sft_masks_token_by_token(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    batch = loader(source=str(src), seq_len=160, pack=False).next_batch()
    parts = [  # (tokens, trained?)
        ([BOS], False),
        (enc("<|system|>\nBe brief.\n<|user|>\nSay hello.\n<|assistant|>\n"), False),
        (enc("hello world") + [EOS], True),
        (enc("<|user|>\nAnd again?\n<|assistant|>\n"), False),
        (enc("hello again") + [EOS], True),
    ]
    ids = [t for toks, _ in parts for t in toks]
    labels = [t if trained else IGNORE for toks, trained in parts for t in toks]
    n = len(ids)
    assert batch["input_ids"][0].tolist() == ids + [PAD] * (160 - n)
    assert batch["labels"][0].tolist() == labels + [IGNORE] * (160 - n)
    full = loader(source=str(src), seq_len=160, pack=False, sft=False).next_batch()
    assert full["labels"][0, :n].tolist() == ids  # sft=False: every token of the chat is trained


# ---- exact resume ----

@pytest.fixture
def resume_sources(tmp_path) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    texts = [" ".join(["word"] * int(rng.integers(1, 30))) + f" {i}" for i in range(40)]
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    chat = lambda t: [{"role": "user", "content": t[:9]}, {"role": "assistant", "content": t}]
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat(t)} for t in texts])
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=7)
    return {
        "synthetic-packed": dict(seq_len=16, batch_size=3, epochs=None),
        "jsonl-padded": dict(source=str(jsonl), pack=False, batch_size=3, seq_len=64, epochs=3,
                             shard_bytes=200),
        "sft-packed": dict(source=str(chats), seq_len=24, batch_size=2, epochs=2, shard_bytes=300),
        "parquet-packed-eval": dict(source=str(tmp_path / "t.parquet"), seq_len=32, batch_size=2, epochs=3,
                                    eval_fraction=0.2),
    }


@pytest.mark.parametrize("name", ["synthetic-packed", "jsonl-padded", "sft-packed", "parquet-packed-eval"])
def test_resume_yields_the_same_batches(resume_sources, name):
    kw = {"shuffle": True, "seed": 5, **resume_sources[name]}
    reference = drain(BatchLoader(DataConfig(**kw)), 60)
    assert len(reference) > 12
    for cut in (1, 5, 12):
        ld = BatchLoader(DataConfig(**kw))
        assert same(drain(ld, cut), reference[:cut])
        state = json.loads(json.dumps(ld.state_dict()))  # plain JSON
        assert state["batches"] == cut
        resumed = BatchLoader(DataConfig(**kw))
        resumed.load_state_dict(state)
        assert same(drain(resumed, 60 - cut), reference[cut:])


def test_resume_refuses_a_different_setup():
    ld = BatchLoader(DataConfig(seq_len=8))
    ld.next_batch()
    message = error(BatchLoader(DataConfig(seq_len=16)).load_state_dict, ld.state_dict())
    assert "made with seq_len=8 but this loader has seq_len=16" in message


# ---- bad data: one sentence each ----

def test_missing_and_empty_sources(tmp_path):
    assert "does not exist" in error(loader, source=str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    assert f"{tmp_path / 'empty.jsonl'} is empty" in error(loader, source=str(tmp_path / "empty.jsonl"))
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    assert "holds no documents" in error(loader, source=str(tmp_path / "blank.txt"))
    (tmp_path / "dir").mkdir()
    assert "folder" in error(loader, source=str(tmp_path / "dir")) and "is empty" in error(
        loader, source=str(tmp_path / "dir"))
    (tmp_path / "dir" / "x.bin").write_bytes(b"x")
    assert "holds no data files" in error(loader, source=str(tmp_path / "dir"))
    (tmp_path / "dir" / "a.txt").write_text("a")
    (tmp_path / "dir" / "b.jsonl").write_text('{"text": "b"}\n')
    assert "holds text and jsonl files; set format" in error(loader, source=str(tmp_path / "dir"))
    assert row_texts(drain(loader(source=str(tmp_path / "dir"), format="jsonl", pack=False))) == ["b"]


def test_unknown_column_and_field(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "id": [1]}), tmp_path / "t.parquet")
    message = error(loader, source=str(tmp_path / "t.parquet"), column="body")
    assert "has no column 'body' (its columns are: text, id)" in message
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "u.parquet")
    assert "its columns are: body" in error(loader, source=str(tmp_path / "u.parquet"))
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "completion": "a"}])
    message = error(loader, source=str(src))
    assert "line 1 has no 'messages' or 'text' field (its fields are: prompt, completion)" in message


def test_tokenizer_larger_than_the_model(tokenizer_dir):
    message = error(loader, tokenizer=str(tokenizer_dir), vocab_size=260)
    n = load_tokenizer(str(tokenizer_dir)).vocab_size
    assert f"has {n} tokens but the model's embedding has 260 rows" in message
    assert "no tokenizer at" in error(load_tokenizer, str(tokenizer_dir / "missing"))


def test_token_ids_out_of_range(tmp_path):
    src = write_jsonl(tmp_path / "ids.jsonl", [{"text": [1, 2]}, {"text": [1, 999]}])
    message = error(drain, loader(source=str(src), vocab_size=260))
    assert f"{src} line 2 has token id 999, outside the model's vocabulary [0, 260)" in message


def test_malformed_json_and_messages(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "broken",\n')
    assert f"{bad} line 3 is not valid JSON" in error(lambda: drain(loader(source=str(bad))))
    arr = tmp_path / "arr.json"
    arr.write_text('[{"text": "a"}, {"text": "b"},]')
    assert f"{arr} is not a valid JSON array (a comma before ']' at line 1)" in error(loader, source=str(arr))
    arr.write_text('[{"text": "a"},\n "b"]')
    assert f"{arr} record 2 (line 2) holds a JSON str, not an object" in error(loader, source=str(arr))
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant"}]}])
    message = error(loader, source=str(chat))
    assert f"{chat} line 1: messages entry 1 needs a string 'content' but has none (its keys are: role)" in message
    chat = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": 5}]}])
    assert "messages entry 0 needs a string 'content' but has a int" in error(loader, source=str(chat))
    twice = write_jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                               {"messages": '[{"role": "user", "content": "hi"}]'}])
    assert f"{twice} line 2: 'messages' holds a string, not a list of {{role, content}} messages" in \
        error(lambda: drain(loader(source=str(twice))))
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}])
    assert "sft is on but" in error(drain, loader(source=str(text), sft=True))


def test_config_and_split_errors(twenty_docs):
    assert "not both" in error(DataConfig, eval_fraction=0.1, eval_count=2)
    assert "epochs" in error(DataConfig, epochs=0)
    assert "holds out all 20 documents" in error(loader, source=str(twenty_docs), eval_count=20)
    with pytest.raises(ConfigError):
        DataConfig(format="csv")


@pytest.mark.parametrize(("field", "value"), [
    ("shuffle", "no"), ("shuffle", 0), ("pack", 1), ("pack", None), ("truncation", "false"), ("sft", "yes"),
    ("sft", 1), ("source", 5), ("tokenizer", None), ("text_field", ["text"]), ("messages_field", 0),
    ("column", 3), ("chat_template", b"{{ x }}"), ("format", 1), ("text_split", None),
    ("batch_size", True), ("seq_len", 8.0), ("seed", "1"), ("epochs", False), ("eval_count", 1.0),
    ("synthetic_docs", "10"), ("shard_bytes", None), ("vocab_size", 260.0),
    ("eval_fraction", "0.1"), ("eval_fraction", True), ("eval_fraction", 1.0), ("eval_fraction", float("nan")),
])
def test_config_fields_are_type_checked(field, value):
    message = error(DataConfig, **{field: value})
    assert message.startswith(f"data config: {field} must be "), message


def test_config_accepts_paths_and_plain_numbers(tmp_path):
    cfg = DataConfig(source=tmp_path, tokenizer=Path("byte"), chat_template=tmp_path / "t.jinja",
                     eval_fraction=0, sft=False, column="text")
    assert cfg.source == str(tmp_path) and cfg.tokenizer == "byte" and cfg.chat_template.endswith("t.jinja")
    json.dumps(cfg.to_dict())  # paths came in, strings are stored: the config stays JSON-able


def test_missing_tokenizers_package(tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert "needs the `tokenizers` package" in error(load_tokenizer, str(tokenizer_dir))
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError):
        HFTokenizer(tokenizer_dir)
