"""The learning rate and warm-up a run gets where its config leaves them out: by the model's size (published recipes'
rates: 3e-4 at 7B, not the 3e-3 that diverged there) and by the run's length; what the user gives stays."""

from __future__ import annotations

import logging

import pytest

from megatrain.config import ModelConfig
from megatrain.presets import default_lr, default_warmup
from pipelines.train import TrainConfig, with_size_defaults


@pytest.mark.parametrize("preset, lr", [("tiny", 3e-3), ("125m", 6e-4), ("1b", 3e-4), ("7b", 3e-4), ("14b", 3e-4),
                                        ("32b", 1.5e-4), ("70b", 1.5e-4)])
def test_the_rate_falls_with_the_size(preset, lr):
    assert default_lr(ModelConfig.from_name(preset).num_params()) == lr


def test_warmup_is_a_few_percent_at_least_20_at_most_half():
    assert [default_warmup(n) for n in (1, 2, 4, 30, 300, 1000, 10_000)] == [0, 1, 2, 15, 20, 30, 300]


def test_what_the_config_leaves_out_is_chosen_and_said(tmp_path, caplog):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "7b"\nsteps = 1000\n')
    with caplog.at_level(logging.INFO, logger="megatrain"):
        cfg = with_size_defaults(TrainConfig.load(toml), ModelConfig.from_name("7b"))
    assert (cfg.lr, cfg.warmup_steps) == (3e-4, 30)
    assert "lr 0.0003, warmup_steps 30 by default for a 6.74 G-parameter model over 1000 steps" in caplog.text
    toml.write_text('model = "7b"\nsteps = 1000\nlr = 1e-3\n')
    cfg = with_size_defaults(TrainConfig.load(toml, {"warmup_steps": 5}), ModelConfig.from_name("7b"))
    assert (cfg.lr, cfg.warmup_steps) == (1e-3, 5)
