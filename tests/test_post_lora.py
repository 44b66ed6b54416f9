"""Losses on log-probs (Engine.step(loss=fn)) on a LoRA run against TRL's loss code on a PEFT model of transformers'
(TRL's fused LM head added before PEFT wraps the model, as TRL's trainers do; post_helpers.trl_peft_model): the
adapters' gradients of the DPO loss and of GRPO's clipped surrogate (dapo, with the k3 KL term, old log-probs and a
temperature) through megatrain's executor on the frozen fp32 base, 1e-5 (judged against fp64 where fp32 rounding is
further); 3 Engine steps of each against PEFT + TRL's loss + torch.optim.AdamW over the adapters, judged against the
fp64 run as tests/helpers.py judges a full run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_matches
from lora_helpers import lora_executor, run_executor, setup
from post_helpers import (
    COMPLETION,
    OPTIM,
    TEMPERATURE,
    assert_trains_as_transformers,
    pairs_batch,
    rollout_batch,
    trl_dpo_loss,
    trl_grpo_loss,
    trl_logprobs,
    trl_peft_model,
)

import megatrain
from megatrain.engine.token_loss import TokenLoss
from megatrain.lora import save_adapter
from megatrain.post.dpo import DPOLoss
from megatrain.post.grpo import GRPOLoss
from pipelines.logprobs import batch_of

CASE = "llama-all-linear"  # lora_helpers.CASES: every linear adapted, B random
BETA_DPO, EPS_LOW, EPS_HIGH, BETA = 0.3, 0.2, 0.28, 0.04
GRPO = GRPOLoss("dapo", EPS_LOW, EPS_HIGH, BETA, max_completion_length=COMPLETION)


def peft_grads(hf: torch.nn.Module, adapters, dtype: torch.dtype, temperature: float, loss) -> tuple:
    """(TRL's loss on the PEFT model's log-probs, {PEFT name: its adapters' gradient})."""
    model = trl_peft_model(hf, adapters, dtype, temperature)
    value = loss(model)
    value.backward()
    return value.detach(), {n.replace(".default.", "."): p.grad.clone() for n, p in model.named_parameters()
                            if p.requires_grad}


def test_dpo_and_grpo_adapter_gradients_match_trl_on_peft(tmp_path: Path) -> None:
    hf, _, adapters = setup(CASE)
    peft32 = trl_peft_model(hf, adapters)
    ids, labels, mask, ref = pairs_batch(1, peft32)
    g_ids, g_labels, fields, trl_inputs = rollout_batch(2, trl_peft_model(hf, adapters, temperature=TEMPERATURE))

    def dpo(m: torch.nn.Module) -> torch.Tensor:
        return trl_dpo_loss(trl_logprobs(m, ids, labels)[0], ref.to(m.dtype), BETA_DPO)

    def grpo(m: torch.nn.Module) -> torch.Tensor:
        logp = trl_logprobs(m, g_ids, g_labels, TEMPERATURE)[0][:, -COMPLETION:]
        inputs = {k: v.to(logp.dtype) for k, v in trl_inputs.items()}
        return trl_grpo_loss(logp, inputs, "dapo", EPS_LOW, EPS_HIGH, BETA, COMPLETION)

    with lora_executor(hf, adapters, tmp_path) as (store, executor):
        ours_dpo = run_executor(executor, store, ids, labels, token_loss=TokenLoss(DPOLoss(BETA_DPO),
                                                                                     {"mask": mask, "ref": ref}))
        ours_grpo = run_executor(executor, store, g_ids, g_labels,
                                 token_loss=TokenLoss(GRPO, fields, temperature=TEMPERATURE))
    assert_matches(ours_dpo, peft_grads(hf, adapters, torch.float32, 1.0, dpo),
                   peft_grads(hf, adapters, torch.float64, 1.0, dpo))
    assert_matches(ours_grpo, peft_grads(hf, adapters, torch.float32, TEMPERATURE, grpo),
                   peft_grads(hf, adapters, torch.float64, TEMPERATURE, grpo))
    assert ours_dpo[1].keys() == {n for n in adapters.tensors} and all(".lora_" in n for n in ours_dpo[1])


@pytest.mark.parametrize("loss", ["dpo", pytest.param("grpo", marks=pytest.mark.slow)])
def test_engine_three_lora_steps_match_peft_trl_and_adamw(ray_session: None, tmp_path: Path, loss: str) -> None:
    """DPO's sigmoid loss, or GRPO's dapo with the KL term (slow: the gradient test above runs its loss in CI), three
    steps of a LoRA Engine."""
    hf, _, adapters = setup(CASE)
    hf.save_pretrained(tmp_path / "model")
    save_adapter(adapters, tmp_path / "adapter")
    lora = f"r={adapters.lora.r},alpha={adapters.lora.alpha},targets=all-linear"
    temperature = TEMPERATURE if loss == "grpo" else 1.0
    peft = trl_peft_model(hf, adapters, temperature=temperature)
    if loss == "dpo":
        batches = [pairs_batch(10 + seed, peft) for seed in range(3)]
        steps = [batch_of(i, lab, loss=DPOLoss(BETA_DPO), fields={"mask": m, "ref": r}) for i, lab, m, r in batches]
        trl_steps = [(i, lab, {"ref": r}) for i, lab, _, r in batches]

        def trl_loss(logp: torch.Tensor, entropy: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor:
            return trl_dpo_loss(logp, f["ref"], BETA_DPO)
    else:
        rollouts = [rollout_batch(20 + seed, peft) for seed in range(3)]
        steps = [batch_of(i, lab, loss=GRPO, temperature=TEMPERATURE, entropy=True, fields=f)
                 for i, lab, f, _ in rollouts]
        trl_steps = [(i, lab, t) for i, lab, _, t in rollouts]

        def trl_loss(logp: torch.Tensor, entropy: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor:
            return trl_grpo_loss(logp[:, -COMPLETION:], f, "dapo", EPS_LOW, EPS_HIGH, BETA, COMPLETION)
    with megatrain.Engine(tmp_path / "model", lora=lora, adapter=tmp_path / "adapter", lora_base_dtype="fp32",
                          optimizer_workers=1, precision="fp32", device="cpu", **OPTIM) as engine:
        losses = [engine.step_batch(step).loss for step in steps]
        params = engine.parameters()
    assert params.keys() == adapters.tensors.keys()  # the adapters alone train
    assert_trains_as_transformers((losses, params), tmp_path / "model", trl_steps, trl_loss, temperature=temperature,
                                  model=lambda dtype: trl_peft_model(hf, adapters, dtype, temperature))
