#!/usr/bin/env bash
# DPO and GRPO on a CPU, end to end, from the repository root (needs `pip install -e '.[test]'` for transformers
# and tokenizers, which make the tiny model):
#   bash examples/post/run.sh [WORK_DIR]      # default WORK_DIR: runs/post-example
set -euo pipefail
work=${1:-runs/post-example}

# 1. data (pairs, prompts) and a tiny random Qwen2-shaped model with its own tokenizer
python examples/post/make_data.py --out "$work"
python examples/finetune/make_model.py --data "$work/corpus.jsonl" --out "$work/tiny-qwen2"

# 2. DPO: the reference log-probs first (cached in $work/dpo/reference_logps.json), then 100 steps of 8 pairs;
#    eval/rewards/accuracies is the held-out pairs' preference accuracy
megatrain dpo --model "$work/tiny-qwen2" --data "$work/pairs.jsonl" --out "$work/dpo" \
    --lr 1e-3 --beta 0.1 --batch-pairs 8 --steps 100 --device cpu

# 3. GRPO: 8 completions of 16 tokens for each of 4 prompts a step, sampled by the streamed model; two rewards
megatrain grpo --model "$work/tiny-qwen2" --prompts "$work/prompts.jsonl" \
    --reward examples/post/rewards.py:digits --reward examples/post/rewards.py:starts_with_number \
    --reward-weights 1.0 0.5 --group-size 8 --max-new-tokens 16 --prompts-per-step 4 --steps 40 \
    --lr 5e-3 --temperature 1.0 --device cpu --out "$work/grpo"
