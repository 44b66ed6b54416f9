"""Opening the source a DataConfig names: the synthetic documents, or a reader of its data files (text, JSON Lines,
Parquet, Arrow, a Hugging Face data set).

Every source is cut into shards that can be read on their own, so nothing is ever read whole; the kinds, their
detection and their shards: docs/design.md#sources."""

from __future__ import annotations

from pathlib import Path

from megatrain.data.columnar import ArrowSource, ParquetSource
from megatrain.data.config import DataConfig
from megatrain.data.documents import Source
from megatrain.data.files import data_files
from megatrain.data.hf_datasets import DatasetsSource, is_datasets_source
from megatrain.data.jsonl import JsonlSource
from megatrain.data.synthetic import SyntheticSource
from megatrain.data.text import TextSource
from megatrain.data.tokenizers import DataError


def find_data_files(cfg: DataConfig) -> tuple[str, list[Path]]:
    """The format (detected or cfg.format) and the non-empty files of a file or folder source ("synthetic" and
    none for the synthetic source). Cheap (no file is read), so a driver can check a source before it starts
    anything."""
    if cfg.source == "synthetic" or cfg.format == "synthetic":
        return "synthetic", []
    if is_datasets_source(cfg):  # opened by the datasets library, where it is read
        return "datasets", []
    path = Path(cfg.source)
    if not path.exists():
        raise DataError(f"data source {path} does not exist; pass an existing file or folder, or "
                        "source='synthetic'.")
    return data_files(path, cfg.format)


def open_source(cfg: DataConfig) -> tuple[str, Source]:
    """The format (detected or cfg.format) and the source it names."""
    fmt, files = find_data_files(cfg)
    if fmt == "synthetic":
        return fmt, SyntheticSource(cfg.synthetic_docs, cfg.seed)
    if fmt == "datasets":
        return fmt, DatasetsSource(cfg)
    if fmt == "text":
        if cfg.record_format is not None:  # plain text has no records: a forced format is a mistaken config
            raise DataError(f"record_format applies to JSON, JSON Lines, Parquet and Arrow files but {cfg.source} "
                            "is text; unset record_format, or set format to the data's.")
        return fmt, TextSource(files, cfg.shard_bytes, cfg.text_split)
    if fmt == "jsonl":
        return fmt, JsonlSource(files, cfg.shard_bytes, cfg.text_field, cfg.messages_field, cfg.sft is False,
                                cfg.record_format)
    columnar = (cfg.column, cfg.text_field, cfg.messages_field, cfg.record_format, cfg.sft is False)
    return fmt, (ParquetSource if fmt == "parquet" else ArrowSource)(files, *columnar)


__all__ = ["find_data_files", "open_source"]
