"""Data: tokenizers, document sources, packing with loss masks, and a resumable batch loader.

    from megatrain.data import BatchLoader, DataConfig
    loader = BatchLoader(DataConfig(source="synthetic", batch_size=8, seq_len=256, vocab_size=260))
    batch = loader.next_batch()  # {"input_ids": int64 [8, 256], "labels": int64 [8, 256]}, labels unshifted
"""

from megatrain.data.config import DataConfig
from megatrain.data.documents import Doc, Document, Source
from megatrain.data.formats import RECORD_FORMATS
from megatrain.data.loader import BatchLoader
from megatrain.data.packing import IGNORE, RowPacker, Sample, make_sample
from megatrain.data.sources import find_data_files, open_source
from megatrain.data.split import EvalSplit
from megatrain.data.stream import DocumentStream
from megatrain.data.synthetic import synthetic_document
from megatrain.data.tokenizers import ByteTokenizer, DataError, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE", "RECORD_FORMATS", "BatchLoader", "ByteTokenizer", "DataConfig", "DataError", "Doc", "Document",
    "DocumentStream", "EvalSplit", "HFTokenizer", "RowPacker", "Sample", "Source", "Tokenizer", "find_data_files",
    "load_tokenizer", "make_sample", "open_source", "synthetic_document",
]
