"""Losses on per-token log-probabilities (megatrain/engine/token_loss.py, megatrain/model/logprob_head.py) against
transformers' own model: the log-probs and entropies of the labels, at a temperature, within 1e-5 of its
log-softmax; the gradient of a loss on them (a clipped ratio, an entropy bonus, per-sequence and per-token fields)
as autograd through transformers' model gives it; cross-entropy written as such a loss gives today's gradients bit
for bit; micro-batches give the whole batch's loss and gradients. Native models (Llama; Gemma 2's soft-capped,
tied head) and the generic path (Phi-3). Bad losses are one sentence."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from helpers import (
    FAMILIES,
    assert_matches,
    batch,
    gemma2_config,
    make_labels,
    rel_err,
    saved_hf_model,
)
from post_helpers import hf_logprobs
from transformers import Phi3Config

import megatrain
from megatrain import MegatrainError
from megatrain.engine.token_loss import TokenLoss

PHI3 = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=2, pad_token_id=0, bos_token_id=0, eos_token_id=1)
MODELS = {"llama": FAMILIES["llama-gqa"], "gemma2": gemma2_config, "phi3-generic": lambda: Phi3Config(**PHI3)}
TEMPERATURE = 0.7


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, torch.nn.Module, megatrain.api.Model]]:
    hf, directory = saved_hf_model(MODELS[request.param](), tmp_path_factory, request.param)
    with megatrain.from_pretrained(directory, loss_chunk_tokens=7) as model:  # chunks that straddle rows
        generic = type(model.executor.arch).__name__ == "GenericArchitecture"
        assert generic == request.param.endswith("generic")
        yield request.param, hf, model


def surrogate(logp: torch.Tensor, entropy: torch.Tensor | None, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """A clipped ratio to old log-probs times per-sequence advantages, a per-token weight, an entropy bonus: every
    kind of field, logp and entropy both under a non-linear function."""
    ratio = torch.exp(logp - f["old"])
    per_token = -torch.min(ratio * f["adv"][:, None], ratio.clamp(0.8, 1.2) * f["adv"][:, None]) * f["weight"]
    mask = f["mask"]
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() - 0.01 * (entropy * mask).sum() / mask.sum()


def fields_of(ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mask = (labels != -100).float()
    mask[:, 0] = 0
    return {"mask": mask, "adv": torch.randn(ids.shape[0], generator=gen),
            "old": -4.8 + 0.3 * torch.randn(ids.shape, generator=gen), "weight": torch.rand(ids.shape, generator=gen)}


def test_logprobs_match_transformers(model_case) -> None:
    _, hf, model = model_case
    ids = batch()
    labels = make_labels("masked", ids)
    with torch.no_grad():
        want_lp, want_ent = hf_logprobs(hf, ids, labels, TEMPERATURE)
    lp, ent = model.logprobs(ids, labels, temperature=TEMPERATURE, entropy=True)
    assert rel_err(lp, want_lp) <= 1e-5 and rel_err(ent, want_ent) <= 1e-5
    lp2, none = model.logprobs(ids, labels, temperature=TEMPERATURE, micro_batches=3)  # a row at a time
    assert none is None and rel_err(lp2, want_lp) <= 1e-5


def test_loss_gradient_matches_transformers(model_case) -> None:
    _, hf, model = model_case
    ids = batch(2)
    labels = make_labels("masked", ids)
    labels[2, 9:] = ids[2, 9:]  # the fully masked row gets a completion
    fields = fields_of(ids, labels)
    loss = TokenLoss(surrogate, fields, temperature=TEMPERATURE, entropy=True)

    def reference(m: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        lp, ent = hf_logprobs(m, ids, labels, TEMPERATURE)
        value = surrogate(lp.to(m.dtype), ent.to(m.dtype), {k: v.to(m.dtype) for k, v in fields.items()})
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    exact = reference(copy.deepcopy(hf).double())
    value, grads = model.loss_and_grads(ids, labels, loss=loss)
    ours = (value, {k: v.clone() for k, v in grads.items()})
    assert_matches(ours, reference(hf), exact)
    # micro-batches: the loss sees the whole step's rows, so a mean of per-sequence means stays that
    value_k, grads_k = model.loss_and_grads(ids, labels, loss=loss, micro_batches=3)
    assert rel_err(value_k, value) <= 1e-6
    for name, g in ours[1].items():
        assert rel_err(grads_k[name], g) <= 1e-5, name


def test_cross_entropy_as_a_loss_is_todays_path_bit_for_bit(model_case) -> None:
    """The native head's closed form with a = -1/n is ops.cross_entropy_sum_and_grad's arithmetic: the same bits
    for every gradient. The loss itself is the same sum in another order (the chunks' sums added vs one sum over
    [batch, seq]): equal within rounding. The generic path's head differentiates F.cross_entropy for today's loss
    and log_softmax-gather for a loss on log-probs, both under autograd: equal within rounding only."""
    case, _, model = model_case
    ids = batch(4)
    labels = make_labels("masked", ids)
    n = int((labels[:, 1:] != -100).sum())
    mask = (labels != -100).float()
    mask[:, 0] = 0
    today, grads = model.loss_and_grads(ids, labels)
    today_grads = {k: v.clone() for k, v in grads.items()}
    value, grads = model.loss_and_grads(ids, labels, loss=TokenLoss(lambda lp, _, f: -(lp * f["mask"]).sum() / n,
                                                                   {"mask": mask}))
    assert rel_err(value, today) <= 1e-6
    if case.endswith("generic"):
        assert all(rel_err(grads[k], g) <= 1e-6 for k, g in today_grads.items())
        return
    different = [k for k, g in today_grads.items() if not torch.equal(grads[k], g)]
    assert not different, f"gradients not bit-identical: {different}"


def test_bad_losses_are_one_sentence(model_case) -> None:
    _, _, model = model_case
    ids = batch()
    with pytest.raises(MegatrainError, match="must return one number computed from the log-probabilities"):
        model.loss_and_grads(ids, loss=TokenLoss(lambda lp, ent, f: lp.sum(-1)))
    with pytest.raises(MegatrainError, match="must return one number"):
        model.loss_and_grads(ids, loss=TokenLoss(lambda lp, ent, f: torch.tensor(1.0)))
    with pytest.raises(MegatrainError, match="one executor and the layer-major schedule"):
        model.loss_and_grads(ids, loss=TokenLoss(lambda lp, ent, f: lp.sum()), micro_batches=3,
                             schedule="per-micro-batch")
    with pytest.raises(MegatrainError, match="temperature must be a positive number"):
        TokenLoss(lambda lp, ent, f: lp.sum(), temperature=0.0)
