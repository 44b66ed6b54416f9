"""Writes a small chat data set for `megatrain finetune` (the project ships no data, so it is generated).

    python examples/finetune/make_data.py --out runs/finetune-example/chat.jsonl --n 2000
    python examples/finetune/make_data.py --out runs/finetune-example/alpaca.json --format alpaca

One conversation per line in the `messages` format that chat models and `megatrain finetune` read:

    {"messages": [{"role": "system", "content": "You are a careful assistant."},
                  {"role": "user", "content": "reverse: red fox sky"},
                  {"role": "assistant", "content": "sky fox red"}]}

or the same conversations as Alpaca records (earlier turns in `history`) or ShareGPT records, which
`megatrain finetune` reads too; an --out ending in .json gets one JSON array instead of JSON Lines.

The tasks (counting words, a word's fixed "opposite", the first/last word, reversing a few words) go from easy to
hard for a tiny model: in a few hundred steps the 64-wide example model learns the reply format (one word, or
as many words as asked, then <|im_end|>), by about a thousand it counts, and the lookups and copies (first,
last, reverse) take longer or a larger model. So the eval loss falls quickly and the generations show what
was learned. Seeded: the same arguments always write the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORDS = ("red", "blue", "green", "gold", "fox", "owl", "cat", "dog", "sun", "moon", "star", "sky", "tree",
         "leaf", "rock", "sand", "rain", "snow", "wind", "fire", "lake", "hill", "road", "ship")
OPPOSITE = dict(zip(WORDS, WORDS[::-1], strict=True))  # a fixed pairing: red <-> ship, blue <-> road, ...
NUMBERS = ("zero", "one", "two", "three", "four", "five")
TASKS: dict[str, Callable[[list[str]], list[str]]] = {
    "count": lambda w: [NUMBERS[len(w)]],  # the first a tiny model gets right
    "opposite": lambda w: [OPPOSITE[x] for x in w],
    "first": lambda w: w[:1],
    "last": lambda w: w[-1:],
    "reverse": lambda w: w[::-1],  # copying needs induction heads: the slowest to learn
}
SYSTEM = "You are a careful assistant."


def make_chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One conversation: an optional system prompt, then one or two task turns."""
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    for _ in range(rng.choice((1, 1, 2))):
        task = rng.choice(list(TASKS))
        words = rng.sample(WORDS, 1 if task == "opposite" else rng.randint(2, 5))
        messages.append({"role": "user", "content": f"{task}: {' '.join(words)}"})
        messages.append({"role": "assistant", "content": " ".join(TASKS[task](words))})
    return {"messages": messages}


def as_alpaca(chat: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """The chat as an Alpaca record: the last exchange is instruction/output, the earlier ones history."""
    system = [m["content"] for m in chat["messages"] if m["role"] == "system"]
    turns = [m["content"] for m in chat["messages"] if m["role"] != "system"]  # user, assistant, user, ...
    pairs = [turns[i : i + 2] for i in range(0, len(turns), 2)]
    record: dict[str, Any] = {"instruction": pairs[-1][0], "input": "", "output": pairs[-1][1]}
    return {**record, **({"system": system[0]} if system else {}), **({"history": pairs[:-1]} if pairs[:-1] else {})}


def as_sharegpt(chat: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in chat["messages"]]}


FORMATS: dict[str, Callable[[dict[str, list[dict[str, str]]]], dict[str, Any]]] = {
    "messages": lambda chat: chat, "alpaca": as_alpaca, "sharegpt": as_sharegpt}


def write_chats(path: str | Path, n: int, seed: int = 0, fmt: str = "messages") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    records = [FORMATS[fmt](make_chat(rng)) for _ in range(n)]
    # .json: one array, as Alpaca and ShareGPT data sets are usually shipped; else one record per line
    text = json.dumps(records, indent=1) if path.suffix == ".json" else "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/finetune-example/chat.jsonl")
    parser.add_argument("--n", type=int, default=2000, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=list(FORMATS), default="messages", help="record format")
    args = parser.parse_args(argv)
    path = write_chats(args.out, args.n, args.seed, args.format)
    print(f"wrote {args.n} conversations to {path}")


if __name__ == "__main__":
    main()
