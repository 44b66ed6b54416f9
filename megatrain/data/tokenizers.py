"""Tokenizers: a byte-level default that needs no files, and HF `tokenizer.json` files via `tokenizers`.

Both share one interface: `encode(text)` (no special tokens: the packer adds BOS and EOS), `decode(ids)`,
`vocab_size`, `bos_id`, `eos_id`, `pad_id` and `apply_chat(messages) -> (ids, assistant_mask)`, which renders a
Jinja chat template as transformers does, or a plain format without one (docs/design.md#tokenizers)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any

from megatrain.config import MegatrainError

Message = dict[str, str]


class DataError(MegatrainError):
    """Bad data, a bad tokenizer, or data that does not fit the model: one sentence saying what to fix."""


class Tokenizer(ABC):
    """The common interface. Subclasses set the ids and implement `encode`, `decode` and `_encode_offsets`."""

    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int = 0
    chat_template: str | None = None
    # strings the Jinja template sees as bos_token / eos_token / pad_token
    special_strings: dict[str, str] = {}

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def _encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each token, the index of its first character in `text`."""

    def apply_chat(self, messages: list[Message]) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and a mask that is True on the tokens of assistant turns."""
        if self.chat_template:
            return self._apply_template(messages)
        return self._apply_plain(messages)

    def _apply_plain(self, messages: list[Message]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        for m in messages:
            assistant = m["role"] == "assistant"
            header = self.encode(f"<|{m['role']}|>\n")
            body = self.encode(m["content"])
            close = [self.eos_id] if assistant and self.eos_id is not None else self.encode("\n")
            ids += header + body + close
            mask += [False] * len(header) + [assistant] * (len(body) + len(close))
        return ids, mask

    def _apply_template(self, messages: list[Message]) -> tuple[list[int], list[bool]]:
        template = _compile(self.chat_template)

        def render(msgs: list[Message], generation_prompt: bool = False) -> str:
            try:
                return template.render(messages=msgs, add_generation_prompt=generation_prompt,
                                       **self.special_strings)
            except MegatrainError:
                raise
            except Exception as e:  # jinja errors, or a template indexing an empty message list
                raise DataError(f"the chat template failed to render a conversation ({e}); "
                                "fix the template or the messages.") from None

        full = render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = None
            for generation_prompt in (True, False):
                try:
                    prefix = render(messages[:i], generation_prompt)
                except DataError:
                    if i:
                        raise
                    prefix = ""  # some templates cannot render an empty conversation
                if full.startswith(prefix):
                    start = len(prefix)
                    break
            end_text = render(messages[: i + 1])
            if start is None or not full.startswith(end_text):
                raise DataError("the chat template renders a conversation's prefix differently from the "
                                "whole, so assistant turns cannot be located; use a template whose output "
                                "grows message by message.")
            spans.append((start, len(end_text)))
        ids, starts = self._encode_offsets(full)
        mask = [any(a <= s < b for a, b in spans) for s in starts]
        return ids, mask


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0-255, then BOS 256, EOS 257, PAD 258 (259 unused: an even vocab of 260).

    Matches the `tiny` model preset (vocab 260, bos 256, eos 257). `decode` drops the special ids.
    """

    vocab_size = 260
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template
        # template text is bytes here, so "<s>"-style strings would not become the special ids
        self.special_strings = {"bos_token": "", "eos_token": "", "pad_token": ""}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def _encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        starts: list[int] = []
        for ci, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids += b
            starts += [ci] * len(b)
        return ids, starts

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer(Tokenizer):
    """A local `tokenizer.json` (a model directory or the file itself) loaded with the `tokenizers` library.

    Never downloads. BOS/EOS/PAD come from tokenizer_config.json, then special_tokens_map.json, then
    config.json (the first that names each; an explicit null means none, as Qwen's bos_token); PAD falls
    back to EOS, then 0 (padding is never trained, so its id only has to be valid).
    """

    def __init__(self, path: str | Path, chat_template: str | None = None):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"no tokenizer at {file}; pass a model directory holding tokenizer.json, "
                            "the tokenizer.json file itself, or tokenizer='byte'.")
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError("loading a tokenizer.json needs the `tokenizers` package; install it "
                            "(pip install tokenizers) or use tokenizer='byte'.") from None
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:
            raise DataError(f"{file} is not a readable tokenizer.json ({e}); re-export it from the "
                            "model.") from None
        self.path = file
        folder = file.parent
        tok_config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        model_config = _read_json(folder / "config.json")

        vocab = self._tok.get_vocab(with_added_tokens=True)
        # the largest id + 1: added tokens may leave gaps above the base vocabulary
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self.special_strings = {}
        ids: dict[str, int | None] = {}
        for kind in ("bos", "eos", "pad"):
            key = f"{kind}_token"
            # the first file that names the token decides; an explicit null (Qwen's bos_token) means none
            named = next((cfg for cfg in (tok_config, special_map) if key in cfg), None)
            token_id = None
            if named is not None:
                token = _token_string(named[key])
                if token is not None:
                    token_id = self._tok.token_to_id(token)
                    if token_id is None:
                        raise DataError(f"{key} {token!r} of {folder} is not in its tokenizer.json "
                                        "vocabulary; fix tokenizer_config.json or special_tokens_map.json.")
                    self.special_strings[key] = token
            else:
                token_id = model_config.get(f"{kind}_token_id")
                if isinstance(token_id, list):
                    token_id = token_id[0] if token_id else None
                if token_id is not None:
                    self.special_strings[key] = self._tok.id_to_token(token_id) or ""
            ids[kind] = token_id
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.pad_id = next(i for i in (ids["pad"], self.eos_id, 0) if i is not None)
        for kind in ("bos_token", "eos_token", "pad_token"):
            self.special_strings.setdefault(kind, "")

        template = tok_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template = chat_template or template

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _encode_offsets(self, text: str) -> tuple[list[int], list[int]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [start for start, _ in enc.offsets]

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str | Path = "byte", chat_template: str | None = None) -> Tokenizer:
    """"byte" for the byte tokenizer, else a model directory or tokenizer.json path.

    `chat_template` (a Jinja string, or a path to a .jinja file) overrides the tokenizer's own.
    """
    if chat_template is not None and chat_template.endswith(".jinja"):
        template_file = Path(chat_template)
        if not template_file.is_file():
            raise DataError(f"chat template file {template_file} does not exist; pass an existing .jinja "
                            "file or the template text itself.")
        chat_template = template_file.read_text()
    if str(spec) == "byte":
        return ByteTokenizer(chat_template)
    return HFTokenizer(spec, chat_template)


# ---- helpers ----

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix or re-export it.") from None
    return value if isinstance(value, dict) else {}


def _token_string(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


_COMPILED: dict[str, Any] = {}


def _compile(template: str) -> Any:
    """The Jinja environment HF transformers renders chat templates in (sandboxed, trimmed blocks)."""
    if template not in _COMPILED:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DataError(f"the chat template rejected a conversation ({message}); fix the messages or "
                            "the template.")

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


__all__ = ["ByteTokenizer", "DataError", "HFTokenizer", "Message", "Tokenizer", "load_tokenizer"]
