"""`megatrain grpo` (pipelines/grpo.py) end to end on a tiny model with a tokenizer: rollouts sampled by the Engine's
own generation (Engine.generate, a KV cache over the streamed layers), two weighted rewards with TRL's signature and
a column of the prompts file, two optimisation passes per rollout batch (old log-probs from the sampling weights), the
k3 KL term to the initial policy (the initial weights streamed from their own arena segment, no checkpoint); the
metrics in OUT/metrics.jsonl, OUT/final a transformers model. The example's whole run (the reward rising well above
its start): slow. Bad rewards are one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli
from post_helpers import EXAMPLES, example_main, tiny_chat_model
from transformers import AutoModelForCausalLM

from megatrain.config import ConfigError, ModelConfig
from megatrain.memory.plan import plan_run
from megatrain.memory.post_plan import post_plan
from megatrain.model.layout import planned_unit_numels
from pipelines.grpo import load_rewards
from pipelines.post_run import RunLog

REWARDS = str(EXAMPLES / "post" / "rewards.py")


def _model_and_prompts(tmp_path: Path) -> tuple[Path, Path]:
    example_main(EXAMPLES / "post" / "make_data.py", "--out", str(tmp_path), "--pairs", "40", "--prompts", "40")
    return tiny_chat_model(tmp_path / "corpus.jsonl", tmp_path / "tiny"), tmp_path / "prompts.jsonl"


def _grpo(model: Path, prompts: Path, out: Path, *flags: str) -> dict:
    run = run_cli("grpo", "--model", str(model), "--prompts", str(prompts), "--reward", f"{REWARDS}:digits",
                  "--reward", f"{REWARDS}:starts_with_number", "--reward-weights", "1.0", "0.5", "--device", "cpu",
                  "--out", str(out), *flags)
    assert run.returncode == 0, run.output
    return json.loads(run.output.strip().splitlines()[-1])


def test_megatrain_grpo_runs_with_kl_and_several_passes(ray_session: None, tmp_path: Path) -> None:
    model, prompts = _model_and_prompts(tmp_path)
    out = tmp_path / "grpo"
    _grpo(model, prompts, out, "--group-size", "4", "--max-new-tokens", "6", "--prompts-per-step", "2", "--steps",
          "3", "--iterations", "2", "--beta", "0.04", "--lr", "5e-3", "--epsilon-high", "0.28")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"reward", "reward_std", "rewards/digits/mean", "rewards/starts_with_number/mean", "kl", "entropy",
                "clip_ratio/region_mean", "completions/mean_length", "loss", "grad_norm"} <= row.keys()
        assert 1 <= row["completions/mean_length"] <= 6 and row["entropy"] > 0
    assert rows[0]["kl"] >= 0 and any(r["kl"] > 0 for r in rows[1:])  # the policy moved off the initial one
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None
    assert not (out / "initial").exists() and not (out / "current").exists()  # no checkpoint round trip


@pytest.mark.slow
def test_the_example_raises_the_reward(ray_session: None, tmp_path: Path) -> None:
    """examples/post/run.sh's GRPO run: 40 rollout batches of 4 prompts x 8 completions of 16 tokens (on this
    machine the mean reward went 0.31 -> 0.96 by step 28, about 3 minutes)."""
    model, prompts = _model_and_prompts(tmp_path)
    summary = _grpo(model, prompts, tmp_path / "grpo", "--group-size", "8", "--max-new-tokens", "16",
                    "--prompts-per-step", "4", "--steps", "40", "--lr", "5e-3")
    assert summary["reward_last"] > summary["reward_first"] + 0.3


def test_bad_rewards_are_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="grpo needs a reward"):
        load_rewards([], None)
    with pytest.raises(ConfigError, match="is not module.py:function"):
        load_rewards(["rewards.py"], None)
    with pytest.raises(ConfigError, match="has no function nope"):
        load_rewards([f"{REWARDS}:nope"], None)
    with pytest.raises(ConfigError, match="2 reward weights for 1 reward functions"):
        load_rewards([f"{REWARDS}:digits"], [1.0, 2.0])


def test_plan_says_what_each_mode_adds() -> None:
    """megatrain plan --post: the policy step's per-token tensors, the reference log-probs, the rollout KV cache
    (every layer's keys and values of the rollout batch), the KL term's copy of the initial weights."""
    config = ModelConfig.from_name("tiny")
    plan = post_plan(config, "grpo", rows=32, seq=80, precision="bf16", kl=True)
    assert plan.kv_cache_bytes == 2 * config.num_layers * 32 * config.num_kv_heads * 80 * config.head_dim * 2
    assert plan.reference_bytes == 2 * sum(planned_unit_numels(config)) and plan.per_token_bytes == 8 * 32 * 80 * 4
    assert post_plan(config, "dpo", rows=8, seq=80, pairs=1000).reference_host_bytes == 16 * 1000
    run = run_cli("plan", "--model", "tiny", "--batch", "32", "--seq", "80", "--device", "cpu", "--post", "grpo",
                  "--kl")
    assert "rollout KV cache" in run.output and "KL to the initial policy" in run.output, run.output
    with pytest.raises(ConfigError, match="--post must be one of dpo, grpo"):
        post_plan(config, "ppo", 1, 1)
    # what a generate call keeps on the GPU beyond the resident units: all but the (untied) embedding where it has
    # room, none without room beyond the plan, nothing said off a GPU
    roomy = plan_run(config, 32, 80, precision="bf16", on_gpu=True, gpu_free=2**40, host_free=2**40)
    held = post_plan(config, "grpo", 32, 80, "bf16", run=roomy).held
    assert held == (config.num_layers + 1, 2 * sum(list(planned_unit_numels(config))[1:]))
    full = plan_run(config, 32, 80, precision="bf16", on_gpu=True, gpu_free=roomy.gpu_total, host_free=2**40)
    assert post_plan(config, "grpo", 32, 80, "bf16", run=full).held == (0, 0)
    assert post_plan(config, "grpo", 32, 80, "bf16", run=plan_run(config, 32, 80, on_gpu=False)).held is None


def test_post_training_metrics_reach_the_ray_metrics(ray_session: None, tmp_path: Path) -> None:
    """The run's metrics go to OUT/metrics.jsonl and to the megatrain_post_training gauge, one series a name (the
    dashboard's Post-training panel)."""
    from actors.metrics import EngineMetrics

    metrics = EngineMetrics(run="post-test")
    RunLog(tmp_path, metrics).write("step", 1, {"reward": 0.5, "kl": 0.01, "bad": float("nan")}, ("reward",))
    assert metrics.last(metrics.post_training, metric="reward") == 0.5
    assert metrics.last(metrics.post_training, metric="kl") == 0.01
    assert metrics.last(metrics.post_training, metric="bad") is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward"] == 0.5
