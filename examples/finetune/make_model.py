"""Makes a tiny Qwen2-shaped HF model directory to fine-tune: a BPE tokenizer trained on the chat data, a
ChatML chat template, and randomly initialised weights, all saved the way `transformers` saves real models.

    python examples/finetune/make_model.py --data runs/finetune-example/chat.jsonl \\
        --out runs/finetune-example/tiny-qwen2

Stands in for a downloaded checkpoint (say Qwen2.5-0.5B-Instruct, whose directory has the same files):
config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json and
chat_template.jinja. Needs `transformers` and `tokenizers` (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

# Qwen2's ChatML format (without its default system prompt and tool calls).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2's: pad/document end, turn markers


def chat_texts(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if line.strip():
            for m in json.loads(line)["messages"]:
                yield f"{m['role']}\n{m['content']}"


def make_model(data: str | Path, out: str | Path, hidden: int = 64, layers: int = 2, vocab: int = 512,
               seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    # byte-level BPE like Qwen's, trained on this data so its words become single tokens
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(chat_texts(Path(data)), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)

    # embedding rows rounded up to a multiple of 64, as real models pad theirs
    config = Qwen2Config(vocab_size=64 * -(-len(fast) // 64), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/finetune-example/chat.jsonl", help="chat JSONL to train the "
                        "tokenizer on")
    parser.add_argument("--out", default="runs/finetune-example/tiny-qwen2")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_model(args.data, args.out, args.hidden, args.layers, seed=args.seed)
    print(f"wrote a tiny Qwen2 model and its tokenizer to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
