"""Models named as the Hugging Face Hub names them (`Qwen/Qwen2.5-7B`, `org/name@revision`), resolved through
`huggingface_hub` into its cache: downloaded where the network allows, read from the cache offline
(`HF_HUB_OFFLINE=1`). What a name resolves to is the cache's snapshot directory, an HF model directory like any other.

Only what megatrain reads is fetched: config.json for a plan, else config.json, the safetensors weights (never
pickles) and the tokenizer's files. A name that cannot be resolved (not found, gated, offline and not cached) is one
sentence.
"""

from __future__ import annotations

from pathlib import Path

from megatrain.config import HUB_NAME, ConfigError

# The files besides config.json and the weights that make a model directory usable for inference: the tokenizer's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]  # weights as safetensors only


def hub_model(name: str, config_only: bool = False) -> Path:
    """The local snapshot directory of hub model `name` (`org/name[@revision]`): config.json alone where
    `config_only` (a plan), else with the safetensors weights and the tokenizer's files."""
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError:
        raise ConfigError(f"model {name!r} is a Hugging Face Hub name, which needs huggingface_hub; install it "
                          "(pip install huggingface_hub) or pass a local model directory.") from None
    match = HUB_NAME.match(name)
    repo, revision = match["repo"], match["revision"]
    try:
        if config_only:
            return Path(hf_hub_download(repo, "config.json", revision=revision)).parent
        return Path(snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES))
    except Exception as e:  # huggingface_hub's errors, each turned into one sentence
        raise ConfigError(unresolved(name, e)) from None


def unresolved(name: str, error: Exception) -> str:
    """One sentence for a hub name that did not resolve."""
    from huggingface_hub import errors

    what = type(error).__name__
    if isinstance(error, errors.GatedRepoError):  # before RepositoryNotFoundError: it is one
        return (f"model {name!r} is gated on the Hugging Face Hub; accept its terms on huggingface.co and log in "
                "(hf auth login, or set HF_TOKEN).")
    if isinstance(error, errors.RepositoryNotFoundError):
        return (f"model {name!r} is not on the Hugging Face Hub (or is private: log in with hf auth login); check "
                "the name, or pass a local model directory or a preset name.")
    if isinstance(error, errors.RevisionNotFoundError):
        return f"model {name!r}: the Hugging Face Hub has no such revision; check the name after '@'."
    if isinstance(error, errors.LocalEntryNotFoundError):  # before EntryNotFoundError: it is one
        return (f"model {name!r} is not in the Hugging Face cache and the Hub cannot be reached (offline, or "
                "HF_HUB_OFFLINE=1); download it where the network allows (hf download) or pass a local directory.")
    if isinstance(error, errors.EntryNotFoundError):
        return f"model {name!r} has no config.json on the Hugging Face Hub, so it is no transformers model."
    return f"model {name!r} could not be fetched from the Hugging Face Hub ({what}: {error})."


def tokenizer_files(directory: str | Path | None) -> list[Path]:
    """The tokenizer's files in a model directory (or beside a tokenizer.json), to be copied with the weights."""
    if directory is None:
        return []
    folder = Path(directory)
    folder = folder if folder.is_dir() else folder.parent
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
