"""Opening the source a DataConfig names: the synthetic documents, or a reader of its data files.

Sources (each a `documents.Source` of documents: text, chats or token ids):

- synthetic: the default, no files. Seeded, learnable documents (see `synthetic_document`).
- text (.txt .text .md, or any file with format="text"): documents are paragraphs separated by blank lines
  (text_split="paragraph"), or whole files (text_split="file").
- jsonl (.jsonl .ndjson .json): one JSON object per line (blank lines are skipped), or a file holding one JSON
  array of objects. A record's document is its `messages_field` (a chat) or its `text_field` (text or token
  ids), or it is an Alpaca or ShareGPT record, converted to a chat (formats.py). The record format is detected
  per file from its first record (or set with `record_format`); every other record of the file must fit it.
- parquet (.parquet .pq) and arrow (.arrow .feather .ipc .arrows, Arrow IPC file or stream format): one
  column (`column`, else `text_field`, else `messages_field`) of strings, token-id lists or message lists; or,
  detected from the column names as a first JSON record is (or set with `record_format`), each row an Alpaca
  or ShareGPT record.
A folder is read as all its files of one format, in sorted path order.
- datasets (hf_datasets.py): a Hugging Face Hub data set by name (org/name[@revision], streamed), a directory
  written by `save_to_disk`, or (format="datasets") files and folders as `load_dataset` reads them; its `split` (of
  configuration `subset`), rows read as Parquet rows are.

Every source is cut into shards that can be read on their own, so nothing is ever read whole: a Parquet row
group, an Arrow record batch, about `shard_bytes` of a text/JSONL file cut at a line (text: a blank line) or
of a JSON array cut between elements, a whole file with text_split="file", or 100 synthetic documents. The
shard index is built when the source is opened (one pass over text/JSON files, parsing each element of a JSON
array once, one at a time; metadata only for Parquet/Arrow).
"""

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
