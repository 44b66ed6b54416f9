"""`megatrain grpo --model M --prompts P.jsonl --reward module.py:function --group-size G --max-new-tokens N`:
GRPO (megatrain/post/grpo.py) with rollouts sampled by the streamed model itself (Engine.generate), as TRL's
GRPOTrainer runs it; the KL reference streamed from the initial weights in the arena, no second model
(docs/design.md#grpo-runs)."""

from __future__ import annotations

import importlib.util
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatrain.config import ConfigError
from megatrain.data.tokenizers import Tokenizer
from megatrain.post.grpo import GRPOLoss, group_advantages, reward_metrics, weighted_rewards
from pipelines.logprobs import batch_of
from pipelines.post_run import EngineOptions, RunLog, model_and_tokenizer, read_jsonl, save_final

log = logging.getLogger(__name__)
RewardFn = Callable[..., list[float | None]]
SHOWN = ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completions/mean_length", "loss")


@dataclass
class GRPOConfig:
    group_size: int = 8  # TRL's num_generations
    max_new_tokens: int = 64
    prompts_per_step: int = 4
    steps: int = 100  # rollout batches
    iterations: int = 1  # optimisation steps per rollout batch (TRL's num_iterations)
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    beta: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    scale_rewards: str = "group"
    reward_weights: list[float] | None = None
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(lr=1e-6))


@dataclass
class Rollouts:
    """A rollout batch as one step's rows: prompt then completion, right-padded, the labels on the completion."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor  # 1 on the completion's tokens, aligned with the labels
    completions: list[Any]  # text, or [{"role": "assistant", "content": text}] for chat prompts
    lengths: list[int]
    finished: list[bool]


def load_rewards(specs: list[str], weights: list[float] | None) -> tuple[list[RewardFn], torch.Tensor]:
    """The reward functions named "path/to/module.py:function" (or "package.module:function"), and their weights."""
    if not specs:
        raise ConfigError("grpo needs a reward: --reward module.py:function (repeat it for several).")
    functions = []
    for spec in specs:
        module_name, _, name = spec.rpartition(":")
        if not module_name or not name:
            raise ConfigError(f"--reward {spec!r} is not module.py:function.")
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ConfigError(f"--reward {spec!r}: {path} is no file.")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        if not callable(getattr(module, name, None)):
            raise ConfigError(f"--reward {spec!r}: {module_name} has no function {name}.")
        functions.append(getattr(module, name))
    if weights is not None and len(weights) != len(functions):
        raise ConfigError(f"{len(weights)} reward weights for {len(functions)} reward functions; give one each.")
    return functions, torch.tensor(weights or [1.0] * len(functions), dtype=torch.float32)


def prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """A prompt's tokens: text encoded; chat messages through the chat template up to the assistant's turn."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ConfigError("a prompt is text or a list of chat messages ({\"role\": ..., \"content\": ...}).")
    ids, assistant = tokenizer.apply_chat([*prompt, {"role": "assistant", "content": ""}])
    return ids[: assistant.index(True)] if True in assistant else ids


def score(rewards: list[RewardFn], weights: torch.Tensor, records: list[dict[str, Any]], completions: list[Any],
          completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards per completion and function [B, F], their weighted sum [B]) as TRL's _calculate_rewards calls the
    functions: prompts, completions, completion_ids and every other column of the records; a None is NaN, and a
    completion no function scored has a NaN sum (megatrain/post/grpo.py: weighted_rewards), with TRL's warning."""
    columns = {k: [r.get(k) for r in records] for k in records[0] if k not in ("prompt", "completion")}
    per_func = torch.zeros(len(records), len(rewards))
    for j, fn in enumerate(rewards):
        values = fn(prompts=[r["prompt"] for r in records], completions=completions, completion_ids=completion_ids,
                    **columns)
        if len(values) != len(records):
            raise ConfigError(f"the reward function {fn.__name__} returned {len(values)} rewards for "
                              f"{len(records)} completions; return one each.")
        per_func[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
    unscored = torch.isnan(per_func).all(dim=1).nonzero()
    if len(unscored):
        row = int(unscored[0])
        log.warning("All reward functions returned None for the completion %r of the prompt %r (and %d more); it is "
                    "left out of its group's mean and std, its advantage 0.", completions[row], records[row]["prompt"],
                    len(unscored) - 1)
    return per_func, weighted_rewards(per_func, weights)


def rollout(engine: Any, records: list[dict[str, Any]], tokenizer: Tokenizer, cfg: GRPOConfig, seed: int
            ) -> Rollouts:
    """Each record's prompt sampled group_size times by the Engine (the rows of one prompt together)."""
    prompts = [prompt_ids(r["prompt"], tokenizer) for r in records for _ in range(cfg.group_size)]
    out = engine.generate(prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed)
    texts = [tokenizer.decode([t for t in ids if t != tokenizer.eos_id]) for ids in out.token_ids]
    chat = not isinstance(records[0]["prompt"], str)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    seq = max(len(p) + len(c) for p, c in zip(prompts, out.token_ids, strict=True))
    ids = torch.full((len(prompts), seq), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for r, (p, c) in enumerate(zip(prompts, out.token_ids, strict=True)):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        labels[r, len(p) : len(p) + len(c)] = torch.tensor(c, dtype=torch.long)
    return Rollouts(ids, labels, (labels != -100).float(), completions, [len(c) for c in out.token_ids],
                    out.finished)


def run_grpo(model: str | Path, prompts: str | Path, rewards: list[str], out: str | Path,
             cfg: GRPOConfig | None = None) -> dict[str, Any]:
    """Trains `model` by GRPO on `prompts` with `rewards` ("module.py:function") into `out`; returns the first and
    last steps' metrics."""
    import megatrain

    cfg = cfg or GRPOConfig()
    out = Path(out)
    model_dir, tokenizer = model_and_tokenizer(model)
    records = read_jsonl(prompts, "--prompts")
    if any("prompt" not in r for r in records):
        raise ConfigError(f"every record of {prompts} needs a \"prompt\" (text or chat messages), as TRL's.")
    reward_fns, weights = load_rewards(rewards, cfg.reward_weights)
    loss = GRPOLoss(cfg.loss_type, cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high,
                    cfg.beta, cfg.max_new_tokens)
    longest = max(len(prompt_ids(r["prompt"], tokenizer)) for r in records) + cfg.max_new_tokens
    order = random.Random(cfg.engine.seed)
    history: list[dict[str, float]] = []
    with megatrain.Engine(model_dir, total_steps=cfg.steps * cfg.iterations, seq_len=longest,
                          batch_size=cfg.prompts_per_step * cfg.group_size, reference=cfg.beta > 0,
                          **cfg.engine.engine_kwargs()) as engine:
        run_log = RunLog(out, engine.metrics)
        for step in range(1, cfg.steps + 1):
            chosen = [records[order.randrange(len(records))] for _ in range(cfg.prompts_per_step)]
            history.append(grpo_step(engine, chosen, tokenizer, reward_fns, weights, loss, cfg, step))
            run_log.write("step", step, history[-1], SHOWN)
        final = save_final(engine, out, model_dir)
    return {"steps": cfg.steps, "first": history[0], "last": history[-1], "final": str(final),
            "reward_first": history[0]["reward"], "reward_last": history[-1]["reward"]}


def grpo_step(engine: Any, records: list[dict[str, Any]], tokenizer: Tokenizer, reward_fns: list[RewardFn],
              weights: torch.Tensor, loss: GRPOLoss, cfg: GRPOConfig, step: int) -> dict[str, float]:
    """One rollout batch and its `iterations` optimisation steps; returns the step's metrics (TRL's names)."""
    batch = rollout(engine, records, tokenizer, cfg, seed=cfg.engine.seed + step)
    repeated = [r for r in records for _ in range(cfg.group_size)]
    completion_ids = [row[m.bool()].tolist() for row, m in zip(batch.labels, batch.mask, strict=True)]
    per_func, rewards = score(reward_fns, weights, repeated, batch.completions, completion_ids)
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards)  # 0 where NaN, as TRL
    fields: dict[str, torch.Tensor] = {"mask": batch.mask, "advantages": advantages, "num_items": batch.mask.sum()}
    if cfg.iterations > 1:  # the sampling policy's log-probs, fixed over the passes
        fields["old_logps"] = engine.logprobs(batch.input_ids, batch.labels, temperature=cfg.temperature)
    if cfg.beta > 0:  # the initial policy's, from its weights stored in the arena
        fields["ref_logps"] = engine.logprobs(batch.input_ids, batch.labels, temperature=cfg.temperature,
                                              reference=True)
    metrics: dict[str, float] = {}
    for _ in range(cfg.iterations):
        result = engine.step_batch(batch_of(batch.input_ids, batch.labels, loss=loss, temperature=cfg.temperature,
                                            entropy=True, fields=fields))
        metrics = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, **result.loss_metrics}
    metrics |= reward_metrics(per_func, rewards, [fn.__name__ for fn in reward_fns], cfg.group_size, cfg.scale_rewards)
    return metrics | {"completions/mean_length": sum(batch.lengths) / len(batch.lengths),
                      "completions/clipped_ratio": 1 - sum(batch.finished) / len(batch.finished)}

