"""The Ray engine against HF transformers + torch.optim.AdamW, on the CPU path of the same code."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import torch
from helpers import OPTIM, assert_same_model, hf_reference, train_engine
from transformers import LlamaConfig, LlamaForCausalLM

import megatrain
from megatrain import ConfigError, MegatrainError
from megatrain.io.checkpoint import CheckpointError
from megatrain.memory.arena import list_segments

VOCAB = 97


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    # more decoder layers than gradient ring slots (GRAD_RING_SLOTS), so streamed gradients reuse slots
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=120, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        labels = ids.clone()
        labels[0, :5] = -100  # a masked prompt
        out.append((ids, labels))
    return out


def assert_close_rel(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert ours.keys() == ref.keys()
    for name, want in ref.items():
        rel = ((ours[name] - want).abs().max() / want.abs().max()).item()
        assert rel <= tol, f"{name}: relative difference {rel:.2e}"


@pytest.fixture(scope="module")
def cpu_run(hf_dir, batches) -> Callable[[str, float | None], tuple[list[float], dict[str, torch.Tensor]]]:
    """The synchronous CPU path's training (1 worker) of a (grads, max_grad_norm), run once per module: the tests
    below hold the same deterministic runs to transformers, to each other, to 3 workers and to the simulated streams
    (2 workers)."""
    runs: dict[tuple[str, float | None], tuple[list[float], dict[str, torch.Tensor]]] = {}

    def run(grads: str, max_grad_norm: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        if (grads, max_grad_norm) not in runs:
            runs[grads, max_grad_norm] = train_engine(hf_dir, batches, 1, max_grad_norm, grads)
        return runs[grads, max_grad_norm]

    return run


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "unclipped"])
def test_engine_matches_hf_adamw(ray_session, hf_dir, batches, cpu_run, max_grad_norm) -> None:
    ref_losses, ref_params = hf_reference(hf_dir, batches, max_grad_norm)
    losses, params = cpu_run("arena", max_grad_norm)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_close_rel(params, ref_params)


# CI: each placement once (the stream placement: test_clipping_off_streams_gradients_..., where "auto" picks it)
@pytest.mark.parametrize(("max_grad_norm", "grads"), [pytest.param(None, "stream", marks=pytest.mark.slow),
                                                    (1.0, "device"),
                                                    pytest.param(None, "device", marks=pytest.mark.slow)],
                         ids=["stream-unclipped", "device-clipped", "device-unclipped"])
def test_gradients_streamed_through_host_slots_give_the_same_training(ray_session, cpu_run, max_grad_norm, grads
                                                                      ) -> None:
    """12 B/param placements: a ring of host gradient slots (with the optimizer freeing them) instead of every
    gradient in the arena. Same kernels on the same values: bit-identical to grads = "arena"."""
    losses, params = cpu_run(grads, max_grad_norm)
    arena_losses, arena_params = cpu_run("arena", max_grad_norm)
    assert losses == arena_losses
    assert_same_model(params, arena_params)


PLACEMENTS = [("arena", 1.0), ("arena", None), ("stream", None), ("device", 1.0), ("device", None)]
PLACEMENT_IDS = ["arena-clipped", "arena-unclipped", "stream-unclipped", "device-clipped", "device-unclipped"]


def _under_simulated_streams(hf_dir, batches, cpu_run, grads, max_grad_norm, seed) -> None:
    want_losses, want_params = cpu_run(grads, max_grad_norm)
    losses, params = train_engine(hf_dir, batches, 2, max_grad_norm, grads, device=f"cpu-async:{seed}")
    assert losses == want_losses
    assert_same_model(params, want_params)


# in CI the device placement clipped; the others with the seeds below (slow). The arena placement meets the simulated
# streams in CI all the same: test_micro_batches.py's and test_long_context.py's clipped runs on "cpu-async" take it
IN_CI = {"device-clipped"}


@pytest.mark.parametrize(("grads", "max_grad_norm"),
                         [pytest.param(*p, id=i, marks=() if i in IN_CI else pytest.mark.slow)
                          for p, i in zip(PLACEMENTS, PLACEMENT_IDS, strict=True)])
def test_every_placement_under_simulated_streams(ray_session, hf_dir, batches, cpu_run, grads, max_grad_norm
                                                 ) -> None:
    """The GPU's schedule (weight buffers, copies on late streams, the sender thread for gradients, updates
    overlapping the next step) on the CPU: the synchronous path's training, bit for bit (and that one matches
    transformers + AdamW above)."""
    _under_simulated_streams(hf_dir, batches, cpu_run, grads, max_grad_norm, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize(("grads", "max_grad_norm"), PLACEMENTS, ids=PLACEMENT_IDS)
def test_every_placement_under_many_seeds_of_delays(ray_session, hf_dir, batches, cpu_run, grads, max_grad_norm,
                                                    seed) -> None:
    _under_simulated_streams(hf_dir, batches, cpu_run, grads, max_grad_norm, seed)


# slow: in CI two workers train bit for bit as one (test_every_placement_under_simulated_streams, above; and two nodes'
# workers as one node's, test_nodes.py), and a run resumed in a new Engine repeats the uninterrupted one
# (test_resident_units.py, test_finetune.py)
@pytest.mark.slow
def test_results_do_not_depend_on_worker_count_and_a_resumed_run_repeats_them(ray_session, hf_dir, batches, cpu_run,
                                                                              tmp_path) -> None:
    """3 workers train bit for bit as 1 (every gradient in the arena: clipping on and no GPU); from the checkpoint after
    step 3, a new Engine (2 workers) repeats the last steps' losses and reaches the same parameters."""
    losses1, params1 = cpu_run("arena", 1.0)
    with megatrain.Engine(hf_dir, optimizer_workers=3, precision="fp32", device="cpu", **OPTIM) as engine:
        assert engine.grads == "arena", "clipping on and no GPU: every gradient waits in the arena"
        losses = []
        for i, (ids, labels) in enumerate(batches):
            losses.append(engine.step(ids, labels))
            if i == 2:
                engine.save_checkpoint(tmp_path / "step-3")
        final = engine.parameters()
    assert losses == losses1
    for name in params1:
        assert torch.equal(final[name], params1[name]), name
    with megatrain.Engine(hf_dir, optimizer_workers=2, precision="fp32", device="cpu", **OPTIM) as engine:
        state = engine.load_checkpoint(tmp_path / "step-3")
        assert state["steps_done"] == 3
        resumed = [engine.step(ids, labels) for ids, labels in batches[3:]]
        assert resumed == losses[3:]
        for name, value in engine.parameters().items():
            assert torch.equal(value, final[name]), name


def engine_on(hf_dir: Path, **kwargs) -> megatrain.Engine:
    return megatrain.Engine(hf_dir, optimizer_workers=1, precision="fp32", device="cpu", batch_size=2, seq_len=16,
                            **kwargs)


def test_one_engine_refuses_bad_input_takes_the_drivers_paths_and_holds_its_cpus(ray_session, hf_dir, batches,
                                                                                  tmp_path, monkeypatch) -> None:
    """One Engine (each start costs seconds), four things a user meets:
    - bad batches are refused as megatrain errors in one sentence, not wrapped in Ray's RayTaskError (whose message is
      the actor's traceback), and change nothing; a shut-down Engine says so;
    - the first Engine's optimizer workers reserve its node's free CPUs: a second one is told at once, instead of
      waiting forever for Ray to schedule its workers;
    - the actors run in another working directory: a relative path means the driver's;
    - a non-finite loss skips the step's update, and max_nonfinite_steps of them in a row stop the run."""
    from megatrain.memory.arena import Arena
    from megatrain.model.layout import ModelLayout
    from pipelines import cluster
    from pipelines.engine import NonFiniteError

    ids = batches[0][0]
    # CPUs an Engine just shut down releases come back within the wait; none come back here: 1 s tells as much as 10
    monkeypatch.setattr(cluster, "FREE_CPU_WAIT_SECONDS", 1.0)
    with engine_on(hf_dir, max_nonfinite_steps=2) as engine:
        assert engine.grads == "arena", "clipping on (the default) and no GPU: every gradient waits in the arena"
        for bad_ids, labels, expected in [(torch.full((1, 8), VOCAB + 5), None, "outside the model's vocabulary"),
                                          (ids.float() + 0.5, None, "input_ids must hold integer token ids"),
                                          (ids, ids.double(), "labels must hold integer token ids")]:
            with pytest.raises(MegatrainError, match=expected) as info:
                engine.step(bad_ids, labels)
            assert not isinstance(info.value, ray.exceptions.RayError) and "\n" not in str(info.value)
        engine.step(ids)  # refused batches changed nothing
        assert engine.steps_done == 1 and engine.updates_applied == 1

        with pytest.raises(MegatrainError, match="the driver's Ray node has no free CPU for the 1 optimizer worker"):
            engine_on(hf_dir)
        engine.step(*batches[0])

        monkeypatch.chdir(tmp_path)
        assert engine.save_checkpoint("ckpt") == tmp_path / "ckpt"
        assert (tmp_path / "ckpt" / "manifest.json").is_file()
        assert engine.save_pretrained("hf") == tmp_path / "hf"
        assert (tmp_path / "hf" / "model.safetensors").is_file()
        engine.load_checkpoint("ckpt")

        engine.wait_for_updates()
        applied = engine.updates_applied
        arena = Arena.open(engine.handle)
        # a poisoned weight in the final norm: every loss is NaN from now on
        ModelLayout.build(engine.config).hf_views(arena.params)["model.norm.weight"][0] = float("nan")
        arena.close()
        poisoned = engine.parameters()
        loss = engine.step(*batches[1])
        assert loss != loss and engine.updates_applied == applied and engine.skipped_steps == 1
        after = engine.parameters()
        for name, value in poisoned.items():
            assert torch.equal(value.nan_to_num(), after[name].nan_to_num()), f"{name} changed on a skipped step"
        with pytest.raises(NonFiniteError, match="2 steps in a row"):
            engine.step(*batches[2])
    for use in (lambda: engine.step(ids), engine.parameters, lambda: engine.save_checkpoint("never-written")):
        with pytest.raises(MegatrainError, match="this Engine was shut down; create a new one"):
            use()


def test_a_corrupt_model_directory_is_one_sentence(ray_session, hf_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    os.truncate(bad / "model.safetensors", 100)
    before = set(list_segments())
    with pytest.raises(CheckpointError, match="is not a readable safetensors file") as info:
        engine_on(bad)
    assert not isinstance(info.value, ray.exceptions.RayError) and "\n" not in str(info.value)
    assert set(list_segments()) <= before


def test_cuda_on_a_cluster_without_a_gpu_is_a_config_error(ray_session, hf_dir, monkeypatch) -> None:
    monkeypatch.setattr("pipelines.engine.node_resources", lambda node: ({"CPU": 2.0}, {"CPU": 2.0}))
    with pytest.raises(ConfigError, match="device 'cuda' was asked for but the driver's Ray node has no GPU"):
        megatrain.Engine(hf_dir, optimizer_workers=1, device="cuda", batch_size=2, seq_len=16)


def test_a_local_ray_starts_without_its_memory_monitor_or_idle_workers_unless_asked(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """The arena in /dev/shm counts as used memory to Ray's monitor, which would kill workers holding none
    of it; the idle workers Ray prestarts are never megatrain's actors; a user's own setting wins."""
    from pipelines.cluster import local_ray_environment

    for variable in ("RAY_memory_monitor_refresh_ms", "RAY_prestart_worker_first_driver"):
        monkeypatch.delenv(variable, raising=False)
    local_ray_environment()
    assert os.environ["RAY_memory_monitor_refresh_ms"] == os.environ["RAY_prestart_worker_first_driver"] == "0"
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "250")
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    local_ray_environment()
    assert os.environ["RAY_memory_monitor_refresh_ms"] == "250"
    assert os.environ["RAY_prestart_worker_first_driver"] == "1"


def test_clipping_off_streams_gradients_and_a_longer_sequence_is_warned_about(ray_session, hf_dir, batches, cpu_run,
                                                                              caplog) -> None:
    """Clipping off (0, as None) on the CPU: gradients go through a ring of host slots ("stream": each unit's update
    starts as its gradient lands), not every gradient in the arena (clipping on and no GPU: "arena", the engine of
    test_one_engine_refuses_bad_input_takes_the_drivers_paths_and_holds_its_cpus; test_arena's resolve_grads), and the
    training is bit for bit the arena's. Where a step is given sequences past the model's positions, that is warned
    about once; not for the Engine's planning seq_len (2048 by default) when the batches are short."""
    positions = LlamaConfig().max_position_embeddings  # hf_dir's
    with megatrain.Engine(hf_dir, optimizer_workers=1, precision="fp32", device="cpu", max_grad_norm=0.0,
                          seq_len=positions + 1, **OPTIM) as engine:
        assert engine.grads == "stream", "clipping off: each unit's update starts as its gradient lands"
        grads_numel = dict((n, k) for n, _, k in engine.handle.segments)["grads"]
        assert grads_numel < dict((n, k) for n, _, k in engine.handle.segments)["params"]
        losses = [engine.step(ids, labels) for ids, labels in batches]
        assert "is longer than the" not in caplog.text
        engine.check_sequence_length(positions + 1)  # what a step of that length checks first
        engine.check_sequence_length(positions + 2)
        params = engine.parameters()
    assert caplog.text.count("is longer than the") == 1
    assert f"seq_len {positions + 1} is longer than the {positions} positions" in caplog.text
    arena_losses, arena_params = cpu_run("arena", None)
    assert losses == arena_losses
    assert_same_model(params, arena_params)
