"""What the post-training tests share (test_token_loss, test_dpo, test_grpo, test_generation*): transformers' greedy
generate on left-padded prompts, transformers' per-token log-probs under
autograd (TRL's own fused LM head in fp32, trl.trainer.utils.add_fused_lm_head; the plain log-softmax in fp64, where
TRL's head computes in fp32), TRL's DPO and GRPO losses on them, and transformers' training on such a loss with
torch.optim.AdamW, in fp32 and in fp64 (the exact run the fp32 runs are judged against), as tests/helpers.py's
hf_reference does for cross-entropy.

TRL's loss code is not separable from its trainers (DPOTrainer._compute_loss, GRPOTrainer._compute_loss read the
trainer's state and an accelerator), so trl_dpo_loss and trl_grpo_loss replicate it operation for operation, with
the lines of trl 1.16.0 they follow."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILIES, hf_reference, max_rel, saved_hf_model
from transformers import Phi3Config
from trl.trainer.utils import add_fused_lm_head

import megatrain
from megatrain.post.dpo import Pair, pair_batch
from megatrain.post.grpo import group_advantages

# (ids, labels, fields) of one step
Step = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=1, total_steps=4)
# (TRL-aligned log-probs [b, t - 1], entropies [b, t - 1], fields) -> the loss
LossOf = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


def trl_logprobs(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [b, t - 1] as TRL's trainers get them (position t: the label t + 1; 0 where
    it is -100), under autograd: TRL's fused LM head on an fp32 model, the plain log-softmax of logits / temperature
    on an fp64 one (TRL's head returns fp32 whatever the model's dtype)."""
    if model.dtype == torch.float32:
        if getattr(model, "_trl_temperature", None) != temperature:
            add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
            model._trl_temperature = temperature
        out = model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False)
        return out.log_probs, out.entropy
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits / temperature, dim=-1)[:, :-1]
    target = labels[:, 1:]
    valid = target != -100
    picked = logp.gather(2, target.clamp_min(0).unsqueeze(2)).squeeze(2) * valid
    return picked, -(logp.exp() * logp).sum(-1) * valid


def trl_peft_model(hf: torch.nn.Module, adapters: Any, dtype: torch.dtype = torch.float32, temperature: float = 1.0
                   ) -> torch.nn.Module:
    """PEFT's LoRA (`adapters`: megatrain.lora.Adapters) on a copy of transformers' model in `dtype`, as TRL's trainers
    make it: in fp32 TRL's fused LM head added first (add_fused_lm_head: "add the head before wrapping the model with
    PEFT"), at `temperature`, for trl_logprobs."""
    import peft
    from peft.utils import set_peft_model_state_dict

    base = copy.deepcopy(hf).to(dtype)
    if dtype == torch.float32:
        add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
    lora = adapters.lora
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                      target_modules=list(lora.target_modules),
                                                      use_rslora=lora.use_rslora))
    assert not set_peft_model_state_dict(model, {n: t.to(dtype) for n, t in adapters.tensors.items()}).unexpected_keys
    model._trl_temperature = temperature  # the head trl_logprobs would add is there
    return model


def label_aligned(trl: torch.Tensor) -> torch.Tensor:
    """TRL's [b, t - 1] as megatrain aligns it, [b, t] with the labels (0 at position 0)."""
    return torch.cat([trl.new_zeros(trl.shape[0], 1), trl], 1)


def hf_logprobs(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-softmax of logits / temperature gathered at the labels, and each position's entropy, aligned
    with the labels as megatrain gives them; under autograd."""
    logp = torch.log_softmax(hf(input_ids=ids, use_cache=False).logits / temperature, dim=-1)[:, :-1]
    target = labels[:, 1:]
    valid = target != -100
    picked = logp.gather(2, target.clamp_min(0).unsqueeze(2)).squeeze(2) * valid
    return label_aligned(picked), label_aligned(-(logp.exp() * logp).sum(-1) * valid)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 100, 101, 17, 18, 19]]  # left-padded to 7 tokens


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], new: int, eos: int | None = None,
              logits: list[torch.Tensor] | None = None) -> list[list[int]]:
    """transformers' greedy generate on the prompts left-padded (with its attention mask): each row's new tokens, up
    to and including its end-of-sequence token; the logits of every step appended to `logits`, where given."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eos,
                      output_logits=True, return_dict_in_generate=True)
    if logits is not None:
        logits.extend(out.logits)
    rows = [r[longest:].tolist() for r in out.sequences]
    return [r[: r.index(eos) + 1] if eos in r else r for r in rows]


# the post-training tests' models: a native one (Llama) and one of the generic path (Phi-3)
VOCAB = 128
PHI3 = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=2, pad_token_id=0, bos_token_id=0, eos_token_id=1)
MODELS = {"llama": FAMILIES["llama-gqa"], "phi3-generic": lambda: Phi3Config(**PHI3)}
# GRPO's rollout batches: 2 prompts x GROUP completions, PROMPT + COMPLETION tokens, sampled at TEMPERATURE
PROMPT, COMPLETION, GROUP, TEMPERATURE = 6, 10, 3, 0.9


def post_model_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[torch.nn.Module, megatrain.api.Model]]:
    """(transformers' model, megatrain's of the same weights in this process) of MODELS[request.param]: a test module's
    fixture as `model_case = pytest.fixture(scope="module", params=list(MODELS))(post_model_case)`."""
    hf, directory = saved_hf_model(MODELS[request.param](), tmp_path_factory, request.param)
    with megatrain.from_pretrained(directory, loss_chunk_tokens=7) as model:
        yield hf, model


def pairs_batch(seed: int, hf: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, completion mask, reference log-probs) of 3 pairs of uneven lengths, the reference the model's
    own sequence log-probs moved by noise (so the log-ratios differ from 0 both ways)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, VOCAB, (n,), generator=gen).tolist()

    pairs = [Pair(tokens(4), tokens(6), tokens(3)), Pair(tokens(7), tokens(2), tokens(5)),
             Pair(tokens(3), tokens(8), tokens(8))]
    ids, labels, mask = pair_batch(pairs, pad_id=0)
    with torch.no_grad():
        own = trl_logprobs(copy.deepcopy(hf), ids, labels)[0].sum(1)
    return ids, labels, mask, own + torch.randn(own.shape, generator=gen)


def rollout_batch(seed: int, hf: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor],
                                                         dict[str, torch.Tensor]]:
    """(ids, labels, megatrain's fields aligned with the labels, TRL's inputs on the completion) of 2 prompts x GROUP
    completions of uneven lengths (right-padded), old and reference log-probs off the model's by noise (some ratios
    clip at either side)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * GROUP
    prompts = torch.randint(2, VOCAB, (2, PROMPT), generator=gen).repeat_interleave(GROUP, dim=0)
    completion = torch.randint(2, VOCAB, (rows, COMPLETION), generator=gen)
    lengths = torch.tensor([10, 7, 3, 10, 5, 1])
    completion_mask = (torch.arange(COMPLETION)[None, :] < lengths[:, None]).float()
    completion = completion.where(completion_mask.bool(), 0)
    ids = torch.cat([prompts, completion], 1)
    labels = ids.where(torch.cat([torch.zeros(rows, PROMPT), completion_mask], 1).bool(), -100)
    with torch.no_grad():
        current = trl_logprobs(copy.deepcopy(hf), ids, labels, TEMPERATURE)[0][:, -COMPLETION:]
    old = (current + 0.25 * torch.randn(current.shape, generator=gen)) * completion_mask
    ref = (current + 0.3 * torch.randn(current.shape, generator=gen)) * completion_mask
    advantages = group_advantages(torch.rand(rows, generator=gen), GROUP)
    trl_inputs = {"completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
                  "ref_per_token_logps": ref, "num_items_in_batch": completion_mask.sum()}
    pad = torch.zeros(rows, PROMPT)
    fields = {"mask": torch.cat([pad, completion_mask], 1), "advantages": advantages,
              "old_logps": torch.cat([pad, old], 1), "ref_logps": torch.cat([pad, ref], 1),
              "num_items": completion_mask.sum()}
    return ids, labels, fields, trl_inputs


def trl_dpo_loss(per_token_logps: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """dpo_trainer.py DPOTrainer._compute_loss, the sigmoid loss with reverse KL (ld_alpha None): L1304 the sum over
    the sequence, L1316 chunk into [chosen, rejected], L1350-1351 the log-ratios to the reference's (ref: TRL's
    ref_chosen_logps then ref_rejected_logps), L1354 the scores, L1383 delta_score, L1388 -logsigmoid(beta * delta),
    L1528 `loss += per_sequence_loss.mean() * loss_weight` (weight 1)."""
    logps = per_token_logps.sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    ref_chosen_logps, ref_rejected_logps = ref.chunk(2, dim=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta_score = chosen_logratios - rejected_logratios
    per_sequence_loss = -F.logsigmoid(beta * delta_score)
    return 0.0 + per_sequence_loss.mean() * 1.0


def trl_grpo_loss(per_token_logps: torch.Tensor, inputs: dict[str, torch.Tensor], loss_type: str,
                  epsilon_low: float, epsilon_high: float, beta: float, max_completion_length: int) -> torch.Tensor:
    """grpo_trainer.py GRPOTrainer._compute_loss with importance sampling per token, no delta, no masks beyond the
    completion's, one process, no gradient accumulation, steps_per_generation 1 (the normalizers' factors 1): on the
    completion's [b, c] tensors as TRL holds them. L3059 advantages unsqueezed, L3066 old log-probs (detached current
    where absent), L3083 log_ratio, L3095 coef_1, L3100 the k3 KL, L3113 coef_2, L3118-3120 the clipped surrogate,
    L3150 + beta * KL, L3154 grpo, L3159 bnpo, L3164 dr_grpo, L3170-3173 dapo (num_items_in_batch)."""
    mask = inputs["completion_mask"]
    advantages = inputs["advantages"].unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    if beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / 1.0
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / 1.0
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / 1.0
    assert loss_type == "dapo"
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / 1
    normalizer = normalizer * 1 / 1
    return (per_token_loss * mask).sum() / normalizer


def hf_train(hf_dir: Path, steps: list[Step], loss: LossOf, dtype: torch.dtype = torch.float32,
             max_grad_norm: float | None = 1.0, temperature: float = 1.0, optim: dict[str, Any] = OPTIM,
             scale: float = 1.0, model: Callable[[torch.dtype], torch.nn.Module] | None = None
             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """helpers.hf_reference (transformers' model, or model(dtype): a PEFT model's adapters, trained by
    torch.optim.AdamW on HF's cosine schedule, as the Engine's defaults) on `loss` of its TRL-aligned log-probs
    (trl_logprobs), floating fields cast to `dtype`."""
    def step_loss(m: torch.nn.Module, step: Step) -> torch.Tensor:
        ids, labels, fields = step
        logp, entropy = trl_logprobs(m, ids, labels, temperature)
        return loss(logp, entropy, {k: v.to(dtype) if v.is_floating_point() else v for k, v in fields.items()})

    return hf_reference(hf_dir, steps, max_grad_norm, optim, dtype, loss=step_loss, scale=scale, model=model)


def assert_trains_as_transformers(ours: tuple[list[float], dict[str, torch.Tensor]], hf_dir: Path,
                                  steps: list[Step], loss: LossOf, **options: Any) -> None:
    """megatrain's losses within 1e-5 of the fp64 run's, and its parameters as close to that run's as transformers'
    fp32 runs are (twice the farthest of three whose roundings differ: the loss scaled by 1 and 1 +- 2^-20, as
    megatrain/self_check.py judges; or 1e-5). A clipped surrogate's kinks amplify rounding, so one run's distance
    is no measure of it."""
    exact_losses, exact = hf_train(hf_dir, steps, loss, torch.float64, **options)
    assert ours[0] == pytest.approx(exact_losses, rel=1e-5, abs=1e-6)
    runs = [hf_train(hf_dir, steps, loss, scale=s, **options)[1] for s in (1.0, 1.0 + 2**-20, 1.0 - 2**-20)]
    assert ours[1].keys() == exact.keys()
    mine = max_rel(ours[1], exact)
    theirs = {n: max(max_rel(run, exact)[n] for run in runs) for n in exact}
    too_far = {n: (e, theirs[n]) for n, e in mine.items() if e > max(1e-5, 2 * theirs[n])}
    assert not too_far, f"(megatrain, transformers fp32) relative errors against fp64: {too_far}"


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_main(script: Path, *args: str) -> None:
    """An example script's main(argv), in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(list(args))


def tiny_chat_model(corpus: Path, out: Path) -> Path:
    """examples/finetune/make_model.py's tiny Qwen2 with a BPE tokenizer trained on `corpus` (chat records)."""
    example_main(EXAMPLES / "finetune" / "make_model.py", "--data", str(corpus), "--out", str(out))
    return out
