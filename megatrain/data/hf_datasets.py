"""`datasets` data sets as a source: a Hub data set by name (`org/name[@revision]`, streamed), a directory written by
`save_to_disk`, or files and folders as `load_dataset` reads them (format = "datasets").

Its rows are read as Parquet rows are (columnar.py): one column of text, token ids or `messages` chats, or Alpaca
or ShareGPT records detected from the column names; `split` picks the split, `subset` the data set's configuration.
Shards: 1,024 rows of a data set on disk; one of a streamed data set's files (its shards) read whole. A Hub data set
streams where the Hub can be reached; offline (HF_HUB_OFFLINE=1), or where it cannot be, it is read from the hub
cache's snapshot of it, as a folder of data files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from megatrain.config import HUB_NAME, is_hub_name
from megatrain.data.columnar import batch_docs, pick_columns
from megatrain.data.config import DataConfig
from megatrain.data.documents import Doc, Source
from megatrain.data.files import EXTENSIONS
from megatrain.data.tokenizers import DataError

ROWS_PER_SHARD = 1024  # a data set on disk: the unit of shuffling and of the re-read on resume
SAVED = ("state.json", "dataset_dict.json")  # what save_to_disk writes beside the Arrow files (one split / several)


def is_datasets_source(cfg: DataConfig) -> bool:
    """Read with `datasets`: format "datasets", a save_to_disk directory, or a Hub name that is no local path."""
    path = Path(cfg.source)
    a_file = cfg.source.lower().endswith(tuple(e for exts in EXTENSIONS.values() for e in exts))  # a mistyped path
    return cfg.format == "datasets" or (path.is_dir() and any((path / f).is_file() for f in SAVED)) or (
        cfg.format is None and not a_file and is_hub_name(cfg.source))


class DatasetsSource(Source):
    def __init__(self, cfg: DataConfig):
        self.name = f"{cfg.source} ({cfg.split})"
        self.data = open_dataset(cfg)
        self.streamed = not hasattr(self.data, "__len__")
        names = self.data.column_names or list(next(iter(self.data)))  # a streamed set may not know its columns
        self.columns = pick_columns(names, self.name, cfg.column, cfg.text_field, cfg.messages_field,
                                     cfg.record_format, cfg.sft is False)
        self.num_shards = self.data.num_shards if self.streamed else max(1, math.ceil(len(self.data) / ROWS_PER_SHARD))

    def read_shard(self, index: int) -> list[Doc]:
        import pyarrow as pa

        if self.streamed:
            rows = [{k: row.get(k) for k in self.columns.names} for row in self.data.shard(self.num_shards, index)]
            return batch_docs(pa.Table.from_pylist(rows), f"{self.name} shard {index}", self.columns, 0)
        first = index * ROWS_PER_SHARD
        table = self.data.with_format("arrow")[first:first + ROWS_PER_SHARD]
        return batch_docs(table, self.name, self.columns, first)


def open_dataset(cfg: DataConfig) -> Any:
    """The split `cfg` names as a `datasets` Dataset (on disk) or IterableDataset (streamed)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{cfg.source} is read with the datasets library, which is not installed; pip install "
                        "datasets (or megatrain[data]).") from None
    path = Path(cfg.source)
    try:
        if path.is_dir() and any((path / f).is_file() for f in SAVED):
            return _split(datasets.load_from_disk(str(path)), cfg)
        if path.exists():
            return datasets.load_dataset(str(path), cfg.subset, split=cfg.split, streaming=bool(cfg.streaming))
        return _hub_dataset(cfg)
    except DataError:
        raise
    except Exception as e:  # datasets' and huggingface_hub's errors, each one sentence
        raise DataError(_unopened(cfg, e)) from None


def _hub_dataset(cfg: DataConfig) -> Any:
    import datasets

    match = HUB_NAME.match(cfg.source)
    if match is None:
        raise DataError(f"data source {cfg.source} does not exist; pass an existing file or folder, a save_to_disk "
                        "directory, a Hugging Face Hub data set name (org/name), or source='synthetic'.")
    repo, revision = match["repo"], match["revision"]
    streaming = cfg.streaming is not False
    if not datasets.config.HF_HUB_OFFLINE:
        try:
            return datasets.load_dataset(repo, cfg.subset, split=cfg.split, streaming=streaming, revision=revision)
        except ConnectionError:
            pass  # the Hub cannot be reached: its cached snapshot, if there is one
    from huggingface_hub import snapshot_download

    local = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True)
    return datasets.load_dataset(local, cfg.subset, split=cfg.split, streaming=streaming)


def _split(data: Any, cfg: DataConfig) -> Any:
    """The split of a save_to_disk DatasetDict (a single saved Dataset is its own split)."""
    if not hasattr(data, "keys"):
        return data
    if cfg.split not in data:
        raise DataError(f"{cfg.source} has no split {cfg.split!r} (its splits are: {', '.join(data)}); set split "
                        "to one of them.")
    return data[cfg.split]


def _unopened(cfg: DataConfig, error: Exception) -> str:
    what, text = type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip() else ""
    if what == "DatasetNotFoundError" or what == "RepositoryNotFoundError":
        return (f"data set {cfg.source!r} is not on the Hugging Face Hub (or is private: log in with hf auth "
                "login); check the name, or pass a local file or folder.")
    if what == "LocalEntryNotFoundError":
        return (f"data set {cfg.source!r} is no file or folder here, nor in the Hugging Face cache, and the Hub "
                "cannot be reached (offline, or HF_HUB_OFFLINE=1); check the path, or download it where the network "
                "allows.")
    if isinstance(error, ValueError) and "split" in text.lower():
        return f"data set {cfg.source!r} has no split {cfg.split!r} ({text.rstrip('.')}); set split to one of them."
    return f"data set {cfg.source!r} could not be opened with datasets ({what}: {text.rstrip('.')})."


__all__ = ["DatasetsSource", "is_datasets_source", "open_dataset"]


def hub_environment(data_format: str) -> dict[str, Any] | None:
    """The loader actor of a `datasets` source reads the Hub (and its cache) as this driver does: with its HF_*
    settings (cache, offline, token), which a Ray worker started before they were set would not have."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "HUGGINGFACE_"))}
    return {"env_vars": env} if data_format == "datasets" and env else None
