"""Writes the post-training examples' data (the project ships none, so it is generated, seeded):

    python examples/post/make_data.py --out runs/post-example

- pairs.jsonl, DPO's preference pairs in TRL's text format: {"prompt": "repeat: owl", "chosen": " owl owl",
  "rejected": " fox fox"}: the chosen completion repeats the prompt's word, the rejected one another word. Every
  word comes up in many pairs, so what DPO teaches (copy the prompt's word) shows on held-out pairs too.
- prompts.jsonl, GRPO's prompts in TRL's format with an extra column the rewards read: {"prompt": "number: 42",
  "number": "42"} (examples/post/rewards.py: completions made of digits, and ones that start with the number).
- corpus.jsonl, the words and digits as chat records, for examples/finetune/make_model.py's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("owl fox cat sun sky red sea hill road lake tree bird stone rain wind snow leaf fish star moon").split()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/post-example")
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out, rng = Path(args.out), random.Random(args.seed)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for _ in range(args.pairs):
        word, other = rng.sample(WORDS, 2)
        pairs.append({"prompt": f"repeat: {word}", "chosen": f" {word} {word}", "rejected": f" {other} {other}"})
    write_jsonl(out / "pairs.jsonl", pairs)
    numbers = [str(rng.randrange(10, 100)) for _ in range(args.prompts)]
    write_jsonl(out / "prompts.jsonl", [{"prompt": f"number: {n}", "number": n} for n in numbers])
    corpus = [{"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}]}
              for p in pairs] + [{"messages": [{"role": "user", "content": f"number: {n}"},
                                               {"role": "assistant", "content": " ".join(n)}]} for n in numbers]
    write_jsonl(out / "corpus.jsonl", corpus)
    print(f"wrote {len(pairs)} pairs, {len(numbers)} prompts and a tokenizer corpus to {out}")


if __name__ == "__main__":
    main()
