"""Alpaca and ShareGPT records, in JSON arrays, JSON Lines, Parquet and Arrow: the same batches as the
equivalent `messages` chats (ids and loss masks, plain format and a Jinja template, shuffled shards, the eval
split, resume), the JSON array reader against json.load, and one sentence for each record that does not fit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import CHATML, error  # a ChatML template with BOS; a one-sentence MegatrainError's message

import megatrain.data.json_array as json_array
from megatrain.config import ConfigError
from megatrain.data import IGNORE, BatchLoader, DataConfig

# Each record, and the messages chat it must train exactly like.
ALPACA = [
    ({"instruction": "Say hello.", "input": "", "output": "hello world"},
     [("user", "Say hello."), ("assistant", "hello world")]),
    ({"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "Be brief."},
     [("system", "Be brief."), ("user", "Translate.\nbonjour"), ("assistant", "hello")]),
    ({"instruction": "And again?", "input": None, "output": "hello again", "system": None,
      "history": [["Say hello.", "hello"], ["Louder.", "HELLO"]]},
     [("user", "Say hello."), ("assistant", "hello"), ("user", "Louder."), ("assistant", "HELLO"),
      ("user", "And again?"), ("assistant", "hello again")]),
    ({"instruction": "", "input": "only an input", "output": ""},
     [("user", "only an input"), ("assistant", "")]),
]
SHAREGPT = [
    ({"conversations": [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "hello world"}]},
     [("user", "Say hello."), ("assistant", "hello world")]),
    ({"system": "Be brief.", "conversations": [{"from": "user", "value": "Hi?"}, {"from": "assistant", "value": "hi"},
                                               {"from": "human", "value": "Bye?"}, {"from": "gpt", "value": "bye"}]},
     [("system", "Be brief."), ("user", "Hi?"), ("assistant", "hi"), ("user", "Bye?"), ("assistant", "bye")]),
    ({"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "one"},
                        {"from": "human", "value": "two"}, {"from": "gpt", "value": "three"}]},  # kept, as in messages
     [("system", "Be kind."), ("user", "one"), ("user", "two"), ("assistant", "three")]),
    ({"system": "", "conversations": [{"from": "human", "value": "Count."}, {"from": "gpt", "value": "1 2 3"}]},
     [("user", "Count."), ("assistant", "1 2 3")]),
]
CASES = {"alpaca": ALPACA, "sharegpt": SHAREGPT}


def as_messages(turns: list[tuple[str, str]]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def write(path: Path, records: list, array: bool) -> Path:
    """A JSON array (pretty-printed, as exports are) or JSON Lines."""
    path.write_text(json.dumps(records, indent=2) if array else "".join(json.dumps(r) + "\n" for r in records))
    return path


def config(**kw) -> DataConfig:
    return DataConfig(**{"batch_size": 2, "seq_len": 48, "shuffle": False, "epochs": 1, **kw})


def batches(**kw) -> list[dict[str, np.ndarray]]:
    return list(BatchLoader(config(**kw)))


def assert_same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
        np.testing.assert_array_equal(x["labels"], y["labels"])


def first_error(path: Path, **kw) -> str:
    """The error of reading a whole file (at open for the first record, while reading for the others)."""
    return error(lambda: batches(source=str(path), **kw))


# ---- the same samples as the messages format ----

@pytest.mark.parametrize("template", [None, CHATML], ids=["plain", "chatml"])
@pytest.mark.parametrize("array", [True, False], ids=["json", "jsonl"])
@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
def test_same_ids_and_masks_as_messages(tmp_path, fmt, array, template):
    records = CASES[fmt] * 3
    data = write(tmp_path / ("d.json" if array else "d.jsonl"), [r for r, _ in records], array)
    chats = write(tmp_path / "m.jsonl", [as_messages(t) for _, t in records], array=False)
    for pack in (True, False):
        mine = batches(source=str(data), chat_template=template, pack=pack)
        assert_same(mine, batches(source=str(chats), chat_template=template, pack=pack))
        assert BatchLoader(DataConfig(source=str(data))).sft  # chats: loss on the assistant turns only
    first = batches(source=str(data), chat_template=template, pack=False, batch_size=1, seq_len=96)[0]
    trained = bytes(int(t) for t in first["labels"][0] if 0 <= t < 256).decode()
    assert trained == ("hello world<|im_end|>\n" if template else "hello world")
    assert (first["labels"] == IGNORE).sum() > 0


def test_shuffled_shards_eval_split_and_resume_match_messages(tmp_path):
    """One record per shard in both files: the shard order, the eval split and resume are the messages path's."""
    records = []
    for i in range(40):
        prompt, answer = ("x" * (i % 7), f"{i} " * (1 + i % 5))
        user = f"Repeat {i}." + (f"\n{prompt}" if prompt else "")
        records.append(({"instruction": f"Repeat {i}.", "input": prompt, "output": answer},
                        [("user", user), ("assistant", answer)]))
    data = write(tmp_path / "a.json", [r for r, _ in records], array=True)
    chats = write(tmp_path / "m.jsonl", [as_messages(t) for _, t in records], array=False)
    kw = {"shuffle": True, "seed": 3, "epochs": 2, "shard_bytes": 1, "eval_fraction": 0.2, "seq_len": 24}
    reference = batches(source=str(data), **kw)
    assert_same(reference, batches(source=str(chats), **kw))
    evals = [list(BatchLoader(config(source=str(s), **kw)).eval_batches()) for s in (data, chats)]
    assert_same(*evals)

    for cut in (1, 7):
        ld = BatchLoader(config(source=str(data), **kw))
        head = [ld.next_batch() for _ in range(cut)]
        resumed = BatchLoader(config(source=str(data), **kw))
        resumed.load_state_dict(json.loads(json.dumps(ld.state_dict())))
        assert_same(head + list(resumed), reference)


def test_a_folder_reads_each_file_in_its_own_format(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write(folder / "a.json", [r for r, _ in ALPACA], array=True)
    write(folder / "b.jsonl", [r for r, _ in SHAREGPT], array=False)
    write(folder / "c.jsonl", [as_messages(t) for _, t in ALPACA[:1]], array=False)
    chats = write(tmp_path / "m.jsonl", [as_messages(t) for _, t in [*ALPACA, *SHAREGPT, *ALPACA[:1]]], array=False)
    assert_same(batches(source=str(folder)), batches(source=str(chats)))


def test_record_format_forces_a_format(tmp_path):
    # the Stanford Alpaca release also stores each prompt rendered as `text`: detected as Alpaca (a chat), read
    # as text when forced to the messages format, or when sft=False prefers text as it always has
    record = {"instruction": "Say hello.", "input": "", "output": "hello", "text": "### Instruction: Say hello."}
    data = write(tmp_path / "t.jsonl", [record], array=False)
    alpaca = batches(source=str(data), pack=False, batch_size=1)
    assert_same(alpaca, batches(source=str(data), pack=False, batch_size=1, record_format="alpaca"))
    for kw in ({"record_format": "messages"}, {"sft": False}):
        row = batches(source=str(data), pack=False, batch_size=1, **kw)[0]["input_ids"][0]
        assert bytes(int(t) for t in row if t < 256).decode() == record["text"]
    # `output` beside a text field is not an Alpaca record: it reads as text, as before
    data = write(tmp_path / "o.jsonl", [{"text": "plain", "output": "x"}], array=False)
    row = batches(source=str(data), pack=False, batch_size=1)[0]["input_ids"][0]
    assert bytes(int(t) for t in row if t < 256).decode() == "plain"
    assert "record_format must be one of messages, alpaca, sharegpt" in error(DataConfig, record_format="csv")
    with pytest.raises(ConfigError):
        DataConfig(record_format=1)
    (tmp_path / "t.txt").write_text("plain")
    assert "record_format applies to JSON, JSON Lines, Parquet and Arrow files but" in first_error(
        tmp_path / "t.txt", record_format="alpaca")


@pytest.mark.parametrize("container", ["parquet", "arrow"])
@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
def test_parquet_and_arrow_rows_are_records(tmp_path, fmt, container):
    """Columns instead of keys: each row is a record (missing values are nulls), read by record batch."""
    records = CASES[fmt] * 2
    keys = {k: None for r, _ in records for k in r}  # from_pylist takes its columns from the first row
    table = pa.Table.from_pylist([{**keys, **r} for r, _ in records])
    path = tmp_path / f"d.{container}"
    if container == "parquet":
        pq.write_table(table, path, row_group_size=3)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
    chats = write(tmp_path / "m.jsonl", [as_messages(t) for _, t in records], array=False)
    assert_same(batches(source=str(path)), batches(source=str(chats)))
    assert BatchLoader(config(source=str(path))).source.num_shards == 3

    pq.write_table(pa.table({"instruction": ["a"], "text": ["b"]}), tmp_path / "i.parquet")
    message = first_error(tmp_path / "i.parquet")
    assert "i.parquet has no 'output' column (its columns are: instruction, text); an Alpaca file needs " \
        "instruction and output columns." in message
    assert_same(batches(source=str(tmp_path / "i.parquet"), column="text"),  # a named column: as before
                batches(source=str(write(tmp_path / "t.jsonl", [{"text": "b"}], array=False))))
    pq.write_table(pa.table({"instruction": ["a"], "output": [None]}), tmp_path / "n.parquet")
    assert "n.parquet row 0: an Alpaca record needs a string 'output' but has a NoneType" in first_error(
        tmp_path / "n.parquet")


# ---- records that do not fit: one sentence, naming the record and the field ----

@pytest.mark.parametrize("array", [True, False], ids=["json", "jsonl"])
def test_bad_records(tmp_path, array):
    path = tmp_path / ("d.json" if array else "d.jsonl")
    ok_alpaca, ok_sharegpt = ALPACA[0][0], SHAREGPT[0][0]
    second = "record 2 (line 7)" if array else "line 2"  # a pretty-printed Alpaca record spans 5 lines

    def fails(*records: dict, **kw) -> str:
        return first_error(write(path, list(records), array), **kw)

    message = fails(ok_alpaca, {"instruction": "No output."})
    assert f"{path} {second}: an Alpaca record needs a string 'output' but has none (its fields are: instruction)" \
        in message
    assert "an Alpaca record needs a string 'instruction' but has a int" in fails({"instruction": 3, "output": "x"})
    message = fails({"instruction": "a", "input": ["b"], "output": ""})
    assert "Alpaca field 'input' holds a list, not a string" in message
    assert "Alpaca field 'history' is not a list of [instruction, output] string pairs" in fails(
        {"instruction": "a", "output": "b", "history": [["only one"]]})

    message = fails(ok_alpaca, ok_sharegpt)
    first = f"{path} record 1 (line 2)" if array else f"{path} line 1"
    assert f"{path} {second} is a ShareGPT record but {first} is an Alpaca record; a file holds one record format" \
        in message
    message = fails(ok_alpaca, {"prompt": "p", "completion": "c"})
    assert f"{second} has no 'instruction' or 'output' field (its fields are: prompt, completion); {first} is an " \
        "Alpaca record" in message
    assert "is an Alpaca record but" in fails(as_messages(ALPACA[0][1]), ok_alpaca)

    bad_role = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "hello"}]}
    message = fails(bad_role)
    assert "conversations entry 1 is from 'bing', not one of system, human, user, gpt, assistant" in message
    message = fails({"conversations": [{"from": "human"}]})
    assert "conversations entry 0 needs a string 'value' but has none (its keys are: from)" in message
    assert "entry 0 needs a string 'from' but has a NoneType" in fails({"conversations": [{"from": None, "value": ""}]})
    assert "'conversations' holds a str, not a list of {from, value} turns" in fails({"conversations": "hi"})
    message = fails({"system": "A.", "conversations": [{"from": "system", "value": "B."}, *bad_role["conversations"]]})
    assert "has both a top-level 'system' and a system turn (conversations entry 0); keep one of them" in message

    message = fails(ok_alpaca, record_format="sharegpt")
    assert f"{first} has no 'conversations' field (its fields are: instruction, input, output); record_format is " \
        "'sharegpt'" in message
    message = fails({"prompt": "p"})
    assert "has no 'messages' or 'text' field (its fields are: prompt); set text_field or messages_field" in message
    assert "or write Alpaca (instruction, output) or ShareGPT (conversations) records" in message


def test_empty_conversations_are_skipped(tmp_path):
    data = write(tmp_path / "s.jsonl", [{"conversations": []}, SHAREGPT[0][0], {"conversations": None}], array=False)
    assert_same(batches(source=str(data)), batches(source=str(write(
        tmp_path / "m.jsonl", [as_messages(SHAREGPT[0][1])], array=False))))


# ---- the JSON array reader ----

def random_value(rng: random.Random, depth: int = 0):
    if depth > 2 or rng.random() < 0.3:
        return rng.choice([1, -2.5e-3, 12345678901234, True, False, None, "é😀\\\"x\n", "", "ascii", "\u4e2d"])
    if rng.random() < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}é": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def test_json_array_reader_matches_json_load(tmp_path, monkeypatch):
    """Reads of a few bytes cut values (numbers, literals, escapes, multi-byte characters) everywhere."""
    rng = random.Random(0)
    path = tmp_path / "a.json"
    for trial in range(150):
        monkeypatch.setattr(json_array, "_READ_BYTES", rng.choice([1, 2, 3, 7, 64, 1 << 20]))
        records = [{"text": f"doc {i}", "x": random_value(rng)} for i in range(rng.randint(0, 9))]
        text = json.dumps(records, indent=rng.choice([None, 1, "\t"]), ensure_ascii=rng.random() < 0.5)
        path.write_text(("\ufeff \n" if trial % 3 == 0 else "") + text + "\n", encoding="utf-8")
        shard_bytes = rng.choice([1, 50, 1 << 20])
        shards, first = json_array.array_shards(path, shard_bytes)
        read = [r for shard in shards for r in json_array.array_records(path, *shard)]
        assert [value for value, _ in read] == json.loads(path.read_text(encoding="utf-8-sig")), trial
        assert first == (read[0] if read else None)
        if shard_bytes == 1:
            assert len(shards) == len(records)
        lines = path.read_text(encoding="utf-8-sig").splitlines()
        for n, (_, where) in enumerate(read, start=1):  # the line named is where the record starts
            line = int(where.rsplit("line ", 1)[1].rstrip(")"))
            assert where.startswith(f"{path} record {n} ") and lines[line - 1].lstrip(" \t[,").startswith("{"), where


@pytest.mark.parametrize(("text", "what"), [
    ('[{"text": "a"},\n{"text": "b"},]', "a comma before ']' at line 2"),
    ('[{"text": "a"} {"text": "b"}]', "expected ',' or ']' after an element at line 1"),
    ('[{"text": "a"},\n{"text": "b"}', "the array is not closed at line 2"),
    ('[{"text": "a"}]\n[]', "text after the array at line 2"),
    ('[{"text": "a"},\n\n {"text": tru}]', "Expecting value at line 3"),
    ('[{"text": "a"},\n {"text": "a\tb"}]', "Invalid control character at line 2"),  # a raw tab in a string
])
def test_broken_json_arrays(tmp_path, monkeypatch, text, what):
    path = tmp_path / "b.json"
    path.write_text(text)
    for read_bytes in (1, 1 << 20):
        monkeypatch.setattr(json_array, "_READ_BYTES", read_bytes)
        assert f"{path} is not a valid JSON array ({what}); fix the file, or write one JSON object per line" in \
            first_error(path)
    path.write_text(json.dumps({"data": [{"text": "a"}]}, indent=2))  # one object over many lines
    message = first_error(path)
    assert message.startswith(f"{path} line 1 is not valid JSON (Expecting property name enclosed in double quotes")
    assert "); a JSON file holds one record per line or one array of records, so fix that line or rewrite" in message
    path.write_bytes(b'[{"text": "\xff"}]')
    assert f"{path} is not UTF-8 text (after line 1); re-encode it as UTF-8." == first_error(path)


def test_example_data_in_every_format_trains_alike(tmp_path):
    """examples/finetune/make_data.py --format: the same conversations as messages, Alpaca (multi-turn ones
    with history) and ShareGPT, in JSONL and in JSON, give the same batches."""
    import importlib.util

    script = Path(__file__).parents[1] / "examples" / "finetune" / "make_data.py"
    spec = importlib.util.spec_from_file_location("make_data", script)
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    reference = batches(source=str(make_data.write_chats(tmp_path / "m.jsonl", 200)), chat_template=CHATML)
    for fmt in ("alpaca", "sharegpt"):
        for suffix in (".json", ".jsonl"):
            path = make_data.write_chats(tmp_path / f"{fmt}{suffix}", 200, fmt=fmt)
            assert_same(batches(source=str(path), chat_template=CHATML), reference)
