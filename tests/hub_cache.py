"""A Hugging Face cache built offline, laid out as huggingface_hub lays it: `<kind>s--org--name/` with `blobs/` (the
files by their hash), `snapshots/<commit>/` (links to the blobs, by name) and `refs/main` (the commit), and the
environment that makes huggingface_hub and datasets read it offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def cache_repo(cache: Path, repo: str, files: dict[str, Path], kind: str = "model", revision: str = "main") -> str:
    """Puts `files` (name in the repository -> a local file) into the hub cache `cache` as the commit a new revision
    names (`refs/<revision>`); returns the commit's hash."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{revision}:{sorted(files)}".encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    for name, source in files.items():
        data = Path(source).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return commit


def cache_directory(cache: Path, repo: str, directory: Path, kind: str = "model", revision: str = "main") -> str:
    """Every file under `directory`, by its path in it, as repository `repo` of the cache."""
    files = {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*")) if p.is_file()}
    return cache_repo(cache, repo, files, kind, revision)


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache under a tmp HF_HOME, read offline: the environment (for subprocesses and actors) and the
    settings huggingface_hub and datasets read from it once, at their import."""
    import huggingface_hub.constants as hub

    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_OFFLINE", "1"), ("HF_DATASETS_CACHE", home / "datasets")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(hub, "HF_HOME", str(home))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config as ds
    except ImportError:
        return cache
    monkeypatch.setattr(ds, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(ds, "HF_DATASETS_CACHE", home / "datasets", raising=False)
    monkeypatch.setattr(ds, "HF_CACHE_HOME", str(home), raising=False)
    return cache
