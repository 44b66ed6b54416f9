#!/usr/bin/env bash
# The fine-tuning path end to end on a CPU, from the repository root (needs `pip install -e '.[test]'` for
# transformers and tokenizers):
#   bash examples/finetune/run.sh [WORK_DIR]      # default WORK_DIR: runs/finetune-example
set -euo pipefail
work=${1:-runs/finetune-example}

# 1. data (the project ships none) and a tiny Qwen2-shaped HF model with its own tokenizer and chat template
python examples/finetune/make_data.py --out "$work/chat.jsonl" --n 2000
python examples/finetune/make_model.py --data "$work/chat.jsonl" --out "$work/tiny-qwen2"

# 2. fine-tune: SFT on the assistant turns, eval on held-out chats, checkpoints, an HF directory at the end
megatrain finetune --model "$work/tiny-qwen2" --data "$work/chat.jsonl" --out "$work/sft" \
    --config examples/configs/finetune_tiny.toml

# 3. the result is a plain transformers model directory
python examples/finetune/generate.py "$work/sft/final" "count: fox owl cat" "count: sun sky" \
    "first: lake hill road" "opposite: red"

# Continue the run later (say with more steps) from its newest checkpoint:
#   megatrain finetune --model "$work/tiny-qwen2" --data "$work/chat.jsonl" --out "$work/sft" \
#       --config examples/configs/finetune_tiny.toml --steps 2000 --resume
