"""DPO (megatrain/post/dpo.py, pipelines/dpo.py) against TRL's code on transformers' model: the gradients of the
sigmoid loss through megatrain's chunked head and layers against TRL's per-token log-probs (its fused LM head) and
DPOTrainer._compute_loss's arithmetic (post_helpers.trl_dpo_loss), native (Llama) and generic path (Phi-3), 1e-5;
TRL's metrics reported with the loss; 3 Engine steps against transformers + TRL's loss + torch.optim.AdamW judged
against fp64; TRL's record formats (text, chat, implicit prompt) as token ids; `megatrain dpo` end to end on a
tiny model with a tokenizer: the reference log-probs cached beside the run and reused, the held-out preference
accuracy up (the example's whole run: slow)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_matches, build_hf_model, run_cli
from post_helpers import (
    MODELS,
    OPTIM,
    assert_trains_as_transformers,
    example_main,
    pairs_batch,
    post_model_case,
    tiny_chat_model,
    trl_dpo_loss,
    trl_logprobs,
)

import megatrain
from megatrain.config import ConfigError
from megatrain.data.tokenizers import ByteTokenizer, load_tokenizer
from megatrain.engine.token_loss import TokenLoss
from megatrain.post.dpo import DPOLoss, Pair, encode_pair, pair_batch
from pipelines.dpo import CACHE, DPOConfig, reference_logps, split
from pipelines.logprobs import batch_of

BETA = 0.3
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "post"


def test_pairs_in_trl_formats_become_rows() -> None:
    tok = ByteTokenizer(chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
                                      "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = encode_pair({"prompt": "ab", "chosen": "c", "rejected": "de"}, tok, tok.eos_id)
    assert text == Pair([97, 98], [99, tok.eos_id], [100, 101, tok.eos_id])
    user = [{"role": "user", "content": "hi"}]
    chat = encode_pair({"prompt": user, "chosen": [{"role": "assistant", "content": "y"}],
                        "rejected": [{"role": "assistant", "content": "no"}]}, tok, tok.eos_id)
    assert bytes(chat.prompt).decode() == "<user>hi|<assistant>" and bytes(chat.chosen).decode() == "y|"
    implicit = encode_pair({"chosen": user + [{"role": "assistant", "content": "y"}],
                            "rejected": user + [{"role": "assistant", "content": "no"}]}, tok, tok.eos_id)
    assert implicit == chat
    ids, labels, mask = pair_batch([text, Pair([1], [2], [3, 4, 5])], pad_id=0)
    assert ids.tolist() == [[97, 98, 99, 257, 0], [1, 2, 0, 0, 0], [97, 98, 100, 101, 257], [1, 3, 4, 5, 0]]
    assert labels[0].tolist() == [-100, -100, 99, 257, -100] and mask[3].tolist() == [0, 1, 1, 1, 0]
    with pytest.raises(ConfigError, match="needs \"chosen\" and \"rejected\""):
        encode_pair({"prompt": "a", "chosen": "b"}, tok, None)


model_case = pytest.fixture(scope="module", params=list(MODELS))(post_model_case)


def test_gradients_match_trl_loss(model_case) -> None:
    hf, model = model_case
    ids, labels, mask, ref = pairs_batch(1, hf)

    def reference(m: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        value = trl_dpo_loss(trl_logprobs(m, ids, labels)[0], ref.to(m.dtype), BETA)
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    loss = TokenLoss(DPOLoss(BETA), {"mask": mask, "ref": ref})
    value, grads = model.loss_and_grads(ids, labels, loss=loss)
    assert_matches((value, {k: v.clone() for k, v in grads.items()}), reference(copy.deepcopy(hf)),
                   reference(copy.deepcopy(hf).double()))
    # TRL's logged metrics (dpo_trainer.py L1583-1601): beta x the log-ratios, their margin, the pairs ordered right
    with torch.no_grad():
        chosen, rejected = trl_logprobs(copy.deepcopy(hf), ids, labels)[0].sum(1).chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    rewards_chosen, rewards_rejected = BETA * (chosen - ref_chosen), BETA * (rejected - ref_rejected)
    want = {"rewards/chosen": rewards_chosen.mean(), "rewards/rejected": rewards_rejected.mean(),
            "rewards/margins": (rewards_chosen - rewards_rejected).mean(),
            "rewards/accuracies": (rewards_chosen > rewards_rejected).float().mean()}
    for name, value in want.items():
        assert loss.reported[name] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name
    assert 0 < loss.reported["rewards/accuracies"] < 1  # the noise orders some pairs each way


def test_engine_three_steps_match_trl_loss_and_adamw(ray_session: None, tmp_path: Path) -> None:
    hf = build_hf_model(MODELS["llama"]())
    hf.save_pretrained(tmp_path)
    batches = [pairs_batch(10 + seed, hf) for seed in range(3)]
    with megatrain.Engine(tmp_path, optimizer_workers=1, precision="fp32", device="cpu", **OPTIM) as engine:
        results = [engine.step_batch(batch_of(ids, labels, loss=DPOLoss(BETA), fields={"mask": mask, "ref": ref}))
                   for ids, labels, mask, ref in batches]
        params = engine.parameters()
    assert all({"rewards/margins", "rewards/accuracies"} <= r.loss_metrics.keys() for r in results)
    steps = [(ids, labels, {"ref": ref}) for ids, labels, _, ref in batches]
    assert_trains_as_transformers(([r.loss for r in results], params), tmp_path, steps,
                                  lambda logp, entropy, f: trl_dpo_loss(logp, f["ref"], BETA))


def _example_data(tmp_path: Path, pairs: int) -> Path:
    example_main(EXAMPLE / "make_data.py", "--out", str(tmp_path), "--pairs", str(pairs))
    return tmp_path


def test_megatrain_dpo_caches_the_reference_and_raises_held_out_accuracy(ray_session: None, tmp_path: Path
                                                                        ) -> None:
    """CI's representative of the example (examples/post/run.sh; its 100 steps: slow): 10 steps of 8 pairs."""
    data = _example_data(tmp_path, pairs=120)
    model = tiny_chat_model(data / "corpus.jsonl", tmp_path / "tiny")
    args = ("dpo", "--model", str(model), "--data", str(data / "pairs.jsonl"), "--out", str(tmp_path / "dpo"),
            "--lr", "1e-3", "--batch-pairs", "8", "--steps", "10", "--eval-every", "10", "--device", "cpu")
    run = run_cli(*args)
    assert run.returncode == 0, run.output
    summary = json.loads(run.output.strip().splitlines()[-1])
    first, last = summary["eval_first"], summary["eval_last"]
    assert first["eval/rewards/accuracies"] == 0.0  # the policy is the reference: every reward 0
    assert last["eval/rewards/accuracies"] > 0.5 and last["eval/rewards/margins"] > 0
    assert (tmp_path / "dpo" / "final" / "tokenizer.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "step"] == list(range(1, 11))
    # the reference log-probs beside the run, for this data, model and length: a rerun reads them, no forward
    cache = tmp_path / "dpo" / CACHE
    saved = json.loads(cache.read_text())
    train, held_out = split([encode_pair(json.loads(line), load_tokenizer(model), None) for line in
                             (data / "pairs.jsonl").read_text().splitlines()], 0.1, 0)
    splits = {"train": train, "eval": held_out}
    assert reference_logps(None, cache, saved["key"], splits, 0, DPOConfig()) == {
        k: [tuple(p) for p in saved[k]] for k in splits}


@pytest.mark.slow
def test_the_example_raises_held_out_accuracy(ray_session: None, tmp_path: Path) -> None:
    """examples/post/run.sh's DPO run: 100 steps of 8 pairs (on this machine: held-out accuracy 0 -> 0.825)."""
    data = _example_data(tmp_path, pairs=400)
    model = tiny_chat_model(data / "corpus.jsonl", tmp_path / "tiny")
    run = run_cli("dpo", "--model", str(model), "--data", str(data / "pairs.jsonl"), "--out", str(tmp_path / "dpo"),
                  "--lr", "1e-3", "--batch-pairs", "8", "--steps", "100", "--device", "cpu")
    assert run.returncode == 0, run.output
    assert json.loads(run.output.strip().splitlines()[-1])["eval_last"]["eval/rewards/accuracies"] >= 0.75
