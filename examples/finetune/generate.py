"""Chats with a fine-tuned model directory through plain `transformers`: what `OUT_DIR/final/` is for.

    python examples/finetune/generate.py runs/finetune-example/sft/final "reverse: red fox sky" "sort: owl cat"

Each prompt is one user turn, formatted by the tokenizer's own chat template; decoding is greedy.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model directory, e.g. OUT_DIR/final")
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    for prompt in args.prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        print(f"{prompt!r} -> {reply!r}")


if __name__ == "__main__":
    main()
