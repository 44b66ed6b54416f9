"""`datasets` data sets as `--data`: a save_to_disk directory (one split or a DatasetDict), a Hugging Face Hub data
set by name read offline from a hub cache built as huggingface_hub lays it (tests/hub_cache.py), and load_dataset-style
files; their text, messages, Alpaca and ShareGPT columns read as the same records of a JSONL file are; bad names and
splits one sentence; `megatrain train --data` takes a save_to_disk directory and a cached Hub data set."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from helpers import assert_one_sentence, run_cli
from hub_cache import cache_directory, offline_hub  # noqa: F401 (a fixture)

from megatrain.data import BatchLoader, DataConfig, DataError

TEXTS = [{"text": f"document {i}: " + " ".join(["word"] * (i % 7 + 1))} for i in range(60)]
CHATS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
         for i in range(30)]
ALPACA = [{"instruction": f"say {i}", "input": "", "output": f"{i}"} for i in range(30)]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(30)]


def batches(source: str, n: int = 3, **kw) -> list[dict[str, np.ndarray]]:
    loader = BatchLoader(DataConfig(source=source, seq_len=32, batch_size=2, shuffle=False, **kw))
    return [loader.next_batch() for _ in range(n)]


def same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("records", [TEXTS, CHATS, ALPACA, SHAREGPT], ids=["text", "messages", "alpaca", "sharegpt"])
def test_a_saved_dataset_reads_as_its_records_in_jsonl(tmp_path, records):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(saved))
    same(batches(str(saved)), batches(jsonl(tmp_path / "r.jsonl", records)))
    loader = BatchLoader(DataConfig(source=str(saved), seq_len=32, batch_size=2))
    assert loader.format == "datasets" and loader.sft == (records is not TEXTS)  # chats train assistant turns only


def test_a_saved_dataset_dict_reads_the_split_asked_for(tmp_path):
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TEXTS[:30]),
                          "test": datasets.Dataset.from_list(TEXTS[30:])}).save_to_disk(str(saved))
    same(batches(str(saved), split="test"), batches(jsonl(tmp_path / "t.jsonl", TEXTS[30:])))
    with pytest.raises(DataError, match="has no split 'validation' \\(its splits are: train, test\\)") as e:
        batches(str(saved), split="validation")
    assert_one_sentence(str(e.value))


def test_load_dataset_style_files(tmp_path):
    folder = tmp_path / "files" / "data"
    folder.mkdir(parents=True)
    jsonl(folder / "train.jsonl", TEXTS[:40])
    jsonl(folder / "test.jsonl", TEXTS[40:])
    same(batches(str(folder.parent), format="datasets", split="test"), batches(jsonl(tmp_path / "t.jsonl", TEXTS[40:])))


@pytest.fixture
def hub_texts(offline_hub, tmp_path) -> str:  # noqa: F811
    """org/texts in the hub cache: parquet train and test splits under data/, as the Hub's parquet exports are."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    datasets.Dataset.from_list(TEXTS[:40]).to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(TEXTS[40:]).to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
    (repo / "README.md").write_text("---\nlicense: mit\n---\n")
    return cache_directory(offline_hub, "org/texts", repo, kind="dataset")


def test_a_cached_hub_dataset_by_name_offline(hub_texts, tmp_path):
    want = batches(jsonl(tmp_path / "train.jsonl", TEXTS[:40]))
    same(batches("org/texts"), want)  # streamed, as a Hub data set is by default
    same(batches(f"org/texts@{hub_texts}", streaming=False), want)
    same(batches("org/texts", split="test"), batches(jsonl(tmp_path / "test.jsonl", TEXTS[40:])))
    assert BatchLoader(DataConfig(source="org/texts", seq_len=32)).source.streamed
    assert not BatchLoader(DataConfig(source="org/texts", seq_len=32, streaming=False)).source.streamed
    for source, said in (("org/nothing", "nor in the Hugging Face cache"), ("org/texts@v2", "nor in the Hugging Face")):
        with pytest.raises(DataError, match=said) as e:
            batches(source)
        assert_one_sentence(str(e.value))
    with pytest.raises(DataError, match="has no column 'body'"):
        batches("org/texts", column="body")


def test_a_mistyped_path_is_not_taken_for_a_hub_name(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        batches("data/train.jsonl")


@pytest.mark.slow  # CI: test_hub.py trains on org/texts by name (train) and on a save_to_disk directory (finetune)
def test_train_takes_a_saved_dataset_and_a_cached_hub_dataset(ray_session, hub_texts, tmp_path):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(saved))
    for name, data in (("saved", str(saved)), ("hub", "org/texts")):
        out = run_cli("train", "--data", data, "--out", str(tmp_path / name), "--steps", "2", "--device", "cpu",
                      "--precision", "fp32", "--batch-size", "2", "--seq-len", "32", "--optimizer-workers", "1",
                      "--log-every", "1", "--no-save-final", "--checkpoint-every", "0")
        assert out.returncode == 0 and "trained 2 steps" in out.output, out.output
        steps = [json.loads(line) for line in (tmp_path / name / "steps.jsonl").read_text().splitlines()]
        assert len(steps) == 2 and all(r["tokens"] > 0 for r in steps)
