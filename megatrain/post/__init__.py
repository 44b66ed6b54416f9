"""Post-training losses on per-token log-probabilities (megatrain/engine/token_loss.py): DPO's (dpo.py) and GRPO's
(grpo.py), as TRL computes them, with the batches and metrics their trainers (pipelines/dpo.py, pipelines/grpo.py)
need. Pure torch on [batch, seq] tensors: no engine, no Ray."""
