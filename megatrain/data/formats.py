"""Record formats of JSON / JSON Lines files (messages, Alpaca, ShareGPT), and their conversion to `messages` chats.

Alpaca and ShareGPT records become chats here, before anything else sees them, so tokenizing, templates, loss masks,
packing and resume are those of the `messages` format, not copies (docs/design.md#record-formats)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatrain.data.tokenizers import DataError, Message

RECORD_FORMATS = ("messages", "alpaca", "sharegpt")  # the values of DataConfig.record_format
NAMES = {"messages": "a messages/text", "alpaca": "an Alpaca", "sharegpt": "a ShareGPT"}  # "line 3 is an Alpaca record"
ALPACA_KEYS = ("instruction", "output")  # an Alpaca record has both; in an Alpaca file either one marks one
SHAREGPT_KEY = "conversations"
# the fields each format reads (the columns a Parquet / Arrow file of that format is read by)
FIELDS = {"alpaca": ("instruction", "input", "output", "system", "history"), "sharegpt": (SHAREGPT_KEY, "system")}
REQUIRED = {"alpaca": ALPACA_KEYS, "sharegpt": (SHAREGPT_KEY,)}
# ShareGPT's speaker names (and the OpenAI names some exports use instead) -> the messages format's roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _got(record: Mapping[str, Any], key: str, what: str = "keys") -> str:
    """How a missing or mistyped field reads in an error: "a int", or "none (its keys are: a, b)"."""
    if key in record:
        return f"a {type(record[key]).__name__}"
    return f"none (its {what} are: {', '.join(record) or 'none'})"


def check_entries(entries: list[Any], where: str, field: str, keys: tuple[str, str]) -> None:
    """Every entry of a chat list is an object with string `keys` (role/content, or ShareGPT's from/value)."""
    for j, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise DataError(f"{where}: {field} entry {j} is a {type(entry).__name__}, not an object with "
                            f"{keys[0]!r} and {keys[1]!r}; make every entry such an object.")
        for key in keys:
            if not isinstance(entry.get(key), str):
                raise DataError(f"{where}: {field} entry {j} needs a string {key!r} but has {_got(entry, key)}; "
                                f"give every entry a string {keys[0]} and {keys[1]}.")


def detect(record: Mapping[str, Any], fields: tuple[str, str]) -> str | None:
    """The format a record's keys say it is in; None when none fits. `fields` are the messages format's two
    fields in the order they are preferred (the text field first when sft=False, as the messages path reads
    them), so a record with both a chat and a text field reads the way it always has."""
    if fields[0] in record:
        return "messages"
    if SHAREGPT_KEY in record:
        return "sharegpt"
    # "instruction" alone decides: `output` is too common a name (beside a text field, say) to turn a record
    # that trained as text before into a broken Alpaca record
    if ALPACA_KEYS[0] in record:
        return "alpaca"
    return "messages" if fields[1] in record else None


def fits(record: Mapping[str, Any], fmt: str, fields: tuple[str, str]) -> bool:
    """Does the record have the field(s) that format reads? (Their contents are checked when converted.)"""
    return any(k in record for k in REQUIRED.get(fmt, fields))


def _optional_text(record: Mapping[str, Any], key: str, where: str, fmt: str) -> str:
    """An optional string field; absent and null read as empty (Alpaca files write `"input": ""` or null)."""
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {fmt} field {key!r} holds a {type(value).__name__}, not a string; store it as "
                        "text or leave it out.")
    return value


def alpaca_chat(record: Mapping[str, Any], where: str) -> list[Message]:
    """An Alpaca record as a messages chat: [system], (history user, assistant)*, user, assistant."""
    for key in ALPACA_KEYS:
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: an Alpaca record needs a string {key!r} but has "
                            f"{_got(record, key, 'fields')}; give every record a string instruction and output.")
    system = _optional_text(record, "system", where, "Alpaca")
    chat = [{"role": "system", "content": system}] if system else []
    history = record.get("history") or []
    if not (isinstance(history, list) and all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history)):
        raise DataError(f"{where}: Alpaca field 'history' is not a list of [instruction, output] string pairs; "
                        "fix it or leave it out.")
    for user, assistant in history:
        chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    query = "\n".join(t for t in (record["instruction"], _optional_text(record, "input", where, "Alpaca")) if t)
    return [*chat, {"role": "user", "content": query}, {"role": "assistant", "content": record["output"]}]


def sharegpt_chat(record: Mapping[str, Any], where: str) -> list[Message] | None:
    """A ShareGPT record as a messages chat; None (skipped) for an empty or null conversation."""
    turns = record[SHAREGPT_KEY]
    if turns is None or turns == []:
        return None
    if not isinstance(turns, list):
        raise DataError(f"{where}: {SHAREGPT_KEY!r} holds a {type(turns).__name__}, not a list of {{from, value}} "
                        "turns; store the conversation as a JSON list.")
    check_entries(turns, where, SHAREGPT_KEY, ("from", "value"))
    system = _optional_text(record, "system", where, "ShareGPT")
    chat = [{"role": "system", "content": system}] if system else []
    for j, turn in enumerate(turns):
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise DataError(f"{where}: {SHAREGPT_KEY} entry {j} is from {turn['from']!r}, not one of "
                            f"{', '.join(SHAREGPT_ROLES)}; rename that speaker or drop the record.")
        if role == "system" and system:  # two system prompts: which one the model should follow is unclear
            raise DataError(f"{where} has both a top-level 'system' and a system turn ({SHAREGPT_KEY} entry {j}); "
                            "keep one of them.")
        chat.append({"role": role, "content": turn["value"]})
    return chat


def to_chat(record: Mapping[str, Any], where: str, fmt: str) -> list[Message] | None:
    """An Alpaca or ShareGPT record as a messages chat (None: nothing to train on)."""
    return alpaca_chat(record, where) if fmt == "alpaca" else sharegpt_chat(record, where)


__all__ = [
    "ALPACA_KEYS", "FIELDS", "NAMES", "RECORD_FORMATS", "REQUIRED", "SHAREGPT_KEY", "alpaca_chat", "check_entries",
    "detect", "fits", "sharegpt_chat", "to_chat",
]
