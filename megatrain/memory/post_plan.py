"""What post-training adds to a run's memory plan (megatrain/memory/plan.py), by mode (`megatrain plan --post`):

policy      a step on a loss on log-probs (megatrain/engine/token_loss.py): the head's two chunked passes hold what
            cross-entropy's does (three [chunk, vocab] fp32 at the peak, as the plan budgets it), plus per-token
            tensors of the step's rows on the device: log-probs, entropy, the loss's two gradients and up to four
            fields of [rows, seq] fp32 (old and reference log-probs, a mask, weights)
reference   the reference's log-probs: a forward per batch without gradients, within the policy step's memory; kept
            on the host: DPO two numbers a pair (OUT/reference_logps.json), GRPO [rows, seq] fp32 a rollout batch.
            With GRPO's KL term the initial weights come back for that forward as a checkpoint: one written and
            two read per rollout batch (weights and Adam moments, 12 B a parameter each), disk traffic, no memory
rollout     the KV cache of a rollout batch on the device (megatrain/engine/generation.py): keys and values of
            every layer, [rows, kv_heads, seq, head_dim] each, in the compute dtype, beside the weight buffers
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import ConfigError, ModelConfig

MODES = ("dpo", "grpo")
PER_TOKEN_TENSORS = 8  # log-probs, entropy, dL/dlogp, dL/dentropy, and four fields
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and the two Adam moments


@dataclass(frozen=True)
class PostPlan:
    mode: str
    rows: int
    seq: int
    per_token_bytes: int  # policy: on the device, beside the training plan's
    reference_host_bytes: int  # reference: kept on the host (DPO: the whole data's; GRPO: a rollout batch's)
    kv_cache_bytes: int  # rollout: on the device while generating (GRPO)
    swap_bytes: int  # GRPO's KL term: checkpoint bytes written and read per rollout batch

    def report(self) -> str:
        lines = [f"post-training ({self.mode}, {self.rows} rows x {self.seq} tokens):",
                 f"  policy step: the head within the plan's three [chunk, vocab] fp32; per-token tensors "
                 f"{_mib(self.per_token_bytes)} on the device",
                 f"  reference log-probs: a forward without gradients, within the step; "
                 f"{_mib(self.reference_host_bytes)} kept on the host"]
        if self.mode == "grpo":
            lines.append(f"  rollout KV cache: {_mib(self.kv_cache_bytes)} on the device while generating (beside the "
                         "weight buffers and resident units; the step's activations are not alive then)")
            if self.swap_bytes:
                lines.append(f"  KL to the initial policy: {self.swap_bytes / 2**30:.1f} GiB of checkpoint written "
                             "and read per rollout batch")
        return "\n".join(lines)


def post_plan(config: ModelConfig, mode: str, rows: int, seq: int, precision: str = "bf16", pairs: int = 0,
              kl: bool = False) -> PostPlan:
    """The post-training lines of a plan: `rows` x `seq` a step (GRPO: prompts x group size, prompt + new tokens;
    DPO: 2 x pairs a step), `pairs` the DPO data's, `kl` GRPO's KL term on."""
    if mode not in MODES:
        raise ConfigError(f"--post must be one of {', '.join(MODES)}, got {mode!r}.")
    per_token = PER_TOKEN_TENSORS * rows * seq * 4
    reference = 2 * 8 * pairs if mode == "dpo" else rows * seq * 4
    kv = 0
    if mode == "grpo":
        kv = 2 * config.num_layers * rows * config.num_kv_heads * seq * config.head_dim * (
            2 if precision == "bf16" else 4)
    swap = 3 * CHECKPOINT_BYTES_PER_PARAM * config.num_params() if mode == "grpo" and kl else 0
    return PostPlan(mode, rows, seq, per_token, reference, kv, swap)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
