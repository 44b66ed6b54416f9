"""megatrain as a verl engine (pipelines/verl_engine.py): verl's own GRPO loss (ppo_loss, the vanilla clipped
policy loss, token-mean, k3 KL to a reference) on a verl no-padding batch, through the registered engine, against the
same verl loss on transformers' model (fp32, CPU, tiny llama).

verl's FSDP engine cannot run here (no CUDA: its device mesh is "cuda"), so the reference is transformers' model
with verl's own log-prob and loss code, as verl's FSDP engine feeds it (packed logits, rolled ids). Needs verl on
PYTHONPATH (0.9.1 declares transformers<5.11: it is installed with --no-deps, see the module's docstring).
"""

from __future__ import annotations

import functools
import os

import pytest

# verl is an optional extra that pip cannot install beside our transformers (see above): .ci/run puts it on
# PYTHONPATH, and with MEGATRAIN_CI set its absence fails this file instead of skipping it
if os.environ.get("MEGATRAIN_CI"):
    import verl  # noqa: F401
else:
    pytest.importorskip("verl", reason="needs verl on PYTHONPATH (installed --no-deps, as .ci/run does)")

import torch  # noqa: E402
from helpers import FAMILIES, build_hf_model, rel_err  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config import ActorConfig
from verl.workers.engine import EngineRegistry
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

import megatrain
from megatrain.engine.token_loss import TokenLoss
from pipelines import verl_engine
from pipelines.verl_engine import MegatrainVerlEngine, VerlLoss, padded

B, P, R, TEMP = 4, 5, 6, 0.7


def actor_config(entropy_coeff: float = 0.0, agg: str = "token-mean") -> ActorConfig:
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B, use_kl_loss=True,
                       kl_loss_coef=0.04, kl_loss_type="low_var_kl", loss_agg_mode=agg, clip_ratio=0.2,
                       entropy_coeff=entropy_coeff, rollout_n=1)


def rollout_batch() -> TensorDict:
    """A rollout batch as verl's trainer holds it (prompts left-padded, responses right-padded), then verl's own
    conversion to the no-padding batch its engines take."""
    g = torch.Generator().manual_seed(1)
    prompt_lens, response_lens = [5, 3, 4, 2], [6, 6, 2, 4]
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[b, P - p:P + r] = torch.randint(1, 128, (p + r,), generator=g)
        attention[b, P - p:P + r] = 1
        response_mask[b, :r] = 1
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    fields = {name: torch.randn(B, R, generator=g) * 0.2 * response_mask - 4.85 * response_mask
              for name in ("old_log_probs", "ref_log_prob")}
    advantages = torch.randn(B, 1, generator=g).expand(B, R) * response_mask
    data = TensorDict({"input_ids": ids, "attention_mask": attention, "response_mask": response_mask,
                       "position_ids": position_ids, "prompts": ids[:, :P], "responses": ids[:, P:],
                       "advantages": advantages, **fields}, batch_size=[B])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=TEMP, global_batch_size=None)
    return data


def transformers_loss(hf: torch.nn.Module, data: TensorDict, loss_fn, entropy: bool = False) -> torch.Tensor:
    """verl's loss on transformers' logits, the log-probs (and entropy) as verl's FSDP engine takes them (packed
    logits, rolled ids)."""
    seqs, offsets = data["input_ids"].unbind(), data["input_ids"].offsets()
    logits = torch.cat([hf(s[None]).logits[0] for s in seqs]) / TEMP
    packed = data["input_ids"].values()
    log_probs = logprobs_from_logits(logits=logits, labels=torch.roll(packed, -1))
    output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets)}
    if entropy:
        output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy_from_logits(logits), offsets)
    verl_engine.batch_info(data)
    return loss_fn(model_output=output, data=data, dp_group=None)[0]


def reference(hf: torch.nn.Module, loss_fn, entropy: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    hf.zero_grad()
    ref = transformers_loss(hf, rollout_batch(), loss_fn, entropy)
    ref.backward()
    return float(ref.detach()), {n: p.grad.clone() for n, p in hf.named_parameters()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = build_hf_model(FAMILIES["llama-gqa"]())
    d = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(d)
    loss_fn = functools.partial(ppo_loss, actor_config())
    return d, loss_fn, *reference(hf, loss_fn), hf


def test_registry_lookup():
    assert EngineRegistry.get_engine_cls("language_model", "megatrain") is MegatrainVerlEngine
    with pytest.raises(megatrain.MegatrainError, match="LoRA"):  # refused before anything starts
        EngineRegistry.new("language_model", "megatrain", "tiny", lora="r=4").initialize()


@pytest.mark.parametrize("entropy,agg", [(False, "token-mean"), (True, "token-mean"), (False, "seq-mean-token-mean")],
                         ids=["kl", "kl+entropy", "seq-mean-token-mean"])
def test_verl_grpo_loss_gradients_match_transformers(setup, entropy, agg):
    """verl's loss as megatrain's fn (the VerlLoss the engine hands its executor): every gradient within 1e-5; with
    an entropy bonus, megatrain's entropy reaches verl's loss as its FSDP engine's does; a per-sequence mean too."""
    d, loss_fn, ref, ref_grads, hf = setup
    if entropy or agg != "token-mean":
        loss_fn = functools.partial(ppo_loss, actor_config(0.01 if entropy else 0.0, agg))
        ref, ref_grads = reference(hf, loss_fn, entropy)
    data = rollout_batch()
    verl_engine.batch_info(data)
    batch = padded(data)
    m = megatrain.from_pretrained(d)
    verl_loss = VerlLoss(loss_fn, data, batch.offsets)
    loss, grads = m.loss_and_grads(batch.input_ids, batch.labels, loss=TokenLoss(verl_loss, {}, TEMP, entropy))
    assert ("actor/entropy_loss" in verl_loss.reported) == entropy
    assert abs(float(loss) - ref) <= 1e-5 * abs(ref)
    assert 0 < verl_loss.reported["actor/pg_clipfrac"] < 1  # the clip is active on some tokens, not all
    assert set(grads) == set(ref_grads)
    assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) < 1e-5


def test_engine_train_batch_weight_sync_checkpoint(setup, tmp_path):
    """verl's train_batch on the registered engine (one Engine, the executor a Ray actor): its loss and the gradient
    norm optimizer_step returns match transformers'; the weights stream out tensor by tensor, updated; a
    checkpoint loads back."""
    d, loss_fn, ref, ref_grads, _ = setup
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    engine = EngineRegistry.new("language_model", "megatrain", str(d), optimizer_workers=1, device="cpu",
                                precision="fp32", metrics=False, batch_size=B, seq_len=P + R, lr=1e-3)
    engine.initialize()
    try:
        before = engine.engine.parameters()
        with engine.train_mode():
            out = engine.train_batch(rollout_batch(), loss_fn)
        assert abs(out["loss"][0] - ref) <= 1e-5 * abs(ref)
        assert abs(out["metrics"]["grad_norm"] - ref_norm) <= 1e-5 * ref_norm
        assert "actor/pg_loss" in out["metrics"]
        with pytest.raises(megatrain.MegatrainError, match="forward_backward_batch"):
            engine.optimizer_step()
        params, peft = engine.get_per_tensor_param()
        assert peft is None and not isinstance(params, dict)
        synced = dict(params)
        assert set(synced) == set(before) and all(synced[n].shape == before[n].shape for n in before)
        assert any(not torch.equal(synced[n], before[n]) for n in before)
        with engine.eval_mode():
            logp = engine.infer_batch(rollout_batch())["model_output"]["log_probs"]
        engine.save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        with engine.eval_mode():
            again = engine.infer_batch(rollout_batch())["model_output"]["log_probs"]
        assert torch.equal(logp.values(), again.values())
    finally:
        engine.shutdown()
