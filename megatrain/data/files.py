"""Data file discovery: the formats known by extension, and the non-empty files of a file or folder source."""

from __future__ import annotations

from pathlib import Path

from megatrain.data.tokenizers import DataError

EXTENSIONS = {
    "text": (".txt", ".text", ".md"),
    "jsonl": (".jsonl", ".ndjson", ".json"),
    "parquet": (".parquet", ".pq"),
    "arrow": (".arrow", ".feather", ".ipc", ".arrows"),
}
FORMATS = ("synthetic", *EXTENSIONS, "datasets")  # datasets: read with the datasets library (hf_datasets.py)


def data_files(path: Path, fmt: str | None) -> tuple[str, list[Path]]:
    """The format (fmt, else from the extensions) and the non-empty data files of an existing file or folder."""
    if path.is_file():
        if fmt is None:
            fmt = next((k for k, exts in EXTENSIONS.items() if path.name.lower().endswith(exts)), None)
            if fmt is None:
                raise DataError(f"cannot tell the format of {path} from its extension; set format to one of "
                                f"{', '.join(EXTENSIONS)}.")
        files = [path]
    else:
        candidates = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        if not candidates:
            raise DataError(f"folder {path} is empty; point source at a folder with data files.")
        by_format = {k: [p for p in candidates if p.name.lower().endswith(exts)]
                     for k, exts in EXTENSIONS.items()}
        if fmt is None:
            found = [k for k, ps in by_format.items() if ps]
            if len(found) > 1:
                raise DataError(f"folder {path} holds {' and '.join(found)} files; set format to the one to "
                                "read.")
            if not found:
                known = " ".join(e for exts in EXTENSIONS.values() for e in exts)
                raise DataError(f"folder {path} holds no data files (looked for {known}); point source at a "
                                "folder with data or set format.")
            fmt = found[0]
        files = by_format[fmt] or candidates  # an explicit format reads files of any extension if none match
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise DataError(f"{path} is empty; point source at a file or folder with data.")
    return fmt, files


__all__ = ["EXTENSIONS", "FORMATS", "data_files"]
